"""E2E: a newcomer's first DAG: its model lives in ``newcomer_models/`` beside the DAG file, which
imports it, and the per-host agent was started as docs/howto/agents.md says (without the DAG folder on its
``PYTHONPATH``). The chunk must train on the agent's workers."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG
from newcomer_models.seqgru import SeqGRU  # noqa: F401 - as users do: the DAG imports its model

from elastic_ops.taskgroup import elastic_training

with DAG(dag_id="e2e_newcomer", schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC"),
         catchup=False):
    elastic_training(task_id="train", trainable="newcomer_models.seqgru:SeqGRU", total_iterations=30,
                     min_workers=1, max_workers=2, priority=1, global_batch=16, params={"hidden": 8},
                     chunk_kwargs={"retries": 0})
