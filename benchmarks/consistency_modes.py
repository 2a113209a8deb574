"""The cost of ``consistency: bitwise`` relative to ``fast``, side by side.

    .venv/bin/python -m benchmarks.consistency_modes [--iterations 300] [--repeats 3] [--workers 1,2]

The digits MLP (``elastic_ops.examples``), global batch 64, with ``bitwise`` (8 virtual
shards: 8 backward passes of 8 samples per iteration, an ``all_gather`` of 8 flat gradients,
8 ordered vector additions) and with ``fast`` (one slice per worker, one ``all_reduce``).
Runs alternate; medians of the training-loop throughput of rank 0 are compared. The ratio is
``bitwise / fast`` (1.0 = bitwise is free).
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
from benchmarks.runtime_overhead import digits_spec, run_ours

RESULTS = Path(__file__).resolve().parent / "results" / "consistency_modes.json"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    from elastic_ops.runtime.launcher import PRELOAD

    multiprocessing.set_forkserver_preload(PRELOAD)  # the bare loop forks from the same warm server
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(w) for w in args.workers.split(",")):
            runs: dict[str, list[dict[str, float]]] = {"bitwise": [], "fast": []}
            for r in range(args.repeats):
                for mode in ("fast", "bitwise"):
                    extra = {"virtual_shards": args.shards} if mode == "bitwise" else {"virtual_shards": None}
                    spec = digits_spec(
                        args.iterations,
                        max(n, args.shards),
                        f"file://{tmp}/{mode}-{n}-{r}",
                        consistency=mode,
                        **extra,
                    )
                    runs[mode].append(run_ours(spec, n))
            fast = statistics.median(x["loop"] for x in runs["fast"])
            bitwise = statistics.median(x["loop"] for x in runs["bitwise"])
            row = {
                "workers": n,
                "fast_samples_per_s": round(fast, 1),
                "bitwise_samples_per_s": round(bitwise, 1),
                "bitwise_over_fast": round(bitwise / fast, 3),
                "fast_all": [round(x["loop"], 1) for x in runs["fast"]],
                "bitwise_all": [round(x["loop"], 1) for x in runs["bitwise"]],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = record(
        "consistency_modes", argv,
        model="elastic_ops.examples.digits:DigitsMLP, global batch 64",
        virtual_shards=args.shards, iterations=args.iterations, repeats=args.repeats,
        device=f"cpu ({os.cpu_count()} cores, 1 thread per worker), torch {torch.__version__}",
        results=rows,
    )
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
