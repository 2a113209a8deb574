"""The plain per-slot implementation of the pool policies (see :mod:`elastic_ops.pool.policies`
for the semantics): the one used for small snapshots, and the reference for the vectorised one.

It walks every held and free slot in Python, which is cheapest for a few dozen jobs (no numpy
call overhead) and slow at thousands. ``tests/pool/test_policy_reference.py`` checks that both
implementations give the same plan, decision for decision.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from elastic_ops.pool import tenants
from elastic_ops.pool.goodput import goodput_fill, move_pays
from elastic_ops.pool.model import (
    Decision,
    HostState,
    Job,
    Plan,
    Preemption,
    Slot,
    Snapshot,
    TargetAction,
)
from elastic_ops.pool.rules import (
    GANG_DOES_NOT_FIT,
    SETTLE_AFTER,
    Change,
    avoided,
    effective_priority,
    freeze_reason,
    keeps_old,
    kept_for_minimum,
    may_freeze,
    moving,
    order_key,
    too_few,
)
from elastic_ops.pool.shares import strict_fill, weighted_fill
from elastic_ops.pool.tenants import Tenants

Policy = Callable[[Snapshot], Plan]
ShareFn = Callable[[list[Job], list[int], int, Snapshot], list[int]]


# --- share functions (step 2) ---------------------------------------------------------------


def _fair(jobs: list[Job], caps: list[int], capacity: int, snap: Snapshot) -> list[int]:
    return weighted_fill([j.min_workers for j in jobs], caps, [1.0] * len(jobs), capacity)


def _priority(jobs: list[Job], caps: list[int], capacity: int, snap: Snapshot) -> list[int]:
    return weighted_fill([j.min_workers for j in jobs], caps, [float(j.priority) for j in jobs], capacity)


def _strict(jobs: list[Job], caps: list[int], capacity: int, snap: Snapshot) -> list[int]:
    classes = [math.floor(effective_priority(j, snap.now, snap.config.aging_s)) for j in jobs]
    return strict_fill([j.min_workers for j in jobs], caps, classes, capacity)


def _goodput(jobs: list[Job], caps: list[int], capacity: int, snap: Snapshot) -> list[int]:
    return goodput_fill(jobs, [j.min_workers for j in jobs], caps, capacity, snap, snap.config.rescale_cost_s)


# --- decide -------------------------------------------------------------------------------


def _usable(snap: Snapshot) -> tuple[dict[str, int], int]:
    up = {h.name: h.slots for h in snap.hosts if h.state == HostState.UP}
    return up, sum(up.values())


def _cap(
    job: Job, up: dict[str, int], capacity: int, frozen_on: dict[str, int] | None = None,
    cache: dict | None = None,
) -> int:
    """The most workers a job can use: its max, limited by slots on up hosts it does not avoid;
    for a job restricted to some up hosts, less the slots that frozen jobs keep on them
    (``frozen_on``: per host). ``cache``: the slots out of reach per set of avoided hosts, for
    one ``frozen_on`` (jobs of one selector share that set: each is summed once)."""
    key = job.avoid_hosts
    out = None if cache is None else cache.get(key)
    if out is None:
        out = sum(up.get(h, 0) for h in key)
        if frozen_on:
            out += sum(frozen_on.values()) - sum(frozen_on.get(h, 0) for h in key)
        if cache is not None:
            cache[key] = out
    return min(job.max_workers, capacity - out)


def restricted(job: Job, up: dict[str, int]) -> bool:
    """Whether ``job`` may not take slots on some ``up`` host (a selector, failures)."""
    return any(h in up for h in job.avoid_hosts)


def _frozen_on(jobs: Iterable[Job], up: dict[str, int]) -> dict[str, int]:
    """Slots that the given (frozen) jobs hold and keep, per up host: in range, on hosts they
    need not leave."""
    out: dict[str, int] = {}
    for job in jobs:
        for h, sl in job.held:
            size = up.get(h)
            if size is not None and 0 <= sl < size and h not in job.leave_hosts:
                out[h] = out.get(h, 0) + 1
    return out


def _share_round(
    jobs: list[Job], caps: list[int], capacity: int, snap: Snapshot, share: ShareFn, base: list[int]
) -> tuple[list[int], dict[int, str]]:
    """Admit in order (gang), then share among the admitted. ``jobs`` is already ordered;
    ``base``: their caps before what frozen jobs keep and repairs lower. Returns the targets and
    the reasons of the jobs left out (admitted ones get their share)."""
    admitted: list[int] = []
    left_out: dict[int, str] = {}
    need = 0
    for i, job in enumerate(jobs):
        if caps[i] < job.min_workers:
            left_out[i] = too_few(job.min_workers, caps[i], base[i])
        elif need + job.min_workers <= capacity:
            admitted.append(i)
            need += job.min_workers
        else:
            left_out[i] = GANG_DOES_NOT_FIT.why(job.min_workers, capacity - need)
    targets = [0] * len(jobs)
    part = share([jobs[i] for i in admitted], [caps[i] for i in admitted], capacity, snap)
    for i, t in zip(admitted, part, strict=True):
        targets[i] = t
    return targets, left_out


def _freeze_reason(
    job: Job, held_up: int, target: int, snap: Snapshot, admits: bool = False, flags: tuple = (False, False)
) -> str | None:
    """Why a running job must stay at ``held_up`` rather than move to ``target`` (None: it may):
    :data:`elastic_ops.pool.rules.FREEZE_RULES` on one job. ``admits``: a higher-ranked job that
    holds nothing is admitted in this plan; ``flags``: its tenant's (reclaims, over its max)."""
    last = math.nan if job.last_rescale is None else job.last_rescale
    c = Change(held_up, target, not job.preemptible, last, admits, *flags)
    if not may_freeze(c, job.min_workers, job.max_workers):
        return None
    return freeze_reason(c, snap.config, snap.now)


def _scan(jobs: Iterable[Job], up: dict[str, int]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """The one pass over every held slot: taken slot indices per up host (only those within its
    slots: a slot beyond them, left over from a host that shrank, takes no capacity), held-on-up
    count per job."""
    taken: dict[str, list[int]] = {}
    held_up: dict[str, int] = {}
    for job in jobs:
        n = 0
        leave = job.leave_hosts
        for h, sl in job.held:
            size = up.get(h)
            if size is None:
                continue
            n += h not in leave  # a slot it must leave is not its own to keep, but is taken
            if 0 <= sl < size:
                lst = taken.get(h)
                if lst is None:
                    taken[h] = [sl]
                else:
                    lst.append(sl)
        held_up[job.name] = n
    return taken, held_up


def _tenant_round(
    tt: Tenants, tid: list[int], free_idx: list[int], ordered: list[Job], caps: list[int],
    base_caps: list[int], keep: list[int], frozen: dict[int, str], capacity: int, snap: Snapshot,
    share: ShareFn,
) -> tuple[list[int], dict[int, str], list[int], np.ndarray]:
    """:func:`_share_round` per tenant, on the parts :func:`tenants.divide_among` gives them.
    Returns the targets and left-out reasons (as ``_share_round``, by position in ``free_idx``),
    the capacity each free job's tenant gave its free jobs, and the parts."""
    groups: dict[int, list[int]] = {}
    for k, i in enumerate(free_idx):
        groups.setdefault(tid[i], []).append(k)
    kept = np.zeros(len(tt), dtype=np.int64)
    for i in frozen:
        kept[tid[i]] += keep[i]
    demand = kept.copy()
    for i in free_idx:
        if caps[i] >= ordered[i].min_workers:
            demand[tid[i]] += caps[i]
    targets = [0] * len(free_idx)
    left_out: dict[int, str] = {}
    held_back = np.zeros(len(tt), dtype=np.int64)
    cfg = snap.config
    for i in frozen:  # what jobs held back by min_rescale_interval_s take once they may
        last = ordered[i].last_rescale
        if last is not None and snap.now - last < cfg.min_rescale_interval_s:
            held_back[tid[i]] += max(0, caps[i] - keep[i])

    def run(t: int, cap: int) -> int:
        ks = groups[t]
        part, left = _share_round([ordered[free_idx[k]] for k in ks], [caps[free_idx[k]] for k in ks], cap,
                                  snap, share, [base_caps[free_idx[k]] for k in ks])
        for k in ks:
            left_out.pop(k, None)
        for n, k in enumerate(ks):
            targets[k] = part[n]
            if n in left:
                left_out[k] = left[n]
        return sum(part)

    parts, given = tenants.divide_among(tt, demand, kept, capacity, groups, run, held_back)
    return targets, left_out, [given[tid[i]] for i in free_idx], parts


def _targets(
    snap,
    share: ShareFn,
    ordered: list[Job],
    up: dict[str, int],
    capacity: int,
    held_up: list[int],
    limit: dict[int, int] | None = None,
    tt: Tenants | None = None,
):
    """Targets and reasons. ``limit``: caps lowered by placement (see :func:`_host_repair`);
    ``tt``: the tenants (None: one, the step skipped), their ids in ``ordered``'s order."""
    no_frozen: dict = {}
    base_caps = [_cap(j, up, capacity, cache=no_frozen) for j in ordered]
    limit = limit or {}
    restricted_idx = [i for i, j in enumerate(ordered) if restricted(j, up)]
    caps = list(base_caps)
    # what a frozen job keeps: what it holds, down to its max (a user lowered it: the job shrinks
    # to it, and no further than a job that may not shrink may go)
    keep = [min(h, j.max_workers) for h, j in zip(held_up, ordered, strict=True)]
    frozen: dict[int, str] = {}
    tid: list[int] = []
    flags = [(False, False)] * len(ordered)
    if tt is not None:
        tid = tt.ids.tolist()
        ids = tt.ids
        usable = np.array([c >= j.min_workers for c, j in zip(base_caps, ordered, strict=True)], dtype=bool)
        held_t = tt.per_tenant(ids, np.array(held_up, dtype=np.float64))
        tt.flags(held_t, tt.per_tenant(ids, np.where(usable, np.maximum(base_caps, held_up), held_up)))
        flags = list(zip(tt.reclaims[ids].tolist(), tt.over[ids].tolist(), strict=True))
    # a fixed point: rounds of share and freeze, a long chain of freezes cut after SETTLE_AFTER
    # rounds (see elastic_ops.pool.rules); the last round's targets are always the plan
    for rnd in range(SETTLE_AFTER + 1):
        if rnd == SETTLE_AFTER:
            for i in range(len(ordered)):
                why = None if i in frozen else _freeze_reason(ordered[i], keep[i], 0, snap, flags=flags[i])
                if why:
                    frozen[i] = why
        free_idx = [i for i in range(len(ordered)) if i not in frozen]
        cap_left = capacity - sum(keep[i] for i in frozen)
        # a restricted job's cap: what its hosts can give after what frozen jobs keep on them
        frozen_on = _frozen_on([ordered[i] for i in sorted(frozen)], up) if frozen else None
        round_cache: dict = {}
        for i in restricted_idx:
            caps[i] = _cap(ordered[i], up, capacity, frozen_on, round_cache)
        for i, c in limit.items():
            caps[i] = min(caps[i], c)
        if tt is None:
            part, left_out = _share_round(
                [ordered[i] for i in free_idx], [caps[i] for i in free_idx], cap_left, snap, share,
                [base_caps[i] for i in free_idx],
            )
        else:
            part, left_out, given, parts = _tenant_round(
                tt, tid, free_idx, ordered, caps, base_caps, keep, frozen, capacity, snap, share
            )
        targets = list(keep)  # frozen jobs keep what they hold
        for k, i in enumerate(free_idx):
            targets[i] = part[k]
        new = {}
        admitted_above = False  # a job ranked above i that holds nothing gets slots
        for i in free_idx:
            if keep[i] and targets[i] != keep[i]:
                r = _freeze_reason(ordered[i], keep[i], targets[i], snap, admitted_above, flags[i])
                if r:
                    new[i] = r
            admitted_above = admitted_above or (held_up[i] == 0 and targets[i] > 0)
        if not new or rnd == SETTLE_AFTER:
            break
        frozen.update(new)
    reasons = [f"share {t} of {cap_left}" for t in targets]
    if tt is not None:
        for k, i in enumerate(free_idx):
            reasons[i] = f"share {targets[i]} of {given[k]}"
    for k, why in left_out.items():
        reasons[free_idx[k]] = why
    for i, why in frozen.items():
        reasons[i] = f"keeps {keep[i]}: {why}"
    if tt is not None:
        held_t = tt.per_tenant(tt.ids, np.array(held_up, dtype=np.float64))
        demand = tt.per_tenant(tt.ids, np.array(
            [keep[i] if i in frozen else (max(caps[i], 0) if caps[i] >= j.min_workers else 0)
             for i, j in enumerate(ordered)], dtype=np.float64))
        sfx = tenants.texts(tt, parts, held_t, demand, capacity)
        reasons = [r + sfx[t] for r, t in zip(reasons, tid, strict=True)]
    return targets, reasons


class _FreeSlots:
    """Free slots on up hosts, handed out first-fit in host-name order (spare hosts first, see
    :func:`spare_hosts`) with a moving cursor, or (``pack``) on as few hosts as possible.
    A host's free list is built only when something is taken from it."""

    def __init__(
        self, up: dict[str, int], taken: dict[str, list[int]], spare: frozenset[str] = frozenset(),
        pack: bool = False,
    ) -> None:
        self.up = up
        self.pack = pack
        self.spare = spare
        self.taken = taken
        # spare hosts (no restricted job may use them) first, then the others, by name
        self.hosts = sorted(
            (h for h in up if len(taken.get(h, ())) < up[h]), key=lambda h: (h not in spare, h)
        )
        self.free: dict[str, list[int]] = {}
        self.cursor = 0
        self.total = sum(up.values()) - sum(len(taken.get(h, ())) for h in up)
        # count_for() per avoid set, kept up to date by every take (restricted jobs of one
        # selector share one; a repair asks it for each of them, and the sum is over many hosts)
        self.outside: dict[frozenset[str], int] = {}

    def _free(self, h: str) -> list[int]:
        lst = self.free.get(h)
        if lst is None:
            t = set(self.taken.get(h, ()))
            # Popped from the end, so stored descending to hand out low indices first.
            lst = self.free[h] = [x for x in range(self.up[h] - 1, -1, -1) if x not in t]
        return lst

    def free_on(self, h: str) -> int:
        lst = self.free.get(h)
        if lst is not None:
            return len(lst)
        return max(0, self.up.get(h, 0) - len(self.taken.get(h, ()))) if h in self.up else 0

    def count_for(self, avoid: frozenset[str]) -> int:
        n = self.outside.get(avoid)
        if n is None:
            n = self.total - sum(self.free_on(h) for h in avoid)
            if len(self.outside) < COUNTED_AVOID_SETS:
                self.outside[avoid] = n
        return n

    def take(self, n: int, prefer: Iterable[str], avoid: frozenset[str]) -> list[Slot]:
        out: list[Slot] = []
        for h in prefer:
            if h in avoid:
                continue
            out.extend(self._take_from(h, n - len(out)))
            if len(out) == n:
                return out
        if self.pack:
            return self._take_packed(n, avoid, out)
        i = self.cursor
        while len(out) < n and i < len(self.hosts):
            h = self.hosts[i]
            if h not in avoid:
                out.extend(self._take_from(h, n - len(out)))
            if i == self.cursor and not self._free(h):
                self.cursor += 1
            i += 1
        return out

    def free_on_hosts_needed(self, mine: dict[str, int], n: int) -> int:
        """How many hosts beyond ``mine`` a grow by ``n`` onto its own hosts, then best fit,
        would add (what :meth:`take` with ``pack`` does, counted, nothing taken)."""
        left = n - sum(self.free_on(h) for h in mine)
        if left <= 0:
            return 0
        room = sorted((c for h in self.hosts if h not in mine and (c := self.free_on(h))), reverse=True)
        if any(c >= left for c in room):
            return 1
        added = 0
        for c in room:
            if left <= 0:
                break
            left -= c
            added += 1
        return added

    def _take_packed(self, n: int, avoid: frozenset[str], out: list[Slot]) -> list[Slot]:
        """Best fit: the host with the fewest free slots that holds what is still needed; while
        none does, all of the host with the most free (names break ties). Spare hosts first, as
        in first fit: the others' free slots are what restricted jobs can grow into."""
        while len(out) < n:
            room = [(c, h) for h in self.hosts if h not in avoid and (c := self.free_on(h))]
            room = [x for x in room if x[1] in self.spare] or room
            if not room:
                break
            out.extend(self._take_from(best_fit(room, n - len(out)), n - len(out)))
        return out

    def _take_from(self, h: str, n: int) -> list[Slot]:
        if n <= 0 or h not in self.up:
            return []
        lst = self._free(h)
        if not lst:
            return []
        k = min(n, len(lst))
        got = [(h, lst.pop()) for _ in range(k)]
        self.total -= k
        for avoid in self.outside:
            if h not in avoid:
                self.outside[avoid] -= k
        return got


def best_fit(room: Sequence[tuple[int, str]], need: int) -> str:
    """The host to take ``need`` more slots from, of ``room`` (free slots, host) in order of
    preference: the first with the fewest free slots that holds them all, else the first with
    the most (all of it is taken, and the rest is placed again)."""
    fits = [k for k, (c, _) in enumerate(room) if c >= need]
    if fits:
        return room[min(fits, key=lambda k: (room[k][0], k))][1]
    return room[min(range(len(room)), key=lambda k: (-room[k][0], k))][1]


# Avoid sets whose free count _FreeSlots keeps (each take updates every one): the selectors'
# few, not one per job that some host failed
COUNTED_AVOID_SETS = 16


def _keep(job: Job, target: int, up: dict[str, int], held_up: int) -> tuple[list[Slot], list[Slot]]:
    """Which held slots to keep and which to release: on up hosts it may use, slots it is not
    already releasing first (a shrink or a move under way goes on, rather than turn round), then
    most-used hosts first, by host and index."""
    if held_up == len(job.held) and target >= held_up:
        return list(job.held), []  # the common case: keeps everything
    count: dict[str, int] = {}
    for h, _ in job.held:
        count[h] = count.get(h, 0) + 1
    usable = {h for h in count if h in up and h not in job.leave_hosts}
    going = job.releasing
    order = sorted(job.held, key=lambda sl: (sl[0] not in usable, sl in going, -count[sl[0]], sl))
    k = min(target, held_up)  # held_up: its slots on the usable hosts, sorted first
    return order[:k], order[k:]


# Passes that may lower the caps of restricted jobs short on their hosts. Lowering some re-shares
# their capacity, which can leave others short in turn (a cascade, one pass each on a full pool
# of many restricted jobs): after these, the jobs still short wait (with a reason that says for
# slots on their hosts) and the next decision, on the pool as it has changed, looks again.
REPAIR_PASSES = 3


def make_policy(share: ShareFn, pack: bool = False, moves: bool = False) -> Policy:
    """The plain policy for ``share``; ``pack``: new slots on as few hosts as possible (best
    fit) rather than first-fit in host-name order; ``moves``: running jobs are also moved onto
    fewer hosts (:func:`_defragment`, :func:`_repack`; ``goodput``, whose models say what a
    spread costs)."""

    def decide(snap: Snapshot) -> Plan:
        up, capacity = _usable(snap)
        ordered = [_honoured(j, up, capacity) for j in sorted(snap.jobs, key=lambda j: order_key(j, snap))]
        tt = tenants.of_snapshot(snap, [j.tenant for j in ordered], capacity)
        taken, held_up_by = _scan(ordered, up)
        held_up = [held_up_by[j.name] for j in ordered]
        spare = spare_hosts(ordered, up)
        limit: dict[int, int] = {}
        for passes in range(1, REPAIR_PASSES + 2):
            targets, reasons = _targets(snap, share, ordered, up, capacity, held_up, limit, tt)
            placed = _place_all(
                snap, ordered, targets, reasons, up, taken, held_up, spare, repair=passes <= REPAIR_PASSES,
                pack=pack, moves=moves,
            )
            if isinstance(placed, Plan):
                return placed
            limit.update(placed)
        raise AssertionError("unreachable: the last pass repairs nothing")  # pragma: no cover

    return decide


def _honoured(job: Job, up: dict[str, int], capacity: int) -> Job:
    """``job`` with the hosts it avoids as :func:`elastic_ops.pool.rules.avoided` decides."""
    if not job.avoid_hosts:
        return job
    kept = avoided(job.avoid_hosts, job.leave_hosts, job.min_workers, capacity,
                   sum(up.get(h, 0) for h in job.avoid_hosts))
    return job if kept is job.avoid_hosts else dataclasses.replace(job, avoid_hosts=kept)


def spare_hosts(jobs: Iterable[Job], up: dict[str, int]) -> frozenset[str]:
    """The up hosts that every restricted job avoids (none may use them): growth and new grants
    take free slots there first. Empty when no job is restricted."""
    out: set[str] | None = None
    for job in jobs:
        if restricted(job, up):
            out = {h for h in job.avoid_hosts if h in up} if out is None else out & job.avoid_hosts
            if not out:
                return frozenset()
    return frozenset(out or ())


def _place_all(
    snap, ordered, targets, reasons, up, taken, held_up, spare, *, repair: bool = True, pack: bool = False,
    moves: bool = False,
) -> Plan | dict[int, int]:
    """Keep/release, then new slots: restricted jobs first (rank order), then the others (rank
    order). Returns the plan, or the caps to lower when restricted jobs' targets cannot be
    placed even after the releases and moves the plan could order (see :func:`_host_repair`);
    ``repair=False`` (the last pass): such jobs wait, nothing is lowered or moved for them."""
    n = len(ordered)
    keeps: list[list[Slot]] = []
    releases: list[list[Slot]] = []
    for j, t, h in zip(ordered, targets, held_up, strict=True):
        k, r = _keep(j, t, up, h)
        keeps.append(k)
        releases.append(r)
    released_on: dict[str, int] = {}  # slots released on each up host
    for rel in releases:
        for h, _ in rel:
            if h in up:
                released_on[h] = released_on.get(h, 0) + 1
    pending = sum(released_on.values())
    free = _FreeSlots(up, taken, spare, pack)
    new: list[list[Slot]] = [[] for _ in range(n)]  # moved-in slots first, then growth
    suffix = [""] * n
    movers: dict[int, list[str]] = {}
    claimed: dict[str, int] = {}  # released slots a restricted job waits for, per host
    first = [i for i, j in enumerate(ordered) if restricted(j, up)]
    # the movable jobs keeping slots, per up host: the jobs a restricted job's repair may move
    # (an index, so that a repair looks at the jobs on its hosts, not at every job)
    keepers: dict[str, set[int]] = {}
    if first:
        for j, other in enumerate(ordered):
            if keeps[j] and _movable(other, targets[j], snap):
                for h, _ in keeps[j]:
                    keepers.setdefault(h, set()).add(j)
    seen: dict[frozenset[str], list[int]] = {}  # movers near the hosts of each avoid set
    lowered_caps: dict[int, int] = {}
    for i in first:
        job = ordered[i]
        need = targets[i] - len(keeps[i]) - len(new[i])
        if need <= 0:
            continue
        avail = free.count_for(job.avoid_hosts)
        if avail < need:
            out = sum(n for h, n in released_on.items() if h in job.avoid_hosts)
            if repair and free.total - avail + out > 0:  # short on its hosts while others have room
                state = (keeps, releases, new, released_on, claimed, movers, keepers, seen)
                before = (sum(claimed.values()), sum(map(len, movers.values())))
                lowered = _host_repair(i, ordered, targets, state, free, up, need, avail)
                if lowered is None:
                    suffix[i] = f"; waiting for {need - avail} slots to be released on its hosts"
                    continue
                # Every short job's cap is lowered in this pass, not one per pass (a pass per
                # job made a decision cost jobs x restricted jobs). A job lowered to what it
                # can reach holds its free slots, as it will once re-planned; one left below
                # its minimum gets nothing then, so the claims and moves its repair made would
                # mislead the jobs after it: plan again from here.
                lowered_caps[i] = lowered
                if lowered >= max(job.min_workers, 1):
                    free.take(avail, {}, job.avoid_hosts)
                elif (sum(claimed.values()), sum(map(len, movers.values()))) != before:
                    break
                continue
            got, suffix[i] = _grow_one(job, need, keeps[i] + new[i], free, pending, pending - out)
        else:
            got = free.take(need, dict.fromkeys(h for h, _ in keeps[i] + new[i]), job.avoid_hosts)
        new[i] += got
    if lowered_caps:
        return lowered_caps
    done = set(first)
    if moves:  # before the grows: a move that pays outranks growth into the same free slots
        for i, job in enumerate(ordered):
            if i not in done and not new[i] and targets[i] == len(keeps[i]):
                before = len(releases[i])
                if _defragment(job, targets[i], i, keeps, releases, new, free, snap):
                    suffix[i] = "; moved onto fewer hosts"
                    pending += len(releases[i]) - before  # growers wait for these, not take less
    for i, job in enumerate(ordered):
        need = targets[i] - len(keeps[i]) - len(new[i])
        if need > 0 and i not in done:
            movable = moves and keeps[i] and not job.releasing and not new[i]
            if movable and _repack(i, targets[i], keeps, releases, new, free, job.avoid_hosts):
                suffix[i] = "; packed onto fewer hosts"
                continue
            got, suffix[i] = _grow_one(job, need, keeps[i] + new[i], free, pending)
            new[i] += got
    decisions = []
    for i, job in enumerate(ordered):
        why = reasons[i] + suffix[i]
        if i in movers:
            needs = ", ".join(dict.fromkeys(movers[i]))
            why += f"; moving {len(movers[i])} slots off hosts that job {needs} needs"
        off_up = [sl for sl in releases[i] if sl[0] not in up and sl[0] not in job.leave_hosts]
        kept = kept_for_minimum(len(keeps[i]) + len(new[i]), len(off_up), job.min_workers)
        if kept:
            old = set(off_up[:kept])
            keeps[i] = keeps[i] + off_up[:kept]
            releases[i] = [sl for sl in releases[i] if sl not in old]
        placements, action, why = outcome(
            job, targets[i], keeps[i], new[i], releases[i], moving(job, up, held_up[i]), why
        )
        if kept:
            why += keeps_old(kept)
        decisions.append(Decision(job.name, targets[i], placements, tuple(releases[i]), action, why))
    return Plan.of(decisions, [len(k) for k in keeps])


def _repack(i: int, target: int, keeps, releases, new, free: _FreeSlots, avoid: frozenset[str]) -> bool:
    """A growing job restarts anyway: if its ``target`` fits on fewer hosts counting the free
    slots and its own, it moves there (its slots elsewhere released) rather than grow onto
    whatever is free next to it. Returns whether it moved."""
    mine = _per_host(keeps[i])
    chosen = _fewest_hosts(target, mine, free, avoid)
    if not chosen:
        return False
    grow = target - len(keeps[i])
    now_hosts = len(mine) + (free.free_on_hosts_needed(mine, grow) if grow > 0 else 0)
    if len(chosen) >= now_hosts:
        return False
    _move(i, target, chosen, mine, keeps, releases, new, free, avoid)
    return True


def _per_host(slots: Iterable[Slot]) -> dict[str, int]:
    mine: dict[str, int] = {}
    for h, _ in slots:
        mine[h] = mine.get(h, 0) + 1
    return mine


def _fewest_hosts(target: int, mine: dict[str, int], free: _FreeSlots, avoid: frozenset[str]) -> list[str]:
    """The hosts ``target`` workers fit on, counting the free slots (not on hosts it avoids) and
    ``mine`` (the job's own per host), as few as possible: best fit, ties to more of its own,
    then name; [] if they do not fit."""
    room = {h: free.free_on(h) * (h not in avoid) + mine.get(h, 0) for h in set(free.hosts) | set(mine)}
    if sum(room.values()) < target:
        return []
    chosen: list[str] = []
    left = target
    while left > 0:
        fits = [(c, -mine.get(h, 0), h) for h, c in room.items() if c >= left and h not in chosen]
        if fits:
            chosen.append(min(fits)[2])
            break
        h = min(((-c, -mine.get(h, 0), h) for h, c in room.items() if c > 0 and h not in chosen))[2]
        chosen.append(h)
        left -= room[h]
    return chosen


def _move(i: int, target: int, chosen: list[str], mine: dict[str, int], keeps, releases, new, free,
          avoid: frozenset[str]) -> None:
    """Job ``i`` keeps its slots on the ``chosen`` hosts, releases the others and takes the
    rest of ``target`` from the free slots there (its own fullest hosts first; none on a host
    it avoids, where it only keeps what it holds)."""
    stay = [sl for sl in keeps[i] if sl[0] in chosen]
    go = [sl for sl in keeps[i] if sl[0] not in chosen]
    got: list[Slot] = []
    for h in sorted(chosen, key=lambda h: -mine.get(h, 0)):
        if h not in avoid:
            got += free._take_from(h, target - len(stay) - len(got))
    keeps[i], releases[i], new[i] = stay, releases[i] + go, got


def _defragment(
    job: Job, target: int, i: int, keeps, releases, new, free: _FreeSlots, snap: Snapshot
) -> bool:
    """A job that keeps ``target`` slots (``keeps[i]``) on more hosts than it needs moves onto
    fewer, its slots elsewhere released, when the free slots and its own make room and its
    model says the spread costs more than the move (:func:`goodput.move_pays`): a job that
    restarts anyway (it shrinks) moves for any gain, one that does not must pay back its
    restart, and is moved only as the rules allow a rescale (preemptible, not rescaled too
    recently). Returns whether it moved."""
    if target <= 0 or job.releasing:
        return False
    mine = _per_host(keeps[i])
    restarts = bool(releases[i])
    if len(mine) <= 1 or not (restarts or _movable(job, target, snap)):
        return False
    chosen = _fewest_hosts(target, mine, free, job.avoid_hosts)
    if not chosen or len(chosen) >= len(mine):
        return False
    cost = 0.0 if restarts else snap.config.rescale_cost_s
    if not move_pays(job, target, len(mine), len(chosen), snap.now, cost):
        return False
    _move(i, target, chosen, mine, keeps, releases, new, free, job.avoid_hosts)
    return True


def _grow_one(job: Job, need: int, have: list[Slot], free: _FreeSlots, pending: int, pending_in=None):
    """New slots for ``need`` more workers of ``job`` (``have``: what it keeps): all of them if
    free, else (nothing being released anywhere) what is free if that reaches its minimum, else
    none. ``pending_in``: for a restricted job, the slots being released on its hosts (its
    reason then names its hosts). Returns the slots and the reason suffix."""
    prefer = dict.fromkeys(h for h, _ in have)
    avail = free.count_for(job.avoid_hosts)
    if avail >= need:
        return free.take(need, prefer, job.avoid_hosts), ""
    if pending == 0 and len(have) + avail >= max(job.min_workers, 1):
        return free.take(avail, prefer, job.avoid_hosts), f"; only {avail} more free"
    if pending_in is None:
        return [], f"; waiting for {need - avail} slots to be released"
    if pending_in > 0:
        return [], f"; waiting for {need - avail} slots to be released on its hosts"
    return [], f"; waiting for {need - avail} slots on its hosts"


def _movable(job: Job, target: int, snap: Snapshot) -> bool:
    """Whether a running job may be moved to other slots for a restricted job (a move is a
    rescale for the rules: graceful preemption, a preemptible job, not rescaled too recently).
    Which of its slots may move: see :func:`_may_leave`."""
    cfg = snap.config
    if target <= 0 or cfg.preemption != Preemption.GRACEFUL or not job.preemptible:
        return False
    return job.last_rescale is None or snap.now - job.last_rescale >= cfg.min_rescale_interval_s


def _may_leave(job: Job, slot: Slot) -> bool:
    """Whether a movable job may be moved off ``slot``. A job in the middle of a shrink or a
    move (releasing slots it was told to give up) may only go on with it: its rescale is
    stamped when its old slots go, so moving it off its new ones would relaunch it twice inside
    ``min_rescale_interval_s``."""
    return not job.releasing or slot in job.releasing


def _host_repair(i, ordered, targets, state, free: _FreeSlots, up, need: int, avail: int) -> int | None:
    """Make room on its hosts for restricted job ``i``, short of ``need - avail`` slots there
    while slots it may not use are free or being released. In order: slots other jobs release
    on its hosts (not counted on by a higher-ranked restricted job); then moves: a running job
    (lowest-ranked first) that keeps slots on its hosts and may be moved (:func:`_movable`)
    releases them and keeps instead a slot it was releasing on a host job ``i`` may not use, or
    is given a free one there (its own hosts first). If that covers the shortfall, the job's
    free slots are held for it (taken, not placed) and it waits for the releases; returns None.
    Otherwise returns the most it could reach: its cap is lowered to that and the targets are
    recomputed."""
    keeps, releases, new, released_on, claimed, movers, keepers, seen = state
    job = ordered[i]

    def mine(h: str) -> bool:
        return h in up and h not in job.avoid_hosts

    mine_hosts = frozenset(h for h in up if h not in job.avoid_hosts)  # once per repair, not per slot
    elsewhere_ok: dict[frozenset[str], bool] = {}  # per avoid set: may it use a host off ours?

    def can_go(j: int) -> bool:  # a job of the same selector has nowhere to move to
        key = ordered[j].avoid_hosts
        if key not in elsewhere_ok:
            elsewhere_ok[key] = any(h not in mine_hosts and h not in key for h in up)
        return elsewhere_ok[key]

    # the movers near its hosts, per set of avoided hosts (the jobs of one selector share it),
    # computed once a pass: a mover added since (a slot it kept elsewhere) is missed, no more
    if (near := seen.get(job.avoid_hosts)) is None:
        near = seen[job.avoid_hosts] = sorted(
            (j for j in {j for h, js in keepers.items() if mine(h) for j in js} if can_go(j)), reverse=True
        )
    candidates = [j for j in near if j != i]

    # Hopeless (even every release and every movable slot on its hosts would leave it below its
    # minimum): its cap is lowered with nothing claimed or moved, so the pass goes on
    have = len(keeps[i]) + len(new[i])
    claimable = elsewhere = 0  # released slots on its hosts; on others (a mover may keep them)
    for h, n in released_on.items():
        left = max(0, n - claimed.get(h, 0))
        if mine(h):
            claimable += left
        else:
            elsewhere += left
    # each moved slot needs a slot off its hosts for the mover: free there, or released there
    room = free.total - avail + elsewhere
    lack = max(job.min_workers, 1) - (have + avail + claimable)
    if lack > 0:  # the movable slots on its hosts decide: counted up to what could cover it
        upto = min(lack, room)
        movable = 0
        for j in candidates:
            if movable >= upto:
                break
            movable += sum(1 for sl in keeps[j] if mine(sl[0]) and _may_leave(ordered[j], sl))
        if min(movable, room) < lack:
            return have + avail + claimable + min(movable, room)

    short = need - avail
    for h in sorted(h for h in released_on if mine(h)):
        if short == 0:
            break
        c = min(short, released_on[h] - claimed.get(h, 0))
        if c > 0:
            claimed[h] = claimed.get(h, 0) + c
            short -= c
    for j in candidates:  # lowest-ranked first
        if short == 0 or room == 0:
            break
        for s in sorted(sl for sl in keeps[j] if mine(sl[0]) and _may_leave(ordered[j], sl)):
            if short == 0 or room == 0 or not _replace(ordered[j], j, state, free, up, mine, mine_hosts):
                break
            room -= 1
            keeps[j].remove(s)
            releases[j].append(s)
            released_on[s[0]] = released_on.get(s[0], 0) + 1
            claimed[s[0]] = claimed.get(s[0], 0) + 1
            movers.setdefault(j, []).append(job.name)
            short -= 1
    if short > 0:
        return targets[i] - short
    free.take(avail, {}, job.avoid_hosts)  # held for it: no one else takes them in this plan
    return None


def _replace(other: Job, j: int, state, free: _FreeSlots, up, mine, mine_hosts: frozenset[str]) -> bool:
    """Give job ``j`` one slot in place of one it moves: a slot it was releasing on a host the
    restricted job may not use (it keeps it instead), else a free one there."""
    keeps, releases, new, released_on, claimed, _, keepers, _ = state
    for r in sorted(releases[j]):
        h = r[0]
        if (
            h in up
            and not mine(h)
            and h not in other.leave_hosts
            and 0 <= r[1] < up[h]
            and released_on[h] - claimed.get(h, 0) > 0
        ):
            releases[j].remove(r)
            keeps[j].append(r)
            keepers.setdefault(h, set()).add(j)
            released_on[h] -= 1
            return True
    avoid = other.avoid_hosts | mine_hosts if other.avoid_hosts else mine_hosts
    got = free.take(1, dict.fromkeys(h for h, _ in keeps[j] + new[j]), avoid)
    new[j].extend(got)
    return bool(got)


def outcome(
    job: Job, target: int, keep: list[Slot], new: list[Slot], release: list[Slot], moved: str, reason: str
) -> tuple[tuple[Slot, ...], TargetAction | None, str]:
    """A job's placements, action and final reason once its kept, new and released slots are known.

    Shared by both implementations, so they name every outcome the same way.
    """
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
    return placements, action, reason + moved


_SHARE_RULES = {"fairshare": _fair, "priority": _priority, "strict": _strict, "goodput": _goodput}
# Every policy packs new slots on few hosts; goodput also moves running jobs onto fewer.
PLAIN: dict[str, Policy] = {
    name: make_policy(fn, pack=True, moves=name == "goodput") for name, fn in _SHARE_RULES.items()
}
# The same rules placing first-fit in host-name order: what the vectorised path hands the rare
# snapshots it cannot place (a restricted job short on its hosts) on clusters too large for
# best fit's pass over the hosts per job.
FIRST_FIT: dict[str, Policy] = {name: make_policy(fn) for name, fn in _SHARE_RULES.items()}
