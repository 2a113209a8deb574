"""``ElasticChunkOperator`` hands the runner the GPU slots its grant (then every heartbeat) names on
the task's own host, in-process and through the agent: two jobs sharing one 8-GPU host 4/4 must
not both train on GPUs 0..3. The runner is replaced by a fake that reads those slots the way the
real one does (right after each ``target(i)``); ``LeaseKeeper.beat`` is called directly, so no
test waits for a heartbeat."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from elastic_ops.operators import ElasticChunkOperator
from elastic_ops.operators.jobs import job_id
from elastic_ops.operators.lease import LeaseKeeper
from elastic_ops.pool import PoolClient
from elastic_ops.runtime.outcome import ChunkResult, ChunkStatus
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


def shrink_then_check(pool: PoolClient, keeper: LeaseKeeper, take, slots) -> list[tuple[int, tuple]]:
    """What the runner sees: the grant's count and slots, then those of a shrink to 2."""
    seen = [(take(0), slots())]
    pool.set_bounds(JOB, 1, 2)
    keeper.beat()  # the heartbeat that brings the shrink
    seen.append((take(5), slots()))
    return seen


def test_the_runner_in_the_task_gets_the_granted_slots_of_its_host(pool, monkeypatch):
    seen = []

    def fake_run_chunk(spec, start, end, *, target, slots, **kwargs):
        seen.extend(shrink_then_check(pool, target.__self__, target, slots))
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

    def fake_agent_run(self, spec, start, end, *, wanted, slots, **kwargs):
        keeper = wanted.__self__
        seen.extend(shrink_then_check(pool, keeper, lambda i: wanted(), slots))
        keeper.applied(5, 2)
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


def test_the_keeper_returns_only_the_slots_on_its_own_host():
    target = SimpleNamespace(
        action="grow", workers=3, reason="more", placements=(("a", 1), ("b", 0), ("a", 3))
    )
    client = SimpleNamespace(heartbeat=lambda job, epoch, workers: target)
    keeper = LeaseKeeper(client, "j", 1, 1, interval_s=1, placements=[("b", 2), ("a", 0)], host="a")
    assert keeper.target(0) == 1 and keeper.slots() == (0,)
    keeper.beat()
    assert keeper.slots() == (0,)  # not taken yet: the runner still runs the old target
    assert keeper.target(3) == 3 and keeper.slots() == (1, 3)
    target.action, target.workers, target.placements = "preempt", 0, ()
    keeper.beat()
    assert keeper.wanted() == 0 and keeper.slots() == ()


def test_the_keeper_reports_a_shrink_only_when_the_smaller_segment_starts():
    reported = []
    target = SimpleNamespace(action="keep", workers=4, reason="", placements=(("a", s) for s in range(4)))

    def heartbeat(job, epoch, workers):
        reported.append(workers)
        return target

    keeper = LeaseKeeper(SimpleNamespace(heartbeat=heartbeat), "j", 1, 4, interval_s=1, host="a")
    target.action, target.workers, target.placements = "shrink", 2, (("a", 0), ("a", 1))
    keeper.beat()
    assert keeper.target(10) == 2  # decided ahead of the boundary, the old workers still run
    keeper.beat()
    keeper.applied(10, 2)  # the 2-worker segment starts: the 4 old workers have exited
    keeper.beat()
    assert reported == [4, 4, 2]
