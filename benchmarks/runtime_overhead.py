"""Training throughput of the elastic runner vs a bare PyTorch DDP loop, side by side.

    .venv/bin/python -m benchmarks.runtime_overhead [--iterations 300] [--repeats 5] [--workers 1,2]
        [--device cpu|cuda]

Same model (the digits MLP from ``elastic_ops.examples``), same data, global batch (64),
optimizer (AdamW), worker count, thread count (1 per worker) and iterations. For each worker
count the two are run alternately ``--repeats`` times and the medians are compared:

* ``loop``: samples per second inside the training loop of rank 0 (the runner: from the first
  iteration boundary to the last, so it includes the per-iteration control-channel checks,
  sample-order slicing, loss scaling and the flat-buffer allreduce; the bare loop: DDP with a
  ``DistributedSampler``-style per-epoch permutation, calling the same ``Trainable.loss``);
* ``end_to_end``: wall time of the whole call, process start, rendezvous, model build and the
  final checkpoint commit included (the bare loop saves nothing).

Ratios are ``runner / bare`` (1.0 = no overhead; target for ``loop`` >= 0.95). Runner in
``consistency: fast`` (plain allreduce, what DDP does); checkpoints only at the end.

``--device cuda`` (a GPU machine; ``benchmarks/device_check.sh`` runs it there): both sides train
on the GPUs, one per worker, over NCCL — the runner through its launcher (``CUDA_VISIBLE_DEVICES``
per worker), the bare loop as a DDP user writes it (``cuda:<rank>``, ``device_ids=[rank]``, the
data set moved to the GPU once). ``--workers`` must not exceed the GPUs visible.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import record, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "runtime_overhead.json"
SPEC_FILE = Path(__file__).resolve().parents[1] / "elastic_ops" / "examples" / "digits-fast.yaml"


def digits_spec(iterations: int, workers: int, ckpt: str, **changes: Any):
    from elastic_ops.spec import JobSpec

    spec = JobSpec.from_yaml(SPEC_FILE)
    return spec.replace(
        total_iterations=iterations,
        chunk_iterations=iterations,
        checkpoint_interval=iterations,
        checkpoint=ckpt,
        max_workers=max(workers, spec.min_workers),
        **changes,
    )


def run_ours(spec, workers: int) -> dict[str, float]:
    from elastic_ops.checkpoint import open_store
    from elastic_ops.runtime import run_chunk

    t0 = time.perf_counter()
    result = run_chunk(
        spec, 0, spec.total_iterations, target=lambda i: workers, store=open_store(spec.checkpoint)
    )
    wall = time.perf_counter() - t0
    return {
        "loop": result.train_samples_per_sec,
        "end_to_end": spec.total_iterations * spec.global_batch / wall,
        "loss": result.loss,
    }


def _bare_worker(
    rank: int, workers: int, port: int, iterations: int, batch: int, out: str, device: str = "cpu"
) -> None:
    """A plain DDP training loop, as a user would write it."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from elastic_ops.examples.digits import DigitsMLP

    os.environ.update(GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=workers)
    trainable = DigitsMLP(**digits_spec(iterations, workers, "file:///tmp/unused").params)
    x, y = trainable.train_dataset().tensors
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    x, y = x.to(dev), y.to(dev)
    model = DDP(trainable.build_model().to(dev), device_ids=[rank] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=0.002, weight_decay=1e-4)
    per = batch // workers
    lo, hi = rank * per, (rank + 1) * per if rank < workers - 1 else batch
    gen, epoch, order, pos = torch.Generator(), -1, None, len(x)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iterations):
        if pos + batch > len(x):  # next epoch (the tail that does not fill a batch is dropped)
            epoch += 1
            gen.manual_seed(epoch)
            order, pos = torch.randperm(len(x), generator=gen).to(dev), 0
        idx = order[pos + lo : pos + hi]
        pos += batch
        loss = trainable.loss(model, (x[idx], y[idx]))  # the same user loss code as the runner
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()  # the runner reads the loss every iteration (NaN check); so does this loop
    elapsed = time.perf_counter() - t0
    if rank == 0:
        Path(out).write_text(json.dumps({"loop": iterations * batch / elapsed, "loss": loss.item()}))
    dist.barrier()  # then just exit: an explicit destroy_process_group once hung a run here


def run_bare(iterations: int, workers: int, batch: int, device: str = "cpu") -> dict[str, float]:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "bare.json")
        store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=300)
        )
        t0 = time.perf_counter()
        mp.start_processes(
            _bare_worker,
            args=(workers, store.port, iterations, batch, out, device),
            nprocs=workers,
            start_method="forkserver",
        )
        wall = time.perf_counter() - t0
        data = json.loads(Path(out).read_text())
    return {"loop": data["loop"], "end_to_end": iterations * batch / wall, "loss": data["loss"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args(argv)
    counts = [int(w) for w in args.workers.split(",")]
    if args.device == "cuda" and (not torch.cuda.is_available() or max(counts) > torch.cuda.device_count()):
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        ap.error(f"--device cuda --workers {args.workers}: this machine shows {gpus} CUDA GPU(s)")
    import multiprocessing

    from elastic_ops.runtime.launcher import PRELOAD

    multiprocessing.set_forkserver_preload(PRELOAD)  # the bare loop forks from the same warm server
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            ours, bare = [], []
            run_bare(20, n, 64, args.device)  # warm the fork server and the data caches before measuring
            for r in range(args.repeats):
                spec = digits_spec(args.iterations, n, f"file://{tmp}/ckpt-{n}-{r}", device=args.device)
                ours.append(run_ours(spec, n))
                bare.append(run_bare(args.iterations, n, spec.global_batch, args.device))
            row = {"workers": n}
            for key in ("loop", "end_to_end"):
                o = statistics.median(x[key] for x in ours)
                b = statistics.median(x[key] for x in bare)
                row[f"runner_{key}_samples_per_s"] = round(o, 1)
                row[f"bare_ddp_{key}_samples_per_s"] = round(b, 1)
                row[f"{key}_ratio"] = round(o / b, 3)
            row["runner_loop_all"] = [round(x["loop"], 1) for x in ours]
            row["bare_loop_all"] = [round(x["loop"], 1) for x in bare]
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = record(
        "runtime_overhead", argv,
        model="elastic_ops.examples.digits:DigitsMLP (64-128-128-10 MLP, AdamW), global batch 64",
        iterations=args.iterations, repeats=args.repeats, target_loop_ratio=0.95,
        device=_describe(args.device), results=rows,
        note="ratios = runner / bare DDP; medians over repeats, runs interleaved",
    )
    write_json(args.out, result)
    return result


def _describe(device: str) -> str:
    if device == "cuda":
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        return (
            f"cuda: {torch.cuda.device_count()} x {', '.join(names)}, CUDA {torch.version.cuda}, "
            f"{os.cpu_count()} CPU cores, torch {torch.__version__}"
        )
    return f"cpu ({os.cpu_count()} cores, 1 thread per worker), torch {torch.__version__}"


if __name__ == "__main__":
    main()
