"""Start an elastic training run from the Airflow UI's trigger form.

Every field is a ``Param`` with a JSON schema, so the form rejects bad values (a worker count out
of range, a priority below 1, a malformed checkpoint URI) before a run is created. Rules between
fields (minimum workers at most the maximum) are checked when the register task renders the
values: that run fails at once, naming the field. An empty checkpoint means the default.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, Param

from elastic_ops.taskgroup import elastic_training

with DAG(
    dag_id="elastic_train_from_form",
    schedule=None,
    start_date=pendulum.datetime(2024, 1, 1, tz="UTC"),
    catchup=False,
    tags=["elastic_ops", "params"],
    doc_md=__doc__,
    params={
        "min_workers": Param(1, type="integer", minimum=1, maximum=8, title="Minimum workers"),
        "max_workers": Param(4, type="integer", minimum=1, maximum=8, title="Maximum workers"),
        "priority": Param(1, type="integer", minimum=1, maximum=1000, title="Priority",
                          description="weight in the pool's priority policy"),
        "iterations": Param(200, type="integer", minimum=4, maximum=100_000, title="Total iterations",
                            description="split into 4 chunk tasks"),
        "checkpoint": Param(None, type=["null", "string"], title="Checkpoint URI",
                            pattern=r"^(|file:///[^?#\s]+|s3://(?![^/]*\.\.)(?!\d{1,3}(\.\d{1,3}){3}(/|$))"
                            r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/[^?#\s]*)?)$",
                            description="file:///path or s3://bucket/prefix; empty = the default"),
    },
):
    elastic_training(
        task_id="train",
        trainable="elastic_ops.examples.digits:DigitsMLP",
        total_iterations="{{ params.iterations }}",
        num_chunks=4,
        min_workers="{{ params.min_workers }}",
        max_workers="{{ params.max_workers }}",
        priority="{{ params.priority }}",
        checkpoint="{{ params.checkpoint }}",
        global_batch=64,
    )
