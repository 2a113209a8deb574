"""A node agent's metrics (docs/airflow.md "Metrics"): what it runs, how its chunks ended, the
requests it refused and why, tagged with its host; from the CLI, through Airflow's Stats as the
host's ``[metrics]`` configuration says (a real StatsD socket here)."""

from __future__ import annotations

import signal
import subprocess
import time
import uuid

import pytest

from elastic_ops.agent.node_client import NodeClient
from elastic_ops.agent.protocol import PROTOCOL_VERSION as V  # the current wire version
from elastic_ops.runtime import ChunkStatus
from tests.agent.node_helpers import cli_node, drop_namespace, make_config, running_node
from tests.agent.test_node import run_on, store_of, wait_for
from tests.recording_metrics import RecordingMetrics
from tests.runtime.builders import make_spec
from tests.statsd_listener import StatsdListener

pytestmark = pytest.mark.timeout(300)


def chunks(metrics: RecordingMetrics) -> list[dict]:
    return [tags for _, name, _, tags in metrics.sent if name == "node.chunks"]


def test_a_node_counts_its_chunks_by_outcome_and_gauges_what_runs(redis_url, tmp_path):
    config, metrics = make_config(), RecordingMetrics()
    try:
        with running_node("host-m", config, metrics=metrics, peer_timeout_s=5.0):
            done = run_on(config, "host-m", make_spec(tmp_path / "a"))
            assert done.status == ChunkStatus.COMPLETED
            # the task has its result a moment before the node has ended the session
            wait_for("the chunk to end on the node", lambda: metrics.last("node.chunks_running") == 0)
            assert 1 in metrics.values("node.chunks_running")  # while it ran
            failing = make_spec(tmp_path / "b", params={"fail_at": 3})
            with pytest.raises(Exception, match="refuses this batch"):
                run_on(config, "host-m", failing)
            wait_for("the failed chunk to be counted", lambda: len(chunks(metrics)) == 2)
            assert chunks(metrics) == [
                {"host": "host-m", "outcome": "completed"},
                {"host": "host-m", "outcome": "failed", "error": "UserCodeError"},
            ]
            assert metrics.last("node.chunks_running") == metrics.last("node.ranks_running") == 0
    finally:
        drop_namespace(config)


def test_refused_requests_are_counted_by_reason(redis_url, tmp_path):
    config, metrics = make_config(), RecordingMetrics()
    r = config.redis()
    runs = config.runs_key("host-m")
    spec = make_spec(tmp_path)

    def envelope(signer, issued: float, session: str, host: str = "host-m") -> bytes:
        run = {"op": "run", "version": V, "spec": spec.to_dict(), "start": 0, "end": 30, "epoch": 1,
               "host": host, "workers": 1, "slots": None, "store": store_of(spec).to_wire(),
               "warm_start": None}
        return signer.seal(runs, {"seq": 1, "kind": "run", "session": session, "issued": issued, "msg": run})

    def refused() -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, name, value, tags in metrics.sent:
            if name == "node.requests_refused":
                assert tags["host"] == "host-m"
                counts[tags["reason"]] = counts.get(tags["reason"], 0) + value
        return counts

    from elastic_ops.agent.redis_channel import Signer

    replayed = uuid.uuid4().hex
    try:
        with running_node("host-m", config, metrics=metrics):
            r.rpush(runs, envelope(Signer("not-the-cluster-secret!!"), time.time(), uuid.uuid4().hex))
            r.rpush(runs, b"not json")
            r.rpush(runs, envelope(config.signer(), time.time() - 3600, uuid.uuid4().hex))
            r.rpush(runs, envelope(config.signer(), 10**400, uuid.uuid4().hex))  # no float: was a crash
            r.rpush(runs, envelope(config.signer(), time.time(), uuid.uuid4().hex, host="host-z"))
            r.set(config.session_key(replayed, "claimed"), "host-m")  # taken already
            r.rpush(runs, envelope(config.signer(), time.time(), replayed))
            expected = {"unverified": 2, "stale": 2, "invalid": 1, "replay": 1}
            wait_for(f"refusals {expected}", lambda: refused() == expected, 60)
            assert chunks(metrics) == []  # nothing ran
    finally:
        drop_namespace(config)


def test_the_cli_node_sends_its_metrics_through_airflows_statsd_settings(redis_url, tmp_path):
    config, statsd = make_config(), StatsdListener()
    cli, env = cli_node(
        "host-s",
        config,
        AIRFLOW_HOME=str(tmp_path / "airflow"),
        AIRFLOW__METRICS__STATSD_ON="True",
        AIRFLOW__METRICS__STATSD_HOST="127.0.0.1",
        AIRFLOW__METRICS__STATSD_PORT=str(statsd.port),
    )
    client = NodeClient(config, accept_timeout_s=10.0, peer_timeout_s=5.0)
    node = subprocess.Popen(cli, env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        wait_for("the node to announce itself", lambda: client.alive("host-s") is not None, 120)
        assert run_on(config, "host-s", make_spec(tmp_path), client=client).status == ChunkStatus.COMPLETED
        counted = lambda: statsd.named("airflow.elastic_ops.node.chunks") == ["1|c"]  # noqa: E731
        wait_for("the chunk's counter", counted, 30)
        assert "1|g" in statsd.named("airflow.elastic_ops.node.chunks_running")
        node.send_signal(signal.SIGTERM)
        assert node.wait(60) == 0
        assert statsd.named("airflow.elastic_ops.node.chunks_running")[-1] == "0|g"
        assert "metrics: through Airflow's Stats (statsd_on)" in node.stderr.read()
    finally:
        if node.poll() is None:
            node.kill()
            node.wait(30)
        statsd.close()
        drop_namespace(config)
