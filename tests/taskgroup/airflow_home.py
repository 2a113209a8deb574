"""The environment of a ``dag.test()`` subprocess with its own ``AIRFLOW_HOME``."""

from __future__ import annotations

import os
from pathlib import Path


def airflow_env(home: Path) -> dict[str, str]:
    """This process's environment without ``AIRFLOW__*`` settings, pointed at ``home``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}
    env.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__LOAD_EXAMPLES="False",
               AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home / 'airflow.db'}",
               AIRFLOW__CORE__DAGS_FOLDER=str(home / "dags"))
    return env
