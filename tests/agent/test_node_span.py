"""Chunks whose grant spans hosts, over node agents on the local Redis: the leader's node starts
the other hosts' ranks through their nodes and all train one process group (bitwise the same
model as one worker); a rank killed on the other host, or its node killed outright, fails the
chunk naming that host; a follower node that stops is not the host's failure; a host without a
node, or a leader without an address, is refused clearly."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_ops.agent.cluster import NodeConfig
from elastic_ops.agent.node import NodeAgent
from elastic_ops.agent.node_client import NodeClient
from elastic_ops.agent.protocol import PROTOCOL_VERSION, require_spans
from elastic_ops.agent.server import ChunkSession
from elastic_ops.agent.span import RanksSession, check_advertise_addr
from elastic_ops.checkpoint import open_store
from elastic_ops.errors import NodeUnavailableError, SpecError, WorkerLostError
from elastic_ops.runtime import run_chunk
from elastic_ops.runtime.allocation import Allocation
from tests.agent.node_helpers import drop_namespace, make_config, running_node
from tests.agent.test_node import store_of
from tests.conftest import require_service
from tests.runtime.agent_helpers import as_applied, as_target
from tests.runtime.builders import make_spec

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[NodeConfig, NodeAgent, NodeAgent]]:
    """``host-a`` (advertises 127.0.0.1: it may lead spanning chunks) and ``host-b``."""
    require_service("Redis", "127.0.0.1", 6379)
    config = make_config()
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # both "hosts" are this machine
    try:
        with (
            running_node("host-a", config, peer_timeout_s=5.0, advertise_addr="127.0.0.1") as a,
            running_node("host-b", config, peer_timeout_s=5.0) as b,
        ):
            yield config, a, b
    finally:
        drop_namespace(config)
        if saved is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = saved


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    return run_chunk(make_spec(tmp_path_factory.mktemp("ref")), 0, 30, target=lambda i: 1).param_sha256


def run_spanning(config, spec, *, grow_at=8, spans=(("host-b", (0, 1)),), applied=None, leader="host-a",
                 leader_node=None):
    """The chunk on ``leader`` with one slot there; 3 workers (spanning) once ``grow_at`` is trained.
    With ``leader_node`` (the leader's NodeAgent) the worker waits at iteration ``grow_at + 2``
    until that node has the grow, so the chunk cannot end before it grows, however slow the
    machine (a gate file beside the checkpoints: the spec, and so its hash, is the same each run).
    Iterations are slowed too: the runner decides boundaries ~50 ms ahead, which for this tiny
    model was the whole chunk, decided for 1 worker before the gate opened."""
    if leader_node is not None:
        gate = Path(spec.checkpoint_uri().removeprefix("file://")).parent / "grown"
        spec = spec.replace(params={**spec.params, "hold_at": grow_at + 2, "hold_file": str(gate),
                                    "sleep_s": 0.005})
        threading.Thread(target=open_when_grown, args=(leader_node, gate), daemon=True).start()
    seen = []
    client = NodeClient(config, accept_timeout_s=10.0, peer_timeout_s=5.0)
    return client.run_chunk(
        spec.to_dict(), 0, 30, epoch=1, host=leader, store=store_of(spec),
        target=as_target(leader, lambda: 3 if seen and seen[-1] >= grow_at else 1, lambda: (0,),
                         lambda: spans),
        spans=True, on_progress=lambda p: seen.append(p.iteration),
        on_applied=as_applied(leader, (lambda *x: applied.append(x)) if applied is not None else None,
                              spans=True),
    )


def open_when_grown(node: NodeAgent, gate: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(isinstance(s, ChunkSession) and s.wanted.workers == 3 for s in list(node.sessions.values())):
            break
        time.sleep(0.01)
    gate.touch()


def test_a_chunk_spanning_two_hosts_trains_one_group_bitwise_equal_to_one_worker(
    cluster, tmp_path, reference
):
    config, a, b = cluster
    assert NodeClient(config).alive("host-a")["addr"] == "127.0.0.1"
    assert NodeClient(config).alive("host-b")["addr"] is None
    spec, applied, before = make_spec(tmp_path), [], b.ranks_served
    result = run_spanning(config, spec, applied=applied, leader_node=a)
    assert result.iteration == 30 and result.param_sha256 == reference
    assert applied[0] == (0, 1, (0,), ())
    grown = applied[1]
    assert grown[1:] == (3, (0,), (("host-b", (0, 1)),)) and grown[0] >= 8
    assert b.ranks_served == before + 1  # host-b's node ran ranks 1 and 2
    assert [n for _, n, _ in result.workers_timeline] == [1, 3]


def test_a_rank_killed_on_the_other_host_fails_the_chunk_naming_it_and_the_retry_matches(
    cluster, tmp_path, reference
):
    config, a, _ = cluster
    params = {"kill_at": 15, "kill_rank": 2, "marker": str(tmp_path / "killed-once")}
    spec = make_spec(tmp_path, params=params)
    with pytest.raises(WorkerLostError) as err:
        run_spanning(config, spec, grow_at=0, leader_node=a)
    assert err.value.retryable and err.value.host == "host-b" and "SIGKILL" in str(err.value)
    assert open_store(spec.checkpoint).latest().iteration == 10  # the last commit before the kill
    result = run_spanning(config, spec, grow_at=0, leader_node=a)
    assert result.workers_timeline[0][0] == 10 and result.param_sha256 == reference


def test_a_span_onto_a_host_without_a_node_is_retryable_and_names_that_host(cluster, tmp_path):
    config, a, _ = cluster
    with pytest.raises(NodeUnavailableError) as err:
        run_spanning(config, make_spec(tmp_path), grow_at=0, spans=(("host-c", (0, 1)),), leader_node=a)
    assert err.value.retryable and err.value.host == "host-c"


def test_a_leader_without_an_address_refuses_to_span(cluster, tmp_path):
    config, _, b = cluster
    with pytest.raises(SpecError, match="advertise-addr"):  # gated: it cannot end before it grows
        run_spanning(config, make_spec(tmp_path), grow_at=0, spans=(("host-a", (0, 1)),), leader="host-b",
                     leader_node=b)


def test_advertise_addresses_and_ranks_requests_are_validated():
    assert check_advertise_addr("127.0.0.1") == "127.0.0.1"
    with pytest.raises(SpecError, match="--advertise-addr"):
        check_advertise_addr("gpu-07.internal")
    with pytest.raises(SpecError, match="cannot listen there"):
        check_advertise_addr("203.0.113.9")  # not an address of this host
    spec = make_spec(Path("/tmp/unused"))
    good = {"op": "ranks", "version": PROTOCOL_VERSION, "host": "b",
            "segment": {"spec": spec.to_dict(), "start": 0, "end": 30, "workers": 3, "segment": 1},
            "master_addr": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "count": 2,
            "group_rank": 1, "slots": [0, 1], "device": "cpu", "threads_per_worker": 1,
            "rendezvous": "0123456789abcdef" * 2}
    RanksSession(None, good, None, "b", None)  # valid
    bad = [({"count": 3}, "count"), ({"slots": [0]}, "slots"), ({"master_addr": "evil"}, "master_addr"),
           ({"master_port": 70000}, "master_port"), ({"device": "tpu"}, "device"),
           ({"rank_offset": 0}, "rank_offset"), ({"extra": 1}, "request"),
           # a signed request still gets no numbers its job could not have (probe finding)
           ({"threads_per_worker": 10**9}, "threads_per_worker"), ({"group_rank": 10**30}, "group_rank"),
           ({"slots": [0, 10**18]}, "slots"),
           ({"segment": {**good["segment"], "start": 10**30}}, "segment.start"),
           ({"segment": {**good["segment"], "end": 31}}, "segment.end"),  # past the job's 30
           ({"segment": {**good["segment"], "segment": 10**30}}, "segment.segment"),
           ({"rendezvous": None}, "rendezvous"), ({"rendezvous": "ab" * 8}, "rendezvous")]
    for change, field in bad:
        with pytest.raises(SpecError) as err:
            RanksSession(None, {**good, **change}, None, "b", None)
        assert err.value.field == field, (change, err.value.field)


def test_a_follower_node_killed_outright_fails_the_chunk_naming_its_host(cluster, tmp_path):
    """The follower's node process dies (SIGKILL): its ranks die with it, the leader's lose their
    peers, and the host that went silent is the one the chunk names (the retry avoids it)."""
    import signal
    import subprocess
    import threading

    from tests.agent.node_helpers import cli_node
    from tests.agent.test_node import wait_for

    config, _, _ = cluster
    cli, env = cli_node("host-c", config)
    node = subprocess.Popen(cli, env=env, cwd=tmp_path, stderr=subprocess.DEVNULL)
    client = NodeClient(config, accept_timeout_s=10.0, peer_timeout_s=5.0)
    try:
        wait_for("host-c's node to announce itself", lambda: client.alive("host-c") is not None, 120)
        spec = make_spec(tmp_path, total_iterations=100_000)
        applied, errors = [], []

        def task() -> None:
            try:
                client.run_chunk(spec.to_dict(), 0, 100_000, epoch=1, host="host-a", store=store_of(spec),
                                 target=lambda: Allocation.split(3, "host-a", (0,), (("host-c", (0, 1)),)),
                                 spans=True, on_applied=lambda *x: applied.append(x))
            except BaseException as exc:  # checked below
                errors.append(exc)

        thread = threading.Thread(target=task, daemon=True)
        thread.start()
        wait_for("the spanning segment to start", lambda: applied, 120)
        os.kill(node.pid, signal.SIGKILL)
        thread.join(60)
        (err,) = errors
        assert isinstance(err, WorkerLostError) and err.retryable and err.host == "host-c"
    finally:
        if node.poll() is None:
            node.kill()
        node.wait(30)


def test_malformed_spans_in_a_run_request_are_refused_naming_the_field(cluster, tmp_path):
    config, _, _ = cluster
    for spans in ((("bad host!", (0,)),), (("host-b", (0, 0)),)):
        with pytest.raises(SpecError) as err:
            run_spanning(config, make_spec(tmp_path), spans=spans)
        assert err.value.field == "spans", spans
    # a host named twice: an Allocation cannot say it, a hand-made message can
    with pytest.raises(SpecError) as err:
        require_spans({"spans": [["host-b", [0]], ["host-b", [1]]]})
    assert err.value.field == "spans"


def test_a_follower_node_that_stops_mid_segment_is_agent_lost_not_the_hosts_failure(cluster, tmp_path):
    """Restarting a node agent (an upgrade) must not cool its host down: the chunk gets the
    retryable AgentLostError, which the task does not report against the host."""
    import threading

    from elastic_ops.errors import AgentLostError
    from tests.agent.test_node import wait_for

    config, _, _ = cluster
    spec = make_spec(tmp_path, total_iterations=100_000)
    applied, errors = [], []
    client = NodeClient(config, accept_timeout_s=10.0, peer_timeout_s=5.0)
    with running_node("host-e", config, peer_timeout_s=5.0) as node_e:

        def task() -> None:
            try:
                client.run_chunk(spec.to_dict(), 0, 100_000, epoch=1, host="host-a", store=store_of(spec),
                                 target=lambda: Allocation.split(2, "host-a", (0,), (("host-e", (0,)),)),
                                 spans=True, on_applied=lambda *x: applied.append(x))
            except BaseException as exc:  # checked below
                errors.append(exc)

        thread = threading.Thread(target=task, daemon=True)
        thread.start()
        wait_for("the spanning segment to start", lambda: applied and node_e.sessions, 120)
        node_e.stop()
        thread.join(60)
    (err,) = errors
    assert type(err) is AgentLostError and err.retryable and "host-e" in str(err), err


def test_the_node_cli_refuses_an_address_it_cannot_listen_on_before_anything_starts(monkeypatch, capsys):
    from elastic_ops.cli import main as cli_main
    from tests.agent.node_helpers import REDIS_URL, SECRET

    monkeypatch.setenv("ELASTIC_OPS_NODE_REDIS_URL", REDIS_URL)
    monkeypatch.setenv("ELASTIC_OPS_NODE_SECRET", SECRET)
    for bad, says in (("gpu-07", "an IPv4 or IPv6 address"), ("203.0.113.9", "cannot listen there")):
        assert cli_main(["node", "--host", "h", "--advertise-addr", bad]) != 0
        err = capsys.readouterr().err
        assert f"--advertise-addr='{bad}'" in err and says in err, err


def test_a_spanning_segments_rendezvous_key_never_crosses_redis(tmp_path):
    """The leader's node derives the segment's rendezvous key from the cluster's secret and a
    fresh token; only the token is in the ranks request, and a follower holding the secret
    derives the same key (without it, another)."""
    import dataclasses
    import json

    from elastic_ops.agent.redis_channel import Signer
    from elastic_ops.agent.span import NodeSpanLauncher, rendezvous_key
    from elastic_ops.runtime.launcher import LaunchRequest, RemotePart

    secret = "a-cluster-secret-of-some-length"

    class Nodes:  # the Redis side, recorded: what would be sent
        signer, asked = Signer(secret), []

        def start_ranks(self, host, msg):
            self.asked.append(msg)
            return dataclasses.make_dataclass("Remote", ["host"])(host)

    class Base:  # this host's launcher, recorded
        def start(self, req):
            self.req = req
            return None

    spec = make_spec(tmp_path)
    cfg = {"spec": spec.to_dict(), "start": 0, "end": 30, "workers": 2, "segment": 0}
    (tmp_path / "segment.json").write_text(json.dumps(cfg))
    runners_key = "f" * 64
    req = LaunchRequest(workers=1, script=None, master_addr="127.0.0.1", master_port=29500, segment=0,
                        log_dir=tmp_path, env={"ELASTIC_OPS_SEGMENT": str(tmp_path / "segment.json")},
                        world_size=2, remote=(RemotePart("host-b", 1, 1, (0,)),), rendezvous_key=runners_key)
    nodes, base = Nodes(), Base()
    NodeSpanLauncher(base, nodes, "127.0.0.1").start(req)
    (msg,) = nodes.asked
    wire = json.dumps(msg)
    key = base.req.rendezvous_key
    assert key == rendezvous_key(Signer(secret), msg["rendezvous"]) and key != runners_key
    assert key not in wire and runners_key not in wire
    follower = RanksSession(None, msg, None, "host-b", Signer(secret))
    assert rendezvous_key(follower.signer, follower.request["rendezvous"]) == key
    assert rendezvous_key(Signer("another-secret-of-some-length"), msg["rendezvous"]) != key
