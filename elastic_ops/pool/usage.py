"""Slot-hours per job, per host and per tenant over a time window, replayed from the pool's event log (what
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
    # per tenant, slot-seconds: guaranteed, used, borrowed (beyond the guarantee), lent (of the
    # idle guarantee, what others borrowed: see client.lent_and_borrowed)
    tenants: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

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
            "tenants": [{"tenant": t, **{k: round(v / 3600, 4) for k, v in row.items()}}
                        for t, row in sorted(self.tenants.items())],
        }


def lent_and_borrowed(
    guaranteed: Mapping[str, int], used: Mapping[str, int], up: int
) -> dict[str, tuple[int, int]]:
    """Per tenant, (borrowed, lent): slots held beyond its guarantee, and the part of its idle
    guarantee that others' borrowing takes (borrowing comes first from the slots nobody is
    guaranteed; the rest from idle guarantees, in proportion to them)."""
    borrowed = {t: max(0, used.get(t, 0) - g) for t, g in guaranteed.items()}
    idle = {t: max(0, g - used.get(t, 0)) for t, g in guaranteed.items()}
    from_idle = max(0, sum(borrowed.values()) - max(0, up - sum(guaranteed.values())))
    total_idle = sum(idle.values())
    return {t: (borrowed[t], round(idle[t] * min(1.0, from_idle / total_idle)) if total_idle else 0)
            for t in guaranteed}


def usage(
    events: Iterable[Mapping[str, Any]], since: float, until: float,
    tenant_of: Mapping[str, str] | None = None, guaranteed: Mapping[str, int] | None = None, up: int = 0,
) -> Usage:
    """Slot-seconds of every job and host within ``[since, until]``, from ``events`` oldest first.
    With ``tenant_of`` (job -> tenant), per tenant too: ``guaranteed`` (the tenants' guarantees as
    they are now) and ``up`` (the up slots now) split each moment's holding into borrowed and lent."""
    held: dict[tuple[str, int], tuple[str, float]] = {}  # slot -> (job, since when)
    jobs: dict[str, float] = {}
    hosts: dict[str, float] = {}
    tenants: dict[str, dict[str, float]] = {}
    g = dict(guaranteed or {})
    counts: dict[str, int] = {}  # slots each tenant holds since ``last``
    last = since

    def count(slot: tuple[str, int], job: str, t0: float, t1: float) -> None:
        seconds = min(t1, until) - max(t0, since)
        if seconds > 0:
            jobs[job] = jobs.get(job, 0.0) + seconds
            hosts[slot[0]] = hosts.get(slot[0], 0.0) + seconds

    def tenants_to(t: float) -> None:
        nonlocal last
        seconds = min(t, until) - max(last, since)
        if tenant_of is not None and seconds > 0:
            split = lent_and_borrowed({n: g.get(n, 0) for n in set(g) | set(counts)}, counts, up)
            for n, (borrowed, lent) in split.items():
                row = tenants.setdefault(n, dict.fromkeys(("guaranteed", "used", "borrowed", "lent"), 0.0))
                row["guaranteed"] += g.get(n, 0) * seconds
                row["used"] += counts.get(n, 0) * seconds
                row["borrowed"] += borrowed * seconds
                row["lent"] += lent * seconds
        last = max(last, t)

    def tenant(job: str) -> str:
        return (tenant_of or {}).get(job, "default")

    for ev in slot_events(events):
        job, t = ev.job, ev.ts
        if t > until:
            break
        tenants_to(t)
        for slot in ev.slots:
            was = held.get(slot)
            if was is not None and (ev.gives or was[0] == job):
                counts[tenant(was[0])] -= 1
            if ev.gives:
                counts[tenant(job)] = counts.get(tenant(job), 0) + 1
        for slot in ev.slots:
            was = held.pop(slot, None)
            if was is not None and (ev.gives or was[0] == job):
                count(slot, was[0], was[1], t)
            elif was is not None:  # not this job's slot: leave it with its holder
                held[slot] = was
            if ev.gives:
                held[slot] = (job, t)
    tenants_to(until)
    for slot, (job, t0) in held.items():
        count(slot, job, t0, until)
    return Usage(since, until, jobs, hosts, tenants)
