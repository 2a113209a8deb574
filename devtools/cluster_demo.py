"""``make cluster-demo``: the seed scenario on the container cluster of ``docker/compose.yaml``.

Builds the images (layer cache: seconds once built), starts the cluster (PostgreSQL, Redis, an S3
endpoint, Airflow's api-server, scheduler, dag-processor, triggerer, a Celery worker, two "GPU
hosts" running ``elastic-ops node`` with CPU slots), then:

1. the seed scenario of ``make demo`` (job 1 alone → 8 workers over both hosts; job 2 arrives →
   4 / 4; job 2's priority raised → 3 / 5; job 1 done → job 2 on 8), checkpoints in ``s3://``;
2. a host dies: a job trains, and once a checkpoint of its chunk is in S3 the container of a host
   it trains on is killed; Airflow retries the chunk on the other host, from that checkpoint, and
   the final model is bitwise the one an uninterrupted run trains.

Prints a summary and the UI's address, and tears everything down (containers, volumes, network)
unless ``--keep`` (``KEEP=1``). ``--short`` (the ``container`` test) skips the seed scenario's
phases: two jobs at once on 2 + 2 slots, a host killed mid-chunk, both models checked.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from devtools import cluster as cl
from devtools.airflow_env import AirflowDeployment
from devtools.demo import GROUP, POOL_SETTINGS, held, run_scenario, summary
from elastic_ops.utils.jobs import job_id

REPO = Path(__file__).resolve().parent.parent
HOSTS = ("gpu-host-1", "gpu-host-2")
DAG_CHUNKS = 3  # dags/elastic_seed_scenario.py: num_chunks, checkpoint_interval, the model
DAG_CHECKPOINT_INTERVAL = 50
SEED_SPEC = {"entrypoint": "elastic_ops.examples.digits:DigitsMLP", "global_batch": 64, "min_workers": 1,
             "max_workers": 8, "consistency": "bitwise", "virtual_shards": 8,
             "checkpoint_interval": DAG_CHECKPOINT_INTERVAL,
             "params": {"lr": 0.002, "hidden": 128, "depth": 2}}
REFERENCE = """
import json, sys
from elastic_ops.runtime import run_chunk
from elastic_ops.spec import JobSpec
spec = JobSpec.from_dict(json.loads(sys.argv[1]))
total, step = spec.total_iterations, spec.chunk_iterations
for start in range(0, total, step):
    result = run_chunk(spec, start, min(start + step, total), target=lambda i: 1)
print("SHA", result.param_sha256)
"""


class ClusterAirflow(AirflowDeployment):
    """The cluster's Airflow, through its REST API (``AirflowDeployment``'s client half): it
    starts nothing; ``check_alive`` checks the Airflow containers instead of processes."""

    cluster: cl.Cluster

    def check_alive(self) -> None:
        for service in ("api-server", "scheduler", "dag-processor", "triggerer", "worker"):
            if self.cluster.state(service) not in ("running", ""):
                raise cl.ClusterError(f"{service} is {self.cluster.state(service)}:\n"
                                      f"{self.cluster.logs(service)[-3000:]}")


def airflow_client(cluster: cl.Cluster, home: Path) -> ClusterAirflow:
    af = ClusterAirflow(home=home, dags_folder=REPO / "dags", port=int(cluster.values["API_PORT"]),
                        user="admin", password=cluster.values["AIRFLOW_ADMIN_PASSWORD"], agent=False)
    af.cluster = cluster
    return af


def pool_url(values: dict[str, str]) -> str:
    return (f"postgresql+psycopg2://elastic:{values['POSTGRES_PASSWORD']}@127.0.0.1:"
            f"{values['POSTGRES_PORT']}/elastic_pool")


def node_env(values: dict[str, str]) -> dict[str, str]:
    redis = f"redis://:{values['REDIS_PASSWORD']}@127.0.0.1:{values['REDIS_PORT']}/0"
    return {"ELASTIC_OPS_NODE_REDIS_URL": redis,
            "ELASTIC_OPS_NODE_SECRET": values["ELASTIC_OPS_NODE_SECRET"]}


def s3_client(values: dict[str, str]) -> Any:
    import boto3

    from elastic_ops.checkpoint.s3 import make_client

    session = boto3.session.Session(aws_access_key_id=values["S3_ACCESS_KEY"],
                                    aws_secret_access_key=values["S3_SECRET_KEY"], region_name="us-east-1")
    return make_client(f"http://127.0.0.1:{values['S3_PORT']}", session=session)


def wait_for(what: str, check, af: ClusterAirflow, timeout: float) -> None:
    cl.say(f"waiting: {what}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        af.check_alive()
        if check():
            cl.say(f"reached: {what}")
            return
        time.sleep(0.3)
    raise cl.ClusterError(f"not reached within {timeout:.0f}s: {what}")


def wait_ready(cluster: cl.Cluster, af: ClusterAirflow, client: Any, timeout: float) -> None:
    """The api-server and scheduler healthy, both node agents announced, both hosts in the pool."""
    from elastic_ops.agent.cluster import node_config_from_env
    from elastic_ops.agent.node_client import NodeClient

    cluster.wait_api(timeout)
    nodes = NodeClient(node_config_from_env(node_env(cluster.values)))
    wait_for("both node agents announced", lambda: all(nodes.alive(h) for h in HOSTS), af, timeout)
    wait_for("both hosts in the pool", lambda: {h["name"] for h in client.status()["hosts"]} >= set(HOSTS),
             af, timeout)


def start_reference(iterations: int) -> subprocess.Popen:
    """The seed DAG's job trained without Airflow, on one worker, uninterrupted."""
    spec = {**SEED_SPEC, "name": "reference", "total_iterations": iterations,
            "chunk_iterations": math.ceil(iterations / DAG_CHUNKS),
            "checkpoint": f"file://{tempfile.mkdtemp(prefix='elastic-ops-reference-')}"}
    return subprocess.Popen([sys.executable, "-c", REFERENCE, json.dumps(spec)], stdout=subprocess.PIPE,
                            text=True)


def host_dies(cluster: cl.Cluster, af: ClusterAirflow, client: Any, dags: list[str], iterations: int,
              timeout: float) -> dict[str, Any]:
    """Trigger ``dags`` (``iterations`` each); once one job's first chunk has a checkpoint in S3
    and is still training, kill the container of a host it trains on. Every run must then
    succeed, the chunk retried once on the other host from that checkpoint, and every model be
    bitwise the uninterrupted reference's."""
    from elastic_ops.checkpoint import open_store

    stamp = time.strftime("%Y%m%dT%H%M%S")
    runs = {dag: f"failover_{stamp}_{n}" for n, dag in enumerate(dags, 1)}
    reference = start_reference(iterations)
    try:
        for dag, run in runs.items():
            af.wait_dag(dag, timeout=timeout)
            af.trigger(dag, {"iterations": iterations, "priority": 3}, run_id=run)
            cl.say(f"triggered {dag} ({iterations} iterations), run {run}")
        s3 = s3_client(cluster.values)
        chunk = math.ceil(iterations / DAG_CHUNKS)
        stores = {dag: open_store(f"s3://{cluster.values['S3_BUCKET']}/checkpoints/{dag}/{GROUP}/{run}",
                                  s3_client=s3, create=False) for dag, run in runs.items()}
        victim: dict[str, Any] = {}

        def a_chunk_mid_way() -> bool:
            for dag, store in stores.items():
                latest = store.latest()
                if latest is not None and 0 < latest.iteration < chunk // 2:
                    victim.update(dag=dag, killed_at=latest.iteration)
                    return True
            return False

        wait_for(f"a checkpoint in S3 in the first half of a first chunk ({chunk} iterations)",
                 a_chunk_mid_way, af, timeout)
        dag, run = victim["dag"], runs[victim["dag"]]
        job = job_id(dag, GROUP, run)
        (holding,) = [j for j in client.status()["jobs"] if j["name"] == job]
        hosts = sorted({h for h, _ in holding["placements"]})
        host = hosts[-1]
        cl.say(f"{dag} trains on {' + '.join(hosts)}, its latest checkpoint at iteration "
               f"{victim['killed_at']} in S3: killing the container of {host}")
        cluster.kill(host)
        states = {d: af.wait_run(d, r, timeout=timeout) for d, r in runs.items()}
        cl.say(f"runs finished: {states}")
        out, _ = reference.communicate(timeout=timeout)
        ref_sha = out.split("SHA ")[-1].strip()
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait()
    tries = {t["task_id"]: t["try_number"] for t in af.task_instances(dag, run)}
    retried = [tid for tid, n in tries.items() if n > 1]
    result = af.xcom(dag, run, retried[0]) if len(retried) == 1 else {}
    shas = {d: af.xcom(d, r, f"{GROUP}.finalize")["param_sha256"] for d, r in runs.items()
            if states[d] == "success"}
    failures = [e for e in client.events(job=job) if e["kind"] == "failure"]
    other = [h for h in HOSTS if h != host]
    checks = {
        "every run succeeded": all(s == "success" for s in states.values()),
        f"one chunk task of {dag} retried, once": len(retried) == 1 and tries[retried[0]] == 2,
        f"the failure reported against {host}": [e["host"] for e in failures] == [host],
        f"the retry trained on {other[0]} only": result.get("trained_on") == other,
        f"resumed from the S3 checkpoint (>= {victim['killed_at']}), not the chunk's start":
            bool(result) and victim["killed_at"] <= result["workers_timeline"][0][0] < chunk,
        "every final model bitwise equal to an uninterrupted run's": set(shas.values()) == {ref_sha}
            and len(shas) == len(runs),
    }
    return {"dag": dag, "run": run, "host": host, "killed_at": victim["killed_at"], "retried": retried,
            "result": result, "ref_sha": ref_sha, "shas": shas, "checks": checks}


def failover_text(fo: dict[str, Any]) -> str:
    lines = [f"host failure: {fo['dag']} run {fo['run']}: container {fo['host']} killed after the "
             f"checkpoint at iteration {fo['killed_at']} (s3://)"]
    if fo["result"]:
        res = fo["result"]
        lines.append(f"  retried {fo['retried'][0]} on {', '.join(res['trained_on'])} from iteration "
                     f"{res['workers_timeline'][0][0]}, {res['workers_timeline'][0][1]} workers")
    lines.append(f"  final model SHA-256 {next(iter(fo['shas'].values()), '-')[:16]}…, uninterrupted run "
                 f"{fo['ref_sha'][:16]}…")
    lines += [f"  {'OK ' if ok else 'NO '} {what}" for what, ok in fo["checks"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", action="store_true", help="leave the cluster running (KEEP=1)")
    ap.add_argument("--short", action="store_true",
                    help="two jobs at once on 2 + 2 slots and a host failure (no seed phases)")
    ap.add_argument("--iterations", type=int, nargs=2, default=(450, 750), metavar=("JOB1", "JOB2"),
                    help="the seed scenario's jobs (default 450 750)")
    ap.add_argument("--failover-iterations", type=int, default=1500,
                    help="the host-failure job's iterations (default 1500: 3 chunks of 500)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds allowed for each phase")
    ap.add_argument("--no-build", action="store_true", help="use the images already built")
    ap.add_argument("--env-file", default=str(cl.ENV_FILE), help="the settings (default docker/cluster.env)")
    ap.add_argument("--project", default="elastic-ops", help="the compose project's name")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    t0 = time.monotonic()
    short_dir = None
    try:
        values = cl.settings(Path(args.env_file))
        values["HOST_SLOTS"] = "2" if args.short else values["HOST_SLOTS"]
        engine = cl.find_engine()
        if engine is None:
            raise cl.ClusterError(f"no container engine: {cl.why_no_engine()}")
        env_file = Path(args.env_file)
        if args.short:  # 2 slots a host whatever the file says
            short_dir = tempfile.mkdtemp(prefix="elastic-ops-cluster-")
            env_file = Path(short_dir) / "cluster.env"
            env_file.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
            env_file.chmod(0o600)
        cl.say(f"engine: {engine.name} ({' '.join(engine.compose)})")
        if not args.no_build:
            cl.say(f"images built in {cl.build_images(engine, 'local'):.0f}s")
        cluster = cl.Cluster(engine, env_file, values, project=args.project)
        with cl.running(cluster, keep=args.keep):
            cl.say("cluster starting (PostgreSQL, Redis, S3, Airflow, 2 GPU hosts)")
            from elastic_ops.pool import PoolClient

            af = airflow_client(cluster, REPO / ".demo" / "cluster")
            client = PoolClient(pool_url(values))
            wait_ready(cluster, af, client, args.timeout)
            client.configure(**POOL_SETTINGS)
            ui = (f"Airflow UI: {cluster.api_url}  (login admin / AIRFLOW_ADMIN_PASSWORD in "
                  f"{args.env_file}); the pool: {cluster.api_url}/elastic-ops/ui")
            cl.say(ui)
            text, ok = "", True
            if not args.short:
                sc = run_scenario(af, client, tuple(args.iterations), args.timeout)
                text, ok = summary(af, client, sc, REPO / ".demo" / "cluster_allocation_timeline.png")
                wait_for("the pool idle", lambda: not any(held(client).values()), af, args.timeout)
                dags = ["elastic_seed_job1"]
            else:
                dags = ["elastic_seed_job1", "elastic_seed_job2"]
            fo = host_dies(cluster, af, client, dags, args.failover_iterations, args.timeout)
            text = "\n\n".join(filter(None, [text, failover_text(fo)]))
            print("\n" + text + "\n\n" + ui + "\n", flush=True)
            ok = ok and all(fo["checks"].values())
        cl.say(f"{'done' if ok else 'FAILED'} in {time.monotonic() - t0:.0f}s")
        return 0 if ok else 1
    except KeyboardInterrupt:
        cl.say("interrupted")
        return 130
    except cl.ClusterError as exc:
        cl.say(f"FAILED: {exc}")
        return 1
    finally:
        if short_dir:
            shutil.rmtree(short_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
