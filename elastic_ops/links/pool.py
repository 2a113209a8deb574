"""``PoolPageLink``: the "Elastic pool" button on every chunk task in the Airflow UI, which
opens the pool's status page (the plugin's ``/elastic-ops/ui``) where the task's job, its
workers, target and the other jobs sharing the pool are."""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow.sdk import BaseOperatorLink

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.types import TaskInstanceKey


class PoolPageLink(BaseOperatorLink):
    name = "Elastic pool"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        from airflow.sdk.configuration import conf

        base = (conf.get("api", "base_url", fallback="") or "").rstrip("/")
        return f"{base}/elastic-ops/ui"
