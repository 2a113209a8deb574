"""How fast a job runs on n workers over h hosts: a small model fitted online from what its
heartbeats measured (the goodput issue's scaling model; pure functions, no I/O).

At a fixed global batch (the default) a job's progress is its iteration rate, and the time of
one iteration is modelled as

    step(n, h) = fixed + compute / n + sync(n, h)
    sync(1, 1) = 0
    sync(n, 1) = local + local_per * (n - 2)      (n >= 2 ranks on one host)
    sync(n, h) = net + net_per * (n - 2)          (h >= 2 hosts)

``compute / n``: each rank computes on its share of the batch; ``fixed``: what does not shrink
with n (the optimizer step, the data loader's latency); ``sync``: the gradient all-reduce,
cheaper inside a host than across hosts, growing with the ring. This is Pollux's model with
its overlap exponent at 1 (compute and synchronisation do not overlap): for large n it predicts
slightly slower steps than an overlapping job runs, so the pool errs towards fewer workers.

**Fit.** Non-negative least squares (``scipy.optimize.nnls``) on relative errors, each measured
configuration weighted by how much it measured (``iterations / (iterations + 20)``), plus one
pseudo-observation per parameter pulling it towards the prior scaled to the job's measured
speed. One configuration measured fixes the scale and leaves the shape to the prior; every
further configuration moves the shape towards what the job does.

**Prior** (fractions of one worker's step): fixed 0.05, compute 0.95, local 0.05, local_per
0.01, net 0.06, net_per 0.01. It says: 2 workers 1.7x, 4 on a host 2.8x, 8 on a host 3.6x (3.5x
over two hosts), 16 over two hosts 3.2x. A second host costs a little more than the first, so a
job is tried across hosts and its measurements decide (a prior that makes every second host a
loss keeps jobs on one host for good: nothing is ever measured beyond it). Optimistic enough
that a job is tried on more workers, pessimistic enough that a job with no evidence does not
get a cluster.

**Exploration.** While the model is uncertain (fewer than three worker counts measured, or the
fit misses its own measurements by more than 10 %), it promises nothing beyond twice the largest
worker count measured: a job grows one doubling at a time, and each step is measured before the
next is paid for. A certain model extrapolates.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from scipy.optimize import nnls

__all__ = ["PRIOR", "Measured", "ScalingModel", "fit", "fit_cached", "measured_from_rows"]

# fixed, compute, local, local_per, net, net_per: fractions of the one-worker step
PRIOR = (0.05, 0.95, 0.05, 0.01, 0.06, 0.01)
PRIOR_WEIGHT = 0.1  # each prior pseudo-observation against a fully weighted measurement's 1
HALF_WEIGHT_ITERATIONS = 20  # a configuration measured over this many iterations weighs 1/2
CERTAIN_COUNTS = 3  # distinct worker counts measured before the model extrapolates
CERTAIN_ERROR = 0.10  # ... and the fit's relative RMS error on them at most this
EXPLORE_FACTOR = 2  # an uncertain model promises nothing past this times the largest count measured


@dataclasses.dataclass(frozen=True)
class Measured:
    """What a job measured in one configuration: ``iterations`` in ``seconds`` of training at
    ``workers`` ranks over ``hosts`` hosts."""

    workers: int
    hosts: int
    iterations: int
    seconds: float

    @property
    def step_s(self) -> float:
        return self.seconds / self.iterations


def measured_from_rows(rows: Iterable[Mapping[str, Any]], batch: int = 0) -> list[Measured]:
    """The rows of ``PoolClient.observations`` at global ``batch`` (0: the job's fixed batch) as
    :class:`Measured`, skipping configurations that measured nothing."""
    return [
        Measured(int(r["workers"]), int(r["hosts"]), int(r["iterations"]), float(r["seconds"]))
        for r in rows
        if int(r["batch"]) == batch and int(r["iterations"]) > 0 and float(r["seconds"]) > 0
        and int(r["workers"]) >= 1 and 1 <= int(r["hosts"]) <= int(r["workers"])
    ]


def _features(workers: int, hosts: int) -> np.ndarray:
    n = float(workers)
    local = workers >= 2 and hosts == 1
    net = hosts >= 2
    return np.array([1.0, 1.0 / n, float(local), local * (n - 2), float(net), net * (n - 2)])


@dataclasses.dataclass(frozen=True)
class ScalingModel:
    """A job's fitted step time. ``params``: (fixed, compute, local, local_per, net, net_per) in
    seconds; ``explore_to``: the largest worker count the model promises a gain up to (None: a
    certain model, no limit); ``measured``: how many configurations it was fitted on;
    ``error``: its relative RMS error on them; ``largest``: the most workers it measured (0:
    not known)."""

    params: tuple[float, float, float, float, float, float]
    explore_to: int | None
    measured: int
    error: float
    largest: int = 0

    def step_s(self, workers: int, hosts: int = 1) -> float:
        """The modelled seconds per iteration (no exploration limit)."""
        return float(_features(workers, hosts) @ np.asarray(self.params))

    def speedup(self, workers: int, hosts: int = 1) -> float:
        """Iteration rate at ``workers`` over ``hosts`` relative to one worker, as far as the
        model promises: past ``explore_to`` no further gain is counted."""
        if workers < 1 or not 1 <= hosts <= workers:
            raise ValueError(f"workers={workers}, hosts={hosts}: need workers >= 1 and 1 <= hosts <= workers")
        n = workers if self.explore_to is None else min(workers, self.explore_to)
        h = min(hosts, n)
        return self.step_s(1, 1) / self.step_s(n, h)


def _scale(measured: Sequence[Measured], prior: np.ndarray, weights: np.ndarray) -> float:
    """The one-worker step that makes the prior's shape best match the measurements (a
    weighted geometric mean of measured step / prior step)."""
    logs = [math.log(m.step_s / float(_features(m.workers, m.hosts) @ prior)) for m in measured]
    return math.exp(float(np.average(logs, weights=weights)))


def fit(measured: Sequence[Measured], prior: Sequence[float] = PRIOR) -> ScalingModel:
    """The :class:`ScalingModel` of a job that measured ``measured`` (one entry per
    configuration; entries of the same configuration are summed). No measurement: the prior,
    with a one-worker step of 1 s, promising up to ``EXPLORE_FACTOR`` workers."""
    p = np.asarray(prior, dtype=np.float64)
    summed: dict[tuple[int, int], list[float]] = {}
    for m in measured:
        if m.iterations > 0 and m.seconds > 0:
            acc = summed.setdefault((m.workers, m.hosts), [0, 0.0])
            acc[0] += m.iterations
            acc[1] += m.seconds
    ms = [Measured(n, h, int(it), s) for (n, h), (it, s) in sorted(summed.items())]
    if not ms:
        return ScalingModel(tuple(float(x) for x in p), EXPLORE_FACTOR, 0, 0.0)  # type: ignore[arg-type]
    w = np.array([m.iterations / (m.iterations + HALF_WEIGHT_ITERATIONS) for m in ms])
    scale = _scale(ms, p, w)
    y = np.array([m.step_s for m in ms])
    a_obs = np.stack([_features(m.workers, m.hosts) for m in ms]) / y[:, None] * np.sqrt(w)[:, None]
    b_obs = np.sqrt(w)
    a_prior = np.eye(len(p)) * (PRIOR_WEIGHT / scale)
    b_prior = PRIOR_WEIGHT * p
    theta, _ = nnls(np.vstack([a_obs, a_prior]), np.concatenate([b_obs, b_prior]))
    if float(_features(1, 1) @ theta) <= 0:  # degenerate: keep the scaled prior
        theta = p * scale
    predicted = np.stack([_features(m.workers, m.hosts) for m in ms]) @ theta
    error = float(np.sqrt(np.average(((predicted - y) / y) ** 2, weights=w)))
    counts = {m.workers for m in ms}
    certain = len(counts) >= CERTAIN_COUNTS and error <= CERTAIN_ERROR
    explore_to = None if certain else EXPLORE_FACTOR * max(counts)
    return ScalingModel(
        tuple(float(x) for x in theta), explore_to, len(ms), error, max(counts)  # type: ignore[arg-type]
    )


@functools.lru_cache(maxsize=4096)
def fit_cached(measured: tuple[Measured, ...]) -> ScalingModel:
    """:func:`fit` of the same measurements, computed once (the planner fits every job it
    plans for; most measured nothing new since the last plan)."""
    return fit(measured)
