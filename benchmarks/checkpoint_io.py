"""Checkpoint store cost vs writing/reading the same bytes raw to the same store.

    .venv/bin/python -m benchmarks.checkpoint_io [--repeats 15] [--out benchmarks/results/checkpoint_io.json]

For a realistic state (an MLP with ~1.9 M parameters plus its Adam state, RNG states and a
data cursor: ~22 MB) and two stores (a local directory, and a real S3 HTTP endpoint: moto's
server in a child process on 127.0.0.1), it measures side by side, in one run, medians over ``--repeats``:

* save: ``store.save(...)`` until it returns: check the state, encode it while computing its
  checksum, write it durably (local: temporary file, fsync, rename, fsync of the directory; S3:
  one PUT, with the store's one listing (fence check) made during it), list the store once
  (local: after the write), create the manifest if absent (local: temporary file, fsync, link,
  fsync of the directory; S3: one conditional PUT). Retention then runs on the store's
  background thread, outside the timing.
  ``raw``: a plain durable write of the same state: local ``torch.save`` straight into a new file
  + flush + fsync (no temporary name, no directory fsync, no manifest); S3 ``torch.save`` to
  memory + one ``put_object``;
* load: ``store.latest()`` + ``store.load(ref)`` (list + manifest + read + checksum, then safe
  decode) vs ``raw``: the bytes read once (local ``read()``; S3 one ``get_object``) and
  ``torch.load(weights_only=True)``;
* S3 clients: raw uses a client with boto3's defaults (botocore retries off), which checks each
  download against the CRC32 S3 stores with the object. The store uses the client
  ``open_store`` builds when given none (``make_client``), which skips that check since the
  store verifies every byte against its manifest's digest anyway: result ``s3``. So that this is
  not mistaken for a cheaper store, ``s3_shared_client`` repeats save and load with the store
  handed raw's own client (as an Airflow ``aws`` connection gives one): both sides pay the CRC32.
* the same without serialisation (``raw_bytes_only``: pure I/O of the encoded bytes; the local
  write goes in 64 KiB pieces, ``shutil.copyfileobj``'s default, which is the fastest way here);
* training stall: how long the training loop is blocked per checkpoint with ``save`` and with
  ``save_async`` (only encoding blocks), plus the loop's slowdown per checkpoint;
* local only: the first load in a new process (how a job restores), the handover of the
  restored state to the workers as a file (``latest(into=)`` vs decoding and re-encoding it),
  the commit of a checkpoint the workers staged (``save_file`` vs decoding and ``save``), and
  finding the newest of 2, 50 and 300 retained checkpoints (listed one directory at a time vs
  the whole store listed first) and a small save beside them.

Ratios are ``raw_time / store_time`` (1.0 = no overhead; target >= 0.8), from medians of wall
time, of CPU time (``time.process_time``: all threads of this process, so less sensitive to
other work on a shared machine; the fsync wait is not CPU time) and from the best of the
repeats. Ours and raw alternate which goes first, round by round, and raw keeps its last two
files as the store keeps its last two checkpoints (deleted outside the timing on both sides), so
drifting load, and the cost of memory the previous round freed, hit both alike.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import write_json
from elastic_ops.checkpoint import CheckpointStore, Checksum, capture_rng, encode_state, open_store
from elastic_ops.checkpoint.checksum import DEFAULT_CHECKSUM
from elastic_ops.checkpoint.retry import RetryPolicy
from elastic_ops.checkpoint.s3 import make_client

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint_io.json"


def build_model(width: int = 1024) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP on 784 inputs with two hidden layers of ``width`` and its Adam optimizer
    (``width`` 1024: ~1.9 M parameters, a ~22 MB state; 4096: ~20 M, ~240 MB)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(784, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
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


def fsync_write(path: Path, data: bytes) -> None:
    """The encoded bytes written durably (``shutil.copyfileobj``: 64 KiB pieces) and fsync'd."""
    with open(path, "wb") as f:
        shutil.copyfileobj(io.BytesIO(data), f)
        f.flush()
        os.fsync(f.fileno())


def fsync_torch_save(path: Path, state: dict[str, Any]) -> None:
    """A plain durable save: ``torch.save(state, path)`` (PyTorch writes the file itself, which is
    faster than handing it a Python file object), then fsync."""
    torch.save(state, str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_load_path(path: Path) -> Any:
    """A plain load: ``torch.load(path, weights_only=True)``; PyTorch reads each tensor's bytes
    from the file straight into its memory (faster than reading the bytes, then loading them)."""
    return torch.load(path, weights_only=True, map_location="cpu")


KEEP = 2  # the store keeps its last two checkpoints (keep_last=2); raw keeps its last two files


def bench_io(
    store: CheckpointStore,
    state: dict[str, Any],
    repeats: int,
    raw_write: Callable[[int, bytes], None],
    raw_read: Callable[[int], bytes],
    raw_delete: Callable[[int], None],
    raw_save: Callable[[int, dict[str, Any]], None] | None = None,
    raw_load: Callable[[int], Any] | None = None,
) -> dict[str, Any]:
    """Our save/load vs the same state saved/loaded raw, side by side, medians of ``repeats``.

    ``raw_save`` (default: ``torch.save`` to memory, then ``raw_write``) saves the state plainly
    and durably; ``raw_load`` (default: the bytes read in one go, then
    ``torch.load(weights_only=True)``) loads it: what checkpointing costs without the store.
    ``raw_bytes_only`` leaves serialisation out.
    """
    data = encode_state(state)
    save_raw = raw_save or (lambda i, st: raw_write(i, _torch_bytes(st)))
    load_raw = raw_load or (
        lambda i: torch.load(io.BytesIO(raw_read(i)), weights_only=True, map_location="cpu")
    )

    def ours_save(i: int) -> None:
        store.save(1000 + i, state, epoch=1, spec_hash="bench")

    def ours_load(_i: int) -> None:
        store.load(store.latest(spec_hash="bench"))

    # (ours, raw) pairs; raw_save and raw_write leave file i, read by the loads of round i
    pairs: list[tuple[tuple[str, Callable[[int], Any]], ...]] = [
        (("save", ours_save), ("raw_save", lambda i: save_raw(i, state))),
        (("load", ours_load), ("raw_load", load_raw)),
        (("raw_write", lambda i: raw_write(i, data)),),
        (("raw_read", raw_read),),
    ]
    wall: dict[str, list[float]] = {name: [] for pair in pairs for name, _ in pair}
    cpu: dict[str, list[float]] = {name: [] for name in wall}
    for i in range(repeats):
        for pair in pairs:
            for name, fn in pair if i % 2 == 0 else pair[::-1]:
                w0, c0 = time.perf_counter(), time.process_time()
                fn(i)
                wall[name].append(time.perf_counter() - w0)
                cpu[name].append(time.process_time() - c0)
                store.wait()  # retention runs in the background after save; keep it out of the next timing
        if i >= KEEP:
            raw_delete(i - KEEP)
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    best = {k: min(v) for k, v in wall.items()}
    return {
        "bytes": len(data),
        **_side_by_side(med),
        "cpu_time": _side_by_side(med_cpu),  # process_time: less sensitive to other work on the machine
        "raw_bytes_only": {
            "write_s": med["raw_write"],
            "read_s": med["raw_read"],
            "save_ratio": med["raw_write"] / med["save"],
            "load_ratio": med["raw_read"] / med["load"],
        },
        "best_of_repeats": _side_by_side(best),  # less sensitive to other load on a shared machine
        "save_MBps": len(data) / med["save"] / 1e6,
        "load_MBps": len(data) / med["load"] / 1e6,
    }


def _side_by_side(t: dict[str, float]) -> dict[str, float]:
    """Ours and raw times of save and load, and the ratios raw / ours."""
    out: dict[str, float] = {}
    for op in ("save", "load"):
        out[f"{op}_s"], out[f"raw_{op}_s"] = t[op], t[f"raw_{op}"]
        out[f"{op}_ratio_raw_over_ours"] = t[f"raw_{op}"] / t[op]
    return out


def _torch_bytes(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


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


def bench_local(root: Path, state: dict[str, Any], repeats: int, checksum: str) -> dict[str, Any]:
    """:func:`bench_io` on a local directory; raw is ``torch.save(path)`` + fsync and
    ``torch.load(path)``, the fastest plain way to each."""
    store = open_store(f"file://{root}/store", keep_last=KEEP, checksum=checksum)
    raw = root / "raw"
    raw.mkdir(parents=True)
    return bench_io(
        store,
        state,
        repeats,
        raw_write=lambda i, data: fsync_write(raw / f"{i}.pt", data),
        raw_read=lambda i: (raw / f"{i}.pt").read_bytes(),
        raw_delete=lambda i: (raw / f"{i}.pt").unlink(missing_ok=True),
        raw_save=lambda i, st: fsync_torch_save(raw / f"{i}.pt", st),
        raw_load=lambda i: torch_load_path(raw / f"{i}.pt"),
    )


def bench_handover(root: Path, state: dict[str, Any], repeats: int, checksum: str) -> dict[str, Any]:
    """How a resuming chunk hands the restored state to its workers, as a file.

    ours: ``store.latest(into=path)`` (the committed file hard-linked, hashed and its pickle
    checked; ``link_s``) and the same across file systems (a hashed copy; ``copy_s``); the
    previous way, ``latest()`` + ``load()`` + ``torch.save`` to the file (``decode_encode_s``);
    and a plain ``shutil.copyfile`` of the committed file (``raw_copy_s``: bytes only, nothing
    verified). Medians of ``repeats``, the variants alternating.
    """
    from elastic_ops.checkpoint import local

    store = open_store(f"file://{root}/store", checksum=checksum)
    ref = store.save(1, state, epoch=1, spec_hash="bench")
    committed = root / "store" / f"it-{1:08d}" / ref.files[0].name
    real_link = local.os.link

    def no_link(*_args: Any) -> None:  # as across file systems
        raise OSError(18, "Invalid cross-device link")

    def handover(kind: str, out: Path) -> None:
        local.os.link = no_link if kind == "copy_s" else real_link
        try:
            if kind == "decode_encode_s":
                torch.save(store.load(store.latest(spec_hash="bench")), out)
            elif kind == "raw_copy_s":
                shutil.copyfile(committed, out)
            else:
                store.latest(spec_hash="bench", into=out)
        finally:
            local.os.link = real_link

    kinds = ["link_s", "copy_s", "decode_encode_s", "raw_copy_s"]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(repeats):
        for kind in kinds if i % 2 == 0 else kinds[::-1]:
            out = root / f"handover-{kind}.pt"
            t0 = time.perf_counter()
            handover(kind, out)
            times[kind].append(time.perf_counter() - t0)
            out.unlink()
    return {k: statistics.median(v) for k, v in times.items()}


def bench_commit_staged(root: Path, state: dict[str, Any], repeats: int, checksum: str) -> dict[str, Any]:
    """What a chunk's committer spends per checkpoint the workers staged (``save_atomic``):
    ``save_file_s`` (model hashed from a mapping, the file committed as it is: this version)
    vs ``decode_encode_s`` (the file loaded, the model hashed, ``save()`` encoding it again: the
    previous one); wall and CPU medians of ``repeats``, alternating."""
    from elastic_ops.runtime.state import load_state, param_sha256, save_atomic

    store = open_store(f"file://{root}/store", keep_last=KEEP, checksum=checksum)

    def commit(kind: str, iteration: int, path: Path) -> None:
        if kind == "decode_encode":
            staged = load_state(path)
            metrics = {"param_sha256": param_sha256(staged["model"])}
            store.save(iteration, staged, epoch=1, spec_hash="bench", metrics=metrics)
        else:
            metrics = {"param_sha256": param_sha256(load_state(path, mmap=True)["model"])}
            store.save_file(iteration, path, epoch=1, spec_hash="bench", metrics=metrics)

    wall: dict[str, list[float]] = {"save_file": [], "decode_encode": []}
    cpu: dict[str, list[float]] = {k: [] for k in wall}
    iteration = 0
    for i in range(repeats):
        for kind in list(wall) if i % 2 == 0 else list(wall)[::-1]:
            iteration += 1
            path = root / f"ckpt-{iteration}.pt"
            save_atomic(state, path)
            w0, c0 = time.perf_counter(), time.process_time()
            commit(kind, iteration, path)
            wall[kind].append(time.perf_counter() - w0)
            cpu[kind].append(time.process_time() - c0)
            store.wait()
            path.unlink()
    return {f"{k}_{m}": statistics.median(v[k]) for m, v in (("s", wall), ("cpu_s", cpu)) for k in wall}


def bench_many_checkpoints(
    root: Path, repeats: int, counts: tuple[int, ...] = (2, 50, 300)
) -> dict[str, Any]:
    """A local store keeping ``count`` small checkpoints (``keep_every`` can keep hundreds):
    ``latest(decode=False)`` listed one checkpoint directory at a time, newest first (this
    version), vs the whole store listed first (the previous one: the same store, its backend's
    ``list_dirs`` hidden), medians of ``repeats`` calls each, alternating; and ``save`` until it
    returns (it lists only the fence markers; retention lists the store on the background
    thread, waited for outside the timing), median of ``repeats`` saves."""
    out: dict[str, Any] = {}
    for count in counts:
        uri = f"file://{root}/keep-{count}"
        store = open_store(uri, keep_last=count)
        for iteration in range(1, count + 1):
            store.save(iteration, {"w": torch.zeros(16)}, epoch=1, spec_hash="bench")
        store.wait()
        full = open_store(uri, keep_last=count)
        full.backend.list_dirs = None  # type: ignore[attr-defined]  # as before: list everything
        sides = {"one_at_a_time": store, "full_listing": full}
        times: dict[str, list[float]] = {side: [] for side in sides}
        for i in range(repeats):
            for side in sides if i % 2 == 0 else reversed(list(sides)):
                t0 = time.perf_counter()
                ref = sides[side].latest(spec_hash="bench", decode=False)
                times[side].append(time.perf_counter() - t0)
                if ref is None or ref.iteration != count:
                    raise RuntimeError(f"latest() found {ref} in a store of {count} checkpoints")
        med = {side: statistics.median(v) for side, v in times.items()}
        saves = []
        for i in range(repeats):
            t0 = time.perf_counter()
            store.save(count + 1 + i, {"w": torch.zeros(16)}, epoch=1, spec_hash="bench")
            saves.append(time.perf_counter() - t0)
            store.wait()
        out[str(count)] = {
            "latest_s": med["one_at_a_time"],
            "full_listing_latest_s": med["full_listing"],
            "ratio_full_over_ours": med["full_listing"] / med["one_at_a_time"],
            "save_s": statistics.median(saves),
        }
    return out


# One load in a new process, timed there: how a resuming chunk restores (its first load, into
# memory the process has never used: every page is new to it). Imports are not timed; the first
# use of the loaders (ours checks once that PyTorch decodes its record reads, torch.load sets
# itself up) is.
_FIRST_LOAD_CHILD = """
import json, sys, time
import torch
from elastic_ops.checkpoint import open_store
torch.set_num_threads(1)
kind, where = sys.argv[1], sys.argv[2]
if kind == "ours":
    store = open_store(where)
    t0 = time.perf_counter()
    store.load(store.latest(spec_hash="bench"))
else:
    t0 = time.perf_counter()
    torch.load(where, weights_only=True, map_location="cpu")
print(json.dumps({"s": time.perf_counter() - t0}))
"""


def bench_first_load(root: Path, state: dict[str, Any], repeats: int, checksum: str) -> dict[str, Any]:
    """The first load in a new process, ours (``latest()`` + ``load()``) vs ``torch.load(path)``,
    alternating which goes first; medians of ``repeats`` processes each."""
    store = open_store(f"file://{root}/store", checksum=checksum)
    store.save(1, state, epoch=1, spec_hash="bench")
    raw = root / "raw.pt"
    fsync_torch_save(raw, state)
    sides = {"ours": store.uri, "raw": str(raw)}
    times: dict[str, list[float]] = {side: [] for side in sides}
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for i in range(repeats):
        for side in sides if i % 2 == 0 else reversed(list(sides)):
            out = subprocess.run(
                [sys.executable, "-c", _FIRST_LOAD_CHILD, side, sides[side]],
                check=True,
                capture_output=True,
                text=True,
                env=env,
            ).stdout
            times[side].append(json.loads(out.splitlines()[-1])["s"])
    ours, bare = statistics.median(times["ours"]), statistics.median(times["raw"])
    return {
        "processes": repeats,
        "load_s": ours,
        "raw_load_s": bare,
        "load_ratio_raw_over_ours": bare / ours,
        "each_s": times,  # every process's time, in order
    }


def run(repeats: int, checksum: str = DEFAULT_CHECKSUM.value, large_width: int = 4096) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, opt = build_model()
    for _ in range(2):
        train_step(model, opt)
    state = snapshot(model, opt, 0)
    results: dict[str, Any] = {
        "command": "python -m benchmarks.checkpoint_io " + " ".join(sys.argv[1:]),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "state": {
            "parameters": sum(p.numel() for p in model.parameters()),
            "encoded_bytes": len(encode_state(state)),
        },
        "repeats": repeats,
        "checksum": checksum,
        "load_average_1_5_15_min": {"start": os.getloadavg()},
    }

    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        root = Path(tmp)
        results["local"] = bench_local(root / "default", state, repeats, checksum)
        results["local"]["first_load_in_new_process"] = bench_first_load(
            root / "first", state, repeats, checksum
        )
        results["local"]["handover_to_workers"] = bench_handover(root / "handover", state, repeats, checksum)
        results["local"]["commit_staged"] = bench_commit_staged(root / "commit", state, repeats, checksum)
        results["local"]["many_checkpoints"] = bench_many_checkpoints(root / "many", max(15, repeats))
        stall_store = open_store(f"file://{root}/stall", keep_last=KEEP, checksum=checksum)
        results["local"]["stall"] = bench_stall(stall_store, 20, 5)
        if large_width:
            big_model, big_opt = build_model(large_width)
            train_step(big_model, big_opt)
            big = snapshot(big_model, big_opt, 0)
            del big_model
            results["local_large"] = bench_local(root / "large", big, max(5, repeats // 2), checksum)
            results["local_large"]["first_load_in_new_process"] = bench_first_load(
                root / "first-large", big, max(5, repeats // 2), checksum
            )
            results["local_large"]["handover_to_workers"] = bench_handover(
                root / "handover-large", big, max(5, repeats // 2), checksum
            )
            results["local_large"]["commit_staged"] = bench_commit_staged(
                root / "commit-large", big, max(5, repeats // 2), checksum
            )
            results["local_large"]["state"] = {
                "width": large_width,
                "parameters": sum(t.numel() for t in big["model"].values()),
            }
            del big, big_opt

    from tests.s3_server import S3ServerProcess

    with S3ServerProcess() as server:  # S3 as a separate process, as it would be
        ep = server.endpoint("bench")
        client = ep.client()  # boto3's defaults (botocore retries off): what raw uses
        # the client open_store() builds when given none (make_client: no redundant CRC32 pass
        # over downloads, which the store verifies with its own digest)
        own_client = make_client(ep.endpoint_url, region_name=ep.region, **ep.credentials)
        s3_options: dict[str, Any] = {
            "s3_client": own_client,
            "keep_last": KEEP,
            "checksum": checksum,
            "retry": RetryPolicy(attempts=3),
        }
        store = open_store(ep.uri("store"), **s3_options)

        def raw_put(i: int, data: bytes) -> None:
            client.put_object(Bucket=ep.bucket, Key=f"raw/{i}.pt", Body=data)

        def raw_get(i: int) -> bytes:
            return client.get_object(Bucket=ep.bucket, Key=f"raw/{i}.pt")["Body"].read()

        def raw_delete(i: int) -> None:
            client.delete_object(Bucket=ep.bucket, Key=f"raw/{i}.pt")

        results["s3"] = bench_io(store, state, repeats, raw_put, raw_get, raw_delete)
        results["s3"]["endpoint"] = "moto server (child process) on 127.0.0.1"
        results["s3"]["client"] = "ours: make_client() (open_store's own); raw: boto3 defaults"
        results["s3"]["stall"] = bench_stall(open_store(ep.uri("stall"), **s3_options), 20, 5)
        # the store handed raw's client (boto3 defaults, as an Airflow aws connection gives):
        # it also pays botocore's CRC32 check of each download
        shared = open_store(ep.uri("shared"), **{**s3_options, "s3_client": client})
        results["s3_shared_client"] = bench_io(shared, state, repeats, raw_put, raw_get, raw_delete)
        results["s3_shared_client"]["client"] = "ours and raw: the same client, boto3 defaults"
    results["load_average_1_5_15_min"]["end"] = os.getloadavg()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--checksum", choices=[c.value for c in Checksum], default=DEFAULT_CHECKSUM.value)
    parser.add_argument(
        "--large-width",
        type=int,
        default=4096,
        help="hidden width of the second, larger local state (4096: ~240 MB); 0 skips it",
    )
    args = parser.parse_args(argv)
    results = run(args.repeats, args.checksum, args.large_width)
    write_json(args.out, results)
    places = [p for p in ("local", "local_large", "s3", "s3_shared_client") if p in results]
    for where in places:
        r = results[where]
        stall = r.get("stall")
        print(
            f"{where:11s} save {r['save_s'] * 1e3:7.1f} ms (raw {r['raw_save_s'] * 1e3:7.1f} ms, ratio "
            f"{r['save_ratio_raw_over_ours']:.2f})  load {r['load_s'] * 1e3:7.1f} ms (raw "
            f"{r['raw_load_s'] * 1e3:7.1f} ms, ratio {r['load_ratio_raw_over_ours']:.2f})"
            + (
                f"  stall/ckpt sync {stall['sync_blocked_per_checkpoint_s'] * 1e3:.0f} ms, async "
                f"{stall['async_blocked_per_checkpoint_s'] * 1e3:.0f} ms"
                if stall
                else ""
            )
        )
    for where in places:
        b, c = results[where]["best_of_repeats"], results[where]["cpu_time"]
        print(
            f"{where:11s} best-of-{args.repeats} ratios: save {b['save_ratio_raw_over_ours']:.2f}, "
            f"load {b['load_ratio_raw_over_ours']:.2f}; CPU-time ratios: save "
            f"{c['save_ratio_raw_over_ours']:.2f}, load {c['load_ratio_raw_over_ours']:.2f}"
        )
    for where in ("local", "local_large"):
        r = results.get(where, {})
        first, h = r.get("first_load_in_new_process"), r.get("handover_to_workers")
        if first and h:
            print(
                f"{where:11s} first load in a new process: {first['load_s'] * 1e3:.1f} ms (raw "
                f"{first['raw_load_s'] * 1e3:.1f} ms, ratio {first['load_ratio_raw_over_ours']:.2f}), "
                f"medians of {first['processes']} processes each; handover to workers: latest(into=) "
                f"{h['link_s'] * 1e3:.1f} ms (hard link) / {h['copy_s'] * 1e3:.1f} ms (copy), before: "
                f"decode + torch.save {h['decode_encode_s'] * 1e3:.1f} ms, plain copyfile "
                f"{h['raw_copy_s'] * 1e3:.1f} ms"
            )
        c = r.get("commit_staged")
        if c:
            print(
                f"{where:11s} commit of a staged checkpoint: save_file {c['save_file_s'] * 1e3:.1f} ms "
                f"(CPU {c['save_file_cpu_s'] * 1e3:.1f}), before: decode + save "
                f"{c['decode_encode_s'] * 1e3:.1f} ms (CPU {c['decode_encode_cpu_s'] * 1e3:.1f})"
            )
    many = results["local"]["many_checkpoints"]
    print(
        "local       N checkpoints kept: "
        + ", ".join(
            f"N={n} latest(decode=False) {m['latest_s'] * 1e3:.2f} ms (whole store listed: "
            f"{m['full_listing_latest_s'] * 1e3:.2f}), small save {m['save_s'] * 1e3:.2f} ms"
            for n, m in many.items()
        )
    )
    print(f"checksum {args.checksum}; load average {results['load_average_1_5_15_min']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
