"""What a chunk try reports: its terminal status, progress while it runs, and its result.

Torch-free on purpose: the agent's client (inside a light Airflow task process) rebuilds a
``ChunkResult`` from the agent's JSON without importing the runtime's heavy parts.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any


class ChunkStatus(enum.StrEnum):
    """How a chunk try ended. Terminal states; a try starts in none of them.

    ``completed``: trained to ``end`` and committed. ``preempted``: the target went to 0; the
    state at ``iteration`` is committed. ``already_done``: the latest checkpoint was at or
    after ``end``; nothing ran.
    """

    COMPLETED = "completed"
    PREEMPTED = "preempted"
    ALREADY_DONE = "already_done"


@dataclasses.dataclass(frozen=True)
class Progress:
    """One iteration's report. Through the agent a non-finite number arrives as ``None``.
    ``steps``: optimizer steps taken since the chunk started (an adaptive job's step may
    advance ``iteration`` by more than one; None: one per iteration); ``batch`` the global
    batch they ran at and ``grad_sqr`` / ``grad_var`` the gradient statistics its workers
    measured (an adaptive job's; None otherwise)."""

    iteration: int
    end: int
    loss: float | None
    workers: int
    samples_per_sec: float | None
    eta_s: float | None
    steps: int | None = None
    batch: int | None = None
    grad_sqr: float | None = None
    grad_var: float | None = None


@dataclasses.dataclass(frozen=True)
class ChunkResult:
    status: ChunkStatus
    start: int
    end: int
    iteration: int
    checkpoint_uri: str | None
    loss: float | None
    metrics: dict[str, float]
    workers_timeline: list[tuple[int, int, float]]
    samples_per_sec: float
    duration_s: float
    param_sha256: str | None
    train_samples_per_sec: float = 0.0  # samples / time inside the training loops (no startup)
    # strategy parameter_server: the bytes its servers sent and received for the iterations
    # (every worker's pulls and pushes, headers included), the steps they took, and the bytes of
    # the state snapshots rank 0 gathered (checkpoints, segment ends); None under all-reduce
    ps_bytes: int | None = None
    ps_steps: int | None = None
    ps_snapshot_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        d["workers_timeline"] = [list(t) for t in self.workers_timeline]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChunkResult:
        """The inverse of :meth:`to_dict`; unknown keys are ignored (a newer sender may add some).

        Raises ``KeyError``/``TypeError``/``ValueError`` on a malformed dict; callers that read
        untrusted input turn those into their own error.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in d.items() if k in names}
        fields["status"] = ChunkStatus(d["status"])
        fields["workers_timeline"] = [tuple(t) for t in d.get("workers_timeline") or []]
        return cls(**fields)


def finite(value: Any) -> Any:
    """JSON has no NaN/inf; progress values (ETA before the first step, a diverging loss) may."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def jsonable(value: Any) -> Any:
    """``value`` with every non-finite float (a NaN metric) replaced by ``None``."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return finite(value)
