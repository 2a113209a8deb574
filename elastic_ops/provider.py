"""Airflow provider metadata (the ``apache_airflow_provider`` entry point)."""

from __future__ import annotations

from elastic_ops import __version__


def get_provider_info() -> dict:
    return {
        "package-name": "elastic-ops",
        "name": "elastic_ops",
        "description": "Elastic deep-learning training: chunked, checkpointed, pool-scheduled.",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "Elastic Ops",
                "external-doc-url": "https://github.com/elastic-ops/elastic-ops",
                "tags": ["ml"],
            }
        ],
        "operators": [
            {"integration-name": "Elastic Ops",
             "python-modules": ["elastic_ops.operators.chunk", "elastic_ops.operators.lifecycle"]}
        ],
        "sensors": [{"integration-name": "Elastic Ops", "python-modules": ["elastic_ops.sensors.pool"]}],
        "triggers": [{"integration-name": "Elastic Ops", "python-modules": ["elastic_ops.triggers.pool"]}],
        "hooks": [{"integration-name": "Elastic Ops", "python-modules": ["elastic_ops.hooks.elastic_ops"]}],
        "connection-types": [
            {
                "connection-type": "elastic_ops_pool",
                "hook-class-name": "elastic_ops.hooks.elastic_ops.ElasticOpsHook",
            }
        ],
        "extra-links": ["elastic_ops.links.pool.PoolPageLink"],
        "plugins": [],  # the plugin registers through the airflow.plugins entry point, once
    }
