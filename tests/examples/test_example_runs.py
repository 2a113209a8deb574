"""The shipped digits spec trained by the real runtime (worker processes, checkpoints)."""

from __future__ import annotations

import pytest

from elastic_ops.examples import load_spec
from elastic_ops.runtime import ChunkStatus, Schedule, run_job

pytestmark = pytest.mark.slow


def _short_digits(tmp_path, name: str):
    """digits.yaml shortened to 40 iterations (2 chunks), checkpoints under ``tmp_path``."""
    return load_spec("digits").replace(
        total_iterations=40, chunk_iterations=20, checkpoint_interval=20,
        checkpoint=f"file://{tmp_path / name}",
    )


def test_digits_bitwise_rescaled_run_equals_single_worker_run(tmp_path):
    single = run_job(_short_digits(tmp_path, "one"), schedule=Schedule.constant(1))
    rescaled = run_job(_short_digits(tmp_path, "two"), schedule=Schedule((0, 20), (2, 1)))
    assert single.status is rescaled.status is ChunkStatus.COMPLETED
    assert [w for _, w, _ in rescaled.workers_timeline] == [2, 1]
    assert rescaled.param_sha256 == single.param_sha256
    assert rescaled.metrics == single.metrics
    assert set(single.metrics) == {"test_accuracy", "test_loss"}
    assert single.metrics["test_accuracy"] > 0.85  # 40 of the spec's 300 iterations
