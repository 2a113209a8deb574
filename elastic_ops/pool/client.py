"""The pool client: the ledger's API. It checks every argument, then runs the ledger's named
operations (:class:`elastic_ops.pool.ledger.Tx`) in transactions.

- A **change** (submit, request, release, priority, bounds, selector, hosts, settings) runs
  under the pool lock, marks the plan dirty and returns once a committed plan has seen it
  (group commit: one caller plans for every change made before its plan began).
- A **heartbeat** takes no pool lock and does not plan: it renews one lease, reports what the job measured
  and reads the target the planner last wrote. When it finds a plan due (dirty, a lease
  overdue, the last plan older than ``plan_refresh_s``) it runs one if no other client is.
- One plan at a time: the pool lock (SQLite: the file's write lock; PostgreSQL: the ``pool``
  row, ``FOR UPDATE``; a try that finds it held skips). The ``allocations`` primary key
  ``(host, slot)`` makes a double grant impossible even so.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection, Row, func, inspect, select, true
from sqlalchemy.exc import DatabaseError, DBAPIError, OperationalError, ProgrammingError
from tenacity import (
    Retrying,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from elastic_ops.errors import (
    LeaseExpiredError,
    LedgerBusyError,
    LedgerUnavailableError,
    SpecError,
)
from elastic_ops.metrics import NO_METRICS, Metrics
from elastic_ops.pool import engine as db
from elastic_ops.pool import ledger
from elastic_ops.pool import schema as s
from elastic_ops.pool.api import SLOT_KINDS, EventKind, Grant, Target, Wait
from elastic_ops.pool.checks import (
    MAX_EPOCH,
    MAX_HOST_SLOTS,
    MAX_LOOKBACK_H,
    check_batching,
    check_bounds,
    check_config,
    check_epoch,
    check_flag,
    check_host,
    check_host_state,
    check_hosts,
    check_int,
    check_name,
    check_observation,
    check_placements,
)
from elastic_ops.pool.engine import NO_LEDGER_HINT, first_line, lock_timeout, make_engine, retryable
from elastic_ops.pool.ledger import PlannerState, Tx
from elastic_ops.pool.model import HostState, Observation, Slot
from elastic_ops.pool.scaling import Batching, ScalingModel, measured_from_rows
from elastic_ops.pool.scaling import fit as fit_scaling
from elastic_ops.pool.usage import lent_and_borrowed
from elastic_ops.pool.usage import usage as usage_of
from elastic_ops.spec import (
    DEFAULT_TENANT,
    MAX_WORKERS_LIMIT,
    check_host_selector,
    check_number,
    check_tenant,
)
from elastic_ops.urls import shown_url

T = TypeVar("T")
SETTLE_POLL_S = 0.002  # a change waiting for another's plan reads the planner this often (x2, to 50 ms)
_BUSY = object()  # _plan_for: another client holds the pool lock
MAX_TENANT_SLOTS = 10**9  # a tenant's guarantee or max (slots)
NUDGE_BACKOFF_S = 1.0  # a heartbeat that found another client planning tries again after this (its
# plan, once committed, covers what this one saw; a planner that died drops its lock at once)


class Lock(enum.StrEnum):
    """How a transaction takes the pool lock: ``pool`` waits for it, ``try`` skips when another
    client holds it (``Tx.locked`` says which), ``none`` takes none (heartbeats, reads)."""

    POOL = "pool"
    TRY = "try"
    NONE = "none"


ENV_URL = "ELASTIC_OPS_POOL_URL"


def check_event_kinds(kinds: Sequence[str] | None) -> list[str]:
    """``kinds`` as event kinds (:class:`EventKind`'s values), each known."""
    if kinds is None:
        return []
    known = [k.value for k in EventKind]
    if isinstance(kinds, str) or not all(isinstance(k, str) and k in known for k in kinds) or len(kinds) > 64:
        raise SpecError("kind", kinds, f"event kinds, each one of {', '.join(known)}")
    return sorted(set(kinds))


def _event_dict(r: Row[Any]) -> dict[str, Any]:
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


def _raise_if_error(result: T | LeaseExpiredError) -> T:
    if isinstance(result, LeaseExpiredError):
        raise result
    return result


class PoolClient:
    """Client of the pool ledger. Safe to use from many processes at once (one client each).

    ``url``: an SQLAlchemy URL (``sqlite:////abs/path/pool.db``, ``postgresql+psycopg2://…``);
    the schema is created or migrated on first use. ``settings`` (``policy``, ``preemption``,
    ``lease_ttl_s``, ``min_rescale_interval_s``, ``min_gain``, ``aging_s``, ``job_idle_s``,
    ``cooling_s``, ``failure_threshold``, ``plan_interval_s``, ``plan_refresh_s``,
    ``rescale_cost_s``) are stored in the ledger, shared by all clients.

    ``clock``: seconds since the epoch. By default the database's own clock on PostgreSQL, so
    that clients on hosts whose clocks disagree cannot expire each other's leases early (or keep
    them alive too long); this host's ``time.time`` on SQLite (a local file: one host).

    ``create=False`` (a client that only reads): a URL that holds no ledger yet is a
    :class:`SpecError`, not a new empty ledger (and on PostgreSQL, its tables).

    ``wait_for_plan=False`` (bulk tools: registering thousands of jobs): a change returns once
    it is committed, without waiting for a plan that saw it; it plans then only if no other
    client is planning (one that is plans again, the plan being dirty), so a request may answer
    ``Wait`` and be granted by that plan.
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
        wait_for_plan: bool = True,
        **settings: object,
    ) -> None:
        url = url or os.environ.get(ENV_URL)
        if not url:
            raise SpecError("url", url, f"give a ledger URL or set ${ENV_URL}")
        self.url = url
        self.clock = clock
        self.sleep = sleep
        self.retries = retries
        self.metrics = metrics
        self.wait_for_plan = check_flag("wait_for_plan", wait_for_plan)
        self.engine = make_engine(url, create=create)
        self._inline_engine = (
            self.engine.execution_options(**{db.INLINE_SETTINGS: True})
            if self.engine.dialect.name == "postgresql" else None
        )
        self._inline_head = (
            None if self._inline_engine is None
            else db.fast_queries(
                ledger.heartbeat_statements(db.inline_settings(self.engine), clock is not None),
                self.engine.dialect,
            )
        )
        self._local = threading.local()
        self._nudge_after = 0.0  # monotonic: no try to plan before (another client was planning)
        # one retry policy per client (tenacity keeps each call's state per thread)
        self._retrying = Retrying(
            stop=stop_after_attempt(retries + 1) | stop_after_delay(db.SQLITE_BUSY_TIMEOUT_S),
            wait=wait_random_exponential(multiplier=0.005, max=0.5),
            retry=retry_if_exception(_lost_lock) | retry_if_exception_type(_Dropped),
            sleep=sleep,
            reraise=True,
        )

        def first_use(tx: Tx) -> int:
            conn = tx.conn
            if not create and not inspect(conn).has_table(s.schema_version.name):
                raise SpecError("url", shown_url(url), "an existing pool ledger: this database holds none",
                                hint=NO_LEDGER_HINT)
            try:
                return s.migrate(conn)
            except SpecError as exc:  # a migration the database refuses: say which ledger
                raise SpecError("url", shown_url(url), exc.allowed, hint=exc.hint) from None

        try:
            self._tx(first_use, lock=Lock.NONE)
        except ProgrammingError as exc:  # e.g. the URL's search_path names no schema; no CREATE right
            raise SpecError("url", shown_url(url), "a database where the ledger's tables can be created "
                            f"and used: {first_line(exc.orig or exc, url)}",
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

    def _run(self, fn: Callable[[Tx], T], lock: Lock, inline: bool = False) -> tuple[T, Tx]:
        """One try of a transaction: begin, lock as ``lock`` says, run ``fn``, commit.
        ``inline`` (PostgreSQL, a transaction whose first statement is ``fn``'s and sets the
        session settings itself): the engine does not send them on its own, and ``now`` is
        the database's clock that statement reads (``Tx.now`` None until then)."""
        committing = False
        inline = inline and self._inline_engine is not None
        # PostgreSQL: each thread keeps one connection (a checkout from the pool and back per
        # call is a visible share of a heartbeat's cost); its transactions set the session
        # settings themselves (the engine's begin event skips them on it)
        held = self._held_connection() if self._inline_engine is not None else None
        try:
            with held.begin() if held is not None else self.engine.begin() as began:
                conn = held if held is not None else began
                db_now = None if held is None or inline else db.begin_settings(conn, self.engine)
                locked = True
                if lock is not Lock.NONE and conn.dialect.name == "postgresql":
                    q = select(s.pool.c.id).where(s.pool.c.id == 1)
                    q = q.with_for_update(skip_locked=True) if lock is Lock.TRY else q.with_for_update()
                    locked = conn.execute(q).first() is not None
                if inline:
                    now = None if self.clock is None else float(self.clock())
                elif self.clock is not None:
                    now = float(self.clock())
                else:
                    now = db_now if db_now is not None else self._now(conn)
                tx = Tx(conn, now, gauges=self.metrics is not NO_METRICS)  # type: ignore[arg-type]
                if inline:
                    tx.inline = self._inline_head
                tx.locked = locked
                out = fn(tx)
                committing = True
        except DBAPIError as exc:
            # a pooled connection the server dropped (it restarted, or ended a session left idle
            # in a transaction): nothing of this try was committed, so it is tried again on a new
            # one (the engine does not ping each connection before use: a round trip per call)
            if held is not None:  # whatever it was, the next call starts on a fresh one
                self._local.conn = None
                held.close()
            if exc.connection_invalidated and not committing:
                raise _Dropped(exc) from exc
            raise
        self._send(tx.sent)
        return out, tx

    def _held_connection(self) -> Connection:
        """This thread's connection, kept between calls (a heartbeat thread beats every few
        seconds: checking a connection out of the pool and back each time is a visible share of
        its cost). Not inherited across a fork."""
        held = getattr(self._local, "conn", None)
        if held is None or held[0] != os.getpid() or held[1].closed:
            held = (os.getpid(), self._inline_engine.connect())  # type: ignore[union-attr]
            self._local.conn = held
        return held[1]

    def _tx(self, fn: Callable[[Tx], T], *, lock: Lock = Lock.POOL, inline: bool = False) -> tuple[T, Tx]:
        """``fn`` in a transaction, retried (tenacity) when a lock was lost in a moment (a
        deadlock, SQLite's busy handler giving up at once). Each SQLite try may itself wait the
        whole busy timeout for the write lock: past that in all, a held lock is
        :class:`LedgerBusyError`, not many such waits."""
        retrying = self._retrying
        try:
            try:
                try:  # the first try outside tenacity: most calls need no other (and it costs)
                    return self._run(fn, lock, inline)
                except (OperationalError, _Dropped) as exc:
                    if not (isinstance(exc, _Dropped) or _lost_lock(exc)):
                        raise
                return retrying(self._run, fn, lock, inline)
            except _Dropped as dropped:
                raise dropped.error from None
        except OperationalError as exc:
            if lock_timeout(exc):  # another client held a lock this call needs for PG_LOCK_TIMEOUT_S
                raise LedgerBusyError(
                    f"pool ledger {shown_url(self.url)}: the pool's lock (or a table's) was not granted "
                    f"within {db.PG_LOCK_TIMEOUT_S}s",
                    hint=f"a client holds it in a long transaction; the server ends one left idle for "
                    f"{db.PG_IDLE_IN_TX_S}s (a hung or stopped client)",
                ) from exc
            if retryable(exc):
                tries = retrying.statistics.get("attempt_number", 1)
                raise LedgerBusyError(
                    f"pool ledger {shown_url(self.url)} stayed busy after {tries - 1} retries",
                    hint="another client holds the ledger's lock in a long transaction (a hung or "
                    "stopped process), or too many clients use one SQLite file; use PostgreSQL",
                ) from exc
            # connection refused or lost: retryable by the caller (a heartbeat, a trigger, an
            # Airflow try), never a raw driver error
            raise LedgerUnavailableError(
                f"pool ledger {shown_url(self.url)} unreachable: {first_line(exc.orig or exc, self.url)}",
                hint="check that the database is up and reachable from this host",
            ) from None  # the driver's own message, in a chained traceback, may quote the URL

    def _read(self, fn: Callable[[Tx], T]) -> T:
        return self._tx(fn, lock=Lock.NONE)[0]

    def _change(self, fn: Callable[[Tx], T], *, lock: Lock = Lock.POOL) -> T:
        """A change of the pool's inputs: ``fn`` (under the pool lock unless it only changes a
        demand or a setting, which no plan in flight writes), then (group commit) wait for a
        committed plan that saw it, so the caller reads its effect at once."""
        out, tx = self._tx(fn, lock=lock)
        if self.wait_for_plan:
            self._settle(tx.seq)
        elif tx.seq is not None:
            self._nudge()  # plans now if nobody else is; else the one planning plans again
        return out

    def _send(self, sent: list[tuple[str, str, float]]) -> None:
        for kind, name, value in sent:
            if kind == "incr":
                self.metrics.incr(name, int(value))
            else:
                self.metrics.gauge(name, value)

    def _now(self, conn: Connection) -> float:
        """The ledger's time for a transaction that did not read the database's clock (SQLite,
        or an injected clock)."""
        if self.clock is not None:
            return float(self.clock())
        if conn.dialect.name == "postgresql":  # one clock for every client of the ledger
            return float(conn.execute(select(func.extract("epoch", func.clock_timestamp()))).scalar_one())
        return time.time()

    # --- the planner ---------------------------------------------------------------------

    def _settle(self, seq: int | None) -> None:
        """Return once a committed plan has seen change ``seq`` (group commit): whoever finds no
        plan running plans, for every change made before its plan began; the others read the
        planner's state (no lock) until that plan has committed. In a burst (more changes
        waiting than this one) a plan first waits out ``plan_interval_s`` since the last plan
        ended, so that more join it."""
        if seq is None:
            return
        waited, poll = False, SETTLE_POLL_S
        deadline = time.monotonic() + db.PG_LOCK_TIMEOUT_S
        while True:
            if self._read(lambda tx: tx.planner_state()).planned_seq >= seq:
                return
            locked = Lock.TRY if time.monotonic() < deadline else Lock.POOL  # a planner that hangs
            out, _ = self._tx(lambda tx, waited=waited: self._plan_for(tx, seq, waited), lock=locked)
            if out is None:
                return
            if out is _BUSY:  # another client is planning: its plan may cover this change
                self.sleep(poll)
                poll = min(2 * poll, 0.05)
                continue
            self.sleep(out)  # a burst: more changes join the plan made after this wait
            waited = True

    @staticmethod
    def _plan_for(tx: Tx, seq: int, waited: bool) -> float | object | None:
        st = tx.planner_state()
        if st.planned_seq >= seq:
            return None
        if not tx.locked:
            return _BUSY
        rest = st.planned_at + tx.settings["plan_interval_s"] - tx.wall
        if not waited and st.dirty_seq - st.planned_seq > 1 and rest > 0:
            return min(rest, tx.settings["plan_interval_s"])
        tx.plan(seen=st.dirty_seq)
        return None

    def _nudge(self) -> bool:
        """Plan if a plan is due (the plan is dirty and ``plan_interval_s`` has passed since the
        last one, a lease is overdue, or the last plan is older than ``plan_refresh_s``) and no
        other client is planning now; never waits for one. Returns whether it planned."""

        if time.monotonic() < self._nudge_after:
            return False  # another client was planning a moment ago: its plan covers this

        def op(tx: Tx) -> bool:
            if not tx.locked:  # another client plans now; it plans again if the plan is dirty
                self._nudge_after = time.monotonic() + NUDGE_BACKOFF_S
                return False
            st, cfg = tx.planner_state(), tx.settings
            due = (
                (st.dirty and tx.wall >= st.planned_at + cfg["plan_interval_s"])
                or tx.now >= st.planned_now + cfg["plan_refresh_s"]
                or tx.overdue()
            )
            if due:
                tx.plan(seen=st.dirty_seq)
            elif tx.now >= st.next_due:  # the earliest lease was renewed since: look again later
                tx.refresh_due()
            return due

        return self._tx(op, lock=Lock.TRY)[0]

    def plan(self) -> dict[str, Any]:
        """Run one plan now (whatever is due) and return the planner's state after it."""

        def op(tx: Tx) -> PlannerState:
            tx.plan(seen=tx.planner_state().dirty_seq)
            return tx.planner_state()

        return dataclasses.asdict(self._tx(op)[0])

    def planner_state(self) -> dict[str, Any]:
        """Changes made and planned, plans run, when the last ended and how long it took."""
        return dataclasses.asdict(self._read(lambda tx: tx.planner_state()))

    def serve_planner(self, stop: Callable[[], bool], *, poll_s: float | None = None) -> int:
        """Plan whenever a plan is due until ``stop()`` is true (``elastic-ops pool planner``: a
        dedicated planner, so expiry and time-driven rules act with no client calling). Clients
        keep planning too; one plans at a time. Returns the plans it ran."""
        plans = 0
        while not stop():
            plans += self._nudge()
            pace = self._read(lambda tx: tx.settings["plan_interval_s"]) if poll_s is None else poll_s
            self.sleep(max(pace, 0.01))
        return plans

    def close(self) -> None:
        held = getattr(self._local, "conn", None)
        if held is not None and held[0] == os.getpid():
            held[1].close()
        self._local.conn = None
        self.engine.dispose()

    # --- settings and hosts --------------------------------------------------------------

    def configure(self, **settings: object) -> dict[str, Any]:
        """Change pool-wide settings (policy, preemption, TTL, anti-thrashing, aging, the
        planner's pace) and re-plan."""
        changes = check_config(settings)
        self._change(lambda tx: tx.configure(changes), lock=Lock.NONE)
        return self._read(lambda tx: dict(tx.settings))

    def add_host(self, name: str, slots: int, labels: dict[str, str] | None = None) -> None:
        """Register (or update) a host with ``slots`` slots; it becomes ``up``."""
        check_host("host", name)
        check_int("slots", slots, 1, MAX_HOST_SLOTS)
        # the rules host selectors follow: a label no selector could name is a typo
        labels_json = json.dumps(check_host_selector("labels", labels), sort_keys=True)
        self._change(lambda tx: tx.add_host(name, slots, labels_json))

    def drain_host(self, name: str) -> None:
        """No new grants on ``name``; its jobs move off at their next iteration boundary."""
        self.set_host_state(name, HostState.DRAINING)

    def set_host_state(self, name: str, state: HostState | str) -> None:
        check_host("host", name)
        st = check_host_state(state)
        self._change(lambda tx: tx.set_host_state(name, st))

    # --- tenants -------------------------------------------------------------------------

    def add_tenant(self, name: str, *, guaranteed: int, max_slots: int | None = None,
                   weight: float = 1.0) -> None:
        """Register a tenant (a team sharing the pool) or change its settings: ``guaranteed``
        slots whenever its jobs can use them (reclaimed from borrowers at their next iteration
        boundaries), at most ``max_slots`` in all (None: no limit), ``weight`` in lending idle
        capacity (see docs/explanation/pool.md, "Tenants")."""
        check_tenant("tenant", name)
        check_int("guaranteed", guaranteed, 0, MAX_TENANT_SLOTS)
        if max_slots is not None:
            check_int("max_slots", max_slots, max(guaranteed, 1), MAX_TENANT_SLOTS)
        check_number("weight", weight, minimum=0, exclusive=True, maximum=1e6)
        self._change(lambda tx: tx.add_tenant(name, guaranteed, max_slots, float(weight)))

    def remove_tenant(self, name: str) -> None:
        """Remove a tenant no unfinished job belongs to."""
        check_tenant("tenant", name)
        self._change(lambda tx: tx.remove_tenant(name))

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
        batching: Batching | Mapping[str, int] | None = None,
        tenant: str = DEFAULT_TENANT,
        dag_id: str | None = None,
    ) -> None:
        """Register a job or update its demand (idempotent). A finished job becomes waiting again.
        ``tenant``: the team whose share it runs in (one :meth:`add_tenant` registered, or
        ``default``; its max must allow ``max_workers``). ``dag_id``: the Airflow DAG it comes
        from (the HTTP API asks for edit permission on it to change the job's priority or bounds).
        ``selector``: labels every host the job runs on must carry (``{"gpu": "h100"}``).
        ``batching``: the global batches an adaptive job (``scaling: adaptive``) lets the pool
        choose from (:class:`~elastic_ops.pool.scaling.Batching`; None: its batch is fixed):
        under ``goodput`` its heartbeats' targets carry the batch the plan chose."""
        check_name("job", job)
        check_bounds(min_workers, max_workers)
        check_int("priority", priority, 1, 1000)
        if not isinstance(preemptible, bool):
            raise SpecError("preemptible", preemptible, "must be true or false")
        wanted = check_host_selector("selector", selector)
        chosen = check_batching(batching)
        check_tenant("tenant", tenant)
        if dag_id is not None:
            check_name("dag_id", dag_id)
        values = dict(min_workers=min_workers, max_workers=max_workers, priority=priority,
                      preemptible=preemptible, selector=json.dumps(wanted, sort_keys=True),
                      tenant=tenant, dag_id=dag_id,
                      batching=None if chosen is None else json.dumps(dataclasses.asdict(chosen),
                                                                      sort_keys=True))
        described = f"min {min_workers} max {max_workers} priority {priority} preemptible {preemptible}"
        if tenant != DEFAULT_TENANT:
            described += f" tenant {tenant}"
        if chosen is not None:
            described += f" batch {chosen.lowest}..{chosen.most} (base {chosen.base})"
        on = f" on hosts with {_labels(wanted)}" if wanted else ""
        self._change(lambda tx: tx.submit(job, values, described, on), lock=Lock.NONE)

    def request(
        self, job: str, *, avoid_hosts: Iterable[str] = (), new_attempt: bool = False
    ) -> Grant | Wait:
        """Ask for workers. Returns the live grant (new or existing) or ``Wait`` with the reason.

        A job without a live lease asks the planner and this call returns after a plan that
        saw the ask: granted then if the policy gives it slots; a job told to wait stays asking
        (for a lease TTL), and a later plan may grant it: its next request returns that grant.

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
        _, seq = self._change(lambda tx: tx.ask(job, avoid, new_attempt))
        if seq is None:  # asked again: nothing new to plan, unless time has made a plan due
            self._nudge()
        lease, slots, reason, ttl = self._read(lambda tx: tx.answer(job))
        if lease is None:
            return Wait(job, reason)
        return Grant(job, lease.epoch, slots, ttl)

    def heartbeat(
        self,
        job: str,
        epoch: int,
        *,
        workers: int,
        placements: Sequence[Slot] | None = None,
        measured: Observation | Mapping[str, Any] | None = None,
    ) -> Target:
        """Renew the lease, report ``measured`` (what the job measured since its last heartbeat)
        and return the target the planner last wrote. ``workers``: what the job runs now. Takes
        no pool lock and does not plan: it touches this job's rows only.

        Slots the plan takes away are released when the job reports ``workers <= target``
        (and, if it passes ``placements``, no longer lists them): it has shrunk at a boundary.
        ``workers=0`` (the job stopped at a boundary after ``preempt``) ends the lease and returns
        all its slots, even if the plan has changed since; the job requests again later. So does a
        preempted job left holding no slot (its ``placements`` lists none of them). A dead epoch
        raises :class:`LeaseExpiredError`.
        """
        check_name("job", job)
        check_epoch(epoch)
        check_int("workers", workers, 0, MAX_WORKERS_LIMIT)
        placements = check_placements(placements)
        observed = check_observation(measured)
        quick = self._quick_heartbeat(job, epoch, workers, placements, observed)
        if quick is not None:
            return quick
        beat, tx = self._tx(lambda tx: tx.heartbeat(job, epoch, workers, placements, observed),
                            lock=Lock.NONE, inline=True)
        self._settle(tx.seq)  # it freed slots a shrink gave up: others may grow onto them
        if beat.error is not None:
            self._nudge()  # an overdue lease: the plan that notices it returns its slots
            raise beat.error
        if beat.stopped:
            return _raise_if_error(self._change(lambda tx: tx.stopped(job, epoch)))
        if beat.plan_due:
            self._nudge()
        assert beat.target is not None
        return beat.target

    def _quick_heartbeat(
        self, job: str, epoch: int, workers: int, placements: Sequence[Slot] | None,
        measured: Observation | None,
    ) -> Target | None:
        """PostgreSQL, the common heartbeat (it renews, reads its target and writes nothing
        else): the one statement and the commit on this thread's DBAPI connection, with none of
        SQLAlchemy's transaction machinery (most of a heartbeat's client CPU). Anything else —
        a slot to free, a release flag to set, a dead lease, an error — rolls back and returns
        None: the full path (``Tx.heartbeat``) does it, and reports errors as it does."""
        if not isinstance(self._inline_head, tuple) or not isinstance(self._inline_head[0], db.FastQuery):
            return None
        try:
            held = self._held_connection()
        except DBAPIError:  # the server is away (restarting): the full path tries and says so
            return None
        if held.in_transaction():
            return None
        now = None if self.clock is None else float(self.clock())
        values = ledger.renew_values(job, epoch, now, None, measured)
        try:
            dbapi = held.connection.driver_connection
            prepared = held.connection.info.setdefault("elastic_ops_prepared", set())
            rows = self._inline_head[measured is not None].rows(dbapi, values, prepared)
            out = ledger.quick_beat(rows, job, workers, placements, measured,
                                    now if now is not None else float(rows[0].db_now) if rows else 0.0,
                                    time.time())
            if out is None:
                dbapi.rollback()
                return None
            dbapi.commit()
        except Exception:  # noqa: BLE001 - whatever it was, the full path tries again and says
            self._local.conn = None
            held.invalidate()
            held.close()
            return None
        target, due = out
        if due:
            self._nudge()
        return target

    def observations(self, job: str) -> list[dict[str, Any]]:
        """What ``job``'s heartbeats reported, summed per (workers, hosts, batch)."""
        check_name("job", job)
        return self._read(lambda tx: tx.observations(job))

    def scaling(self, job: str, *, batch: int = 0) -> ScalingModel:
        """``job``'s scaling model (:mod:`elastic_ops.pool.scaling`), fitted to what its
        heartbeats measured at global ``batch`` (0: the job's fixed batch)."""
        check_int("batch", batch, 0, 2**62)
        return fit_scaling(measured_from_rows(self.observations(job), batch))

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
        return self._change(lambda tx: tx.release(job, epoch, finished, handover))

    def finish(self, job: str) -> bool:
        """End ``job`` whatever it holds: a live lease is released (its slots return), the job
        leaves the plan. Idempotent: False when it had ended already. For a job whose run failed
        for good outside any grant."""
        return self._change(lambda tx: tx.finish(job))

    def report_failure(self, job: str, host: str, cause: str | None = None) -> None:
        """``job`` failed on ``host``: the job avoids it from now on; enough failures cool it.
        ``cause`` (what failed, e.g. the error; at most 500 characters kept) goes into the
        failure event's reason, where the retry's task reads why it runs."""
        check_name("job", job)
        check_host("host", host)
        if cause is not None and not isinstance(cause, str):
            raise SpecError("cause", cause, "a string or None")
        kept = None if cause is None else cause[:500]
        self._change(lambda tx: tx.report_failure(job, host, kept), lock=Lock.NONE)

    def check_epoch(self, job: str, epoch: int) -> None:
        """Raise :class:`LeaseExpiredError` unless ``epoch`` is the job's live lease."""
        check_name("job", job)
        check_epoch(epoch)

        def op(tx: Tx) -> LeaseExpiredError | None:
            tx.job_row(job)
            return tx.lease_error(job, epoch)

        if (dead := self._read(op)) is not None:
            self._nudge()
            raise dead

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
            check=lambda tx, row: (tx.check_unpreemptible_min(job, min_workers, row.preemptible),
                                   tx.check_tenant_demand(job, row.tenant, max_workers)),
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
                         check=lambda tx, row: tx.check_unpreemptible_min(job, row.min_workers, preemptible))

    def _update_job(
        self, job: str, values: dict[str, Any], reason: str, check: Callable[[Tx, Any], None] | None = None
    ) -> None:
        self._change(lambda tx: tx.update_job(job, values, reason, check), lock=Lock.NONE)

    # --- reading -------------------------------------------------------------------------

    def job_dag(self, job: str) -> str | None:
        """The Airflow DAG ``job`` comes from (None: submitted outside Airflow)."""
        check_name("job", job)
        return self._read(lambda tx: tx.job_row(job).dag_id)

    def status(self) -> dict[str, Any]:
        """Hosts, jobs (with held slots, targets, leases) and settings, after any plan due
        (an overdue lease is expired first)."""
        self._nudge()

        def op(tx: Tx) -> dict[str, Any]:
            conn, now = tx.conn, tx.now
            held, going = tx.holdings()
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
                        # an adaptive job's batches and the batch the plan chose (0: its own)
                        "batching": None if r.batching is None else json.loads(r.batching),
                        "batch": r.plan_batch,
                        "tenant": r.tenant,
                        "dag_id": r.dag_id,
                    }
                )
            total = sum(h["slots"] for h in hosts if h["state"] == HostState.UP.value)
            used = sum(per_host.values())
            return {
                "now": now,
                "settings": dict(tx.settings),
                "planner": dataclasses.asdict(tx.planner_state()),
                "hosts": hosts,
                "jobs": jobs,
                "tenants": tenant_rows(tx.tenants(), jobs, total),
                "slots": {"up": total, "used": used},
            }

        return self._read(op)

    def events(
        self, job: str | None = None, *, since_id: int = 0, last: int | None = None,
        since_ts: float | None = None, kinds: Sequence[str] | None = None,
    ) -> list[dict[str, Any]]:
        """The event log, oldest first (optionally one job's, only ids above ``since_id``, only
        those at or after ``since_ts`` (Unix seconds), only ``kinds``, only the ``last`` N)."""
        if last is not None:
            check_int("last", last, 1, 1_000_000)
        check_int("since_id", since_id, 0, MAX_EPOCH)
        if since_ts is not None:
            check_number("since_ts", since_ts, minimum=0)
        wanted = check_event_kinds(kinds)
        if job is not None:
            check_name("job", job)

        def op(tx: Tx) -> list[dict[str, Any]]:
            q = select(s.events).where(s.events.c.id > since_id)
            if job is not None:
                q = q.where(s.events.c.job == job)
            if since_ts is not None:
                q = q.where(s.events.c.ts >= since_ts)
            if wanted:
                q = q.where(s.events.c.kind.in_(wanted))
            if last is not None:  # the newest N, still returned oldest first
                q = select(q.order_by(s.events.c.id.desc()).limit(last).subquery())
                q = q.order_by(q.selected_columns.id)
            else:
                q = q.order_by(s.events.c.id)
            return [_event_dict(r) for r in tx.conn.execute(q)]

        return self._read(op)

    def usage(self, *, hours: float | None = None, job: str | None = None) -> dict[str, Any]:
        """Slot-hours per job, per host and per tenant (guaranteed, used, borrowed, lent) over the
        last ``hours`` (default: since the oldest event), replayed from the event log (see
        :mod:`elastic_ops.pool.usage`); ``job``: that job's only (and the hosts as it used them),
        reading its events alone."""
        if hours is not None:
            check_number("hours", hours, minimum=0, exclusive=True, maximum=MAX_LOOKBACK_H)
        if job is not None:
            check_name("job", job)

        def op(tx: Tx):
            conn, now = tx.conn, tx.now
            # only the events that give or take slots: targets, submissions and the rest change
            # no holding (and are most of a busy log)
            mine = s.events.c.job == job if job is not None else true()
            kinds = s.events.c.kind.in_(sorted(SLOT_KINDS))
            q = select(s.events).where(mine, kinds).order_by(s.events.c.id)
            rows = [_event_dict(r) for r in conn.execute(q)]
            oldest = conn.execute(select(func.min(s.events.c.ts)).where(mine)).scalar()
            hs = conn.execute(select(s.hosts.c.name, s.hosts.c.slots, s.hosts.c.state)).all()
            tenant_of = {r.name: r.tenant for r in conn.execute(select(s.jobs.c.name, s.jobs.c.tenant))}
            guaranteed = {t.name: t.guaranteed for t in tx.tenants()}
            return now, rows, oldest, hs, tenant_of, guaranteed

        now, rows, oldest, hs, tenant_of, guaranteed = self._read(op)
        since = now - hours * 3600 if hours is not None else (now if oldest is None else float(oldest))
        up = sum(r.slots for r in hs if r.state == HostState.UP.value)
        out = usage_of(rows, since, now, tenant_of, guaranteed, up)
        return out.to_dict({r.name: r.slots for r in hs})

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

        return self._tx(lambda tx: tx.prune_events(older_than_s))[0]


def tenant_rows(listed, jobs: list[dict[str, Any]], up: int) -> list[dict[str, Any]]:
    """``status()["tenants"]``: each tenant's settings and what its jobs hold now (a tenant not
    registered, ``default``, listed while unfinished jobs are in it)."""
    used: dict[str, int] = {}
    for j in jobs:
        if j["state"] != "finished":
            used[j["tenant"]] = used.get(j["tenant"], 0) + j["workers"]
    rows = {t.name: {"name": t.name, "guaranteed": t.guaranteed, "max_slots": t.max_slots, "weight": t.weight}
            for t in listed}
    for name in used:
        rows.setdefault(name, {"name": name, "guaranteed": 0, "max_slots": None, "weight": 1.0})
    split = lent_and_borrowed({n: r["guaranteed"] for n, r in rows.items()}, used, up)
    for name, r in rows.items():
        r["in_use"] = used.get(name, 0)
        r["borrowed"], r["lent"] = split[name]
        r["jobs"] = sum(1 for j in jobs if j["tenant"] == name and j["state"] != "finished")
    return [rows[n] for n in sorted(rows)]


class _Dropped(Exception):
    """A try that lost its connection before it committed (tried again on a new one)."""

    def __init__(self, error: DBAPIError) -> None:
        super().__init__(str(error))
        self.error = error


def _lost_lock(exc: BaseException) -> bool:
    """A lock lost in a moment (tried again), not one held past its timeout (LedgerBusyError)."""
    return isinstance(exc, OperationalError) and retryable(exc) and not lock_timeout(exc)
