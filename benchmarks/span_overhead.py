"""The per-iteration cost of a segment spanning hosts, side by side with the same workers on one.

    .venv/bin/python -m benchmarks.span_overhead [--iterations 400] [--repeats 3] [--workers 2,4]

The digits MLP (``elastic_ops.examples``, global batch 64, fast consistency) trained by
``run_chunk`` with N workers on this host's launcher ("one host") and with the same N split
half here, half on a second "host" (:class:`~devtools.span.LoopbackSpanLauncher`:
the other host's ranks are started the way a follower node starts them, on this machine, so
the network is loopback). What differs is what spanning adds to every iteration: rank 0
broadcasts each boundary's target (the other hosts cannot map the control channel) and the
starting state arrives by broadcast. Runs alternate; medians of rank 0's training-loop
throughput are compared. ``span_over_one_host`` = 1.0 means spanning costs nothing here; a real
network adds its own latency to every collective, the target's broadcast included.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import record, write_json
from benchmarks.runtime_overhead import digits_spec

RESULTS = Path(__file__).resolve().parent / "results" / "span_overhead.json"


def run(spec: Any, workers: int, span: bool) -> float:
    from devtools.span import LoopbackSpanLauncher
    from elastic_ops.checkpoint import open_store
    from elastic_ops.runtime import run_chunk
    from elastic_ops.runtime.allocation import Allocation

    here = workers // 2 if span else workers
    others = (("host-b", tuple(range(workers - here))),) if span else ()
    grant = Allocation.split(workers, "localhost", tuple(range(here)), others)
    result = run_chunk(
        spec, 0, spec.total_iterations, target=lambda i: grant, store=open_store(spec.checkpoint),
        span_hosts=True, launcher=LoopbackSpanLauncher(),
    )
    if [n for _, n, _ in result.workers_timeline] != [workers]:
        raise RuntimeError(f"expected one segment of {workers} workers, got {result.workers_timeline}")
    return result.train_samples_per_sec


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", default="2,4")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    from elastic_ops.runtime.launcher import PRELOAD

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # both "hosts" are this machine
    multiprocessing.set_forkserver_preload(PRELOAD)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(w) for w in args.workers.split(",")):
            runs: dict[str, list[float]] = {"one_host": [], "span": []}
            for r in range(args.repeats):
                for kind in ("one_host", "span"):
                    spec = digits_spec(args.iterations, n, f"file://{tmp}/{kind}-{n}-{r}",
                                       consistency="fast", virtual_shards=None)
                    runs[kind].append(run(spec, n, kind == "span"))
            one, span = (statistics.median(runs[k]) for k in ("one_host", "span"))
            row = {
                "workers": n,
                "split": f"{n // 2} here + {n - n // 2} on host-b",
                "one_host_samples_per_s": round(one, 1),
                "span_samples_per_s": round(span, 1),
                "span_over_one_host": round(span / one, 3),
                "one_host_all": [round(x, 1) for x in runs["one_host"]],
                "span_all": [round(x, 1) for x in runs["span"]],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = record(
        "span_overhead", argv,
        model="elastic_ops.examples.digits:DigitsMLP, global batch 64, consistency fast",
        iterations=args.iterations, repeats=args.repeats,
        device=f"cpu ({os.cpu_count()} cores, 1 thread per worker, gloo on loopback), "
        f"torch {torch.__version__}",
        results=rows,
    )
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
