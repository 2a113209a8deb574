"""Node agents over a real Redis: a chunk trains on the node of the host it names (bitwise the same
model as in-process), targets reach it, a missing or dead node is a retryable error naming the
host, a silent task's workers are killed with the last checkpoint intact, and nothing but a
fresh, first-seen request sealed with the cluster's secret runs anything."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator

import psutil
import pytest

from elastic_ops.agent.cluster import NodeConfig, node_config_from_env
from elastic_ops.agent.node import NodeAgent
from elastic_ops.agent.node_client import NodeClient, without_credentials
from elastic_ops.agent.protocol import PROTOCOL_VERSION, S3Config, StoreConfig
from elastic_ops.agent.redis_channel import MessageLostError, PeerSilentError, RedisChannel, Signer
from elastic_ops.checkpoint import open_store
from elastic_ops.errors import (
    AgentLostError,
    AgentProtocolError,
    NodeLostError,
    NodeUnavailableError,
    SpecError,
    WorkerLostError,
)
from elastic_ops.runtime import ChunkStatus, run_chunk
from tests.agent.node_helpers import REDIS_URL, SECRET, cli_node, drop_namespace, make_config, running_node
from tests.conftest import require_service
from tests.runtime.agent_helpers import as_applied, as_target
from tests.runtime.builders import make_spec

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[NodeConfig, NodeAgent, NodeAgent]]:
    """Two node agents, ``host-a`` and ``host-b``, of one namespace (a silent task: 5 s)."""
    require_service("Redis", "127.0.0.1", 6379)
    config = make_config()
    try:
        with (
            running_node("host-a", config, peer_timeout_s=5.0) as a,
            running_node("host-b", config, peer_timeout_s=5.0) as b,
        ):
            yield config, a, b
    finally:
        drop_namespace(config)


def store_of(spec) -> StoreConfig:
    return StoreConfig(spec.checkpoint_uri(), keep_last=spec.keep_last, keep_every=spec.keep_every)


def run_on(config, host, spec, start=0, end=30, *, wanted=lambda: 1, client=None, on_applied=None, **kwargs):
    """``wanted()`` workers of ``spec`` on ``host``'s node; ``on_applied(iteration, workers, slots)``."""
    client = client or NodeClient(config, accept_timeout_s=10.0, peer_timeout_s=5.0)
    return client.run_chunk(
        spec.to_dict(), start, end, epoch=1, host=host, store=store_of(spec), target=as_target(host, wanted),
        on_applied=as_applied(host, on_applied), **kwargs
    )


def chunk_in_background(config, host, spec, client, *, ready=lambda p: True):
    """A long chunk on 2 workers in a thread, returned once a progress message passes ``ready``:
    ``(thread, errors)``, the errors it ended with."""
    started = threading.Event()
    errors: list[BaseException] = []

    def task() -> None:
        try:
            run_on(
                config,
                host,
                spec,
                0,
                100_000,
                wanted=lambda: 2,
                client=client,
                on_progress=lambda p: ready(p) and started.set(),
            )
        except BaseException as exc:  # the caller checks them
            errors.append(exc)

    thread = threading.Thread(target=task, daemon=True)
    thread.start()
    assert started.wait(120), f"no progress of the chunk on {host}"
    return thread, errors


def wait_for(what: str, check, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_chunks_train_on_the_node_of_their_host_and_give_the_in_process_model(cluster, tmp_path):
    config, a, b = cluster
    reference = run_chunk(make_spec(tmp_path / "ref"), 0, 30, target=lambda i: 1).param_sha256
    spec = make_spec(tmp_path / "job")
    before = (a.accepted, b.accepted)
    applied: list[tuple[int, int, tuple[int, ...] | None]] = []
    first = run_on(config, "host-a", spec, 0, 15, on_applied=lambda *x: applied.append(x))
    assert (a.accepted, b.accepted) == (before[0] + 1, before[1])
    second = run_on(config, "host-b", spec, 15, 30, wanted=lambda: 2)  # the other host, 2 workers
    assert (a.accepted, b.accepted) == (before[0] + 1, before[1] + 1)
    assert first.status == second.status == ChunkStatus.COMPLETED and second.iteration == 30
    assert applied == [(0, 1, None)]
    assert second.param_sha256 == reference  # bitwise: hosts and worker counts change nothing
    assert open_store(spec.checkpoint).latest().iteration == 30


def test_the_pools_target_reaches_the_workers_on_the_node(cluster, tmp_path):
    config, _, _ = cluster
    spec = make_spec(tmp_path, total_iterations=100_000)
    seen: list[int] = []
    applied: list[tuple[int, int, tuple[int, ...] | None]] = []

    def wanted() -> int:  # grow once 8 iterations are trained; preempt once the grow is applied
        if any(n == 2 for _, n, _ in applied):
            return 0
        return 2 if seen and seen[-1] >= 8 else 1

    result = run_on(
        config,
        "host-b",
        spec,
        0,
        100_000,
        wanted=wanted,
        on_progress=lambda p: seen.append(p.iteration),
        on_applied=lambda *x: applied.append(x),
    )
    assert result.status == ChunkStatus.PREEMPTED
    assert [n for _, n, _ in result.workers_timeline][:2] == [1, 2]
    assert open_store(spec.checkpoint).latest().iteration == result.iteration  # committed at preemption


def test_the_announced_nodes_are_listed(cluster, monkeypatch, capsys):
    from elastic_ops.cli import main as cli_main

    config, a, b = cluster
    nodes = NodeClient(config).announced()
    assert sorted(nodes) == ["host-a", "host-b"] and nodes["host-a"]["pid"] == os.getpid()
    monkeypatch.setenv("ELASTIC_OPS_NODE_REDIS_URL", REDIS_URL)
    monkeypatch.setenv("ELASTIC_OPS_NODE_SECRET", SECRET)
    monkeypatch.setenv("ELASTIC_OPS_NODE_NAMESPACE", config.namespace)
    assert cli_main(["nodes", "--json"]) == 0
    assert sorted(json.loads(capsys.readouterr().out)) == ["host-a", "host-b"]
    assert cli_main(["nodes"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["HOST", "PID", "VERSION", "CHUNKS", "ADDRESS"]
    assert table[1].split()[0] == "host-a" and table[1].split()[-1] == "-"  # no --advertise-addr


def test_forged_announcements_cannot_break_or_dress_up_the_node_list(cluster):
    """A key that is not UTF-8 made every listing (CLI, /nodes, the status page) fail, and escape
    sequences in a field reached the terminal. Announcements were not signed: one written
    without the secret, with an address, made a task run a chunk as a span and fail it for good
    (a probe); now it is not seen at all."""
    import redis

    config, _, _ = cluster
    r = redis.Redis.from_url(REDIS_URL)
    prefix = config.alive_key("").encode()
    r.set(prefix + b"\xff\xfe", b'{"pid": 1}', ex=60)
    r.set(prefix + b"evil host", b'{"pid": 1}', ex=60)
    info = {"pid": 7, "addr": "\x1b]0;pwned\x07", "version": PROTOCOL_VERSION, "at": time.time()}
    r.set(config.alive_key("host-x"), config.announcement("host-x", info), ex=60)
    forged = {"host": "host-y", "pid": 9, "version": PROTOCOL_VERSION, "addr": "10.9.9.9"}
    r.set(config.alive_key("host-y"), json.dumps(forged), ex=60)  # without the secret
    client = NodeClient(config)
    nodes = client.announced()
    assert sorted(nodes) == ["host-a", "host-b", "host-x"]
    assert nodes["host-x"] == {"pid": 7, "version": PROTOCOL_VERSION, "at": info["at"]}
    assert client.alive("host-y") is None and client.live_hosts(["host-y", "host-a"]) == {"host-a"}


def test_a_second_node_agent_for_a_host_already_served_refuses_to_start(cluster, monkeypatch):
    """Two agents for one host name (a cloned VM's hostname, one left running) both took its
    chunks, with no warning, and stopping one withdrew the other's announcement (a probe)."""
    from elastic_ops.agent import node as node_module

    config, a, _ = cluster
    monkeypatch.setattr(node_module, "HOST_TAKEN_WAIT_S", 3.0)  # for a dead agent's to lapse
    second = NodeAgent("host-a", config)
    with pytest.raises(SpecError, match=r"invalid --host='host-a': a host name no other live node agent "
                                        rf"serves \(pid {os.getpid()} announces it"):
        second.serve()
    assert NodeClient(config).alive("host-a")["instance"] == a.instance  # the first one's, untouched


def test_a_replayed_announcement_neither_keeps_a_stopped_node_alive_nor_blocks_its_restart(cluster):
    """Re-SETting a captured announcement every 2 s (no secret needed) kept a stopped node in
    ``live_hosts`` and made a new ``elastic-ops node --host`` refuse to start (a probe)."""
    import redis

    config, _, _ = cluster
    r = redis.Redis.from_url(REDIS_URL)
    t0 = time.time()
    info = {"host": "host-r", "pid": 4242, "version": PROTOCOL_VERSION, "instance": "deadbeef", "at": t0}
    captured = config.announcement("host-r", info)
    r.set(config.alive_key("host-r"), captured, ex=60)
    assert NodeClient(config).live_hosts(["host-r"]) == {"host-r"}  # fresh: a live node's
    later = NodeClient(config, wall_clock=lambda: t0 + 300.0)  # the same bytes, replayed 5 minutes on
    assert later.live_hosts(["host-r"]) == set() and later.alive("host-r") is None
    assert "host-r" not in later.announced()
    early = NodeClient(config, wall_clock=lambda: t0 - 300.0)  # from the future: not trusted either
    assert early.alive("host-r") is None
    stop = threading.Event()

    def replay():  # the replayer keeps the key fresh in Redis; its signed time never moves
        while not stop.is_set():
            r.set(config.alive_key("host-r"), captured, ex=60)
            stop.wait(0.5)

    t = threading.Thread(target=replay, daemon=True)
    t.start()
    try:  # the restarted node supersedes the replay (serving() raises its start-up refusal)
        with running_node("host-r", config, warm=False) as node:
            stop.set()
            t.join(5)
            # its next renewal (every 2 s) replaces the last replayed copy
            wait_for("the node's own announcement", lambda: (NodeClient(config).alive("host-r") or {})
                     .get("instance") == node.instance, 10)
    finally:
        stop.set()
        r.delete(config.alive_key("host-r"))


def test_a_host_without_a_node_agent_is_a_retryable_error_naming_it(cluster, tmp_path):
    config, _, _ = cluster
    with pytest.raises(NodeUnavailableError) as info:
        run_on(config, "host-c", make_spec(tmp_path))
    err = info.value
    assert isinstance(err, WorkerLostError) and err.retryable and err.host == "host-c"
    assert "no elastic-ops node agent is running for host host-c" in str(err)
    assert "elastic-ops node --host host-c" in str(err)


def test_a_task_that_goes_silent_mid_chunk_leaves_no_workers_and_an_intact_checkpoint(cluster, tmp_path):
    config, a, _ = cluster
    spec = make_spec(tmp_path, total_iterations=100_000, checkpoint_interval=10)
    # a client whose channel never beats and is never closed: its process froze or died
    client = NodeClient(config, accept_timeout_s=10.0, peer_timeout_s=5.0, beat_s=10_000.0)
    thread, errors = chunk_in_background(config, "host-a", spec, client, ready=lambda p: p.iteration >= 35)
    # from here the client's reads go on, but a beatless channel looks dead to the node
    (session,) = [s for s in a.sessions.values() if s.request["spec"].name == spec.name]
    pids = [pid for pc in session.launcher._contexts for pid in pc.pids().values()]
    assert len(pids) == 2
    wait_for("the node to kill the silent task's workers", lambda: all(_gone(p) for p in pids), 30)
    wait_for("the chunk to end on the node", lambda: session not in a.sessions.values())
    store = open_store(spec.checkpoint)
    ref = store.latest(spec_hash=spec.spec_hash())
    assert 30 <= ref.iteration < 100_000 and ref.iteration % 10 == 0
    assert store.load(ref)["iteration"] == ref.iteration  # checksums verify
    thread.join(30)
    (err,) = errors  # and the client learns the session is over
    assert isinstance(err, NodeLostError) and err.host == "host-a"


def test_a_forged_stale_or_replayed_request_runs_nothing(cluster, tmp_path, caplog):
    config, a, _ = cluster
    r = config.redis()
    runs = config.runs_key("host-a")
    spec = make_spec(tmp_path)
    run = {
        "op": "run",
        "version": PROTOCOL_VERSION,
        "spec": spec.to_dict(),
        "start": 0,
        "end": 30,
        "epoch": 1,
        "host": "host-a",
        "workers": 1,
        "slots": None,
        "store": store_of(spec).to_wire(),
        "warm_start": None,
    }

    def envelope(signer: Signer, issued: float, session: str) -> bytes:
        return signer.seal(runs, {"seq": 1, "kind": "run", "session": session, "issued": issued, "msg": run})

    before = a.accepted
    forged = envelope(Signer("not-the-cluster-secret!!"), time.time(), uuid.uuid4().hex)
    stale = envelope(config.signer(), time.time() - 3600, uuid.uuid4().hex)
    moved = config.signer().seal(  # genuine, but sealed for another host's list
        config.runs_key("host-b"),
        {"seq": 1, "kind": "run", "session": uuid.uuid4().hex, "issued": time.time(), "msg": run},
    )
    with caplog.at_level("WARNING", logger="elastic_ops.node"):
        for raw in (forged, stale, moved, b"not json", b'{"mac": 1}'):
            r.rpush(runs, raw)
        wait_for("the node to refuse five requests", lambda: caplog.text.count("refused") >= 5)
        assert "failed its signature check" in caplog.text and "issued 3600 s ago" in caplog.text
        # a genuine request runs once; the same bytes again run nothing
        session = uuid.uuid4().hex
        genuine = envelope(config.signer(), time.time(), session)
        r.rpush(runs, genuine)
        wait_for("the genuine request to be taken", lambda: a.accepted == before + 1)
        r.rpush(runs, genuine)
        wait_for("the replay to be refused", lambda: "already taken (a replay)" in caplog.text)
    assert a.accepted == before + 1
    reply = RedisChannel(
        r,
        config.signer(),
        inbox=config.session_key(session, "to_task"),
        outbox=config.session_key(session, "to_node"),
    )
    try:
        assert reply.read(timeout=30)["type"] == "accepted"
    finally:
        reply.close()  # the test's "task" leaves: the node ends that chunk


def test_forged_and_replayed_messages_inside_a_session_are_dropped_a_lost_one_is_an_error(redis_url):
    config = make_config()
    r = config.redis()
    try:
        a = RedisChannel(r, config.signer(), inbox="x", outbox=f"{config.namespace}:s:ab", beat_s=100)
        b = RedisChannel(r, config.signer(), inbox=f"{config.namespace}:s:ab", outbox="y", beat_s=100)
        a.send({"type": "progress", "iteration": 1})
        assert b.read(timeout=5) == {"type": "progress", "iteration": 1}
        a.send({"type": "progress", "iteration": 2})
        raw = r.lpop(f"{config.namespace}:s:ab")
        # anyone with Redis access can push: tampered, unsigned and replayed envelopes are
        # dropped (one junk push used to end a running chunk for good), the genuine one read
        r.rpush(f"{config.namespace}:s:ab", raw.replace(b'iteration\\":2', b'iteration\\":3'))
        r.rpush(f"{config.namespace}:s:ab", b"not an envelope")
        r.rpush(f"{config.namespace}:s:ab", raw)  # the genuine one
        assert b.read(timeout=5) == {"type": "progress", "iteration": 2}
        r.rpush(f"{config.namespace}:s:ab", raw)  # replayed inside the session
        assert b.read(timeout=0.5) is None and b.dropped == 3
        a.send({"type": "progress", "iteration": 3})
        assert b.read(timeout=5) == {"type": "progress", "iteration": 3}
        a.send({"type": "progress", "iteration": 4})
        r.lpop(f"{config.namespace}:s:ab")  # a genuine message removed: the gap ends the session,
        a.send({"type": "progress", "iteration": 5})  # as Redis's fault (retryable), not the peer's
        with pytest.raises(MessageLostError, match="out of order .*a message was lost in Redis"):
            b.read(timeout=5)
        assert "a message was lost" in b.redis_trouble
        a.close()
        b.close()
    finally:
        drop_namespace(config)


def test_a_junk_flood_behind_genuine_envelopes_neither_ends_the_session_nor_blames_the_peer(redis_url):
    """400,000 unsigned envelopes pushed onto a running session's list made the task raise
    "nothing from the peer for 10 s" and the host be reported (a probe): envelopes were read
    one round trip each. Now junk is drained in bulk; and when the peer's envelopes do not come
    through while junk does, Redis (the flood) is blamed, not the peer."""
    config = make_config()
    r = config.redis()
    box = f"{config.namespace}:s:flood"
    try:
        a = RedisChannel(r, config.signer(), inbox=f"{box}:in", outbox=box, beat_s=0.5)
        b = RedisChannel(r, config.signer(), inbox=box, outbox=f"{box}:out", beat_s=100, peer_timeout_s=5)
        junk = [b"junk-%d" % i for i in range(200_000)]
        pipe = r.pipeline(transaction=False)
        for k in range(0, len(junk), 10_000):
            pipe.rpush(box, *junk[k:k + 10_000])
        pipe.execute()
        a.send({"type": "progress", "iteration": 7})  # behind all of it
        deadline = time.monotonic() + 30
        got = None
        while got is None and time.monotonic() < deadline:
            got = b.read(timeout=1)
        assert got == {"type": "progress", "iteration": 7} and b.dropped >= 200_000
        a.close()
        # the peer is gone and only junk arrives: the session ends, blamed on Redis
        r.rpush(box, *junk[:1000])
        with pytest.raises(EOFError):
            while True:
                b.read(timeout=1)
        c = RedisChannel(r, config.signer(), inbox=f"{box}:2", outbox=f"{box}:x", beat_s=100,
                         peer_timeout_s=1)
        stop = threading.Event()

        def flood():
            while not stop.is_set():
                r.rpush(f"{box}:2", b"junk")
                stop.wait(0.05)

        t = threading.Thread(target=flood, daemon=True)
        t.start()
        try:
            with pytest.raises(PeerSilentError, match="envelopes that are not the peer's flooded"):
                while True:
                    c.read(timeout=1)
        finally:
            stop.set()
            t.join(5)
        assert "flooded" in c.redis_trouble  # the task reports it as Redis's fault, not the host's
        for ch in (b, c):
            ch.close()
    finally:
        drop_namespace(config)


def test_junk_on_a_nodes_run_queue_gets_no_thread_and_delays_no_genuine_request(cluster, tmp_path):
    """400,000 envelopes on a host's queue made a genuine request fail after 30 s, the node
    starting one thread per popped item (a probe)."""
    config, a, _ = cluster
    r = config.redis()
    runs = config.runs_key("host-a")
    pipe = r.pipeline(transaction=False)
    for k in range(20):
        pipe.rpush(runs, *[b"junk-%d" % (k * 10_000 + i) for i in range(10_000)])
    pipe.execute()
    threads_before = threading.active_count()
    # answered behind the junk, within the task's accept timeout (else NodeUnavailableError)
    client = NodeClient(config, accept_timeout_s=30.0)
    assert client.latest("host-a", StoreConfig(f"file://{tmp_path}/ckpt"), None) is None
    assert threading.active_count() <= threads_before + 8  # no thread per junk envelope
    assert r.llen(runs) == 0


class _Flaky:
    """A Redis client that is unreachable while ``down`` (connection refused)."""

    def __init__(self, r) -> None:
        self.r, self.down = r, False

    def _check(self) -> None:
        import redis

        if self.down:
            raise redis.exceptions.ConnectionError("Error 111 connecting: Connection refused.")

    def pipeline(self):
        pipe, check = self.r.pipeline(), self._check

        class Pipe:
            def __getattr__(self, name):
                return getattr(pipe, name)

            def execute(self):
                check()
                return pipe.execute()

        return Pipe()

    def blpop(self, *a, **kw):
        self._check()
        return self.r.blpop(*a, **kw)

    def lpop(self, *a, **kw):
        self._check()
        return self.r.lpop(*a, **kw)


def test_a_redis_blip_shorter_than_the_peer_timeout_ends_nothing(redis_url):
    """A beat that could not be pushed spent its sequence number: when Redis came back the peer
    saw a gap, a non-retryable protocol error that ended the job; and the node took any failed
    push for the task gone and killed its workers (a probe). Now what could not be pushed goes,
    in order, once Redis is back; only an outage past the peer timeout ends the session, as
    Redis's fault."""
    config = make_config()
    r = config.redis()
    t = [0.0]  # the outage's length, added to the real clock (reads time out in real time)

    def clock() -> float:
        return time.monotonic() + t[0]

    try:
        flaky_a, flaky_b = _Flaky(r), _Flaky(r)
        box = f"{config.namespace}:s:blip"
        a = RedisChannel(flaky_a, config.signer(), inbox=f"{box}:in", outbox=box, beat_s=100, clock=clock)
        b = RedisChannel(flaky_b, config.signer(), inbox=box, outbox=f"{box}:out", beat_s=100, clock=clock)
        a.send({"type": "progress", "iteration": 1})
        assert b.read(timeout=5) == {"type": "progress", "iteration": 1}
        flaky_a.down = flaky_b.down = True
        a._push("beat")  # the beat thread's push, while Redis is away: no error, nothing lost
        t[0] += 3
        a.send({"type": "progress", "iteration": 2})  # no error either: the node keeps its workers
        assert b.read(timeout=0.3) is None
        flaky_a.down = flaky_b.down = False
        t[0] += 1
        a.send({"type": "progress", "iteration": 3})  # the beat and 2 go first, in order
        assert b.read(timeout=5) == {"type": "progress", "iteration": 2}
        assert b.read(timeout=5) == {"type": "progress", "iteration": 3}
        assert not b.redis_trouble and b.dropped == 0
        flaky_a.down = flaky_b.down = True  # away for longer than the peer timeout
        a.send({"type": "progress", "iteration": 4})
        assert b.read(timeout=0.3) is None  # the task polls on meanwhile: its reads fail
        t[0] += 11
        with pytest.raises(OSError, match="Redis unreachable for 1[12] s"):
            a.send({"type": "progress", "iteration": 5})
        with pytest.raises(PeerSilentError, match="Redis unreachable"):
            b.read(timeout=5)
        assert b.redis_trouble  # the task maps it to AgentLostError, not the host's fault
        a.close()
        b.close()
    finally:
        drop_namespace(config)


def test_a_message_too_large_for_a_node_is_refused_where_it_is_sealed():
    """A spec whose params made the run request over 2 MiB was pushed, refused by the node, and
    seen by the task as a node that did not take the chunk: retryable, held against the host,
    one host cooled down after another (a probe)."""
    with pytest.raises(AgentProtocolError, match="would be .* bytes; a node agent reads at most") as err:
        Signer(SECRET).seal("ns:node:h:runs", {"msg": {"params": {"x": "y" * (2 << 20)}}})
    assert not err.value.retryable


def test_settings_are_validated_where_they_enter():
    assert node_config_from_env({}) is None
    with pytest.raises(SpecError, match="missing ELASTIC_OPS_NODE_SECRET: .*at least 16 characters"):
        node_config_from_env({"ELASTIC_OPS_NODE_REDIS_URL": "redis://127.0.0.1:6379/0"})
    with pytest.raises(SpecError, match=r"ELASTIC_OPS_NODE_SECRET.*<5 characters, hidden>"):
        NodeConfig(url="redis://h:6379/0", secret="short")
    with pytest.raises(SpecError, match=r"ELASTIC_OPS_NODE_REDIS_URL='http://:\*\*\*@h'.*a Redis URL"):
        NodeConfig(url="http://:pw@h", secret=SECRET)
    with pytest.raises(SpecError, match=r"REDIS_URL='redis://admin:\*\*\*@h:6379/0'.*encode '/'") as err:
        NodeConfig(url="redis://admin:S3CRET/pw@h:6379/0", secret=SECRET)  # was a ValueError quoting 'S3CRET'
    assert "S3CRET" not in str(err.value)
    with pytest.raises(SpecError, match=r"REDIS_URL='redis://:\*\*\*@redis-host:6379/0'.*a host"):
        NodeConfig(url="redis://:123/45@redis-host:6379/0", secret=SECRET)  # '123' read as the port
    NodeConfig(url="redis://admin:S3CRET%2Fpw@h:6379/0", secret=SECRET)
    NodeConfig(url="unix:///run/redis.sock?db=0", secret=SECRET)
    with pytest.raises(SpecError, match="ELASTIC_OPS_NODE_NAMESPACE"):
        NodeConfig(url="redis://h", secret=SECRET, namespace="a b")
    with pytest.raises(SpecError, match="--host"):
        NodeAgent("bad host!", make_config())
    config = NodeConfig(url="redis://:hunter2-password@h:6379/0", secret=SECRET)
    assert "hunter2" not in repr(config) and SECRET not in repr(config) and "***" in repr(config)


def test_s3_keys_never_travel_to_a_node():
    s3 = S3Config(
        endpoint_url="http://127.0.0.1:9000",
        region_name="eu-west-1",
        access_key_id="AKIAEXAMPLE",
        secret_access_key="very-secret",
        session_token="tok",
    )
    sent = without_credentials(StoreConfig("s3://bucket/p", s3=s3)).to_wire()
    assert sent["s3"] == {"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"}
    assert "very-secret" not in json.dumps(sent) and "AKIAEXAMPLE" not in json.dumps(sent)


def test_the_cli_node_stops_on_sigterm_a_frozen_node_is_node_lost_and_its_workers_die_with_it(
    redis_url, tmp_path
):
    config = make_config()
    client = NodeClient(config, accept_timeout_s=10.0, peer_timeout_s=4.0)
    cli, env = cli_node("host-d", config)
    node = subprocess.Popen(cli, env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        wait_for("the node to announce itself", lambda: client.alive("host-d") is not None, 120)
        assert client.alive("host-d")["pid"] == node.pid
        node.send_signal(signal.SIGTERM)
        assert node.wait(60) == 0
        assert client.alive("host-d") is None  # withdrawn at once, not after its TTL
        assert "serving" in node.stderr.read()

        node = subprocess.Popen(cli, env=env, cwd=tmp_path, stderr=subprocess.DEVNULL)
        wait_for("the node to announce itself", lambda: client.alive("host-d") is not None, 120)
        spec = make_spec(tmp_path, total_iterations=100_000)
        thread, errors = chunk_in_background(config, "host-d", spec, client)
        os.kill(node.pid, signal.SIGSTOP)  # the host hangs (or is cut off): nothing more comes
        thread.join(60)
        (err,) = errors
        assert isinstance(err, NodeLostError) and err.retryable and err.host == "host-d"
        assert not isinstance(err, AgentLostError)  # held against the host: the retry avoids it
        # the node process dies alone (SIGKILL, its host still up): nothing it started survives it
        # (the fork server exits, and the kernel kills the workers with it: PR_SET_PDEATHSIG)
        started_by_node = psutil.Process(node.pid).children(recursive=True)
        assert len(started_by_node) >= 3  # the fork server and at least the chunk's 2 workers
        os.kill(node.pid, signal.SIGKILL)
        node.wait(30)
        wait_for(
            "everything the node started to exit", lambda: all(_gone(p.pid) for p in started_by_node), 30
        )
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs = psutil.Process(node.pid).children(recursive=True) + [psutil.Process(node.pid)]
            for p in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        node.wait(30)
        drop_namespace(config)


def test_a_node_adds_its_host_to_the_pool_once_and_leaves_a_known_host_alone(tmp_path, monkeypatch, capsys):
    from elastic_ops.agent.node import register_host
    from elastic_ops.cli import main as cli_main
    from elastic_ops.pool import PoolClient

    url = f"sqlite:///{tmp_path / 'pool.db'}"
    assert register_host("host-x", 4, url) is True
    pool = PoolClient(url)
    pool.set_host_state("host-x", "draining")  # an operator drains it
    assert register_host("host-x", 8, url) is False  # the node restarts: nothing changes
    (host,) = pool.status()["hosts"]
    assert (host["name"], host["slots"], host["state"]) == ("host-x", 4, "draining")
    assert register_host("host-g", 2, url, {"gpu": "h100"}) is True  # labels for host selectors
    assert {h["name"]: h["labels"] for h in pool.status()["hosts"]}["host-g"] == {"gpu": "h100"}
    with pytest.raises(SpecError, match="--register-slots"):
        register_host("host-y", 0, url)
    monkeypatch.setenv("ELASTIC_OPS_NODE_REDIS_URL", REDIS_URL)
    monkeypatch.setenv("ELASTIC_OPS_NODE_SECRET", SECRET)
    assert cli_main(["node", "--host", "bad host", "--register-slots", "2", "--pool-url", url]) == 2
    assert "invalid --host='bad host'" in capsys.readouterr().err
    argv = ["node", "--host", "host-z", "--register-slots", "2", "--label", "gpu", "--pool-url", url]
    assert cli_main(argv) == 2
    assert "invalid --label='gpu'" in capsys.readouterr().err
    assert cli_main(["node", "--host", "host-z", "--label", "gpu=h100"]) == 2  # it would label nothing
    assert "invalid --label=['gpu=h100']: only with --register-slots" in capsys.readouterr().err
    monkeypatch.delenv("ELASTIC_OPS_NODE_REDIS_URL")
    assert cli_main(["node", "--host", "h"]) == 2
    assert "ELASTIC_OPS_NODE_REDIS_URL" in capsys.readouterr().err


def test_abort_ends_the_chunk_on_the_node_at_once(redis_url, tmp_path):
    """What the operator's ``on_kill`` does: the node kills the workers now, not after its peer
    timeout (here 300 s, so only the explicit close can end the chunk within the wait)."""
    config = make_config()
    try:
        with running_node("host-e", config, peer_timeout_s=300.0) as node:
            client = NodeClient(config, accept_timeout_s=10.0)
            spec = make_spec(tmp_path, total_iterations=100_000)
            thread, errors = chunk_in_background(config, "host-e", spec, client)
            (session,) = node.sessions.values()
            pids = [pid for pc in session.launcher._contexts for pid in pc.pids().values()]
            client.abort()
            wait_for("the node to kill the workers", lambda: all(_gone(p) for p in pids), 60)
            wait_for("the chunk to end on the node", lambda: not node.sessions, 60)
            thread.join(30)
            assert len(errors) == 1 and isinstance(errors[0], NodeLostError)
    finally:
        drop_namespace(config)
