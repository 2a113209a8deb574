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
