"""Progress lines with an ETA for the task log, throttled so logs stay readable."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastic_ops.runtime.outcome import Progress


def format_eta(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def progress_logger(
    log: logging.Logger, job: str, *, every_s: float = 2.0, clock: Callable[[], float] = time.monotonic
) -> Callable[[Progress], None]:
    """An ``on_progress`` callback that logs at most every ``every_s`` seconds (and the last one)."""
    last = [float("-inf")]

    def on_progress(p: Progress) -> None:
        now = clock()
        if now - last[0] < every_s and p.iteration < p.end:
            return
        last[0] = now
        loss = f"{p.loss:.4f}" if p.loss is not None else "?"
        log.info(
            "job %s: iteration %d/%d loss=%s workers=%d %.0f samples/s ETA %s",
            job, p.iteration, p.end, loss, p.workers, p.samples_per_sec or 0.0, format_eta(p.eta_s),
        )

    return on_progress
