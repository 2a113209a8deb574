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
relaunch), with an adaptive job's global batch in the bits above (:func:`with_batch`; 0: its
own). Workers end the segment at any decision that does not :func:`continues` their count and
hand it back as ``next_workers``; the runner reads the count with :func:`count_of`; a new
batch alone is followed from that boundary on, in the same segment.
A second ``float64`` array holds one row ``ROW`` per boundary; rank 0 writes the rows before
publishing the boundary in ``[0]`` (an adaptive job's step may cross several boundaries: it
writes a row for each).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

UNDECIDED = -1
_HEADER = 2
MOVED = 1 << 32  # above any worker count (MAX_WORKERS_LIMIT): "same count, relaunch on new slots"
_BATCH_SHIFT = 33  # an adaptive job's batch, above the moved bit (MAX_GLOBAL_BATCH < 2**30)
_SEGMENT_BITS = (1 << _BATCH_SHIFT) - 1  # count and moved: what ends a segment when it changes
# (loss, unix time, cursor, optimizer steps in the segment, gradient sqr, gradient var, batch)
ROW = ("loss", "time", "cursor", "steps", "grad_sqr", "grad_var", "batch")


def moved(workers: int) -> int:
    """The decision "relaunch ``workers`` workers on other slots" (differs from every count)."""
    return MOVED + workers


def with_batch(value: int, batch: int) -> int:
    """Decision ``value`` with global batch ``batch`` (0: the job's own)."""
    return (value & _SEGMENT_BITS) | (int(batch) << _BATCH_SHIFT)


def count_of(value: int) -> int:
    """The worker count of a decision (plain or :func:`moved`)."""
    return value & (MOVED - 1)


def batch_of(value: int) -> int:
    """The global batch a decision carries (0: the job's own)."""
    return value >> _BATCH_SHIFT


def continues(value: int, workers: int) -> bool:
    """Whether a segment of ``workers`` goes on at decision ``value`` (its batch may change)."""
    return value >= 0 and value & _SEGMENT_BITS == workers


class ControlChannel:
    def __init__(self, directory: str | Path, length: int, *, create: bool) -> None:
        directory = Path(directory)
        mode = "w+" if create else "r+"
        self.length = length  # number of boundaries: iterations in the segment + 1
        self.ctl = np.memmap(directory / "control.i64", dtype=np.int64, mode=mode, shape=(_HEADER + length,))
        self.prog = np.memmap(directory / "progress.f64", dtype=np.float64, mode=mode,
                              shape=(length, len(ROW)))
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
        loss, t, cursor = self.prog[j, :3]
        return float(loss), float(t), int(cursor)

    def measured(self, j: int) -> tuple[int, float | None, float | None, int]:
        """Boundary ``j``'s optimizer steps in the segment, gradient statistics (None: none
        measured) and batch (0: the job's own)."""
        steps, sqr, var, batch = self.prog[j, 3:]
        finite = np.isfinite(sqr) and np.isfinite(var)
        return int(steps), float(sqr) if finite else None, float(var) if finite else None, int(batch)

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

    def publish(self, j: int, loss: float, cursor: int, *, since: int | None = None, steps: int | None = None,
                grad: tuple[float, float] | None = None, batch: int = 0) -> None:
        """Boundaries ``since..j`` reached (default: ``j`` alone), all with the same row."""
        sqr, var = grad if grad is not None else (np.nan, np.nan)
        first = j if since is None else since
        self.prog[first : j + 1] = (loss, time.time(), cursor, j if steps is None else steps, sqr, var, batch)
        self.ctl[0] = j
