"""Host-aware targets and placement: jobs restricted to some hosts (a selector, hosts they avoid
after failures) next to jobs that may use any host; and the weighted fill's exact ties."""

from __future__ import annotations

from elastic_ops.pool.plain_policies import PLAIN
from elastic_ops.pool.policies import VECTORISED

from .builders import make_job, make_snapshot


def _both(name, snap):
    """The plan of policy ``name`` from both implementations, checked equal."""
    ref, fast = PLAIN[name](snap), VECTORISED[name](snap)
    assert fast == ref
    assert (fast.target, fast.action, fast.reason) == (ref.target, ref.action, ref.reason)
    return ref


def test_an_exact_tie_of_remainders_goes_to_the_higher_ranked_job():
    # shares 10/3, 4/3, 4/3 of 6 (weights 5:2:2): every remainder is exactly 1/3 and the leftover
    # slot goes to the first in rank, A (float noise used to give it to B)
    snap = make_snapshot(
        hosts=(("h0", 6),),
        jobs=[
            make_job("A", 3, 6, priority=5, submitted=0.0),
            make_job("B", 1, 4, priority=2, submitted=1.0),
            make_job("C", 1, 2, priority=2, submitted=2.0),
        ],
    )
    assert _both("priority", snap).targets() == {"A": 4, "B": 1, "C": 1}
