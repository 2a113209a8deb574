"""What each policy decides on small, readable snapshots."""

from __future__ import annotations

import numpy as np
import pytest

from elastic_ops.errors import SpecError, UnknownPolicyError
from elastic_ops.pool import shares
from elastic_ops.pool.model import PolicyConfig, TargetAction
from elastic_ops.pool.plain_policies import PLAIN
from elastic_ops.pool.policies import VECTORISED, decide, effective_priority, get_policy
from elastic_ops.pool.shares import weighted_fill

from .builders import make_snapshot


def slots(host, *idx):
    return tuple((host, i) for i in idx)


def targets(snap, policy):
    return decide(snap, policy).targets()


def test_fairshare_is_max_min_fair_within_bounds():
    snap = make_snapshot(
        hosts=[("h0", 10)],
        jobs=[dict(name="a", max_workers=2), dict(name="b", max_workers=8), dict(name="c", max_workers=8)],
    )
    assert targets(snap, "fairshare") == {"a": 2, "b": 4, "c": 4}


def test_priority_shares_follow_the_weights():
    snap = make_snapshot(jobs=[dict(name="a", priority=3), dict(name="b", priority=5, submitted=1)])
    assert targets(snap, "priority") == {"a": 3, "b": 5}
    assert targets(snap, "fairshare") == {"a": 4, "b": 4}


def test_strict_serves_higher_classes_first_and_minimums_to_all():
    snap = make_snapshot(
        hosts=[("h0", 10)],
        jobs=[
            dict(name="hi", priority=9, max_workers=6),
            dict(name="lo1", priority=1, min_workers=2, max_workers=8),
            dict(name="lo2", priority=1, min_workers=1, max_workers=8, submitted=1),
        ],
    )
    assert targets(snap, "strict") == {"hi": 6, "lo1": 2, "lo2": 2}


def test_gang_a_job_starts_only_when_its_minimum_fits():
    snap = make_snapshot(
        hosts=[("h0", 8)],
        jobs=[dict(name="big", priority=5, min_workers=6), dict(name="wide", min_workers=4, submitted=1)],
    )
    plan = decide(snap, "priority").by_job()
    assert plan["big"].target == 8 and plan["wide"].target == 0
    assert "does not fit" in plan["wide"].reason and plan["wide"].action is None


def test_ties_break_by_submission_then_name():
    jobs = [
        dict(name=n, min_workers=3, max_workers=3, submitted=s) for n, s in (("b", 0), ("a", 0), ("c", -1))
    ]
    assert targets(make_snapshot(hosts=[("h0", 6)], jobs=jobs), "fairshare") == {"c": 3, "a": 3, "b": 0}


def test_aging_lets_a_starved_waiting_job_overtake():
    running = dict(name="run", priority=2, min_workers=8, held=slots("h0", *range(8)))
    waiting = dict(name="wait", priority=1, min_workers=8, submitted=0.0, waiting_since=0.0)
    young = make_snapshot(jobs=[running, waiting], now=100.0, aging_s=600)
    old = make_snapshot(jobs=[running, waiting], now=1300.0, aging_s=600)
    assert targets(young, "priority") == {"run": 8, "wait": 0}
    assert effective_priority(old.jobs[1], old.now, 600) == 1 + 2  # two whole aging periods
    plan = decide(old, "priority").by_job()
    assert plan["run"].action == TargetAction.PREEMPT and plan["wait"].target == 8


@pytest.mark.parametrize("policy", ["priority", "fairshare", "strict"])
def test_two_gang_jobs_of_equal_priority_take_turns_instead_of_swapping_at_every_boundary(policy):
    """Each needs the whole pool. A waiting job overtakes the running one only after waiting a
    whole aging period; with fractional aging it did so at once, and they preempted each other
    at every heartbeat."""
    running = dict(name="a", min_workers=8, max_workers=8, held=slots("h0", *range(8)))
    waiting = dict(name="b", min_workers=8, max_workers=8, submitted=0.0, waiting_since=0.0)
    for waited, runner in ((1.0, "a"), (599.0, "a"), (601.0, "b")):
        snap = make_snapshot(jobs=[running, waiting], now=waited, aging_s=600)
        plan = decide(snap, policy).by_job()
        assert (plan["a"].target, plan["b"].target) == ((8, 0) if runner == "a" else (0, 8)), (policy, waited)


def test_graceful_shrink_keeps_slots_until_released_and_the_newcomer_waits():
    snap = make_snapshot(jobs=[dict(name="a", held=slots("h0", *range(8))), dict(name="b", submitted=5)])
    plan = decide(snap, "priority").by_job()
    assert plan["a"].action == TargetAction.SHRINK and len(plan["a"].release) == 4
    assert plan["b"].target == 4 and plan["b"].placements == () and "released" in plan["b"].reason


def test_preemption_none_and_non_preemptible_jobs_keep_their_slots():
    held = dict(name="a", held=slots("h0", *range(8)))
    for snap in (
        make_snapshot(jobs=[held, dict(name="b", priority=9)], preemption="none"),
        make_snapshot(jobs=[dict(held, preemptible=False), dict(name="b", priority=9)]),
    ):
        plan = decide(snap, "priority").by_job()
        assert plan["a"].target == 8 and plan["a"].action == TargetAction.KEEP
        assert plan["b"].target == 0


@pytest.mark.parametrize("rule", ["not preemptible", "preemption none", "rescaled"])
@pytest.mark.parametrize("n", [6, 9, 40])
@pytest.mark.parametrize("policy", ["priority", "fairshare", "strict"])
def test_a_long_chain_of_jobs_that_may_not_shrink_keeps_every_one_of_them(policy, n, rule):
    """``n`` equal running jobs fill the pool and a higher-priority job arrives: each freeze
    shrinks the next job, one a round (a probe found the 6th one preempted with "keeps 2")."""
    extra = {"not preemptible": dict(preemptible=False), "rescaled": dict(last_rescale=990.0)}.get(rule, {})
    running = [dict(name=f"r{i:02d}", min_workers=1, max_workers=2, held=slots("h0", 2 * i, 2 * i + 1),
                    submitted=float(i), **extra) for i in range(n)]
    config = {"preemption none": dict(preemption="none"), "rescaled": dict(min_rescale_interval_s=60)}
    snap = make_snapshot(hosts=[("h0", 2 * n)], jobs=[*running, dict(name="vip", max_workers=2, priority=5,
                         submitted=999.0)], now=1000.0, **config.get(rule, {}))
    for plan in (VECTORISED[policy](snap), PLAIN[policy](snap)):
        by = plan.by_job()
        for r in running:
            d = by[r["name"]]
            assert (d.target, d.action, d.release) == (2, TargetAction.KEEP, ()), d
            assert d.reason.startswith("keeps 2: "), d
        assert by["vip"].target == 0, by["vip"]


@pytest.mark.parametrize("policy", ["priority", "fairshare", "strict"])
@pytest.mark.parametrize("rule", ["not preemptible", "preemption none", "rescaled"])
def test_a_job_that_may_not_shrink_whose_max_is_lowered_shrinks_to_that_max_only(policy, rule):
    """Holding 8 with max lowered to 7 (or 6) it lost every protection: preempted to 0 for a
    waiting job, or shrunk to a fair share of 4 (a probe)."""
    extra = {"not preemptible": dict(preemptible=False), "rescaled": dict(last_rescale=990.0)}.get(rule, {})
    config = {"preemption none": dict(preemption="none"), "rescaled": dict(min_rescale_interval_s=60)}
    for new_max in (7, 6):
        a = dict(name="a", min_workers=4, max_workers=new_max, held=slots("h0", *range(8)), **extra)
        snap = make_snapshot(jobs=[a, dict(name="b", min_workers=1, max_workers=8, priority=10)],
                             now=1000.0, **config.get(rule, {}))
        for plan in (VECTORISED[policy](snap), PLAIN[policy](snap)):
            d = plan.by_job()["a"]
            assert d.target == new_max and d.reason.startswith(f"keeps {new_max}: "), d
            assert len(d.release) == 8 - new_max, d
            assert plan.by_job()["b"].target == 8 - new_max


def test_anti_thrashing_interval_and_min_gain():
    recent = dict(name="a", held=slots("h0", *range(8)), last_rescale=990.0)
    snap = make_snapshot(jobs=[recent, dict(name="b")], now=1000.0, min_rescale_interval_s=60)
    plan = decide(snap, "priority").by_job()
    assert plan["a"].target == 8 and "rescaled 10s ago" in plan["a"].reason and plan["b"].target == 0
    later = make_snapshot(jobs=[recent, dict(name="b")], now=1100.0, min_rescale_interval_s=60)
    assert targets(later, "priority") == {"a": 4, "b": 4}
    # 8 -> 7 is a 12.5% change: below a 25% threshold it is skipped.
    small = make_snapshot(
        hosts=[("h0", 9)],
        jobs=[dict(name="a", held=slots("h0", *range(8))), dict(name="b", max_workers=2)],
        min_gain=0.25, aging_s=0,  # b does not outrank a
    )
    assert targets(small, "fairshare") == {"a": 8, "b": 1}


@pytest.mark.parametrize("policy", ["priority", "fairshare", "strict"])
def test_min_gain_never_keeps_a_job_that_outranks_the_runner_waiting_for_good(policy):
    """A 1-slot job next to an 8-slot one on 8 slots: the runner's shrink is a 12 % change,
    below min_gain 0.3. Once the waiting job outranks the runner (aging), it gets in."""
    running = dict(name="r", held=slots("h0", *range(8)), max_workers=8)
    waiting = dict(name="w", min_workers=1, max_workers=1, submitted=0.0, waiting_since=0.0)
    young = make_snapshot(hosts=[("h0", 8)], jobs=[running, waiting], now=10.0, aging_s=600, min_gain=0.3)
    assert targets(young, policy) == {"r": 8, "w": 0}  # not yet ranked above r: it waits
    old = make_snapshot(hosts=[("h0", 8)], jobs=[running, waiting], now=36_000.0, aging_s=600, min_gain=0.3)
    assert targets(old, policy) == {"r": 7, "w": 1}


def test_draining_host_gets_no_grants_and_its_jobs_move_off():
    snap = make_snapshot(
        hosts=[("h0", 4, "draining"), ("h1", 4)],
        jobs=[
            dict(name="a", max_workers=4, held=slots("h0", 0, 1)),
            dict(name="b", max_workers=4, submitted=1),
        ],
    )
    plan = decide(snap, "fairshare").by_job()
    assert all(h == "h1" for d in plan.values() for h, _ in d.placements)
    assert set(plan["a"].release) == set(slots("h0", 0, 1)) and "moving off" in plan["a"].reason
    assert plan["a"].target + plan["b"].target == 4


def test_avoid_hosts_are_respected_and_cap_the_share():
    snap = make_snapshot(hosts=[("h0", 4), ("h1", 4)], jobs=[dict(name="a", avoid_hosts=frozenset({"h0"}))])
    plan = decide(snap, "priority").by_job()
    assert plan["a"].target == 4 and {h for h, _ in plan["a"].placements} == {"h1"}


def test_weighted_fill_rounds_deterministically_and_sums_to_capacity():
    assert weighted_fill([1, 1, 1], [8, 8, 8], [1, 1, 1], 8) == [3, 3, 2]
    assert weighted_fill([1, 1], [2, 8], [5, 1], 8) == [2, 6]


@pytest.mark.parametrize("seed", range(4))
def test_weighted_fill_shares_as_a_search_over_every_breakpoint_does(seed, monkeypatch):
    # the share narrows the price by bisection before it sorts the breakpoints left; with no
    # narrowing it sorts them all: the same shares, thousands of distinct weights or a few
    rng = np.random.default_rng(seed)
    cases = []
    for k in range(150):
        n = int(rng.integers(1, 3000 if k % 3 == 0 else 40))
        lo = rng.integers(0, 5, n)
        hi = lo + rng.integers(0, 30, n)
        w = rng.integers(1, 4, n).astype(float) if k % 2 else rng.uniform(0.01, 5.0, n)
        cases.append((lo, hi, w, int(rng.integers(lo.sum(), hi.sum() + 2))))
    narrowed = [shares.weighted_fill_array(*c) for c in cases]
    monkeypatch.setattr(shares, "NARROW_STEPS", 0)
    for case, got in zip(cases, narrowed, strict=True):
        lo, hi, _, capacity = case
        assert np.array_equal(got, shares.weighted_fill_array(*case))
        assert int(got.sum()) == min(capacity, int(hi.sum())) and (lo <= got).all() and (got <= hi).all()


def test_invalid_policy_inputs_get_clear_errors():
    with pytest.raises(UnknownPolicyError, match="'best'.*fairshare, goodput, priority, strict"):
        get_policy("best")
    with pytest.raises(SpecError, match="preemption='always'"):
        PolicyConfig(preemption="always")
    with pytest.raises(SpecError, match="min_gain=-1"):
        PolicyConfig(min_gain=-1)
    # a tiny aging_s overflowed the ranking (1e-320) or ranked differently in the two
    # implementations (1e-9); NaN compared false to every bound
    for tiny in (1e-320, 1e-9, 0.5):
        with pytest.raises(SpecError, match=rf"aging_s={tiny!r}: must be 0 \(no aging\) or >= 1 second"):
            PolicyConfig(aging_s=tiny)
    with pytest.raises(SpecError, match="min_rescale_interval_s=nan: must be a finite number >= 0"):
        PolicyConfig(min_rescale_interval_s=float("nan"))
    assert PolicyConfig(aging_s=0).aging_s == 0 and PolicyConfig(aging_s=1).aging_s == 1


def test_a_plan_builds_decisions_on_demand_and_lists_the_jobs_whose_slots_change():
    snap = make_snapshot(
        hosts=[("h0", 4), ("h1", 4)],
        jobs=[
            dict(name="keeps", max_workers=2, held=slots("h0", 0, 1)),
            dict(name="grows", max_workers=3, held=slots("h0", 2), submitted=1),
            dict(name="new", max_workers=2, submitted=2),
        ],
        aging_s=0,
    )
    for policy in ("fairshare", "priority", "strict"):
        plan = get_policy(policy)(snap)
        assert [plan.jobs[k] for k in plan.changed()] == ["grows", "new"]
        assert plan["keeps"] == plan.get("keeps") == plan.decision(plan.index("keeps"))
        assert plan["keeps"].placements == slots("h0", 0, 1) and plan["keeps"].action == TargetAction.KEEP
        grows = plan.index("grows")
        assert plan.slots.new(grows) == slots("h0", 3) + slots("h1", 0)  # own host first
        assert plan.slots.placements(grows) == slots("h0", 2, 3) + slots("h1", 0)
        assert plan.slots.new(plan.index("new")) == slots("h1", 1, 2)
        assert plan.get("nobody") is None
        with pytest.raises(KeyError):
            plan["nobody"]
        assert plan.targets() == {"keeps": 2, "grows": 3, "new": 2}
        assert plan == get_policy(policy)(snap) and plan.by_job() == {d.job: d for d in plan.decisions}
