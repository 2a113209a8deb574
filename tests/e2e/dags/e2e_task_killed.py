"""E2E: the e2e_sigkill job with no retries, whose chunk *task* process the test SIGKILLs (as the
OOM killer would): no ``on_kill``, no clean-up of its own; the ``end_job`` teardown ends the job
in the pool."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG
from e2e_sigkill import SPEC

from elastic_ops.taskgroup import elastic_training

with DAG(dag_id="e2e_task_killed", schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC"),
         catchup=False):
    elastic_training(task_id="train", min_workers=1, max_workers=2, priority=1, checkpoint_interval=20,
                     chunk_kwargs={"retries": 0}, **SPEC)
