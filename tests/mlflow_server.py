"""A real MLflow tracking server for tests: ``mlflow server`` with a SQLite backend on 127.0.0.1 and
a free port, its artifacts in a temporary directory. One per test session (it takes seconds to
start); each test uses an experiment of its own.

    from tests.mlflow_server import mlflow_server  # noqa: F401 (the fixture)

    def test_x(mlflow_server):
        mlflow_server.uri, mlflow_server.client()

Without the ``mlflow`` package the tests skip, and fail where ``ELASTIC_OPS_REQUIRE_SERVICES=1``
(CI): ``make setup`` installs it (the ``dev`` extra).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REQUIRE_SERVICES

START_S = 180  # an upper bound on the server's start (it migrates its database first)


def require_mlflow() -> None:
    try:
        import mlflow  # noqa: F401
    except ImportError:
        msg = "needs the mlflow package (make setup installs it: pip install -c constraints.txt -e '.[dev]')"
        if REQUIRE_SERVICES:
            pytest.fail(f"ELASTIC_OPS_REQUIRE_SERVICES=1 and {msg}")
        pytest.skip(msg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class MlflowServer:
    uri: str
    root: Path
    log: Path

    def client(self) -> Any:
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)

    def experiment(self) -> str:
        """A fresh experiment name for one test."""
        return f"test-{uuid.uuid4().hex[:10]}"


@contextlib.contextmanager
def running_server() -> Iterator[MlflowServer]:
    root = Path(tempfile.mkdtemp(prefix="elastic-ops-mlflow-"))
    port = _free_port()
    log = root / "server.log"
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
           "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start: {log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield MlflowServer(uri, root, log)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def mlflow_server() -> Iterator[MlflowServer]:
    require_mlflow()
    with running_server() as server:
        yield server
