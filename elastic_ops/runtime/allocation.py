"""``Allocation``: the pool's target for a chunk as one value — a worker count and the
``(host, slot)`` pairs it grants — from the lease's heartbeat to the runner (``target(i)``) and,
as the slots a segment really runs on, back to the heartbeat (``on_segment(i, allocation)``).

One value per call, as ``RendezvousHandler.next_rendezvous()`` returns one ``RendezvousInfo``:
count and slots always come from the same pool answer. Torch-free: the agents' clients, inside
light Airflow task processes, read and write it too (:meth:`to_wire`, :meth:`from_wire`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

Slot = tuple[str, int]  # (host, slot index on that host)
Spans = tuple[tuple[str, tuple[int, ...]], ...]  # other hosts' slots: ((host, slots), ...), in order


@dataclasses.dataclass(frozen=True)
class Allocation:
    """``workers`` (0: preempt) on ``placements``, in the pool's order; ``placements=None``: the
    count alone (the caller places nothing: ranks take the visible GPUs in order, and a segment
    reports no slots). ``batch``: the global batch the pool chose for an adaptive job
    (``scaling: adaptive``; 0: the job's own), followed at iteration boundaries without a
    relaunch."""

    workers: int
    placements: tuple[Slot, ...] | None = None
    batch: int = 0

    @classmethod
    def split(
        cls, workers: int, host: str, slots: Sequence[int] | None, spans: Spans | None = None, batch: int = 0
    ) -> Allocation:
        """From ``host``'s slots and the other hosts' (``spans``): :meth:`to_wire`'s inverse."""
        if slots is None:
            return cls(int(workers), batch=int(batch))
        return cls(int(workers), tuple((host, int(s)) for s in slots)
                   + tuple((str(h), int(s)) for h, ss in (spans or ()) for s in ss), int(batch))

    def on(self, host: str) -> tuple[int, ...]:
        """The slots on ``host``, in order (none when the count alone is known)."""
        return tuple(s for h, s in self.placements or () if h == host)

    def elsewhere(self, host: str) -> Spans:
        """The other hosts' slots, ``((host, slots), ...)`` in the pool's order."""
        others: dict[str, list[int]] = {}
        for h, s in self.placements or ():
            if h != host:
                others.setdefault(h, []).append(s)
        return tuple((h, tuple(ss)) for h, ss in others.items())

    def with_workers(self, workers: int) -> Allocation:
        return dataclasses.replace(self, workers=int(workers))

    def to_wire(self, host: str, *, spans: bool) -> dict[str, Any]:
        """The agents' message fields: ``workers``, ``slots`` (``host``'s, or null), ``batch``
        when one was chosen and, when ``spans`` (a node that leads segments across hosts), the
        other hosts' ``spans``."""
        slots = None if self.placements is None else list(self.on(host))
        wire: dict[str, Any] = {"workers": self.workers, "slots": slots}
        if self.batch:
            wire["batch"] = self.batch
        if spans:
            wire["spans"] = [[h, list(ss)] for h, ss in self.elsewhere(host)]
        return wire
