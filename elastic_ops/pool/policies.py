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
held slots; the free slot indices then form one list in (host name, slot index) order, and each
host keeps a cursor into it, because every take (own hosts first, then in name order) consumes
a host's lowest free indices; slot tuples are made only for the slots handed out. Python-level
work per decision is a few passes over the jobs and the hosts, one C-level read of every held
slot, and the slots that change hands. Cost: O(J log J + H + S) for J jobs, H hosts and S
slots, with only O(J + H + changed slots) of it interpreted.

``tests/pool/reference_policies.py`` keeps the plain per-slot implementation; a property test
checks that both give the same plan.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from itertools import chain, repeat
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
from elastic_ops.pool.plain_policies import PLAIN, effective_priority, order_key, outcome
from elastic_ops.pool.shares import strict_fill_array, weighted_fill_array

__all__ = ["POLICIES", "VECTORISED", "decide", "effective_priority", "get_policy", "make_policy", "order_key"]

Policy = Callable[[Snapshot], Plan]
# (mins, caps, priorities, effective priorities, capacity) -> targets, all arrays over the
# admitted jobs in rank order.
ShareFn = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int], np.ndarray]

_host = itemgetter(0)


# --- share functions (step 2) ---------------------------------------------------------------


def _fair(mins, caps, prio, eff, capacity: int) -> np.ndarray:
    return weighted_fill_array(mins, caps, np.ones(len(mins)), capacity)


def _priority(mins, caps, prio, eff, capacity: int) -> np.ndarray:
    return weighted_fill_array(mins, caps, prio, capacity)


def _strict(mins, caps, prio, eff, capacity: int) -> np.ndarray:
    return strict_fill_array(mins, caps, np.floor(eff), capacity)


# --- step 1: the job table ------------------------------------------------------------------

_FIELDS = (
    "held",
    "priority",
    "submitted",
    "waiting_since",
    "min_workers",
    "max_workers",
    "name",
    "avoid_hosts",
    "preemptible",
    "last_rescale",
)
_fields = attrgetter(*_FIELDS)


class _Table:
    """The snapshot's jobs as arrays, in rank order (see :func:`order_key`), read in one pass."""

    def __init__(self, snap: Snapshot) -> None:
        jobs = snap.jobs
        n = len(jobs)
        cols = list(zip(*map(_fields, jobs), strict=True)) if n else [()] * len(_FIELDS)
        helds, prio_l, sub_l, ws_l, min_l, max_l, names, avoid_l, pre_l, last_l = cols
        hl = np.fromiter(map(len, helds), np.int64, n)
        prio = np.array(prio_l, dtype=np.float64)
        eff = prio.copy()
        aging = snap.config.aging_s
        if aging > 0 and n:
            ws = np.array(ws_l, dtype=np.float64)  # None -> nan
            waiting = (hl == 0) & ~np.isnan(ws)
            eff[waiting] = prio[waiting] + np.maximum(0.0, snap.now - ws[waiting]) / aging
        order = _rank(-eff, hl == 0, np.array(sub_l, dtype=np.float64), names)
        ol = order.tolist()
        self.jobs: list[Job] = list(map(jobs.__getitem__, ol))
        self.held: list[tuple[Slot, ...]] = list(map(helds.__getitem__, ol))
        self.avoid: list[frozenset[str]] = list(map(avoid_l.__getitem__, ol))
        self.n_held = hl[order]
        self.prio = prio[order]
        self.eff = eff[order]
        self.mins = np.array(min_l, dtype=np.int64)[order]
        self.maxs = np.array(max_l, dtype=np.int64)[order]
        self.preemptible = np.array(pre_l, dtype=bool)[order]
        self.last_rescale = np.array(last_l, dtype=np.float64)[order]  # None -> nan


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
    """Every held slot as arrays (``owner`` job, ``host`` id, ``index``, on an up host or not;
    in the order of ``flat``, i.e. job by job in rank order) and the free slots on ``up`` hosts,
    from one pass over the held slots. Host ids number the hosts in name order. ``free_index``
    lists the free slot indices in (host name, index) order; host ``h`` owns
    ``free_index[pos[h]:end[h]]`` and gives them out from the front."""

    def __init__(self, snap: Snapshot, up: dict[str, int], helds: list[tuple[Slot, ...]], n_held) -> None:
        self.flat: list[Slot] = list(chain.from_iterable(helds))
        names, host = self._host_ids(snap)
        self.ids = dict(zip(names, range(len(names)), strict=True))
        up_size = np.fromiter(map(up.get, names, repeat(0)), np.int64, len(names))
        self.host = host
        self.host_list: list[int] = host.tolist()
        self.first = np.concatenate([[0], np.cumsum(n_held)]).tolist()  # job i: flat[first[i]:first[i+1]]
        self.index = np.fromiter(map(_index, self.flat), np.int64, len(self.flat))
        self.owner = np.repeat(np.arange(len(helds)), n_held)
        self.on_up = np.fromiter(map(up.__contains__, names), bool, len(names))[host]
        self.held_up = n_held - np.bincount(self.owner[~self.on_up], minlength=len(helds))
        off = np.zeros(len(names) + 1, dtype=np.int64)
        np.cumsum(up_size, out=off[1:])
        ok = (self.index >= 0) & (self.index < up_size[host])  # on an up host, within its slots
        taken = np.zeros(int(off[-1]), dtype=bool)
        taken[off[host[ok]] + self.index[ok]] = True
        free = np.flatnonzero(~taken)
        host_of = np.repeat(np.arange(len(names)), up_size)[free]
        self.names = names
        self.free_index: list[int] = (free - off[host_of]).tolist()
        self._host_of = host_of
        self.slots: list[Slot] | None = None  # see expect()
        counts = np.bincount(host_of, minlength=len(names))
        ends = np.cumsum(counts)
        self.pos: list[int] = (ends - counts).tolist()
        self.end: list[int] = ends.tolist()
        self.hosts: list[int] = np.flatnonzero(counts).tolist()  # ids with free slots, name order
        self.has_free: set[int] = set(self.hosts)
        self.total = len(free)
        self.cursor = 0

    def _host_ids(self, snap: Snapshot) -> tuple[list[str], np.ndarray]:
        """Host names in name order (the snapshot's, plus any held slot's unknown host) and the
        id of each held slot's host in that order."""
        names = sorted(set(map(_name, snap.hosts)))
        for _ in range(2):
            ids = dict(zip(names, range(len(names)), strict=True))
            try:
                host = np.fromiter(map(ids.__getitem__, map(_host, self.flat)), np.int64, len(self.flat))
                return names, host
            except KeyError:  # a slot on a host the snapshot does not list: not up, not free
                names = sorted(set(names).union(map(_host, self.flat)))
        raise AssertionError("unreachable")

    def expect(self, demand: int) -> None:
        """Prepare to hand out about ``demand`` slots. If that is a good part of what is free,
        make every free slot's tuple now in one C-level pass (cheaper per slot); otherwise make
        them host by host as they are taken, so a nearly empty cluster costs O(taken), not
        O(free)."""
        if demand * 4 >= self.total:
            names = self.names
            self.slots = list(
                zip(map(names.__getitem__, self._host_of.tolist()), self.free_index, strict=True)
            )

    def held_hosts(self, i: int) -> list[int]:
        """Host ids of job ``i``'s held slots, in its order."""
        return self.host_list[self.first[i] : self.first[i + 1]]

    def avoid_ids(self, avoid: frozenset[str]) -> frozenset[int]:
        return frozenset(self.ids[h] for h in avoid if h in self.ids) if avoid else _NONE

    def count_for(self, avoid: frozenset[int]) -> int:
        if not avoid:
            return self.total
        return self.total - sum(self.end[h] - self.pos[h] for h in avoid)

    def take(self, n: int, own: list[int], avoid: frozenset[int]) -> list[Slot]:
        """``n`` free slots: on the ``own`` hosts first (in their order), then in host-name
        order, skipping ``avoid``; lowest slot indices first on each host. Callers check that
        ``count_for(avoid) >= n``."""
        out: list[Slot] = []
        pos, end, index, names, slots = self.pos, self.end, self.free_index, self.names, self.slots
        for h in dict.fromkeys(filter(self.has_free.__contains__, own)):
            if h not in avoid:
                p, e = pos[h], end[h]
                k = min(n - len(out), e - p)
                if slots is not None:
                    out += slots[p : p + k]
                else:
                    out += zip(repeat(names[h], k), index[p : p + k], strict=False)
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
                if slots is not None:
                    out += slots[p : p + k]
                else:
                    out += zip(repeat(names[h], k), index[p : p + k], strict=False)
                p = pos[h] = p + k
                if p == e:
                    self.has_free.discard(h)
            if i == self.cursor and p == e:
                self.cursor += 1  # hosts before the cursor are full
            i += 1
        self.total -= len(out)
        return out


_NONE: frozenset[int] = frozenset()
_name = attrgetter("name")

_index = itemgetter(1)


# --- step 2: targets ------------------------------------------------------------------------


def _usable(snap: Snapshot) -> tuple[dict[str, int], int]:
    up = {name: n for name, n, state in map(_host_fields, snap.hosts) if state == HostState.UP}
    return up, sum(up.values())


_host_fields = attrgetter("name", "slots", "state")


def _caps(t: _Table, up: dict[str, int], capacity: int) -> np.ndarray:
    """The most workers each job can use: its max, limited by slots on up hosts it does not avoid."""
    usable = np.full(len(t.jobs), capacity, dtype=np.int64)
    for i in np.flatnonzero(np.fromiter(map(bool, t.avoid), bool, len(t.avoid))).tolist():
        usable[i] -= sum(up.get(h, 0) for h in t.avoid[i])
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


def _freeze(t: _Table, held_up, targets, free, snap: Snapshot) -> dict[int, str]:
    """Jobs (among ``free``) that must stay at what they hold, with why (see module docstring)."""
    cfg = snap.config
    cand = free & (held_up > 0) & (targets != held_up) & (held_up <= t.maxs) & (held_up >= t.mins)
    if not cand.any():
        return {}
    shrink = cand & (targets < held_up)
    if cfg.preemption == Preemption.NONE:
        a, b = shrink, np.zeros_like(shrink)
    else:
        a, b = np.zeros_like(shrink), shrink & ~t.preemptible
    rest = cand & ~a & ~b
    with np.errstate(invalid="ignore"):
        c = rest & ~np.isnan(t.last_rescale) & (snap.now - t.last_rescale < cfg.min_rescale_interval_s)
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
        new = _freeze(t, held_up, targets, is_free, snap)
        if not new:
            break
        frozen.update(new)
        is_free[list(new)] = False
    return targets, _reasons(targets, cap_left, free_idx, mins, fcaps, usable, admitted, frozen, held_up)


def _reasons(targets, cap_left, free_idx, mins, fcaps, usable, admitted, frozen, held_up) -> list[str]:
    """Why each job gets its target. Texts are built once per distinct value, not per job."""
    tl = targets.tolist()
    text = {v: f"share {v} of {cap_left}" for v in set(tl)}
    reasons = list(map(text.__getitem__, tl))
    if not admitted.all():
        m_adm = np.where(admitted, mins, 0)
        left = cap_left - (np.cumsum(m_adm) - m_adm)
        for fits, template in (
            (False, "min {} exceeds the {} usable slots it may use"),  # cap < min
            (True, "min {} does not fit: {} slots left after higher-ranked jobs"),  # gang
        ):
            k = np.flatnonzero(~admitted & (usable == fits))
            if len(k) == 0:
                continue
            lo, c = mins[k], (left[k] if fits else np.maximum(fcaps[k], 0))
            width = int(c.max()) + 1
            uniq, inv = np.unique(lo * width + c, return_inverse=True)
            texts = [template.format(u // width, u % width) for u in uniq.tolist()]
            for i, j in zip(free_idx[k].tolist(), inv.reshape(-1).tolist(), strict=True):
                reasons[i] = texts[j]
    for i, why in frozen.items():
        reasons[i] = f"keeps {int(held_up[i])}: {why}"
    return reasons


# --- step 3: placement ----------------------------------------------------------------------


def _keep_all(free: _Free, jobs: np.ndarray, targets: np.ndarray, n: int):
    """For the jobs in ``jobs`` (those that shrink or hold slots on hosts that are not up):
    which held slots to keep (on up hosts, most-used hosts first, then by host name and slot
    index) and which to release. One lexsort over their slots. Returns ``{job: (keep,
    release, host ids of keep)}`` and the number of released slots on up hosts."""
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
    hosts = h[order].tolist()
    n_keep = np.bincount(o[keep], minlength=n)[jobs].tolist()
    bounds = np.searchsorted(o, jobs).tolist() + [len(o)]
    out = {}
    for k, i in enumerate(jobs.tolist()):
        b, m, e = bounds[k], bounds[k] + n_keep[k], bounds[k + 1]
        out[i] = (slots[b:m], slots[m:e], hosts[b:m])
    return out, int((u & ~keep).sum())


# Where the plain per-slot implementation is faster (no numpy call overhead): up to 48 jobs,
# or up to 256 jobs on at most 64 hosts (measured crossovers on the benchmark's snapshots).
# Both give the same plans (tests/pool/test_policy_reference.py).
SMALL_SNAPSHOT_JOBS = 48
SMALL_CLUSTER = (256, 64)  # (jobs, hosts)


def _small(snap: Snapshot) -> bool:
    n = len(snap.jobs)
    return n <= SMALL_SNAPSHOT_JOBS or (n <= SMALL_CLUSTER[0] and len(snap.hosts) <= SMALL_CLUSTER[1])


def make_policy(share: ShareFn, plain: Policy | None = None) -> Policy:
    """The policy for ``share``: the plain implementation ``plain`` for small snapshots (see
    :data:`SMALL_SNAPSHOT_JOBS`), the vectorised one otherwise (or always, without ``plain``)."""

    def decide(snap: Snapshot) -> Plan:
        if plain is not None and _small(snap):
            return plain(snap)
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
    free.expect(int(np.maximum(targets - held_up, 0).sum()))
    tl = targets.tolist()
    need = (targets - t.n_held).tolist()
    moved = (held_up != t.n_held).tolist()
    decisions: list[Decision] = []
    append = decisions.append
    keep_action, grow = TargetAction.KEEP, TargetAction.GROW
    for i, (job, held, target, reason) in enumerate(zip(t.jobs, t.held, tl, reasons, strict=True)):
        if i in kept:
            keep, release, own = kept[i]
            append(_place(job, target, reason, keep, release, own, free, pending, moved[i]))
        elif need[i] <= 0:  # the steady state (holds and keeps it) or a job that waits
            append(make_decision(job.name, target, held, (), keep_action if held else None, reason))
        else:
            new, reason = _grow(job, need[i], len(held), free.held_hosts(i), reason, free, pending)
            action = grow if new else (keep_action if held else None)
            append(make_decision(job.name, target, held + tuple(new) if new else held, (), action, reason))
    return Plan(tuple(decisions))


def _grow(job: Job, need: int, have: int, own: list[int], reason: str, free: _Free, pending: int):
    """The free slots for ``need`` more workers: all of them, or (when no slots are being
    released that could make up the rest) what is free if that reaches the job's minimum."""
    if job.avoid_hosts:
        avoid = free.avoid_ids(job.avoid_hosts)
        avail = free.count_for(avoid)
    else:
        avoid, avail = _NONE, free.total
    if avail >= need:
        return free.take(need, own, avoid), reason
    if pending == 0 and have + avail >= max(job.min_workers, 1):
        return free.take(avail, own, avoid), reason + f"; only {avail} more free"
    return [], reason + f"; waiting for {need - avail} slots to be released"


def _place(job, target, reason, keep, release, own, free: _Free, pending, moved: bool) -> Decision:
    need = target - len(keep)
    if need <= 0 and not release and job.held:
        return make_decision(job.name, target, job.held, (), TargetAction.KEEP, reason)
    new: list[Slot] = []
    if need > 0:
        new, reason = _grow(job, need, len(keep), own, reason, free, pending)
    placements, action, reason = outcome(job, target, keep, new, release, moved, reason)
    return make_decision(job.name, target, placements, tuple(release), action, reason)


_SHARES: dict[str, ShareFn] = {"fairshare": _fair, "priority": _priority, "strict": _strict}
POLICIES: dict[str, Policy] = {name: make_policy(fn, PLAIN[name]) for name, fn in _SHARES.items()}
# The vectorised path at every size (tests and benchmarks compare it with PLAIN).
VECTORISED: dict[str, Policy] = {name: make_policy(fn) for name, fn in _SHARES.items()}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(name, list(POLICIES)) from None


def decide(snapshot: Snapshot, policy: str = "priority") -> Plan:
    """Run the named policy on a snapshot."""
    return get_policy(policy)(snapshot)
