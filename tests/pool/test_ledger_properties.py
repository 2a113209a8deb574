"""Invariants of the ledger under random sequences of what its users do: jobs that ask, follow
their targets at boundaries, hand their slots to their next chunk, finish or vanish; operators
that drain hosts and change priorities and bounds; time that passes."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_ops.errors import LeaseExpiredError
from elastic_ops.pool import Grant, PoolClient, TargetAction

from .conftest import Clock, pg_schema_url
from .timeline import held_now, replay

JOBS = ("a", "b", "c")
HOSTS = ("h0", "h1")


class Driver:
    """Plays chunk tasks and operators against one ledger and checks every grant it gets."""

    def __init__(self, pool: PoolClient, clock: Clock, rng: random.Random) -> None:
        self.pool, self.clock, self.rng = pool, clock, rng
        self.bounds = {j: (1, 4) for j in JOBS}
        self.live: dict[str, tuple[int, int]] = {}  # job -> (epoch, workers it runs)
        self.parked: set[str] = set()

    def check_grant(self, job: str, grant: Grant) -> None:
        lo, hi = self.bounds[job]
        assert lo <= grant.workers <= hi, f"{job} granted {grant.workers} workers, bounds {lo}..{hi}"
        assert len(set(grant.placements)) == grant.workers, grant

    def step(self) -> None:
        rng, pool = self.rng, self.pool
        job = rng.choice(JOBS)
        op = rng.choices(["request", "beat", "end", "host", "priority", "bounds", "time", "fail", "finish"],
                         weights=[3, 3, 2, 2, 1, 1, 1, 1, 1])[0]
        if op == "request" and job not in self.live:
            pool.submit(job, min_workers=self.bounds[job][0], max_workers=self.bounds[job][1],
                        priority=rng.randint(1, 5))
            outcome = pool.request(job, new_attempt=job in self.parked or rng.random() < 0.5)
            self.parked.discard(job)
            if isinstance(outcome, Grant):
                self.check_grant(job, outcome)
                self.live[job] = (outcome.epoch, outcome.workers)
        elif op == "beat" and job in self.live:
            epoch, workers = self.live[job]
            try:
                target = pool.heartbeat(job, epoch, workers=workers)
                lo, hi = self.bounds[job]
                assert target.action == TargetAction.PREEMPT or lo <= target.workers <= hi, target
                if target.action == TargetAction.PREEMPT:
                    pool.heartbeat(job, epoch, workers=0)
                    del self.live[job]
                elif target.workers != workers:  # acts at its boundary, then says so
                    self.live[job] = (epoch, target.workers)
                    pool.heartbeat(job, epoch, workers=target.workers, placements=target.placements)
            except LeaseExpiredError:
                del self.live[job]
        elif op == "end" and job in self.live:
            epoch, _ = self.live.pop(job)
            how = rng.choices(["finished", "unfinished", "handover"], weights=[1, 1, 3])[0]
            pool.release(job, epoch, finished=how == "finished", handover=how == "handover")
            if how == "handover":
                self.parked.add(job)
        elif op == "host":
            pool.set_host_state(rng.choice(HOSTS), rng.choice(["up", "up", "draining", "down"]))
        elif op == "priority":
            pool.submit(job, min_workers=self.bounds[job][0], max_workers=self.bounds[job][1])
            pool.set_priority(job, rng.randint(1, 5))
        elif op == "bounds" and job not in self.live and job not in self.parked:
            lo = rng.randint(1, 3)
            self.bounds[job] = (lo, rng.randint(lo, 6))
            pool.submit(job, min_workers=self.bounds[job][0], max_workers=self.bounds[job][1])
        elif op == "fail" and job in self.live:  # a worker lost: the host is reported, the try ends
            epoch, _ = self.live.pop(job)
            pool.report_failure(job, rng.choice(HOSTS))
            pool.release(job, epoch)
        elif op == "finish":  # the run failed for good, whatever the job holds (parked or not)
            pool.submit(job, min_workers=self.bounds[job][0], max_workers=self.bounds[job][1])
            pool.finish(job)
            self.live.pop(job, None)
            self.parked.discard(job)
        elif op == "time":
            self.clock.advance(rng.choice([1.0, 5.0, 31.0]))  # 31: past the lease TTL

    def check_ledger(self) -> None:
        events = self.pool.events()
        replay(events)  # no slot ever held by two jobs; only a holder gives a slot back
        with self.pool.engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT host, slot, job FROM allocations")).all()
            leases = {r.job for r in conn.execute(sa.text("SELECT job FROM leases WHERE ended IS NULL"))}
        allocations = {(r.host, r.slot): r.job for r in rows}
        assert held_now(events) == allocations, "the event log and the allocations table disagree"
        holders = set(allocations.values())
        assert holders <= leases, f"slots held without a live lease: {holders - leases}"
        assert leases <= holders, f"live leases that hold no slot: {leases - holders}"


def play(url: str, seed: int, steps: int = 60) -> None:
    clock = Clock()
    pool = PoolClient(url, clock=clock, lease_ttl_s=30,
                      policy=random.Random(seed).choice(["priority", "fairshare"]), aging_s=0.0)
    for host in HOSTS:
        pool.add_host(host, 4)
    driver = Driver(pool, clock, random.Random(seed))
    try:
        for _ in range(steps):
            driver.step()
            driver.check_ledger()
    finally:
        pool.close()


@settings(max_examples=60)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_operations_keep_the_ledger_consistent_and_every_grant_within_bounds(seed):
    with tempfile.TemporaryDirectory() as tmp:
        play(f"sqlite:///{Path(tmp) / 'pool.db'}", seed)


@pytest.mark.postgres
@settings(max_examples=20, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_the_same_on_postgresql(postgres_url, seed):
    url, cleanup = pg_schema_url(postgres_url)  # a fresh schema per example
    try:
        play(url, seed)
    finally:
        cleanup()
