"""The tenant step of a decision: capacity divided among tenants, each tenant's part then shared
among its jobs by the pool's policy.

A snapshot's :class:`~elastic_ops.pool.model.Tenant` s (teams) each have a ``guaranteed``
number of slots, an optional ``max_slots`` and a ``weight``. Within the share step
(:mod:`elastic_ops.pool.rules`), capacity is divided first among the tenants, by
:func:`divide`:

1. every tenant gets what its jobs can use of its guarantee (its **demand**: what its frozen
   jobs keep plus the caps of its other jobs, up to its maximum);
2. what is left -- guarantees nobody uses, and slots nobody is guaranteed -- is **lent** to the
   tenants that want more, in proportion to their weights, each up to its demand;
3. a tenant whose jobs cannot take all of its part (a gang minimum that does not fit, a
   ``goodput`` job that gains nothing from more) keeps what they take, and the rest is divided
   again among the others (:func:`divide_among`).

Then the job-level policy (priority, fairshare, strict, goodput; admission and aging as
without tenants) shares each tenant's part among its jobs. A running job keeps slots its
tenant no longer gets until it shrinks at its next iteration boundary: **reclaim** is graceful
preemption through the freeze rules, with two tenant rules in them (``Change.reclaims``: a
borrower's shrink while another tenant is below its guarantee is never held back by
``min_gain``, only delayed by ``min_rescale_interval_s``, so a guarantee is back within one
rescale interval and one iteration of the borrowers; ``Change.tenant_over``: a tenant above its
maximum, lowered by a user, shrinks whatever the freeze rules say, as a job above its own max).
A job that is not preemptible, or a pool with ``preemption: none``, gives nothing back before
it ends: such jobs should stay within their tenant's guarantee.

With every job in one tenant whose maximum does not bind, the step is skipped
(:func:`of_snapshot` returns None): the decision is exactly the one without tenants.

Every job's reason names the tenant rule that set its tenant's part (:data:`RULES`), e.g.
``reclaimed for tenant vision (guaranteed 16, using 9)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from elastic_ops.pool.model import Snapshot, Tenant
from elastic_ops.pool.shares import weighted_fill_array

NO_MAX = 2**62  # a tenant without a maximum


@dataclasses.dataclass(frozen=True)
class TenantRule:
    """A reason a tenant gets the part it gets; ``text`` formats its numbers."""

    name: str
    text: str


GUARANTEED = TenantRule("guaranteed", "tenant {t} within its guaranteed {g}")
BORROWING = TenantRule("borrowing", "tenant {t} borrows {b} idle slots (guaranteed {g})")
AT_MAX = TenantRule("at_max", "tenant {t} at its max {m} (guaranteed {g})")
RECLAIMED = TenantRule("reclaimed", "reclaimed for tenant {u} (guaranteed {gu}, using {hu})")
RECLAIMING = TenantRule("reclaiming", "tenant {t} gets {p} of its guaranteed {g}: borrowed slots are "
                        "reclaimed at the borrowers' next boundaries")
OVERCOMMITTED = TenantRule("overcommitted", "tenant {t} gets {p} of its guaranteed {g}: the guarantees "
                           "exceed the {c} up slots")
RULES = (GUARANTEED, BORROWING, AT_MAX, RECLAIMED, RECLAIMING, OVERCOMMITTED)


class Tenants:
    """The tenants of one decision as arrays (sorted by name: ties in lending go to the first),
    and the tenant id of each of ``jobs`` (a name the snapshot does not list is a tenant without
    guarantee or maximum). ``reclaims`` / ``over``: per tenant, whether it borrows while another
    is below its guarantee, and whether it holds more than its maximum (:meth:`flags`)."""

    def __init__(self, listed: Sequence[Tenant], job_tenants: Sequence[str]) -> None:
        known = {t.name: t for t in listed}
        names = sorted(set(known) | set(job_tenants))
        index = {n: i for i, n in enumerate(names)}
        self.names = names
        self.ids = np.fromiter(map(index.__getitem__, job_tenants), np.int64, len(job_tenants))
        self.guaranteed = np.array([known[n].guaranteed if n in known else 0 for n in names], dtype=np.int64)
        self.max_slots = np.array(
            [NO_MAX if n not in known or known[n].max_slots is None else known[n].max_slots for n in names],
            dtype=np.int64,
        )
        self.weight = np.array([known[n].weight if n in known else 1.0 for n in names], dtype=np.float64)
        self.reclaims = np.zeros(len(names), dtype=bool)
        self.over = np.zeros(len(names), dtype=bool)

    def __len__(self) -> int:
        return len(self.names)

    def per_tenant(self, ids: np.ndarray, values) -> np.ndarray:
        """``values`` summed per tenant (``ids``: the tenant of each value)."""
        return np.bincount(ids, weights=values, minlength=len(self.names)).astype(np.int64)

    def flags(self, held: np.ndarray, demand: np.ndarray) -> None:
        """Set :attr:`reclaims` and :attr:`over` from what each tenant holds now (``held``) and
        could use (``demand``)."""
        short = (held < self.guaranteed) & (demand > held)
        borrowing = held > self.guaranteed
        self.reclaims = borrowing & (int(short.sum()) - short > 0)
        self.over = held > self.max_slots


def of_snapshot(snap: Snapshot, job_tenants: Sequence[str], capacity: int) -> Tenants | None:
    """The decision's tenants, for the jobs' tenants in the order the caller ranks them; None
    when the step changes nothing: the snapshot lists no tenant, or one that every job is in and
    whose maximum does not bind."""
    if not snap.tenants:  # a snapshot without tenants: every job in one pool
        return None
    names = set(job_tenants) | {t.name for t in snap.tenants}
    if len(names) == 1:
        t = snap.tenants[0] if snap.tenants else None
        if t is None or t.max_slots is None or t.max_slots >= capacity:
            return None
    return Tenants(snap.tenants, job_tenants)


def divide(guaranteed: np.ndarray, limit: np.ndarray, weight: np.ndarray, floor: np.ndarray,
           capacity: int) -> np.ndarray:
    """Each tenant's part of ``capacity``: at least ``floor`` (what its frozen jobs keep), its
    guarantee up to ``limit`` (what it can use, at most its maximum), then the rest lent by
    ``weight`` up to ``limit``. Guarantees that do not all fit (hosts down, or more guaranteed
    than the pool has) are cut in proportion to them."""
    zero = np.zeros(len(limit), dtype=np.int64)
    base = np.maximum(floor, np.minimum(guaranteed, limit))
    room = capacity - int(floor.sum())
    if int(base.sum()) - int(floor.sum()) > room:
        weights = np.maximum(guaranteed, 1).astype(np.float64)
        return floor + weighted_fill_array(zero, base - floor, weights, max(room, 0))
    return base + weighted_fill_array(zero, limit - base, weight, capacity - int(base.sum()))


def divide_among(tt: Tenants, demand: np.ndarray, kept: np.ndarray, capacity: int,
                 members: Iterable[int], run: Callable[[int, int], int],
                 held_back: np.ndarray | None = None) -> tuple[np.ndarray, dict[int, int]]:
    """Divide ``capacity`` (:func:`divide`) and share each part: ``run(t, cap)`` shares ``cap``
    among tenant ``t``'s free jobs (``members``: the tenants that have any) and returns what they
    take. A tenant that takes less than its part keeps what it took, and the rest is divided again
    (each round fixes at least one tenant) -- except, within its guarantee, what ``held_back``
    (per tenant) says its jobs held back by ``min_rescale_interval_s`` will take once they may:
    lent now, the borrower's own rescale would protect it, and the guarantee would come back
    only after two intervals. Returns the parts and what each member's free jobs were given
    (``part - kept``)."""
    if held_back is not None:  # claimed within the guarantee from the start
        demand = demand + np.minimum(held_back, np.maximum(tt.guaranteed - demand, 0))
    limit = np.maximum(np.minimum(demand, tt.max_slots), kept)
    members = list(members)
    given: dict[int, int] = {}
    took: dict[int, int] = {}
    fixed: set[int] = set()
    parts = kept
    for _ in range(len(members) + 1):
        parts = divide(tt.guaranteed, limit, tt.weight, kept, capacity)
        short = []
        for t in members:
            cap = int(parts[t] - kept[t])
            if given.get(t) != cap:
                given[t] = cap
                took[t] = run(t, cap)
            if t not in fixed and kept[t] + took[t] < parts[t]:
                short.append(t)
        if not short:
            break
        fixed.update(short)
        used = kept[short] + np.array([took[t] for t in short], dtype=np.int64)
        if held_back is not None:
            used += np.minimum(held_back[short], np.maximum(tt.guaranteed[short] - used, 0))
        limit[short] = np.minimum(limit[short], used)
    return parts, given


def texts(tt: Tenants, parts: np.ndarray, held: np.ndarray, demand: np.ndarray, capacity: int) -> list[str]:
    """The tenant rule of each tenant's part, as the text its jobs' reasons end with."""
    g, m = tt.guaranteed, tt.max_slots
    wants = np.minimum(g, demand)
    short = np.flatnonzero((held < wants) & (parts > held))
    out = []
    for t, name in enumerate(tt.names):
        others = [u for u in short.tolist() if u != t]
        p, gt = int(parts[t]), int(g[t])
        if p < held[t] and held[t] > gt and others:
            u = min(others, key=lambda u: (-(int(wants[u]) - int(held[u])), tt.names[u]))
            text = RECLAIMED.text.format(u=tt.names[u], gu=int(g[u]), hu=int(held[u]))
        elif m[t] < NO_MAX and p >= m[t] and demand[t] > m[t]:
            text = AT_MAX.text.format(t=name, m=int(m[t]), g=gt)
        elif p > gt:
            text = BORROWING.text.format(t=name, b=p - gt, g=gt)
        elif p < wants[t]:
            rule = RECLAIMING if int(g.sum()) <= capacity else OVERCOMMITTED
            text = rule.text.format(t=name, p=p, g=gt, c=capacity)
        else:
            text = GUARANTEED.text.format(t=name, g=gt)
        out.append("; " + text)
    return out
