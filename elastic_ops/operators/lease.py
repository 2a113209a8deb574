"""``LeaseKeeper``: heartbeats a grant in the background and feeds the runner its target.

The chunk runner calls :meth:`LeaseKeeper.target` at every iteration boundary; the keeper
answers with the pool's latest target (0 = full preemption) and remembers it as the worker count
the job now runs, which the next heartbeat reports, so a shrink frees its slots promptly.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from elastic_ops.errors import ElasticOpsError, LeaseExpiredError

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(self, client: Any, job: str, epoch: int, workers: int, *, interval_s: float) -> None:
        self.client = client
        self.job = job
        self.epoch = epoch
        self.interval_s = max(0.05, float(interval_s))
        self._lock = threading.Lock()
        self._wanted = workers     # what the pool wants
        self._running = workers    # what the runner runs (reported by heartbeats)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"lease-{job}", daemon=True)
        self.lost = False
        self.reasons: list[str] = []

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def target(self, iteration: int) -> int:
        with self._lock:
            wanted = self._wanted
            changed = wanted != self._running
            self._running = wanted
        if changed:
            log.info("job %s: %d workers from iteration %d", self.job, wanted, iteration)
            self._wake.set()  # report the new count now, so the pool can hand freed slots on
        return wanted

    def wanted(self) -> int:
        """The pool's latest target, without taking it (a runner elsewhere takes it later and
        says so through :meth:`applied`)."""
        with self._lock:
            return self._wanted

    def applied(self, iteration: int, workers: int) -> None:
        """A runner in another process (the agent) runs ``workers`` from boundary ``iteration`` on."""
        with self._lock:
            changed = workers != self._running
            self._running = workers
        if changed:
            log.info("job %s: %d workers from iteration %d", self.job, workers, iteration)
            self._wake.set()

    def beat(self) -> None:
        with self._lock:
            running = self._running
        try:
            target = self.client.heartbeat(self.job, self.epoch, workers=running)
        except LeaseExpiredError as exc:
            log.warning("job %s: lease lost (%s); stopping at the next boundary", self.job, exc)
            self.lost = True
            with self._lock:
                self._wanted = 0
            return
        except ElasticOpsError as exc:  # a busy ledger: try again at the next beat
            log.warning("job %s: heartbeat failed (%s)", self.job, exc)
            return
        action = str(getattr(target.action, "value", target.action))
        wanted = 0 if action == "preempt" else int(target.workers)
        with self._lock:
            if wanted != self._wanted:
                self.reasons.append(f"{action} to {wanted}: {target.reason}")
                log.info("job %s: pool target %s -> %d workers (%s)", self.job, action, wanted, target.reason)
            self._wanted = wanted

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.beat()
            self._wake.wait(self.interval_s)
            self._wake.clear()
