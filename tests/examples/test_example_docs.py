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


TUTORIAL = DOC.parent / "tutorial.md"


def test_the_tutorial_trains_the_recipe_tested_here():
    """The tutorial's Trainable and spec are this recipe's, word for word (so they are tested here)."""
    tutorial = TUTORIAL.read_text()
    section = tutorial[tutorial.index("## 2. Write a Trainable"):]
    for lang in ("python", "yaml"):
        shown = re.search(rf"```{lang}\n(.*?)```", section, re.S).group(1)
        assert shown == _block(lang, "## Writing your own Trainable"), lang


def test_the_tutorial_dag_builds_its_task_group(recipe_module):
    """The tutorial's ``elastic_training(...)`` call, in a DAG, with the recipe importable as the
    tutorial says (``mymodels/`` beside the DAG file): the chunks it names, its spec fields."""
    pendulum = pytest.importorskip("pendulum")
    from airflow.sdk import DAG

    tutorial = TUTORIAL.read_text()
    step = tutorial[tutorial.index("## 4. Put it in a DAG"):]
    code = re.search(r"```python\n(.*?)```", step, re.S).group(1)
    with DAG(dag_id="tutorial", schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC")) as dag:
        exec(compile(code, str(TUTORIAL), "exec"), {})
    ids = [t.task_id for t in dag.tasks]
    assert {"train_diabetes.register", "train_diabetes.chunk_01_of_04", "train_diabetes.chunk_04_of_04",
            "train_diabetes.finalize", "train_diabetes.end_job"} <= set(ids)
    assert ("chunk_01_of_04 → … → chunk_04_of_04") in tutorial
