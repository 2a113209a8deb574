"""``ElasticChunkOperator`` hands the runner the GPU slots its grant (then every heartbeat) names on
the task's own host, in-process and through the agent: two jobs sharing one 8-GPU host 4/4 must
not both train on GPUs 0..3. The runner is replaced by a fake that reads those slots the way the
real one does (in each ``target(i)``'s allocation); ``LeaseKeeper.beat`` is called directly, so no
test waits for a heartbeat."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from elastic_ops.operators import ElasticChunkOperator
from elastic_ops.operators.lease import LeaseKeeper
from elastic_ops.pool import PoolClient
from elastic_ops.pool.api import Target, TargetAction
from elastic_ops.runtime.allocation import Allocation
from elastic_ops.runtime.outcome import ChunkResult, ChunkStatus
from elastic_ops.utils.jobs import job_id
from tests.operators.helpers import TINY_FIELDS, airflow_pool

FIELDS = TINY_FIELDS | {"max_workers": 4}
JOB = job_id("d", "train", "run1")


@pytest.fixture
def pool(monkeypatch, tmp_path) -> PoolClient:
    monkeypatch.delenv("ELASTIC_OPS_AGENT_SOCKET", raising=False)
    client = airflow_pool(monkeypatch, tmp_path, "gpu-a", 8)
    # the first job on the host holds slots 0..3 for the whole test
    client.submit("first", min_workers=4, max_workers=4, priority=5, preemptible=False)
    assert [s for _, s in client.request("first").placements] == [0, 1, 2, 3]
    return client


def result(start: int, end: int) -> ChunkResult:
    return ChunkResult(
        status=ChunkStatus.COMPLETED,
        start=start,
        end=end,
        iteration=end,
        checkpoint_uri=None,
        loss=0.5,
        metrics={},
        workers_timeline=[(start, 4, 0.0)],
        samples_per_sec=1.0,
        duration_s=1.0,
        param_sha256=None,
    )


def held(pool: PoolClient, job: str) -> list[tuple[str, int]]:
    (row,) = [j for j in pool.status()["jobs"] if j["name"] == job]
    return sorted(tuple(p) for p in row["placements"])


def shrink_then_check(pool: PoolClient, keeper: LeaseKeeper, take) -> list[tuple[int, tuple]]:
    """What the runner sees on gpu-a: the grant's count and slots, then those of a shrink to 2."""
    first = take(0)
    seen = [(first.workers, first.on("gpu-a"))]
    pool.set_bounds(JOB, 1, 2)
    keeper.beat()  # the heartbeat that brings the shrink
    shrunk = take(5)
    seen.append((shrunk.workers, shrunk.on("gpu-a")))
    return seen


def test_the_runner_in_the_task_gets_the_granted_slots_of_its_host(pool, monkeypatch):
    seen = []

    def fake_run_chunk(spec, start, end, *, target, **kwargs):
        seen.extend(shrink_then_check(pool, target.__self__, target))
        return result(start, end)

    monkeypatch.setattr("elastic_ops.runtime.run_chunk", fake_run_chunk)
    op = ElasticChunkOperator(task_id="chunk_0", spec_fields=FIELDS, chunk_index=0, group_id="train")
    out = op.execute({"dag": SimpleNamespace(dag_id="d"), "run_id": "run1"})
    assert out["status"] == "completed" and out["hosts"] == ["gpu-a"]
    (n0, s0), (n1, s1) = seen
    assert (n0, s0) == (4, (4, 5, 6, 7))  # the second job's slots on the shared host, not 0..3
    assert n1 == 2 and len(s1) == 2 and set(s1) <= {4, 5, 6, 7}  # the kept slots of the shrink


def test_the_agent_path_forwards_the_same_slots(pool, monkeypatch, tmp_path):
    seen = []

    def fake_agent_run(self, spec, start, end, *, target, **kwargs):
        keeper = target.__self__
        seen.extend(shrink_then_check(pool, keeper, lambda i: target()))
        keeper.applied(5, Allocation(2))
        keeper.beat()  # reports the smaller count: the pool frees the slots the shrink gave up
        seen.append(held(pool, JOB))
        return result(start, end)

    monkeypatch.setenv("ELASTIC_OPS_AGENT_SOCKET", str(tmp_path / "agent.sock"))
    monkeypatch.setattr("elastic_ops.agent.client.AgentClient.run_chunk", fake_agent_run)
    monkeypatch.setattr("elastic_ops.agent.client.AgentClient.latest", lambda self, store, h: None)
    op = ElasticChunkOperator(task_id="chunk_0", spec_fields=FIELDS, chunk_index=0, group_id="train")
    out = op.execute({"dag": SimpleNamespace(dag_id="d"), "run_id": "run1"})
    assert out["status"] == "completed"
    (n0, s0), (n1, s1), after = seen
    assert (n0, s0) == (4, (4, 5, 6, 7)) and n1 == 2
    assert after == [("gpu-a", s) for s in sorted(s1)]  # the slots it runs on are the ones it keeps


def test_the_keepers_target_carries_the_slots_of_the_same_heartbeat_host_by_host():
    targets = [Target("j", 3, TargetAction.GROW, "more", (("a", 1), ("b", 0), ("a", 3)))]
    client = SimpleNamespace(heartbeat=lambda job, epoch, workers: targets[-1])
    keeper = LeaseKeeper(client, "j", 1, 1, interval_s=1, placements=[("b", 2), ("a", 0)], host="a")
    first = keeper.target(0)
    assert first.workers == 1 and first.on("a") == (0,) and first.elsewhere("a") == (("b", (2,)),)
    keeper.beat()
    grown = keeper.target(3)
    assert grown.workers == 3 and grown.on("a") == (1, 3) and grown.elsewhere("a") == (("b", (0,)),)
    targets.append(Target("j", 0, TargetAction.PREEMPT, "", ()))
    keeper.beat()
    assert keeper.current() == Allocation(0, ())


def test_the_keeper_reports_a_shrink_only_when_the_smaller_segment_starts():
    reported = []

    def heartbeat(job, epoch, workers):
        reported.append(workers)
        return Target("j", 2, TargetAction.SHRINK, "", (("a", 0), ("a", 1)))

    keeper = LeaseKeeper(SimpleNamespace(heartbeat=heartbeat), "j", 1, 4, interval_s=1, host="a")
    keeper.beat()
    assert keeper.target(10).workers == 2  # decided ahead of the boundary, the old workers still run
    keeper.beat()
    keeper.applied(10, Allocation(2))  # the 2-worker segment starts: the 4 old workers have exited
    keeper.beat()
    assert reported == [4, 4, 2]
