"""Allocation policies: pure functions from a :class:`Snapshot` to a :class:`Plan`.

A decision has three steps, all deterministic and free of I/O:

1. **Order and admit.** Jobs are ordered by ``(-effective priority, running first, submitted,
   name)``. Walking that order, a job is admitted if its ``min_workers`` still fits in the
   capacity (slots on ``up`` hosts) after the minimums of the jobs admitted before it: gang
   semantics, a job starts only when its minimum can be granted. Jobs not admitted get 0.
2. **Share.** The capacity is split among admitted jobs within ``[min, max]``: ``fairshare``
   (max-min fair, equal weights), ``priority`` (weights = priorities, so 3:5 on 8 slots gives
   3/5) or ``strict`` (minimums first, then the rest to the highest priority class, max-min fair
   inside a class). Running jobs that must not move (``preemption=none``, non-preemptible,
   rescaled too recently, or a change smaller than ``min_gain``) are frozen at what they hold
   and the rest is re-shared around them.
3. **Place.** Each job keeps its held slots on ``up`` hosts (most-used hosts first) up to its
   target and releases the rest at its next boundary; growth takes free slots on ``up`` hosts
   it does not avoid, its own hosts first, then hosts in name order (lowest slot index first).
   A grow (or a new grant) waits for its full increment while other jobs still have slots to
   release, so a job rescales once rather than in steps.

**Aging** (no starvation): a job holding no slots has effective priority
``priority + (now - waiting_since) / aging_s``; a running job's is its priority. Aging changes
the admission order and the ``strict`` class, never the ``priority`` weights.

**Representation (why it is fast).** Steps 1-2 run on numpy arrays with one entry per job
(ordering by ``lexsort``, admission by cumulative sums, shares by vectorised water-filling).
Free capacity is a bitmap over the slots of ``up`` hosts, built in one vectorised pass over the
held slots; the free slots then form one list in (host name, slot index) order, and each host
keeps a cursor into it, because every take (own hosts first, then in name order) consumes a
host's lowest free indices. Python-level work per decision is one pass over the jobs plus the
slots that change hands. Cost: O(J log J + H + S) for J jobs, H hosts and S slots, with only
O(J + changed slots) of it interpreted.

``tests/pool/reference_policies.py`` keeps the plain per-slot implementation; a property test
checks that both give the same plan.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from itertools import chain
from operator import attrgetter, itemgetter

import numpy as np

from elastic_ops.errors import UnknownPolicyError
from elastic_ops.pool.model import (
    Decision,
    HostState,
    Job,
    Plan,
    Preemption,
    Slot,
    Snapshot,
    TargetAction,
    make_decision,
)
from elastic_ops.pool.shares import strict_fill_array, weighted_fill_array

Policy = Callable[[Snapshot], Plan]
# (mins, caps, priorities, effective priorities, capacity) -> targets, all arrays over the
# admitted jobs in rank order.
ShareFn = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int], np.ndarray]

_host = itemgetter(0)


def effective_priority(job: Job, now: float, aging_s: float) -> float:
    """Priority plus one unit per ``aging_s`` seconds spent waiting (jobs holding no slots)."""
    if job.held or aging_s <= 0 or job.waiting_since is None:
        return float(job.priority)
    return job.priority + max(0.0, now - job.waiting_since) / aging_s


def order_key(job: Job, snap: Snapshot) -> tuple:
    """Deterministic rank: higher effective priority, then running jobs, then FIFO, then name."""
    eff = effective_priority(job, snap.now, snap.config.aging_s)
    return (-eff, 0 if job.held else 1, job.submitted, job.name)


# --- share functions (step 2) ---------------------------------------------------------------


def _fair(mins, caps, prio, eff, capacity: int) -> np.ndarray:
    return weighted_fill_array(mins, caps, np.ones(len(mins)), capacity)


def _priority(mins, caps, prio, eff, capacity: int) -> np.ndarray:
    return weighted_fill_array(mins, caps, prio, capacity)


def _strict(mins, caps, prio, eff, capacity: int) -> np.ndarray:
    return strict_fill_array(mins, caps, np.floor(eff), capacity)


# --- step 1: the job table ------------------------------------------------------------------

_fields = attrgetter("held", "priority", "submitted", "waiting_since", "min_workers", "max_workers", "name")


class _Table:
    """The snapshot's jobs as arrays, in rank order (see :func:`order_key`)."""

    def __init__(self, snap: Snapshot) -> None:
        jobs = snap.jobs
        n = len(jobs)
        cols = list(zip(*map(_fields, jobs), strict=True)) if n else [()] * 7
        helds, prio_l, sub_l, ws_l, min_l, max_l, names = cols
        hl = np.fromiter(map(len, helds), np.int64, n)
        prio = np.array(prio_l, dtype=np.float64)
        eff = prio.copy()
        aging = snap.config.aging_s
        if aging > 0:
            waiting = [i for i, (h, w) in enumerate(zip(helds, ws_l, strict=True)) if not h and w is not None]
            if waiting:
                ws = np.array([ws_l[i] for i in waiting], dtype=np.float64)
                eff[waiting] = prio[waiting] + np.maximum(0.0, snap.now - ws) / aging
        submitted = np.array(sub_l, dtype=np.float64)
        order = _rank(-eff, hl == 0, submitted, names)
        ol = order.tolist()
        self.jobs: list[Job] = list(map(jobs.__getitem__, ol))
        self.held: list[tuple[Slot, ...]] = list(map(helds.__getitem__, ol))
        self.n_held = hl[order]
        self.prio = prio[order]
        self.eff = eff[order]
        self.mins = np.array(min_l, dtype=np.int64)[order]
        self.maxs = np.array(max_l, dtype=np.int64)[order]


def _rank(neg_eff: np.ndarray, waiting: np.ndarray, submitted: np.ndarray, names) -> np.ndarray:
    """Indices in :func:`order_key` order. The numeric keys are sorted by numpy; names only
    break the ties that remain (usually none), so strings are compared only among tied jobs."""
    order = np.lexsort((submitted, waiting, neg_eff))
    if len(order) < 2:
        return order
    a, w, s = neg_eff[order], waiting[order], submitted[order]
    tied = (a[1:] == a[:-1]) & (w[1:] == w[:-1]) & (s[1:] == s[:-1])
    if not tied.any():
        return order
    starts = np.flatnonzero(np.concatenate([[True], ~tied]))
    ends = np.concatenate([starts[1:], [len(order)]])
    out = order.tolist()
    for b, e in zip(starts.tolist(), ends.tolist(), strict=True):
        if e - b > 1:
            out[b:e] = sorted(out[b:e], key=names.__getitem__)
    return np.array(out, dtype=np.int64)


# --- free capacity --------------------------------------------------------------------------


class _Free:
    """Every held slot as arrays (``owner`` job, ``host`` id in name order, ``index``, on an up
    host or not; in the order of ``flat``) and the free slots on ``up`` hosts, from one pass over
    the held slots. ``slots`` lists the free slots in (host name, index) order; host ``h`` owns
    ``slots[pos[h]:end[h]]`` and gives them out from the front."""

    def __init__(self, snap: Snapshot, up: dict[str, int], helds: list[tuple[Slot, ...]], n_held) -> None:
        self.flat: list[Slot] = list(chain.from_iterable(helds))
        names, host = self._host_ids(snap)
        up_size = np.fromiter((up.get(h, 0) for h in names), np.int64, len(names))
        self.is_up_host = np.fromiter((h in up for h in names), bool, len(names))
        self.host = host
        self.index = np.fromiter(map(_index, self.flat), np.int64, len(self.flat))
        self.owner = np.repeat(np.arange(len(helds)), n_held)
        self.on_up = self.is_up_host[host]
        self.held_up = n_held - np.bincount(self.owner[~self.on_up], minlength=len(helds))
        off = np.zeros(len(names) + 1, dtype=np.int64)
        np.cumsum(up_size, out=off[1:])
        ok = (self.index >= 0) & (self.index < up_size[host])  # on an up host, within its slots
        taken = np.zeros(int(off[-1]), dtype=bool)
        taken[off[host[ok]] + self.index[ok]] = True
        free = np.flatnonzero(~taken)
        host_of = np.searchsorted(off, free, side="right") - 1
        idx = (free - off[host_of]).tolist()
        self.slots: list[Slot] = list(zip(map(names.__getitem__, host_of.tolist()), idx, strict=True))
        counts = np.bincount(host_of, minlength=len(names))
        ends = np.cumsum(counts)
        with_free = np.flatnonzero(counts)
        self.hosts: list[str] = [names[i] for i in with_free.tolist()]  # name order
        self.pos: dict[str, int] = dict(zip(self.hosts, (ends - counts)[with_free].tolist(), strict=True))
        self.end: dict[str, int] = dict(zip(self.hosts, ends[with_free].tolist(), strict=True))
        self.has_free: set[str] = set(self.hosts)
        self.total = len(self.slots)
        self.cursor = 0

    def _host_ids(self, snap: Snapshot) -> tuple[list[str], np.ndarray]:
        """Host names in name order (the snapshot's, plus any held slot's unknown host) and the
        id of each held slot's host in that order."""
        names = sorted({h.name for h in snap.hosts})
        for _ in range(2):
            ids = dict(zip(names, range(len(names)), strict=True))
            try:
                return names, np.fromiter(
                    map(ids.__getitem__, map(_host, self.flat)), np.int64, len(self.flat)
                )
            except KeyError:  # a slot on a host the snapshot does not list: not up, not free
                names = sorted(set(names).union(map(_host, self.flat)))
        raise AssertionError("unreachable")

    def count_for(self, avoid: frozenset[str]) -> int:
        if not avoid:
            return self.total
        return self.total - sum(self.end[h] - self.pos[h] for h in avoid if h in self.pos)

    def take(self, n: int, held, avoid: frozenset[str]) -> list[Slot]:
        """``n`` free slots: on the hosts of ``held`` first (in their order), then in host-name
        order, skipping ``avoid``; lowest slot indices first on each host. Callers check that
        ``count_for(avoid) >= n``."""
        out: list[Slot] = []
        pos, end, slots = self.pos, self.end, self.slots
        for h in dict.fromkeys(filter(self.has_free.__contains__, map(_host, held))):
            if h not in avoid:
                p, e = pos[h], end[h]
                k = min(n - len(out), e - p)
                out += slots[p : p + k]
                pos[h] = p + k
                if p + k == e:
                    self.has_free.discard(h)
                if len(out) == n:
                    break
        hosts, i = self.hosts, self.cursor
        while len(out) < n and i < len(hosts):
            h = hosts[i]
            p, e = pos[h], end[h]
            if h not in avoid and p < e:
                k = min(n - len(out), e - p)
                out += slots[p : p + k]
                p = pos[h] = p + k
                if p == e:
                    self.has_free.discard(h)
            if i == self.cursor and p == e:
                self.cursor += 1  # hosts before the cursor are full
            i += 1
        self.total -= len(out)
        return out


_index = itemgetter(1)


# --- step 2: targets ------------------------------------------------------------------------


def _usable(snap: Snapshot) -> tuple[dict[str, int], int]:
    up = {h.name: h.slots for h in snap.hosts if h.state == HostState.UP}
    return up, sum(up.values())


def _caps(t: _Table, up: dict[str, int], capacity: int) -> np.ndarray:
    """The most workers each job can use: its max, limited by slots on up hosts it does not avoid."""
    usable = np.full(len(t.jobs), capacity, dtype=np.int64)
    for i, avoid in enumerate(map(attrgetter("avoid_hosts"), t.jobs)):
        if avoid:
            usable[i] -= sum(up.get(h, 0) for h in avoid)
    return np.minimum(t.maxs, usable)


def _admit(mins: np.ndarray, caps: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Gang admission in rank order: a job is admitted if ``cap >= min`` and its min fits after
    the mins admitted before it. Returns (usable, admitted) masks. Vectorised up to the first
    job that does not fit; after it only jobs with a min no larger than what is left can fit."""
    usable = caps >= mins
    m = np.where(usable, mins, 0)
    cum = np.cumsum(m)
    over = np.flatnonzero(usable & (cum > capacity))
    if len(over) == 0:
        return usable, usable
    p = int(over[0])
    admitted = usable.copy()
    admitted[p:] = False
    left = capacity - int(cum[p] - m[p])
    rest = p + 1 + np.flatnonzero(usable[p + 1 :] & (mins[p + 1 :] <= left))
    for i, need in zip(rest.tolist(), mins[rest].tolist(), strict=True):
        if need <= left:
            admitted[i] = True
            left -= need
    return usable, admitted


class _Movable:
    """What :func:`_freeze` needs per job, as arrays (rank order)."""

    def __init__(self, t: _Table) -> None:
        self.preemptible = np.fromiter(map(attrgetter("preemptible"), t.jobs), bool, len(t.jobs))
        last = [j.last_rescale for j in t.jobs]
        self.last = np.array([np.nan if x is None else x for x in last], dtype=np.float64)


def _freeze(t: _Table, mv: _Movable, held_up, targets, free, snap: Snapshot) -> dict[int, str]:
    """Jobs (among ``free``) that must stay at what they hold, with why (see module docstring)."""
    cfg = snap.config
    cand = free & (held_up > 0) & (targets != held_up) & (held_up <= t.maxs) & (held_up >= t.mins)
    if not cand.any():
        return {}
    shrink = cand & (targets < held_up)
    if cfg.preemption == Preemption.NONE:
        a, b = shrink, np.zeros_like(shrink)
    else:
        a, b = np.zeros_like(shrink), shrink & ~mv.preemptible
    rest = cand & ~a & ~b
    with np.errstate(invalid="ignore"):
        c = rest & ~np.isnan(mv.last) & (snap.now - mv.last < cfg.min_rescale_interval_s)
        gain = np.abs(targets - held_up) / np.maximum(held_up, 1)
    d = rest & ~c & (targets > 0) & (gain < cfg.min_gain)
    out: dict[int, str] = {}
    for i in np.flatnonzero(a).tolist():
        out[i] = "preemption is 'none': running jobs are not shrunk"
    for i in np.flatnonzero(b).tolist():
        out[i] = "job is not preemptible"
    for i in np.flatnonzero(c).tolist():
        ago = snap.now - t.jobs[i].last_rescale
        out[i] = f"rescaled {ago:.0f}s ago (< {cfg.min_rescale_interval_s:.0f}s)"
    for i in np.flatnonzero(d).tolist():
        h, tgt = int(held_up[i]), int(targets[i])
        out[i] = f"gain {abs(tgt - h) / h:.2f} below min_gain {cfg.min_gain:.2f}"
    return out


def _targets(t: _Table, share: ShareFn, held_up, up: dict[str, int], capacity: int, snap: Snapshot):
    caps = _caps(t, up, capacity)
    mv = _Movable(t)
    n = len(t.jobs)
    frozen: dict[int, str] = {}
    is_free = np.ones(n, dtype=bool)
    # Freezing only ever grows the frozen set, so this reaches a fixed point; the bound keeps the
    # worst case cheap (what is still unfrozen after it simply follows the last round).
    for _ in range(6):
        free_idx = np.flatnonzero(is_free)
        cap_left = capacity - int(held_up[~is_free].sum())
        mins, fcaps = t.mins[free_idx], caps[free_idx]
        usable, admitted = _admit(mins, fcaps, cap_left)
        targets = held_up.copy()  # frozen jobs keep what they hold
        targets[free_idx] = 0
        a = free_idx[admitted]
        targets[a] = share(mins[admitted], fcaps[admitted], t.prio[a], t.eff[a], cap_left)
        new = _freeze(t, mv, held_up, targets, is_free, snap)
        if not new:
            break
        frozen.update(new)
        is_free[list(new)] = False
    return targets, _reasons(targets, cap_left, free_idx, mins, fcaps, usable, admitted, frozen, held_up)


def _reasons(targets, cap_left, free_idx, mins, fcaps, usable, admitted, frozen, held_up) -> list[str]:
    """Why each job gets its target. Texts are built once per distinct value, not per job."""
    tl = targets.tolist()
    text = {v: f"share {v} of {cap_left}" for v in set(tl)}
    reasons = np.array(list(map(text.__getitem__, tl)), dtype=object)
    out = ~admitted
    if out.any():
        m_adm = np.where(admitted, mins, 0)
        left = cap_left - (np.cumsum(m_adm) - m_adm)
        # Not usable: "min exceeds cap"; usable but not admitted: "does not fit in what is left".
        key_a = np.where(usable, 1, 0)[out]
        key_b = mins[out]
        key_c = np.where(usable, left, np.maximum(fcaps, 0))[out]
        keys = np.stack([key_a, key_b, key_c], axis=1)
        uniq, inv = np.unique(keys, axis=0, return_inverse=True)
        texts = np.array(
            [
                f"min {lo} does not fit: {c} slots left after higher-ranked jobs"
                if fits
                else f"min {lo} exceeds the {c} usable slots it may use"
                for fits, lo, c in uniq.tolist()
            ],
            dtype=object,
        )
        reasons[free_idx[out]] = texts[inv.reshape(-1)]
    result = reasons.tolist()
    for i, why in frozen.items():
        result[i] = f"keeps {int(held_up[i])}: {why}"
    return result


# --- step 3: placement ----------------------------------------------------------------------


def _keep_all(free: _Free, jobs: np.ndarray, targets: np.ndarray, n: int):
    """For the jobs in ``jobs`` (those that shrink or hold slots on hosts that are not up):
    which held slots to keep (on up hosts, most-used hosts first, then by host name and slot
    index) and which to release. One lexsort over their slots. Returns ``{job: (keep,
    release)}`` and the number of released slots on up hosts."""
    pick = np.zeros(n, dtype=bool)
    pick[jobs] = True
    sel = np.flatnonzero(pick[free.owner])
    o, h, x, u = free.owner[sel], free.host[sel], free.index[sel], free.on_up[sel]
    _, inv, cnt = np.unique(o * (int(h.max(initial=0)) + 1) + h, return_inverse=True, return_counts=True)
    order = np.lexsort((x, h, -cnt[inv.reshape(-1)], ~u, o))
    o, u = o[order], u[order]
    start = np.searchsorted(o, o, side="left")
    keep = u & (np.arange(len(o)) - start < targets[o])
    slots = list(map(free.flat.__getitem__, sel[order].tolist()))
    n_keep = np.bincount(o[keep], minlength=n)[jobs].tolist()
    bounds = np.searchsorted(o, jobs).tolist() + [len(o)]
    out = {}
    for k, i in enumerate(jobs.tolist()):
        b, m, e = bounds[k], bounds[k] + n_keep[k], bounds[k + 1]
        out[i] = (slots[b:m], slots[m:e])
    return out, int((u & ~keep).sum())


def make_policy(share: ShareFn) -> Policy:
    def decide(snap: Snapshot) -> Plan:
        # A decision allocates O(jobs + changed slots) short-lived objects that refcounting
        # frees, no cycles. Left on, the cyclic collector would walk the whole snapshot (every
        # held slot) several times per decision at 10,000 jobs for no garbage: pause it for the
        # call (restored on return or error; left alone if the caller had disabled it).
        if not gc.isenabled():
            return _decide(snap, share)
        gc.disable()
        try:
            return _decide(snap, share)
        finally:
            gc.enable()

    return decide


def _decide(snap: Snapshot, share: ShareFn) -> Plan:
    up, capacity = _usable(snap)
    t = _Table(snap)
    free = _Free(snap, up, t.held, t.n_held)
    held_up = free.held_up
    targets, reasons = _targets(t, share, held_up, up, capacity, snap)
    # Jobs that keep all they hold (on up hosts); the others keep part and release the rest.
    simple = (held_up == t.n_held) & (targets >= held_up)
    kept, pending = _keep_all(free, np.flatnonzero(~simple), targets, len(t.jobs))
    tl = targets.tolist()
    need = (targets - t.n_held).tolist()
    moved = (held_up != t.n_held).tolist()
    decisions: list[Decision] = []
    append = decisions.append
    keep_action, grow = TargetAction.KEEP, TargetAction.GROW
    for i, (job, held, target, reason) in enumerate(zip(t.jobs, t.held, tl, reasons, strict=True)):
        if i in kept:
            keep, release = kept[i]
            append(_place(job, target, reason, keep, release, free, pending, moved[i]))
        elif need[i] <= 0:  # the steady state (holds and keeps it) or a job that waits
            append(make_decision(job.name, target, held, (), keep_action if held else None, reason))
        else:
            new, reason = _grow(job, need[i], len(held), held, reason, free, pending)
            action = grow if new else (keep_action if held else None)
            append(make_decision(job.name, target, held + tuple(new) if new else held, (), action, reason))
    return Plan(tuple(decisions))


def _grow(job: Job, need: int, have: int, keep, reason: str, free: _Free, pending: int):
    """The free slots for ``need`` more workers: all of them, or (when no slots are being
    released that could make up the rest) what is free if that reaches the job's minimum."""
    avail = free.count_for(job.avoid_hosts)
    if avail >= need:
        return free.take(need, keep, job.avoid_hosts), reason
    if pending == 0 and have + avail >= max(job.min_workers, 1):
        return free.take(avail, keep, job.avoid_hosts), reason + f"; only {avail} more free"
    return [], reason + f"; waiting for {need - avail} slots to be released"


def _place(job, target, reason, keep, release, free: _Free, pending, moved: bool) -> Decision:
    need = target - len(keep)
    if need <= 0 and not release and job.held:
        return make_decision(job.name, target, job.held, (), TargetAction.KEEP, reason)
    new: list[Slot] = []
    if need > 0:
        new, reason = _grow(job, need, len(keep), keep, reason, free, pending)
    placements = job.held if (not new and not release) else tuple(keep + new)
    if job.held and target == 0:
        action: TargetAction | None = TargetAction.PREEMPT
        reason = "preempted: " + reason
    elif new:
        action = TargetAction.GROW
    elif release:
        action = TargetAction.SHRINK
    elif job.held:
        action = TargetAction.KEEP
    else:
        action = None
    if moved:
        reason += "; moving off unhealthy hosts"
    return make_decision(job.name, target, placements, tuple(release), action, reason)


POLICIES: dict[str, Policy] = {
    "fairshare": make_policy(_fair),
    "priority": make_policy(_priority),
    "strict": make_policy(_strict),
}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(name, list(POLICIES)) from None


def decide(snapshot: Snapshot, policy: str = "priority") -> Plan:
    """Run the named policy on a snapshot."""
    return get_policy(policy)(snapshot)
