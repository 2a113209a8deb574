"""Tenants on the Pollux workloads (simulated): three teams sharing the pool with guarantees of
50 / 30 / 20 % of its slots, against the same policy without tenants.

    .venv/bin/python -m benchmarks.pool_tenants [--slots 64] [--workloads 1,2,...,8]
        [--policies fairshare,goodput] [--out benchmarks/results/pool_tenants.json]

Each job of a workload (``workloads/workload-K.csv``, the nominal load) goes to tenant ``a``,
``b`` or ``c`` with probability 0.5 / 0.3 / 0.2 (seeded: the same split for every policy); the
tenants are guaranteed 50 / 30 / 20 % of the slots (32 / 19 / 13 of 64), no maximum, weight 1.
Every run: 30 s per rescale, a 60 s re-plan tick, anti-thrashing ``min_rescale_interval_s =
300`` (so a borrower's protection is what delays a reclaim). Targets (issue 26), per workload:

- utilisation with tenants >= 0.9 of the same policy's without;
- every guarantee restored within one rescale interval plus one iteration of the borrowers:
  the longest time a tenant lacked part of its guarantee beyond the free slots while others
  borrowed (``max_restore_s``) <= 300 s + the slowest iteration of any job (its step on one
  worker). The simulator releases slots at the plan that reclaims them; in a cluster add the
  borrower's iteration, and the ledger's next plan (``plan_refresh_s``);
- average JCT within 10 % of the run without tenants.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys

from benchmarks._results import record, write_json
from elastic_ops.pool.model import Tenant
from elastic_ops.pool.simulator import SimConfig, simulate
from elastic_ops.pool.workload import default_traces_dir, load_application, read_workload

SPLIT = {"a": 0.5, "b": 0.3, "c": 0.2}
INTERVAL_S = 300.0
SEED = 26


def guarantees(slots: int) -> tuple[Tenant, ...]:
    """50 / 30 / 20 % of ``slots``, rounded down, the rest to the largest."""
    g = {t: int(share * slots) for t, share in SPLIT.items()}
    g["a"] += slots - sum(g.values())
    return tuple(Tenant(t, n) for t, n in g.items())


def split(jobs, seed: int = SEED):
    rng = random.Random(seed)
    names, weights = list(SPLIT), list(SPLIT.values())
    return [dataclasses.replace(j, tenant=rng.choices(names, weights)[0]) for j in jobs]


def slowest_iteration(jobs, traces) -> float:
    """The longest step of any job: on one worker at its own batch."""
    apps = {j.application: load_application(str(traces), j.application) for j in jobs}
    return max(apps[j.application].step_time(1, j.batch_size) for j in jobs)


def cell(path, policy: str, cfg: SimConfig, traces) -> dict:
    jobs = split(read_workload(path))
    plain = simulate(jobs, policy, cfg, traces)
    shared = simulate(jobs, policy, dataclasses.replace(cfg, tenants=guarantees(cfg.slots)), traces)
    bound = INTERVAL_S + slowest_iteration(jobs, traces)
    restore = max(t["max_restore_s"] for t in shared["tenants"].values())
    out = {
        "workload": path.name,
        "jobs_per_tenant": {t: v["jobs"] for t, v in shared["tenants"].items()},
        "without": {k: plain[k] for k in ("avg_jct", "p99_jct", "makespan", "utilization", "rescales")},
        "with": {k: shared[k] for k in ("avg_jct", "p99_jct", "makespan", "utilization", "rescales")},
        "tenants": shared["tenants"],
        "utilization_ratio": round(shared["utilization"] / plain["utilization"], 4),
        "avg_jct_ratio": round(shared["avg_jct"] / plain["avg_jct"], 4),
        "max_restore_s": restore,
        "restore_bound_s": round(bound, 3),
    }
    out["targets"] = {
        "utilization_at_least_0.9": out["utilization_ratio"] >= 0.9,
        "restored_within_interval_plus_iteration": restore <= bound,
        "avg_jct_within_10pct": out["avg_jct_ratio"] <= 1.10,
    }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--workloads", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--policies", default="fairshare,goodput")
    ap.add_argument("--out", default="benchmarks/results/pool_tenants.json")
    args = ap.parse_args(argv)
    traces = default_traces_dir()
    cfg = SimConfig(slots=args.slots, rescale_cost=30.0, replan_interval=60.0,
                    min_rescale_interval_s=INTERVAL_S)
    policies = {}
    for policy in args.policies.split(","):
        rows = []
        for k in args.workloads.split(","):
            row = cell(traces.parent / "workloads" / f"workload-{k}.csv", policy, cfg, traces)
            rows.append(row)
            print(f"{policy} {row['workload']}: utilization x{row['utilization_ratio']:.3f}, avg JCT "
                  f"x{row['avg_jct_ratio']:.3f}, longest restore {row['max_restore_s']:.0f}s "
                  f"(bound {row['restore_bound_s']:.0f}s)", flush=True)
        policies[policy] = {
            "rows": rows,
            "min_utilization_ratio": min(r["utilization_ratio"] for r in rows),
            "max_avg_jct_ratio": max(r["avg_jct_ratio"] for r in rows),
            "max_restore_s": max(r["max_restore_s"] for r in rows),
            "targets_met": {t: all(r["targets"][t] for r in rows) for t in rows[0]["targets"]},
        }
    result = record(
        "pool_tenants", argv if argv is not None else sys.argv[1:], slots=args.slots,
        tenants={t.name: t.guaranteed for t in guarantees(args.slots)}, split=SPLIT,
        min_rescale_interval_s=INTERVAL_S, rescale_cost_s=cfg.rescale_cost,
        replan_interval_s=cfg.replan_interval, policies=policies,
    )
    write_json(args.out, result)
    print(json.dumps({p: {k: v for k, v in r.items() if k != "rows"} for p, r in policies.items()}))


if __name__ == "__main__":
    main()
