"""An adaptive job (``scaling: adaptive``) in the runtime: it follows the batch the pool chose at
iteration boundaries without a relaunch, advances its iteration counter by the AdaScale gain,
reports its gradient statistics, and a run resumed from a checkpoint continues the same
trajectory (bitwise mode: the same for any worker schedule)."""

from __future__ import annotations

import random

import pytest
import torch

from elastic_ops.errors import SpecError, WorkerLostError
from elastic_ops.runtime import run_chunk
from elastic_ops.runtime.adaptive import AdaptiveBatch
from elastic_ops.runtime.allocation import Allocation
from elastic_ops.runtime.consistency import noise_estimate
from elastic_ops.runtime.control import batch_of, continues, count_of, moved, with_batch
from tests.runtime.builders import final_state, make_spec

pytestmark = pytest.mark.timeout(300)


def adaptive_spec(tmp_path, **overrides):
    fields = dict(scaling="adaptive", max_global_batch=48, params={"samples": 960})
    return make_spec(tmp_path, **{**fields, **overrides})


def grows(workers=lambda i: 2, batch_from=5, batch=48):
    """The pool's target: ``workers(i)`` and, from ``batch_from`` on, global batch ``batch``."""
    return lambda i: Allocation(workers(i), batch=batch if i >= batch_from else 0)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    spec = adaptive_spec(tmp_path_factory.mktemp("adaptive-ref"))
    seen = []
    result = run_chunk(spec, 0, 30, target=grows(), on_progress=seen.append)
    return result, final_state(spec), seen


def test_a_new_batch_is_followed_in_the_same_segment_and_advances_the_counter_by_its_gain(uninterrupted):
    result, state, seen = uninterrupted
    assert result.iteration == 30
    assert [(i, n) for i, n, _ in result.workers_timeline] == [(0, 2)]  # no relaunch for the batch
    batches = state["adaptive"]["batches"]
    assert batches[0] == [0, 12] and batches[1][1] == 48 and batches[1][0] >= 5
    steps = seen[-1].steps
    assert steps < 30  # an iteration at 4x the batch made more than one iteration's progress
    # every sample once: the cursor is the sum of the batches run
    assert state["cursor"] == sum(12 if p.batch == 12 else 48 for p in _steps(seen))
    for p in seen[1:]:
        assert p.grad_sqr is not None and p.grad_var is not None and p.grad_sqr >= 0 and p.grad_var > 0
        assert p.batch in (12, 48)


def _steps(seen):
    """One progress report per optimizer step (those an adaptive step crossed repeat it)."""
    out, last = [], 0
    for p in seen:
        if p.steps > last:
            out.append(p)
            last = p.steps
    return out


def test_a_run_killed_mid_chunk_resumes_from_its_checkpoint_on_the_same_trajectory(tmp_path, uninterrupted):
    params = {"samples": 960, "kill_from": 16, "kill_rank": 1, "marker": str(tmp_path / "killed-once")}
    spec = adaptive_spec(tmp_path, params=params)
    with pytest.raises(WorkerLostError):
        run_chunk(spec, 0, 30, target=grows())
    resumed = run_chunk(spec, 0, 30, target=grows())
    assert 10 <= resumed.workers_timeline[0][0] < 30  # resumed, not restarted
    assert resumed.param_sha256 == uninterrupted[0].param_sha256


def test_bitwise_adaptive_training_is_the_same_for_any_worker_schedule(tmp_path, uninterrupted):
    schedule = grows(workers=lambda i: 1 if i < 8 else 3 if i < 20 else 2)
    result = run_chunk(adaptive_spec(tmp_path), 0, 30, target=schedule)
    assert [n for _, n, _ in result.workers_timeline] == [1, 3, 2]
    assert result.param_sha256 == uninterrupted[0].param_sha256


def test_fast_mode_measures_the_noise_from_its_workers_and_halves(tmp_path):
    for workers in (1, 2):
        spec = adaptive_spec(tmp_path / str(workers), consistency="fast", virtual_shards=None,
                             params={"samples": 960, "dropout": 0.0})
        seen = []
        run_chunk(spec, 0, 12, target=grows(workers=lambda i, n=workers: n), on_progress=seen.append)
        assert all(p.grad_var is not None and p.grad_var > 0 for p in seen[1:])


def test_an_adaptive_spec_is_validated_where_it_enters(tmp_path):
    spec = make_spec(tmp_path, scaling="adaptive")
    assert spec.max_global_batch == 12 * 3  # default: each worker at most the base batch
    assert spec.step_batch(0) == 12 and spec.step_batch(7) == 12 and spec.step_batch(1000) == 36
    assert spec.step_batch(29) == 24  # whole virtual shards (6) in bitwise mode
    assert make_spec(tmp_path).step_batch(48) == 12  # a fixed job keeps its batch
    with pytest.raises(SpecError, match="max_global_batch.*>= global_batch"):
        make_spec(tmp_path, scaling="adaptive", max_global_batch=6)
    with pytest.raises(SpecError, match="max_global_batch.*only with scaling 'adaptive'"):
        make_spec(tmp_path, max_global_batch=48)
    with pytest.raises(SpecError, match="warmup_iterations"):
        make_spec(tmp_path, scaling="adaptive", warmup_iterations=5)
    with pytest.raises(SpecError, match="max_global_batch"):
        make_spec(tmp_path, scaling="adaptive", max_global_batch=2**40)


def test_a_decision_carries_count_move_and_batch_apart():
    for n in (0, 1, 7, 2**20):
        for b in (0, 12, 2**30 - 1):
            for v in (n, moved(n)):
                d = with_batch(v, b)
                assert count_of(d) == n and batch_of(d) == b
                assert continues(d, n) == (v == n)


def test_the_noise_estimate_is_unbiased_for_parts_of_any_sizes():
    gen = torch.Generator().manual_seed(0)
    true, sigma, dim = torch.randn(20, generator=gen) * 0.3, 1.5, 20
    sizes = [3, 5, 8, 16]
    sqr, var, trials = 0.0, 0.0, 4000
    for _ in range(trials):
        parts = [true + sigma * torch.randn(b, dim, generator=gen) for b in sizes]
        means = [p.mean(0) for p in parts]
        total = sum(sizes)
        big = sum(m * b for m, b in zip(means, sizes, strict=True)) / total
        small = sum(b * float(m @ m) for m, b in zip(means, sizes, strict=True))
        s, v = noise_estimate(small, float(big @ big), total, len(sizes))
        sqr, var = sqr + s / trials, var + v / trials
    assert sqr == pytest.approx(float(true @ true), rel=0.1)
    assert var == pytest.approx(sigma**2 * dim, rel=0.05)
    assert noise_estimate(1.0, 1.0, 10, 1) is None


def test_the_counter_never_passes_the_chunks_end_and_the_state_round_trips():
    rng = random.Random(3)
    for _ in range(200):
        a, it, end = AdaptiveBatch(8), rng.randrange(0, 50), rng.randrange(51, 120)
        while it < end:
            a.measured((rng.uniform(0, 1), rng.uniform(0, 50)))
            batch, g = a.plan(it, rng.choice([8, 16, 64, 512]), end)
            assert g >= 1 and (batch == 8) == (g == 1.0 or batch == 8)
            it += a.advance(g)
            assert it <= end
            assert AdaptiveBatch.restore(8, a.state()) == a


def test_through_the_per_host_agent_the_batch_goes_out_and_the_statistics_come_back(tmp_path):
    from elastic_ops.agent.client import AgentClient
    from elastic_ops.agent.protocol import StoreConfig
    from tests.runtime.agent_helpers import running_agent

    spec = adaptive_spec(tmp_path)
    progress = []
    with running_agent(tmp_path / "agent") as agent:
        result = AgentClient(agent.path).run_chunk(
            spec.to_dict(), 0, 30, epoch=1, host="h1", store=StoreConfig(spec.checkpoint_uri()),
            target=lambda: Allocation(2, batch=48), on_progress=progress.append,
        )
    assert result.iteration == 30 and [n for _, n, _ in result.workers_timeline] == [2]
    assert {p.batch for p in progress if p.batch} >= {48}  # the pool's batch reached the workers
    assert any(p.grad_var for p in progress) and progress[-1].steps < 30
