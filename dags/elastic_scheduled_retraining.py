"""Scheduled retraining: every day, continue from the previous run's final model.

``warm_start="previous"`` makes the first chunk read the latest event of this DAG's model Asset
and initialise the weights from that run's final checkpoint (cold start the first time).
Paused on creation: unpause it in the UI when you want it to run.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from elastic_ops.taskgroup import elastic_training

with DAG(
    dag_id="elastic_scheduled_retraining",
    schedule="@daily",
    start_date=pendulum.datetime(2024, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    is_paused_upon_creation=True,
    tags=["elastic_ops", "scheduled"],
    doc_md=__doc__,
):
    elastic_training(
        task_id="retrain_digits",
        trainable="elastic_ops.examples.digits:DigitsMLP",
        total_iterations=200,
        chunk_iterations=100,
        min_workers=1,
        max_workers=4,
        priority=2,
        global_batch=64,
        warm_start="previous",
        params={"lr": 0.001},
    )
