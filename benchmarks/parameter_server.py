"""Parameter server vs all-reduce, side by side in one run: training throughput and bytes moved
per iteration, at N = 2 and 4 workers on CPU.

    .venv/bin/python -m benchmarks.parameter_server [--iterations 20] [--workers 2,4] [--servers 2]

Two models of the NCF example (``elastic_ops.examples.ncf``), each trained the same number of
iterations at the same global batch (256) and virtual shards (4) by three strategies:

* ``ps``: ``strategy: parameter_server`` with ``--servers`` servers (sync mode, bitwise);
* ``allreduce_bitwise``: ``consistency: bitwise`` (the all-reduce path's same guarantee);
* ``allreduce_fast``: ``consistency: fast`` (a plain all-reduce, what DDP does).

``embedding``: 2,000 users x 200,000 items, 32 wide (7.04 M table parameters, 99.9 % of the
model; ``sparse=True`` embeddings, Adagrad). ``dense``: 200 x 200 rows, 16 wide, an MLP tower of
1,024 (1.1 % table parameters): where the parameter server stops paying.

Throughput is samples per second inside the training loops (``train_samples_per_sec``: rank 0
from its first iteration boundary to its last). Bytes per iteration, all ranks together: for the
parameter server, measured (the servers count every byte they send and receive, headers too;
the state gathered at the chunk's end is reported apart); for all-reduce, computed from the
flat gradient buffer (``W`` bytes: gradients, flags, loss) and gloo's ring algorithms
(``fast``: an all-reduce sends ``2 (N-1) W`` in all; ``bitwise``: an all-gather of ``ceil(V/N)``
rows per rank sends ``N (N-1) ceil(V/N) W``). The machine's load is recorded with the result.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._results import record, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "parameter_server.json"

MODELS = {
    "embedding": {"users": 2000, "items": 200_000, "dim": 32, "hidden": 64, "per_user": 40},
    "dense": {"users": 200, "items": 200, "dim": 16, "hidden": 1024, "per_user": 20},
}
STRATEGIES = ("ps", "allreduce_bitwise", "allreduce_fast")
BATCH, SHARDS = 256, 4


def spec_for(model: str, strategy: str, iterations: int, servers: int, ckpt: str):
    from elastic_ops.spec import JobSpec

    fields: dict[str, Any] = dict(
        name=f"bench-{model}-{strategy}", entrypoint="elastic_ops.examples.ncf:NCF",
        total_iterations=iterations, global_batch=BATCH, min_workers=1, max_workers=SHARDS,
        checkpoint=ckpt, checkpoint_interval=iterations, params=MODELS[model],
    )
    if strategy == "ps":
        fields |= {"strategy": "parameter_server", "servers": servers, "consistency": "bitwise",
                   "virtual_shards": SHARDS}
    elif strategy == "allreduce_bitwise":
        fields |= {"consistency": "bitwise", "virtual_shards": SHARDS}
    else:
        fields |= {"consistency": "fast"}
    return JobSpec(**fields)


def allreduce_bytes(model: str, strategy: str, workers: int) -> int:
    """What gloo's ring algorithms send per iteration, all ranks together (see the module doc)."""
    from elastic_ops.examples.ncf import NCF

    net = NCF(**MODELS[model]).build_model()
    params = [p for p in net.parameters() if p.requires_grad]
    width = (sum(p.numel() for p in params) + len(params) + 2) * 4  # float32
    if strategy == "allreduce_fast":
        return 2 * (workers - 1) * width
    return workers * (workers - 1) * math.ceil(SHARDS / workers) * width


def run_one(model: str, strategy: str, workers: int, iterations: int, servers: int) -> dict[str, Any]:
    from elastic_ops.runtime import run_chunk

    with tempfile.TemporaryDirectory() as tmp:
        spec = spec_for(model, strategy, iterations, servers, f"file://{tmp}/ckpt")
        t0 = time.perf_counter()
        result = run_chunk(spec, 0, iterations, target=lambda i: workers)
        wall = time.perf_counter() - t0
    out: dict[str, Any] = {
        "samples_per_sec": round(result.train_samples_per_sec, 1),
        "wall_s": round(wall, 2),
        "loss": result.loss,
        "param_sha256": result.param_sha256,
    }
    if strategy == "ps":
        out["bytes_per_iteration"] = int(result.ps_bytes / max(result.ps_steps, 1))
        out["bytes_gathered_at_end"] = result.ps_snapshot_bytes
        out["bytes_measured"] = True
    else:
        out["bytes_per_iteration"] = allreduce_bytes(model, strategy, workers)
        out["bytes_measured"] = False
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--workers", default="2,4")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--models", default="embedding,dense")
    args = ap.parse_args(argv)
    from elastic_ops.examples.ncf import NCF

    counts = [int(n) for n in args.workers.split(",")]
    runs: dict[str, Any] = {}
    for model in args.models.split(","):
        share = NCF(**MODELS[model]).parameter_share()
        runs[model] = {"table_share": round(share, 4), "params": MODELS[model], "by_workers": {}}
        for n in counts:
            row = {}
            for strategy in STRATEGIES:
                row[strategy] = run_one(model, strategy, n, args.iterations, args.servers)
                print(model, n, strategy, row[strategy], flush=True)
            base = row["allreduce_bitwise"]["samples_per_sec"]
            fast = row["allreduce_fast"]["samples_per_sec"]
            row["ps_vs_allreduce_bitwise"] = round(row["ps"]["samples_per_sec"] / base, 2) if base else None
            row["ps_vs_allreduce_fast"] = round(row["ps"]["samples_per_sec"] / fast, 2) if fast else None
            # bitwise either way: the parameter server trains the bitwise all-reduce's model only
            # when it has no table (its tables step sparse), so the hashes are reported, not compared
            runs[model]["by_workers"][str(n)] = row
    result = record(
        "parameter_server", argv, iterations=args.iterations, global_batch=BATCH, virtual_shards=SHARDS,
        servers=args.servers, threads_per_worker=1, cpus=os.cpu_count(), models=runs,
    )
    print(write_json(RESULTS, result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
