"""``GrantTrigger`` (wait for a grant) and ``PoolCapacityTrigger`` (wait for free capacity).

Both poll the pool ledger from the triggerer in a worker thread (the ledger client is
synchronous SQLAlchemy). Everything the deferred task needs afterwards travels in the trigger's
keyword arguments and comes back in the event payload: the task keeps no state across deferral.
The ledger URL (which may hold a password) travels in the kwargs only: Airflow stores trigger
kwargs encrypted (Fernet) and its REST API does not return them; the triggers' ``repr`` (which
the triggerer logs) shows it without password, and no event payload carries it. (Resolving the
connection in the triggerer instead costs ~3 s on a cold triggerer's first lookup, measured,
which delays the first grant by as much.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from elastic_ops.errors import ElasticOpsError, UnknownJobError
from elastic_ops.pool.api import Grant
from elastic_ops.triggers.events import CapacityEvent, GrantEvent, TriggerFailure
from elastic_ops.urls import shown_url

if TYPE_CHECKING:
    from elastic_ops.pool import PoolClient
    from elastic_ops.pool.api import Wait

_MODULE = "elastic_ops.triggers.pool"

# GrantTrigger's wait for ``not_before`` (tests replace them)
_wall_clock = time.time
_sleep = asyncio.sleep


def _open_ledger(url: str):
    from elastic_ops.pool import PoolClient  # imported off the event loop: numpy, SQLAlchemy

    return PoolClient(url)


async def _pool_client(ledger_url: str):
    return await asyncio.to_thread(_open_ledger, ledger_url)


def _close_quietly(client: PoolClient) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing must not replace the event or the cancellation
        pass


class _LedgerTrigger(BaseTrigger):
    ledger_url: str

    def __repr__(self) -> str:  # the triggerer logs it; BaseTrigger's would print the password
        classpath, kwargs = self.serialize()
        return self.repr(classpath, {**kwargs, "ledger_url": shown_url(kwargs["ledger_url"])})


def free_slots(status: dict[str, Any], host_selector: dict[str, str] | None = None) -> int:
    """Free slots on hosts that take grants (state ``up``) and carry every label of
    ``host_selector``, from ``PoolClient.status()``."""
    want = set((host_selector or {}).items())
    return sum(
        max(0, int(h["slots"]) - int(h.get("used", 0)))
        for h in status.get("hosts", [])
        if str(h.get("state", "up")) == "up" and want <= set(h.get("labels", {}).items())
    )


class GrantTrigger(_LedgerTrigger):
    """Fires once the pool grants ``job`` at least its minimum, with the grant in the event.

    The trigger *requests* (it is the job's place in the pool's queue, so the pool can plan and
    preempt for it); the resumed task heartbeats the grant at once. On a ledger error that
    retrying cannot fix it fires a ``TriggerFailure`` event instead of looping forever.

    ``not_before`` (Unix time): the first request waits until then. A grant that fires within
    seconds of the deferral can meet apache/airflow#72716 (Airflow 3.3): the scheduler takes the
    deferring process's late exit event for the resumed try's and fails the resumed try
    mid-chunk. The chunk task asked in-process for ``defer_after`` seconds already; a few more
    before the first request here cost little and give the scheduler time to see that exit.
    """

    def __init__(
        self,
        *,
        job: str,
        ledger_url: str,
        state: dict[str, Any],
        avoid_hosts: list[str] | tuple[str, ...] = (),
        poll_interval: float = 1.0,
        not_before: float | None = None,
    ) -> None:
        super().__init__()
        self.job = job
        self.ledger_url = ledger_url
        self.state = dict(state)
        self.avoid_hosts = list(avoid_hosts)
        self.poll_interval = float(poll_interval)
        self.not_before = None if not_before is None else float(not_before)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{_MODULE}.GrantTrigger",
            {
                "job": self.job, "ledger_url": self.ledger_url, "state": self.state,
                "avoid_hosts": list(self.avoid_hosts), "poll_interval": self.poll_interval,
                "not_before": self.not_before,
            },
        )

    def _request_once(self, client: PoolClient) -> Grant | Wait:
        return client.request(self.job, avoid_hosts=tuple(self.avoid_hosts))

    async def on_kill(self) -> None:
        """A user acted on the waiting task (mark failed or succeeded, clear; Airflow 3.3 calls
        this only then, not when a triggerer stops): end the job in the pool, whose queue place
        this trigger held, so that its demand stops holding slots back from other jobs at once,
        not after ``job_idle_s``. A cleared task's next request makes the job wait again."""
        def finish() -> None:
            client = _open_ledger(self.ledger_url)
            try:
                client.finish(self.job)
            finally:
                client.close()

        try:
            await asyncio.to_thread(finish)
        except ElasticOpsError as exc:  # the ledger's own safety net (job_idle_s) still applies
            self.log.warning("could not end job %s in the pool (%s); it leaves the plan after "
                             "job_idle_s", self.job, exc)
        else:
            self.log.info("job %s: its waiting task was stopped by a user; ended in the pool", self.job)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        started = time.monotonic()
        if self.not_before is not None and (delay := self.not_before - _wall_clock()) > 0:
            await _sleep(delay)
        client = None
        try:
            while True:
                try:
                    if client is None:
                        client = await _pool_client(self.ledger_url)
                    outcome = await asyncio.to_thread(self._request_once, client)
                except ElasticOpsError as exc:
                    if not exc.retryable:
                        # an unknown job (the ledger was reset): the task's next try registers it again
                        again = isinstance(exc, UnknownJobError)
                        yield TriggerEvent(TriggerFailure(str(exc), type(exc).__name__, again).to_payload())
                        return
                    # a busy ledger: keep waiting rather than fail the task
                    self.log.warning("pool ledger busy (%s); still waiting", exc)
                    await asyncio.sleep(self.poll_interval)
                    continue
                if isinstance(outcome, Grant):
                    waited = time.monotonic() - started
                    self.log.info("job %s granted %d workers (epoch %s) after %.1fs",
                                  self.job, len(outcome.placements), outcome.epoch, waited)
                    yield TriggerEvent(GrantEvent.from_grant(outcome, self.state, waited).to_payload())
                    return
                self.log.debug("job %s waits: %s", self.job, outcome.reason)
                await asyncio.sleep(self.poll_interval)
        finally:  # the engine's pooled connections, at once (not at the next GC)
            if client is not None:
                _close_quietly(client)


class PoolCapacityTrigger(_LedgerTrigger):
    """Fires when the pool has at least ``min_workers`` free slots (on hosts with the labels of
    ``host_selector``, if given)."""

    def __init__(
        self,
        *,
        ledger_url: str,
        min_workers: int,
        poll_interval: float = 2.0,
        host_selector: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.ledger_url = ledger_url
        self.min_workers = int(min_workers)
        self.poll_interval = float(poll_interval)
        self.host_selector = dict(host_selector or {})

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{_MODULE}.PoolCapacityTrigger",
            {"ledger_url": self.ledger_url, "min_workers": self.min_workers,
             "poll_interval": self.poll_interval, "host_selector": dict(self.host_selector)},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        started = time.monotonic()
        client = None
        try:
            while True:
                try:
                    if client is None:
                        client = await _pool_client(self.ledger_url)
                    free = free_slots(await asyncio.to_thread(client.status), self.host_selector)
                except ElasticOpsError as exc:
                    if not exc.retryable:
                        yield TriggerEvent(TriggerFailure(str(exc), type(exc).__name__, False).to_payload())
                        return
                    # a busy or unreachable ledger: keep watching, as GrantTrigger keeps waiting
                    self.log.warning("pool ledger unavailable (%s); still watching", exc)
                    await asyncio.sleep(self.poll_interval)
                    continue
                if free >= self.min_workers:
                    waited = time.monotonic() - started
                    yield TriggerEvent(CapacityEvent(free, self.min_workers, waited).to_payload())
                    return
                await asyncio.sleep(self.poll_interval)
        finally:  # the engine's pooled connections, at once (not at the next GC)
            if client is not None:
                _close_quietly(client)
