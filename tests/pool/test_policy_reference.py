"""The fast policies agree with the plain per-slot reference implementation, plan for plan.

The fast path changes the representation (job arrays, a free-slot bitmap, per-host cursors);
the reference walks every slot. Equal plans on random small snapshots, including ties, odd
orderings, unhealthy hosts and avoided hosts, mean the rewrite kept the semantics and the
tie-breaks, not just the invariants the other property tests check.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from elastic_ops.pool.policies import POLICIES

from .builders import shuffled_snapshots, snapshots
from .reference_policies import REFERENCE

SAME = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _assert_same_plan(snap):
    for name in sorted(POLICIES):
        fast, ref = POLICIES[name](snap), REFERENCE[name](snap)
        assert [d.job for d in fast.decisions] == [d.job for d in ref.decisions], name
        for got, want in zip(fast.decisions, ref.decisions, strict=True):
            assert got == want, f"{name}: {got} != {want}"


@SAME
@given(snap=shuffled_snapshots())
def test_fast_policies_match_the_reference_with_ties_and_odd_orders(snap):
    _assert_same_plan(snap)


@SAME
@given(snap=snapshots())
def test_fast_policies_match_the_reference(snap):
    _assert_same_plan(snap)
