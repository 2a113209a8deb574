"""A drained host's job moves off at its next iteration boundary (issue #3), through
``ElasticChunkOperator`` with a real SQLite pool: at the boundary the runner relaunches the same
count on the new slots, the lease keeper heartbeats them as ``placements=``, and from then on the
ledger holds only the new slots, none on the drained host. In the task process the real runner
trains; on the agent path the agent's client is faked (the real agent's side of a move is in
tests/runtime/test_agent.py). Heartbeats are sent directly (``keeper.beat()``), so no test waits
for one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from elastic_ops.operators import ElasticChunkOperator
from elastic_ops.pool import PoolClient
from elastic_ops.pool.api import Target, TargetAction
from elastic_ops.runtime.allocation import Allocation
from elastic_ops.runtime.chunk import run_chunk as real_run_chunk
from elastic_ops.utils.jobs import job_id
from tests.operators.helpers import TINY_FIELDS, airflow_pool
from tests.operators.test_gpu_slots import held, result

pytestmark = pytest.mark.timeout(300)

JOB = job_id("d", "train", "run1")
OLD = [("gpu-a", 0), ("gpu-a", 1)]
NEW = [("gpu-b", 0), ("gpu-b", 1)]


@pytest.fixture
def pool(monkeypatch, tmp_path) -> PoolClient:
    monkeypatch.delenv("ELASTIC_OPS_AGENT_SOCKET", raising=False)
    return airflow_pool(monkeypatch, tmp_path, "gpu-a", 2)


def drain(pool: PoolClient, keeper) -> None:
    """gpu-b joins, gpu-a drains, and the keeper's next heartbeat brings the move."""
    pool.add_host("gpu-b", 2)
    pool.drain_host("gpu-a")
    keeper.beat()
    now = keeper.current()
    assert now.workers == 2 and now.on("gpu-a") == ()  # same count, none left on gpu-a


def execute() -> dict:
    op = ElasticChunkOperator(task_id="chunk_0", spec_fields=TINY_FIELDS, chunk_index=0, group_id="train")
    return op.execute({"dag": SimpleNamespace(dag_id="d"), "run_id": "run1"})


def test_the_job_in_the_task_moves_off_a_drained_host_at_its_next_boundary(pool, monkeypatch):
    seen = []

    def run_chunk(spec, start, end, *, target, on_segment, **kwargs):
        keeper = target.__self__

        def pool_target(i: int) -> Allocation:  # the host drains once iteration 8 is decided
            if i >= 8 and not pool.status()["hosts"][1:]:
                drain(pool, keeper)
            return target(i)

        def started(i: int, running: Allocation) -> None:
            on_segment(i, running)
            keeper.beat()  # the heartbeat applied() wakes the keeper for, sent here at once
            seen.append((i, running.workers, running.on("gpu-a"), held(pool, JOB)))

        return real_run_chunk(spec, start, end, target=pool_target, on_segment=started, **kwargs)

    monkeypatch.setattr("elastic_ops.runtime.run_chunk", run_chunk)
    out = execute()
    assert out["status"] == "completed" and out["iterations"] == 20
    (i0, n0, on0, held0), (i1, n1, on1, held1) = seen
    assert (i0, n0, on0, held0) == (0, 2, (0, 1), OLD)
    # relaunched at a boundary after the drain with the same count, on no slot of gpu-a; the
    # heartbeat that reports it releases gpu-a's slots at once
    assert i1 >= 8 and n1 == 2 and on1 == () and held1 == NEW
    assert [n for _, n, _ in out["workers_timeline"]] == [2, 2]


def test_the_agent_path_reports_the_move_the_same_way(pool, monkeypatch, tmp_path):
    seen = []

    def fake_agent_run(self, spec, start, end, *, target, on_applied, **kwargs):
        keeper = target.__self__

        def here() -> Allocation:  # what the agent on gpu-a runs of the target
            now = target()
            return Allocation.split(now.workers, "gpu-a", now.on("gpu-a"))

        on_applied(0, here())  # the agent's first 'applied': 2 workers on gpu-a 0, 1
        keeper.beat()
        seen.append(held(pool, JOB))
        drain(pool, keeper)
        seen.append(held(pool, JOB))  # told to move: the old slots stay the job's until it has
        on_applied(10, here())  # the agent relaunched at boundary 10 on the new target
        keeper.beat()
        seen.append(held(pool, JOB))
        return result(start, end)

    monkeypatch.setenv("ELASTIC_OPS_AGENT_SOCKET", str(tmp_path / "agent.sock"))
    monkeypatch.setattr("elastic_ops.agent.client.AgentClient.run_chunk", fake_agent_run)
    monkeypatch.setattr("elastic_ops.agent.client.AgentClient.latest", lambda self, store, h: None)
    assert execute()["status"] == "completed"
    assert seen == [OLD, sorted(OLD + NEW), NEW]


def test_a_keeper_lists_the_running_segment_s_slots_in_every_heartbeat():
    calls = []
    target = Target("j", 2, TargetAction.KEEP, "", (("a", 0), ("a", 1)))

    def heartbeat(job, epoch, workers, **kwargs):
        calls.append((workers, kwargs.get("placements")))
        return target

    from elastic_ops.operators.lease import LeaseKeeper

    keeper = LeaseKeeper(SimpleNamespace(heartbeat=heartbeat), "j", 1, 2, interval_s=1, host="a")
    keeper.beat()  # no segment started yet: the count only
    keeper.applied(0, Allocation.split(2, "a", (0, 1)))
    keeper.beat()
    keeper.applied(7, Allocation.split(2, "a", (3, 2)))  # a move at the same count
    keeper.beat()
    keeper.applied(9, Allocation(1))  # slots not known: the count only, as before placements
    keeper.beat()
    assert calls == [
        (2, None),
        (2, (("a", 0), ("a", 1))),
        (2, (("a", 3), ("a", 2))),
        (1, None),
    ]
    hostless = LeaseKeeper(SimpleNamespace(heartbeat=heartbeat), "j", 1, 2, interval_s=1)
    hostless.applied(0, Allocation.split(2, "a", (0, 1)))  # a keeper that knows no host: count only
    hostless.beat()
    assert calls[-1] == (2, None)
