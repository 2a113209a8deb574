"""``ElasticOpsPlugin`` (the ``airflow.plugins`` entry point): the pool API in the api-server.

Registered once: through the entry point when the package is installed, which is how every
deployment gets it; ``plugins/elastic_ops_plugin.py`` (the demo deployment's plugin folder)
only defines it when the entry point is missing.
"""

from __future__ import annotations

import logging

from airflow.sdk.plugins_manager import AirflowPlugin

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
    external_views = [
        {"name": "Elastic pool status", "href": f"{URL_PREFIX}/ui", "destination": "nav",
         "category": "admin", "url_route": "elastic-pool"},
    ]


def entry_point_installed() -> bool:
    """Whether the installed distribution registers the plugin through its entry point."""
    from importlib.metadata import entry_points

    target = "elastic_ops.plugin:ElasticOpsPlugin"
    return any(ep.value == target for ep in entry_points(group="airflow.plugins"))
