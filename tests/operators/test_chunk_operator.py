"""``ElasticChunkOperator``'s first entry: defer while the pool says wait (with everything the
resumed try needs in the trigger), skip finished ranges, re-register an unknown job."""

from __future__ import annotations

import json
import socket
import time
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import TaskDeferred

from elastic_ops.checkpoint import open_store
from elastic_ops.errors import (
    AgentLostError,
    JobEndedError,
    LeaseExpiredError,
    LedgerBusyError,
    PoolError,
    SpecError,
    UserCodeError,
    WorkerLostError,
)
from elastic_ops.operators import ElasticChunkOperator, ElasticRegisterOperator
from elastic_ops.operators.results import ChunkTry
from elastic_ops.pool import PoolClient
from elastic_ops.runtime.outcome import ChunkStatus
from elastic_ops.spec import JobSpec
from elastic_ops.triggers import GrantTrigger
from elastic_ops.triggers.events import GrantEvent, TriggerFailure
from elastic_ops.utils.jobs import job_id
from tests.operators.helpers import airflow_pool, chunk_result, train_with

FIELDS = {"entrypoint": "elastic_ops.examples.digits:DigitsMLP", "total_iterations": 40,
          "chunk_iterations": 20, "global_batch": 64, "min_workers": 1, "max_workers": "{{ x }}",
          "priority": 2}


@pytest.fixture
def pool(monkeypatch, tmp_path) -> PoolClient:
    return airflow_pool(monkeypatch, tmp_path)


def make_chunk(index: int = 1, operator_kwargs: dict | None = None, **fields) -> ElasticChunkOperator:
    """A chunk task whose templated fields are already rendered (max_workers=2)."""
    op = ElasticChunkOperator(task_id=f"chunk_{index}", spec_fields=FIELDS | {"max_workers": "2"} | fields,
                              chunk_index=index, group_id="train", **(operator_kwargs or {}))
    return op


def context(run_id: str = "run1") -> dict:
    return {"dag": SimpleNamespace(dag_id="d"), "run_id": run_id}


def test_register_submits_the_rendered_demand(pool):
    op = ElasticRegisterOperator(task_id="register", spec_fields=FIELDS | {"max_workers": "2"},
                                 group_id="train")
    out = op.execute(context())
    (job,) = pool.status()["jobs"]
    assert job["name"] == out["job"] == job_id("d", "train", "run1")
    assert (job["min_workers"], job["max_workers"], job["priority"]) == (1, 2, 2)
    assert out["checkpoint"].endswith("/elastic_ops_checkpoints/d/train/run1")
    assert job["selector"] == {}


def test_a_jobs_host_selector_reaches_the_pool_and_keeps_it_on_those_hosts(pool):
    pool.add_host("h100-0", 2, {"gpu": "h100"})
    op = ElasticRegisterOperator(task_id="register", group_id="train",
                                 spec_fields=FIELDS | {"max_workers": "4", "host_selector": {"gpu": "h100"}})
    job = op.execute(context())["job"]
    assert {j["name"]: j["selector"] for j in pool.status()["jobs"]} == {job: {"gpu": "h100"}}
    grant = pool.request(job)
    assert {h for h, _ in grant.placements} == {"h100-0"}  # not h1, the unlabelled host


def test_a_full_pool_defers_with_everything_the_resumed_try_needs(pool):
    pool.submit("other", min_workers=2, max_workers=2, priority=5, preemptible=False)
    pool.request("other")
    op = make_chunk(1)
    before = time.time()
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context())
    after = time.time()
    trig = deferred.value.trigger
    assert isinstance(trig, GrantTrigger) and deferred.value.method_name == "execute_granted"
    assert trig.job == job_id("d", "train", "run1") and trig.ledger_url == pool.url
    # the state comes back in the event payload, stored as plain JSON: no ledger URL in it
    assert pool.url not in json.dumps(trig.state)
    state = trig.state
    assert (state["start"], state["end"], state["chunk_index"]) == (20, 40, 1)
    spec = JobSpec.from_dict(state["spec"])  # the whole rendered spec travels with the trigger
    assert spec.max_workers == 2 and spec.name == trig.job
    assert pool.status()["jobs"][0]["name"] == trig.job  # registered on the way (no register task ran)
    assert before <= state["deferred_at"] <= after  # the wait counts from here, not from the trigger's start
    assert trig.not_before == state["deferred_at"] + 5.0  # the scheduler sees this process exit first


def test_a_grant_that_comes_within_defer_after_is_trained_without_deferring(pool, monkeypatch, wait_clock):
    pool.submit("other", min_workers=2, max_workers=2, priority=5, preemptible=False)
    blocker = pool.request("other")
    sleep = wait_clock.sleep

    def other_job_ends_during_the_third_poll_interval(seconds):
        sleep(seconds)
        if len(wait_clock.sleeps) == 3:
            pool.release("other", blocker.epoch, finished=True)

    monkeypatch.setattr("elastic_ops.operators.chunk._sleep", other_job_ends_during_the_third_poll_interval)
    trained = []
    train_with(monkeypatch, lambda request, lease: trained.append(request.epoch) or chunk_result())
    result = make_chunk(1).execute(ti_context(1, 3))  # no TaskDeferred
    assert result["status"] == "completed" and len(trained) == 1
    assert wait_clock.sleeps == [1.0, 1.0, 1.0]  # polled every poll_interval until the grant


@pytest.mark.parametrize(("defer_after", "polls"), [(10.0, 10), (2.5, 2), (0, 0)])
def test_a_longer_wait_defers_after_defer_after_seconds(pool, wait_clock, defer_after, polls):
    pool.submit("other", min_workers=2, max_workers=2, priority=5, preemptible=False)
    pool.request("other")
    with pytest.raises(TaskDeferred):
        make_chunk(1, {"defer_after": defer_after}).execute(context())
    assert wait_clock.sleeps == [1.0] * polls


def test_the_wait_for_a_grant_counts_from_the_deferral(pool, monkeypatch):
    seen = []

    def run_granted(self, ctx, chunk, grant, hook):
        seen.append(chunk)
        return chunk.result(status="completed", checkpoint_uri=None, now=time.time())

    monkeypatch.setattr(ElasticChunkOperator, "_run_granted", run_granted)
    t0 = time.time()
    op = make_chunk(0)
    state = chunk_try(op) | {"waited_s": 1.0, "deferred_at": t0 - 30}
    event = GrantEvent(job="j", epoch=1, placements=(("h", 0),), ttl_s=60, state=state, waited_s=0.01)
    op.execute_granted(context(), event.to_payload())
    # 1 s before + 30 s since the deferral (not the trigger's 0.01 s), measured at the resume
    (chunk,) = seen
    assert 31 <= chunk.waited_s <= 31 + (time.time() - t0) and chunk.deferred_at is None


def test_a_range_already_in_the_latest_checkpoint_succeeds_without_a_grant(pool, tmp_path):
    op = make_chunk(0)
    spec = op._spec(context())
    open_store(spec.checkpoint_uri()).save(20, {"model": {}, "iteration": 20}, epoch=1,
                                            spec_hash=spec.spec_hash())
    result = op.execute(context())
    assert result["status"] == "already_done" and result["iterations"] == 0
    assert not [e for e in pool.events() if e["kind"] == "grant"]


@pytest.mark.parametrize("retryable", [False, True])
def test_a_trigger_failure_fails_the_task_as_retryable_as_the_trigger_said(pool, retryable):
    with pytest.raises(PoolError, match="UnknownHostError") as err:
        failure = TriggerFailure("gone", "UnknownHostError", retryable)
        make_chunk(0).execute_granted(context(), failure.to_payload())
    assert err.value.retryable is retryable


def ti_context(try_number: int, max_tries: int, run_id: str = "run1") -> dict:
    return context(run_id) | {"ti": SimpleNamespace(try_number=try_number, max_tries=max_tries)}


def train_raising(monkeypatch, exc: BaseException) -> None:
    def run(request, lease):
        raise exc
    train_with(monkeypatch, run)


def job_row(pool: PoolClient, name: str) -> dict:
    return {j["name"]: j for j in pool.status()["jobs"]}[name]


def test_a_new_try_takes_over_the_earlier_tries_lease_under_a_new_epoch(pool, monkeypatch):
    job = job_id("d", "train", "run1")
    pool.submit(job, min_workers=1, max_workers=2)
    earlier = pool.request(job)  # an earlier try, killed before it released
    epochs = []
    train_with(monkeypatch, lambda request, lease: epochs.append(request.epoch) or chunk_result())
    make_chunk(1).execute(ti_context(1, 3))
    assert epochs == [earlier.epoch + 1]
    with pytest.raises(LeaseExpiredError):  # the earlier try's epoch is dead
        pool.check_epoch(job, earlier.epoch)


def test_a_chunk_hands_its_slots_to_the_next_chunk_and_the_last_one_ends_the_job(pool, monkeypatch):
    job = job_id("d", "train", "run1")
    grants = []

    def trained(request, lease):
        grants.append((request.epoch, lease.current().on(request.host)))
        return chunk_result(start=request.start, end=request.end, iteration=request.end)

    train_with(monkeypatch, trained)
    make_chunk(0).execute(ti_context(1, 3))
    # between the two tasks: the slots stay the job's, parked, and a newcomer waits its turn
    # through the plan rather than taking them because they were momentarily free
    assert job_row(pool, job)["state"] == "parked" and pool.status()["slots"]["used"] == 2
    out = make_chunk(1).execute(ti_context(1, 3))
    assert out["trained_on"] == [socket.gethostname()]  # no node agents: this task's machine
    (e0, slots0), (e1, slots1) = grants
    assert e1 == e0 + 1 and slots1 == slots0  # the same slots, fenced under a new epoch
    assert job_row(pool, job)["state"] == "finished" and pool.status()["slots"]["used"] == 0


def test_a_final_failure_ends_the_job_so_others_get_its_slots_at_once(pool, monkeypatch):
    train_raising(monkeypatch, UserCodeError("boom in loss()"))
    with pytest.raises(UserCodeError):
        make_chunk(1).execute(ti_context(1, 3))  # not retryable: final at the first try
    job = job_id("d", "train", "run1")
    assert job_row(pool, job)["state"] == "finished"
    pool.submit("next", min_workers=2, max_workers=2)
    assert pool.request("next").workers == 2


def test_a_retryable_failure_keeps_the_demand_until_the_last_try(pool, monkeypatch):
    train_raising(monkeypatch, WorkerLostError("rank 1 killed by SIGKILL", host="h1"))
    job = job_id("d", "train", "run1")
    with pytest.raises(WorkerLostError):
        make_chunk(1).execute(ti_context(1, 3))
    assert job_row(pool, job)["state"] == "waiting"  # the retry comes: the job keeps its place
    with pytest.raises(WorkerLostError):
        make_chunk(1).execute(ti_context(4, 3))  # the last try
    assert job_row(pool, job)["state"] == "finished"


def test_a_failing_clean_up_does_not_replace_the_training_error(pool, monkeypatch):
    train_raising(monkeypatch, UserCodeError("boom in loss()"))
    monkeypatch.setattr(PoolClient, "release", lambda *a, **k: (_ for _ in ()).throw(LedgerBusyError("busy")))
    with pytest.raises(UserCodeError, match="boom in loss"):
        make_chunk(1).execute(ti_context(1, 3))


def test_on_kill_gives_the_slots_back_ends_the_job_and_does_not_blame_the_host(pool, monkeypatch):
    """Ended, not only released: a run marked failed never asks again, and its waiting job kept
    its planned share for job_idle_s (a probe saw another job wait 600 s for those slots)."""
    op = make_chunk(1)

    def killed_mid_chunk(request, lease):
        op.on_kill()  # Airflow's SIGTERM handler runs while the chunk trains
        assert pool.status()["slots"]["used"] == 0  # released at once, not after the TTL
        raise WorkerLostError("rank 0 killed by SIGTERM", host=request.host)  # the workers die with the task

    train_with(monkeypatch, killed_mid_chunk)
    with pytest.raises(WorkerLostError):
        op.execute(ti_context(1, 3))
    assert not [e for e in pool.events() if e["kind"] == "failure"]
    assert {h["name"]: h for h in pool.status()["hosts"]}["h1"]["failures"] == 0
    job = next(e["job"] for e in pool.events() if e["kind"] == "grant")
    assert job_row(pool, job)["state"] == "finished"
    pool.request(job, new_attempt=True)  # a cleared or retried chunk asks again: planned again
    assert job_row(pool, job)["state"] != "finished"


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"poll_interval": 0}, "poll_interval"),  # the trigger would re-plan the ledger in a tight loop
    ({"poll_interval": float("nan")}, "poll_interval"),
    ({"heartbeat_interval": -5}, "heartbeat_interval"),
    ({"heartbeat_interval": "2"}, "heartbeat_interval"),
    ({"chunk_index": -3}, "chunk_index"),  # would train a chunk counted from the end
    ({"defer_after": -1}, "defer_after"),
    ({"defer_after": float("inf")}, "defer_after"),
])
def test_operator_arguments_are_checked_when_the_dag_is_parsed(kwargs, field):
    args = {"task_id": "c", "spec_fields": FIELDS, "chunk_index": 0, "group_id": "train"} | kwargs
    with pytest.raises(SpecError) as err:
        ElasticChunkOperator(**args)
    assert err.value.field == field


def test_an_agent_that_went_away_is_retried_and_not_held_against_the_host(pool, monkeypatch):
    train_raising(monkeypatch, AgentLostError("the elastic-ops agent stopped mid-chunk"))
    with pytest.raises(AgentLostError) as err:
        make_chunk(1).execute(ti_context(1, 3))
    assert err.value.retryable
    assert not [e for e in pool.events() if e["kind"] == "failure"]
    assert job_row(pool, job_id("d", "train", "run1"))["state"] == "waiting"


def test_the_wait_for_a_grant_is_bounded_by_the_tasks_execution_timeout(pool):
    from datetime import timedelta

    pool.submit("other", min_workers=2, max_workers=2, priority=5, preemptible=False)
    pool.request("other")
    op = ElasticChunkOperator(task_id="chunk_1", spec_fields=FIELDS | {"max_workers": "2"}, chunk_index=1,
                              group_id="train", execution_timeout=timedelta(minutes=7))
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context())
    assert deferred.value.timeout == timedelta(minutes=7)


def test_a_retry_avoids_the_hosts_that_failed_since_the_job_was_registered(pool):
    from elastic_ops.operators.chunk import failed_hosts

    pool.add_host("h2", 2)
    pool.submit("j", min_workers=1, max_workers=2)
    pool.report_failure("j", "h1")
    assert failed_hosts(pool, "j") == ["h1"]
    pool.submit("j", min_workers=1, max_workers=2)  # the register task ran again in the same run
    assert failed_hosts(pool, "j") == ["h1"]
    pool.release("j", 0, finished=True)  # the run ended (failed for good) ...
    pool.submit("j", min_workers=1, max_workers=2)  # ... was cleared, and registers again
    assert failed_hosts(pool, "j") == []


def test_a_grant_that_expired_before_the_task_resumed_is_asked_for_again(pool, monkeypatch):
    pool.submit("other", min_workers=2, max_workers=2, priority=5, preemptible=False)
    blocker = pool.request("other")
    with pytest.raises(TaskDeferred) as deferred:
        make_chunk(1).execute(context())
    trig = deferred.value.trigger
    pool.release("other", blocker.epoch, finished=True)
    grant = pool.request(trig.job)  # what the trigger does
    # the task resumes after the grant's TTL: a ledger client an hour ahead expires the lease
    PoolClient(pool.url, clock=lambda: time.time() + 3600).status()
    epochs = []
    train_with(monkeypatch, lambda request, lease: epochs.append(request.epoch) or chunk_result())
    event = GrantEvent(trig.job, grant.epoch, grant.placements, grant.ttl_s, trig.state, 0.1)
    make_chunk(1).execute_granted(context(), event.to_payload())
    assert len(epochs) == 1 and epochs[0] > grant.epoch  # a fresh grant, never the dead one


def test_a_wait_that_failed_for_good_ends_the_job_in_the_pool(pool):
    """The trigger met an error retrying cannot fix: the task fails for good, and the job's
    demand must not keep holding slots back from other jobs."""
    op = make_chunk(1)
    pool.submit("other", min_workers=2, max_workers=2, priority=5, preemptible=False)
    blocker = pool.request("other")
    with pytest.raises(TaskDeferred):
        op.execute(ti_context(1, 3))
    job = job_id("d", "train", "run1")
    assert job_row(pool, job)["state"] == "waiting"
    failure = TriggerFailure("the ledger refused the job", "SpecError", False)
    with pytest.raises(PoolError):
        make_chunk(1).execute_granted(ti_context(1, 3), failure.to_payload())
    assert job_row(pool, job)["state"] == "finished"
    pool.release("other", blocker.epoch, finished=True)
    pool.submit("next", min_workers=2, max_workers=2)
    assert pool.request("next").workers == 2  # the failed job holds nothing back



def _stopped_at_a_boundary(iteration: int = 26):
    """What the runner returns when the lease's target went to 0 (preempted, or the lease lost)."""
    return chunk_result(ChunkStatus.PREEMPTED, timeline=[(20, 2, time.time())], iteration=iteration)


def test_a_chunk_whose_job_ended_while_it_trained_does_not_bring_it_back(pool, monkeypatch):
    """Its run marked failed, Airflow ran the end_job teardown while the chunk's process still
    lived: the chunk saw its lease gone, stopped like a preempted one, asked the pool again and
    was granted slots for a run that had ended (a probe)."""
    job = job_id("d", "train", "run1")

    def ended_meanwhile(request, lease):
        pool.finish(job)  # the teardown
        return _stopped_at_a_boundary()

    train_with(monkeypatch, ended_meanwhile)
    with pytest.raises(JobEndedError):
        make_chunk(1).execute(ti_context(1, 3))
    assert job_row(pool, job)["state"] == "finished"
    assert [e["kind"] for e in pool.events(job=job)].count("grant") == 1


def test_a_killed_chunk_that_stops_at_a_boundary_does_not_ask_again(pool, monkeypatch):
    job = job_id("d", "train", "run1")
    op = make_chunk(1)

    def killed(request, lease):
        op.on_kill()  # Airflow's SIGTERM: the lease goes, the runner stops at its next boundary
        return _stopped_at_a_boundary()

    train_with(monkeypatch, killed)
    with pytest.raises(LeaseExpiredError, match="stopped at iteration 26: its task is being killed") as err:
        op.execute(ti_context(1, 3))
    assert err.value.retryable  # a worker's graceful shutdown kills tries too: they are retried
    assert job_row(pool, job)["state"] == "finished"
    assert [e["kind"] for e in pool.events(job=job)].count("grant") == 1


def test_a_full_preemption_releases_and_waits_again_without_failing(pool, monkeypatch):
    """Preemption is never a failure and never a retry: the try gives its slots back and defers."""
    job = job_id("d", "train", "run1")
    epochs = []

    def preempted(request, lease):
        epochs.append(request.epoch)
        pool.submit("urgent", min_workers=2, max_workers=2, priority=9, preemptible=False)
        return _stopped_at_a_boundary()

    train_with(monkeypatch, preempted)
    with pytest.raises(TaskDeferred) as deferred:
        make_chunk(1).execute(ti_context(1, 3))
    state = deferred.value.trigger.state
    assert state["preemptions"] == 1 and state["trained"] == 6 and state["warm_start"] is None
    with pytest.raises(LeaseExpiredError):  # the preempted try's lease was released
        pool.check_epoch(job, epochs[0])
    assert not [e for e in pool.events() if e["kind"] == "failure"]
    assert pool.request("urgent").workers == 2  # the slots went to the job that preempted it


@pytest.mark.parametrize("slots_come_free", [True, False])
def test_a_chunk_killed_while_it_waits_in_the_task_neither_trains_nor_defers(
    pool, monkeypatch, wait_clock, slots_come_free
):
    """on_kill (mark failed, clear) while the try polls the pool within defer_after: nothing was
    running for it to release. The try trained anyway on a grant that came next (slots the pool
    then held for it until the lease TTL, after the process was killed) or deferred, and the job
    stayed in the plan (a probe)."""
    pool.submit("other", min_workers=2, max_workers=2, priority=5, preemptible=False)
    blocker = pool.request("other")
    op = make_chunk(1)
    sleep = wait_clock.sleep

    def killed_during_the_wait(seconds):
        sleep(seconds)
        if len(wait_clock.sleeps) == 2:
            op.on_kill()  # Airflow's SIGTERM handler, while the task polls the pool
            if slots_come_free:
                pool.release("other", blocker.epoch, finished=True)

    monkeypatch.setattr("elastic_ops.operators.chunk._sleep", killed_during_the_wait)
    trained = []
    train_with(monkeypatch, lambda *a: trained.append(a))
    with pytest.raises(LeaseExpiredError, match="being killed") as err:
        op.execute(ti_context(1, 3))  # neither a result nor TaskDeferred
    assert err.value.retryable and not trained
    job = job_id("d", "train", "run1")
    assert job_row(pool, job)["state"] == "finished"
    assert pool.status()["slots"]["used"] == (0 if slots_come_free else 2)
    if slots_come_free:
        pool.submit("next", min_workers=2, max_workers=2)
        assert pool.request("next").workers == 2  # the killed try holds nothing back


def chunk_try(op: ElasticChunkOperator) -> dict:
    """The state a deferred try of ``op`` (chunk 2: iterations 20..40) carries, as on the wire."""
    return ChunkTry(spec=op._spec(context()).to_dict(), chunk_index=1, start=20, end=40,
                    started_at=time.time()).to_dict()


def granted(job, grant, op) -> GrantEvent:
    """The trigger's event for ``grant`` to chunk 2 (iterations 20..40) of ``op``."""
    return GrantEvent(job, grant.epoch, grant.placements, grant.ttl_s, chunk_try(op), 0.1)


def test_a_chunk_killed_before_its_grant_is_trained_gives_the_grant_back(pool, monkeypatch):
    """on_kill between the trigger's grant and the resumed try's start of training."""
    job = job_id("d", "train", "run1")
    op = make_chunk(1)
    pool.submit(job, min_workers=1, max_workers=2)
    grant = pool.request(job)
    trained = []
    train_with(monkeypatch, lambda *a: trained.append(a))
    op.on_kill()
    event = granted(job, grant, op)
    with pytest.raises(LeaseExpiredError, match="given back untrained"):
        op.execute_granted(ti_context(1, 3), event.to_payload())
    assert not trained and pool.status()["slots"]["used"] == 0
    assert job_row(pool, job)["state"] == "finished"


def test_a_chunk_killed_while_its_grant_is_renewed_gives_it_back_untrained(pool, monkeypatch):
    """on_kill landing during the first heartbeat of the resumed try (a ledger round trip, up to
    the busy timeout) found nothing running and returned; the try then trained (a review)."""
    from elastic_ops.operators.lease import LeaseKeeper

    job = job_id("d", "train", "run1")
    op = make_chunk(1)
    pool.submit(job, min_workers=1, max_workers=2)
    grant = pool.request(job)
    real_beat, calls, trained = LeaseKeeper.beat, [], []

    def beat(self):
        if not calls:
            op.on_kill()  # Airflow's SIGTERM handler, during the ledger round trip
        calls.append(1)
        return real_beat(self)

    monkeypatch.setattr(LeaseKeeper, "beat", beat)
    train_with(monkeypatch, lambda *a: trained.append(a))
    event = granted(job, grant, op)
    with pytest.raises(LeaseExpiredError, match="given back untrained"):
        op.execute_granted(ti_context(1, 3), event.to_payload())
    assert not trained and pool.status()["slots"]["used"] == 0


def test_the_task_log_says_where_each_try_resumes_from_and_why(pool, monkeypatch, capsys):
    """The UI shows the task log: it said "2 workers from iteration 26" on a retry, not the
    checkpoint the try resumed from nor why it ran; that was in the agent's log only."""
    pool.add_host("h2", 2)
    op = make_chunk(1)
    spec = op._spec(ti_context(1, 3))
    store = open_store(spec.checkpoint_uri())

    def dies_on_h1(request, lease):
        store.save(26, {"model": {}, "iteration": 26}, epoch=request.epoch, spec_hash=spec.spec_hash())
        raise WorkerLostError("rank 1 killed by SIGKILL", host="h1")

    train_with(monkeypatch, dies_on_h1)
    capsys.readouterr()
    with pytest.raises(WorkerLostError):
        op.execute(ti_context(1, 3))
    first = "".join(capsys.readouterr())
    assert f"job {spec.name}: chunk 2 [20, 40), try 1: starts from scratch (no checkpoint yet)" in first

    train_with(monkeypatch, lambda request, lease: chunk_result(start=20, end=40, iteration=40))
    make_chunk(1).execute(ti_context(2, 3))
    second = "".join(capsys.readouterr())
    assert (f"job {spec.name}: chunk 2 [20, 40), try 2, a retry after WorkerLostError: rank 1 killed by "
            f"SIGKILL on h1; the grant avoids h1: resumes from the checkpoint at iteration 26 "
            f"({spec.checkpoint_uri()}/it-00000026)") in second


def test_a_retry_the_pool_has_no_failure_for_says_where_to_look(pool, monkeypatch, capsys):
    train_with(monkeypatch, lambda request, lease: chunk_result(start=20, end=40, iteration=40))
    capsys.readouterr()
    make_chunk(1).execute(ti_context(3, 3))
    assert ("chunk 2 [20, 40), try 3, a retry: the previous try failed without blaming a host (its log "
            "says why): starts from scratch" in "".join(capsys.readouterr()))
