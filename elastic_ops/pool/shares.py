"""Integer share computations: weighted max-min fairness within bounds.

All functions are pure and run in O(n log n) for n jobs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


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
    breaks: list[tuple[float, float]] = []
    for lo, hi, w in zip(mins, caps, weights, strict=True):
        if hi > lo:
            breaks.append((lo / w, w))
            breaks.append((hi / w, -w))
    breaks.sort()
    total, slope, lam_prev = float(sum(mins)), 0.0, 0.0
    lam = breaks[-1][0] if breaks else 0.0
    for lam_b, delta in breaks:
        at_b = total + slope * (lam_b - lam_prev)
        if at_b >= capacity and slope > 0:
            lam = lam_prev + (capacity - total) / slope
            break
        total, lam_prev, slope = at_b, lam_b, slope + delta
    exact = [min(max(w * lam, lo), hi) for lo, hi, w in zip(mins, caps, weights, strict=True)]
    out = [max(lo, min(hi, math.floor(x + 1e-9))) for x, lo, hi in zip(exact, mins, caps, strict=True)]
    left = capacity - sum(out)
    if left > 0:
        order = sorted((i for i in range(n) if out[i] < caps[i]), key=lambda i: (-(exact[i] - out[i]), i))
        for i in order[:left]:
            out[i] += 1
    return out


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
