"""The allocation rules (elastic_ops.pool.rules): each written once, the same on one job's values
and on columns of many."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_ops.pool.model import PolicyConfig, Preemption
from elastic_ops.pool.plain_policies import PLAIN
from elastic_ops.pool.policies import POLICIES, VECTORISED
from elastic_ops.pool.rules import FREEZE_RULES, Change, freeze_reason, may_freeze, retry_where_it_failed

from .builders import make_job, make_snapshot


def test_a_job_avoids_the_host_that_failed_it_while_others_can_hold_its_minimum():
    snap = make_snapshot(hosts=(("a", 4), ("b", 4)), jobs=[make_job("j", 2, 4, avoid_hosts=frozenset({"a"}))])
    assert retry_where_it_failed(snap) is snap
    assert {h for h, _ in POLICIES["priority"](snap)["j"].placements} == {"b"}


def test_a_job_is_retried_where_it_failed_when_no_other_host_can_hold_its_minimum():
    # one lost worker on a one-host pool must not make the job wait forever
    snap = make_snapshot(hosts=(("a", 4), ("b", 1)), jobs=[make_job("j", 2, 4, avoid_hosts=frozenset({"a"}))])
    assert retry_where_it_failed(snap).jobs[0].avoid_hosts == frozenset()
    d = POLICIES["priority"](snap)["j"]
    assert d.target >= 2 and "a" in {h for h, _ in d.placements}


def test_hosts_outside_a_selector_stay_avoided_even_when_the_job_must_wait():
    job = make_job("j", 4, 4, avoid_hosts=frozenset({"a", "b"}), leave_hosts=frozenset({"b"}))
    snap = make_snapshot(hosts=(("a", 4), ("b", 4)), jobs=[job])
    assert retry_where_it_failed(snap).jobs[0].avoid_hosts == frozenset({"b"})
    assert POLICIES["fairshare"](snap)["j"].placements == (("a", 0), ("a", 1), ("a", 2), ("a", 3))


def _configs():
    return st.builds(
        PolicyConfig,
        preemption=st.sampled_from(list(Preemption)),
        min_rescale_interval_s=st.sampled_from([0.0, 60.0]),
        min_gain=st.sampled_from([0.0, 0.25, 0.5]),
    )


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 9), st.integers(0, 9), st.booleans(), st.none() | st.floats(900, 1000),
                  st.booleans(), st.integers(1, 3), st.integers(3, 9)),
        min_size=1, max_size=30,
    ),
    cfg=_configs(),
)
def test_each_freeze_rule_means_the_same_on_one_job_and_on_columns(rows, cfg):
    now = 1000.0
    held, target, pinned, last, above, mins, maxs = (list(c) for c in zip(*rows, strict=True))
    last = [math.nan if x is None else x for x in last]
    cols = Change(np.array(held), np.array(target), np.array(pinned), np.array(last), np.array(above))
    with np.errstate(invalid="ignore", divide="ignore"):
        cand = may_freeze(Change(cols.held, cols.target, None, None, None), np.array(mins), np.array(maxs))
        masks = [np.asarray(rule.holds(cols, cfg, now)) & cand for rule in FREEZE_RULES]
    for i in range(len(rows)):
        one = Change(held[i], target[i], pinned[i], last[i], above[i])
        assert bool(may_freeze(one, mins[i], maxs[i])) == bool(cand[i])
        first = next((r for r, m in zip(FREEZE_RULES, masks, strict=True) if m[i]), None)
        why = freeze_reason(one, cfg, now) if cand[i] else None
        assert why == (None if first is None else first.text(one, cfg, now))


def test_a_job_moving_off_a_draining_host_keeps_its_old_slots_until_its_minimum_fits():
    # A holds one slot on the up host and one on the draining one; the slot it needs on the up
    # host is B's, released at B's next boundary: A keeps its draining slot until then
    snap = make_snapshot(
        hosts=(("u", 3), ("d", 2, "draining")),
        jobs=[
            make_job("A", 2, 2, priority=5, held=[("u", 2), ("d", 0)]),
            make_job("B", 1, 1, held=[("u", 0), ("u", 1)]),
        ],
    )
    for policies in (PLAIN, VECTORISED):
        d = policies["priority"](snap)["A"]
        assert set(d.placements) == {("u", 2), ("d", 0)} and d.release == (), d
        assert d.reason.endswith("; keeps 1 old slots until its minimum fits on up hosts"), d
        assert policies["priority"](snap)["B"].release == (("u", 1),)
