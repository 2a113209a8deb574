"""The goodput policy: shares by measured speed-up, restarts weighed, jobs packed on few hosts."""

from __future__ import annotations

import dataclasses
import random
import types

import numpy as np
import pytest

from elastic_ops.pool import Grant, PoolClient, goodput, policies
from elastic_ops.pool.model import Observation, Snapshot
from elastic_ops.pool.plain_policies import PLAIN
from elastic_ops.pool.policies import POLICIES
from elastic_ops.pool.scaling import Batching, GradStats, Measured, ScalingModel, best_batch, fit

from .builders import make_job, make_snapshot

GOODPUT = POLICIES["goodput"]
# certain models (explore_to None): one that scales linearly, one flat past 2 workers
LINEAR = ScalingModel((0.0, 1.0, 0.0, 0.0, 0.0, 0.0), None, 3, 0.0)
FLAT_PAST_2 = ScalingModel((0.5, 1.0, 0.0, 0.0, 0.0, 0.0), None, 3, 0.0)  # 1.5 s, 1.0 s, 0.83 s ...
_PRIOR = fit(())  # a job that measured nothing


def _slots(host, n, start=0):
    return [(host, i) for i in range(start, start + n)]


def test_the_seed_scenario_holds_under_goodput_for_jobs_that_scale_alike():
    # 8 slots: job1 alone -> 8; job2 at the same priority -> 4/4; job2's priority 3 -> 5 -> 3/5;
    # job1 gone -> 8 (rescale cost 0: the shares alone, as the seed scenario asks)
    def plan(jobs):
        return GOODPUT(make_snapshot(hosts=(("h0", 8),), jobs=jobs, rescale_cost_s=0.0)).targets()

    one = make_job("job1", 1, 8, priority=3, scaling=LINEAR, submitted=0.0)
    assert plan([one]) == {"job1": 8}
    two = make_job("job2", 1, 8, priority=3, scaling=LINEAR, submitted=30.0)
    assert plan([one, two]) == {"job1": 4, "job2": 4}
    raised = make_job("job2", 1, 8, priority=5, scaling=LINEAR, submitted=30.0)
    assert plan([one, raised]) == {"job1": 3, "job2": 5}
    assert plan([raised]) == {"job2": 8}


def test_a_job_that_stops_gaining_is_not_grown_while_one_that_scales_takes_the_rest():
    snap = make_snapshot(
        hosts=(("h0", 8),), rescale_cost_s=0.0,
        jobs=[make_job("flat", 1, 8, scaling=FLAT_PAST_2, submitted=0.0),
              make_job("scales", 1, 8, scaling=LINEAR, submitted=1.0)],
    )
    targets = GOODPUT(snap).targets()
    assert targets["flat"] < targets["scales"] and targets["flat"] + targets["scales"] == 8
    assert POLICIES["fairshare"](snap).targets() == {"flat": 4, "scales": 4}  # weights alone


def test_free_slots_no_job_gains_from_stay_free():
    useless = ScalingModel((1.0, 0.0, 0.0, 0.0, 0.0, 0.0), None, 3, 0.0)  # no faster on more workers
    snap = make_snapshot(hosts=(("h0", 8),), jobs=[make_job("a", 1, 8, scaling=useless)])
    assert GOODPUT(snap).targets() == {"a": 1}


def test_idle_slots_let_a_job_try_twice_the_most_it_has_measured():
    # the model (fitted on 1..4 workers) says a second host is a loss; the pool is idle, so
    # the job is lent 8 to measure once -- and no more than it may use
    flat_past_4 = ScalingModel((0.0, 1.0, 0.0, 0.0, 1.0, 0.0), None, 3, 0.0, 4)
    job = make_job("a", 1, 16, scaling=flat_past_4, held=_slots("h0", 4), submitted=0.0)
    snap = make_snapshot(hosts=(("h0", 4), ("h1", 4), ("h2", 4), ("h3", 4)), jobs=[job], rescale_cost_s=0.0)
    assert GOODPUT(snap).targets() == {"a": 8}
    tried = dataclasses.replace(job, scaling=dataclasses.replace(flat_past_4, largest=16))
    assert GOODPUT(dataclasses.replace(snap, jobs=(tried,))).targets()["a"] <= 16
    capped = dataclasses.replace(job, max_workers=4)
    assert GOODPUT(dataclasses.replace(snap, jobs=(capped,))).targets() == {"a": 4}


def test_multi_host_jobs_get_whole_hosts():
    # two linear jobs on three 4-slot hosts: fairshare splits 6 / 6 (each on two part-used
    # hosts); goodput gives whole hosts
    snap = make_snapshot(
        hosts=(("h0", 4), ("h1", 4), ("h2", 4)), rescale_cost_s=0.0,
        jobs=[make_job("a", 1, 12, scaling=LINEAR, submitted=0.0),
              make_job("b", 1, 12, scaling=LINEAR, submitted=1.0)],
    )
    assert POLICIES["fairshare"](snap).targets() == {"a": 6, "b": 6}
    plan = GOODPUT(snap)
    assert sorted(plan.targets().values()) == [4, 8]
    for d in plan.decisions:
        assert len({h for h, _ in d.placements}) == d.target // 4


def test_a_grow_that_does_not_pay_back_its_restart_is_skipped():
    # a young job on 7 of 8 slots: the 8th worker saves under 2 % of its run -- less than the
    # 30 s stall over its expected 600 s; free restarts take it
    job = make_job("a", 1, 8, scaling=LINEAR, held=_slots("h0", 7), submitted=900.0)
    costly = make_snapshot(hosts=(("h0", 8),), jobs=[job], now=1000.0, rescale_cost_s=120.0)
    assert GOODPUT(costly).targets() == {"a": 7}
    free = make_snapshot(hosts=(("h0", 8),), jobs=[job], now=1000.0, rescale_cost_s=0.0)
    assert GOODPUT(free).targets() == {"a": 8}
    old = make_snapshot(hosts=(("h0", 8),), jobs=[make_job("a", 1, 8, scaling=LINEAR, held=_slots("h0", 7),
                                                              submitted=-100_000.0)],
                        now=1000.0, rescale_cost_s=120.0)
    assert GOODPUT(old).targets() == {"a": 8}  # a long run pays the stall back


def test_a_grow_is_counted_over_the_time_since_the_job_was_last_reshaped():
    # the long run above, reshaped 100 s ago: its new allocation is expected to last about as
    # long as the last one did (5 min at least), too short for the 8th worker to pay 120 s back
    job = make_job("a", 1, 8, scaling=LINEAR, held=_slots("h0", 7), submitted=-100_000.0, last_rescale=900.0)
    snap = make_snapshot(hosts=(("h0", 8),), jobs=[job], now=1000.0, rescale_cost_s=120.0)
    assert GOODPUT(snap).targets() == PLAIN["goodput"](snap).targets() == {"a": 7}
    settled = dataclasses.replace(job, last_rescale=-50_000.0)
    snap = dataclasses.replace(snap, jobs=(settled,))
    assert GOODPUT(snap).targets() == PLAIN["goodput"](snap).targets() == {"a": 8}


def test_a_newcomer_is_placed_on_as_few_hosts_as_it_fits():
    # h0 and h1 have 2 and 4 slots free: first-fit by name would split a 4-worker job 2 + 2;
    # every policy packs it on h1 alone
    snap = make_snapshot(
        hosts=(("h0", 4), ("h1", 4), ("h2", 4)), rescale_cost_s=0.0,
        jobs=[make_job("old", 2, 2, held=_slots("h0", 2), scaling=LINEAR, submitted=0.0),
              make_job("full", 4, 4, held=_slots("h2", 4), scaling=LINEAR, submitted=1.0),
              make_job("new", 4, 4, scaling=LINEAR, submitted=2.0)],
    )
    assert {h for h, _ in GOODPUT(snap)["new"].placements} == {"h1"}
    for name in POLICIES:
        assert {h for h, _ in POLICIES[name](snap)["new"].placements} == {"h1"}, name


def test_a_growing_job_moves_onto_fewer_hosts_when_it_restarts_anyway():
    # "a" holds 2 on h0 (full); growing to 4 next to it would spread it over two hosts, while
    # h1 is empty: it moves there and gives its h0 slots back
    snap = make_snapshot(
        hosts=(("h0", 4), ("h1", 4)), rescale_cost_s=0.0,
        jobs=[make_job("a", 1, 4, held=_slots("h0", 2), scaling=LINEAR, submitted=0.0),
              make_job("b", 2, 2, held=_slots("h0", 2, 2), scaling=FLAT_PAST_2, submitted=1.0)],
    )
    d = GOODPUT(snap)["a"]
    assert d.target == 4 and {h for h, _ in d.placements} == {"h1"} and set(d.release) == set(_slots("h0", 2))
    assert "packed onto fewer hosts" in d.reason


SPREAD_SLOW = ScalingModel((0.0, 1.0, 0.0, 0.0, 1.0, 0.0), None, 3, 0.0)  # 4 workers: 0.25 s, 2 hosts: 1.25 s


def _spread(scaling: ScalingModel, cost: float = 30.0, **job) -> Snapshot:
    """"a" (4 workers) spread 2 + 2 over h0 and h1, each shared with a 2-worker job; h2 free."""
    return make_snapshot(
        hosts=(("h0", 4), ("h1", 4), ("h2", 4)), now=10_000.0, min_rescale_interval_s=60.0,
        rescale_cost_s=cost,
        jobs=[make_job("a", 4, 4, held=_slots("h0", 2) + _slots("h1", 2), scaling=scaling,
                       **{"submitted": 0.0, **job}),
              make_job("b", 2, 2, held=_slots("h0", 2, 2), scaling=LINEAR, submitted=1.0),
              make_job("c", 2, 2, held=_slots("h1", 2, 2), scaling=LINEAR, submitted=2.0)],
    )


def test_a_spread_job_moves_onto_fewer_hosts_when_the_spread_costs_more_than_the_move():
    d = GOODPUT(_spread(SPREAD_SLOW))["a"]
    assert d.target == 4 and {h for h, _ in d.placements} == {"h2"}
    assert set(d.release) == set(_slots("h0", 2) + _slots("h1", 2)) and "moved onto fewer hosts" in d.reason
    assert GOODPUT(_spread(SPREAD_SLOW)) == GOODPUT(_spread(SPREAD_SLOW))  # a pure function of the snapshot


def test_a_spread_job_stays_where_it_is_when_the_move_does_not_pay():
    # its model says the spread costs nothing
    assert {h for h, _ in GOODPUT(_spread(LINEAR))["a"].placements} == {"h0", "h1"}
    # it gains, but only 1 % over the 300 s a young job is expected to run: less than the restart
    mild = ScalingModel((0.0, 1.0, 0.0, 0.0, 0.0025, 0.0), None, 3, 0.0)
    assert {h for h, _ in GOODPUT(_spread(mild, submitted=9_900.0))["a"].placements} == {"h0", "h1"}
    assert {h for h, _ in GOODPUT(_spread(mild, cost=0.0, submitted=9_900.0))["a"].placements} == {"h2"}
    # a move is a rescale for the rules: not right after one, nor for a job that is not preemptible
    for job in ({"last_rescale": 9_990.0}, {"preemptible": False}):
        d = GOODPUT(_spread(SPREAD_SLOW, **job))["a"]
        assert {h for h, _ in d.placements} == {"h0", "h1"} and not d.release, job


def test_at_cluster_size_the_move_searches_go_to_jobs_one_host_can_hold():
    # pairs of full 4-slot hosts, each pair shared by two spread jobs that no host can hold
    # whole (ranked first), more of them than one decision searches for; then "z", spread over
    # h_a and h_b, where h_a has room for all of it: z moves there
    pairs = max(policies.MOVE_SEARCHES // 2 + 4, policies.SMALL_CLUSTER[1] // 2 + 1)  # the vectorised path
    hosts = [(f"h{k:03d}", 4) for k in range(2 * pairs)] + [("h_a", 4), ("h_b", 4)]
    jobs = []
    for k in range(pairs):
        one, two = f"h{2 * k:03d}", f"h{2 * k + 1:03d}"
        for name, start in ((f"s{k:03d}", 0), (f"t{k:03d}", 2)):
            jobs.append(make_job(name, 4, 4, priority=2, held=_slots(one, 2, start) + _slots(two, 2, start),
                                 scaling=SPREAD_SLOW, submitted=0.0))
    jobs.append(make_job("z", 4, 4, held=_slots("h_a", 2) + _slots("h_b", 2), scaling=SPREAD_SLOW,
                         submitted=1.0))
    jobs.append(make_job("y", 2, 2, held=_slots("h_b", 2, 2), scaling=LINEAR, submitted=2.0))
    snap = make_snapshot(hosts=hosts, jobs=jobs, now=10_000.0, rescale_cost_s=30.0)
    plan = GOODPUT(snap)
    assert {h for h, _ in plan["z"].placements} == {"h_a"} and "moved onto fewer hosts" in plan["z"].reason
    assert not any(plan[j.name].release for j in jobs if j.name != "z")


# bert's shape: a misfit model, which keeps its measured points
BERT = fit([Measured(n, h, 1000, 1000 * s) for (n, h), s in
            {(1, 1): 1.0, (4, 1): 1 / 3.85, (8, 2): 1 / 2.90, (11, 3): 1 / 5.90}.items()])


def test_the_vectorised_move_check_agrees_with_move_pays_for_every_host_count():
    """moves_that_pay (one pass over every candidate and host count) decides as move_pays does
    job by job: models that fit and misfit ones (measured points), adaptive jobs, young and old."""
    from elastic_ops.pool.goodput import move_pays, moves_that_pay

    assert BERT.points
    rng = random.Random(3)
    for _ in range(4):
        base = _adaptive_snapshot(rng, 60, 16, 4)
        jobs = tuple(dataclasses.replace(j, scaling=rng.choice([None, LINEAR, SPREAD_SLOW, BERT]),
                                         submitted=rng.uniform(0.0, base.now)) for j in base.jobs)
        snap = dataclasses.replace(base, jobs=jobs)
        rows = np.arange(len(jobs))
        workers = np.array([rng.randint(1, 16) for _ in jobs])
        hosts_now = np.array([rng.randint(1, w) for w in workers.tolist()])
        cost = np.array([rng.choice([0.0, 30.0]) for _ in jobs])
        pays, at, least = moves_that_pay(snap, rows, workers, hosts_now, cost)
        for k, job in enumerate(jobs):
            for h in range(int(least[k]), int(hosts_now[k]) + 1):
                want = move_pays(job, int(workers[k]), int(hosts_now[k]), h, snap.now, float(cost[k]))
                assert bool(pays[at[k] + h - least[k]]) == want, (job.name, workers[k], hosts_now[k], h)


def _random_snapshot(rng: random.Random, n_jobs: int, n_hosts: int, per_host: int) -> Snapshot:
    slots = [(f"h{i:03d}", s) for i in range(n_hosts) for s in range(per_host)]
    rng.shuffle(slots)
    jobs, cursor = [], 0
    for k in range(n_jobs):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 24)
        n_held = rng.choice([0, 0, lo, rng.randint(lo, hi)])
        held = tuple(sorted(slots[cursor:cursor + n_held])) if cursor + n_held <= len(slots) else ()
        cursor += len(held)
        mild = ScalingModel((0.05, 0.9, 0.05, 0.01, 0.08, 0.01), rng.choice([None, 4, 8]), 2, 0.05)
        model = rng.choice([None, LINEAR, FLAT_PAST_2, mild])
        jobs.append(make_job(f"j{k}", lo, hi, priority=rng.randint(1, 5), held=held, scaling=model,
                             attained=rng.uniform(0, 50_000), submitted=rng.uniform(0, 9_000)))
    hosts = tuple((f"h{i:03d}", per_host) for i in range(n_hosts))
    return make_snapshot(hosts=hosts, jobs=jobs, now=10_000.0)


@pytest.mark.parametrize("seed", range(3))
def test_the_share_solver_finds_the_price_as_a_bisection_over_every_job_does(seed, monkeypatch):
    # after a few bisections the solver searches only the jobs whose pick still moves; curves
    # with dips, holes (sizes a multi-host job cannot take) and ties, thousands of jobs or a few
    rng = np.random.default_rng(seed)
    cases = []
    for k in range(100):
        n = int(rng.integers(1, 2000 if k % 4 == 0 else 60))
        sizes = rng.integers(1, 40, n)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        seg = np.repeat(np.arange(n), sizes)
        offs = np.arange(int(sizes.sum())) - starts[seg]
        curve = rng.uniform(0.5, 4, n)[seg] * np.log1p(rng.uniform(0.2, 1.0, n)[seg] * offs)
        curve -= (rng.random(len(offs)) < 0.1) * rng.uniform(0, 0.5, len(offs))
        if k % 3 == 0:
            curve = np.round(curve, 2)
        hole = (rng.random(len(offs)) < 0.15) & (offs > 0)
        c = types.SimpleNamespace(sizes=sizes, starts=starts, lo=rng.integers(0, 3, n),
                                  packable=np.where(hole, -np.inf, curve))
        idx = np.arange(n) if k % 2 else np.sort(rng.choice(n, max(1, n // 2), replace=False))
        cases.append((c, idx, int(c.lo[idx].sum() + rng.integers(0, sizes[idx].sum()))))
    narrowed = [goodput._solve(*case) for case in cases]
    monkeypatch.setattr(goodput, "NARROW_AFTER", goodput.BISECTIONS)
    for (c, idx, capacity), got in zip(cases, narrowed, strict=True):
        assert np.array_equal(got, goodput._solve(c, idx, capacity))
        assert int(got.sum()) <= capacity
        assert (c.lo[idx] <= got).all() and (got <= c.lo[idx] + c.sizes[idx] - 1).all()


@pytest.mark.parametrize("size", [(12, 4, 4), (60, 16, 4), (400, 100, 8)])
def test_goodput_plans_keep_the_invariants_at_small_and_large_sizes(size):
    rng = random.Random(sum(size))
    for _ in range(5):
        snap = _random_snapshot(rng, *size)
        plan = GOODPUT(snap)
        assert plan == GOODPUT(snap)  # the same plan for the same snapshot
        jobs = {j.name: j for j in snap.jobs}
        taken: dict = {}
        for d in plan.decisions:
            job = jobs[d.job]
            assert d.target == 0 or job.min_workers <= d.target <= job.max_workers, d
            assert len(d.placements) <= d.target
            for sl in d.placements:
                assert sl not in taken or taken[sl] == d.job, (sl, d.job, taken[sl])  # no slot twice
                taken[sl] = d.job
            assert set(d.release) <= set(job.held)
        held_by = {sl: j.name for j in snap.jobs for sl in j.held}
        for sl, owner in taken.items():  # a new slot is free or given back by its holder
            assert held_by.get(sl, owner) == owner or sl in set(plan[held_by[sl]].release)
        capacity = sum(h.slots for h in snap.hosts)
        assert sum(plan.targets().values()) <= capacity


def test_the_plain_and_vectorised_goodput_give_the_same_targets():
    from elastic_ops.pool.policies import _SHARES, make_policy

    vectorised = make_policy(_SHARES["goodput"])  # the vectorised path at every size
    rng = random.Random(7)
    for _ in range(5):
        snap = _random_snapshot(rng, 40, 10, 4)
        assert vectorised(snap).targets() == PLAIN["goodput"](snap).targets()


def _adaptive_snapshot(rng: random.Random, n_jobs: int, n_hosts: int, per_host: int) -> Snapshot:
    """A random snapshot with about half its jobs adaptive (some without gradients yet)."""
    base = _random_snapshot(rng, n_jobs, n_hosts, per_host)
    jobs = []
    for j in base.jobs:
        if rng.random() < 0.5:
            lo = rng.choice([8, 32, 128])
            j = dataclasses.replace(
                j, batching=Batching(base=lo * 2, most=lo * 64, per_worker=rng.choice([1, 2]), least=lo,
                                     per_worker_most=rng.choice([0, 64])),
                grad=rng.choice([None, GradStats(1.0, rng.uniform(0, 1e4))]))
        jobs.append(j)
    return dataclasses.replace(base, jobs=tuple(jobs))


def test_the_plain_and_vectorised_goodput_give_the_same_targets_with_adaptive_jobs():
    from elastic_ops.pool.policies import _SHARES, make_policy

    vectorised = make_policy(_SHARES["goodput"])
    rng = random.Random(11)
    for _ in range(5):
        snap = _adaptive_snapshot(rng, 40, 10, 4)
        assert vectorised(snap).targets() == PLAIN["goodput"](snap).targets()


def test_each_adaptive_jobs_batch_is_the_best_on_its_target_and_the_hosts_of_its_slots():
    rng = random.Random(5)
    for _ in range(3):
        snap = _adaptive_snapshot(rng, 400, 100, 8)  # the vectorised path
        plan = GOODPUT(snap)
        jobs = {j.name: j for j in snap.jobs}
        for k, name in enumerate(plan.jobs):
            j, n = jobs[name], plan.target[k]
            if j.batching is None or n == 0:
                continue
            hosts = max(1, len({h for h, _ in plan.slots.placements(k)}))
            want = best_batch(j.scaling or _PRIOR, j.grad, j.batching, n, min(hosts, n))[0]
            assert plan.batch_of(k) == want, (j, n, hosts)


def test_the_rescale_cost_is_a_pool_setting_the_plans_use(ledger_url, clock, monkeypatch):
    from elastic_ops.errors import SpecError
    from elastic_ops.pool import ledger as ledger_module

    pool = PoolClient(ledger_url, clock=clock, policy="goodput")
    assert pool.status()["settings"]["rescale_cost_s"] == 30.0
    assert pool.configure(rescale_cost_s=120)["rescale_cost_s"] == 120
    for bad in (-1, float("nan"), "30"):
        with pytest.raises(SpecError, match="rescale_cost_s"):
            pool.configure(rescale_cost_s=bad)
    seen = []
    real = ledger_module.get_policy
    def spy(name):
        return lambda snap: seen.append(snap) or real(name)(snap)

    monkeypatch.setattr(ledger_module, "get_policy", spy)
    pool.add_host("h", 4)
    pool.submit("a", min_workers=1, max_workers=4)
    assert isinstance(pool.request("a"), Grant)
    assert seen and all(s.config.rescale_cost_s == 120 for s in seen)


def test_on_the_real_ledger_the_job_that_scales_poorly_ends_with_fewer_workers(ledger_url, clock):
    # two jobs report what they measured with their heartbeats: "linear" runs an iteration in
    # 8/n s, "poor" in 4 + 4/n s. "poor" runs alone first (it grows, measuring each size), then
    # "linear" arrives; the planner fits both and shares the 8 slots by what they gain
    pool = PoolClient(ledger_url, clock=clock, policy="goodput", preemption="graceful")
    pool.add_host("gpu-0", 8)
    step = {"poor": lambda n: 4.0 + 4.0 / n, "linear": lambda n: 8.0 / n}
    epochs, workers = {}, {}

    def start(name):
        pool.submit(name, min_workers=1, max_workers=8)
        g = pool.request(name)
        while not isinstance(g, Grant):  # it waits for slots the other gives up at a boundary
            beat_all(1)
            g = pool.request(name)
        epochs[name], workers[name] = g.epoch, g.workers

    def beat_all(rounds):
        for _ in range(rounds):  # 60 s of training at the current size, then follow the target
            clock.advance(60)
            for name in list(epochs):
                n = workers[name]
                measured = Observation(iterations=max(1, round(60 / step[name](n))), seconds=60.0, workers=n)
                workers[name] = pool.heartbeat(name, epochs[name], workers=n, measured=measured).workers
            pool.plan()

    start("poor")
    beat_all(10)
    start("linear")
    beat_all(30)
    final = {j["name"]: j["workers"] for j in pool.status()["jobs"]}
    assert final["poor"] < final["linear"] and sum(final.values()) <= 8, final
    assert pool.scaling("poor").speedup(8) < pool.scaling("linear").speedup(8)


# --- adaptive batch -------------------------------------------------------------------------

NOISY = GradStats(sqr=1.0, var=400.0)  # a larger batch averages much noise away
# certain, with a real fixed cost and ring: on a fixed batch it stops gaining past a few workers
RING = ScalingModel((0.05, 1.0, 0.05, 0.01, 0.08, 0.02), None, 3, 0.0)


def _adaptive(name, submitted=0.0, **kw):
    kw.setdefault("grad", NOISY)
    return make_job(name, 1, 16, scaling=RING, submitted=submitted,
                    batching=Batching(base=64, most=4096, per_worker=2, least=16), **kw)


def test_an_adaptive_job_with_a_noisy_gradient_gets_the_workers_a_fixed_batch_would_waste():
    snap = make_snapshot(hosts=tuple((f"h{i}", 4) for i in range(4)), rescale_cost_s=0.0,
                         jobs=[_adaptive("adaptive"), make_job("fixed", 1, 16, scaling=RING, submitted=0.0)])
    plan = GOODPUT(snap)
    targets = plan.targets()
    assert targets["adaptive"] > targets["fixed"] and sum(targets.values()) <= 16
    k = plan.index("adaptive")
    assert plan.batch_of(k) > 64 * 2  # on its workers a larger batch than its own
    assert plan.batch_of(plan.index("fixed")) == 0  # a fixed job's batch is its own
    assert plan == GOODPUT(snap)  # the same plan, batches included, for the same snapshot


def test_an_adaptive_job_trains_at_its_own_batch_until_its_gradients_are_measured():
    snap = make_snapshot(hosts=(("h0", 8),), rescale_cost_s=0.0, jobs=[_adaptive("a", grad=None)])
    plan = GOODPUT(snap)
    assert plan.batch_of(plan.index("a")) == 64
    assert plan.targets() == GOODPUT(make_snapshot(hosts=(("h0", 8),), rescale_cost_s=0.0, jobs=[
        make_job("a", 1, 16, scaling=RING, submitted=0.0)])).targets()  # and is shared as a fixed one


def test_plans_without_adaptive_jobs_choose_no_batch():
    snap = make_snapshot(hosts=(("h0", 8),), jobs=[make_job("a", 1, 8, scaling=LINEAR)])
    assert GOODPUT(snap).batch == () and POLICIES["fairshare"](snap).batch == ()


@pytest.mark.parametrize("size", [(12, 4, 4), (400, 100, 8)])
def test_adaptive_batches_stay_within_what_each_job_allows(size):
    rng = random.Random(size[0])
    for _ in range(3):
        snap = _adaptive_snapshot(rng, *size)
        plan = GOODPUT(snap)
        assert plan == GOODPUT(snap)
        for k, name in enumerate(plan.jobs):
            j = next(x for x in snap.jobs if x.name == name)
            b = plan.batch_of(k)
            if j.batching is None or plan.target[k] == 0:
                assert b == 0
            else:
                assert b == j.batching.base or j.batching.lowest <= b <= j.batching.most, (j, b)
                if j.grad is None:
                    assert b == j.batching.base


def test_on_the_real_ledger_an_adaptive_jobs_heartbeats_carry_the_batch_the_plan_chose(ledger_url, clock):
    """An adaptive job reports its gradient statistics with its measurements; its targets carry
    the batch of most goodput on its workers (its own until the statistics are known, kept
    across chunks), a fixed job's none. Its step: 0.5 s + 4 s per 64 samples over n workers."""
    pool = PoolClient(ledger_url, clock=clock, policy="goodput", rescale_cost_s=0.0)
    for i in range(4):
        pool.add_host(f"h{i}", 4)
    pool.submit("adaptive", min_workers=1, max_workers=16,
                batching={"base": 64, "most": 4096, "per_worker": 2, "least": 16})
    pool.submit("fixed", min_workers=1, max_workers=16)
    leases = {name: pool.request(name) for name in ("adaptive", "fixed")}
    assert all(isinstance(g, Grant) for g in leases.values())
    now = {name: (g.workers, 0) for name, g in leases.items()}  # (workers, batch) each runs
    seen = []
    for r in range(8):
        clock.advance(60)
        for name, g in leases.items():
            n, batch = now[name]
            local = (batch or 64) / n
            iters = max(1, round(60 / (0.5 + 4.0 * local / 64)))
            grads = dict(grad_sqr=1.0, grad_var=400.0) if name == "adaptive" and r >= 1 else {}
            measured = Observation(iters, 60.0, n, min(n, 1 + (n - 1) // 4), batch, **grads)
            t = pool.heartbeat(name, g.epoch, workers=n, measured=measured)
            now[name] = (t.workers, t.batch)
            seen.append((name, r, t.batch))
        pool.plan()
    assert {b for name, _, b in seen if name == "fixed"} == {0}
    first = [b for name, r, b in seen if name == "adaptive" and r <= 1]
    assert first[0] == 64  # no statistics yet: its own batch
    assert now["adaptive"][1] > 64 * 2  # a noisy gradient on many workers: a larger batch
    assert now["adaptive"][1] <= 4096
    # a new chunk (a new lease) keeps what the job measured: the plan does not forget its batch
    pool.release("adaptive", leases["adaptive"].epoch, handover=True)
    again = pool.request("adaptive", new_attempt=True)
    assert isinstance(again, Grant)
    t = pool.heartbeat("adaptive", again.epoch, workers=again.workers)
    assert t.batch > 64 * 2


@pytest.mark.parametrize("bad, says", [
    ({"base": 64}, "needs base and most"),
    ({"base": 64, "most": 32}, "need 1 <= least <= base <= most"),
    ({"base": 64, "most": 128, "size": 3}, "an unknown field"),
    ({"base": "64", "most": 128}, "batching.base"),
    ("64..128", "must be a Batching"),
])
def test_a_bad_batching_is_refused_naming_it(tmp_path, bad, says):
    from elastic_ops.errors import SpecError

    pool = PoolClient(f"sqlite:///{tmp_path}/l.db")
    with pytest.raises(SpecError, match=says):
        pool.submit("a", min_workers=1, max_workers=4, batching=bad)


def test_gradient_statistics_come_in_pairs_of_finite_numbers(tmp_path, clock):
    from elastic_ops.errors import SpecError

    pool = PoolClient(f"sqlite:///{tmp_path}/l.db", clock=clock)
    pool.add_host("h", 4)
    pool.submit("a", min_workers=1, max_workers=4)
    g = pool.request("a")
    for bad, says in [(dict(grad_sqr=1.0), "both gradient statistics"),
                      (dict(grad_sqr=1.0, grad_var=float("nan")), "measured.grad_var"),
                      (dict(grad_sqr=-1.0, grad_var=1.0), "measured.grad_sqr")]:
        with pytest.raises(SpecError, match=says):
            pool.heartbeat("a", g.epoch, workers=g.workers, measured=Observation(10, 1.0, g.workers, **bad))
