"""Slot-hours per job and per host over a time window, replayed from the pool's event log (what
a platform team charges back, and how busy each host was).

Every slot a job held counts from the event that gave it (``grant``, ``grow``) to the event that
took it back (``shrink``, ``release``, ``expiry``), clipped to the window; a slot still held counts
to the window's end. Parked slots (between two chunk tasks) count: the job kept them. Events
pruned away (``prune-events``) are gone from the window too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from elastic_ops.pool.api import slot_events


@dataclasses.dataclass(frozen=True)
class Usage:
    since: float
    until: float
    jobs: dict[str, float]  # slot-seconds
    hosts: dict[str, float]

    def to_dict(self, host_slots: Mapping[str, int] | None = None) -> dict[str, Any]:
        """Slot-hours; with ``host_slots``, each host's busy share of its slots over the window."""
        span = max(self.until - self.since, 0.0)
        hosts = []
        for name, used in sorted(self.hosts.items()):
            row: dict[str, Any] = {"host": name, "slot_hours": round(used / 3600, 4)}
            slots = (host_slots or {}).get(name)
            if slots and span > 0:
                row["utilization"] = round(used / (slots * span), 4)
            hosts.append(row)
        return {
            "since": self.since,
            "until": self.until,
            "hours": round(span / 3600, 4),
            "slot_hours": round(sum(self.jobs.values()) / 3600, 4),
            "jobs": [{"job": j, "slot_hours": round(s / 3600, 4)}
                     for j, s in sorted(self.jobs.items(), key=lambda kv: (-kv[1], kv[0]))],
            "hosts": hosts,
        }


def usage(events: Iterable[Mapping[str, Any]], since: float, until: float) -> Usage:
    """Slot-seconds of every job and host within ``[since, until]``, from ``events`` oldest first."""
    held: dict[tuple[str, int], tuple[str, float]] = {}  # slot -> (job, since when)
    jobs: dict[str, float] = {}
    hosts: dict[str, float] = {}

    def count(slot: tuple[str, int], job: str, t0: float, t1: float) -> None:
        seconds = min(t1, until) - max(t0, since)
        if seconds > 0:
            jobs[job] = jobs.get(job, 0.0) + seconds
            hosts[slot[0]] = hosts.get(slot[0], 0.0) + seconds

    for ev in slot_events(events):
        job, t = ev.job, ev.ts
        if t > until:
            break
        for slot in ev.slots:
            was = held.pop(slot, None)
            if was is not None and (ev.gives or was[0] == job):
                count(slot, was[0], was[1], t)
            elif was is not None:  # not this job's slot: leave it with its holder
                held[slot] = was
            if ev.gives:
                held[slot] = (job, t)
    for slot, (job, t0) in held.items():
        count(slot, job, t0, until)
    return Usage(since, until, jobs, hosts)
