"""``ElasticOpsPlugin`` (the ``airflow.plugins`` entry point): the pool API in the api-server,
and its two views in the Airflow UI: the pool view (a navigation entry) and the job view (a tab
on every DAG run; it lists the run's elastic training groups, or says there is none).

Registered once: through the entry point when the package is installed, which is how every
deployment gets it; ``plugins/elastic_ops_plugin.py`` (the demo deployment's plugin folder)
only defines it when the entry point is missing.
"""

from __future__ import annotations

import logging

from airflow.sdk.plugins_manager import AirflowPlugin

from elastic_ops.links.pool import JOB_VIEW_ROUTE

log = logging.getLogger(__name__)

PLUGIN_NAME = "elastic_ops"
URL_PREFIX = "/elastic-ops"


def _fastapi_apps() -> list[dict]:
    try:
        from elastic_ops.plugin.api import app
    except ImportError as exc:  # a worker without the api-server extras: no HTTP API there
        log.debug("elastic_ops pool API not available: %s", exc)
        return []
    return [{"app": app, "url_prefix": URL_PREFIX, "name": "Elastic Ops pool API"}]


class ElasticOpsPlugin(AirflowPlugin):
    name = PLUGIN_NAME
    fastapi_apps = _fastapi_apps()
    # hrefs without the api-server's base URL: the UI resolves them against its own
    external_views = [
        {"name": "Elastic pool", "href": f"{URL_PREFIX}/ui", "destination": "nav",
         "url_route": "elastic-pool", "nav_top_level": True},
        {"name": "Elastic job", "href": f"{URL_PREFIX}/ui/job?dag_id={{DAG_ID}}&run_id={{RUN_ID}}",
         "destination": "dag_run", "url_route": JOB_VIEW_ROUTE},
    ]


def entry_point_installed() -> bool:
    """Whether the installed distribution registers the plugin through its entry point."""
    from importlib.metadata import entry_points

    target = "elastic_ops.plugin:ElasticOpsPlugin"
    return any(ep.value == target for ep in entry_points(group="airflow.plugins"))
