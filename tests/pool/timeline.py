"""Replaying the ledger's event log into allocation timelines (shared by several tests), through
the pool's one replay (``elastic_ops.pool.api.slot_events``)."""

from __future__ import annotations

from elastic_ops.pool.api import slot_events


def replay(events: list[dict]) -> list[dict[str, int]]:
    """Apply slot events in order; fail if a slot is ever held by two jobs or freed by a non-holder.

    Returns the worker count per job after each slot event (the allocation timeline).
    """
    owner: dict[tuple[str, int], str] = {}
    timeline = []
    for e in slot_events(events):
        for slot in e.slots:
            if e.gives:
                assert slot not in owner, f"slot {slot} granted to {e.job} while held by {owner[slot]}"
                owner[slot] = e.job
            else:
                assert owner.get(slot) == e.job, f"{e.job} released {slot} held by {owner.get(slot)}"
                del owner[slot]
        counts: dict[str, int] = {}
        for job in owner.values():
            counts[job] = counts.get(job, 0) + 1
        timeline.append(counts)
    return timeline


def held_now(events: list[dict]) -> dict[tuple[str, int], str]:
    owner: dict[tuple[str, int], str] = {}
    for e in slot_events(events):
        for slot in e.slots:
            if e.gives:
                owner[slot] = e.job
            else:
                owner.pop(slot, None)
    return owner
