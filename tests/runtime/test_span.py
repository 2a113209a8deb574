"""Segments that span hosts: one process group over several hosts' ranks (here all "hosts" run
on this machine through :class:`LoopbackSpanLauncher`, the node agents' follower path in-process)."""

from __future__ import annotations

import pytest
import torch

from devtools.span import LoopbackSpanLauncher
from elastic_ops.checkpoint import open_store
from elastic_ops.errors import SpecError, UserCodeError, WorkerLostError
from elastic_ops.runtime import ChunkStatus, Schedule, run_chunk, run_job
from elastic_ops.runtime.allocation import Allocation
from elastic_ops.runtime.data_order import stream_slice
from elastic_ops.runtime.launcher import FailureReport, LaunchRequest, LocalLauncher, RemotePart, worker_env
from elastic_ops.runtime.placement import place, used
from elastic_ops.runtime.span import RemoteExit, SpanningContext
from tests.runtime.builders import make_spec

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def _loopback_gloo(monkeypatch):
    # every "host" is this machine: gloo on loopback (a cluster's nodes set their interface)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    spec = make_spec(tmp_path_factory.mktemp("ref"))
    return run_job(spec, schedule=Schedule.constant(1)).param_sha256


class _Grant:
    """One slot here and two on host-b; the target grows 1 → 3 at 10 and shrinks to 2 at 20."""

    def __init__(self, host: str = "localhost") -> None:
        self.host = host  # the leader's, where rank 0 runs

    def target(self, i: int) -> Allocation:
        return Allocation.split(1 if i < 10 else 3 if i < 20 else 2, self.host, (4,), (("host-b", (0, 1)),))


def test_place_puts_rank_0_here_then_fills_the_other_hosts_in_order():
    assert place(1, (4,), (("b", (0, 1)),)) == (1, ())
    here, parts = place(4, (4, 5), (("b", (0,)), ("c", (2, 3))))
    assert here == 2
    assert parts == (RemotePart("b", 2, 1, (0,)), RemotePart("c", 3, 1, (2,)))
    assert place(3, (4,), ()) == (3, ())  # no other hosts: all here, as before
    assert place(5, (4,), (("b", (0,)),)) == (4, (RemotePart("b", 1, 1, (0,)),))  # slots ran out
    assert place(2, (), (("b", (0, 1)),)) == (1, (RemotePart("b", 1, 1, (0,)),))  # rank 0 stays here
    assert place(0, (), (("b", (0,)),)) == (0, ())
    assert used(3, ((4,), (("b", (0, 1)),)), "a") == {("a", 4), ("b", 0), ("b", 1)}


def test_worker_env_of_a_follower_host_carries_global_ranks():
    req = LaunchRequest(workers=2, script=None, master_addr="10.0.0.1", master_port=29500, segment=3,
                        log_dir=None, env={}, rank_offset=2, world_size=5, group_rank=1)
    env = worker_env(req, 1)
    ranks = (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"])
    assert ranks == ("3", "5", "1", "2")
    assert (env["GROUP_RANK"], env["LEARNER_ID"], env["NUM_LEARNERS"]) == ("1", "4", "5")
    assert env["MASTER_ADDR"] == "10.0.0.1"


def test_the_local_launcher_refuses_ranks_on_other_hosts(tmp_path):
    req = LaunchRequest(workers=1, script=None, master_addr="127.0.0.1", master_port=1, segment=0,
                        log_dir=tmp_path, env={}, world_size=2, remote=(RemotePart("b", 1, 1, (0,)),))
    with pytest.raises(SpecError, match="this host only"):
        LocalLauncher().start(req)


def test_a_grant_across_hosts_trains_one_group_bitwise_equal_to_one_worker(tmp_path, reference):
    grant, launcher, started = _Grant(), LoopbackSpanLauncher(), []
    result = run_chunk(
        make_spec(tmp_path), 0, 30, target=grant.target, span_hosts=True, launcher=launcher,
        on_segment=lambda i, a: started.append((i, a.workers, a.on("localhost"), a.elsewhere("localhost"))),
    )
    assert result.status is ChunkStatus.COMPLETED and result.iteration == 30
    assert started == [(0, 1, (4,), ()), (10, 3, (4,), (("host-b", (0, 1)),)),
                       (20, 2, (4,), (("host-b", (0,)),))]
    assert launcher.hosts_started == [("host-b", 1, 2), ("host-b", 1, 1)]
    assert result.param_sha256 == reference


def test_every_sample_is_used_once_per_epoch_across_hosts(tmp_path):
    record = tmp_path / "ids"
    record.mkdir()
    spec = make_spec(tmp_path, params={"record_dir": str(record)})
    grant = _Grant()
    run_chunk(spec, 0, 30, target=grant.target, span_hosts=True, launcher=LoopbackSpanLauncher())
    seen = [int(i) for f in record.iterdir() for line in f.read_text().split("\n") if line
            for i in line.split()]
    assert sorted(seen) == sorted(stream_slice(spec.data_seed, 96, 0, 30 * 12).tolist())
    assert {f.name.split("-")[0] for f in record.iterdir()} == {"rank0", "rank1", "rank2"}


def test_a_rank_killed_on_another_host_names_that_host_and_the_rerun_matches(tmp_path, reference):
    params = {"kill_at": 15, "kill_rank": 2, "marker": str(tmp_path / "killed-once")}
    spec = make_spec(tmp_path, params=params)
    grant = _Grant("host-a")
    with pytest.raises(WorkerLostError) as err:
        run_chunk(spec, 0, 30, target=grant.target, span_hosts=True, launcher=LoopbackSpanLauncher(),
                  host="host-a")
    assert err.value.retryable and err.value.host == "host-b"
    assert "rank 2 killed by SIGKILL" in str(err.value)
    assert open_store(spec.checkpoint).latest().iteration == 10
    result = run_chunk(spec, 0, 30, target=grant.target, span_hosts=True, launcher=LoopbackSpanLauncher(),
                       host="host-a")
    assert result.workers_timeline[0][0] == 10
    assert result.param_sha256 == reference


def test_a_user_error_on_another_host_is_reported_with_its_traceback(tmp_path):
    spec = make_spec(tmp_path, params={"fail_at": 12})
    grant = _Grant()
    with pytest.raises(UserCodeError) as err:
        run_chunk(spec, 0, 30, target=grant.target, span_hosts=True, launcher=LoopbackSpanLauncher())
    assert "tiny model refuses this batch" in str(err.value) and "Traceback" in str(err.value)


class _Ranks:
    def __init__(self, host, ends):
        self.host, self.ends, self.closed = host, list(ends), False

    def poll(self):
        return self.ends.pop(0) if self.ends else None

    def close(self):
        self.closed = True


class _Local:
    def __init__(self, results):
        self.results, self.closed = list(results), False

    def wait(self, timeout=-1, period=1):
        return self.results.pop(0) if self.results else None

    def close(self):
        self.closed = True

    def pids(self):
        return {}


def test_the_spanning_context_waits_for_every_host_then_names_the_killed_rank():
    t = [0.0]
    ok = type("R", (), {"failures": {}})()
    killed = RemoteExit(host="b", killed={2: "SIGKILL"})
    remote = _Ranks("b", [None, killed])
    ctx = SpanningContext(_Local([None, None, None]), [remote], grace_s=5, clock=lambda: t[0])
    assert ctx._poll() is None  # all running
    assert ctx._poll() is None  # b reported a kill: wait (grace) for this host's ranks
    t[0] = 6.0
    result = ctx._poll()  # grace over: this host's ranks are stopped, the failure returned
    assert set(result.failures) == {2} and ctx.local.closed
    assert ctx.remote_killed() == {2: ("b", "SIGKILL")}
    done = SpanningContext(_Local([ok]), [_Ranks("b", [RemoteExit(host="b")])])
    assert done._poll() is ok  # everyone ended well
    lost = SpanningContext(_Local([None]), [_Ranks("b", [RemoteExit(host="b", lost=True)])], grace_s=0)
    assert lost._poll().failures and lost.lost_host() == "b"
    assert RemoteExit.from_wire("b", killed.to_wire()) == killed
    stopped = RemoteExit(host="b", failed=(1,), stopping=True)
    assert RemoteExit.from_wire("b", stopped.to_wire()) == stopped and not stopped.ok
    ctx = SpanningContext(_Local([None]), [_Ranks("b", [stopped])], grace_s=0)
    assert ctx._poll().failures and ctx.stopped_host() == "b" and ctx.lost_host() is None


def test_a_ddp_script_spans_hosts_and_trains_the_same_as_on_one_host(tmp_path):
    """Script mode: the script's own DDP runs over the spanning group (fast consistency: equal
    within floating-point tolerance to the same schedule on one host)."""
    from tests.runtime.test_script_mode import script_spec

    grant = _Grant()
    spanned = script_spec(tmp_path / "span")
    run_chunk(spanned, 0, 24, target=grant.target, span_hosts=True, launcher=LoopbackSpanLauncher())
    alone = script_spec(tmp_path / "alone")
    run_chunk(alone, 0, 24, target=lambda i: grant.target(i).workers)
    got, want = (open_store(s.checkpoint).load(open_store(s.checkpoint).latest()) for s in (spanned, alone))
    assert got["iteration"] == 24
    for k in want["model"]:
        torch.testing.assert_close(got["model"][k], want["model"][k], rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs (one per rank: NCCL refuses two ranks on one GPU)")
def test_a_segment_spanning_hosts_over_nccl_is_bitwise_equal_to_one_worker(tmp_path):
    """GPU slot 0 "here" and slot 1 on host-b (this machine's GPU 1): the target's broadcast and
    the starting state travel over NCCL on the device; the model ends on one CUDA worker's bits."""
    cuda_ref = run_job(make_spec(tmp_path / "one", device="cuda"), schedule=Schedule.constant(1)).param_sha256
    spec = make_spec(tmp_path / "span", device="cuda")
    result = run_chunk(spec, 0, 30, target=lambda i: Allocation.split(1 if i < 10 else 2, "localhost", (0,),
                                                                      (("host-b", (1,)),)),
                       span_hosts=True, launcher=LoopbackSpanLauncher())
    assert [n for _, n, _ in result.workers_timeline] == [1, 2]
    assert result.param_sha256 == cuda_ref


def test_a_follower_host_without_a_gpu_for_its_granted_slot_is_the_one_named(tmp_path, monkeypatch):
    """The follower's launcher finds no GPU for its slot: that host is the one the task reports
    (and the retry avoids), not the leader's, which would otherwise be blamed for it."""
    from elastic_ops.runtime import launcher

    monkeypatch.setattr(launcher, "visible_gpus", lambda: ["0", "1"])  # slot 5 has no GPU
    spec = make_spec(tmp_path, device="cuda", max_workers=2, virtual_shards=2)
    with pytest.raises(WorkerLostError) as err:
        run_chunk(spec, 0, 10, target=lambda i: Allocation.split(2, "host-a", (0,), (("host-b", (5,)),)),
                  span_hosts=True, launcher=LoopbackSpanLauncher(), host="host-a")
    assert err.value.retryable and err.value.host == "host-b"
    assert str(err.value).startswith("host-b: no GPU for granted slot(s) [5] on this host")


def test_a_follower_here_names_its_host_on_its_ranks_reports(tmp_path):
    """As a node agent's reports do (RemoteExit.from_wire): a follower rank's GPU or disk fault is
    held against its own host, not the leader's (the runner's fallback when a report names none)."""
    import json

    from elastic_ops.runtime.span import FollowerRanks

    class _Pc:
        def wait(self, timeout=-1):
            return type("R", (), {"failures": {0: object()}})()

        def failure_report(self):
            return FailureReport()

    launcher = type("L", (), {"start": lambda self, req: _Pc()})()
    req = LaunchRequest(workers=1, script=None, master_addr="127.0.0.1", master_port=1, segment=0,
                        log_dir=tmp_path, env={"ELASTIC_OPS_SEGMENT": str(tmp_path / "b" / "segment.json")},
                        rank_offset=1, world_size=2)
    ranks = FollowerRanks(launcher, req, {"dir": str(tmp_path)}, "host-b")
    (tmp_path / "b" / "error-1.json").write_text(json.dumps(
        {"kind": "device", "rank": 1, "message": "DeviceUnusable: no GPU", "time": 1.0}))
    (report,) = ranks.poll().reports
    assert report["host"] == "host-b" and report["kind"] == "device"
