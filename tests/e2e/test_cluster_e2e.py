"""End to end, a cluster on one machine: a real Airflow (scheduler, dag-processor, triggerer,
api-server and a Celery worker: CeleryExecutor on the local Redis, as DESIGN.md's cluster column
says) with its metadata and the pool ledger on the local PostgreSQL, whose chunk tasks send
their chunks over the local Redis to the node agents of two pool hosts, ``host1`` and
``host2``, each a separate ``elastic-ops node`` process started with ``--advertise-addr
127.0.0.1``.

A job granted more workers than one host has trains one process group across both hosts: the
node of the host holding most of the grant leads, the other host's node runs the other ranks,
and the model is bitwise the one a single worker trains. The node agents' metrics reach a
StatsD listener from the deployment's Airflow ``[metrics]`` settings.

The host running a chunk dies (its node agent is SIGKILLed with everything it started, workers
included): the chunk's try fails with ``NodeLostError``, which reports the host to the pool;
Airflow retries the chunk on a grant that avoids that host, on the other host's node, from the
latest committed checkpoint; the model is bitwise the one an uninterrupted run trains.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest

from devtools.airflow_env import AirflowDeployment
from devtools.demo import setup_pool
from elastic_ops.utils.jobs import job_id
from tests.agent.node_helpers import REDIS_URL, SECRET, drop_namespace
from tests.conftest import fresh_database, require_service
from tests.e2e.test_airflow_e2e import finished_after_one_retry, start_reference, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CELERY_BROKER = "redis://127.0.0.1:6379/1"  # the node agents use database 0
SPAN_SPEC = {  # tests/e2e/dags/e2e_span.py trains this
    "entrypoint": "elastic_ops.examples.digits:DigitsMLP", "total_iterations": 60, "chunk_iterations": 60,
    "global_batch": 64, "min_workers": 1, "max_workers": 4, "consistency": "bitwise", "virtual_shards": 4,
    "data_seed": 5, "checkpoint_interval": 20, "params": {"hidden": 32, "depth": 1},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, statsd):
    require_service("Redis", "127.0.0.1", 6379)
    with fresh_database("af_e2e") as airflow_db, fresh_database("pool_e2e") as ledger:
        yield from _cluster(tmp_path_factory, airflow_db, ledger, statsd.port)


def _cluster(tmp_path_factory, airflow_db: str, ledger: str, statsd_port: int):
    root = tmp_path_factory.mktemp("cluster")
    dags = root / "dags"
    dags.mkdir()
    for src in (HERE / "dags").glob("*.py"):
        shutil.copy(src, dags / src.name)
    env = {
        "ELASTIC_OPS_NODE_REDIS_URL": REDIS_URL,
        "ELASTIC_OPS_NODE_SECRET": SECRET,
        "ELASTIC_OPS_NODE_NAMESPACE": f"e2e-{uuid.uuid4().hex[:12]}",
        "GLOO_SOCKET_IFNAME": "lo",  # both "hosts" are this machine
        # the tasks find the ledger through the pool connection, as in a deployment
        "AIRFLOW_CONN_ELASTIC_OPS_POOL_DEFAULT": json.dumps(
            {"conn_type": "elastic_ops_pool", "extra": {"url": ledger}}),
        # Airflow's metrics settings, which the node agents read too
        "AIRFLOW__METRICS__STATSD_ON": "True", "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
        "AIRFLOW__METRICS__STATSD_PORT": str(statsd_port),
    }
    af = AirflowDeployment(home=root / "airflow", dags_folder=dags, plugins_folder=REPO / "plugins",
                           parallelism=2, agent=False, nodes=("host1", "host2"), extra_env=env,
                           node_args=("--advertise-addr", "127.0.0.1"),
                           celery_broker=CELERY_BROKER,
                           database_url=airflow_db)
    try:
        with af:
            pool = setup_pool(ledger, slots=4, hosts=2)
            yield af, pool
    finally:
        drop_namespace(af.node_config())


def test_a_job_granted_more_than_one_host_trains_one_group_across_both(cluster, tmp_path, statsd):
    """First in this module: the next test kills a host."""
    af, pool = cluster
    from elastic_ops.runtime import run_chunk
    from elastic_ops.spec import JobSpec

    af.wait_dag("e2e_span")
    run = af.trigger("e2e_span", run_id="span_run")
    reference = JobSpec.from_dict({**SPAN_SPEC, "name": "ref", "checkpoint": f"file://{tmp_path}/ref"})
    ref_sha = run_chunk(reference, 0, 60, target=lambda i: 1).param_sha256
    assert af.wait_run("e2e_span", run, timeout=400) == "success"
    result = af.xcom("e2e_span", run, "train.chunk_01_of_01")
    assert result["hosts"] == result["trained_on"] == ["host1", "host2"]  # granted and trained on both
    assert {n for _, n, _ in result["workers_timeline"]} == {4}  # 2 slots per host: 4 only across hosts
    assert af.xcom("e2e_span", run, "train.finalize")["param_sha256"] == ref_sha
    leader = (af.home / "logs" / "node-host1.log").read_text(errors="replace")
    follower = (af.home / "logs" / "node-host2.log").read_text(errors="replace")
    assert "chunk [0, 60)" in leader and "ranks 2..3 of 4" in follower
    # the tasks ran in the Celery worker, from this deployment's queue
    assert {t["queue"] for t in af.task_instances("e2e_span", run)} == {af.queue}
    worker = (af.home / "logs" / "celery-worker.log").read_text(errors="replace")
    assert "Executing workload in Celery" in worker
    assert "run_id=span_run/task_id=train.chunk_01_of_01" in worker
    assert not [e for e in pool.events(job=job_id("e2e_span", "train", run)) if e["kind"] == "failure"]
    # the api-server (same cluster settings) lists both node agents and their addresses
    import httpx

    auth = {"Authorization": f"Bearer {af.token()}"}
    nodes = httpx.get(f"{af.url}/elastic-ops/nodes", headers=auth, timeout=30).json()["nodes"]
    assert sorted(nodes) == ["host1", "host2"] and {n["addr"] for n in nodes.values()} == {"127.0.0.1"}
    # the leader's node counted the chunk, the follower's its ranks (plain StatsD: no host tag)
    wait_until("node metrics", lambda: statsd.named("airflow.elastic_ops.node.chunks") == ["1|c"]
               and statsd.named("airflow.elastic_ops.node.ranks") == ["1|c"], af, 30,
               detail=lambda: str([ln for ln in statsd.lines if ".node." in ln]))
    assert "1|g" in statsd.named("airflow.elastic_ops.node.chunks_running")


def test_a_chunk_whose_host_dies_is_retried_on_the_other_hosts_node(cluster, tmp_path, request):
    af, pool = cluster
    reference = start_reference(tmp_path)
    request.addfinalizer(lambda: (reference.kill(), reference.wait()))
    from elastic_ops.checkpoint import open_store

    af.wait_dag("e2e_sigkill")
    run = af.trigger("e2e_sigkill", run_id="host_dies")
    job = job_id("e2e_sigkill", "train", run)
    store = open_store(f"file://{af.home}/elastic_ops_checkpoints/e2e_sigkill/train/{run}")
    wait_until("the first checkpoints", lambda: (r := store.latest()) is not None and r.iteration >= 20, af)
    killed_at = store.latest().iteration
    (holding,) = [j for j in pool.status()["jobs"] if j["name"] == job]
    (host,) = {h for h, _ in holding["placements"]}  # the job's slots are on one host
    af.kill_node(host)  # the host dies: its node agent, fork server and workers at once

    retried, ref_sha = finished_after_one_retry(af, run, reference)
    failures = [e for e in pool.events(job=job) if e["kind"] == "failure"]
    assert [e["host"] for e in failures] == [host]  # the task reported the dead host
    result = af.xcom("e2e_sigkill", run, retried)
    other = [h for h in ("host1", "host2") if h != host]
    assert result["hosts"] == result["trained_on"] == other  # granted and trained on the other node
    assert 0 < killed_at <= result["workers_timeline"][0][0] < 240  # resumed mid-chunk from a checkpoint
    summary = af.xcom("e2e_sigkill", run, "train.finalize")
    assert summary["param_sha256"] == ref_sha  # bitwise identical to an uninterrupted run
    import sqlalchemy as sa  # the run is in Airflow's PostgreSQL metadata, the job in the PostgreSQL ledger

    with sa.create_engine(af.database_url).connect() as conn:
        query = sa.text("SELECT state FROM dag_run WHERE run_id = :r")
        states = conn.execute(query, {"r": run}).scalars().all()
    assert states == ["success"] and pool.url.startswith("postgresql")
    log = (af.home / "logs" / f"node-{host}.log").read_text(errors="replace")
    assert "chunk [0, 240)" in log  # the dead node had been running it
