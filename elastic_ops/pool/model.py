"""What the pool knows (a snapshot) and what a policy decides (a plan).

Everything here is a frozen value. The ledger builds a :class:`Snapshot` from its tables, a
policy turns it into a :class:`Plan`, and the ledger applies the plan. The simulator builds
snapshots from its own state and calls the same policies.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import functools
from collections.abc import Iterable, Mapping, Sequence

from elastic_ops.errors import SpecError
from elastic_ops.pool.scaling import Batching, GradStats, ScalingModel
from elastic_ops.spec import DEFAULT_TENANT, check_number

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
        running ──release(handover=True)──▶ parked ──request──▶ running (new epoch, same slots)
        parked ──target 0 / all its slots moved / lease expires──▶ waiting

    ``parked``: a chunk ended and the job's next chunk follows. The job keeps its lease and
    slots for one lease TTL, running nothing; a shrink the plan decides meanwhile frees slots at
    once (there is no boundary to wait for).
    """

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTING = "preempting"
    PARKED = "parked"
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


@dataclasses.dataclass(frozen=True, slots=True)
class Host:
    name: str
    slots: int
    state: HostState = HostState.UP
    labels: tuple[tuple[str, str], ...] = ()


def outside(selector: Mapping[str, str], hosts: Iterable[Host]) -> frozenset[str]:
    """The hosts that lack one of the ``selector``'s labels: a job with that selector may not
    use them (the ledger hands them to policies as hosts the job avoids, a hard constraint)."""
    if not selector:
        return frozenset()
    need = set(selector.items())
    return frozenset(h.name for h in hosts if not need <= set(h.labels))


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """A demand: ``min_workers..max_workers`` at a priority.

    ``held`` are the slots the job holds now (its live lease); ``waiting_since`` is when it last
    started waiting (submission or preemption) and drives aging; ``last_rescale`` is when its
    allocation last changed (anti-thrashing). ``avoid_hosts``: hosts it takes no new slot on;
    ``leave_hosts`` (among them): hosts it may hold no slot on at all (outside its host
    selector): slots it holds there are released, as on a host that is not up, and still taken
    until then. ``releasing`` (among ``held``): slots it was told to give up at its next
    boundary and still holds: a job in the middle of a shrink or a move keeps its other slots
    first and may be moved only off those until it has acted (see plain_policies._may_leave).
    ``scaling``: its fitted step-time model (None: nothing measured, the prior);
    ``attained``: GPU-seconds it has trained so far. ``batching``: the global batches an
    adaptive job (``scaling: adaptive``) lets the pool choose from (None: its batch is fixed);
    ``grad``: its gradient statistics as last measured (None: not measured). Only the
    ``goodput`` policy reads these four. ``tenant``: the team it belongs to (a
    :class:`Tenant` of the snapshot; one not listed is a tenant without guarantee or max).
    """

    name: str
    min_workers: int
    max_workers: int
    priority: int = 1
    preemptible: bool = True
    avoid_hosts: frozenset[str] = frozenset()
    leave_hosts: frozenset[str] = frozenset()
    submitted: float = 0.0
    waiting_since: float | None = None
    last_rescale: float | None = None
    held: tuple[Slot, ...] = ()
    epoch: int = 0
    releasing: frozenset[Slot] = frozenset()
    scaling: ScalingModel | None = None
    attained: float = 0.0
    batching: Batching | None = None
    grad: GradStats | None = None
    tenant: str = DEFAULT_TENANT


# Job's slots in field order, as make_job passes them (the descriptors set a frozen slot)
_JOB_SLOTS = tuple(getattr(Job, f.name).__set__ for f in dataclasses.fields(Job))


def make_job(
    name: str, min_workers: int, max_workers: int, priority: int, preemptible: bool,
    avoid_hosts: frozenset[str], leave_hosts: frozenset[str], submitted: float,
    waiting_since: float | None, last_rescale: float | None, held: tuple[Slot, ...], epoch: int,
    releasing: frozenset[Slot], scaling: ScalingModel | None = None, attained: float = 0.0,
    batching: Batching | None = None, grad: GradStats | None = None, tenant: str = DEFAULT_TENANT,
) -> Job:
    """The same :class:`Job` as ``Job(...)``, built without the frozen dataclass ``__init__``
    (one ``object.__setattr__`` per field): each field's slot is set through its descriptor. The
    ledger builds one per job for every plan."""
    j = _new(Job)
    for put, value in zip(_JOB_SLOTS, (
        name, min_workers, max_workers, priority, preemptible, avoid_hosts, leave_hosts, submitted,
        waiting_since, last_rescale, held, epoch, releasing, scaling, attained, batching, grad, tenant,
    ), strict=True):
        put(j, value)
    return j


@dataclasses.dataclass(frozen=True)
class Observation:
    """What a running job measured since its last heartbeat, carried by that heartbeat.

    ``iterations`` completed in ``seconds`` of training (start-up and checkpoint stalls
    excluded) at ``workers`` ranks spread over ``hosts`` hosts, global batch ``batch`` (0: the
    job's fixed batch). The ledger sums them per (workers, hosts, batch): what the pool learns
    of how the job scales. ``grad_sqr`` and ``grad_var`` (an adaptive job's, both or neither):
    its gradient statistics as its workers last measured them (:class:`GradStats`; the
    variance that of one batch of the job's base size); the ledger keeps the latest."""

    iterations: int
    seconds: float
    workers: int
    hosts: int = 1
    batch: int = 0
    grad_sqr: float | None = None
    grad_var: float | None = None


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """Knobs shared by all policies.

    ``min_rescale_interval_s``: a running job is not rescaled again sooner than this after its
    last rescale (moves off unhealthy hosts are exempt). ``min_gain``: a rescale of a running
    job whose relative change ``|target - held| / held`` is below this is skipped.
    ``aging_s``: a waiting job gains one priority unit per ``aging_s`` seconds of waiting (see
    :func:`elastic_ops.pool.policies.effective_priority`); 0 disables aging.
    ``rescale_cost_s``: the seconds a rescale stalls a job (checkpoint, restart, rendezvous):
    the ``goodput`` policy grows a running job only when the gain pays it back.
    """

    preemption: Preemption = Preemption.GRACEFUL
    min_rescale_interval_s: float = 0.0
    min_gain: float = 0.0
    aging_s: float = 600.0
    rescale_cost_s: float = 30.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "preemption", _preemption(self.preemption))
        for field in ("min_rescale_interval_s", "min_gain", "rescale_cost_s"):
            check_number(field, getattr(self, field), minimum=0)
        check_aging("aging_s", self.aging_s)


MIN_AGING_S = 1.0


def check_aging(field: str, value: object) -> float:
    """``aging_s``: 0 (no aging) or at least a second. A smaller one lifts a waiting job's
    priority past what a float ranks exactly (at 1e-320 the arithmetic overflows), and the two
    policy implementations would rank such jobs differently."""
    check_number(field, value, minimum=0)
    if 0 < value < MIN_AGING_S:  # type: ignore[operator]
        raise SpecError(field, value, f"must be 0 (no aging) or >= {MIN_AGING_S:g} second")
    return value  # type: ignore[return-value]


def _preemption(value: object) -> Preemption:
    try:
        return Preemption(value)
    except ValueError:
        raise SpecError("preemption", value, "must be one of 'none', 'graceful'") from None


@dataclasses.dataclass(frozen=True)
class Tenant:
    """A team sharing the pool (see :mod:`elastic_ops.pool.tenants`). ``guaranteed``: the slots
    it gets whenever its jobs can use them (reclaimed from borrowers by graceful preemption);
    ``max_slots``: the most it may hold, borrowing included (None: no limit); ``weight``: its
    share of the idle capacity lent to tenants that want more than their guarantee."""

    name: str
    guaranteed: int = 0
    max_slots: int | None = None
    weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """``tenants``: the pool's tenants (empty: every job in one tenant, the decision as without
    tenants)."""

    hosts: tuple[Host, ...]
    jobs: tuple[Job, ...]
    now: float
    config: PolicyConfig = PolicyConfig()
    tenants: tuple[Tenant, ...] = ()


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


class PlanSlots(abc.ABC):
    """The slots of a plan, job by job (``k`` is the job's position in :attr:`Plan.jobs`).

    Two implementations: :class:`DecisionSlots` over ready-made tuples (the plain policies) and
    the vectorised policies' arrays (``elastic_ops.pool.policies``), which make slot tuples only
    for the jobs a caller asks about.
    """

    @abc.abstractmethod
    def placements(self, k: int) -> tuple[Slot, ...]:
        """The slots job ``k`` should hold: kept ones first, then new ones."""

    @abc.abstractmethod
    def release(self, k: int) -> tuple[Slot, ...]:
        """Held slots job ``k`` gives back at its next boundary."""

    @abc.abstractmethod
    def new(self, k: int) -> tuple[Slot, ...]:
        """Slots job ``k`` did not hold and is given now (the tail of its placements)."""

    @abc.abstractmethod
    def changed(self) -> list[int]:
        """The jobs (ascending positions) that are given or give back slots; every other job's
        placements are exactly the slots it holds."""

    def changed_placements(self) -> dict[int, tuple[Slot, ...]]:
        """:meth:`placements` of every job in :meth:`changed` (implementations may build them
        in bulk)."""
        return {k: self.placements(k) for k in self.changed()}


class DecisionSlots(PlanSlots):
    """:class:`PlanSlots` over per-job tuples; ``kept[k]`` is how many of job ``k``'s
    placements it already held."""

    def __init__(
        self, placements: Sequence[tuple[Slot, ...]], release: Sequence[tuple[Slot, ...]], kept: Sequence[int]
    ) -> None:
        self._placements, self._release, self._kept = placements, release, kept

    def placements(self, k: int) -> tuple[Slot, ...]:
        return self._placements[k]

    def release(self, k: int) -> tuple[Slot, ...]:
        return self._release[k]

    def new(self, k: int) -> tuple[Slot, ...]:
        return self._placements[k][self._kept[k] :]

    def changed(self) -> list[int]:
        return [
            k
            for k, (p, r, n) in enumerate(zip(self._placements, self._release, self._kept, strict=True))
            if r or len(p) > n
        ]


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A policy's decision for every job of a snapshot, as columns in rank order.

    ``jobs``, ``target``, ``action`` and ``reason`` have one entry per job; ``slots`` holds the
    placements and releases. :meth:`decision` (and ``plan[job]``, :meth:`get`,
    :attr:`decisions`) builds the :class:`Decision` of a job on demand, so a caller that needs
    a few jobs' slots (the ledger answering one request) or only the jobs whose slots change
    (:meth:`changed`, the simulator) never pays for slot tuples of the others. Two plans are
    equal when every decision is, and so is every batch.

    ``batch``: the global batch the plan chose for each job, in the same order (0: the job's
    own, fixed or base batch); empty when it chose none (only ``goodput`` chooses, for
    adaptive jobs: :func:`elastic_ops.pool.goodput.with_batches`).
    """

    jobs: tuple[str, ...]
    target: tuple[int, ...]
    action: tuple[TargetAction | None, ...]
    reason: tuple[str, ...]
    slots: PlanSlots
    batch: tuple[int, ...] = ()

    def batch_of(self, k: int) -> int:
        """The global batch chosen for the job at position ``k`` (0: its own batch)."""
        return self.batch[k] if self.batch else 0

    @classmethod
    def of(cls, decisions: Sequence[Decision], kept: Sequence[int]) -> Plan:
        """A plan from ready-made decisions; ``kept[k]``: how many of decision ``k``'s
        placements the job already held (they come first)."""
        return cls(
            tuple(d.job for d in decisions),
            tuple(d.target for d in decisions),
            tuple(d.action for d in decisions),
            tuple(d.reason for d in decisions),
            DecisionSlots([d.placements for d in decisions], [d.release for d in decisions], kept),
        )

    @functools.cached_property
    def _index(self) -> dict[str, int]:
        return dict(zip(self.jobs, range(len(self.jobs)), strict=True))

    def index(self, job: str) -> int:
        """Position of ``job`` in :attr:`jobs` (``KeyError`` if the plan does not list it)."""
        return self._index[job]

    def decision(self, k: int) -> Decision:
        return make_decision(
            self.jobs[k],
            self.target[k],
            self.slots.placements(k),
            self.slots.release(k),
            self.action[k],
            self.reason[k],
        )

    def __getitem__(self, job: str) -> Decision:
        return self.decision(self._index[job])

    def get(self, job: str) -> Decision | None:
        k = self._index.get(job)
        return None if k is None else self.decision(k)

    def changed(self) -> list[int]:
        """Positions of the jobs that are given or give back slots (see :class:`PlanSlots`)."""
        return self.slots.changed()

    @functools.cached_property
    def decisions(self) -> tuple[Decision, ...]:
        """Every job's :class:`Decision`, in rank order (built on first use)."""
        return tuple(map(self.decision, range(len(self.jobs))))

    def by_job(self) -> Mapping[str, Decision]:
        return {d.job: d for d in self.decisions}

    def targets(self) -> dict[str, int]:
        return dict(zip(self.jobs, self.target, strict=True))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        batches = [tuple(map(p.batch_of, range(len(p.jobs)))) for p in (self, other)]
        return self.decisions == other.decisions and batches[0] == batches[1]
