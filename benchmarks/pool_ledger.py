"""Ledger throughput: request + heartbeat + release operations per second, SQLite vs PostgreSQL.

    .venv/bin/python -m benchmarks.pool_ledger [--seconds 3] [--clients 1 8 32]
        [--out benchmarks/results/pool_ledger.json]

Each client is its own process with its own ``PoolClient`` and its own job (min 1, max 2
workers) on a pool of 128 slots; it loops request -> heartbeat -> release for ``--seconds``.
Every call is one transaction (sync -> decide -> apply, serialised by the ledger's lock), so
the number is the ledger's serialised decision rate. PostgreSQL runs in a fresh schema that is
dropped afterwards; it is skipped (and recorded as such) when no server is reachable.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
import tempfile
import time
import uuid

import sqlalchemy as sa

from benchmarks._results import write_json
from elastic_ops.pool import Grant, PoolClient

PG_BASE = os.environ.get("ELASTIC_OPS_TEST_POSTGRES", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")


def _client_loop(url: str, idx: int, start_at: float, seconds: float, out) -> None:
    pool = PoolClient(url)
    job = f"bench-{idx}"
    pool.submit(job, min_workers=1, max_workers=2)
    while time.time() < start_at:
        time.sleep(0.001)
    ops, end = 0, start_at + seconds
    while time.time() < end:
        g = pool.request(job)
        ops += 1
        if isinstance(g, Grant):
            pool.heartbeat(job, g.epoch, workers=g.workers)
            pool.release(job, g.epoch)
            ops += 2
    pool.close()
    out.put(ops)


def run_cell(url: str, clients: int, seconds: float) -> dict:
    setup = PoolClient(url)
    setup.add_host("bench-host", 128)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    start_at = time.time() + 1.0 + 0.05 * clients  # everyone connected before the clock starts
    procs = [ctx.Process(target=_client_loop, args=(url, i, start_at, seconds, out)) for i in range(clients)]
    for p in procs:
        p.start()
    total = sum(out.get(timeout=seconds + 120) for _ in procs)
    for p in procs:
        p.join()
    setup.close()
    return {"clients": clients, "ops": total, "seconds": seconds, "ops_per_s": round(total / seconds, 1)}


def _pg_available() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=1):
            return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--out", default="benchmarks/results/pool_ledger.json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.clients:
            url = f"sqlite:///{tmp}/pool-{n}.db"
            rows.append({"backend": "sqlite", **run_cell(url, n, args.seconds)})
            print(rows[-1], flush=True)
    pg_note = None
    if _pg_available():
        engine = sa.create_engine(PG_BASE)
        for n in args.clients:
            schema = f"bench_{uuid.uuid4().hex[:10]}"
            with engine.begin() as conn:
                conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
            try:
                sep = "&" if "?" in PG_BASE else "?"
                url = f"{PG_BASE}{sep}options=-csearch_path%3D{schema}"
                rows.append({"backend": "postgresql", **run_cell(url, n, args.seconds)})
                print(rows[-1], flush=True)
            finally:
                with engine.begin() as conn:
                    conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        engine.dispose()
    else:
        pg_note = "PostgreSQL not reachable at 127.0.0.1:5432: skipped"
    result = {
        "benchmark": "pool_ledger",
        "command": "python -m benchmarks.pool_ledger " + " ".join(sys.argv[1:]),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg_at_start": os.getloadavg()[0],
        "note": pg_note,
        "rows": rows,
    }
    write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    main()
