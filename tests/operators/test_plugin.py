"""The plugin loads exactly once (entry point + deployment plugin folder) and its state-changing
route requires Airflow authentication."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import elastic_ops.plugin as plugin_module

REPO = Path(__file__).resolve().parents[2]
PLUGIN_FILE = REPO / "plugins" / "elastic_ops_plugin.py"

COUNT_PLUGINS = """
import json
from airflow import plugins_manager
plugins, errors = plugins_manager._get_plugins()
print(json.dumps({"names": [p.name for p in plugins], "errors": {str(k): v for k, v in errors.items()}}))
"""


def test_plugin_is_registered_once_with_the_entry_point_and_the_plugin_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}
    env.update(AIRFLOW_HOME=str(tmp_path), AIRFLOW__CORE__PLUGINS_FOLDER=str(REPO / "plugins"),
               AIRFLOW__CORE__LOAD_EXAMPLES="False")
    # cwd outside the checkout: a setuptools ``*.egg-info`` in the working directory would make
    # Airflow's loader see the distribution (and its entry point) twice.
    out = subprocess.run([sys.executable, "-c", COUNT_PLUGINS], env=env, capture_output=True, text=True,
                         timeout=180, check=True, cwd=tmp_path)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["names"].count("elastic_ops") == 1
    assert not [e for e in result["errors"].values() if "elastic_ops" in e]


@pytest.mark.parametrize(("installed", "defines"), [(True, False), (False, True)])
def test_plugin_folder_defines_the_plugin_only_without_the_entry_point(monkeypatch, installed, defines):
    monkeypatch.setattr(plugin_module, "entry_point_installed", lambda: installed)
    namespace = runpy.run_path(str(PLUGIN_FILE))
    assert ("ElasticOpsPlugin" in namespace) is defines


def test_entry_point_is_installed():
    assert plugin_module.entry_point_installed()


def test_pool_api_refuses_unauthenticated_requests():
    from fastapi.testclient import TestClient

    from elastic_ops.plugin_api import app

    client = TestClient(app)
    assert client.post("/jobs/any/priority", json={"priority": 5}).status_code == 401
    assert client.get("/status").status_code == 401


@pytest.mark.parametrize("body", [{"priority": True}, {"priority": "5"}, {"priority": 5.0}, {"priority": 0},
                                  {"priority": 3, "extra": 1}, {}])
def test_priority_route_takes_an_integer_and_nothing_else(monkeypatch, tmp_path, body):
    from airflow.api_fastapi.core_api.security import get_user
    from fastapi.testclient import TestClient

    from elastic_ops import plugin_api
    from elastic_ops.pool import PoolClient

    pool = PoolClient(f"sqlite:///{tmp_path / 'pool.db'}")
    pool.submit("j", min_workers=1, max_workers=1, priority=2)
    monkeypatch.setattr(plugin_api, "_client", lambda: pool)
    monkeypatch.setattr(plugin_api, "_authorize", lambda method, user: None)  # auth: tested above
    monkeypatch.setitem(plugin_api.app.dependency_overrides, get_user, lambda: object())
    client = TestClient(plugin_api.app)
    assert client.post("/jobs/j/priority", json=body).status_code == 422
    assert pool.status()["jobs"][0]["priority"] == 2
    assert client.post("/jobs/j/priority", json={"priority": 5}).status_code == 200
    assert pool.status()["jobs"][0]["priority"] == 5
