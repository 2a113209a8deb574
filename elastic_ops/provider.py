"""Airflow provider metadata (the ``apache_airflow_provider`` entry point)."""

from __future__ import annotations

from elastic_ops import __version__


def get_provider_info() -> dict:
    return {
        "package-name": "elastic-ops",
        "name": "elastic_ops",
        "description": "Elastic deep-learning training: chunked, checkpointed, pool-scheduled.",
        "versions": [__version__],
    }
