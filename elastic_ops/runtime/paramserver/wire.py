"""The messages between workers and servers: ``torch.distributed`` point-to-point over the
segment's gloo group (ranks ``0..N-1`` workers, ``N..N+K-1`` servers).

Every request starts with a header of ``HEADER`` int64 values, sent with tag ``HDR``; a
server receives headers from any source (``recv(src=None)``) and then the request's payloads
from that sender with tag ``DATA`` (point-to-point messages between two ranks with one tag
arrive in the order they were sent). Replies go back with tag ``DATA``; the end-of-step
acknowledgement with tag ``ACK``.

=========  =========================================  =========================================
kind       header ``[kind, a, b, c, ...]``             payloads
=========  =========================================  =========================================
PULL       ``[PULL, it]``                              reply: the server's dense parameters, flat
ROWS       ``[ROWS, table, n, it]``                    ``n`` row ids (local to the server's
                                                       range); reply: those rows
PUSH       ``[PUSH, shard, it, n_int, n_float]``       ints ``[used_t..., count_t..., ids...]``,
                                                       floats ``[dense grads, used flags, loss,
                                                       rows...]``
SNAP       ``[SNAP, it]`` (rank 0)                     reply: the server's state, bytes
BYE        ``[BYE, snapshot, it]`` (every worker)      reply (``snapshot`` = 1): the state
=========  =========================================  =========================================

A server that has all ``V`` pushes of an iteration sums them in shard order, steps, and sends
every worker an ``ACK`` holding the global loss: no worker starts the next iteration before
every server has stepped, so a pull always reads the parameters of its iteration.

The state bytes are ``torch.save`` of tensors, numbers and dicts, read with
``weights_only=True`` (:func:`~elastic_ops.runtime.state.load_state`): no code crosses.
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist

HEADER = 8
HDR, DATA, ACK = 1, 2, 3
PULL, ROWS, PUSH, SNAP, BYE = 1, 2, 3, 4, 5


class Counter:
    """Bytes this process sent and received over the group (payloads and headers); the state
    snapshots (checkpoints, segment ends) apart, in ``snapshot``."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self.snapshot = 0

    def add_sent(self, t: torch.Tensor) -> None:
        self.sent += t.numel() * t.element_size()

    def add_received(self, t: torch.Tensor) -> None:
        self.received += t.numel() * t.element_size()


def header(kind: int, *values: int) -> torch.Tensor:
    h = torch.zeros(HEADER, dtype=torch.int64)
    h[0] = kind
    if values:
        h[1 : 1 + len(values)] = torch.tensor(values, dtype=torch.int64)
    return h


def state_bytes(state: dict[str, Any]) -> torch.Tensor:
    """``state`` as a uint8 tensor (``torch.save``)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def bytes_state(data: torch.Tensor) -> dict[str, Any]:
    from elastic_ops.runtime.state import load_state

    return load_state(io.BytesIO(data.numpy().tobytes()))


def send_blob(data: torch.Tensor, dst: int, counter: Counter) -> None:
    size = torch.tensor([data.numel()], dtype=torch.int64)
    dist.send(size, dst, tag=DATA)
    dist.send(data, dst, tag=DATA)
    counter.snapshot += size.numel() * 8 + data.numel()


def recv_blob(src: int, counter: Counter) -> torch.Tensor:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, tag=DATA)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src, tag=DATA)
    counter.snapshot += size.numel() * 8 + data.numel()
    return data
