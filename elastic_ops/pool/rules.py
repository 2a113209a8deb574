"""The pool's allocation rules, each written once, each with the reason it gives.

A decision runs four steps in this order (:func:`elastic_ops.pool.policies.make_policy`):

1. **Admit** (gang): walking the jobs in :func:`order_key` order, a job is admitted when its
   minimum fits in what the jobs admitted before it left. Not admitted: :data:`CAP_BELOW_MIN`
   (its hosts cannot hold its minimum) or :data:`GANG_DOES_NOT_FIT`.
2. **Share**: with tenants, capacity is first divided among them (guarantees, idle capacity
   lent by weight up to each one's max: :mod:`elastic_ops.pool.tenants`), and steps 1-2 run
   within each tenant's part; the policy's share function splits the capacity among the
   admitted jobs within ``[min, max]`` (:mod:`elastic_ops.pool.shares`,
   :mod:`elastic_ops.pool.goodput`).
3. **Freeze**: a running job that one of :data:`FREEZE_RULES` holds back keeps what it holds,
   and the rest is shared again around it (a fixed point; :data:`SETTLE_AFTER`).
4. **Place**: each job keeps its slots on up hosts and takes free ones (its own hosts first,
   then best fit; ``goodput`` also moves running jobs onto fewer hosts when that pays); a job
   held on hosts it must leave says so (:func:`moving`); a running job never runs below its
   minimum while it moves (:func:`kept_for_minimum`).

Before the first step :func:`avoided` decides which hosts each job avoids.

The rules are plain functions of a job's values, so the two implementations of the steps (the
per-slot one in :mod:`elastic_ops.pool.plain_policies` for small snapshots, the vectorised one in
:mod:`elastic_ops.pool.policies`) call the same code: a freeze rule's ``holds`` is written with
operators that mean the same on one job's numbers and on numpy columns of all of them. The ledger
and the simulator run the policy and nothing else, so they apply exactly these rules.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Mapping
from typing import Generic, NamedTuple, TypeVar

from elastic_ops.pool.api import Target
from elastic_ops.pool.model import (
    Decision,
    HostState,
    Job,
    PolicyConfig,
    Preemption,
    Snapshot,
    TargetAction,
)

# --- order ----------------------------------------------------------------------------------


def effective_priority(job: Job, now: float, aging_s: float) -> float:
    """Priority plus one unit per *whole* ``aging_s`` seconds spent waiting (jobs holding no
    slots). Whole units: a waiting job overtakes a running one of the same priority only after
    waiting ``aging_s``, so two such jobs take turns instead of preempting each other at every
    boundary (with fractions, any wait at all outranked the running job)."""
    if job.held or aging_s <= 0 or job.waiting_since is None:
        return float(job.priority)
    return job.priority + math.floor(max(0.0, now - job.waiting_since) / aging_s)


def order_key(job: Job, snap: Snapshot) -> tuple:
    """Deterministic rank: higher effective priority, then running jobs, then FIFO, then name."""
    eff = effective_priority(job, snap.now, snap.config.aging_s)
    return (-eff, 0 if job.held else 1, job.submitted, job.name)


# --- which hosts a job avoids ---------------------------------------------------------------


def avoided(avoid: frozenset[str], leave: frozenset[str], min_workers: int, capacity: int, on_avoided: int):
    """The hosts a job avoids: those that failed it (``avoid`` beyond ``leave``) and those
    outside its host selector (``leave``, always), unless the other up hosts cannot hold even its
    minimum; then avoiding the failed ones would make it wait forever (a one-host pool after one
    lost worker), and it is retried where it failed. ``capacity``: the up slots;
    ``on_avoided``: those on ``avoid``'s hosts. Returns ``avoid`` itself when it stands."""
    if avoid != leave and capacity - on_avoided < min_workers:
        return leave
    return avoid


def retry_where_it_failed(snap: Snapshot) -> Snapshot:
    """The snapshot with each job's avoided hosts as the policies honour them (:func:`avoided`);
    the snapshot itself when every job's stand."""
    up = {h.name: h.slots for h in snap.hosts if h.state == HostState.UP}
    total = sum(up.values())
    jobs = tuple(
        dataclasses.replace(j, avoid_hosts=kept)
        if (kept := avoided(j.avoid_hosts, j.leave_hosts, j.min_workers, total,
                            sum(up.get(h, 0) for h in j.avoid_hosts))) is not j.avoid_hosts
        else j
        for j in snap.jobs
    )
    return snap if all(map(operator.is_, jobs, snap.jobs)) else dataclasses.replace(snap, jobs=jobs)


# --- admit ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AdmitRule:
    """Why a job is not admitted, given its minimum and a count of slots: ``text`` formats them."""

    name: str
    text: str

    def why(self, min_workers: int, slots: int) -> str:
        return self.text.format(min_workers, slots)


CAP_BELOW_MIN = AdmitRule("cap_below_min", "min {} exceeds the {} usable slots it may use")
CAP_HELD_BY_OTHERS = AdmitRule(
    "cap_held_by_others",
    "min {} exceeds the {} slots it may use now: the others on its hosts are held by jobs that "
    "cannot move or shrink yet",
)
GANG_DOES_NOT_FIT = AdmitRule("gang", "min {} does not fit: {} slots left after higher-ranked jobs")


def too_few(min_workers: int, cap: int, base: int) -> str:
    """Why a job whose ``cap`` is below its minimum waits: its hosts have too few slots, or
    (``base``, its cap on an empty pool, reaches it) jobs on them keep theirs for now."""
    rule = CAP_BELOW_MIN if base < min_workers else CAP_HELD_BY_OTHERS
    return rule.why(min_workers, max(cap, 0))


# --- freeze ---------------------------------------------------------------------------------

T = TypeVar("T")


class Change(NamedTuple, Generic[T]):
    """What the freeze rules read of running jobs that the share would rescale: one job's values
    (the plain path) or numpy columns of many (the vectorised one). ``last_rescale``: NaN when
    never rescaled; ``pinned``: not preemptible; ``admitted_above``: a job ranked above it that
    holds nothing is admitted in this plan; ``reclaims``: its tenant borrows while another is
    below its guarantee; ``tenant_over``: its tenant holds more than its maximum
    (:mod:`elastic_ops.pool.tenants`; both False without tenants)."""

    held: T
    target: T
    pinned: T
    last_rescale: T
    admitted_above: T
    reclaims: T = False  # type: ignore[assignment]
    tenant_over: T = False  # type: ignore[assignment]


def no(x: T) -> T:
    """Logical not, for a bool and for a numpy bool column alike."""
    return x ^ True  # type: ignore[operator,return-value]


@dataclasses.dataclass(frozen=True)
class FreezeRule:
    """A reason a running job keeps what it holds instead of the share's target."""

    name: str
    holds: Callable[[Change, PolicyConfig, float], object]  # (change, config, now) -> bool or mask
    text: Callable[[Change, PolicyConfig, float], str]  # one job's change -> its reason


def _shrinks(c: Change):
    return c.target < c.held


def _gain(c: Change):
    return abs(c.target - c.held) / c.held


FREEZE_RULES: tuple[FreezeRule, ...] = (
    FreezeRule(
        "preemption_none",
        lambda c, cfg, now: _shrinks(c) & (cfg.preemption == Preemption.NONE),
        lambda c, cfg, now: "preemption is 'none': running jobs are not shrunk",
    ),
    FreezeRule(
        "not_preemptible",
        lambda c, cfg, now: _shrinks(c) & c.pinned,
        lambda c, cfg, now: "job is not preemptible",
    ),
    FreezeRule(
        "rescaled_recently",
        lambda c, cfg, now: now - c.last_rescale < cfg.min_rescale_interval_s,  # NaN: never
        lambda c, cfg, now: f"rescaled {now - c.last_rescale:.0f}s ago (< {cfg.min_rescale_interval_s:.0f}s)",
    ),
    # min_gain never holds back a shrink that lets a higher-ranked job holding nothing in: it would
    # keep that job waiting for good (a 1-slot newcomer next to an 8-slot job is a 12 % change);
    # min_rescale_interval_s only delays it. Nor a borrower's shrink that gives another tenant its
    # guarantee back: the reclaim would wait for good.
    FreezeRule(
        "min_gain",
        lambda c, cfg, now: (c.target > 0) & (_gain(c) < cfg.min_gain)
        & no(_shrinks(c) & (c.admitted_above | c.reclaims)),
        lambda c, cfg, now: f"gain {_gain(c):.2f} below min_gain {cfg.min_gain:.2f}",
    ),
)


def may_freeze(c: Change, min_workers, max_workers):
    """Which changes a freeze rule may hold back: a running job within its bounds that the share
    would rescale (a job above its max, which a user lowered, or below its min always moves; so
    does a job of a tenant above its maximum)."""
    return (c.held > 0) & (c.target != c.held) & (c.held <= max_workers) & (c.held >= min_workers) & no(
        c.tenant_over)


def freeze_reason(c: Change, cfg: PolicyConfig, now: float) -> str | None:
    """The first rule that holds one job's change back, as its reason (None: it may change).
    The caller has checked :func:`may_freeze`."""
    for rule in FREEZE_RULES:
        if rule.holds(c, cfg, now):
            return rule.text(c, cfg, now)
    return None


# Exact freeze rounds before a chain of freezes is settled in one step. Freezing only ever grows
# the frozen set, so the rounds reach a fixed point; usually one round freezes every job it must,
# but freezing one can shrink the next (N equal jobs that may not shrink, one newcomer: one job a
# round). After SETTLE_AFTER rounds every free job that a rule would hold back from a shrink to 0
# keeps what it holds (min_gain, a preference, never holds back a change to 0), and the last round
# shares among the rest.
SETTLE_AFTER = 8


# --- place ----------------------------------------------------------------------------------

# (on hosts that are not up, on hosts outside its selector) -> the reason suffix of a job that
# holds slots it cannot keep
MOVING = {
    (True, False): "; moving off unhealthy hosts",
    (False, True): "; moving off hosts outside its host selector",
    (True, True): "; moving off unhealthy hosts and hosts outside its host selector",
}


def moving(job: Job, up: Mapping[str, int], held_up: int) -> str:
    """The reason suffix of a job that holds slots it cannot keep (``held_up``: those it can)."""
    if held_up == len(job.held):
        return ""
    unhealthy = any(h not in up for h, _ in job.held)
    outside = any(h in up and h in job.leave_hosts for h, _ in job.held)
    return MOVING[unhealthy, outside]


def kept_for_minimum(placed: int, released_off_up: int, min_workers: int) -> int:
    """How many of the slots a running job releases on hosts that are not up it keeps for now,
    so that it never runs below its minimum while it moves: a job moved off a draining host whose
    new slots are not all free yet (others release them at their next boundary) keeps enough old
    slots to run ``min_workers`` meanwhile, rather than shrink under its minimum and grow back.
    Only slots on hosts that are not up: no other job may be given those, so keeping them costs
    nobody (slots on an up host outside its selector go, as others may be waiting for them).
    ``placed``: the slots it keeps and is given; with none at all it is preempted, as planned."""
    if placed == 0 or released_off_up == 0:
        return 0
    return max(0, min(min_workers - placed, released_off_up))


def keeps_old(n: int) -> str:
    """The reason suffix of a job that :func:`kept_for_minimum` keeps ``n`` old slots for."""
    return f"; keeps {n} old slots until its minimum fits on up hosts"


def target_of(job: str, workers: int, d: Decision, batch: int = 0) -> Target:
    """What a job running ``workers`` is told by its decision ``d``: the count it may run and how
    to get there. An equal count with slots to release is a move (``grow``: new slots first)."""
    n = len(d.placements)
    if d.target == 0 or n == 0:  # nothing usable to run on (e.g. its host drains, others full)
        action = TargetAction.PREEMPT
    elif n > workers or (n == workers and d.release):
        action = TargetAction.GROW
    elif n < workers:
        action = TargetAction.SHRINK
    else:
        action = TargetAction.KEEP
    return Target(job, n, action, d.reason, d.placements, batch if n else 0)
