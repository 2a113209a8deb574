"""Allocation timelines from the pool's event log, computed once for every picture of them: the
plugin's ``/elastic-ops/timeline`` route and views, the demo's PNG, and the tests' checks of the
seed sequence.

:func:`compute` turns events (oldest first, as ``PoolClient.events()`` returns them) and the
chunks' reported progress into a :class:`Timeline`: slots held per job over time, the pool's
capacity (slots of hosts that are up), every allocation change with the plan's reason, and
completed iterations per job; clipped to a time range and bounded to a point limit.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from elastic_ops.pool.api import EventKind, slot_events
from elastic_ops.spec import check_int, check_number

MAX_POINTS = 20_000  # the route's and the views' ceiling: a few hundred KiB of JSON at most
DEFAULT_POINTS = 5_000
# the kinds that change a job's allocation or tell why it will: each is one Change
CHANGE_KINDS = frozenset({EventKind.TARGET, EventKind.GRANT, EventKind.GROW, EventKind.SHRINK,
                          EventKind.RELEASE, EventKind.EXPIRY, EventKind.PREEMPT, EventKind.FINISH,
                          EventKind.FAILURE, EventKind.PARK})
_STATE = re.compile(r"state -> (\w+)|cooling over -> (up)")

Point = tuple[float, int]


@dataclasses.dataclass(frozen=True)
class Change:
    """One event that changed (or set out to change) a job's allocation, with its reason."""

    ts: float
    job: str
    kind: str
    workers: int | None  # the slots held after it (slot events), the new target (``target``)
    reason: str


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The series the views draw. Every series is a step function: a value holds until the next
    point. ``truncated``: points were dropped (the oldest) to keep within the limit."""

    start: float
    end: float
    held: dict[str, tuple[Point, ...]]
    capacity: tuple[Point, ...]
    changes: tuple[Change, ...]
    progress: dict[str, tuple[Point, ...]]
    truncated: bool = False
    tenants: dict[str, str] = dataclasses.field(default_factory=dict)  # job -> its tenant

    def held_by_tenant(self) -> dict[str, tuple[Point, ...]]:
        """Slots each tenant's jobs held over time (``tenants``; a job not in it: ``default``)."""
        steps: dict[str, list[tuple[float, str, int]]] = {}
        for job, pts in self.held.items():
            steps.setdefault(self.tenants.get(job, "default"), []).extend((t, job, n) for t, n in pts)
        out = {}
        for tenant, rows in steps.items():
            now: dict[str, int] = {}
            series: list[Point] = []
            total = 0
            for t, job, n in sorted(rows):
                total += n - now.get(job, 0)
                now[job] = n
                if series and series[-1][0] == t:
                    series[-1] = (t, total)
                elif not series or series[-1][1] != total:
                    series.append((t, total))
            out[tenant] = tuple(series)
        return out

    @property
    def jobs(self) -> list[str]:
        return sorted(set(self.held) | set(self.progress))

    def held_at(self, job: str, ts: float) -> int:
        """Slots ``job`` held at ``ts`` (0 before its first point)."""
        value = 0
        for t, n in self.held.get(job, ()):
            if t > ts:
                break
            value = n
        return value

    def to_dict(self) -> dict[str, Any]:
        """The route's JSON: lists of ``[ts, value]`` pairs, changes as objects."""
        return {
            "start": self.start, "end": self.end, "truncated": self.truncated,
            "held": {j: [list(p) for p in pts] for j, pts in self.held.items()},
            "capacity": [list(p) for p in self.capacity],
            "changes": [dataclasses.asdict(c) for c in self.changes],
            "progress": {j: [list(p) for p in pts] for j, pts in self.progress.items()},
            "tenants": dict(self.tenants),
            "held_by_tenant": {t: [list(p) for p in pts] for t, pts in self.held_by_tenant().items()},
        }


def held_series(events: Iterable[dict[str, Any]]) -> dict[str, list[Point]]:
    """``job -> [(ts, slots held after the event)]``, from slot-level grant/grow/shrink/release."""
    held: dict[str, set[tuple[str, int]]] = {}
    series: dict[str, list[Point]] = {}
    for ev in slot_events(events):
        mine = held.setdefault(ev.job, set())
        if ev.gives:
            mine |= set(ev.slots)
        else:
            mine -= set(ev.slots)
        series.setdefault(ev.job, []).append((ev.ts, len(mine)))
    return series


def capacity_series(events: Iterable[Mapping[str, Any]]) -> list[Point]:
    """Slots of hosts that are up, after each host event (added, state changed, cooled down)."""
    slots: dict[str, int] = {}
    up: dict[str, bool] = {}
    series: list[Point] = []
    for e in events:
        if e["kind"] != EventKind.HOST or not e.get("host"):
            continue
        host, reason = e["host"], e.get("reason") or ""
        if reason.startswith("added"):
            slots[host], up[host] = int(e.get("workers") or 0), True
        elif m := _STATE.search(reason):
            up[host] = (m.group(1) or m.group(2)) == "up"
        total = sum(n for h, n in slots.items() if up.get(h))
        if not series or series[-1][1] != total:
            series.append((float(e["ts"]), total))
    return series


def check_bounds(since: float | None, until: float | None, max_points: int) -> None:
    """The range and limit a caller asks for, or :class:`SpecError` naming the field."""
    for field, value in (("since_ts", since), ("until_ts", until)):
        if value is not None:
            check_number(field, value, minimum=0, maximum=1e11)
    if since is not None and until is not None and until < since:
        from elastic_ops.errors import SpecError

        raise SpecError("until_ts", until, f"must be at or after since_ts ({since})")
    check_int("max_points", max_points, 1, MAX_POINTS)


def compute(
    events: Sequence[Mapping[str, Any]],
    progress: Mapping[str, Iterable[Point]] | None = None,
    *,
    job: str | None = None,
    since: float | None = None,
    until: float | None = None,
    max_points: int = DEFAULT_POINTS,
    now: float | None = None,
    tenant_of: Mapping[str, str] | None = None,
) -> Timeline:
    """The timeline of ``job`` (None: every job, the pool) between ``since`` and ``until`` (Unix
    seconds; None: from the job's first event, to the last event or ``now``; a ``since`` before
    the first event means the first event). Every series starts at ``since`` with the value it
    had then (replayed from all ``events``), so a range shows a state, not only the changes
    inside it; at most ``max_points`` points in all, the newest kept. ``tenant_of``: each job's
    tenant (the timeline then groups jobs by tenant: :meth:`Timeline.held_by_tenant`)."""
    check_bounds(since, until, max_points)
    progress = progress or {}
    held = {j: pts for j, pts in held_series(events).items() if job is None or j == job}
    prog = {j: sorted((float(t), int(i)) for t, i in pts) for j, pts in progress.items()
            if job is None or j == job}
    cap = capacity_series(events)
    changes = [Change(float(e["ts"]), e["job"], str(e["kind"]), e.get("workers"), e.get("reason") or "")
               for e in events
               if e["kind"] in CHANGE_KINDS and e.get("job") and (job is None or e["job"] == job)]
    # the range: from the job's first event (the pool's, without ``job``), not the hosts' setup
    mine = [e for e in events if job is None or e.get("job") == job]
    stamps = [float(e["ts"]) for e in mine] + [t for pts in prog.values() for t, _ in pts]
    first = min([float(e["ts"]) for e in events] + stamps, default=now or 0.0)
    start = max(since, first) if since is not None else min(stamps, default=first)  # nothing before the log
    end = until if until is not None else max([*stamps, *([now] if now is not None else [])], default=start)
    held = {j: _clip(pts, start, end) for j, pts in held.items()}
    prog = {j: _clip(pts, start, end) for j, pts in prog.items()}
    cap = _clip(cap, start, end)
    changes = [c for c in changes if start <= c.ts <= end]
    total = sum(map(len, held.values())) + sum(map(len, prog.values())) + len(cap) + len(changes)
    truncated = total > max_points
    if truncated:  # keep the newest: each series (and the changes) cut to its share of the limit
        share = max(1, max_points // max(1, len(held) + len(prog) + 2))
        held = {j: pts[-share:] for j, pts in held.items()}
        prog = {j: pts[-share:] for j, pts in prog.items()}
        cap, changes = cap[-share:], changes[-share:]
    return Timeline(start=start, end=end, held={j: tuple(p) for j, p in held.items() if p},
                    capacity=tuple(cap), changes=tuple(changes),
                    progress={j: tuple(p) for j, p in prog.items() if p}, truncated=truncated,
                    tenants={j: t for j, t in (tenant_of or {}).items() if j in held or j in prog})


def _clip(points: Sequence[Point], start: float, end: float) -> list[Point]:
    """The points inside ``[start, end]``, led by the value in force at ``start`` (if any)."""
    before = [p for p in points if p[0] < start]
    inside = [p for p in points if start <= p[0] <= end]
    if before and (not inside or inside[0][0] > start):
        inside.insert(0, (start, before[-1][1]))
    return inside


def allocation_sequence(events: Iterable[dict[str, Any]], jobs: Sequence[str]) -> list[tuple[int, ...]]:
    """The distinct successive allocations ``(held by jobs[0], held by jobs[1], …)``."""
    held = {j: 0 for j in jobs}
    points = sorted(
        (ts, j, n) for j, pts in held_series(events).items() if j in held for ts, n in pts
    )
    seq: list[tuple[int, ...]] = []
    for _, job, n in points:
        held[job] = n
        state = tuple(held[j] for j in jobs)
        if not seq or seq[-1] != state:
            seq.append(state)
    return seq


def is_subsequence(wanted: Sequence[Any], seq: Sequence[Any]) -> bool:
    it = iter(seq)
    return all(any(x == w for x in it) for w in wanted)


def max_concurrent_holders(events: Iterable[dict[str, Any]]) -> int:
    """The most jobs that ever held the same slot at once (must be 1: no double grants)."""
    owner: dict[tuple[str, int], set[str]] = {}
    worst = 0
    for ev in slot_events(events):
        for s in ev.slots:
            holders = owner.setdefault(s, set())
            if ev.gives:
                holders.add(ev.job)
            else:
                holders.discard(ev.job)
            worst = max(worst, len(holders))
    return worst


def progress_from_results(results: Iterable[Mapping[str, Any]], ends: Mapping[int, float] | None = None
                          ) -> list[Point]:
    """``(time, completed iteration)`` from chunk task results (``ChunkTaskResult`` dicts): each
    segment's start from its ``workers_timeline``, and each chunk's end at the time it committed
    (``ends``: chunk index -> Unix time; without it, the last segment's time)."""
    points: list[Point] = []
    for res in results:
        timeline = res.get("workers_timeline") or []
        points += [(float(t), int(i)) for i, _, t in timeline]
        at = (ends or {}).get(int(res.get("chunk_index", -1)))
        if at is None and timeline:
            at = float(timeline[-1][2])
        if at is not None and res.get("end") is not None:
            points.append((float(at), int(res["end"])))
    return sorted(points)


def plot(
    events: Sequence[dict[str, Any]],
    progress: dict[str, list[Point]],
    path: Path,
    *,
    labels: dict[str, str] | None = None,
    slots: int | None = None,
) -> Path:
    """Write the two-panel allocation timeline PNG (workers per job; completed iterations)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or {}
    tl = compute(events, progress, max_points=MAX_POINTS)
    t0 = min([p[0][0] for p in tl.held.values()] + [p[0][0] for p in tl.progress.values()], default=tl.start)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    for job, pts in sorted(tl.held.items()):
        xs = [t - t0 for t, _ in pts]
        ax1.step(xs, [n for _, n in pts], where="post", label=labels.get(job, job), linewidth=2)
    if slots:
        ax1.axhline(slots, color="grey", linestyle=":", linewidth=1)
    ax1.set_ylabel("workers (slots held)")
    ax1.set_title("Elastic jobs in the pool: allocation over time")
    ax1.legend(loc="upper right")
    for job, pts in sorted(tl.progress.items()):
        ax2.plot([t - t0 for t, _ in pts], [i for _, i in pts], marker="o", markersize=3,
                 label=labels.get(job, job))
    ax2.set_ylabel("completed iterations")
    ax2.set_xlabel("seconds since the first grant")
    ax2.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
