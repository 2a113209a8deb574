"""A flood of refusals is counted, but logged at a bounded rate."""

from __future__ import annotations

import logging

from elastic_ops.agent.throttle import ThrottledLog


def test_a_flood_is_logged_at_most_burst_times_a_window_and_says_what_it_held_back(caplog):
    now = [0.0]
    throttled = ThrottledLog(logging.getLogger("elastic_ops.node"), every_s=60, burst=3, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="elastic_ops.node"):
        for i in range(1000):
            throttled.warning("dropped %d", i)
        assert [r.getMessage() for r in caplog.records] == ["dropped 0", "dropped 1", "dropped 2"]
        now[0] = 61.0
        throttled.warning("dropped %d", 1000)
    assert caplog.records[-1].getMessage() == "dropped 1000 (and 997 more like it before, not logged)"
