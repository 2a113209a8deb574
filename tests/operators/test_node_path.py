"""``ElasticChunkOperator`` in a cluster (``ELASTIC_OPS_NODE_REDIS_URL`` set): the chunk trains on
the node agent of the host the pool granted; hosts without a live node agent are avoided when the
chunk asks for workers; a granted host whose node does not take the chunk is reported like a
failed host, so the retry's grant avoids it and the chunk trains on another host."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from elastic_ops.agent import node_client
from elastic_ops.agent.protocol import PROTOCOL_VERSION
from elastic_ops.errors import NodeUnavailableError
from elastic_ops.operators import ElasticChunkOperator
from elastic_ops.runtime.allocation import Allocation
from tests.agent.node_helpers import REDIS_URL, SECRET, drop_namespace, make_config, running_node
from tests.operators.helpers import TINY_FIELDS, airflow_pool, run_torchless_task

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cluster(monkeypatch, redis_url):
    config = make_config()
    monkeypatch.setenv("ELASTIC_OPS_NODE_REDIS_URL", REDIS_URL)
    monkeypatch.setenv("ELASTIC_OPS_NODE_SECRET", SECRET)
    monkeypatch.setenv("ELASTIC_OPS_NODE_NAMESPACE", config.namespace)
    yield config
    drop_namespace(config)


def chunk_op() -> ElasticChunkOperator:
    return ElasticChunkOperator(task_id="chunk_0", spec_fields=TINY_FIELDS, chunk_index=0, group_id="train")


CONTEXT = {"dag": SimpleNamespace(dag_id="d"), "run_id": "run1"}


def test_hosts_without_a_node_agent_get_no_chunk(cluster, monkeypatch, tmp_path, capsys):
    pool = airflow_pool(monkeypatch, tmp_path, host="host-a", slots=2)  # no node agent runs for host-a
    pool.add_host("host-b", 2)
    with running_node("host-b", cluster) as node_b:
        result = chunk_op().execute(CONTEXT)
        assert node_b.accepted == 1
    assert result["status"] == "completed" and result["iterations"] == 20 and result["hosts"] == ["host-b"]
    assert result["trained_on"] == ["host-b"]
    assert not [e for e in pool.events() if e["kind"] == "failure"]  # no try was wasted on host-a
    assert "avoids hosts with no live node agent: host-a" in "".join(capsys.readouterr())


def test_a_granted_host_whose_node_does_not_take_the_chunk_is_reported_and_avoided(
    cluster, monkeypatch, tmp_path
):
    pool = airflow_pool(monkeypatch, tmp_path, host="host-a", slots=2)
    pool.add_host("host-b", 2)
    # host-a's node died a moment ago: its announcement has not lapsed yet, nobody takes requests
    info = {"host": "host-a", "pid": 1, "version": PROTOCOL_VERSION, "chunks": 0, "at": time.time()}
    cluster.redis().set(cluster.alive_key("host-a"), cluster.announcement("host-a", info), ex=60)
    monkeypatch.setattr(node_client, "ACCEPT_TIMEOUT_S", 2.0)
    with running_node("host-b", cluster) as node_b:
        with pytest.raises(NodeUnavailableError, match="node agent of host host-a did not take the chunk"):
            chunk_op().execute(CONTEXT)  # the grant is on host-a (first by name)
        job = next(e["job"] for e in pool.events() if e["kind"] == "grant")
        assert [e["host"] for e in pool.events(job) if e["kind"] == "failure"] == ["host-a"]
        assert all(h["used"] == 0 for h in pool.status()["hosts"])  # the failed try gave its slots back
        assert cluster.redis().llen(cluster.runs_key("host-a")) == 0  # the request was withdrawn

        result = chunk_op().execute(CONTEXT)  # Airflow's retry: a grant that avoids host-a
        assert node_b.accepted == 1
    assert result["status"] == "completed" and result["hosts"] == ["host-b"] and result["param_sha256"]


def test_a_grant_on_a_host_whose_node_went_away_while_deferred_is_asked_for_again(
    cluster, monkeypatch, tmp_path, capsys
):
    """The task deferred with no node missing; host-a's node went away before the grant came:
    the resumed task gives that grant back and asks again (no failure, no try spent)."""
    import time

    from elastic_ops.triggers.events import GrantEvent
    from elastic_ops.utils.jobs import chunk_range

    pool = airflow_pool(monkeypatch, tmp_path, host="host-a", slots=2)
    pool.add_host("host-b", 2)
    op = chunk_op()
    spec = op._spec(CONTEXT)
    start, end = chunk_range(spec, 0)
    pool.submit(spec.name, min_workers=1, max_workers=2)
    grant = pool.request(spec.name)  # what the trigger got: host-a, first by name
    assert {h for h, _ in grant.placements} == {"host-a"}
    state = {"spec": spec.to_dict(), "chunk_index": 0, "start": start, "end": end, "warm_start": None,
             "preemptions": 0, "timeline": [], "epochs": [], "hosts": [], "trained": 0, "waited_s": 0.0,
             "started_at": time.time()}
    with running_node("host-b", cluster) as node_b:
        result = op.execute_granted(CONTEXT, GrantEvent.from_grant(grant, state).to_payload())
        assert node_b.accepted == 1
    assert result["status"] == "completed" and result["trained_on"] == ["host-b"]
    assert not [e for e in pool.events() if e["kind"] == "failure"]
    assert "host host-a has no live node agent any more; asking again" in "".join(capsys.readouterr())


def test_a_one_host_pool_whose_node_is_gone_fails_the_try_instead_of_asking_forever(
    cluster, monkeypatch, tmp_path
):
    """The only host has no node agent: avoiding it would leave the job nothing, so the pool
    grants it again; the task gives it back once, then sends the chunk, which nobody takes."""
    airflow_pool(monkeypatch, tmp_path, host="host-a", slots=2)
    monkeypatch.setattr(node_client, "ACCEPT_TIMEOUT_S", 1.0)
    with pytest.raises(NodeUnavailableError, match="host host-a"):
        chunk_op().execute(CONTEXT)


def test_a_chunk_task_in_a_cluster_never_imports_torch(cluster, monkeypatch, tmp_path):
    """The task trains on the node and asks a node whether its range is done (the second run)."""
    pool = airflow_pool(monkeypatch, tmp_path, host="h1", slots=2)
    with running_node("h1", cluster) as node:
        first, again, log = run_torchless_task(TINY_FIELDS, "run1", tmp_path)
        assert node.accepted == 1  # the second run asked the node, and ran nothing
    assert first["status"] == "completed" and first["hosts"] == ["h1"] and again["status"] == "already_done"
    assert "sending the chunk to the node agent of host h1" in log and "in this task process" not in log
    assert [e["kind"] for e in pool.events() if e["kind"] in ("grant", "release")] == ["grant", "release"]


def pool_target(wanted: int, slots_here: int) -> Allocation:
    """The pool's target: ``wanted`` workers, ``slots_here`` of its slots on host "a", the rest on "b"."""
    there = tuple(range(max(0, wanted - slots_here)))
    return Allocation.split(wanted, "a", range(slots_here), (("b", there),))


@pytest.mark.parametrize(
    ("wanted", "here", "min_workers", "follows"),
    [
        (2, 2, 1, 2),  # all of the target is on this host
        (0, 2, 1, 0),  # a preemption
        (4, 2, 1, 2),  # a grant across hosts: the workers this host has slots for
        (4, 2, 3, 0),  # ...fewer than the minimum: give the lease back and ask again
        (2, 0, 1, 0),  # moved off this host (a drain): ask again, the new grant is elsewhere
    ],
)
def test_a_node_follows_the_target_with_the_slots_on_its_own_host(wanted, here, min_workers, follows):
    from elastic_ops.executors.node import node_target

    assert node_target(pool_target(wanted, here), "a", min_workers).workers == follows


@pytest.mark.parametrize(
    ("wanted", "here", "min_workers", "follows"),
    [
        (4, 2, 3, 4),  # a grant across hosts: all of it, one process group
        (4, 1, 1, 4),  # one slot here is enough for rank 0
        (2, 0, 1, 0),  # moved off this host: ask again (the new grant's busiest host leads)
        (0, 2, 1, 0),  # a preemption
    ],
)
def test_a_node_that_leads_spanning_groups_follows_the_whole_target(wanted, here, min_workers, follows):
    from elastic_ops.executors.node import node_target

    assert node_target(pool_target(wanted, here), "a", min_workers, span=True).workers == follows


def test_the_node_of_the_host_holding_most_of_the_grant_trains_it():
    from elastic_ops.executors.node import busiest_host

    assert busiest_host([("a", 0), ("b", 0), ("b", 1)]) == "b"
    assert busiest_host([("a", 0), ("a", 1), ("b", 0), ("b", 1)]) == "a"  # a tie: the first


def test_a_grant_across_hosts_trains_on_one_node_with_that_hosts_slots(cluster, monkeypatch, tmp_path):
    pool = airflow_pool(monkeypatch, tmp_path, host="host-a", slots=2)
    pool.add_host("host-b", 2)
    fields = {**TINY_FIELDS, "max_workers": 4}
    op = ElasticChunkOperator(task_id="chunk_0", spec_fields=fields, chunk_index=0, group_id="train")
    with running_node("host-a", cluster) as node_a, running_node("host-b", cluster) as node_b:
        result = op.execute(CONTEXT)
        assert (node_a.accepted, node_b.accepted) == (1, 0)
    grant = next(e for e in pool.events() if e["kind"] == "grant")
    assert {h for h, _ in grant["slots"]} == {"host-a", "host-b"}  # 4 slots on 2 hosts were granted
    assert result["status"] == "completed" and {n for _, n, _ in result["workers_timeline"]} == {2}
    assert result["hosts"] == ["host-a", "host-b"] and result["trained_on"] == ["host-a"]


def test_a_grant_across_hosts_trains_one_group_when_the_node_advertises_an_address(
    cluster, monkeypatch, tmp_path
):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # both "hosts" are this machine
    pool = airflow_pool(monkeypatch, tmp_path, host="host-a", slots=2)
    pool.add_host("host-b", 2)
    fields = {**TINY_FIELDS, "max_workers": 4}
    op = ElasticChunkOperator(task_id="chunk_0", spec_fields=fields, chunk_index=0, group_id="train")
    with (
        running_node("host-a", cluster, advertise_addr="127.0.0.1") as node_a,
        running_node("host-b", cluster) as node_b,
    ):
        result = op.execute(CONTEXT)
        assert (node_a.accepted, node_b.accepted, node_b.ranks_served) == (1, 0, 1)
    assert result["status"] == "completed" and {n for _, n, _ in result["workers_timeline"]} == {4}
    assert result["hosts"] == ["host-a", "host-b"] and result["trained_on"] == ["host-a", "host-b"]
    assert not [e for e in pool.events() if e["kind"] == "failure"]


def test_a_drained_hosts_running_chunk_moves_to_the_other_hosts_node(cluster, monkeypatch, tmp_path):
    import threading
    import time

    pool = airflow_pool(monkeypatch, tmp_path, host="host-a", slots=2)
    pool.add_host("host-b", 2)
    fields = {**TINY_FIELDS, "total_iterations": 4000, "chunk_iterations": 4000}
    op = ElasticChunkOperator(task_id="chunk_0", spec_fields=fields, chunk_index=0, group_id="train")
    out: list = []
    with running_node("host-a", cluster) as node_a, running_node("host-b", cluster) as node_b:
        thread = threading.Thread(target=lambda: out.append(op.execute(CONTEXT)), daemon=True)
        thread.start()
        deadline = time.monotonic() + 120
        while not node_a.sessions:  # training on host-a
            assert time.monotonic() < deadline and thread.is_alive(), "the chunk never ran on host-a"
            time.sleep(0.05)
        pool.drain_host("host-a")  # the pool moves the job to host-b at its next boundary
        thread.join(240)
        assert (node_a.accepted, node_b.accepted) == (1, 1)
    (result,) = out
    assert result["status"] == "completed" and result["iterations"] == 4000 and result["preemptions"] == 1
    assert result["trained_on"] == ["host-a", "host-b"]
    assert not [e for e in pool.events() if e["kind"] == "failure"]  # a move, not a failure
