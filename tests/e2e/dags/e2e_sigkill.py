"""E2E: a bitwise elastic job (one 240-iteration chunk, checkpoints every 20) whose worker the
test SIGKILLs mid-chunk. The digits MLP is paced (``e2e_paced``, next to this file: at least
30 ms an iteration) so that the chunk is still training when the test looks for a worker.
Tracked in MLflow: the retried job is one run."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from elastic_ops.taskgroup import elastic_training
from elastic_ops.tracking import MlflowTracking

SPEC = {
    "trainable": "e2e_paced:PacedDigitsMLP", "total_iterations": 240, "chunk_iterations": 240,
    "global_batch": 64, "consistency": "bitwise", "virtual_shards": 2, "data_seed": 3,
    "params": {"hidden": 32, "depth": 1, "pace_s": 0.03},
}

with DAG(dag_id="e2e_sigkill", schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC"),
         catchup=False):
    elastic_training(
        task_id="train", min_workers=1, max_workers=2, priority=1, checkpoint_interval=20,
        chunk_kwargs={"retries": 2, "retry_delay": timedelta(seconds=1), "retry_exponential_backoff": 0},
        tracking=MlflowTracking(),  # MLFLOW_TRACKING_URI: the test's server (experiment: the DAG id)
        **SPEC,
    )
