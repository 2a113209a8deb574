"""Where a segment's ranks run: this host's granted slots first (rank 0, beside the control
channel), then the other hosts' in the pool's order (:func:`place`), and which granted slots
came with which boundary's target (:class:`SlotsByBoundary`)."""

from __future__ import annotations

from collections.abc import Sequence

from elastic_ops.runtime.allocation import Spans
from elastic_ops.runtime.launcher import RemotePart

Placement = tuple[tuple[int, ...], Spans]  # this host's slots, then the other hosts'


def place(workers: int, slots: Sequence[int], spans: Spans) -> tuple[int, tuple[RemotePart, ...]]:
    """Where ``workers`` ranks run: ``(ranks on this host, the other hosts' parts)``. This host's
    slots come first (rank 0 is here), then each other host's, in order; ranks left over when
    the slots run out stay on this host (on CPU the slots are bookkeeping; on CUDA the launcher
    then refuses, naming the slots), and so does rank 0 when this host has no slot (the control
    channel is here)."""
    here = max(min(workers, len(slots)), min(workers, 1)) if spans else workers
    parts, offset = [], here
    for host, theirs in spans:
        n = min(workers - offset, len(theirs))
        if n <= 0:
            break
        parts.append(RemotePart(host=host, rank_offset=offset, count=n, slots=tuple(theirs[:n])))
        offset += n
    return here + (workers - offset), tuple(parts)


def used(workers: int, placement: Placement, host: str) -> set[tuple[str, int]]:
    """The ``(host, slot)`` pairs ``workers`` ranks use under ``placement``."""
    slots, spans = placement
    here, parts = place(workers, slots, spans)
    return {(host, s) for s in slots[:here]} | {(p.host, s) for p in parts for s in p.slots}


class SlotsByBoundary:
    """The granted GPU slots (a :data:`Placement`) that came with the target of each decided
    boundary.

    ``slots()`` is read right after every ``target(i)``, from the same thread, so a segment
    launched at boundary ``i`` gets the slots of the very pool target that decided its worker
    count; reading them at launch instead could see a later target (boundaries are decided
    ahead of rank 0). Only changes are kept: one entry per slot change, not per boundary.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[int, Placement]] = []  # (first boundary, placement), ascending

    def note(self, iteration: int, slots: Placement) -> None:
        # A boundary decided again (a new segment re-decides the ones after its start)
        # supersedes what was noted for it and every later one.
        entries = [e for e in self._entries if e[0] < iteration]
        if not entries or entries[-1][1] != slots:
            entries.append((iteration, slots))
        self._entries = entries

    def at(self, iteration: int) -> Placement | None:
        """The slots in force at ``iteration`` (``None`` if nothing was noted up to it)."""
        k = max((k for k, e in enumerate(self._entries) if e[0] <= iteration), default=None)
        if k is None:
            return None
        del self._entries[:k]  # segments launch in ascending order: older entries are done
        return self._entries[0][1]
