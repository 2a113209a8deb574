"""The elastic training runtime: Trainables, deterministic data order, consistency modes,
workers and launchers, the chunk runner. Never imports Airflow. See docs/runtime.md."""

from __future__ import annotations

from elastic_ops.runtime.chunk import ChunkResult, ChunkStatus, Progress, run_chunk
from elastic_ops.runtime.job import Schedule, run_job
from elastic_ops.runtime.state import param_sha256
from elastic_ops.runtime.trainable import Trainable, load_trainable, load_trainable_class

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
