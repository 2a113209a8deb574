"""Run a whole job (or an iteration range) locally, with an optional worker schedule.

A *worker schedule* says how many workers train each iteration (for tests and demos; in
production the pool decides). Two forms, never mixed:

- ``1,3,2`` — equal parts of the iterations being run: with ``--iterations 0:90`` that is
  iterations 0-29 on 1 worker, 30-59 on 3, 60-89 on 2 (part ``j`` of ``k`` starts at
  ``start + j * (end - start) // k``);
- ``1@0,3@40,2@70`` — explicit absolute iteration boundaries, ascending: from iteration 40 on,
  3 workers. The first boundary is the run's first iteration (``--iterations 40:`` →
  ``3@40,…``).

Every count must lie in ``[min_workers, max_workers]`` of the spec. Without a schedule the job
runs on ``max_workers`` throughout.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic_ops.errors import SpecError, short_repr
from elastic_ops.runtime.chunk import ChunkResult, Progress, run_chunk
from elastic_ops.runtime.outcome import ChunkStatus
from elastic_ops.spec import JobSpec, stop_metric_missing, stop_reached

log = logging.getLogger(__name__)

FLAG = "--workers-schedule"


@dataclass(frozen=True)
class Schedule:
    """Worker count by iteration: ``counts[j]`` from ``starts[j]`` (ascending) on."""

    starts: tuple[int, ...]
    counts: tuple[int, ...]

    def __call__(self, iteration: int) -> int:
        return self.counts[max(0, bisect.bisect_right(self.starts, iteration) - 1)]

    @classmethod
    def constant(cls, workers: int) -> Schedule:
        return cls((0,), (workers,))

    @classmethod
    def parse(cls, text: str, spec: JobSpec, start: int, end: int) -> Schedule:
        items = [p.strip() for p in str(text).split(",")]
        if not text or not all(items):
            raise SpecError(FLAG, text, "must be a comma-separated list like '1,3,2' or '1@0,3@40,2@70'")
        explicit = ["@" in p for p in items]
        if any(explicit) and not all(explicit):
            raise SpecError(FLAG, text, "must use one form: all 'N' or all 'N@ITERATION'")
        if len(items) > end - start:
            why = f"has {len(items)} parts for {end - start} iterations: at most one part per iteration"
            raise SpecError(FLAG, text, why)
        counts, starts = [], []
        for j, item in enumerate(items):
            n_text, at, at_text = item.partition("@")
            if at and not at_text.strip():
                raise SpecError(FLAG, text, f"{item!r} needs the iteration it starts at, like '3@40'")
            n = _int(text, n_text)
            if not spec.min_workers <= n <= spec.max_workers:
                raise SpecError(
                    FLAG,
                    text,
                    f"worker count {n} must be between min_workers "
                    f"({spec.min_workers}) and max_workers ({spec.max_workers})",
                )
            counts.append(n)
            starts.append(_int(text, at_text) if at_text else start + j * (end - start) // len(items))
        if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
            raise SpecError(FLAG, text, "iteration boundaries must be strictly ascending")
        outside = [b for b in starts if not start <= b < end]
        if outside:
            why = f"iteration {outside[0]} is outside the run's iterations [{start}, {end})"
            raise SpecError(FLAG, text, why)
        if starts[0] != start:  # else the iterations before it would have no count
            why = f"the first part must start at the run's first iteration, like '{counts[0]}@{start}'"
            raise SpecError(FLAG, text, why)
        return cls(tuple(starts), tuple(counts))


_INT = re.compile(r"\s*-?[0-9]{1,18}\s*")  # ASCII digits: int() also takes "1_0", "+1" and "１"
_DIGITS = re.compile(r"\s*-?[0-9]+\s*")  # (and raises ValueError past 4,300 digits)


def _int(text: str, value: str) -> int:
    if not _INT.fullmatch(value):
        why = "has too many digits" if _DIGITS.fullmatch(value) else "is not an integer"
        raise SpecError(FLAG, text, f"{short_repr(value, 40)} {why}")
    return int(value)  # a negative count or boundary gets the range check's message


def parse_range(text: str | None, spec: JobSpec) -> tuple[int, int]:
    """``START:END`` (either side may be empty) → ``(start, end)`` within the job."""
    if not text:
        return 0, spec.total_iterations
    lo, sep, hi = text.partition(":")
    if all(_INT.fullmatch(side) or not side.strip() for side in (lo, hi)):
        start = int(lo) if lo.strip() else 0
        end = int(hi) if hi.strip() else spec.total_iterations
    else:
        start = end = -1
    if not sep or not 0 <= start < end <= spec.total_iterations:
        raise SpecError(
            "--iterations",
            text,
            f"must be START:END with 0 <= START < END <= total_iterations ({spec.total_iterations})",
        )
    return start, end


def run_job(
    spec: JobSpec,
    *,
    schedule: Schedule | Callable[[int], int] | None = None,
    store: Any = None,
    start: int = 0,
    end: int | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    warm_start: str | None = None,
    **kwargs: Any,
) -> ChunkResult:
    """Train iterations ``[start, end)`` (the whole job by default) in one runner call.

    Checkpoints are committed every ``checkpoint_interval`` iterations (by default the chunk
    size, i.e. where Airflow would commit between chunks) and at the end. With ``stop_when``
    the range runs chunk by chunk, as Airflow runs it, and ends at the first chunk end whose
    metrics meet it (the same iteration and model as under Airflow).
    """
    end = spec.total_iterations if end is None else end
    target = schedule or Schedule.constant(spec.max_workers)
    if not spec.stop_when:
        return run_chunk(
            spec, start, end, target=target, store=store, on_progress=on_progress, warm_start=warm_start,
            **kwargs,
        )
    parts: list[ChunkResult] = []
    warned = False
    for a, b in _pieces(spec, start, end):
        part = run_chunk(spec, a, b, target=target, store=store, on_progress=on_progress,
                         warm_start=warm_start if a == start else None, **kwargs)
        parts.append(part)
        ends = {"loss": part.loss, **part.metrics}
        completed = part.status is ChunkStatus.COMPLETED  # a preempted one was not evaluated
        if completed and not warned and (missing := stop_metric_missing(spec.stop_when, ends)):
            log.warning("%s", missing)
            warned = True
        # only a chunk end's metrics decide: a piece done already reports the latest checkpoint,
        # which may lie inside a later chunk (a preemption's, an interval's)
        at_end = part.iteration == b
        if part.status is ChunkStatus.PREEMPTED or (at_end and stop_reached(spec.stop_when, ends)):
            break
    return _joined(parts)


def _pieces(spec: JobSpec, start: int, end: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut at the job's chunk boundaries."""
    cuts = sorted({start, end, *(b for _, b in spec.chunk_ranges() if start < b < end)})
    return list(zip(cuts, cuts[1:], strict=False))


def _joined(parts: list[ChunkResult]) -> ChunkResult:
    """One result for consecutive chunk runs: the last one's state, everyone's timeline and time."""
    last = parts[-1]
    seconds = sum(p.duration_s for p in parts)
    trained = [p for p in parts if p.status is not ChunkStatus.ALREADY_DONE]
    return dataclasses.replace(
        last,
        start=parts[0].start,
        status=last.status if last.status is ChunkStatus.PREEMPTED or not trained else ChunkStatus.COMPLETED,
        workers_timeline=[t for p in parts for t in p.workers_timeline],
        duration_s=seconds,
        samples_per_sec=_weighted(parts, "samples_per_sec", seconds),
        train_samples_per_sec=_weighted(parts, "train_samples_per_sec", seconds),
    )


def _weighted(parts: list[ChunkResult], field: str, seconds: float) -> float:
    """A rate over the parts, each weighted by its duration."""
    return sum(getattr(p, field) * p.duration_s for p in parts) / seconds if seconds else 0.0
