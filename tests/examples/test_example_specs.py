"""The shipped YAML specs: valid, importable, identical in the package and the checkout."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from elastic_ops.errors import SpecError
from elastic_ops.examples import EXAMPLES, load_spec, spec_path
from elastic_ops.runtime import Trainable
from elastic_ops.spec import Consistency, JobSpec

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", EXAMPLES)
def test_spec_validates_and_names_itself(name):
    spec = JobSpec.from_yaml(spec_path(name))
    assert spec.name == name
    assert spec.checkpoint is None  # defaults to file://<cwd>/checkpoints/<name>
    assert spec.checkpoint_uri("checkpoints").endswith(f"/checkpoints/{name}")


@pytest.mark.parametrize("name", EXAMPLES)
def test_checkout_path_resolves_to_the_packaged_spec(name):
    checkout = REPO / "examples" / f"{name}.yaml"
    assert checkout.resolve() == spec_path(name).resolve()
    assert JobSpec.from_yaml(checkout) == load_spec(name)


@pytest.mark.parametrize("name", EXAMPLES)
def test_entrypoint_builds_with_the_spec_params(name):
    spec = load_spec(name)
    module, _, cls = spec.entrypoint.partition(":")
    trainable = getattr(importlib.import_module(module), cls)(**spec.params)
    assert isinstance(trainable, Trainable)
    assert len(trainable.train_dataset()) >= spec.global_batch


def test_script_mode_spec_names_the_checkout_script():
    spec = JobSpec.from_yaml(REPO / "examples" / "ddp_script.yaml")
    assert (REPO / spec.entrypoint).is_file()  # relative to the repository root, where you run it
    assert spec.consistency is Consistency.FAST  # the only mode script mode supports
    assert all(spec.global_batch % n == 0 for n in (1, 2, 4))  # the documented schedule splits evenly


def test_at_least_one_bitwise_example():
    spec = load_spec("digits")
    assert spec.consistency is Consistency.BITWISE
    assert (spec.global_batch, spec.virtual_shards, spec.max_workers) == (64, 8, 8)
    assert load_spec("digits-fast").consistency is Consistency.FAST


def test_fast_and_bitwise_digits_train_the_same_job():
    bitwise, fast = load_spec("digits"), load_spec("digits-fast")
    same = ("entrypoint", "total_iterations", "global_batch", "data_seed", "params")
    assert all(getattr(bitwise, k) == getattr(fast, k) for k in same)


def test_unknown_example_is_a_clear_error():
    with pytest.raises(SpecError) as info:
        spec_path("mnist")
    assert info.value.field == "example" and "digits" in info.value.allowed
