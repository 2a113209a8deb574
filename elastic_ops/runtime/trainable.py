"""The ``Trainable`` base class a user's model subclasses, and entrypoint loading."""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from elastic_ops.errors import EntrypointError


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


def find_trainable_module(entrypoint: str) -> None:
    """Check that the module of ``package.module:Class`` can be found, running none of its
    code nor its packages' (what a long-lived process checks: an import would run the user's
    import-time code there and keep that module, stale, for every later chunk). The top-level
    name is asked of ``sys.meta_path``'s finders, as ``import`` asks them (installed, editable
    and zipped packages); the names below it are looked up in their package's folders, as the
    path finder would. That the class exists is checked where the workers import it."""
    if not isinstance(entrypoint, str) or ":" not in entrypoint:
        raise EntrypointError("entrypoint", entrypoint, "must be 'package.module:TrainableClass'")
    module_name = entrypoint.partition(":")[0]
    parts = module_name.split(".")
    locations: list[str] | None = None
    for k, part in enumerate(parts):
        name = ".".join(parts[: k + 1])
        if name in sys.modules:
            found = list(getattr(sys.modules[name], "__path__", None) or []) if k + 1 < len(parts) else []
            kind = "package" if found or k + 1 == len(parts) else "module"
        elif locations is None:
            kind, found = _top_level(name)
        else:
            kind, found = _below(part, locations)
        if kind is None or (k + 1 < len(parts) and kind == "module"):
            why = "is not importable" if kind is None else "is not a package"
            raise EntrypointError("entrypoint", entrypoint,
                                  f"module {module_name!r} cannot be found ({name!r} {why})")
        locations = found


def _top_level(name: str) -> tuple[str | None, list[str]]:
    for finder in sys.meta_path:
        try:
            spec = finder.find_spec(name, None)
        except (AttributeError, ImportError, ValueError):  # a legacy finder, or one that refuses
            continue
        if spec is not None:
            where = spec.submodule_search_locations
            return ("package", list(where)) if where is not None else ("module", [])
    return None, []


def _below(part: str, locations: Sequence[str]) -> tuple[str | None, list[str]]:
    """Where ``part`` is in the folders of its package: a package (a folder with ``__init__``),
    a module file, or the portions of a namespace package (folders without one)."""
    portions = []
    for loc in locations:
        base = os.path.join(loc, part)
        if os.path.isdir(base) and any(os.path.isfile(os.path.join(base, "__init__" + x)) for x in _SUFFIXES):
            return "package", [base]
        if any(os.path.isfile(base + x) for x in _SUFFIXES):
            return "module", []
        if os.path.isdir(base):
            portions.append(base)
    return ("package", portions) if portions else (None, [])


_SUFFIXES = tuple(importlib.machinery.all_suffixes())


def load_trainable_class(entrypoint: str) -> type[Trainable]:
    """Import ``package.module:Class`` and check that it is a ``Trainable`` subclass."""
    if not isinstance(entrypoint, str) or ":" not in entrypoint:
        raise EntrypointError("entrypoint", entrypoint, "must be 'package.module:TrainableClass'")
    module_name, _, attr = entrypoint.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or an error raised while importing user code
        raise EntrypointError(
            "entrypoint",
            entrypoint,
            f"module {module_name!r} cannot be imported ({type(exc).__name__}: {exc})",
        ) from exc
    cls = getattr(module, attr, None)
    if cls is None:
        raise EntrypointError("entrypoint", entrypoint, f"module {module_name!r} has no attribute {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, Trainable)):
        raise EntrypointError(
            "entrypoint",
            entrypoint,
            "must name a subclass of elastic_ops.runtime.Trainable",
            hint=f"{attr} is {type(cls).__name__}",
        )
    missing = [m for m in REQUIRED_METHODS if getattr(cls, m) is getattr(Trainable, m)]
    if missing:  # caught here, not as NotImplementedError inside every worker
        raise EntrypointError(
            "entrypoint", entrypoint, f"must implement {', '.join(m + '()' for m in missing)}",
            hint=f"{cls.__qualname__} leaves them to Trainable, which only raises NotImplementedError",
        )
    return cls


def load_trainable(entrypoint: str, params: Mapping[str, Any] | None = None) -> Trainable:
    return load_trainable_class(entrypoint)(**dict(params or {}))


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
