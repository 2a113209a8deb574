"""`elastic-ops run`: end to end in a real subprocess, and clear errors for bad flags."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastic_ops.cli import main
from elastic_ops.runtime.job import Schedule, run_job
from tests.runtime.builders import ENTRY, make_spec

REPO = Path(__file__).resolve().parents[2]


def write_spec(tmp_path: Path, **kw) -> Path:
    data = dict(
        name="tiny-cli",
        entrypoint=ENTRY,
        total_iterations=20,
        global_batch=12,
        max_workers=2,
        consistency="bitwise",
        virtual_shards=6,
        checkpoint_interval=10,
        data_seed=3,
    )
    data.update(kw)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
def test_run_prints_progress_and_ends_with_one_json_line(tmp_path):
    spec = write_spec(tmp_path)
    uri = f"file://{tmp_path}/ckpt"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_ops.cli",
            "run",
            "--spec",
            str(spec),
            "--workers-schedule",
            "1,2",
            "--checkpoint",
            uri,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["iterations"] == 20 and out["status"] == "completed"
    assert [w[:2] for w in out["workers_timeline"]] == [[0, 1], [10, 2]]
    assert out["checkpoint"].startswith(uri) and len(out["param_sha256"]) == 64
    assert out["loss"] > 0 and 0 <= out["metrics"]["accuracy"] <= 1 and out["samples_per_sec"] > 0
    assert "iteration 20/20" in proc.stderr and "ETA" in proc.stderr
    # the same job in Python gives the same parameters (bitwise, any schedule)
    same = run_job(
        make_spec(tmp_path / "py", name="tiny-cli", total_iterations=20, max_workers=2, data_seed=3),
        schedule=Schedule.constant(1),
    )
    assert same.param_sha256 == out["param_sha256"]


def test_the_json_line_is_strict_json_when_a_metric_is_not_finite(tmp_path, capsys):
    """Python's json.dumps wrote NaN and Infinity, which strict parsers (jq, JSON.parse) refuse."""
    spec = write_spec(tmp_path, total_iterations=4, params={"nan_eval": True})
    assert main(["run", "--spec", str(spec), "--checkpoint", f"file://{tmp_path}/ck", "--quiet"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    out = json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in {line}"))
    assert out["metrics"]["perplexity"] is None and out["metrics"]["r2"] is None
    assert 0 <= out["metrics"]["accuracy"] <= 1


def test_run_with_stop_when_stops_where_airflow_would(tmp_path, capsys):
    """Chunk by chunk, up to the first chunk end whose metrics meet stop_when: the model of
    training that far, nothing after."""
    common = {"chunk_iterations": 5, "checkpoint_interval": 5}
    reach = write_spec(tmp_path / "a", **common, stop_when={"metric": "accuracy", "at_least": 0.0})
    assert main(["run", "--spec", str(reach), "--checkpoint", f"file://{tmp_path}/a/ck", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["iteration"], out["iterations"], out["stopped_early"]) == (5, 5, True)
    spec = make_spec(tmp_path / "py", name="tiny-cli", total_iterations=20, max_workers=2, data_seed=3,
                     **common)
    first = run_job(spec, end=5)
    assert first.param_sha256 == out["param_sha256"]

    never = write_spec(tmp_path / "b", **common, stop_when={"metric": "accuracy", "at_least": 2.0})
    assert main(["run", "--spec", str(never), "--checkpoint", f"file://{tmp_path}/b/ck", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["iteration"], out["stopped_early"]) == (20, False)
    assert [w[0] for w in out["workers_timeline"]] == [0, 5, 10, 15]  # one run per chunk


def test_a_stop_when_metric_no_chunk_reports_is_warned_about_once(tmp_path, caplog):
    """A misspelt metric (``acc`` for ``accuracy``) never stops the job: the user is told so at
    the first chunk end, with the names that chunk reported."""
    spec = make_spec(tmp_path, total_iterations=20, chunk_iterations=5,
                     stop_when={"metric": "acc", "at_least": 0.0})
    with caplog.at_level("WARNING", logger="elastic_ops.runtime.job"):
        result = run_job(spec)
    assert result.iteration == 20
    (warning,) = [r.getMessage() for r in caplog.records if "stop_when" in r.getMessage()]
    assert "stop_when.metric 'acc' is not among this chunk end's metrics (accuracy, loss)" in warning


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--workers-schedule", "1,x", "not an integer"),
        # int() takes these; what a typo or a pasted full-width digit makes is not a count
        ("--workers-schedule", "1@1_0", "'1_0' is not an integer"),
        ("--workers-schedule", "+1", "'+1' is not an integer"),
        ("--workers-schedule", "\uff11", "is not an integer"),
        ("--iterations", "1_0:15", "START:END"),
        ("--workers-schedule", "1,5", "max_workers"),
        ("--workers-schedule", "1@0,2", "one form"),
        ("--workers-schedule", "2@10,1@5", "ascending"),
        ("--workers-schedule", "1@,2@", "needs the iteration it starts at"),
        ("--workers-schedule", "1@0,2@100000", "outside the run's iterations"),
        ("--workers-schedule", "2@5,1@10", "first part must start at the run's first iteration, like '2@0'"),
        ("--workers-schedule", "1,-1", "worker count -1 must be between min_workers (1)"),
        ("--workers-schedule", "", "comma-separated list"),
        ("--workers-schedule", ",".join(["1"] * 21), "at most one part per iteration"),  # 20 iterations
        ("--iterations", "15:5", "START:END"),
        ("--iterations", "0:99", "START:END"),
        # int() raised ValueError past 4,300 digits: a traceback, not an error line
        ("--iterations", "9" * 5000 + ":", "START:END"),
        ("--workers-schedule", "9" * 5000, "has too many digits"),
        ("--workers-schedule", "1@0,1@" + "9" * 5000, "has too many digits"),
        ("--checkpoint", "ftp://host/x", "file:///absolute/path"),
        ("--checkpoint", "file://tmp/x", "note the three slashes in file:///"),  # the spec's hint too
    ],
)
def test_bad_flag_values_name_the_flag(tmp_path, capsys, flag, value, needle):
    rc = main(["run", "--spec", str(write_spec(tmp_path)), flag, value, "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and f"invalid {flag}=" in err and needle in err


def test_equal_parts_schedule_splits_the_run_range():
    spec = make_spec(Path("/tmp"), total_iterations=90)
    s = Schedule.parse("1,3,2", spec, 0, 90)
    assert [s(i) for i in (0, 29, 30, 59, 60, 89)] == [1, 1, 3, 3, 2, 2]
    s = Schedule.parse("1,3", spec, 40, 90)
    assert [s(i) for i in (40, 64, 65, 89)] == [1, 1, 3, 3]


def test_stop_when_reads_only_chunk_ends_after_a_preemption_inside_a_later_chunk(tmp_path, monkeypatch):
    """A piece already done reports the latest checkpoint: here a preemption's, inside the next
    chunk, whose loss met stop_when. The job stopped there (a model Airflow never gives); it runs
    on to the first chunk end that meets it (a probe)."""
    from elastic_ops.runtime import job as job_module
    from elastic_ops.runtime.outcome import ChunkResult, ChunkStatus

    spec = make_spec(tmp_path, total_iterations=30, chunk_iterations=10,
                     stop_when={"metric": "loss", "at_most": 0.2})
    latest = {"iteration": 15, "loss": 0.1}  # committed by a preempted earlier run
    ends = {20: 0.5, 30: 0.05}
    calls = []

    def fake_chunk(spec, a, b, **_):
        calls.append((a, b))
        done = latest["iteration"] >= b
        it, loss = (latest["iteration"], latest["loss"]) if done else (b, ends[b])
        return ChunkResult(ChunkStatus.ALREADY_DONE if done else ChunkStatus.COMPLETED, a, b, it, None,
                           loss, {}, [], 0.0, 0.0, "x")

    monkeypatch.setattr(job_module, "run_chunk", fake_chunk)
    result = run_job(spec)
    assert calls == [(0, 10), (10, 20), (20, 30)] and result.iteration == 30
    latest["loss"] = 0.5  # and a chunk end that meets it still stops the job there
    ends[20] = 0.15
    calls.clear()
    assert run_job(spec).iteration == 20 and calls == [(0, 10), (10, 20)]


@pytest.mark.parametrize("var", ["ELASTIC_OPS_PG_TIMEOUT_S", "ELASTIC_OPS_STALL_S"])
@pytest.mark.parametrize("value", ["1.5", "0", "-3", "\u0664", "ten"])
def test_a_bad_timeout_is_refused_before_any_worker(tmp_path, capsys, monkeypatch, value, var):
    """Read with a bare int() in every worker: 1.5 was a ValueError traceback per worker (a probe)."""
    monkeypatch.setenv(var, value)
    rc = main(["run", "--spec", str(write_spec(tmp_path)), "--workers-schedule", "2", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and f"invalid {var}=" in err and "whole seconds" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_sigterm_stops_the_run_cleanly(tmp_path):
    """SIGTERM killed the command at once: no cleanup, its work directory left behind (staged
    states, for the next chunk on the host to sweep), a commit under way cut off."""
    import signal
    import tempfile
    import time

    spec = write_spec(tmp_path, total_iterations=200, params={"sleep_s": 0.02})
    proc = subprocess.Popen(
        [sys.executable, "-m", "elastic_ops.cli", "run", "--spec", str(spec), "--checkpoint",
         f"file://{tmp_path}/ckpt"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        for line in proc.stderr:  # the first progress line: the workers train
            if "/200 loss" in line:
                break
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    mine = []
    for d in Path(tempfile.gettempdir()).glob("elastic-ops-*"):
        owner = d / "owner.pid"
        if owner.exists() and owner.read_text().split(" ")[0] == str(proc.pid):
            mine.append(d)
    assert mine == []
    assert code == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10  # its workers exit with it (they watch the launcher)
    while time.monotonic() < deadline and _workers_of(proc.pid):
        time.sleep(0.1)
    assert _workers_of(proc.pid) == []


def _workers_of(pid: int) -> list[int]:
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("ELASTIC_OPS_LAUNCHER_PID") == str(pid):
                found.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return found


def test_a_sigterm_during_a_launch_exits_143_whatever_the_launch_made_of_it(tmp_path, monkeypatch):
    """SIGTERM while a segment launched exited 1 (5 of 14 runs): torch's own handler raised its
    SignalException, or the fork server's FileNotFoundError surfaced (a chaos campaign)."""
    import os
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    spec = write_spec(tmp_path, total_iterations=20)
    argv = ["run", "--spec", str(spec), "--checkpoint", f"file://{tmp_path}/ckpt", "--quiet"]

    def torch_caught_it(*a, **k):  # torch's handler: its exception, wrapped by the launch
        try:
            raise SignalException("Process got signal: 15", sigval=signal.SIGTERM)
        except SignalException as exc:
            raise RuntimeError("launch failed") from exc

    def fork_server_lost(*a, **k):  # our handler ran, then a fork server's error came out instead
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except SystemExit:
            raise FileNotFoundError("/tmp/pymp-xyz/listener") from None

    for fake in (torch_caught_it, fork_server_lost):
        monkeypatch.setattr("elastic_ops.runtime.job.run_job", fake)  # what the command imports
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 128 + signal.SIGTERM, fake.__name__

    def plain_bug(*a, **k):  # an error of its own is not a SIGTERM
        raise RuntimeError("a bug")

    monkeypatch.setattr("elastic_ops.runtime.job.run_job", plain_bug)
    with pytest.raises(RuntimeError, match="a bug"):
        main(argv)


def test_the_rendezvous_socket_is_closed_once_when_a_signal_cuts_the_store_start(monkeypatch):
    """``loopback_store``'s cleanup closed a descriptor the store had already taken and closed:
    its EBADF replaced the SIGTERM's SystemExit(143)."""
    import os

    from elastic_ops.runtime import launcher

    def store_took_it(*a, master_listen_fd, **k):
        os.close(master_listen_fd)
        raise SystemExit(143)

    monkeypatch.setattr(launcher.dist, "TCPStore", store_took_it)
    with pytest.raises(SystemExit) as info:
        launcher.loopback_store()
    assert info.value.code == 143


# Runs `elastic-ops run` with a SIGTERM sent to itself at one point of a segment's launch.
_SIGTERM_AT = """
import os, signal, sys, threading, time
import multiprocessing.context as mpc
import elastic_ops.runtime.chunk as chunk

point = sys.argv.pop(1)
started, stores = [], []
store_start, process_start = chunk.loopback_store, mpc.ForkServerProcess.start
thread_start = threading.Thread.start


def keep(*args):  # the segment's store, to see the rendezvous begin
    stores.append(store_start(*args))
    return stores[-1]


def term_in_rendezvous():  # once a worker has set its address in the segment's store
    deadline = time.monotonic() + 60
    while not stores[-1].list_keys() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)


def process(self):  # between-workers: the first one is in its rendezvous, the second not started
    process_start(self)
    started.append(self)
    if len(started) == 1:
        term_in_rendezvous()


def thread(self):  # controller: the launch returned, the runner's controller thread starting
    if self.name == "elastic-ops-control":
        term_in_rendezvous()
    thread_start(self)


chunk.loopback_store = keep
if point == "between-workers":
    mpc.ForkServerProcess.start = process
else:
    threading.Thread.start = thread
from elastic_ops.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("point", ["between-workers", "controller"])
def test_a_sigterm_mid_launch_exits_143_and_leaves_no_worker(tmp_path, point):
    """A SIGTERM between two workers' starts (torch's start loop raised, so the first worker was
    on no PContext) left that worker running, non-daemonic, in its rendezvous for the rank that
    never came (ELASTIC_OPS_PG_TIMEOUT_S, 600 s); multiprocessing's exit handler joins such
    children, so the command hung instead of exiting 143 (a chaos campaign: > 120 s, once; a
    worker not yet past its own start died instead, on the semaphores its lost PContext had
    unlinked: the fork server's FileNotFoundError). Same for a SIGTERM as the controller thread
    started, after the launch returned. The wrapper waits for a worker's first key in the store,
    so the worker is surely past its start."""
    import os
    import signal

    spec = write_spec(tmp_path, total_iterations=200)
    proc = subprocess.Popen(
        [sys.executable, "-c", _SIGTERM_AT, point, "run", "--spec", str(spec), "--checkpoint",
         f"file://{tmp_path}/ckpt", "--quiet"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=90)  # generous: a fork server's start, not the 600 s
        assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
        assert _workers_of(proc.pid) == []  # stopped before the command exited, not after
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever a failure left behind
        proc.wait()
