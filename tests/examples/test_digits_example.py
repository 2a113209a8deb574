"""DigitsMLP: deterministic data, a working model, the accuracy the docs promise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from elastic_ops.errors import SpecError
from elastic_ops.examples import digits, load_spec
from elastic_ops.examples.digits import DigitsMLP


def _fresh_split(**kw):
    digits.load_split.cache_clear()
    return digits.load_split(**kw)


def test_split_is_identical_across_loads():
    first = {k: v.tobytes() for k, v in _fresh_split().items()}
    second = {k: v.tobytes() for k, v in _fresh_split().items()}
    assert first == second


def test_split_shapes_partition_and_standardisation():
    s = _fresh_split()
    assert s["x_train"].shape == (1438, 64) and s["x_test"].shape == (359, 64)
    assert s["x_train"].dtype.name == "float32" and s["y_train"].dtype.name == "int64"
    assert set(s["y_train"]) == set(range(10)) and set(s["y_test"]) == set(range(10))
    # train and test together are the whole data set, each sample once
    import numpy as np
    from sklearn.datasets import load_digits

    everything = np.concatenate([s["y_train"], s["y_test"]])
    assert (np.bincount(everything) == np.bincount(load_digits().target)).all()
    varying = s["x_train"].std(axis=0) > 0
    assert abs(s["x_train"][:, varying].mean(axis=0)).max() < 1e-5
    assert abs(s["x_train"][:, varying].std(axis=0) - 1).max() < 1e-4


def test_split_seed_changes_the_split():
    a, b = _fresh_split(split_seed=0), _fresh_split(split_seed=1)
    assert a["y_test"].tobytes() != b["y_test"].tobytes()


def test_dataset_items_are_feature_label_pairs():
    ds = DigitsMLP().train_dataset()
    x, y = ds[0]
    assert len(ds) == 1438 and x.shape == (64,) and x.dtype == torch.float32 and y.dtype == torch.int64


def test_model_init_ignores_global_rng_state():
    torch.manual_seed(1)
    a = DigitsMLP().build_model()
    torch.manual_seed(2)
    b = DigitsMLP().build_model()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_one_step_lowers_the_loss():
    t = DigitsMLP()
    model, batch = t.build_model(), default_collate([t.train_dataset()[i] for i in range(64)])
    opt = t.build_optimizer(model)
    before = t.loss(model, batch)
    opt.zero_grad()
    before.backward()
    opt.step()
    assert float(t.loss(model, batch).detach()) < float(before.detach())


def test_loss_is_the_mean_of_equal_shard_losses():
    """Virtual-shard reduction averages shard losses; that equals the batch loss only for a mean."""
    t = DigitsMLP()
    model, batch = t.build_model(), default_collate([t.train_dataset()[i] for i in range(64)])
    shards = [t.loss(model, (batch[0][k : k + 8], batch[1][k : k + 8])) for k in range(0, 64, 8)]
    assert torch.allclose(t.loss(model, batch), torch.stack(shards).mean(), atol=1e-6)


def test_evaluate_returns_documented_metrics_and_keeps_train_mode():
    t = DigitsMLP()
    model = t.build_model()
    metrics = t.evaluate(model)
    assert set(metrics) == {"test_accuracy", "test_loss"}
    assert 0 <= metrics["test_accuracy"] <= 1 and metrics["test_loss"] > 0
    assert model.training


def test_training_is_deterministic(plain_train):
    a, _ = plain_train(DigitsMLP(), global_batch=64, iterations=15)
    b, _ = plain_train(DigitsMLP(), global_batch=64, iterations=15)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize(
    ("params", "field"),
    [({"lr": 0}, "params.lr"), ({"hidden": 1.5}, "params.hidden"),
     ({"test_fraction": 1}, "params.test_fraction"), ({"momentum": 0.9}, "params.momentum")],
)
def test_bad_params_name_the_parameter(params, field):
    with pytest.raises(SpecError) as info:
        DigitsMLP(**params)
    assert info.value.field == field


@pytest.mark.parametrize("seed", [0, 1])
def test_reaches_95_percent_with_the_shipped_spec_budget(plain_train, seed):
    spec = load_spec("digits")
    trainable = DigitsMLP(**spec.params)
    model, losses = plain_train(
        trainable, global_batch=spec.global_batch, iterations=spec.total_iterations, seed=seed
    )
    assert len(losses) == 300
    assert trainable.evaluate(model)["test_accuracy"] >= 0.95


def test_digits_data_read_without_scikit_learn_matches_load_digits():
    """The fast CSV path must give exactly the arrays ``load_digits`` gives."""
    from sklearn.datasets import load_digits

    from elastic_ops.examples.digits import _load_digits_arrays

    x, y = _load_digits_arrays()
    reference = load_digits()
    assert np.array_equal(x, reference.data.astype(np.float64))
    assert np.array_equal(y, reference.target.astype(np.int64))
