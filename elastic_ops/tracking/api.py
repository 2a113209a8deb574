"""The experiment-tracking contract: what the chunk path tells a tracker, and nothing else.

A DAG chooses a tracking (``elastic_training(..., tracking=MlflowTracking(...))``): a
:class:`Tracking`, which opens the job's :class:`JobRun` for each task of the job (register,
every chunk try, finalize). Every task of one elastic job resumes the same run: a tracker finds
it by the job's identity (:class:`TrackedJob`), never creating one run per chunk or per try.

The layers that have the data call the run: the lease keeper at every iteration boundary
(:meth:`JobRun.progressed`) and rescale (:meth:`JobRun.rescaled`), the chunk operator at a
grant, a chunk end, a preemption and a failure, finalize with the trained model. A tracker that
fails must not fail training: :func:`guarded` wraps a run so that its errors are warnings in the
task log, unless the tracking is ``strict`` (then a retryable :class:`TrackingError`).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from elastic_ops.errors import TrackingError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from elastic_ops.runtime.outcome import ChunkResult, Progress
    from elastic_ops.spec import JobSpec

Log = logging.Logger | logging.LoggerAdapter[Any]
_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@]+@")  # scheme://user:password@


@dataclasses.dataclass(frozen=True)
class TrackedJob:
    """The job a task records, and which task it is. ``spec.name`` (``<dag>.<group>.<run id>``)
    is the job's identity: the same for every task and try of one DAG run's training."""

    spec: JobSpec
    dag_id: str
    run_id: str
    group_id: str
    task_id: str
    try_number: int | None = None


class JobRun(Protocol):
    """One elastic job's run in a tracker, as one task sees it. Calls come from the task's
    threads (``progressed`` from the runner's); an implementation must not block them long."""

    def granted(self, epoch: int, workers: int, hosts: tuple[str, ...]) -> None:
        """A grant of ``workers`` on ``hosts`` under fencing ``epoch`` starts training (a newer
        epoch than a racing try's: that try's records stop)."""

    def progressed(self, p: Progress) -> None:
        """An iteration boundary: its loss, worker count and throughput."""

    def rescaled(self, iteration: int, workers: int, previous: int, reason: str | None) -> None:
        """The chunk went from ``previous`` to ``workers`` workers at ``iteration``."""

    def chunk_ended(self, chunk_index: int, result: ChunkResult) -> None:
        """A grant's training returned: the chunk's end (its evaluation metrics) or a preemption."""

    def preempted(self, iteration: int) -> None:
        """The pool took every worker at ``iteration`` (the state there is committed)."""

    def failed(self, error: BaseException, *, host: str | None, final: bool) -> None:
        """A try failed (``final``: no retry follows; the run ends as failed)."""

    def finalized(self, summary: Mapping[str, Any], model: Callable[[], nn.Module] | None,
                  weights: Callable[[], dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
        """The job is complete: record ``model()`` (the Trainable's model with the final
        checkpoint's weights), or for a script entrypoint, which has no class to build a model
        from, ``weights()`` (its final ``state_dict``); end the run; what to add to the model
        Asset's extra."""

    def close(self) -> None:
        """The task is ending (or deferring): send what is buffered, within a bounded time."""


class NoRun:
    """Records nothing: the run of a job that has no tracking."""

    def granted(self, epoch: int, workers: int, hosts: tuple[str, ...]) -> None:
        return None

    def progressed(self, p: Progress) -> None:
        return None

    def rescaled(self, iteration: int, workers: int, previous: int, reason: str | None) -> None:
        return None

    def chunk_ended(self, chunk_index: int, result: ChunkResult) -> None:
        return None

    def preempted(self, iteration: int) -> None:
        return None

    def failed(self, error: BaseException, *, host: str | None, final: bool) -> None:
        return None

    def finalized(self, summary: Mapping[str, Any], model: Callable[[], nn.Module] | None,
                  weights: Callable[[], dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return None


NO_RUN = NoRun()


class Tracking(abc.ABC):
    """A DAG's choice of tracker (a frozen dataclass of its settings). ``strict``: a tracking
    failure fails the task (retryably) instead of a warning."""

    strict: bool = False

    @property
    @abc.abstractmethod
    def kind(self) -> str:
        """The tracker's name in messages (``mlflow``)."""

    @abc.abstractmethod
    def open(self, job: TrackedJob, log: Log) -> JobRun:
        """Find the job's run (create it the first time) and resume it for this task."""

    def check_entrypoint(self, entrypoint: str) -> None:
        """Refuse, when the DAG is parsed, what this tracking cannot do for ``entrypoint``
        (a ``SpecError`` naming the setting)."""
        return None

    def redact(self, text: str) -> str:
        """``text`` (an error's message, for the task log) without the tracker's secrets."""
        return without_userinfo(text)


def without_userinfo(text: str) -> str:
    """``text`` with every URL's ``user:password@`` taken out."""
    return _USERINFO.sub(r"\1", text)


class Guarded:
    """A :class:`JobRun` whose errors never reach training: each is a warning in the task log
    (once per kind of call), or, ``strict``, a retryable :class:`TrackingError`."""

    def __init__(self, run: JobRun, tracking: Tracking, log: Log) -> None:
        self._run, self._tracking, self._log = run, tracking, log
        self._kind, self._strict = tracking.kind, tracking.strict
        self._warned: set[str] = set()

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the tracker's, whatever it is
            said = self._tracking.redact(f"{type(exc).__name__}: {exc}")
            if self._strict:
                raise TrackingError(f"{self._kind} tracking failed to record {what}: {said}",
                                    hint="the tracking is strict=True; without it this is a "
                                    "warning and training goes on") from None
            if what not in self._warned:
                self._warned.add(what)
                self._log.warning("%s tracking could not record %s (%s); training goes on", self._kind,
                                  what, said)
            return None

    def granted(self, epoch: int, workers: int, hosts: tuple[str, ...]) -> None:
        self._call("the grant", self._run.granted, epoch, workers, hosts)

    def progressed(self, p: Progress) -> None:
        self._call("progress", self._run.progressed, p)

    def rescaled(self, iteration: int, workers: int, previous: int, reason: str | None) -> None:
        self._call("a rescale", self._run.rescaled, iteration, workers, previous, reason)

    def chunk_ended(self, chunk_index: int, result: ChunkResult) -> None:
        self._call("the chunk's end", self._run.chunk_ended, chunk_index, result)

    def preempted(self, iteration: int) -> None:
        self._call("a preemption", self._run.preempted, iteration)

    def failed(self, error: BaseException, *, host: str | None, final: bool) -> None:
        self._call("a failure", self._run.failed, error, host=host, final=final)

    def finalized(self, summary: Mapping[str, Any], model: Callable[[], nn.Module] | None,
                  weights: Callable[[], dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
        return self._call("the final model", self._run.finalized, summary, model, weights) or {}

    def close(self) -> None:
        self._call("the buffered metrics", self._run.close)


def open_run(tracking: Tracking | None, job: TrackedJob, log: Log) -> JobRun:
    """The job's run for this task, guarded (:class:`NO_RUN` without tracking, or when the
    tracker cannot be reached and the tracking is not strict)."""
    if tracking is None:
        return NO_RUN
    try:
        run = tracking.open(job, log)
    except Exception as exc:  # noqa: BLE001 - an unreachable server, a missing package, …
        said = tracking.redact(f"{type(exc).__name__}: {exc}")  # an error may quote the URI it used
        if tracking.strict:
            if isinstance(exc, TrackingError):
                raise
            raise TrackingError(f"{tracking.kind} tracking of job {job.spec.name} could not start: {said}",
                                hint="the tracking is strict=True") from None
        log.warning("%s tracking of job %s is off for this task (%s); training goes on", tracking.kind,
                    job.spec.name, said)
        return NO_RUN
    return Guarded(run, tracking, log)
