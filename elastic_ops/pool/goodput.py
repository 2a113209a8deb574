"""The ``goodput`` share rule: workers go where they buy the most progress.

Each admitted job's progress on ``n`` workers is its speed-up ``S(n)`` from its fitted
:class:`~elastic_ops.pool.scaling.ScalingModel` (the prior for a job that measured nothing),
on the tightest packing of ``n`` workers on the pool's hosts (the ``goodput`` policy places
jobs that way). The rule maximises

    sum over jobs of  w_j * log S_j(n_j)      within min_j <= n_j <= cap_j, sum n_j <= capacity

over **packable** sizes: up to one host's slots any count, beyond that whole hosts (and the
job's minimum and maximum): a multi-host job on part of a host leaves holes that scatter the
jobs after it.

**Why ``log``** (proportional fairness, Pollux's power-mean fairness at p = 0): a job whose
speed-up stops growing gains nothing from more workers and is not grown, however many are
free; and two jobs that scale alike (linearly) get shares in proportion to their weights, as
under ``priority`` -- so the weights keep their meaning. (Pollux's p = -1 gives more to the
slowest job, but splits linearly scaling jobs by the square root of their weights.)

**Weights.** ``w = priority * (1 + YOUTH_BONUS / (1 + attained / YOUTH_GPU_S))``: the
priority, times a youth factor from 4 (a job that has trained nothing) down towards 1 (one
that has trained many GPU-hours; 2.5 at 4 GPU-hours). Young jobs -- most of them short, in
every published trace -- weigh more, as Tiresias's least-attained-service queues favour them;
a long job keeps at least a quarter of a young one's weight, so it is never starved.

**What a job measured counts as measured where its model cannot explain it.** A model that
misses its own measurements by more than 10 % (``scaling.CERTAIN_ERROR``: its six parameters
cannot bend that way, as bert's traces run 3.85x on one host, 2.90x on two and 5.90x on three)
carries its measured configurations (:attr:`ScalingModel.points`), and ``S(n)`` at a measured
(workers, hosts) is the measured step, shrunk towards the fit by the measurement's weight
(scaling.py, "Measured points"). Without this such a job's fit put 11 workers on three hosts
at about what 4 on one host run, and the rule kept shrinking it to one host and growing it back
(``workloads-0.5/workload-5``: 790 -> 772 s). A model that explains its measurements keeps its
smooth curve: the small residuals of a good fit made the shares hop between neighbouring sizes
(a 40-job Philly sample: 187 -> 1335 rescales, average JCT +12 %).

**Solving it.** The Lagrangian ``max_n w log S(n) - λ n`` is solved per job for a common λ
(the price of a slot), found by bisection so that the jobs fit; it picks points of each job's
concave envelope, so a speed-up that dips when a job spills onto a second host is handled.
Slots the integer solution leaves over go one step at a time to the job whose next packable
size gains most per slot. Ties prefer fewer workers. One vectorised pass over all jobs' curves;
a policy calls the rule once per freeze round on the same snapshot, so each job's curve points
are computed once per snapshot and gathered after (:meth:`_Table.log_speeds`).

**Moves.** The plain policy (the simulator's sizes) also moves a job that keeps its size on
more hosts than it needs onto fewer when :func:`move_pays`: the time its faster spread saves
over its horizon (as below) exceeds its restart (plain_policies._defragment).

**Restarts are weighed.** A running job's change happens only when its gain, over the time the
new allocation is expected to last (its *horizon*), exceeds ``rescale_cost_s`` (the stall of a
rescale): for a grow, the time its extra workers save; for a shrink, what the freed slots are
worth to the job that gains most from them, less what the job loses. The horizon is the lesser
of the job's age (its expected remaining run, as least-attained-service schedulers estimate it)
and the time since its allocation last changed (``Job.last_rescale``: an allocation that has
lasted ``t`` is expected to last about ``t`` more; a job reshaped a minute ago, by arrivals and
completions around it, will likely be reshaped again soon), clamped to
``MIN_HORIZON_S..MAX_HORIZON_S``. Jobs held back keep what they hold and the rest is shared
again around them.

**What a running job holds is worth its restart.** The rule solves with each running job's
objective at the size it holds raised by what a restart costs it over its horizon, in log
speed-up (``-log(1 - rescale_cost_s / horizon)``, the gain at which the change above pays):
the slots an arrival needs are then taken where taking them costs least, all jobs weighed
together, rather than a few from every job, and a completion's slots go where growing pays its
restart. The test above still decides each change, on the objective without it. Measured on the
16 Pollux workloads and 13 others (docs/benchmarks.md): a fifth to a third fewer rescales.

**Idle slots are lent to learn on.** Slots no model promises a gain for go first to jobs whose
model is uncertain (weighted max-min, up to their max), then to certain jobs, in rank order, up
to twice the most they measured: each size is tried once, so a model fitted on few sizes (a
job whose second host is slow while its third and fourth pay) does not keep a job small for
good. An idle GPU costs a restart, nothing else.

The constants were chosen on the Pollux artifact's workloads (``benchmarks/pool_simulator.py``)
and are not tuned per workload.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Sequence
from itertools import chain, compress, repeat
from operator import attrgetter, is_, is_not

import numpy as np

from elastic_ops.pool.model import HostState, Job, Plan, Snapshot
from elastic_ops.pool.scaling import BatchRows, ScalingModel, best_batch, best_batches, fit
from elastic_ops.pool.shares import weighted_fill_array

__all__ = [
    "Columns", "MAX_HORIZON_S", "MIN_HORIZON_S", "YOUTH_BONUS", "YOUTH_GPU_S", "goodput_fill",
    "goodput_fill_array", "host_slots", "move_pays", "moves_that_pay", "speed_on",
    "with_batches",
]

YOUTH_GPU_S = 4 * 3600.0  # attained GPU-seconds at which the youth bonus is halved
YOUTH_BONUS = 3.0  # a job that has trained nothing weighs 1 + this times its priority
MIN_HORIZON_S = 300.0  # the least horizon a change's gain is counted over (module docstring)
MAX_HORIZON_S = 1200.0  # ... and the most
MOST_RESTART_SHARE = 0.5  # a held size is worth at most log 2 (a restart of half the horizon or more)
BISECTIONS = 60
NARROW_AFTER = 8  # bisections on every job's points before only the undecided ones are searched
TIE = 1e-9  # objective differences below this are ties (fewer workers win)
LOG_NONE = -30.0  # log S(0): finite, so a job with minimum 0 is in the sums, first to get one


@dataclasses.dataclass(frozen=True)
class Columns:
    """What a policy has already read of a snapshot's jobs, in snapshot order, so that the rule
    does not read it again (the vectorised policy hands it over with the jobs it admits)."""

    held: np.ndarray  # slots each job holds
    submitted: np.ndarray
    last_rescale: np.ndarray  # nan: never
    per_host: int  # host_slots(snapshot)


@functools.cache
def _prior() -> ScalingModel:
    return fit(())


def _weights(priority: np.ndarray, attained: np.ndarray) -> np.ndarray:
    """Priority times the youth factor (module docstring)."""
    return priority * (1.0 + YOUTH_BONUS / (1.0 + np.maximum(attained, 0.0) / YOUTH_GPU_S))


def host_slots(snap: Snapshot) -> int:
    """The workers one host holds: the largest up host (the tightest packing there is)."""
    up = map(is_, map(attrgetter("state"), snap.hosts), repeat(HostState.UP))  # (C level: 12,500 hosts)
    return max(compress(map(attrgetter("slots"), snap.hosts), up), default=1)


class _Table:
    """What the rule reads of every job of a snapshot, as arrays (built once per snapshot: a
    policy calls the rule once per freeze round, on the jobs it admits in that round)."""

    def __init__(self, snap: Snapshot, cols: Columns | None = None):
        jobs = snap.jobs
        n = len(jobs)
        prior = _prior()
        # Columns read at C level; a model's fields once per distinct model object (jobs that
        # measured nothing share the prior).

        def column(field: str):
            return map(attrgetter(field), jobs)

        scal = list(column("scaling"))
        first, inv = _groups(np.fromiter(map(id, scal), np.int64, n))
        models = [scal[i] or prior for i in first.tolist()]
        params = np.fromiter(chain.from_iterable(map(attrgetter("params"), models)), np.float64,
                             6 * len(models)).reshape(len(models), 6)
        self.params = np.take(params, inv, axis=0)  # (take: rows, a few times faster than [inv])
        self.explore = np.array([np.inf if m.explore_to is None else m.explore_to for m in models],
                                np.float64)[inv]
        self.largest = np.array([m.largest for m in models], np.int64)[inv]
        # what misfit models measured (ScalingModel.points), sorted by (model, workers, hosts)
        points = [(k, n, h, corr) for k, m in enumerate(models) for n, h, corr in m.points]
        self.point_keys: np.ndarray | None = None
        if points:
            k, pn, ph, corr = np.array(points, np.float64).T
            keys = _point_key(k.astype(np.int64), pn, ph)
            order = np.argsort(keys)
            self.point_keys, self.point_corr, self.model_of = keys[order], corr[order], inv.astype(np.int64)
        self.attained = np.fromiter(column("attained"), np.float64, n)
        if cols is not None:
            self.held, self.submitted, self.per_host = cols.held, cols.submitted, cols.per_host
            self.last_rescale = cols.last_rescale
        else:
            self.held = np.fromiter(map(len, column("held")), np.int64, n)
            self.submitted = np.fromiter(column("submitted"), np.float64, n)
            self.last_rescale = np.fromiter(column("last_rescale"), np.float64, n)  # None -> nan
            self.per_host = host_slots(snap)
        self._jobs = jobs
        self._row: dict[str, int] | None = None
        # log S of each job's points asked for so far: (first n, last n, where in values, values)
        self._curve_cache = (np.full(n, -1), np.full(n, -2), np.zeros(n, np.int64), np.zeros(0))
        # adaptive jobs (one pass; most snapshots have none), and those that measured their
        # gradients: their curves take the best batch
        batchings = list(column("batching"))
        has = np.fromiter(map(is_not, batchings, repeat(None)), bool, n)
        batched = np.flatnonzero(has)
        mine = list(compress(batchings, has))
        grads = list(map(attrgetter("grad"), compress(jobs, has)))
        measured = np.fromiter(map(is_not, grads, repeat(None)), bool, len(grads))
        chooses = batched[measured]
        self.any_batching = bool(len(batched))
        self.any_adaptive = bool(len(chooses))
        self.adaptive = np.zeros(n, dtype=bool)
        self.adaptive[chooses] = True
        if len(batched):
            # every Batching field in one pass (fewer passes over objects the policy reads cold)
            fields = attrgetter("base", "most", "per_worker", "least", "per_worker_most")
            cols = np.fromiter(chain.from_iterable(map(fields, mine)), np.float64, 5 * len(mine))
            cols = cols.reshape(-1, 5)
            self.base_batch = np.zeros(n, np.int64)
            self.base_batch[batched] = cols[:, 0]
        if len(chooses):
            got = list(compress(grads, measured))
            stats = np.fromiter(chain.from_iterable(map(attrgetter("sqr", "var"), got)), np.float64,
                                2 * len(got)).reshape(-1, 2)

            def col(values: np.ndarray, default: float) -> np.ndarray:
                out = np.full(n, default, np.float64)
                out[chooses] = values
                return out

            self.sqr, self.var = col(stats[:, 0], np.nan), col(stats[:, 1], np.nan)
            base, most, per, least, per_most = cols[measured].T
            self.base, self.most, self.per = col(base, 1.0), col(most, 1.0), col(per, 1.0)
            self.low = col(np.where(least > 0, least, base), 1.0)  # Batching.lowest
            self.per_most = col(np.where(per_most > 0, per_most, most), 1.0)  # 0: no limit

        self.uncertain = np.isfinite(self.explore)
        # no job gains past its top: an uncertain model's explore_to; a certain one's step time
        # has a minimum where the ring's cost outgrows the compute it splits
        compute = self.params[:, 1]
        if self.any_adaptive:  # a larger batch moves the peak out: compute grows with it
            compute = compute * np.where(self.adaptive, self.most / self.base, 1.0)
        ring = self.params[:, 5]
        with np.errstate(divide="ignore", invalid="ignore"):
            peak = np.where(ring > 0, np.ceil(np.sqrt(compute / ring)) + self.per_host, np.inf)
        self.top = np.where(self.uncertain, np.maximum(self.explore, 1), np.maximum(peak, self.per_host))

    def log_speeds(self, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray, seg: np.ndarray,
                   n: np.ndarray) -> np.ndarray:
        """``log S`` at the points ``n`` of jobs ``rows`` (job ``i``'s points ``lo[i]..hi[i]``,
        ``seg``: each point's job; 0 at n = 0). A policy asks once per freeze round, mostly for
        the same points: a job's points are computed once per snapshot and gathered after (a
        job asked for points outside those it has gets them computed)."""
        c_lo, c_hi, c_at, vals = self._curve_cache  # read once: a thread replaces it whole
        hit = (c_lo[rows] <= lo) & (hi <= c_hi[rows])
        on = hit[seg]
        out = np.zeros(len(n))
        r = rows[seg]
        if on.any():
            out[on] = vals[(c_at[r] + n.astype(np.int64) - c_lo[r])[on]]
        miss = ~on & (n > 0)
        if miss.any():
            out[miss] = _log_speed(self, r[miss], n[miss])
            new = np.flatnonzero(~hit & (c_lo[rows] < 0))  # jobs not asked about before
            if len(new):
                # their points, job by job in order
                pts = np.arange(len(seg)) if len(new) == len(rows) else np.flatnonzero(np.isin(seg, new))
                c_lo, c_hi, c_at = c_lo.copy(), c_hi.copy(), c_at.copy()
                c_lo[rows[new]], c_hi[rows[new]] = lo[new], hi[new]
                sizes = hi[new] - lo[new] + 1
                c_at[rows[new]] = len(vals) + np.cumsum(sizes) - sizes
                self._curve_cache = (c_lo, c_hi, c_at, np.concatenate([vals, out[pts]]))
        return out

    def rows_of(self, jobs: Sequence[Job]) -> np.ndarray:
        """The rows of ``jobs`` (jobs of the snapshot): a view that knows their positions in the
        snapshot (``snapshot_rows``, as the vectorised policy passes its admitted jobs) says
        them; other sequences are looked up by name (a policy may pass a job as it honours it:
        another object, see rules.avoided)."""
        pos = getattr(jobs, "snapshot_rows", None)
        if pos is not None:
            return pos
        if self._row is None:
            self._row = dict(zip(map(_job_name, self._jobs), range(len(self._jobs)), strict=True))
        return np.fromiter(map(self._row.__getitem__, map(_job_name, jobs)), np.int64, len(jobs))

    def rows_named(self, names: Sequence[str]) -> np.ndarray:
        """The rows of the jobs called ``names``."""
        by_name = dict(zip(map(attrgetter("name"), self._jobs), range(len(self._jobs)), strict=True))
        return np.fromiter(map(by_name.__getitem__, names), np.int64, len(names))

    def batch_rows(self, rows: np.ndarray, workers: np.ndarray, hosts: np.ndarray) -> BatchRows:
        """Jobs ``rows`` (adaptive ones) at ``workers`` over ``hosts``, for best_batches."""
        return BatchRows(np.take(self.params, rows, axis=0), self.explore[rows], self.sqr[rows],
                         self.var[rows], self.base[rows], self.low[rows], self.most[rows], self.per[rows],
                         self.per_most[rows], workers.astype(np.float64), hosts.astype(np.float64))


_job_name = attrgetter("name")


def _groups(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_index=True, return_inverse=True)[1:]`` by one stable sort
    (numpy 2's ``unique`` of integers hashes them first: several times slower here)."""
    order = np.argsort(keys, kind="stable")
    s = keys[order]
    new = np.ones(len(s), dtype=bool)
    np.not_equal(s[1:], s[:-1], out=new[1:])
    inv = np.empty(len(s), dtype=np.int64)
    inv[order] = np.cumsum(new) - 1
    return order[new], inv

# (snapshot, its _Table) of the last call: the snapshot is kept, so no other takes its id; one
# tuple replaced whole, so a thread never reads another thread's table
_last: tuple[Snapshot | None, _Table | None] = (None, None)


def _table(snap: Snapshot, cols: Columns | None = None) -> _Table:
    global _last
    seen, table = _last
    if seen is not snap or table is None:
        table = _Table(snap, cols)
        _last = (snap, table)
    return table


def _log_speed(t: _Table, r: np.ndarray, n: np.ndarray, hosts: np.ndarray | None = None) -> np.ndarray:
    """``log S(n)`` of the jobs at rows ``r`` on ``n`` workers (one entry per point; n > 0),
    over ``hosts`` hosts (default: packed on the pool's hosts); an adaptive job's at its best
    batch (best_batches)."""
    out, e, h = _modelled(t, r, n, hosts)
    return _with_measured(t, r, e, h, out)


def _modelled(t: _Table, r: np.ndarray, n: np.ndarray, hosts: np.ndarray | None):
    """:func:`_log_speed` without a misfit model's measured points, and the workers and hosts it
    was modelled at. The model reads only whether a job spans hosts (one host, or more: the
    network's terms), not how many."""
    per_host = t.per_host
    e = np.maximum(np.minimum(n, t.explore[r]), 1.0)
    h = np.minimum(np.ceil(n / per_host) if hosts is None else np.maximum(hosts, 1), e)
    local, net = (e >= 2) & (h == 1), h >= 2
    q = np.take(t.params, r, axis=0)
    step = q[:, 0] + q[:, 1] / e + local * (q[:, 2] + q[:, 3] * (e - 2))
    step += net * (q[:, 4] + q[:, 5] * (e - 2))
    out = np.log(q[:, 0] + q[:, 1]) - np.log(step)  # against the step on one worker
    if t.any_adaptive and (pts := np.flatnonzero(t.adaptive[r])).size:
        out[pts] = np.log(best_batches(t.batch_rows(r[pts], n[pts], h[pts]))[1])
    return out, e, h


def _with_measured(t: _Table, r: np.ndarray, e: np.ndarray, h: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out`` (modelled log speeds of rows ``r`` at ``e`` workers over ``h`` hosts) with the
    configurations a misfit model measured as measured (not an adaptive job's: its batch moves)."""
    if t.point_keys is not None:
        fix = _measured(t, r, np.ones(len(r)), np.ones(len(r))) - _measured(t, r, e, h)
        if t.any_adaptive:
            fix[t.adaptive[r]] = 0.0
        out += fix
    return out


def _point_key(model: np.ndarray, workers: np.ndarray, hosts: np.ndarray) -> np.ndarray:
    """One int64 per (model, workers, hosts) (workers and hosts below 2**24)."""
    return (model << 48) | (workers.astype(np.int64) << 24) | hosts.astype(np.int64)


def _measured(t: _Table, r: np.ndarray, n: np.ndarray, h: np.ndarray) -> np.ndarray:
    """The log of measured over modelled step of the jobs at rows ``r`` on ``n`` workers over
    ``h`` hosts, where their models have it (ScalingModel.points), else 0."""
    keys = _point_key(t.model_of[r], n, h)
    at = np.minimum(np.searchsorted(t.point_keys, keys), len(t.point_keys) - 1)
    return np.where(t.point_keys[at] == keys, t.point_corr[at], 0.0)


class _Curves:
    """Every job's objective ``w log S(n)`` for ``n = lo..hi``, one flat array (job ``i``'s
    points at ``starts[i]:starts[i] + sizes[i]``), built in one vectorised pass."""

    def __init__(self, t: _Table, rows: np.ndarray, w: np.ndarray, lo: np.ndarray, caps: np.ndarray,
                 spare: int):
        per_host = t.per_host
        self.uncertain = t.uncertain[rows]
        self.largest = t.largest[rows]
        self.w = w
        top = t.top[rows]
        hi = np.maximum(lo, np.minimum(np.minimum(top, caps), lo + max(spare, 0))).astype(np.int64)
        self.lo, self.sizes = lo, hi - lo + 1
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        seg = np.repeat(np.arange(len(rows)), self.sizes)
        self.offs = np.arange(len(seg)) - self.starts[seg]
        whole = lo[seg] + self.offs
        n = whole.astype(np.float64)
        log_speed = t.log_speeds(rows, lo, hi, seg, n)
        self.flat = self.w[seg] * np.where(n == 0, LOG_NONE, log_speed)
        # packable sizes: more workers than one host holds come in whole hosts (any count up to a
        # host, the minimum and the maximum are allowed): partly used hosts of multi-host jobs are what
        # scatters the jobs after them
        k = np.arange(int(hi.max(initial=0)) + 1)
        ok = ((k <= per_host) | (k % per_host == 0))[whole] | (self.offs == 0) | (whole == caps[seg])
        self.packable = np.where(ok, self.flat, -np.inf)

    def at(self, idx: np.ndarray, workers: np.ndarray) -> np.ndarray:
        """The objective of jobs ``idx`` at ``workers`` (within their ranges)."""
        return self.flat[self.starts[idx] + workers - self.lo[idx]]

    def keeping(self, idx: np.ndarray, workers: np.ndarray, value: np.ndarray) -> _Curves:
        """A copy whose jobs ``idx`` are worth ``value`` more at ``workers`` (what they hold)."""
        out = copy.copy(self)
        at = self.starts[idx] + workers - self.lo[idx]
        out.flat, out.packable = self.flat.copy(), self.packable.copy()
        out.flat[at] += value
        out.packable[at] += value
        return out


def speed_on(job: Job, workers: int, hosts: int) -> float:
    """The modelled speed-up of ``job`` on ``workers`` over ``hosts`` hosts (its fitted model,
    the prior if it measured nothing; an adaptive job's at its best batch there)."""
    model = job.scaling or _prior()
    hosts = max(1, min(hosts, workers))
    if job.batching is not None and job.grad is not None:
        return best_batch(model, job.grad, job.batching, workers, hosts)[1]
    return model.speedup(workers, hosts)


def move_pays(job: Job, workers: int, hosts_now: int, hosts_then: int, now: float, cost_s: float) -> bool:
    """Whether moving ``job`` (``workers`` of them) from ``hosts_now`` hosts to ``hosts_then``
    pays back ``cost_s`` (the stall of its restart; 0 for a job that restarts anyway): the time
    the faster spread saves over its horizon, as for a change of size (the lesser of its age and
    the time since its allocation last changed, clamped to ``MIN_HORIZON_S..MAX_HORIZON_S``)."""
    before, after = speed_on(job, workers, hosts_now), speed_on(job, workers, hosts_then)
    if not after > before * (1 + TIE):
        return False
    last = np.nan if job.last_rescale is None else job.last_rescale
    horizon = float(_horizons(now, np.float64(job.submitted), np.float64(last)))
    return horizon * (1 - before / after) > cost_s


def moves_that_pay(snap: Snapshot, rows: np.ndarray, workers: np.ndarray, hosts_now: np.ndarray,
                   cost_s: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`move_pays` for the jobs at ``rows`` of ``snap`` (running ``workers`` over
    ``hosts_now`` hosts; ``cost_s``: each one's restart) onto every number of hosts from the
    fewest their size needs (``least``) to ``hosts_now``, in one vectorised pass: job ``k``
    moved onto ``h`` hosts pays where ``pays[at[k] + h - least[k]]``. Returns (pays, at, least)."""
    t = _table(snap)
    least = np.minimum(np.ceil(workers / t.per_host).astype(np.int64), hosts_now)
    sizes = hosts_now.astype(np.int64) - least + 1
    at = np.cumsum(sizes) - sizes
    seg = np.repeat(np.arange(len(rows)), sizes)
    h = (np.arange(int(sizes.sum())) - at[seg] + least[seg]).astype(np.float64)
    # each job modelled on one host and on two (the model reads only whether it spans hosts),
    # spread over its counts; a misfit model's measured points per count
    k = len(rows)
    w = workers.astype(np.float64)
    two, e, _ = _modelled(t, np.concatenate([rows, rows]), np.concatenate([w, w]),
                          np.repeat([1.0, 2.0], k))
    log_s = np.where(h == 1, two[:k][seg], two[k:][seg])
    e = e[:k][seg]  # the workers each job is modelled at
    log_s = _with_measured(t, rows[seg], e, np.minimum(h, e), log_s)
    gain = log_s - log_s[at + sizes - 1][seg]  # against the spread it runs on
    horizon = _horizons(snap.now, t.submitted[rows], t.last_rescale[rows])[seg]
    with np.errstate(over="ignore", invalid="ignore"):
        pays = (gain > np.log1p(TIE)) & (horizon * -np.expm1(-gain) > cost_s[seg])
    return pays, at, least


def with_batches(plan: Plan, snap: Snapshot) -> Plan:
    """``plan`` with the global batch of every adaptive job that is given workers: the batch of
    most goodput on its target and the hosts its slots lie on (:func:`best_batches`; its own
    batch until its gradients are measured)."""
    t = _table(snap)
    if not t.any_batching:
        return plan
    rows = getattr(plan.slots, "snapshot_rows", None)  # the vectorised plan's: its jobs' rows
    if rows is None:
        rows = t.rows_named(plan.jobs)
    target = np.asarray(plan.target, dtype=np.int64)
    batch = np.where(target > 0, t.base_batch[rows], 0).astype(np.int64)
    choose = np.flatnonzero((target > 0) & t.adaptive[rows])
    if len(choose):
        n = target[choose]
        # the step reads only whether the job spans hosts (one host, or more: the network's terms)
        spans = getattr(plan.slots, "spans_hosts", None)  # the vectorised plan's, from host ids
        if spans is not None:
            hosts = np.where(spans(choose), 2, 1)
        else:
            hosts = np.fromiter((len({h for h, _ in plan.slots.placements(k)}) for k in choose.tolist()),
                                np.int64, len(choose))
        hosts = np.clip(hosts, 1, n)  # (a job told to wait for slots still being released holds none yet)
        batch[choose] = best_batches(t.batch_rows(rows[choose], n, hosts))[0]
    return dataclasses.replace(plan, batch=tuple(batch.tolist()))


def goodput_fill(
    jobs: Sequence[Job], mins: Sequence[int], caps: Sequence[int], capacity: int, snap: Snapshot,
    rescale_cost_s: float,
) -> list[int]:
    """Targets for the admitted ``jobs`` (jobs of ``snap``, rank order; ``sum(mins) <=
    capacity``): see the module docstring. ``rescale_cost_s``: the stall a running job's change
    must pay back."""
    return goodput_fill_array(jobs, mins, caps, capacity, snap, rescale_cost_s).tolist()


def goodput_fill_array(
    jobs: Sequence[Job], mins: Sequence[int] | np.ndarray, caps: Sequence[int] | np.ndarray, capacity: int,
    snap: Snapshot, rescale_cost_s: float, priority: np.ndarray | None = None,
) -> np.ndarray:
    """:func:`goodput_fill` as an array (the vectorised policy's form; ``priority``: the jobs'
    priorities, where the caller has them as a column)."""
    n = len(jobs)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    lo = np.asarray(mins, dtype=np.int64)
    cap = np.asarray(caps, dtype=np.int64)
    t = _table(snap, getattr(jobs, "snapshot_columns", None))
    rows = t.rows_of(jobs)
    if priority is None:
        priority = np.fromiter(map(attrgetter("priority"), jobs), np.float64, n)
    w = _weights(np.asarray(priority, np.float64), t.attained[rows])
    c = _Curves(t, rows, w, lo, cap, capacity - int(lo.sum()))
    everyone = np.arange(n)
    helds = np.minimum(t.held[rows], lo + c.sizes - 1)
    horizon = _horizons(snap.now, t.submitted[rows], t.last_rescale[rows])
    kept = c
    if rescale_cost_s > 0:
        running = np.flatnonzero((t.held[rows] > 0) & (helds >= lo))
        if len(running):
            cost = np.minimum(rescale_cost_s / horizon[running], MOST_RESTART_SHARE)
            kept = c.keeping(running, helds[running], -np.log1p(-cost) * w[running])
    targets = _solve(kept, everyone, capacity)
    pinned = _pins(c, horizon, helds, targets, capacity, rescale_cost_s)
    if len(pinned):
        rest = np.setdiff1d(everyone, pinned)
        targets = helds.copy()
        targets[rest] = _solve(kept, rest, capacity - int(helds[pinned].sum()))
    return _explore(c, targets, cap, capacity, pinned, t.per_host)


def _horizons(now: float, submitted: np.ndarray, last_rescale: np.ndarray) -> np.ndarray:
    """How long a change of each job is counted over: the lesser of its age and the time since
    its allocation last changed (``last_rescale``, nan: never), clamped to
    ``MIN_HORIZON_S..MAX_HORIZON_S`` (module docstring)."""
    return np.clip(now - np.fmax(submitted, last_rescale), MIN_HORIZON_S, MAX_HORIZON_S)


def _pins(c: _Curves, horizon, helds, targets, capacity: int, cost: float) -> np.ndarray:
    """Running jobs whose change does not pay back its stall over its ``horizon``: they keep
    what they hold (in rank order, while the others' minimums still fit)."""
    if cost <= 0:
        return np.zeros(0, dtype=np.int64)
    cand = np.flatnonzero((helds >= c.lo) & (targets != helds))
    if len(cand) == 0:
        return cand
    # what the change gains, in log speed-up: a grow its own; a shrink what the slots it frees
    # are worth to the job that gains most from them, less its own loss
    own = (c.at(cand, targets[cand]) - c.at(cand, helds[cand])) / c.w[cand]
    value = _slot_value(c, helds, targets)
    freed = (helds[cand] - targets[cand]).clip(min=0)
    worth = np.where(freed > 0, value * np.maximum(freed, 1), 0.0)  # (inf * 0 would be nan)
    gain = np.where(targets[cand] > helds[cand], own, own + worth / c.w[cand])
    with np.errstate(over="ignore", invalid="ignore"):
        pays = (gain > 0) & (horizon[cand] * -np.expm1(-np.maximum(gain, 0)) > cost)
    keep = cand[~pays]
    room = capacity - int(c.lo.sum())
    return keep[np.cumsum(helds[keep] - c.lo[keep]) <= room]


def _slot_value(c: _Curves, helds, targets) -> float:
    """What a slot is worth in this plan: the most any job gains per slot it is given beyond
    what it holds (a job that holds nothing: beyond its minimum, which the pins always leave
    room for); 0 if none is given any."""
    base = np.maximum(helds, c.lo)
    grows = np.flatnonzero(targets > base)
    if len(grows) == 0:
        return 0.0
    per = (c.at(grows, targets[grows]) - c.at(grows, base[grows])) / (targets[grows] - base[grows])
    return max(float(per.max()), 0.0)


def _explore(c: _Curves, targets, caps, capacity: int, pinned, per_host: int) -> np.ndarray:
    """Slots no model promises a gain for are lent to learn on: an idle GPU costs nothing but a
    restart. First, max-min fairly by weight, to jobs whose model is still uncertain (up to
    their caps); then, in rank order, a job whose model is certain goes to twice the most it
    has measured (so each size is tried once: a model fitted on few sizes can miss one that
    runs well, as a job whose second host is slow and whose third and fourth pay). Packable
    sizes only."""
    left = capacity - int(targets.sum())
    if left <= 0:
        return targets
    out = targets.copy()
    mask = c.uncertain & (targets < caps)
    mask[pinned] = False
    idx = np.flatnonzero(mask)
    if len(idx):
        part = weighted_fill_array(targets[idx], caps[idx], c.w[idx], int(targets[idx].sum()) + left)
        out[idx] = np.maximum(targets[idx], _packed_floor(part, c.lo[idx], caps[idx], per_host))
        left = capacity - int(out.sum())
    try_to = _packed_floor(np.minimum(caps, 2 * c.largest), c.lo, caps, per_host)
    certain = ~c.uncertain & (try_to > c.largest) & (try_to > out)
    certain[pinned] = False
    for i in np.flatnonzero(certain).tolist():
        step = int(try_to[i] - out[i])
        if step <= left:
            out[i] += step
            left -= step
    return out


def _packed_floor(n: np.ndarray, lo: np.ndarray, caps: np.ndarray, per_host: int) -> np.ndarray:
    """The largest packable size (see :class:`_Curves`) at most ``n``."""
    big = (n > per_host) & (n % per_host != 0) & (n != lo) & (n != caps)
    return np.where(big, np.maximum(lo, n - n % per_host), n)


def _solve(c: _Curves, idx: np.ndarray, capacity: int) -> np.ndarray:
    """Workers for jobs ``idx`` maximising their summed (packable) objective with ``sum <=
    capacity``, by the Lagrangian (bisection on the price of a slot) and a greedy top-up.
    After :data:`NARROW_AFTER` bisections only the jobs whose pick still differs between the
    two ends of the bracket are searched, on their points between the two picks: the same
    price, in a fraction of the passes over every job's points."""
    if len(idx) == 0:
        return np.zeros(0, dtype=np.int64)
    sizes = c.sizes[idx]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    seg = np.repeat(np.arange(len(idx)), sizes)
    offs = np.arange(int(sizes.sum())) - starts[seg]
    flat = c.packable[c.starts[idx][seg] + offs]
    rel = flat - flat[starts][seg]
    lo = c.lo[idx]
    room = capacity - int(lo.sum())
    extra = _pick(rel, offs, starts, seg, 0.0)
    if int(extra.sum()) > room:
        # a price above every job's best average gain per worker keeps everyone at its min
        with np.errstate(invalid="ignore"):
            slope = np.where(offs > 0, rel / np.maximum(offs, 1), 0.0)
        a, b = 0.0, max(float(np.max(slope, initial=0.0)), 0.0) + 1.0
        most, fewest = extra, _pick(rel, offs, starts, seg, b)  # the picks at a and at b
        # after a few rounds on every point, only the jobs whose pick still moves between a
        # and b are searched on, and only their points between the two picks (a higher price
        # never picks more workers)
        part = (rel, offs, starts, seg)
        fixed = 0
        for step in range(BISECTIONS):
            mid = (a + b) / 2
            got = _pick(*part, mid)
            if fixed + int(got.sum()) > room:
                a = mid
                most = got
            else:
                b = mid
                fewest = got
            if b - a <= 1e-12 * b:
                break
            if step == NARROW_AFTER:
                moving = most != fewest
                if not moving.any():
                    break
                fixed = int(fewest[~moving].sum())
                most, fewest = most[moving], fewest[moving]
                count = most - fewest + 1
                s_starts = np.cumsum(count) - count
                s_seg = np.repeat(np.arange(len(count)), count)
                on = (starts[moving] + fewest - s_starts)[s_seg] + np.arange(len(s_seg))
                part = (rel[on], offs[on], s_starts, s_seg)
        extra = _pick(rel, offs, starts, seg, b)
        # (at price 0 every job is at its best already: no step gains)
        left = room - int(extra.sum())
        if left > 0:
            extra = _top_up(flat, starts, sizes, extra, left)
    return lo + extra


def _pick(rel: np.ndarray, offs: np.ndarray, starts: np.ndarray, seg: np.ndarray, lam: float) -> np.ndarray:
    """Each job's workers beyond its minimum at price ``lam`` a worker: the point of most
    ``rel - lam * offs`` (ties: fewer workers)."""
    val = rel - lam * offs
    best = np.maximum.reduceat(val, starts)
    return np.minimum.reduceat(np.where(val >= best[seg] - TIE, offs, _BIG), starts)


_BIG = np.iinfo(np.int64).max


def _top_up(flat: np.ndarray, starts: np.ndarray, sizes: np.ndarray, extra: np.ndarray, left: int):
    """Hand out ``left`` more workers, one step at a time to the job whose next allowed size
    (the next finite point of its curve) gains most per worker, while the step fits (ties: the
    higher-ranked job)."""
    extra = extra.copy()
    m = len(flat)
    # nxt[p]: the next finite point after p in p's curve (m: none)
    pos = np.where(np.isfinite(flat), np.arange(m), m)
    ends = starts + sizes
    after = np.minimum.accumulate(pos[::-1])[::-1]  # first finite point at or after p
    nxt = np.append(after[1:], m)
    seg_end = np.repeat(ends, sizes)
    nxt = np.where(nxt < seg_end, nxt, m)
    while left > 0:
        cur = starts + extra
        q = nxt[cur]
        step = q - cur
        ok = (q < m) & (step <= left)
        if not ok.any():
            break
        gain = np.full(len(sizes), -np.inf)
        idx = np.flatnonzero(ok)
        gain[idx] = (flat[q[idx]] - flat[cur[idx]]) / step[idx]
        best = int(np.argmax(gain))
        if gain[best] <= TIE:
            break
        extra[best] += int(step[best])
        left -= int(step[best])
    return extra
