"""What a chunk try reports: its terminal status, progress while it runs, and its result.

Torch-free on purpose: the agent's client (inside a light Airflow task process) rebuilds a
``ChunkResult`` from the agent's JSON without importing the runtime's heavy parts.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

# The loss history a chunk's result carries: the last optimizer steps' losses, as many as the
# training state keeps (runtime/state.py). Every step of a chunk of up to this many iterations.
LOSS_HISTORY_MAX = 1000


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
    """How a chunk try ended. ``loss_history``: ``(iteration, loss)`` of the chunk's optimizer
    steps, the iteration being the boundary the step reached (as in :class:`Progress`): the
    last :data:`LOSS_HISTORY_MAX` steps of the chunk, those trained by an earlier try before
    the checkpoint this one resumed from included (the training state carries them)."""

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
    loss_history: list[tuple[int, float]] = dataclasses.field(default_factory=list)
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
        d["loss_history"] = [list(t) for t in self.loss_history]
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
        fields["loss_history"] = checked_loss_history(d.get("loss_history") or [])
        return cls(**fields)


def checked_loss_history(value: Any) -> list[tuple[int, float]]:
    """``value`` (a result's ``loss_history`` as JSON) as ``(iteration, loss)`` pairs; a
    ``ValueError`` unless it is a list of at most :data:`LOSS_HISTORY_MAX` pairs of an integer
    iteration >= 1, strictly increasing, and a finite number."""
    allowed = (f"a list of at most {LOSS_HISTORY_MAX} [iteration, loss] pairs, iterations increasing "
               "from 1, losses finite")
    if not isinstance(value, list) or len(value) > LOSS_HISTORY_MAX:
        raise ValueError(f"loss_history must be {allowed}")
    out: list[tuple[int, float]] = []
    for pair in value:
        ok = isinstance(pair, list | tuple) and len(pair) == 2
        it, loss = pair if ok else (None, None)
        ok = ok and isinstance(it, int) and not isinstance(it, bool) and it > (out[-1][0] if out else 0)
        ok = ok and isinstance(loss, int | float) and not isinstance(loss, bool) and math.isfinite(loss)
        if not ok:
            raise ValueError(f"loss_history must be {allowed}; got {pair!r} after {out[-1:] or 'none'}")
        out.append((it, float(loss)))
    return out


def loss_steps(entries: Any, reached: int, start: int, upto: int) -> list[tuple[int, float]]:
    """The ``(iteration, loss)`` pairs of a training state's loss history (its
    ``metrics.loss``: ``[iteration a step started at, loss]``, the last entry's step reaching
    ``reached``, the state's iteration) for the steps that reached an iteration in
    ``(start, upto]``: a chunk's. A step's iteration is where the next one started (an adaptive
    job's step may advance several). Steps without a finite loss (a script that gave none) are
    left out."""
    rows = [(int(e[0]), e[1]) for e in entries if isinstance(e, list | tuple) and len(e) == 2]
    ends = [it for it, _ in rows[1:]] + [int(reached)] if rows else []
    out: list[tuple[int, float]] = []
    for (_, loss), it in zip(rows, ends, strict=True):
        finite_loss = isinstance(loss, int | float) and not isinstance(loss, bool) and math.isfinite(loss)
        if start < it <= upto and finite_loss and (not out or it > out[-1][0]):
            out.append((it, float(loss)))
    return out[-LOSS_HISTORY_MAX:]


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
