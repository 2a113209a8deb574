"""Shared setup for operator tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

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


TASK = """  # a chunk task that must not import torch: it runs chunk 0 twice

import json, logging, sys
from types import SimpleNamespace

class NoTorch:  # the task process must not import torch on the agent path
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"the task process imported {name}")

sys.meta_path.insert(0, NoTorch())
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from elastic_ops.operators import ElasticChunkOperator

op = ElasticChunkOperator(task_id="chunk_0", spec_fields=json.loads(sys.argv[1]), chunk_index=0,
                          group_id="train")
context = {"dag": SimpleNamespace(dag_id="d"), "run_id": sys.argv[2]}
print("RESULT", json.dumps(op.execute(context)))
print("RESULT", json.dumps(op.execute(context)))  # again: done (asked of the agent or a node)
"""


def run_torchless_task(
    fields: dict[str, Any], run_id: str, cwd: Path, **env: str
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """Run ``TASK`` in a subprocess (this environment plus ``env``): the results of its two runs
    and its log (stdout and stderr: Airflow's logging setup decides which)."""
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TASK), json.dumps(fields), run_id],
        env=dict(os.environ, PYTHONPATH=str(repo), **env), capture_output=True, text=True,
        timeout=240, cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(x.split(" ", 1)[1]) for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    first, again = results
    return first, again, proc.stdout + proc.stderr


def train_with(monkeypatch: pytest.MonkeyPatch, run: Any) -> None:
    """Chunk tasks train through ``run(request, lease)`` (a stand-in for the runtime) on an
    in-process executor: the operator, the pool and the store are real."""
    from elastic_ops.executors.in_process import InProcessExecutor
    from elastic_ops.hooks.elastic_ops import ElasticOpsHook

    class Scripted(InProcessExecutor):
        def run(self, request, lease):
            return run(request, lease)

    monkeypatch.setattr(ElasticOpsHook, "executor", lambda self, log: Scripted(self, log))


def chunk_result(
    status: Any = None, *, start: int = 20, end: int = 40, iteration: int = 40, timeline: Any = (),
    loss: float | None = None, metrics: dict[str, float] | None = None, samples_per_sec: float = 1.0,
) -> Any:
    """A runner's ``ChunkResult`` for chunk ``[start, …)`` that ended at ``iteration``;
    ``timeline``: its segments ``(iteration, workers, unix_time)``."""
    from elastic_ops.runtime.outcome import ChunkResult, ChunkStatus

    return ChunkResult(
        status=status or ChunkStatus.COMPLETED, start=start, end=end, iteration=iteration,
        checkpoint_uri=None, loss=loss, metrics=dict(metrics or {}),
        workers_timeline=[tuple(t) for t in timeline], samples_per_sec=samples_per_sec, duration_s=1.0,
        param_sha256=None,
    )
