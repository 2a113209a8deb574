"""Pure pieces of the runtime: entrypoints, LR scaling, the control channel, the state hash."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from elastic_ops.errors import EntrypointError, SpecError, WorkerLostError
from elastic_ops.runtime import launcher, load_trainable_class, param_sha256
from elastic_ops.runtime.consistency import lr_factor, target_factor
from elastic_ops.runtime.control import ControlChannel
from elastic_ops.runtime.launcher import (
    LaunchRequest,
    loopback_store,
    parse_visible_devices,
    slot_gpus,
    visible_gpus,
    worker_env,
)
from elastic_ops.runtime.placement import SlotsByBoundary
from elastic_ops.runtime.state import load_state, save_atomic
from tests.runtime.builders import TinyMLP


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ("no_such_pkg.mod:Model", "cannot be imported"),
        ("tests.runtime.builders:Missing", "has no attribute 'Missing'"),
        ("tests.runtime.builders:make_spec", "subclass of elastic_ops.runtime.Trainable"),
        ("not-an-entrypoint", "package.module:TrainableClass"),
        ("elastic_ops.runtime:Trainable", "must implement build_model(), build_optimizer(), train_dataset()"),
    ],
)
def test_bad_entrypoints_raise_entrypoint_errors_naming_the_field(entry, needle):
    with pytest.raises(EntrypointError) as err:
        load_trainable_class(entry)
    assert err.value.field == "entrypoint" and needle in str(err.value)


def test_a_trainable_entrypoint_loads():
    assert load_trainable_class("tests.runtime.builders:TinyMLP") is TinyMLP


def test_a_long_lived_process_finds_the_trainables_module_without_running_its_code(tmp_path, monkeypatch):
    # the agent checks an entrypoint this way: importing it there ran the user's import-time
    # code in the agent, and kept that module (stale after an edit) for every later chunk
    import sys

    from elastic_ops.runtime.trainable import find_trainable_module

    pkg = tmp_path / "userpkg_fresh"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"open({str(tmp_path / 'pkg-ran')!r}, 'w').close()\n")
    (pkg / "model.py").write_text(f"open({str(tmp_path / 'module-ran')!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    find_trainable_module("userpkg_fresh.model:Anything")
    assert not (tmp_path / "pkg-ran").exists() and not (tmp_path / "module-ran").exists()
    assert "userpkg_fresh" not in sys.modules and "userpkg_fresh.model" not in sys.modules
    find_trainable_module("tests.runtime.builders:TinyMLP")  # already imported: found
    for entry, needle in [("userpkg_fresh.nope:X", "'userpkg_fresh.nope' is not importable"),
                          ("userpkg_fresh.model.deeper:X", "'userpkg_fresh.model' is not a package"),
                          ("no_such_pkg_here:X", "cannot be found"), ("no-colon", "package.module:")]:
        with pytest.raises(EntrypointError, match=needle):
            find_trainable_module(entry)


@given(workers=st.integers(1, 64), lo=st.integers(1, 8))
def test_scaling_factors_follow_linear_and_sqrt_rules(workers, lo):
    assert target_factor("linear_lr", workers, lo) == pytest.approx(workers / lo)
    assert target_factor("sqrt_lr", workers, lo) == pytest.approx(math.sqrt(workers / lo))
    assert target_factor("fixed", workers, lo) == 1.0


@given(
    f0=st.floats(0.1, 8),
    f1=st.floats(0.1, 8),
    start=st.integers(0, 100),
    warmup=st.integers(0, 50),
    it=st.integers(0, 300),
)
def test_lr_ramp_is_monotone_between_its_ends(f0, f1, start, warmup, it):
    ramp = {"from": f0, "to": f1, "start": start}
    f = lr_factor(ramp, it, warmup)
    assert min(f0, f1) - 1e-12 <= f <= max(f0, f1) + 1e-12
    if it >= start + warmup:
        assert f == f1
    if warmup and it <= start:
        assert f == pytest.approx(f0)


def test_control_channel_targets_are_seen_by_readers(tmp_path):
    parent = ControlChannel(tmp_path, 5, create=True)
    worker = ControlChannel(tmp_path, 5, create=False)
    assert not parent.decided(1) and parent.decided(4)  # the last boundary is the end: no decision
    parent.decide(1, 3)
    assert worker.target(1) == 3
    worker.publish(2, 0.5, 24)
    assert parent.reached() == 2 and parent.row(2)[0] == 0.5 and parent.row(2)[2] == 24


def test_the_rendezvous_store_listens_on_loopback_only():
    """Workers join it over loopback; nothing off this host may reach a segment's keys."""
    psutil = pytest.importorskip("psutil")
    store = loopback_store()
    client = torch.distributed.TCPStore("127.0.0.1", store.port, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"
    listening = {
        c.laddr.ip
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port
    }
    assert listening == {"127.0.0.1"}


def test_worker_environment_has_pytorch_and_wml_names(tmp_path):
    req = LaunchRequest(
        workers=3, script=None, master_addr="127.0.0.1", master_port=1234, segment=2, log_dir=tmp_path, env={}
    )
    env = worker_env(req, 2)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("2", "3", "2")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "1234")
    assert (env["LEARNER_ID"], env["NUM_LEARNERS"]) == ("3", "3")  # WML is 1-based
    cuda = worker_env(LaunchRequest(**{**req.__dict__, "device": "cuda"}), 1, ["4", "6"])
    assert cuda["CUDA_VISIBLE_DEVICES"] == "6"
    threads = worker_env(LaunchRequest(**{**req.__dict__, "threads_per_worker": 3}), 0)
    assert threads["OMP_NUM_THREADS"] == "3"  # threads_per_worker: the workers' CPU threads


def _request(tmp_path, workers: int, slots, device: str = "cuda") -> LaunchRequest:
    return LaunchRequest(
        workers=workers,
        script=None,
        master_addr="127.0.0.1",
        master_port=1234,
        segment=0,
        log_dir=tmp_path,
        env={},
        device=device,
        slots=slots,
    )


GPUS = [str(g) for g in range(8)]  # an 8-GPU host, all visible


def test_cuda_workers_run_on_the_granted_slots_not_on_the_first_gpus(tmp_path):
    # Two jobs share an 8-GPU host 4/4: the second holds slots 4..7 and must not use GPUs 0..3.
    req = _request(tmp_path, 4, (4, 5, 6, 7))
    assert [worker_env(req, r, GPUS)["CUDA_VISIBLE_DEVICES"] for r in range(4)] == ["4", "5", "6", "7"]
    # slot i is the i-th *visible* GPU (this process may see a subset of the host's devices)
    req = _request(tmp_path, 2, (2, 0))
    assert [worker_env(req, r, ["1", "3", "5"])["CUDA_VISIBLE_DEVICES"] for r in range(2)] == ["5", "1"]
    assert slot_gpus((6, 7, 1), 2, GPUS) == ["6", "7"]  # slots past the worker count are not used
    # without granted slots (the CLI) ranks take the visible GPUs in order, as before
    assert worker_env(_request(tmp_path, 2, None), 1, GPUS)["CUDA_VISIBLE_DEVICES"] == "1"
    # on CPU the slots change nothing
    assert "CUDA_VISIBLE_DEVICES" not in worker_env(_request(tmp_path, 2, (4, 5), "cpu"), 1, GPUS)


def test_a_slot_beyond_the_visible_gpus_is_a_retryable_host_fault_saying_what_to_fix(tmp_path, monkeypatch):
    # The pool lists more slots for the host than CUDA can use there (a GPU fell off the bus, the
    # host was registered with too many, it has none): not the job's spec, and another host may
    # have the GPUs. It was a SpecError: the job ended for good and the host was never reported.
    with pytest.raises(WorkerLostError) as err:
        worker_env(_request(tmp_path, 2, (3, 4)), 0, ["0", "1", "2", "3"])
    assert err.value.retryable
    assert ("no GPU for granted slot(s) [4] on this host: it has 4 GPU(s) CUDA can use, "
            "['0', '1', '2', '3'] (slots 0..3)") in str(err.value)
    assert "elastic-ops pool add-host HOST N" in err.value.hint and "avoids this host" in err.value.hint
    monkeypatch.setattr(launcher, "nvidia_driver_loaded", lambda: True)
    with pytest.raises(WorkerLostError, match=r"slot\(s\) \[0\] on this host: it has no GPU CUDA can use"):
        slot_gpus((0,), 1, [])  # a GPU host that lost them all (the driver runs, CUDA sees none)
    with pytest.raises(SpecError, match=r"one granted GPU slot on this host per worker \(3 workers\)"):
        slot_gpus((4, 5), 3, GPUS)
    with pytest.raises(SpecError, match="distinct slots"):
        slot_gpus((4, 4), 2, GPUS)
    with pytest.raises(SpecError, match="an integer >= 0"):
        slot_gpus((-1,), 1, GPUS)


@pytest.mark.parametrize(
    ("listed", "count", "want"),
    [
        (None, 3, ["0", "1", "2"]),  # unset: every GPU CUDA sees
        ("", 8, []),  # set but empty: CUDA sees no GPU (it was read as "no restriction")
        ("-1", 8, []),  # the usual way to hide every GPU (it was one GPU named "-1")
        ("2,3", 2, ["2", "3"]),
        (" 1 , 3 ", 2, ["1", "3"]),
        ("4,5,6,7", 4, ["4", "5", "6", "7"]),  # this process sees a subset: ids stay the host's
        ("0,-1,1", 1, ["0"]),  # CUDA stops reading at the first entry that is not a device
        ("0,1,x,2", 2, ["0", "1"]),
        ("0,0", 0, []),  # a device listed twice: CUDA makes none visible
        ("0,1,2,3", 2, ["0", "1"]),  # ordinals past the host's GPUs: CUDA sees the first two
        ("GPU-a1b2,GPU-c3d4", 2, ["GPU-a1b2", "GPU-c3d4"]),
        ("GPU-a1b2,0", 1, ["GPU-a1b2"]),
        ("MIG-a,MIG-b,MIG-c", 1, ["MIG-a", "MIG-b", "MIG-c"]),  # CUDA enumerates one MIG device per process
        ("MIG-a", 0, []),  # ...but none at all: no GPU here
        ("0", 0, []),  # a CPU build of torch (or no driver): nothing to hand out
    ],
)
def test_visible_gpus_reads_cuda_visible_devices_as_cuda_does(monkeypatch, listed, count, want):
    if listed is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert visible_gpus() == want


@pytest.mark.parametrize(
    "listed", ["", "-1", "0,1", " 1 , 3 ", "0,-1,1", "0,1,x,2", "0,0", "1gpu2,3", "+2", "GPU-a,GPU-b",
               "GPU-a,0", "GPU-a,GPU-a", "MIG-a,MIG-b", "MIG-a,GPU-b", "x"],
)
def test_the_parser_agrees_with_torch_cuda_own(monkeypatch, listed):
    parse = getattr(torch.cuda, "_parse_visible_devices", None)
    if parse is None:
        pytest.skip("this torch has no torch.cuda._parse_visible_devices")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    assert parse_visible_devices(listed) == [str(d) for d in parse()]


def test_each_boundary_keeps_the_slots_that_came_with_its_target():
    slots = SlotsByBoundary()
    assert slots.at(0) is None
    slots.note(0, (4, 5))
    slots.note(1, (4, 5))  # unchanged: not stored again
    slots.note(2, (4, 5, 6))  # a grow decided for boundary 2 ...
    slots.note(3, (5,))  # ... and a shrink for 3 (decided before rank 0 reached 2)
    assert slots.at(0) == (4, 5) and slots.at(1) == (4, 5)
    assert slots.at(2) == (4, 5, 6)  # the segment at 2 gets its own target's slots, not the latest
    slots.note(3, (4, 5, 6))  # the segment at 2 decides 3 again: that supersedes the old note
    slots.note(4, (6,))
    assert slots.at(3) == (4, 5, 6) and slots.at(4) == (6,) and slots.at(9) == (6,)


def test_state_round_trips_safely_and_the_hash_sees_every_bit(tmp_path):
    model = torch.nn.Linear(3, 2)
    state = {"model": model.state_dict(), "iteration": 4}
    save_atomic(state, tmp_path / "s.pt")
    loaded = load_state(tmp_path / "s.pt")
    assert param_sha256(loaded["model"]) == param_sha256(model.state_dict())
    bumped = {k: v.clone() for k, v in loaded["model"].items()}
    bumped["bias"].view(torch.int32)[0] ^= 1  # flip the lowest mantissa bit
    assert param_sha256(bumped) != param_sha256(loaded["model"])


WATCHED_WORKER = """
import sys, time
from elastic_ops.runtime.worker import die_with_launcher
assert die_with_launcher() is not None
print("watching", flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "pidfd_open"), reason="needs Linux pidfds")
def test_a_worker_ends_at_once_when_the_process_that_launched_it_dies():
    import os
    import subprocess
    import sys

    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    env = dict(os.environ, ELASTIC_OPS_LAUNCHER_PID=str(launcher.pid))
    worker = subprocess.Popen(
        [sys.executable, "-c", WATCHED_WORKER], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert worker.stdout.readline().strip() == "watching"
        assert worker.poll() is None  # the launcher lives: the worker goes on
        launcher.kill()  # SIGKILL: no chance to clean up
        launcher.wait()
        assert worker.wait(timeout=30) == 1
    finally:
        for proc in (launcher, worker):
            proc.kill()
            proc.wait()
    # a launcher already gone when the worker starts: the worker does not start at all
    late = subprocess.run(
        [sys.executable, "-c", WATCHED_WORKER], env=env, capture_output=True, text=True, timeout=60
    )
    assert late.returncode == 1 and "watching" not in late.stdout


class _SlowStore:
    """A store whose first commit waits for ``release``: the states staged meanwhile queue up."""

    def __init__(self) -> None:
        import threading

        self.release, self.committed = threading.Event(), []

    def save_file(self, iteration, path, **kwargs):
        self.release.wait(30)
        self.committed.append(iteration)
        return type("Ref", (), {"uri": f"file:///ck/it-{iteration}"})()


def _staged(tmp_path, iteration: int) -> str:
    path = tmp_path / f"ckpt-{iteration}.pt"
    save_atomic({"model": TinyMLP().build_model().state_dict(), "iteration": iteration}, path)
    return str(path)


@pytest.mark.parametrize(("keep_every", "committed"), [(None, [10, 50]), (20, [10, 20, 40, 50])])
def test_a_slow_store_commits_the_newest_state_and_drops_the_overtaken(tmp_path, keep_every, committed):
    """Training that stages states faster than the store commits them must not pile them up
    (on disk, in the queue): an overtaken one is dropped, its file removed; the newest, the
    ones retention keeps for good (keep_every) and the chunk's end are committed."""
    from elastic_ops.runtime.commit import Committer

    store = _SlowStore()
    committer = Committer(store, epoch=1, spec_hash="h", keep_every=keep_every)
    paths = {i: _staged(tmp_path, i) for i in (10, 20, 30, 40)}
    for i in (10, 20, 30, 40):  # 10 is being committed (slowly) while 20..40 are staged
        committer.submit(i, paths[i], {"loss": 0.5}, remove=True)
    end = _staged(tmp_path, 50)
    committer.submit(50, end, {"loss": 0.4}, remove=False)  # the chunk's end: always committed
    store.release.set()
    committer.drain()
    committer.close()
    assert store.committed == committed
    assert sorted(committer.dropped) == sorted({20, 30, 40} - set(committed))
    assert [i for i, p in paths.items() if Path(p).exists()] == []  # staged files all gone
    assert Path(end).exists()  # the caller's own state file is left to it


def test_work_directories_of_processes_gone_are_swept_and_no_others(tmp_path):
    """A chunk killed outright (SIGKILL) leaves its work directory, staged checkpoints and all;
    the next chunk on the host removes it, and only it."""
    import socket
    import subprocess
    import sys

    from elastic_ops.runtime.workdir import OWNER_FILE, WORKDIR_PREFIX, sweep_stale_workdirs

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    host = socket.gethostname()
    owners = {"dead": f"{gone} {host}", "alive": f"{os.getppid()} {host}", "other-host": f"{gone} elsewhere",
              "no-owner": None, "garbled": "not a pid"}
    for name, owner in owners.items():
        d = tmp_path / f"{WORKDIR_PREFIX}{name}"
        (d / "seg-0").mkdir(parents=True)
        (d / "seg-0" / "ckpt-9.pt").write_bytes(b"x" * 100)
        if owner is not None:
            (d / OWNER_FILE).write_text(owner)
    (tmp_path / "unrelated").mkdir()
    removed = sweep_stale_workdirs(str(tmp_path))
    assert [d.name for d in removed] == [f"{WORKDIR_PREFIX}dead"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([f"{WORKDIR_PREFIX}{n}" for n in owners if n != "dead"] + ["unrelated"])


def test_a_cuda_job_granted_a_host_without_an_nvidia_driver_is_the_jobs_placement_to_fix(monkeypatch):
    """No retry on a CPU host can succeed, and a failure held against it would cool a healthy
    host for other jobs (a review): the job is told to select GPU hosts, not retried."""
    monkeypatch.setattr(launcher, "nvidia_driver_loaded", lambda: False)
    with pytest.raises(SpecError) as err:
        slot_gpus((0, 1), 2, [])
    assert err.value.field == "device" and not err.value.retryable
    assert "this one has no NVIDIA driver, so no GPU for granted slot(s) [0, 1]" in str(err.value)
    assert "host_selector" in err.value.hint and "device 'auto'" in err.value.hint
    monkeypatch.setattr(launcher, "nvidia_driver_loaded", lambda: True)
    with pytest.raises(WorkerLostError):  # the driver runs, the GPUs are gone: the host's fault
        slot_gpus((0, 1), 2, [])


def test_the_runner_decides_ahead_at_rank_0s_recent_rate_not_its_mean_since_the_start(tmp_path):
    """A slow first iteration (CUDA's warm-up) must not keep the lookahead short afterwards:
    rank 0 would wait for decisions at every few boundaries."""
    from elastic_ops.runtime.chunk import HORIZON_S, LOOKAHEAD, lookahead

    chan = ControlChannel(tmp_path, 40, create=True)
    times = [0.0, 1.0] + [1.0 + 0.003 * k for k in range(1, 38)]  # 1 s, then 3 ms per iteration
    for j, t in enumerate(times):
        chan.prog[j, :3] = (0.5, t, 12 * j)
    ahead, since = lookahead(chan, 5, (0, times[0]))
    assert ahead == LOOKAHEAD and since == (5, times[5])  # the warm-up is all it has seen yet
    ahead, since = lookahead(chan, 10, since)
    assert ahead == math.ceil(HORIZON_S / 0.003) and since == (10, times[10])  # 17, not 2
    assert lookahead(chan, 10, (10, times[10]))[0] >= LOOKAHEAD  # no division by zero

