"""``LeaseKeeper``: a failing heartbeat never kills the keeper; silence past the TTL is a lost lease."""

from __future__ import annotations

import time
from types import SimpleNamespace

from sqlalchemy.exc import OperationalError

from elastic_ops.operators.lease import LeaseKeeper


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def target(workers: int) -> SimpleNamespace:
    return SimpleNamespace(action="keep", workers=workers, reason="steady", placements=[("a", 0)] * workers)


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
    assert keeper.wanted() == 2 and not keeper.lost
    clock.t += 10
    keeper.beat()  # succeeds: the silence starts again from here
    outcomes += [RuntimeError("bug"), dropped]
    clock.t += 29
    keeper.beat()
    assert not keeper.lost and keeper.wanted() == 2
    clock.t += 2  # 31 s without a successful heartbeat: the pool has expired the lease
    keeper.beat()
    assert keeper.lost and keeper.wanted() == 0


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
