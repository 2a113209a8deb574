"""strategy parameter_server with real worker and server processes (gloo on CPU): bitwise equal to a
1-worker run across rescales, a killed worker, a killed server and a resume; exactly-once samples;
the servers' shards and optimizer state in the checkpoints; sparse pushes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elastic_ops.checkpoint import open_store
from elastic_ops.errors import StaleEpochError, UserCodeError, WorkerLostError
from elastic_ops.runtime import ChunkStatus, Schedule, run_chunk, run_job
from elastic_ops.runtime.data_order import stream_slice
from elastic_ops.runtime.paramserver.layout import build_layout, split_by_server
from tests.runtime.builders import RecNet, final_state, make_ps_spec

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """An uninterrupted 1-worker run of the standard tiny parameter-server job."""
    spec = make_ps_spec(tmp_path_factory.mktemp("ps-ref"))
    result = run_job(spec, schedule=Schedule.constant(1))
    assert result.status is ChunkStatus.COMPLETED and result.iteration == 30
    return {"sha": result.param_sha256, "state": final_state(spec), "result": result}


def _same_model(reference: dict, spec) -> None:
    ref, got = reference["state"]["model"], final_state(spec)["model"]
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_schedule_1_3_2_equals_one_worker_bit_for_bit(tmp_path, reference):
    spec = make_ps_spec(tmp_path)
    result = run_job(spec, schedule=Schedule.parse("1,3,2", spec, 0, 30))
    assert [(i, n) for i, n, _ in result.workers_timeline] == [(0, 1), (10, 3), (20, 2)]
    assert result.param_sha256 == reference["sha"]
    _same_model(reference, spec)
    assert result.metrics["accuracy"] == reference["result"].metrics["accuracy"]
    # the servers were not restarted by the rescales: they stepped every iteration once
    assert result.ps_steps == 30


def test_the_checkpoint_holds_every_servers_shard_and_optimizer_state(reference):
    state = reference["state"]
    ps = state["ps"]
    assert ps["servers"] == 2 and len(ps["optimizer"]) == 2 and len(ps["scheduler"]) == 2
    users = state["model"]["users.weight"]
    assert users.shape == (40, 4)  # the whole table, assembled from the servers' rows
    # Adagrad's sum per server: each holds its half of each table's rows
    sums = [sorted(tuple(s["sum"].shape) for s in opt["state"].values()) for opt in ps["optimizer"]]
    assert all((20, 4) in shapes and (30, 4) in shapes for shapes in sums)
    assert all(sched["last_epoch"] == 30 for sched in ps["scheduler"])  # StepLR stepped on each server


def test_resume_restores_the_servers_shards_and_optimizer_state_bit_for_bit(tmp_path, reference):
    spec = make_ps_spec(tmp_path, checkpoint_interval=7)
    first = run_chunk(spec, 0, 12, target=lambda i: 1)
    assert first.status is ChunkStatus.COMPLETED and open_store(spec.checkpoint).latest().iteration == 12
    second = run_chunk(spec, 12, 30, target=lambda i: 2)
    assert second.workers_timeline[0][0] == 12
    assert second.param_sha256 == reference["sha"]


def _killed_then_rerun(spec, target, says: str, reference) -> None:
    """The chunk loses a process at iteration 17: retryable, blamed on its host, the checkpoint
    at 10 intact; a rerun from there gives the uninterrupted run's parameters."""
    with pytest.raises(WorkerLostError) as err:
        run_chunk(spec, 0, 30, target=target, host="host-a")
    assert err.value.retryable and err.value.host == "host-a"
    assert says in str(err.value) and "SIGKILL" in str(err.value)
    assert open_store(spec.checkpoint).latest().iteration == 10
    result = run_chunk(spec, 0, 30, target=lambda i: 2)  # new workers and servers, from the checkpoint
    assert result.workers_timeline[0][0] == 10
    assert result.param_sha256 == reference["sha"]


def test_a_killed_worker_is_retryable_and_the_rerun_matches_an_uninterrupted_run(tmp_path, reference):
    params = {"kill_at": 17, "kill_rank": 1, "marker": str(tmp_path / "killed-once")}
    _killed_then_rerun(make_ps_spec(tmp_path, params=params), lambda i: 2, "rank 1", reference)


def test_a_killed_server_is_retryable_and_restores_from_the_checkpoint(tmp_path, reference):
    params = {"kill_server": 1, "kill_server_at": 17, "marker": str(tmp_path / "server-killed-once")}
    spec = make_ps_spec(tmp_path, params=params)
    _killed_then_rerun(spec, Schedule.parse("1@0,3@12", spec, 0, 30), "parameter server 1", reference)
    _same_model(reference, spec)


def test_samples_are_used_exactly_once_across_rescales_and_a_mid_epoch_resume(tmp_path):
    record = tmp_path / "ids"
    record.mkdir()
    spec = make_ps_spec(tmp_path, params={"record_dir": str(record)})  # 96 samples: 8 iterations/epoch
    run_chunk(spec, 0, 13, target=Schedule.parse("1@0,3@5", spec, 0, 13))
    run_chunk(spec, 13, 30, target=Schedule.parse("2@13,1@20", spec, 13, 30))
    lines = [line for f in record.iterdir() for line in f.read_text().split("\n") if line]
    used = [int(i) for line in lines for i in line.split()]
    expected = stream_slice(spec.data_seed, 96, 0, 30 * 12).tolist()
    assert sorted(used) == sorted(expected)


def test_preemption_commits_the_servers_state_and_the_job_resumes_bit_for_bit(tmp_path, reference):
    spec = make_ps_spec(tmp_path)
    first = run_chunk(spec, 0, 30, target=lambda i: 0 if i >= 15 else 2)
    assert first.status is ChunkStatus.PREEMPTED and first.iteration == 15
    assert open_store(spec.checkpoint).latest().iteration == 15
    second = run_chunk(spec, 0, 30, target=lambda i: 3)
    assert second.status is ChunkStatus.COMPLETED and second.param_sha256 == reference["sha"]


def test_fencing_applies_unchanged(tmp_path):
    spec = make_ps_spec(tmp_path, total_iterations=4)
    open_store(spec.checkpoint).fence(5)
    with pytest.raises(StaleEpochError):
        run_chunk(spec, 0, 4, target=lambda i: 1, epoch=3)


def test_pushes_and_pulls_move_the_rows_touched_not_the_table(tmp_path):
    """A 200,000-row table (800,000 floats, 3.2 MB): a 12-sample batch touches at most 12 of
    its rows, and the bytes moved per step stay a small fraction of one copy of it."""
    spec = make_ps_spec(tmp_path, total_iterations=6, params={"items": 200_000})
    result = run_job(spec, schedule=Schedule.constant(2))
    per_step = result.ps_bytes / result.ps_steps
    table_bytes = 200_000 * 4 * 4
    assert per_step < table_bytes / 100, per_step  # ~2 KB of rows and ids, headers, the dense head
    assert result.ps_snapshot_bytes > table_bytes  # the chunk's end gathered the whole model, once


def test_a_model_that_reads_a_tables_weight_directly_is_told_to_call_the_module(tmp_path):
    spec = make_ps_spec(tmp_path, total_iterations=3, params={"read_weight": True})
    with pytest.raises(UserCodeError, match="users.weight.*call the module"):
        run_chunk(spec, 0, 3, target=lambda i: 1)


def test_before_step_is_refused_naming_why(tmp_path):
    spec = make_ps_spec(tmp_path, entrypoint="tests.runtime.builders:TinyMLP", total_iterations=3)
    with pytest.raises(UserCodeError, match="before_step"):
        run_chunk(spec, 0, 3, target=lambda i: 1)


def test_a_dense_model_trains_the_all_reduce_bitwise_model(tmp_path):
    """With no embedding table (every parameter dense), a server sums the shards' gradients in
    shard order as the bitwise all-reduce does, and steps the same optimizer on the same values."""
    from tests.runtime.builders import make_spec

    ar = make_spec(tmp_path / "ar", params={"clip": None})
    ps = make_ps_spec(tmp_path / "ps", entrypoint="tests.runtime.builders:NoClipMLP")
    a = run_job(ar, schedule=Schedule.constant(2))
    b = run_job(ps, schedule=Schedule.parse("1,3,2", ps, 0, 30))
    assert a.param_sha256 == b.param_sha256


# --- the layout ---------------------------------------------------------------------------


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 3)
        self.out = nn.Linear(3, 10, bias=False)
        self.out.weight = self.emb.weight  # weight tying: a dense gradient


def test_tables_are_split_by_rows_and_dense_parameters_balanced_over_servers():
    model = RecNet(40, 61, 4, 0.0)
    lay = build_layout(model, 3)
    assert [t.name for t in lay.tables] == ["users.weight", "items.weight"]
    assert [t.sparse for t in lay.tables] == [True, False]
    assert lay.tables[1].ranges == ((0, 21), (21, 41), (41, 61))
    assert sorted(lay.dense_owner) == [2, 3, 4, 5]  # the head's weights and biases
    assert sum(lay.elements(s) for s in range(3)) == lay.total_elements()
    ids = torch.tensor([0, 5, 20, 21, 40, 41, 60])
    assert split_by_server(ids, lay.tables[1]) == [(0, 3), (3, 5), (5, 7)]
    assert build_layout(model, 3) == lay  # the same for every process
    assert build_layout(_Tied(), 2).tables == ()
