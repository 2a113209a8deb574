"""The ``Trainable`` base class a user's model subclasses, and entrypoint loading."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from elastic_ops.errors import EntrypointError
from elastic_ops.runtime.entrypoints import find_trainable_module  # noqa: F401 - its old home


class Trainable:
    """A model written once, trained with any number of workers.

    Subclass it and implement ``build_model``, ``build_optimizer``, ``train_dataset`` and
    ``loss``; ``build_scheduler`` and ``evaluate`` are optional. The spec's ``params`` are passed
    to ``__init__`` as keyword arguments. ``loss`` must return the *mean* loss over the batch it
    is given (the runtime scales it by the batch's share of the global batch).

    The scheduler, if any, is stepped once per iteration, after the optimizer; ``before_step``
    (optional) sees the iteration's global gradient first, e.g. to clip it.
    """

    def __init__(self, **params: Any) -> None:
        self.params = dict(params)

    def build_model(self) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} must implement build_model()")

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        raise NotImplementedError(f"{type(self).__name__} must implement build_optimizer(model)")

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> Any | None:
        return None

    def train_dataset(self) -> torch.utils.data.Dataset:
        raise NotImplementedError(f"{type(self).__name__} must implement train_dataset()")

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement loss(model, batch)")

    def before_step(self, model: nn.Module) -> None:
        """Called once per iteration, before ``optimizer.step()``, with the gradient of the global
        batch's mean loss in each parameter's ``.grad`` (``None`` where no worker's loss used
        it): the same on every worker, and in bitwise mode the same bits for any worker count.
        Clip it here (``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)``); changing
        ``.grad`` in place is what the optimizer then sees."""

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {}

    def fetch(self, dataset: Any, indices: torch.Tensor) -> Any:
        """Build the batch for ``indices`` (override for custom collation).

        ``TensorDataset`` is indexed directly (one gather per tensor); other map-style data
        sets are indexed sample by sample and collated with PyTorch's ``default_collate``.
        """
        if isinstance(dataset, torch.utils.data.TensorDataset):
            return tuple(t[indices] for t in dataset.tensors)
        from torch.utils.data import default_collate

        return default_collate([dataset[int(i)] for i in indices])


REQUIRED_METHODS = ("build_model", "build_optimizer", "train_dataset", "loss")


def load_trainable_class(entrypoint: str) -> type[Trainable]:
    """Import ``package.module:Class`` and check that it is a ``Trainable`` subclass."""
    if not isinstance(entrypoint, str) or ":" not in entrypoint:
        raise EntrypointError("entrypoint", entrypoint, "must be 'package.module:TrainableClass'")
    module_name, _, attr = entrypoint.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or an error raised while importing user code
        where = ""
        if isinstance(exc, ImportError):  # say which process looked, and where
            import sys

            from elastic_ops.runtime.entrypoints import this_process

            where = f" in {this_process()}, whose sys.path is {sys.path}"
        raise EntrypointError(
            "entrypoint",
            entrypoint,
            f"module {module_name!r} cannot be imported{where} ({type(exc).__name__}: {exc})",
        ) from exc
    cls = getattr(module, attr, None)
    if cls is None:
        raise EntrypointError("entrypoint", entrypoint, f"module {module_name!r} has no attribute {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, Trainable)):
        raise EntrypointError(
            "entrypoint", entrypoint,
            f"must name a subclass of elastic_ops.runtime.Trainable; {attr} is {_what(cls)}",
            hint=_how_to_wrap(attr) if isinstance(cls, type) and issubclass(cls, nn.Module) else
            "see docs/examples.md, \"Writing your own Trainable\"",
        )
    missing = [m for m in REQUIRED_METHODS if getattr(cls, m) is getattr(Trainable, m)]
    if missing:  # caught here, not as NotImplementedError inside every worker
        raise EntrypointError(
            "entrypoint", entrypoint, f"must implement {', '.join(m + '()' for m in missing)}",
            hint=f"{cls.__qualname__} leaves them to Trainable, which only raises NotImplementedError",
        )
    return cls


def _what(obj: object) -> str:
    """What a message says an object is: "an nn.Module subclass (a model)", "a function", …"""
    if isinstance(obj, type):
        if issubclass(obj, nn.Module):
            return "a torch.nn.Module subclass (a model, not a Trainable)"
        bases = ", ".join(b.__name__ for b in obj.__bases__)
        return f"a class not derived from Trainable (its bases: {bases})"
    if callable(obj):
        return f"a {type(obj).__name__}, not a class"
    return f"a {type(obj).__name__} instance, not a class"


def _how_to_wrap(model: str) -> str:
    return (f"wrap the model in a Trainable: `class {model}Job(Trainable):` with `build_model(self): return "
            f"{model}(**self.params)`, build_optimizer, train_dataset and loss, and name that class "
            "(docs/examples.md, \"Writing your own Trainable\")")


def load_trainable(entrypoint: str, params: Mapping[str, Any] | None = None) -> Trainable:
    """The Trainable, built with ``params``, checked against the parameters it declares first
    (a worker of an agent whose task never imported the model: the message names the misspelt
    parameter, not a TypeError's traceback)."""
    from elastic_ops.runtime.entrypoints import check_params

    cls, given = load_trainable_class(entrypoint), dict(params or {})
    check_params(cls, given)
    return cls(**given)


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return (
            type(batch)(to_device(v, device) for v in batch)
            if isinstance(batch, tuple)
            else [to_device(v, device) for v in batch]
        )
    return batch
