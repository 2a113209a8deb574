"""The scaling model: fitted from noisy measurements it recovers the curve that made them, a job
that stops gaining is modelled as flat, and an uncertain model promises one doubling at a time."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_ops.errors import SpecError
from elastic_ops.pool import Observation, PoolClient
from elastic_ops.pool.scaling import (
    PRIOR,
    Batching,
    BatchRows,
    GradStats,
    Measured,
    ScalingModel,
    best_batch,
    best_batches,
    best_batches_full,
    fit,
    gain,
    measured_from_rows,
)

from .builders import grant


def _truth(fixed=0.02, compute=1.0, local=0.03, local_per=0.004, net=0.08, net_per=0.01) -> ScalingModel:
    return ScalingModel((fixed, compute, local, local_per, net, net_per), None, 0, 0.0)


def _measure(model: ScalingModel, configs, rng: random.Random, noise: float = 0.05, reports: int = 10,
             iterations: int = 20):
    """What a job following ``model`` reports: per configuration, ``reports`` heartbeats of
    ``iterations`` each, every one's step time off by lognormal noise (the fit sums them)."""
    return [
        Measured(n, h, iterations, model.step_s(n, h) * iterations * rng.lognormvariate(0.0, noise))
        for n, h in configs
        for _ in range(reports)
    ]


@pytest.mark.parametrize("seed", range(10))
def test_a_fit_recovers_the_curve_that_made_noisy_measurements(seed):
    rng = random.Random(seed)
    truth = _truth()
    configs = [(1, 1), (2, 1), (3, 1), (4, 1), (6, 1), (8, 1), (16, 2), (24, 3), (32, 4)]
    model = fit(_measure(truth, configs, rng))
    assert model.explore_to is None  # many counts, a close fit: it extrapolates
    for n, h in [*configs, (12, 2), (48, 6)]:  # measured, between and beyond
        assert model.step_s(n, h) == pytest.approx(truth.step_s(n, h), rel=0.1)
        assert model.speedup(n, h) == pytest.approx(truth.speedup(n, h), rel=0.1)


def test_a_job_that_stops_gaining_is_modelled_flat():
    """Its step is dominated by synchronisation past 2 workers: more workers buy nothing."""
    rng = random.Random(1)
    flat = _truth(compute=1.0, local=0.45, local_per=0.12)
    model = fit(_measure(flat, [(1, 1), (2, 1), (4, 1)], rng, noise=0.03))
    assert model.speedup(2) == pytest.approx(flat.speedup(2), rel=0.1)
    assert model.speedup(4) < 1.15 * model.speedup(2)
    assert model.speedup(8) <= model.speedup(4)


def test_an_uncertain_model_promises_one_doubling_past_what_was_measured():
    rng = random.Random(2)
    truth = _truth()
    one = fit(_measure(truth, [(1, 1)], rng))
    assert one.explore_to == 2
    assert one.speedup(8) == one.speedup(2) > 1
    two = fit(_measure(truth, [(1, 1), (2, 1)], rng))
    assert two.explore_to == 4
    assert two.speedup(16) == two.speedup(4) > two.speedup(2)


def test_with_no_measurement_the_prior_speaks():
    model = fit([])
    assert model.measured == 0 and model.explore_to == 2
    assert model.params == PRIOR
    assert model.speedup(2) == pytest.approx(1.74, abs=0.01)
    unlimited = ScalingModel(model.params, None, 0, 0.0)
    assert unlimited.speedup(4) == pytest.approx(2.8, abs=0.05)
    assert unlimited.speedup(8) == pytest.approx(3.6, abs=0.05)
    assert unlimited.speedup(16, 2) == pytest.approx(3.2, abs=0.05)
    # a second host costs a little at first: the job tries it, and its measurement decides
    assert unlimited.speedup(8, 1) > unlimited.speedup(8, 2) > unlimited.speedup(4)


def test_one_configuration_sets_the_scale_and_leaves_the_shape_to_the_prior():
    model = fit([Measured(2, 1, 100, 30.0)])
    assert model.step_s(2, 1) == pytest.approx(0.3, rel=0.02)
    assert model.speedup(2) == pytest.approx(fit([]).speedup(2), rel=0.02)


def test_repeated_configurations_are_summed_and_empty_ones_ignored():
    a = fit([Measured(1, 1, 50, 5.0), Measured(1, 1, 50, 5.0), Measured(2, 1, 0, 0.0)])
    b = fit([Measured(1, 1, 100, 10.0)])
    assert a == b


def test_observation_rows_of_the_ledger_become_measurements():
    rows = [
        {"workers": 2, "hosts": 1, "batch": 0, "iterations": 40, "seconds": 8.0},
        {"workers": 4, "hosts": 2, "batch": 0, "iterations": 0, "seconds": 0.0},  # measured nothing
        {"workers": 4, "hosts": 1, "batch": 256, "iterations": 10, "seconds": 1.0},  # another batch
    ]
    assert measured_from_rows(rows) == [Measured(2, 1, 40, 8.0)]
    assert measured_from_rows(rows, batch=256) == [Measured(4, 1, 10, 1.0)]


def test_a_model_that_cannot_explain_its_measurements_keeps_them():
    """bert's shape (the traces): 3.85x on one host, 2.90x on two, 5.90x on three. No step of
    the model's form bends that way: the fit misses, and the measured configurations count as
    measured (shrunk by their weight: 1000 iterations, about 0.98); a fit that explains its
    measurements keeps no points."""
    bert = {(1, 1): 1.0, (4, 1): 1 / 3.85, (8, 2): 1 / 2.90, (11, 3): 1 / 5.90}
    model = fit([Measured(n, h, 1000, 1000 * s) for (n, h), s in bert.items()])
    assert model.error > 0.10 and {(n, h) for n, h, _ in model.points} == set(bert)
    assert model.speedup(11, 3) == pytest.approx(5.90, rel=0.05)
    assert model.speedup(11, 3) > model.speedup(4, 1) > model.speedup(8, 2)
    assert model.speedup(1, 1) == pytest.approx(1.0)
    linear = fit([Measured(n, 1, 1000, 1000 / n) for n in (1, 2, 4)])
    assert linear.error <= 0.10 and linear.points == ()


def test_a_spread_that_is_impossible_is_refused():
    with pytest.raises(ValueError, match="hosts=3"):
        fit([]).speedup(2, 3)


_config = st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, min(n, 8))))
_measured = st.builds(lambda c, it, s: Measured(c[0], c[1], it, s), _config, st.integers(1, 10_000),
                      st.floats(1e-3, 1e4))


@settings(max_examples=200, deadline=None)
@given(st.lists(_measured, max_size=8), _config)
def test_every_fit_is_a_usable_model(measured, probe):
    model = fit(measured)
    assert all(p >= 0 for p in model.params)
    assert model.speedup(1, 1) == pytest.approx(1.0)
    s = model.speedup(*probe)
    assert 0 < s < float("inf")
    assert fit(measured) == model  # same measurements, same model


def test_the_pool_fits_a_job_from_its_heartbeats(ledger_url, clock):
    """Two chunks of one job, at 1 and then 2 workers: the pool's model of it is what they measured."""
    pool = PoolClient(ledger_url, clock=clock, lease_ttl_s=60)
    pool.add_host("h0", 2)
    g = grant(pool, "a", max_workers=1)
    for _ in range(5):
        pool.heartbeat("a", g.epoch, workers=1, measured=Observation(iterations=10, seconds=2.0, workers=1))
    pool.release("a", g.epoch, handover=True)
    pool.set_bounds("a", 1, 2)
    g = pool.request("a")
    assert g.workers == 2
    for _ in range(5):
        pool.heartbeat("a", g.epoch, workers=2, measured=Observation(iterations=10, seconds=1.25, workers=2))
    model = pool.scaling("a")
    assert model.measured == 2 and model.explore_to == 4
    assert model.step_s(1) == pytest.approx(0.2, rel=0.02)
    assert model.speedup(2) == pytest.approx(1.6, rel=0.03)
    with pytest.raises(SpecError, match="batch=-1"):
        pool.scaling("a", batch=-1)
    pool.close()


# --- adaptive batch -------------------------------------------------------------------------


def test_a_fit_recovers_the_compute_term_from_measurements_at_several_batches():
    """The compute term grows with the per-worker batch: measurements at several batches fit
    one curve that predicts batches and counts never measured."""
    rng = random.Random(3)
    truth = _truth(fixed=0.05, compute=0.4)
    configs = [(1, 1, 1.0), (2, 1, 1.0), (4, 1, 2.0), (8, 1, 4.0), (16, 2, 4.0), (16, 2, 8.0), (32, 4, 8.0)]
    measured = [
        Measured(n, h, 20, truth.step_s(n, h, c) * 20 * rng.lognormvariate(0.0, 0.03), c)
        for n, h, c in configs for _ in range(10)
    ]
    model = fit(measured)
    for n, h, c in [*configs, (8, 1, 16.0), (24, 3, 2.0)]:
        assert model.step_s(n, h, c) == pytest.approx(truth.step_s(n, h, c), rel=0.1)


def test_the_gain_is_one_at_the_base_and_grows_towards_the_scale_while_the_gradient_is_noisy():
    noisy, clean = GradStats(sqr=1.0, var=1000.0), GradStats(sqr=1.0, var=0.01)
    assert gain(noisy, 1.0) == pytest.approx(1.0) and gain(clean, 1.0) == pytest.approx(1.0)
    assert 7.0 < gain(noisy, 8.0) <= 8.0  # var >> sqr: almost all of the batch counts
    assert 1.0 <= gain(clean, 8.0) < 1.02  # no noise to average away: a bigger batch buys nothing
    assert gain(noisy, 0.5) < 1.0  # a smaller batch makes less progress per iteration
    assert gain(None, 8.0) == 1.0  # not measured: no batch is worth more than the base


@given(st.floats(1e-6, 1e6), st.floats(0, 1e6), st.lists(st.floats(0.01, 100.0), min_size=2, max_size=8))
def test_the_gain_never_falls_as_the_batch_grows_nor_passes_the_scale(sqr, var, scales):
    stats = GradStats(sqr, var)
    gains = [gain(stats, s) for s in sorted(scales)]
    assert all(a <= b * (1 + 1e-12) for a, b in zip(gains, gains[1:], strict=False))
    assert all(g <= max(s, 1.0) * (1 + 1e-12) for g, s in zip(gains, sorted(scales), strict=True))


def test_best_batch_grows_the_batch_with_the_workers_when_the_gradient_is_noisy():
    model = _truth(fixed=0.05, compute=1.0)
    batching = Batching(base=64, most=4096, per_worker=4, least=16)
    noisy = GradStats(sqr=1.0, var=500.0)
    chosen = [best_batch(model, noisy, batching, n, max(1, n // 8))[0] for n in (1, 4, 16, 64)]
    assert chosen == sorted(chosen) and chosen[-1] > 64 * 4  # more workers, a larger batch
    speed = [best_batch(model, noisy, batching, n, max(1, n // 8))[1] for n in (1, 4, 16, 64)]
    fixed = [model.speedup(n, max(1, n // 8)) for n in (1, 4, 16, 64)]
    # the base is always a candidate
    assert all(s >= f * (1 - 1e-9) for s, f in zip(speed, fixed, strict=True))
    assert speed[-1] > 2 * fixed[-1]  # ... and on many workers a larger one buys much more
    # a gradient with no noise to average away: the least batch the workers allow
    assert best_batch(model, GradStats(1.0, 0.0), batching, 4)[0] == 16
    # statistics not known yet: the base, whatever the workers
    assert {best_batch(model, None, batching, n)[0] for n in (1, 8, 64)} == {64}


@given(st.integers(1, 64), st.integers(1, 8), st.integers(1, 512), st.integers(1, 8), st.integers(0, 64),
       st.floats(0.001, 1e4), st.floats(0, 1e4))
def test_best_batch_stays_within_what_the_job_allows(workers, hosts, base, per, per_most, sqr, var):
    hosts = min(hosts, workers)
    per_most = per_most and max(per_most, per)
    batching = Batching(base=base, most=base * 16, per_worker=per, least=max(1, base // 4),
                        per_worker_most=per_most)
    batch, speed = best_batch(_truth(), GradStats(sqr, var), batching, workers, hosts)
    assert speed > 0
    if batch != base:  # the base is always allowed; any other batch keeps every bound
        assert batching.lowest <= batch <= batching.most
        # the per-worker bounds, as far as the least and the most batch allow them
        assert batch >= min(workers * per, batching.most) - 1  # (rounded to a whole batch)
        assert not per_most or batch <= max(workers * per_most, batching.lowest) + 1


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_the_bracketed_batch_search_finds_what_weighing_every_candidate_finds(seed):
    """best_batches weighs a few grid points around the continuous optimum; on random jobs
    (models, noise scales from none to huge, unknown statistics, memory bounds, exploration
    limits, degenerate parameters) it picks the batch of the full grid and the same goodput."""
    rng = random.Random(seed)
    rows = []
    for _ in range(200):
        params = [rng.choice([0.0, rng.uniform(0, 0.2)]) for _ in range(6)]
        params[1] = rng.choice([0.0, rng.uniform(0.01, 2.0)])
        params[0] = rng.choice([params[0], rng.uniform(0.001, 0.5)])
        if params[0] + params[1] <= 0:
            params[0] = 0.1
        model = ScalingModel(tuple(params), rng.choice([None, rng.randint(1, 64)]), 0, 0.0)
        stats = rng.choice([None, GradStats(rng.choice([0.0, 10 ** rng.uniform(-3, 3)]),
                                            rng.choice([0.0, 10 ** rng.uniform(-3, 5)]))])
        base = rng.randint(1, 512)
        per = rng.randint(1, 16)
        batching = Batching(base=base, most=base * rng.choice([1, 2, 16, 64]), per_worker=per,
                            least=rng.choice([0, max(1, base // rng.randint(1, 8))]),
                            per_worker_most=rng.choice([0, per * rng.randint(1, 32)]))
        workers = rng.randint(1, 256)
        rows.append((model, stats, batching, workers, rng.randint(1, workers)))
    r = BatchRows.of(rows)
    fast, full = best_batches(r), best_batches_full(r)
    assert fast[1] == pytest.approx(full[1], rel=1e-12)
    for (model, stats, batching, n, h), a, b in zip(rows, fast[0].tolist(), full[0].tolist(), strict=True):
        if a != b:  # only where goodput is flat in the batch: candidates that tie within rounding
            n_eff = n if model.explore_to is None else min(n, model.explore_to)
            good = [gain(stats, x / batching.base) / model.step_s(n_eff, min(h, n_eff), x / batching.base)
                    for x in (a, b)]
            assert good[0] == pytest.approx(good[1], rel=1e-9)


@pytest.mark.parametrize("bad", [dict(base=0, most=8), dict(base=8, most=4), dict(base=8, most=16, least=9),
                                 dict(base=8, most=16, per_worker=0),
                                 dict(base=8, most=16, per_worker=4, per_worker_most=2)])
def test_a_batching_out_of_order_is_refused(bad):
    with pytest.raises(ValueError, match="need 1 <= least <= base <= most"):
        Batching(**bad)
