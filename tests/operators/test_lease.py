"""``LeaseKeeper``: a failing heartbeat never kills the keeper; silence past the TTL is a lost lease."""

from __future__ import annotations

import time
from types import SimpleNamespace

from sqlalchemy.exc import OperationalError

from elastic_ops.operators.lease import LeaseKeeper
from elastic_ops.pool.api import Target, TargetAction
from elastic_ops.runtime.allocation import Allocation
from elastic_ops.runtime.outcome import Progress


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def target(workers: int) -> Target:
    return Target("j", workers, TargetAction.KEEP, "steady", (("a", 0),) * workers)


def test_a_raw_ledger_error_is_retried_and_silence_past_the_ttl_loses_the_lease():
    clock, outcomes = Clock(), []

    def heartbeat(job, epoch, *, workers, **_):
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    keeper = LeaseKeeper(SimpleNamespace(heartbeat=heartbeat), "j", 1, 2, interval_s=1, ttl_s=30, clock=clock)
    dropped = OperationalError("SELECT 1", {}, Exception("server closed the connection unexpectedly"))
    outcomes += [dropped, target(2)]
    clock.t += 10
    keeper.beat()  # a raw driver error: logged, not raised (it would end the heartbeat thread)
    assert keeper.current().workers == 2 and not keeper.lost
    clock.t += 10
    keeper.beat()  # succeeds: the silence starts again from here
    outcomes += [RuntimeError("bug"), dropped]
    clock.t += 29
    keeper.beat()
    assert not keeper.lost and keeper.current().workers == 2
    clock.t += 2  # 31 s without a successful heartbeat: the pool has expired the lease
    keeper.beat()
    assert keeper.lost and keeper.current().workers == 0


def test_the_heartbeat_thread_survives_errors():
    calls = []

    def heartbeat(job, epoch, *, workers, **_):
        calls.append(workers)
        if len(calls) < 3:
            raise RuntimeError("transient")
        return target(2)

    keeper = LeaseKeeper(SimpleNamespace(heartbeat=heartbeat), "j", 1, 2, interval_s=0.05, ttl_s=60).start()
    try:
        for _ in range(400):  # up to 20 s on a loaded machine; ~0.2 s normally
            if len(calls) >= 4:
                break
            time.sleep(0.05)
    finally:
        keeper.stop()
    assert len(calls) >= 4 and not keeper.lost


def test_heartbeats_carry_what_the_runner_measured_at_a_steady_count(tmp_path):
    """Boundaries at one worker count become iterations and seconds in the next heartbeat; a
    change of count starts timing afresh (a relaunch's start-up is not training); a failed
    heartbeat loses nothing; the pool keeps them per configuration."""
    from elastic_ops.pool import PoolClient

    clock = Clock()
    pool = PoolClient(f"sqlite:///{tmp_path / 'pool.db'}")
    pool.add_host("a", 4)
    pool.submit("j", min_workers=1, max_workers=4)
    g = pool.request("j")
    failing = [True]

    def heartbeat(job, epoch, **kw):
        if failing.pop(0) if failing else False:
            raise RuntimeError("transient")
        return pool.heartbeat(job, epoch, **kw)

    keeper = LeaseKeeper(SimpleNamespace(heartbeat=heartbeat), "j", g.epoch, 4, interval_s=1, clock=clock)
    keeper.applied(0, Allocation.split(4, "h", [0, 1, 2, 3]))

    def boundary(it: int, workers: int, dt: float) -> None:
        clock.t += dt
        keeper.progressed(Progress(it, 100, None, workers, None, None))

    boundary(0, 4, 0)
    for it in range(1, 11):
        boundary(it, 4, 0.5)  # 10 iterations in 5 s on 4 workers
    keeper.beat()  # fails: kept for the next beat
    assert pool.observations("j") == []
    boundary(11, 2, 30.0)  # relaunched on 2: its start-up is not counted
    for it in range(12, 16):
        boundary(it, 2, 1.0)  # 4 iterations in 4 s on 2 workers
    keeper.beat()
    keeper.beat()
    obs = {o["workers"]: (o["iterations"], o["seconds"]) for o in pool.observations("j")}
    assert obs == {4: (10, 5.0), 2: (4, 4.0)}
    keeper.beat()  # nothing new measured: nothing sent
    assert sum(o["reports"] for o in pool.observations("j")) == 2


def test_an_adaptive_jobs_steps_batch_and_gradients_reach_the_pool_and_its_batch_comes_back(tmp_path):
    """A ``scaling: adaptive`` spec registers the batches it allows; its boundaries' optimizer
    steps (fewer than its iterations: a step at a larger batch advances the counter by its
    gain) are measured per (workers, hosts, batch), its gradient statistics go with them, and
    once the plan knows them the target's batch reaches the runner through the keeper."""
    from elastic_ops.pool import PoolClient
    from elastic_ops.utils.jobs import register
    from tests.runtime.builders import make_spec

    clock = Clock()
    spec = make_spec(tmp_path, name="adaptive", scaling="adaptive", max_global_batch=96, max_workers=8,
                     virtual_shards=8, global_batch=16)
    pool = PoolClient(f"sqlite:///{tmp_path / 'pool.db'}", policy="goodput", rescale_cost_s=0.0)
    pool.add_host("a", 8)
    register(pool, spec)
    g = pool.request("adaptive")
    keeper = LeaseKeeper(pool, "adaptive", g.epoch, g.workers, interval_s=1, clock=clock)
    keeper.beat()
    assert keeper.current().batch in (0, 16)  # nothing measured: its own batch
    noisy = dict(grad_sqr=0.01, grad_var=5.0)  # a noise scale far above its batch
    for step in range(20):
        clock.t += 0.5
        keeper.progressed(Progress(2 * step, 100, None, g.workers, None, None, steps=step, batch=16, **noisy))
    keeper.beat()
    (row,) = pool.observations("adaptive")
    assert (row["batch"], row["iterations"], row["seconds"]) == (16, 19, 9.5)  # steps, not iterations
    pool.plan()
    keeper.beat()
    assert keeper.current().batch > 16
