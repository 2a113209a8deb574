"""The tenant step of a decision (elastic_ops.pool.tenants): guarantees, borrowing of idle
capacity, maxima and reclaim, on both implementations."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_ops.pool import tenants
from elastic_ops.pool.model import Host, Job, PolicyConfig, Preemption, Snapshot, Tenant
from elastic_ops.pool.plain_policies import PLAIN
from elastic_ops.pool.policies import VECTORISED

from .builders import large_snapshots, make_job, snapshots

PROPS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = ("vision", "nlp", "rec")


def _divide(g, limit, w, floor, cap):
    a = lambda x: np.array(x, dtype=np.int64)  # noqa: E731
    return tenants.divide(a(g), a(limit), np.array(w, dtype=float), a(floor), cap).tolist()


def test_divide_guarantees_then_idle_lent_by_weight_up_to_each_limit():
    # 16 slots; a guaranteed 8 uses 2: its 6 idle and the 4 nobody is guaranteed are lent 1:2
    assert _divide([8, 4, 0], [2, 20, 20], [1, 1, 2], [0, 0, 0], 16) == [2, 4 + 3, 7]
    assert _divide([8, 4, 0], [2, 5, 20], [1, 1, 2], [0, 0, 0], 16) == [2, 5, 9]  # the limit holds
    # guarantees over the capacity: cut in proportion to them
    assert _divide([12, 12], [12, 12], [1, 1], [0, 0], 12) == [6, 6]
    # what frozen jobs keep is a floor, even past a guarantee
    assert _divide([8, 8], [16, 16], [1, 1], [10, 0], 16) == [10, 6]


def _snap(jobs, tenants_, hosts=(("h0", 8), ("h1", 8)), **config):
    hs = tuple(Host(n, s) for n, s in hosts)
    return Snapshot(hs, tuple(jobs), 1_000.0, PolicyConfig(**config), tuple(tenants_))


TWO = (Tenant("vision", 8), Tenant("nlp", 8))


def _both(snap):
    plain = PLAIN["priority"](snap)
    assert VECTORISED["priority"](snap) == plain
    return plain


def test_a_tenant_borrows_the_idle_tenants_guarantee_and_gives_it_back_by_graceful_shrinks():
    # nlp alone: it borrows everything
    p = _both(_snap([make_job("n1", 1, 16, tenant="nlp")], TWO))
    assert p["n1"].target == 16
    assert p["n1"].reason.endswith("tenant nlp borrows 8 idle slots (guaranteed 8)")
    held = p["n1"].placements
    # vision submits (ranked below: priority 1 against nlp's 5): nlp shrinks to its guarantee at its
    # next boundary, however min_gain would judge the shrink
    jobs = [make_job("n1", 1, 16, priority=5, tenant="nlp", held=held, last_rescale=0.0),
            make_job("v1", 2, 16, tenant="vision", submitted=999.0)]
    p = _both(_snap(jobs, TWO, min_gain=0.9, min_rescale_interval_s=60.0))
    assert (p["n1"].target, p["n1"].action.value) == (8, "shrink")
    assert p["n1"].reason == "share 8 of 8; reclaimed for tenant vision (guaranteed 8, using 0)"
    assert p["v1"].target == 8 and not p["v1"].placements  # it waits for the slots nlp releases
    assert "waiting for 8 slots to be released" in p["v1"].reason
    assert not set(p["n1"].placements) & set(p["n1"].release)


def test_reclaim_waits_at_most_one_rescale_interval():
    held = tuple(("h0", i) for i in range(8)) + tuple(("h1", i) for i in range(8))
    jobs = [make_job("n1", 1, 16, tenant="nlp", held=held, last_rescale=990.0),
            make_job("v1", 2, 16, tenant="vision", submitted=999.0)]
    p = _both(_snap(jobs, TWO, min_rescale_interval_s=60.0))
    assert p["n1"].target == 16 and p["n1"].reason.startswith("keeps 16: rescaled 10s ago")
    assert "tenant vision gets 0 of its guaranteed 8" in p["v1"].reason
    later = dataclasses.replace(_snap(jobs, TWO, min_rescale_interval_s=60.0), now=1_050.0)
    assert _both(later)["n1"].target == 8  # 60 s after its last rescale


def test_a_tenant_never_holds_more_than_its_max_even_when_jobs_may_not_shrink():
    capped = (Tenant("vision", 0, max_slots=6), Tenant("nlp", 0))
    p = _both(_snap([make_job("v1", 1, 16, tenant="vision"), make_job("v2", 1, 16, tenant="vision")], capped))
    assert p["v1"].target + p["v2"].target == 6
    assert "tenant vision at its max 6" in p["v1"].reason
    held = tuple(("h0", i) for i in range(8))  # a max lowered below what it holds
    jobs = [make_job("v1", 1, 16, tenant="vision", held=held, preemptible=False, last_rescale=999.0)]
    assert _both(_snap(jobs, capped, min_rescale_interval_s=60.0))["v1"].target == 6


def test_one_tenant_decides_as_without_tenants():
    jobs = [make_job("a", 1, 8, priority=3), make_job("b", 2, 8, submitted=1.0)]
    plain = _snap(jobs, ())
    for listed in ((), (Tenant("default", 4),), (Tenant("default", 0, max_slots=16),)):
        snap = dataclasses.replace(plain, tenants=listed)
        assert PLAIN["priority"](snap) == PLAIN["priority"](plain) == VECTORISED["priority"](snap)


@st.composite
def tenant_snapshots(draw, large=False, fair=False):
    """A snapshot whose jobs belong to up to three tenants with guarantees (summing to at most
    the up slots: see the property), maxima and weights. ``fair``: graceful preemption, no
    anti-thrashing, every job preemptible and free to use every host."""
    base = draw(large_snapshots() if large else snapshots())
    up = sum(h.slots for h in base.hosts if h.state == "up")
    shares = draw(st.lists(st.integers(0, max(up, 0)), min_size=3, max_size=3))
    scale = max(sum(shares), 1)
    listed = tuple(
        Tenant(n, shares[k] * up // scale if sum(shares) > up else shares[k],
               draw(st.none() | st.integers(1, max(up, 1) + 4)), float(draw(st.integers(1, 3))))
        for k, n in enumerate(NAMES)
    )
    jobs = []
    for j in base.jobs:
        j = dataclasses.replace(j, tenant=draw(st.sampled_from(NAMES)))
        if fair:
            j = dataclasses.replace(j, preemptible=True, avoid_hosts=frozenset(), leave_hosts=frozenset())
        jobs.append(j)
    config = base.config
    if fair:
        config = dataclasses.replace(config, preemption=Preemption.GRACEFUL, min_rescale_interval_s=0.0,
                                     min_gain=0.0)
    return dataclasses.replace(base, jobs=tuple(jobs), tenants=listed, config=config)


def _same(snap):
    for name in VECTORISED:
        assert VECTORISED[name](snap) == PLAIN[name](snap), name


@PROPS
@given(tenant_snapshots())
def test_both_implementations_agree_with_tenants(snap):
    _same(snap)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tenant_snapshots(large=True))
def test_both_implementations_agree_with_tenants_on_large_snapshots(snap):
    _same(snap)


def _used(snap: Snapshot, plan) -> dict[str, int]:
    out = dict.fromkeys(NAMES, 0)
    for j in snap.jobs:
        out[j.tenant] += plan[j.name].target
    return out


@PROPS
@given(tenant_snapshots(fair=True), st.sampled_from(["fairshare", "priority", "strict", "goodput"]))
def test_no_tenant_above_its_max(snap, policy):
    plan = PLAIN[policy](snap)
    used = _used(snap, plan)
    for t in snap.tenants:
        assert t.max_slots is None or used[t.name] <= t.max_slots, (t, used)


def _cap(job: Job, snap: Snapshot) -> int:
    return min(job.max_workers, sum(h.slots for h in snap.hosts if h.state == "up"))


@PROPS
@given(tenant_snapshots(fair=True), st.sampled_from(["fairshare", "priority", "strict"]))
def test_no_tenant_below_its_guarantee_with_demand_while_another_borrows(snap, policy):
    """Borrowing only from idle capacity: a tenant below its guarantee (and max) whose jobs could
    use more (a job below its cap that runs, or one waiting whose minimum fits in what its
    guarantee has left) means no other tenant holds more than its own guarantee in the plan."""
    plan = (PLAIN if len(snap.jobs) <= 48 else VECTORISED)[policy](snap)
    used = _used(snap, plan)
    g = {t.name: t.guaranteed for t in snap.tenants}
    most = {t.name: min(t.guaranteed, t.max_slots or t.guaranteed) for t in snap.tenants}
    for t in NAMES:
        room = most[t] - used[t]  # below its guarantee, and its max lets it have more
        if room <= 0:
            continue
        wanting = [j for j in snap.jobs if j.tenant == t and plan[j.name].target < _cap(j, snap)
                   and (plan[j.name].target > 0 or j.min_workers <= room)]
        if wanting:
            assert all(used[u] <= g[u] for u in NAMES if u != t), (t, used, g, wanting)


@PROPS
@given(tenant_snapshots(fair=True), st.sampled_from(["fairshare", "priority", "strict"]))
def test_after_one_rescale_interval_no_tenant_waits_for_a_borrower(snap, policy):
    """With anti-thrashing on, one ``min_rescale_interval_s`` after every job's last rescale
    (the reclaim time) the guarantee property holds as without it."""
    cfg = dataclasses.replace(snap.config, min_rescale_interval_s=60.0)
    later = dataclasses.replace(snap, config=cfg, now=snap.now + 60.0)
    test_no_tenant_below_its_guarantee_with_demand_while_another_borrows.hypothesis.inner_test(later, policy)
