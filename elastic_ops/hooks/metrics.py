"""``AirflowMetrics``: :class:`elastic_ops.metrics.Metrics` through Airflow's Stats.

In a task, Airflow's task runner has set Stats up from the ``[metrics]`` configuration
(``statsd_on``, ``statsd_datadog_enabled``, ``otel_on``, allow/block lists, name validation), so
elastic_ops' metrics go wherever the deployment sends Airflow's own. Where Stats was not set up,
they go nowhere. A metric never fails the caller: a backend error is logged once and dropped.
"""

from __future__ import annotations

import datetime
import logging

from elastic_ops.metrics import Tags

log = logging.getLogger(__name__)

PREFIX = "elastic_ops."


class AirflowMetrics:
    def __init__(self) -> None:
        self._warned = False

    def incr(self, name: str, count: int = 1, *, tags: Tags = None) -> None:
        self._send("incr", PREFIX + name, count, tags)

    def gauge(self, name: str, value: float, *, tags: Tags = None) -> None:
        self._send("gauge", PREFIX + name, value, tags)

    def timing(self, name: str, seconds: float, *, tags: Tags = None) -> None:
        self._send("timing", PREFIX + name, datetime.timedelta(seconds=seconds), tags)

    def _send(self, kind: str, name: str, value: object, tags: Tags) -> None:
        try:
            from airflow.sdk.observability import stats

            getattr(stats, kind)(name, value, tags=dict(tags) if tags else None)
        except Exception as exc:  # noqa: BLE001 - metrics must never fail training
            if not self._warned:
                self._warned = True
                log.warning("could not send metric %s (%s: %s); dropping metrics that fail",
                            name, type(exc).__name__, exc)


def metrics_from_airflow_config() -> AirflowMetrics:
    """``AirflowMetrics`` for a process Airflow did not start (``elastic-ops node`` on a GPU host):
    Airflow's Stats set up from this host's ``[metrics]`` configuration (``AIRFLOW__METRICS__*``
    or ``$AIRFLOW_HOME/airflow.cfg``), as Airflow's task runner sets it up for a task. With no
    backend configured, or a configuration that cannot be read (logged), nothing is sent."""
    try:
        from airflow.sdk.configuration import conf
        from airflow.sdk.observability import stats
        from airflow.sdk.observability.metrics import stats_utils

        stats.initialize(
            factory=stats_utils.get_stats_factory(),
            export_legacy_names=conf.getboolean("metrics", "legacy_names_on"),
        )
        on = [k for k in ("statsd_on", "statsd_datadog_enabled", "otel_on") if conf.getboolean("metrics", k)]
    except Exception as exc:  # noqa: BLE001 - metrics must never stop what they observe
        log.warning("sending no metrics: Airflow's [metrics] configuration could not be read (%s: %s)",
                    type(exc).__name__, exc)
        return AirflowMetrics()
    shown = f"through Airflow's Stats ({', '.join(on)})" if on else "off ([metrics] of Airflow)"
    log.info("metrics: %s", shown)
    return AirflowMetrics()
