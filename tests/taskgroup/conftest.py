"""Fixtures for the ``dag.test()`` integration tests: one migrated Airflow metadata database."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.taskgroup.airflow_home import airflow_env


@pytest.fixture(scope="session")
def migrated_db(tmp_path_factory) -> Path:
    """A migrated SQLite metadata database; each run copies it into its own ``AIRFLOW_HOME``."""
    home = tmp_path_factory.mktemp("airflow_template")
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=airflow_env(home), check=True,
                   capture_output=True, timeout=300, cwd=home)
    return home / "airflow.db"
