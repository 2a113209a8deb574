"""The workers' rendezvous: the runner's ``TCPStore``, with every value signed by a per-segment key.

torch's ``TCPStore`` has no authentication, and its listening socket (on loopback, or on the
advertised address of a segment spanning hosts) is open to every local user: anyone can connect,
``list_keys()``, read every value and ``set`` any key. A secret key *prefix* hides nothing
(``list_keys`` shows it). So the workers go through :class:`SignedStore`: every value they set
carries an HMAC-SHA256 of its key and bytes under the segment's key, and every value they read
must verify, so a value written by anyone without the key (or moved from another key, or left
by another segment) fails the rendezvous loudly instead of pointing a rank at an impostor.

The key is new for every segment (:func:`new_key`) and reaches the workers through their
environment (``ELASTIC_OPS_RENDEZVOUS_KEY``; a process's environment is readable by its own
user only), never argv or a log; each worker takes it out of its environment before any user
code runs (:func:`segment_key`). Across hosts the leader's node agent derives it from the
cluster's secret and a fresh token that the ``ranks`` request carries
(:mod:`elastic_ops.agent.span`), so the key itself never crosses Redis.

What this does not stop (docs/runtime.md "Who can reach the rendezvous"): reading the values
(gloo's addresses), deleting or overwriting keys (the segment then fails and is retried), and
gloo's own sockets, which have no authentication either.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import secrets
from collections.abc import Sequence

import torch.distributed as dist

KEY_ENV = "ELASTIC_OPS_RENDEZVOUS_KEY"
_MAC_BYTES = 32
_taken: str | None = None  # this worker's key, once taken out of its environment


class RendezvousForgeryError(RuntimeError):
    """A rendezvous value that the segment's key does not sign: written by someone else."""


def new_key() -> str:
    """A fresh segment key (256 bits, hex)."""
    return secrets.token_hex(32)


def segment_key() -> str:
    """This worker's segment key, removed from ``os.environ`` the first time (the user's code,
    and any process it starts, never sees it). A worker the runner did not start has none."""
    global _taken
    if _taken is None:
        key = os.environ.pop(KEY_ENV, None)
        if not key:
            raise RuntimeError(
                f"{KEY_ENV} is not set: this process was not started by the elastic_ops runner "
                "(a segment's workers get the key that signs its rendezvous)"
            )
        _taken = key
    return _taken


class SignedStore(dist.Store):
    """``store`` with every value signed and verified under ``key`` (see the module doc).

    Counters (``add``) cannot carry a signature and pass through unsigned: torch uses them for
    barriers, where a forged count can only make a wait end early or never, which the group's
    timeout and its own checks then report."""

    def __init__(self, store: dist.Store, key: str) -> None:
        super().__init__()
        self._store, self._hex = store, key
        self._key = bytes.fromhex(key)

    def __repr__(self) -> str:
        return "SignedStore(***)"

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\n" + value, hashlib.sha256).digest()

    def _sign(self, key: str, value: str | bytes) -> bytes:
        data = value.encode() if isinstance(value, str) else bytes(value)
        return self._mac(key, data) + data

    def _open(self, key: str, raw: bytes) -> bytes:
        mac, data = raw[:_MAC_BYTES], raw[_MAC_BYTES:]
        if len(mac) < _MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, data)):
            raise RendezvousForgeryError(
                f"the rendezvous value at {key!r} is not signed by this segment's key: someone who "
                "can reach the segment's store (another local user, another host) wrote it; the "
                "segment fails rather than connect to whoever wrote it (see docs/runtime.md, "
                "'Who can reach the rendezvous')"
            )
        return data

    def set(self, key: str, value: str | bytes) -> None:
        self._store.set(key, self._sign(key, value))

    def get(self, key: str) -> bytes:
        return self._open(key, self._store.get(key))

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self._store.multi_set(list(keys), [self._sign(k, v) for k, v in zip(keys, values, strict=True)])

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [self._open(k, raw) for k, raw in zip(keys, self._store.multi_get(list(keys)), strict=True)]

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._store.wait(list(keys))
        else:
            self._store.wait(list(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self._store.check(list(keys))

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._store.set_timeout(timeout)

    def clone(self) -> SignedStore:
        # a connection of its own for another thread (torch's process groups may ask for one)
        return SignedStore(self._store.clone(), self._hex)


def worker_store(timeout: datetime.timedelta) -> SignedStore:
    """The rendezvous store of this worker's segment: a client of the runner's ``TCPStore`` at
    ``MASTER_ADDR:MASTER_PORT``, signed with :func:`segment_key`."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
        is_master=False, timeout=timeout,
    )
    return SignedStore(store, segment_key())
