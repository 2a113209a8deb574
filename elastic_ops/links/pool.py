"""``PoolPageLink``: the "Elastic pool" button on every chunk task in the Airflow UI, which
opens the job view of the task's DAG run inside the Airflow UI (the run's "Elastic job" tab,
the plugin's ``/elastic-ops/ui/job``): the job's workers and iterations over time with the
plan's reasons, its chunks, tries and checkpoints, and a link to the whole pool."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.types import TaskInstanceKey

JOB_VIEW_ROUTE = "elastic-job"  # the job view's url_route (elastic_ops.plugin)


def job_view_url(base: str, dag_id: str, run_id: str) -> str:
    """The Airflow UI's page of the job view of one DAG run (the plugin's tab on the run)."""
    dag, run = quote(dag_id, safe=""), quote(run_id, safe="")
    return f"{base.rstrip('/')}/dags/{dag}/runs/{run}/plugin/{JOB_VIEW_ROUTE}"


class PoolPageLink(BaseOperatorLink):
    name = "Elastic pool"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        from airflow.sdk.configuration import conf

        base = conf.get("api", "base_url", fallback="") or ""
        return job_view_url(base, ti_key.dag_id, ti_key.run_id)
