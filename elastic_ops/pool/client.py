"""The pool client: the ledger's API, one database transaction per call.

Every call runs **sync → decide → apply** (:mod:`elastic_ops.pool.ledger`) in one transaction,
so the plan every client acts on is the one the last change made.

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

from sqlalchemy import Connection, delete, func, insert, inspect, or_, select, true, update
from sqlalchemy.exc import DatabaseError, OperationalError, ProgrammingError

from elastic_ops.errors import (
    JobEndedError,
    LeaseExpiredError,
    LedgerBusyError,
    LedgerUnavailableError,
    SpecError,
)
from elastic_ops.metrics import NO_METRICS, Metrics
from elastic_ops.pool import engine as db
from elastic_ops.pool import ledger
from elastic_ops.pool import schema as s
from elastic_ops.pool.checks import (
    MAX_EPOCH,
    MAX_HOST_SLOTS,
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
from elastic_ops.pool.engine import NO_LEDGER_HINT, first_line, lock_timeout, make_engine, retryable
from elastic_ops.pool.ledger import Target
from elastic_ops.pool.model import HostState, JobState, Slot
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

    ``create=False`` (a client that only reads): a URL that holds no ledger yet is a
    :class:`SpecError`, not a new empty ledger (and on PostgreSQL, its tables).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        retries: int = 20,
        metrics: Metrics = NO_METRICS,
        create: bool = True,
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
        self.engine = make_engine(url, create=create)

        def first_use(conn: Connection, now: float) -> int:
            if not create and not inspect(conn).has_table(s.schema_version.name):
                raise SpecError("url", shown_url(url), "an existing pool ledger: this database holds none",
                                hint=NO_LEDGER_HINT)
            try:
                return s.migrate(conn)
            except SpecError as exc:  # a migration the database refuses: say which ledger
                raise SpecError("url", shown_url(url), exc.allowed, hint=exc.hint) from None

        try:
            self._tx(first_use, lock=False)
        except ProgrammingError as exc:  # e.g. the URL's search_path names no schema; no CREATE right
            raise SpecError("url", shown_url(url), "a database where the ledger's tables can be created "
                            f"and used: {first_line(exc.orig or exc)}",
                            hint="check that the URL's schema (search_path) exists and that its user may "
                            "create tables there") from None
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
        # the retries are for a lock lost in a moment (a deadlock, SQLite's busy handler giving
        # up at once); each SQLite try may itself wait the whole busy timeout for the write
        # lock: past that in all, a held lock is LedgerBusyError, not 21 such waits (~10 min)
        deadline = time.monotonic() + db.SQLITE_BUSY_TIMEOUT_S
        for attempt in range(self.retries + 1):
            try:
                sent: list[tuple[str, str, float]] = []  # metrics, sent once the transaction commits
                with self.engine.begin() as conn:
                    conn.info.pop("pool_settings", None)
                    conn.info["pool_metrics"] = sent
                    conn.info["pool_gauges"] = self.metrics is not NO_METRICS
                    if lock and conn.dialect.name == "postgresql":
                        conn.execute(select(s.pool.c.id).where(s.pool.c.id == 1).with_for_update())
                    out = fn(conn, self._now(conn))
                    conn.info.pop("pool_metrics", None)
                self._send(sent)
                return out
            except OperationalError as exc:
                if lock_timeout(exc):  # another client held a lock this call needs for PG_LOCK_TIMEOUT_S
                    raise LedgerBusyError(
                        f"pool ledger {shown_url(self.url)}: the pool's lock (or a table's) was not granted "
                        f"within {db.PG_LOCK_TIMEOUT_S}s",
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
                if attempt == self.retries or time.monotonic() >= deadline:
                    raise LedgerBusyError(
                        f"pool ledger {shown_url(self.url)} stayed busy after {attempt} retries",
                        hint="another client holds the ledger's lock in a long transaction (a hung or "
                        "stopped process), or too many clients use one SQLite file; use PostgreSQL",
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
                ledger.log_event(conn, now, "config", reason=json.dumps(changes, sort_keys=True))
            ledger.replan(conn, now)
            return ledger.pool_settings(conn)

        return self._tx(op)

    def add_host(self, name: str, slots: int, labels: dict[str, str] | None = None) -> None:
        """Register (or update) a host with ``slots`` slots; it becomes ``up``."""
        check_host("host", name)
        check_int("slots", slots, 1, MAX_HOST_SLOTS)
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
            ledger.log_event(conn, now, "host", host=name, workers=slots, reason=f"added: {slots} slots, up")
            ledger.replan(conn, now)

        self._tx(op)

    def drain_host(self, name: str) -> None:
        """No new grants on ``name``; its jobs move off at their next iteration boundary."""
        self.set_host_state(name, HostState.DRAINING)

    def set_host_state(self, name: str, state: HostState | str) -> None:
        check_host("host", name)
        st = check_host_state(state)

        def op(conn, now):
            ledger.host_row(conn, name)
            conn.execute(
                update(s.hosts)
                .where(s.hosts.c.name == name)
                .values(state=st.value, state_since=now, failures=0)
            )
            ledger.log_event(conn, now, "host", host=name, reason=f"state -> {st.value}")
            ledger.replan(conn, now)

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
                ledger.log_event(
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
                    ledger.log_event(
                        conn, now, "submit", job=job, reason=f"registered again: min {min_workers} "
                        f"max {max_workers} priority {priority} preemptible {preemptible}{on}",
                    )
                elif changed := _changed_demand(row, values):  # the log keeps every job's demand
                    ledger.log_event(conn, now, "config", job=job, reason=f"submitted again: {changed}")
                conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(**values))
            ledger.replan(conn, now)

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
            ledger.sync(conn, now)  # an overdue lease is not handed out again
            row = ledger.job_row(conn, job)
            values: dict[str, Any] = {"last_seen": now}
            if avoid:
                values["avoid_hosts"] = json.dumps(sorted(set(json.loads(row.avoid_hosts)) | set(avoid)))
            if row.state == JobState.FINISHED.value:
                if not new_attempt:
                    raise JobEndedError(job)
                values.update(state=JobState.WAITING.value, waiting_since=now)
            lease = ledger.live_lease(conn, job)
            if lease is not None and row.state == JobState.PARKED.value:
                values["state"] = JobState.RUNNING.value  # the next chunk takes the parked slots
            conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(**values))
            if lease is not None and new_attempt:
                lease = ledger.reissue(conn, now, job, lease)
            if lease is None:
                plan = ledger.replan(conn, now, grant_to=job, synced=True)
                lease = ledger.live_lease(conn, job)
                if lease is None:
                    d = plan.get(job)
                    return Wait(job, d.reason if d else "not planned")
            ttl = ledger.pool_settings(conn)["lease_ttl_s"]
            return Grant(job, lease.epoch, ledger.held_slots(conn, job), ttl)

        return self._tx(op)


    def heartbeat(
        self, job: str, epoch: int, *, workers: int, placements: Sequence[Slot] | None = None
    ) -> Target:
        """Renew the lease and return the target. ``workers``: what the job runs now.

        Slots the plan takes away are released when the job reports ``workers <= target``
        (and, if it passes ``placements``, no longer lists them): it has shrunk at a boundary.
        ``workers=0`` (the job stopped at a boundary after ``preempt``) ends the lease and returns
        all its slots, even if the plan has changed since; the job requests again later. So does a
        preempted job left holding no slot (its ``placements`` lists none of them).
        """
        check_name("job", job)
        check_epoch(epoch)
        check_int("workers", workers, 0, MAX_WORKERS_LIMIT)
        placements = check_placements(placements)

        def op(conn, now):
            ledger.sync(conn, now)
            row = ledger.job_row(conn, job)
            if (dead := ledger.lease_error(conn, job, epoch)) is not None:
                return dead  # raised after the commit: the expiry sync() found must stick
            if workers == 0:
                return ledger.stopped(conn, now, job, epoch)
            ttl = ledger.pool_settings(conn)["lease_ttl_s"]
            conn.execute(
                update(s.leases)
                .where(s.leases.c.job == job, s.leases.c.epoch == epoch)
                .values(expires=now + ttl)
            )
            values: dict[str, Any] = {"last_seen": now}
            if row.state == JobState.PARKED.value:  # it runs workers: not parked any more
                values["state"] = JobState.RUNNING.value
            conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(**values))
            if left := ledger.abandoned(conn, job, placements):
                ledger.free_slots(conn, now, job, left, "shrink", "released at boundary: no longer used",
                                  epoch=epoch, workers=workers)
            lo = row.min_workers
            d = ledger.within_minimum(ledger.replan(conn, now, synced=True)[job], lo)
            # the slots a shrink gives up go once the job runs no more workers than the slots it
            # keeps (not its target: slots the target counts may not be free yet, e.g. when its
            # host drains while the others are full, and the job still runs on the old ones)
            if d.release and workers <= len(d.placements):
                gone = ledger.given_up(conn, job, d, placements)
                if gone:
                    ledger.free_slots(
                        conn,
                        now,
                        job,
                        gone,
                        "shrink",
                        f"released at boundary: {d.reason}",
                        epoch=epoch,
                        workers=d.target,
                    )
                    d = ledger.within_minimum(ledger.replan(conn, now, synced=True)[job], lo)
            if d.target == 0 and not ledger.held_slots(conn, job):
                # preempted and holding nothing now: it has stopped, whatever it says it runs (a
                # live lease holding no slot was granted back as 0 workers)
                return ledger.stopped(conn, now, job, epoch)
            ledger.mark_releasing(conn, now, job, d.release)
            return ledger.target_of(job, workers, d)

        return _raise_if_error(self._tx(op))


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
            row = ledger.job_row(conn, job)
            ledger.sync(conn, now)
            live = ledger.live_lease(conn, job)
            if handover and live is not None and live.epoch == epoch:
                return ledger.park(conn, now, job, epoch)
            return ledger.give_back(conn, now, row, epoch, finished)

        return self._tx(op)



    def finish(self, job: str) -> bool:
        """End ``job`` whatever it holds: a live lease is released (its slots return), the job
        leaves the plan. Idempotent: False when it had ended already. For a job whose run failed
        for good outside any grant."""

        def op(conn, now):
            row = ledger.job_row(conn, job)
            ledger.sync(conn, now)
            if row.state == JobState.FINISHED.value:
                return False
            live = ledger.live_lease(conn, job)
            ledger.give_back(conn, now, row, row.epoch if live is None else live.epoch, True)
            return True

        return self._tx(op)

    def report_failure(self, job: str, host: str) -> None:
        """``job`` failed on ``host``: the job avoids it from now on; enough failures cool it."""
        check_name("job", job)
        check_host("host", host)

        def op(conn, now):
            row = ledger.job_row(conn, job)
            h = ledger.host_row(conn, host)
            cfg = ledger.pool_settings(conn)
            avoid = sorted(set(json.loads(row.avoid_hosts)) | {host})
            conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(avoid_hosts=json.dumps(avoid)))
            failures = h.failures + 1
            values: dict[str, Any] = {"failures": failures}
            reason = f"failure {failures} of job {job}"
            if failures >= cfg["failure_threshold"] and h.state == HostState.UP.value:
                values.update(state=HostState.COOLING.value, state_since=now, failures=0)
                reason += f"; cooling for {cfg['cooling_s']:.0f}s"
            conn.execute(update(s.hosts).where(s.hosts.c.name == host).values(**values))
            ledger.log_event(conn, now, "failure", job=job, host=host, reason=reason)
            ledger.replan(conn, now)

        self._tx(op)

    def check_epoch(self, job: str, epoch: int) -> None:
        """Raise :class:`LeaseExpiredError` unless ``epoch`` is the job's live lease."""
        check_name("job", job)
        check_epoch(epoch)

        def op(conn, now):
            ledger.job_row(conn, job)
            ledger.sync(conn, now)
            return ledger.lease_error(conn, job, epoch)

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
        held = len(ledger.held_slots(conn, job))
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
            row = ledger.job_row(conn, job)
            if check is not None:
                check(conn, row)
            conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(**values))
            ledger.log_event(conn, now, "config", job=job, reason=reason)
            ledger.replan(conn, now)

        self._tx(op)

    # --- reading -------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Hosts, jobs (with held slots, targets, leases) and settings, after a sync."""

        def op(conn, now):
            ledger.sync(conn, now)
            held, going = ledger.holdings(conn)
            per_host: dict[str, int] = {}
            for slots in held.values():
                for h, _ in slots:
                    per_host[h] = per_host.get(h, 0) + 1
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
                        "placements": [list(p) for p in sorted(held.get(r.name, ()))],
                        "releasing": [list(p) for p in sorted(going.get(r.name, ()))],
                    }
                )
            total = sum(h["slots"] for h in hosts if h["state"] == HostState.UP.value)
            used = sum(per_host.values())
            return {
                "now": now,
                "settings": ledger.pool_settings(conn),
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
            # the newest event stays whatever its age: SQLite numbers a new row max(id) + 1, so
            # with it gone the next events would take ids a reader polling since_id has seen
            newest = conn.execute(select(func.max(s.events.c.id))).scalar() or 0
            gone = conn.execute(
                delete(s.events).where(
                    s.events.c.ts < now - older_than_s,
                    s.events.c.id < newest,
                    or_(s.events.c.job.is_(None), s.events.c.job.not_in(live)),
                )
            )
            return int(gone.rowcount or 0)

        return self._tx(op)

    # --- internals -----------------------------------------------------------------------


















