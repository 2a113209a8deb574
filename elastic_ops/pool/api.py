"""The pool's nouns, in one place: what a job is told (:class:`Grant`, :class:`Wait`,
:class:`Target`), what a policy decides (:class:`~elastic_ops.pool.model.Decision`,
:class:`~elastic_ops.pool.model.Plan`, over a :class:`~elastic_ops.pool.model.Snapshot`), and the
event log's vocabulary (:class:`EventKind`) with its one replay (:func:`slot_events`), which
usage accounting, the demo's timelines and the tests' invariants all read the log through.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from elastic_ops.pool.model import Decision, Plan, Slot, Snapshot, TargetAction

__all__ = [
    "Decision", "EventKind", "Grant", "Plan", "SlotEvent", "Snapshot", "Target", "TargetAction", "Wait",
    "slot_events",
]


@dataclasses.dataclass(frozen=True)
class Grant:
    """The job holds ``placements`` under fencing ``epoch``; renew within ``ttl_s``."""

    job: str
    epoch: int
    placements: tuple[Slot, ...]
    ttl_s: float

    @property
    def workers(self) -> int:
        return len(self.placements)


@dataclasses.dataclass(frozen=True)
class Wait:
    """The job waits for slots, and why."""

    job: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Target:
    """What a running job should do at its next boundary. ``workers`` = ``len(placements)``,
    the slots it holds now (0 for ``preempt``). ``batch``: the global batch the plan chose for
    an adaptive job (0: its own batch)."""

    job: str
    workers: int
    action: TargetAction
    reason: str
    placements: tuple[Slot, ...]
    batch: int = 0


class EventKind(enum.StrEnum):
    """Every kind of row in the pool's event log."""

    SUBMIT = "submit"    # a job registered (again)
    CONFIG = "config"    # a job's or the pool's settings changed
    HOST = "host"        # a host added or its state changed
    TARGET = "target"    # a running job's target changed
    GRANT = "grant"      # slots given to a job that had none
    GROW = "grow"        # more slots given to a running job
    SHRINK = "shrink"    # slots taken back from a running job
    RELEASE = "release"  # all of a job's slots given back
    EXPIRY = "expiry"    # a lease expired: its slots taken back
    PREEMPT = "preempt"  # a running job told to stop
    REISSUE = "reissue"  # a lease re-issued under a new epoch (a new try)
    PARK = "park"        # a chunk ended; its slots wait for the next chunk
    FINISH = "finish"    # a job ended
    FAILURE = "failure"  # a job's workers failed on a host


GIVES = frozenset({EventKind.GRANT, EventKind.GROW})
TAKES = frozenset({EventKind.SHRINK, EventKind.RELEASE, EventKind.EXPIRY})
SLOT_KINDS = GIVES | TAKES


@dataclasses.dataclass(frozen=True)
class SlotEvent:
    """An event that gave ``job`` slots (``gives``) or took them back."""

    ts: float
    kind: EventKind
    job: str
    slots: tuple[Slot, ...]
    gives: bool


def slot_events(events: Iterable[Mapping[str, Any]]) -> Iterator[SlotEvent]:
    """The events of ``events`` (the log's rows as dicts, oldest first) that give or take slots."""
    for ev in events:
        kind, job = ev.get("kind"), ev.get("job")
        if not job or kind not in SLOT_KINDS:
            continue
        slots = tuple((str(h), int(i)) for h, i in ev.get("slots") or ())
        yield SlotEvent(float(ev["ts"]), EventKind(kind), str(job), slots, kind in GIVES)
