"""``ElasticOpsHook``: ledger URL resolution and checkpoint stores through Airflow connections."""

from __future__ import annotations

import json

import pytest

from elastic_ops.errors import SpecError
from elastic_ops.hooks import ElasticOpsHook, default_ledger_url
from elastic_ops.provider import get_provider_info
from tests.s3_server import s3_endpoint, s3_server  # noqa: F401  (fixtures)


def set_conn(monkeypatch, conn_id: str, **conn) -> None:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))


def test_without_a_connection_the_ledger_is_sqlite_beside_airflow_home(monkeypatch, tmp_path):
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    monkeypatch.delenv("AIRFLOW_CONN_ELASTIC_OPS_POOL_DEFAULT", raising=False)
    expected = f"sqlite:///{tmp_path}/elastic_ops_pool.db"
    assert ElasticOpsHook().ledger_url() == expected == default_ledger_url()


def test_a_named_connection_that_does_not_exist_is_an_error_not_a_pool_of_its_own(monkeypatch, tmp_path):
    """Only the default id falls back to the embedded ledger: a typo in a cluster's connection
    id would otherwise give each machine its own pool (the same GPUs granted twice)."""
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    with pytest.raises(SpecError, match="invalid elastic_ops_conn_id='pool_prod_typo': an Airflow conn"):
        ElasticOpsHook("pool_prod_typo").ledger_url()


def test_connection_extra_url_wins(monkeypatch):
    set_conn(monkeypatch, "elastic_ops_pool_default", conn_type="elastic_ops_pool",
             extra={"url": "postgresql+psycopg2://postgres@127.0.0.1:5432/test"})
    assert ElasticOpsHook().ledger_url() == "postgresql+psycopg2://postgres@127.0.0.1:5432/test"


def test_connection_fields_build_a_postgres_url(monkeypatch):
    set_conn(monkeypatch, "pool_pg", conn_type="elastic_ops_pool", host="db.internal", login="svc",
             password="p@ss/word", port=5433, schema="pool")
    assert ElasticOpsHook("pool_pg").ledger_url() == "postgresql+psycopg2://svc:p%40ss%2Fword@db.internal:5433/pool"


def test_connection_without_url_or_host_is_a_clear_error(monkeypatch):
    set_conn(monkeypatch, "pool_bad", conn_type="elastic_ops_pool")
    with pytest.raises(SpecError, match="invalid connection=.pool_bad.*needs extra"):
        ElasticOpsHook("pool_bad").ledger_url()


def test_pool_client_uses_the_resolved_ledger(monkeypatch, tmp_path):
    set_conn(monkeypatch, "elastic_ops_pool_default", conn_type="elastic_ops_pool",
             extra={"url": f"sqlite:///{tmp_path / 'ledger.db'}"})
    client = ElasticOpsHook().pool()
    client.add_host("h1", 2)
    assert (tmp_path / "ledger.db").exists()
    assert client.status()["slots"]["up"] == 2


def test_s3_store_goes_through_the_aws_connection_and_its_endpoint(monkeypatch, s3_endpoint):  # noqa: F811
    set_conn(monkeypatch, "my_s3", conn_type="aws", login=s3_endpoint.credentials["aws_access_key_id"],
             password=s3_endpoint.credentials["aws_secret_access_key"],
             extra={"endpoint_url": s3_endpoint.endpoint_url, "region_name": s3_endpoint.region})
    hook = ElasticOpsHook(aws_conn_id="my_s3")
    assert hook.s3_client().meta.endpoint_url == s3_endpoint.endpoint_url
    store = hook.store(s3_endpoint.uri("job-1"))
    ref = store.save(5, {"model": {"w": [1.0, 2.0]}, "iteration": 5}, epoch=1, spec_hash="abc")
    assert store.latest().iteration == 5 and ref.uri.startswith(s3_endpoint.uri("job-1"))
    assert s3_endpoint.client().list_objects_v2(Bucket=s3_endpoint.bucket)["KeyCount"] > 0


def test_the_connections_client_gets_the_stores_botocore_settings(monkeypatch):
    # one retry loop (the store's), no redundant download CRC32; the connection's own config stays
    set_conn(monkeypatch, "my_s3", conn_type="aws", login="k", password="s",
             extra={"endpoint_url": "http://127.0.0.1:1", "region_name": "eu-west-1",
                    "config_kwargs": {"connect_timeout": 7}})
    config = ElasticOpsHook(aws_conn_id="my_s3").s3_client().meta.config
    assert config.retries["total_max_attempts"] == 1
    assert config.response_checksum_validation == "when_required"
    assert config.connect_timeout == 7 and config.max_pool_connections == 16


def test_provider_info_registers_the_connection_type_and_hook():
    info = get_provider_info()
    assert info["connection-types"] == [{"connection-type": "elastic_ops_pool",
                                         "hook-class-name": "elastic_ops.hooks.elastic_ops.ElasticOpsHook"}]
    assert ElasticOpsHook.conn_type == "elastic_ops_pool"
    assert ElasticOpsHook.default_conn_name == "elastic_ops_pool_default"


def test_the_default_checkpoint_root_is_beside_airflow_home_or_the_clusters_setting(monkeypatch, tmp_path):
    from elastic_ops.hooks.elastic_ops import default_checkpoint_root

    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    monkeypatch.delenv("ELASTIC_OPS_CHECKPOINT_ROOT", raising=False)
    assert default_checkpoint_root() == f"file://{tmp_path}/elastic_ops_checkpoints"
    monkeypatch.setenv("ELASTIC_OPS_CHECKPOINT_ROOT", "s3://team-ckpt/elastic/")
    assert default_checkpoint_root() == "s3://team-ckpt/elastic"
    monkeypatch.setenv("ELASTIC_OPS_CHECKPOINT_ROOT", "file://relative/path")
    with pytest.raises(SpecError) as err:
        default_checkpoint_root()
    assert "ELASTIC_OPS_CHECKPOINT_ROOT" in str(err.value) and "file:///" in str(err.value)
