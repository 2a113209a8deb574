"""Metrics the pool and the chunk tasks emit, behind an interface the layers under Airflow take
as a parameter (like clocks): :class:`Metrics`. The Airflow layer passes
:class:`elastic_ops.hooks.metrics.AirflowMetrics`, which sends them through Airflow's own Stats
to whatever the deployment configured (StatsD, Datadog, OpenTelemetry); elsewhere nothing is
sent (:data:`NO_METRICS`). Names are relative (``pool.slots_used``); the Airflow side prefixes
``elastic_ops.``. docs/airflow.md "Metrics" lists them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

Tags = Mapping[str, str] | None


class Metrics(Protocol):
    def incr(self, name: str, count: int = 1, *, tags: Tags = None) -> None: ...

    def gauge(self, name: str, value: float, *, tags: Tags = None) -> None: ...

    def timing(self, name: str, seconds: float, *, tags: Tags = None) -> None: ...


class NoMetrics:
    """Sends nothing."""

    def incr(self, name: str, count: int = 1, *, tags: Tags = None) -> None:
        return None

    def gauge(self, name: str, value: float, *, tags: Tags = None) -> None:
        return None

    def timing(self, name: str, seconds: float, *, tags: Tags = None) -> None:
        return None


NO_METRICS = NoMetrics()
