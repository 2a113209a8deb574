"""Manifests are parsed strictly; an invalid one makes its checkpoint invisible."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastic_ops.checkpoint import InvalidStateError, open_store
from elastic_ops.checkpoint.manifest import FileEntry, Manifest, parse_manifest
from elastic_ops.errors import CheckpointCorruptError, CheckpointError, SpecError
from tests.checkpoint.builders import small_state

SHA = "a" * 64


def make_manifest_doc(**changes) -> dict:
    files = (FileEntry("d-x/state.pt", SHA, 10),)
    doc = json.loads(Manifest(iteration=20, epoch=3, spec_hash="h", created=1.5, files=files).to_json())
    doc.update(changes)
    return doc


@given(
    iteration=st.integers(0, 10**9),
    epoch=st.integers(0, 2**62),
    size=st.integers(0, 2**40),
    metrics=st.dictionaries(st.text(max_size=5), st.floats(allow_nan=False) | st.integers() | st.none()),
)
def test_manifest_round_trips(iteration: int, epoch: int, size: int, metrics: dict) -> None:
    m = Manifest(iteration, epoch, "spec", 12.0, (FileEntry("d-1/state.pt", SHA, size),), metrics)
    back = parse_manifest(m.to_json(), where="x")
    assert back == m and back.metrics == metrics


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"format_version": 99}, "format_version=99"),
        ({"format": "other"}, "format must be"),
        ({"iteration": -1}, "iteration=-1"),
        ({"epoch": "3"}, "epoch='3'"),
        ({"files": []}, "non-empty"),
        ({"files": [{"name": "../../etc/passwd", "sha256": SHA, "size": 1}]}, "not a relative path"),
        ({"files": [{"name": "/abs/state.pt", "sha256": SHA, "size": 1}]}, "not a relative path"),
        ({"files": [{"name": "d/state.pt", "sha256": "xyz", "size": 1}]}, "not a hex digest"),
        ({"files": [{"name": "d/state.pt", "sha256": SHA, "size": -5}]}, "size -5"),
    ],
)
def test_invalid_manifest_is_refused_with_reason(changes: dict, why: str) -> None:
    with pytest.raises(CheckpointCorruptError, match=why):
        parse_manifest(json.dumps(make_manifest_doc(**changes)).encode(), where="it-20")


def test_checkpoint_with_invalid_manifest_does_not_exist(tmp_path) -> None:
    store = open_store(f"file://{tmp_path}")
    store.save(10, small_state(1), epoch=1, spec_hash="h")
    (tmp_path / "it-00000020").mkdir()
    (tmp_path / "it-00000020/manifest.json").write_text(json.dumps(make_manifest_doc(format_version=2)))
    assert [r.iteration for r in store.list()] == [10]
    assert store.latest().iteration == 10


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("relative/path", "must be 'file:///absolute/path' or 's3://bucket/prefix'"),
        ("file://relative", "three slashes"),
        ("gs://bucket/x", "must be 'file:///absolute/path'"),
        ("s3:///prefix-only", "bucket name is missing"),
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
