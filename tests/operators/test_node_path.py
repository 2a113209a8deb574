"""``ElasticChunkOperator`` in a cluster (``ELASTIC_OPS_NODE_REDIS_URL`` set): the chunk trains on
the node agent of the host the pool granted; hosts without a live node agent are avoided when the
chunk asks for workers; a granted host whose node does not take the chunk is reported like a
failed host, so the retry's grant avoids it and the chunk trains on another host."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from elastic_ops.agent import node_client
from elastic_ops.errors import NodeUnavailableError
from elastic_ops.operators import ElasticChunkOperator
from tests.agent.node_helpers import REDIS_URL, SECRET, drop_namespace, make_config, running_node
from tests.operators.helpers import TINY_FIELDS, airflow_pool

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
    assert not [e for e in pool.events() if e["kind"] == "failure"]  # no try was wasted on host-a
    assert "avoids hosts with no live node agent: host-a" in "".join(capsys.readouterr())


def test_a_granted_host_whose_node_does_not_take_the_chunk_is_reported_and_avoided(
    cluster, monkeypatch, tmp_path
):
    pool = airflow_pool(monkeypatch, tmp_path, host="host-a", slots=2)
    pool.add_host("host-b", 2)
    # host-a's node died a moment ago: its announcement has not lapsed yet, nobody takes requests
    info = {"host": "host-a", "pid": 1, "version": 1, "chunks": 0}
    cluster.redis().set(cluster.alive_key("host-a"), json.dumps(info), ex=60)
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


def test_a_chunk_task_in_a_cluster_never_imports_torch(cluster, monkeypatch, tmp_path):
    """The task trains on the node and asks a node whether its range is done (the second run)."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    from tests.operators.test_agent_path import TASK

    pool = airflow_pool(monkeypatch, tmp_path, host="h1", slots=2)
    with running_node("h1", cluster) as node:
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(TASK), json.dumps(TINY_FIELDS), "run1"],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert node.accepted == 1  # the second run asked the node, and ran nothing
    first, again = (
        json.loads(x.split(" ", 1)[1]) for x in proc.stdout.splitlines() if x.startswith("RESULT")
    )
    assert first["status"] == "completed" and first["hosts"] == ["h1"] and again["status"] == "already_done"
    log = proc.stdout + proc.stderr
    assert "sending the chunk to the node agent of host h1" in log and "in this task process" not in log
    assert [e["kind"] for e in pool.events() if e["kind"] in ("grant", "release")] == ["grant", "release"]
