"""An adaptive batch on a real model: the digits MLP with ``scaling: adaptive`` vs the same job at
its fixed batch, both trained through the real control loop (a goodput pool on SQLite, its
planner, a lease keeper heartbeating the runner's measurements, the runner following the target).

    .venv/bin/python -m benchmarks.adaptive_digits [--slots 2] [--iterations 300] [--chunk 30]

Both runs train ``iterations`` base iterations (64 samples each at the fixed batch) in chunks of
``chunk``, evaluating the test split at every chunk's end. Reported per run: the test accuracy and
the samples consumed at each chunk end, optimizer steps, wall time; and the samples each needed
to first reach the fixed run's final accuracy (the issue's "reaches the fixed-batch run's
accuracy in no more samples"). The adaptive run's batches are what the pool chose from what its
workers measured, so they depend on the machine's speed: the run is deterministic given the
batches it records, not across machines.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._results import record, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "adaptive_digits.json"
SPEC_FILE = Path(__file__).resolve().parent.parent / "examples" / "digits.yaml"


def train(spec: Any, slots: int, tmp: Path) -> dict[str, Any]:
    """``spec`` through a goodput pool of one host of ``slots``; the accuracy and samples at
    every chunk end."""
    from elastic_ops.checkpoint import open_store
    from elastic_ops.operators.lease import LeaseKeeper
    from elastic_ops.pool import PoolClient
    from elastic_ops.runtime import run_chunk
    from elastic_ops.utils.jobs import register

    pool = PoolClient(f"sqlite:///{tmp / (spec.name + '.db')}", policy="goodput", rescale_cost_s=1.0)
    pool.add_host("local", slots)
    register(pool, spec)
    grant = pool.request(spec.name)
    keeper = LeaseKeeper(pool, spec.name, grant.epoch, grant.workers, interval_s=0.3,
                         placements=grant.placements, host="local").start()
    stop = threading.Event()

    def planner() -> None:
        while not stop.wait(0.3):
            pool.plan()

    thread = threading.Thread(target=planner, daemon=True)
    thread.start()
    store = open_store(spec.checkpoint)
    points, t0, steps = [], time.monotonic(), 0
    try:
        for start, end in spec.chunk_ranges():
            seen: list[Any] = []

            def progressed(p: Any, seen: list[Any] = seen) -> None:
                seen.append(p)
                keeper.progressed(p)

            result = run_chunk(spec, start, end, target=keeper.target, on_progress=progressed,
                               on_segment=keeper.applied, host="local", store=store)
            state = store.load(store.latest(spec_hash=spec.spec_hash()))
            steps += max((p.steps or 0) for p in seen) if seen else 0
            points.append({"iteration": result.iteration, "samples": int(state["cursor"]),
                           "test_accuracy": result.metrics.get("test_accuracy"),
                           "seconds": time.monotonic() - t0, "steps": steps,
                           "batches": (state.get("adaptive") or {}).get("batches", [])})
    finally:
        stop.set()
        thread.join()
        keeper.stop()
        pool.release(spec.name, grant.epoch, finished=True)
    return {"points": points, "final_accuracy": points[-1]["test_accuracy"], "samples": points[-1]["samples"],
            "steps": steps, "seconds": points[-1]["seconds"]}


def samples_to(points: list[dict[str, Any]], accuracy: float) -> int | None:
    """The samples at the first chunk end at or above ``accuracy`` (None: never)."""
    return next((p["samples"] for p in points if p["test_accuracy"] >= accuracy - 1e-9), None)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--chunk", type=int, default=30)
    ap.add_argument("--max-batch", type=int, default=512)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    from elastic_ops.spec import JobSpec

    base = JobSpec.from_yaml(SPEC_FILE)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        adaptive = {"scaling": "adaptive", "max_global_batch": args.max_batch}
        for name, extra in (("fixed", {}), ("adaptive", adaptive)):
            spec = base.replace(name=f"digits-{name}", total_iterations=args.iterations,
                                chunk_iterations=args.chunk, checkpoint_interval=args.chunk,
                                max_workers=max(args.slots, 1), checkpoint=f"file://{tmp}/{name}", **extra)
            runs[name] = train(spec, args.slots, Path(tmp))
    target = runs["fixed"]["final_accuracy"]
    for run in runs.values():
        run["samples_to_fixed_accuracy"] = samples_to(run["points"], target)
    fixed, adaptive = runs["fixed"], runs["adaptive"]
    reached = adaptive["samples_to_fixed_accuracy"]
    out = record(
        "adaptive_digits", argv, slots=args.slots, iterations=args.iterations, chunk=args.chunk,
        runs=runs,
        summary={
            "fixed_accuracy": fixed["final_accuracy"], "adaptive_accuracy": adaptive["final_accuracy"],
            "fixed_samples": fixed["samples"], "adaptive_samples": adaptive["samples"],
            "adaptive_samples_to_fixed_accuracy": adaptive["samples_to_fixed_accuracy"],
            "fixed_samples_to_fixed_accuracy": fixed["samples_to_fixed_accuracy"],
            "steps": {"fixed": fixed["steps"], "adaptive": adaptive["steps"]},
            "seconds": {"fixed": round(fixed["seconds"], 1), "adaptive": round(adaptive["seconds"], 1)},
            "no_more_samples": reached is not None and reached <= fixed["samples_to_fixed_accuracy"],
        },
    )
    write_json(args.out, out)
    print(out["summary"])
    return out


if __name__ == "__main__":
    main()
