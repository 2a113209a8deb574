"""Integer share computations: weighted max-min fairness within bounds.

All functions are pure and run in O(n log n) for n jobs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def weighted_fill(
    mins: Sequence[int], caps: Sequence[int], weights: Sequence[float], capacity: int
) -> list[int]:
    """Split ``capacity`` so each job gets ``clamp(weight * λ, min, cap)``, summing to capacity.

    The common λ is found by sweeping the sorted breakpoints ``min/w`` and ``cap/w`` of the
    piecewise-linear total. Fractions are rounded down and the leftover units go to the largest
    fractional parts (ties: lower index first), so the result is deterministic. Callers make sure
    ``sum(mins) <= capacity`` (gang admission); if ``sum(caps) <= capacity`` every job gets its cap.
    """
    n = len(mins)
    if n == 0:
        return []
    if sum(mins) >= capacity:
        return list(mins)
    if sum(caps) <= capacity:
        return list(caps)
    lo = np.asarray(mins, dtype=np.float64)
    hi = np.asarray(caps, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    lam = _solve_lambda(lo, hi, w, float(capacity))
    exact = np.clip(w * lam, lo, hi)
    out = np.clip(np.floor(exact + 1e-9), lo, hi)
    left = capacity - int(out.sum())
    if left > 0:
        room = np.flatnonzero(out < hi)
        # Largest remainder first, lower index on ties (lexsort: last key is primary).
        order = room[np.lexsort((room, -(exact[room] - out[room])))]
        out[order[:left]] += 1
    return [int(x) for x in out]


def _solve_lambda(lo: np.ndarray, hi: np.ndarray, w: np.ndarray, capacity: float) -> float:
    """The λ with ``sum(clip(w λ, lo, hi)) == capacity``: the total is piecewise linear and
    nondecreasing in λ, so sort the breakpoints, find the segment by cumulative sums, and solve
    that segment exactly (vectorised: O(n log n))."""
    starts, ends = lo / w, hi / w
    by_start, by_end = np.argsort(starts, kind="stable"), np.argsort(ends, kind="stable")
    s_sorted, e_sorted = starts[by_start], ends[by_end]
    zero = np.zeros(1)
    lo_cum = np.concatenate([zero, np.cumsum(lo[by_start])])
    ws_cum = np.concatenate([zero, np.cumsum(w[by_start])])
    hi_cum = np.concatenate([zero, np.cumsum(hi[by_end])])
    we_cum = np.concatenate([zero, np.cumsum(w[by_end])])
    points = np.unique(np.concatenate([starts, ends]))
    i_s = np.searchsorted(s_sorted, points, side="right")  # jobs whose share has started growing
    i_e = np.searchsorted(e_sorted, points, side="right")  # jobs already at their cap
    totals = (lo_cum[-1] - lo_cum[i_s]) + (ws_cum[i_s] - we_cum[i_e]) * points + hi_cum[i_e]
    k = int(np.searchsorted(totals, capacity))
    if k == 0:
        return float(points[0])
    if k >= len(points):
        return float(points[-1])
    p0, p1, t0, t1 = points[k - 1], points[k], totals[k - 1], totals[k]
    return float(p0 + (p1 - p0) * (capacity - t0) / (t1 - t0)) if t1 > t0 else float(p1)


def strict_fill(mins: Sequence[int], caps: Sequence[int], classes: Sequence[int], capacity: int) -> list[int]:
    """Everyone gets its min; the rest goes to higher classes first, max-min fair within a class."""
    out = list(mins)
    left = capacity - sum(mins)
    by_class: dict[int, list[int]] = {}
    for i, c in enumerate(classes):
        by_class.setdefault(c, []).append(i)
    for c in sorted(by_class, reverse=True):
        if left <= 0:
            break
        idx = by_class[c]
        room = sum(caps[i] - mins[i] for i in idx)
        extra = min(left, room)
        part = weighted_fill(
            [mins[i] for i in idx],
            [caps[i] for i in idx],
            [1.0] * len(idx),
            sum(mins[i] for i in idx) + extra,
        )
        for i, v in zip(idx, part, strict=True):
            out[i] = v
        left -= extra
    return out
