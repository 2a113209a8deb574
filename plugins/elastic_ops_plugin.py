"""The demo deployment's plugin folder.

The elastic_ops plugin registers itself through the ``airflow.plugins`` entry point of the
installed package. This file only defines it for a checkout that is on ``PYTHONPATH`` without
being installed, so Airflow loads it exactly once either way.
"""

from elastic_ops.plugin import entry_point_installed

if not entry_point_installed():
    from elastic_ops.plugin import ElasticOpsPlugin  # noqa: F401 - picked up by the plugin loader
