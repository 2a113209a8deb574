"""Manifests are parsed strictly; an invalid one makes its checkpoint invisible."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastic_ops.checkpoint import Checksum, InvalidStateError, open_store
from elastic_ops.checkpoint.manifest import FileEntry, Manifest, parse_manifest
from elastic_ops.errors import CheckpointCorruptError, CheckpointError, SpecError
from tests.checkpoint.builders import small_state

SHA = "a" * 64
XXH = "b" * 32


def make_manifest_doc(**changes) -> dict:
    files = (FileEntry("d-x/state.pt", Checksum.XXH3_128, XXH, 10),)
    doc = json.loads(Manifest(iteration=20, epoch=3, spec_hash="h", created=1.5, files=files).to_json())
    doc.update(changes)
    return doc


@given(
    iteration=st.integers(0, 10**9),
    epoch=st.integers(0, 2**62),
    size=st.integers(0, 2**40),
    metrics=st.dictionaries(st.text(max_size=5), st.floats(allow_nan=False) | st.integers() | st.none()),
    algorithm=st.sampled_from(Checksum),
)
def test_manifest_round_trips(
    iteration: int, epoch: int, size: int, metrics: dict, algorithm: Checksum
) -> None:
    entry = FileEntry(
        "d-1/state.pt", algorithm, {Checksum.SHA256: SHA, Checksum.XXH3_128: XXH}[algorithm], size
    )
    m = Manifest(iteration, epoch, "spec", 12.0, (entry,), metrics)
    back = parse_manifest(m.to_json(), where="x")
    assert back == m and back.metrics == metrics


def test_format_version_1_manifest_is_read_as_sha256() -> None:
    doc = make_manifest_doc(format_version=1, files=[{"name": "d-x/state.pt", "sha256": SHA, "size": 10}])
    m = parse_manifest(json.dumps(doc).encode(), where="it-20")
    assert m.files == (FileEntry("d-x/state.pt", Checksum.SHA256, SHA, 10),)


V2 = {"algorithm": "xxh3-128", "digest": XXH}


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"format_version": 99}, "format_version=99"),
        ({"format": "other"}, "format must be"),
        ({"iteration": -1}, "iteration=-1"),
        ({"epoch": "3"}, "epoch='3'"),
        ({"files": []}, "non-empty"),
        ({"format_version": True}, "format_version=True"),
        ({"files": [{"name": "../../etc/passwd", **V2, "size": 1}]}, "not a relative path"),
        ({"files": [{"name": "/abs/state.pt", **V2, "size": 1}]}, "not a relative path"),
        # a '.' component: a local store refused the key with a bare ValueError when a writer
        # checked such a damaged manifest, and the iteration could not be committed again
        ({"files": [{"name": "d/./state.pt", **V2, "size": 1}]}, "not a relative path"),
        # no state file: latest() returned the checkpoint, load() failed instead of falling back,
        # and committing the iteration again was a CommitConflictError for good
        ({"files": [{"name": "d/other.bin", **V2, "size": 1}]}, "lists 0 state.pt files"),
        ({"files": [{"name": "d/state.pt", **V2, "size": 1}, {"name": "e/state.pt", **V2, "size": 1}]},
         "lists 2 state.pt files"),
        (
            {"files": [{"name": "d/state.pt", "algorithm": "xxh3-128", "digest": "xyz", "size": 1}]},
            "not a hex",
        ),
        ({"files": [{"name": "d/state.pt", "algorithm": "xxh3-128", "digest": SHA, "size": 1}]}, "not a hex"),
        (
            {"files": [{"name": "d/state.pt", "algorithm": "md5", "digest": XXH, "size": 1}]},
            "'md5' of d/state.pt",
        ),
        ({"files": [{"name": "d/state.pt", **V2, "size": -5}]}, "size -5"),
        # one state file twice: latest() returned it and load() failed instead of falling back
        ({"files": [{"name": "d/state.pt", **V2, "size": 1}] * 2}, "'d/state.pt' is listed twice"),
        # each version has its own entry layout: no mixing
        (
            {"files": [{"name": "d/state.pt", "sha256": SHA, "size": 1}]},
            "must have exactly algorithm, digest",
        ),
        ({"format_version": 1, "files": [{"name": "d/state.pt", **V2, "size": 1}]}, "exactly name, sha256"),
        ({"format_version": 1, "files": [{"name": "d/state.pt", "sha256": "xyz", "size": 1}]}, "not a hex"),
    ],
)
def test_invalid_manifest_is_refused_with_reason(changes: dict, why: str) -> None:
    with pytest.raises(CheckpointCorruptError, match=why):
        parse_manifest(json.dumps(make_manifest_doc(**changes)).encode(), where="it-20")


@pytest.mark.parametrize("name", ["d-x/./state.pt", "d-x/other.bin"])
def test_a_damaged_manifest_naming_a_dot_or_no_state_file_is_replaced(tmp_path, name: str) -> None:
    """Such a manifest, its file present with the right size and digest, made a local store raise
    ValueError when the iteration was committed again ('.'), or was taken for intact (no state
    file): latest() returned it, load() raised, committing again was a CommitConflictError."""
    store = open_store(f"file://{tmp_path}")
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    store.save(20, small_state(2), epoch=1, spec_hash="h")
    (tmp_path / "it-00000020/d-x").mkdir()
    (tmp_path / "it-00000020/d-x/other.bin").write_bytes(b"bytes")
    doc = json.loads((tmp_path / "it-00000020/manifest.json").read_text())
    digest = Checksum.XXH3_128.hexdigest(b"bytes")
    doc["files"] = [{"name": name, "algorithm": "xxh3-128", "digest": digest, "size": 5}]
    (tmp_path / "it-00000020/manifest.json").write_text(json.dumps(doc))
    assert store.latest().iteration == 10
    ref = store.save(20, small_state(2), epoch=1, spec_hash="h")  # replaces the damaged one
    assert store.latest() == ref and store.load(ref)["step"] == 2


def test_checkpoint_with_invalid_manifest_does_not_exist(tmp_path) -> None:
    store = open_store(f"file://{tmp_path}")
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    (tmp_path / "it-00000020").mkdir()
    (tmp_path / "it-00000020/manifest.json").write_text(json.dumps(make_manifest_doc(format_version=99)))
    assert [r.iteration for r in store.list()] == [10]
    assert store.latest().iteration == 10


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("relative/path", "must be 'file:///absolute/path' or 's3://bucket/prefix'"),
        ("file://relative", "three slashes"),
        ("gs://bucket/x", "must be 'file:///absolute/path'"),
        ("s3:///prefix-only", "bucket name is missing"),
        ("s3://BAD/x", "a bucket name has 3-63 lowercase letters"),  # as the spec refuses it
        ("s3://-bucket-/x", "starts and ends with a letter or digit"),
        # urlparse would put what follows '?' or '#' (the Airflow layer's '/<run_id>') into the
        # query or fragment: two runs would open the same store
        ("s3://bucket/models?v=2/run-1", "no '\\?', '#'"),
        ("file:///tmp/ck#x/run-1", "no '\\?', '#'"),
        ("file:///tmp/%00x", "NUL"),
    ],
)
def test_bad_uri_names_the_value_and_what_is_allowed(uri: str, message: str) -> None:
    with pytest.raises(SpecError, match=message) as err:
        open_store(uri)
    assert err.value.field == "checkpoint" and err.value.value == uri


def test_bad_retention_settings_are_refused(tmp_path) -> None:
    with pytest.raises(SpecError, match="keep_last=0"):
        open_store(f"file://{tmp_path}", keep_last=0)
    with pytest.raises(SpecError, match="keep_every=-1"):
        open_store(f"file://{tmp_path}", keep_every=-1)


def test_bad_metrics_or_state_are_refused_before_anything_is_written(tmp_path) -> None:
    store = open_store(f"file://{tmp_path}")
    with pytest.raises(CheckpointError, match="metrics"):
        store.save(10, small_state(1), epoch=1, spec_hash="h", metrics={"loss": object()})
    with pytest.raises(InvalidStateError):
        store.save(10, {"w": {1, 2}}, epoch=1, spec_hash="h")
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_unknown_checksum_is_refused_naming_what_is_allowed(tmp_path) -> None:
    with pytest.raises(SpecError, match="invalid checksum='md5': must be one of 'xxh3-128', 'sha256'") as err:
        open_store(f"file://{tmp_path}", checksum="md5")
    assert err.value.field == "checksum"


def test_checksums_under_different_algorithms_never_count_as_the_same_content() -> None:
    data = b"the same bytes"
    a = Manifest(20, 1, "h", 1.0, (FileEntry.of("d-1/state.pt", data, Checksum.SHA256),))
    b = Manifest(20, 1, "h", 2.0, (FileEntry.of("d-2/state.pt", data, Checksum.XXH3_128),))
    c = Manifest(20, 2, "h", 3.0, (FileEntry.of("d-3/state.pt", data, Checksum.XXH3_128),))
    assert b.same_content(c), "same bytes, same algorithm: an idempotent retry"
    assert not a.same_content(b), "digests of different algorithms cannot be compared: a conflict"


def test_a_checkpoint_uri_naming_a_file_is_a_permanent_storage_error(tmp_path) -> None:
    from elastic_ops.errors import StoragePermanentError

    (tmp_path / "afile").write_bytes(b"x")
    with pytest.raises(StoragePermanentError, match="afile is a file") as err:
        open_store(f"file://{tmp_path}/afile")
    assert not err.value.retryable
