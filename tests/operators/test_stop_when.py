"""``stop_when``: the chunk whose end meets the condition ends the job (its slots go back at
once), later chunk tasks train nothing and ask the pool for nothing, finalize takes that model."""

from __future__ import annotations

from elastic_ops.checkpoint import open_store
from elastic_ops.utils.jobs import job_id
from tests.operators.helpers import airflow_pool, chunk_result, train_with
from tests.operators.test_chunk_operator import context, make_chunk, ti_context

STOP = {"metric": "test_accuracy", "at_least": 0.9}
JOB = job_id("d", "train", "run1")


def trained(accuracy: float):
    def run(request, lease):
        return chunk_result(start=request.start, end=request.end, iteration=request.end, loss=0.3,
                            metrics={"test_accuracy": accuracy})
    return run


def job_state(pool) -> str:
    return {j["name"]: j for j in pool.status()["jobs"]}[JOB]["state"]


def test_the_chunk_that_meets_stop_when_ends_the_job_and_frees_its_slots(monkeypatch, tmp_path):
    pool = airflow_pool(monkeypatch, tmp_path)
    train_with(monkeypatch, trained(0.93))
    out = make_chunk(0, stop_when=STOP).execute(ti_context(1, 3))
    assert out["status"] == "completed"
    assert job_state(pool) == "finished" and pool.status()["slots"]["used"] == 0  # not parked


def test_a_chunk_that_does_not_meet_it_hands_its_slots_to_the_next(monkeypatch, tmp_path):
    pool = airflow_pool(monkeypatch, tmp_path)
    train_with(monkeypatch, trained(0.5))
    make_chunk(0, stop_when=STOP).execute(ti_context(1, 3))
    assert job_state(pool) == "parked" and pool.status()["slots"]["used"] == 2


def test_chunks_after_the_stop_train_nothing_and_ask_for_nothing(monkeypatch, tmp_path):
    pool = airflow_pool(monkeypatch, tmp_path)
    op = make_chunk(1, stop_when=STOP)
    spec = op._spec(context())
    store = open_store(spec.checkpoint_uri())
    store.save(20, {"model": {}, "iteration": 20}, epoch=1, spec_hash=spec.spec_hash(),
               metrics={"loss": 0.3, "test_accuracy": 0.91})  # chunk 0's end met it
    def must_not_train(*args):
        raise AssertionError("a stopped job's chunk trained")

    train_with(monkeypatch, must_not_train)
    out = op.execute(context())
    assert out["status"] == "stopped" and out["iterations"] == 0 and out["checkpoint_uri"].endswith("20")
    assert not [e for e in pool.events() if e["kind"] in ("submit", "grant")]

    # without stop_when, or below the bound, the same chunk trains from that checkpoint
    for fields in ({}, {"stop_when": {"metric": "test_accuracy", "at_least": 0.95}}):
        train_with(monkeypatch, trained(0.5))
        assert make_chunk(1, **fields).execute(ti_context(1, 3))["status"] == "completed"
