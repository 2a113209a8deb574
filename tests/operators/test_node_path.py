"""``ElasticChunkOperator`` in a cluster (``ELASTIC_OPS_NODE_REDIS_URL`` set): the chunk trains on
the node agent of the host the pool granted, and a granted host without a node agent is reported
like a failed host, so the retry's grant avoids it and the chunk trains on another host."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

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


def test_a_chunk_retried_after_its_host_had_no_node_trains_on_another_hosts_node(
    cluster, monkeypatch, tmp_path
):
    pool = airflow_pool(monkeypatch, tmp_path, host="host-a", slots=2)  # no node agent runs for host-a
    pool.add_host("host-b", 2)
    context = {"dag": SimpleNamespace(dag_id="d"), "run_id": "run1"}
    op = ElasticChunkOperator(task_id="chunk_0", spec_fields=TINY_FIELDS, chunk_index=0, group_id="train")
    with running_node("host-b", cluster) as node_b:
        with pytest.raises(
            NodeUnavailableError, match="no elastic-ops node agent is running for host host-a"
        ):
            op.execute(context)  # the first grant is on host-a (first by name)
        job = next(e["job"] for e in pool.events() if e["kind"] == "grant")
        failures = [e for e in pool.events(job) if e["kind"] == "failure"]
        assert [e["host"] for e in failures] == ["host-a"]
        assert all(h["used"] == 0 for h in pool.status()["hosts"])  # the failed try gave its slots back

        result = op.execute(context)  # Airflow's retry: a grant that avoids host-a
        assert node_b.accepted == 1
    assert result["status"] == "completed" and result["iterations"] == 20 and result["hosts"] == ["host-b"]
    assert result["param_sha256"]
