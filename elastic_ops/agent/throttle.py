"""Warnings that anyone who can write to Redis can cause, logged at a bounded rate."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

EVERY_S = 60.0
BURST = 20


class ThrottledLog:
    """``warning()`` logs at most ``burst`` messages every ``every_s`` seconds and says, with the
    next one it logs, how many it held back: a flood of junk pushed onto a node's lists must not
    flood its log (every one is still counted, in metrics and counters)."""

    def __init__(self, log: logging.Logger, every_s: float = EVERY_S, burst: int = BURST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.every_s, self.burst, self.clock = log, every_s, burst, clock
        self._lock = threading.Lock()
        self._window = float("-inf")
        self._logged = self._held = 0

    def warning(self, message: str, *args: object) -> None:
        with self._lock:
            now = self.clock()
            if now - self._window >= self.every_s:
                self._window, self._logged = now, 0
            if self._logged >= self.burst:
                self._held += 1
                return
            self._logged += 1
            held, self._held = self._held, 0
        if held:
            message += f" (and {held} more like it before, not logged)"
        self.log.warning(message, *args)
