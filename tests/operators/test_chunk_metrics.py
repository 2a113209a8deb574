"""What a chunk task tells the deployment's metrics backend: its workers at every change, the
iterations it trained, its throughput, its wait for a grant, preemptions and failed hosts, all
tagged with the job, the DAG and the task."""

from __future__ import annotations

import time

import pytest
from airflow.sdk.exceptions import TaskDeferred

from elastic_ops.errors import WorkerLostError
from elastic_ops.hooks.elastic_ops import ElasticOpsHook
from elastic_ops.runtime.allocation import Allocation
from elastic_ops.runtime.outcome import ChunkStatus
from elastic_ops.utils.jobs import job_id
from tests.operators.helpers import airflow_pool, chunk_result, train_with
from tests.operators.test_chunk_operator import make_chunk, ti_context
from tests.recording_metrics import RecordingMetrics

JOB = job_id("d", "train", "run1")
TAGS = {"job": JOB, "dag_id": "d", "task_id": "chunk_1"}


@pytest.fixture
def rec(monkeypatch, tmp_path) -> RecordingMetrics:
    airflow_pool(monkeypatch, tmp_path, slots=2)
    recorder = RecordingMetrics()
    monkeypatch.setattr(ElasticOpsHook, "metrics", staticmethod(lambda: recorder))
    return recorder


def chunk_metrics(rec: RecordingMetrics) -> list[tuple[str, str, float]]:
    return [(k, n, v) for k, n, v, tags in rec.sent if n.startswith("chunk.") and tags.get("job") == JOB]


def train(status: ChunkStatus, iteration: int, segments: list[tuple[int, int]], during=None):
    """A stand-in for the runtime: runs ``segments`` (start, workers) of chunk [20, 40), reports
    each to the lease keeper as the runner does, and ends at ``iteration``."""
    def run(request, lease):
        if during is not None:
            during(ElasticOpsHook().pool())
        for start, workers in segments:
            lease.applied(start, Allocation.split(workers, request.host, range(workers)))
        return chunk_result(status, iteration=iteration, samples_per_sec=512.0,
                            timeline=[(s, w, time.time()) for s, w in segments])
    return lambda monkeypatch: train_with(monkeypatch, run)


def test_a_chunk_reports_its_workers_iterations_throughput_and_wait(rec, monkeypatch):
    train(ChunkStatus.COMPLETED, 40, [(20, 2), (30, 1)])(monkeypatch)
    make_chunk(1).execute(ti_context(1, 3))
    sent = chunk_metrics(rec)
    assert [v for k, n, v in sent if n == "chunk.workers"] == [2, 2, 1, 0]  # grant, 2 segments, end
    assert [v for k, n, v in sent if n == "chunk.iterations"] == [20]
    assert [v for k, n, v in sent if n == "chunk.samples_per_s"] == [512.0]
    waits = [v for k, n, v in sent if k == "timing" and n == "chunk.wait"]
    assert len(waits) == 1 and 0 <= waits[0] < 60
    assert not [n for k, n, v in sent if n in ("chunk.preemptions", "chunk.host_failures")]
    assert all(tags == TAGS for k, n, v, tags in rec.sent if n.startswith("chunk."))


def test_a_preempted_chunk_counts_the_preemption_and_only_what_it_trained(rec, monkeypatch):
    def urgent(pool):
        pool.submit("urgent", min_workers=2, max_workers=2, priority=9, preemptible=False)

    train(ChunkStatus.PREEMPTED, 26, [(20, 2)], urgent)(monkeypatch)
    with pytest.raises(TaskDeferred):  # preempted, then the pool has nothing for it: it waits
        make_chunk(1).execute(ti_context(1, 3))
    sent = chunk_metrics(rec)
    assert [v for k, n, v in sent if n == "chunk.preemptions"] == [1]
    assert [v for k, n, v in sent if n == "chunk.iterations"] == [6]
    assert [v for k, n, v in sent if n == "chunk.workers"][-1] == 0


def test_a_host_that_failed_the_chunk_is_counted_with_its_name(rec, monkeypatch):
    def lost(request, lease):
        raise WorkerLostError("rank 1 killed by SIGKILL", host="h1")

    train_with(monkeypatch, lost)
    with pytest.raises(WorkerLostError):
        make_chunk(1).execute(ti_context(1, 3))
    failures = [(v, tags) for k, n, v, tags in rec.sent if n == "chunk.host_failures"]
    assert failures == [(1, {**TAGS, "host": "h1"})]
    assert [v for k, n, v in chunk_metrics(rec) if n == "chunk.workers"] == [2, 0]
    assert "pool.event.failure" in [n for k, n, v, t in rec.sent]  # the pool's own counter too
