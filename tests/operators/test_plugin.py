"""The plugin loads exactly once (entry point + deployment plugin folder); its HTTP API is tested
in tests/test_plugin_api.py."""

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
