"""Invariants every policy keeps, for any snapshot."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_ops.pool.model import HostState, Preemption, Snapshot, TargetAction
from elastic_ops.pool.policies import POLICIES, _small, order_key
from elastic_ops.pool.rules import retry_where_it_failed
from elastic_ops.pool.shares import weighted_fill

from .builders import large_snapshots, snapshots

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _up(snap: Snapshot) -> dict[str, int]:
    return {h.name: h.slots for h in snap.hosts if h.state == HostState.UP}


@PROPS
@given(snap=snapshots())
def test_no_slot_is_granted_twice(snap):
    for name in sorted(POLICIES):
        _check_no_slot_is_granted_twice(name, snap)


def _check_no_slot_is_granted_twice(name, snap):
    plan = POLICIES[name](snap)
    seen = {}
    holder = {sl: j.name for j in snap.jobs for sl in j.held}
    up = _up(snap)
    jobs = {j.name: j for j in retry_where_it_failed(snap).jobs}  # the hosts each avoids
    for d in plan.decisions:
        for sl in d.placements:
            assert sl not in seen, f"{sl} placed for {seen[sl]} and {d.job}"
            seen[sl] = d.job
            assert holder.get(sl, d.job) == d.job, f"{d.job} placed on {sl}, still held by {holder[sl]}"
            if sl not in jobs[d.job].held:  # a new grant: healthy host, in range, not avoided
                assert sl[0] in up and 0 <= sl[1] < up[sl[0]]
                assert sl[0] not in jobs[d.job].avoid_hosts
        assert set(d.release) == set(jobs[d.job].held) - set(d.placements)


@PROPS
@given(snap=snapshots())
def test_every_job_within_bounds_or_waiting(snap):
    for name in sorted(POLICIES):
        _check_every_job_within_bounds_or_waiting(name, snap)


def _check_every_job_within_bounds_or_waiting(name, snap):
    plan = POLICIES[name](snap)
    assert sorted(d.job for d in plan.decisions) == sorted(j.name for j in snap.jobs)
    jobs = {j.name: j for j in retry_where_it_failed(snap).jobs}  # the hosts each avoids
    for d in plan.decisions:
        j = jobs[d.job]
        assert d.target == 0 or j.min_workers <= d.target <= j.max_workers, d
        assert len(d.placements) <= d.target
        if d.target == 0 and j.held:
            assert d.action == TargetAction.PREEMPT
    assert sum(d.target for d in plan.decisions) <= sum(_up(snap).values())


@PROPS
@given(snap=snapshots())
def test_preemption_only_takes_from_lower_ranked_or_over_share_jobs(snap):
    for name in sorted(POLICIES):
        _check_preemption_only_takes_from_lower_ranked_or_over_share_jobs(name, snap)


def _check_preemption_only_takes_from_lower_ranked_or_over_share_jobs(name, snap):
    plan = POLICIES[name](snap)
    up = _up(snap)
    capacity = sum(up.values())
    by = plan.by_job()
    jobs = {j.name: j for j in retry_where_it_failed(snap).jobs}  # the hosts each avoids
    frozen = {d.job for d in plan.decisions if d.reason.startswith("keeps")}
    for x in snap.jobs:
        held_up = sum(1 for h, _ in x.held if h in up and h not in x.leave_hosts)  # what it may keep
        target = by[x.name].target
        if target >= held_up or not x.min_workers <= held_up <= x.max_workers:
            continue  # nothing taken (or its own bounds changed: it must be resized anyway)
        assert x.preemptible and snap.config.preemption == Preemption.GRACEFUL, by[x.name]
        if target > 0:
            assert target >= x.min_workers  # a shrink never goes below the minimum
            continue
        # Fully preempted: its minimum did not fit next to the jobs that rank above it.
        above = sum(
            (by[y].target if y in frozen else jobs[y].min_workers)
            for y in by
            if by[y].target > 0 and (y in frozen or order_key(jobs[y], snap) < order_key(x, snap))
        )
        avoided = sum(up.get(h, 0) for h in x.avoid_hosts)
        assert above + x.min_workers > capacity or x.min_workers > capacity - avoided, by[x.name]


@PROPS
@given(snap=snapshots(), seed=st.integers(0, 2**16))
def test_same_snapshot_same_plan_in_any_order(snap, seed):
    for name in sorted(POLICIES):
        _check_same_snapshot_same_plan_in_any_order(name, snap, seed)


def _check_same_snapshot_same_plan_in_any_order(name, snap, seed):
    rng = random.Random(seed)
    jobs, hosts = list(snap.jobs), list(snap.hosts)
    rng.shuffle(jobs)
    rng.shuffle(hosts)
    shuffled = Snapshot(tuple(hosts), tuple(jobs), snap.now, snap.config)
    plan = POLICIES[name](snap)
    assert plan == POLICIES[name](snap)
    assert plan.by_job() == POLICIES[name](shuffled).by_job()


@PROPS
@given(snap=snapshots(preemption=Preemption.NONE))
def test_preemption_none_never_shrinks_a_running_job(snap):
    for name in POLICIES:
        by = POLICIES[name](snap).by_job()
        up = _up(snap)
        for j in snap.jobs:
            held_up = sum(1 for h, _ in j.held if h in up and h not in j.leave_hosts)  # leaving is no shrink
            if j.min_workers <= held_up <= j.max_workers:
                assert by[j.name].target >= held_up, by[j.name]


@PROPS
@given(snap=snapshots())
def test_a_job_said_to_keep_what_it_holds_is_given_exactly_that(snap):
    for name in POLICIES:
        for d in POLICIES[name](snap).decisions:
            if d.reason.startswith("keeps "):
                assert d.target == int(d.reason.split()[1].rstrip(":")), (name, d)


LARGE = settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))


@LARGE
@given(snap=large_snapshots())
def test_the_invariants_hold_at_the_sizes_the_vectorised_policies_decide(snap):
    assert not _small(snap)  # these snapshots reach the vectorised path, not the plain one
    for name in sorted(POLICIES):
        _check_no_slot_is_granted_twice(name, snap)
        _check_every_job_within_bounds_or_waiting(name, snap)
        _check_preemption_only_takes_from_lower_ranked_or_over_share_jobs(name, snap)
    _check_same_snapshot_same_plan_in_any_order("goodput", snap, 7)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_weighted_fill_is_weighted_max_min_fair(data):
    n = data.draw(st.integers(1, 8))
    mins = data.draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    caps = [m + data.draw(st.integers(0, 6)) for m in mins]
    w = data.draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
    capacity = data.draw(st.integers(sum(mins), sum(caps) + 3))
    out = weighted_fill(mins, caps, w, capacity)
    assert sum(out) == min(capacity, sum(caps))
    assert all(lo <= o <= hi for lo, o, hi in zip(mins, out, caps, strict=True))
    # No unit could move from one job to another and make the smaller weighted share larger.
    for j in range(n):
        for k in range(n):
            if out[j] < caps[j] and out[k] > mins[k]:
                assert (out[k] - 1) / w[k] <= (out[j] + 1) / w[j] + 1e-9


@PROPS
@given(snap=snapshots())
def test_no_plan_keeps_or_gives_a_slot_on_a_host_its_job_must_leave(snap):
    """Hosts outside a job's selector (``leave_hosts``): what it holds there is released, nothing
    new is taken there, and the slots stay taken until released (nobody else is given them)."""
    for name in POLICIES:
        plan = POLICIES[name](snap)
        jobs = {j.name: j for j in retry_where_it_failed(snap).jobs}  # the hosts each avoids
        leaving = {s for j in snap.jobs for s in j.held if s[0] in j.leave_hosts}
        for d in plan.decisions:
            j = jobs[d.job]
            assert not {h for h, _ in d.placements} & j.leave_hosts, d
            assert {s for s in j.held if s[0] in j.leave_hosts} <= set(d.release), d
            assert not (set(d.placements) - set(j.held)) & leaving, d  # not handed to another job yet
