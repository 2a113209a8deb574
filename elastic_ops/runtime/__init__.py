"""The elastic training runtime: Trainables, deterministic data order, consistency modes,
workers and launchers, the chunk runner. Never imports Airflow. See docs/runtime.md.

The names below load on first use (PEP 562): importing a torch-free submodule such as
:mod:`elastic_ops.runtime.outcome` must not pull torch into a light Airflow task process.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "ChunkResult": "elastic_ops.runtime.outcome",
    "ChunkStatus": "elastic_ops.runtime.outcome",
    "Progress": "elastic_ops.runtime.outcome",
    "run_chunk": "elastic_ops.runtime.chunk",
    "Schedule": "elastic_ops.runtime.job",
    "run_job": "elastic_ops.runtime.job",
    "param_sha256": "elastic_ops.runtime.state",
    "Trainable": "elastic_ops.runtime.trainable",
    "load_trainable": "elastic_ops.runtime.trainable",
    "load_trainable_class": "elastic_ops.runtime.trainable",
}

__all__ = [
    "ChunkResult",
    "ChunkStatus",
    "Progress",
    "Schedule",
    "Trainable",
    "load_trainable",
    "load_trainable_class",
    "param_sha256",
    "run_chunk",
    "run_job",
]

if TYPE_CHECKING:
    from elastic_ops.runtime.chunk import run_chunk
    from elastic_ops.runtime.job import Schedule, run_job
    from elastic_ops.runtime.outcome import ChunkResult, ChunkStatus, Progress
    from elastic_ops.runtime.state import param_sha256
    from elastic_ops.runtime.trainable import Trainable, load_trainable, load_trainable_class


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
