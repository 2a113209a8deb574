"""The NCF example (parameter servers): its data, its hit rate, bitwise across a rescale."""

from __future__ import annotations

import pytest
import torch

from elastic_ops.examples import load_spec
from elastic_ops.examples.ncf import NCF, generate
from elastic_ops.runtime import ChunkStatus, Schedule, run_job


def test_the_data_is_deterministic_and_leaves_the_held_out_item_out_of_training():
    a, b = generate(50, 200, 8, 2, 4, 3.0, 0), generate.__wrapped__(50, 200, 8, 2, 4, 3.0, 0)
    assert all(torch.equal(a[k], b[k]) for k in a)
    held = a["test_items"][:, 0]
    pos = a["label"] == 1
    trained = set(zip(a["user"][pos].tolist(), a["item"][pos].tolist(), strict=True))
    assert not any((u, int(i)) in trained for u, i in enumerate(held))
    negatives = a["test_items"][:, 1:]
    assert not any((u, int(i)) in trained for u in range(50) for i in negatives[u])
    assert len(a["user"]) == 50 * 7 * 3  # 7 positives per user, 2 negatives each


def test_the_shipped_spec_is_embedding_heavy_and_parameter_served():
    spec = load_spec("ncf")
    assert spec.parameter_server and spec.servers == 2 and spec.virtual_shards == 8
    assert NCF(**spec.params).parameter_share() >= 0.9


@pytest.mark.slow
def test_ncf_rescaled_equals_one_worker_and_learns_beyond_popularity(tmp_path):
    base = load_spec("ncf").replace(total_iterations=400, chunk_iterations=200, checkpoint_interval=100,
                                    params={**load_spec("ncf").params, "users": 300, "items": 300})
    one = run_job(base.replace(checkpoint=f"file://{tmp_path}/one"), schedule=Schedule.constant(1))
    spec = base.replace(checkpoint=f"file://{tmp_path}/two")
    two = run_job(spec, schedule=Schedule.parse("2,3", spec, 0, 400))
    assert one.status is two.status is ChunkStatus.COMPLETED
    assert two.param_sha256 == one.param_sha256 and two.metrics == one.metrics
    assert one.metrics["hit_rate"] > 0.3  # chance: 0.10
