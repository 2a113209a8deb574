"""An S3 multipart upload (a state of at least 64 MiB, the default threshold) interrupted mid-part
(issue 22, item 14), on the real moto endpoint of tests/s3_server.py: a part's connection cut while
its body is on the way, every part cut until the retries are spent, and the writer SIGKILLed while
a part is in flight. The last committed checkpoint stays intact and loads bitwise, the failed save
leaves nothing ``latest()``/``list()``/``load()`` take for a checkpoint, and a retry commits."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
import torch

from elastic_ops.checkpoint import open_store
from elastic_ops.checkpoint.retry import RetryPolicy
from elastic_ops.errors import StorageTransientError
from tests.checkpoint.builders import child_open, no_sleep
from tests.s3_server import S3Endpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MiB = 1024 * 1024
PARTS = 5  # 68 MiB in the default 16 MiB parts


def big_state(seed: int) -> dict[str, Any]:
    """68 MiB of float32: over the 64 MiB multipart threshold, so the data goes up in parts."""
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(17 * MiB, generator=g), "step": seed}


def open_s3(ep: S3Endpoint):
    """A store on ``ep`` with 3 tries per request, no waits between them."""
    return open_store(ep.uri("job"), s3_client=ep.client(), retry=RetryPolicy(attempts=3, sleep=no_sleep))


def assert_committed(ep: S3Endpoint, iteration: int, state: dict[str, Any]) -> None:
    """A fresh store (another process's view) finds ``iteration`` newest, and its bytes are ``state``'s."""
    store = open_s3(ep)
    ref = store.latest()
    assert ref is not None and ref.iteration == iteration
    back = store.load(ref)
    assert back["step"] == state["step"] and torch.equal(back["w"], state["w"])
    assert [r.iteration for r in store.list()] == sorted({10, iteration})


def manifests(ep: S3Endpoint) -> list[str]:
    resp = ep.client().list_objects_v2(Bucket=ep.bucket, Prefix="job/")
    return sorted(o["Key"] for o in resp.get("Contents", []) if o["Key"].endswith("manifest.json"))


def open_uploads(ep: S3Endpoint) -> list[str]:
    return [u["Key"] for u in ep.client().list_multipart_uploads(Bucket=ep.bucket).get("Uploads", [])]


@pytest.fixture
def committed_10(s3_endpoint: S3Endpoint) -> dict[str, Any]:
    state = big_state(10)
    ref = open_s3(s3_endpoint).save(10, state, epoch=1, spec_hash="h")
    key = f"job/it-00000010/{ref.files[0].name}"
    etag = s3_endpoint.client().head_object(Bucket=s3_endpoint.bucket, Key=key)["ETag"]
    assert etag.strip('"').endswith(f"-{PARTS}"), "stored as a multipart upload"
    return state


def test_a_part_cut_mid_body_is_retried_and_the_save_commits(s3_endpoint: S3Endpoint, committed_10) -> None:
    fault = s3_endpoint.inject(1, kind="drop", method="PUT", path_contains="it-00000020/d-")
    state = big_state(20)
    open_s3(s3_endpoint).save(20, state, epoch=1, spec_hash="h")
    assert fault.remaining == 0, "a part's connection was cut"
    assert_committed(s3_endpoint, 20, state)
    assert open_uploads(s3_endpoint) == [], "the failed transfer's upload was aborted, no parts left"


def test_a_save_whose_parts_are_all_cut_fails_retryably_leaves_no_checkpoint_and_its_retry_commits(
    s3_endpoint: S3Endpoint, committed_10
) -> None:
    s3_endpoint.inject(10_000, kind="drop", method="PUT", path_contains="it-00000020/d-")
    store = open_s3(s3_endpoint)
    with pytest.raises(StorageTransientError) as info:
        store.save(20, big_state(20), epoch=1, spec_hash="h")
    assert info.value.retryable
    assert manifests(s3_endpoint) == ["job/it-00000010/manifest.json"]  # nothing names iteration 20
    assert store.latest().iteration == 10  # the writer's own store, too
    assert_committed(s3_endpoint, 10, committed_10)

    s3_endpoint.server.clear_faults()  # S3 is well again: the task's retry saves 20 anew
    state = big_state(21)
    store.save(20, state, epoch=1, spec_hash="h")
    assert_committed(s3_endpoint, 20, state)


def _save_in_child(uri: str, endpoint_url: str) -> None:
    child_open(uri, endpoint_url).save(20, big_state(20), epoch=1, spec_hash="h")


def test_a_writer_killed_mid_part_leaves_the_last_checkpoint_newest_and_a_retry_commits(
    s3_endpoint: S3Endpoint, committed_10
) -> None:
    fault = s3_endpoint.inject(1, kind="hold", method="PUT", path_contains="it-00000020/d-")
    child = mp.get_context("fork").Process(target=_save_in_child,
                                          args=(s3_endpoint.uri("job"), s3_endpoint.endpoint_url))
    child.start()
    try:
        assert fault.arrived.wait(120), "no part of the child's upload reached S3"
        child.kill()  # mid-part: the held part's body is still on the way
        child.join(60)
        assert child.exitcode == -9
    finally:
        fault.release.set()
        if child.is_alive():
            child.kill()
            child.join()
    assert manifests(s3_endpoint) == ["job/it-00000010/manifest.json"]
    assert_committed(s3_endpoint, 10, committed_10)
    # documented (docs/checkpoint.md): a killed writer's upload stays open until the bucket's
    # AbortIncompleteMultipartUpload rule; it is invisible to listings and to the store
    (left,) = open_uploads(s3_endpoint)
    assert left.startswith("job/it-00000020/d-")

    state = big_state(22)
    open_s3(s3_endpoint).save(20, state, epoch=1, spec_hash="h")  # the retry, in another process's place
    assert_committed(s3_endpoint, 20, state)
