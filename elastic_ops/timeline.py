"""Allocation timelines from the pool's event log: workers held per job over time, the
allocation sequence, and the PNG the demo writes (workers per job + completed iterations)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from elastic_ops.pool.api import slot_events


def held_series(events: Iterable[dict[str, Any]]) -> dict[str, list[tuple[float, int]]]:
    """``job -> [(ts, slots held after the event)]``, from slot-level grant/grow/shrink/release."""
    held: dict[str, set[tuple[str, int]]] = {}
    series: dict[str, list[tuple[float, int]]] = {}
    for ev in slot_events(events):
        mine = held.setdefault(ev.job, set())
        if ev.gives:
            mine |= set(ev.slots)
        else:
            mine -= set(ev.slots)
        series.setdefault(ev.job, []).append((ev.ts, len(mine)))
    return series


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


def plot(
    events: Sequence[dict[str, Any]],
    progress: dict[str, list[tuple[float, int]]],
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
    series = held_series(events)
    t0 = min([p[0][0] for p in series.values() if p] + [p[0][0] for p in progress.values() if p] or [0])
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    for job, pts in sorted(series.items()):
        xs = [t - t0 for t, _ in pts]
        ax1.step(xs, [n for _, n in pts], where="post", label=labels.get(job, job), linewidth=2)
    if slots:
        ax1.axhline(slots, color="grey", linestyle=":", linewidth=1)
    ax1.set_ylabel("workers (slots held)")
    ax1.set_title("Elastic jobs in the pool: allocation over time")
    ax1.legend(loc="upper right")
    for job, pts in sorted(progress.items()):
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
