"""Load test of the pool ledger's control plane at cluster size: heartbeats against the cheapest
hand-written lease renewal, and how fast a change becomes a target the jobs can read.

    .venv/bin/python -m benchmarks.pool_ledger [--jobs 100 1000 10000] [--seconds 10]
        [--clients 32] [--rounds 1] [--sqlite-jobs 1000] [--setup-timeout 900]
        [--out benchmarks/results/pool_ledger.json]

For each job count N (PostgreSQL, in a fresh schema dropped afterwards; SQLite, in a fresh file,
as a smaller secondary row) it builds a pool of 16-slot hosts (64 hosts up to 1,000 jobs,
ceil(N / 16) above: one slot per job, a few spare), with a lease TTL of 3,600 s so that no lease
may expire during the run, and then:

1. **Setup.** ``--clients`` processes (fork) each submit and request their share of the N jobs
   (min 1 worker; max 2 for as many as the spare slots hold, so that the plan is not trivial
   but nobody must be shrunk), all at once: group commit folds concurrent changes into one
   plan. Reported: seconds, plans run, changes per plan.
2. **Heartbeat phase** (``--seconds``). Each process loops over its jobs calling
   ``heartbeat(job, epoch, workers=..., measured=Observation(...))`` as fast as it can (a job
   follows the target it reads). Reported: heartbeats/s (all processes), p50/p99 latency.
   Meanwhile one more process makes a change every ~0.5 s (``set_priority`` of a random job,
   1..9): "change" is the ``set_priority`` call (it returns once a committed plan saw it),
   "readable" is that plus one heartbeat of the job (the target the plan wrote is readable).
   Plans/s over the phase, the last plan's duration and plan_s sampled after each change too.
3. **Raw phase** (``--seconds``, same processes, right after): each process renews its own
   jobs' rows of a table ``raw_leases(job, epoch, expires, target)`` of N rows in the same
   schema, by hand: ``UPDATE ... SET expires = ... WHERE job = ... AND epoch = ... RETURNING
   target`` in its own transaction, committed (PostgreSQL: one psycopg2 connection per
   process, BEGIN / UPDATE / COMMIT; SQLite: BEGIN IMMEDIATE, as the ledger). Lock one row,
   move its expiry, read its target, commit: the floor a lease renewal costs on that database.
   Reported: renewals/s, p50/p99, and ``ratio`` = heartbeats/s / renewals/s.

   ``--rounds`` > 1 alternates the two phases that many times (counts and latencies over all
   rounds; rates averaged over them).
4. **After.** Expiry events in the event log (must be 0), leases that ended expired, live
   leases left (must be N), and heartbeats that found their lease dead.

The JSON (``--out``) has one row per backend x N, the command, Python version, CPUs, the load
average at start and a ``targets`` block (``ratio_min``, ``heartbeats_per_s_min_at_1000``) with
``met`` booleans computed from the PostgreSQL row at 1,000 jobs. Absolute numbers depend on the
machine and on what else runs on it: compare rows of one run (and the ratio), not runs.
"""

from __future__ import annotations

import argparse
import array
import dataclasses
import json
import math
import multiprocessing as mp
import os
import platform
import random
import socket
import sqlite3
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import Counter
from threading import BrokenBarrierError
from typing import Any

import numpy as np
import sqlalchemy as sa

from benchmarks._results import write_json
from elastic_ops.errors import LeaseExpiredError
from elastic_ops.pool import Grant, Observation, PoolClient
from elastic_ops.pool import schema as s

PG_BASE = os.environ.get("ELASTIC_OPS_TEST_POSTGRES", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")
HOST_SLOTS = 16
LEASE_TTL_S = 3600.0  # longer than any setup (10,000 jobs: up to 15 min on 2 loaded cores)
CHANGE_EVERY_S = 0.5
PACED_INTERVAL_S = 2.0  # the paced phase: each job heartbeats every 2 s, as chunk tasks do
TARGETS = {"ratio_min": 0.25, "heartbeats_per_s_min_at_1000": 2000, "change_readable_max_ms_at_1000": 1000}


@dataclasses.dataclass(frozen=True)
class Cell:
    backend: str  # "postgresql" | "sqlite"
    url: str  # the ledger's SQLAlchemy URL
    raw: dict[str, Any]  # how a raw connection is made: psycopg2 kwargs, or {"path": sqlite file}
    jobs: tuple[tuple[str, int], ...]  # (name, max_workers)
    hosts: int
    clients: int
    seconds: float
    rounds: int
    setup_timeout: float


def layout(n: int) -> tuple[int, tuple[tuple[str, int], ...]]:
    """Hosts and jobs for ``n`` jobs: 64 x 16 slots up to 1,000 jobs, ceil(n / 16) hosts above;
    every job min 1, and max 2 for as many jobs (at most one in ten) as the spare slots hold, so
    that every job's maximum fits and no priority change can make the plan shrink anyone."""
    hosts = 64 if n <= 1000 else math.ceil(n / HOST_SLOTS)
    spare = hosts * HOST_SLOTS - n
    twos = min(n // 10, spare)
    step = n // twos if twos else 0
    jobs = tuple((f"job-{i:05d}", 2 if step and i % step == 0 and i // step < twos else 1) for i in range(n))
    return hosts, jobs


# --- child processes --------------------------------------------------------------------------


def _wait(barrier, timeout: float) -> None:
    barrier.wait(timeout=timeout)


def _raw_connect(cell: Cell):
    if cell.backend == "postgresql":
        import psycopg2

        return psycopg2.connect(**cell.raw)
    conn = sqlite3.connect(cell.raw["path"], timeout=30, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


def _raw_phase(cell: Cell, conn, mine: list[str], seconds: float) -> dict[str, Any]:
    """Lock one row, move its expiry, read its target, commit: as fast as possible."""
    lat = array.array("d")
    pg = cell.backend == "postgresql"
    sql = ("UPDATE raw_leases SET expires = %s WHERE job = %s AND epoch = %s RETURNING target" if pg
           else "UPDATE raw_leases SET expires = ? WHERE job = ? AND epoch = ? RETURNING target")
    cur = conn.cursor()
    missing = 0
    i, n = 0, len(mine)
    start = time.perf_counter()
    end = start + seconds
    t1 = start
    while True:
        t0 = time.perf_counter()
        if t0 >= end:
            break
        job = mine[i % n]
        i += 1
        if pg:
            cur.execute(sql, (time.time() + LEASE_TTL_S, job, 1))
            row = cur.fetchone()
            conn.commit()
        else:
            cur.execute("BEGIN IMMEDIATE")
            cur.execute(sql, (time.time() + LEASE_TTL_S, job, 1))
            row = cur.fetchone()
            cur.execute("COMMIT")
        missing += row is None
        t1 = time.perf_counter()
        lat.append(t1 - t0)
    return {"count": len(lat), "elapsed": t1 - start, "lat": lat, "missing": missing}


def _heartbeat_phase(pool: PoolClient, leases: dict[str, list[int]], seconds: float) -> dict[str, Any]:
    """Heartbeat every job of this process in turn, as fast as possible; a job follows the
    target it reads (a grow or shrink changes the workers it reports next)."""
    lat = array.array("d")
    actions: Counter[str] = Counter()
    expired = 0
    items = list(leases.items())
    i = 0
    start = time.perf_counter()
    end = start + seconds
    t1 = start
    while items:
        t0 = time.perf_counter()
        if t0 >= end:
            break
        k = i % len(items)
        job, st = items[k]
        i += 1
        try:
            measured = Observation(iterations=10, seconds=1.0, workers=st[1])
            tgt = pool.heartbeat(job, st[0], workers=st[1], measured=measured)
        except LeaseExpiredError:
            expired += 1
            items.pop(k)  # a real job would request again (a change); here it just stops
            continue
        t1 = time.perf_counter()
        lat.append(t1 - t0)
        actions[tgt.action.value] += 1
        if tgt.workers:
            st[1] = tgt.workers
    return {"count": len(lat), "elapsed": t1 - start, "lat": lat, "lease_expired": expired,
            "actions": dict(actions)}


def _paced_phase(pool: PoolClient, leases: dict[str, list[int]], seconds: float) -> dict[str, Any]:
    """Each job of this process heartbeats once every PACED_INTERVAL_S, spread evenly: the load
    a pool of this size gets in production (the changes' latency is read under it)."""
    lat = array.array("d")
    items = list(leases.items())
    start = time.perf_counter()
    end = start + seconds
    gap = PACED_INTERVAL_S / max(1, len(items))
    next_at, i = start + random.random() * gap, 0
    while items:
        now = time.perf_counter()
        if now >= end or next_at >= end:
            break
        if now < next_at:
            time.sleep(next_at - now)
        job, st = items[i % len(items)]
        i += 1
        t0 = time.perf_counter()
        try:
            tgt = pool.heartbeat(job, st[0], workers=st[1],
                                 measured=Observation(iterations=10, seconds=1.0, workers=st[1]))
        except LeaseExpiredError:
            items.remove((job, st))
            continue
        lat.append(time.perf_counter() - t0)
        if tgt.workers:
            st[1] = tgt.workers
        next_at += gap
    return {"count": len(lat), "elapsed": time.perf_counter() - start, "lat": lat}


def _worker(cell: Cell, idx: int, barrier, out, timeouts: dict[str, float]) -> None:
    try:
        pool = PoolClient(cell.url)
        raw = _raw_connect(cell)
        mine = list(cell.jobs[idx :: cell.clients])
        _wait(barrier, timeouts["start"])  # B0: setup starts
        t0 = time.perf_counter()
        leases: dict[str, list[int]] = {}
        waiting: list[str] = []
        for name, most in mine:
            pool.wait_for_plan = False  # registering jobs in bulk (docs/pool.md), then asking
            pool.submit(name, min_workers=1, max_workers=most)
            pool.wait_for_plan = True
            g = pool.request(name)
            if isinstance(g, Grant):
                leases[name] = [g.epoch, g.workers]
            else:
                waiting.append(name)
        retried = len(waiting)
        deadline = time.perf_counter() + 60
        while waiting and time.perf_counter() < deadline:  # a later plan grants them
            time.sleep(0.2)
            still = []
            for name in waiting:
                g = pool.request(name)
                if isinstance(g, Grant):
                    leases[name] = [g.epoch, g.workers]
                else:
                    still.append(name)
            waiting = still
        out.put(("setup", idx, {"s": time.perf_counter() - t0, "granted": len(leases), "retried": retried,
                                "ungranted": len(waiting)}))
        _wait(barrier, timeouts["setup"])  # B1: setup done
        names = [name for name, _ in mine]
        for r in range(cell.rounds):
            _wait(barrier, timeouts["phase"])  # heartbeat phase starts
            out.put(("hb", idx, r, _heartbeat_phase(pool, leases, cell.seconds)))
            _wait(barrier, timeouts["phase"])
            _wait(barrier, timeouts["phase"])  # raw phase starts
            out.put(("raw", idx, r, _raw_phase(cell, raw, names, cell.seconds)))
            _wait(barrier, timeouts["phase"])
            _wait(barrier, timeouts["phase"])  # paced phase starts
            out.put(("paced", idx, r, _paced_phase(pool, leases, cell.seconds)))
            _wait(barrier, timeouts["phase"])
        raw.close()
        pool.close()
    except BrokenBarrierError:
        pass  # another process failed: the parent reports it
    except BaseException:
        out.put(("error", idx, traceback.format_exc()))
        barrier.abort()
        raise


def _live_leases(pool: PoolClient) -> dict[str, list[int]]:
    """Every live lease as ``job -> [epoch, slots held]`` (read directly from the tables)."""
    le, a = s.leases.c, s.allocations.c
    with pool.engine.connect() as conn:
        live = {r.job: r.epoch for r in conn.execute(sa.select(le.job, le.epoch).where(le.ended.is_(None)))}
        held = dict(conn.execute(sa.select(a.job, sa.func.count()).group_by(a.job)).all())
        conn.rollback()
    return {job: [epoch, int(held.get(job, 1))] for job, epoch in live.items()}


def _changes_during(pool: PoolClient, rng: random.Random, names: list[str], leases: dict[str, list[int]],
                    seconds: float) -> dict[str, Any]:
    """A change every CHANGE_EVERY_S for ``seconds``: (change s, change + one heartbeat s, plan s)."""
    samples, expired = [], 0
    start = time.perf_counter()
    end, next_at = start + seconds, start + CHANGE_EVERY_S / 2
    while True:
        now = time.perf_counter()
        if next_at >= end or now >= end:
            break
        if now < next_at:
            time.sleep(next_at - now)
        job = rng.choice(names)
        epoch, workers = leases[job]
        t0 = time.perf_counter()
        pool.set_priority(job, rng.randint(1, 9))
        t1 = time.perf_counter()
        try:
            tgt = pool.heartbeat(job, epoch, workers=workers)
            if tgt.workers:
                leases[job][1] = tgt.workers
        except LeaseExpiredError:
            expired += 1
        t2 = time.perf_counter()
        samples.append((t1 - t0, t2 - t0, pool.planner_state()["plan_s"]))
        next_at = max(next_at + CHANGE_EVERY_S, time.perf_counter())
    return {"samples": samples, "lease_expired": expired}


def _changer(cell: Cell, barrier, out, timeouts: dict[str, float]) -> None:
    """One change every ~0.5 s during heartbeat phases: set_priority, then one heartbeat."""
    try:
        pool = PoolClient(cell.url)
        rng = random.Random(7)
        _wait(barrier, timeouts["start"])
        _wait(barrier, timeouts["setup"])
        leases = _live_leases(pool)
        names = sorted(leases)
        for r in range(cell.rounds):
            _wait(barrier, timeouts["phase"])  # heartbeats as fast as they can
            out.put(("changes", -1, r, _changes_during(pool, rng, names, leases, cell.seconds)))
            _wait(barrier, timeouts["phase"])
            _wait(barrier, timeouts["phase"])  # raw renewals: no change
            _wait(barrier, timeouts["phase"])
            _wait(barrier, timeouts["phase"])  # heartbeats at the production pace
            out.put(("paced_changes", -1, r, _changes_during(pool, rng, names, leases, cell.seconds)))
            _wait(barrier, timeouts["phase"])
        pool.close()
    except BrokenBarrierError:
        pass
    except BaseException:
        out.put(("error", -1, traceback.format_exc()))
        barrier.abort()
        raise


# --- the parent ------------------------------------------------------------------------------


def _ms(xs, q: float) -> float | None:
    return None if len(xs) == 0 else round(float(np.quantile(xs, q)) * 1000, 3)


def _lat_stats(parts: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    lat = np.concatenate([np.frombuffer(p["lat"], dtype=np.float64) for p in parts] or [np.zeros(0)])
    count = sum(p["count"] for p in parts)
    # each process's rate over its own clock (it starts at the barrier, ends with its last call),
    # summed over the processes, averaged over the rounds
    per_s = sum(p["count"] / p["elapsed"] for p in parts if p["elapsed"] > 0) / rounds
    return {"count": count, "per_s": round(per_s, 1), "p50_ms": _ms(lat, 0.5), "p99_ms": _ms(lat, 0.99),
            "max_ms": _ms(lat, 1.0)}


class _Run:
    """The children of one cell, their barrier and their queue; makes sure every child ends."""

    def __init__(self, cell: Cell) -> None:
        self.cell = cell
        ctx = mp.get_context("fork")
        self.barrier = ctx.Barrier(cell.clients + 2)  # the workers, the changer, this process
        self.out = ctx.Queue()
        self.timeouts = {"start": 120.0, "setup": cell.setup_timeout, "phase": cell.seconds + 180.0}
        self.procs = [ctx.Process(target=_worker, args=(cell, i, self.barrier, self.out, self.timeouts),
                                  daemon=True) for i in range(cell.clients)]
        self.procs.append(ctx.Process(target=_changer, args=(cell, self.barrier, self.out, self.timeouts),
                                      daemon=True))
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watcher, daemon=True)

    def _watcher(self) -> None:  # a child that died (killed, crashed) must not leave us waiting
        while not self._stop.wait(0.5):
            if any(p.exitcode not in (None, 0) for p in self.procs):
                self.barrier.abort()
                return

    def __enter__(self) -> _Run:
        for p in self.procs:
            p.start()
        self._watch.start()
        return self

    def wait(self, which: str) -> None:
        try:
            self.barrier.wait(timeout=self.timeouts[which])
        except BrokenBarrierError:
            raise RuntimeError(f"a benchmark process failed ({which}):\n{self._errors()}") from None

    def _errors(self) -> str:
        errs, codes = [], {i: p.exitcode for i, p in enumerate(self.procs) if p.exitcode not in (None, 0)}
        try:
            while True:
                msg = self.out.get(timeout=1.0)
                if msg[0] == "error":
                    errs.append(f"process {msg[1]}:\n{msg[2]}")
        except Exception:
            pass
        if errs:
            return "\n".join(errs)
        if codes:
            return f"no traceback; exit codes {codes}"
        return "no traceback, no process died: a barrier timed out"

    def collect(self, timeout: float, **expected: int) -> dict[str, list[Any]]:
        """The next messages: ``expected[kind]`` of each kind, in whatever order they come."""
        got: dict[str, list[Any]] = {kind: [] for kind in expected}
        while any(len(got[k]) < n for k, n in expected.items()):
            msg = self.out.get(timeout=timeout)
            if msg[0] == "error":
                raise RuntimeError(f"benchmark process {msg[1]} failed:\n{msg[2]}")
            if msg[0] not in got or len(got[msg[0]]) >= expected[msg[0]]:
                raise RuntimeError(f"unexpected {msg[0]!r} results (expected {expected})")
            got[msg[0]].append(msg)
        return got

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if exc[0] is not None:
            self.barrier.abort()
        for p in self.procs:
            p.join(timeout=30 if exc[0] is None else 5)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.out.close()
        self.out.cancel_join_thread()


def run_cell(cell: Cell) -> dict[str, Any]:
    n = len(cell.jobs)
    admin = PoolClient(cell.url, lease_ttl_s=LEASE_TTL_S)
    try:
        t = time.perf_counter()
        for h in range(cell.hosts):
            admin.add_host(f"host-{h:04d}", HOST_SLOTS)
        hosts_s = time.perf_counter() - t
        with admin.engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE raw_leases (job text PRIMARY KEY, epoch int, "
                                 "expires double precision, target int)"))
            conn.execute(sa.text("INSERT INTO raw_leases VALUES (:job, 1, :expires, 1)"),
                         [{"job": name, "expires": time.time() + LEASE_TTL_S} for name, _ in cell.jobs])
        settings = admin.status()["settings"]
        with _Run(cell) as run:
            st0 = admin.planner_state()  # nothing changes before the start: no race with the children
            run.wait("start")
            t0 = time.perf_counter()
            run.wait("setup")
            setup_s, st1 = time.perf_counter() - t0, admin.planner_state()
            setups = [m[2] for m in run.collect(60, setup=cell.clients)["setup"]]
            hb_parts, raw_parts, changes, plan_windows = [], [], [], []
            paced_parts, paced_changes = [], []
            changer_expired = 0
            for _ in range(cell.rounds):
                a = admin.planner_state()
                run.wait("phase")
                ta = time.perf_counter()
                run.wait("phase")
                b, tb = admin.planner_state(), time.perf_counter()
                plan_windows.append((b["plans"] - a["plans"], tb - ta, b["plan_s"]))
                got = run.collect(120, hb=cell.clients, changes=1)
                hb_parts += [m[3] for m in got["hb"]]
                ch = got["changes"][0][3]
                changes += ch["samples"]
                changer_expired += ch["lease_expired"]
                run.wait("phase")
                run.wait("phase")
                raw_parts += [m[3] for m in run.collect(120, raw=cell.clients)["raw"]]
                run.wait("phase")
                run.wait("phase")
                got = run.collect(120, paced=cell.clients, paced_changes=1)
                paced_parts += [m[3] for m in got["paced"]]
                paced_changes += got["paced_changes"][0][3]["samples"]
        hb, raw = _lat_stats(hb_parts, cell.rounds), _lat_stats(raw_parts, cell.rounds)
        paced = _lat_stats(paced_parts, cell.rounds)
        paced_readable = np.array([c[1] for c in paced_changes])
        paced_plan = np.array([c[2] for c in paced_changes])
        actions: Counter[str] = Counter()
        for p in hb_parts:
            actions.update(p["actions"])
        change_s = np.array([c[0] for c in changes])
        readable_s = np.array([c[1] for c in changes])
        plan_samples = np.array([c[2] for c in changes])
        phase_plans = sum(w[0] for w in plan_windows)
        phase_s = sum(w[1] for w in plan_windows)
        events = admin.events()
        le = s.leases.c
        with admin.engine.connect() as conn:
            ended_expired = conn.execute(sa.select(sa.func.count()).select_from(s.leases)
                                         .where(le.end_reason == "expired")).scalar_one()
            live = conn.execute(sa.select(sa.func.count()).select_from(s.leases)
                                .where(le.ended.is_(None))).scalar_one()
            conn.rollback()
        setup_plans = st1["plans"] - st0["plans"]
        setup_changes = st1["dirty_seq"] - st0["dirty_seq"]
        return {
            "backend": cell.backend,
            "jobs": n,
            "hosts": cell.hosts,
            "slots": cell.hosts * HOST_SLOTS,
            "jobs_max_2": sum(1 for _, most in cell.jobs if most == 2),
            "clients": cell.clients,
            "seconds": cell.seconds,
            "rounds": cell.rounds,
            "setup": {
                "hosts_s": round(hosts_s, 2),
                "jobs_s": round(setup_s, 2),
                "plans": setup_plans,
                "changes": setup_changes,
                "changes_per_plan": round(setup_changes / setup_plans, 2) if setup_plans else None,
                "last_plan_s": round(st1["plan_s"], 4),
                "granted": sum(x["granted"] for x in setups),
                "granted_after_retry": sum(x["retried"] - x["ungranted"] for x in setups),
                "ungranted": sum(x["ungranted"] for x in setups),
            },
            "heartbeat": {**hb, "lease_expired": sum(p["lease_expired"] for p in hb_parts),
                          "actions": dict(actions)},
            "raw": {**raw, "missing_rows": sum(p["missing"] for p in raw_parts)},
            "ratio": round(hb["per_s"] / raw["per_s"], 4) if raw["per_s"] else None,
            "planner": {
                "plans_in_phase": phase_plans,
                "plans_per_s": round(phase_plans / phase_s, 2) if phase_s else None,
                "last_plan_ms": round(plan_windows[-1][2] * 1000, 3) if plan_windows else None,
                "plan_ms_p50": _ms(plan_samples, 0.5),
                "plan_ms_max": _ms(plan_samples, 1.0),
                "settings_at_start": settings,
            },
            "changes": {
                "count": len(changes),
                "change_ms_p50": _ms(change_s, 0.5),
                "change_ms_max": _ms(change_s, 1.0),
                "readable_ms_p50": _ms(readable_s, 0.5),
                "readable_ms_max": _ms(readable_s, 1.0),
                "lease_expired": changer_expired,
            },
            "paced": {
                "interval_s": PACED_INTERVAL_S,
                "heartbeats": paced,
                "changes": len(paced_changes),
                "readable_ms_p50": _ms(paced_readable, 0.5),
                "readable_ms_max": _ms(paced_readable, 1.0),
                "plan_ms_p50": _ms(paced_plan, 0.5),
                "plan_ms_max": _ms(paced_plan, 1.0),
            },
            "after": {
                "expiry_events": sum(1 for e in events if e["kind"] == "expiry"),
                "leases_ended_expired": int(ended_expired),
                "live_leases": int(live),
                "events": len(events),
            },
        }
    finally:
        admin.close()


def _line(row: dict[str, Any]) -> str:
    keys = ("heartbeat", "raw", "setup", "planner", "changes", "after", "paced")
    hb, raw, su, pl, ch, af, pc = (row[k] for k in keys)
    return (
        f"{row['backend']:10s} jobs={row['jobs']:<6d} setup {su['jobs_s']}s/{su['plans']} plans | "
        f"heartbeat {hb['per_s']}/s p50 {hb['p50_ms']}ms p99 {hb['p99_ms']}ms | "
        f"raw {raw['per_s']}/s p50 {raw['p50_ms']}ms | ratio {row['ratio']} | "
        f"plans {pl['plans_per_s']}/s last {pl['last_plan_ms']}ms | "
        f"change->readable p50 {ch['readable_ms_p50']}ms max {ch['readable_ms_max']}ms | "
        f"paced {pc['heartbeats']['per_s']}/s: change->readable p50 {pc['readable_ms_p50']}ms "
        f"max {pc['readable_ms_max']}ms | "
        f"expiries {af['expiry_events']} live {af['live_leases']}/{row['jobs']}"
    )


def _pg_available() -> bool:
    url = sa.engine.make_url(PG_BASE)
    try:
        with socket.create_connection((url.host or "127.0.0.1", url.port or 5432), timeout=1):
            return True
    except OSError:
        return False


def _pg_raw_args(schema: str) -> dict[str, Any]:
    url = sa.engine.make_url(PG_BASE)
    args = url.translate_connect_args(username="user", database="dbname")
    return {**args, "options": f"-csearch_path={schema}", "connect_timeout": 10}


def _targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    at = next((r for r in rows if r["backend"] == "postgresql" and r["jobs"] == 1000), None)
    met = None
    if at is not None:
        met = {
            "ratio": at["ratio"] is not None and at["ratio"] >= TARGETS["ratio_min"],
            "heartbeats_per_s_at_1000": at["heartbeat"]["per_s"] >= TARGETS["heartbeats_per_s_min_at_1000"],
            "no_expiry": at["after"]["expiry_events"] == 0,
            "change_readable_paced": (at["paced"]["readable_ms_max"] or 0)
            <= TARGETS["change_readable_max_ms_at_1000"],
        }
    return {**TARGETS, "row": None if at is None else "postgresql, 1000 jobs", "met": met}


def main() -> None:
    ap = argparse.ArgumentParser(description="Load test of the pool ledger's control plane.")
    ap.add_argument("--jobs", type=int, nargs="*", default=[100, 1000, 10000],
                    help="job counts on PostgreSQL (default 100 1000 10000)")
    ap.add_argument("--sqlite-jobs", type=int, nargs="*", default=[1000],
                    help="job counts on SQLite (default 1000; none: skip SQLite)")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    ap.add_argument("--clients", type=int, default=32, help="heartbeating processes")
    ap.add_argument("--rounds", type=int, default=1, help="heartbeat/raw phase pairs, alternated")
    ap.add_argument("--setup-timeout", type=float, default=900.0,
                    help="give up if setting up the jobs takes longer (seconds)")
    ap.add_argument("--out", default="benchmarks/results/pool_ledger.json")
    args = ap.parse_args()
    if args.clients < 1 or args.rounds < 1 or args.seconds <= 0:
        ap.error("--clients and --rounds must be >= 1, --seconds > 0")
    if any(n < args.clients for n in [*args.jobs, *args.sqlite_jobs]):
        ap.error("every job count must be >= --clients (each process heartbeats its own jobs)")
    load_at_start = os.getloadavg()

    def cell(backend: str, url: str, raw: dict[str, Any], n: int) -> Cell:
        hosts, jobs = layout(n)
        return Cell(backend, url, raw, jobs, hosts, args.clients, args.seconds, args.rounds,
                    args.setup_timeout)

    rows = []
    pg_note = None
    if args.jobs and _pg_available():
        engine = sa.create_engine(PG_BASE)
        try:
            for n in args.jobs:
                schema = f"bench_{uuid.uuid4().hex[:10]}"
                with engine.begin() as conn:
                    conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
                try:
                    sep = "&" if "?" in PG_BASE else "?"
                    url = f"{PG_BASE}{sep}options=-csearch_path%3D{schema}"
                    rows.append(run_cell(cell("postgresql", url, _pg_raw_args(schema), n)))
                    print(_line(rows[-1]), flush=True)
                finally:
                    with engine.begin() as conn:
                        conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        finally:
            engine.dispose()
    elif args.jobs:
        pg_note = f"PostgreSQL not reachable at {sa.engine.make_url(PG_BASE).render_as_string()}: skipped"
        print(pg_note, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sqlite_jobs:
            path = f"{tmp}/pool-{n}.db"
            rows.append(run_cell(cell("sqlite", f"sqlite:///{path}", {"path": path}, n)))
            print(_line(rows[-1]), flush=True)
    result = {
        "benchmark": "pool_ledger",
        "command": "python -m benchmarks.pool_ledger " + " ".join(sys.argv[1:]),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg_at_start": list(load_at_start),
        "load_avg_at_end": list(os.getloadavg()),
        "note": pg_note,
        "targets": _targets(rows),
        "rows": rows,
    }
    write_json(args.out, result)
    print(json.dumps({"targets": result["targets"], "out": args.out}))


if __name__ == "__main__":
    main()
