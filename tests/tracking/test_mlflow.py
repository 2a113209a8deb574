"""MLflow tracking against a real ``mlflow server`` (SQLite, loopback): one run per elastic job,
resumed by every chunk and retry, no step logged twice, a dead server only a warning, no secret
in a log or in the run."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from airflow.sdk import Asset

from elastic_ops.errors import SpecError, TrackingError, WorkerLostError
from elastic_ops.operators import ElasticChunkOperator, ElasticRegisterOperator
from elastic_ops.operators.lifecycle import ElasticFinalizeOperator
from elastic_ops.runtime.allocation import Allocation
from elastic_ops.runtime.outcome import Progress, loss_steps
from elastic_ops.tracking import MlflowTracking, TrackedJob
from elastic_ops.tracking import mlflow as tracking_mlflow
from elastic_ops.utils.jobs import job_id
from tests.mlflow_server import mlflow_server  # noqa: F401 - the fixture
from tests.operators.helpers import TINY_FIELDS, airflow_pool, chunk_result, train_with
from tests.runtime.agent_helpers import running_agent

JOB = job_id("d", "train", "run1")
log = logging.getLogger("test.mlflow")


def ctx(try_number: int = 1, **more) -> dict:
    return {"dag": SimpleNamespace(dag_id="d"), "run_id": "run1",
            "ti": SimpleNamespace(try_number=try_number, max_tries=3, **more)}


def tasks(fields: dict, tracking: MlflowTracking, chunks: int) -> tuple:
    common = {"spec_fields": fields, "group_id": "train", "tracking": tracking}
    register = ElasticRegisterOperator(task_id="register", **common)
    chunk_ops = [ElasticChunkOperator(task_id=f"chunk_{i + 1:02d}_of_{chunks:02d}", chunk_index=i, **common)
                 for i in range(chunks)]
    asset = Asset(name="d.train.model", uri="file:///models/d/train")
    finalize = ElasticFinalizeOperator(task_id="finalize", chunk_task_ids=[c.task_id for c in chunk_ops],
                                       outlets=[asset], **common)
    return register, chunk_ops, finalize, asset


def the_run(client, experiment: str):
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`elastic_ops.job` = '{JOB}'")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


def task_log(caplog, capsys) -> str:
    """What the task log holds (the operator's logger writes through Airflow's setup)."""
    return caplog.text + "".join(capsys.readouterr())


def steps(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


@pytest.fixture
def server(mlflow_server, monkeypatch, tmp_path):  # noqa: F811 - the fixture
    """The pool (one host, 2 slots), the in-process executor, and the MLflow server as the
    Airflow connection ``mlflow_default`` (host and port, as a user gives them)."""
    airflow_pool(monkeypatch, tmp_path, slots=2)
    monkeypatch.delenv("ELASTIC_OPS_AGENT_SOCKET", raising=False)
    monkeypatch.delenv("ELASTIC_OPS_NODE_REDIS_URL", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    host, port = mlflow_server.uri.removeprefix("http://").split(":")
    monkeypatch.setenv("AIRFLOW_CONN_MLFLOW_DEFAULT",
                       json.dumps({"conn_type": "http", "host": host, "port": int(port)}))
    # what the tracking sets in the task's environment (credentials, request settings) goes after
    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
                "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    return mlflow_server


@pytest.mark.parametrize("path", ["in_process", "agent"])
def test_a_job_retried_mid_run_is_one_run_with_every_step_once_and_its_model(server, tmp_path, caplog,
                                                                            capsys, monkeypatch, path):
    """Register, chunk 1 killed mid-run (a worker SIGKILLed at iteration 17, after the commit at
    15), its retry from that checkpoint, chunk 2, finalize: one MLflow run, the loss at every
    iteration exactly once (the retry re-trained 16 and 17, which the run may have already), the
    failure counted, the final model logged and registered, its URI in the Asset's extra.
    Through the per-host agent, progress is sampled (here: hardly ever): every step's loss comes
    with the chunk's result, the steps chunk 1's first try trained before its checkpoint too."""
    caplog.set_level(logging.INFO)
    with contextlib.ExitStack() as stack:
        if path == "agent":
            agent = stack.enter_context(running_agent(tmp_path / "agent", progress_every_s=3600.0))
            monkeypatch.setenv("ELASTIC_OPS_AGENT_SOCKET", agent.path)
        _retried_mid_run(server, tmp_path, caplog, capsys, path)


def _retried_mid_run(server, tmp_path, caplog, capsys, path: str) -> None:
    experiment, client = server.experiment(), server.client()
    tracking = MlflowTracking(experiment=experiment, registered_model_name=f"tiny-{experiment}")
    fields = TINY_FIELDS | {"total_iterations": 40, "chunk_iterations": 20, "checkpoint_interval": 5,
                            "min_workers": 2, "max_workers": 2,
                            "params": {"kill_at": 17, "kill_rank": 1,
                                       "marker": str(tmp_path / "killed-once")}}
    register, (chunk1, chunk2), finalize, asset = tasks(fields, tracking, chunks=2)

    register.execute(ctx())
    run = the_run(client, experiment)
    assert run.data.params["params.kill_at"] == "17" and run.data.params["total_iterations"] == "40"
    assert run.data.tags["elastic_ops.dag_id"] == "d" and run.info.status == "RUNNING"
    with pytest.raises(WorkerLostError):
        chunk1.execute(ctx(1))
    first = steps(client, run.info.run_id, "loss")
    if path == "in_process":  # every iteration live, past the checkpoint it resumes from
        assert first == list(range(1, first[-1] + 1)) and first[-1] > 15
    else:  # a failed try has no result: what the agent sampled, at most its first iteration
        assert first in ([], [1])

    out1 = chunk1.execute(ctx(2))
    assert "resumes from the checkpoint at iteration 15" in task_log(caplog, capsys)
    out2 = chunk2.execute(ctx(1))
    assert chunk2.execute(ctx(2))["status"] == "already_done"  # a cleared chunk: nothing logged again
    results = {chunk1.task_id: out1, chunk2.task_id: out2}
    events: dict = defaultdict(SimpleNamespace)
    pulled = {"xcom_pull": lambda task_ids: results[task_ids]}
    summary = finalize.execute(ctx(1, **pulled) | {"outlet_events": events})

    run = the_run(client, experiment)  # still the one run
    run_id = run.info.run_id
    assert steps(client, run_id, "loss") == list(range(1, 41))  # every iteration, once
    if path == "in_process":  # live, every iteration (through the agent: sampled)
        assert steps(client, run_id, "workers") == list(range(1, 41))
    assert {m.value for m in client.get_metric_history(run_id, "workers")} == {2.0}
    assert steps(client, run_id, "accuracy") == [20, 40]  # the chunks' evaluations
    assert run.data.tags["elastic_ops.failures"] == "1"
    assert "WorkerLostError" in run.data.tags["elastic_ops.last_failure"]
    assert "chunk_01_of_02 try 1" in run.data.tags["elastic_ops.last_failure"]
    assert run.info.status == "FINISHED"
    assert run.data.metrics["job.slot_hours"] > 0
    spec = json.loads(open(client.download_artifacts(run_id, "elastic_ops/spec.json", str(tmp_path))).read())
    assert spec["name"] == JOB and spec["total_iterations"] == 40

    extra = events[asset].extra
    assert extra == summary and extra["mlflow_run_id"] == run_id
    assert extra["mlflow_registered_model"] == f"tiny-{experiment}" and extra["mlflow_model_version"] == "1"
    import mlflow.pytorch

    model = mlflow.pytorch.load_model(extra["mlflow_model_uri"])
    version = client.get_model_version(f"tiny-{experiment}", "1")
    assert version.run_id == run_id
    from elastic_ops.checkpoint import open_store

    final = open_store(summary["checkpoint_uri"].rsplit("/", 1)[0]).latest()
    weights = open_store(summary["checkpoint_uri"].rsplit("/", 1)[0]).load(final)["model"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    # each step's value is the loss of the trajectory the final model came from
    trained = open_store(summary["checkpoint_uri"].rsplit("/", 1)[0]).load(final)["metrics"]["loss"]
    logged = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert logged == loss_steps(trained, 40, 0, 40)

    # finalize again (a cleared task): the same model, no second version
    again = finalize.execute(ctx(2, **pulled) | {"outlet_events": events})
    assert again["mlflow_model_uri"] == extra["mlflow_model_uri"]
    assert [v.version for v in client.search_model_versions(f"name='tiny-{experiment}'")] == ["1"]


def progress(iteration: int, workers: int, loss: float = 0.5) -> Progress:
    return Progress(iteration=iteration, end=40, loss=loss, workers=workers, samples_per_sec=100.0, eta_s=1.0)


def scripted(segments: list[tuple[int, int]], end: int = 40):
    """A stand-in for the runtime (the operator, the pool and the tracking are real): segments
    ``(start, workers)`` of chunk [20, 40), each boundary reported as the runner does."""
    def run(request, lease):
        bounds = [*(s for s, _ in segments[1:]), end]
        for (start, workers), stop in zip(segments, bounds, strict=True):
            lease.applied(start, Allocation.split(workers, request.host, range(workers)))
            for it in range(start + 1, stop + 1):
                lease.progressed(progress(it, workers))
        return chunk_result(iteration=end, timeline=[(s, w, time.time()) for s, w in segments],
                            metrics={"accuracy": 0.75, "bad name!": 1.0, "nan": float("nan")})
    return run


def test_rescales_are_counted_at_their_iteration_and_workers_follow_them(server, monkeypatch):
    experiment, client = server.experiment(), server.client()
    train_with(monkeypatch, scripted([(20, 2), (30, 1)]))
    fields = TINY_FIELDS | {"total_iterations": 40, "chunk_iterations": 20}
    _, (_, chunk2), _, _ = tasks(fields, MlflowTracking(experiment=experiment), chunks=2)
    chunk2.execute(ctx())
    run = the_run(client, experiment)  # created by the chunk: register's tracking may have been down
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "workers")}
    assert history[25] == 2.0 and history[31] == 1.0
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "rescales")] == [(30, 1.0)]
    assert run.data.tags["elastic_ops.last_rescale"].startswith("iteration 30: 2 -> 1 workers")
    assert run.data.metrics["accuracy"] == 0.75 and run.data.metrics["bad name_"] == 1.0
    assert "nan" not in run.data.metrics
    assert run.data.tags["elastic_ops.epoch"] == "1"


def test_a_tracking_server_that_is_down_is_a_warning_and_the_chunk_trains(server, monkeypatch, caplog,
                                                                           capsys):
    monkeypatch.delenv("AIRFLOW_CONN_MLFLOW_DEFAULT")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens on the discard port
    train_with(monkeypatch, scripted([(20, 2)]))
    fields = TINY_FIELDS | {"total_iterations": 40, "chunk_iterations": 20}
    _, (_, chunk2), _, _ = tasks(fields, MlflowTracking(timeout_s=2), chunks=2)
    out = chunk2.execute(ctx())
    assert out["status"] == "completed"
    said = task_log(caplog, capsys)
    assert "mlflow tracking of job d.train.run1 is off for this task" in said and "training goes on" in said

    _, (_, strict), _, _ = tasks(fields, MlflowTracking(timeout_s=2, strict=True), chunks=2)
    with pytest.raises(TrackingError) as err:
        strict.execute(ctx(2))
    assert err.value.retryable


def test_no_tracking_configured_is_said_once_per_task_and_strict_refuses(monkeypatch, tmp_path, caplog):
    airflow_pool(monkeypatch, tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("AIRFLOW_CONN_MLFLOW_DEFAULT", raising=False)
    job = TrackedJob(spec=_spec(), dag_id="d", run_id="run1", group_id="train", task_id="t")
    with pytest.raises(TrackingError, match="no MLflow tracking server configured"):
        MlflowTracking().open(job, log)


def _spec():
    return ElasticChunkOperator(task_id="c", spec_fields=TINY_FIELDS, chunk_index=0, group_id="train")._spec(
        {"dag": SimpleNamespace(dag_id="d"), "run_id": "run1"})


def test_credentials_never_reach_a_log_or_the_run(server, monkeypatch, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    experiment, client = server.experiment(), server.client()
    host, port = server.uri.removeprefix("http://").split(":")
    monkeypatch.setenv("AIRFLOW_CONN_MLFLOW_DEFAULT", json.dumps(
        {"conn_type": "http", "host": host, "port": int(port), "login": "alice",
         "password": "pw-s3cr3t-123"}))
    train_with(monkeypatch, scripted([(20, 1)]))
    _, (_, chunk2), _, _ = tasks(TINY_FIELDS | {"total_iterations": 40, "chunk_iterations": 20},
                                 MlflowTracking(experiment=experiment), chunks=2)
    chunk2.execute(ctx())
    run = the_run(client, experiment)
    said = task_log(caplog, capsys)
    assert f"at {server.uri}" in said  # the line that names the server
    assert "pw-s3cr3t-123" not in said
    assert "pw-s3cr3t-123" not in json.dumps([run.data.params, run.data.tags])
    assert tracking_mlflow.shown_uri("https://bob:tok3n@mlflow.example.com:5000/x?token=y") == \
        "https://mlflow.example.com:5000/x"

    # credentials in MLFLOW_TRACKING_URI, and a server that is down: MLflow's error quotes the URL
    monkeypatch.delenv("AIRFLOW_CONN_MLFLOW_DEFAULT")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://alice:pw-s3cr3t-123@127.0.0.1:9")
    _, (_, again), _, _ = tasks(TINY_FIELDS | {"total_iterations": 40, "chunk_iterations": 20},
                                MlflowTracking(experiment=experiment, timeout_s=2), chunks=2)
    again.execute(ctx(2))
    said = task_log(caplog, capsys)
    assert "is off for this task" in said and "127.0.0.1:9" in said
    assert "pw-s3cr3t-123" not in said


def test_two_tasks_that_create_the_run_at_once_end_in_the_earlier(server, monkeypatch):
    """The race: both searched and found none; this task creates its run after the other did."""
    experiment, client = server.experiment(), server.client()
    exp_id = client.create_experiment(experiment)
    other = client.create_run(exp_id, tags={"elastic_ops.job": JOB})
    real, searches = tracking_mlflow._job_runs, []

    def racing(*args):  # the first search ran before the other task's run existed
        searches.append(args)
        return [] if len(searches) == 1 else real(*args)

    monkeypatch.setattr(tracking_mlflow, "_job_runs", racing)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    job = TrackedJob(spec=_spec(), dag_id="d", run_id="run1", group_id="train", task_id="t")
    run = MlflowTracking(experiment=experiment, conn_id="mlflow_none").open(job, log)
    assert run.run_id == other.info.run_id
    active = client.search_runs([exp_id], filter_string=f"tags.`elastic_ops.job` = '{JOB}'")
    assert [r.info.run_id for r in active] == [other.info.run_id]


def test_an_older_try_stops_sending_once_a_newer_try_was_granted(server, monkeypatch, caplog):
    experiment = server.experiment()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    job = TrackedJob(spec=_spec(), dag_id="d", run_id="run1", group_id="train", task_id="t")
    tracking = MlflowTracking(experiment=experiment, conn_id="mlflow_none")
    older, newer = tracking.open(job, log), tracking.open(job, log)
    assert older.run_id == newer.run_id
    older.granted(5, 2, ("h1",))
    newer.granted(6, 2, ("h1",))
    newer.progressed(progress(1, 2, loss=0.25))
    newer.close()
    older.progressed(progress(1, 2, loss=0.75))
    older.progressed(progress(2, 2, loss=0.75))
    older.close()
    history = server.client().get_metric_history(older.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 0.25)]
    assert "a newer try (epoch 6)" in caplog.text


@pytest.mark.parametrize(("field", "value"), [("experiment", ""), ("registered_model_name", 3),
                                              ("strict", "yes"), ("timeout_s", 0), ("conn_id", None)])
def test_settings_are_checked_naming_the_field(field, value):
    with pytest.raises(SpecError, match=f"invalid {field}="):
        MlflowTracking(**{field: value})


def test_elastic_training_refuses_what_is_not_a_tracking():
    from elastic_ops.taskgroup import elastic_training

    with pytest.raises(SpecError, match="invalid tracking="):
        elastic_training("train", "tests.runtime.builders:TinyMLP", 20, 10, tracking={"mlflow": True})


def test_a_preemption_is_counted_at_its_iteration_and_the_resumed_grant_goes_on_in_the_same_run(
        server, monkeypatch):
    from elastic_ops.runtime.outcome import ChunkStatus

    experiment, client = server.experiment(), server.client()
    grants = []

    def run(request, lease):  # preempted at 30 on the first grant; the second trains on from there
        grants.append(request.epoch)
        start = 20 if len(grants) == 1 else 30
        end = 30 if len(grants) == 1 else 40
        lease.applied(start, Allocation.split(2, request.host, range(2)))
        for it in range(start + 1, end + 1):
            lease.progressed(progress(it, 2))
        status = ChunkStatus.PREEMPTED if len(grants) == 1 else ChunkStatus.COMPLETED
        return chunk_result(status, iteration=end, timeline=[(start, 2, time.time())])

    train_with(monkeypatch, run)
    fields = TINY_FIELDS | {"total_iterations": 40, "chunk_iterations": 20}
    _, (_, chunk2), _, _ = tasks(fields, MlflowTracking(experiment=experiment), chunks=2)
    assert chunk2.execute(ctx())["preemptions"] == 1 and len(grants) == 2
    run_ = the_run(client, experiment)
    history = client.get_metric_history(run_.info.run_id, "preemptions")
    assert [(m.step, m.value) for m in history] == [(30, 1.0)]
    assert run_.data.tags["elastic_ops.last_preemption"] == "iteration 30"
    assert steps(client, run_.info.run_id, "loss") == list(range(21, 41))
    assert run_.data.tags["elastic_ops.epoch"] == str(grants[-1])


SCRIPT_FIELDS = {"entrypoint": str(Path(__file__).parents[1] / "runtime" / "ddp_script.py"),
                 "total_iterations": 8, "chunk_iterations": 8, "global_batch": 12, "min_workers": 1,
                 "max_workers": 1, "consistency": "fast", "data_seed": 1}


def test_a_script_entrypoints_final_weights_are_logged_as_a_state_dict_not_a_model(server, tmp_path):
    """A DDP script defines its model inside the script: no task but its workers can build
    it, so no MLflow model; its final weights are the run's artifact ``model_state_dict``."""
    experiment, client = server.experiment(), server.client()
    tracking = MlflowTracking(experiment=experiment)
    register, (chunk,), finalize, asset = tasks(SCRIPT_FIELDS, tracking, chunks=1)
    register.execute(ctx())
    out = chunk.execute(ctx())
    events: dict = defaultdict(SimpleNamespace)
    pulled = {"xcom_pull": lambda task_ids: out}
    summary = finalize.execute(ctx(1, **pulled) | {"outlet_events": events})
    run = the_run(client, experiment)
    assert run.info.status == "FINISHED" and "mlflow_model_uri" not in summary
    uri = summary["mlflow_state_dict_uri"]
    assert uri == f"runs:/{run.info.run_id}/model_state_dict" and events[asset].extra == summary
    assert steps(client, run.info.run_id, "loss") == list(range(1, 9))  # a script's loss too
    import mlflow
    import mlflow.pytorch

    from elastic_ops.checkpoint import open_store

    mlflow.set_tracking_uri(server.uri)
    logged = mlflow.pytorch.load_state_dict(uri)
    store = open_store(summary["checkpoint_uri"].rsplit("/", 1)[0])
    final = store.load(store.latest())["model"]
    assert logged.keys() == final.keys() and all(torch.equal(logged[k], final[k]) for k in final)
    again = finalize.execute(ctx(2, **pulled) | {"outlet_events": events})  # a cleared finalize
    assert again["mlflow_state_dict_uri"] == uri
    assert [a.path for a in client.list_artifacts(run.info.run_id, "model_state_dict")] == \
        ["model_state_dict/state_dict.pth"]


def test_registering_a_script_entrypoints_model_is_refused_when_the_dag_is_parsed():
    from elastic_ops.taskgroup import elastic_training

    tracking = MlflowTracking(registered_model_name="wine")
    with pytest.raises(SpecError, match="invalid registered_model_name='wine': must be None for a "
                                        "script entrypoint") as err:
        elastic_training("train", SCRIPT_FIELDS["entrypoint"], 8, 8, tracking=tracking)
    assert "Trainable" in str(err.value.hint)
    with pytest.raises(SpecError, match="registered_model_name"):
        ElasticChunkOperator(task_id="c", spec_fields=SCRIPT_FIELDS, chunk_index=0, group_id="train",
                             tracking=tracking)
