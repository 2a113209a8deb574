"""``LeaseKeeper``: heartbeats a grant in the background and feeds the runner its target.

The chunk runner calls :meth:`LeaseKeeper.target` at every iteration boundary (a little ahead
of the workers) and gets the pool's latest target as one
:class:`~elastic_ops.runtime.allocation.Allocation`: the count (0 = full preemption) and the
slots that came with it (``Target.placements``: on a grow the kept slots plus the newly reserved
ones, on a shrink only the kept ones), so workers run on the GPUs the job was granted. The count
the heartbeats report is what really runs: :meth:`LeaseKeeper.applied` sets it when a segment's
workers start, after the previous segment's have exited, so a shrink frees its slots only once
nothing of this job runs on them any more, and promptly then. The slots a shrink gives up are
still the job's in the ledger until a heartbeat reports the smaller count, and the new segment
never uses them: they are the ones the pool hands to the next job.

Once a segment has started on known slots (:meth:`applied` with placements, on a keeper that knows
its host), every heartbeat also lists them (``placements=``): the pool then releases at once the
slots its plan takes away that the running workers do not use (a move off a draining host, or a
shrink), and keeps the ones they do use even when its target has moved on (a move the runner
could not follow keeps the old slots this job's, so no other job is handed a busy GPU).

Every heartbeat also carries what the runner measured since the last one (:meth:`progressed`:
optimizer steps and seconds at a steady worker count, over how many hosts and, for an adaptive
job, at which global batch, with its latest gradient statistics), which the pool keeps per
configuration (``PoolClient.observations``). The pool's target carries the batch it chose for
an adaptive job (``Target.batch``): :meth:`target` hands it to the runner with the count.

A heartbeat that fails (a busy or unreachable ledger, any error) is retried at the next beat;
once no heartbeat has succeeded for the lease's TTL the pool has expired the lease, and the
keeper treats it as lost (target 0: the chunk stops at its next boundary).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from elastic_ops.errors import ElasticOpsError, LeaseExpiredError
from elastic_ops.metrics import NO_METRICS, Metrics
from elastic_ops.pool.model import Observation
from elastic_ops.runtime.allocation import Allocation
from elastic_ops.runtime.outcome import Progress
from elastic_ops.tracking.api import NO_RUN

if TYPE_CHECKING:
    from elastic_ops.pool.client import PoolClient
    from elastic_ops.tracking.api import JobRun

log = logging.getLogger(__name__)


class LeaseKeeper:
    """``placements``: the grant's ``(host, slot)`` pairs; ``host``: where this task trains (the
    host whose slots :meth:`slots` returns; ``None``: every host's)."""

    def __init__(
        self,
        client: PoolClient,
        job: str,
        epoch: int,
        workers: int,
        *,
        interval_s: float,
        placements: Sequence[tuple[str, int]] = (),
        host: str | None = None,
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: Metrics = NO_METRICS,
        tags: Mapping[str, str] | None = None,
        tracker: JobRun = NO_RUN,
    ) -> None:
        self.client = client
        self.metrics, self.tags = metrics, tags  # ``chunk.workers`` at every change
        self.tracker = tracker  # the job's experiment run: every boundary, every rescale
        self.job = job
        self.epoch = epoch
        self.host = host
        self.interval_s = max(0.05, float(interval_s))
        self._lock = threading.Lock()
        self._wanted = workers  # what the pool wants
        self._running = workers  # what the runner runs (reported by heartbeats)
        self._placements = tuple(placements)  # the slots of the pool's latest target
        self._batch = 0  # the batch of the pool's latest target (an adaptive job's; 0: its own)
        self._running_on: tuple[tuple[str, int], ...] | None = None  # the running segment's slots
        self.hosts_used: set[str] = set()  # every host a segment of this chunk ran ranks on
        self._applied_once = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"lease-{job}", daemon=True)
        self.lost = False
        self.reasons: list[str] = []
        self.ttl_s = ttl_s  # None: never lost by silence (only by the pool saying so)
        self.clock = clock
        self._last_ok = clock()  # the grant itself renewed the lease
        # what the runner measured, not yet sent: (workers, hosts, batch) -> [steps, seconds]
        self._at: tuple[int, int, int, float] | None = None  # the last boundary: steps, workers, batch, time
        self._measured: dict[tuple[int, int, int], list[float]] = {}
        self._grad: tuple[float, float] | None = None  # the latest gradient statistics (sent with each)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def target(self, iteration: int) -> Allocation:
        """The pool's latest target, for boundary ``iteration`` (the runner asks ahead of the
        workers, and says through :meth:`applied` when the count really changes)."""
        return self.current()

    def current(self) -> Allocation:
        """The pool's latest target, count and slots of the same heartbeat (the agents' clients
        poll it without a boundary in hand)."""
        with self._lock:
            return Allocation(self._wanted, self._placements, self._batch)

    def applied(self, iteration: int, allocation: Allocation) -> None:
        """``allocation.workers`` start at boundary ``iteration`` on ``allocation.placements``
        (the previous segment's workers have exited): report the new count, and the slots as
        ``placements``, now, so the pool can hand the slots a shrink or a move freed to others.
        A bare count (no placements) reports the count only, as does a keeper without a host."""
        workers = allocation.workers
        placements = allocation.placements if self.host is not None else None
        with self._lock:
            changed = workers != self._running or placements != self._running_on
            # the grant's first segment is where the chunk starts, not a rescale
            previous = self._running if self._applied_once else None
            self._running, self._running_on, self._applied_once = workers, placements, True
            if placements:
                self.hosts_used |= {h for h, _ in placements}
            reason = self.reasons[-1] if self.reasons else None
        if previous is not None and previous != workers:
            self.tracker.rescaled(iteration, workers, previous, reason)
        if changed:
            self.metrics.gauge("chunk.workers", workers, tags=self.tags)
            where = "" if placements is None else " on " + _where(placements)
            log.info("job %s: %d workers from iteration %d%s", self.job, workers, iteration, where)
            self._wake.set()

    def progressed(self, p: Progress) -> None:
        """The runner reached a boundary (its ``Progress``): the optimizer steps since the
        previous one at the same worker count and batch, timed here, go to the pool with the
        next heartbeat (how fast the job runs in that configuration), and so do an adaptive
        job's gradient statistics. A change of count or batch starts timing afresh, so a
        relaunch's start-up is not counted as training."""
        if not self.lost:  # a lost lease's try is no longer the job's (a newer one may train)
            self.tracker.progressed(p)
        now = self.clock()
        steps = int(p.iteration if p.steps is None else p.steps)
        batch = int(p.batch or 0)
        with self._lock:
            if p.grad_sqr is not None and p.grad_var is not None:
                self._grad = (float(p.grad_sqr), float(p.grad_var))
            last, self._at = self._at, (steps, int(p.workers), batch, now)
            if last is None or last[1:3] != (p.workers, batch) or steps <= last[0] or p.workers < 1:
                return
            hosts = len({h for h, _ in self._running_on}) if self._running_on else 1
            key = (int(p.workers), max(1, min(hosts, int(p.workers))), batch)
            acc = self._measured.setdefault(key, [0, 0.0])
            acc[0] += steps - last[0]
            acc[1] += now - last[3]

    def _progress(self) -> tuple[tuple[int, int, int] | None, Observation] | None:
        """One configuration's measurements to send (the others wait for the next beats), with
        the latest gradient statistics (None: nothing new measured)."""
        with self._lock:
            grad = self._grad
            stats = {} if grad is None else {"grad_sqr": grad[0], "grad_var": grad[1]}
            for key, (its, secs) in self._measured.items():
                if its > 0 and secs > 0:
                    return key, Observation(iterations=int(its), seconds=float(secs), workers=key[0],
                                            hosts=key[1], batch=key[2], **stats)
        return None

    def beat(self) -> None:
        with self._lock:
            running, running_on = self._running, self._running_on
        # placements only once known: before the first segment starts, the count alone decides
        extra: dict[str, Any] = {} if running_on is None else {"placements": running_on}
        measured = self._progress()
        if measured is not None:
            extra["measured"] = measured[1]
        try:
            target = self.client.heartbeat(self.job, self.epoch, workers=running, **extra)
        except LeaseExpiredError as exc:
            self._lose(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a busy or unreachable ledger, or any bug: keep beating
            silent = self.clock() - self._last_ok
            if self.ttl_s is not None and silent >= self.ttl_s:
                self._lose(f"no heartbeat succeeded for {silent:.0f}s (lease TTL {self.ttl_s:.0f}s): {exc}")
            else:
                kind = "" if isinstance(exc, ElasticOpsError) else f"{type(exc).__name__}: "
                log.warning("job %s: heartbeat failed (%s%s); retrying", self.job, kind, exc)
            return
        self._last_ok = self.clock()
        if measured is not None:  # sent: what was measured since goes with a later beat
            with self._lock:
                acc = self._measured.get(measured[0])
                if acc is not None:
                    acc[0] -= measured[1].iterations
                    acc[1] -= measured[1].seconds
                    if acc[0] <= 0:
                        del self._measured[measured[0]]
        action = str(target.action)  # a TargetAction (a str enum), or its value from the HTTP API
        wanted = 0 if action == "preempt" else int(target.workers)
        placements = () if wanted == 0 else tuple((str(h), int(s)) for h, s in target.placements)
        batch = int(target.batch)
        with self._lock:
            if wanted != self._wanted:
                self.reasons.append(f"{action} to {wanted}: {target.reason}")
                log.info("job %s: pool target %s -> %d workers (%s)", self.job, action, wanted, target.reason)
            if batch != self._batch:
                log.info("job %s: pool batch -> %s", self.job, batch or "the job's own")
            self._wanted, self._placements, self._batch = wanted, placements, batch

    def _lose(self, why: str) -> None:
        log.warning("job %s: lease lost (%s); stopping at the next boundary", self.job, why)
        self.lost = True
        with self._lock:
            self._wanted, self._placements = 0, ()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.beat()
            self._wake.wait(self.interval_s)
            self._wake.clear()


def _where(placements: Sequence[tuple[str, int]]) -> str:
    """``slots [0, 1] of h1, [3] of h2``: placements by host, in order."""
    by_host: dict[str, list[int]] = {}
    for host, slot in placements:
        by_host.setdefault(host, []).append(slot)
    return "slots " + ", ".join(f"{slots} of {host}" for host, slots in by_host.items())
