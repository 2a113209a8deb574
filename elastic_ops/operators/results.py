"""The typed XCom result of a chunk task (a JSON dict on the wire)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from elastic_ops.runtime.outcome import ChunkResult


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


@dataclasses.dataclass(frozen=True)
class ChunkTry:
    """What one try of a chunk task carries from grant to grant, through its deferrals (the
    trigger's ``state``, as :meth:`to_dict`): the rendered spec, the range, and what the try has
    done so far. Every grant's training returns a new one (:meth:`after`)."""

    spec: dict[str, Any]              # the rendered JobSpec's wire form
    chunk_index: int
    start: int
    end: int
    started_at: float                 # unix time the try began
    warm_start: str | None = None     # the previous model to start from (first chunk, not yet trained)
    preemptions: int = 0
    timeline: tuple[tuple[float, ...], ...] = ()   # (iteration, workers, unix_time) of every segment
    epochs: tuple[int, ...] = ()      # fencing epochs of the grants trained on
    hosts: tuple[str, ...] = ()       # hosts the grants held slots on
    trained_on: tuple[str, ...] = ()  # where the workers ran
    trained: int = 0                  # iterations trained by this try
    waited_s: float = 0.0             # time spent waiting for grants
    deferred_at: float | None = None  # unix time of the deferral in flight
    asked_at: float | None = None     # unix time the deferred request was first asked

    @property
    def job(self) -> str:
        return str(self.spec["name"])

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["timeline"] = [list(t) for t in self.timeline]
        for key in ("epochs", "hosts", "trained_on"):
            d[key] = list(d[key])
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ChunkTry:
        """The inverse of :meth:`to_dict` (the trigger hands the dict back unchanged)."""
        def opt_float(key: str) -> float | None:
            return None if data.get(key) is None else float(data[key])

        return cls(
            spec=dict(data["spec"]), chunk_index=int(data["chunk_index"]), start=int(data["start"]),
            end=int(data["end"]), started_at=float(data["started_at"]), warm_start=data.get("warm_start"),
            preemptions=int(data.get("preemptions", 0)),
            timeline=tuple(tuple(t) for t in data.get("timeline") or ()),
            epochs=tuple(int(e) for e in data.get("epochs") or ()),
            hosts=tuple(str(h) for h in data.get("hosts") or ()),
            trained_on=tuple(str(h) for h in data.get("trained_on") or ()),
            trained=int(data.get("trained", 0)), waited_s=float(data.get("waited_s", 0.0)),
            deferred_at=opt_float("deferred_at"), asked_at=opt_float("asked_at"),
        )

    def resumed(self, now: float, waited_fallback: float) -> tuple[ChunkTry, float]:
        """Back from a deferral at unix time ``now``: the try with the wait counted (from the
        deferral, not the trigger's start, which the triggerer may pick up late), and how long
        the request was asked for in all (the ``chunk.wait`` metric)."""
        waited = now - self.deferred_at if self.deferred_at is not None else waited_fallback
        asked_at = self.asked_at if self.asked_at is not None else self.deferred_at
        asked_for = now - asked_at if asked_at is not None else waited
        back = dataclasses.replace(self, waited_s=self.waited_s + max(0.0, waited), deferred_at=None,
                                   asked_at=None)
        return back, max(0.0, asked_for)

    def after(self, epoch: int, hosts: Sequence[str], where: set[str], result: ChunkResult) -> ChunkTry:
        """This try after one grant's training returned ``result`` (a ``ChunkResult``)."""
        # from where this run resumed (its first segment's start), not the chunk's start: after a
        # preemption the same try resumes mid-chunk, and those iterations were counted already
        begun = result.workers_timeline[0][0] if result.workers_timeline else result.start
        return dataclasses.replace(
            self, timeline=self.timeline + tuple(tuple(t) for t in result.workers_timeline),
            epochs=self.epochs + (epoch,), hosts=tuple(sorted(set(self.hosts) | set(hosts))),
            trained_on=tuple(sorted(set(self.trained_on) | where)),
            trained=self.trained + max(0, int(result.iteration) - int(begun)),
        )

    def result(
        self, *, status: str, checkpoint_uri: str | None, now: float, result: ChunkResult | None = None
    ) -> ChunkTaskResult:
        """The task's XCom result (``result``: the last grant's, if one trained)."""
        return ChunkTaskResult(
            job=self.job, chunk_index=self.chunk_index, start=self.start, end=self.end, status=status,
            iterations=self.trained, workers_timeline=[list(t) for t in self.timeline],
            samples_per_sec=float(result.samples_per_sec or 0.0) if result else 0.0,
            loss=result.loss if result else None, metrics=dict(result.metrics or {}) if result else {},
            checkpoint_uri=checkpoint_uri, param_sha256=result.param_sha256 if result else None,
            epochs=list(self.epochs), hosts=list(self.hosts), preemptions=self.preemptions,
            waited_s=self.waited_s, duration_s=now - self.started_at,
            train_samples_per_sec=float(result.train_samples_per_sec or 0.0) if result else 0.0,
            trained_on=list(self.trained_on),
        )
