"""An MLP on scikit-learn's bundled handwritten digits (8x8 images, 10 classes, 1797 samples).

The data ships inside scikit-learn (``sklearn.datasets.load_digits``), so nothing is
downloaded. The train/test split is a fixed permutation from ``split_seed``; features are
standardised with the training split's mean and standard deviation. With the shipped spec
(``digits.yaml``: global batch 64, 300 iterations) it reaches about 97 % test accuracy.

Parameters (``JobSpec.params``):

``lr`` (0.002), ``hidden`` (128), ``depth`` (2 hidden layers), ``weight_decay`` (1e-4, AdamW),
``test_fraction`` (0.2), ``split_seed`` (0), ``init_seed`` (0: the parameter initialisation,
independent of the worker count and of anything seeded before).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from elastic_ops.examples import params as P
from elastic_ops.runtime.trainable import Trainable

SCHEMA = {
    "lr": (0.002, P.positive_float),
    "hidden": (128, P.positive_int),
    "depth": (2, P.positive_int),
    "weight_decay": (1e-4, P.non_negative_float),
    "test_fraction": (0.2, P.fraction),
    "split_seed": (0, P.non_negative_int),
    "init_seed": (0, P.non_negative_int),
}

NUM_FEATURES = 64
NUM_CLASSES = 10


def _load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """Pixels (float64) and labels (int64) of scikit-learn's bundled digits data.

    Reads the CSV that ``sklearn.datasets.load_digits`` parses, without importing scikit-learn:
    that import costs ~2.4 s of CPU in every worker process of every chunk (measured), far more
    than training a chunk of this model. Falls back to ``load_digits`` if the file moves.
    """
    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is not None and path.is_file():
        raw = np.loadtxt(path, delimiter=",")
        return raw[:, :-1].astype(np.float64), raw[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.data.astype(np.float64), data.target.astype(np.int64)


@functools.lru_cache(maxsize=8)
def load_split(test_fraction: float = 0.2, split_seed: int = 0) -> dict[str, np.ndarray]:
    """The standardised split: ``x_train, y_train, x_test, y_test`` (float32 / int64 arrays).

    Cached per process; callers must not modify the arrays (they are marked read-only).
    """
    x, y = _load_digits_arrays()
    order = np.random.default_rng(split_seed).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    mean = x[train].mean(axis=0)
    std = x[train].std(axis=0)
    std[std == 0] = 1.0  # border pixels that are always 0 in the training split
    scaled = ((x - mean) / std).astype(np.float32)
    split = {
        "x_train": scaled[train], "y_train": y[train], "x_test": scaled[test], "y_test": y[test],
    }
    for arr in split.values():
        arr.setflags(write=False)
    return split


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


class DigitsMLP(Trainable):
    """Classifies 8x8 digit images with a ReLU MLP trained by AdamW on cross-entropy."""

    PARAMS = SCHEMA  # the parameters it takes: a misspelt one is refused before workers start

    def __init__(self, **params: object) -> None:
        super().__init__(**P.parse(params, SCHEMA))

    def _split(self) -> dict[str, np.ndarray]:
        return load_split(self.params["test_fraction"], self.params["split_seed"])

    def build_model(self) -> nn.Module:
        # Initialise from our own seed so the model never depends on what ran before.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.params["init_seed"])
            layers: list[nn.Module] = []
            width = NUM_FEATURES
            for _ in range(self.params["depth"]):
                layers += [nn.Linear(width, self.params["hidden"]), nn.ReLU()]
                width = self.params["hidden"]
            layers.append(nn.Linear(width, NUM_CLASSES))
            return nn.Sequential(*layers)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            model.parameters(), lr=self.params["lr"], weight_decay=self.params["weight_decay"]
        )

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> None:
        return None

    def train_dataset(self) -> TensorDataset:
        """``(features[64] float32, label int64)`` pairs of the training split."""
        split = self._split()
        return TensorDataset(torch.tensor(split["x_train"]), torch.tensor(split["y_train"]))

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        device = _device_of(model)
        return F.cross_entropy(model(x.to(device)), y.to(device))

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """``test_accuracy`` (0..1) and ``test_loss`` (mean cross-entropy) on the test split."""
        split = self._split()
        device = _device_of(model)
        x = torch.tensor(split["x_test"], device=device)
        y = torch.tensor(split["y_test"], device=device)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                logits = model(x)
        finally:
            model.train(was_training)
        return {
            "test_accuracy": float((logits.argmax(dim=1) == y).float().mean()),
            "test_loss": float(F.cross_entropy(logits, y)),
        }
