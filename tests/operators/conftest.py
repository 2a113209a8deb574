"""Operator test plumbing: the chunk task's in-task wait for a grant runs on a driven clock, so a
test that expects a deferral does not sleep ``defer_after`` seconds first."""

from __future__ import annotations

import pytest

from elastic_ops.operators import chunk


class WaitClock:
    """``monotonic``/``sleep`` for :mod:`elastic_ops.operators.chunk`: sleeping moves the clock."""

    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds


@pytest.fixture(autouse=True)
def wait_clock(monkeypatch) -> WaitClock:
    clock = WaitClock()
    monkeypatch.setattr(chunk, "_monotonic", clock.monotonic)
    monkeypatch.setattr(chunk, "_sleep", clock.sleep)
    return clock
