"""What the pool knows (a snapshot) and what a policy decides (a plan).

Everything here is a frozen value. The ledger builds a :class:`Snapshot` from its tables, a
policy turns it into a :class:`Plan`, and the ledger applies the plan. The simulator builds
snapshots from its own state and calls the same policies.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping

from elastic_ops.errors import SpecError

Slot = tuple[str, int]  # (host name, slot index on that host)


class HostState(enum.StrEnum):
    """Health of a host.

    Transitions::

        up ──drain──▶ draining ──set up──▶ up
        up ──failures ≥ threshold──▶ cooling ──cooling period over──▶ up
        any ──set down──▶ down ──set up / add_host──▶ up

    Only ``up`` hosts receive new grants. Slots held on any other host are released at the
    holder's next iteration boundary (the job shrinks, then grows onto ``up`` hosts).
    """

    UP = "up"
    DRAINING = "draining"
    DOWN = "down"
    COOLING = "cooling"


class JobState(enum.StrEnum):
    """Life cycle of a job in the pool.

    Transitions::

        waiting ──grant──▶ running ──target 0──▶ preempting ──heartbeat workers=0──▶ waiting
        running ──lease expires──▶ waiting
        running / waiting ──release(finished=True)──▶ finished ──request / submit──▶ waiting
        running ──release(finished=False)──▶ waiting
    """

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTING = "preempting"
    FINISHED = "finished"


class TargetAction(enum.StrEnum):
    """What a running job must do at its next iteration boundary."""

    KEEP = "keep"
    GROW = "grow"
    SHRINK = "shrink"
    PREEMPT = "preempt"


class Preemption(enum.StrEnum):
    """``none``: a running job is never shrunk for another job. ``graceful``: running jobs that
    are over their share (or outranked) shrink at their next boundary, never below their
    minimum unless fully preempted (then they checkpoint, release and wait)."""

    NONE = "none"
    GRACEFUL = "graceful"


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    slots: int
    state: HostState = HostState.UP
    labels: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Job:
    """A demand: ``min_workers..max_workers`` at a priority.

    ``held`` are the slots the job holds now (its live lease); ``waiting_since`` is when it last
    started waiting (submission or preemption) and drives aging; ``last_rescale`` is when its
    allocation last changed (anti-thrashing).
    """

    name: str
    min_workers: int
    max_workers: int
    priority: int = 1
    preemptible: bool = True
    avoid_hosts: frozenset[str] = frozenset()
    submitted: float = 0.0
    waiting_since: float | None = None
    last_rescale: float | None = None
    held: tuple[Slot, ...] = ()
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """Knobs shared by all policies.

    ``min_rescale_interval_s``: a running job is not rescaled again sooner than this after its
    last rescale (moves off unhealthy hosts are exempt). ``min_gain``: a rescale of a running
    job whose relative change ``|target - held| / held`` is below this is skipped.
    ``aging_s``: a waiting job gains one priority unit per ``aging_s`` seconds of waiting (see
    :func:`elastic_ops.pool.policies.effective_priority`); 0 disables aging.
    """

    preemption: Preemption = Preemption.GRACEFUL
    min_rescale_interval_s: float = 0.0
    min_gain: float = 0.0
    aging_s: float = 600.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "preemption", _preemption(self.preemption))
        for field in ("min_rescale_interval_s", "min_gain", "aging_s"):
            value = getattr(self, field)
            if not isinstance(value, int | float) or value < 0:
                raise SpecError(field, value, "must be a number >= 0")


def _preemption(value: object) -> Preemption:
    try:
        return Preemption(value)
    except ValueError:
        raise SpecError("preemption", value, "must be one of 'none', 'graceful'") from None


@dataclasses.dataclass(frozen=True)
class Snapshot:
    hosts: tuple[Host, ...]
    jobs: tuple[Job, ...]
    now: float
    config: PolicyConfig = PolicyConfig()


@dataclasses.dataclass(frozen=True)
class Decision:
    """The plan for one job.

    ``target``: workers the job should run. ``placements``: the slots it should hold (kept +
    newly reserved; ``len(placements) <= target``, shorter only while it waits for others to
    release). ``release``: held slots to give back at its next iteration boundary.
    """

    job: str
    target: int
    placements: tuple[Slot, ...]
    release: tuple[Slot, ...]
    action: TargetAction | None  # None for a job that holds nothing and gets nothing (waits)
    reason: str


_new = object.__new__


def make_decision(
    job: str,
    target: int,
    placements: tuple[Slot, ...],
    release: tuple[Slot, ...],
    action: TargetAction | None,
    reason: str,
) -> Decision:
    """The same :class:`Decision` as ``Decision(...)``, built without the frozen dataclass
    ``__init__`` (one ``object.__setattr__`` per field), which is most of the cost of a decision
    at 10,000 jobs: the policies build one per job. Fields are not checked (neither are they in
    ``__init__``)."""
    d = _new(Decision)
    d.__dict__.update(
        job=job, target=target, placements=placements, release=release, action=action, reason=reason
    )
    return d


@dataclasses.dataclass(frozen=True)
class Plan:
    decisions: tuple[Decision, ...]

    def by_job(self) -> Mapping[str, Decision]:
        return {d.job: d for d in self.decisions}

    def targets(self) -> dict[str, int]:
        return {d.job: d.target for d in self.decisions}
