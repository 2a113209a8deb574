"""Checkpoint store cost vs writing/reading the same bytes raw to the same store.

    .venv/bin/python -m benchmarks.checkpoint_io [--repeats 5] [--out benchmarks/results/checkpoint_io.json]

For a realistic state (an MLP with ~1.9 M parameters plus its Adam state, RNG states and a
data cursor: ~22 MB) and two stores (a local directory, and a real S3 HTTP endpoint: moto's
server on 127.0.0.1), it measures side by side, in one run, medians over ``--repeats``:

* save: ``store.save(...)`` (encode + sha256 + fence check + data upload + conditional manifest
  + retention) vs ``raw``: the already-encoded bytes written once (local: write + fsync; S3: one
  ``put_object``) and vs ``torch.save`` straight to the file (local) — what a user would write
  without the store;
* load: ``store.latest()`` + ``store.load(ref)`` (list + manifest + verified read + safe decode)
  vs ``raw``: reading the bytes once (local ``read_bytes``; S3 one ``get_object``);
* training stall: how long the training loop is blocked per checkpoint with ``save`` and with
  ``save_async`` (only encoding blocks), plus the loop's slowdown per checkpoint.

Ratios are ``raw_time / store_time`` (1.0 = no overhead; target >= 0.8).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from elastic_ops.checkpoint import CheckpointStore, capture_rng, encode_state, open_store
from elastic_ops.checkpoint.retry import RetryPolicy

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint_io.json"


def build_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer, iteration: int) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": capture_rng(),
        "cursor": {"epoch": 0, "offset": iteration * 64},
        "iteration": iteration,
    }


def median_time(fn: Callable[[int], Any], repeats: int) -> float:
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def bench_io(
    store: CheckpointStore,
    state: dict[str, Any],
    repeats: int,
    raw_write: Callable[[int, bytes], None],
    raw_read: Callable[[int], bytes],
    plain_torch_save: Callable[[int], None] | None,
) -> dict[str, Any]:
    data = encode_state(state)
    base = 1000
    save_s = median_time(lambda i: store.save(base + i, state, epoch=1, spec_hash="bench"), repeats)
    raw_write_s = median_time(lambda i: raw_write(i, data), repeats)

    def ours_load(_i: int) -> None:
        store.load(store.latest(spec_hash="bench"))

    load_s = median_time(ours_load, repeats)
    raw_read_s = median_time(lambda i: raw_read(i % repeats), repeats)
    out = {
        "bytes": len(data),
        "save_s": save_s,
        "raw_write_s": raw_write_s,
        "save_ratio_raw_over_ours": raw_write_s / save_s,
        "load_s": load_s,
        "raw_read_s": raw_read_s,
        "load_ratio_raw_over_ours": raw_read_s / load_s,
        "save_MBps": len(data) / save_s / 1e6,
        "load_MBps": len(data) / load_s / 1e6,
    }
    if plain_torch_save is not None:
        out["plain_torch_save_s"] = median_time(plain_torch_save, repeats)
        out["save_ratio_plain_torch_save_over_ours"] = out["plain_torch_save_s"] / save_s
    return out


def bench_stall(store: CheckpointStore, every: int, checkpoints: int) -> dict[str, Any]:
    """Training-loop time blocked per checkpoint, synchronous vs background save."""
    model, opt = build_model()
    train_step(model, opt)
    steps = every * checkpoints

    def loop(mode: str, first_iteration: int) -> tuple[float, list[float]]:
        blocked = []
        t0 = time.perf_counter()
        for i in range(1, steps + 1):
            train_step(model, opt)
            if mode != "none" and i % every == 0:
                it = first_iteration + i
                b0 = time.perf_counter()
                if mode == "sync":
                    store.save(it, snapshot(model, opt, it), epoch=1, spec_hash="stall")
                else:
                    store.save_async(it, snapshot(model, opt, it), epoch=1, spec_hash="stall")
                blocked.append(time.perf_counter() - b0)
        store.close()  # background saves finish (counted: the job is not done until they are)
        return time.perf_counter() - t0, blocked

    loop("none", 0)  # warm-up
    base_s, _ = loop("none", 0)
    sync_s, sync_blocked = loop("sync", 10_000)
    async_s, async_blocked = loop("async", 20_000)
    return {
        "checkpoint_every_steps": every,
        "checkpoints": checkpoints,
        "loop_without_checkpoints_s": base_s,
        "sync_blocked_per_checkpoint_s": statistics.median(sync_blocked),
        "sync_slowdown_per_checkpoint_s": (sync_s - base_s) / checkpoints,
        "async_blocked_per_checkpoint_s": statistics.median(async_blocked),
        "async_slowdown_per_checkpoint_s": (async_s - base_s) / checkpoints,
    }


def run(repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, opt = build_model()
    for _ in range(2):
        train_step(model, opt)
    state = snapshot(model, opt, 0)
    results: dict[str, Any] = {
        "command": "python -m benchmarks.checkpoint_io " + " ".join(sys.argv[1:]),
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "platform": platform.platform()},
        "state": {"parameters": sum(p.numel() for p in model.parameters()),
                  "encoded_bytes": len(encode_state(state))},
        "repeats": repeats,
    }

    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        root = Path(tmp)
        store = open_store(f"file://{root}/store", keep_last=2)
        (root / "raw").mkdir()
        results["local"] = bench_io(
            store, state, repeats,
            raw_write=lambda i, data: fsync_write(root / "raw" / f"{i}.pt", data),
            raw_read=lambda i: (root / "raw" / f"{i}.pt").read_bytes(),
            plain_torch_save=lambda i: _torch_save_fsync(state, root / "raw" / f"plain-{i}.pt"),
        )
        results["local"]["stall"] = bench_stall(open_store(f"file://{root}/stall", keep_last=2), 20, 5)

    from tests.s3_server import S3Server

    with S3Server() as server:
        ep = server.endpoint("bench")
        client = ep.client()
        store = open_store(ep.uri("store"), s3_client=client, keep_last=2, retry=RetryPolicy(attempts=3))

        def raw_put(i: int, data: bytes) -> None:
            client.put_object(Bucket=ep.bucket, Key=f"raw/{i}.pt", Body=data)

        def raw_get(i: int) -> bytes:
            return client.get_object(Bucket=ep.bucket, Key=f"raw/{i}.pt")["Body"].read()

        results["s3"] = bench_io(store, state, repeats, raw_put, raw_get, None)
        results["s3"]["endpoint"] = "moto server on 127.0.0.1 (in-process thread)"
        stall_store = open_store(
            ep.uri("stall"), s3_client=client, keep_last=2, retry=RetryPolicy(attempts=3)
        )
        results["s3"]["stall"] = bench_stall(stall_store, 20, 5)
    return results


def _torch_save_fsync(state: dict[str, Any], path: Path) -> None:
    buf = io.BytesIO()
    torch.save(state, buf)
    fsync_write(path, buf.getvalue())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    results = run(args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    for where in ("local", "s3"):
        r = results[where]
        print(
            f"{where:5s} save {r['save_s'] * 1e3:7.1f} ms (raw {r['raw_write_s'] * 1e3:7.1f} ms, ratio "
            f"{r['save_ratio_raw_over_ours']:.2f})  load {r['load_s'] * 1e3:7.1f} ms (raw "
            f"{r['raw_read_s'] * 1e3:7.1f} ms, ratio {r['load_ratio_raw_over_ours']:.2f})  stall/ckpt sync "
            f"{r['stall']['sync_blocked_per_checkpoint_s'] * 1e3:.0f} ms, async "
            f"{r['stall']['async_blocked_per_checkpoint_s'] * 1e3:.0f} ms"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
