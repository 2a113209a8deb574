"""A chunk that warm-starts from an ``s3://`` model reads it through the Airflow ``aws`` connection.

The warm-start model lies on a real S3 HTTP endpoint (moto's server); only the ``aws`` connection
knows its endpoint and credentials. boto3's default chain is emptied (no AWS env, no config
files, no instance metadata), so reading the model any other way fails.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from airflow.sdk import Asset

from elastic_ops.checkpoint import open_store
from elastic_ops.errors import StoragePermanentError
from elastic_ops.examples.digits import DigitsMLP
from elastic_ops.operators import ElasticChunkOperator
from elastic_ops.pool import PoolClient
from tests.s3_server import s3_endpoint, s3_server  # noqa: F401  (fixtures)

pytestmark = pytest.mark.timeout(300)

PARAMS = {"hidden": 16, "depth": 1}
FIELDS = {"entrypoint": "elastic_ops.examples.digits:DigitsMLP", "total_iterations": 2,
          "chunk_iterations": 2, "global_batch": 64, "min_workers": 1, "max_workers": 1,
          "priority": 2, "params": PARAMS}


def set_conn(monkeypatch, conn_id: str, **conn) -> None:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))


@pytest.fixture
def no_default_aws_chain(monkeypatch, tmp_path):
    """boto3's default credential chain and endpoint find nothing."""
    import os

    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def zero_model() -> dict[str, torch.Tensor]:
    """A warm-start model no fresh initialisation resembles: every weight 0."""
    return {k: torch.zeros_like(v) for k, v in DigitsMLP(**PARAMS).build_model().state_dict().items()}


@pytest.mark.parametrize("warm_start", ["uri", "previous"])
def test_s3_warm_start_reads_the_model_through_the_aws_connection(
    monkeypatch, tmp_path, s3_endpoint, no_default_aws_chain, warm_start  # noqa: F811
):
    ledger = f"sqlite:///{tmp_path / 'pool.db'}"
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    set_conn(monkeypatch, "elastic_ops_pool_default", conn_type="elastic_ops_pool", extra={"url": ledger})
    set_conn(monkeypatch, "models_s3", conn_type="aws", login=s3_endpoint.access_key_id,
             password=s3_endpoint.secret_access_key,
             extra={"endpoint_url": s3_endpoint.endpoint_url, "region_name": s3_endpoint.region})
    PoolClient(ledger, aging_s=0.0).add_host("h1", 1)
    model_asset = Asset(name="d.train.model", uri=s3_endpoint.uri("models"))  # where finalize emits
    previous = s3_endpoint.uri("models/previous-run")
    open_store(previous, s3_client=s3_endpoint.client()).save(
        7, {"model": zero_model(), "iteration": 7}, epoch=1, spec_hash="an-earlier-job")
    with pytest.raises(StoragePermanentError, match="no usable AWS credentials"):  # the default chain
        open_store(previous).latest()

    op = ElasticChunkOperator(
        task_id="chunk_01_of_01", spec_fields=FIELDS, chunk_index=0, group_id="train",
        aws_conn_id="models_s3", warm_start=previous if warm_start == "uri" else "previous",
        inlets=[model_asset],
    )
    context = {"dag": SimpleNamespace(dag_id="d"), "run_id": "run1",
               "inlet_events": {model_asset: [SimpleNamespace(extra={"checkpoint_root": previous})]}}
    before = len(s3_endpoint.server.requests)
    result = op.execute(context)

    assert result["status"] == "completed" and result["iterations"] == 2
    reads = [r for r in s3_endpoint.server.requests[before:]
             if r[0] == "GET" and f"/{s3_endpoint.bucket}" in r[1] and r[3] == "200"]
    assert reads, "the warm-start model was not read from the connection's endpoint"
    # the job trained on from the zero model: 2 AdamW steps of lr 0.002 move no weight far from 0
    store = open_store(op._spec(context).checkpoint_uri())  # the job's own file:// checkpoints
    final = store.load(store.latest())["model"]
    assert max(float(t.abs().max()) for t in final.values()) < 0.01


@pytest.mark.parametrize("named", ["s3://another-bucket/model", "file:///etc/models", "s3://models/digits-x/r"])
def test_an_asset_event_cannot_point_the_warm_start_outside_the_model_assets_uri(named):
    """Whoever may post Asset events must not redirect the job to other storage."""
    from elastic_ops.errors import SpecError

    asset = Asset(name="d.train.model", uri="s3://models/digits")
    op = ElasticChunkOperator(task_id="chunk_01_of_01", spec_fields=FIELDS, chunk_index=0, group_id="train",
                              warm_start="previous", inlets=[asset])
    context = {"inlet_events": {asset: [SimpleNamespace(extra={"checkpoint_root": named})]}}
    with pytest.raises(SpecError, match="invalid warm_start=.*must lie under the model Asset's URI"):
        op._warm_start(context)


@pytest.mark.parametrize("named", [
    "file:///srv/ckpt/d/train/../../other_team/model",  # a probe read another team's checkpoints so
    "file:///srv/ckpt/d/train/%2e%2e/%2E%2E/other_team/model",  # (the store unquotes the path)
    "file:///srv/ckpt/d/train/./../../etc",
    "s3://models/digits/../other-team/model",
])
def test_an_asset_event_cannot_climb_out_of_the_model_assets_uri(named):
    from elastic_ops.errors import SpecError

    asset = Asset(name="d.train.model", uri=named.split("/train")[0] + "/train" if named.startswith("file")
                  else "s3://models/digits")
    op = ElasticChunkOperator(task_id="chunk_01_of_01", spec_fields=FIELDS, chunk_index=0, group_id="train",
                              warm_start="previous", inlets=[asset])
    context = {"inlet_events": {asset: [SimpleNamespace(extra={"checkpoint_root": named})]}}
    with pytest.raises(SpecError, match=r"invalid warm_start=.*without '\.' or '\.\.' path segments"):
        op._warm_start(context)


def test_the_previous_model_is_the_newest_asset_event_fetched_alone():
    """Years of daily retraining leave thousands of events: only the newest is fetched."""
    asset = Asset(name="d.train.model", uri="s3://models/digits")

    class Accessor:  # the shape of Airflow's InletEventsAccessor
        def __init__(self) -> None:
            self.query: dict = {}

        def ascending(self, ascending: bool = True):
            self.query["ascending"] = ascending
            return self

        def limit(self, n: int):
            self.query["limit"] = n
            return self

        def _events(self):
            assert self.query == {"ascending": False, "limit": 1}, self.query
            return [SimpleNamespace(extra={"checkpoint_root": "s3://models/digits/newest-run"})]

        def __len__(self) -> int:
            return len(self._events())

        def __getitem__(self, i):
            return self._events()[i]

    op = ElasticChunkOperator(task_id="chunk_01_of_01", spec_fields=FIELDS, chunk_index=0, group_id="train",
                              warm_start="previous", inlets=[asset])
    assert op._warm_start({"inlet_events": {asset: Accessor()}}) == "s3://models/digits/newest-run"
