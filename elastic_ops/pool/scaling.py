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

**Measured points.** A model that misses its own measurements by more than ``CERTAIN_ERROR``
(a job whose speed-up is not of this shape, as bert's: slower on two hosts than on one, faster
on three) also keeps what it measured at its base batch: at a measured (workers, hosts) its
step is the measured one, shrunk towards the fit by the measurement's weight (the fit's
``iterations / (iterations + 20)``): ``step * exp(weight * log(measured / fitted))``. Speed-ups
stay relative to the one-worker step (measured, where it was). A model that fits keeps its smooth
curve (its small residuals would only make neighbouring sizes look different).

**Adaptive batch** (a job with ``scaling: adaptive`` lets the pool choose its global batch).
The compute term grows with the per-worker batch: at global batch ``scale`` times the job's
base batch, ``compute * scale / n`` (Pollux's linear compute model); measurements at several
batches fit the same six parameters. What a larger batch buys is its *statistical efficiency*:
one iteration at ``scale`` times the base batch makes the progress of

    gain(scale) = (var + sqr) / (var / scale + sqr)

iterations at the base batch (the AdaScale gain; ``sqr``: the squared norm of the true
gradient, ``var``: the variance of one base batch's gradient, as the job measured them, see
:class:`GradStats`). ``gain`` is 1 at ``scale`` 1, grows towards ``scale`` while the gradient
is noisy (``var >> sqr``) and flattens once it is not. A job's *goodput* at ``n`` workers is
``gain(scale) / step(n, h, scale)``, and :func:`best_batch` picks the batch that maximises it
(:class:`Batching`: the batches the job allows); a job that has reported no gradient
statistics trains at its base batch (``gain`` unknown: no batch is worth more than it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from scipy.optimize import nnls

from elastic_ops.adascale import adascale_gain

__all__ = [
    "PRIOR", "BatchRows", "Batching", "GradStats", "Measured", "ScalingModel", "best_batch", "best_batches",
    "best_batches_full", "fit", "fit_cached", "gain", "measured_from_rows",
]

# fixed, compute, local, local_per, net, net_per: fractions of the one-worker step
PRIOR = (0.05, 0.95, 0.05, 0.01, 0.06, 0.01)
PRIOR_WEIGHT = 0.1  # each prior pseudo-observation against a fully weighted measurement's 1
HALF_WEIGHT_ITERATIONS = 20  # a configuration measured over this many iterations weighs 1/2
CERTAIN_COUNTS = 3  # distinct worker counts measured before the model extrapolates
CERTAIN_ERROR = 0.10  # ... and the fit's relative RMS error on them at most this
EXPLORE_FACTOR = 2  # an uncertain model promises nothing past this times the largest count measured
BATCH_CANDIDATES = 24  # batches best_batch weighs, geometrically spaced from the base to the most


@dataclasses.dataclass(frozen=True)
class Measured:
    """What a job measured in one configuration: ``iterations`` in ``seconds`` of training at
    ``workers`` ranks over ``hosts`` hosts, at ``scale`` times the job's base global batch."""

    workers: int
    hosts: int
    iterations: int
    seconds: float
    scale: float = 1.0

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


def _features(workers: int, hosts: int, scale: float = 1.0) -> np.ndarray:
    n = float(workers)
    local = workers >= 2 and hosts == 1
    net = hosts >= 2
    return np.array([1.0, scale / n, float(local), local * (n - 2), float(net), net * (n - 2)])


@dataclasses.dataclass(frozen=True, slots=True)
class GradStats:
    """A job's gradient statistics, as its workers last measured them: ``sqr``, the squared
    norm of the true gradient; ``var``, the variance (trace of the covariance) of the gradient
    of one *base* batch. ``var / sqr`` times the base batch is the gradient noise scale."""

    sqr: float
    var: float

    def __post_init__(self) -> None:
        for name in ("sqr", "var"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}={v!r}: need a finite number >= 0")


def gain(stats: GradStats | None, scale: float | np.ndarray) -> float | np.ndarray:
    """Progress of one iteration at ``scale`` times the base batch, in base-batch iterations
    (module docstring). Unknown statistics, or none measured: 1 (no batch is worth more)."""
    if stats is None:
        return np.ones_like(scale) if isinstance(scale, np.ndarray) else 1.0
    return adascale_gain(stats.sqr, stats.var, scale)


@dataclasses.dataclass(frozen=True, slots=True)
class Batching:
    """The global batches an adaptive job allows: from ``least`` (0: ``base``) to ``most``,
    with ``per_worker`` to ``per_worker_most`` (0: no limit; what fits a worker's memory)
    samples on each worker. ``base``: the spec's ``global_batch``, the batch its learning
    rate is tuned for, which it trains at until its gradient statistics are known (and which is
    always allowed: past ``per_worker_most`` the workers accumulate it in micro-batches)."""

    base: int
    most: int
    per_worker: int = 1
    least: int = 0
    per_worker_most: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.lowest <= self.base <= self.most or self.per_worker < 1 or not (
            self.per_worker_most == 0 or self.per_worker_most >= self.per_worker
        ):
            raise ValueError(f"{self}: need 1 <= least <= base <= most, per_worker >= 1 and "
                             "per_worker_most 0 or at least per_worker")

    @property
    def lowest(self) -> int:
        return self.least or self.base

def scale_grid(low: np.ndarray, top: np.ndarray, floor: np.ndarray, ceiling: np.ndarray) -> np.ndarray:
    """The scales an adaptive job's batch is chosen from, one ascending row per entry of
    ``low`` and ``top`` (its least and largest scale), ``floor`` and ``ceiling`` (the least and
    most its workers take: ``workers * per_worker / base``, ``workers * per_worker_most /
    base``): ``BATCH_CANDIDATES`` geometrically spaced from the low to the top, clipped to the
    floor and the ceiling as far as they lie between the low and the top, and the base itself
    (scale 1: always allowed)."""
    low, top = np.asarray(low, np.float64), np.asarray(top, np.float64)
    grid = low[:, None] * np.power((top / low)[:, None], np.linspace(0.0, 1.0, BATCH_CANDIDATES)[None, :])
    hi = np.clip(np.asarray(ceiling, np.float64), low, top)  # the least batch wins over memory:
    lo = np.clip(np.asarray(floor, np.float64), low, hi)  # ... its workers accumulate it
    grid = np.clip(grid, lo[:, None], hi[:, None])
    return np.sort(np.concatenate([grid, np.ones((len(low), 1))], axis=1), axis=1)


@dataclasses.dataclass(frozen=True, slots=True)
class ScalingModel:
    """A job's fitted step time. ``params``: (fixed, compute, local, local_per, net, net_per) in
    seconds; ``explore_to``: the largest worker count the model promises a gain up to (None: a
    certain model, no limit); ``measured``: how many configurations it was fitted on;
    ``error``: its relative RMS error on them; ``largest``: the most workers it measured (0:
    not known); ``points``: the configurations it measured at its base batch, as (workers,
    hosts, correction): the log of measured over modelled step, shrunk by the measurement's
    weight (module docstring, "Measured points")."""

    params: tuple[float, float, float, float, float, float]
    explore_to: int | None
    measured: int
    error: float
    largest: int = 0
    points: tuple[tuple[int, int, float], ...] = ()

    def step_s(self, workers: int, hosts: int = 1, scale: float = 1.0) -> float:
        """The modelled seconds per iteration at ``scale`` times the base batch (no
        exploration limit; at a measured configuration of the base batch, what was measured,
        as far as its weight says)."""
        step = float(_features(workers, hosts, scale) @ np.asarray(self.params))
        if scale == 1.0:
            for n, h, corr in self.points:
                if n == workers and h == hosts:
                    return step * math.exp(corr)
        return step

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
    logs = [math.log(m.step_s / float(_features(m.workers, m.hosts, m.scale) @ prior)) for m in measured]
    return math.exp(float(np.average(logs, weights=weights)))


def fit(measured: Sequence[Measured], prior: Sequence[float] = PRIOR) -> ScalingModel:
    """The :class:`ScalingModel` of a job that measured ``measured`` (one entry per
    configuration; entries of the same configuration are summed). No measurement: the prior,
    with a one-worker step of 1 s, promising up to ``EXPLORE_FACTOR`` workers."""
    p = np.asarray(prior, dtype=np.float64)
    summed: dict[tuple[int, int, float], list[float]] = {}
    for m in measured:
        if m.iterations > 0 and m.seconds > 0:
            acc = summed.setdefault((m.workers, m.hosts, m.scale), [0, 0.0])
            acc[0] += m.iterations
            acc[1] += m.seconds
    ms = [Measured(n, h, int(it), s, c) for (n, h, c), (it, s) in sorted(summed.items())]
    if not ms:
        return ScalingModel(tuple(float(x) for x in p), EXPLORE_FACTOR, 0, 0.0)  # type: ignore[arg-type]
    w = np.array([m.iterations / (m.iterations + HALF_WEIGHT_ITERATIONS) for m in ms])
    scale = _scale(ms, p, w)
    y = np.array([m.step_s for m in ms])
    feats = np.stack([_features(m.workers, m.hosts, m.scale) for m in ms])
    a_obs = feats / y[:, None] * np.sqrt(w)[:, None]
    b_obs = np.sqrt(w)
    a_prior = np.eye(len(p)) * (PRIOR_WEIGHT / scale)
    b_prior = PRIOR_WEIGHT * p
    theta, _ = nnls(np.vstack([a_obs, a_prior]), np.concatenate([b_obs, b_prior]))
    if float(_features(1, 1) @ theta) <= 0:  # degenerate: keep the scaled prior
        theta = p * scale
    predicted = feats @ theta
    error = float(np.sqrt(np.average(((predicted - y) / y) ** 2, weights=w)))
    counts = {m.workers for m in ms}
    certain = len(counts) >= CERTAIN_COUNTS and error <= CERTAIN_ERROR
    explore_to = None if certain else EXPLORE_FACTOR * max(counts)
    with np.errstate(divide="ignore", invalid="ignore"):
        corr = w * np.log(y / predicted)
    points = tuple((m.workers, m.hosts, float(c)) for m, c in zip(ms, corr.tolist(), strict=True)
                   if error > CERTAIN_ERROR and m.scale == 1.0 and math.isfinite(c) and c != 0.0)
    return ScalingModel(
        tuple(float(x) for x in theta), explore_to, len(ms), error, max(counts), points  # type: ignore[arg-type]
    )


@functools.lru_cache(maxsize=4096)
def fit_cached(measured: tuple[Measured, ...]) -> ScalingModel:
    """:func:`fit` of the same measurements, computed once (the planner fits every job it
    plans for; most measured nothing new since the last plan)."""
    return fit(measured)


@dataclasses.dataclass(frozen=True)
class BatchRows:
    """Adaptive jobs as columns, one row each (a job at one worker count): what
    :func:`best_batches` reads. ``params``: (rows, 6) model parameters; ``explore``: each
    model's ``explore_to`` (inf: certain); ``sqr``, ``var``: gradient statistics (NaN: not
    measured); ``base``, ``low``, ``most``, ``per``, ``per_most``: the :class:`Batching`
    (``per_most`` = ``most`` when unlimited); ``workers``, ``hosts``: where the row is."""

    params: np.ndarray
    explore: np.ndarray
    sqr: np.ndarray
    var: np.ndarray
    base: np.ndarray
    low: np.ndarray
    most: np.ndarray
    per: np.ndarray
    per_most: np.ndarray
    workers: np.ndarray
    hosts: np.ndarray

    @classmethod
    def of(cls, rows: Sequence[tuple[ScalingModel, GradStats | None, Batching, int, int]]) -> BatchRows:
        """From (model, stats, batching, workers, hosts) tuples."""
        cols = np.array([
            (np.inf if m.explore_to is None else m.explore_to, np.nan if g is None else g.sqr,
             np.nan if g is None else g.var, b.base, b.lowest, b.most, b.per_worker,
             b.per_worker_most or b.most, n, h)
            for m, g, b, n, h in rows
        ], np.float64).reshape(len(rows), 10)
        params = np.array([m.params for m, *_ in rows], np.float64).reshape(len(rows), 6)
        return cls(params, *cols.T)


def _rest_step(r: BatchRows) -> tuple[np.ndarray, np.ndarray]:
    """The workers each row's step is modelled at (the exploration limit caps them, as in
    :meth:`ScalingModel.speedup`) and the step's part that does not grow with the batch."""
    p = r.params
    n = np.maximum(np.minimum(r.workers, r.explore), 1.0)
    h = np.minimum(r.hosts, n)
    local, net = (n >= 2) & (h == 1), h >= 2
    return n, p[:, 0] + local * (p[:, 2] + p[:, 3] * (n - 2)) + net * (p[:, 4] + p[:, 5] * (n - 2))


def _stats(r: BatchRows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Which rows measured their gradients, and their ``sqr``, ``var`` (1, 0 where not: a gain
    of 1 at every batch)."""
    known = np.isfinite(r.sqr) & np.isfinite(r.var) & (r.sqr + r.var > 0)
    return known, np.where(known, r.sqr, 1.0), np.where(known, r.var, 0.0)


def best_batches_full(r: BatchRows) -> tuple[np.ndarray, np.ndarray]:
    """:func:`best_batches` by weighing every candidate of :func:`scale_grid` (the reference
    the bracketed search is tested against)."""
    p = r.params
    n, rest = _rest_step(r)
    scales = scale_grid(r.low / r.base, r.most / r.base, r.workers * r.per / r.base,
                        r.workers * r.per_most / r.base)
    known, sqr, var = _stats(r)
    scales = np.where(known[:, None], scales, 1.0)  # unknown: what a batch buys is not known
    step = rest[:, None] + p[:, 1, None] * scales / n[:, None]
    good = adascale_gain(sqr[:, None], var[:, None], scales) / step
    k = np.argmax(good, axis=1)  # ties: the smaller batch (scales ascend; argmax takes the first)
    pick = np.arange(len(k))
    batch = np.rint(scales[pick, k] * r.base).astype(np.int64)
    return batch, good[pick, k] * (p[:, 0] + p[:, 1])


BRACKET = np.arange(2)  # the grid points either side of the continuous optimum


def best_batches(r: BatchRows) -> tuple[np.ndarray, np.ndarray]:
    """For every row, the global batch of most goodput (``gain / step``, module docstring) over
    the job's candidates (:func:`scale_grid`), and that goodput relative to one worker at the
    base batch: its speed-up in base-batch progress. A row without statistics: the base. The
    model's exploration limit caps the workers the step is modelled at, as in
    :meth:`ScalingModel.speedup`. One pass over all rows (the policy calls it for every point
    of every adaptive job's curve).

    Not every candidate is weighed: with ``step = rest + compute * scale / n``, ``1 / goodput``
    is ``var * rest / scale + const + sqr * compute * scale / n`` up to a factor, convex in
    ``scale`` with its minimum at ``sqrt(var * rest * n / (sqr * compute))``. So goodput is
    unimodal in the scale, and so it is over the clipped (still ascending) grid: its best point
    is one of the two grid points either side of that optimum's position on the geometric grid
    (rounding can move the position only past a point it is within rounding of, which then is
    one of the two). Those two and the base are weighed; the same batches and goodputs as
    :func:`best_batches_full` (tests/pool/test_scaling.py)."""
    p = r.params
    n, rest = _rest_step(r)
    known, sqr, var = _stats(r)
    low, top = r.low / r.base, r.most / r.base
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        opt = np.sqrt(var * rest * n / (sqr * p[:, 1]))
        at = np.log(opt / low) / np.log(top / low) * (BATCH_CANDIDATES - 1)
    # nan (a flat goodput, or one grid point): the first; the grid's ends past it
    at = np.clip(np.nan_to_num(at, nan=0.0, posinf=BATCH_CANDIDATES, neginf=0.0), 0, BATCH_CANDIDATES - 1)
    ks = np.clip(np.floor(at).astype(np.int64)[:, None] + BRACKET, 0, BATCH_CANDIDATES - 1)
    # the same arithmetic as scale_grid, at the bracket's points only
    grid = low[:, None] * np.power((top / low)[:, None], np.linspace(0.0, 1.0, BATCH_CANDIDATES)[ks])
    hi = np.clip(r.workers * r.per_most / r.base, low, top)
    lo = np.clip(r.workers * r.per / r.base, low, hi)
    grid = np.clip(grid, lo[:, None], hi[:, None])
    step = rest[:, None] + p[:, 1, None] * grid / n[:, None]
    good = adascale_gain(sqr[:, None], var[:, None], grid) / step
    k = np.argmax(good, axis=1)  # ties: the smaller batch (the bracket ascends)
    pick = np.arange(len(k))
    scale, best = grid[pick, k], good[pick, k]
    base = 1.0 / (rest + p[:, 1] / n)  # the base batch (gain 1): always a candidate
    use_base = ~known | (base > best) | ((base == best) & (scale > 1.0))
    scale, best = np.where(use_base, 1.0, scale), np.where(use_base, base, best)
    return np.rint(scale * r.base).astype(np.int64), best * (p[:, 0] + p[:, 1])


def best_batch(
    model: ScalingModel, stats: GradStats | None, batching: Batching, workers: int, hosts: int = 1
) -> tuple[int, float]:
    """The global batch of most goodput for an adaptive job on ``workers`` over ``hosts``, and
    that goodput relative to one worker at the base batch (its speed-up in base-batch
    progress): :func:`best_batches` of one row. Within ``batching``; without ``stats``, the
    base batch."""
    if workers < 1 or not 1 <= hosts <= workers:
        raise ValueError(f"workers={workers}, hosts={hosts}: need workers >= 1 and 1 <= hosts <= workers")
    batch, speed = best_batches(BatchRows.of([(model, stats, batching, workers, hosts)]))
    return int(batch[0]), float(speed[0])
