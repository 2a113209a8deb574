"""``ElasticPoolSensor``: gate work on pool capacity, deferring while it waits."""

from __future__ import annotations

import json

import pytest
from airflow.sdk.exceptions import TaskDeferred

from elastic_ops.errors import LedgerBusyError, PoolError, SpecError, WaitFailedError
from elastic_ops.pool import PoolClient
from elastic_ops.sensors import ElasticPoolSensor
from elastic_ops.triggers import PoolCapacityTrigger
from elastic_ops.triggers.events import CapacityEvent, TriggerFailure


@pytest.fixture
def pool(monkeypatch, tmp_path) -> PoolClient:
    url = f"sqlite:///{tmp_path / 'pool.db'}"
    monkeypatch.setenv("AIRFLOW_CONN_ELASTIC_OPS_POOL_DEFAULT",
                       json.dumps({"conn_type": "elastic_ops_pool", "extra": {"url": url}}))
    client = PoolClient(url)
    client.add_host("h1", 4)
    return client


def occupy(pool: PoolClient, workers: int) -> None:
    pool.submit("busy", min_workers=workers, max_workers=workers, priority=1, preemptible=False)
    pool.request("busy")


def test_succeeds_at_once_when_the_pool_has_room(pool):
    occupy(pool, 2)
    sensor = ElasticPoolSensor(task_id="gate", min_workers=2)
    assert sensor.poke({}) is True
    assert sensor.execute({}) is None


def test_defers_to_the_capacity_trigger_while_the_pool_is_full(pool):
    occupy(pool, 3)
    sensor = ElasticPoolSensor(task_id="gate", min_workers=2, poll_interval=0.5, timeout=60)
    assert sensor.poke({}) is False
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    trigger = deferred.value.trigger
    assert isinstance(trigger, PoolCapacityTrigger)
    assert trigger.min_workers == 2 and trigger.ledger_url == pool.url
    assert deferred.value.method_name == "execute_complete"


def test_resumes_with_the_event_or_fails_on_a_trigger_failure(pool):
    sensor = ElasticPoolSensor(task_id="gate", min_workers=2)
    assert sensor.execute_complete({}, CapacityEvent(3, 2, 1.0).to_payload())["free"] == 3
    with pytest.raises(PoolError, match="UnknownHostError"):
        sensor.execute_complete({}, TriggerFailure("x", "UnknownHostError", False).to_payload())


def test_a_host_selector_counts_only_the_hosts_with_those_labels(pool):
    pool.add_host("h100-0", 2, {"gpu": "h100"})  # h1 (4 free, no labels) does not count
    sensor = ElasticPoolSensor(task_id="gate", min_workers=3, host_selector={"gpu": "h100"})
    assert sensor.poke({}) is False
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    assert deferred.value.trigger.host_selector == {"gpu": "h100"}
    assert ElasticPoolSensor(task_id="g2", min_workers=2, host_selector={"gpu": "h100"}).poke({}) is True
    with pytest.raises(SpecError, match="host_selector"):
        ElasticPoolSensor(task_id="bad", host_selector={"gpu": 1})


def test_non_deferrable_mode_pokes_in_the_worker(pool):
    sensor = ElasticPoolSensor(task_id="gate", min_workers=4, deferrable=False)
    assert sensor.poke({}) is True


@pytest.mark.parametrize("bad", [0, -1, "two", 1.5, True])
def test_bad_minimum_is_rejected_when_the_dag_is_parsed(bad):
    with pytest.raises(SpecError) as err:
        ElasticPoolSensor(task_id="gate", min_workers=bad)
    assert err.value.field == "min_workers"


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "2"])
def test_a_bad_poll_interval_is_refused_when_the_dag_is_parsed(bad):
    with pytest.raises(SpecError, match="invalid poll_interval=.*finite number of seconds > 0"):
        ElasticPoolSensor(task_id="gate", min_workers=1, poll_interval=bad)


@pytest.mark.parametrize(("exc", "action"), [
    (SpecError("min_workers", "0", "must be an integer >= 1"), "fail"),  # a rendered template
    (WaitFailedError("watching the pool failed: SpecError: no ledger", retryable=False), "fail"),
    (LedgerBusyError("busy"), "retry"),
])
def test_errors_retrying_cannot_fix_fail_at_once_whatever_the_retries(exc, action):
    """The sensor classifies errors as the elastic operators do: a dag.test() probe saw a
    SpecError from min_workers='{{ params.n }}' rendered '0' retried twice (retries=2)."""
    sensor = ElasticPoolSensor(task_id="gate", min_workers="{{ params.n }}", retries=2)
    assert sensor.retry_policy is not None
    decision = sensor.retry_policy.evaluate(exc, try_number=1, max_tries=2)
    assert decision.action.value == action
