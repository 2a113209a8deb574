"""What carries the agent protocol's messages between a task and the process running its chunk.

A chunk is a session, not a call: the run request goes one way, then targets go one way and
progress, segment changes and the outcome the other, until either side ends it. A
:class:`Channel` is that pair of streams, whatever the transport: :class:`SocketChannel` for the
per-host agent's Unix socket, :class:`elastic_ops.agent.redis_channel.RedisChannel` for the node
agents of a cluster. The session logic (``ChunkSession`` on the agent's side, :func:`drive_chunk`
in the client) is written once against this interface.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any, Protocol

from elastic_ops.agent.protocol import MessageReader, encode


class Channel(Protocol):
    def send(self, msg: dict[str, Any]) -> None:
        """Send one message; ``OSError`` when the peer is gone."""

    def read(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next message; ``None`` if none came within ``timeout``; ``EOFError`` once the peer
        has closed (or, where the transport cannot see a close, has gone silent too long)."""

    def close(self) -> None:
        """End this side; a ``read`` blocked in another thread returns soon after."""


SEND_TIMEOUT_S = 30.0  # a peer that reads nothing for this long is gone (its buffer is full)


class SocketChannel:
    """A connected stream socket: newline-delimited JSON (:mod:`elastic_ops.agent.protocol`).

    A send that cannot complete within ``send_timeout_s`` (the peer stopped reading: frozen,
    stopped, or hostile) raises ``TimeoutError``, an ``OSError``: the peer is gone."""

    def __init__(self, sock: socket.socket, send_timeout_s: float = SEND_TIMEOUT_S) -> None:
        self.sock = sock
        sock.settimeout(send_timeout_s)  # reads wait in select, so this bounds sends only
        self.reader = MessageReader(sock)

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.sendall(encode(msg))

    def read(self, timeout: float | None = None) -> dict[str, Any] | None:
        return self.reader.read(timeout=timeout)

    def close(self) -> None:
        # shutdown, not close: a recv blocked on a socket another thread closes never returns;
        # what was sent is still delivered
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
