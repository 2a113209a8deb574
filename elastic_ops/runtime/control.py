"""The per-segment control channel between the chunk runner (parent) and its workers.

Why a shared-memory file and not store round trips: the target for every iteration boundary
must reach every worker, and a ``TCPStore.get`` costs ~50 µs per iteration on the critical path
(measured), a visible share of a small model's iteration. The local launcher's workers share
the parent's host, so the parent writes decisions into a memory-mapped file and workers read
them for the cost of a memory load. Each value is written once, before anybody reads it
(``-1`` means "not decided yet"), so every rank reads the same target at the same boundary.

Layout (``int64``): ``[0]`` = last boundary rank 0 reached (relative to the segment start,
``-1`` before the first), ``[1]`` reserved, ``[2 + j]`` = target for boundary ``start + j``: a
worker count (``0`` = preempt), or :func:`moved` of one (the same count on other slots: a
relaunch). Workers end the segment at any value other than their own count and hand it back as
``next_workers``; the runner reads the count with :func:`count_of`.
A second ``float64`` array holds one row ``(loss, unix_time, cursor)`` per boundary; rank 0
writes the row before publishing the boundary in ``[0]``.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

UNDECIDED = -1
_HEADER = 2
MOVED = 1 << 32  # above any worker count (MAX_WORKERS_LIMIT): "same count, relaunch on new slots"


def moved(workers: int) -> int:
    """The decision "relaunch ``workers`` workers on other slots" (differs from every count)."""
    return MOVED + workers


def count_of(value: int) -> int:
    """The worker count of a decision (plain or :func:`moved`)."""
    return value - MOVED if value >= MOVED else value


class ControlChannel:
    def __init__(self, directory: str | Path, length: int, *, create: bool) -> None:
        directory = Path(directory)
        mode = "w+" if create else "r+"
        self.length = length  # number of boundaries: iterations in the segment + 1
        self.ctl = np.memmap(directory / "control.i64", dtype=np.int64, mode=mode, shape=(_HEADER + length,))
        self.prog = np.memmap(directory / "progress.f64", dtype=np.float64, mode=mode, shape=(length, 3))
        if create:
            self.ctl[:] = UNDECIDED
            self.prog[:] = np.nan
            self.ctl.flush()
            self.prog.flush()

    # --- parent side ---------------------------------------------------------------------

    def reached(self) -> int:
        return int(self.ctl[0])

    def decide(self, j: int, workers: int) -> None:
        if 0 <= j < self.length:
            self.ctl[_HEADER + j] = workers

    def decided(self, j: int) -> bool:
        """True when boundary ``j`` needs no decision (the last boundary is the chunk's end)."""
        return j >= self.length - 1 or int(self.ctl[_HEADER + j]) != UNDECIDED

    def value(self, j: int) -> int:
        """The decision for boundary ``j`` (``UNDECIDED`` if none yet)."""
        return int(self.ctl[_HEADER + j])

    def row(self, j: int) -> tuple[float, float, int]:
        loss, t, cursor = self.prog[j]
        return float(loss), float(t), int(cursor)

    # --- worker side ---------------------------------------------------------------------

    def target(self, j: int, *, poll_s: float = 0.0002, abort: float = 600.0) -> int:
        """Wait for the parent's decision for boundary ``j`` (normally already there)."""
        value = int(self.ctl[_HEADER + j])
        deadline = None
        while value == UNDECIDED:
            deadline = deadline or time.monotonic() + abort
            if time.monotonic() > deadline:
                raise TimeoutError(f"no target for boundary {j} within {abort}s (runner gone?)")
            time.sleep(poll_s)
            value = int(self.ctl[_HEADER + j])
        return value

    def publish(self, j: int, loss: float, cursor: int) -> None:
        self.prog[j] = (loss, time.time(), cursor)
        self.ctl[0] = j
