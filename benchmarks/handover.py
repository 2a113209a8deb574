"""Slots handed over between a job's chunks vs released: rescales, grants and completion times,
side by side in one run.

A virtual-time run of the real ledger (``PoolClient`` on SQLite with an injected clock, the
``priority`` policy with graceful preemption): jobs of several chunks on one pool. A chunk is a
fixed amount of work (worker-seconds) and runs at its worker count; a worker-count change costs
``rescale_s`` without progress (the workers restart at a boundary); between two chunks of a job
Airflow takes ``gap_s`` (the task ends, the scheduler starts the next one, which asks for its
grant); a waiting job asks every ``poll_s``; a running job heartbeats every ``heartbeat_s`` and
acts on the target at once (its next boundary), then reports the count it runs. The same
scenario runs twice: each chunk *releases* its slots when it ends (what the chunk tasks did
before), or *hands them over* to the next chunk (``release(handover=True)``). Deterministic: the
figures depend on the parameters, not on the machine. Writes ``benchmarks/results/handover.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._results import write_json
from elastic_ops.pool import Grant, PoolClient, TargetAction

RESULTS = Path(__file__).parent / "results" / "handover.json"
DT = 0.25  # the simulation step, in virtual seconds


@dataclasses.dataclass(frozen=True)
class Scenario:
    slots: int = 8
    hosts: int = 2
    priorities: tuple[int, ...] = (3, 3, 5, 2)
    arrival_every_s: float = 45.0
    chunks: int = 5
    chunk_work: float = 8 * 60.0  # worker-seconds: a minute on 8 workers
    max_workers: int = 8
    gap_s: float = 10.0
    rescale_s: float = 5.0
    heartbeat_s: float = 2.0
    poll_s: float = 1.0
    lease_ttl_s: float = 60.0


@dataclasses.dataclass
class Job:
    name: str
    priority: int
    arrives: float
    phase: str = "arriving"  # arriving / waiting / running / gap / done
    next_at: float = 0.0
    epoch: int = 0
    workers: int = 0
    chunk: int = 0
    left: float = 0.0
    stalled_until: float = 0.0
    next_beat: float = 0.0
    rescales: int = 0
    slots: tuple = ()  # where its workers run (the grant's, then each target's placements)
    moved: int = 0  # chunks that started on other slots than the previous chunk ended on
    between_chunks: bool = False  # a chunk has ended and the next has not started yet
    preemptions: int = 0
    finished: float | None = None


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def simulate(sc: Scenario, *, handover: bool, db: Path) -> dict[str, Any]:
    clock = Clock()
    pool = PoolClient(f"sqlite:///{db}", clock=clock, policy="priority", preemption="graceful",
                      lease_ttl_s=sc.lease_ttl_s, aging_s=0.0, min_rescale_interval_s=0.0)
    per_host = sc.slots // sc.hosts
    for h in range(sc.hosts):
        pool.add_host(f"h{h}", per_host)
    jobs = [Job(f"job{i}", p, i * sc.arrival_every_s) for i, p in enumerate(sc.priorities)]
    for job in jobs:
        job.next_at = job.arrives
    busy = 0.0  # worker-seconds trained
    while any(j.phase != "done" for j in jobs):
        if clock.t > 100_000:
            raise RuntimeError(f"the scenario did not finish: {jobs}")
        for job in jobs:
            busy += step(pool, sc, job, clock.t, handover)
        clock.t += DT
    events = pool.events()
    done = [j.finished - j.arrives for j in jobs if j.finished is not None]
    makespan = max(j.finished for j in jobs if j.finished is not None)
    pool.close()
    return {
        "rescales": sum(j.rescales for j in jobs),
        "preemptions": sum(j.preemptions for j in jobs),
        "grants": sum(1 for e in events if e["kind"] == "grant"),
        "chunks_started_elsewhere": sum(j.moved for j in jobs),
        # slots placed under a job (grant or grow): each can land on another GPU or host
        "slot_placements": sum(len(e["slots"]) for e in events if e["kind"] in ("grant", "grow")),
        "mean_job_completion_s": statistics.mean(done),
        "makespan_s": makespan,
        "utilisation": busy / (sc.slots * makespan),
        "per_job_completion_s": {j.name: j.finished - j.arrives for j in jobs if j.finished is not None},
    }


def step(pool: PoolClient, sc: Scenario, job: Job, now: float, handover: bool) -> float:
    """Advance ``job`` by one step at time ``now``; returns the worker-seconds it trained."""
    if job.phase in ("arriving", "gap", "waiting") and now >= job.next_at:
        if job.phase == "arriving":
            pool.submit(job.name, min_workers=1, max_workers=sc.max_workers, priority=job.priority)
        first = job.phase != "waiting"  # a chunk task's first request of its try
        outcome = pool.request(job.name, new_attempt=first)
        if job.phase == "arriving":
            job.left = sc.chunk_work
        if isinstance(outcome, Grant):
            # counted also when the next chunk had to wait for its grant after the gap
            if job.between_chunks and set(outcome.placements) != set(job.slots):
                job.moved += 1
            job.between_chunks = False
            job.slots = outcome.placements
            job.phase, job.epoch, job.workers = "running", outcome.epoch, outcome.workers
            job.next_beat = now + sc.heartbeat_s
        else:
            job.phase, job.next_at = "waiting", now + sc.poll_s
        return 0.0
    if job.phase != "running":
        return 0.0
    if now >= job.next_beat:
        job.next_beat = now + sc.heartbeat_s
        target = pool.heartbeat(job.name, job.epoch, workers=job.workers)
        if target.action == TargetAction.PREEMPT:
            pool.heartbeat(job.name, job.epoch, workers=0)  # checkpointed and stopped
            job.preemptions += 1
            job.phase, job.next_at, job.workers = "waiting", now + sc.poll_s, 0
            return 0.0
        if target.workers != job.workers:
            job.workers, job.slots = target.workers, target.placements
            job.rescales += 1
            job.stalled_until = now + sc.rescale_s
            pool.heartbeat(job.name, job.epoch, workers=job.workers)  # runs the new count now
    if now < job.stalled_until:
        return 0.0
    trained = job.workers * DT
    job.left -= trained
    if job.left > 0:
        return trained
    job.chunk += 1
    last = job.chunk == sc.chunks
    pool.release(job.name, job.epoch, finished=last, handover=handover and not last)
    job.workers = 0
    if last:
        job.phase, job.finished = "done", now + DT
    else:
        job.phase, job.next_at, job.left = "gap", now + sc.gap_s, sc.chunk_work
        job.between_chunks = True
    return trained


def run(sc: Scenario) -> dict[str, Any]:
    out: dict[str, Any] = {
        "command": "python -m benchmarks.handover " + " ".join(sys.argv[1:]),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "scenario": dataclasses.asdict(sc),
    }
    with tempfile.TemporaryDirectory(prefix="handover-bench-") as tmp:
        for mode, flag in (("release", False), ("handover", True)):
            out[mode] = simulate(sc, handover=flag, db=Path(tmp) / f"{mode}.db")
    r, h = out["release"], out["handover"]
    out["handover_over_release"] = {
        key: (h[key] / r[key] if r[key] else None)
        for key in ("rescales", "preemptions", "grants", "chunks_started_elsewhere", "slot_placements",
                    "mean_job_completion_s",
                    "makespan_s", "utilisation")
    }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gap-s", type=float, default=Scenario.gap_s,
                        help="seconds Airflow takes between two chunk tasks of a job")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = run(Scenario(gap_s=args.gap_s))
    write_json(args.out, result)
    print(f"wrote {args.out}")
    for mode in ("release", "handover"):
        m = result[mode]
        print(f"{mode:9s} rescales {m['rescales']:3d}  preemptions {m['preemptions']:2d}  "
              f"grants {m['grants']:3d}  chunks started elsewhere {m['chunks_started_elsewhere']:2d}  "
              f"mean JCT {m['mean_job_completion_s']:7.1f}s  makespan {m['makespan_s']:7.1f}s  "
              f"utilisation {m['utilisation']:.3f}")


if __name__ == "__main__":
    main()
