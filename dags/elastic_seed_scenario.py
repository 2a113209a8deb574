"""The seed scenario: two elastic jobs on the digits MLP competing for an 8-slot pool.

``make demo`` triggers ``elastic_seed_job1``, then ``elastic_seed_job2`` while job 1 trains on
8 workers (→ 4 / 4), raises job 2's priority from 3 to 5 (→ 3 / 5), and job 2 gets all 8 once
job 1 finishes. Trigger them yourself from the UI (or ``airflow dags trigger``) and raise the
priority with ``elastic-ops pool set-priority <job> 5``.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, Param

from elastic_ops.taskgroup import elastic_training

for number in (1, 2):
    with DAG(
        dag_id=f"elastic_seed_job{number}",
        schedule=None,
        start_date=pendulum.datetime(2024, 1, 1, tz="UTC"),
        catchup=False,
        max_active_runs=1,
        tags=["elastic_ops", "seed-scenario"],
        params={
            "iterations": Param(240, type="integer", minimum=3, maximum=100_000,
                                description="total training iterations (3 chunk tasks)"),
            "priority": Param(3, type="integer", minimum=1, maximum=1000),
        },
        doc_md=__doc__,
    ):
        elastic_training(
            task_id="train_digits",
            trainable="elastic_ops.examples.digits:DigitsMLP",
            total_iterations="{{ params.iterations }}",
            num_chunks=3,
            min_workers=1,
            max_workers=8,
            priority="{{ params.priority }}",
            global_batch=64,
            consistency="bitwise",
            virtual_shards=8,
            checkpoint_interval=50,
            params={"lr": 0.002, "hidden": 128, "depth": 2},
            chunk_kwargs={"retries": 3},
        )
