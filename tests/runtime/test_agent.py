"""The per-host agent with real worker processes: same result as in-process, rescale through the
socket, typed errors, client disconnect (no orphans, last checkpoint intact), bad requests."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import psutil
import pytest

from elastic_ops.agent.client import AgentClient
from elastic_ops.agent.protocol import (
    MAX_MESSAGE_BYTES,
    StoreConfig,
    encode,
    error_from_wire,
    require_slots,
)
from elastic_ops.agent.protocol import PROTOCOL_VERSION as V  # the current wire version
from elastic_ops.agent.server import Agent
from elastic_ops.checkpoint import open_store
from elastic_ops.errors import (
    AgentLostError,
    AgentProtocolError,
    AgentUnavailableError,
    SpecError,
    UserCodeError,
    WorkerLostError,
)
from elastic_ops.runtime import ChunkStatus, run_chunk
from elastic_ops.runtime.allocation import Allocation
from tests.runtime.agent_helpers import as_applied, as_target, line, raw_exchange, running_agent
from tests.runtime.builders import RecordingLauncher, make_spec

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    with running_agent(tmp_path_factory.mktemp("agent")) as a:
        yield a


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """The tiny bitwise job trained in this process on one worker, uninterrupted."""
    spec = make_spec(tmp_path_factory.mktemp("ref"))
    return run_chunk(spec, 0, 30, target=lambda i: 1).param_sha256


def store_of(spec) -> StoreConfig:
    return StoreConfig(spec.checkpoint_uri(), keep_last=spec.keep_last, keep_every=spec.keep_every)


def run_on(agent, spec, start: int = 0, end: int = 30, *, host: str = "h1", wanted=lambda: 1, slots=None,
           on_applied=None, **kwargs):
    """The chunk ``[start, end)`` of ``spec`` through the agent's client (epoch 1): ``wanted()``
    workers on ``slots()`` of ``host``; ``on_applied(iteration, workers, slots)``."""
    return AgentClient(agent.path).run_chunk(
        spec.to_dict(), start, end, epoch=1, host=host, store=store_of(spec),
        target=as_target(host, wanted, slots), on_applied=as_applied(host, on_applied), **kwargs
    )


def test_a_chunk_on_the_agent_equals_the_same_chunk_in_process(agent, tmp_path, reference):
    spec = make_spec(tmp_path)
    progress = []
    result = run_on(agent, spec, on_progress=progress.append)
    assert result.status == ChunkStatus.COMPLETED and result.iteration == 30
    assert result.param_sha256 == reference
    assert progress[-1].iteration == 30 and progress[-1].eta_s == 0
    iteration, uri, metrics = AgentClient(agent.path).latest(store_of(spec), spec.spec_hash())
    assert (iteration, uri, metrics["param_sha256"]) == (30, result.checkpoint_uri, reference)
    assert metrics["loss"] == result.loss  # the chunk end's metrics travel too (stop_when reads them)
    assert open_store(spec.checkpoint).latest().metrics["param_sha256"] == reference
    # a question about a store that does not exist answers "none" and creates nothing there
    nowhere = StoreConfig(f"file://{tmp_path}/not/here")
    assert AgentClient(agent.path).latest(nowhere, spec.spec_hash()) is None
    assert not (tmp_path / "not").exists()


def bitwise_reference(tmp_path, iterations: int) -> str:
    """The long tiny job trained in this process on one worker for ``iterations``, uninterrupted."""
    spec = make_spec(tmp_path / "ref", total_iterations=100_000)
    return run_chunk(spec, 0, iterations, target=lambda i: 1).param_sha256


def test_a_target_change_reaches_the_workers_through_the_agent(agent, tmp_path):
    spec = make_spec(tmp_path, total_iterations=100_000)
    seen: list[int] = []
    applied: list[tuple[int, int, tuple[int, ...] | None]] = []

    def wanted() -> int:  # the pool grows the job once it has trained 8 iterations, then preempts it
        if any(n == 2 for _, n, _ in applied):
            return 0  # ends the chunk only once the grow was applied: nothing depends on timing
        return 2 if seen and seen[-1] >= 8 else 1

    result = run_on(
        agent,
        spec,
        0,
        100_000,
        wanted=wanted,
        on_progress=lambda p: seen.append(p.iteration),
        on_applied=lambda i, n, slots: applied.append((i, n, slots)),
    )
    assert result.status == ChunkStatus.PREEMPTED
    grown_at = next(i for i, n, _ in applied if n == 2)
    assert [n for _, n, _ in result.workers_timeline][:2] == [1, 2], result.workers_timeline
    # every segment start is announced (the first one too); no slots were granted here
    assert applied == [(0, 1, None), (grown_at, 2, None)] and grown_at > 8
    # bitwise: the rescale changes nothing
    assert result.param_sha256 == bitwise_reference(tmp_path, result.iteration)


def test_the_granted_slots_travel_with_each_target_to_the_launch(tmp_path):
    spec = make_spec(tmp_path, total_iterations=100_000)
    seen: list[int] = []
    launcher = RecordingLauncher()
    count = [1]
    granted = {1: [6], 2: [6, 3], 0: []}

    def wanted() -> int:  # slot 6; after 8 iterations a grow to slots 6 and 3; then a preemption
        if len(launcher.requests) == 2:
            count[0] = 0
        elif seen and seen[-1] >= 8:
            count[0] = 2
        return count[0]

    with running_agent(tmp_path / "agent", launcher=launcher, warm=False) as agent:
        result = run_on(
            agent,
            spec,
            0,
            100_000,
            wanted=wanted,
            slots=lambda: granted[count[0]],
            on_progress=lambda p: seen.append(p.iteration),
        )
        assert result.status == ChunkStatus.PREEMPTED
        assert [(r.workers, r.slots) for r in launcher.requests] == [(1, (6,)), (2, (6, 3))]
        del launcher.requests[:]
        run_on(agent, make_spec(tmp_path / "plain"), 0, 5)  # no slots: none in the request
        assert [r.slots for r in launcher.requests] == [None]


def test_a_same_count_move_relaunches_on_the_agent_and_is_announced_with_its_slots(tmp_path):
    spec = make_spec(tmp_path, total_iterations=100_000)
    seen: list[int] = []
    applied: list[tuple[int, int, tuple[int, ...] | None]] = []
    launcher = RecordingLauncher()

    def slots() -> list[int]:  # 2 workers throughout; after 8 iterations the pool moves them
        return [3, 2] if seen and seen[-1] >= 8 else [0, 1]

    def wanted() -> int:  # then preempts the job, once the move was applied
        return 0 if len(applied) == 2 else 2

    with running_agent(tmp_path / "agent", launcher=launcher, warm=False) as agent:
        result = run_on(
            agent,
            spec,
            0,
            100_000,
            wanted=wanted,
            slots=slots,
            on_progress=lambda p: seen.append(p.iteration),
            on_applied=lambda i, n, s: applied.append((i, n, s)),
        )
    assert result.status == ChunkStatus.PREEMPTED
    assert [(r.workers, r.slots) for r in launcher.requests] == [(2, (0, 1)), (2, (3, 2))]
    moved_at = applied[-1][0]
    assert applied == [(0, 2, (0, 1)), (moved_at, 2, (3, 2))] and moved_at > 8
    assert result.param_sha256 == bitwise_reference(tmp_path, result.iteration)


def test_a_malformed_applied_message_is_a_protocol_error():
    from elastic_ops.agent.protocol import applied_from_wire

    assert applied_from_wire({"iteration": 4, "workers": 2, "slots": [1, 0]}) == (4, 2, (1, 0), None)
    assert applied_from_wire({"iteration": 4, "workers": 2, "slots": None}) == (4, 2, None, None)
    spanning = {"iteration": 4, "workers": 3, "slots": [0], "spans": [["h2", [1, 0]]]}
    assert applied_from_wire(spanning) == (4, 3, (0,), (("h2", (1, 0)),))
    for bad in (
        {"iteration": 4, "workers": 0},
        {"workers": 2},
        {"iteration": 4, "workers": 2, "slots": [1, 1]},
        {**spanning, "spans": [["h2", [1, 1]]]},
        {**spanning, "spans": [["h2", [0]], ["h2", [1]]]},
        {**spanning, "spans": [["bad host!", [0]]]},
        {**spanning, "spans": "h2"},
    ):
        with pytest.raises(AgentProtocolError, match="malformed 'applied' message"):
            applied_from_wire(bad)


class _ClosedAfterResult:
    """The agent's side of a chunk that just ended: its result is in the task's receive buffer
    and it has closed its end, so a target the task sends now fails (EPIPE)."""

    def __init__(self, result: dict) -> None:
        self.messages = [None, {"type": "result", "result": result}]

    def send(self, msg: dict) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def read(self, timeout: float | None = None) -> dict | None:
        if not self.messages:
            raise EOFError("the agent closed the connection")
        return self.messages.pop(0)


def test_a_target_the_agent_can_no_longer_take_does_not_lose_its_result():
    """Seen under a real scheduler: the pool shrank a job just as its chunk ended; sending the
    target failed because the agent had closed after its result, and the task raised
    AgentLostError (a retry, slots released) for a chunk that had completed."""
    from elastic_ops.agent.client import drive_chunk
    from elastic_ops.runtime.outcome import ChunkResult, jsonable

    done = ChunkResult(status=ChunkStatus.COMPLETED, start=0, end=300, iteration=300, checkpoint_uri=None,
                       loss=0.1, metrics={}, workers_timeline=[(0, 4, 0.0)], samples_per_sec=1.0,
                       duration_s=1.0, param_sha256="ab" * 32)
    four, three = {"workers": 4, "slots": None}, {"workers": 3, "slots": None}
    targets = iter([four, three])  # the shrink arrives as the chunk ends
    result = drive_chunk(_ClosedAfterResult(jsonable(done.to_dict())), "h1", four, lambda: next(targets),
                         on_progress=None, on_applied=None, poll_s=0.01,
                         lost=lambda why: AgentLostError(why), error=lambda msg: RuntimeError(msg))
    assert result.status == ChunkStatus.COMPLETED and result.iteration == 300
    # and a channel that ends without a result is still a lost chunk, saying why
    ending = _ClosedAfterResult({})
    ending.messages = [None]
    targets = iter([three] * 3)
    with pytest.raises(AgentLostError, match="closed the connection; a target could not be sent"):
        drive_chunk(ending, "h1", four, lambda: next(targets), on_progress=None, on_applied=None,
                    poll_s=0.01, lost=lambda why: AgentLostError(why), error=lambda msg: RuntimeError(msg))


def test_slots_on_the_wire_are_validated(agent, tmp_path):
    spec = make_spec(tmp_path)
    for bad in ([1, 1], [-1], [10**18]):
        with pytest.raises(SpecError) as err:
            run_on(agent, spec, slots=lambda bad=bad: bad)
        assert err.value.field == "slots" and "distinct integers in [0, 1000000)" in str(err.value)
    assert require_slots(json.loads(encode({"slots": [4, 0]}))) == (4, 0)  # round trip
    assert require_slots({}) is None and require_slots({"slots": None}) is None
    for bad in (["0"], [True], [1.0], "0,1", {"0": 1}, list(range(4097))):
        with pytest.raises(SpecError, match="invalid slots="):
            require_slots({"slots": bad})
    # a target without the slots that the run request had is refused, naming the field
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(agent.path)
    run = {"op": "run", "version": V, "spec": spec.to_dict(), "start": 0, "end": 30, "epoch": 1}
    run |= {"host": "h1", "workers": 1, "slots": [0], "store": store_of(spec).to_wire()}
    sock.sendall(encode(run) + encode({"op": "target", "workers": 1}))
    from elastic_ops.agent.protocol import MessageReader

    reader = MessageReader(sock)
    msg = reader.read(timeout=120)
    while msg is not None and msg["type"] in ("progress", "applied"):
        msg = reader.read(timeout=120)
    sock.close()
    err = error_from_wire(msg)
    assert type(err) is SpecError and err.field == "slots", msg
    wait_for("the chunk to end", lambda: not agent.sessions)
    # a host name is logged: a newline in it would forge a log line; an epoch names files
    for field, value in (("host", "h1\n2026-11-30 INFO forged"), ("epoch", 10**30)):
        reply = raw_exchange(agent.path, line({**run, field: value}))
        assert reply["type"] == "error" and error_from_wire(reply).field == field, reply


def test_a_span_sent_to_the_per_host_agent_is_refused_before_anything_is_announced(agent, tmp_path):
    """The per-host agent cannot lead a segment across hosts: its first reply is the refusal, not
    an ``applied`` for workers that never start."""
    spec = make_spec(tmp_path)
    run = {"op": "run", "version": V, "spec": spec.to_dict(), "start": 0, "end": 30, "epoch": 1,
           "host": "h1", "workers": 2, "slots": [0], "spans": [["h2", [0]]],
           "store": store_of(spec).to_wire()}
    reply = raw_exchange(agent.path, line(run), timeout=120)
    assert reply["type"] == "error", reply
    err = error_from_wire(reply)
    assert type(err) is SpecError and err.field == "workers" and "advertise-addr" in str(err), reply
    wait_for("the chunk to end", lambda: not agent.sessions)


def test_a_killed_worker_is_a_retryable_worker_lost_error_naming_the_host(agent, tmp_path):
    params = {"kill_at": 17, "kill_rank": 1, "marker": str(tmp_path / "killed-once")}
    spec = make_spec(tmp_path, params=params)
    with pytest.raises(WorkerLostError) as err:
        run_on(agent, spec, host="host-a", wanted=lambda: 2)
    assert type(err.value) is WorkerLostError and err.value.retryable
    assert err.value.host == "host-a" and "SIGKILL" in str(err.value)
    assert open_store(spec.checkpoint).latest().iteration == 10


def test_a_user_error_comes_back_as_the_same_non_retryable_class(agent, tmp_path):
    spec = make_spec(tmp_path, params={"fail_at": 3})
    with pytest.raises(UserCodeError) as err:
        run_on(agent, spec, wanted=lambda: 2)
    assert not err.value.retryable and "tiny model refuses this batch" in str(err.value)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(what: str, check, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        time.sleep(0.05)


def test_a_task_that_disconnects_mid_chunk_leaves_no_workers_and_an_intact_checkpoint(agent, tmp_path):
    spec = make_spec(tmp_path, total_iterations=100_000, checkpoint_interval=10)
    request = {
        "op": "run",
        "version": V,
        "spec": spec.to_dict(),
        "start": 0,
        "end": 100_000,
        "epoch": 1,
        "host": "h1",
        "workers": 2,
        "store": store_of(spec).to_wire(),
        "warm_start": None,
    }
    from elastic_ops.agent.protocol import MessageReader

    # closed however this block ends: a failed assertion must not leave a 100,000-iteration
    # chunk running on the module's agent for the tests after it
    with contextlib.closing(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)) as sock:
        sock.connect(agent.path)
        sock.sendall(encode(request))
        reader = MessageReader(sock)
        while True:  # train past a few committed checkpoints
            msg = reader.read(timeout=120)
            assert msg is not None and msg["type"] in ("progress", "applied"), msg
            if msg["type"] == "progress" and msg["iteration"] >= 35:
                break
        (session,) = agent.sessions.values()
        pids = [pid for pc in session.launcher._contexts for pid in pc.pids().values()]
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
    # the socket is closed: the task process died

    wait_for("the workers to be killed", lambda: all(_gone(p) for p in pids))
    wait_for("the chunk to end", lambda: not agent.sessions)
    store = open_store(spec.checkpoint)
    ref = store.latest(spec_hash=spec.spec_hash())
    assert 30 <= ref.iteration < 100_000 and ref.iteration % 10 == 0
    state = store.load(ref)  # verifies the manifest's checksums
    assert state["iteration"] == ref.iteration
    assert store.latest(spec_hash=spec.spec_hash()).iteration == ref.iteration  # nothing committed after
    assert AgentClient(agent.path).ping()["chunks"] == 0  # and the agent serves on


def test_abort_kills_the_workers_of_a_running_chunk_at_once(agent, tmp_path):
    """The chunk operator's on_kill aborted node-agent chunks only: a per-host agent's workers
    trained on for seconds, committing checkpoints on slots the pool had already given to
    another job (a probe), until the task's process died."""
    import threading

    spec = make_spec(tmp_path, total_iterations=100_000, checkpoint_interval=10)
    client, outcome, seen = AgentClient(agent.path), [], []

    def run() -> None:
        try:
            client.run_chunk(spec.to_dict(), 0, 100_000, epoch=1, host="h1", store=store_of(spec),
                             target=lambda: Allocation(2), on_progress=lambda p: seen.append(p.iteration))
        except BaseException as exc:  # noqa: BLE001 - what the caller gets is the assertion
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_for("a few iterations", lambda: seen and seen[-1] >= 15)
        (session,) = agent.sessions.values()
        pids = [pid for pc in session.launcher._contexts for pid in pc.pids().values()]
    finally:
        client.abort()  # in on_kill: from Airflow's signal handler
    thread.join(60)
    assert not thread.is_alive() and isinstance(outcome[0], AgentLostError), outcome
    wait_for("the workers to be killed", lambda: all(_gone(p) for p in pids), timeout=30)
    wait_for("the chunk to end", lambda: not agent.sessions)
    client.abort()  # nothing running: nothing to do


def test_an_agent_that_stops_mid_chunk_fails_the_chunk_as_retryable_without_blaming_the_host(tmp_path):
    spec = make_spec(tmp_path, total_iterations=100_000, checkpoint_interval=10)
    errors: list[BaseException] = []
    started = threading.Event()
    with running_agent(tmp_path / "agent") as agent:

        def task() -> None:
            try:
                run_on(agent, spec, 0, 100_000, wanted=lambda: 2, on_progress=lambda p: started.set())
            except BaseException as exc:  # checked below
                errors.append(exc)

        thread = threading.Thread(target=task)
        thread.start()
        assert started.wait(120)
        # leaving the block stops the agent (as SIGTERM does): it kills the chunk's workers
    thread.join(120)
    (err,) = errors
    # retryable, and not a WorkerLostError: the task does not report the host as failing
    assert isinstance(err, AgentLostError) and err.retryable and not isinstance(err, WorkerLostError)
    assert not os.path.exists(agent.path)  # and removed its socket


@pytest.mark.parametrize(
    ("data", "cls", "text"),
    [
        (b"this is not json\n", AgentProtocolError, "not valid JSON"),
        (b"[1, 2]\n", AgentProtocolError, "must be a JSON object"),
        (line({"op": "explode", "version": V}), SpecError, "invalid op='explode': one of ping, latest, run"),
        (line({"op": "ping", "version": 99}), SpecError, "invalid version=99"),
        (line({"op": "run", "version": V, "spec": "x"}), SpecError, "invalid spec='str'"),
        (
            line({"op": "run", "version": V, "spec": {}, "pickle": "..."}),
            SpecError,
            "invalid request=['pickle']",
        ),
        (
            line({"op": "latest", "version": V, "store": {"uri": "ftp://x"}}),
            SpecError,
            "invalid store.uri='ftp://x'",
        ),
        (b"x" * (MAX_MESSAGE_BYTES + 10), AgentProtocolError, "exceeds the limit"),
        (line({"op": "ping", "version": True}), SpecError, "invalid version=True"),
        (b'{"op": "bogus", "op": "ping", "version": 2}\n', AgentProtocolError, "key 'op' appears twice"),
        (b'{"op": "ping", "version": 2, "x": NaN}\n', AgentProtocolError, "NaN is not a JSON number"),
        (b"[" * 200_000 + b"\n", AgentProtocolError, "nested too deeply"),
        (
            line({"op": "latest", "version": V, "store": {"uri": "file:///tmp/%00x"}}),
            SpecError,
            "invalid store.uri='file:///tmp/%00x'",
        ),
    ],
)
def test_bad_requests_are_rejected_with_clear_errors(agent, data, cls, text):
    reply = raw_exchange(agent.path, data)
    assert reply["type"] == "error"
    err = error_from_wire(reply)
    assert type(err) is cls and text in str(err), str(err)


def test_a_run_request_with_bad_fields_names_the_field(agent, tmp_path):
    spec = make_spec(tmp_path)
    client = AgentClient(agent.path)
    for start, end, field in ((-1, 30, "start"), (0, 31, "end")):
        with pytest.raises(SpecError) as err:
            run_on(agent, spec, start, end)
        assert err.value.field == field
    with pytest.raises(SpecError) as err:
        client.run_chunk(
            dict(spec.to_dict(), max_workers=0),
            0,
            30,
            epoch=1,
            host="h1",
            store=store_of(spec),
            target=lambda: Allocation(1),
        )
    assert err.value.field == "max_workers"
    # the session ends just after its error is sent (it joins its reader thread first)
    wait_for("the refused chunks to end", lambda: AgentClient(agent.path).ping()["chunks"] == 0)


def test_the_socket_is_private_to_its_user(agent):
    import os
    import stat

    assert stat.S_IMODE(os.stat(agent.path).st_mode) == 0o600


def _impostor(path: str, report: int) -> None:
    """In a forked child: serve ``path`` as uid 65534, report how many bytes a client sent."""
    try:
        os.setuid(65534)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)
        os.write(report, b"listening\n")
        srv.settimeout(30)
        conn, _ = srv.accept()
        conn.settimeout(30)
        got = conn.recv(1 << 20)
        with contextlib.suppress(OSError):
            conn.sendall(b'{"type": "pong", "version": 2, "pid": 1, "chunks": 0}\n')
        os.write(report, f"{len(got)}\n".encode())
    finally:
        os._exit(0)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to run a listener as another user")
def test_a_task_does_not_talk_to_a_socket_another_user_serves():
    """Another user who holds the agent's path (e.g. in a shared /tmp) must not receive the
    store's credentials nor answer for the agent: the task checks who serves the socket."""
    import tempfile

    shared = tempfile.mkdtemp(prefix="agent-shared-")
    os.chmod(shared, 0o1777)  # world-writable and sticky, like /tmp
    path = os.path.join(shared, "agent.sock")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _impostor(path, w)
    os.close(w)
    try:
        with os.fdopen(r) as report:
            assert report.readline().strip() == "listening"
            with pytest.raises(AgentUnavailableError, match="runs as uid 65534, not as this user"):
                AgentClient(path).ping()
            assert report.readline().strip() == "0"  # the impostor received nothing
    finally:
        os.waitpid(pid, 0)
        shutil.rmtree(shared, ignore_errors=True)


def test_only_an_agent_of_the_same_user_or_root_is_used(agent, monkeypatch):
    import elastic_ops.agent.client as client_module

    assert AgentClient(agent.path).ping()["chunks"] >= 0
    monkeypatch.setattr(client_module, "peer_uid", lambda sock: 12345)
    with pytest.raises(AgentUnavailableError, match="runs as uid 12345"):
        AgentClient(agent.path).ping()


def test_an_agent_of_another_protocol_version_is_unavailable_not_an_error(agent, monkeypatch):
    """After an upgrade the task speaks a newer protocol than a still-running agent: the chunk
    must run in the task process (AgentUnavailableError), not fail as a bad spec."""
    import elastic_ops.agent.client as client_module

    monkeypatch.setattr(client_module, "PROTOCOL_VERSION", 99)
    with pytest.raises(AgentUnavailableError, match="speaks another protocol version"):
        AgentClient(agent.path).ping()


def test_no_agent_at_the_path_is_agent_unavailable(tmp_path):
    with pytest.raises(AgentUnavailableError, match="no elastic-ops agent"):
        AgentClient(str(tmp_path / "none.sock")).ping()
    assert json.loads(encode({"a": 1}))["a"] == 1


def test_the_cli_agent_serves_until_sigterm_then_removes_its_socket(tmp_path):
    path = tmp_path / "cli.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "elastic_ops.cli", "agent", "--socket", str(path)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for("the agent to answer", lambda: path.exists() and _answers(str(path)), timeout=180)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with pytest.raises(SpecError, match="another elastic-ops agent is running there"):
            Agent(str(path), warm=False).serve()  # a second agent on the same socket is refused
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not path.exists() and "elastic-ops agent stopped" in proc.stderr.read()


def _answers(path: str) -> bool:
    try:
        return AgentClient(path).ping()["type"] == "pong"
    except AgentUnavailableError:
        return False


def test_a_peer_that_stops_reading_is_gone_after_the_send_timeout_not_never():
    """Probe finding: a task that kept its connection but read nothing hung its chunk for good
    once the socket's buffer was full (the agent's send blocked the runner's thread)."""
    from elastic_ops.agent.channel import SocketChannel

    agent_side, task_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        channel = SocketChannel(agent_side, send_timeout_s=0.3)
        big = {"type": "progress", "pad": "x" * 65536}
        t0 = time.monotonic()
        with pytest.raises(OSError):  # TimeoutError
            for _ in range(10_000):
                channel.send(big)
        assert time.monotonic() - t0 < 30
        # reads still wait as long as asked (the timeout bounds sends only)
        t0 = time.monotonic()
        assert channel.read(timeout=0.5) is None and time.monotonic() - t0 >= 0.45
    finally:
        agent_side.close()
        task_side.close()


def test_a_chunk_whose_task_cannot_be_reached_has_its_workers_killed(tmp_path):
    from elastic_ops.agent.server import ChunkSession

    class Unreachable:
        def send(self, msg):
            raise TimeoutError("timed out")

        def read(self, timeout=None):
            return None

        def close(self):
            pass

    class Launcher:
        address = None
        aborted = 0

    spec = make_spec(tmp_path)
    store = {"uri": spec.checkpoint_uri(), "keep_last": 3, "keep_every": None}
    request = {"op": "run", "version": V, "spec": spec.to_dict(), "start": 0, "end": 30, "epoch": 1,
               "host": "h1", "workers": 1, "slots": None, "store": store, "warm_start": None}
    session = ChunkSession(Unreachable(), request, Launcher())
    killed = []
    session.launcher.abort = lambda: killed.append(True)
    session.send({"type": "progress"})
    assert session.gone.is_set() and killed == [True]


def test_connections_past_the_cap_are_refused_and_the_agent_serves_on(agent, monkeypatch):
    """Each connection is a thread: a client opening many (idle, or feeding a byte now and then)
    cannot grow the agent without bound. Past the cap a connection is closed at once."""
    from elastic_ops.agent import server

    monkeypatch.setattr(server, "MAX_CONNECTIONS", len([t for t in agent._threads if t.is_alive()]) + 2)
    held = []
    try:
        for _ in range(2):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(agent.path)
            held.append(s)
        time.sleep(0.5)  # accepted, each in its thread, waiting for a request
        extra = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        extra.connect(agent.path)
        held.append(extra)
        extra.settimeout(10)
        assert extra.recv(1) == b""  # closed without a word
    finally:
        for s in held:
            s.close()
    monkeypatch.undo()
    time.sleep(0.5)
    assert raw_exchange(agent.path, line({"op": "ping", "version": V}))["type"] == "pong"


def test_a_read_timeout_is_a_total_a_trickling_peer_cannot_stretch_it():
    """Probe finding: the agent's 30 s wait for a first request restarted at every byte, so a
    client sending one byte now and then held a connection (and its thread) open for ever."""
    from elastic_ops.agent.protocol import MessageReader

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.05):
            with contextlib.suppress(OSError):
                b.sendall(b"x")

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        t0 = time.monotonic()
        assert MessageReader(a).read(timeout=0.5) is None
        assert time.monotonic() - t0 < 2.0
    finally:
        stop.set()
        thread.join(5)
        a.close()
        b.close()
