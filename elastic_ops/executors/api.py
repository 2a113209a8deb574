"""The executor contract: where a granted chunk trains, as one object the operator talks to.

Three executors implement it — in the task process (:mod:`.in_process`), on the per-host agent
(:mod:`.host_agent`) and on a cluster's node agents (:mod:`.node`) — and the hook chooses one,
once, from the environment (:func:`elastic_ops.executors.executor_from_env`). The operator
never asks the environment again: it asks the executor which host a grant trains on, which
hosts a grant must avoid, what the latest checkpoint is, and to run the chunk under a lease.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from elastic_ops.executors.progress import progress_logger
from elastic_ops.runtime.allocation import Allocation
from elastic_ops.runtime.outcome import ChunkResult, Progress
from elastic_ops.spec import JobSpec

if TYPE_CHECKING:
    from elastic_ops.agent.protocol import StoreConfig
    from elastic_ops.checkpoint.store import CheckpointStore


@dataclasses.dataclass(frozen=True)
class LatestCheckpoint:
    """The job's latest committed checkpoint, as the "already done?" check reads it."""

    iteration: int
    uri: str
    metrics: Mapping[str, Any]

    @classmethod
    def of(cls, found: tuple[int, str, Mapping[str, Any]] | None) -> LatestCheckpoint | None:
        """From an agent's ``(iteration, uri, metrics)`` answer (``None``: no checkpoint yet)."""
        return None if found is None else cls(int(found[0]), str(found[1]), dict(found[2]))


@dataclasses.dataclass(frozen=True)
class ChunkRequest:
    """One grant's training: iterations ``[start, end)`` of ``spec`` under fencing ``epoch``,
    led from ``host`` (the executor's :meth:`ChunkExecutor.host_of` the grant)."""

    spec: JobSpec
    start: int
    end: int
    epoch: int
    host: str
    warm_start: str | None = None


class Lease(Protocol):
    """What an executor needs of the chunk's lease (:class:`elastic_ops.operators.lease.LeaseKeeper`):
    the pool's target as one :class:`Allocation` (for a boundary, or now), and where to report
    the segments that really start and the progress they make."""

    hosts_used: set[str]

    def target(self, iteration: int) -> Allocation: ...

    def current(self) -> Allocation: ...

    def applied(self, iteration: int, allocation: Allocation) -> None: ...

    def progressed(self, p: Progress) -> None: ...


class Stores(Protocol):
    """Where an executor opens checkpoint stores (the hook: the Airflow connections' credentials)."""

    def store(self, uri: str, *, keep_last: int = 3, keep_every: int | None = None) -> CheckpointStore: ...

    def store_config(self, uri: str, *, keep_last: int = 3, keep_every: int | None = None) -> StoreConfig: ...


class PoolHosts(Protocol):
    """The pool as an executor reads it: its hosts (``status()["hosts"]``)."""

    def status(self) -> dict[str, Any]: ...


class ChunkExecutor(abc.ABC):
    """Runs granted chunks somewhere. Subclasses implement :meth:`latest` and :meth:`run`; the
    placement questions default to "this task's process trains, on any host"."""

    def __init__(self, stores: Stores, log: logging.Logger | logging.LoggerAdapter[Any]) -> None:
        self.stores = stores
        self.log = log

    def avoid_hosts(self) -> list[str]:
        """Hosts a grant must avoid because this executor could not train there."""
        return []

    def host_of(self, placements: Sequence[tuple[str, int]]) -> str:
        """The host a grant with ``placements`` trains from (its first slot's host)."""
        return placements[0][0]

    def can_train_on(self, host: str) -> bool:
        """Whether a grant on ``host`` can still train (asked when the grant comes)."""
        return True

    def trained_on(self, host: str, lease: Lease) -> set[str]:
        """Where the workers of a chunk led from ``host`` ran (this task's machine)."""
        return {socket.gethostname()}

    @abc.abstractmethod
    def latest(self, spec: JobSpec) -> LatestCheckpoint | None:
        """The latest committed checkpoint of ``spec``'s job (None: none yet)."""

    @abc.abstractmethod
    def run(self, request: ChunkRequest, lease: Lease) -> ChunkResult:
        """Train ``request`` following ``lease``'s target; the runtime's result or its error."""

    def abort(self) -> None:  # noqa: B027 - optional: in the task process the workers stop with it
        """The task is being killed: stop the workers now (safe in a signal handler)."""

    # --- shared by the executors --------------------------------------------------------------

    def _store_config(self, spec: JobSpec) -> StoreConfig:
        return self.stores.store_config(spec.checkpoint_uri(), keep_last=spec.keep_last,
                                        keep_every=spec.keep_every)

    def _progress(self, request: ChunkRequest, lease: Lease) -> Callable[[Progress], None]:
        """Every boundary's progress: logged, and timed for the pool's heartbeats."""
        logged = progress_logger(self.log, request.spec.name)

        def on_progress(p: Progress) -> None:
            logged(p)
            lease.progressed(p)

        return on_progress
