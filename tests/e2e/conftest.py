"""Fixtures of the end-to-end modules."""

from __future__ import annotations

import pytest

from tests.statsd_listener import StatsdListener


@pytest.fixture(scope="module")
def statsd():
    """A StatsD listener for one module's deployment (Airflow's ``[metrics]`` point at it)."""
    listener = StatsdListener()
    yield listener
    listener.close()
