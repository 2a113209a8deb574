"""The seed scenario: 8 slots, `priority` policy, graceful preemption (see docs/pool.md)."""

from __future__ import annotations

from elastic_ops.pool import Grant, PoolClient, TargetAction, Wait

from .timeline import replay


def workers(client: PoolClient) -> dict[str, int]:
    return {j["name"]: j["workers"] for j in client.status()["jobs"] if j["state"] != "finished"}


def test_seed_scenario(ledger_url, clock):
    pool = PoolClient(ledger_url, clock=clock, policy="priority", preemption="graceful")
    pool.add_host("gpu-0", 8)

    # Job 1 alone -> 8.
    pool.submit("job1", min_workers=1, max_workers=8, priority=3)
    g1 = pool.request("job1")
    assert isinstance(g1, Grant) and g1.workers == 8
    assert pool.heartbeat("job1", g1.epoch, workers=8).action == TargetAction.KEEP

    # Job 2 arrives with the same priority: it waits until job 1 gives up 4 at a boundary.
    clock.advance(30)
    pool.submit("job2", min_workers=1, max_workers=8, priority=3)
    w = pool.request("job2")
    assert isinstance(w, Wait) and "released" in w.reason
    t = pool.heartbeat("job1", g1.epoch, workers=8)
    assert (t.action, t.workers) == (TargetAction.SHRINK, 4)
    assert workers(pool) == {"job1": 8, "job2": 0}  # nothing is taken before the boundary
    clock.advance(1)
    assert pool.heartbeat("job1", g1.epoch, workers=4).action == TargetAction.KEEP
    g2 = pool.request("job2")
    assert isinstance(g2, Grant) and g2.workers == 4
    assert workers(pool) == {"job1": 4, "job2": 4}

    # Job 2's priority is raised: weights 3:5 -> 3 / 5.
    clock.advance(30)
    pool.set_priority("job2", 5)
    t2 = pool.heartbeat("job2", g2.epoch, workers=4)
    assert (t2.action, t2.workers) == (TargetAction.KEEP, 4)  # its 5th slot is still job 1's
    t1 = pool.heartbeat("job1", g1.epoch, workers=4)
    assert (t1.action, t1.workers) == (TargetAction.SHRINK, 3)
    clock.advance(1)
    pool.heartbeat("job1", g1.epoch, workers=3)
    t2 = pool.heartbeat("job2", g2.epoch, workers=4)
    assert (t2.action, t2.workers) == (TargetAction.GROW, 5)
    assert workers(pool) == {"job1": 3, "job2": 5}

    # Job 1 finishes: job 2 gets all 8.
    clock.advance(30)
    assert pool.release("job1", g1.epoch, finished=True) is True
    t2 = pool.heartbeat("job2", g2.epoch, workers=5)
    assert (t2.action, t2.workers) == (TargetAction.GROW, 8)
    assert workers(pool) == {"job2": 8}

    # The allocation sequence, replayed from the event log, never gives a slot to two jobs.
    timeline = replay(pool.events())
    compact = [tuple(sorted(c.items())) for c in timeline]
    assert compact == [
        (("job1", 8),),
        (("job1", 4),),
        (("job1", 4), ("job2", 4)),
        (("job1", 3), ("job2", 4)),
        (("job1", 3), ("job2", 5)),
        (("job2", 5),),
        (("job2", 8),),
    ]
    kinds = [e["kind"] for e in pool.events("job1") if e["kind"] in {"grant", "shrink", "release"}]
    assert kinds == ["grant", "shrink", "shrink", "release"]
