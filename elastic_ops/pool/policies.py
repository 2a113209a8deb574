"""Allocation policies: pure functions from a :class:`Snapshot` to a :class:`Plan`.

The rules a decision applies, and the order of its steps (admit -> share -> freeze -> place),
are in :mod:`elastic_ops.pool.rules`, each written once; this module is their vectorised
implementation, for large snapshots, and the registry of the policies (:data:`POLICIES`). Small
snapshots (:data:`SMALL_CLUSTER`) and snapshots where a restricted job is short on its
hosts while others have room (moves, lowered caps) are decided by the plain per-slot
implementation, :mod:`elastic_ops.pool.plain_policies`; ``tests/pool/test_policy_reference.py``
checks that both give the same plan.

**Representation (why it is fast).** The snapshot is read column by column at C level (one
``map`` per job field, host field, and two over the held slots). Steps 1-2 run on numpy arrays
with one entry per job (ordering by ``lexsort``, admission by cumulative sums, shares by
vectorised water-filling). The free slots are positions in (host name, slot index) order, and
because every take consumes a host's lowest free indices, what is left on a host is a suffix
of its range: a take advances per-host cursors (Python, per host it touches), on the job's own
hosts first, then best fit from a heap of hosts per free count (:class:`_BestFit`); ``goodput``
also moves running jobs onto fewer hosts (:class:`_Mover`, a bounded number of searches per
decision). Keep/release
for shrinking jobs is one sort of their slots. The result is a :class:`Plan` of columns (target,
action, reason per job) and slot arrays -- no slot tuple and no :class:`Decision` is made
while deciding; the plan makes them for the jobs a caller asks about. Cost: O(J log J + H + S)
for J jobs, H hosts and S held slots, with O(J + H + S) of it C-level reads and O(growing jobs
× log H + hosts they touch) interpreted.
"""

from __future__ import annotations

import bisect
import gc
import heapq
from collections.abc import Callable, Sequence
from itertools import chain, compress, repeat
from operator import attrgetter, itemgetter

import numpy as np

from elastic_ops.errors import UnknownPolicyError
from elastic_ops.pool import tenants
from elastic_ops.pool.goodput import Columns, goodput_fill_array, moves_that_pay, with_batches
from elastic_ops.pool.model import (
    HostState,
    Job,
    Plan,
    PlanSlots,
    Preemption,
    Slot,
    Snapshot,
    TargetAction,
)
from elastic_ops.pool.plain_policies import FIRST_FIT, PLAIN
from elastic_ops.pool.rules import (
    CAP_BELOW_MIN,
    FREEZE_RULES,
    GANG_DOES_NOT_FIT,
    MOVING,
    SETTLE_AFTER,
    Change,
    avoided,
    effective_priority,
    keeps_old,
    kept_for_minimum,
    may_freeze,
    order_key,
    too_few,
)
from elastic_ops.pool.shares import strict_fill_array, weighted_fill_array

__all__ = ["POLICIES", "VECTORISED", "decide", "effective_priority", "get_policy", "make_policy", "order_key"]

Policy = Callable[[Snapshot], Plan]
# (mins, caps, priorities, effective priorities, capacity, jobs, snapshot) -> targets, all
# arrays (and the Job objects) over the admitted jobs in rank order.
ShareFn = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, Sequence[Job], Snapshot], np.ndarray]

_host = itemgetter(0)


# --- share functions (step 2) ---------------------------------------------------------------


def _fair(mins, caps, prio, eff, capacity: int, jobs: Sequence[Job], snap: Snapshot) -> np.ndarray:
    return weighted_fill_array(mins, caps, np.ones(len(mins)), capacity)


def _priority(mins, caps, prio, eff, capacity: int, jobs: Sequence[Job], snap: Snapshot) -> np.ndarray:
    return weighted_fill_array(mins, caps, prio, capacity)


def _strict(mins, caps, prio, eff, capacity: int, jobs: Sequence[Job], snap: Snapshot) -> np.ndarray:
    return strict_fill_array(mins, caps, np.floor(eff), capacity)


def _goodput(mins, caps, prio, eff, capacity: int, jobs: Sequence[Job], snap: Snapshot) -> np.ndarray:
    return goodput_fill_array(jobs, mins, caps, capacity, snap, snap.config.rescale_cost_s, prio)


# --- step 1: the job table ------------------------------------------------------------------


def _column(jobs: Sequence[Job], field: str) -> list:
    return list(map(attrgetter(field), jobs))


def _array(jobs: Sequence[Job], field: str, dtype) -> np.ndarray:
    """One field of every job as an array, read at C level (a float ``None`` becomes nan, as
    with ``np.array``). A :class:`Job` keeps its fields in slots: compact, so a pass over
    10,000 jobs reads few cache lines."""
    return np.fromiter(map(attrgetter(field), jobs), dtype, len(jobs))


class _Table:
    """The snapshot's jobs as columns in rank order (see :func:`order_key`): one C-level pass
    per field, no per-job Python code."""

    def __init__(self, snap: Snapshot) -> None:
        jobs = snap.jobs  # snapshot order (a share rule may read more columns)
        n = len(jobs)
        helds = _column(jobs, "held")
        names = _column(jobs, "name")
        avoid = _column(jobs, "avoid_hosts")
        leave = _column(jobs, "leave_hosts")
        hl = np.fromiter(map(len, helds), np.int64, n)
        prio = _array(jobs, "priority", np.float64)
        eff = prio
        aging = snap.config.aging_s
        if aging > 0 and n:
            ws = _array(jobs, "waiting_since", np.float64)  # None -> nan
            waiting = (hl == 0) & ~np.isnan(ws)
            if waiting.any():
                eff = prio.copy()
                eff[waiting] = prio[waiting] + np.floor(np.maximum(0.0, snap.now - ws[waiting]) / aging)
        submitted = _array(jobs, "submitted", np.float64)
        last = _array(jobs, "last_rescale", np.float64)  # None -> nan
        # snapshot order (goodput's Columns)
        self.snapshot_held, self.snapshot_submitted, self.snapshot_last_rescale = hl, submitted, last
        self.cols: Columns  # with the hosts' (with_hosts), before any share rule runs
        order = _rank(-eff, hl == 0, submitted, names)
        ol = order.tolist()
        self.n = n
        self.order = order  # rank -> position in snap.jobs
        self.names: list[str] = list(map(names.__getitem__, ol))
        self.jobs: list[Job] = list(map(snap.jobs.__getitem__, ol))
        self.held: list[tuple[Slot, ...]] = list(map(helds.__getitem__, ol))
        self.has_avoid = np.fromiter(map(bool, avoid), bool, n)[order]
        # The hosts each job avoids, by rank, for the few jobs that avoid any.
        self.avoid: dict[int, frozenset[str]] = {
            i: avoid[ol[i]] for i in np.flatnonzero(self.has_avoid).tolist()
        }
        # ...and the hosts each may hold no slot on (outside its selector), for the few with any.
        self.leave: dict[int, frozenset[str]] = {
            i: leave[ol[i]] for i in np.flatnonzero(np.fromiter(map(bool, leave), bool, n)[order]).tolist()
        }
        # ...and the slots each is releasing (mid-shrink or mid-move), for the few with any.
        going = _column(jobs, "releasing")
        self.releasing: dict[int, frozenset[Slot]] = {}
        if has := list(compress(range(n), going)):  # C-level: most jobs release nothing
            rank = np.empty(n, dtype=np.int64)
            rank[order] = np.arange(n)
            self.releasing = {int(rank[k]): going[k] for k in has}
        self.n_held = hl[order]
        self.prio = prio[order]
        self.eff = eff[order]
        self.mins = _array(jobs, "min_workers", np.int64)[order]
        self.maxs = _array(jobs, "max_workers", np.int64)[order]
        self.preemptible = _array(jobs, "preemptible", bool)[order]
        self.last_rescale = last[order]

    def with_hosts(self, hs: _Hosts) -> None:
        """``cols``: what a share rule may reuse of this table and the hosts (snapshot order)."""
        self.cols = Columns(self.snapshot_held, self.snapshot_submitted, self.snapshot_last_rescale,
                            hs.largest_up)


class _Picked(Sequence[Job]):
    """The jobs at positions ``idx`` of ``jobs``, read only if a share rule asks (most never do:
    a list per freeze round would cost every policy a pass over the admitted jobs)."""

    def __init__(self, jobs: list[Job], idx: np.ndarray, order: np.ndarray, columns: Columns):
        self._jobs, self._idx, self._order = jobs, idx, order
        self.snapshot_columns = columns  # what the policy read of every job (goodput reads more)

    @property
    def snapshot_rows(self) -> np.ndarray:
        """The jobs' positions in the snapshot's jobs (the goodput rule reads its columns so)."""
        return self._order[self._idx]

    def __len__(self) -> int:
        return len(self._idx)

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [self._jobs[i] for i in self._idx[k].tolist()]
        return self._jobs[int(self._idx[k])]

    def __iter__(self):
        return map(self._jobs.__getitem__, self._idx.tolist())


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
    from one pass over the held slots. Host ids number the hosts in name order.

    The free slots are positions ``0..n-1`` in (host name, index) order (``host_of``,
    ``free_index``). The hosts that have free slots are numbered by *rank* in name order; rank
    ``r`` owns positions ``start[r]:end[r]``. Every take consumes a host's lowest free indices,
    so what is left on a host is always a suffix of its range: rank ``r`` has given out
    ``start[r]:pos[r]``. Which host a take goes to is best fit (:class:`_BestFit`). Taking
    slots records positions (:meth:`taken`), never slot tuples (:class:`_Slots` makes those
    on demand)."""

    def __init__(
        self,
        hs: _Hosts,
        helds: list[tuple[Slot, ...]],
        n_held,
        leave: dict[int, frozenset[str]] | None = None,
        spare: frozenset[str] = frozenset(),
    ) -> None:
        self.flat: list[Slot] = list(chain.from_iterable(helds))
        host = self._host_ids(hs)
        names, self.ids, up_size = hs.names, hs.ids, hs.up_size
        self.host = host
        self.first = np.concatenate([[0], np.cumsum(n_held)])  # job i: flat[first[i]:first[i+1]]
        self.index = np.fromiter(map(_index, self.flat), np.int64, len(self.flat))
        self.owner = np.repeat(np.arange(len(helds)), n_held)
        self.host_up = hs.is_up[host]
        # a held slot its job may keep: on an up host it does not have to leave (a slot it must
        # leave is still taken below, until released)
        self.on_up = self.host_up
        if leave:
            self.on_up = self.host_up.copy()
            for i, hosts in leave.items():
                ids = [self.ids[h] for h in hosts if h in self.ids]
                a, b = int(self.first[i]), int(self.first[i + 1])
                if ids and b > a:
                    self.on_up[a:b] &= ~np.isin(host[a:b], ids)
        self.held_up = n_held - np.bincount(self.owner[~self.on_up], minlength=len(helds))
        ok = (self.index >= 0) & (self.index < up_size[host])  # on an up host, within its slots
        self.keepable = self.on_up & ok  # what a frozen job keeps (plain_policies._frozen_on)
        # Free positions run over the hosts in take order: spare hosts first (plain
        # spare_hosts), then by name; ``order[k]``: the host id at place k, ``place`` its inverse.
        order = np.arange(len(names))
        if spare:
            sp = np.zeros(len(names), dtype=bool)
            sp[[self.ids[h] for h in spare]] = True
            order = np.concatenate([np.flatnonzero(sp), np.flatnonzero(~sp)])
        place = np.empty_like(order)
        place[order] = np.arange(len(order))
        size_o = up_size[order]
        off = np.zeros(len(names) + 1, dtype=np.int64)
        np.cumsum(size_o, out=off[1:])
        taken = np.zeros(int(off[-1]), dtype=bool)
        taken[off[place[host[ok]]] + self.index[ok]] = True
        free = np.flatnonzero(~taken)
        at = np.repeat(np.arange(len(names)), size_o)[free]  # place of each free position
        self.host_of = order[at]
        self.free_index = free - off[at]
        self.names = names
        counts = np.bincount(self.host_of, minlength=len(names))
        with_free = order[counts[order] > 0]  # in take order
        self.rank_of = np.full(len(names), -1, dtype=np.int64)  # host id -> rank, -1: nothing free
        self.rank_of[with_free] = np.arange(len(with_free))
        self.rank_host = with_free  # rank -> host id
        ends = np.cumsum(counts[with_free])
        self.pos: list[int] = (ends - counts[with_free]).tolist()  # each rank's next free position
        self.total = len(free)
        # Positions handed out, job after job: arrays, then the runs run_start[i] +
        # range(run_size[i]) that take() handed out since.
        self._parts: list[np.ndarray] = []
        self.run_start: list[int] = []
        self.run_size: list[int] = []
        n_spare = int(len(with_free) and np.count_nonzero(np.isin(with_free, order[: len(spare)])))
        self.packer = _BestFit(counts[with_free].tolist(), n_spare)

    def _flush(self) -> None:
        """Move take()'s runs into ``_parts``."""
        if self.run_start:
            lo = np.array(self.run_start, dtype=np.int64)
            self._parts.append(_ranges(lo, lo + np.array(self.run_size, dtype=np.int64)))
            self.run_start.clear()
            self.run_size.clear()

    def taken(self) -> np.ndarray:
        """Every position handed out, in order."""
        self._flush()
        return np.concatenate(self._parts) if self._parts else np.zeros(0, dtype=np.int64)

    def _host_ids(self, hs: _Hosts) -> np.ndarray:
        """The host id of each held slot (``hs`` gains the hosts it did not list)."""
        names = list(map(_host, self.flat))
        try:
            return _lookup(hs.ids, names)
        except KeyError:  # a slot on a host the snapshot does not list: not up, not free
            hs.extend(set(names))
            return _lookup(hs.ids, names)

    def avoid_ranks(self, avoid: frozenset[str]) -> frozenset[int]:
        if not avoid:
            return _NONE
        ids = [self.ids[h] for h in avoid if h in self.ids]
        return frozenset(r for r in self.rank_of[ids].tolist() if r >= 0)

    def count_for(self, avoid: frozenset[int]) -> int:
        if not avoid:
            return self.total
        count = self.packer.count
        return self.total - sum(count[r] for r in avoid)

    def take(self, n: int, own: list[int], avoid: frozenset[int]) -> None:
        """Hand out ``n`` free positions (see :meth:`taken`): on the ``own`` ranks first (in
        their order; a repeated rank finds nothing left the second time), then best fit,
        skipping ``avoid``; lowest slot indices first on each host. Callers check that
        ``count_for(avoid) >= n``."""
        bf = self.packer
        if not avoid and bf.spare_room <= 0:
            self._take_packed(n, own)
            return
        cnt, pos, starts, sizes, took = bf.count, self.pos, self.run_start, self.run_size, bf.took
        left, mine = n, len(own)
        i = 0
        while left > 0:
            if i < mine:
                r = own[i]
                i += 1
                if r < 0 or not cnt[r] or r in avoid:
                    continue
            else:
                r = bf.best(left, avoid)
                if r < 0:  # callers check count_for(avoid) >= n
                    raise AssertionError(f"{left} fewer free slots than counted")
            k = cnt[r] if cnt[r] < left else left
            starts.append(pos[r])
            sizes.append(k)
            pos[r] += k
            took(r, k)
            left -= k
        if n > 0:
            self.total -= n

    def _take_packed(self, n: int, own: list[int]) -> None:
        """:meth:`take` of one job that avoids nothing, with one tier of hosts."""
        self.take_run([n], own, [0, len(own)], 0, 1)

    def take_run(self, wants: list[int], own: list[int], at_own: list[int], j: int, stop: int) -> None:
        """:meth:`take` for jobs ``j..stop-1`` in turn, job ``k`` taking ``wants[k]`` with its
        own ranks ``own[at_own[k]:at_own[k + 1]]``, none avoiding a host; the callers check that
        all of it is free. Where no spare host has room (one tier of hosts: the common case)
        these are the same takes as :meth:`_BestFit.best` and ``took`` make, inline: a job that
        no host can hold takes whole hosts off the heap of the largest free count, as many as
        leave a rest that one host holds, in one step (no host ever gains free slots, so no
        count above the largest fills again), then the rest best fit. Per job, not per slot:
        this loop is most of a decision's placement time at cluster size."""
        bf = self.packer
        cnt, pos, starts, sizes = bf.count, self.pos, self.run_start, self.run_size
        at, heaps, top = bf.at[1], bf.heaps[1], bf.most
        push, pop = heapq.heappush, heapq.heappop
        total = self.total
        for q in range(j, stop):
            n = wants[q]
            if bf.spare_room > 0:  # two tiers: the general take (spare_room only falls)
                self.total = total
                self.take(n, own[at_own[q] : at_own[q + 1]], _NONE)
                total = self.total
                continue
            left = n
            for i in range(at_own[q], at_own[q + 1]):
                if left <= 0:
                    break
                r = own[i]
                if r < 0:
                    continue
                c = cnt[r]
                if not c:
                    continue
                k = c if c < left else left
                starts.append(pos[r])
                sizes.append(k)
                pos[r] += k
                left -= k
                at[c] -= 1
                c -= k
                cnt[r] = c
                at[c] += 1
                if c:
                    push(heaps[c], r)
            # while no host holds the rest, all of the hosts with the most free, lowest rank first
            # (no host ever gains free slots, so no bucket above ``top`` fills again)
            while left > 0:
                while top and not at[top]:
                    top -= 1
                if left <= top or not top:
                    break
                heap = heaps[top]
                k = (left - 1) // top
                if k > at[top]:
                    k = at[top]
                for _ in range(k):
                    r = pop(heap)
                    while cnt[r] != top:  # stale: it has fewer free since
                        r = pop(heap)
                    starts.append(pos[r])
                    sizes.append(top)
                    pos[r] += top
                    cnt[r] = 0
                at[top] -= k
                at[0] += k
                left -= k * top
            if left > 0:  # the host with the fewest free that holds the rest
                r = c = -1
                for c in range(left, top + 1):
                    if at[c]:
                        heap = heaps[c]
                        while cnt[heap[0]] != c:
                            pop(heap)
                        r = heap[0]
                        break
                if r < 0:  # callers check that it is free
                    raise AssertionError(f"{left} fewer free slots than counted")
                starts.append(pos[r])
                sizes.append(left)
                pos[r] += left
                at[c] -= 1
                c -= left
                cnt[r] = c
                at[c] += 1
                if c:
                    push(heaps[c], r)
            total -= n
        self.total = total

    def avoid_ids(self, avoid: frozenset[str]) -> set[int]:
        """The host ids of the listed hosts among ``avoid``."""
        ids = self.ids
        return {ids[h] for h in avoid if h in ids}


class _BestFit:
    """Free slots per host rank, for best-fit takes (plain_policies._FreeSlots._take_packed):
    the host with the fewest free slots that holds what is still needed; while none does, all
    of the host with the most (lowest rank breaks ties); spare hosts (ranks below ``n_spare``)
    first while one has room. One heap of ranks per (tier, free count), stale entries dropped
    when met, and the number of hosts at each count: a take costs O(log hosts), not a pass
    over the hosts."""

    def __init__(self, count: list[int], n_spare: int) -> None:
        self.count = count
        self.n_spare = n_spare
        self.most = most = max(count, default=0)
        # ranks ascending: each heap starts sorted (one stable sort by tier and count, split)
        key = np.asarray(count, dtype=np.int64)
        key[n_spare:] += most + 1
        ranks = np.argsort(key, kind="stable").tolist()
        cut = np.searchsorted(key[ranks], np.arange(2 * most + 3)).tolist()
        buckets = [ranks[cut[k] : cut[k + 1]] for k in range(2 * most + 2)]
        self.heaps: tuple[list[list[int]], list[list[int]]] = (buckets[: most + 1], buckets[most + 1 :])
        # hosts with exactly c free, per tier (exact, unlike the heaps)
        self.at: tuple[list[int], list[int]] = tuple(list(map(len, h)) for h in self.heaps)  # type: ignore[assignment]
        self.spare_room = n_spare - self.at[0][0]

    def most_free(self) -> int:
        """The most free slots any host has now."""
        return next((c for c in range(self.most, 0, -1) if self.at[0][c] or self.at[1][c]), 0)

    def took(self, r: int, k: int) -> None:
        tier = r >= self.n_spare
        at = self.at[tier]
        c = self.count[r]
        at[c] -= 1
        c -= k
        self.count[r] = c
        at[c] += 1
        if c:
            heapq.heappush(self.heaps[tier][c], r)
        elif not tier:
            self.spare_room -= 1

    def _top(self, heap: list[int], c: int, avoid: frozenset[int]) -> int:
        """The lowest rank in ``heap`` that has ``c`` free and is not avoided (-1: none)."""
        count = self.count
        while count[heap[0]] != c:  # the count says one is there
            heapq.heappop(heap)
        if heap[0] not in avoid:
            return heap[0]
        aside, found = [], -1
        while heap:
            r = heapq.heappop(heap)
            if count[r] != c:
                continue
            aside.append(r)
            if r not in avoid:
                found = r
                break
        for r in aside:
            heapq.heappush(heap, r)
        return found

    def _least_id(self, c: int, excl: set[int], host_of: np.ndarray) -> int:
        """The rank with ``c`` free, not in ``excl``, on the host first in name order (either
        tier: within one, rank order is name order); -1: none."""
        best = -1
        for tier in (0, 1):
            if self.at[tier][c]:
                r = self._top(self.heaps[tier][c], c, excl)  # type: ignore[arg-type]
                if r >= 0 and (best < 0 or host_of[r] < host_of[best]):
                    best = r
        return best

    def fewest_hosts(self, target: int, mine: dict[int, int], own: dict[int, int], excl: set[int],
                     host_of: np.ndarray, rank_of: np.ndarray, total: int) -> list[int]:
        """plain_policies._fewest_hosts: the hosts (ids) ``target`` workers fit on, as few as
        possible, counting free slots outside ``excl`` (ranks: the avoided ones) and ``mine``
        (the job's own per host id; ``own``: their ranks, -1 for none free; ``host_of``: rank ->
        host id, ``rank_of`` its inverse; ``total``: the free slots): best fit, ties to more of
        its own, then name; [] if they do not fit."""
        count = self.count
        room = {h: m + (count[r] if r >= 0 and r not in excl else 0) for h, m in mine.items()
                for r in (own[h],)}
        excl = excl | {r for r in own.values() if r >= 0}
        free_out = total - sum(count[r] for r in excl)
        if free_out + sum(room.values()) < target:
            return []
        chosen: list[int] = []
        left = target
        while left > 0:
            fits = [(c, -mine[h], h) for h, c in room.items() if c >= left and h not in chosen]
            for c in range(left, self.most + 1):
                r = self._least_id(c, excl, host_of)
                if r >= 0:
                    fits.append((c, 0, int(host_of[r])))
                    break
            if fits:
                chosen.append(min(fits)[2])
                return chosen
            most = [(-c, -mine[h], h) for h, c in room.items() if c > 0 and h not in chosen]
            for c in range(min(left, self.most + 1) - 1, 0, -1):
                r = self._least_id(c, excl, host_of)
                if r >= 0:
                    most.append((-c, 0, int(host_of[r])))
                    break
            c, _, h = min(most)
            if h not in room:  # another's host, all of it: it is not offered again
                room[h] = -c
                excl.add(int(rank_of[h]))
            chosen.append(h)
            left -= room[h]
        return chosen

    def hosts_added(self, mine: dict[int, int], own: dict[int, int], n: int) -> int:
        """plain_policies._FreeSlots.free_on_hosts_needed: the hosts beyond ``mine`` a grow by
        ``n`` onto its own hosts, then best fit, would add (counted, nothing taken)."""
        count = self.count
        left = n - sum(count[r] for r in own.values() if r >= 0)
        if left <= 0:
            return 0
        at = [a + b for a, b in zip(self.at[0], self.at[1], strict=True)]
        for r in own.values():
            if r >= 0:
                at[count[r]] -= 1
        if any(at[c] for c in range(min(left, self.most + 1), self.most + 1)):
            return 1
        added = 0
        for c in range(self.most, 0, -1):
            while at[c] and left > 0:
                at[c] -= 1
                left -= c
                added += 1
        return added

    def best(self, need: int, avoid: frozenset[int]) -> int:
        """The rank to take ``need`` more slots from (-1: nothing free outside ``avoid``)."""
        spare = self.spare_room
        if spare and avoid:
            spare -= sum(1 for r in avoid if r < self.n_spare and self.count[r])
        tier = 0 if spare > 0 else 1
        at, heaps, most, count = self.at[tier], self.heaps[tier], self.most, self.count
        first = need if need <= most else most + 1
        for c in range(first, most + 1):  # the fewest that hold it all
            if at[c]:
                heap = heaps[c]
                if count[heap[0]] == c and heap[0] not in avoid:  # the usual case, inline
                    return heap[0]
                r = self._top(heap, c, avoid)
                if r >= 0:
                    return r
        for c in range(first - 1, 0, -1):  # else the most
            if at[c]:
                r = self._top(heaps[c], c, avoid)
                if r >= 0:
                    return r
        return -1


# Searches for fewer hosts (moves of running jobs) one vectorised decision makes at most, in
# rank order: each is a walk over the free counts in Python, and a move restarts the job; what
# is left waits for the next decision (the plain path, for small snapshots, searches for every
# job). Only jobs a move could pay for are searched, and for a move onto one host only those a
# host can hold whole (checked for all candidates at once).
MOVE_SEARCHES = 32


class _Mover:
    """Moves of running jobs onto fewer hosts (``goodput``'s: plain_policies._defragment and
    _repack) on the vectorised plan's arrays: job ``i`` keeps its slots on the chosen hosts
    (first in its segment of ``perm``), releases the others and takes free ones there."""

    def __init__(self, t: _Table, free: _Free, perm: np.ndarray, n_keep: np.ndarray, snap: Snapshot):
        self.t, self.free, self.perm, self.n_keep, self.snap = t, free, perm, n_keep, snap
        self.searches = MOVE_SEARCHES
        self._ranks: list[int] | None = None  # free.rank_of as a list, once a search needs it

    def mine(self, i: int) -> tuple[dict[int, int], dict[int, int]]:
        """Job ``i``'s kept slots per host id, and those hosts' ranks."""
        a = int(self.free.first[i])
        mine: dict[int, int] = {}
        for h in self.free.host[self.perm[a : a + int(self.n_keep[i])]].tolist():
            mine[h] = mine.get(h, 0) + 1
        if self._ranks is None:
            self._ranks = self.free.rank_of.tolist()
        return mine, {h: self._ranks[h] for h in mine}

    def fewest(self, i: int, target: int, mine: dict[int, int], own: dict[int, int]) -> list[int]:
        if self.searches <= 0:
            return []
        self.searches -= 1
        free = self.free
        avoid = set(free.avoid_ranks(self.t.avoid.get(i, _NO_HOSTS)))
        return free.packer.fewest_hosts(target, mine, own, avoid, free.rank_host, free.rank_of, free.total)

    def move(self, i: int, target: int, chosen: list[int], mine: dict[int, int]) -> int:
        """plain_policies._move; returns the slots it releases."""
        free, perm = self.free, self.perm
        a, e, k = int(free.first[i]), int(free.first[i + 1]), int(self.n_keep[i])
        kept, gone = perm[a : a + k].copy(), perm[a + k : e].copy()
        on = set(chosen)  # (a job's few slots: a set beats np.isin's machinery)
        stay = np.fromiter(map(on.__contains__, free.host[kept].tolist()), bool, len(kept))
        perm[a:e] = np.concatenate([kept[stay], gone, kept[~stay]])
        self.n_keep[i] = int(stay.sum())
        ranks = [int(free.rank_of[h]) for h in sorted(chosen, key=lambda h: -mine.get(h, 0))]
        free.take(target - int(self.n_keep[i]), ranks, free.avoid_ranks(self.t.avoid.get(i, _NO_HOSTS)))
        return int((~stay).sum())

    def repack(self, i: int, target: int) -> int | None:
        """plain_policies._repack for growing job ``i``: the new slots it took, or None (it did
        not move)."""
        if self.searches <= 0:
            return None
        mine, own = self.mine(i)
        chosen = self.fewest(i, target, mine, own)
        if not chosen:
            return None
        grow = target - int(self.n_keep[i])
        now = len(mine) + (self.free.packer.hosts_added(mine, own, grow) if grow > 0 else 0)
        if len(chosen) >= now:
            return None
        self.move(i, target, chosen, mine)
        return target - int(self.n_keep[i])

    def defragment(self, candidates: np.ndarray, targets: np.ndarray, n_new: np.ndarray,
                   reasons: list[str]) -> int:
        """plain_policies._defragment for ``candidates`` (rank order): a job that keeps its
        target on more hosts than it needs moves when its model says the spread costs more than
        the move. Returns the slots released."""
        t, snap, released, free = self.t, self.snap, 0, self.free
        restarts = self.n_keep[candidates] < t.n_held[candidates]
        ok = restarts | _movable(t, candidates, snap)
        candidates, restarts = candidates[ok], restarts[ok]
        if len(candidates) == 0:
            return 0
        # hosts each keeps slots on; then, all at once, whether any move could pay back its cost
        a = free.first[candidates]
        kept = self.n_keep[candidates]
        owner = np.repeat(np.arange(len(candidates)), kept)
        hosts = free.host[self.perm[_ranges(a, a + kept)]]
        span = len(free.names) + 1
        keys = np.sort(owner * span + hosts)
        first = np.ones(len(keys), dtype=bool)
        np.not_equal(keys[1:], keys[:-1], out=first[1:])
        pairs = keys[first]
        job = pairs // span
        spans = np.bincount(job, minlength=len(candidates))
        cost = np.where(restarts, 0.0, snap.config.rescale_cost_s)
        target = targets[candidates]
        pays, at, least = moves_that_pay(snap, t.order[candidates], target, spans, cost)
        # a move onto one host needs a host that holds the whole job: one of its own (what it
        # keeps there and what is free there) or the host with the most free (avoided hosts not
        # counted out: this only saves searches that cannot succeed)
        one = np.flatnonzero(least == 1)
        if len(one):
            count = np.asarray(free.packer.count, dtype=np.int64)
            rank = free.rank_of[pairs % span]
            mine = np.diff(np.append(np.flatnonzero(first), len(keys)))
            room = mine.copy()
            has = rank >= 0
            room[has] += count[rank[has]]
            most = np.full(len(candidates), free.packer.most_free(), dtype=np.int64)
            on = spans > 0
            most[on] = np.maximum(most[on], np.maximum.reduceat(room, (np.cumsum(spans) - spans)[on]))
            pays[at[one]] &= most[one] >= target[one]
        # a search only for a job that some move could pay for (onto fewer hosts than it spans)
        may = np.logical_or.reduceat(pays, at) if len(pays) else np.zeros(0, bool)
        for k in np.flatnonzero(may).tolist():
            if self.searches <= 0:
                break
            i = int(candidates[k])
            target = int(targets[i])
            mine, own = self.mine(i)
            chosen = self.fewest(i, target, mine, own)
            if chosen and len(chosen) < len(mine) and pays[at[k] + len(chosen) - least[k]]:
                released += self.move(i, target, chosen, mine)
                n_new[i] = target - int(self.n_keep[i])
                reasons[i] += "; moved onto fewer hosts"
        return released


def _movable(t: _Table, jobs: np.ndarray, snap: Snapshot) -> np.ndarray:
    """plain_policies._movable for the jobs (ranks) ``jobs``."""
    cfg = snap.config
    if cfg.preemption != Preemption.GRACEFUL:
        return np.zeros(len(jobs), dtype=bool)
    last = t.last_rescale[jobs]
    with np.errstate(invalid="ignore"):
        return t.preemptible[jobs] & (np.isnan(last) | (snap.now - last >= cfg.min_rescale_interval_s))


def _lookup(d: dict, keys: list) -> np.ndarray:
    """``[d[k] for k in keys]`` as an int64 array. One ``itemgetter(*keys)`` call does every
    lookup in C, which costs less than calling ``d.__getitem__`` once per key through ``map``
    (about 3.5 vs 5 ms for the 47,121 held slots of the benchmark's largest snapshot)."""
    if len(keys) < 2:  # itemgetter needs a key, and with one it returns the value, not a tuple
        return np.array([d[k] for k in keys], dtype=np.int64)
    return np.fromiter(itemgetter(*keys)(d), np.int64, len(keys))


_NONE: frozenset[int] = frozenset()
_NO_HOSTS: frozenset[str] = frozenset()
_name = attrgetter("name")

_index = itemgetter(1)


# --- step 2: targets ------------------------------------------------------------------------


class _Hosts:
    """The snapshot's hosts in name order: ``names``, ``ids`` (name -> id), ``is_up`` and
    ``up_size`` (slots of an ``up`` host, 0 for any other), read at C level; ``capacity`` = up
    slots."""

    def __init__(self, snap: Snapshot) -> None:
        hosts = snap.hosts
        names = list(map(_name, hosts))
        size = np.fromiter(map(_slots, hosts), np.int64, len(hosts))
        up = np.fromiter(map(_UP, map(_state, hosts)), bool, len(hosts))
        self.largest_up = int(size[up].max()) if up.any() else 1  # goodput.host_slots
        by_name = sorted(names)
        if by_name != names:
            order = np.array(sorted(range(len(names)), key=names.__getitem__), dtype=np.int64)
            size, up = size[order], up[order]
        self.names = by_name
        self.ids = dict(zip(by_name, range(len(by_name)), strict=True))
        if len(self.ids) < len(by_name):  # a host listed twice: the last up entry counts (plain)
            up_slots = dict(
                compress(zip(names, map(_slots, hosts), strict=True), map(_UP, map(_state, hosts)))
            )
            self.names = sorted(self.ids)
            self.ids = dict(zip(self.names, range(len(self.names)), strict=True))
            self.up_size = np.fromiter(map(up_slots.get, self.names, repeat(0)), np.int64, len(self.names))
            self.is_up = np.fromiter(map(up_slots.__contains__, self.names), bool, len(self.names))
        else:
            self.up_size = np.where(up, size, 0)
            self.is_up = up
        self.capacity = int(self.up_size.sum())

    def extend(self, more: set[str]) -> None:
        """Add hosts the snapshot does not list (a held slot's): not up, nothing free."""
        old, up_size, is_up = self.ids, self.up_size, self.is_up
        self.names = sorted(set(self.names) | more)
        self.ids = dict(zip(self.names, range(len(self.names)), strict=True))
        known = np.fromiter(map(old.__contains__, self.names), bool, len(self.names))
        self.up_size = np.zeros(len(self.names), dtype=np.int64)
        self.up_size[known] = up_size  # both in name order
        self.is_up = np.zeros(len(self.names), dtype=bool)
        self.is_up[known] = is_up

    def up_slots(self, sets: list[frozenset[str]]) -> np.ndarray:
        """Slots on the ``up`` hosts among each set of host names (unlisted names count 0)."""
        if not sets:
            return np.zeros(0, dtype=np.int64)
        names = list(chain.from_iterable(sets))
        ids = np.fromiter(map(self.ids.get, names, repeat(-1)), np.int64, len(names))
        size = np.zeros(len(ids), dtype=np.int64)
        size[ids >= 0] = self.up_size[ids[ids >= 0]]
        owner = np.repeat(np.arange(len(sets)), np.fromiter(map(len, sets), np.int64, len(sets)))
        return np.bincount(owner, weights=size, minlength=len(sets)).astype(np.int64)


_slots, _state, _UP = attrgetter("slots"), attrgetter("state"), HostState.UP.__eq__


def _caps(t: _Table, hs: _Hosts, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """The most workers each job can use: its max, limited by slots on up hosts it does not
    avoid. Also returns those avoided slots per job."""
    avoided = np.zeros(t.n, dtype=np.int64)
    if t.avoid:
        avoided[list(t.avoid)] = hs.up_slots(list(t.avoid.values()))
    return np.minimum(t.maxs, capacity - avoided), avoided


def _restricted(t: _Table, hs: _Hosts) -> list[int]:
    """The jobs (ranks, ascending) that avoid an up host (plain_policies.restricted)."""
    ids, up = hs.ids, hs.is_up
    return [i for i, hosts in sorted(t.avoid.items()) if any(h in ids and up[ids[h]] for h in hosts)]


def _spare(t: _Table, hs: _Hosts, restricted: list[int]) -> frozenset[str]:
    """plain_policies.spare_hosts: the up hosts every restricted job avoids."""
    out: set[str] | None = None
    ids, up = hs.ids, hs.is_up
    for i in restricted:
        hosts = t.avoid[i]
        out = {h for h in hosts if h in ids and up[ids[h]]} if out is None else out & hosts
        if not out:
            return frozenset()
    return frozenset(out or ())


def _frozen_caps(t, hs, free, caps0, avoided, capacity, restricted, is_free) -> np.ndarray:
    """A restricted job's cap less what frozen jobs keep on the up hosts it may use
    (plain_policies._cap)."""
    fz = ~is_free[free.owner] & free.keepable
    if not restricted or not fz.any():
        return caps0
    per_host = np.bincount(free.host[fz], minlength=len(hs.names))
    total = int(per_host.sum())
    caps = caps0.copy()
    ids = hs.ids
    kept_on: dict[frozenset[str], int] = {}  # per avoid set (jobs of one selector share it)
    for i in restricted:
        avoid = t.avoid[i]
        on_avoided = kept_on.get(avoid)
        if on_avoided is None:
            on_avoided = kept_on[avoid] = sum(int(per_host[ids[h]]) for h in avoid if h in ids)
        caps[i] = min(int(t.maxs[i]), capacity - int(avoided[i]) - (total - on_avoided))
    return caps


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


def _freeze(t: _Table, held_up, targets, free, snap: Snapshot, flags=(False, False)) -> dict[int, str]:
    """Jobs (among ``free``) that must stay at what they hold, with why:
    :data:`elastic_ops.pool.rules.FREEZE_RULES` on all of them at once (first rule that holds).
    ``flags``: per job, its tenant's (reclaims, over its max) columns (no tenants: False)."""
    cfg, now = snap.config, snap.now
    reclaims, over = flags
    cand = free & may_freeze(Change(held_up, targets, None, None, None, None, over), t.mins, t.maxs)
    if not cand.any():
        return {}
    admitting = free & (held_up == 0) & (targets > 0)
    c = Change(held_up, targets, ~t.preemptible, t.last_rescale, (np.cumsum(admitting) - admitting) > 0,
               reclaims, over)
    out: dict[int, str] = {}
    left = cand
    reclaims, over = (np.broadcast_to(x, held_up.shape) for x in flags)  # one job's, below
    with np.errstate(invalid="ignore", divide="ignore"):  # rows outside ``cand`` may hold 0
        for rule in FREEZE_RULES:
            hit = left & rule.holds(c, cfg, now)
            if not hit.any():
                continue
            left = left & ~hit
            for i in np.flatnonzero(hit).tolist():
                one = Change(int(held_up[i]), int(targets[i]), bool(c.pinned[i]), float(t.last_rescale[i]),
                             bool(c.admitted_above[i]), bool(reclaims[i]), bool(over[i]))
                out[i] = rule.text(one, cfg, now)
    return out


def _targets(t: _Table, share: ShareFn, held_up, hs: _Hosts, snap: Snapshot, free: _Free, restricted):
    capacity = hs.capacity
    t.with_hosts(hs)
    caps0, avoided = _caps(t, hs, capacity)
    n = t.n
    tt = tenants.of_snapshot(snap, _column(snap.jobs, "tenant"), capacity) if snap.tenants else None
    held_t = None
    flags: tuple = (False, False)
    if tt is not None:
        tt.ids = tt.ids[t.order]  # rank order
        held_t = tt.per_tenant(tt.ids, held_up)
        wants = np.where(caps0 >= t.mins, np.maximum(caps0, held_up), held_up)
        tt.flags(held_t, tt.per_tenant(tt.ids, wants))
        flags = (tt.reclaims[tt.ids], tt.over[tt.ids])
    # what a frozen job keeps: down to its max (see plain_policies._targets)
    held_up = np.minimum(held_up, t.maxs)
    frozen: dict[int, str] = {}
    is_free = np.ones(n, dtype=bool)
    # a fixed point, a long chain of freezes cut after SETTLE_AFTER rounds (elastic_ops.pool.rules)
    for rnd in range(SETTLE_AFTER + 1):
        if rnd == SETTLE_AFTER:
            hard = _freeze(t, held_up, np.where(is_free, 0, held_up), is_free, snap, flags)
            frozen.update(hard)
            is_free[list(hard)] = False
        free_idx = np.flatnonzero(is_free)
        cap_left = capacity - int(held_up[~is_free].sum())
        caps = _frozen_caps(t, hs, free, caps0, avoided, capacity, restricted, is_free)
        mins, fcaps = t.mins[free_idx], caps[free_idx]
        targets = held_up.copy()  # frozen jobs keep what they hold
        targets[free_idx] = 0
        if tt is None:
            usable, admitted = _admit(mins, fcaps, cap_left)
            a = free_idx[admitted]
            jobs = _Picked(t.jobs, a, t.order, t.cols)
            targets[a] = share(mins[admitted], fcaps[admitted], t.prio[a], t.eff[a], cap_left, jobs, snap)
            given = None
        else:
            usable, admitted, given, parts = _tenant_round(t, tt, share, snap, targets, free_idx, mins, fcaps,
                                                           held_up, is_free, capacity, caps)
        new = _freeze(t, held_up, targets, is_free, snap, flags)
        if not new or rnd == SETTLE_AFTER:
            break
        frozen.update(new)
        is_free[list(new)] = False
    reasons = _reasons(targets, cap_left, free_idx, mins, fcaps, usable, admitted, frozen, held_up, given,
                       None if tt is None else tt.ids[free_idx])
    if caps is not caps0:  # frozen jobs keep slots on restricted jobs' hosts
        for i in free_idx[~usable & (caps0[free_idx] >= mins)].tolist():
            reasons[i] = too_few(int(t.mins[i]), int(caps[i]), int(caps0[i]))
    if tt is not None:
        demand = tt.per_tenant(tt.ids, np.where(is_free, np.where(caps >= t.mins, np.maximum(caps, 0), 0),
                                                held_up))
        sfx = tenants.texts(tt, parts, held_t, demand, capacity)
        reasons = list(map(str.__add__, reasons, map(sfx.__getitem__, tt.ids.tolist())))
    return targets, reasons


def _tenant_round(t: _Table, tt, share: ShareFn, snap: Snapshot, targets, free_idx, mins, fcaps, held_up,
                  is_free, capacity: int, caps):
    """Admission and share per tenant, on the parts :func:`tenants.divide_among` gives them
    (plain_policies._tenant_round). Fills ``targets`` of the free jobs; returns the admission
    masks (over ``free_idx``), the capacity each free job's tenant gave its free jobs, and the
    parts."""
    tid = tt.ids[free_idx]
    order = np.argsort(tid, kind="stable")  # rank order within each tenant
    cut = np.searchsorted(tid[order], np.arange(len(tt) + 1))
    groups = {k: order[cut[k]:cut[k + 1]] for k in range(len(tt)) if cut[k + 1] > cut[k]}
    kept = tt.per_tenant(tt.ids[~is_free], held_up[~is_free])
    demand = kept + tt.per_tenant(tid, np.where(fcaps >= mins, np.maximum(fcaps, 0), 0))
    usable = np.zeros(len(free_idx), dtype=bool)
    admitted = np.zeros(len(free_idx), dtype=bool)

    def run(k: int, cap: int) -> int:
        g = groups[k]
        u, ad = _admit(mins[g], fcaps[g], cap)
        usable[g], admitted[g] = u, ad
        targets[free_idx[g]] = 0
        a = free_idx[g[ad]]
        jobs = _Picked(t.jobs, a, t.order, t.cols)
        got = share(mins[g[ad]], fcaps[g[ad]], t.prio[a], t.eff[a], cap, jobs, snap)
        targets[a] = got
        return int(np.sum(got))

    # what jobs held back by min_rescale_interval_s take once they may (plain_policies)
    with np.errstate(invalid="ignore"):
        recent = ~is_free & (snap.now - t.last_rescale < snap.config.min_rescale_interval_s)
    held_back = tt.per_tenant(tt.ids[recent], np.maximum(caps[recent] - held_up[recent], 0))
    parts, given = tenants.divide_among(tt, demand, kept, capacity, groups, run, held_back)
    per = np.zeros(len(tt), dtype=np.int64)
    per[list(given)] = list(given.values())
    return usable, admitted, per[tid], parts


def _reasons(targets, cap_left, free_idx, mins, fcaps, usable, admitted, frozen, held_up, given=None,
             tid=None) -> list[str]:
    """Why each job gets its target (see plain_policies.too_few for a job whose cap frozen jobs
    lowered). Texts are built once per distinct value, not per job. ``given``: with tenants, the
    capacity each free job's tenant shared (``tid``: its tenant), in place of ``cap_left``."""
    tl = targets.tolist()
    if given is None:
        text = {v: f"share {v} of {cap_left}" for v in set(tl)}
        reasons = list(map(text.__getitem__, tl))
    else:
        of = np.zeros(len(targets), dtype=np.int64)
        of[free_idx] = given
        width = int(of.max(initial=0)) + 1
        uniq, inv = np.unique(targets * width + of, return_inverse=True)
        texts = [f"share {u // width} of {u % width}" for u in uniq.tolist()]
        reasons = list(map(texts.__getitem__, inv.reshape(-1).tolist()))
    if not admitted.all():
        m_adm = np.where(admitted, mins, 0)
        if given is None:
            left = cap_left - (np.cumsum(m_adm) - m_adm)
        else:  # what higher-ranked jobs of its own tenant left of its tenant's part
            order = np.argsort(tid, kind="stable")
            cum = np.cumsum(m_adm[order])
            starts = np.searchsorted(tid[order], tid[order])
            before = cum - m_adm[order] - np.where(starts > 0, cum[starts - 1], 0)
            left = np.empty(len(tid), dtype=np.int64)
            left[order] = given[order] - before
        for fits, rule in ((False, CAP_BELOW_MIN), (True, GANG_DOES_NOT_FIT)):
            k = np.flatnonzero(~admitted & (usable == fits))
            if len(k) == 0:
                continue
            lo, c = mins[k], (left[k] if fits else np.maximum(fcaps[k], 0))
            if int(c.min()) < 0:  # frozen jobs keep more than the capacity (slots past a host's size)
                for i, m, v in zip(free_idx[k].tolist(), lo.tolist(), c.tolist(), strict=True):
                    reasons[i] = rule.why(m, v)
                continue
            width = int(c.max()) + 1
            uniq, inv = np.unique(lo * width + c, return_inverse=True)
            texts = [rule.why(u // width, u % width) for u in uniq.tolist()]
            for i, j in zip(free_idx[k].tolist(), inv.reshape(-1).tolist(), strict=True):
                reasons[i] = texts[j]
    for i, why in frozen.items():
        reasons[i] = f"keeps {int(held_up[i])}: {why}"
    return reasons


# --- step 3: placement ----------------------------------------------------------------------


def _keep(free: _Free, jobs: np.ndarray, targets: np.ndarray, n_held: np.ndarray, releasing=None):
    """For the jobs in ``jobs`` (those that shrink or hold slots they cannot keep: on hosts that
    are not up, or outside their selector): which held slots to keep (on up hosts they may use,
    slots not in ``releasing`` (per job) first, most-used hosts first, then by host name and
    slot index: plain_policies._keep) and which to release, by one sort over their slots.
    Returns ``perm`` (the held slots' positions in ``free.flat``, each job's kept ones first, in
    the order it keeps them, then its released ones; the identity for every other job),
    ``n_keep`` per job and the released slots on up hosts, per host id."""
    n = len(n_held)
    perm = np.arange(len(free.flat))
    n_keep = n_held.copy()
    if len(jobs) == 0:
        return perm, n_keep, np.zeros(len(free.names), dtype=np.int64)
    pick = np.zeros(n, dtype=bool)
    pick[jobs] = True
    sel = np.flatnonzero(pick[free.owner])
    o, h, x, u = free.owner[sel], free.host[sel], free.index[sel], free.on_up[sel]
    r = np.zeros(len(sel), dtype=bool)
    for i, going in (releasing or {}).items():
        if pick[i]:
            a, b = int(free.first[i]), int(free.first[i + 1])
            r[np.searchsorted(sel, a) : np.searchsorted(sel, b)] = [sl in going for sl in free.flat[a:b]]
    order = _keep_order(o, h, x, u, r)
    o, u, hu, hh = o[order], u[order], free.host_up[sel][order], h[order]
    start = np.searchsorted(o, o, side="left")
    keep = u & (np.arange(len(o)) - start < targets[o])
    # ``sel`` is grouped by job in rank order and so is ``order`` (job is its first key): each
    # job's block of positions is permuted in place.
    perm[sel] = sel[order]
    n_keep[jobs] = np.bincount(o[keep], minlength=n)[jobs]
    return perm, n_keep, np.bincount(hh[hu & ~keep], minlength=len(free.names))


def _ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``concatenate([arange(a, b) for a, b in zip(lo, hi)])``, vectorised."""
    sizes = hi - lo
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    return np.arange(total) + np.repeat(lo - starts, sizes)


def _keep_order(o: np.ndarray, h: np.ndarray, x: np.ndarray, u: np.ndarray, r: np.ndarray) -> np.ndarray:
    """The stable order of slots by (job ``o``, up hosts ``u`` first, slots not being released
    ``r`` first, most of the job's slots on the host first, host ``h``, index ``x``). The keys
    are packed into one int64 and sorted once when they fit (they do unless hosts hold millions
    of slots); else a lexsort."""
    if len(o) == 0:
        return np.zeros(0, dtype=np.int64)
    hosts = int(h.max()) + 1
    pair = o * hosts + h
    by_pair = np.argsort(pair, kind="stable")
    sp = pair[by_pair]
    starts = np.flatnonzero(np.concatenate([[True], sp[1:] != sp[:-1]]))
    sizes = np.diff(np.append(starts, len(sp)))
    cnt = np.empty_like(o)
    cnt[by_pair] = np.repeat(sizes, sizes)  # slots the job holds on the slot's host
    xs = x - int(x.min())
    widths = [int(v).bit_length() for v in (o.max(), 1, 1, cnt.max(), hosts - 1, xs.max())]
    if sum(widths) > 62:
        return np.lexsort((x, h, -cnt, r, ~u, o))
    key = o.copy()
    for field, width in zip((~u, r, int(cnt.max()) - cnt, h, xs), widths[1:], strict=True):
        key <<= width
        key |= field
    return np.argsort(key, kind="stable")


def _host_range(host: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The least and the largest of each run of ``host`` (runs of ``sizes``; -1, -1 for an
    empty run)."""
    lo, hi = np.full(len(sizes), -1), np.full(len(sizes), -1)
    has = np.flatnonzero(sizes > 0)
    if len(has):
        at = (np.cumsum(sizes) - sizes)[has]
        lo[has], hi[has] = np.minimum.reduceat(host, at), np.maximum.reduceat(host, at)
    return lo, hi


class _Slots(PlanSlots):
    """The vectorised plan's slots: job ``k`` keeps ``flat[perm[first[k]:first[k] + kept[k]]]``
    and releases the rest of ``flat[perm[first[k]:first[k + 1]]]``; it is given the free slots
    at ``taken[new_at[k]:new_at[k + 1]]``. Slot tuples are made only when asked for."""

    def __init__(self, held: list[tuple[Slot, ...]], free: _Free, perm, n_keep, n_new, order) -> None:
        self.snapshot_rows = order  # each plan position's job in snap.jobs (goodput.with_batches)
        self._held, self._flat, self._names = held, free.flat, free.names
        self._perm, self._first, self._kept = perm, free.first, n_keep
        self._new_at = np.concatenate([[0], np.cumsum(n_new)])
        self._taken = free.taken()
        self._host_of, self._index = free.host_of, free.free_index
        self._held_host = free.host
        self._changed = (n_new > 0) | (n_keep < self._first[1:] - self._first[:-1])

    def spans_hosts(self, ks: np.ndarray) -> np.ndarray:
        """Whether the placements of each job ``ks`` lie on more than one host, from the host ids
        (no slot tuples made; what the adaptive jobs' batches are chosen on, see
        goodput.with_batches). A job with no placements: False."""
        if len(ks) == 0:
            return np.zeros(0, dtype=bool)
        a = self._first[ks]
        lo, hi = self._new_at[ks], self._new_at[ks + 1]
        kept = _host_range(self._held_host[self._perm[_ranges(a, a + self._kept[ks])]], self._kept[ks])
        new = _host_range(self._host_of[self._taken[_ranges(lo, hi)]], hi - lo)
        both = (kept[0] >= 0) & (new[0] >= 0)
        return (kept[0] != kept[1]) | (new[0] != new[1]) | (both & (kept[0] != new[0]))

    def changed(self) -> list[int]:
        return np.flatnonzero(self._changed).tolist()

    def _bounds(self, k: int) -> tuple[int, int, int]:
        a = int(self._first[k])
        return a, a + int(self._kept[k]), int(self._first[k + 1])

    def placements(self, k: int) -> tuple[Slot, ...]:
        if not self._changed[k]:
            return self._held[k]
        a, m, _ = self._bounds(k)
        kept = tuple(map(self._flat.__getitem__, self._perm[a:m].tolist()))
        return kept + self.new(k)

    def release(self, k: int) -> tuple[Slot, ...]:
        _, m, e = self._bounds(k)
        return tuple(map(self._flat.__getitem__, self._perm[m:e].tolist())) if m < e else ()

    def changed_placements(self) -> dict[int, tuple[Slot, ...]]:
        """Every changed job's placements, with every slot tuple made in one C-level pass
        (kept ones are the snapshot's own tuples) and cut per job."""
        ks = np.flatnonzero(self._changed)
        if len(ks) == 0:
            return {}
        a, e = self._first[ks], self._first[ks] + self._kept[ks]
        kept_at = self._perm[_ranges(a, e)].tolist()
        kept = list(map(self._flat.__getitem__, kept_at))
        lo, hi = self._new_at[ks], self._new_at[ks + 1]
        at = self._taken[_ranges(lo, hi)]
        new = list(
            zip(
                map(self._names.__getitem__, self._host_of[at].tolist()),
                self._index[at].tolist(),
                strict=True,
            )
        )
        kb = np.concatenate([[0], np.cumsum(e - a)]).tolist()
        nb = np.concatenate([[0], np.cumsum(hi - lo)]).tolist()
        return {k: tuple(kept[kb[i] : kb[i + 1]] + new[nb[i] : nb[i + 1]]) for i, k in enumerate(ks.tolist())}

    def new(self, k: int) -> tuple[Slot, ...]:
        at = self._taken[self._new_at[k] : self._new_at[k + 1]]
        if len(at) == 0:
            return ()
        hosts = map(self._names.__getitem__, self._host_of[at].tolist())
        return tuple(zip(hosts, self._index[at].tolist(), strict=True))


# Where the plain per-slot implementation is faster (no numpy call overhead): up to 256 jobs on
# at most 64 hosts (measured crossovers on the benchmark's snapshots; its best fit is a pass
# over the hosts per job: 48 jobs on 12,500 hosts took 0.5 s). Both give the same plans
# (tests/pool/test_policy_reference.py).
SMALL_CLUSTER = (256, 64)  # (jobs, hosts)


def _small(snap: Snapshot) -> bool:
    return len(snap.jobs) <= SMALL_CLUSTER[0] and len(snap.hosts) <= SMALL_CLUSTER[1]


def make_policy(
    share: ShareFn, plain: Policy | None = None, repair: Policy | None = None, moves: bool = False,
) -> Policy:
    """The policy for ``share``: the plain implementation ``plain`` for small snapshots (see
    :data:`SMALL_CLUSTER`), the vectorised one otherwise (or always, without ``plain``).
    ``repair`` (default ``plain``): the plain implementation, which decides the snapshots where a
    restricted job is short on its hosts while others have room (moves, lowered caps: see
    plain_policies._host_repair); the vectorised path hands those over whole. New slots go best
    fit; ``moves``: running jobs are moved onto fewer hosts too (as plain_policies.make_policy)."""
    repair = repair or plain

    def decide(snap: Snapshot) -> Plan:
        if plain is not None and _small(snap):
            return plain(snap)
        # A decision allocates O(jobs + changed slots) short-lived objects that refcounting
        # frees, no cycles. Left on, the cyclic collector would walk the whole snapshot (every
        # held slot) several times per decision at 10,000 jobs for no garbage: pause it for the
        # call (restored on return or error; left alone if the caller had disabled it).
        if not gc.isenabled():
            return _decide_or_repair(snap, share, repair, moves)
        gc.disable()
        try:
            return _decide_or_repair(snap, share, repair, moves)
        finally:
            gc.enable()

    return decide


def _decide_or_repair(
    snap: Snapshot, share: ShareFn, repair: Policy | None, moves: bool = False
) -> Plan:
    try:
        return _decide(snap, share, moves)
    except _HostsNeeded:
        if repair is None:
            raise
        return repair(snap)


def _decide(snap: Snapshot, share: ShareFn, moves: bool = False) -> Plan:
    t = _Table(snap)
    hs = _Hosts(snap)
    if t.avoid:
        _honoured_avoids(t, hs)
    restricted = _restricted(t, hs) if t.avoid else []
    free = _Free(hs, t.held, t.n_held, t.leave, _spare(t, hs, restricted))
    held_up = free.held_up
    targets, reasons = _targets(t, share, held_up, hs, snap, free, restricted)
    # Jobs that keep all they hold (on up hosts) need no sorting; the others keep part.
    simple = (held_up == t.n_held) & (targets >= held_up)
    perm, n_keep, released_on = _keep(free, np.flatnonzero(~simple), targets, t.n_held, t.releasing)
    pending = int(released_on.sum())
    n_new = np.zeros(t.n, dtype=np.int64)
    growing = np.flatnonzero(targets > n_keep)
    first = np.zeros(t.n, dtype=bool)
    first[restricted] = True
    g1, g2 = growing[first[growing]], growing[~first[growing]]
    mover = _Mover(t, free, perm, n_keep, snap) if moves else None
    # restricted jobs first (rank order), then (packing) moves onto fewer hosts, then the others
    # (rank order): see plain_policies._place_all. Each step's positions, put back in rank order
    # at the end.
    parts, labels = [], []
    if len(g1):
        need = targets - n_keep
        _take_restricted(t, free, g1, need[g1], perm, n_keep, n_new, reasons, pending, released_on)
        parts.append(free.taken())
        labels.append(g1)
        free._parts = []
    if mover is not None:
        spread = _spread(free, perm, n_keep)
        cand = np.flatnonzero(~first & (targets > 0) & (targets == n_keep) & spread)
        if t.releasing:
            cand = cand[~np.isin(cand, list(t.releasing))]
        if len(cand):
            pending += mover.defragment(cand, targets, n_new, reasons)
            moved = cand[n_new[cand] > 0]
            parts.append(free.taken())
            labels.append(moved)
            free._parts = []
    if len(g2):
        _take_all(t, free, g2, (targets - n_keep)[g2], perm, n_keep, n_new, reasons, pending, mover)
        parts.append(free.taken())
        labels.append(g2)
        free._parts = []
    if len(parts) > 1:
        lab = np.concatenate([np.repeat(g, n_new[g]) for g in labels])
        free._parts = [np.concatenate(parts)[np.argsort(lab, kind="stable")]]
    elif parts:
        free._parts = parts
    # Actions and reason suffixes as plain_policies.outcome() names them, for every job at once.
    has_held = t.n_held > 0
    preempted = has_held & (targets == 0)
    for i in np.flatnonzero(preempted).tolist():
        reasons[i] = "preempted: " + reasons[i]
    moving = np.flatnonzero(held_up != t.n_held)
    if len(moving):
        unhealthy = np.bincount(free.owner[~free.host_up], minlength=t.n) > 0
        outside = np.bincount(free.owner[free.host_up & ~free.on_up], minlength=t.n) > 0
        for i in moving.tolist():
            reasons[i] += MOVING[bool(unhealthy[i]), bool(outside[i])]
        placed = n_keep[moving] + n_new[moving]
        for i in moving[unhealthy[moving] & (placed > 0) & (placed < t.mins[moving])].tolist():
            _keep_for_minimum(free, i, int(t.mins[i]), t.leave.get(i), perm, n_keep, n_new, reasons)
    code = np.select(
        [preempted, n_new > 0, n_keep < t.n_held, has_held], [_PREEMPT, _GROW, _SHRINK, _KEEP], _WAIT
    )
    return Plan(
        tuple(t.names),
        tuple(targets.tolist()),
        tuple(_ACTIONS[code].tolist()),  # one fancy index of an object array, no per-job call
        tuple(reasons),
        _Slots(t.held, free, perm, n_keep, n_new, t.order),
    )


def _spread(free: _Free, perm: np.ndarray, n_keep: np.ndarray) -> np.ndarray:
    """Whether each job keeps slots on more than one host."""
    a = free.first[:-1]
    lo, hi = _host_range(free.host[perm[_ranges(a, a + n_keep)]], n_keep)
    return lo != hi


def _keep_for_minimum(free: _Free, i: int, min_workers: int, leave, perm, n_keep, n_new, reasons) -> None:
    """rules.kept_for_minimum for job ``i``: its first released slots on hosts that are not up
    (and that it need not leave: ``leave``) move to the front of its release segment of ``perm``
    and are kept."""
    m, e = int(free.first[i]) + int(n_keep[i]), int(free.first[i + 1])
    seg = perm[m:e]
    off = ~free.host_up[seg]
    if leave:
        off &= ~np.isin(free.host[seg], [free.ids[h] for h in leave if h in free.ids])
    kept = kept_for_minimum(int(n_keep[i] + n_new[i]), int(off.sum()), min_workers)
    if kept:
        chosen = np.flatnonzero(off)[:kept]
        rest = np.ones(len(seg), dtype=bool)
        rest[chosen] = False
        perm[m:e] = np.concatenate([seg[chosen], seg[rest]])
        n_keep[i] += kept
        reasons[i] += keeps_old(kept)


def _honoured_avoids(t: _Table, hs: _Hosts) -> None:
    """rules.avoided for every job that avoids hosts: a job retried where it failed (the other
    up hosts cannot hold its minimum) avoids only the hosts outside its selector."""
    ranks = list(t.avoid)
    for i, n in zip(ranks, hs.up_slots([t.avoid[i] for i in ranks]).tolist(), strict=True):
        hosts = t.avoid[i]
        kept = avoided(hosts, t.leave.get(i, _NO_HOSTS), int(t.mins[i]), hs.capacity, n)
        if kept is not hosts:
            if kept:
                t.avoid[i] = kept
            else:
                del t.avoid[i]
                t.has_avoid[i] = False


_ACTIONS = np.array(
    [TargetAction.PREEMPT, TargetAction.GROW, TargetAction.SHRINK, TargetAction.KEEP, None], dtype=object
)
_PREEMPT, _GROW, _SHRINK, _KEEP, _WAIT = range(5)


def _take_all(
    t: _Table, free: _Free, growing, need, perm, n_keep, n_new, reasons: list[str], pending: int,
    mover: _Mover | None = None,
):
    """Hand out free slots to the ``growing`` jobs (rank order), ``need`` more each: its own
    hosts first, then best fit (:meth:`_Free.take`); with ``mover``, a job that keeps slots
    moves onto fewer hosts instead where its new size fits there (plain_policies._repack)."""
    kept = n_keep[growing]
    # The kept hosts (ranks) of each growing job in its order, for take(): own[a[j]:a[j + 1]].
    first = free.first[growing]
    own = free.rank_of[free.host[perm[_ranges(first, first + kept)]]].tolist()
    a = np.concatenate([[0], np.cumsum(kept)]).tolist()
    kl, avoids = kept.tolist(), t.has_avoid[growing].tolist()
    gl, nl = growing.tolist(), need.tolist()
    got = [0] * len(gl)  # slots given to each growing job (into n_new once, at the end)
    # Runs of plain jobs (avoiding nothing, not moved), taken in one call while all they want is
    # free: run_end[j] is where the run holding j ends (j itself where j is not plain). A job
    # that keeps slots may move while the mover has searches left; after, it is plain too.
    plain = ~t.has_avoid[growing]
    run_end = after_moves = _run_ends(plain)
    if mover is not None:
        releasing = np.isin(growing, list(t.releasing)) if t.releasing else False
        run_end = _run_ends(plain & ((kept == 0) | releasing))
    cum = np.cumsum(need).tolist()
    j = 0
    while j < len(gl):
        if free.total == 0:  # nothing left to give: the rest wait (or run on what they keep)
            _nothing_free(t, growing[j:], need[j:], n_keep, reasons, pending)
            break
        if mover is not None and mover.searches <= 0:
            run_end = after_moves
        end = run_end[j]
        if end > j:  # the run's jobs that find all they want free
            stop = bisect.bisect_right(cum, free.total + (cum[j - 1] if j else 0), j, end)
            if stop > j:
                free.take_run(nl, own, a, j, stop)
                got[j:stop] = nl[j:stop]
                j = stop
                continue
        _take_one(t, free, gl[j], nl[j], j, kl, avoids, own, a, got, reasons, pending, mover)
        j += 1
    n_new[growing] = got


def _run_ends(plain: np.ndarray) -> list[int]:
    """For each position, where the run of ``plain`` positions holding it ends (itself where it
    is not plain)."""
    not_plain = np.flatnonzero(~plain)
    return np.append(not_plain, len(plain))[np.searchsorted(not_plain, np.arange(len(plain)))].tolist()


def _take_one(t, free, i, want, j, kl, avoids, own, a, got, reasons, pending, mover) -> None:
    """Growing job ``i`` (``j``-th of :func:`_take_all`'s) outside a run: it avoids hosts, may
    move, or finds less free than it wants."""
    if mover is not None and kl[j] and i not in t.releasing:
        moved = mover.repack(i, kl[j] + want)
        if moved is not None:  # it restarts anyway: onto fewer hosts rather than spread
            got[j] = moved
            reasons[i] += "; packed onto fewer hosts"
            return
    if not avoids[j] and free.total >= want:  # the common case of _grow, inline
        free.take(want, own[a[j] : a[j + 1]], _NONE)
        got[j] = want
    else:
        got[j], reasons[i] = _grow(t, i, want, kl[j], own[a[j] : a[j + 1]], reasons[i], free, pending)


class _HostsNeeded(Exception):
    """A restricted job is short on its hosts while slots it may not use are free or being
    released: the plan needs the plain implementation's repair (moves, lowered caps)."""


def _take_restricted(t: _Table, free: _Free, jobs, need, perm, n_keep, n_new, reasons, pending, released_on):
    """Hand out free slots to the restricted growing ``jobs`` (rank order), as
    plain_policies._place_all's first pass; raises :class:`_HostsNeeded` where that pass would
    repair."""
    first = free.first[jobs]
    kept = n_keep[jobs]
    own = free.rank_of[free.host[perm[_ranges(first, first + kept)]]].tolist()
    a = np.concatenate([[0], np.cumsum(kept)]).tolist()
    ids, rel = free.ids, released_on.tolist()
    for j, (i, want) in enumerate(zip(jobs.tolist(), need.tolist(), strict=True)):
        hosts = t.avoid[i]
        avoid = free.avoid_ranks(hosts)
        avail = free.count_for(avoid)
        mine = own[a[j] : a[j + 1]]
        if avail >= want:
            free.take(want, mine, avoid)
            n_new[i] = want
            continue
        out = sum(rel[ids[h]] for h in hosts if h in ids)
        if free.total - avail + out > 0:
            raise _HostsNeeded
        n_new[i], reasons[i] = _grow(t, i, want, kept[j], mine, reasons[i], free, pending, pending - out)


def _nothing_free(t: _Table, rest, need, n_keep, reasons: list[str], pending: int) -> None:
    """:func:`_grow` for jobs that find no free slot at all, vectorised (reasons only)."""
    only = (n_keep[rest] >= np.maximum(t.mins[rest], 1)) if pending == 0 else np.zeros(len(rest), bool)
    text = {w: f"; waiting for {w} slots to be released" for w in set(need.tolist())}
    text[-1] = "; only 0 more free"
    for i, w in zip(rest.tolist(), np.where(only, -1, need).tolist(), strict=True):
        reasons[i] += text[w]


def _grow(
    t: _Table,
    i: int,
    need: int,
    have: int,
    own: list[int],
    reason: str,
    free: _Free,
    pending: int,
    pending_in: int | None = None,
):
    """Take the free slots for ``need`` more workers of job ``i``: all of them, or (when no
    slots are being released that could make up the rest) what is free if that reaches the
    job's minimum. Returns how many were taken and the reason (plain_policies._grow_one;
    ``pending_in``: slots released on a restricted job's hosts)."""
    avoid = free.avoid_ranks(t.avoid.get(i, _NO_HOSTS))
    avail = free.count_for(avoid)
    if avail >= need:
        free.take(need, own, avoid)
        return need, reason
    if pending == 0 and have + avail >= max(int(t.mins[i]), 1):
        free.take(avail, own, avoid)
        return avail, reason + f"; only {avail} more free"
    if pending_in is None:
        return 0, reason + f"; waiting for {need - avail} slots to be released"
    if pending_in > 0:
        return 0, reason + f"; waiting for {need - avail} slots to be released on its hosts"
    return 0, reason + f"; waiting for {need - avail} slots on its hosts"


_SHARES: dict[str, ShareFn] = {
    "fairshare": _fair, "priority": _priority, "strict": _strict, "goodput": _goodput,
}
POLICIES: dict[str, Policy] = {
    name: make_policy(fn, PLAIN[name], FIRST_FIT[name], moves=name == "goodput")
    for name, fn in _SHARES.items()
}
_goodput_workers = POLICIES["goodput"]


def _goodput_policy(snap: Snapshot) -> Plan:
    """``goodput``: the workers, then the batch of each adaptive job on them (the cyclic
    collector paused for both, as in make_policy: the batches' tuple would start a collection
    over the snapshot)."""
    if not gc.isenabled():
        return with_batches(_goodput_workers(snap), snap)
    gc.disable()
    try:
        return with_batches(_goodput_workers(snap), snap)
    finally:
        gc.enable()


POLICIES["goodput"] = _goodput_policy
# The policies that read each job's scaling model and attained service: the ledger and the
# simulator build them only for these (the others pay nothing for them).
LEARNING = frozenset({"goodput"})
# The vectorised path at every size (tests and benchmarks compare it with PLAIN). Not goodput's:
# its vectorised form bounds the searches for fewer hosts per decision (MOVE_SEARCHES), the
# plain one does not (test_policy_reference compares them where the bound is not reached).
VECTORISED: dict[str, Policy] = {
    name: make_policy(fn, repair=PLAIN[name]) for name, fn in _SHARES.items() if name != "goodput"
}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(name, list(POLICIES)) from None


def decide(snapshot: Snapshot, policy: str = "priority") -> Plan:
    """Run the named policy on a snapshot."""
    return get_policy(policy)(snapshot)
