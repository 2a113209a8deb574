"""Elasticity overhead under real Airflow, side by side with one ``elastic-ops run``.

The same job (digits MLP, fixed 2 workers) runs (a) as one ``elastic-ops run`` and (b) as 10
chunk tasks under a real scheduler (LocalExecutor, SQLite; separate scheduler, dag-processor,
triggerer, api-server), once per mode: ``agent`` (the chunks run on the per-host elastic-ops
agent, the default deployment) and ``in_process`` (no agent: each task runs its chunk itself,
the baseline). Reports the total ratio and, per mode, a per-chunk breakdown of the gap:

* ``scheduling_s``: previous task's end → this task's start (scheduler + executor);
* ``task_start_s``: task start → first training segment start (task process start, imports,
  DAG parse, pool request);
* ``runtime_fixed_s``: chunk time not spent in training loops (worker start, rendezvous,
  restore, commit — the runtime's own fixed cost, measured by the runner);

and the time from a preemption decision (pool event) to the preempting job's first segment.

    .venv/bin/python -m benchmarks.airflow_overhead [--iterations 400] [--modes agent,in_process]
        [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import datetime
from pathlib import Path

import yaml

from benchmarks._results import write_json
from devtools.airflow_env import AirflowDeployment
from devtools.demo import setup_pool

REPO = Path(__file__).resolve().parent.parent
CHUNKS = 10
LOW_FACTOR = 10  # the preempted job's length, in multiples of the benchmark job's
SPEC = {"entrypoint": "elastic_ops.examples.digits:DigitsMLP", "global_batch": 64, "min_workers": 2,
        "max_workers": 2, "consistency": "fast", "data_seed": 0, "params": {"hidden": 128, "depth": 2}}

DAG = """
import pendulum
from airflow.sdk import DAG
from elastic_ops.taskgroup import elastic_training
SPEC = {spec!r}
with DAG(dag_id="bench_overhead", schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC")):
    elastic_training(task_id="train", trainable=SPEC["entrypoint"], total_iterations={total},
                     chunk_iterations={chunk}, priority=1,
                     **{{k: v for k, v in SPEC.items() if k != "entrypoint"}})
for name, prio, total in (("bench_low", 1, {low_total}), ("bench_high", 900, {total})):
    with DAG(dag_id=name, schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC")):
        elastic_training(task_id="train", trainable=SPEC["entrypoint"], total_iterations=total,
                         chunk_iterations=total, priority=prio,
                         **{{k: v for k, v in SPEC.items() if k != "entrypoint"}})
"""


def ts(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def direct_run(work: Path, total: int) -> dict:
    spec = dict(SPEC, name="bench_direct", total_iterations=total, chunk_iterations=total,
                checkpoint=f"file://{work / 'direct'}")
    path = work / "direct.yaml"
    path.write_text(yaml.safe_dump(spec))
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "elastic_ops.cli", "run", "--spec", str(path), "--quiet"],
                         capture_output=True, text=True, check=True, cwd=work)
    wall = time.time() - t0
    return {"wall_s": round(wall, 2), "result": json.loads(out.stdout.strip().splitlines()[-1])}


def chunk_breakdown(af: AirflowDeployment, run: str) -> list[dict]:
    tis = sorted((t for t in af.task_instances("bench_overhead", run) if ".chunk_" in t["task_id"]),
                 key=lambda t: t["task_id"])
    rows, prev_end = [], None
    for ti in tis:
        res = af.xcom("bench_overhead", run, ti["task_id"])
        start, end = ts(ti["start_date"]), ts(ti["end_date"])
        seg = res["workers_timeline"][0][2] if res["workers_timeline"] else start
        iters = res["end"] - res["start"]
        train = iters * SPEC["global_batch"] / res["train_samples_per_sec"] if res.get(
            "train_samples_per_sec") else None
        rows.append({
            "task_id": ti["task_id"], "iterations": iters,
            "scheduling_s": round(start - prev_end, 2) if prev_end else None,
            "task_start_s": round(seg - start, 2), "task_s": round(end - start, 2),
            "runtime_fixed_s": round(end - seg - train, 2) if train else None,
            "train_s": round(train, 2) if train else None,
        })
        prev_end = end
    return rows


def preemption_latency(af: AirflowDeployment, pool) -> dict:
    """Low-priority job on both slots; a high-priority job arrives and preempts it."""
    from elastic_ops.utils.jobs import job_id

    low = af.trigger("bench_low", run_id="low")
    low_job = job_id("bench_low", "train", low)
    deadline = time.monotonic() + 600
    while not any(j["name"] == low_job and j["workers"] == 2 for j in pool.status()["jobs"]):
        af.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError("low job never started")
        time.sleep(0.3)
    high = af.trigger("bench_high", run_id="high")
    high_job = job_id("bench_high", "train", high)
    af.wait_run("bench_high", high, timeout=900)
    af.wait_run("bench_low", low, timeout=900)
    events = pool.events()
    arrived = min(x["ts"] for x in events if x["job"] == high_job)
    decision = next(e["ts"] for e in events if e["job"] == low_job and e["ts"] >= arrived
                    and e["kind"] in ("preempt", "shrink", "target"))
    res = af.xcom("bench_high", high, "train.chunk_01_of_01")
    first = res["workers_timeline"][0][2]
    return {"decision_to_first_segment_s": round(first - decision, 2),
            "high_job_waited_s": round(res["waited_s"], 2)}


MODES = ("agent", "in_process")


def mean_of(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r[key] is not None]
    return round(sum(values) / max(1, len(values)), 2)


def measure(work: Path, dags: Path, mode: str, direct_s: float) -> dict:
    """The chunked job and the preemption scenario under one fresh deployment."""
    with AirflowDeployment(home=work / f"airflow-{mode}", dags_folder=dags, parallelism=4,
                           agent=mode == "agent") as af:
        pool = setup_pool(f"sqlite:///{af.home / 'elastic_ops_pool.db'}", slots=2)
        pool.configure(policy="strict")
        af.wait_dag("bench_overhead", timeout=300)
        run = af.trigger("bench_overhead", run_id="chunked")
        state = af.wait_run("bench_overhead", run, timeout=1800)
        if state != "success":
            raise RuntimeError(f"bench_overhead ended {state} in mode {mode}; see {af.home}/logs")
        rows = chunk_breakdown(af, run)
        print(mode, json.dumps(rows), flush=True)
        tis = [t for t in af.task_instances("bench_overhead", run) if ".chunk_" in t["task_id"]]
        chunked_wall = max(ts(t["end_date"]) for t in tis) - min(ts(t["start_date"]) for t in tis)
        try:
            preempt = preemption_latency(af, pool)
        except StopIteration:  # no preemption happened: say so instead of losing the run
            preempt = {"error": "the low-priority job was never preempted (it finished first)"}
    fixed = mean_of(rows, "scheduling_s") + mean_of(rows, "task_start_s") + mean_of(rows, "runtime_fixed_s")
    return {
        "airflow_10_chunks_s": round(chunked_wall, 2),
        "total_ratio": round(chunked_wall / direct_s, 3),
        "per_chunk_mean": {k: mean_of(rows, k) for k in ("scheduling_s", "task_start_s", "runtime_fixed_s",
                                                         "train_s")},
        "per_chunk_fixed_overhead_s": round(fixed, 2),
        "overhead_for_2min_chunks_pct": round(100 * fixed / 120, 1),
        "chunks": rows,
        "preemption": preempt,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=400)
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated, from {', '.join(MODES)} (default: both, agent first)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "airflow_overhead.json"))
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        ap.error(f"--modes: {bad or modes!r} not allowed; choose from {', '.join(MODES)}")
    total = args.iterations
    work = Path(tempfile.mkdtemp(prefix="bench_airflow_"))
    load_before = [round(x, 2) for x in os.getloadavg()]
    try:
        direct = direct_run(work, total)
        print("direct:", direct["wall_s"], "s", flush=True)
        dags = work / "dags"
        dags.mkdir()
        # the low-priority job must still be training when the high one arrives (seconds later)
        dag_text = DAG.format(spec=SPEC, total=total, chunk=total // CHUNKS, low_total=total * LOW_FACTOR)
        (dags / "bench.py").write_text(textwrap.dedent(dag_text))
        results = {}
        for mode in modes:
            results[mode] = measure(work, dags, mode, direct["wall_s"])
            print(mode, json.dumps({k: v for k, v in results[mode].items() if k != "chunks"}), flush=True)
        report = {
            "command": "python -m benchmarks.airflow_overhead " + " ".join(argv or sys.argv[1:]),
            "machine": f"{os.cpu_count()} shared CPU cores (other jobs running), CPU only",
            "load_average_1_5_15": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]},
            "job": dict(SPEC, total_iterations=total, chunks=CHUNKS),
            "direct_elastic_ops_run_s": direct["wall_s"],
            **results,
        }
        out = Path(args.out)
        write_json(out, report)
        print(json.dumps({k: ({kk: vv for kk, vv in v.items() if kk != "chunks"} if k in MODES else v)
                          for k, v in report.items()}, indent=2))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
