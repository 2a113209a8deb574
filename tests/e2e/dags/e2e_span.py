"""E2E: a bitwise job that may use 4 workers in a pool of two hosts with 2 slots each: its grant
spans both hosts, and it trains one process group across their node agents (the cluster e2e)."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from elastic_ops.taskgroup import elastic_training

with DAG(dag_id="e2e_span", schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC"),
         catchup=False):
    elastic_training(
        task_id="train", trainable="elastic_ops.examples.digits:DigitsMLP", total_iterations=60,
        chunk_iterations=60, global_batch=64, min_workers=1, max_workers=4, consistency="bitwise",
        virtual_shards=4, data_seed=5, checkpoint_interval=20, params={"hidden": 32, "depth": 1},
    )
