"""Graceful drain on a termination notice: SIGTERM to a node agent's process (or a drain sent to a
node or to the per-host agent) commits every running chunk at its next iteration boundary, ends
it as a preemption (no host blamed), and the agent exits within the grace; the chunk resumes on
another host from that fresh checkpoint, bitwise. A chunk that reaches no boundary within the
grace is killed and retried from its last commit. Real processes, real Redis."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from types import SimpleNamespace

import psutil
import pytest

from elastic_ops.agent.client import AgentClient
from elastic_ops.agent.node import NodeAgent
from elastic_ops.agent.node_client import NodeClient
from elastic_ops.agent.server import Agent, check_grace
from elastic_ops.checkpoint import open_store
from elastic_ops.errors import AgentLostError, NodeUnavailableError, SpecError, WorkerLostError
from elastic_ops.runtime import ChunkStatus, run_chunk
from tests.agent.node_helpers import REDIS_URL, SECRET, cli_node, drop_namespace, make_config, running_node
from tests.agent.test_node import run_on, store_of, wait_for
from tests.recording_metrics import RecordingMetrics
from tests.runtime.agent_helpers import as_target, running_agent
from tests.runtime.builders import make_spec

pytestmark = pytest.mark.timeout(300)

# no periodic commit before the notice: without a drain, a kill loses everything trained so far
SLOW = dict(total_iterations=100_000, checkpoint_interval=5000, params={"sleep_s": 0.01})


def reference(tmp_path, iterations: int) -> str:
    """The same job trained in this process on one worker, uninterrupted."""
    return run_chunk(make_spec(tmp_path / "ref", **SLOW), 0, iterations, target=lambda i: 1).param_sha256


def in_background(run, ready):
    """``run(on_progress)`` in a thread; returns ``(thread, outcome)`` once a progress message
    passes ``ready`` (``outcome``: ``result`` or ``error``, and ``seen``, the last iteration)."""
    started, outcome = threading.Event(), {"seen": -1}

    def progress(p) -> None:
        outcome["seen"] = p.iteration
        if ready(p):
            started.set()

    def task() -> None:
        try:
            outcome["result"] = run(progress)
        except BaseException as exc:  # the test checks it
            outcome["error"] = exc
        started.set()

    thread = threading.Thread(target=task, daemon=True)
    thread.start()
    assert started.wait(120), "no progress of the chunk"
    assert "error" not in outcome, outcome.get("error")
    return thread, outcome


def test_sigterm_to_a_node_process_commits_at_the_next_boundary_and_it_exits(redis_url, tmp_path):
    config = make_config()
    client = NodeClient(config, accept_timeout_s=10.0, peer_timeout_s=5.0)
    cli, env = cli_node("host-t", config)
    node = subprocess.Popen([*cli, "--grace", "60"], env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    spec = make_spec(tmp_path, **SLOW)
    try:
        wait_for("the node to announce itself", lambda: client.alive("host-t") is not None, 120)
        thread, outcome = in_background(
            lambda progress: run_on(config, "host-t", spec, 0, 100_000, client=client, on_progress=progress),
            ready=lambda p: p.iteration >= 30,
        )
        notice = outcome["seen"]
        node.send_signal(signal.SIGTERM)  # the spot instance's notice
        assert node.wait(60) == 0  # within the grace, having ended its chunk
        thread.join(30)
        result = outcome.get("result")
        assert result is not None, outcome.get("error")  # no error: nothing to blame a host for
        assert result.status == ChunkStatus.PREEMPTED and result.iteration >= notice
        latest = open_store(spec.checkpoint).latest()
        assert latest.iteration == result.iteration  # committed at the boundary after the notice
        assert client.alive("host-t") is None
        log = node.stderr.read()
        assert "draining" in log and "preempted at iteration" in log

        # the chunk continues on another host from that checkpoint, bitwise as if uninterrupted
        with running_node("host-u", config):
            end = result.iteration + 20
            resumed = run_on(config, "host-u", spec, result.iteration, end)
        assert resumed.status == ChunkStatus.COMPLETED
        assert resumed.param_sha256 == reference(tmp_path, end)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            for p in psutil.Process(node.pid).children(recursive=True) + [psutil.Process(node.pid)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        node.wait(30)
        drop_namespace(config)


def test_a_chunk_that_reaches_no_boundary_within_the_grace_is_killed_and_retried_from_its_last_commit(
    redis_url, tmp_path
):
    config = make_config()
    gate = tmp_path / "gate"  # the worker holds at iteration 25 until it exists: no boundary comes
    spec = make_spec(tmp_path, total_iterations=40, checkpoint_interval=10,
                     params={"hold_at": 25, "hold_file": str(gate)})
    try:
        with running_node("host-h", config, grace_s=2.0) as node:
            client = NodeClient(config, accept_timeout_s=10.0, peer_timeout_s=5.0)
            thread, outcome = in_background(
                lambda progress: run_on(config, "host-h", spec, 0, 40, client=client, on_progress=progress),
                ready=lambda p: p.iteration >= 24,
            )
            wait_for("the periodic commit at 20", lambda: (open_store(spec.checkpoint).latest() or
                                                            SimpleNamespace(iteration=0)).iteration == 20)
            client.drain("host-h")  # the node's own grace: 2 s
            thread.join(60)
            wait_for("the node to stop", lambda: not node.sessions, 60)
        err = outcome.get("error")
        assert isinstance(err, AgentLostError) and err.retryable  # killed by its agent:
        assert not isinstance(err, WorkerLostError)  # not held against the host
        assert open_store(spec.checkpoint).latest().iteration == 20  # nothing corrupted, nothing newer
        gate.write_text("go")
        # the retry: a new lease, from the last commit
        retried = run_chunk(spec, 0, 40, target=lambda i: 1, epoch=2)
        assert retried.status == ChunkStatus.COMPLETED and retried.iteration == 40
        ref = make_spec(tmp_path / "ref", total_iterations=40, checkpoint_interval=10,
                        params={"hold_at": 25, "hold_file": str(gate)})
        assert retried.param_sha256 == run_chunk(ref, 0, 40, target=lambda i: 1).param_sha256
    finally:
        gate.write_text("go")
        drop_namespace(config)


def test_a_drained_node_ends_its_chunk_as_a_preemption_and_the_task_continues_on_another_host(
    redis_url, monkeypatch, tmp_path
):
    """Under the chunk operator: the drain (``elastic-ops node --drain``'s request over Redis)
    ends the chunk as a preemption, the node drains its host in the pool, the task asks again and
    finishes on host-b, bitwise; no failure is reported, no host blamed."""
    from elastic_ops.operators import ElasticChunkOperator
    from tests.operators.helpers import TINY_FIELDS, airflow_pool

    config = make_config()
    monkeypatch.setenv("ELASTIC_OPS_NODE_REDIS_URL", REDIS_URL)
    monkeypatch.setenv("ELASTIC_OPS_NODE_SECRET", SECRET)
    monkeypatch.setenv("ELASTIC_OPS_NODE_NAMESPACE", config.namespace)
    pool = airflow_pool(monkeypatch, tmp_path, host="host-a", slots=2)
    pool.add_host("host-b", 2)
    fields = {**TINY_FIELDS, "total_iterations": 600, "chunk_iterations": 600, "params": {"sleep_s": 0.01}}
    op = ElasticChunkOperator(task_id="chunk_0", spec_fields=fields, chunk_index=0, group_id="train")
    context = {"dag": SimpleNamespace(dag_id="d"), "run_id": "run1"}
    try:
        with (
            running_node("host-a", config, pool_url=pool.url) as node_a,
            running_node("host-b", config) as node_b,
        ):
            out: dict = {}
            thread = threading.Thread(target=lambda: out.update(op.execute(context)), daemon=True)
            thread.start()
            wait_for("the chunk to train on host-a", lambda: _seen(node_a), 120)
            NodeClient(config).drain("host-a", grace_s=60)
            thread.join(120)
            assert node_b.accepted == 1
        assert out["status"] == "completed" and out["iterations"] == 600 and out["preemptions"] == 1
        assert out["trained_on"] == ["host-a", "host-b"]
        assert not [e for e in pool.events() if e["kind"] == "failure"]  # a preemption, not a failure
        assert {h["name"]: h["state"] for h in pool.status()["hosts"]}["host-a"] == "draining"
        spec = make_spec(tmp_path / "ref", **{k: v for k, v in fields.items() if k not in (
            "chunk_iterations", "priority")})
        assert out["param_sha256"] == run_chunk(spec, 0, 600, target=lambda i: 1).param_sha256
    finally:
        drop_namespace(config)


def _seen(node: NodeAgent) -> bool:
    """Whether the node's chunk has run its first segment (the task learnt the slots)."""
    return any(getattr(s, "applied", None) is not None for s in list(node.sessions.values()))


def test_sigterm_drains_the_per_host_agent_too(tmp_path):
    spec = make_spec(tmp_path, **SLOW)
    with running_agent(tmp_path / "agent", grace_s=60) as agent:
        thread, outcome = in_background(
            lambda progress: AgentClient(agent.path).run_chunk(
                spec.to_dict(), 0, 100_000, epoch=1, host="h1", store=store_of(spec),
                target=as_target("h1", lambda: 1), on_progress=progress),
            ready=lambda p: p.iteration >= 30,
        )
        notice = outcome["seen"]
        reply = AgentClient(agent.path).drain()  # what its SIGTERM does
        assert reply["type"] == "draining" and reply["chunks"] == 1 and reply["grace_s"] == 60
        thread.join(60)
        result = outcome.get("result")
        assert result is not None, outcome.get("error")
        assert result.status == ChunkStatus.PREEMPTED and result.iteration >= notice
        assert open_store(spec.checkpoint).latest().iteration == result.iteration
        wait_for("the agent to stop serving", lambda: not (tmp_path / "agent" / "agent.sock").exists(), 60)


def test_drain_settings_are_validated_where_they_enter(redis_url, tmp_path, capsys):
    from elastic_ops.cli import main as cli_main

    assert check_grace("--grace", "45") == 45.0 and check_grace("--grace", 0) == 0.0
    for bad in ("abc", "-1", "nan", "inf", "3601", True, None, [5]):
        with pytest.raises(SpecError, match="invalid --grace=.*a number of seconds from 0"):
            check_grace("--grace", bad)
    config = make_config()
    with pytest.raises(SpecError, match="--grace"):
        NodeAgent("host-v", config, grace_s=-3)
    with pytest.raises(SpecError, match="--grace"):
        Agent(str(tmp_path / "a.sock"), grace_s=float("nan"))
    assert cli_main(["agent", "--socket", str(tmp_path / "a.sock"), "--grace", "soon"]) == 2
    err = capsys.readouterr().err
    assert "invalid --grace='soon': a number of seconds from 0 (kill at once) to 3600" in err
    env = {"ELASTIC_OPS_NODE_REDIS_URL": REDIS_URL, "ELASTIC_OPS_NODE_SECRET": SECRET,
           "ELASTIC_OPS_NODE_NAMESPACE": config.namespace}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        assert cli_main(["node", "--host", "host-v", "--drain", "--grace", "-5"]) == 2
        assert "invalid --grace='-5'" in capsys.readouterr().err
        assert cli_main(["node", "--host", "host-v", "--drain", "--register-slots", "2"]) == 2
        assert "invalid --register-slots='2': not with --drain" in capsys.readouterr().err
        assert cli_main(["node", "--host", "host-v", "--drain"]) == 2  # no node runs for host-v
        assert "no elastic-ops node agent is running for host host-v" in capsys.readouterr().err
    with pytest.raises(NodeUnavailableError):
        NodeClient(config).drain("host-v")
    try:  # a drain with a bad grace sent to a node (by a client that skipped the check) drains nothing
        metrics = RecordingMetrics()
        with running_node("host-w", config, metrics=metrics) as node:
            runs = config.runs_key("host-w")
            body = {"seq": 1, "kind": "drain", "session": "ab" * 16, "issued": time.time(),
                    "msg": {"grace_s": -1}}
            config.redis().rpush(runs, config.signer().seal(runs, body))
            wait_for("the refusal", lambda: metrics.values("node.requests_refused"), 30)
            assert [t["reason"] for _, n, _, t in metrics.sent if n == "node.requests_refused"] == ["invalid"]
            assert not node.draining and NodeClient(config).alive("host-w") is not None
    finally:
        drop_namespace(config)
