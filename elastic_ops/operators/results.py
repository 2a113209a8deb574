"""The typed XCom result of a chunk task (a JSON dict on the wire)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ChunkTaskResult:
    """What one chunk task did. ``workers_timeline`` holds ``[iteration, workers, unix_time]``."""

    job: str
    chunk_index: int
    start: int
    end: int
    status: str                       # completed | already_done | stopped (the job met stop_when earlier)
    iterations: int                   # iterations trained by this task (all its grants)
    workers_timeline: list[list[float]]
    samples_per_sec: float
    loss: float | None
    metrics: dict[str, float]
    checkpoint_uri: str | None
    param_sha256: str | None
    epochs: list[int]                 # fencing epochs of the grants this task ran under
    hosts: list[str]                  # hosts the grants held slots on (the pool's view)
    preemptions: int
    waited_s: float
    duration_s: float
    train_samples_per_sec: float = 0.0  # samples / time inside the training loops (last grant)
    # where the workers ran: the granted host's node agent (cluster), else this task's machine
    trained_on: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ChunkTaskResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
