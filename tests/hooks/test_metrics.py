"""``AirflowMetrics``: elastic_ops' metrics through Airflow's Stats, prefixed, timings as
durations; a failing metrics backend never fails the caller (one warning, then quiet)."""

from __future__ import annotations

import datetime
import logging

from airflow.sdk.observability import stats

from elastic_ops.hooks.metrics import AirflowMetrics


def test_metrics_reach_airflows_stats_with_the_prefix(monkeypatch):
    sent = []

    def recorder(kind):
        return lambda name, value, tags=None: sent.append((kind, name, value, tags))

    for kind in ("incr", "gauge", "timing"):
        monkeypatch.setattr(stats, kind, recorder(kind))
    m = AirflowMetrics()
    m.incr("chunk.iterations", 20, tags={"job": "j"})
    m.gauge("pool.slots_up", 8)
    m.timing("chunk.wait", 1.5, tags={"job": "j"})
    assert sent == [
        ("incr", "elastic_ops.chunk.iterations", 20, {"job": "j"}),
        ("gauge", "elastic_ops.pool.slots_up", 8, None),
        ("timing", "elastic_ops.chunk.wait", datetime.timedelta(seconds=1.5), {"job": "j"}),
    ]


def test_a_failing_backend_is_logged_once_and_never_raises(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise OSError("statsd host unreachable")

    monkeypatch.setattr(stats, "gauge", broken)
    m = AirflowMetrics()
    with caplog.at_level(logging.WARNING, logger="elastic_ops.hooks.metrics"):
        for _ in range(3):
            m.gauge("chunk.workers", 4)
    warnings = [r for r in caplog.records if "could not send metric" in r.getMessage()]
    assert len(warnings) == 1 and "statsd host unreachable" in warnings[0].getMessage()
