"""The chunk runner with real worker processes (gloo on CPU): resume, rescale, failures."""

from __future__ import annotations

import math
from types import SimpleNamespace

import psutil
import pytest
import torch

from elastic_ops.checkpoint import open_store
from elastic_ops.errors import (
    CheckpointNotFoundError,
    NonFiniteLossError,
    SpecError,
    StaleEpochError,
    UserCodeError,
    WorkerLostError,
)
from elastic_ops.runtime import ChunkStatus, Schedule, run_chunk, run_job
from elastic_ops.runtime.allocation import Allocation
from elastic_ops.runtime.chunk import _Runner
from elastic_ops.runtime.control import count_of, moved
from elastic_ops.runtime.data_order import stream_slice
from elastic_ops.runtime.launcher import FailureReport, signalled_ranks
from elastic_ops.runtime.verdict import segment_failure
from tests.runtime.builders import RecordingLauncher, final_state, make_spec

pytestmark = pytest.mark.timeout(300)


def one_worker(_: int) -> int:
    return 1


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, str]:
    """Uninterrupted static 1-worker runs of the standard tiny job (bitwise and fast)."""
    out = {}
    for mode in ("bitwise", "fast"):
        tmp = tmp_path_factory.mktemp(f"ref-{mode}")
        spec = make_spec(tmp, consistency=mode, **_mode_fields(mode))
        result = run_job(spec, schedule=Schedule.constant(1))
        assert result.status is ChunkStatus.COMPLETED and result.iteration == 30
        out[mode] = result.param_sha256
        out[f"{mode}-state"] = final_state(spec)
    return out


def _mode_fields(mode: str) -> dict:
    # fast mode: no dropout, since random masks are drawn per worker there (docs/explanation/elasticity.md)
    if mode == "bitwise":
        return {"virtual_shards": 6}
    return {"virtual_shards": None, "params": {"dropout": 0.0}}


def test_resume_from_a_checkpoint_gives_identical_parameters(tmp_path, reference):
    spec = make_spec(tmp_path, checkpoint_interval=7)
    first = run_chunk(spec, 0, 12, target=one_worker)
    assert first.status is ChunkStatus.COMPLETED and first.iteration == 12
    assert open_store(spec.checkpoint).latest().iteration == 12
    second = run_chunk(spec, 12, 30, target=lambda i: 2)
    assert second.status is ChunkStatus.COMPLETED
    assert second.param_sha256 == reference["bitwise"]


def test_bitwise_schedule_1_3_2_equals_one_worker_bit_for_bit(tmp_path, reference):
    spec = make_spec(tmp_path)
    result = run_job(spec, schedule=Schedule.parse("1,3,2", spec, 0, 30))
    assert [(i, n) for i, n, _ in result.workers_timeline] == [(0, 1), (10, 3), (20, 2)]
    assert result.param_sha256 == reference["bitwise"]
    ref, got = reference["bitwise-state"]["model"], final_state(spec)["model"]
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_draws_in_the_optimizers_step_and_in_evaluate_do_not_depend_on_the_schedule(tmp_path):
    """They drew from each rank's generator as its last shard left it: the replicas of a noisy
    optimizer trained apart (rank 0's was kept), a sampling evaluate() varied by schedule (a probe)."""
    params = {"noisy_step": True, "eval_draw": True}
    one = run_job(make_spec(tmp_path / "one", params=params), schedule=Schedule.constant(1))
    spec = make_spec(tmp_path / "three", params=params)
    rescaled = run_job(spec, schedule=Schedule.parse("1,3,2", spec, 0, 30))
    assert rescaled.param_sha256 == one.param_sha256
    assert rescaled.metrics["accuracy"] == one.metrics["accuracy"]


def test_fast_schedule_1_3_2_equals_one_worker_within_tolerance(tmp_path, reference):
    spec = make_spec(tmp_path, consistency="fast", **_mode_fields("fast"))
    result = run_job(spec, schedule=Schedule.parse("1@0,3@9,2@21", spec, 0, 30))
    assert [n for _, n, _ in result.workers_timeline] == [1, 3, 2]
    ref, got = reference["fast-state"]["model"], final_state(spec)["model"]
    for k in ref:  # documented tolerance: 1e-5 relative to the parameter scale after 30 steps
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-5)


def test_gradient_accumulation_below_a_micro_batch_limit_trains_the_same_model(tmp_path, reference):
    """micro_batch=2: one worker takes 12 samples as 6 accumulated micro-batches, two workers 3
    each; the optimisation trajectory is the fixed-batch one (fast mode: within tolerance)."""
    spec = make_spec(tmp_path, consistency="fast", micro_batch=2, **_mode_fields("fast"))
    result = run_job(spec, schedule=Schedule.parse("1,2", spec, 0, 30))
    assert [n for _, n, _ in result.workers_timeline] == [1, 2]
    ref, got = reference["fast-state"]["model"], final_state(spec)["model"]
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-5)


def test_samples_are_used_exactly_once_across_rescales_and_a_mid_epoch_resume(tmp_path):
    record = tmp_path / "ids"
    record.mkdir()
    spec = make_spec(tmp_path, params={"record_dir": str(record)})  # 96 samples: 8 iterations/epoch
    run_chunk(spec, 0, 13, target=Schedule.parse("1@0,3@5", spec, 0, 13))  # stops mid-epoch 1
    run_chunk(spec, 13, 30, target=Schedule.parse("2@13,1@20", spec, 13, 30))
    used = [
        int(i) for f in record.iterdir() for line in f.read_text().split("\n") if line for i in line.split()
    ]
    expected = stream_slice(spec.data_seed, 96, 0, 30 * 12).tolist()
    assert sorted(used) == sorted(expected)  # the same multiset as the 1-worker stream
    counts = {i: used.count(i) for i in range(96)}
    # 360 samples = 3 full epochs + 72 samples of the 4th: every sample 3 or 4 times
    assert sorted(set(counts.values())) == [3, 4] and list(counts.values()).count(4) == 72


def test_before_step_clips_the_global_gradient_alike_for_any_worker_schedule(tmp_path, reference):
    """Gradient clipping in ``Trainable.before_step`` sees the reduced gradient (the same bits
    for any worker count in bitwise mode), so a 1→3→2 run ends on the 1-worker run's bits."""
    one = make_spec(tmp_path / "one", params={"clip": 0.05})
    alone = run_job(one, schedule=Schedule.constant(1))
    spec = make_spec(tmp_path / "rescaled", params={"clip": 0.05})
    rescaled = run_job(spec, schedule=Schedule.parse("1,3,2", spec, 0, 30))
    assert [n for _, n, _ in rescaled.workers_timeline] == [1, 3, 2]
    assert rescaled.param_sha256 == alone.param_sha256
    assert alone.param_sha256 != reference["bitwise"]  # the clip took effect


def test_killed_worker_is_retryable_and_the_rerun_matches_an_uninterrupted_run(tmp_path, reference):
    params = {"kill_at": 17, "kill_rank": 1, "marker": str(tmp_path / "killed-once")}
    spec = make_spec(tmp_path, params=params)
    with pytest.raises(WorkerLostError) as err:
        run_chunk(spec, 0, 30, target=lambda i: 2, host="host-a")
    assert err.value.retryable and err.value.host == "host-a"
    assert "SIGKILL" in str(err.value)
    assert open_store(spec.checkpoint).latest().iteration == 10  # the last commit before the kill
    result = run_chunk(spec, 0, 30, target=lambda i: 2)
    assert result.workers_timeline[0][0] == 10  # resumed, not restarted
    assert result.param_sha256 == reference["bitwise"]


def test_a_full_local_disk_is_a_lost_worker_on_that_host_saying_so(tmp_path):
    """A worker that cannot stage its state (disk full) was read as a lost peer or an internal
    bug ('unexpected pos 704 vs 598'): it is the host's fault, named, and the retry avoids it."""
    spec = make_spec(tmp_path, params={"full_disk_rank": 0})
    with pytest.raises(WorkerLostError) as err:
        run_chunk(spec, 0, 30, target=lambda i: 2, host="host-a")
    assert err.value.retryable and err.value.host == "host-a"
    assert "could not write to its local disk" in str(err.value) and "No space left" in str(err.value)
    assert open_store(spec.checkpoint).latest() is None  # nothing half-committed


def test_a_failed_torch_save_on_a_full_file_system_is_the_os_error_it_is(tmp_path, monkeypatch):
    import errno

    from elastic_ops.runtime import state as state_mod

    def torn(obj, path):  # torch's zip writer hides the ENOSPC behind its own error
        open(path, "wb").write(b"PK")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(state_mod.torch, "save", torn)
    monkeypatch.setattr(state_mod.os, "statvfs", lambda p: SimpleNamespace(f_bavail=3, f_frsize=4096))
    with pytest.raises(OSError) as err:
        state_mod.save_atomic({"x": 1}, tmp_path / "s.pt")
    assert err.value.errno == errno.ENOSPC and str(tmp_path) in str(err.value)
    assert list(tmp_path.iterdir()) == []  # no staging directory left behind
    monkeypatch.setattr(state_mod.os, "statvfs", lambda p: SimpleNamespace(f_bavail=10**6, f_frsize=4096))
    with pytest.raises(RuntimeError, match="unexpected pos"):  # room left: not taken for a full disk
        state_mod.save_atomic({"x": 1}, tmp_path / "s.pt")


def test_the_killed_rank_is_named_even_when_a_peer_exit_was_seen_first():
    # start_processes reports only the first failure it polls; a SIGKILLed worker's peer often
    # exits with 1 first, and our own teardown SIGTERMs the rest.
    procs = [SimpleNamespace(exitcode=1), SimpleNamespace(exitcode=-9), SimpleNamespace(exitcode=-15)]
    assert signalled_ranks(SimpleNamespace(_pc=SimpleNamespace(processes=procs))) == {1: "SIGKILL"}
    assert signalled_ranks(SimpleNamespace()) == {}


def test_a_peers_collective_error_does_not_hide_a_killed_rank_and_a_users_error_wins(tmp_path):
    """A DDP script's rank 1 SIGKILLed: rank 0's allreduce fails inside the script with gloo's
    "Connection reset by peer" (reported as 'comm' by the worker: worker._gloo_transport_error),
    which must not hide the kill. A user's own error wins over a dead rank, which often follows
    from it (our teardown SIGKILLs a rank that ignored its SIGTERM: a review)."""
    import json

    def report(rank, kind, message):
        (tmp_path / f"error-{rank}.json").write_text(json.dumps({
            "kind": kind, "message": message, "traceback": "Traceback ...", "iteration": None,
            "rank": rank, "time": 1.0 + rank,
        }))

    runner = SimpleNamespace(host="host-a")
    exited = {0: SimpleNamespace(exitcode=1, signal_name=lambda: "")}
    report(0, "comm", "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    err = segment_failure(runner.host, tmp_path, exited, FailureReport(killed={1: "SIGKILL"}))
    assert isinstance(err, WorkerLostError) and err.retryable and err.host == "host-a"
    assert "rank 1 killed by SIGKILL" in str(err)
    report(0, "user", "ValueError: rank 0: bad row in shard")  # its error, then our teardown's kill
    err = segment_failure(runner.host, tmp_path, exited, FailureReport(killed={1: "SIGKILL"}))
    assert isinstance(err, UserCodeError) and "bad row in shard" in str(err)


def test_gloo_transport_errors_raised_in_a_script_are_a_lost_peer():
    from elastic_ops.runtime.worker import _gloo_transport_error

    assert _gloo_transport_error(RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
                                              "Read error [127.0.0.1]:1234: Connection reset by peer"))
    assert not _gloo_transport_error(RuntimeError("shape mismatch in my layer"))


def test_a_forged_rendezvous_in_a_script_is_a_lost_worker_not_the_scripts_error():
    from elastic_ops.runtime.rendezvous import RendezvousForgeryError
    from elastic_ops.runtime.worker import script_error_kind

    assert script_error_kind(RendezvousForgeryError("the rendezvous value at 'k' is not signed")) == "comm"
    assert script_error_kind(RuntimeError("shape mismatch in my layer")) == "user"


def test_a_lone_hung_worker_is_stopped_after_the_stall_timeout(tmp_path, monkeypatch):
    """One worker has no process group, so no collective timed out: a hang in user code (or a
    SIGSTOPped worker) hung run_chunk for ever (a probe: > 45 s). After ELASTIC_OPS_STALL_S
    between two boundaries it is a lost worker saying so."""
    monkeypatch.setenv("ELASTIC_OPS_STALL_S", "2")
    spec = make_spec(tmp_path, params={"hold_at": 13, "hold_file": str(tmp_path / "never")})
    with pytest.raises(WorkerLostError) as err:
        run_chunk(spec, 0, 30, target=lambda i: 1, host="host-a")
    assert err.value.retryable and err.value.host == "host-a"
    assert "rank 0 reached no iteration boundary for 2 s after iteration 13" in str(err.value)
    assert open_store(spec.checkpoint).latest().iteration == 10  # the last commit before it hung


def test_a_collective_timeout_says_so_instead_of_a_bare_exit_status(tmp_path):
    """A rank slower than ELASTIC_OPS_PG_TIMEOUT_S: its peer's collective timed out and the chunk
    said only 'worker lost on localhost: rank 0 exited with 1'."""
    import json

    (tmp_path / "error-0.json").write_text(json.dumps({
        "kind": "comm", "message": "RuntimeError: [gloo] Timed out waiting 3000ms for send operation",
        "traceback": "", "iteration": 3, "rank": 0, "time": 1.0,
    }))
    exited = {0: SimpleNamespace(exitcode=1, signal_name=lambda: "")}
    err = segment_failure("host-a", tmp_path, exited, FailureReport(killed={}))
    assert isinstance(err, WorkerLostError) and err.retryable and err.host == "host-a"
    assert "rank 0 exited with 1 (rank 0's collective failed: RuntimeError: [gloo] Timed out" in str(err)
    assert "ELASTIC_OPS_PG_TIMEOUT_S" in str(err)
    # a hung rank (SIGSTOP) is killed by the teardown's SIGKILL: the timeout is still said
    err = segment_failure("host-a", tmp_path, exited, FailureReport(killed={1: "SIGKILL"}))
    assert "rank 1 killed by SIGKILL (rank 0's collective failed: RuntimeError: [gloo] Timed out" in str(err)
    # a rank killed outright is named as before, without its peers' broken connections
    (tmp_path / "error-0.json").write_text(json.dumps({
        "kind": "comm", "message": "RuntimeError: [gloo] Connection reset by peer",
        "traceback": "", "iteration": 3, "rank": 0, "time": 1.0,
    }))
    err = segment_failure("host-a", tmp_path, exited, FailureReport(killed={1: "SIGKILL"}))
    assert "rank 1 killed by SIGKILL" in str(err) and "collective" not in str(err)


def test_user_exception_is_a_non_retryable_user_code_error_with_the_traceback(tmp_path):
    spec = make_spec(tmp_path, params={"fail_at": 3})
    with pytest.raises(UserCodeError) as err:
        run_chunk(spec, 0, 30, target=lambda i: 2)
    assert not err.value.retryable
    assert "tiny model refuses this batch" in str(err.value) and "builders.py" in str(err.value)


@pytest.mark.parametrize(("workers", "code"), [(1, 1), (2, "no data at /nowhere"), (1, 0)])
def test_sys_exit_in_model_code_is_a_user_error_not_a_lost_worker(tmp_path, workers, code):
    """SystemExit went past the user-code guard: the worker exited with 1 and no report, a
    WorkerLostError (retried, blamed on the host) without the message; sys.exit(0) on one worker
    was 'exited without handing over their state' with a hint for scripts."""
    spec = make_spec(tmp_path, total_iterations=8, params={"exit_at": 3, "exit_code": code})
    with pytest.raises(UserCodeError, match=f"at iteration 3: SystemExit: {code}") as err:
        run_chunk(spec, 0, 8, target=lambda i: workers)
    assert not err.value.retryable and "builders.py" in str(err.value)


@pytest.mark.parametrize("workers", [1, 2])
def test_parameters_of_two_dtypes_are_a_user_error_naming_them_not_a_lost_worker(tmp_path, workers):
    """It failed inside the runtime's gradient buffer as a RuntimeError, reported as a lost worker
    (retried, the host blamed) even on one worker."""
    spec = make_spec(tmp_path, params={"double_head": True})
    with pytest.raises(UserCodeError) as err:
        run_chunk(spec, 0, 30, target=lambda i: workers)
    assert not err.value.retryable
    assert "mix dtypes: torch.float32 (e.g. '0.weight'), torch.float64 (e.g. '3.weight')" in str(err.value)


def test_a_state_the_safe_loader_refuses_is_a_user_error_before_training_and_nothing_is_committed(tmp_path):
    """It was found only when the runner loaded the staged file to commit it, after the whole
    chunk had trained: a raw UnpicklingError, nothing committed."""
    spec = make_spec(tmp_path, params={"numpy_scheduler": True})
    with pytest.raises(UserCodeError) as err:
        run_chunk(spec, 0, 30, target=lambda i: 2)
    assert "rank 0 before training" in str(err.value)
    assert "invalid state['scheduler']['base']: type numpy.float64 is not allowed" in str(err.value)
    assert open_store(spec.checkpoint_uri()).latest() is None


def test_a_staged_state_is_checked_before_it_is_written(tmp_path):
    import numpy as np

    from elastic_ops.runtime.segment import UserFailure, _stage

    with pytest.raises(UserFailure, match=r"state\['metrics'\]\['x'\]: type numpy.float64"):
        _stage({"metrics": {"x": np.float64(1.0)}}, tmp_path / "ckpt-1.pt")
    assert not (tmp_path / "ckpt-1.pt").exists()


def test_nan_loss_is_a_non_finite_loss_error(tmp_path):
    spec = make_spec(tmp_path, params={"nan_at": 4})
    with pytest.raises(NonFiniteLossError) as err:
        run_chunk(spec, 0, 30, target=lambda i: 2)
    assert not err.value.retryable and "iteration 4" in str(err.value)


def test_target_zero_preempts_with_a_committed_checkpoint_then_the_job_resumes(tmp_path, reference):
    spec = make_spec(tmp_path)
    result = run_chunk(spec, 0, 30, target=lambda i: 0 if i >= 15 else 2)
    assert result.status is ChunkStatus.PREEMPTED and result.iteration == 15
    assert open_store(spec.checkpoint).latest().iteration == 15
    assert result.checkpoint_uri == open_store(spec.checkpoint).latest().uri
    done = run_chunk(spec, 0, 30, target=lambda i: 3)
    assert done.status is ChunkStatus.COMPLETED and done.param_sha256 == reference["bitwise"]


def test_a_result_carries_the_loss_of_every_step_of_the_chunk_those_before_a_resume_too(tmp_path):
    """What the tracker logs at a chunk's end: every step's loss, at the iteration the step
    reached (as progress reports it); a resumed try's history has the steps trained before the
    checkpoint it resumed from (they come with the state), and an already-done chunk's too."""
    whole = run_chunk(make_spec(tmp_path / "whole"), 0, 30, target=lambda i: 2)
    assert [it for it, _ in whole.loss_history] == list(range(1, 31))
    spec, live = make_spec(tmp_path / "cut"), []
    first = run_chunk(spec, 0, 30, target=lambda i: 0 if i >= 15 else 2, on_progress=live.append)
    assert first.status is ChunkStatus.PREEMPTED and first.loss_history == whole.loss_history[:15]
    assert [(p.iteration, p.loss) for p in live] == first.loss_history
    done = run_chunk(spec, 0, 30, target=lambda i: 2)
    assert done.workers_timeline[0][0] == 15 and done.loss_history == whole.loss_history
    again = run_chunk(spec, 10, 20, target=lambda i: 2, launcher=_NoLaunch())
    assert again.status is ChunkStatus.ALREADY_DONE and again.loss_history == whole.loss_history[10:20]


class _NoLaunch:
    def start(self, req):  # pragma: no cover - failing is the point
        raise AssertionError("an already-done chunk must not start workers")


@pytest.mark.parametrize("value", [None, 2.5, float("nan"), -1, "3", True])
def test_a_target_that_is_not_a_worker_count_is_a_spec_error_naming_it(tmp_path, value):
    """int() took whatever target() returned: 2.5 ran 2 workers, "3" ran 3, -1 preempted the
    job, and None or NaN failed with a bare TypeError / ValueError naming neither."""
    spec = make_spec(tmp_path, total_iterations=8)
    with pytest.raises(SpecError, match=r"invalid target=.*target\(0\) must return a worker count"):
        run_chunk(spec, 0, 8, target=lambda i: value)
    assert open_store(spec.checkpoint).latest() is None


def test_a_bad_target_mid_chunk_stops_the_workers_with_a_spec_error(tmp_path):
    spec = make_spec(tmp_path, total_iterations=8)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(SpecError, match=r"invalid target=None: target\(5\)"):
        run_chunk(spec, 0, 8, target=lambda i: 1 if i < 5 else None)
    workers = [p for p in psutil.Process().children(recursive=True)
               if p.pid not in before and "forkserver" not in " ".join(p.cmdline())
               and "resource_tracker" not in " ".join(p.cmdline())]
    assert not workers
    assert run_chunk(spec, 0, 8, target=lambda i: 1).status is ChunkStatus.COMPLETED


def test_numpy_worker_counts_are_counts(tmp_path):
    import numpy as np

    spec = make_spec(tmp_path, total_iterations=4)
    result = run_chunk(spec, 0, 4, target=lambda i: np.int64(2))
    assert [n for _, n, _ in result.workers_timeline] == [2]


def test_an_already_done_chunk_returns_at_once_without_workers(tmp_path, reference):
    spec = make_spec(tmp_path)
    run_chunk(spec, 0, 30, target=lambda i: 2)
    result = run_chunk(spec, 10, 20, target=lambda i: 2, launcher=_NoLaunch())  # no workers start
    assert result.status is ChunkStatus.ALREADY_DONE and result.iteration == 30
    assert result.param_sha256 == reference["bitwise"]


def test_a_chunk_fences_the_store_with_its_epoch_before_it_restores(tmp_path):
    """A new try (epoch 2) fences first: what an earlier try (epoch 1) still commits afterwards
    is refused, and a try whose epoch is already superseded does not start."""
    spec = make_spec(tmp_path)
    store = open_store(spec.checkpoint)
    store.save(30, {"model": {}, "iteration": 30}, epoch=1, spec_hash=spec.spec_hash())
    result = run_chunk(spec, 20, 30, target=one_worker, epoch=2, launcher=_NoLaunch())
    assert result.status is ChunkStatus.ALREADY_DONE and store.current_epoch() == 2
    with pytest.raises(StaleEpochError, match="fencing epoch 1 is stale \\(current epoch is 2\\)"):
        store.save(40, {"model": {}, "iteration": 40}, epoch=1, spec_hash=spec.spec_hash())
    with pytest.raises(StaleEpochError) as stale:
        run_chunk(spec, 20, 30, target=one_worker, epoch=1, launcher=_NoLaunch())
    assert stale.value.retryable  # the next try gets a new lease
    assert store.latest(spec_hash=spec.spec_hash()).iteration == 30


def test_a_later_chunk_without_a_checkpoint_is_refused_naming_the_store_it_read(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        run_chunk(make_spec(tmp_path), 10, 20, target=one_worker, launcher=_NoLaunch())
    elsewhere = open_store(f"file://{tmp_path}/runs/run-1")  # as under Airflow: <checkpoint>/<run_id>
    with pytest.raises(CheckpointNotFoundError, match=f"in file://{tmp_path}/runs/run-1 to resume"):
        run_chunk(make_spec(tmp_path), 10, 20, target=one_worker, store=elsewhere, launcher=_NoLaunch())


def test_warm_start_takes_the_weights_of_another_job(tmp_path):
    source = make_spec(tmp_path / "src", name="source")
    run_chunk(source, 0, 30, target=one_worker)
    src_model = final_state(source)["model"]
    spec = make_spec(
        tmp_path / "dst", name="dest", total_iterations=1, checkpoint_interval=1, params={"lr": 0.0}
    )
    result = run_chunk(spec, 0, 1, target=one_worker, warm_start=source.checkpoint)
    got = final_state(spec)
    assert got["iteration"] == 1 and result.status is ChunkStatus.COMPLETED
    assert all(torch.equal(src_model[k], got["model"][k]) for k in src_model)  # lr 0: weights kept


def test_a_warm_start_from_a_folder_that_does_not_exist_creates_nothing(tmp_path):
    spec = make_spec(tmp_path / "dst", name="dest", total_iterations=1, checkpoint_interval=1)
    missing = tmp_path / "no" / "such" / "store"
    with pytest.raises(CheckpointNotFoundError, match="holds no committed checkpoint"):
        run_chunk(spec, 0, 1, target=one_worker, warm_start=f"file://{missing}")
    assert not (tmp_path / "no").exists()  # a read-only field writes nothing


class _Grant:
    """A pool lease as the runner sees it: 1 worker on slot 5, then 2 on slots 5 and 2 (a grow)."""

    def __init__(self) -> None:
        self.workers = 0

    def target(self, iteration: int) -> Allocation:
        workers = 1 if iteration < 10 else 2
        return Allocation.split(workers, "localhost", (5,) if workers == 1 else (5, 2))


def test_the_granted_slots_reach_every_launch_request(tmp_path):
    grant, launcher = _Grant(), RecordingLauncher()
    result = run_chunk(make_spec(tmp_path), 0, 30, target=grant.target, launcher=launcher)
    assert result.status is ChunkStatus.COMPLETED
    assert [(r.workers, r.slots) for r in launcher.requests] == [(1, (5,)), (2, (5, 2))]
    plain = RecordingLauncher()  # without slots (the CLI): no slots in the request, as before
    run_chunk(make_spec(tmp_path / "plain", threads_per_worker=2), 0, 5, target=one_worker, launcher=plain)
    assert [r.slots for r in plain.requests] == [None]
    assert [r.threads_per_worker for r in plain.requests] == [2]  # the spec's CPU threads per worker


class _Move:
    """A lease the pool moves: 2 workers on slots 0 and 1, from boundary 10 the same count on
    slots 3 and 2 (e.g. off a draining host), from 20 those slots in another order."""

    def __init__(self) -> None:
        self.at = 0

    def target(self, iteration: int) -> Allocation:
        slots = (0, 1) if iteration < 10 else (3, 2) if iteration < 20 else (2, 3)
        return Allocation.split(2, "localhost", slots)


def test_a_same_count_move_relaunches_on_the_new_slots_and_changes_nothing(tmp_path, reference):
    lease, launcher, started = _Move(), RecordingLauncher(), []
    result = run_chunk(
        make_spec(tmp_path),
        0,
        30,
        target=lease.target,
        launcher=launcher,
        on_segment=lambda i, a: started.append((i, a.workers, a.on("localhost"))),
    )
    assert result.status is ChunkStatus.COMPLETED and result.iteration == 30
    # the move ends the segment at boundary 10; a mere reorder (boundary 20) does not
    assert [(r.workers, r.slots) for r in launcher.requests] == [(2, (0, 1)), (2, (3, 2))]
    assert started == [(0, 2, (0, 1)), (10, 2, (3, 2))]
    assert [(i, n) for i, n, _ in result.workers_timeline] == [(0, 2), (10, 2)]
    assert result.param_sha256 == reference["bitwise"]  # bitwise: the relaunch changes nothing


def test_a_move_off_this_host_is_followed_on_cpu_and_not_on_cuda(tmp_path):
    """On CUDA the local launcher cannot start workers on another host's slots: the workers stay
    on their GPUs (and the lease keeps reporting them) instead of failing at the relaunch."""
    granted = {"slots": (0, 1)}
    runner = _Runner(
        make_spec(tmp_path),
        0,
        30,
        lambda i: Allocation.split(2, "h", granted["slots"]),
        None,
        0,
        None,
        "h",
        None,
        tmp_path,
    )
    try:
        runner.device = "cpu"
        granted["slots"] = ()  # the whole grant is on another host now
        assert runner.decide(10, 2, ((0, 1), ())) == moved(2)  # CPU slots are bookkeeping: follow
        runner.device = "cuda"
        assert runner.decide(10, 2, ((0, 1), ())) == 2  # stay: nothing here to relaunch on
        granted["slots"] = (1, 5)  # a move on this host: followed on CUDA too
        assert runner.decide(11, 2, ((0, 1), ())) == moved(2)
        granted["slots"] = (1, 0)  # the same GPUs: no relaunch
        assert runner.decide(12, 2, ((0, 1), ())) == 2
        assert runner.decide(13, 1, ((0, 1), ())) == 2  # a count change is a plain decision
        assert count_of(moved(2)) == 2 and count_of(0) == 0 and moved(1) > 4096
    finally:
        runner.committer.close()


class _PidsLauncher(RecordingLauncher):
    """Also keeps the worker pids of every launch."""

    def __init__(self) -> None:
        super().__init__()
        self.pids: list[list[int]] = []

    def start(self, req):
        pc = super().start(req)
        self.pids.append(list(pc.pids().values()))
        return pc


def test_a_new_count_is_announced_only_after_the_old_workers_exited(tmp_path):
    # The lease reports a shrink when on_segment fires: the slots it gives up must be empty then.
    launcher, calls = _PidsLauncher(), []

    def on_segment(iteration: int, allocation: Allocation) -> None:
        assert allocation.placements is None  # a bare count: no slots
        earlier = [pid for pids in launcher.pids for pid in pids]
        calls.append((iteration, allocation.workers, [pid for pid in earlier if psutil.pid_exists(pid)]))

    run_chunk(
        make_spec(tmp_path),
        0,
        30,
        target=lambda i: 2 if i < 10 else 1,
        launcher=launcher,
        on_segment=on_segment,
    )
    assert calls == [(0, 2, []), (10, 1, [])]
    assert [r.workers for r in launcher.requests] == [2, 1]


def test_progress_reports_every_iteration_with_an_eta(tmp_path):
    seen = []
    run_chunk(make_spec(tmp_path), 0, 30, target=lambda i: 1 if i < 20 else 2, on_progress=seen.append)
    assert [p.iteration for p in seen] == list(range(1, 31))
    assert {p.workers for p in seen} == {1, 2} and seen[-1].eta_s == 0
    assert all(math.isfinite(p.loss) for p in seen)  # finite losses reported


def test_linear_lr_scaling_grows_the_batch_with_the_workers(tmp_path):
    spec = make_spec(
        tmp_path,
        consistency="fast",
        virtual_shards=None,
        scaling="linear_lr",
        warmup_iterations=4,
        params={"dropout": 0.0},
    )
    result = run_job(spec, schedule=Schedule.parse("1@0,3@10", spec, 0, 30))
    assert result.status is ChunkStatus.COMPLETED
    state = final_state(spec)
    assert state["cursor"] == 10 * 12 + 20 * 36  # 12 samples per worker per iteration
    assert state["lr_ramp"] == {"from": 1.0, "to": 3.0, "start": 10}  # warmup toward 3x from iteration 10


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_workers_with_nccl_are_bitwise_equal_to_one_worker(tmp_path, reference):
    spec = make_spec(tmp_path, device="cuda")
    one = run_job(spec, schedule=Schedule.constant(1))
    assert one.status is ChunkStatus.COMPLETED
    # on any number of GPUs: stopped at 12, restored from the checkpoint in new worker
    # processes, the run ends on the same bits as the uninterrupted one
    resumed = make_spec(tmp_path / "resumed", device="cuda")
    assert run_chunk(resumed, 0, 12, target=one_worker).iteration == 12
    assert run_chunk(resumed, 12, 30, target=one_worker).param_sha256 == one.param_sha256
    if torch.cuda.device_count() >= 2:
        spec2 = make_spec(tmp_path / "two", device="cuda", max_workers=2)
        two = run_job(spec2, schedule=Schedule.parse("1,2", spec2, 0, 30))
        assert two.param_sha256 == one.param_sha256


def test_a_planted_checkpoint_the_safe_loader_refuses_is_passed_over_before_any_worker(tmp_path):
    """The workers get the restored state as the committed file itself, but its pickle is
    checked first: a planted newest checkpoint (valid checksums, content the safe loader
    refuses) is passed over for the older one, whose chunk then trains the gap and commits that
    iteration again; with no older one there is nothing to resume from. Nothing in it runs."""
    import io

    from elastic_ops.checkpoint.manifest import FileEntry, Manifest

    class Exploit:
        def __reduce__(self):  # noqa: ANN204
            return (open, (str(tmp_path / "pwned"), "w"))

    spec = make_spec(tmp_path)
    evil = io.BytesIO()
    torch.save({"model": Exploit()}, evil)
    root = tmp_path / "ckpt"
    (root / "it-00000010/d-evil").mkdir(parents=True)
    (root / "it-00000010/d-evil/state.pt").write_bytes(evil.getvalue())
    entry = FileEntry.of("d-evil/state.pt", evil.getvalue())
    manifest = Manifest(iteration=10, epoch=1, spec_hash=spec.spec_hash(), created=0.0, files=(entry,))
    (root / "it-00000010/manifest.json").write_bytes(manifest.to_json())
    launcher = RecordingLauncher()
    with pytest.raises(CheckpointNotFoundError):
        run_chunk(spec, 10, 20, target=lambda i: 1, launcher=launcher)
    assert launcher.requests == []
    assert run_chunk(spec, 0, 5, target=one_worker).status is ChunkStatus.COMPLETED  # an older one
    done = run_chunk(spec, 10, 20, target=one_worker)
    assert done.status is ChunkStatus.COMPLETED and done.iteration == 20
    assert [r.iteration for r in open_store(spec.checkpoint).list()] == [5, 10, 20]
    assert not (tmp_path / "pwned").exists()


# --- a CUDA job on a host whose GPUs it cannot use (CPU-runnable: the coordinator's view of the GPUs
# is patched; the workers are real and find no such GPU, on a CPU build as on a GPU machine) ------


def test_a_granted_slot_the_host_has_no_gpu_for_fails_retryably_naming_the_host(tmp_path, monkeypatch):
    from elastic_ops.runtime import launcher

    monkeypatch.setattr(launcher, "visible_gpus", lambda: ["0", "1"])  # the pool thinks it has 4
    spec = make_spec(tmp_path, device="cuda")
    with pytest.raises(WorkerLostError) as err:
        run_chunk(spec, 0, 10, target=lambda i: Allocation.split(1, "gpu-7", (3,)), host="gpu-7")
    assert err.value.retryable and err.value.host == "gpu-7"  # reported: the retry avoids gpu-7
    assert str(err.value).startswith("gpu-7: no GPU for granted slot(s) [3] on this host: it has 2 GPU(s)")
    assert open_store(spec.checkpoint).latest() is None  # refused before any worker started


@pytest.mark.parametrize("workers", [1, 2])
def test_a_worker_whose_gpu_cuda_cannot_use_is_a_worker_lost_on_the_host(tmp_path, monkeypatch, workers):
    """A GPU gone, busy or broken is the host's fault: the chunk is retried elsewhere. It was a
    non-retryable TrainingError ('runtime error on rank 0') with one worker, the job ended for
    good, the host never reported."""
    from elastic_ops.runtime import launcher

    monkeypatch.setattr(launcher, "visible_gpus", lambda: ["98", "99"])  # no such GPUs
    spec = make_spec(tmp_path, device="cuda", max_workers=2)
    with pytest.raises(WorkerLostError) as err:
        run_chunk(spec, 0, 10, target=lambda i: Allocation.split(workers, "gpu-7", (0, 1)), host="gpu-7")
    assert err.value.retryable and err.value.host == "gpu-7"
    text = str(err.value)
    assert "worker lost on gpu-7: rank " in text and " cannot use its GPU: DeviceUnusable: " in text
    assert "CUDA_VISIBLE_DEVICES='9" in str(err.value) and "nvidia-smi" in err.value.hint


def test_a_script_whose_gpu_cuda_cannot_use_is_a_worker_lost_not_a_user_error(tmp_path, monkeypatch):
    from pathlib import Path

    from elastic_ops.runtime import launcher

    monkeypatch.setattr(launcher, "visible_gpus", lambda: ["99"])
    script = str(Path(__file__).with_name("ddp_script.py"))
    spec = make_spec(tmp_path, entrypoint=script, consistency="fast", virtual_shards=None, device="cuda")
    with pytest.raises(WorkerLostError, match=r"rank 0 cannot use its GPU: .*CUDA_VISIBLE_DEVICES='99'"):
        run_chunk(spec, 0, 4, target=one_worker, host="gpu-7")


def test_device_auto_is_resolved_by_the_chunks_process_and_logged(tmp_path, monkeypatch, caplog):
    """``auto`` resolves where the chunk runs (every rank gets the result); which device it was
    shows in the segment's log line: nothing else (result, checkpoint, spec hash) names it."""
    from elastic_ops.runtime import launcher

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host, as the coordinator sees it
    monkeypatch.setattr(launcher, "visible_gpus", lambda: ["0"])
    spec = make_spec(tmp_path, device="auto")
    with caplog.at_level("INFO", logger="elastic_ops.runtime"), pytest.raises(WorkerLostError):
        # no GPU for slot 2
        run_chunk(spec, 0, 10, target=lambda i: Allocation.split(1, "gpu-7", (2,)), host="gpu-7")
    assert "segment 0: iterations 0..10 with 1 worker(s) on cuda (device auto), slots [2]" in caplog.text
    assert spec.spec_hash() == make_spec(tmp_path, device="cpu").spec_hash()  # the device is not in it


def test_a_changed_spec_at_the_old_checkpoint_location_says_what_changed(tmp_path):
    """Edit a hyperparameter, keep the checkpoint location: it was `iteration 10 is already
    committed ... another writer owns this job` at the first commit, every time (an audit)."""
    first = make_spec(tmp_path, params={"weight_decay": 0.0})
    assert run_chunk(first, 0, 20, target=one_worker).status is ChunkStatus.COMPLETED
    changed = make_spec(tmp_path, params={"weight_decay": 0.01})
    with pytest.raises(SpecError, match=r"invalid checkpoint=.*another \(spec hash .*up to iteration 20.*"
                                        r"changed: params\.weight_decay 0\.0 -> 0\.01") as err:
        run_chunk(changed, 0, 20, target=one_worker)
    assert "warm_start=" in str(err.value) and not err.value.retryable
    assert [r.iteration for r in open_store(first.checkpoint).list()] == [10, 20], "nothing written"
    elsewhere = changed.replace(checkpoint=f"file://{tmp_path}/ckpt2")
    assert run_chunk(elsewhere, 0, 20, target=one_worker).status is ChunkStatus.COMPLETED
    # the old job itself resumes where it was
    assert run_chunk(first, 20, 30, target=one_worker).status is ChunkStatus.COMPLETED
