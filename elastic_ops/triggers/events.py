"""Typed payloads carried by trigger events (plain JSON on the wire, dataclasses in code)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic_ops.pool.api import Grant


@dataclasses.dataclass(frozen=True)
class GrantEvent:
    """The pool granted ``job`` slots; ``state`` is what the deferred task needs to go on."""

    job: str
    epoch: int
    placements: tuple[tuple[str, int], ...]
    ttl_s: float
    state: dict[str, Any]
    waited_s: float = 0.0

    kind = "grant"

    @property
    def workers(self) -> int:
        return len(self.placements)

    @property
    def hosts(self) -> list[str]:
        return sorted({h for h, _ in self.placements})

    def to_payload(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "job": self.job, "epoch": self.epoch,
            "placements": [[h, s] for h, s in self.placements], "ttl_s": self.ttl_s,
            "state": self.state, "waited_s": self.waited_s,
        }

    @classmethod
    def from_grant(cls, grant: Grant, state: dict[str, Any], waited_s: float = 0.0) -> GrantEvent:
        return cls(
            job=grant.job, epoch=int(grant.epoch),
            placements=tuple((str(h), int(s)) for h, s in grant.placements),
            ttl_s=float(grant.ttl_s), state=dict(state), waited_s=waited_s,
        )


@dataclasses.dataclass(frozen=True)
class CapacityEvent:
    """The pool can give ``min_workers`` now (``free`` slots were free when it looked)."""

    free: int
    min_workers: int
    waited_s: float = 0.0

    kind = "capacity"

    def to_payload(self) -> dict[str, Any]:
        return {"kind": self.kind, "free": self.free, "min_workers": self.min_workers,
                "waited_s": self.waited_s}


@dataclasses.dataclass(frozen=True)
class TriggerFailure:
    """The trigger could not do its job (ledger unreachable, unknown job); carries the error."""

    error: str
    error_type: str
    retryable: bool

    kind = "error"

    def to_payload(self) -> dict[str, Any]:
        return {"kind": self.kind, "error": self.error, "error_type": self.error_type,
                "retryable": self.retryable}


def parse_event(payload: dict[str, Any]) -> GrantEvent | CapacityEvent | TriggerFailure:
    """Rebuild the typed event from a trigger event payload."""
    if not isinstance(payload, dict) or "kind" not in payload:
        raise ValueError(f"not an elastic_ops trigger event: {payload!r}")
    kind = payload["kind"]
    if kind == GrantEvent.kind:
        return GrantEvent(
            job=payload["job"], epoch=int(payload["epoch"]),
            placements=tuple((str(h), int(s)) for h, s in payload["placements"]),
            ttl_s=float(payload["ttl_s"]), state=dict(payload.get("state") or {}),
            waited_s=float(payload.get("waited_s", 0.0)),
        )
    if kind == CapacityEvent.kind:
        return CapacityEvent(free=int(payload["free"]), min_workers=int(payload["min_workers"]),
                             waited_s=float(payload.get("waited_s", 0.0)))
    if kind == TriggerFailure.kind:
        return TriggerFailure(error=payload["error"], error_type=payload["error_type"],
                              retryable=bool(payload["retryable"]))
    raise ValueError(f"unknown elastic_ops trigger event kind {kind!r}")
