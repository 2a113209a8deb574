"""Redis restarted mid-chunk (issue 22, item 14), against docs/runtime.md "Failures": a private
redis-server (no persistence, as a cache is usually run) that the test kills with SIGKILL and starts
again on the same port while a chunk trains on a node agent over it.

- Away for longer than the peer timeout → the session ends, the task gets ``AgentLostError``
  (retryable, *not* the host's fault), the node kills the chunk's workers and keeps retrying Redis;
  once Redis is back the node announces itself again, the last committed checkpoint is intact and a
  retry from it gives the uninterrupted run's model bitwise.
- Back within the peer timeout → nothing ends (what could not be pushed goes when Redis is back),
  unless a message was in flight when Redis died (popped but its reply lost): then the session
  ends as Redis's fault, as above. Either way nothing is held against the host.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

from elastic_ops.agent.cluster import NodeConfig
from elastic_ops.agent.node_client import NodeClient
from elastic_ops.checkpoint import open_store
from elastic_ops.errors import AgentLostError, NodeLostError
from elastic_ops.runtime import ChunkStatus, run_chunk
from tests.agent.node_helpers import SECRET, running_node
from tests.agent.test_node import _gone, run_on, wait_for
from tests.runtime.builders import make_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REDIS_SERVER = shutil.which("redis-server")


class PrivateRedis:
    """A redis-server of this test alone, on a free port, persisting nothing."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        argv = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.directory), "--daemonize", "no"]
        log = open(self.directory / "redis.log", "ab")  # the child keeps its own copy
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: everything in memory (session lists, announcements, claims) is gone."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    server = PrivateRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.kill()


def held_spec(tmp_path: Path):
    """A chunk that commits iteration 30 and then waits at 35 until ``tmp_path/gate`` exists."""
    gate = tmp_path / "gate"
    spec = make_spec(tmp_path / "job", total_iterations=100, checkpoint_interval=10,
                     params={"hold_at": 35, "hold_file": str(gate)})
    return spec, gate


def chunk_thread(config, host, spec, client, end, *, ready) -> tuple[threading.Thread, list, list]:
    """``spec``'s iterations ``[0, end)`` on ``host`` in a thread, once a progress passed ``ready``:
    ``(thread, results, errors)``."""
    results: list = []
    errors: list[BaseException] = []
    started = threading.Event()

    def task() -> None:
        try:
            results.append(run_on(config, host, spec, 0, end, wanted=lambda: 2, client=client,
                                  on_progress=lambda p: ready(p) and started.set()))
        except BaseException as exc:  # the test checks them
            errors.append(exc)

    thread = threading.Thread(target=task, daemon=True)
    thread.start()
    assert started.wait(120), f"no progress of the chunk on {host}"
    return thread, results, errors


def committed(spec) -> int:
    ref = open_store(spec.checkpoint).latest(spec_hash=spec.spec_hash())
    return -1 if ref is None else ref.iteration


def reference(tmp_path: Path, end: int) -> str:
    spec = make_spec(tmp_path / "ref", total_iterations=100, checkpoint_interval=10)
    return run_chunk(spec, 0, end, target=lambda i: 1).param_sha256


@contextlib.contextmanager
def held_chunk(server: PrivateRedis, tmp_path: Path, host: str, peer_timeout_s: float, end: int):
    """A node agent for ``host`` over ``server`` and a chunk ``[0, end)`` on it, held at iteration 35
    with 30 committed: a namespace with ``node``, ``client``, ``thread``, ``results``, ``errors``,
    ``spec``, ``gate``, ``config``."""
    config = NodeConfig(url=server.url, secret=SECRET, namespace=host)
    spec, gate = held_spec(tmp_path)
    with running_node(host, config, peer_timeout_s=peer_timeout_s) as node:
        client = NodeClient(config, accept_timeout_s=10.0, peer_timeout_s=peer_timeout_s)
        thread, results, errors = chunk_thread(config, host, spec, client, end,
                                               ready=lambda p: p.iteration >= 30)
        wait_for("iteration 30 committed", lambda: committed(spec) == 30, 60)
        yield SimpleNamespace(node=node, client=client, thread=thread, results=results, errors=errors,
                              spec=spec, gate=gate, config=config)


def announced_again(client: NodeClient, host: str) -> None:
    wait_for(f"the node of {host} to announce itself again", lambda: host in client.live_hosts([host]), 60)


def assert_redis_fault(errors: list[BaseException]) -> None:
    """One error, ``AgentLostError``: retryable, naming Redis, not held against the host."""
    (err,) = errors
    assert isinstance(err, AgentLostError) and not isinstance(err, NodeLostError), repr(err)
    assert err.retryable and getattr(err, "host", None) is None and "Redis" in str(err)


def test_redis_restarted_for_longer_than_the_peer_timeout_ends_the_chunk_as_redis_fault(
    private_redis, tmp_path
):
    with held_chunk(private_redis, tmp_path, "host-r", 3.0, 100) as c:
        (session,) = c.node.sessions.values()
        pids = [pid for pc in session.launcher._contexts for pid in pc.pids().values()]
        assert len(pids) == 2
        private_redis.kill()
        c.thread.join(60)  # both sides give up after their 3-s peer timeout, Redis still away
        assert not c.thread.is_alive(), "the task did not end while Redis was away"
        wait_for("the node to kill the chunk's workers", lambda: all(_gone(p) for p in pids), 60)
        wait_for("the chunk to end on the node", lambda: not c.node.sessions, 60)
        assert_redis_fault(c.errors)

        private_redis.start()  # back, empty
        announced_again(c.client, "host-r")
        store = open_store(c.spec.checkpoint)
        ref = store.latest(spec_hash=c.spec.spec_hash())
        assert ref.iteration == 30 and store.load(ref)["iteration"] == 30  # intact, checksums verify
        c.gate.touch()
        retry = run_on(c.config, "host-r", c.spec, 30, 50, client=NodeClient(c.config, accept_timeout_s=30.0))
    assert retry.status == ChunkStatus.COMPLETED and retry.iteration == 50
    assert retry.param_sha256 == reference(tmp_path, 50)  # nothing lost, nothing trained twice


def test_redis_restarted_within_the_peer_timeout_ends_nothing_or_ends_as_redis_fault(private_redis, tmp_path):
    with held_chunk(private_redis, tmp_path, "host-q", 10.0, 50) as c:
        private_redis.kill()
        private_redis.start()  # back within a second or two, every list and key gone
        announced_again(c.client, "host-q")
        c.gate.touch()
        c.thread.join(120)
        assert not c.thread.is_alive()
        wait_for("the chunk to end on the node", lambda: not c.node.sessions, 60)
        if c.errors:  # a beat was in flight when Redis died: a gap, Redis's fault (documented)
            assert_redis_fault(c.errors)
            assert "lost in Redis" in str(c.errors[0])
            c.results.append(run_on(c.config, "host-q", c.spec, committed(c.spec), 50))
    (result,) = c.results
    assert result.status == ChunkStatus.COMPLETED and result.iteration == 50
    assert result.param_sha256 == reference(tmp_path, 50)
