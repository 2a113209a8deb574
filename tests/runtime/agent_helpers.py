"""An elastic-ops agent served from a thread of the test process, and raw-socket helpers."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from elastic_ops.agent.protocol import MessageReader
from elastic_ops.agent.server import Agent


@contextlib.contextmanager
def serving(server: Any, name: str) -> Iterator[Any]:
    """``server.serve()`` (an agent or a node agent) in a thread of the test process, yielded once
    ready; its start-up error is raised here, not lost in the thread; stopped on exit."""
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            server.serve()
        except BaseException as exc:  # surfaced below, not lost in the thread
            errors.append(exc)
            server.ready.set()

    thread = threading.Thread(target=serve, name=name, daemon=True)
    thread.start()
    server.ready.wait(300)
    if errors:
        raise errors[0]
    try:
        yield server
    finally:
        server.stop()
        thread.join(120)


def running_agent(directory: Path, **options: Any) -> contextlib.AbstractContextManager[Agent]:
    """An agent on ``directory/agent.sock`` (every progress message sent unless told otherwise)."""
    options.setdefault("progress_every_s", 0.0)
    return serving(Agent(str(directory / "agent.sock"), **options), "test-agent")


def raw_exchange(path: str, data: bytes, timeout: float = 60) -> dict[str, Any]:
    """Send raw bytes, return the agent's first reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        sock.sendall(data)
        msg = MessageReader(sock).read(timeout=timeout)
        assert msg is not None, "no reply"
        return msg


def line(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg).encode() + b"\n"


def as_target(host: str, wanted: Any, slots: Any = None, spans: Any = None) -> Any:
    """A client's ``target()`` from a count function and, optionally, ``host``'s slots and the
    other hosts' (functions, read right after the count, as a lease's answer is one value)."""
    from elastic_ops.runtime.allocation import Allocation

    def target() -> Allocation:
        n = wanted()
        here, there = None if slots is None else slots(), None if spans is None else spans()
        return Allocation.split(n, host, here, there)

    return target


def as_applied(host: str, record: Any, *, spans: bool = False) -> Any:
    """A client's ``on_applied(iteration, allocation)`` that hands ``record`` the plain values:
    ``(iteration, workers, host's slots or None[, the other hosts' slots])``."""
    if record is None:
        return None

    def applied(iteration: int, allocation: Any) -> None:
        slots = None if allocation.placements is None else allocation.on(host)
        if spans:
            record(iteration, allocation.workers, slots, allocation.elsewhere(host))
        else:
            record(iteration, allocation.workers, slots)

    return applied
