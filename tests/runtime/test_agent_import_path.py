"""A newcomer's first run: a Trainable kept beside the DAG, and the per-host agent started as the
docs/howto/agents.md says (``elastic-ops agent --socket …``, with neither the DAG folder on its ``PYTHONPATH``
nor its working directory there). The task hands the agent its import path, so the chunk runs;
where the agent still cannot find the module, the task is told which process could not, where
it looked and how to fix it, as a retryable error."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from elastic_ops.agent.client import AgentClient
from elastic_ops.agent.protocol import StoreConfig
from elastic_ops.errors import (
    AgentUnavailableError,
    EntrypointElsewhereError,
    EntrypointError,
    UserCodeError,
)
from elastic_ops.runtime import ChunkStatus
from tests.runtime.agent_helpers import as_target
from tests.runtime.builders import make_spec

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]

SEQGRU = textwrap.dedent('''
    import torch
    from torch import nn

    from elastic_ops.runtime import Trainable


    class SeqGRU(Trainable):
        def __init__(self, *, hidden: int = 4):
            super().__init__(hidden=hidden)

        def build_model(self):
            return nn.Linear(4, 2)

        def build_optimizer(self, model):
            return torch.optim.SGD(model.parameters(), lr=0.1)

        def train_dataset(self):
            g = torch.Generator().manual_seed(0)
            x, y = torch.randn(48, 4, generator=g), torch.randint(0, 2, (48,), generator=g)
            return torch.utils.data.TensorDataset(x, y)

        def loss(self, model, batch):
            x, y = batch
            return nn.functional.cross_entropy(model(x), y)
''')


@pytest.fixture(scope="module")
def dag_folder(tmp_path_factory) -> Path:
    """``dags/newcomer_models/seqgru.py`` beside a DAG, as users keep their models."""
    dags = tmp_path_factory.mktemp("airflow") / "dags"
    (dags / "newcomer_models").mkdir(parents=True)
    (dags / "newcomer_models" / "__init__.py").write_text("")
    (dags / "newcomer_models" / "seqgru.py").write_text(SEQGRU)
    (dags / "newcomer_models" / "broken.py").write_text("import newcomer_dependency_not_installed\n")
    (dags / "newcomer_dag.py").write_text("from newcomer_models.seqgru import SeqGRU  # noqa: F401\n")
    return dags


@pytest.fixture(scope="module")
def agent_path(tmp_path_factory):
    """``elastic-ops agent --socket PATH`` as its own process, started elsewhere, with only
    elastic_ops (this checkout) on its ``PYTHONPATH``: the DAG folder is the task's alone."""
    where = tmp_path_factory.mktemp("agent")
    path = where / "agent.sock"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "elastic_ops.cli", "agent", "--socket", str(path)],
                            cwd=where, env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not _answers(str(path)):
            assert proc.poll() is None and time.monotonic() < deadline, "the agent did not start"
            time.sleep(0.5)
        yield str(path)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _answers(path: str) -> bool:
    try:
        return os.path.exists(path) and AgentClient(path).ping()["type"] == "pong"
    except AgentUnavailableError:
        return False


def run_on_agent(path: str, tmp_path: Path, **params):
    spec = make_spec(tmp_path, entrypoint="newcomer_models.seqgru:SeqGRU", total_iterations=6,
                     global_batch=4, max_workers=2, virtual_shards=2, checkpoint_interval=6, params=params)
    store = StoreConfig(spec.checkpoint_uri())
    return AgentClient(path).run_chunk(spec.to_dict(), 0, 6, epoch=1, host="h1", store=store,
                                       target=as_target("h1", lambda: 2))


def test_a_trainable_beside_the_dag_trains_on_an_agent_started_without_the_dag_folder(
        agent_path, dag_folder, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(dag_folder))  # what Airflow does for a task
    result = run_on_agent(agent_path, tmp_path)
    assert result.status == ChunkStatus.COMPLETED and result.iteration == 6


def test_a_module_the_agent_cannot_find_names_the_agent_its_path_and_the_fix(
        agent_path, dag_folder, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(dag_folder))
    # an older task, or a folder only this task can read: the agent does not get the import path
    monkeypatch.setattr("elastic_ops.runtime.entrypoints.task_import_path", lambda: [])
    with pytest.raises(EntrypointElsewhereError) as err:
        run_on_agent(agent_path, tmp_path)
    text = str(err.value)
    assert err.value.retryable and isinstance(err.value, EntrypointError)
    assert "imports in this task" in text and "not where the chunk runs" in text
    assert "newcomer_models" in text and "pid " in text and "sys.path" in text
    assert "PYTHONPATH" in text and "DAG folder" in text


def test_a_module_importable_nowhere_stays_the_jobs_own_non_retryable_error(agent_path, tmp_path):
    spec = make_spec(tmp_path, entrypoint="newcomer_modelz.seqgru:SeqGRU")
    with pytest.raises(EntrypointError) as err:
        AgentClient(agent_path).run_chunk(spec.to_dict(), 0, 6, epoch=1, host="h1",
                                          store=StoreConfig(spec.checkpoint_uri()),
                                          target=as_target("h1", lambda: 1))
    assert type(err.value) is EntrypointError and not err.value.retryable
    assert "cannot be found" in str(err.value) and "pid " in str(err.value)


def test_a_misspelt_parameter_of_a_model_the_task_never_imported_is_named_by_the_workers(
        agent_path, dag_folder, tmp_path, monkeypatch):
    """A DAG that names its model only as a string: neither the task nor the agent imports it,
    so the workers check the parameters, and say which, not with a TypeError traceback."""
    monkeypatch.syspath_prepend(str(dag_folder))
    assert "newcomer_models.seqgru" not in sys.modules
    with pytest.raises(UserCodeError) as err:
        run_on_agent(agent_path, tmp_path, hiden=8)
    assert "invalid params.hiden=8: SeqGRU takes no parameter 'hiden'; it accepts: hidden" in str(err.value)
    assert "did you mean 'hidden'?" in str(err.value) and not err.value.retryable


def test_a_dependency_the_workers_cannot_import_names_the_worker_and_its_path(
        agent_path, dag_folder, tmp_path, monkeypatch):
    """The agent finds the module (it runs none of it); the workers import it and miss one of its
    imports: they say so, with their pid, host and sys.path (the DAG folder, from the task, on it)."""
    monkeypatch.syspath_prepend(str(dag_folder))
    spec = make_spec(tmp_path, entrypoint="newcomer_models.broken:Model")
    with pytest.raises(UserCodeError) as err:
        AgentClient(agent_path).run_chunk(spec.to_dict(), 0, 6, epoch=1, host="h1",
                                          store=StoreConfig(spec.checkpoint_uri()),
                                          target=as_target("h1", lambda: 1))
    text = str(err.value)
    assert "module 'newcomer_models.broken' cannot be imported in " in text and "pid " in text
    assert str(dag_folder) in text and "newcomer_dependency_not_installed" in text
