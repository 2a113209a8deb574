"""The ledger's mechanism: one :class:`Tx` per database transaction, with named operations.

Two kinds of transaction (see docs/pool.md, "The control plane"):

- **Changes and plans.** A change (submit, request, release, priority, bounds, host, settings)
  writes its rows and marks the plan dirty (:meth:`Tx.mark_dirty`); it does not plan. Plans and
  the changes that touch leases or slots hold the *pool lock* (SQLite: the file's write lock,
  taken at ``BEGIN IMMEDIATE``; PostgreSQL: the single ``pool`` row, ``SELECT … FOR UPDATE``),
  so they are serialised; a change of a demand or a setting, which no plan writes, takes none.
  A plan
  (:meth:`Tx.plan`: *sync → decide → apply*) expires overdue leases, builds a
  :class:`~elastic_ops.pool.model.Snapshot`, calls the configured policy (the same pure
  function the simulator calls), reserves the slots of decided grows and grants, and writes
  every job's decision (target, reason, the slots to hold and to give back) to its row.
- **Heartbeats** (:meth:`Tx.heartbeat`) take no pool lock: they renew one lease, add what the
  job measured to the lease's sums, free the slots the job says it left, and read the decision
  the planner last wrote for the job. O(rows of that job). On PostgreSQL the common one (nothing
  to write but the renewal) is one statement (:func:`heartbeat_statements`) whose rows
  :func:`quick_beat` turns into the target.

The planner state (``planner`` row: ``dirty_seq``, ``planned_seq``, when the last plan ended)
is what :class:`~elastic_ops.pool.client.PoolClient` reads to decide whether, and when, a plan
must run (group commit: a change returns once a plan that saw it has committed).

No function here commits; the client's ``_tx`` begins, locks, retries and commits.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, Float, bindparam, case, delete, exists, func, insert, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Row
from sqlalchemy.sql.expression import CTE, ColumnElement, Select, Update

from elastic_ops.errors import JobEndedError, LeaseExpiredError, SpecError, UnknownHostError, UnknownJobError
from elastic_ops.pool import schema as s
from elastic_ops.pool.api import EventKind, Target
from elastic_ops.pool.checks import CONFIG_FIELDS, check_host, check_name
from elastic_ops.pool.engine import FastQuery
from elastic_ops.pool.model import (
    Decision,
    Host,
    HostState,
    JobState,
    Observation,
    Plan,
    PolicyConfig,
    Preemption,
    Slot,
    Snapshot,
    TargetAction,
    Tenant,
    make_job,
    outside,
)
from elastic_ops.pool.policies import LEARNING, get_policy
from elastic_ops.pool.rules import target_of
from elastic_ops.pool.scaling import Batching, GradStats, Measured, fit_cached
from elastic_ops.spec import DEFAULT_TENANT


@dataclasses.dataclass(frozen=True)
class PlannerState:
    """The ``planner`` row: changes made (``dirty_seq``), changes the last committed plan saw
    (``planned_seq``), when that plan ended (``planned_at``, wall-clock seconds), how many plans
    ran and how long the last one took."""

    dirty_seq: int
    planned_seq: int
    planned_at: float
    plans: int
    plan_s: float
    next_due: float = 0.0
    planned_now: float = 0.0

    @property
    def dirty(self) -> bool:
        return self.dirty_seq > self.planned_seq


@dataclasses.dataclass(frozen=True)
class Beat:
    """A heartbeat's outcome: the target, and whether the caller should try to run a plan
    after the commit (the plan is dirty, a lease is overdue, or the last plan is older than
    ``plan_refresh_s``), or raise (the lease is not live)."""

    target: Target | None
    error: LeaseExpiredError | None
    stopped: bool  # workers=0, or preempted and holding nothing: a change under the pool lock
    plan_due: bool


def _slots_json(slots: Sequence[Slot]) -> str:
    return json.dumps([list(x) for x in slots])


def _slots_of(text: str | None) -> tuple[Slot, ...] | None:
    return None if text is None else tuple((str(h), int(sl)) for h, sl in json.loads(text))


@functools.lru_cache(maxsize=4096)
def _batching(text: str) -> Batching:
    """A job row's ``batching`` (JSON, written by ``submit``; most adaptive jobs share a few)."""
    return Batching(**json.loads(text))


_FAR = 1e300  # no lease and no cooling host: time alone changes nothing
TAKEOVER_S = 1.0  # a plan left dirty this long (past plan_interval_s) is planned by the next heartbeat


@dataclasses.dataclass(frozen=True)
class _BeatView:
    """What a heartbeat reads of its job (rows of the heartbeat's statement), and what the job's
    report means: ``left``, slots it was told to give up and no longer runs on; ``gone``, slots
    of a shrink it has acted on (it runs no more workers than the slots it keeps)."""

    mine: tuple[Any, ...]
    held: frozenset[Slot]
    d: Decision
    left: tuple[Slot, ...]
    gone: tuple[Slot, ...]

    @classmethod
    def of(cls, head: Any, rows: Sequence[Any], job: str, workers: int,
           placements: Sequence[Slot] | None) -> _BeatView:
        mine = tuple(r for r in rows if r.host is not None)
        held = frozenset((r.host, r.slot) for r in mine)
        told = {(r.host, r.slot) for r in mine if r.releasing is not None}
        keep = _slots_of(head.plan_placements)
        keep = tuple(sorted(held)) if keep is None else keep
        d = Decision(job, head.target, keep, _slots_of(head.plan_release) or (), None, head.reason)
        still = None if placements is None else {tuple(x) for x in placements}
        # told to give up in an earlier heartbeat and no longer used: they go whatever the plan
        # says now (a plan that changed its mind meanwhile would send the job back, a second
        # relaunch inside min_rescale_interval_s)
        left = tuple(sorted(sl for sl in told if sl not in still)) if still is not None else ()
        # the slots a shrink gives up go once the job runs no more workers than the slots it
        # keeps (not its target: slots the target counts may not be free yet, e.g. when its
        # host drains while the others are full, and the job still runs on the old ones)
        gone: tuple[Slot, ...] = ()
        if d.release and workers <= len(d.placements):
            if still is not None:
                gone = tuple(sl for sl in d.release if sl not in still and sl not in left and sl in held)
            else:
                gone = tuple(sl for sl in d.release if sl in told)
        return cls(mine, held, d, left, gone)

    def runs_on(self, held: frozenset[Slot]) -> Decision:
        """The decision as the job may follow it: on what it still holds (slots the plan counts
        that a heartbeat freed since the plan are not its own any more)."""
        d = self.d
        return dataclasses.replace(
            d, placements=tuple(sl for sl in d.placements if sl in held),
            release=tuple(sl for sl in d.release if sl in held),
        )


def quick_beat(
    rows: Sequence[Any], job: str, workers: int, placements: Sequence[Slot] | None,
    measured: Observation | None, now: float, wall: float,
) -> Target | tuple[Target, bool] | None:
    """A heartbeat whose statement (:func:`heartbeat_statements`) renewed the lease and whose
    report needs no other write (no slot freed, no release flag changed, its measurement in the
    configuration the lease sums): its target and whether a plan is due. ``None``: anything
    else, for the full path (:meth:`Tx.heartbeat`) to handle."""
    if not rows or workers == 0:
        return None
    head = rows[0]
    if head.renewed is None or head.state == JobState.PARKED.value:
        return None
    if measured is not None and head.obs_reports and (
        _config(measured) != (head.obs_workers, head.obs_hosts, head.obs_batch)
    ):
        return None
    v = _BeatView.of(head, rows, job, workers, placements)
    if v.left or v.gone:
        return None
    d = v.runs_on(v.held)
    if d.target == 0 and not v.held:
        return None
    release = set(d.release)
    if any(((r.host, r.slot) in release) != (r.releasing is not None) for r in v.mine):
        return None
    return target_of(job, workers, d, head.plan_batch), plan_is_due(head, now, wall)


def renew_values(job: str, epoch: int, now: float | None, ttl: float | None,
                 measured: Observation | None) -> dict[str, Any]:
    """The parameters of the heartbeat's statements (``ttl`` None: the statement reads it)."""
    values: dict[str, Any] = {"b_job": job, "b_epoch": epoch, "b_now": now,
                              "b_expires": None if ttl is None or now is None else now + ttl}
    if measured is not None:
        values.update(b_w=measured.workers, b_h=measured.hosts, b_b=measured.batch,
                      b_i=measured.iterations, b_s=measured.seconds, b_gs=measured.grad_sqr,
                      b_gv=measured.grad_var)
    return values


def plan_is_due(head: Any, now: float, wall: float) -> bool:
    """Whether a heartbeat that read ``head`` should try to plan: time alone may have changed
    the plan (``next_due``, ``plan_refresh_s``), or a dirty plan was left unplanned. A dirty plan
    is its changer's to make (it waits for it): a heartbeat takes over only one left for
    TAKEOVER_S past ``plan_interval_s`` (its changer died, or did not wait)."""
    return now >= head.next_due or (
        (head.dirty_seq > head.planned_seq and wall >= head.planned_at + head.plan_interval_s + TAKEOVER_S)
        or now >= head.planned_now + head.plan_refresh_s
    )


def _config(m: Observation) -> tuple[int, int, int]:
    return (m.workers, m.hosts, m.batch)


def _upsert(dialect: str):
    return postgresql.insert if dialect == "postgresql" else sqlite.insert


def _coarse(workers: int, hosts: int, iterations: int, seconds: float) -> Measured:
    """A live lease's measurement rounded: iterations to two significant digits, the step time
    to three. It changes with every heartbeat, and the plan's fit of it is cached only while it
    is the same value -- so a job is refitted when it has measured ~10 % more, or its speed
    moved by ~0.1 %, not at every plan."""
    digits = max(len(str(iterations)) - 2, 0)
    kept = max(round(iterations, -digits), 1)
    return Measured(workers, hosts, kept, kept * float(f"{seconds / iterations:.3g}"))


class Tx:
    """One open transaction of the ledger and the operations that run inside it.

    ``conn``: the connection (its transaction begun, and locked if the operation needs it);
    ``now``: the ledger's time for this transaction; ``wall``: wall-clock seconds (the planner's
    rate limit; the injected ledger clock may stand still in tests). Metrics are collected in
    ``sent`` and sent by the client once the transaction commits."""

    def __init__(
        self, conn: Connection, now: float, *, wall: float | None = None, gauges: bool = False
    ) -> None:
        self.conn = conn
        self.now = now
        self.wall = time.time() if wall is None else wall
        self.gauges = gauges
        self.sent: list[tuple[str, str, float]] = []
        self._settings: dict[str, Any] | None = None
        self.locked = True  # the client says whether it holds the pool lock
        self.inline: Any = None  # the heartbeat's first statement, setting the session (heartbeat_head)
        self.seq: int | None = None  # this transaction's change, if it made one

    # --- reading --------------------------------------------------------------------------

    @property
    def settings(self) -> dict[str, Any]:
        """Pool settings, read once per transaction."""
        if self._settings is None:
            row = self.conn.execute(select(s.pool).where(s.pool.c.id == 1)).mappings().one()
            self._settings = {k: row[k] for k in CONFIG_FIELDS}
        return self._settings

    def job_row(self, job: str):
        check_name("job", job)  # every job-named call comes here (a list would reach the SQL)
        row = self.conn.execute(select(s.jobs).where(s.jobs.c.name == job)).first()
        if row is None:
            raise UnknownJobError(job)
        return row

    def host_row(self, host: str):
        check_host("host", host)
        row = self.conn.execute(select(s.hosts).where(s.hosts.c.name == host)).first()
        if row is None:
            raise UnknownHostError(host)
        return row

    def live_lease(self, job: str):
        le = s.leases.c
        return self.conn.execute(select(s.leases).where(le.job == job, le.ended.is_(None))).first()

    def lease_error(self, job: str, epoch: int) -> LeaseExpiredError | None:
        """The error to raise (once the transaction has committed) unless ``epoch`` is live."""
        live = self.live_lease(job)
        if live is None or live.epoch != epoch or live.expires < self.now:
            current = None if live is None or live.expires < self.now else live.epoch
            return LeaseExpiredError(
                f"lease epoch {epoch} of job {job!r} is not live (live epoch: {current})",
                hint="the lease expired, was released or was replaced; request a new grant",
            )
        return None

    def held_slots(self, job: str) -> tuple[Slot, ...]:
        a = s.allocations.c
        rows = self.conn.execute(select(a.host, a.slot).where(a.job == job).order_by(a.host, a.slot))
        return tuple((r.host, r.slot) for r in rows)

    def planner_state(self) -> PlannerState:
        r = self.conn.execute(select(s.planner).where(s.planner.c.id == 1)).one()
        return PlannerState(r.dirty_seq, r.planned_seq, r.planned_at, r.plans, r.plan_s, r.next_due,
                            r.planned_now)

    # --- writing --------------------------------------------------------------------------

    def log_event(
        self,
        kind: EventKind,
        *,
        job: str | None = None,
        host: str | None = None,
        slots: Sequence[Slot] = (),
        epoch: int | None = None,
        workers: int | None = None,
        reason: str = "",
    ) -> None:
        self.sent.append(("incr", f"pool.event.{kind}", 1))
        self.conn.execute(
            insert(s.events).values(
                ts=self.now, kind=kind, job=job, host=host, slots=_slots_json(slots),
                epoch=epoch, workers=workers, reason=reason,
            )
        )

    def mark_dirty(self) -> int:
        """The pool's inputs changed: a plan must run. Returns this change's sequence number
        (the client waits for a plan that saw it)."""
        p = s.planner.c
        self.conn.execute(update(s.planner).where(p.id == 1).values(dirty_seq=p.dirty_seq + 1))
        self.seq = int(self.conn.execute(select(p.dirty_seq).where(p.id == 1)).scalar_one())
        return self.seq

    def overdue(self) -> bool:
        """Time alone has changed the pool's inputs: a live lease is past its expiry, or a
        host's cooling period is over (the next plan's sync acts on both)."""
        le, h, p = s.leases.c, s.hosts.c, s.pool.c
        cooling = select(p.cooling_s).where(p.id == 1).scalar_subquery()
        return bool(self.conn.execute(select(or_(
            exists().where(le.ended.is_(None), le.expires < self.now),
            exists().where(h.state == HostState.COOLING.value, h.state_since + cooling <= self.now),
        ))).scalar())

    def _due_expr(self) -> Any:
        """SQL: the ledger time by which time alone may change the plan (the earliest live
        lease's expiry, the end of a cooling period; far off with neither)."""
        le, h, p = s.leases.c, s.hosts.c, s.pool.c
        expiry = select(func.min(le.expires)).where(le.ended.is_(None)).scalar_subquery()
        cooled = (
            select(func.min(h.state_since) + select(p.cooling_s).where(p.id == 1).scalar_subquery())
            .where(h.state == HostState.COOLING.value).scalar_subquery()
        )
        least = func.min if self.conn.dialect.name == "sqlite" else func.least
        return least(func.coalesce(expiry, _FAR), func.coalesce(cooled, _FAR))

    def refresh_due(self) -> None:
        """Write ``planner.next_due`` (:meth:`_due_expr`). Heartbeats move their expiry forward,
        so it is a lower bound: a heartbeat past it checks (:meth:`overdue`)."""
        self.conn.execute(update(s.planner).where(s.planner.c.id == 1).values(next_due=self._due_expr()))

    def free_slots(
        self, job, slots: Sequence[Slot], kind: EventKind, reason: str, *, epoch, workers
    ) -> list[Slot]:
        """Give ``job``'s ``slots`` back; logs (and returns) those it still held. A heartbeat
        and a plan may free slots of one job at once (PostgreSQL: neither holds a pool lock
        for both); a slot the other freed first is neither freed nor logged twice."""
        a = s.allocations.c
        gone = [
            (h, sl) for h, sl in slots
            if self.conn.execute(delete(s.allocations).where(a.host == h, a.slot == sl, a.job == job))
            .rowcount
        ]
        self.log_event(kind, job=job, slots=gone, epoch=epoch, workers=workers, reason=reason)
        if gone:
            self.conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(last_rescale=self.now))
        return gone

    def reserve(
        self, job, epoch, slots: list[Slot], kind: EventKind, d: Decision, *, rescaled: bool = True
    ) -> None:
        self.conn.execute(
            insert(s.allocations),
            [{"host": h, "slot": sl, "job": job, "epoch": epoch, "granted": self.now} for h, sl in slots],
        )
        if rescaled:
            self.conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(last_rescale=self.now))
        self.log_event(kind, job=job, slots=slots, epoch=epoch, workers=len(d.placements), reason=d.reason)

    def end_lease(self, job, epoch, why: str) -> None:
        le = s.leases.c
        self.conn.execute(update(s.leases).where(le.job == job, le.epoch == epoch)
                          .values(ended=self.now, end_reason=why))
        self._keep_measured(job, epoch)

    def _keep_measured(self, job: str, epoch: int) -> None:
        """Move what the lease's heartbeats measured into ``observations`` (it ended, or the job
        runs in another configuration now)."""
        le = s.leases.c
        r = self.conn.execute(
            select(le.obs_workers, le.obs_hosts, le.obs_batch, le.obs_iterations, le.obs_seconds,
                   le.obs_reports, le.obs_first).where(le.job == job, le.epoch == epoch)
        ).first()
        if r is None or not r.obs_reports:
            return
        self._keep_observation(job, r)
        self.conn.execute(update(s.leases).where(le.job == job, le.epoch == epoch)
                          .values(obs_iterations=0, obs_seconds=0.0, obs_reports=0))

    def _keep_observation(self, job: str, r: Any) -> None:
        """Add a lease's accumulated ``obs_*`` (row ``r``) to the job's ``observations``."""
        o = s.observations.c
        stmt = _upsert(self.conn.dialect.name)(s.observations).values(
            job=job, workers=r.obs_workers, hosts=r.obs_hosts, batch=r.obs_batch,
            iterations=r.obs_iterations, seconds=r.obs_seconds, reports=r.obs_reports,
            first_ts=r.obs_first, last_ts=self.now,
        )
        ex = stmt.excluded
        self.conn.execute(stmt.on_conflict_do_update(
            index_elements=[o.job, o.workers, o.hosts, o.batch],
            set_={"iterations": o.iterations + ex.iterations, "seconds": o.seconds + ex.seconds,
                  "reports": o.reports + ex.reports, "last_ts": ex.last_ts},
        ))

    def _to_waiting(self, job: str, **extra: object) -> None:
        self.conn.execute(
            update(s.jobs).where(s.jobs.c.name == job).values(
                state=JobState.WAITING.value, waiting_since=self.now, plan_placements=None,
                plan_release=None, **extra,
            )
        )

    # --- sync: what time alone changes ------------------------------------------------------

    def sync(self) -> bool:
        """Expire overdue leases (slots return, epoch dies) and end finished cooling periods.
        Returns whether it changed anything (a change outside a plan must mark the plan dirty)."""
        le = s.leases.c
        changed = False
        overdue = select(s.leases).where(le.ended.is_(None), le.expires < self.now)
        for lease in self.conn.execute(overdue).all():
            # ended first, and only if still overdue: a heartbeat may have renewed it since the
            # read (PostgreSQL re-checks the condition once that heartbeat commits)
            ended = self.conn.execute(
                update(s.leases)
                .where(le.job == lease.job, le.epoch == lease.epoch, le.ended.is_(None),
                       le.expires < self.now)
                .values(ended=self.now, end_reason="expired")
            ).rowcount
            if not ended:
                continue
            self._keep_measured(lease.job, lease.epoch)
            self.free_slots(lease.job, self.held_slots(lease.job), EventKind.EXPIRY,
                            f"lease expired at {lease.expires:.3f}", epoch=lease.epoch, workers=0)
            changed = True
            self.conn.execute(
                update(s.jobs)
                .where(s.jobs.c.name == lease.job, s.jobs.c.state != JobState.FINISHED.value)
                .values(state=JobState.WAITING.value, waiting_since=self.now, plan_placements=None,
                        plan_release=None)
            )
        cooling_s = self.settings["cooling_s"]
        h = s.hosts.c
        for row in self.conn.execute(
            select(s.hosts).where(h.state == HostState.COOLING.value, h.state_since + cooling_s <= self.now)
        ).all():
            self.conn.execute(update(s.hosts).where(h.name == row.name).values(state=HostState.UP.value,
                                                                               state_since=self.now))
            self.log_event(EventKind.HOST, host=row.name, reason="cooling over -> up")
            changed = True
        return changed

    # --- the plan ---------------------------------------------------------------------------

    def holdings(self) -> tuple[dict[str, list[Slot]], dict[str, list[Slot]]]:
        """Every job's held slots and, among them, those it was told to give up at its next
        boundary and still holds (in table order: one pass, no sort)."""
        held: dict[str, list[Slot]] = {}
        releasing: dict[str, list[Slot]] = {}
        a = s.allocations.c
        for r in self.conn.execute(select(a.job, a.host, a.slot, a.releasing)):
            held.setdefault(r.job, []).append((r.host, r.slot))
            if r.releasing is not None:
                releasing.setdefault(r.job, []).append((r.host, r.slot))
        return held, releasing

    def snapshot(self) -> tuple[Snapshot, dict[str, Any]]:
        """The snapshot a policy decides on, and the job rows it was built from."""
        cfg, now = self.settings, self.now
        hosts = tuple(
            Host(r.name, r.slots, HostState(r.state), tuple(sorted(json.loads(r.labels).items())))
            for r in self.conn.execute(select(s.hosts))
        )
        held, releasing = self.holdings()
        idle_before = now - cfg["job_idle_s"]
        jobs = []
        unfinished = select(s.jobs).where(s.jobs.c.state != JobState.FINISHED.value)
        rows = {r.name: r for r in self.conn.execute(unfinished)}
        learns = cfg["policy"] in LEARNING
        batchings = {r.name: _batching(r.batching) for r in rows.values() if r.batching is not None}
        learned = self.measured({n: b.base for n, b in batchings.items()}) if learns else {}
        grads = self.gradients() if learns and batchings else {}
        none: frozenset[str] = frozenset()
        for r in rows.values():
            mine = held.get(r.name, ())
            if not mine and r.last_seen < idle_before:
                continue  # a waiting job that stopped asking does not block others
            # hosts without the job's labels are never its own; those that failed it are avoided
            # as the policy decides (rules.avoided) ("{}" / "[]": most jobs, no parse)
            excluded = none if r.selector == "{}" else outside(json.loads(r.selector), hosts)
            failed = none if r.avoid_hosts == "[]" else frozenset(json.loads(r.avoid_hosts))
            going = releasing.get(r.name)
            measured = learned.get(r.name)
            jobs.append(make_job(
                r.name, r.min_workers, r.max_workers, r.priority, bool(r.preemptible),
                failed | excluded, excluded,  # a narrowed selector moves the job off its hosts
                r.submitted, r.waiting_since, r.last_rescale, tuple(sorted(mine)), r.epoch,
                frozenset(going) if going else none,
                fit_cached(tuple(measured)) if measured else None,
                sum(m.workers * m.seconds for m in measured) if measured else 0.0,
                batchings.get(r.name), grads.get(r.name), r.tenant,
            ))
        config = PolicyConfig(
            preemption=Preemption(cfg["preemption"]),
            min_rescale_interval_s=cfg["min_rescale_interval_s"],
            min_gain=cfg["min_gain"],
            aging_s=cfg["aging_s"],
            rescale_cost_s=cfg["rescale_cost_s"],
        )
        return Snapshot(hosts, tuple(jobs), now, config, self.tenants()), rows

    def tenants(self) -> tuple[Tenant, ...]:
        return tuple(Tenant(r.name, r.guaranteed, r.max_slots, r.weight)
                     for r in self.conn.execute(select(s.tenants).order_by(s.tenants.c.name)))

    def tenant_row(self, name: str):
        return self.conn.execute(select(s.tenants).where(s.tenants.c.name == name)).first()

    def check_tenant_demand(self, job: str, tenant: str, max_workers: int) -> None:
        """A job's tenant must exist (``default`` always does) and its maximum allow the job's."""
        row = self.tenant_row(tenant)
        if row is None and tenant != DEFAULT_TENANT:
            known = ", ".join(t.name for t in self.tenants()) or "none yet"
            raise SpecError("tenant", tenant, f"a tenant of the pool (known: {known}; and 'default')",
                            hint=f"add it first: elastic-ops pool add-tenant {tenant} --guaranteed N")
        if row is not None and row.max_slots is not None and max_workers > row.max_slots:
            raise SpecError("max_workers", max_workers,
                            f"must be <= {row.max_slots}, the max of tenant {tenant!r} (job {job!r})")

    def add_tenant(self, name: str, guaranteed: int, max_slots: int | None, weight: float) -> None:
        """Register a tenant or change its settings (its jobs are re-planned at once)."""
        values = dict(guaranteed=guaranteed, max_slots=max_slots, weight=weight)
        if self.tenant_row(name) is None:
            self.conn.execute(insert(s.tenants).values(name=name, **values))
            what = "added"
        else:
            self.conn.execute(update(s.tenants).where(s.tenants.c.name == name).values(**values))
            what = "changed"
        limit = "no max" if max_slots is None else f"max {max_slots}"
        self.log_event(EventKind.CONFIG, reason=f"tenant {name} {what}: guaranteed {guaranteed}, {limit}, "
                       f"weight {weight:g}")
        self.mark_dirty()

    def remove_tenant(self, name: str) -> None:
        """Remove a tenant that no unfinished job belongs to."""
        if self.tenant_row(name) is None:
            raise SpecError("tenant", name, f"a tenant of the pool (known: "
                            f"{', '.join(t.name for t in self.tenants()) or 'none'})")
        j = s.jobs.c
        busy = self.conn.execute(select(j.name).where(j.tenant == name, j.state != JobState.FINISHED.value)
                                 .limit(1)).first()
        if busy is not None:
            raise SpecError("tenant", name, f"a tenant no unfinished job belongs to (job {busy.name!r} does)",
                            hint="move its jobs to another tenant (submit them again) or let them finish")
        self.conn.execute(delete(s.tenants).where(s.tenants.c.name == name))
        self.log_event(EventKind.CONFIG, reason=f"tenant {name} removed")
        self.mark_dirty()

    def plan(self, seen: int | None = None) -> Plan:
        """sync → decide → apply, under the pool lock. Reserves decided grows of running jobs,
        grants to waiting jobs that asked within a lease TTL, and writes every job's decision to
        its row, where heartbeats read it. ``seen``: the change sequence this plan covers
        (recorded as ``planned_seq``)."""
        started = time.perf_counter()
        self.sync()
        cfg, now = self.settings, self.now
        while True:  # each pass that frees parked slots frees at least one: it ends
            snap, rows = self.snapshot()
            plan = get_policy(cfg["policy"])(snap)
            if not self._unpark(plan, rows, snap):
                break
        if self.gauges:
            self._gauges(snap)
        held_by = {j.name: j.held for j in snap.jobs}
        changed = set(plan.changed())
        ask_since = now - cfg["lease_ttl_s"]
        for k, (name, target, reason) in enumerate(zip(plan.jobs, plan.target, plan.reason, strict=True)):
            row = rows[name]
            values: dict[str, Any] = {}
            if row.plan_batch != plan.batch_of(k):
                values["plan_batch"] = plan.batch_of(k)
            if row.target != target or row.reason != reason:
                values.update(target=target, reason=reason)
                if row.target != target:
                    self.log_event(EventKind.TARGET, job=name, workers=target, reason=reason)
            if held_by[name]:
                pp = pr = None  # unchanged: it keeps exactly what it holds
                if k in changed:
                    d = plan.decision(k)
                    new = plan.slots.new(k)
                    if new:
                        # a move (new slots for old ones, with or without more workers) rescales
                        # when its old slots go (free_slots stamps it then): stamped now, it would
                        # count as rescaled while it holds both, be frozen on all of them by
                        # min_rescale_interval_s (a job frozen keeps what it holds), and moved back
                        plain_grow = len(d.placements) > len(held_by[name]) and not d.release
                        self.reserve(name, row.epoch, list(new), EventKind.GROW, d, rescaled=plain_grow)
                    pp, pr = _slots_json(d.placements), _slots_json(d.release)
                    if d.reason != reason:
                        values.update(target=target, reason=d.reason)
                if row.plan_placements != pp or row.plan_release != pr:
                    values.update(plan_placements=pp, plan_release=pr)
                state = JobState.PREEMPTING if target == 0 else JobState.RUNNING
                if row.state == JobState.PARKED.value:  # _unpark() left it slots to keep
                    state = JobState.PARKED
                if row.state != state.value:
                    values["state"] = state.value
                    if state == JobState.PREEMPTING:
                        self.log_event(EventKind.PREEMPT, job=name, epoch=row.epoch, workers=0, reason=reason)
            elif k in changed and row.asked is not None and row.asked >= ask_since:
                d = plan.decision(k)
                epoch = row.epoch + 1
                self.conn.execute(insert(s.leases).values(job=name, epoch=epoch, granted=now,
                                                          expires=now + cfg["lease_ttl_s"]))
                values.update(epoch=epoch, state=JobState.RUNNING.value, asked=None,
                              plan_placements=None, plan_release=None)
                self.reserve(name, epoch, list(d.placements), EventKind.GRANT, d)
            if values:
                self.conn.execute(update(s.jobs).where(s.jobs.c.name == name).values(**values))
        if len(rows) != len(plan.jobs):  # the common case: every job was planned, none idle
            self._mark_idle(rows, set(plan.jobs), cfg["job_idle_s"])
        self._planned(seen, time.perf_counter() - started)
        return plan

    def _planned(self, seen: int | None, took: float) -> None:
        p = s.planner.c
        values: dict[str, Any] = dict(planned_at=time.time(), planned_now=self.now, plans=p.plans + 1,
                                      plan_s=took)
        if seen is not None:
            values["planned_seq"] = func.max(seen, p.planned_seq) if self.conn.dialect.name == "sqlite" \
                else func.greatest(seen, p.planned_seq)
        values["next_due"] = self._due_expr()  # one statement: a plan's round trips are its cost under load
        self.conn.execute(update(s.planner).where(p.id == 1).values(**values))
        self.sent.append(("gauge", "pool.plan_seconds", took))

    def _gauges(self, snap: Snapshot) -> None:
        """The pool as this decision found it (before it applies its own changes)."""
        running = sum(1 for j in snap.jobs if j.held)
        self.sent.extend([
            ("gauge", "pool.slots_up", sum(h.slots for h in snap.hosts if h.state == HostState.UP)),
            ("gauge", "pool.slots_used", sum(len(j.held) for j in snap.jobs)),
            ("gauge", "pool.jobs_running", running),
            ("gauge", "pool.jobs_waiting", len(snap.jobs) - running),
        ])

    def _mark_idle(self, rows: dict[str, Any], planned: set[str], idle_s: float) -> None:
        """Jobs left out of the plan because nobody asked for them for ``job_idle_s`` (a task
        marked failed while it waited, a paused DAG): shown as such, not with the last share the
        plan gave them."""
        reason = f"idle: no request for over {idle_s:g}s (job_idle_s); planned again at its next request"
        for name in rows.keys() - planned:
            row = rows[name]
            if row.target != 0 or row.reason != reason:
                self.conn.execute(update(s.jobs).where(s.jobs.c.name == name).values(target=0, reason=reason))

    def _unpark(self, plan: Plan, rows: dict[str, Any], snap: Snapshot) -> bool:
        """Apply at once what ``plan`` takes from parked jobs (they run nothing, so there is no
        boundary to wait for): a shrink frees the slots; a preemption, or a move of all its
        slots (e.g. off a draining host), ends the lease, and the next chunk's request is granted
        afresh. Returns whether any slot was freed (the plan must then be made again)."""
        parked = {name for name, r in rows.items() if r.state == JobState.PARKED.value}
        if not parked:  # the common case: one pass over the rows, on every plan
            return False
        freed = False
        for job in snap.jobs:
            if job.name not in parked or not job.held:
                continue
            row = rows[job.name]
            d = plan.decision(plan.index(job.name))
            if d.target == 0 or not d.placements or len(d.release) == len(job.held):
                why = "preempted" if d.target == 0 or not d.placements else "moved"
                self.free_slots(job.name, job.held, EventKind.RELEASE, f"parked, then {why}: {d.reason}",
                                epoch=row.epoch, workers=0)
                self.end_lease(job.name, row.epoch, f"{why} while parked")
                self._to_waiting(job.name)
                freed = True
            elif d.release:
                self.free_slots(job.name, d.release, EventKind.SHRINK,
                                f"parked, released at once: {d.reason}", epoch=row.epoch,
                                workers=len(d.placements))
                freed = True
        return freed

    # --- heartbeats (no pool lock) -------------------------------------------------------------

    def heartbeat(
        self, job: str, epoch: int, workers: int, placements: Sequence[Slot] | None,
        measured: Observation | None,
    ) -> Beat:
        """Renew ``epoch``'s lease, record ``measured``, free the slots the job left, and read its
        decision. Touches only this job's rows (and reads the pool and planner rows)."""
        if self.inline is not None:  # PostgreSQL: renew and read in one statement
            return self._heartbeat_one_statement(job, epoch, workers, placements, measured)
        rows = self.conn.execute(_HEAD, {"b_job": job, "b_epoch": epoch}).all()
        if not rows:
            check_name("job", job)
            raise UnknownJobError(job)
        head = rows[0]
        plan_due = plan_is_due(head, self.now, self.wall)
        if head.ended is not None or head.expires is None or head.expires < self.now:
            return Beat(None, self.lease_error(job, epoch), False, True)
        values = renew_values(job, epoch, self.now, head.lease_ttl_s, measured)
        if measured is not None:
            if head.obs_reports and _config(measured) != (head.obs_workers, head.obs_hosts, head.obs_batch):
                self._keep_measured(job, epoch)  # it runs in another configuration now
            renewed = self.conn.execute(_RENEW_MEASURED, values).rowcount
        else:
            renewed = self.conn.execute(_RENEW, values).rowcount
        if not renewed:  # ended or replaced since the read (a plan, a new try)
            return Beat(None, self.lease_error(job, epoch), False, True)
        return self._beat_on(head, rows, job, epoch, workers, placements, plan_due)

    def _heartbeat_one_statement(
        self, job: str, epoch: int, workers: int, placements: Sequence[Slot] | None,
        measured: Observation | None,
    ) -> Beat:
        """PostgreSQL: the renewal is a data-modifying CTE of the statement that reads the
        decision, the planner's state and the job's slots (and sets the transaction's session
        settings and reads the clock): one round trip and the commit. The statement's reads see
        the rows as they were before the renewal (one snapshot): what the lease had measured in
        its previous configuration is moved to ``observations`` from those."""
        stmt, values = self.inline[measured is not None], renew_values(job, epoch, self.now, None, measured)
        if isinstance(stmt, FastQuery):
            rows = stmt.run(self.conn, values)
        else:
            rows = self.conn.execute(stmt, values).all()
        if not rows:
            check_name("job", job)
            raise UnknownJobError(job)
        head = rows[0]
        if self.now is None:
            self.now = float(head.db_now)
        plan_due = plan_is_due(head, self.now, self.wall)
        if head.renewed is None:
            return Beat(None, self.lease_error(job, epoch), False, True)
        if measured is not None and head.obs_reports and (
            _config(measured) != (head.obs_workers, head.obs_hosts, head.obs_batch)
        ):
            self._keep_observation(job, head)  # it runs in another configuration now
        return self._beat_on(head, rows, job, epoch, workers, placements, plan_due)

    def _beat_on(
        self, head: Any, rows: Sequence[Any], job: str, epoch: int, workers: int,
        placements: Sequence[Slot] | None, plan_due: bool,
    ) -> Beat:
        """The heartbeat once renewed: free what the job left, and its target."""
        if workers == 0:
            return Beat(None, None, True, plan_due)
        v = _BeatView.of(head, rows, job, workers, placements)
        freed: list[Slot] = []
        if v.left:
            freed += self.free_slots(job, v.left, EventKind.SHRINK, "released at boundary: no longer used",
                                     epoch=epoch, workers=workers)
        gone = [sl for sl in v.gone if sl not in freed]
        if gone:
            freed += self.free_slots(job, gone, EventKind.SHRINK, f"released at boundary: {v.d.reason}",
                                     epoch=epoch, workers=v.d.target)
        held = v.held
        if freed:  # a shrink reported: a change (the caller waits for a plan that saw it)
            held = held - set(freed)
            self.mark_dirty()
        d = v.runs_on(held)
        if d.target == 0 and not held:
            # preempted and holding nothing now: it has stopped, whatever it says it runs
            return Beat(None, None, True, plan_due)
        self._mark_releasing(v.mine, set(d.release))
        if head.state == JobState.PARKED.value:  # it runs workers: not parked any more
            self.conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(state=JobState.RUNNING.value))
        return Beat(target_of(job, workers, d, head.plan_batch), None, False, plan_due)

    def _mark_releasing(self, rows: Sequence[Any], release: set[Slot]) -> None:
        """Remember which slots this heartbeat told the job to give up (and forget the rest)."""
        a = s.allocations.c
        for r in rows:
            told = (r.host, r.slot) in release
            if told != (r.releasing is not None):
                self.conn.execute(
                    update(s.allocations).where(a.host == r.host, a.slot == r.slot)
                    .values(releasing=self.now if told else None)
                )

    def measured(self, bases: Mapping[str, int]) -> dict[str, list[Measured]]:
        """What every job measured, per configuration: the kept rows and what live leases have
        measured so far (two reads, whatever the number of jobs). A job with a base batch in
        ``bases`` (an adaptive one) at every batch it ran, as a scale of its base (batch 0: its
        base); the others at their fixed batch only."""
        o, le = s.observations.c, s.leases.c
        out: dict[str, list[Measured]] = {}

        def scale(job: str, batch: int) -> float | None:
            base = bases.get(job)
            if base is None:
                return 1.0 if batch == 0 else None
            return batch / base if batch else 1.0

        for r in self.conn.execute(select(o.job, o.workers, o.hosts, o.batch, o.iterations, o.seconds)
                                   .where(o.iterations > 0, o.seconds > 0)):
            if (c := scale(r.job, r.batch)) is not None:
                out.setdefault(r.job, []).append(Measured(r.workers, r.hosts, r.iterations, r.seconds, c))
        live = select(le.job, le.obs_workers, le.obs_hosts, le.obs_batch, le.obs_iterations,
                      le.obs_seconds).where(le.ended.is_(None), le.obs_iterations > 0, le.obs_seconds > 0)
        for r in self.conn.execute(live):
            if (c := scale(r.job, r.obs_batch)) is not None:
                m = _coarse(r.obs_workers, r.obs_hosts, r.obs_iterations, r.obs_seconds)
                out.setdefault(r.job, []).append(dataclasses.replace(m, scale=c))
        return out

    def gradients(self) -> dict[str, GradStats]:
        """Each unfinished job's gradient statistics, as its latest lease that reported any
        measured them (kept across chunks: a new chunk's lease has measured nothing yet)."""
        le, j = s.leases.c, s.jobs.c
        rows = self.conn.execute(
            select(le.job, le.epoch, le.obs_grad_sqr, le.obs_grad_var)
            .join(s.jobs, j.name == le.job)
            .where(le.obs_grad_sqr.is_not(None), le.obs_grad_var.is_not(None),
                   j.state != JobState.FINISHED.value, j.batching.is_not(None))
        )
        latest: dict[str, tuple[int, GradStats]] = {}
        for r in rows:
            if r.job not in latest or r.epoch > latest[r.job][0]:
                latest[r.job] = (r.epoch, GradStats(float(r.obs_grad_sqr), float(r.obs_grad_var)))
        return {job: g for job, (_, g) in latest.items()}

    def observations(self, job: str) -> list[dict[str, Any]]:
        """What ``job``'s heartbeats measured, summed per (workers, hosts, batch): the kept rows
        and what its live lease has measured so far."""
        o, le = s.observations.c, s.leases.c
        out: dict[tuple[int, int, int], dict[str, Any]] = {}
        for r in self.conn.execute(select(s.observations).where(o.job == job)):
            out[(r.workers, r.hosts, r.batch)] = {
                "workers": r.workers, "hosts": r.hosts, "batch": r.batch, "iterations": r.iterations,
                "seconds": r.seconds, "reports": r.reports, "first_ts": r.first_ts, "last_ts": r.last_ts,
            }
        live = self.conn.execute(select(s.leases).where(le.job == job, le.ended.is_(None))).first()
        if live is not None and live.obs_reports:
            key = (live.obs_workers, live.obs_hosts, live.obs_batch)
            row = out.setdefault(key, {"workers": key[0], "hosts": key[1], "batch": key[2], "iterations": 0,
                                       "seconds": 0.0, "reports": 0, "first_ts": live.obs_first,
                                       "last_ts": self.now})
            row["iterations"] += live.obs_iterations
            row["seconds"] += live.obs_seconds
            row["reports"] += live.obs_reports
            row["first_ts"] = min(row["first_ts"], live.obs_first)
            row["last_ts"] = self.now
        return [out[k] for k in sorted(out)]

    # --- changes (under the pool lock) -----------------------------------------------------------

    def configure(self, changes: dict[str, Any]) -> None:
        if changes:
            self.conn.execute(update(s.pool).where(s.pool.c.id == 1).values(**changes))
            self._settings = None
            self.log_event(EventKind.CONFIG, reason=json.dumps(changes, sort_keys=True))
        self.mark_dirty()

    def add_host(self, name: str, slots: int, labels_json: str) -> None:
        row = self.conn.execute(select(s.hosts).where(s.hosts.c.name == name)).first()
        a = s.allocations.c
        busy = self.conn.execute(select(a.slot).where(a.host == name, a.slot >= slots)).first()
        if busy is not None:  # slots that would vanish under the jobs running on them
            raise SpecError(
                "slots", slots,
                f"must keep the slots jobs hold on host {name!r} (slot {busy.slot} is in use)",
                hint=f"drain the host first (elastic-ops pool drain {name}), then shrink it",
            )
        values = dict(slots=slots, labels=labels_json, state=HostState.UP.value, state_since=self.now,
                      failures=0)
        if row is None:
            self.conn.execute(insert(s.hosts).values(name=name, **values))
        else:
            self.conn.execute(update(s.hosts).where(s.hosts.c.name == name).values(**values))
        self.log_event(EventKind.HOST, host=name, workers=slots, reason=f"added: {slots} slots, up")
        self.mark_dirty()

    def set_host_state(self, name: str, state: HostState) -> None:
        self.host_row(name)
        self.conn.execute(update(s.hosts).where(s.hosts.c.name == name)
                          .values(state=state.value, state_since=self.now, failures=0))
        self.log_event(EventKind.HOST, host=name, reason=f"state -> {state.value}")
        self.mark_dirty()

    def check_unpreemptible_min(self, job: str, min_workers: int, preemptible: bool) -> None:
        """A job that may not be preempted and holds fewer slots than its minimum would have to be
        preempted to honour it: the change that would make it so is refused (bounds, submit,
        preemptible)."""
        held = len(self.held_slots(job))
        if not preemptible and 0 < held < min_workers:
            raise SpecError(
                "min_workers", min_workers,
                f"must be <= the {held} slots job {job!r} holds: it may not be preempted",
                hint="raise it once the job has released its slots, or make it preemptible",
            )

    def submit(self, job: str, values: dict[str, Any], described: str, on: str) -> None:
        """Register a job or update its demand (``values``: its demand columns)."""
        row = self.conn.execute(select(s.jobs).where(s.jobs.c.name == job)).first()
        self.check_tenant_demand(job, values["tenant"], values["max_workers"])
        values = {**values, "last_seen": self.now}
        if values.get("dag_id") is None and row is not None:
            values["dag_id"] = row.dag_id  # submitted again outside Airflow: it still comes from its DAG
        if row is None:
            self.conn.execute(insert(s.jobs).values(
                name=job, state=JobState.WAITING.value, submitted=self.now, waiting_since=self.now,
                epoch=0, avoid_hosts="[]", target=0, reason="submitted", **values,
            ))
            self.log_event(EventKind.SUBMIT, job=job, reason=f"{described}{on}")
        else:
            self.check_unpreemptible_min(job, values["min_workers"], values["preemptible"])
            if row.state == JobState.FINISHED.value:  # a rerun (the DAG run was cleared)
                values.update(state=JobState.WAITING.value, waiting_since=self.now, submitted=self.now,
                              avoid_hosts="[]")
                self.log_event(EventKind.SUBMIT, job=job, reason=f"registered again: {described}{on}")
            elif changed := _changed_demand(row, values):  # the log keeps every job's demand
                self.log_event(EventKind.CONFIG, job=job, reason=f"submitted again: {changed}")
            self.conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(**values))
        self.mark_dirty()

    def update_job(self, job: str, values: dict[str, Any], reason: str,
                   check: Callable[[Tx, Any], None] | None = None) -> None:
        row = self.job_row(job)
        if check is not None:
            check(self, row)
        self.conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(**values))
        self.log_event(EventKind.CONFIG, job=job, reason=reason)
        self.mark_dirty()

    def ask(self, job: str, avoid: Sequence[str], new_attempt: bool) -> tuple[Any, int | None]:
        """The request's change: returns ``(live lease or None, change seq or None)``; with no
        live lease the job asks the planner (``asked``), and the caller waits for a plan."""
        if self.sync():  # an overdue lease is not handed out again
            self.mark_dirty()
        row = self.job_row(job)
        values: dict[str, Any] = {"last_seen": self.now}
        if avoid:
            values["avoid_hosts"] = json.dumps(sorted(set(json.loads(row.avoid_hosts)) | set(avoid)))
        if row.state == JobState.FINISHED.value:
            if not new_attempt:
                raise JobEndedError(job)
            values.update(state=JobState.WAITING.value, waiting_since=self.now)
        lease = self.live_lease(job)
        if lease is not None and row.state == JobState.PARKED.value:
            values["state"] = JobState.RUNNING.value  # the next chunk takes the parked slots
        if lease is None:
            values["asked"] = self.now
        self.conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(**values))
        if lease is not None and new_attempt:
            lease = self._reissue(job, lease, row.epoch)
        if lease is not None:
            le = s.leases.c  # handed out: renewed
            self.conn.execute(update(s.leases).where(le.job == job, le.epoch == lease.epoch)
                              .values(expires=self.now + self.settings["lease_ttl_s"]))
            return lease, (self.mark_dirty() if avoid else None)
        # asking again (a trigger polls every second or two) tells the planner nothing new: no
        # plan, unless the ask had lapsed (the plan left the job out, or stopped granting it)
        cfg, now = self.settings, self.now
        asking = (
            row.state == JobState.WAITING.value and not avoid and row.asked is not None
            and row.asked >= now - cfg["lease_ttl_s"] and row.last_seen >= now - cfg["job_idle_s"]
        )
        return None, (None if asking else self.mark_dirty())

    def answer(self, job: str) -> tuple[Any, tuple[Slot, ...], str, float]:
        """After the plan: the job's live lease (or None), its slots, its reason, the TTL."""
        lease = self.live_lease(job)
        row = self.job_row(job)
        if lease is None:
            return None, (), row.reason, self.settings["lease_ttl_s"]
        held = self.held_slots(job)
        # what the plan wants it to run on, among what it holds (a grant the plan has since
        # shrunk, e.g. its bounds lowered while it was handed out, starts on the smaller set)
        keep = [sl for sl in _slots_of(row.plan_placements) or () if sl in set(held)]
        return lease, tuple(keep) if keep else held, row.reason, self.settings["lease_ttl_s"]

    def _reissue(self, job: str, lease: Row[Any], current_epoch: int) -> Any:
        """End ``lease`` and give its slots to a new lease of the next epoch."""
        epoch = current_epoch + 1
        ttl = self.settings["lease_ttl_s"]
        self.end_lease(job, lease.epoch, "superseded by a new try")
        self.conn.execute(insert(s.leases).values(job=job, epoch=epoch, granted=self.now,
                                                  expires=self.now + ttl))
        self.conn.execute(update(s.allocations).where(s.allocations.c.job == job).values(epoch=epoch))
        self.conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(epoch=epoch, last_seen=self.now))
        self.log_event(EventKind.REISSUE, job=job, epoch=epoch, slots=self.held_slots(job),
                       reason=f"new try: epoch {lease.epoch} -> {epoch}, same slots")
        return self.live_lease(job)

    def stopped(self, job: str, epoch: int) -> Target | LeaseExpiredError:
        """The job reports ``workers=0`` (or was preempted and holds nothing): it checkpointed and
        stopped at a boundary (only a preempted job runs nothing, ``min_workers >= 1``). All its
        slots return, with a ``release`` event, and its lease ends, *whatever the plan says now*:
        the preemptor may have left since the job was told ``preempt``, and a plan that lets it
        keep its slots must not leave them (and a live lease) to a job that is no longer running."""
        if (dead := self.lease_error(job, epoch)) is not None:
            return dead
        held = self.held_slots(job)
        reason = self.job_row(job).reason
        if held:
            self.free_slots(job, held, EventKind.RELEASE, f"stopped at boundary: {reason}", epoch=epoch,
                            workers=0)
        self.end_lease(job, epoch, "preempted")
        self._to_waiting(job, last_seen=self.now)
        self.mark_dirty()
        return Target(job, 0, TargetAction.PREEMPT, reason, ())

    def release(self, job: str, epoch: int, finished: bool, handover: bool) -> bool:
        row = self.job_row(job)
        self.sync()
        live = self.live_lease(job)
        if handover and live is not None and live.epoch == epoch:
            return self._park(job, epoch)
        return self._give_back(row, epoch, finished)

    def finish(self, job: str) -> bool:
        row = self.job_row(job)
        self.sync()
        if row.state == JobState.FINISHED.value:
            return False
        live = self.live_lease(job)
        self._give_back(row, row.epoch if live is None else live.epoch, True)
        return True

    def _park(self, job: str, epoch: int) -> bool:
        ttl = self.settings["lease_ttl_s"]
        le = s.leases.c
        self.conn.execute(update(s.leases).where(le.job == job, le.epoch == epoch)
                          .values(expires=self.now + ttl))
        self.conn.execute(update(s.jobs).where(s.jobs.c.name == job)
                          .values(state=JobState.PARKED.value, last_seen=self.now))
        self.log_event(EventKind.PARK, job=job, epoch=epoch, workers=0,
                       reason=f"chunk done; slots kept for the next chunk for {ttl:.0f}s")
        self.mark_dirty()
        return True

    def _give_back(self, row: Row[Any], epoch: int, finished: bool) -> bool:
        """``PoolClient.release`` inside its transaction (the ledger synced)."""
        job = row.name
        live = self.live_lease(job)
        released = live is not None and live.epoch == epoch
        if released:
            why = "finished" if finished else "released"
            self.free_slots(job, self.held_slots(job), EventKind.RELEASE, why, epoch=epoch, workers=0)
            self.end_lease(job, epoch, why)
        # a late release of a lease already ended does not bring a finished job back: only its
        # next request does (on_kill ends the job, then the dying try releases again)
        revived = row.state == JobState.FINISHED.value and not released and not finished
        if (epoch == row.epoch or released) and not revived:
            state = JobState.FINISHED if finished else JobState.WAITING
            self.conn.execute(
                update(s.jobs).where(s.jobs.c.name == job).values(
                    state=state.value, waiting_since=self.now, target=0, reason=state.value, asked=None,
                    plan_placements=None, plan_release=None,
                )
            )
            if finished:
                self.log_event(EventKind.FINISH, job=job, epoch=epoch)
        self.mark_dirty()
        return released

    def report_failure(self, job: str, host: str, cause: str | None = None) -> None:
        row = self.job_row(job)
        h = self.host_row(host)
        cfg = self.settings
        avoid = sorted(set(json.loads(row.avoid_hosts)) | {host})
        self.conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(avoid_hosts=json.dumps(avoid)))
        failures = h.failures + 1
        values: dict[str, Any] = {"failures": failures}
        reason = f"failure {failures} of job {job}"
        if failures >= cfg["failure_threshold"] and h.state == HostState.UP.value:
            values.update(state=HostState.COOLING.value, state_since=self.now, failures=0)
            reason += f"; cooling for {cfg['cooling_s']:.0f}s"
        if cause:
            reason += f"; {cause}"
        self.conn.execute(update(s.hosts).where(s.hosts.c.name == host).values(**values))
        self.log_event(EventKind.FAILURE, job=job, host=host, reason=reason)
        self.mark_dirty()

    def prune_events(self, older_than_s: float) -> int:
        """Events older than ``older_than_s`` go, except those of a job holding a live lease (the
        log still explains every slot held now) and the newest (SQLite numbers a new row
        max(id) + 1: with it gone the next events would take ids a reader has seen)."""
        live = select(s.leases.c.job).where(s.leases.c.ended.is_(None))
        newest = self.conn.execute(select(func.max(s.events.c.id))).scalar() or 0
        gone = self.conn.execute(
            delete(s.events).where(
                s.events.c.ts < self.now - older_than_s,
                s.events.c.id < newest,
                or_(s.events.c.job.is_(None), s.events.c.job.not_in(live)),
            )
        )
        return int(gone.rowcount or 0)


def _changed_demand(row: Row[Any], values: dict[str, Any]) -> str:
    """What a submit changes of a job's demand, as ``"max 8 -> 2, priority 1 -> 7"`` ('' if nothing)."""
    parts = []
    for key in ("min_workers", "max_workers", "priority", "preemptible", "selector", "batching", "tenant"):
        old, new = getattr(row, key), values[key]
        if key == "preemptible":
            old = bool(old)
        if old != new:
            parts.append(f"{key.removesuffix('_workers')} {old} -> {new}")
    return ", ".join(parts)


def _renewals(now: ColumnElement[Any], expires: ColumnElement[Any]) -> tuple[Update, Update]:
    """The lease renewal without and with a measurement: the expiry moves to ``expires`` if the
    lease is live at ``now``; a measurement in the configuration the lease has measured in is
    added, one in another replaces it (its sums were kept first)."""
    le = s.leases.c
    live = (le.job == bindparam("b_job"), le.epoch == bindparam("b_epoch"), le.ended.is_(None),
            le.expires >= now)
    renew = update(s.leases).where(*live).values(expires=expires)
    same = (le.obs_workers == bindparam("b_w")) & (le.obs_hosts == bindparam("b_h")) & (
        le.obs_batch == bindparam("b_b"))
    renew_measured = update(s.leases).where(*live).values(
        expires=expires, obs_workers=bindparam("b_w"), obs_hosts=bindparam("b_h"),
        obs_batch=bindparam("b_b"),
        obs_first=case((same & (le.obs_reports > 0), le.obs_first), else_=now),
        obs_iterations=case((same, le.obs_iterations), else_=0) + bindparam("b_i"),
        obs_seconds=case((same, le.obs_seconds), else_=0.0) + bindparam("b_s"),
        obs_reports=case((same, le.obs_reports), else_=0) + 1,
        # the latest the workers measured (an adaptive job's; NULL keeps what was there)
        obs_grad_sqr=func.coalesce(bindparam("b_gs", type_=Float), le.obs_grad_sqr),
        obs_grad_var=func.coalesce(bindparam("b_gv", type_=Float), le.obs_grad_var),
    )
    return renew, renew_measured


def _head(extra: Sequence[ColumnElement[Any]] = (), renewed: CTE | None = None) -> Select[Any]:
    """The heartbeat's read: the job's decision, its lease, the planner's state and the job's
    slots (one row per slot; one row of NULLs when it holds none), and ``renewed``'s job."""
    j, le, p, pl, a = s.jobs.c, s.leases.c, s.pool.c, s.planner.c, s.allocations.c
    joined = (
        s.jobs.join(s.planner, pl.id == 1).join(s.pool, p.id == 1)
        .outerjoin(s.leases, (le.job == j.name) & (le.epoch == bindparam("b_epoch")))
        .outerjoin(s.allocations, a.job == j.name)
    )
    cols = [
        j.state, j.target, j.reason, j.min_workers, j.plan_placements, j.plan_release, j.plan_batch,
        pl.dirty_seq, pl.planned_seq, pl.planned_at, pl.next_due, pl.planned_now,
        p.plan_interval_s, p.plan_refresh_s, p.lease_ttl_s,
        le.ended, le.expires, le.obs_workers, le.obs_hosts, le.obs_batch, le.obs_reports,
        le.obs_first, le.obs_iterations, le.obs_seconds, a.host, a.slot, a.releasing, *extra,
    ]
    if renewed is not None:
        joined = joined.outerjoin(renewed, renewed.c.job == j.name)
        cols.append(renewed.c.job.label("renewed"))
    return select(*cols).select_from(joined).where(j.name == bindparam("b_job"))


# built once (a heartbeat is the ledger's hottest call: SQLAlchemy caches the statements'
# compiled forms, not their construction)
_HEAD = _head()
_RENEW, _RENEW_MEASURED = _renewals(bindparam("b_now"), bindparam("b_expires"))


def heartbeat_statements(
    inline: Sequence[ColumnElement[Any]], clock: bool,
) -> tuple[Select[Any], Select[Any]]:
    """PostgreSQL: the heartbeat as one statement, without and with a measurement: the renewal
    a data-modifying CTE (``renewed``) of the read, with ``inline`` columns in the select list
    (``engine.inline_settings``: the session settings, and the clock as ``db_now``). ``clock``:
    the client's own clock gives ``b_now``; else the database's (``clock_timestamp()``)."""
    p = s.pool.c
    now = bindparam("b_now") if clock else func.extract("epoch", func.clock_timestamp())
    ttl = select(p.lease_ttl_s).where(p.id == 1).scalar_subquery()
    plain, measured = _renewals(now, ttl + now)
    le = s.leases.c
    return tuple(  # type: ignore[return-value]
        _head(inline, renew.returning(le.job).cte("renewed")) for renew in (plain, measured)
    )
