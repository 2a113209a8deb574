"""The pool client: the ledger's mechanism around the pure policies.

Every call runs **sync → decide → apply** in one database transaction:

- *sync* expires leases whose TTL passed (their slots return, their epoch dies) and returns
  cooled-down hosts to ``up``;
- *decide* builds a :class:`~elastic_ops.pool.model.Snapshot` and calls the configured policy;
- *apply* reserves the slots of decided grows, creates the caller's grant, releases slots a
  job has given up at its boundary, and records every change in ``events``.

Transactions are serialised: SQLite takes the write lock at ``BEGIN IMMEDIATE`` (with a busy
timeout and retries), PostgreSQL locks the single ``pool`` row with ``SELECT … FOR UPDATE``.
The ``allocations`` primary key ``(host, slot)`` makes a double grant impossible even so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, delete, func, insert, or_, select, true, update
from sqlalchemy.exc import DatabaseError, OperationalError

from elastic_ops.errors import (
    JobEndedError,
    LeaseExpiredError,
    LedgerBusyError,
    LedgerUnavailableError,
    SpecError,
    UnknownHostError,
    UnknownJobError,
)
from elastic_ops.metrics import NO_METRICS, Metrics
from elastic_ops.pool import engine as db
from elastic_ops.pool import schema as s
from elastic_ops.pool.checks import (
    CONFIG_FIELDS,
    MAX_EPOCH,
    MAX_LOOKBACK_H,
    check_bounds,
    check_config,
    check_epoch,
    check_flag,
    check_host,
    check_host_state,
    check_hosts,
    check_int,
    check_name,
    check_placements,
)
from elastic_ops.pool.engine import first_line, lock_timeout, make_engine, retryable
from elastic_ops.pool.model import (
    Decision,
    Host,
    HostState,
    Job,
    JobState,
    Plan,
    PolicyConfig,
    Preemption,
    Slot,
    Snapshot,
    TargetAction,
    outside,
)
from elastic_ops.pool.policies import get_policy
from elastic_ops.pool.usage import ADD as USAGE_ADD
from elastic_ops.pool.usage import REMOVE as USAGE_REMOVE
from elastic_ops.pool.usage import usage as usage_of
from elastic_ops.spec import MAX_WORKERS_LIMIT, check_host_selector, check_number
from elastic_ops.urls import shown_url

ENV_URL = "ELASTIC_OPS_POOL_URL"


@dataclasses.dataclass(frozen=True)
class Grant:
    job: str
    epoch: int
    placements: tuple[Slot, ...]
    ttl_s: float

    @property
    def workers(self) -> int:
        return len(self.placements)


@dataclasses.dataclass(frozen=True)
class Wait:
    job: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Target:
    """What a running job should do at its next boundary. ``workers`` = ``len(placements)``,
    the slots it holds now (0 for ``preempt``)."""

    job: str
    workers: int
    action: TargetAction
    reason: str
    placements: tuple[Slot, ...]


def _event_dict(r: Any) -> dict[str, Any]:
    return {
        "id": r.id,
        "ts": r.ts,
        "kind": r.kind,
        "job": r.job,
        "host": r.host,
        "slots": [tuple(x) for x in json.loads(r.slots)],
        "epoch": r.epoch,
        "workers": r.workers,
        "reason": r.reason,
    }


def _labels(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _avoidable(avoid: frozenset[str], up_slots: dict[str, int], min_workers: int) -> frozenset[str]:
    """The hosts a job avoids (those that failed it), unless the other hosts that are up cannot
    hold even its minimum: then avoiding them would make it wait forever (a one-host pool after
    one lost worker), and it is retried where it failed."""
    if avoid and sum(n for h, n in up_slots.items() if h not in avoid) < min_workers:
        return frozenset()
    return avoid


def _within_minimum(d: Decision, min_workers: int) -> Decision:
    """``d`` for a running job, never below its minimum while it moves: a job moved off an
    unhealthy host whose new slots are not all free yet (others release them at their next
    boundary) keeps enough of its old slots to run ``min_workers`` meanwhile, rather than shrink
    under its minimum and grow back. (With no new slot at all it is preempted, as planned.)"""
    short = min_workers - len(d.placements)
    if short <= 0 or not d.placements or not d.release:
        return d
    return dataclasses.replace(
        d, placements=d.placements + d.release[:short], release=d.release[short:],
        reason=f"{d.reason}; keeps {min(short, len(d.release))} old slots until its minimum fits on up hosts",
    )


def _raise_if_error(result: Any) -> Any:
    if isinstance(result, LeaseExpiredError):
        raise result
    return result


def _changed_demand(row: Any, values: dict[str, Any]) -> str:
    """What a submit changes of a job's demand, as ``"max 8 -> 2, priority 1 -> 7"`` ('' if nothing)."""
    parts = []
    for key in ("min_workers", "max_workers", "priority", "preemptible", "selector"):
        old, new = getattr(row, key), values[key]
        if key == "preemptible":
            old = bool(old)
        if old != new:
            parts.append(f"{key.removesuffix('_workers')} {old} -> {new}")
    return ", ".join(parts)


class PoolClient:
    """Client of the pool ledger. Safe to use from many processes at once (one client each).

    ``url``: an SQLAlchemy URL (``sqlite:////abs/path/pool.db``, ``postgresql+psycopg2://…``);
    the schema is created or migrated on first use. ``settings`` (``policy``, ``preemption``,
    ``lease_ttl_s``, ``min_rescale_interval_s``, ``min_gain``, ``aging_s``, ``job_idle_s``,
    ``cooling_s``, ``failure_threshold``) are stored in the ledger, shared by all clients.

    ``clock``: seconds since the epoch. By default the database's own clock on PostgreSQL, so
    that clients on hosts whose clocks disagree cannot expire each other's leases early (or keep
    them alive too long); this host's ``time.time`` on SQLite (a local file: one host).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        retries: int = 20,
        metrics: Metrics = NO_METRICS,
        **settings: Any,
    ) -> None:
        url = url or os.environ.get(ENV_URL)
        if not url:
            raise SpecError("url", url, f"give a ledger URL or set ${ENV_URL}")
        self.url = url
        self.clock = clock
        self.sleep = sleep
        self.retries = retries
        self.metrics = metrics
        self.engine = make_engine(url)
        try:
            self._tx(lambda conn, now: s.migrate(conn), lock=False)
        except DatabaseError as exc:
            if isinstance(exc, OperationalError) or "not a database" not in str(exc.orig):
                raise
            raise SpecError("url", shown_url(url), "an SQLite ledger file (or a path where one may be "
                            "created): this file is not an SQLite database") from None
        if settings:
            self.configure(**settings)

    # --- transactions -------------------------------------------------------------------

    def _tx(self, fn: Callable[[Connection, float], Any], *, lock: bool = True) -> Any:
        delay = 0.005
        for attempt in range(self.retries + 1):
            try:
                sent: list[tuple[str, str, float]] = []  # metrics, sent once the transaction commits
                with self.engine.begin() as conn:
                    conn.info.pop("pool_settings", None)
                    conn.info["pool_metrics"] = sent
                    if lock and conn.dialect.name == "postgresql":
                        conn.execute(select(s.pool.c.id).where(s.pool.c.id == 1).with_for_update())
                    out = fn(conn, self._now(conn))
                    conn.info.pop("pool_metrics", None)
                self._send(sent)
                return out
            except OperationalError as exc:
                if lock_timeout(exc):  # another client held the pool's lock for PG_LOCK_TIMEOUT_S
                    raise LedgerBusyError(
                        f"pool ledger {shown_url(self.url)}: the pool's lock was not granted within "
                        f"{db.PG_LOCK_TIMEOUT_S}s",
                        hint=f"a client holds it in a long transaction; the server ends one left idle for "
                        f"{db.PG_IDLE_IN_TX_S}s (a hung or stopped client)",
                    ) from exc
                if not retryable(exc):
                    # connection refused or lost: retryable by the caller (a heartbeat, a trigger,
                    # an Airflow try), never a raw driver error
                    raise LedgerUnavailableError(
                        f"pool ledger {shown_url(self.url)} unreachable: {first_line(exc.orig or exc)}",
                        hint="check that the database is up and reachable from this host",
                    ) from exc
                if attempt == self.retries:
                    raise LedgerBusyError(
                        f"pool ledger stayed busy after {self.retries} retries",
                        hint="too many concurrent clients for SQLite; use PostgreSQL",
                    ) from exc
            self.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 0.5)
        raise AssertionError("unreachable")  # pragma: no cover

    def _send(self, sent: list[tuple[str, str, float]]) -> None:
        for kind, name, value in sent:
            if kind == "incr":
                self.metrics.incr(name, int(value))
            else:
                self.metrics.gauge(name, value)

    @staticmethod
    def _gauges(conn: Connection, snap: Snapshot) -> None:
        """The pool as this decision found it (before it applies its own changes)."""
        running = sum(1 for j in snap.jobs if j.held)
        conn.info["pool_metrics"].extend([
            ("gauge", "pool.slots_up", sum(h.slots for h in snap.hosts if h.state == HostState.UP)),
            ("gauge", "pool.slots_used", sum(len(j.held) for j in snap.jobs)),
            ("gauge", "pool.jobs_running", running),
            ("gauge", "pool.jobs_waiting", len(snap.jobs) - running),
        ])

    def _now(self, conn: Connection) -> float:
        if self.clock is not None:
            return float(self.clock())
        if conn.dialect.name == "postgresql":  # one clock for every client of the ledger
            return float(conn.execute(select(func.extract("epoch", func.clock_timestamp()))).scalar_one())
        return time.time()

    def close(self) -> None:
        self.engine.dispose()

    # --- settings and hosts --------------------------------------------------------------

    def configure(self, **settings: Any) -> dict[str, Any]:
        """Change pool-wide settings (policy, preemption, TTL, anti-thrashing, aging) and re-plan."""
        changes = check_config(settings)

        def op(conn, now):
            if changes:
                conn.execute(update(s.pool).where(s.pool.c.id == 1).values(**changes))
                conn.info.pop("pool_settings", None)
                self._event(conn, now, "config", reason=json.dumps(changes, sort_keys=True))
            self._replan(conn, now)
            return self._settings(conn)

        return self._tx(op)

    def add_host(self, name: str, slots: int, labels: dict[str, str] | None = None) -> None:
        """Register (or update) a host with ``slots`` slots; it becomes ``up``."""
        check_host("host", name)
        check_int("slots", slots, 1, 1_000_000)
        # the rules host selectors follow: a label no selector could name is a typo
        labels_json = json.dumps(check_host_selector("labels", labels), sort_keys=True)

        def op(conn, now):
            row = conn.execute(select(s.hosts).where(s.hosts.c.name == name)).first()
            a = s.allocations.c
            busy = conn.execute(select(a.slot).where(a.host == name, a.slot >= slots)).first()
            if busy is not None:  # slots that would vanish under the jobs running on them
                raise SpecError(
                    "slots", slots,
                    f"must keep the slots jobs hold on host {name!r} (slot {busy.slot} is in use)",
                    hint=f"drain the host first (elastic-ops pool drain {name}), then shrink it",
                )
            values = dict(
                slots=slots, labels=labels_json, state=HostState.UP.value, state_since=now, failures=0
            )
            if row is None:
                conn.execute(insert(s.hosts).values(name=name, **values))
            else:
                conn.execute(update(s.hosts).where(s.hosts.c.name == name).values(**values))
            self._event(conn, now, "host", host=name, workers=slots, reason=f"added: {slots} slots, up")
            self._replan(conn, now)

        self._tx(op)

    def drain_host(self, name: str) -> None:
        """No new grants on ``name``; its jobs move off at their next iteration boundary."""
        self.set_host_state(name, HostState.DRAINING)

    def set_host_state(self, name: str, state: HostState | str) -> None:
        check_host("host", name)
        st = check_host_state(state)

        def op(conn, now):
            self._host_row(conn, name)
            conn.execute(
                update(s.hosts)
                .where(s.hosts.c.name == name)
                .values(state=st.value, state_since=now, failures=0)
            )
            self._event(conn, now, "host", host=name, reason=f"state -> {st.value}")
            self._replan(conn, now)

        self._tx(op)

    # --- jobs ----------------------------------------------------------------------------

    def submit(
        self,
        job: str,
        *,
        min_workers: int,
        max_workers: int,
        priority: int = 1,
        preemptible: bool = True,
        selector: Mapping[str, str] | None = None,
    ) -> None:
        """Register a job or update its demand (idempotent). A finished job becomes waiting again.
        ``selector``: labels every host the job runs on must carry (``{"gpu": "h100"}``)."""
        check_name("job", job)
        check_bounds(min_workers, max_workers)
        check_int("priority", priority, 1, 1000)
        if not isinstance(preemptible, bool):
            raise SpecError("preemptible", preemptible, "must be true or false")
        wanted = check_host_selector("selector", selector)

        def op(conn, now):
            row = conn.execute(select(s.jobs).where(s.jobs.c.name == job)).first()
            values = dict(
                min_workers=min_workers,
                max_workers=max_workers,
                priority=priority,
                preemptible=preemptible,
                last_seen=now,
                selector=json.dumps(wanted, sort_keys=True),
            )
            on = f" on hosts with {_labels(wanted)}" if wanted else ""
            if row is None:
                conn.execute(
                    insert(s.jobs).values(
                        name=job,
                        state=JobState.WAITING.value,
                        submitted=now,
                        waiting_since=now,
                        epoch=0,
                        avoid_hosts="[]",
                        target=0,
                        reason="submitted",
                        **values,
                    )
                )
                self._event(
                    conn,
                    now,
                    "submit",
                    job=job,
                    reason=f"min {min_workers} max {max_workers} "
                    f"priority {priority} preemptible {preemptible}{on}",
                )
            else:
                self._check_unpreemptible_min(conn, job, min_workers, preemptible)
                if row.state == JobState.FINISHED.value:  # a rerun (the DAG run was cleared)
                    values.update(
                        state=JobState.WAITING.value, waiting_since=now, submitted=now, avoid_hosts="[]"
                    )
                    self._event(conn, now, "submit", job=job, reason=f"registered again: min {min_workers} "
                                f"max {max_workers} priority {priority} preemptible {preemptible}{on}")
                elif changed := _changed_demand(row, values):  # the log keeps every job's demand
                    self._event(conn, now, "config", job=job, reason=f"submitted again: {changed}")
                conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(**values))
            self._replan(conn, now)

        self._tx(op)

    def request(
        self, job: str, *, avoid_hosts: Iterable[str] = (), new_attempt: bool = False
    ) -> Grant | Wait:
        """Ask for workers. Returns the live grant (new or existing) or ``Wait`` with the reason.

        ``new_attempt=True`` (the first request of a new try of a chunk): a lease the job still
        holds belongs to an earlier try, which may not be quite dead (a task killed while its
        workers still commit): it is re-issued under a new epoch, same slots, so fencing refuses
        whatever the earlier try still writes. A finished job waits again (a cleared or retried
        chunk); without ``new_attempt`` (a try asking again after a preemption, or a trigger
        polling) it raises :class:`JobEndedError`: the job was ended while that try ran (its run
        marked failed, its teardown ran), and must not be revived by it.
        """
        check_name("job", job)
        avoid = check_hosts("avoid_hosts", avoid_hosts)
        check_flag("new_attempt", new_attempt)

        def op(conn, now):
            self._sync(conn, now)  # an overdue lease is not handed out again
            row = self._job_row(conn, job)
            values: dict[str, Any] = {"last_seen": now}
            if avoid:
                values["avoid_hosts"] = json.dumps(sorted(set(json.loads(row.avoid_hosts)) | set(avoid)))
            if row.state == JobState.FINISHED.value:
                if not new_attempt:
                    raise JobEndedError(job)
                values.update(state=JobState.WAITING.value, waiting_since=now)
            lease = self._live_lease(conn, job)
            if lease is not None and row.state == JobState.PARKED.value:
                values["state"] = JobState.RUNNING.value  # the next chunk takes the parked slots
            conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(**values))
            if lease is not None and new_attempt:
                lease = self._reissue(conn, now, job, lease)
            if lease is None:
                plan = self._replan(conn, now, grant_to=job, synced=True)
                lease = self._live_lease(conn, job)
                if lease is None:
                    d = plan.get(job)
                    return Wait(job, d.reason if d else "not planned")
            ttl = self._settings(conn)["lease_ttl_s"]
            return Grant(job, lease.epoch, self._held(conn, job), ttl)

        return self._tx(op)

    def _reissue(self, conn: Connection, now: float, job: str, lease: Any) -> Any:
        """End ``lease`` and give its slots to a new lease of the next epoch."""
        epoch = self._job_row(conn, job).epoch + 1
        ttl = self._settings(conn)["lease_ttl_s"]
        self._end_lease(conn, now, job, lease.epoch, "superseded by a new try")
        conn.execute(insert(s.leases).values(job=job, epoch=epoch, granted=now, expires=now + ttl))
        conn.execute(update(s.allocations).where(s.allocations.c.job == job).values(epoch=epoch))
        conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(epoch=epoch, last_seen=now))
        self._event(conn, now, "reissue", job=job, epoch=epoch, slots=self._held(conn, job),
                    reason=f"new try: epoch {lease.epoch} -> {epoch}, same slots")
        return self._live_lease(conn, job)

    def heartbeat(
        self, job: str, epoch: int, *, workers: int, placements: Sequence[Slot] | None = None
    ) -> Target:
        """Renew the lease and return the target. ``workers``: what the job runs now.

        Slots the plan takes away are released when the job reports ``workers <= target``
        (and, if it passes ``placements``, no longer lists them): it has shrunk at a boundary.
        ``workers=0`` (the job stopped at a boundary after ``preempt``) ends the lease and returns
        all its slots, even if the plan has changed since; the job requests again later.
        """
        check_name("job", job)
        check_epoch(epoch)
        check_int("workers", workers, 0, MAX_WORKERS_LIMIT)
        placements = check_placements(placements)

        def op(conn, now):
            self._sync(conn, now)
            row = self._job_row(conn, job)
            if (dead := self._not_live(conn, job, epoch)) is not None:
                return dead  # raised after the commit: the expiry _sync found must stick
            if workers == 0:
                return self._stopped(conn, now, job, epoch)
            ttl = self._settings(conn)["lease_ttl_s"]
            conn.execute(
                update(s.leases)
                .where(s.leases.c.job == job, s.leases.c.epoch == epoch)
                .values(expires=now + ttl)
            )
            values: dict[str, Any] = {"last_seen": now}
            if row.state == JobState.PARKED.value:  # it runs workers: not parked any more
                values["state"] = JobState.RUNNING.value
            conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(**values))
            lo = row.min_workers
            d = _within_minimum(self._replan(conn, now, synced=True)[job], lo)
            # the slots a shrink gives up go once the job runs no more workers than the slots it
            # keeps (not its target: slots the target counts may not be free yet, e.g. when its
            # host drains while the others are full, and the job still runs on the old ones)
            if d.release and workers <= len(d.placements):
                gone = self._given_up(conn, job, d, placements)
                if gone:
                    self._free(
                        conn,
                        now,
                        job,
                        gone,
                        "shrink",
                        f"released at boundary: {d.reason}",
                        epoch=epoch,
                        workers=d.target,
                    )
                    d = _within_minimum(self._replan(conn, now, synced=True)[job], lo)
            self._mark_releasing(conn, now, job, d.release)
            return self._target(job, workers, d)

        return _raise_if_error(self._tx(op))

    def _stopped(self, conn: Connection, now: float, job: str, epoch: int) -> Target:
        """The job reports ``workers=0``: it checkpointed and stopped at a boundary (only a
        preempted job runs nothing, ``min_workers >= 1``). All its slots return, with a
        ``release`` event, and its lease ends, *whatever the plan says now*: the preemptor may
        have left since the job was told ``preempt``, and a plan that lets it keep its slots
        must not leave them (and a live lease) to a job that is no longer running."""
        held = self._held(conn, job)
        reason = self._job_row(conn, job).reason
        if held:
            self._free(
                conn, now, job, held, "release", f"stopped at boundary: {reason}", epoch=epoch, workers=0
            )
        self._end_lease(conn, now, job, epoch, "preempted")
        conn.execute(
            update(s.jobs)
            .where(s.jobs.c.name == job)
            .values(state=JobState.WAITING.value, waiting_since=now, last_seen=now)
        )
        self._replan(conn, now, synced=True)
        return Target(job, 0, TargetAction.PREEMPT, reason, ())

    def release(self, job: str, epoch: int, *, finished: bool = False, handover: bool = False) -> bool:
        """Give back every slot of the lease ``epoch``. Idempotent: a lease already ended (or
        expired) releases nothing and returns False. ``finished=True`` ends the job.

        ``handover=True`` (a chunk ended and the job's next chunk follows): the job keeps its
        lease and slots, *parked*, for one lease TTL, so the next chunk's request gets the same
        slots back (re-issued under a new epoch) rather than a new grant that may place it
        elsewhere, and the slots do not show as free in the gap between two Airflow tasks.
        Parked slots are still the plan's to move: a shrink frees them at once. Returns True if
        the lease was live."""
        check_name("job", job)
        check_epoch(epoch)
        check_flag("finished", finished)
        check_flag("handover", handover)
        if finished and handover:
            raise SpecError("handover", handover, "a finished job has no next chunk to hand over to; "
                            "pass finished=True or handover=True, not both")

        def op(conn, now):
            row = self._job_row(conn, job)
            self._sync(conn, now)
            live = self._live_lease(conn, job)
            if handover and live is not None and live.epoch == epoch:
                return self._park(conn, now, job, epoch)
            return self._give_back(conn, now, row, epoch, finished)

        return self._tx(op)

    def _park(self, conn: Connection, now: float, job: str, epoch: int) -> bool:
        ttl = self._settings(conn)["lease_ttl_s"]
        conn.execute(
            update(s.leases).where(s.leases.c.job == job, s.leases.c.epoch == epoch).values(expires=now + ttl)
        )
        conn.execute(
            update(s.jobs).where(s.jobs.c.name == job).values(state=JobState.PARKED.value, last_seen=now)
        )
        self._event(conn, now, "park", job=job, epoch=epoch, workers=0,
                    reason=f"chunk done; slots kept for the next chunk for {ttl:.0f}s")
        self._replan(conn, now, synced=True)
        return True

    def _give_back(self, conn: Connection, now: float, row: Any, epoch: int, finished: bool) -> bool:
        """:meth:`release` inside its transaction (the ledger synced)."""
        job = row.name
        live = self._live_lease(conn, job)
        released = live is not None and live.epoch == epoch
        if released:
            held = self._held(conn, job)
            why = "finished" if finished else "released"
            self._free(conn, now, job, held, "release", why, epoch=epoch, workers=0)
            self._end_lease(conn, now, job, epoch, why)
        # a late release of a lease already ended does not bring a finished job back: only its
        # next request does (on_kill ends the job, then the dying try releases again)
        revived = row.state == JobState.FINISHED.value and not released and not finished
        if (epoch == row.epoch or released) and not revived:
            state = JobState.FINISHED if finished else JobState.WAITING
            conn.execute(
                update(s.jobs)
                .where(s.jobs.c.name == job)
                .values(state=state.value, waiting_since=now, target=0, reason=state.value)
            )
            if finished:
                self._event(conn, now, "finish", job=job, epoch=epoch)
        self._replan(conn, now, synced=True)
        return released

    def finish(self, job: str) -> bool:
        """End ``job`` whatever it holds: a live lease is released (its slots return), the job
        leaves the plan. Idempotent: False when it had ended already. For a job whose run failed
        for good outside any grant."""

        def op(conn, now):
            row = self._job_row(conn, job)
            self._sync(conn, now)
            if row.state == JobState.FINISHED.value:
                return False
            live = self._live_lease(conn, job)
            self._give_back(conn, now, row, row.epoch if live is None else live.epoch, True)
            return True

        return self._tx(op)

    def report_failure(self, job: str, host: str) -> None:
        """``job`` failed on ``host``: the job avoids it from now on; enough failures cool it."""
        check_name("job", job)
        check_host("host", host)

        def op(conn, now):
            row = self._job_row(conn, job)
            h = self._host_row(conn, host)
            cfg = self._settings(conn)
            avoid = sorted(set(json.loads(row.avoid_hosts)) | {host})
            conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(avoid_hosts=json.dumps(avoid)))
            failures = h.failures + 1
            values: dict[str, Any] = {"failures": failures}
            reason = f"failure {failures} of job {job}"
            if failures >= cfg["failure_threshold"] and h.state == HostState.UP.value:
                values.update(state=HostState.COOLING.value, state_since=now, failures=0)
                reason += f"; cooling for {cfg['cooling_s']:.0f}s"
            conn.execute(update(s.hosts).where(s.hosts.c.name == host).values(**values))
            self._event(conn, now, "failure", job=job, host=host, reason=reason)
            self._replan(conn, now)

        self._tx(op)

    def check_epoch(self, job: str, epoch: int) -> None:
        """Raise :class:`LeaseExpiredError` unless ``epoch`` is the job's live lease."""
        check_name("job", job)
        check_epoch(epoch)

        def op(conn, now):
            self._job_row(conn, job)
            self._sync(conn, now)
            return self._not_live(conn, job, epoch)

        _raise_if_error(self._tx(op))

    def set_priority(self, job: str, priority: int) -> None:
        check_int("priority", priority, 1, 1000)
        self._update_job(job, {"priority": priority}, f"priority -> {priority}")

    def set_bounds(self, job: str, min_workers: int, max_workers: int) -> None:
        """Change a job's demand. A job that may not be preempted and holds fewer slots than the
        new minimum would have to be preempted to honour it: refused."""
        check_bounds(min_workers, max_workers)
        self._update_job(
            job,
            {"min_workers": min_workers, "max_workers": max_workers},
            f"bounds -> {min_workers}..{max_workers}",
            check=lambda conn, row: self._check_unpreemptible_min(conn, job, min_workers, row.preemptible),
        )

    def _check_unpreemptible_min(
        self, conn: Connection, job: str, min_workers: int, preemptible: bool
    ) -> None:
        """A job that may not be preempted and holds fewer slots than its minimum would have to be
        preempted to honour it: the change that would make it so is refused (bounds, submit,
        preemptible)."""
        held = len(self._held(conn, job))
        if not preemptible and 0 < held < min_workers:
            raise SpecError(
                "min_workers", min_workers,
                f"must be <= the {held} slots job {job!r} holds: it may not be preempted",
                hint="raise it once the job has released its slots, or make it preemptible",
            )

    def set_selector(self, job: str, selector: Mapping[str, str] | None) -> None:
        """Change the labels a job's hosts must carry (``{}``/None: any host). Slots it holds on
        hosts without them stay its own until it gives them back; new ones follow the selector."""
        wanted = check_host_selector("selector", selector)
        self._update_job(job, {"selector": json.dumps(wanted, sort_keys=True)},
                         f"selector -> {_labels(wanted) or 'any host'}")

    def set_preemptible(self, job: str, preemptible: bool) -> None:
        if not isinstance(preemptible, bool):
            raise SpecError("preemptible", preemptible, "must be true or false")
        self._update_job(job, {"preemptible": preemptible}, f"preemptible -> {preemptible}",
                         check=lambda conn, row: self._check_unpreemptible_min(
                             conn, job, row.min_workers, preemptible))

    def _update_job(
        self,
        job: str,
        values: dict[str, Any],
        reason: str,
        check: Callable[[Connection, Any], None] | None = None,
    ) -> None:
        def op(conn, now):
            row = self._job_row(conn, job)
            if check is not None:
                check(conn, row)
            conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(**values))
            self._event(conn, now, "config", job=job, reason=reason)
            self._replan(conn, now)

        self._tx(op)

    # --- reading -------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Hosts, jobs (with held slots, targets, leases) and settings, after a sync."""

        def op(conn, now):
            self._sync(conn, now)
            held: dict[str, list[Slot]] = {}
            per_host: dict[str, int] = {}
            for r in conn.execute(select(s.allocations).order_by(s.allocations.c.host, s.allocations.c.slot)):
                held.setdefault(r.job, []).append((r.host, r.slot))
                per_host[r.host] = per_host.get(r.host, 0) + 1
            live = {r.job: r for r in conn.execute(select(s.leases).where(s.leases.c.ended.is_(None)))}
            hosts = [
                {
                    "name": r.name,
                    "slots": r.slots,
                    "used": per_host.get(r.name, 0),
                    "state": r.state,
                    "labels": json.loads(r.labels),
                    "failures": r.failures,
                }
                for r in conn.execute(select(s.hosts).order_by(s.hosts.c.name))
            ]
            jobs = []
            for r in conn.execute(select(s.jobs).order_by(s.jobs.c.name)):
                lease = live.get(r.name)
                jobs.append(
                    {
                        "name": r.name,
                        "state": r.state,
                        "min_workers": r.min_workers,
                        "max_workers": r.max_workers,
                        "priority": r.priority,
                        "preemptible": r.preemptible,
                        "workers": len(held.get(r.name, ())),
                        "target": r.target,
                        "reason": r.reason,
                        "epoch": r.epoch,
                        "lease_expires_in": None if lease is None else round(lease.expires - now, 3),
                        "avoid_hosts": json.loads(r.avoid_hosts),
                        "selector": json.loads(r.selector),
                        "placements": [list(p) for p in held.get(r.name, ())],
                    }
                )
            total = sum(h["slots"] for h in hosts if h["state"] == HostState.UP.value)
            used = sum(per_host.values())
            return {
                "now": now,
                "settings": self._settings(conn),
                "hosts": hosts,
                "jobs": jobs,
                "slots": {"up": total, "used": used},
            }

        return self._tx(op)

    def events(
        self, job: str | None = None, *, since_id: int = 0, last: int | None = None
    ) -> list[dict[str, Any]]:
        """The event log, oldest first (optionally one job's, only ids above ``since_id``, only the
        ``last`` N)."""
        if last is not None:
            check_int("last", last, 1, 1_000_000)
        check_int("since_id", since_id, 0, MAX_EPOCH)
        if job is not None:
            check_name("job", job)

        def op(conn, now):
            q = select(s.events).where(s.events.c.id > since_id)
            if job is not None:
                q = q.where(s.events.c.job == job)
            if last is not None:  # the newest N, still returned oldest first
                q = select(q.order_by(s.events.c.id.desc()).limit(last).subquery())
                q = q.order_by(q.selected_columns.id)
            else:
                q = q.order_by(s.events.c.id)
            return [_event_dict(r) for r in conn.execute(q)]

        return self._tx(op, lock=False)

    def usage(self, *, hours: float | None = None, job: str | None = None) -> dict[str, Any]:
        """Slot-hours per job and per host over the last ``hours`` (default: since the oldest
        event), replayed from the event log (see :mod:`elastic_ops.pool.usage`); ``job``: that
        job's only (and the hosts as it used them), reading its events alone."""
        if hours is not None:
            check_number("hours", hours, minimum=0, exclusive=True, maximum=MAX_LOOKBACK_H)
        if job is not None:
            check_name("job", job)

        def op(conn, now):
            # only the events that give or take slots: targets, submissions and the rest change
            # no holding (and are most of a busy log)
            mine = s.events.c.job == job if job is not None else true()
            kinds = s.events.c.kind.in_(sorted(USAGE_ADD | USAGE_REMOVE))
            q = select(s.events).where(mine, kinds).order_by(s.events.c.id)
            rows = [_event_dict(r) for r in conn.execute(q)]
            oldest = conn.execute(select(func.min(s.events.c.ts)).where(mine)).scalar()
            slots = {r.name: r.slots for r in conn.execute(select(s.hosts.c.name, s.hosts.c.slots))}
            return now, rows, oldest, slots

        now, rows, oldest, slots = self._tx(op, lock=False)
        since = now - hours * 3600 if hours is not None else (now if oldest is None else float(oldest))
        return usage_of(rows, since, now).to_dict(slots)

    def prune_events(self, older_than_s: float) -> int:
        """Delete events older than ``older_than_s`` seconds; returns how many went.

        Events of a job that holds a live lease are kept whatever their age, so the log still
        explains every slot held now (replaying it gives the current allocation).
        """
        if (
            isinstance(older_than_s, bool)
            or not isinstance(older_than_s, int | float)
            or not 0 < older_than_s < float("inf")
        ):
            raise SpecError("older_than_s", older_than_s, "must be a positive number of seconds")

        def op(conn, now):
            live = select(s.leases.c.job).where(s.leases.c.ended.is_(None))
            gone = conn.execute(
                delete(s.events).where(
                    s.events.c.ts < now - older_than_s,
                    or_(s.events.c.job.is_(None), s.events.c.job.not_in(live)),
                )
            )
            return int(gone.rowcount or 0)

        return self._tx(op)

    # --- internals -----------------------------------------------------------------------

    def _settings(self, conn: Connection) -> dict[str, Any]:
        """Pool settings, read once per transaction (``_tx`` clears the cache)."""
        cached = conn.info.get("pool_settings")
        if cached is None:
            row = conn.execute(select(s.pool).where(s.pool.c.id == 1)).mappings().one()
            cached = conn.info["pool_settings"] = {k: row[k] for k in CONFIG_FIELDS}
        return cached

    def _job_row(self, conn: Connection, job: str):
        check_name("job", job)  # every job-named call comes here (a list would reach the SQL)
        row = conn.execute(select(s.jobs).where(s.jobs.c.name == job)).first()
        if row is None:
            raise UnknownJobError(job)
        return row

    def _host_row(self, conn: Connection, host: str):
        check_host("host", host)
        row = conn.execute(select(s.hosts).where(s.hosts.c.name == host)).first()
        if row is None:
            raise UnknownHostError(host)
        return row

    def _live_lease(self, conn: Connection, job: str):
        return conn.execute(select(s.leases).where(s.leases.c.job == job, s.leases.c.ended.is_(None))).first()

    def _not_live(self, conn: Connection, job: str, epoch: int) -> LeaseExpiredError | None:
        """The error to raise (once the transaction has committed) unless ``epoch`` is live."""
        live = self._live_lease(conn, job)
        if live is None or live.epoch != epoch:
            current = None if live is None else live.epoch
            return LeaseExpiredError(
                f"lease epoch {epoch} of job {job!r} is not live (live epoch: {current})",
                hint="the lease expired, was released or was replaced; request a new grant",
            )
        return None

    def _held(self, conn: Connection, job: str) -> tuple[Slot, ...]:
        rows = conn.execute(
            select(s.allocations.c.host, s.allocations.c.slot)
            .where(s.allocations.c.job == job)
            .order_by(s.allocations.c.host, s.allocations.c.slot)
        )
        return tuple((r.host, r.slot) for r in rows)

    def _event(
        self,
        conn: Connection,
        now: float,
        kind: str,
        *,
        job: str | None = None,
        host: str | None = None,
        slots: Sequence[Slot] = (),
        epoch: int | None = None,
        workers: int | None = None,
        reason: str = "",
    ) -> None:
        conn.info["pool_metrics"].append(("incr", f"pool.event.{kind}", 1))
        conn.execute(
            insert(s.events).values(
                ts=now,
                kind=kind,
                job=job,
                host=host,
                slots=json.dumps([list(x) for x in slots]),
                epoch=epoch,
                workers=workers,
                reason=reason,
            )
        )

    def _free(self, conn, now, job, slots: Sequence[Slot], kind: str, reason: str, *, epoch, workers) -> None:
        for h, sl in slots:
            conn.execute(
                delete(s.allocations).where(
                    s.allocations.c.host == h, s.allocations.c.slot == sl, s.allocations.c.job == job
                )
            )
        if slots:
            conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(last_rescale=now))
        self._event(conn, now, kind, job=job, slots=slots, epoch=epoch, workers=workers, reason=reason)

    def _given_up(self, conn, job, d: Decision, placements) -> list[Slot]:
        """Slots of ``d.release`` the job has certainly stopped using: it says so (``placements``),
        or it was told to release them in an earlier heartbeat and now runs ``workers <= target``
        (it acted at a boundary). A job that runs nothing is handled by :meth:`_stopped`."""
        if placements is not None:
            still = {tuple(p) for p in placements}
            return [sl for sl in d.release if sl not in still]
        rows = conn.execute(
            select(s.allocations.c.host, s.allocations.c.slot).where(
                s.allocations.c.job == job, s.allocations.c.releasing.is_not(None)
            )
        )
        told = {(r.host, r.slot) for r in rows}
        return [sl for sl in d.release if sl in told]

    def _mark_releasing(self, conn, now, job, release: Sequence[Slot]) -> None:
        """Remember which slots this heartbeat told the job to give up (and forget the rest)."""
        rows = conn.execute(
            select(s.allocations.c.host, s.allocations.c.slot, s.allocations.c.releasing).where(
                s.allocations.c.job == job
            )
        ).all()
        wanted = set(release)
        for r in rows:
            told = (r.host, r.slot) in wanted
            if told != (r.releasing is not None):
                conn.execute(
                    update(s.allocations)
                    .where(s.allocations.c.host == r.host, s.allocations.c.slot == r.slot)
                    .values(releasing=now if told else None)
                )

    def _end_lease(self, conn, now, job, epoch, why: str) -> None:
        conn.execute(
            update(s.leases)
            .where(s.leases.c.job == job, s.leases.c.epoch == epoch)
            .values(ended=now, end_reason=why)
        )

    def _sync(self, conn: Connection, now: float) -> None:
        """Expire overdue leases (slots return, epoch dies) and end finished cooling periods."""
        expired = conn.execute(
            select(s.leases).where(s.leases.c.ended.is_(None), s.leases.c.expires < now)
        ).all()
        for lease in expired:
            held = self._held(conn, lease.job)
            self._free(
                conn,
                now,
                lease.job,
                held,
                "expiry",
                f"lease expired at {lease.expires:.3f}",
                epoch=lease.epoch,
                workers=0,
            )
            self._end_lease(conn, now, lease.job, lease.epoch, "expired")
            conn.execute(
                update(s.jobs)
                .where(s.jobs.c.name == lease.job, s.jobs.c.state != JobState.FINISHED.value)
                .values(state=JobState.WAITING.value, waiting_since=now)
            )
        cooling_s = self._settings(conn)["cooling_s"]
        for h in conn.execute(
            select(s.hosts).where(
                s.hosts.c.state == HostState.COOLING.value, s.hosts.c.state_since + cooling_s <= now
            )
        ).all():
            conn.execute(
                update(s.hosts)
                .where(s.hosts.c.name == h.name)
                .values(state=HostState.UP.value, state_since=now)
            )
            self._event(conn, now, "host", host=h.name, reason="cooling over -> up")

    def _snapshot(self, conn: Connection, now: float, cfg: dict[str, Any]) -> Snapshot:
        hosts = tuple(
            Host(r.name, r.slots, HostState(r.state), tuple(sorted(json.loads(r.labels).items())))
            for r in conn.execute(select(s.hosts))
        )
        held: dict[str, list[Slot]] = {}
        for r in conn.execute(select(s.allocations.c.job, s.allocations.c.host, s.allocations.c.slot)):
            held.setdefault(r.job, []).append((r.host, r.slot))
        idle_before = now - cfg["job_idle_s"]
        up_slots = {h.name: h.slots for h in hosts if h.state is HostState.UP}
        jobs = []
        rows = conn.execute(select(s.jobs).where(s.jobs.c.state != JobState.FINISHED.value)).all()
        conn.info["pool_job_rows"] = {r.name: r for r in rows}
        for r in rows:
            mine = held.get(r.name, ())
            if not mine and r.last_seen < idle_before:
                continue  # a waiting job that stopped asking does not block others
            # hosts without the job's labels are never its own; among the others, those that
            # failed it are avoided unless that leaves too few
            excluded = outside(json.loads(r.selector), hosts)
            usable = {h: n for h, n in up_slots.items() if h not in excluded} if excluded else up_slots
            failed = _avoidable(frozenset(json.loads(r.avoid_hosts)), usable, r.min_workers)
            jobs.append(
                Job(
                    name=r.name,
                    min_workers=r.min_workers,
                    max_workers=r.max_workers,
                    priority=r.priority,
                    preemptible=bool(r.preemptible),
                    avoid_hosts=failed | excluded,
                    leave_hosts=excluded,  # a narrowed selector moves the job off them
                    submitted=r.submitted,
                    waiting_since=r.waiting_since,
                    last_rescale=r.last_rescale,
                    held=tuple(sorted(mine)),
                    epoch=r.epoch,
                )
            )
        config = PolicyConfig(
            preemption=Preemption(cfg["preemption"]),
            min_rescale_interval_s=cfg["min_rescale_interval_s"],
            min_gain=cfg["min_gain"],
            aging_s=cfg["aging_s"],
        )
        return Snapshot(hosts, tuple(jobs), now, config)

    def _replan(
        self, conn: Connection, now: float, *, grant_to: str | None = None, synced: bool = False
    ) -> Plan:
        """sync → decide → apply. Reserves decided grows of running jobs; grants only to
        ``grant_to`` (other waiting jobs get theirs when they ask). Returns the plan
        (``plan[job]`` is a job's :class:`Decision`). Reads every job's target and reason from
        the plan's columns; slot tuples are made only for the jobs given slots."""
        if not synced:
            self._sync(conn, now)
        cfg = self._settings(conn)
        while True:  # each pass that frees parked slots frees at least one: it ends
            snap = self._snapshot(conn, now, cfg)
            plan = get_policy(cfg["policy"])(snap)
            rows = conn.info.pop("pool_job_rows")  # read by _snapshot in this transaction
            if not self._unpark(conn, now, plan, rows, snap):
                break
        if self.metrics is not NO_METRICS:
            self._gauges(conn, snap)
        held_by = {j.name: j.held for j in snap.jobs}
        changed = set(plan.changed())
        for k, (name, target, reason) in enumerate(zip(plan.jobs, plan.target, plan.reason, strict=True)):
            row = rows[name]
            values: dict[str, Any] = {}
            if row.target != target or row.reason != reason:
                values.update(target=target, reason=reason)
                if row.target != target:
                    self._event(conn, now, "target", job=name, workers=target, reason=reason)
            if held_by[name]:
                new = plan.slots.new(k) if k in changed else ()
                if new:
                    self._reserve(conn, now, name, row.epoch, list(new), "grow", plan.decision(k))
                state = JobState.PREEMPTING if target == 0 else JobState.RUNNING
                if row.state == JobState.PARKED.value:  # _unpark left it slots to keep
                    state = JobState.PARKED
                if row.state != state.value:
                    values["state"] = state.value
                    if state == JobState.PREEMPTING:
                        self._event(conn, now, "preempt", job=name, epoch=row.epoch, workers=0, reason=reason)
            elif name == grant_to and k in changed:
                d = plan.decision(k)
                epoch = row.epoch + 1
                ttl = cfg["lease_ttl_s"]
                conn.execute(insert(s.leases).values(job=name, epoch=epoch, granted=now, expires=now + ttl))
                values.update(epoch=epoch, state=JobState.RUNNING.value)
                self._reserve(conn, now, name, epoch, list(d.placements), "grant", d)
            if values:
                conn.execute(update(s.jobs).where(s.jobs.c.name == name).values(**values))
        if len(rows) != len(plan.jobs):  # the common case: every job was planned, none idle
            self._mark_idle(conn, rows, set(plan.jobs), cfg["job_idle_s"])
        return plan

    @staticmethod
    def _mark_idle(conn: Connection, rows: dict[str, Any], planned: set[str], idle_s: float) -> None:
        """Jobs left out of the plan because nobody asked for them for ``job_idle_s`` (a task
        marked failed while it waited, a paused DAG): shown as such, not with the last share the
        plan gave them."""
        reason = f"idle: no request for over {idle_s:g}s (job_idle_s); planned again at its next request"
        for name in rows.keys() - planned:
            row = rows[name]
            if row.target != 0 or row.reason != reason:
                conn.execute(update(s.jobs).where(s.jobs.c.name == name).values(target=0, reason=reason))

    def _unpark(self, conn: Connection, now: float, plan: Plan, rows: dict[str, Any], snap: Snapshot) -> bool:
        """Apply at once what ``plan`` takes from parked jobs (they run nothing, so there is no
        boundary to wait for): a shrink frees the slots; a preemption, or a move of all its
        slots (e.g. off a draining host), ends the lease, and the next chunk's request is granted
        afresh. Returns whether any slot was freed (the plan must then be made again: they are
        free now)."""
        parked = {name for name, r in rows.items() if r.state == JobState.PARKED.value}
        if not parked:  # the common case: one pass over the rows, on every re-plan
            return False
        freed = False
        for job in snap.jobs:
            if job.name not in parked or not job.held:
                continue
            row = rows[job.name]
            # a parked job too keeps old slots rather than hand its next chunk less than its minimum
            d = _within_minimum(plan.decision(plan.index(job.name)), row.min_workers)
            if d.target == 0 or not d.placements or len(d.release) == len(job.held):
                why = "preempted" if d.target == 0 or not d.placements else "moved"
                self._free(conn, now, job.name, job.held, "release", f"parked, then {why}: {d.reason}",
                           epoch=row.epoch, workers=0)
                self._end_lease(conn, now, job.name, row.epoch, f"{why} while parked")
                conn.execute(
                    update(s.jobs)
                    .where(s.jobs.c.name == job.name)
                    .values(state=JobState.WAITING.value, waiting_since=now)
                )
                freed = True
            elif d.release:
                self._free(conn, now, job.name, d.release, "shrink", f"parked, released at once: {d.reason}",
                           epoch=row.epoch, workers=len(d.placements))
                freed = True
        return freed

    def _reserve(self, conn, now, job, epoch, slots: list[Slot], kind: str, d: Decision) -> None:
        conn.execute(
            insert(s.allocations),
            [{"host": h, "slot": sl, "job": job, "epoch": epoch, "granted": now} for h, sl in slots],
        )
        conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(last_rescale=now))
        self._event(
            conn, now, kind, job=job, slots=slots, epoch=epoch, workers=len(d.placements), reason=d.reason
        )

    @staticmethod
    def _target(job: str, workers: int, d: Decision) -> Target:
        n = len(d.placements)
        if d.target == 0 or n == 0:  # nothing usable to run on (e.g. its host drains, others full)
            action = TargetAction.PREEMPT
        elif n > workers or (n == workers and d.release):  # equal count + release: a move
            action = TargetAction.GROW
        elif n < workers:
            action = TargetAction.SHRINK
        else:
            action = TargetAction.KEEP
        return Target(job, n, action, d.reason, d.placements)
