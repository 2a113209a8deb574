"""The seed scenario under ``dag.test()``: two elastic jobs compete for an 8-slot pool.

``dag.test()`` runs one DAG run's tasks one at a time in its process, so each job is its own
process, a ``dag.test()`` of that job's DAG (its own ``AIRFLOW_HOME`` and metadata database),
and the two share what a deployment shares: the SQLite pool ledger (through the
``elastic_ops_pool`` connection) and the machine. The test plays the operator at the pool: it
starts job 2 once job 1 trains on 8 workers and raises job 2's priority through
``PoolClient.set_priority`` once they train on 4 / 4. The pool's event log must show
8/0 → 4/4 → 3/5 → 0/8 (with the transient states between, see docs/howto/demo.md) and no slot held
by two jobs at once.

The jobs train ``PacedDigits`` (``paced.py``): the test's gate files hold each job at its
current allocation until the next step of the scenario, so the order of the steps never
depends on how fast this machine trains.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from devtools.demo import setup_pool
from elastic_ops.timeline import allocation_sequence, is_subsequence, max_concurrent_holders
from tests.pool.timeline import replay
from tests.taskgroup.airflow_home import airflow_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
EXPECTED = [(8, 0), (4, 4), (3, 5), (0, 8)]
ITERATIONS = 60  # enough to rescale a few times while paced; the rest runs once released

DAG_FILE = """
import pendulum
from airflow.sdk import DAG
from elastic_ops.taskgroup import elastic_training

with DAG(dag_id="{dag_id}", schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC")) as dag:
    elastic_training(
        task_id="train", trainable="tests.taskgroup.paced:PacedDigits",
        total_iterations={iterations}, chunk_iterations={iterations}, min_workers=1, max_workers=8,
        priority=3, global_batch=64, consistency="bitwise", virtual_shards=8,
        params={{"hidden": 16, "depth": 1, "gate": "{gate}"}},
        chunk_kwargs={{"heartbeat_interval": 0.5, "poll_interval": 0.5, "retries": 0}},
    )

if __name__ == "__main__":  # dag.test() parses this file again: run only once
    import os, time
    # Start up before the job "arrives" (imports, dag.test()'s in-process execution API), so that
    # the DAG run starts promptly on "go".
    import elastic_ops.runtime.chunk
    from airflow.sdk.execution_time.supervisor import in_process_api_server
    in_process_api_server().transport
    while not os.path.exists("{go}"):
        time.sleep(0.1)
    dr = dag.test()
    open("{out}", "w").write(str(dr.state))
"""


class Job:
    """One job's ``dag.test()`` process and its gate file."""

    def __init__(self, number: int, migrated: Path, tmp: Path, ledger_url: str) -> None:
        self.dag_id = f"seed_job{number}"
        home = tmp / f"home{number}"
        (home / "dags").mkdir(parents=True)
        shutil.copy(migrated, home / "airflow.db")
        self.gate = tmp / f"gate{number}"
        self.out = tmp / f"state{number}"
        self.go = tmp / f"go{number}"
        self.log = tmp / f"job{number}.log"
        self.held = True
        self.set_gate("0")
        self.dag_file = home / "dags" / f"{self.dag_id}.py"
        self.dag_file.write_text(textwrap.dedent(DAG_FILE.format(
            dag_id=self.dag_id, iterations=ITERATIONS, gate=self.gate, out=self.out, go=self.go)))
        self.env = airflow_env(home) | {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "AIRFLOW_CONN_ELASTIC_OPS_POOL_DEFAULT": json.dumps(
                {"conn_type": "elastic_ops_pool", "extra": {"url": ledger_url}}),
        }
        self.home = home
        self.proc: subprocess.Popen | None = None

    def spawn(self) -> None:
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(self.dag_file)], env=self.env, cwd=self.home,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start(self) -> None:
        """Start the DAG run (the job arrives)."""
        self.go.touch()

    def set_gate(self, value: str) -> None:
        tmp = self.gate.with_suffix(".tmp")
        tmp.write_text(value)
        tmp.replace(self.gate)  # atomic: a worker never reads half a value

    def pool_job(self, status: dict) -> dict | None:
        return next((j for j in status["jobs"] if j["name"].startswith(self.dag_id + ".")), None)

    def follow(self, status: dict) -> None:
        """Hold the job at the pool's current target (or let it run to the end once released)."""
        job = self.pool_job(status)
        self.set_gate("release" if not self.held else str(job["target"] if job else 0))

    def tail(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else ""

    def stop(self) -> None:
        """Kill this job's process group (its task and training workers) if it is still there."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


def test_seed_scenario_allocation_sequence_under_dag_test(migrated_db, tmp_path):
    ledger = f"sqlite:///{tmp_path / 'pool.db'}"
    pool = setup_pool(ledger)  # 8 slots, priority policy, graceful preemption, no aging
    jobs = [Job(1, migrated_db, tmp_path, ledger), Job(2, migrated_db, tmp_path, ledger)]

    def held() -> tuple[int, int]:
        return tuple((j.pool_job(status) or {}).get("workers", 0) for j in jobs)

    def wait_for(what: str, check, timeout: float = 180.0) -> None:
        nonlocal status
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = pool.status()
            for job in jobs:
                job.follow(status)
            if check():
                print(f"{time.monotonic() - t0:6.1f} s  {what}: held {held()}")
                return
            for job in jobs:
                if job.proc is not None and job.proc.poll() not in (None, 0):
                    pytest.fail(f"{job.dag_id} exited {job.proc.returncode} before {what}:\n{job.tail()}")
            time.sleep(0.25)
        pytest.fail(f"not reached within {timeout:.0f} s: {what}; held {held()}\n"
                    + "\n".join(f"--- {j.dag_id}\n{j.tail()}" for j in jobs))

    status = pool.status()
    t0 = time.monotonic()
    try:
        for job in jobs:
            job.spawn()
        jobs[0].start()
        wait_for("job 1 on 8 workers", lambda: held() == (8, 0))
        jobs[1].start()
        wait_for("job 1 / job 2 on 4 / 4", lambda: held() == (4, 4))
        pool.set_priority(jobs[1].pool_job(status)["name"], 5)
        wait_for("job 1 / job 2 on 3 / 5", lambda: held() == (3, 5))
        jobs[0].held = False
        wait_for("job 2 on 8 workers", lambda: held()[1] == 8)
        jobs[1].held = False
        wait_for("both runs done", lambda: all(j.proc.poll() is not None for j in jobs))
    finally:
        for job in jobs:
            job.stop()

    for job in jobs:
        assert job.proc.returncode == 0, job.tail()
        assert job.out.read_text() == "success", job.tail()
    names = [j.pool_job(status)["name"] for j in jobs]
    events = pool.events()
    seq = allocation_sequence(events, names)
    assert is_subsequence(EXPECTED, seq), f"allocation sequence {seq}"
    assert seq[0] == (8, 0) and seq[-1] == (0, 0)
    assert max_concurrent_holders(events) == 1
    replay(events)  # fails if a slot is granted while held or freed by a job that did not hold it
    assert all(j["state"] == "finished" and j["workers"] == 0 for j in pool.status()["jobs"])
