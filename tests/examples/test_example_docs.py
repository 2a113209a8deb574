"""The Trainable recipe in docs/examples.md is real code that trains."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from elastic_ops.runtime import Trainable, load_trainable_class
from elastic_ops.spec import Consistency, JobSpec

DOC = Path(__file__).resolve().parents[2] / "docs" / "examples.md"


def _block(lang: str, after: str) -> str:
    text = DOC.read_text()
    section = text[text.index(after):]
    return re.search(rf"```{lang}\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def recipe_module(tmp_path, monkeypatch):
    """The documented class saved as ``mymodels/diabetes.py`` on ``sys.path``, as the doc says."""
    (tmp_path / "mymodels").mkdir()
    (tmp_path / "mymodels" / "diabetes.py").write_text(_block("python", "## Writing your own Trainable"))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_documented_spec_validates_and_names_the_recipe(recipe_module):
    spec = JobSpec.from_dict(yaml.safe_load(_block("yaml", "## Writing your own Trainable")))
    assert spec.consistency is Consistency.BITWISE and spec.virtual_shards == spec.max_workers
    cls = load_trainable_class(spec.entrypoint)
    assert issubclass(cls, Trainable) and cls(**spec.params).params == {"lr": 0.05}


def test_documented_trainable_learns(recipe_module):
    cls = load_trainable_class("mymodels.diabetes:DiabetesRegression")
    trainable = cls(lr=0.05)
    torch.manual_seed(0)
    model = trainable.build_model()
    optimizer = trainable.build_optimizer(model)
    dataset = trainable.train_dataset()
    before = trainable.evaluate(model)["r2"]
    generator = torch.Generator().manual_seed(0)
    for _ in range(100):
        batch = trainable.fetch(dataset, torch.randint(len(dataset), (32,), generator=generator))
        loss = trainable.loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = trainable.evaluate(model)["r2"]
    assert after > before and after > 0.4  # a linear model explains about half the variance
