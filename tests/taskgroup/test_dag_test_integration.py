"""Integration with ``dag.test()``: a whole elastic job, and a chunk that defers for a grant.

Each run happens in a subprocess with its own ``AIRFLOW_HOME`` (a copy of one migrated SQLite
metadata database), because Airflow reads its configuration once per process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.taskgroup.airflow_home import airflow_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PRELUDE = """
import json, os, sys
import pendulum
from airflow.sdk import DAG, task
from elastic_ops.pool import PoolClient
from elastic_ops.taskgroup import elastic_training

OUT = sys.argv[1] if len(sys.argv) > 1 else None
POOL = PoolClient("sqlite:///" + os.environ["AIRFLOW_HOME"] + "/elastic_ops_pool.db", policy="priority",
                  aging_s=0.0)
DIGITS = "elastic_ops.examples.digits:DigitsMLP"
START = pendulum.datetime(2024, 1, 1, tz="UTC")
TINY = {"global_batch": 64, "consistency": "bitwise", "virtual_shards": 2,
        "params": {"hidden": 16, "depth": 1}}


def finish(dag, chunk_ids):
    dr = dag.test()
    from airflow.models.asset import AssetEvent
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        def xcom(tid):
            row = session.query(XComModel).filter_by(dag_id=dag.dag_id, run_id=dr.run_id, task_id=tid,
                                                     key="return_value").one()
            return row.value if not isinstance(row.value, str) else json.loads(row.value)
        events = [e.extra for e in session.query(AssetEvent).all()]
        tis = {ti.task_id: (str(ti.state), ti.try_number) for ti in dr.get_task_instances(session=session)}
        out = {"state": str(dr.state), "tis": tis, "events": events,
               "chunks": [xcom(t) for t in chunk_ids], "finalize": xcom("train.finalize"),
               "pool_jobs": POOL.status()["jobs"], "pool_events": POOL.events()}
    json.dump(out, open(OUT, "w"), default=str)
"""


def run_dag_file(migrated_db: Path, tmp_path: Path, body: str) -> dict:
    home = tmp_path / "home"
    (home / "dags").mkdir(parents=True)
    shutil.copy(migrated_db, home / "airflow.db")
    dag_file = home / "dags" / "dag_under_test.py"
    dag_file.write_text(PRELUDE + textwrap.dedent(body))
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(dag_file), str(out)], env=airflow_env(home), cwd=home,
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_a_whole_elastic_job_runs_and_emits_the_model_asset(migrated_db, tmp_path):
    result = run_dag_file(migrated_db, tmp_path, """
        with DAG(dag_id="whole", schedule=None, start_date=START) as dag:
            elastic_training(task_id="train", trainable=DIGITS, total_iterations=6, chunk_iterations=3,
                             min_workers=1, max_workers=2, **TINY)

        if __name__ == "__main__":  # dag.test() parses this file again: set up and run only once
            POOL.add_host("h1", 2)
            finish(dag, ["train.chunk_01_of_02", "train.chunk_02_of_02"])
    """)
    assert result["state"] == "success"
    c1, c2 = result["chunks"]
    assert (c1["start"], c1["end"], c2["start"], c2["end"]) == (0, 3, 3, 6)
    assert c1["status"] == c2["status"] == "completed"
    assert c1["iterations"] == c2["iterations"] == 3
    assert c2["epochs"][0] > c1["epochs"][0]  # every grant has a newer fencing epoch
    assert [w for _, w, _ in c1["workers_timeline"]] == [2]
    fin = result["finalize"]
    assert fin["iteration"] == 6 and fin["param_sha256"] == c2["param_sha256"]
    span_h = (result["pool_events"][-1]["ts"] - result["pool_events"][0]["ts"]) / 3600
    assert 0 < fin["slot_hours"] <= 2 * span_h + 1e-4  # 2 slots at most, for no longer than the run
    assert fin["checkpoint_uri"].startswith(fin["checkpoint_root"])
    assert result["events"] and result["events"][-1]["checkpoint_uri"] == fin["checkpoint_uri"]
    assert "test_accuracy" in result["events"][-1]["metrics"]
    (job,) = result["pool_jobs"]
    assert job["state"] == "finished" and job["workers"] == 0


def test_a_chunk_defers_while_the_pool_is_full_then_runs_when_slots_free(migrated_db, tmp_path):
    result = run_dag_file(migrated_db, tmp_path, """
        with DAG(dag_id="deferring", schedule=None, start_date=START) as dag:
            elastic_training(task_id="train", trainable=DIGITS, total_iterations=2, min_workers=1,
                             max_workers=1, chunk_kwargs={"defer_after": 0}, **TINY)  # defer at once

        if __name__ == "__main__":  # dag.test() parses this file again: set up and run only once
            POOL.add_host("h1", 1)
            POOL.submit("blocker", min_workers=1, max_workers=1, priority=1, preemptible=False)
            blocker = POOL.request("blocker")

            import elastic_ops.triggers.pool as trig
            polls = []
            original = trig.GrantTrigger._request_once

            def spy(self, client):  # the trigger runs inline under dag.test(): free the slot after 1 poll
                outcome = original(self, client)
                polls.append(type(outcome).__name__)
                if len(polls) == 1:
                    POOL.release("blocker", blocker.epoch, finished=True)
                return outcome

            trig.GrantTrigger._request_once = spy
            finish(dag, ["train.chunk_01_of_01"])
            out = json.load(open(OUT))
            out["polls"] = polls
            json.dump(out, open(OUT, "w"), default=str)
    """)
    assert result["state"] == "success"
    assert result["polls"][0] == "Wait" and result["polls"][-1] == "Grant"
    (chunk,) = result["chunks"]
    assert chunk["waited_s"] > 0 and chunk["iterations"] == 2
    kinds = [(e["kind"], e["job"]) for e in result["pool_events"] if e["kind"] in ("release", "grant")]
    job = chunk["job"]
    assert kinds.index(("release", "blocker")) < kinds.index(("grant", job))


def test_a_job_that_meets_stop_when_stops_at_that_chunk_and_emits_that_model(migrated_db, tmp_path):
    result = run_dag_file(migrated_db, tmp_path, """
        with DAG(dag_id="early", schedule=None, start_date=START) as dag:
            elastic_training(task_id="train", trainable=DIGITS, total_iterations=9, chunk_iterations=3,
                             min_workers=1, max_workers=2,
                             stop_when={"metric": "test_accuracy", "at_least": 0.01}, **TINY)

        if __name__ == "__main__":
            POOL.add_host("h1", 2)
            finish(dag, ["train.chunk_01_of_03", "train.chunk_02_of_03", "train.chunk_03_of_03"])
    """)
    assert result["state"] == "success"
    c1, c2, c3 = result["chunks"]
    assert c1["status"] == "completed" and c1["iterations"] == 3 and c1["metrics"]["test_accuracy"] >= 0.01
    assert c2["status"] == c3["status"] == "stopped" and c2["iterations"] == c3["iterations"] == 0
    fin = result["finalize"]
    assert fin["iteration"] == 3 and fin["stopped_early"] and fin["param_sha256"] == c1["param_sha256"]
    assert result["events"][-1]["iteration"] == 3  # the Asset event carries the model it stopped at
    (job,) = result["pool_jobs"]
    assert job["state"] == "finished" and job["workers"] == 0
    assert [e["kind"] for e in result["pool_events"]].count("grant") == 1  # chunks 2 and 3 asked for nothing


def test_a_chunk_killed_on_its_last_try_leaves_no_job_in_the_plan(migrated_db, tmp_path):
    """The chunk dies holding its grant and runs none of its own clean-up (as a SIGKILLed or
    OOM-killed task process does): the run fails, and the ``end_job`` teardown ends the job in the
    pool, so the other job's plan no longer leaves it a share."""
    result = run_dag_file(migrated_db, tmp_path, """
        with DAG(dag_id="killed", schedule=None, start_date=START) as dag:
            elastic_training(task_id="train", trainable=DIGITS, total_iterations=4, chunk_iterations=2,
                             min_workers=1, max_workers=2, chunk_kwargs={"retries": 0}, **TINY)

        if __name__ == "__main__":
            from elastic_ops.executors.in_process import InProcessExecutor
            from elastic_ops.operators.chunk import ElasticChunkOperator

            def killed(self, *args, **kwargs):
                raise SystemExit(-9)

            InProcessExecutor.run = killed  # dies while it holds the grant
            ElasticChunkOperator._quietly = lambda self, *a, **k: None  # and cleans nothing up
            POOL.add_host("h1", 2)
            POOL.submit("other", min_workers=1, max_workers=2)
            dr = dag.test()
            from airflow.utils.session import create_session

            with create_session() as session:
                tis = {ti.task_id: str(ti.state) for ti in dr.get_task_instances(session=session)}
            out = {"state": str(dr.state), "tis": tis, "pool_jobs": POOL.status()["jobs"]}
            json.dump(out, open(OUT, "w"), default=str)
    """)
    assert result["state"] == "failed"
    assert result["tis"]["train.chunk_01_of_02"] == "failed"
    assert result["tis"]["train.finalize"] == "upstream_failed"
    assert result["tis"]["train.end_job"] == "success"
    jobs = {j["name"]: j for j in result["pool_jobs"]}
    (job,) = set(jobs) - {"other"}
    assert jobs[job]["state"] == "finished" and jobs[job]["workers"] == 0
    assert jobs["other"]["target"] == 2
