"""Checkpoint store cost vs writing/reading the same bytes raw to the same store.

    .venv/bin/python -m benchmarks.checkpoint_io [--repeats 5] [--out benchmarks/results/checkpoint_io.json]

For a realistic state (an MLP with ~1.9 M parameters plus its Adam state, RNG states and a
data cursor: ~22 MB) and two stores (a local directory, and a real S3 HTTP endpoint: moto's
server in a child process on 127.0.0.1), it measures side by side, in one run, medians over ``--repeats``:

* save: ``store.save(...)`` until it returns (encode + sha256 + data upload + one listing for
  the fence check + conditional manifest; retention then runs on the store's background thread)
  vs ``raw``: ``torch.save`` to memory and the bytes written once (local: write +
  fsync; S3: one ``put_object``);
* load: ``store.latest()`` + ``store.load(ref)`` (list + manifest + read + sha256 + safe decode)
  vs ``raw``: the bytes read once (local ``read_bytes``; S3 one ``get_object``) and
  ``torch.load(weights_only=True)``;
* the same without serialisation (``raw_bytes_only``: pure I/O of the encoded bytes);
* training stall: how long the training loop is blocked per checkpoint with ``save`` and with
  ``save_async`` (only encoding blocks), plus the loop's slowdown per checkpoint.

Ratios are ``raw_time / store_time`` (1.0 = no overhead; target >= 0.8), from medians and from
the best of the repeats (the latter is less sensitive to other work on a shared machine). Ours
and raw run interleaved, round by round, so drifting machine load hits both alike.
"""

from __future__ import annotations

import argparse
import io
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

from benchmarks._results import write_json
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
) -> dict[str, Any]:
    """Our save/load vs the same bytes written/read raw, side by side, medians of ``repeats``.

    ``raw`` = serialise with ``torch.save`` and write the bytes in one go / read them in one go
    and ``torch.load(weights_only=True)``: what checkpointing costs without the store.
    ``raw_bytes_only`` leaves serialisation out (pure I/O of the encoded bytes).
    """
    data = encode_state(state)

    def ours_save(i: int) -> None:
        store.save(1000 + i, state, epoch=1, spec_hash="bench")

    def raw_save(i: int) -> None:
        buf = io.BytesIO()
        torch.save(state, buf)
        raw_write(i, buf.getvalue())

    def ours_load(_i: int) -> None:
        store.load(store.latest(spec_hash="bench"))

    def raw_load(i: int) -> None:
        torch.load(io.BytesIO(raw_read(i)), weights_only=True, map_location="cpu")

    # interleaved rounds, so drift in machine load hits both sides alike
    steps: dict[str, Callable[[int], Any]] = {
        "save": ours_save, "raw_save": raw_save, "raw_write": lambda i: raw_write(i, data),
        "load": ours_load, "raw_load": raw_load, "raw_read": raw_read,
    }
    t: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(repeats):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn(i)
            t[name].append(time.perf_counter() - t0)
            store.wait()  # retention runs in the background after save; keep it out of the next timing
    med = {k: statistics.median(v) for k, v in t.items()}
    best = {k: min(v) for k, v in t.items()}
    return {
        "bytes": len(data),
        "save_s": med["save"],
        "raw_save_s": med["raw_save"],
        "save_ratio_raw_over_ours": med["raw_save"] / med["save"],
        "load_s": med["load"],
        "raw_load_s": med["raw_load"],
        "load_ratio_raw_over_ours": med["raw_load"] / med["load"],
        "raw_bytes_only": {
            "write_s": med["raw_write"],
            "read_s": med["raw_read"],
            "save_ratio": med["raw_write"] / med["save"],
            "load_ratio": med["raw_read"] / med["load"],
        },
        "best_of_repeats": {  # less sensitive to other load on a shared machine
            "save_s": best["save"], "raw_save_s": best["raw_save"],
            "save_ratio_raw_over_ours": best["raw_save"] / best["save"],
            "load_s": best["load"], "raw_load_s": best["raw_load"],
            "load_ratio_raw_over_ours": best["raw_load"] / best["load"],
        },
        "save_MBps": len(data) / med["save"] / 1e6,
        "load_MBps": len(data) / med["load"] / 1e6,
    }


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
        )
        results["local"]["stall"] = bench_stall(open_store(f"file://{root}/stall", keep_last=2), 20, 5)

    from tests.s3_server import S3ServerProcess

    with S3ServerProcess() as server:  # S3 as a separate process, as it would be
        ep = server.endpoint("bench")
        client = ep.client()
        store = open_store(ep.uri("store"), s3_client=client, keep_last=2, retry=RetryPolicy(attempts=3))

        def raw_put(i: int, data: bytes) -> None:
            client.put_object(Bucket=ep.bucket, Key=f"raw/{i}.pt", Body=data)

        def raw_get(i: int) -> bytes:
            return client.get_object(Bucket=ep.bucket, Key=f"raw/{i}.pt")["Body"].read()

        results["s3"] = bench_io(store, state, repeats, raw_put, raw_get)
        results["s3"]["endpoint"] = "moto server (child process) on 127.0.0.1"
        stall_store = open_store(
            ep.uri("stall"), s3_client=client, keep_last=2, retry=RetryPolicy(attempts=3)
        )
        results["s3"]["stall"] = bench_stall(stall_store, 20, 5)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    results = run(args.repeats)
    write_json(args.out, results)
    for where in ("local", "s3"):
        r = results[where]
        print(
            f"{where:5s} save {r['save_s'] * 1e3:7.1f} ms (raw {r['raw_save_s'] * 1e3:7.1f} ms, ratio "
            f"{r['save_ratio_raw_over_ours']:.2f})  load {r['load_s'] * 1e3:7.1f} ms (raw "
            f"{r['raw_load_s'] * 1e3:7.1f} ms, ratio {r['load_ratio_raw_over_ours']:.2f})  stall/ckpt sync "
            f"{r['stall']['sync_blocked_per_checkpoint_s'] * 1e3:.0f} ms, async "
            f"{r['stall']['async_blocked_per_checkpoint_s'] * 1e3:.0f} ms"
        )
    for where in ("local", "s3"):
        b = results[where]["best_of_repeats"]
        print(f"{where:5s} best-of-{args.repeats} ratios: save {b['save_ratio_raw_over_ours']:.2f}, "
              f"load {b['load_ratio_raw_over_ours']:.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
