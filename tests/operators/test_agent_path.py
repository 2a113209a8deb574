"""``ElasticChunkOperator`` and the per-host agent: the chunk runs on the agent when
``ELASTIC_OPS_AGENT_SOCKET`` names a live one (and the task process never imports torch), in the
task process when none answers there; errors keep their class and hence their retry decision."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from airflow.sdk import RetryAction

from elastic_ops.agent.protocol import (
    AgentRemoteError,
    S3Config,
    StoreConfig,
    agent_socket_from_env,
    error_from_wire,
    error_to_wire,
)
from elastic_ops.errors import (
    EntrypointError,
    NonFiniteLossError,
    SpecError,
    StaleEpochError,
    UserCodeError,
    WorkerLostError,
)
from elastic_ops.operators import ElasticChunkOperator
from elastic_ops.pool import PoolClient
from elastic_ops.utils.retry import ElasticRetryPolicy
from tests.operators.helpers import TINY_FIELDS, airflow_pool, run_torchless_task
from tests.runtime.agent_helpers import running_agent

pytestmark = pytest.mark.timeout(300)

FIELDS = TINY_FIELDS



@pytest.fixture
def pool(monkeypatch, tmp_path) -> PoolClient:
    return airflow_pool(monkeypatch, tmp_path)


def context(run_id: str = "run1") -> dict:
    return {"dag": SimpleNamespace(dag_id="d"), "run_id": run_id}


def test_a_chunk_task_trains_on_the_agent_without_importing_torch(pool, tmp_path):
    with running_agent(tmp_path / "agent") as agent:
        first, again, log = run_torchless_task(FIELDS, "run1", tmp_path,
                                               ELASTIC_OPS_AGENT_SOCKET=agent.path)
    assert first["status"] == "completed" and first["iterations"] == 20 and first["hosts"] == ["h1"]
    assert first["param_sha256"] and again["status"] == "already_done"
    assert f"sending the chunk to the elastic-ops agent at {agent.path}" in log
    assert "in this task process" not in log
    assert "iteration 20/20" in log and "ETA" in log  # progress in the task log, as in-process
    assert [e["kind"] for e in pool.events() if e["kind"] in ("grant", "release")] == ["grant", "release"]


def test_without_a_live_agent_the_chunk_runs_in_the_task_process(pool, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_OPS_AGENT_SOCKET", str(tmp_path / "no-agent.sock"))
    op = ElasticChunkOperator(task_id="chunk_0", spec_fields=FIELDS, chunk_index=0, group_id="train")
    result = op.execute(context())
    assert result["status"] == "completed" and result["iterations"] == 20
    log = "".join(capsys.readouterr())  # the operator's logger writes through Airflow's setup
    assert "no elastic-ops agent at" in log and "training in this task process instead" in log


def test_a_bad_agent_socket_setting_fails_loudly(pool, monkeypatch):
    monkeypatch.setenv("ELASTIC_OPS_AGENT_SOCKET", "relative/agent.sock")
    op = ElasticChunkOperator(task_id="chunk_0", spec_fields=FIELDS, chunk_index=0, group_id="train")
    with pytest.raises(SpecError, match="ELASTIC_OPS_AGENT_SOCKET"):
        op.execute(context())
    assert (
        agent_socket_from_env({}) is None and agent_socket_from_env({"ELASTIC_OPS_AGENT_SOCKET": ""}) is None
    )
    with pytest.raises(SpecError, match="at most 107 bytes"):
        agent_socket_from_env({"ELASTIC_OPS_AGENT_SOCKET": "/" + "x" * 200})


@pytest.mark.parametrize(
    ("exc", "action"),
    [
        (WorkerLostError("rank 1 killed by SIGKILL", host="h2", hint="retry"), RetryAction.RETRY),
        (UserCodeError("ValueError in loss()"), RetryAction.FAIL),
        (NonFiniteLossError("loss is nan at iteration 7"), RetryAction.FAIL),
        (SpecError("max_workers", 0, "must be >= 1"), RetryAction.FAIL),
        (EntrypointError("entrypoint", "x:Y", "cannot be imported"), RetryAction.FAIL),
        (StaleEpochError(3, 4), RetryAction.RETRY),  # the next try gets a new lease and epoch
        (RuntimeError("something else"), RetryAction.DEFAULT),
    ],
)
def test_errors_from_the_agent_keep_their_class_and_retry_decision(exc, action):
    back = error_from_wire(json.loads(json.dumps(error_to_wire(exc, "Traceback ..."))))
    if isinstance(exc, RuntimeError):
        assert isinstance(back, AgentRemoteError) and "RuntimeError: something else" in str(back)
    else:
        assert type(back) is type(exc) and str(back) == str(exc) and back.retryable == exc.retryable
        assert {k: getattr(back, k) for k in vars(exc) if k != "args"} == {
            k: (getattr(exc, k) if not isinstance(getattr(exc, k), tuple) else list(getattr(exc, k)))
            for k in vars(exc)
            if k != "args"
        }
    assert ElasticRetryPolicy().evaluate(back, try_number=1, max_tries=4).action == action
    if isinstance(exc, WorkerLostError):
        assert back.host == "h2"


def test_s3_credentials_never_show_in_a_repr():
    s3 = S3Config(
        endpoint_url="http://127.0.0.1:9000",
        region_name="eu-west-1",
        access_key_id="AKIAEXAMPLE",
        secret_access_key="very-secret",
        session_token="token-secret",
    )
    store = StoreConfig("s3://bucket/prefix", s3=s3)
    for text in (repr(s3), repr(store), str(store)):
        assert "very-secret" not in text and "token-secret" not in text and "AKIAEXAMPLE" not in text
    assert "http://127.0.0.1:9000" in repr(store)
    assert StoreConfig.from_wire(store.to_wire()) == store
    with pytest.raises(SpecError, match="store.s3"):
        StoreConfig.from_wire({"uri": "file:///tmp/x", "s3": {"endpoint_url": "http://x"}})
    with pytest.raises(SpecError, match="store.s3"):
        StoreConfig.from_wire({"uri": "s3://bucket/p", "s3": {"password": "x"}})


def test_the_agent_gets_the_s3_settings_of_the_aws_connection(monkeypatch, tmp_path):
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv(
        "AIRFLOW_CONN_MODELS_S3",
        json.dumps(
            {
                "conn_type": "aws",
                "login": "AKIAEXAMPLE",
                "password": "very-secret",
                "extra": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"},
            }
        ),
    )
    op = ElasticChunkOperator(
        task_id="chunk_0", spec_fields=FIELDS, chunk_index=0, group_id="train", aws_conn_id="models_s3"
    )
    store = op._hook().store_config("s3://bucket/prefix")
    assert store.s3 == S3Config(
        endpoint_url="http://127.0.0.1:9000",
        region_name="eu-west-1",
        access_key_id="AKIAEXAMPLE",
        secret_access_key="very-secret",
    )
    assert op._hook().store_config("file:///tmp/x").s3 is None
    client = store.s3.client()  # what the agent builds: the same endpoint, region and keys
    assert client.meta.endpoint_url == "http://127.0.0.1:9000" and client.meta.region_name == "eu-west-1"
    assert client._request_signer._credentials.access_key == "AKIAEXAMPLE"


def test_the_agents_s3_client_has_the_stores_botocore_settings():
    from elastic_ops.agent.protocol import S3Config

    client = S3Config(endpoint_url="http://127.0.0.1:1", region_name="eu-west-1",
                      access_key_id="k", secret_access_key="s").client()
    assert client.meta.endpoint_url == "http://127.0.0.1:1" and client.meta.region_name == "eu-west-1"
    assert client.meta.config.retries["total_max_attempts"] == 1
    assert client.meta.config.response_checksum_validation == "when_required"
