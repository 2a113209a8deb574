"""Retry classification (Airflow 3.3 retry_policy), job naming and run-time spec building."""

from __future__ import annotations

from hashlib import sha256

import pytest
from airflow.sdk import RetryAction
from hypothesis import given
from hypothesis import strategies as st

from elastic_ops.errors import (
    CheckpointCorruptError,
    EntrypointError,
    LeaseExpiredError,
    LedgerBusyError,
    NonFiniteLossError,
    SpecError,
    StorageTransientError,
    UserCodeError,
    WorkerLostError,
)
from elastic_ops.spec import JobSpec
from elastic_ops.utils.jobs import chunk_range, coerce_rendered, job_id, runtime_spec, safe_name
from elastic_ops.utils.retry import ElasticRetryPolicy

FIELDS = {"entrypoint": "elastic_ops.examples.digits:DigitsMLP", "total_iterations": 100,
          "chunk_iterations": 30, "global_batch": 64, "max_workers": 4}


@pytest.mark.parametrize(("exc", "action"), [
    (WorkerLostError("worker 3 got SIGKILL", host="h1"), RetryAction.RETRY),
    (LedgerBusyError("busy"), RetryAction.RETRY),
    (LeaseExpiredError("gone"), RetryAction.RETRY),
    (StorageTransientError("503"), RetryAction.RETRY),
    (SpecError("max_workers", 0, "must be >= 1"), RetryAction.FAIL),
    (EntrypointError("entrypoint", "x:Y", "cannot be imported"), RetryAction.FAIL),
    (UserCodeError("ZeroDivisionError in loss()"), RetryAction.FAIL),
    (NonFiniteLossError("loss is nan at iteration 7"), RetryAction.FAIL),
    (CheckpointCorruptError("checksum mismatch"), RetryAction.FAIL),
    (RuntimeError("something else"), RetryAction.DEFAULT),
])
def test_retry_policy_retries_only_retryable_errors(exc, action):
    decision = ElasticRetryPolicy().evaluate(exc, try_number=1, max_tries=4)
    assert decision.action == action
    if action != RetryAction.DEFAULT:
        assert type(exc).__name__ in decision.reason


def test_retry_policy_serializes():
    policy = ElasticRetryPolicy()
    assert isinstance(ElasticRetryPolicy.deserialize(policy.serialize()), ElasticRetryPolicy)


@given(st.text(min_size=1, max_size=300))
def test_job_names_are_always_valid_spec_names(run_id):
    name = job_id("my_dag", "train", run_id)
    assert JobSpec.from_dict(FIELDS | {"name": name}).name == name


def test_job_names_of_different_long_runs_differ():
    base = "manual__" + "x" * 200
    assert job_id("d", "g", base + "1") != job_id("d", "g", base + "2")
    assert len(safe_name("y" * 500)) == 128


def test_runs_whose_ids_differ_only_in_replaced_characters_are_different_jobs():
    """``col:1`` and ``col+1`` both became ``col_1``: one pool job and one checkpoint prefix for
    two runs, which fenced each other until one failed (a chaos probe)."""
    assert job_id("d", "g", "col:1") != job_id("d", "g", "col+1")
    assert safe_name("col:1") != safe_name("col+1")
    assert safe_name("run_1") == "run_1" and job_id("d", "g", "run_1") == "d.g.run_1"  # unchanged: as is


def test_rendered_strings_become_typed_values():
    out = coerce_rendered({"max_workers": "8", "priority": " 3 ", "preemptible": "False",
                           "checkpoint": "None", "keep_every": "", "entrypoint": "a.b:C"})
    assert out == {"max_workers": 8, "priority": 3, "preemptible": False, "checkpoint": None,
                   "keep_every": None, "entrypoint": "a.b:C"}
    # the form's JSON Schema "integer" admits 200.0, which renders as "200.0" (failed at register);
    # a digit of another script stays text, refused by the spec as by the CLI (a probe)
    out = coerce_rendered({"total_iterations": "200.0", "min_workers": "\u0664", "max_workers": "2.5",
                           "priority": "4."})
    assert out == {"total_iterations": 200, "min_workers": "\u0664", "max_workers": "2.5", "priority": "4."}


def test_each_run_trains_under_its_own_checkpoint_prefix():
    a = runtime_spec(FIELDS, name="j", checkpoint_root="file:///ck/d/g",
                     run_id="manual__2024-01-01T00:00:00+00:00")
    b = runtime_spec(FIELDS | {"checkpoint": "s3://models/digits/"}, name="j", checkpoint_root="file:///x",
                     run_id="scheduled__1")
    assert a.checkpoint == "file:///ck/d/g/manual__2024-01-01T00_00_00_00_00-" + sha256(
        b"manual__2024-01-01T00:00:00+00:00").hexdigest()[:16]
    assert b.checkpoint == "s3://models/digits/scheduled__1"


def test_rendered_bad_values_are_rejected_at_run_time():
    with pytest.raises(SpecError) as err:
        runtime_spec(FIELDS | {"max_workers": "0"}, name="j", checkpoint_root="file:///x", run_id="r")
    assert err.value.field == "max_workers"
    with pytest.raises(SpecError) as err:  # named as the form gave it, before the run's prefix
        runtime_spec(FIELDS | {"checkpoint": "s3://b/x?y"}, name="j", checkpoint_root="file:///x", run_id="r")
    assert err.value.value == "s3://b/x?y"


@given(total=st.integers(1, 5000), num_chunks=st.integers(1, 64))
def test_chunks_cover_every_iteration_exactly_once(total, num_chunks):
    if num_chunks > total:
        with pytest.raises(SpecError):
            runtime_spec(FIELDS | {"total_iterations": total}, name="j", checkpoint_root="file:///x",
                         run_id="r", num_chunks=num_chunks)
        return
    spec = runtime_spec(FIELDS | {"total_iterations": total}, name="j", checkpoint_root="file:///x",
                        run_id="r", num_chunks=num_chunks)
    covered = []
    for i in range(num_chunks):
        start, end = chunk_range(spec, i)
        covered.extend(range(start, end))
    assert covered == list(range(total))
