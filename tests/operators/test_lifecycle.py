"""``ElasticFinalizeOperator``: the model Asset event describes the final checkpoint."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
from airflow.sdk import Asset

from elastic_ops.checkpoint import open_store
from elastic_ops.operators import ElasticChunkOperator
from elastic_ops.operators.lifecycle import ElasticFinalizeOperator
from elastic_ops.operators.results import ChunkTaskResult
from tests.operators.helpers import airflow_pool

FIELDS = {"entrypoint": "elastic_ops.examples.digits:DigitsMLP", "total_iterations": 40,
          "chunk_iterations": 20, "global_batch": 64, "min_workers": 1, "max_workers": "2"}


def already_done(index: int, job: str) -> dict:
    return ChunkTaskResult(
        job=job, chunk_index=index, start=20 * index, end=20 * (index + 1), status="already_done",
        iterations=0, workers_timeline=[], samples_per_sec=0.0, loss=None, metrics={}, checkpoint_uri=None,
        param_sha256=None, epochs=[], hosts=[], preemptions=0, waited_s=0.0, duration_s=0.1,
    ).to_dict()


@pytest.mark.parametrize("marked_success", [False, True])
def test_a_rerun_that_trained_nothing_still_reports_the_final_models_figures(monkeypatch, tmp_path,
                                                                             marked_success):
    """``marked_success``: a user marked chunk 1 success mid-chunk; it pushed no result, and
    finalize failed with an AttributeError although chunk 2 had completed the model (a probe)."""
    pool = airflow_pool(monkeypatch, tmp_path)
    asset = Asset(name="d.train.model", uri="file:///models/d/train")
    op = ElasticFinalizeOperator(task_id="finalize", spec_fields=FIELDS, group_id="train",
                                 chunk_task_ids=["train.c1", "train.c2"], outlets=[asset])
    dag = SimpleNamespace(dag_id="d")
    spec = ElasticChunkOperator(task_id="c", spec_fields=FIELDS, chunk_index=0, group_id="train")._spec(
        {"dag": dag, "run_id": "r1"})
    pool.submit(spec.name, min_workers=1, max_workers=2)
    metrics = {"loss": 0.125, "accuracy": 0.97, "param_sha256": "ab" * 32}
    open_store(spec.checkpoint_uri()).save(40, {"model": {}, "iteration": 40}, epoch=1,
                                           spec_hash=spec.spec_hash(), metrics=metrics)
    events: dict = defaultdict(SimpleNamespace)
    results = {"train.c1": None if marked_success else already_done(0, spec.name),
               "train.c2": already_done(1, spec.name)}
    context = {"dag": dag, "run_id": "r1", "outlet_events": events,
               "ti": SimpleNamespace(xcom_pull=lambda task_ids: results[task_ids])}
    summary = op.execute(context)
    assert summary["loss"] == pytest.approx(0.125) and summary["metrics"] == {"accuracy": 0.97}
    assert summary["param_sha256"] == "ab" * 32 and summary["iteration"] == 40
    assert summary["chunks"] == 2
    assert summary["chunks_without_result"] == (["train.c1"] if marked_success else [])
    assert events[asset].extra == summary


def test_register_refuses_conf_keys_no_param_declares(monkeypatch, tmp_path):
    """Airflow runs a DAG with ``{"max_worker": 8}`` in its conf without a word (the params keep
    their defaults): register fails the run, naming the key, the closest param and the params
    there are, before the job is registered."""
    from elastic_ops.errors import SpecError
    from elastic_ops.operators.lifecycle import ElasticRegisterOperator

    pool = airflow_pool(monkeypatch, tmp_path)
    op = ElasticRegisterOperator(task_id="register", spec_fields=FIELDS, group_id="train")
    dag = SimpleNamespace(dag_id="d", params={"max_workers": 2, "priority": 1})

    def run(dag, conf, run_id):
        return op.execute({"dag": dag, "run_id": run_id, "dag_run": SimpleNamespace(conf=conf)})

    with pytest.raises(SpecError) as err:
        run(dag, {"max_worker": 8}, "r1")
    text = str(err.value)
    assert "invalid conf.max_worker=8: not a param of DAG d" in text
    assert "its params: max_workers, priority" in text and "did you mean 'max_workers'?" in text
    assert not err.value.retryable and pool.status()["jobs"] == []  # nothing registered
    assert run(dag, {"max_workers": 8}, "r2")["job"]
    # a DAG without params: its conf is the author's own
    assert run(SimpleNamespace(dag_id="d", params={}), {"anything": 1}, "r3")["job"]


def test_end_job_ends_a_job_its_chunks_left_in_the_plan(monkeypatch, tmp_path):
    """A chunk SIGKILLed on its last try ran no clean-up: its lease expires, but the job stayed
    in the plan (holding slots back from the others) until ``job_idle_s``. The teardown ends it;
    run again, or on a job finalize ended, it changes nothing."""
    from elastic_ops.operators.lifecycle import ElasticEndJobOperator

    pool = airflow_pool(monkeypatch, tmp_path)
    pool.add_host("h1", 2)
    # the killed chunk's lease was granted just now: quiet after 3 heartbeats of 0.07 s
    op = ElasticEndJobOperator(task_id="end_job", spec_fields=FIELDS, group_id="train",
                               heartbeat_interval=0.07)
    context = {"dag": SimpleNamespace(dag_id="d"), "run_id": "r1"}
    job = op._spec(context).name
    pool.submit(job, min_workers=1, max_workers=2)
    pool.request(job)  # granted, then the task was killed: nothing released
    pool.submit("other", min_workers=1, max_workers=2)
    assert op.execute(context) == {"job": job, "ended": True}
    jobs = {j["name"]: j for j in pool.status()["jobs"]}
    assert jobs[job]["state"] == "finished" and jobs[job]["workers"] == 0
    assert jobs["other"]["target"] == 2  # the plan gives its share to the job still there
    assert op.execute(context) == {"job": job, "ended": False}


def test_end_job_without_a_registered_job_does_nothing(monkeypatch, tmp_path):
    from elastic_ops.operators.lifecycle import ElasticEndJobOperator

    pool = airflow_pool(monkeypatch, tmp_path)
    op = ElasticEndJobOperator(task_id="end_job", spec_fields=FIELDS, group_id="train")
    context = {"dag": SimpleNamespace(dag_id="d"), "run_id": "r1"}
    assert op.execute(context) == {"job": op._spec(context).name, "ended": False}
    broken = ElasticEndJobOperator(task_id="end_job", spec_fields={**FIELDS, "max_workers": "x"},
                                   group_id="train")
    assert broken.execute(context) == {"job": None, "ended": False}
    assert pool.status()["jobs"] == []


def test_end_job_waits_while_a_chunk_still_renews_its_lease(monkeypatch, tmp_path):
    """A run marked failed: Airflow marks the chunk failed and runs the teardown while the
    chunk's process still trains (until its on_kill). Ending the job then gave its slots to
    another job while its workers still used them (a probe: 5 s of two jobs on the same slots).
    The wait follows the chunks' heartbeat interval (a fixed 10 s ended a live job whose chunks
    renewed every 15 s) and ends after one lease TTL at most."""
    import threading
    import time

    from elastic_ops.operators.lifecycle import ElasticEndJobOperator

    pool = airflow_pool(monkeypatch, tmp_path)
    # quiet once 3 heartbeats of 1/3 s are missed: the chunk below beats every 0.1 s
    op = ElasticEndJobOperator(task_id="end_job", spec_fields=FIELDS, group_id="train",
                               heartbeat_interval=1 / 3)
    context = {"dag": SimpleNamespace(dag_id="d"), "run_id": "r1"}
    job = op._spec(context).name
    pool.submit(job, min_workers=1, max_workers=2)
    grant = pool.request(job)
    beats: list[float] = []

    def dying_chunk() -> None:  # heartbeats for another 1.5 s, then its process is gone
        until = time.time() + 1.5
        while time.time() < until:
            pool.heartbeat(job, grant.epoch, workers=2)
            beats.append(time.time())
            time.sleep(0.1)

    chunk = threading.Thread(target=dying_chunk)
    chunk.start()
    try:
        assert op.execute(context) == {"job": job, "ended": True}
    finally:
        chunk.join()
    finished = next(e["ts"] for e in pool.events(job=job) if e["kind"] == "finish")
    assert finished >= beats[-1] + 0.9  # not while the chunk still held its slots



def test_end_job_waits_one_lease_ttl_at_most(monkeypatch, tmp_path):
    """A holder that renews for ever (none should, once Airflow has ended its task) does not
    hold the teardown for ever: a lease TTL, after which a dead holder's lease has expired."""
    import threading
    import time

    from elastic_ops.errors import LeaseExpiredError
    from elastic_ops.operators.lifecycle import ElasticEndJobOperator

    pool = airflow_pool(monkeypatch, tmp_path)
    pool.configure(lease_ttl_s=2)
    op = ElasticEndJobOperator(task_id="end_job", spec_fields=FIELDS, group_id="train", heartbeat_interval=1)
    context = {"dag": SimpleNamespace(dag_id="d"), "run_id": "r1"}
    job = op._spec(context).name
    pool.submit(job, min_workers=1, max_workers=2)
    grant, stop = pool.request(job), threading.Event()

    def renewing() -> None:
        while not stop.is_set():
            try:
                pool.heartbeat(job, grant.epoch, workers=2)
            except LeaseExpiredError:  # ended by end_job
                return
            time.sleep(0.1)

    holder = threading.Thread(target=renewing)
    holder.start()
    started = time.monotonic()
    try:
        assert op.execute(context) == {"job": job, "ended": True}
    finally:
        stop.set()
        holder.join()
    assert 1.5 <= time.monotonic() - started < 10
