"""Decision time of a policy on a full pool where many jobs are restricted to some hosts (host
selectors), next to the same pool with no restricted job, in one run.

    .venv/bin/python -m benchmarks.pool_repair [--repeats 3] [--out FILE]

The pool: 8-slot hosts, every slot held (held slots scattered), a quarter of the hosts carry
the label half the jobs select; most jobs may be rescaled (moved), ``min_rescale_interval_s``
60. With restricted jobs short on their hosts, the plain implementation repairs (moves, lowered
caps: docs/explanation/pool.md "How a decision is made", step "Place", at most ``REPAIR_PASSES``
repairing passes); without them the vectorised path decides alone. ``ratio`` is restricted /
unrestricted (the cost of the repair).
Timed: the least wall time of ``--repeats`` calls of ``POLICIES["priority"](snapshot)``.
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks._results import record, write_json
from elastic_ops.pool.model import Host, HostState, Job, PolicyConfig, Snapshot
from elastic_ops.pool.policies import POLICIES

CELLS = [(1_000, 125), (4_000, 500)]


def full_pool(n_jobs: int, n_hosts: int, restricted: float = 0.5, seed: int = 0) -> Snapshot:
    """A full pool: a quarter of the 8-slot hosts labelled, a ``restricted`` share of the jobs
    limited to them, most jobs movable (rescaled 10 s or 100 s ago, or never)."""
    rng = random.Random(seed)
    hosts = [Host(f"h{i:04d}", 8, HostState.UP) for i in range(n_hosts)]
    other = frozenset(h.name for i, h in enumerate(hosts) if i % 4)
    free = [(h.name, s) for h in hosts for s in range(8)]
    rng.shuffle(free)
    jobs, cur = [], 0
    for i in range(n_jobs):
        outside = other if rng.random() < restricted else frozenset()
        lo = rng.randint(1, 2)
        hi = lo + rng.randint(0, 3)
        n = rng.randint(0, hi) if cur < len(free) else 0
        held = tuple(free[cur:cur + n])
        cur += n
        jobs.append(Job(f"j{i:05d}", lo, hi, rng.randint(1, 5), preemptible=rng.random() < 0.8,
                        avoid_hosts=outside, leave_hosts=outside, submitted=float(i),
                        waiting_since=None if held else 0.0, last_rescale=rng.choice([None, 990.0, 900.0]),
                        held=held))
    return Snapshot(tuple(hosts), tuple(jobs), 1000.0, PolicyConfig(min_rescale_interval_s=60.0))


def _best(snap: Snapshot, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        POLICIES["priority"](snap)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/pool_repair.json")
    args = ap.parse_args()
    rows = []
    for jobs, hosts in CELLS:
        restricted = _best(full_pool(jobs, hosts, 0.5), args.repeats)
        plain = _best(full_pool(jobs, hosts, 0.0), args.repeats)
        rows.append({"jobs": jobs, "hosts": hosts, "restricted_share": 0.5,
                     "restricted_s": round(restricted, 4), "unrestricted_s": round(plain, 4),
                     "ratio": round(restricted / plain, 1)})
        print(rows[-1], flush=True)
    write_json(args.out, record("pool_repair", None, repeats=args.repeats, rows=rows))


if __name__ == "__main__":
    main()
