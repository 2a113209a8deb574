"""One error hierarchy for elastic_ops.

Every error says whether retrying can help (``retryable``). The Airflow layer maps
``retryable=False`` onto "fail without burning retries" and ``retryable=True`` onto Airflow's
normal retry with backoff. Messages carry the values involved and a hint.
"""

from __future__ import annotations

import reprlib


class ElasticOpsError(Exception):
    """Base class. ``retryable`` tells the caller whether another try may succeed."""

    retryable: bool = False

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(f"{message} (hint: {hint})" if hint else message)


# --- user input ---------------------------------------------------------------------------


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()
"""The value of a :class:`SpecError` about a setting that was not given at all."""


def short_repr(value: object, limit: int = 300) -> str:
    """``repr(value)`` cut to ``limit`` characters for a message. Bounded in depth and width as
    it is built, so a value that nests or repeats itself enormously (a YAML alias bomb, a 1 MB
    string sent over HTTP) costs nothing to quote and is not echoed back whole."""
    shown = reprlib.Repr()  # (keyword arguments only from Python 3.12)
    shown.maxlevel, shown.maxdict = 4, 20
    shown.maxlist = shown.maxtuple = shown.maxset = 20
    shown.maxstring = shown.maxlong = shown.maxother = limit
    try:
        text = shown.repr(value)
    except RecursionError:
        text = f"<{type(value).__name__} that contains itself>"
    return text if len(text) <= limit else text[:limit] + "…"


class SpecError(ElasticOpsError, ValueError):
    """A user-facing value is invalid (or, ``value=UNSET``, missing). Names the field, the value
    and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str, *, hint: str | None = None) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        shown = f"missing {field}" if value is UNSET else f"invalid {field}={short_repr(value)}"
        super().__init__(f"{shown}: {allowed}", hint=hint)

    def naming(self, field: str) -> SpecError:
        """The same error about ``field``: the name the user gave the value under (an option,
        an environment variable) rather than the parameter it became."""
        return type(self)(field, self.value, self.allowed, hint=self.hint)


class EntrypointError(SpecError):
    """The entrypoint cannot be imported or is not a Trainable / script."""


class EntrypointElsewhereError(EntrypointError):
    """The entrypoint imports in the task but not in the process that runs the chunk (an agent
    started without the task's folders on its path). Retryable: the deployment, not the job, is
    wrong, and a retry after the agent is fixed (or on another host) succeeds."""

    retryable = True


# --- training ----------------------------------------------------------------------------


class TrainingError(ElasticOpsError):
    """Training itself failed."""


class UserCodeError(TrainingError):
    """An exception raised by the user's model code. Deterministic: retrying will not help."""


class NonFiniteLossError(TrainingError):
    """The loss became NaN or infinite. Not retryable: the same data gives the same loss."""


class WorkerLostError(TrainingError):
    """A worker process or its host died (signal, OOM kill, lost connection). Retryable."""

    retryable = True

    def __init__(self, message: str, *, host: str | None = None, hint: str | None = None) -> None:
        self.host = host
        super().__init__(message, hint=hint)


class NodeUnavailableError(WorkerLostError):
    """No node agent took the chunk for the host the pool granted (none is running for it, or it
    did not answer in time). Retryable, and held against the host: the task reports it, so the
    retry's grant avoids that host, like a host whose workers died."""


class NodeLostError(WorkerLostError):
    """The node agent running the chunk went silent mid-chunk (its host or its process died, or
    the network between them failed). Retryable, and held against the host."""


class AgentLostError(TrainingError):
    """The host's elastic-ops agent stopped or crashed mid-chunk (its workers went with it).
    Retryable, and not held against the host: the pool does not count it as the host failing."""

    retryable = True


class AgentUnavailableError(ElasticOpsError):
    """No agent answers at the configured socket (not started, gone, or refusing)."""

    retryable = True


class AgentProtocolError(ElasticOpsError):
    """The peer broke the protocol (not JSON, too long, wrong shape). Not retryable."""


class PreemptedError(TrainingError):
    """The pool took every worker away. Not a failure: the caller checkpoints and waits again."""

    retryable = True


# --- checkpoints -------------------------------------------------------------------------


class CheckpointError(ElasticOpsError):
    """Base for checkpoint store problems."""


class InvalidStateError(CheckpointError, TypeError):
    """The state to save holds a value the safe loader could not read back. Not retryable."""

    def __init__(self, path: str, value: object, allowed: str) -> None:
        self.path = path
        super().__init__(
            f"invalid state{path}: type {type(value).__module__}.{type(value).__qualname__} is not "
            f"allowed; allowed: {allowed}",
            hint="convert it to tensors or plain lists (numpy RNG state: use capture_rng())",
        )


class CheckpointNotFoundError(CheckpointError):
    """No committed checkpoint exists where one was required."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint failed verification (checksum, manifest, format) or holds unsafe content."""


class UnsafeCheckpointError(CheckpointCorruptError):
    """A checkpoint tried to make the loader execute code. Never loaded."""


class CommitConflictError(CheckpointError):
    """Another writer already committed this iteration (conditional commit lost)."""


class StaleEpochError(CheckpointError):
    """A writer holding an old fencing epoch tried to commit. Its lease is dead; a new try gets a
    new lease (and epoch), so retrying helps."""

    retryable = True

    def __init__(self, epoch: int, current: int, *, hint: str | None = None) -> None:
        self.epoch = epoch
        self.current = current
        super().__init__(
            f"fencing epoch {epoch} is stale (current epoch is {current})",
            hint=hint or "this writer's lease expired or was replaced; its work is discarded",
        )


class StorageTransientError(CheckpointError):
    """A transient storage failure that survived all retries (5xx, throttling, timeouts)."""

    retryable = True


class StoragePermanentError(CheckpointError):
    """A storage failure that retrying cannot fix (access denied, no such bucket, credentials)."""


class StorageCredentialsExpiredError(CheckpointError):
    """The session credentials expired (or could not be refreshed) mid-task. Not retried in the
    process, whose credentials are what expired; retryable as a task: the next try gets fresh
    ones from its connection."""

    retryable = True


# --- pool --------------------------------------------------------------------------------


class PoolError(ElasticOpsError):
    """Base for resource pool problems."""


class UnknownJobError(PoolError, KeyError):
    def __init__(self, job: str) -> None:
        self.job = job
        super().__init__(
            f"unknown job {job!r}",
            hint="a job is known once its chunk task asks the pool for workers; `elastic-ops pool "
            "status` lists the known jobs",
        )

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return self.args[0]


class UnknownHostError(PoolError, KeyError):
    def __init__(self, host: str) -> None:
        self.host = host
        super().__init__(f"unknown host {host!r}", hint="list hosts with `elastic-ops pool status`")

    def __str__(self) -> str:
        return self.args[0]


class UnknownPolicyError(PoolError, ValueError):
    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        super().__init__(f"unknown policy {name!r}; known policies: {', '.join(sorted(known))}")


class JobEndedError(PoolError):
    """The job ended in the pool (its run was marked failed, its ``end_job`` teardown ran, or it
    was finished by hand) while a try still asked for workers. Not retryable: a new try (a
    cleared or retried chunk) asks again, and makes the job wait again."""

    def __init__(self, job: str) -> None:
        self.job = job
        super().__init__(
            f"job {job!r} has ended in the pool while this try was still running; not asking for "
            "workers again",
            hint="its run was marked failed or its end_job teardown ran; clear the chunk to train again",
        )


class LeaseExpiredError(PoolError):
    """The lease is gone (expired, released, or superseded by a newer epoch)."""

    retryable = True


class WaitFailedError(PoolError):
    """Waiting for the pool in the triggerer failed; as retryable as the error the trigger met."""

    def __init__(self, message: str, *, retryable: bool, hint: str | None = None) -> None:
        self.retryable = retryable
        super().__init__(message, hint=hint)


class LedgerBusyError(PoolError):
    """The ledger database stayed locked past the retry budget."""

    retryable = True


class LedgerUnavailableError(PoolError):
    """The ledger database could not be reached (connection refused or lost)."""

    retryable = True


class ApiAuthError(PoolError):
    """The api-server refused the credentials (401) or the user's permission (403)."""


# --- experiment tracking ------------------------------------------------------------------


class TrackingError(ElasticOpsError):
    """The experiment tracker (MLflow) could not record the job. Raised only by a tracking
    configured ``strict=True``; otherwise it is a warning in the task log and training goes on."""

    retryable = True
