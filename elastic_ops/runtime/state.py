"""The training state that moves between segments and into checkpoints.

A state is a nested dict of tensors, numbers, strings, lists and dicts only, so that it loads
with ``torch.load(..., weights_only=True)`` (no code execution) and fits the checkpoint store:

``format, iteration, cursor, model, optimizer, scheduler, rng{torch, numpy, python},
metrics{loss: [[it, loss]...], eval: [[it, {...}]...]}, lr_ramp{from, to, start}`` and, for an
adaptive job, ``adaptive{base, carry, sqr_sum, var_sum, weight, batches}`` (runtime/adaptive.py).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from pathlib import Path
from typing import IO, Any

import torch

from elastic_ops.checkpoint.codec import capture_rng, check_layout, restore_rng
from elastic_ops.runtime.outcome import LOSS_HISTORY_MAX

__all__ = ["capture_rng", "restore_rng", "build_state", "param_sha256", "load_state", "save_atomic"]

FORMAT = 1
# the loss of the last N optimizer steps is kept in the metrics history (and a chunk result carries it)
LOSS_HISTORY = LOSS_HISTORY_MAX


def param_sha256(model_state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the bytes of every tensor of a model ``state_dict``, in its order."""
    h = hashlib.sha256()
    for name, tensor in model_state.items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DistributedDataParallel wrapper (scripts may pass either)."""
    return getattr(model, "module", model)


def build_state(
    *,
    iteration: int,
    cursor: int,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    metrics: dict[str, Any],
    lr_ramp: dict[str, float] | None = None,
    adaptive: dict[str, Any] | None = None,
) -> dict[str, Any]:
    extra = {"adaptive": adaptive} if adaptive is not None else {}
    return {
        "format": FORMAT,
        "iteration": int(iteration),
        "cursor": int(cursor),
        "model": {k: v.detach().cpu().clone() for k, v in unwrap(model).state_dict().items()},
        "optimizer": _to_cpu(optimizer.state_dict()) if optimizer is not None else {},
        "scheduler": scheduler.state_dict() if scheduler is not None else {},
        "rng": capture_rng(),
        "metrics": {
            "loss": list(metrics.get("loss", []))[-LOSS_HISTORY:],
            "eval": list(metrics.get("eval", [])),
        },
        "lr_ramp": dict(lr_ramp or {}),
        **extra,
    }


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def save_atomic(state: dict[str, Any], path: str | Path) -> None:
    """``torch.save`` to a temporary name, then rename: readers never see a partial file.

    The temporary file is ``archive.pt`` in a private directory: ``torch.save`` names the zip's
    top directory after the file, and under that name the bytes are exactly what
    :func:`elastic_ops.checkpoint.encode_state` gives, so a staged file can be committed as it
    is (``CheckpointStore.save_file``) and an identical retry is still recognised as identical.
    """
    path = Path(path)
    tmp_dir = path.with_name(f".{path.name}.{os.getpid()}.d")
    tmp_dir.mkdir(exist_ok=True)
    try:
        tmp = tmp_dir / "archive.pt"
        try:
            torch.save(state, tmp)
        except RuntimeError as exc:
            raise _full(tmp_dir) or exc from exc
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _full(where: Path) -> OSError | None:
    """A full file system as the OSError it is: torch's zip writer reports a failed write as its
    own ``RuntimeError`` ("unexpected pos 704 vs 598"), which says nothing of the disk."""
    try:
        st = os.statvfs(where)
    except OSError:
        return None
    if st.f_bavail * st.f_frsize >= DISK_FULL_BELOW:
        return None
    return OSError(errno.ENOSPC, f"No space left on device while staging a checkpoint in {where.parent}")


DISK_FULL_BELOW = 1 << 20  # free bytes under which a failed torch.save is taken for a full disk


def load_state(path: str | Path | IO[bytes], *, mmap: bool = False) -> dict[str, Any]:
    """Load a staged state; ``weights_only=True`` refuses anything that would execute code.

    ``mmap=True`` maps the file instead of reading it (tensors read only where touched): for a
    look at part of a state, e.g. :func:`param_sha256` of its model, not for training from it.
    """
    check_layout(path)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
