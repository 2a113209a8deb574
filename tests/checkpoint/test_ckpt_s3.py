"""S3 backend against a real S3 HTTP endpoint (moto server) with faults injected on the wire."""

from __future__ import annotations

import botocore.exceptions as bce
import pytest
from boto3.s3.transfer import TransferConfig

from elastic_ops.checkpoint import open_store
from elastic_ops.checkpoint.retry import RetryPolicy, is_transient
from elastic_ops.errors import (
    CommitConflictError,
    StorageCredentialsExpiredError,
    StoragePermanentError,
    StorageTransientError,
)
from tests.checkpoint.builders import small_state
from tests.s3_server import SECRET_KEY, S3Endpoint

MiB = 1024 * 1024


def make_s3_store(ep: S3Endpoint, sleeps: list[float] | None = None, *, attempts: int = 6, **kwargs):
    sleeps = [] if sleeps is None else sleeps
    policy = RetryPolicy(attempts=attempts, initial_s=0.5, max_s=4.0, sleep=sleeps.append)
    return open_store(ep.uri("job"), s3_client=ep.client(), retry=policy, **kwargs)


def _faulted(ep: S3Endpoint) -> list[tuple]:
    return [r for r in ep.server.requests if r[3].startswith("fault") and ep.bucket in r[1]]


@pytest.mark.parametrize(
    "fault",
    [
        {"status": 503, "code": "SlowDown"},
        {"status": 500, "code": "InternalError"},
        {"status": 400, "code": "RequestTimeout"},
        {"status": 429, "code": "TooManyRequestsException"},
        {"kind": "drop"},
    ],
    ids=["slowdown", "500", "request-timeout", "429", "dropped-connection"],
)
def test_transient_errors_are_retried_with_backoff_and_succeed(s3_endpoint: S3Endpoint, fault) -> None:
    sleeps: list[float] = []
    store = make_s3_store(s3_endpoint, sleeps)
    s3_endpoint.inject(3, method="PUT", path_contains="/state.pt", **fault)  # the data upload
    s3_endpoint.inject(2, method="PUT", path_contains="/manifest.json", **fault)  # the commit
    s3_endpoint.inject(1, method="GET", path_contains="/state.pt", **fault)  # the read-back

    store.save(10, small_state(7), epoch=1, spec_hash="h")
    assert store.load(store.latest())["step"] == 7
    assert len(_faulted(s3_endpoint)) == 6, "every injected fault was hit on the real endpoint"
    assert len(sleeps) == 6
    # bounded exponential backoff with jitter: attempt k waits in [0, min(4, 0.5 * 2**(k-1))]
    assert all(0 <= s <= 4.0 for s in sleeps)


def test_retry_budget_exhausted_gives_retryable_transient_error(s3_endpoint: S3Endpoint) -> None:
    sleeps: list[float] = []
    store = make_s3_store(s3_endpoint, sleeps, attempts=3)
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    s3_endpoint.inject(100, method="PUT", path_contains="/manifest.json", status=503, code="SlowDown")
    with pytest.raises(StorageTransientError, match="after 3 attempts: SlowDown") as err:
        store.save(20, small_state(2), epoch=1, spec_hash="h")
    assert err.value.retryable is True
    assert len(sleeps) == 2
    s3_endpoint.server.clear_faults()
    # the save was interrupted before its manifest: invisible, the previous one is the latest
    assert make_s3_store(s3_endpoint).latest().iteration == 10
    keys = [o["Key"] for o in s3_endpoint.client().list_objects_v2(Bucket=s3_endpoint.bucket)["Contents"]]
    assert any(k.startswith("job/it-00000020/d-") for k in keys)


@pytest.mark.parametrize(
    ("status", "code", "hint"),
    [
        (403, "AccessDenied", "s3:PutObject"),
        (403, "InvalidAccessKeyId", "access key id"),
        (403, "SignatureDoesNotMatch", "secret access key"),
    ],
)
def test_permanent_errors_fail_at_once_with_a_fix(s3_endpoint: S3Endpoint, status, code, hint) -> None:
    sleeps: list[float] = []
    store = make_s3_store(s3_endpoint, sleeps)
    s3_endpoint.inject(100, status=status, code=code)
    with pytest.raises(StoragePermanentError) as err:
        store.save(10, small_state(1), epoch=1, spec_hash="h")
    assert err.value.retryable is False
    assert code in str(err.value) and hint in str(err.value)
    assert SECRET_KEY not in str(err.value)
    # the data PUT and the commit's listing (made during the upload) each answered once: no retry
    faulted = sorted((method, query) for method, _, query, _ in _faulted(s3_endpoint))
    assert sleeps == [] and [m for m, _ in faulted] == ["GET", "PUT"], faulted


def test_expired_session_credentials_fail_at_once_but_the_task_is_retried(s3_endpoint: S3Endpoint) -> None:
    sleeps: list[float] = []
    store = make_s3_store(s3_endpoint, sleeps)
    s3_endpoint.inject(100, status=400, code="ExpiredToken")
    with pytest.raises(StorageCredentialsExpiredError, match="session credentials expired") as err:
        store.save(10, small_state(1), epoch=1, spec_hash="h")
    assert err.value.retryable is True and sleeps == []  # the next try brings fresh credentials


def test_missing_bucket_is_permanent(s3_endpoint: S3Endpoint) -> None:
    sleeps: list[float] = []
    store = open_store(
        "s3://no-such-bucket-here/job", s3_client=s3_endpoint.client(), retry=RetryPolicy(sleep=sleeps.append)
    )
    with pytest.raises(StoragePermanentError, match="NoSuchBucket.*create the bucket"):
        store.latest()
    assert sleeps == []


def test_large_objects_use_multipart_transfer(s3_endpoint: S3Endpoint) -> None:
    store = make_s3_store(
        s3_endpoint,
        transfer_config=TransferConfig(multipart_threshold=1 * MiB, multipart_chunksize=5 * MiB),
    )
    state = small_state(3, n=(6 * MiB) // 4)  # ~6 MiB of float32 -> 2 parts
    s3_endpoint.inject(1, method="PUT", path_contains="/state.pt", status=503, code="SlowDown")  # one part
    ref = store.save(10, state, epoch=1, spec_hash="h")
    log = [r for r in s3_endpoint.server.requests if s3_endpoint.bucket in r[1] and "/state.pt" in r[1]]
    assert any(r[0] == "POST" and r[2] == "uploads" for r in log), "multipart upload initiated"
    key = f"job/it-00000010/{ref.files[0].name}"
    head = s3_endpoint.client().head_object(Bucket=s3_endpoint.bucket, Key=key)
    assert head["ETag"].strip('"').endswith("-2"), "stored as 2 parts"

    back = make_s3_store(s3_endpoint, transfer_config=store.backend.transfer).load(ref)
    assert back["step"] == 3 and back["w"].equal(state["w"])
    log = [r for r in s3_endpoint.server.requests if s3_endpoint.bucket in r[1] and "/state.pt" in r[1]]
    assert sum(r[0] == "GET" and r[3] == "206" for r in log) >= 2, "downloaded in ranged parts"


def test_endpoint_honours_conditional_create(s3_endpoint: S3Endpoint) -> None:
    """The commit primitive: a second If-None-Match:* PUT of a key gets 412."""
    client = s3_endpoint.client()
    client.put_object(Bucket=s3_endpoint.bucket, Key="k", Body=b"a", IfNoneMatch="*")
    with pytest.raises(bce.ClientError) as err:
        client.put_object(Bucket=s3_endpoint.bucket, Key="k", Body=b"b", IfNoneMatch="*")
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert client.get_object(Bucket=s3_endpoint.bucket, Key="k")["Body"].read() == b"a"


def _client_error(code: str, status: int) -> bce.ClientError:
    return bce.ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op")


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (_client_error("SlowDown", 503), True),
        (_client_error("InternalError", 500), True),
        (_client_error("Whatever", 502), True),
        (_client_error("RequestTimeout", 400), True),
        (_client_error("ConditionalRequestConflict", 409), True),
        (bce.ReadTimeoutError(endpoint_url="http://x"), True),
        (bce.EndpointConnectionError(endpoint_url="http://x"), True),
        (bce.ConnectionClosedError(endpoint_url="http://x"), True),
        (_client_error("AccessDenied", 403), False),
        (_client_error("NoSuchBucket", 404), False),
        (_client_error("InvalidAccessKeyId", 403), False),
        (bce.NoCredentialsError(), False),
    ],
)
def test_error_classification(exc: Exception, transient: bool) -> None:
    assert is_transient(exc) is transient


def test_backoff_is_bounded_exponential_with_jitter() -> None:
    top = RetryPolicy(initial_s=0.5, max_s=4.0, rng=lambda: 1.0)
    assert [top.wait(a) for a in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert RetryPolicy(rng=lambda: 0.0).wait(3) == 0.0


def test_store_against_s3_in_a_separate_process() -> None:
    from tests.s3_server import S3ServerProcess

    with S3ServerProcess() as server:
        ep = server.endpoint()
        store = open_store(ep.uri("job"), s3_client=ep.client())
        store.save(10, small_state(4), epoch=1, spec_hash="h")
        with pytest.raises(CommitConflictError):
            open_store(ep.uri("job"), s3_client=ep.client()).save(10, small_state(5), epoch=1, spec_hash="h")
        assert open_store(ep.uri("job"), s3_client=ep.client()).load(store.latest())["step"] == 4


def test_a_manifest_write_whose_reply_was_lost_is_committed_and_keeps_its_data(s3_endpoint) -> None:
    """S3 stored the manifest but the reply got lost; the retry meets our own manifest (412):
    that is our commit, and its data must stay."""
    store = make_s3_store(s3_endpoint)
    s3_endpoint.inject(1, method="PUT", path_contains="/manifest.json", kind="lost_reply", status=500,
                       code="InternalError")
    ref = store.save(10, small_state(7), epoch=1, spec_hash="h")
    assert len(_faulted(s3_endpoint)) == 1
    latest = make_s3_store(s3_endpoint).latest(spec_hash="h")
    assert latest is not None and latest.iteration == 10 and latest.files == ref.files
    assert store.load(latest)["step"] == 7


def test_retention_runs_after_a_commit_whose_manifest_reply_was_lost(s3_endpoint) -> None:
    """The lost reply's commit returned before retention (an audit: 4-5 checkpoints kept with
    keep_last=3 through a proxy dropping replies)."""
    store = make_s3_store(s3_endpoint, keep_last=3)
    for it in (10, 20, 30):
        store.save(it, small_state(it), epoch=1, spec_hash="h")
    s3_endpoint.inject(1, method="PUT", path_contains="it-00000040/manifest.json", kind="lost_reply",
                       status=500, code="InternalError")
    store.save(40, small_state(40), epoch=1, spec_hash="h")
    store.wait()
    assert len(_faulted(s3_endpoint)) == 1
    assert [r.iteration for r in make_s3_store(s3_endpoint).list()] == [20, 30, 40]
