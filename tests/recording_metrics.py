"""``RecordingMetrics``: a :class:`elastic_ops.metrics.Metrics` that keeps what it was sent."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RecordingMetrics:
    sent: list[tuple[str, str, float, dict]] = field(default_factory=list)  # (kind, name, value, tags)

    def incr(self, name, count=1, *, tags=None):
        self.sent.append(("incr", name, count, dict(tags or {})))

    def gauge(self, name, value, *, tags=None):
        self.sent.append(("gauge", name, value, dict(tags or {})))

    def timing(self, name, seconds, *, tags=None):
        self.sent.append(("timing", name, seconds, dict(tags or {})))

    def values(self, name: str) -> list[float]:
        return [v for _, n, v, _ in self.sent if n == name]

    def last(self, name: str) -> float:
        return self.values(name)[-1]

    def total(self, name: str) -> float:
        return sum(self.values(name))
