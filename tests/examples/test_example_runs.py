"""The shipped digits spec trained by the real runtime (worker processes, checkpoints)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic_ops.checkpoint import open_store
from elastic_ops.examples import load_spec
from elastic_ops.examples.digits import DigitsMLP
from elastic_ops.runtime import ChunkStatus, Schedule, run_job
from elastic_ops.spec import JobSpec

REPO = Path(__file__).resolve().parents[2]

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


def _final_model(uri: str) -> dict:
    store = open_store(uri)
    return store.load(store.latest())["model"]


def test_ddp_script_trains_the_same_model_as_the_trainable(tmp_path):
    """Script mode (examples/ddp_script.py, rescaled 2 -> 1) follows the Trainable's trajectory."""
    script = JobSpec.from_yaml(REPO / "examples" / "ddp_script.yaml").replace(
        entrypoint=str(REPO / "examples" / "ddp_script.py"), total_iterations=30, chunk_iterations=30,
        checkpoint_interval=30, checkpoint=f"file://{tmp_path / 'script'}",
    )
    trainable = load_spec("digits-fast").replace(
        total_iterations=30, chunk_iterations=30, checkpoint_interval=30,
        checkpoint=f"file://{tmp_path / 'trainable'}",
    )
    assert run_job(script, schedule=Schedule((0, 15), (2, 1))).status is ChunkStatus.COMPLETED
    assert run_job(trainable, schedule=Schedule.constant(1)).status is ChunkStatus.COMPLETED
    a, b = _final_model(script.checkpoint), _final_model(trainable.checkpoint)
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    digits = DigitsMLP()
    model = digits.build_model()
    model.load_state_dict(a)
    assert digits.evaluate(model)["test_accuracy"] > 0.85


def test_chartransformer_with_dropout_is_bitwise_across_worker_counts(tmp_path):
    """A real transformer (LayerNorm, attention, embeddings, dropout) under bitwise consistency."""

    def spec(name):
        return load_spec("chartransformer").replace(
            name=name, total_iterations=6, chunk_iterations=6, checkpoint_interval=6,
            global_batch=8, consistency="bitwise", virtual_shards=4, max_workers=2,
            params={"context": 16, "stride": 16, "d_model": 32, "heads": 2, "layers": 1, "dropout": 0.2},
            checkpoint=f"file://{tmp_path / name}",
        )

    one = run_job(spec("one"), schedule=Schedule.constant(1))
    two = run_job(spec("two"), schedule=Schedule((0, 3), (2, 1)))
    assert one.param_sha256 == two.param_sha256
    assert one.metrics == two.metrics and set(one.metrics) == {"val_loss", "val_bpc"}
