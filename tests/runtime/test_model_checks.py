"""What the runtime tells a user about a model whose training would differ from what they expect."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from elastic_ops.errors import UserCodeError
from elastic_ops.runtime import run_chunk
from elastic_ops.runtime.model_checks import check_scheduler, metric_values, norm_layer_warning
from tests.runtime.builders import make_spec


def test_a_plateau_scheduler_is_refused_before_training(tmp_path):
    """It failed at iteration 0 with "step() missing 'metrics'" (a probe)."""
    spec = make_spec(tmp_path, params={"plateau": True}, total_iterations=2)
    with pytest.raises(UserCodeError, match="ReduceLROnPlateau, which steps on a metric.*StepLR"):
        run_chunk(spec, 0, 2, target=lambda i: 1)
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    check_scheduler(torch.optim.lr_scheduler.StepLR(opt, 1))
    check_scheduler(None)


@pytest.mark.parametrize("value", [[0.1, 0.2], "high", {"a": 1}, torch.ones(3)])
def test_a_metric_that_is_not_a_number_is_named(tmp_path, value):
    """A list failed in float() after the whole chunk, naming neither the key nor the rule."""
    with pytest.raises(TypeError, match=r"evaluate\(\) returned 'top5': .* which is not a number"):
        metric_values({"accuracy": 0.5, "top5": value})
    spec = make_spec(tmp_path, params={"eval_extra": {"top5": [0.1, 0.2]}}, total_iterations=2)
    with pytest.raises(UserCodeError, match=r"evaluate\(\) returned 'top5': \[0.1, 0.2\]"):
        run_chunk(spec, 0, 2, target=lambda i: 1)


def test_numbers_of_any_kind_are_metrics():
    got = metric_values({"a": 1, "b": torch.tensor(0.5), "c": np.float32(0.25), "d": True, 3: 2.0})
    assert got == {"a": 1.0, "b": 0.5, "c": 0.25, "d": 1.0, "3": 2.0}
    assert metric_values(None) == {}
    with pytest.raises(TypeError, match=r"evaluate\(\) returned \[0.5\]; it must return a dict"):
        metric_values([0.5])


def test_batchnorm_is_named_in_a_warning_that_says_what_depends_on_the_workers():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    fast = norm_layer_warning(model, "fast")
    assert "'1'" in fast and "gradients, not only the running statistics, depend on the worker count" in fast
    assert "running statistics, evaluate() and param_sha256 depend" in norm_layer_warning(model, "bitwise")
    other_norms = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.GroupNorm(2, 4))
    assert norm_layer_warning(other_norms, "fast") is None


@pytest.mark.parametrize("consistency", ["bitwise", "fast"])
def test_a_parameter_no_worker_uses_gets_no_gradient_as_in_a_plain_loop(tmp_path, consistency):
    """It got a zero gradient, so weight decay moved it (a probe's aux head ended 2 % smaller
    than in a plain loop). Now ``p.grad`` is None where no worker's loss used ``p``, as under
    DDP with ``find_unused_parameters``: the optimizer leaves it alone, on any schedule."""
    from elastic_ops.checkpoint import open_store
    from tests.runtime.builders import TinyMLP

    params = {"aux_head": True, "weight_decay": 0.1}
    torch.manual_seed(7)  # the runtime seeds the model with data_seed
    initial = TinyMLP(**params).build_model().state_dict()
    finals = []
    for name, schedule in (("one", lambda i: 1), ("many", lambda i: 1 + i % 3)):
        extra = {"virtual_shards": 6} if consistency == "bitwise" else {"virtual_shards": None}
        spec = make_spec(tmp_path / name, params=params, total_iterations=6, consistency=consistency, **extra)
        result = run_chunk(spec, 0, 6, target=schedule)
        store = open_store(spec.checkpoint)
        model = store.load(store.latest())["model"]
        assert torch.equal(model["aux.weight"], initial["aux.weight"])  # not decayed
        assert not torch.equal(model["body.0.weight"], initial["body.0.weight"])  # trained, and decayed
        finals.append(result.param_sha256)
    if consistency == "bitwise":
        assert finals[0] == finals[1]
