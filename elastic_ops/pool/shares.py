"""Integer share computations: weighted max-min fairness within bounds.

All functions are pure, vectorised with numpy, and run in O(n log n) for n jobs. The ``*_array``
forms take and return int64 arrays (what the policies use); the list forms wrap them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NARROW_STEPS = 12  # bisections of λ before the breakpoints left are sorted (_solve_lambda)


def weighted_fill(
    mins: Sequence[int], caps: Sequence[int], weights: Sequence[float], capacity: int
) -> list[int]:
    """Split ``capacity`` so each job gets ``clamp(weight * λ, min, cap)``, summing to capacity.

    The common λ is found by sweeping the sorted breakpoints ``min/w`` and ``cap/w`` of the
    piecewise-linear total. Fractions are rounded down and the leftover units go to the largest
    fractional parts, compared to 1e-9 so that float noise does not break an exact tie (ties:
    lower index first), so the result is deterministic. Callers make sure
    ``sum(mins) <= capacity`` (gang admission); if ``sum(caps) <= capacity`` every job gets its cap.
    """
    lo = np.asarray(mins, dtype=np.int64).reshape(-1)
    hi = np.asarray(caps, dtype=np.int64).reshape(-1)
    return weighted_fill_array(lo, hi, np.asarray(weights, dtype=np.float64), capacity).tolist()


def weighted_fill_array(lo: np.ndarray, hi: np.ndarray, w: np.ndarray, capacity: int) -> np.ndarray:
    """:func:`weighted_fill` on int64 arrays ``lo``/``hi`` and float weights ``w``."""
    if len(lo) == 0:
        return np.zeros(0, dtype=np.int64)
    if int(lo.sum()) >= capacity:
        return lo.copy()
    if int(hi.sum()) <= capacity:
        return hi.copy()
    lo_f = lo.astype(np.float64)
    hi_f = hi.astype(np.float64)
    w = np.asarray(w, dtype=np.float64)
    lam = _solve_lambda(lo_f, hi_f, w, float(capacity))
    exact = np.clip(w * lam, lo_f, hi_f)
    out = np.clip(np.floor(exact + 1e-9), lo_f, hi_f)
    left = capacity - int(out.sum())
    if left > 0:
        room = np.flatnonzero(out < hi_f)
        # Remainders compared to 1e-9 (rounded), so float noise never breaks an exact tie:
        # equal remainders go to the lower index (rank).
        frac = np.round(exact[room] - out[room], 9)
        out[room[_smallest(-frac, left)]] += 1
    return out.astype(np.int64)


def _smallest(keys: np.ndarray, k: int) -> np.ndarray:
    """Positions of the ``k`` smallest ``keys``, lower position first on ties (what a stable
    sort would put first), without sorting all of them: a partition finds the k-th value and
    only the candidates up to it are sorted."""
    if k >= len(keys):
        return np.arange(len(keys))
    kth = np.partition(keys, k - 1)[k - 1]
    cand = np.flatnonzero(keys <= kth)
    return cand[np.argsort(keys[cand], kind="stable")[:k]]


def _solve_lambda(lo: np.ndarray, hi: np.ndarray, w: np.ndarray, capacity: float) -> float:
    """The λ with ``sum(clip(w λ, lo, hi)) == capacity``: the total is piecewise linear and
    nondecreasing in λ with breakpoints ``lo/w`` and ``hi/w``; a binary search over the
    distinct sorted breakpoints finds the segment where it reaches ``capacity``, and that
    segment is solved exactly.

    Each evaluation sums the same clipped terms in the same order, and rounding is monotone,
    so the computed total is nondecreasing in λ too and the search is well defined. The search
    first bisects λ itself (:data:`NARROW_STEPS` vectorised totals), so only the breakpoints
    left in that bracket, and the nearest one on each side, are sorted: the same segment as a
    search over all of them, without sorting thousands of distinct weights' breakpoints.
    """
    points = np.concatenate([lo / w, hi / w])
    buf = np.empty_like(w)

    def total(lam: float) -> float:  # sum(clip(w lam, lo, hi)), in place (lo <= hi)
        np.multiply(w, lam, out=buf)
        np.maximum(buf, lo, out=buf)
        return float(np.minimum(buf, hi, out=buf).sum())

    # total(a) < capacity <= total(b) (callers: sum(lo) < capacity < sum(hi))
    a, b = 0.0, float(points.max())
    if total(a) < capacity <= total(b):
        for _ in range(NARROW_STEPS):
            mid = (a + b) / 2
            if total(mid) >= capacity:
                b = mid
            else:
                a = mid
        # the segment's ends: distinct breakpoints within [a, b], and the nearest outside it
        inside = points[(points >= a) & (points <= b)]
        below = np.max(points, where=points < a, initial=-np.inf)
        above = np.min(points, where=points > b, initial=np.inf)
        points = np.unique(np.concatenate([inside, [below, above]]))
        points = points[np.isfinite(points)]
    else:
        points = np.unique(points)
    k, m = 0, len(points)  # the first k with total(points[k]) >= capacity lies in [k, m]
    while k < m:
        mid = (k + m) // 2
        if total(points[mid]) >= capacity:
            m = mid
        else:
            k = mid + 1
    if k == 0:
        return float(points[0])
    if k == len(points):
        return float(points[-1])
    p0, p1 = float(points[k - 1]), float(points[k])
    t0, t1 = total(p0), total(p1)
    return p0 + (p1 - p0) * (capacity - t0) / (t1 - t0) if t1 > t0 else p1


def strict_fill(mins: Sequence[int], caps: Sequence[int], classes: Sequence[int], capacity: int) -> list[int]:
    """Everyone gets its min; the rest goes to higher classes first, max-min fair within a class."""
    lo = np.asarray(mins, dtype=np.int64).reshape(-1)
    hi = np.asarray(caps, dtype=np.int64).reshape(-1)
    return strict_fill_array(lo, hi, np.asarray(classes, dtype=np.float64), capacity).tolist()


def strict_fill_array(lo: np.ndarray, hi: np.ndarray, classes: np.ndarray, capacity: int) -> np.ndarray:
    """:func:`strict_fill` on arrays. Classes, highest first, are filled to their caps while the
    leftover lasts; the one class where it runs out is shared max-min fairly (ties: lower index);
    classes below it keep their mins."""
    out = lo.copy()
    left = capacity - int(lo.sum())
    if left <= 0 or len(lo) == 0:
        return out
    order = np.argsort(-np.asarray(classes, dtype=np.float64), kind="stable")  # index order within a class
    cls = np.asarray(classes)[order]
    starts = np.flatnonzero(np.concatenate([[True], cls[1:] != cls[:-1]]))
    room = np.add.reduceat((hi - lo)[order], starts)
    full = np.cumsum(room) <= left
    n_full = int(np.argmin(full)) if not full.all() else len(starts)
    stop = starts[n_full] if n_full < len(starts) else len(order)
    out[order[:stop]] = hi[order[:stop]]  # classes served in full
    if n_full < len(starts):
        extra = left - int(room[:n_full].sum())
        end = starts[n_full + 1] if n_full + 1 < len(starts) else len(order)
        idx = order[stop:end]
        out[idx] = weighted_fill_array(lo[idx], hi[idx], np.ones(len(idx)), int(lo[idx].sum()) + extra)
    return out
