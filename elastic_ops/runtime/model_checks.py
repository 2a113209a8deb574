"""What the runtime can tell about a user's model that makes its training differ from what the
user expects: refused at once where it cannot work, warned about where it works differently.

Warnings go to the worker's stderr (the chunk's log), from rank 0 only, once per segment.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from elastic_ops.errors import short_repr

NORM_LAYERS = (torch.nn.modules.batchnorm._BatchNorm,)


def warn(message: str) -> None:
    print(f"elastic_ops: warning: {message}", file=sys.stderr, flush=True)


def check_scheduler(scheduler: Any) -> None:
    """The runtime steps the scheduler once per iteration, without arguments."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TypeError(
            "build_scheduler() returned a ReduceLROnPlateau, which steps on a metric; elastic_ops steps "
            "the scheduler once per iteration without one: return an iteration-based LRScheduler "
            "(StepLR, CosineAnnealingLR, OneCycleLR, LambdaLR, SequentialLR, ...)"
        )


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def norm_layer_warning(model: torch.nn.Module, consistency: str) -> str | None:
    """Batch normalisation sees only part of the global batch on each worker (see docs/examples.md,
    "Rules that keep training independent of the worker count")."""
    layers = [name or "<model>" for name, m in model.named_modules() if isinstance(m, NORM_LAYERS)]
    if not layers:
        return None
    if consistency == "bitwise":
        return (
            f"BatchNorm layers {_names(layers)} normalise over each virtual shard (the same for any worker "
            "count), but each worker updates their running statistics from its own shards and the "
            "checkpoint keeps rank 0's: running statistics, evaluate() and param_sha256 depend on the "
            "worker schedule; use GroupNorm or LayerNorm for results identical on any schedule"
        )
    return (
        f"BatchNorm layers {_names(layers)} normalise over each worker's share of the global batch: in "
        "consistency 'fast' the gradients, not only the running statistics, depend on the worker count; "
        "use GroupNorm or LayerNorm for training independent of it"
    )


def metric_values(result: Any, where: str = "evaluate()") -> dict[str, float]:
    """``evaluate()``'s mapping as floats, or a ``TypeError`` naming the key and the value."""
    if result is None:
        return {}
    if not isinstance(result, Mapping):
        raise TypeError(f"{where} returned {short_repr(result, 80)}; it must return a dict of metric "
                        "names to numbers (or None)")
    out: dict[str, float] = {}
    for key, value in result.items():
        out[str(key)] = _number(where, key, value)
    return out


def _number(where: str, key: Any, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: a tensor of many elements
        raise TypeError(f"{where} returned {key!r}: {short_repr(value, 80)}, which is not a number "
                        f"({exc}); each metric must be a number, a 0-d tensor or a numpy scalar") from None
