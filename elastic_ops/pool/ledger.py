"""The ledger's mechanism, inside one transaction: **sync → decide → apply**.

- *sync* (:func:`sync`) expires leases whose TTL passed (their slots return, their epoch dies)
  and returns cooled-down hosts to ``up``;
- *decide* (:func:`replan`) builds a :class:`~elastic_ops.pool.model.Snapshot` from the rows
  and calls the configured policy, the same pure function the simulator calls;
- *apply* reserves the slots of decided grows, creates the asking job's grant, frees slots a
  parked job gives up, and records every change in ``events``.

Every function takes the open connection of a transaction :class:`~elastic_ops.pool.client.PoolClient`
began (and locked); none commits. Per-transaction state rides in ``conn.info``: the settings
(``pool_settings``), the metrics sent after the commit (``pool_metrics``), whether anyone reads
the pool gauges (``pool_gauges``) and the job rows the last snapshot read (``pool_job_rows``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, delete, insert, select, update

from elastic_ops.errors import LeaseExpiredError, UnknownHostError, UnknownJobError
from elastic_ops.pool import schema as s
from elastic_ops.pool.checks import CONFIG_FIELDS, check_host, check_name
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


@dataclasses.dataclass(frozen=True)
class Target:
    """What a running job should do at its next boundary. ``workers`` = ``len(placements)``,
    the slots it holds now (0 for ``preempt``)."""

    job: str
    workers: int
    action: TargetAction
    reason: str
    placements: tuple[Slot, ...]


def avoidable(avoid: frozenset[str], up_slots: dict[str, int], min_workers: int) -> frozenset[str]:
    """The hosts a job avoids (those that failed it), unless the other hosts that are up cannot
    hold even its minimum: then avoiding them would make it wait forever (a one-host pool after
    one lost worker), and it is retried where it failed."""
    if avoid and sum(n for h, n in up_slots.items() if h not in avoid) < min_workers:
        return frozenset()
    return avoid


def within_minimum(d: Decision, min_workers: int) -> Decision:
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


def pool_settings(conn: Connection) -> dict[str, Any]:
    """Pool settings, read once per transaction (``PoolClient._tx`` clears the cache)."""
    cached = conn.info.get("pool_settings")
    if cached is None:
        row = conn.execute(select(s.pool).where(s.pool.c.id == 1)).mappings().one()
        cached = conn.info["pool_settings"] = {k: row[k] for k in CONFIG_FIELDS}
    return cached


def job_row(conn: Connection, job: str):
    check_name("job", job)  # every job-named call comes here (a list would reach the SQL)
    row = conn.execute(select(s.jobs).where(s.jobs.c.name == job)).first()
    if row is None:
        raise UnknownJobError(job)
    return row


def host_row(conn: Connection, host: str):
    check_host("host", host)
    row = conn.execute(select(s.hosts).where(s.hosts.c.name == host)).first()
    if row is None:
        raise UnknownHostError(host)
    return row


def live_lease(conn: Connection, job: str):
    return conn.execute(select(s.leases).where(s.leases.c.job == job, s.leases.c.ended.is_(None))).first()


def lease_error(conn: Connection, job: str, epoch: int) -> LeaseExpiredError | None:
    """The error to raise (once the transaction has committed) unless ``epoch`` is live."""
    live = live_lease(conn, job)
    if live is None or live.epoch != epoch:
        current = None if live is None else live.epoch
        return LeaseExpiredError(
            f"lease epoch {epoch} of job {job!r} is not live (live epoch: {current})",
            hint="the lease expired, was released or was replaced; request a new grant",
        )
    return None


def held_slots(conn: Connection, job: str) -> tuple[Slot, ...]:
    rows = conn.execute(
        select(s.allocations.c.host, s.allocations.c.slot)
        .where(s.allocations.c.job == job)
        .order_by(s.allocations.c.host, s.allocations.c.slot)
    )
    return tuple((r.host, r.slot) for r in rows)


def log_event(
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


def free_slots(conn, now, job, slots: Sequence[Slot], kind: str, reason: str, *, epoch, workers) -> None:
    for h, sl in slots:
        conn.execute(
            delete(s.allocations).where(
                s.allocations.c.host == h, s.allocations.c.slot == sl, s.allocations.c.job == job
            )
        )
    if slots:
        conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(last_rescale=now))
    log_event(conn, now, kind, job=job, slots=slots, epoch=epoch, workers=workers, reason=reason)


def given_up(conn, job, d: Decision, placements) -> list[Slot]:
    """Slots of ``d.release`` the job has certainly stopped using: it says so (``placements``),
    or it was told to release them in an earlier heartbeat and now runs ``workers <= target``
    (it acted at a boundary). A job that runs nothing is handled by :func:`stopped`."""
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


def abandoned(conn, job, placements) -> list[Slot]:
    """Slots the job was told to give up in an earlier heartbeat and no longer lists among those
    it runs on (``placements``): it left them at a boundary. They go whatever the plan says now:
    a plan that changed its mind meanwhile (the job a move made room for left) would otherwise
    keep them and send the job back, a second relaunch inside ``min_rescale_interval_s``."""
    if placements is None:
        return []
    rows = conn.execute(
        select(s.allocations.c.host, s.allocations.c.slot).where(
            s.allocations.c.job == job, s.allocations.c.releasing.is_not(None)
        )
    )
    still = {tuple(p) for p in placements}
    return sorted((r.host, r.slot) for r in rows if (r.host, r.slot) not in still)


def mark_releasing(conn, now, job, release: Sequence[Slot]) -> None:
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


def end_lease(conn, now, job, epoch, why: str) -> None:
    conn.execute(
        update(s.leases)
        .where(s.leases.c.job == job, s.leases.c.epoch == epoch)
        .values(ended=now, end_reason=why)
    )


def sync(conn: Connection, now: float) -> None:
    """Expire overdue leases (slots return, epoch dies) and end finished cooling periods."""
    expired = conn.execute(
        select(s.leases).where(s.leases.c.ended.is_(None), s.leases.c.expires < now)
    ).all()
    for lease in expired:
        held = held_slots(conn, lease.job)
        free_slots(
            conn,
            now,
            lease.job,
            held,
            "expiry",
            f"lease expired at {lease.expires:.3f}",
            epoch=lease.epoch,
            workers=0,
        )
        end_lease(conn, now, lease.job, lease.epoch, "expired")
        conn.execute(
            update(s.jobs)
            .where(s.jobs.c.name == lease.job, s.jobs.c.state != JobState.FINISHED.value)
            .values(state=JobState.WAITING.value, waiting_since=now)
        )
    cooling_s = pool_settings(conn)["cooling_s"]
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
        log_event(conn, now, "host", host=h.name, reason="cooling over -> up")


def holdings(conn: Connection) -> tuple[dict[str, list[Slot]], dict[str, list[Slot]]]:
    """Every job's held slots and, among them, those it was told to give up at its next
    boundary and still holds (in table order: one pass, no sort)."""
    held: dict[str, list[Slot]] = {}
    releasing: dict[str, list[Slot]] = {}
    a = s.allocations.c
    for r in conn.execute(select(a.job, a.host, a.slot, a.releasing)):
        held.setdefault(r.job, []).append((r.host, r.slot))
        if r.releasing is not None:
            releasing.setdefault(r.job, []).append((r.host, r.slot))
    return held, releasing


def snapshot(conn: Connection, now: float, cfg: dict[str, Any]) -> Snapshot:
    hosts = tuple(
        Host(r.name, r.slots, HostState(r.state), tuple(sorted(json.loads(r.labels).items())))
        for r in conn.execute(select(s.hosts))
    )
    held, releasing = holdings(conn)
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
        failed = avoidable(frozenset(json.loads(r.avoid_hosts)), usable, r.min_workers)
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
                releasing=frozenset(releasing.get(r.name, ())),
            )
        )
    config = PolicyConfig(
        preemption=Preemption(cfg["preemption"]),
        min_rescale_interval_s=cfg["min_rescale_interval_s"],
        min_gain=cfg["min_gain"],
        aging_s=cfg["aging_s"],
    )
    return Snapshot(hosts, tuple(jobs), now, config)


def replan(
    conn: Connection, now: float, *, grant_to: str | None = None, synced: bool = False
) -> Plan:
    """sync → decide → apply. Reserves decided grows of running jobs; grants only to
    ``grant_to`` (other waiting jobs get theirs when they ask). Returns the plan
    (``plan[job]`` is a job's :class:`Decision`). Reads every job's target and reason from
    the plan's columns; slot tuples are made only for the jobs given slots."""
    if not synced:
        sync(conn, now)
    cfg = pool_settings(conn)
    while True:  # each pass that frees parked slots frees at least one: it ends
        snap = snapshot(conn, now, cfg)
        plan = get_policy(cfg["policy"])(snap)
        rows = conn.info.pop("pool_job_rows")  # read by snapshot() in this transaction
        if not unpark(conn, now, plan, rows, snap):
            break
    if conn.info.get("pool_gauges"):  # a client with metrics
        gauges(conn, snap)
    held_by = {j.name: j.held for j in snap.jobs}
    changed = set(plan.changed())
    for k, (name, target, reason) in enumerate(zip(plan.jobs, plan.target, plan.reason, strict=True)):
        row = rows[name]
        values: dict[str, Any] = {}
        if row.target != target or row.reason != reason:
            values.update(target=target, reason=reason)
            if row.target != target:
                log_event(conn, now, "target", job=name, workers=target, reason=reason)
        if held_by[name]:
            new = plan.slots.new(k) if k in changed else ()
            if new:
                d = plan.decision(k)
                # a move (new slots for old ones, with or without more workers) rescales when its
                # old slots go (free_slots stamps it then): stamped now, it would count as
                # rescaled while it holds both, be frozen on all of them by
                # min_rescale_interval_s (a job frozen keeps what it holds), and moved back
                plain_grow = len(d.placements) > len(held_by[name]) and not d.release
                reserve(conn, now, name, row.epoch, list(new), "grow", d, rescaled=plain_grow)
            state = JobState.PREEMPTING if target == 0 else JobState.RUNNING
            if row.state == JobState.PARKED.value:  # unpark() left it slots to keep
                state = JobState.PARKED
            if row.state != state.value:
                values["state"] = state.value
                if state == JobState.PREEMPTING:
                    log_event(conn, now, "preempt", job=name, epoch=row.epoch, workers=0, reason=reason)
        elif name == grant_to and k in changed:
            d = plan.decision(k)
            epoch = row.epoch + 1
            ttl = cfg["lease_ttl_s"]
            conn.execute(insert(s.leases).values(job=name, epoch=epoch, granted=now, expires=now + ttl))
            values.update(epoch=epoch, state=JobState.RUNNING.value)
            reserve(conn, now, name, epoch, list(d.placements), "grant", d)
        if values:
            conn.execute(update(s.jobs).where(s.jobs.c.name == name).values(**values))
    if len(rows) != len(plan.jobs):  # the common case: every job was planned, none idle
        mark_idle(conn, rows, set(plan.jobs), cfg["job_idle_s"])
    return plan


def gauges(conn: Connection, snap: Snapshot) -> None:
    """The pool as this decision found it (before it applies its own changes)."""
    running = sum(1 for j in snap.jobs if j.held)
    conn.info["pool_metrics"].extend([
        ("gauge", "pool.slots_up", sum(h.slots for h in snap.hosts if h.state == HostState.UP)),
        ("gauge", "pool.slots_used", sum(len(j.held) for j in snap.jobs)),
        ("gauge", "pool.jobs_running", running),
        ("gauge", "pool.jobs_waiting", len(snap.jobs) - running),
    ])


def mark_idle(conn: Connection, rows: dict[str, Any], planned: set[str], idle_s: float) -> None:
    """Jobs left out of the plan because nobody asked for them for ``job_idle_s`` (a task
    marked failed while it waited, a paused DAG): shown as such, not with the last share the
    plan gave them."""
    reason = f"idle: no request for over {idle_s:g}s (job_idle_s); planned again at its next request"
    for name in rows.keys() - planned:
        row = rows[name]
        if row.target != 0 or row.reason != reason:
            conn.execute(update(s.jobs).where(s.jobs.c.name == name).values(target=0, reason=reason))


def unpark(conn: Connection, now: float, plan: Plan, rows: dict[str, Any], snap: Snapshot) -> bool:
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
        d = within_minimum(plan.decision(plan.index(job.name)), row.min_workers)
        if d.target == 0 or not d.placements or len(d.release) == len(job.held):
            why = "preempted" if d.target == 0 or not d.placements else "moved"
            free_slots(conn, now, job.name, job.held, "release", f"parked, then {why}: {d.reason}",
                       epoch=row.epoch, workers=0)
            end_lease(conn, now, job.name, row.epoch, f"{why} while parked")
            conn.execute(
                update(s.jobs)
                .where(s.jobs.c.name == job.name)
                .values(state=JobState.WAITING.value, waiting_since=now)
            )
            freed = True
        elif d.release:
            free_slots(conn, now, job.name, d.release, "shrink", f"parked, released at once: {d.reason}",
                       epoch=row.epoch, workers=len(d.placements))
            freed = True
    return freed


def reserve(
    conn, now, job, epoch, slots: list[Slot], kind: str, d: Decision, *, rescaled: bool = True
) -> None:
    conn.execute(
        insert(s.allocations),
        [{"host": h, "slot": sl, "job": job, "epoch": epoch, "granted": now} for h, sl in slots],
    )
    if rescaled:
        conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(last_rescale=now))
    log_event(
        conn, now, kind, job=job, slots=slots, epoch=epoch, workers=len(d.placements), reason=d.reason
    )


def target_of(job: str, workers: int, d: Decision) -> Target:
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


def reissue(conn: Connection, now: float, job: str, lease: Any) -> Any:
    """End ``lease`` and give its slots to a new lease of the next epoch."""
    epoch = job_row(conn, job).epoch + 1
    ttl = pool_settings(conn)["lease_ttl_s"]
    end_lease(conn, now, job, lease.epoch, "superseded by a new try")
    conn.execute(insert(s.leases).values(job=job, epoch=epoch, granted=now, expires=now + ttl))
    conn.execute(update(s.allocations).where(s.allocations.c.job == job).values(epoch=epoch))
    conn.execute(update(s.jobs).where(s.jobs.c.name == job).values(epoch=epoch, last_seen=now))
    log_event(conn, now, "reissue", job=job, epoch=epoch, slots=held_slots(conn, job),
                reason=f"new try: epoch {lease.epoch} -> {epoch}, same slots")
    return live_lease(conn, job)


def stopped(conn: Connection, now: float, job: str, epoch: int) -> Target:
    """The job reports ``workers=0``: it checkpointed and stopped at a boundary (only a
    preempted job runs nothing, ``min_workers >= 1``). All its slots return, with a
    ``release`` event, and its lease ends, *whatever the plan says now*: the preemptor may
    have left since the job was told ``preempt``, and a plan that lets it keep its slots
    must not leave them (and a live lease) to a job that is no longer running."""
    held = held_slots(conn, job)
    reason = job_row(conn, job).reason
    if held:
        free_slots(
            conn, now, job, held, "release", f"stopped at boundary: {reason}", epoch=epoch, workers=0
        )
    end_lease(conn, now, job, epoch, "preempted")
    conn.execute(
        update(s.jobs)
        .where(s.jobs.c.name == job)
        .values(state=JobState.WAITING.value, waiting_since=now, last_seen=now)
    )
    replan(conn, now, synced=True)
    return Target(job, 0, TargetAction.PREEMPT, reason, ())


def park(conn: Connection, now: float, job: str, epoch: int) -> bool:
    ttl = pool_settings(conn)["lease_ttl_s"]
    conn.execute(
        update(s.leases).where(s.leases.c.job == job, s.leases.c.epoch == epoch).values(expires=now + ttl)
    )
    conn.execute(
        update(s.jobs).where(s.jobs.c.name == job).values(state=JobState.PARKED.value, last_seen=now)
    )
    log_event(conn, now, "park", job=job, epoch=epoch, workers=0,
                reason=f"chunk done; slots kept for the next chunk for {ttl:.0f}s")
    replan(conn, now, synced=True)
    return True


def give_back(conn: Connection, now: float, row: Any, epoch: int, finished: bool) -> bool:
    """``PoolClient.release`` inside its transaction (the ledger synced)."""
    job = row.name
    live = live_lease(conn, job)
    released = live is not None and live.epoch == epoch
    if released:
        held = held_slots(conn, job)
        why = "finished" if finished else "released"
        free_slots(conn, now, job, held, "release", why, epoch=epoch, workers=0)
        end_lease(conn, now, job, epoch, why)
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
            log_event(conn, now, "finish", job=job, epoch=epoch)
    replan(conn, now, synced=True)
    return released
