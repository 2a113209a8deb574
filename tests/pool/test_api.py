"""The event log speaks one vocabulary (``EventKind``) and is replayed one way (``slot_events``):
whatever the ledger does, every row it writes is of a declared kind, and replaying the slot
events of a whole job's life never holds a slot twice and ends holding nothing."""

from __future__ import annotations

from elastic_ops.pool import PoolClient
from elastic_ops.pool.api import GIVES, EventKind, slot_events
from tests.pool.timeline import replay


def test_every_event_the_ledger_writes_is_of_a_declared_kind_and_replays_to_nothing_held(tmp_path):
    pool = PoolClient(f"sqlite:///{tmp_path / 'pool.db'}", aging_s=0.0)
    pool.add_host("h1", 4)
    pool.submit("a", min_workers=1, max_workers=4)
    a = pool.request("a")
    pool.submit("b", min_workers=2, max_workers=2, priority=9, preemptible=False)
    pool.heartbeat("a", a.epoch, workers=a.workers)  # b's demand shrinks a
    pool.heartbeat("a", a.epoch, workers=2)
    b = pool.request("b")
    pool.report_failure("a", "h1")
    pool.release("b", b.epoch, finished=True)
    pool.release("a", a.epoch, finished=True)
    events = pool.events()
    kinds = {e["kind"] for e in events}
    assert kinds <= set(EventKind) and {"grant", "shrink", "release", "submit", "failure"} <= kinds
    assert replay(events)[-1] == {}  # no slot held twice or freed by another job; nothing left held
    assert all(ev.gives is (ev.kind in GIVES) for ev in slot_events(events))
