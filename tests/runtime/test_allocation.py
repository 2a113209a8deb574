"""``Allocation``: one value for the pool's target, whichever way it travels (the lease, the
runner, the agents' wire)."""

from __future__ import annotations

import pytest

from elastic_ops.runtime.allocation import Allocation

GRANT = Allocation(3, (("b", 2), ("a", 0), ("b", 5)))


def test_the_slots_split_by_host_in_the_pools_order():
    assert GRANT.on("a") == (0,) and GRANT.on("b") == (2, 5) and GRANT.on("c") == ()
    assert GRANT.elsewhere("a") == (("b", (2, 5)),)
    assert GRANT.elsewhere("b") == (("a", (0,)),)


@pytest.mark.parametrize("host", ["a", "b"])
@pytest.mark.parametrize("spans", [True, False])
def test_the_wire_form_comes_back_as_the_same_slots_the_receiver_can_use(host, spans):
    wire = GRANT.to_wire(host, spans=spans)
    back = Allocation.split(wire["workers"], host, wire["slots"], wire.get("spans"))
    assert back.workers == 3 and back.on(host) == GRANT.on(host)
    assert back.elsewhere(host) == (GRANT.elsewhere(host) if spans else ())
    assert ("spans" in wire) is spans  # only a node leading across hosts is sent the others' slots


def test_a_bare_count_carries_no_slots_and_sends_null():
    bare = Allocation(2)
    assert bare.placements is None and bare.on("a") == () and bare.to_wire("a", spans=False) == {
        "workers": 2, "slots": None}
    assert Allocation.split(2, "a", None, (("b", (1,)),)) == bare
    assert Allocation(0, ()) != bare  # known to hold nothing (a preemption) is not "unknown"


def test_a_new_count_keeps_the_slots():
    assert GRANT.with_workers(1) == Allocation(1, GRANT.placements)
