"""The torch-free chunk outcome types and the runtime package's lazily loaded names."""

from __future__ import annotations

import subprocess
import sys

import elastic_ops.runtime as runtime
from elastic_ops.runtime.outcome import ChunkResult, ChunkStatus


def make_result(**overrides) -> ChunkResult:
    fields = dict(
        status=ChunkStatus.PREEMPTED,
        start=0,
        end=30,
        iteration=17,
        checkpoint_uri="file:///c/it-17",
        loss=0.25,
        metrics={"acc": 0.9},
        workers_timeline=[(0, 2, 1.0), (10, 3, 2.5)],
        samples_per_sec=100.0,
        duration_s=3.0,
        param_sha256="ab" * 32,
        train_samples_per_sec=120.0,
    )
    return ChunkResult(**{**fields, **overrides})


def test_a_result_survives_its_json_round_trip():
    result = make_result()
    wire = result.to_dict()
    assert wire["status"] == "preempted" and wire["workers_timeline"] == [[0, 2, 1.0], [10, 3, 2.5]]
    assert ChunkResult.from_dict({**wire, "added_by_a_newer_sender": 1}) == result


def test_every_exported_name_resolves():
    for name in runtime.__all__:
        assert getattr(runtime, name) is not None
    assert set(runtime.__all__) <= set(dir(runtime))


def test_the_outcome_types_do_not_import_torch():
    code = "import sys, elastic_ops.runtime.outcome; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
