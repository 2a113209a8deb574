"""Decision latency of each pool policy as jobs and slots grow.

    .venv/bin/python -m benchmarks.pool_decision [--repeats 5] [--no-reference] [--out FILE]
    .venv/bin/python -m benchmarks.pool_decision --tenants [--repeats 5]

``--tenants``: only the largest cell, each policy on the snapshot as it is and on the same one
with its jobs in three tenants (guaranteed 50 / 30 / 20 % of the slots, jobs assigned at random
in those proportions): the cost of the tenant step (:mod:`elastic_ops.pool.tenants`).

For each (jobs, slots) cell a snapshot is built once (8-slot hosts, 2% of them draining; half
the jobs running and holding slots, the rest waiting; mixed min/max/priorities; some avoided
hosts). What is timed (``min_cpu_ms``) is exactly one call ``policy(snapshot)``: from the
frozen snapshot (every job's held slots as tuples, as the ledger and the simulator build it)
to the complete :class:`Plan` -- every job's target, action and reason, and which slots every
job keeps, is given and releases (as arrays). Building the snapshot is not timed (the ledger
builds it from its tables, the simulator from its state). A plan makes slot tuples and
:class:`Decision` objects only on demand, so two further costs are timed separately, on the
same plan: ``changed_slots_cpu_ms``, the slot tuples of every job whose slots change (what the
simulator reads; the ledger reads those of the jobs it grants to or grows), and
``all_decisions_cpu_ms``, a :class:`Decision` for every job (``plan.decisions``; no caller
needs it at this size, tests and small snapshots do).

Each call gets a new snapshot object (a shallow copy made outside the timed part), as the
ledger builds one per decision: nothing a policy computed for one call is reused by the next.
Each is the least CPU time of the process over ``--repeats`` calls (less sensitive to other
load on a shared machine; the policies' calls alternate); wall times (median, least) are in the
JSON too.
``reference_min_cpu_ms`` times the plain per-slot implementation
(``elastic_ops.pool.plain_policies``: same plans; the registered policies use it for small
snapshots, see ``policies._small``) on the same snapshot in the same run, so ``speedup`` is a
like-for-like ratio. ``calibration_ms`` is the CPU time of ``sum(range(10**7))`` at the start,
a yardstick to compare machines and loads. The target is <= 50 ms at 10,000 jobs x 100,000
slots, with room to spare: the goal is <= 40 ms on a quiet machine. ``growth`` gives the time
ratio of each cell to the smallest one, next to the ratio of J log J + H + S, the work the
policy is designed to do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import random
import statistics
import sys
import time

from benchmarks._results import write_json
from elastic_ops.pool.model import Host, HostState, Job, Plan, PolicyConfig, Snapshot
from elastic_ops.pool.policies import POLICIES, VECTORISED
from elastic_ops.pool.scaling import Batching, GradStats, Measured, fit

ADAPTIVE = "goodput+adaptive"  # goodput on the same snapshot with half the jobs adaptive
FITTED = "goodput+fitted"  # goodput on the same snapshot with every running job's model fitted
TENANTS_OUT = "benchmarks/results/pool_decision_tenants.json"
REFERENCE_MAX_JOBS_X_HOSTS = 2 * 10**7
CELLS = [(100, 1_000), (1_000, 10_000), (1_000, 100_000), (10_000, 10_000), (10_000, 100_000)]


def build(n_jobs: int, n_slots: int, seed: int = 0) -> Snapshot:
    rng = random.Random(seed)
    per_host = 8
    hosts = tuple(
        Host(f"h{i:06d}", per_host, HostState.DRAINING if rng.random() < 0.02 else HostState.UP)
        for i in range(n_slots // per_host)
    )
    free = [(h.name, s) for h in hosts for s in range(h.slots)]
    rng.shuffle(free)
    budget = int(0.9 * n_slots)
    jobs = []
    for i in range(n_jobs):
        lo = rng.randint(1, 4)
        hi = lo + rng.randint(0, 28)
        running = i % 2 == 0 and budget > 0
        n_held = min(rng.randint(lo, hi), budget) if running else 0
        held = tuple(sorted(free[:n_held]))
        del free[:n_held]
        budget -= n_held
        jobs.append(
            Job(
                name=f"job{i:06d}",
                min_workers=lo,
                max_workers=hi,
                priority=rng.randint(1, 10),
                preemptible=rng.random() < 0.9,
                avoid_hosts=frozenset({hosts[rng.randrange(len(hosts))].name})
                if rng.random() < 0.05
                else frozenset(),
                submitted=float(i),
                waiting_since=None if held else float(i),
                last_rescale=float(i) if held else None,
                held=held,
            )
        )
    return Snapshot(
        hosts, tuple(jobs), now=float(n_jobs + 100), config=PolicyConfig(min_rescale_interval_s=30.0)
    )


def adaptive(snap: Snapshot, seed: int = 1) -> Snapshot:
    """``snap`` with every other job ``scaling: adaptive`` and its gradients measured (noise
    scales from none to large): the goodput policy chooses those jobs' batches too."""
    rng = random.Random(seed)
    jobs = tuple(
        dataclasses.replace(j, batching=Batching(64, 4096, 1, 16), grad=GradStats(1.0, rng.uniform(0, 1000)))
        if k % 2 == 0 else j
        for k, j in enumerate(snap.jobs)
    )
    return dataclasses.replace(snap, jobs=jobs)


def fitted(snap: Snapshot, seed: int = 3) -> Snapshot:
    """``snap`` with every job that holds 2 or more slots on a model fitted from what it measured
    (one worker, half its slots and all of them, 3 % noise; step times of varied shape: a
    fixed part, compute that splits, a ring that grows), as in a cluster that has run a while:
    most such models are certain, so the goodput rule weighs many more sizes per job than on
    the prior."""
    rng = random.Random(seed)
    jobs = []
    for job in snap.jobs:
        n = len(job.held)
        if n >= 2:
            fixed, ring = rng.uniform(0.02, 0.1), rng.uniform(0.002, 0.05)
            seen = []
            for w in sorted({1, max(1, n // 2), n}):
                hosts = -(-w // 8)
                sync = 0.0 if w == 1 else (0.05 + ring * (w - 2)) * (1.0 if hosts == 1 else 1.5)
                seen.append(Measured(w, hosts, 100, 100 * (fixed + 1.0 / w + sync) * rng.uniform(0.97, 1.03)))
            job = dataclasses.replace(job, scaling=fit(seen))
        jobs.append(job)
    return dataclasses.replace(snap, jobs=tuple(jobs))


def with_tenants(snap: Snapshot, seed: int = 2) -> Snapshot:
    """``snap`` with its jobs in tenants a, b, c (probability 0.5 / 0.3 / 0.2), guaranteed 50 /
    30 / 20 % of the up slots."""
    from elastic_ops.pool.model import Tenant

    rng = random.Random(seed)
    up = sum(h.slots for h in snap.hosts if h.state == HostState.UP)
    tenants = (Tenant("a", up // 2), Tenant("b", up * 3 // 10), Tenant("c", up // 5))
    jobs = tuple(dataclasses.replace(j, tenant=rng.choices("abc", (5, 3, 2))[0]) for j in snap.jobs)
    return dataclasses.replace(snap, jobs=jobs, tenants=tenants)


def measure_tenants(repeats: int) -> dict:
    """The largest cell, each policy without and with tenants, calls alternating."""
    n_jobs, n_slots = CELLS[-1]
    plain = build(n_jobs, n_slots)
    shared = with_tenants(plain)
    calls: dict[tuple[str, bool], list[float]] = {}
    for _ in range(repeats):
        for name, policy in sorted(POLICIES.items()):
            for tenanted, snap in ((False, plain), (True, shared)):
                calls.setdefault((name, tenanted), []).extend(_time(policy, snap, 1)[1])
    rows = []
    for name in sorted(POLICIES):
        without, with_ = (round(1000 * min(calls[name, t]), 2) for t in (False, True))
        rows.append({"policy": name, "jobs": n_jobs, "slots": n_slots, "without_tenants_min_cpu_ms": without,
                     "with_tenants_min_cpu_ms": with_, "tenant_step_ms": round(with_ - without, 2)})
        print(f"{name:<10} without tenants {without:>7.2f} ms CPU, with {with_:>7.2f} ms", flush=True)
    return {
        "benchmark": "pool_decision",
        "command": "python -m benchmarks.pool_decision " + " ".join(sys.argv[1:]),
        "python": platform.python_version(),
        "repeats": repeats,
        "load_avg_at_start": os.getloadavg()[0],
        "calibration_ms": {"sum_range_1e7_cpu": _calibrate()},
        "tenants": {t.name: t.guaranteed for t in shared.tenants},
        "target_ms_at_10k_jobs_100k_slots": 50,
        "meets_target_with_tenants": all(r["with_tenants_min_cpu_ms"] <= 50 for r in rows
                                         if r["policy"] in VECTORISED),
        "rows": rows,
    }


def _time(fn, arg, repeats: int) -> tuple[list[float], list[float]]:
    times, cpu = [], []
    for _ in range(repeats):
        if isinstance(arg, Snapshot):
            # a new snapshot object per call, as the ledger builds one per decision: the goodput
            # rule keeps its table of the last snapshot it saw, which a repeat must not reuse
            arg = dataclasses.replace(arg)
        t0, c0 = time.perf_counter(), time.process_time()
        fn(arg)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return times, cpu


def _changed_slots(plan: Plan) -> dict:
    return plan.slots.changed_placements()


def _all_decisions(plan: Plan) -> list:
    return list(map(plan.decision, range(len(plan.jobs))))


def _calibrate() -> float:
    best = math.inf
    for _ in range(3):
        c0 = time.process_time()
        sum(range(10**7))
        best = min(best, time.process_time() - c0)
    return round(1000 * best, 1)


def measure(repeats: int, reference: bool) -> dict:
    load = os.getloadavg()[0]
    calibration = _calibrate()
    ref_policies = {}
    if reference:
        from elastic_ops.pool.plain_policies import PLAIN as ref_policies
    rows = []
    for n_jobs, n_slots in CELLS:
        base_snap = build(n_jobs, n_slots)
        runs = {name: (policy, base_snap) for name, policy in POLICIES.items()}
        runs[ADAPTIVE] = (POLICIES["goodput"], adaptive(base_snap))
        runs[FITTED] = (POLICIES["goodput"], fitted(base_snap))
        # The policies take turns, call by call, so that a burst of load on this shared machine
        # does not fall on every call of one policy.
        calls: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in runs}
        for _ in range(repeats):
            for name, (policy, snap) in sorted(runs.items()):
                times, cpu = _time(policy, snap, 1)
                calls[name][0].extend(times)
                calls[name][1].extend(cpu)
        for name, (policy, snap) in sorted(runs.items()):
            times, cpu = calls[name]
            plan = policy(snap)
            changed = plan.changed()
            row = {
                "policy": name,
                "jobs": n_jobs,
                "slots": n_slots,
                "min_cpu_ms": round(1000 * min(cpu), 2),
                "median_ms": round(1000 * statistics.median(times), 2),
                "min_ms": round(1000 * min(times), 2),
                "changed_jobs": len(changed),
                "slots_handed_out": sum(len(plan.slots.new(k)) for k in changed),
                "changed_slots_cpu_ms": round(1000 * min(_time(_changed_slots, plan, repeats)[1]), 2),
                "all_decisions_cpu_ms": round(1000 * min(_time(_all_decisions, plan, repeats)[1]), 2),
            }
            # the plain form's best fit is a pass over the hosts per job: not timed past a bound
            small = n_jobs * (n_slots // 8) <= REFERENCE_MAX_JOBS_X_HOSTS
            if name in ref_policies and name in VECTORISED and small:  # goodput's plain form also moves jobs
                _, ref_cpu = _time(ref_policies[name], snap, repeats)
                row["reference_min_cpu_ms"] = round(1000 * min(ref_cpu), 2)
                row["speedup"] = round(min(ref_cpu) / min(cpu), 1)
                # Against the plan plus the slot tuples of every changed job (the reference makes
                # tuples for every job as it decides).
                row["speedup_with_changed_slots"] = round(
                    min(ref_cpu) / (min(cpu) + row["changed_slots_cpu_ms"] / 1000), 1
                )
            rows.append(row)
            print(
                f"{name:<10} jobs {n_jobs:>6} slots {n_slots:>7}: {row['min_cpu_ms']:>8.2f} ms CPU"
                f" (+ changed slots {row['changed_slots_cpu_ms']:.2f}, all decisions"
                f" {row['all_decisions_cpu_ms']:.2f})"
                + (f"  (reference {row['reference_min_cpu_ms']:.2f} ms)" if "speedup" in row else ""),
                flush=True,
            )

    def work(j: int, s: int) -> float:
        return j * math.log2(max(j, 2)) + s / 8 + s

    base = CELLS[0]
    for r in rows:
        first = next(x for x in rows if x["policy"] == r["policy"] and (x["jobs"], x["slots"]) == base)
        r["growth"] = round(r["min_cpu_ms"] / first["min_cpu_ms"], 1)
        r["work_growth"] = round(work(r["jobs"], r["slots"]) / work(*base), 1)
    big = [r for r in rows if (r["jobs"], r["slots"]) == CELLS[-1]]
    return {
        "benchmark": "pool_decision",
        "command": "python -m benchmarks.pool_decision " + " ".join(sys.argv[1:]),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "repeats": repeats,
        "cpus": os.cpu_count(),
        "load_avg_at_start": load,
        "calibration_ms": {"sum_range_1e7_cpu": calibration},
        "measured": (
            "CPU (process_time) and wall time of one policy(snapshot) call, to the complete Plan "
            "(columns + slot arrays); snapshot build not timed; slot tuples of changed jobs and "
            "Decision objects for all jobs timed separately"
        ),
        "target_ms_at_10k_jobs_100k_slots": 50,
        "meets_target": all(r["min_cpu_ms"] <= 50 for r in big if r["policy"] in VECTORISED),
        "goodput_meets_target": all(r["min_cpu_ms"] <= 50 for r in big if r["policy"] not in VECTORISED),
        "goal_ms_at_10k_jobs_100k_slots": 40,
        "meets_goal": all(r["min_cpu_ms"] <= 40 for r in big if r["policy"] in VECTORISED),
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/pool_decision.json")
    ap.add_argument("--no-reference", action="store_true", help="skip timing the reference implementation")
    ap.add_argument("--tenants", action="store_true", help="the largest cell without and with tenants")
    args = ap.parse_args()
    if args.tenants:
        out = args.out if args.out != ap.get_default("out") else TENANTS_OUT
        result = measure_tenants(args.repeats)
        write_json(out, result)
        print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
        return
    result = measure(args.repeats, not args.no_reference)
    write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    main()
