"""``make demo``: the seed scenario under a real Airflow deployment.

Starts Airflow (SQLite metadata, LocalExecutor; scheduler, dag-processor, triggerer and
api-server as separate processes) under ``.demo/airflow``, an 8-slot SQLite pool ledger with the
``priority`` policy and graceful preemption, and ``file://`` checkpoints. Then:

1. job 1 (``elastic_seed_job1``, digits MLP, priority 3) starts alone → 8 workers;
2. job 2 (``elastic_seed_job2``, priority 3) arrives → 4 / 4;
3. job 2's priority is raised to 5 → 3 / 5;
4. job 1 finishes → job 2 gets all 8.

Prints where the Airflow UI, the pool view and each job's view are while it runs, a summary
table at the end, and writes the allocation timeline PNG. Every Airflow process is stopped on
exit, Ctrl-C or failure; with ``--keep`` (``make demo KEEP=1``) the deployment stays up after the
scenario, to look at the finished timelines, until Ctrl-C.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devtools.airflow_env import AirflowDeployment
from elastic_ops.links.pool import job_view_url
from elastic_ops.timeline import allocation_sequence, is_subsequence, max_concurrent_holders, plot
from elastic_ops.utils.jobs import job_id

REPO = Path(__file__).resolve().parent.parent
SLOTS = 8
GROUP = "train_digits"
EXPECTED = [(8, 0), (4, 4), (3, 5), (0, 8)]
POOL_SETTINGS = {
    "policy": "priority", "preemption": "graceful", "lease_ttl_s": 60.0,
    "min_rescale_interval_s": 0.0, "min_gain": 0.0, "aging_s": 0.0, "job_idle_s": 600.0,
}


def say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def setup_pool(url: str, slots: int = SLOTS, hosts: int = 1) -> Any:
    from elastic_ops.pool import PoolClient

    client = PoolClient(url)
    client.configure(**POOL_SETTINGS)
    per_host = slots // hosts
    for i in range(hosts):
        client.add_host("localhost" if hosts == 1 else f"host{i + 1}", per_host)
    return client


def held(client: Any) -> dict[str, int]:
    return {j["name"]: int(j["workers"]) for j in client.status()["jobs"]}


def reached(client: Any, jobs: list[str], milestones: list[tuple[int, ...]]) -> bool:
    """Whether the pool's event log shows these allocations of ``jobs``, in this order.

    Read from the log, not the live state: with the agent a state between two chunk boundaries
    can last less than one poll, and a job may finish before the next look.
    """
    return is_subsequence(milestones, allocation_sequence(client.events(), jobs))


def wait_for(what: str, check: Callable[[], bool], af: AirflowDeployment, timeout: float) -> None:
    say(f"waiting: {what}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        af.check_alive()
        if check():
            say(f"reached: {what}")
            return
        time.sleep(0.5)
    raise TimeoutError(f"not reached within {timeout:.0f}s: {what}")


def run_scenario(af: AirflowDeployment, client: Any, iterations: tuple[int, int], timeout: float) -> dict:
    """Drive the seed scenario; returns the run ids and job names."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    dags = ("elastic_seed_job1", "elastic_seed_job2")
    runs = (f"demo_{stamp}_1", f"demo_{stamp}_2")
    jobs = tuple(job_id(d, GROUP, r) for d, r in zip(dags, runs, strict=True))
    for dag in dags:
        af.wait_dag(dag, timeout=180)
    af.trigger(dags[0], {"iterations": iterations[0], "priority": 3}, run_id=runs[0])
    say(f"job 1 triggered: {jobs[0]}; its view: {job_view_url(af.url, dags[0], runs[0])}")
    wait_for("job 1 on 8 workers", lambda: held(client).get(jobs[0]) == 8, af, timeout)
    af.trigger(dags[1], {"iterations": iterations[1], "priority": 3}, run_id=runs[1])
    say(f"job 2 triggered: {jobs[1]}; its view: {job_view_url(af.url, dags[1], runs[1])}")
    wait_for("job 1 / job 2 on 4 / 4", lambda: reached(client, jobs, EXPECTED[:2]), af, timeout)
    client.set_priority(jobs[1], 5)
    say("job 2's priority raised 3 -> 5 (weights 3 : 5)")
    wait_for("job 1 / job 2 on 3 / 5", lambda: reached(client, jobs, EXPECTED[:3]), af, timeout)
    state1 = af.wait_run(dags[0], runs[0], timeout=timeout)
    say(f"job 1 run finished: {state1}")
    wait_for("job 2 on 8 workers", lambda: held(client).get(jobs[1]) == 8
             or af.run_state(dags[1], runs[1]) in ("success", "failed"), af, timeout)
    state2 = af.wait_run(dags[1], runs[1], timeout=timeout)
    say(f"job 2 run finished: {state2}")
    return {"dags": dags, "runs": runs, "jobs": jobs, "states": (state1, state2)}


def progress_points(client: Any, job: str, af: AirflowDeployment, dag: str, run: str) -> list:
    """(time, completed iteration) per committed checkpoint of the job, from the chunk results."""
    points = []
    for ti in af.task_instances(dag, run):
        if ".chunk_" in ti["task_id"] and ti["state"] == "success":
            res = af.xcom(dag, run, ti["task_id"])
            points += [(t, int(i)) for i, _, t in res["workers_timeline"]]
            points.append((ti_end(ti), int(res["end"])))
    return sorted(points)


def ti_end(ti: dict) -> float:
    from datetime import datetime

    return datetime.fromisoformat(ti["end_date"].replace("Z", "+00:00")).timestamp()


def summary(af: AirflowDeployment, client: Any, sc: dict, png: Path) -> tuple[str, bool]:
    events = client.events()
    seq = allocation_sequence(events, list(sc["jobs"]))
    rows = []
    progress = {}
    for n, (dag, run, job, state) in enumerate(zip(sc["dags"], sc["runs"], sc["jobs"], sc["states"],
                                                   strict=True), 1):
        fin = af.xcom(dag, run, f"{GROUP}.finalize") if state == "success" else {}
        evs = [e for e in events if e["job"] == job]
        rescales = sum(e["kind"] in ("grow", "shrink") for e in evs)
        workers = sorted({e["workers"] for e in evs if e["kind"] in ("grant", "grow", "shrink")})
        span = [e["ts"] for e in evs if e["kind"] in ("grant", "finish")]
        rows.append([f"job {n}", state, str(fin.get("iteration", "-")), ",".join(map(str, workers)),
                     str(rescales), str(fin.get("preemptions", "-")),
                     f"{(max(span) - min(span)):.0f}s" if len(span) > 1 else "-",
                     f"{fin.get('metrics', {}).get('test_accuracy', float('nan')):.3f}"])
        progress[job] = progress_points(client, job, af, dag, run)
    plot(events, progress, png, labels={j: f"job {i}" for i, j in enumerate(sc["jobs"], 1)}, slots=SLOTS)
    head = ["job", "run", "iterations", "worker counts", "rescales", "preemptions", "wall", "test acc"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
    ok = is_subsequence(EXPECTED, seq) and max_concurrent_holders(events) == 1
    text = "\n".join([
        line(head), line(["-" * w for w in widths]), *map(line, rows), "",
        "allocation sequence (job 1, job 2): " + " -> ".join(f"{a}/{b}" for a, b in seq),
        f"seed sequence 8/0 -> 4/4 -> 3/5 -> 0/8: {'OK' if ok else 'NOT SEEN'}; "
        f"no slot ever held by two jobs: {max_concurrent_holders(events) == 1}",
        f"timeline: {png}",
    ])
    return text, ok and all(s == "success" for s in sc["states"])


def keep_running(af: AirflowDeployment, sc: dict) -> None:
    """Leave the deployment up (the finished timelines stay to look at) until Ctrl-C."""
    say(f"left running: the pool view {af.url}/plugin/elastic-pool; the jobs' views "
        + ", ".join(job_view_url(af.url, d, r) for d, r in zip(sc["dags"], sc["runs"], strict=True))
        + f" (login {af.user} / {af.password}). Ctrl-C stops it.")
    try:
        while True:
            af.check_alive()
            time.sleep(2)
    except KeyboardInterrupt:
        say("Ctrl-C: stopping Airflow")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--home", default=str(REPO / ".demo"), help="demo directory (default .demo/)")
    ap.add_argument("--iterations", type=int, nargs=2, default=(450, 750), metavar=("JOB1", "JOB2"))
    ap.add_argument("--timeout", type=float, default=600, help="seconds allowed for each phase")
    ap.add_argument("--port", type=int, default=0, help="api-server port (default: a free one)")
    ap.add_argument("--keep", action="store_true",
                    help="leave Airflow running after the scenario (Ctrl-C stops it)")
    args = ap.parse_args(argv)
    home = Path(args.home).resolve()
    shutil.rmtree(home / "airflow", ignore_errors=True)
    af = AirflowDeployment(home=home / "airflow", dags_folder=REPO / "dags", plugins_folder=REPO / "plugins",
                           port=args.port, parallelism=4)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    t0 = time.monotonic()
    try:
        say(f"setting up Airflow under {af.home} (SQLite, LocalExecutor)")
        af.setup()
        client = setup_pool(f"sqlite:///{af.home / 'elastic_ops_pool.db'}")
        say("starting api-server, scheduler, dag-processor, triggerer")
        af.start()
        say(f"Airflow UI: {af.url}  (login {af.user} / {af.password}); the pool view: "
            f"{af.url}/plugin/elastic-pool (on its own: {af.url}/elastic-ops/ui), JSON at "
            f"{af.url}/elastic-ops/timeline and /elastic-ops/status")
        sc = run_scenario(af, client, tuple(args.iterations), args.timeout)
        text, ok = summary(af, client, sc, home / "allocation_timeline.png")
        print("\n" + text + "\n", flush=True)
        say(f"done in {time.monotonic() - t0:.0f}s")
        if args.keep:
            keep_running(af, sc)
        return 0 if ok else 1
    except KeyboardInterrupt:
        say("interrupted; stopping Airflow")
        return 130
    except Exception as exc:
        say(f"FAILED: {exc}")
        say(f"logs: {af.home / 'logs'}")
        return 1
    finally:
        af.stop()
        say("all Airflow processes stopped")


if __name__ == "__main__":
    sys.exit(main())
