"""Shared setup for operator tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_ops.pool import PoolClient

# the runtime tests' tiny model as an elastic task's spec fields
TINY_FIELDS = {
    "entrypoint": "tests.runtime.builders:TinyMLP",
    "total_iterations": 20,
    "chunk_iterations": 20,
    "global_batch": 12,
    "min_workers": 1,
    "max_workers": 2,
    "priority": 2,
    "consistency": "bitwise",
    "virtual_shards": 6,
    "data_seed": 7,
}


def airflow_pool(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, host: str = "h1", slots: int = 2
) -> PoolClient:
    """A SQLite pool ledger with one host, which the operators find through the default Airflow
    connection (``AIRFLOW_HOME`` under ``tmp_path``)."""
    url = f"sqlite:///{tmp_path / 'pool.db'}"
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    monkeypatch.setenv(
        "AIRFLOW_CONN_ELASTIC_OPS_POOL_DEFAULT",
        json.dumps({"conn_type": "elastic_ops_pool", "extra": {"url": url}}),
    )
    client = PoolClient(url, aging_s=0.0)
    client.add_host(host, slots)
    return client
