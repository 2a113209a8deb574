"""Round trips the store overlaps on a remote backend, and the S3 client it builds.

The commit's listing (fence check + retention plan) runs while a one-request upload is in
flight; a stale writer must still be refused before anything becomes visible, and a failed
upload must not leave the listing in flight. Concurrency is proven with events, not timing.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import botocore.exceptions as bce
import pytest

from elastic_ops.checkpoint import CheckpointStore
from elastic_ops.checkpoint.backend import Backend, ObjectInfo
from elastic_ops.checkpoint.local import LocalBackend
from elastic_ops.checkpoint.s3 import S3Backend, make_client
from elastic_ops.errors import StaleEpochError, StorageTransientError
from tests.checkpoint.builders import small_state
from tests.s3_server import S3Endpoint

WAIT_S = 10.0  # generous: only reached when the behaviour under test is broken


class RemoteLike(Backend):
    """A directory behind the remote-backend interface: one-request puts below ``limit`` bytes.

    ``hold_data_put``: the data upload waits until the listing has started (proves overlap).
    ``fail_data_put``: the data upload raises a transient error after the listing started.
    """

    remote = True

    def __init__(self, root: Path, *, limit: int = 1 << 20) -> None:
        self.inner = LocalBackend(root)
        self.uri = self.inner.uri
        self.single_put_limit = limit
        self.hold_data_put = False
        self.fail_data_put = False
        self.list_started = threading.Event()
        self.list_release = threading.Event()
        self.list_release.set()
        self.list_done = threading.Event()
        self.upload_failed = threading.Event()
        self.calls: list[str] = []
        self.damaged_reads = 0  # this many data reads come back with one byte flipped

    def put(self, key: str, data: bytes) -> None:
        self.calls.append("put-data" if "/d-" in key else "put")
        if "/d-" in key and (self.hold_data_put or self.fail_data_put):
            assert self.list_started.wait(WAIT_S), "the listing did not start during the upload"
            if self.fail_data_put:
                self.upload_failed.set()
                raise StorageTransientError("upload failed (injected)")
        self.inner.put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self.calls.append("put-manifest" if key.endswith("manifest.json") else "put-if-absent")
        return self.inner.put_if_absent(key, data)

    def get(self, key: str, *, size_hint: int | None = None) -> bytes | None:
        data = self.inner.get(key, size_hint=size_hint)
        if data is not None and "/d-" in key and self.damaged_reads > 0:
            self.damaged_reads -= 1
            self.calls.append("damaged-read")
            return data[:10] + bytes([data[10] ^ 0xFF]) + data[11:]
        return data

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        self.calls.append(f"list:{prefix}")
        self.list_started.set()
        assert self.list_release.wait(WAIT_S)
        out = self.inner.list(prefix)
        self.list_done.set()
        return out

    def delete(self, keys: list[str]) -> None:
        self.inner.delete(keys)

    def delete_if(self, key: str, data: bytes) -> bool:
        return self.inner.delete_if(key, data)


def _data_keys(root: Path) -> list[str]:
    return [o.key for o in LocalBackend(root).list("it-")]


def test_listing_runs_while_a_one_request_upload_is_in_flight(tmp_path: Path) -> None:
    backend = RemoteLike(tmp_path)
    backend.hold_data_put = True  # the upload finishes only once the listing has started
    store = CheckpointStore(backend, keep_last=2)
    ref = store.save(10, small_state(3), epoch=1, spec_hash="h")
    store.wait()
    assert store.load(store.latest())["step"] == 3 and ref.iteration == 10
    # one listing of the whole root (fence + retention), then the manifest: nothing in between
    commit = [c for c in backend.calls if c in ("list:", "put-data", "put-manifest")]
    assert commit.count("list:") == 1 and commit[-1] == "put-manifest"


def test_stale_writer_is_refused_and_leaves_nothing_when_listing_overlaps(tmp_path: Path) -> None:
    CheckpointStore(LocalBackend(tmp_path)).fence(5)
    backend = RemoteLike(tmp_path)
    backend.hold_data_put = True
    store = CheckpointStore(backend)
    with pytest.raises(StaleEpochError):
        store.save(10, small_state(1), epoch=3, spec_hash="h")
    assert "put-manifest" not in backend.calls
    assert _data_keys(tmp_path) == [], "the zombie's upload was removed"
    assert CheckpointStore(LocalBackend(tmp_path)).latest() is None


def test_fence_raised_before_the_save_is_seen_even_if_the_upload_is_slow(tmp_path: Path) -> None:
    # the listing starts when the save starts: a fence raised before save() is always honoured
    backend = RemoteLike(tmp_path)
    store = CheckpointStore(backend)
    store.save(10, small_state(1), epoch=3, spec_hash="h")
    CheckpointStore(LocalBackend(tmp_path)).fence(4)
    backend.hold_data_put = True
    with pytest.raises(StaleEpochError):
        store.save(20, small_state(2), epoch=3, spec_hash="h")
    assert store.latest().iteration == 10


def test_failed_upload_raises_with_no_listing_left_in_flight(tmp_path: Path) -> None:
    backend = RemoteLike(tmp_path)
    backend.fail_data_put = True
    backend.list_release.clear()  # the listing is still running when the upload fails
    store = CheckpointStore(backend)
    raised: list[BaseException] = []

    def save() -> None:
        try:
            store.save(10, small_state(1), epoch=1, spec_hash="h")
        except BaseException as exc:  # checked below
            raised.append(exc)

    saving = threading.Thread(target=save)
    saving.start()
    assert backend.upload_failed.wait(WAIT_S)
    saving.join(0.2)
    assert saving.is_alive(), "save() returned while its listing was still running"
    backend.list_release.set()
    saving.join(WAIT_S)
    assert len(raised) == 1 and isinstance(raised[0], StorageTransientError) and backend.list_done.is_set()
    assert "put-manifest" not in backend.calls and store.latest() is None


def test_upload_of_many_requests_lists_after_it(tmp_path: Path) -> None:
    backend = RemoteLike(tmp_path, limit=64)  # the state is larger: a multipart upload on S3
    store = CheckpointStore(backend)
    store.fence(1)
    backend.calls.clear()
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    store.wait()  # retention, on the background thread, lists the whole store for itself
    commit = [c for c in backend.calls if c.startswith("list:") or c in ("put-data", "put-manifest")]
    assert commit == ["put-data", "list:_fence/", "put-manifest", "list:it-"]


def test_local_store_lists_after_writing(tmp_path: Path) -> None:
    store = CheckpointStore(LocalBackend(tmp_path))
    assert not store._list_during_upload({"state.pt": b"x"})  # no round trip to save


def test_remote_read_damaged_on_the_way_is_read_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = RemoteLike(tmp_path)
    store = CheckpointStore(backend)
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    store.save(20, small_state(2), epoch=1, spec_hash="h")
    backend.damaged_reads = 1  # damaged in transit: the second read is intact
    with caplog.at_level(logging.WARNING, logger="elastic_ops.checkpoint"):
        ref = store.latest()
    assert ref is not None and ref.iteration == 20 and store.load(ref)["step"] == 2
    assert backend.calls.count("damaged-read") == 1
    assert any("reading it again" in r.getMessage() for r in caplog.records)
    assert not any("skipping" in r.getMessage() for r in caplog.records)
    backend.damaged_reads = 2  # damaged every time: the checkpoint is skipped
    ref = CheckpointStore(backend).latest()
    assert ref is not None and ref.iteration == 10


class _PagedClient:
    """list_objects_v2 in pages of two, as S3 answers past MaxKeys."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.calls: list[dict[str, Any]] = []

    def list_objects_v2(self, **params: Any) -> dict[str, Any]:
        self.calls.append(params)
        start = int(params.get("ContinuationToken", "0"))
        page = self.keys[start : start + 2]
        more = start + 2 < len(self.keys)
        out: dict[str, Any] = {"Contents": [{"Key": k, "Size": 1} for k in page], "IsTruncated": more}
        if more:
            out["NextContinuationToken"] = str(start + 2)
        return out


def test_s3_list_follows_every_page() -> None:
    keys = [f"job/it-{i:08d}/manifest.json" for i in range(5)]
    client = _PagedClient(keys)
    backend = S3Backend("bucket", "job", client=client)
    assert [o.key for o in backend.list("it-")] == [k[4:] for k in keys]
    assert len(client.calls) == 3 and all(c["Prefix"] == "job/it-" for c in client.calls)
    assert backend.single_put_limit == backend.transfer.multipart_threshold


def test_own_client_skips_crc_and_the_store_still_catches_damage(
    s3_endpoint: S3Endpoint, caplog: pytest.LogCaptureFixture
) -> None:
    client = make_client(s3_endpoint.endpoint_url, region_name=s3_endpoint.region, **s3_endpoint.credentials)
    assert client.meta.config.response_checksum_validation == "when_required"
    assert client.meta.config.max_pool_connections >= 8 + 2  # transfer parts + manifest/listing
    backend = S3Backend(s3_endpoint.bucket, "job", client=client)
    store = CheckpointStore(backend)
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    store.save(20, small_state(2), epoch=1, spec_hash="h")
    store.wait()
    key = next(o.key for o in backend.list("it-00000020/") if o.key.endswith("state.pt"))
    data = bytearray(backend.get(key))
    data[len(data) // 2] ^= 0xFF  # stored damaged (S3's CRC then matches the damaged bytes)
    backend.put(key, bytes(data))
    with caplog.at_level(logging.WARNING, logger="elastic_ops.checkpoint"):
        ref = store.latest()
    assert ref is not None and ref.iteration == 10
    assert store.load(ref)["step"] == 1
    assert any(
        "it-00000020" in r.getMessage() and "fails verification" in r.getMessage() for r in caplog.records
    )


class _CrcFailing:
    """A client whose downloads of data objects fail botocore's CRC32 check ``times`` times."""

    def __init__(self, client: Any, times: int) -> None:
        self._client, self.times, self.failed = client, times, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def get_object(self, **params: Any) -> Any:
        if params["Key"].endswith("state.pt") and self.failed < self.times:
            self.failed += 1
            raise bce.FlexibleChecksumError(error_msg="Expected checksum AAAA did not match BBBB")
        return self._client.get_object(**params)


@pytest.mark.parametrize(("times", "expected"), [(1, 20), (2, 10)], ids=["on-the-way", "at-rest"])
def test_crc_mismatch_of_a_default_client_is_reread_then_damage(
    s3_endpoint: S3Endpoint, caplog: pytest.LogCaptureFixture, times: int, expected: int
) -> None:
    client = _CrcFailing(s3_endpoint.client(), times)
    store = CheckpointStore(S3Backend(s3_endpoint.bucket, "job", client=client))
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    store.save(20, small_state(2), epoch=1, spec_hash="h")
    store.wait()
    with caplog.at_level(logging.WARNING, logger="elastic_ops.checkpoint"):
        ref = store.latest()
    assert ref is not None and ref.iteration == expected
    assert store.load(ref)["step"] == expected // 10
    assert client.failed == times
    skipped = [r.getMessage() for r in caplog.records if "skipping damaged" in r.getMessage()]
    assert len(skipped) == (times - 1) and all("checksum S3 stored" in m for m in skipped)
