"""Replaying the ledger's event log into allocation timelines (shared by several tests)."""

from __future__ import annotations

ADD = {"grant", "grow"}
REMOVE = {"shrink", "release", "expiry"}


def replay(events: list[dict]) -> list[dict[str, int]]:
    """Apply slot events in order; fail if a slot is ever held by two jobs or freed by a non-holder.

    Returns the worker count per job after each slot event (the allocation timeline).
    """
    owner: dict[tuple[str, int], str] = {}
    timeline = []
    for e in events:
        if e["kind"] not in ADD | REMOVE:
            continue
        for slot in map(tuple, e["slots"]):
            if e["kind"] in ADD:
                assert slot not in owner, f"slot {slot} granted to {e['job']} while held by {owner[slot]}"
                owner[slot] = e["job"]
            else:
                assert owner.get(slot) == e["job"], f"{e['job']} released {slot} held by {owner.get(slot)}"
                del owner[slot]
        counts: dict[str, int] = {}
        for job in owner.values():
            counts[job] = counts.get(job, 0) + 1
        timeline.append(counts)
    return timeline


def held_now(events: list[dict]) -> dict[tuple[str, int], str]:
    owner: dict[tuple[str, int], str] = {}
    for e in events:
        for slot in map(tuple, e["slots"]):
            if e["kind"] in ADD:
                owner[slot] = e["job"]
            elif e["kind"] in REMOVE:
                owner.pop(slot, None)
    return owner
