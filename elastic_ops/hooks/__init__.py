"""Airflow hooks: the only way the Airflow layer reaches the pool ledger and checkpoint store."""

from elastic_ops.hooks.elastic_ops import ElasticOpsHook, default_ledger_url

__all__ = ["ElasticOpsHook", "default_ledger_url"]
