"""A discrete-event cluster simulator that drives the same policy code as the ledger.

Time advances from event to event: job arrivals, job completions and re-plan ticks (every
``replan_interval`` seconds). The policy runs at every tick and, as in the ledger (which
decides on every request and release), at every arrival and completion
(``replan_on_events=False`` re-plans at ticks only, like the artifact). At a tick the simulator builds a
:class:`~elastic_ops.pool.model.Snapshot` of its cluster (hosts of ``slots_per_host`` slots,
jobs with the slots they hold) and calls the policy; slots a plan releases are given back at
once (a job reaches an iteration boundary within seconds, far below the tick), and the policy
is called again until the plan is stable, so grows see the freed slots in the same tick.

Every change of a running job's worker count, and every start, costs ``rescale_cost``
seconds without progress (checkpoint, restart, rendezvous; the artifact charges 30 s). A job
runs at ``1 / step_time(workers, global_batch, spread)`` iterations per second, where the
spread is how its slots lie on the hosts (``placement="actual"``, the default: a job scattered
over more hosts than it needs runs at the speed measured for that spread) or the tightest
packing whatever its slots (``placement="packed"``, the optimistic model of earlier versions),
and finishes after the iterations its application needs (see :mod:`elastic_ops.pool.workload`).
With ``placement="actual"`` a *move* (same count, other slots) relaunches the workers and costs
``rescale_cost`` too.

**What a policy sees.** The policy knows a job only as production does: its demand and, for
``goodput``, the scaling model fitted to what the job *measured* -- iterations and training
seconds (stalls excluded) per (workers, hosts), as its heartbeats would report them -- and the
GPU-seconds it has trained. It never reads the traces' step times.

**Adaptive jobs** (``adaptive=True``, under ``goodput``): every job lets the pool choose its
global batch, from the smallest batch its application's traces measured to the largest, with
a per-GPU batch the traces measured (no accumulation), and ``max_workers`` tuned at the
largest batch as :func:`tuned_max_workers` tunes it at the job's own. It trains at its own
batch until it has measured its gradients; then at the batch each plan chose, changed at an
iteration boundary without a restart. Its work stays its own: the iterations its own batch
needs, an iteration at another batch counting for the ratio of the two batches' AdaScale
gains in the epoch it is in (the traces' ``grad_sqr`` and ``grad_var``); it reports the
gradient statistics of the batch it runs, as its workers would measure them. The other
policies do not choose batches: they run the same jobs at their own batch.

Baselines: ``static``: each job gets exactly the GPUs it asked for, strictly first come first
served (no backfilling), never rescaled; it starts as soon as its GPUs are free (not only at
ticks), which favours the baseline. ``tiresias``: Tiresias's two-dimensional least attained
service (Gu et al., NSDI'19) as the Pollux paper compares with it: jobs at the GPUs they asked
for (no elasticity), in two queues by attained GPU-time (below ``TIRESIAS_THRESHOLD_GPU_S``
first), first come first served inside a queue, backfilling, preempting running jobs that
rank lower, placed on as few hosts as they fit; re-decided at the same ticks and events.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic_ops.errors import SpecError, UnknownPolicyError
from elastic_ops.pool.model import Host, Job, PolicyConfig, Preemption, Snapshot, Tenant
from elastic_ops.pool.plain_policies import best_fit
from elastic_ops.pool.policies import LEARNING, POLICIES, get_policy
from elastic_ops.pool.scaling import Batching, GradStats, Measured, ScalingModel, fit
from elastic_ops.pool.workload import (
    GPUS_PER_NODE,
    MAX_SUBMIT_S,
    TRACES_ENV,
    Application,
    WorkloadJob,
    default_traces_dir,
    load_application,
    read_workload,
    spread_of,
    synthetic_workload,
)
from elastic_ops.spec import check_number

STATIC = "static"
TIRESIAS = "tiresias"
BASELINES = (STATIC, TIRESIAS)
TIRESIAS_THRESHOLD_GPU_S = 16 * 3600.0  # the Pollux artifact's setting: 16 GPU-hours
REFIT_S = 600.0  # a job's model is refitted at a new configuration, else at most this often
EPS = 1e-6
# A job is done when what is left is below the clock's rounding (about 1e-16 of its reading):
# a relative 1e-12 covers that with room, and stays a millisecond at the latest arrival a
# workload may have (1e9 s; 1e-6 of it would end jobs 1000 s early).
CLOCK_ROUNDING = 1e-12
PLACEMENTS = ("actual", "packed")


def tuned_max_workers(app: Application, batch: int, limit: int, min_efficiency: float = 0.5) -> int:
    """The largest worker count that is faster than every smaller one and keeps at least
    ``min_efficiency`` of linear scaling: the ``max_workers`` a user would tune for the job."""
    base = app.step_time(1, batch)
    best_t, best_r = base, 1
    for r in range(2, app.max_workers(batch, limit) + 1):
        t = app.step_time(r, batch)
        if t < best_t and base / (t * r) >= min_efficiency:
            best_t, best_r = t, r
    return best_r


@dataclasses.dataclass
class _SimJob:
    spec: WorkloadJob
    iterations: float
    max_workers: int
    app: Application
    remaining: float = 0.0
    held: tuple[tuple[str, int], ...] = ()
    penalty: float = 0.0
    started: float | None = None
    finished: float | None = None
    last_rescale: float | None = None
    rescales: int = 0
    moves: int = 0
    gpu_seconds: float = 0.0
    scattered_gpu_seconds: float = 0.0  # on more hosts than the tightest packing needs
    waiting_since: float = 0.0  # as the ledger: since submission, or since preempted (set at start)
    spread_aware: bool = True
    slots_per_host: int = GPUS_PER_NODE
    # what the job measured, per (workers, hosts, batch scale): [iterations, training seconds]
    measured: dict[tuple[int, int, float], list[float]] = dataclasses.field(default_factory=dict)
    # adaptive (scaling: adaptive): the batches the pool may choose, the one it runs at (0: its
    # own), and the iterations at its own batch where each epoch ends (its statistics change)
    batching: Batching | None = None
    batch: int = 0
    epoch_its: tuple[float, ...] = ()
    batch_changes: int = 0
    model: ScalingModel | None = None
    fitted_at: float = -math.inf
    fitted_on: int = 0  # configurations measured at the last fit
    target: int = 0  # what a plan without anti-thrashing gave it last (tenants' restore times)
    _rate: float = 0.0  # iterations at its own batch (their statistical worth) per second
    _step: float = 0.0  # seconds per iteration at the batch it runs
    _scattered: bool = False
    _hosts: int = 0

    def place(self, held: tuple[tuple[str, int], ...]) -> None:
        self.held = held
        spread = spread_of(held)
        self._hosts = len(spread)
        self._scattered = len(spread) > math.ceil(len(held) / self.slots_per_host)
        if not held:
            self._rate = self._step = 0.0
            return
        where = spread if self.spread_aware else None
        self._step = self.app.step_time(len(held), self.global_batch(), where)
        self._rate = self._worth() / self._step

    def global_batch(self) -> int:
        return self.batch or self.spec.batch_size

    def _done(self) -> float:
        # a job stopped on an epoch's end by rounding may be a hair short of it: count it past
        return self.iterations - self.remaining + 1e-9 * self.iterations

    def _epoch(self) -> int:
        done = self._done()
        return min(bisect.bisect_right(self.epoch_its, done), len(self.epoch_its) - 1)

    def _worth(self) -> float:
        """What one iteration at the batch it runs is worth in iterations at its own batch:
        the ratio of their AdaScale gains in the epoch it is in (1 at its own batch)."""
        if self.batching is None or self.global_batch() == self.spec.batch_size:
            return 1.0
        e = self._epoch()
        return self.app.gain(self.global_batch(), e) / self.app.gain(self.spec.batch_size, e)

    def _to_epoch_end(self) -> float:
        """Iterations (at its own batch) left in its epoch: at the end its rate changes."""
        if self.batching is None or self.global_batch() == self.spec.batch_size:
            return math.inf
        k = bisect.bisect_right(self.epoch_its, self._done())
        return self.epoch_its[k] - (self.iterations - self.remaining) if k < len(self.epoch_its) else math.inf

    def rate(self) -> float:
        return self._rate

    def time_to_finish(self) -> float:
        if not self.held:
            return math.inf
        return self.penalty + self.remaining / self.rate()

    def time_to_event(self) -> float:
        """Until it finishes or its rate changes (an epoch ends)."""
        if not self.held:
            return math.inf
        return self.penalty + min(self.remaining, self._to_epoch_end()) / self.rate()

    def grad(self) -> GradStats | None:
        """Its gradient statistics as its workers would measure them at the batch it runs,
        the variance that of one batch of its own size (None: not trained yet)."""
        if self.batching is None or not self.measured:
            return None
        sqr, var = self.app.grad_stats(self.global_batch(), self._epoch())
        return GradStats(max(sqr, 0.0), max(var, 0.0) * self.app.base_batch / self.spec.batch_size)

    def set_batch(self, batch: int) -> None:
        """Train at global ``batch`` from now: at an iteration boundary, no restart."""
        if batch != self.batch:
            self.batch_changes += batch != self.global_batch()  # (0 and its own are one batch)
            self.batch = batch
            self.place(self.held)

    def advance(self, dt: float) -> None:
        self.gpu_seconds += dt * len(self.held)
        if self._scattered:
            self.scattered_gpu_seconds += dt * len(self.held)
        if not self.held:
            return
        stall = min(self.penalty, dt)
        self.penalty -= stall
        epoch = self._epoch() if self.batching is not None else 0
        self.remaining -= (dt - stall) * self.rate()
        if dt > stall:
            scale = self.global_batch() / self.spec.batch_size
            acc = self.measured.setdefault((len(self.held), self._hosts, scale), [0.0, 0.0])
            acc[0] += (dt - stall) / self._step
            acc[1] += dt - stall
        if self.batching is not None and self._epoch() != epoch:
            self.place(self.held)  # a new epoch: its statistics, so its rate, changed

    def attained(self) -> float:
        """GPU-seconds of training, from what it measured."""
        return sum(n * sec for (n, _, _), (_, sec) in self.measured.items())

    def scaling(self, now: float) -> ScalingModel | None:
        """The model fitted to what it measured: refitted when it measured a new configuration,
        else at most every REFIT_S seconds."""
        if not self.measured:
            return None
        if len(self.measured) != self.fitted_on or now - self.fitted_at >= REFIT_S:
            self.model = fit([Measured(n, h, max(1, round(it)), sec, scale)
                              for (n, h, scale), (it, sec) in self.measured.items() if sec > 0])
            self.fitted_at, self.fitted_on = now, len(self.measured)
        return self.model


@dataclasses.dataclass(frozen=True)
class SimConfig:
    slots: int = 64
    slots_per_host: int = 4
    rescale_cost: float = 30.0
    replan_interval: float = 60.0
    preemption: str = "graceful"
    min_rescale_interval_s: float = 0.0
    min_gain: float = 0.0
    aging_s: float = 600.0
    # Like the ledger, which decides on every request and release: re-plan at arrivals and
    # completions too, not only at ticks. False = the artifact's tick-only re-planning.
    replan_on_events: bool = True
    placement: str = "actual"  # step times for the job's real spread over hosts, or "packed"
    # every job scaling: adaptive under a policy that chooses batches (goodput): from its own
    # batch up to the largest its application's traces measured
    adaptive: bool = False
    # the pool's tenants (elastic_ops.pool.tenants); each job's is its workload row's
    tenants: tuple[Tenant, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.adaptive, bool):
            raise SpecError("adaptive", self.adaptive, "must be true or false")
        if self.placement not in PLACEMENTS:
            raise SpecError("placement", self.placement, f"must be one of {', '.join(PLACEMENTS)}")
        if not isinstance(self.slots, int) or self.slots < 1:
            raise SpecError("slots", self.slots, "must be an integer >= 1")
        if not isinstance(self.slots_per_host, int) or self.slots_per_host < 1:
            raise SpecError("slots_per_host", self.slots_per_host, "must be an integer >= 1")
        for f in ("rescale_cost", "min_rescale_interval_s", "min_gain", "aging_s"):
            check_number(f, getattr(self, f), minimum=0)
        # a re-plan tick more often than every second only makes the run take forever
        check_number("replan_interval", self.replan_interval, minimum=1)


def _check_jobs(workload: Sequence[WorkloadJob]) -> None:
    """What read_workload checks of a file, for a list the caller built."""
    seen: set[str] = set()
    for w in workload:
        # the policies and the metrics know a job by its name: two jobs of one name would be one job
        if w.name in seen:
            raise SpecError("workload", w.name, "job names must be unique: this one is used twice")
        seen.add(w.name)
        # past the bound the clock stops moving (now + a tick == now) and the run never ends
        if not (math.isfinite(w.submit) and 0 <= w.submit <= MAX_SUBMIT_S):
            raise SpecError("workload", w.name, f"submit must be a number of seconds from 0 to "
                            f"{MAX_SUBMIT_S:,.0f}, not {w.submit!r}")


class Simulation:
    def __init__(self, workload: Sequence[WorkloadJob], policy: str, config: SimConfig, traces: str | Path):
        if policy not in BASELINES and policy not in POLICIES:  # unknown names fail before any work
            raise UnknownPolicyError(policy, [*BASELINES, *POLICIES])
        _check_jobs(workload)
        self.policy = policy
        self.cfg = config
        n_hosts = math.ceil(config.slots / config.slots_per_host)
        self.hosts = tuple(
            Host(f"n{i:03d}", min(config.slots_per_host, config.slots - i * config.slots_per_host))
            for i in range(n_hosts)
        )
        self.pconfig = PolicyConfig(
            preemption=Preemption(config.preemption),
            min_rescale_interval_s=config.min_rescale_interval_s,
            min_gain=config.min_gain,
            aging_s=config.aging_s,
            rescale_cost_s=config.rescale_cost,
        )
        self.jobs: list[_SimJob] = []
        self._reclaim_at = math.inf  # when a borrower's rescale protection ends while a tenant is short
        self._tenants = _TenantClock(config.tenants, workload, config.slots) if config.tenants else None
        for w in workload:
            try:
                app = load_application(str(traces), w.application)
            except SpecError as exc:
                if exc.field != "application":
                    raise
                allowed = f"job {w.name!r}: {exc.allowed}"
                raise SpecError(exc.field, exc.value, allowed, hint=exc.hint) from None
            app.check_batch(w.name, w.batch_size)
            job = _SimJob(
                w, app.iterations(w.batch_size), tuned_max_workers(app, w.batch_size, config.slots), app,
                spread_aware=config.placement == "actual", slots_per_host=config.slots_per_host,
            )
            if config.adaptive and policy in LEARNING:
                # from the smallest batch its traces measured to the largest (as the Pollux
                # artifact's jobs), per worker what the traces measured (no accumulation);
                # its own batch until its gradients are measured
                job.batching = Batching(w.batch_size, max(app.validation), max(1, math.ceil(app.min_local)),
                                        app.base_batch, max(1, math.floor(app.max_local)))
                job.max_workers = tuned_max_workers(app, job.batching.most, config.slots)
                job.epoch_its = app.epoch_iterations(w.batch_size)
            job.remaining = job.iterations
            self.jobs.append(job)
        self.now = 0.0

    # --- running ---------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        pending = sorted(self.jobs, key=lambda j: (j.spec.submit, j.spec.name))
        arrived: list[_SimJob] = []
        next_tick = 0.0
        while pending or any(j.finished is None for j in arrived):
            if pending and all(j.finished is not None for j in arrived):
                # an empty cluster: re-planning it changes nothing, and one tick at a time a far
                # arrival (days, years away) would take forever to reach
                next_tick = self._tick_at_or_after(next_tick, pending[0].spec.submit)
            running = [j for j in arrived if j.finished is None and j.held]
            t_done = min((self.now + j.time_to_event() for j in running), default=math.inf)
            t_arr = pending[0].spec.submit if pending else math.inf
            t_next = min(t_done, t_arr, next_tick if self.policy != STATIC else math.inf, self._reclaim_at)
            if t_next == math.inf:  # static: nothing runs and nothing arrives -> stuck
                raise SpecError(
                    "workload", self.jobs[0].spec.name, "a job asks for more GPUs than the cluster has"
                )
            for j in running:
                j.advance(t_next - self.now)
            if self._tenants is not None:
                self._tenants.advance(arrived, self.now, t_next)
            self.now = t_next
            changed = t_next >= self._reclaim_at  # a borrower's protection is over: reclaim now
            self._reclaim_at = math.inf
            for j in running:
                if j.time_to_finish() <= max(EPS, CLOCK_ROUNDING * self.now):
                    j.finished, changed = self.now, True
                    j.place(())
            while pending and pending[0].spec.submit <= self.now + EPS:
                arrived.append(pending.pop(0))
                changed = True
            if self.policy == STATIC:
                self._static(arrived)
            elif self.now >= next_tick - EPS or (changed and self.cfg.replan_on_events):
                if self.policy == TIRESIAS:
                    self._tiresias(arrived)
                else:
                    self._replan(arrived)
                next_tick = self.now + self.cfg.replan_interval
            if self._tenants is not None:
                interval = self.cfg.min_rescale_interval_s
                self._reclaim_at = self._tenants.reclaim_at(arrived, self.now, interval)
        return self._metrics()

    def _tick_at_or_after(self, tick: float, t: float) -> float:
        """The first tick at or after ``t`` of the ticks ``tick + k * replan_interval`` (the ones
        re-planning the empty cluster would have reached: the tick-only timing stays as it was)."""
        if t <= tick:
            return tick
        return tick + math.ceil((t - tick) / self.cfg.replan_interval) * self.cfg.replan_interval

    def _start_or_rescale(self, j: _SimJob, held: tuple[tuple[str, int], ...]) -> None:
        if len(held) != len(j.held):
            if j.held and not held:  # preempted: it waits (and ages) from now, as in the ledger
                j.waiting_since = self.now
            if j.held and held:
                j.rescales += 1
            if held:
                j.penalty = self.cfg.rescale_cost
                j.last_rescale = self.now
                if j.started is None:
                    j.started = self.now
        elif held and j.spread_aware and set(held) != set(j.held):  # a move relaunches the workers
            j.moves += 1
            j.penalty = self.cfg.rescale_cost
        j.place(held)

    def _static(self, arrived: list[_SimJob]) -> None:
        used = {s for j in arrived for s in j.held}
        free = [(h.name, i) for h in self.hosts for i in range(h.slots) if (h.name, i) not in used]
        for j in arrived:
            if j.finished is not None or j.held:
                continue
            need = min(j.spec.num_replicas, self.cfg.slots)
            if need > len(free):
                break  # strict FIFO: the head of the queue blocks everyone behind it
            self._start_or_rescale(j, tuple(free[:need]))
            free = free[need:]

    def _tiresias(self, arrived: list[_SimJob]) -> None:
        active = [j for j in arrived if j.finished is None]
        order = sorted(active, key=lambda j: (j.attained() >= TIRESIAS_THRESHOLD_GPU_S, j.spec.submit,
                                              j.spec.name))
        budget, chosen = self.cfg.slots, []
        for j in order:  # backfilling: a job that does not fit lets smaller ones behind it run
            need = min(j.spec.num_replicas, self.cfg.slots)
            if need <= budget:
                chosen.append(j)
                budget -= need
        keep = {id(j) for j in chosen}
        for j in active:
            if j.held and id(j) not in keep:
                self._start_or_rescale(j, ())  # preempted: it checkpoints and waits
        free: dict[str, list[int]] = {h.name: list(range(h.slots)) for h in self.hosts}
        for j in active:
            for h, i in j.held:
                free[h].remove(i)
        for j in chosen:
            if not j.held:
                self._start_or_rescale(j, _packed(free, min(j.spec.num_replicas, self.cfg.slots)))

    def _snapshot(self, active: list[_SimJob], refit: bool = True) -> Snapshot:
        """``refit=False``: each job's model as last fitted (a look that changes nothing)."""
        learns = self.policy in LEARNING
        jobs = tuple(
            Job(
                name=j.spec.name,
                min_workers=1,
                max_workers=j.max_workers,
                priority=1,
                submitted=j.spec.submit,
                waiting_since=None if j.held else max(j.spec.submit, j.waiting_since),
                last_rescale=j.last_rescale,
                held=j.held,
                scaling=(j.scaling(self.now) if refit else j.model) if learns else None,
                attained=j.attained() if learns else 0.0,
                batching=j.batching,
                grad=j.grad(),
                tenant=j.spec.tenant,
            )
            for j in active
        )
        return Snapshot(self.hosts, jobs, self.now, self.pconfig, self.cfg.tenants)

    def _replan(self, arrived: list[_SimJob]) -> None:
        active = [j for j in arrived if j.finished is None]
        by_name = {j.spec.name: j for j in active}
        policy = get_policy(self.policy)
        for _ in range(4):  # release, then let grows take the freed slots; stops when stable
            changed = False
            plan = policy(self._snapshot(active))
            for k, placements in plan.slots.changed_placements().items():  # the others keep theirs
                changed = True
                self._start_or_rescale(by_name[plan.jobs[k]], placements)
            for k in range(len(plan.jobs)) if plan.batch else ():
                if plan.batch_of(k):  # 0: it is given no workers, its batch stays
                    by_name[plan.jobs[k]].set_batch(plan.batch_of(k))
            if not changed:
                break
        if self._tenants is not None and self._tenants.borrowed_now(active):
            self._entitled(active, policy)

    def _entitled(self, active: list[_SimJob], policy) -> None:
        """Each job's target without anti-thrashing: what its tenant is entitled to now (the
        tenants' restore times compare what they hold with it)."""
        snap = self._snapshot(active, refit=False)
        free = dataclasses.replace(snap.config, min_rescale_interval_s=0.0, min_gain=0.0)
        plan = policy(dataclasses.replace(snap, config=free))
        by_name = {j.spec.name: j for j in active}
        for k, name in enumerate(plan.jobs):
            by_name[name].target = plan.target[k]

    def _metrics(self) -> dict[str, Any]:
        jcts = sorted(j.finished - j.spec.submit for j in self.jobs)
        first = min(j.spec.submit for j in self.jobs)
        makespan = max(j.finished for j in self.jobs) - first
        p99 = jcts[min(len(jcts) - 1, math.ceil(0.99 * len(jcts)) - 1)]
        busy = sum(j.gpu_seconds for j in self.jobs)
        by_app: dict[str, list[float]] = {}
        for j in self.jobs:
            by_app.setdefault(j.spec.application, []).append(j.finished - j.spec.submit)
        return {
            "policy": self.policy,
            "jobs": len(jcts),
            "avg_jct": round(sum(jcts) / len(jcts), 3),
            "p99_jct": round(p99, 3),
            "makespan": round(makespan, 3),
            "utilization": round(busy / (self.cfg.slots * makespan), 4) if makespan > 0 else 0.0,
            "rescales": sum(j.rescales for j in self.jobs),
            "moves": sum(j.moves for j in self.jobs),
            "batch_changes": sum(j.batch_changes for j in self.jobs),  # adaptive jobs: no restart
            # GPU time of jobs spread over more hosts than the tightest packing needs
            "scattered": round(sum(j.scattered_gpu_seconds for j in self.jobs) / busy, 4) if busy else 0.0,
            "placement": self.cfg.placement,
            "avg_jct_by_application": {a: round(sum(v) / len(v), 3) for a, v in sorted(by_app.items())},
            **({"tenants": self._tenants.metrics(self.jobs)} if self._tenants is not None else {}),
        }


class _TenantClock:
    """What the tenants get over time: per tenant, slot-seconds held beyond its guarantee
    (borrowed), seconds below its guarantee while other tenants borrow what it is entitled to
    (short: what a plan without anti-thrashing gives its jobs, less what they hold, is more than
    the free slots), and how long each shortfall took to be given back (its restore time)."""

    def __init__(self, tenants: Sequence[Tenant], workload: Sequence[WorkloadJob], slots: int) -> None:
        self.slots = slots
        self.g = {t.name: t.guaranteed for t in tenants}
        for w in workload:
            self.g.setdefault(w.tenant, 0)
        self.borrowed = dict.fromkeys(self.g, 0.0)
        self.short = dict.fromkeys(self.g, 0.0)
        # per tenant, (from, to, held, shortfall) while short: what restore_times reads
        self.segments: dict[str, list[tuple[float, float, int, int]]] = {t: [] for t in self.g}

    def _state(self, arrived: list[_SimJob]) -> tuple[dict[str, int], dict[str, int]]:
        """Per tenant, the slots its jobs hold and those the last plan gave them (the policy's
        view of what they want: a goodput job that gains nothing from more is not short)."""
        held = dict.fromkeys(self.g, 0)
        wants = dict.fromkeys(self.g, 0)
        for j in arrived:
            if j.finished is None:
                held[j.spec.tenant] += len(j.held)
                wants[j.spec.tenant] += max(j.target, len(j.held))
        return held, wants

    def borrowed_now(self, active: list[_SimJob]) -> bool:
        held, _ = self._state(active)
        return any(held[t] > g for t, g in self.g.items())

    def _lacks(self, held, wants) -> dict[str, int]:
        """Per short tenant, what borrowers hold of what it is entitled to within its guarantee
        (beyond the free slots: those its own jobs take once their protection ends)."""
        borrowing = {t for t in self.g if held[t] > self.g[t]}
        free = self.slots - sum(held.values())
        lack = {t: min(self.g[t], wants[t]) - held[t] - free for t in self.g}
        return {t: n for t, n in lack.items() if n > 0 and borrowing - {t}}

    def _short(self, held, wants) -> set[str]:
        return set(self._lacks(held, wants))

    def advance(self, arrived: list[_SimJob], t0: float, t1: float) -> None:
        held, wants = self._state(arrived)
        lacks = self._lacks(held, wants)
        for t in self.g:
            self.borrowed[t] += max(0, held[t] - self.g[t]) * (t1 - t0)
            if t in lacks and t1 > t0:
                self.short[t] += t1 - t0
                self.segments[t].append((t0, t1, held[t], lacks[t]))

    def reclaim_at(self, arrived: list[_SimJob], now: float, interval: float) -> float:
        """When the next plan could reclaim for a short tenant: the earliest end of a running
        job's rescale protection (a borrower's, or the short tenant's own job that will grow;
        the ledger plans again within ``plan_refresh_s``; inf: none is short)."""
        held, wants = self._state(arrived)
        if not self._short(held, wants) or interval <= 0:
            return math.inf
        ends = [j.last_rescale + interval for j in arrived if j.finished is None and j.held
                and j.last_rescale is not None and j.last_rescale + interval > now]
        if not ends:
            return math.inf
        at = min(ends)
        last = at - interval
        while at - last < interval:  # the first time the rule (now - last < interval) lets it go
            at = math.nextafter(at, math.inf)
        return at

    def restore_times(self, t: str) -> list[float]:
        """For each moment tenant ``t`` became short by ``s`` slots (its jobs want more, another
        borrows), how long until it held ``s`` more or was short no more."""
        segs = self.segments[t]
        out = []
        for k, (a, _, held, s) in enumerate(segs):
            if k and segs[k - 1][1] == a and segs[k - 1][2:] == (held, s):
                continue  # the same shortfall as the segment before
            end = a
            for b0, b1, h, _ in segs[k:]:
                if b0 > end or h >= held + s:  # not short in between, or covered
                    break
                end = b1
            out.append(end - a)
        return out

    def metrics(self, jobs: list[_SimJob]) -> dict[str, dict[str, float]]:
        out = {}
        for t in sorted(self.g):
            mine = [j.finished - j.spec.submit for j in jobs if j.spec.tenant == t]
            eps = self.restore_times(t)
            out[t] = {
                "guaranteed": self.g[t],
                "jobs": len(mine),
                "avg_jct": round(sum(mine) / len(mine), 3) if mine else 0.0,
                "borrowed_slot_hours": round(self.borrowed[t] / 3600, 3),
                "below_guarantee_s": round(self.short[t], 3),
                "shortfalls": len(eps),
                "max_restore_s": round(max(eps, default=0.0), 3),
            }
        return out


def _packed(free: dict[str, list[int]], n: int) -> tuple[tuple[str, int], ...]:
    """``n`` of the ``free`` slots (taken out of it) on as few hosts as possible: the host with
    the fewest free slots that holds what is still needed, else all of the one with the most."""
    out: list[tuple[str, int]] = []
    while len(out) < n:
        need = n - len(out)
        h = best_fit(sorted((len(v), h) for h, v in free.items() if v), need)
        take, free[h] = free[h][:need], free[h][need:]
        out.extend((h, i) for i in take)
    return tuple(out)


def simulate(
    workload: str | Path | Sequence[WorkloadJob],
    policy: str,
    config: SimConfig | None = None,
    traces: str | Path | None = None,
) -> dict[str, Any]:
    """Run one policy (or ``static``) over a workload; return the metrics dict."""
    jobs = read_workload(workload) if isinstance(workload, str | Path) else list(workload)
    if not jobs:
        raise SpecError("workload", str(workload), "has no jobs")
    return Simulation(jobs, policy, config or SimConfig(), traces or default_traces_dir()).run()


def policy_names(name: str) -> list[str]:
    """The policies ``name`` runs: one registered policy, ``static``, or ``all`` of them."""
    everything = [*BASELINES, *sorted(POLICIES)]
    if name == "all":
        return everything
    if name not in everything:
        raise SpecError("policy", name, f"must be one of {', '.join(everything)}, or all")
    return [name]


def read_tenants(path: str | Path) -> tuple[tuple[Tenant, ...], dict[str, str]]:
    """A tenants file (JSON): ``{"tenants": {NAME: {"guaranteed": N, "max_slots": M, "weight":
    W}}, "jobs": {JOB: NAME}}``; ``jobs`` (optional) puts workload jobs in tenants, in place of
    the workload's ``tenant`` column."""
    from elastic_ops.spec import check_int, check_tenant

    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise SpecError("tenants", str(p), f"a readable JSON tenants file ({exc})") from None
    allowed = '{"tenants": {NAME: {"guaranteed": N, "max_slots": M, "weight": W}}, "jobs": {JOB: NAME}}'
    if not isinstance(data, dict) or not isinstance(data.get("tenants"), dict) or (
            set(data) - {"tenants", "jobs"}):
        raise SpecError("tenants", str(p), f"a JSON object {allowed}")
    out = []
    for name, t in sorted(data["tenants"].items()):
        check_tenant("tenants", name)
        if not isinstance(t, dict) or set(t) - {"guaranteed", "max_slots", "weight"}:
            raise SpecError("tenants", f"{p}: {name}",
                            f"an object of guaranteed, max_slots, weight ({allowed})")
        g = check_int(f"tenants.{name}.guaranteed", t.get("guaranteed", 0), 0, 10**9)
        m = t.get("max_slots")
        if m is not None:
            check_int(f"tenants.{name}.max_slots", m, max(g, 1), 10**9)
        w = check_number(f"tenants.{name}.weight", t.get("weight", 1.0), minimum=0, exclusive=True)
        out.append(Tenant(name, g, m, float(w)))
    jobs = data.get("jobs", {})
    if not isinstance(jobs, dict) or not all(isinstance(v, str) and v in data["tenants"]
                                             for v in jobs.values()):
        raise SpecError("tenants", str(p), "its jobs must map job names to tenants it lists")
    return tuple(out), dict(jobs)


def main_simulate(args) -> int:
    names = policy_names(args.policy)  # a typo fails before any work
    tenants, tenant_of = read_tenants(args.tenants) if getattr(args, "tenants", None) else ((), {})
    cfg = SimConfig(
        slots=args.slots,
        slots_per_host=args.slots_per_host,
        rescale_cost=args.rescale_cost,
        replan_interval=args.replan_interval,
        preemption=args.preemption,
        min_rescale_interval_s=args.min_rescale_interval_s,
        min_gain=args.min_gain,
        placement=args.placement,
        adaptive=args.adaptive,
        tenants=tenants,
    )
    try:
        results = _run_policies(args, names, cfg, tenant_of)
    except SpecError as exc:
        # the CLI shows an error about the traces as --traces; without it they came from elsewhere
        if exc.field == "traces" and not args.traces:
            if os.environ.get(TRACES_ENV):
                raise exc.naming(f"${TRACES_ENV}") from None
            raise SpecError(  # the default folder: the user typed no path, so say where it came from
                "traces", exc.value, exc.allowed,
                hint=f"the default, beside the checkout; pass --traces DIR or set ${TRACES_ENV}",
            ) from None
        raise
    if args.json:
        print(json.dumps(results if args.policy == "all" else results[args.policy], sort_keys=True))
    return 0


def _run_policies(args, names: list[str], cfg: SimConfig, tenant_of: dict[str, str] | None = None
                  ) -> dict[str, dict[str, Any]]:
    traces = Path(args.traces) if args.traces else default_traces_dir()
    if args.synthetic is not None:
        workload: str | list[WorkloadJob] = synthetic_workload(
            traces / "philly.csv", traces, jobs=args.synthetic, seed=args.seed, max_gpus=args.slots
        )
    else:
        workload = args.workload
    if tenant_of:
        jobs = read_workload(workload) if isinstance(workload, str | Path) else workload
        workload = [dataclasses.replace(w, tenant=tenant_of.get(w.name, w.tenant)) for w in jobs]
    results = {}
    for name in names:
        results[name] = r = simulate(workload, name, cfg, traces)
        print(
            f"{name:<10} avg_jct {r['avg_jct']:>10.1f}s  p99_jct {r['p99_jct']:>10.1f}s  "
            f"makespan {r['makespan']:>10.1f}s  utilization {r['utilization']:.3f}  rescales {r['rescales']}"
        )
        for t, m in r.get("tenants", {}).items():
            print(f"  tenant {t:<10} avg_jct {m['avg_jct']:>10.1f}s  below guarantee "
                  f"{m['below_guarantee_s']:.0f}s (longest restore {m['max_restore_s']:.0f}s)  "
                  f"borrowed {m['borrowed_slot_hours']:.1f} slot-hours")
    return results
