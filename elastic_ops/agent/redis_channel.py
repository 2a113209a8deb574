"""The agent protocol over Redis, for node agents on other hosts (:mod:`elastic_ops.agent.node`).

Every message is a Redis list element: a sealed envelope ``{"mac": HEX, "body": JSON}`` where
``body`` is ``{"seq": n, "kind": "msg" | "beat" | "close", "msg": {...}}`` and ``mac`` is
HMAC-SHA256 over the list's name and ``body`` with the cluster's shared secret
(``ELASTIC_OPS_NODE_SECRET``). So whoever can write to Redis but lacks the secret cannot start a
chunk, change a target or forge an outcome; an envelope moved to another list (another session,
the other direction) fails its MAC; ``seq`` must grow by one, so a message replayed inside a
session is dropped and one lost (gone from Redis) ends it (:class:`MessageLostError`), never a
silent skip. Envelopes a side could not push while Redis was away are pushed, in order, when it
is back (within the peer timeout), so a blip of Redis ends nothing. Never pickle: bodies are parsed with the
protocol's strict JSON decoder.

Redis lists have no "connection closed", so each side sends a ``beat`` every ``beat_s`` and
treats ``peer_timeout_s`` without any envelope as the peer gone (``EOFError``, as a closed
socket; :attr:`RedisChannel.redis_trouble` says when Redis, not the peer, was the cause); a side
that ends normally sends ``close``. Both lists expire ``ttl_s`` after their
last write, so an abandoned session leaves nothing behind.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic_ops.agent.protocol import MAX_MESSAGE_BYTES, decode
from elastic_ops.agent.throttle import ThrottledLog
from elastic_ops.errors import UNSET, AgentProtocolError, SpecError

log = logging.getLogger("elastic_ops.node")
_DROPPED = ThrottledLog(log)  # junk anyone with Redis access pushes: counted, logged at a bounded rate

SECRET_ENV = "ELASTIC_OPS_NODE_SECRET"
MIN_SECRET_CHARS = 16
BEAT_S = 1.0
PEER_TIMEOUT_S = 10.0
SESSION_TTL_S = 3600
READ_BATCH = 512  # envelopes taken from Redis per round trip: junk is drained in bulk
_ENVELOPE_START = b'{"mac": "'  # how every envelope seal() writes begins


class PeerSilentError(EOFError):
    """No envelope from the other side within the peer timeout."""


class MessageLostError(EOFError):
    """A genuine message of the session is gone from Redis (a restart without persistence, a
    flush, someone with write access removing it): the session cannot go on. Redis's fault, not
    the peer's: :attr:`RedisChannel.redis_trouble` says so."""


MAX_UNSENT = 10_000  # envelopes kept for a Redis that is away (about peer_timeout_s of traffic)


class Signer:
    """Seals and opens envelopes with the cluster's shared secret."""

    def __init__(self, secret: str | None, *, field: str = SECRET_ENV) -> None:
        if not isinstance(secret, str) or len(secret) < MIN_SECRET_CHARS:
            shown = UNSET if not secret else f"<{len(secret)} characters, hidden>"
            raise SpecError(
                field,
                shown,
                f"a shared secret of at least {MIN_SECRET_CHARS} characters, the same on the tasks "
                "and every node agent",
                hint="e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`",
            )
        self._key = secret.encode()

    def __repr__(self) -> str:
        return "Signer(***)"

    def _mac(self, where: str, body: bytes) -> str:
        return hmac.new(self._key, where.encode() + b"\n" + body, hashlib.sha256).hexdigest()

    def derive(self, purpose: str, token: str) -> str:
        """A key for ``purpose`` that only holders of the secret can compute from the public
        ``token`` (hex): the rendezvous key of a segment spanning hosts, whose token travels in
        the ``ranks`` request while the key itself never crosses Redis. Its input cannot be an
        envelope's (those MAC a list name and a JSON object)."""
        return hmac.new(self._key, f"derive\n{purpose}\n{token}".encode(), hashlib.sha256).hexdigest()

    def seal(self, where: str, body: dict[str, Any]) -> bytes:
        """The envelope for ``body`` on the list named ``where``."""
        data = json.dumps(body, separators=(",", ":"), allow_nan=False)
        out = json.dumps({"mac": self._mac(where, data.encode()), "body": data}).encode()
        if len(out) > 2 * MAX_MESSAGE_BYTES:  # refused here, not by the node (it looked unavailable)
            raise AgentProtocolError(
                f"a message for {where} would be {len(out)} bytes; a node agent reads at most "
                f"{2 * MAX_MESSAGE_BYTES} (a spec's params that large: pass data as files or URIs)"
            )
        return out

    def open(self, where: str, raw: bytes) -> dict[str, Any]:
        """``body`` of an envelope read from ``where``; :class:`AgentProtocolError` if it is not
        one, or its MAC does not verify (wrong secret, forged, or moved from another list)."""
        if len(raw) > 2 * MAX_MESSAGE_BYTES:
            raise AgentProtocolError(f"an envelope on {where} exceeds {2 * MAX_MESSAGE_BYTES} bytes")
        if not raw.startswith(_ENVELOPE_START):  # junk is refused before it costs a JSON parse
            raise AgentProtocolError(f"a message on {where} is not an envelope")
        env = decode(raw)
        mac, body = env.get("mac"), env.get("body")
        if not isinstance(mac, str) or not isinstance(body, str):
            raise AgentProtocolError(f"an envelope on {where} needs string 'mac' and 'body'")
        if not hmac.compare_digest(mac, self._mac(where, body.encode())):
            raise AgentProtocolError(
                f"an envelope on {where} failed its signature check: not from a holder of "
                f"{SECRET_ENV} (or the tasks and the node agents use different secrets)"
            )
        return decode(body.encode())


def redis_error_types() -> tuple[type[BaseException], ...]:
    """What redis-py raises when Redis cannot serve a command (unreachable, timed out, refused
    it: out of memory, read-only replica, wrong password, ...)."""
    import redis

    return (redis.exceptions.RedisError,)


def wrong_type(exc: BaseException) -> bool:
    """Whether Redis refused a command because its key holds another type of value (a string
    where a list belongs: another program's key in this namespace), not because it is away."""
    import redis

    return isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith("WRONGTYPE")


def key_type(client: Any, key: str) -> str:
    """The type of the value at ``key`` (``string``, ``hash``, ...), for a message; ``unknown``
    if Redis cannot say."""
    try:
        found = client.type(key)
    except redis_error_types():
        return "unknown"
    return found.decode(errors="replace") if isinstance(found, bytes) else str(found)


class RedisChannel:
    """One session's pair of lists: this side pops ``inbox`` and pushes ``outbox``.

    ``send`` is safe from several threads; ``read`` belongs to one thread. A beat thread keeps
    the peer from timing out while this side is quiet (a long checkpoint, a waiting task)."""

    def __init__(
        self,
        redis: Any,
        signer: Signer,
        *,
        inbox: str,
        outbox: str,
        peer_timeout_s: float = PEER_TIMEOUT_S,
        beat_s: float = BEAT_S,
        ttl_s: int = SESSION_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis, self.signer = redis, signer
        self.inbox, self.outbox = inbox, outbox
        self.peer_timeout_s, self.beat_s, self.ttl_s, self.clock = peer_timeout_s, beat_s, ttl_s, clock
        self._lock = threading.Lock()
        self._seq_out = 0
        self._unsent: list[bytes] = []  # sealed, in order, not yet known to be in Redis
        self._failing_since: float | None = None  # when pushing to Redis began to fail
        self._seq_in = 0
        self.redis_trouble = ""  # why the session ended through Redis, not the peer ('' if it did not)
        self._read_failed = False  # a read from Redis failed since the last envelope came in
        self.dropped = 0  # envelopes that did not verify, or repeated one already taken
        self._dropped_at_last_in = 0  # ... as many when the last genuine one came
        self._batch: collections.deque[bytes] = collections.deque()  # taken from Redis, not yet read
        self._last_in = clock()
        self._closed = threading.Event()
        self._peer_closed = False
        self._beats = threading.Thread(target=self._beat, name=f"beat-{outbox}", daemon=True)
        self._beats.start()

    def __repr__(self) -> str:
        return f"RedisChannel(inbox={self.inbox!r}, outbox={self.outbox!r})"

    def _push(self, kind: str, msg: dict[str, Any] | None = None) -> None:
        """Seal the next envelope and push it, after any still unsent, in order. While Redis is
        away (for less than ``peer_timeout_s``, within :data:`MAX_UNSENT` envelopes) they wait
        for the next push or beat: a blip of Redis neither ends the session nor leaves a gap in
        the sequence (a sequence number spent on a beat that never arrived ended it for good).
        An envelope pushed twice (a reply lost after the push) is a repeat the peer drops."""
        with self._lock:
            self._seq_out += 1
            body = {"seq": self._seq_out, "kind": kind, "msg": msg}
            self._unsent.append(self.signer.seal(self.outbox, body))
            try:
                pipe = self.redis.pipeline()
                pipe.rpush(self.outbox, *self._unsent)
                pipe.expire(self.outbox, self.ttl_s)
                pipe.execute()
            except redis_error_types() as exc:
                now = self.clock()
                self._failing_since = now if self._failing_since is None else self._failing_since
                away = now - self._failing_since
                if away > self.peer_timeout_s or len(self._unsent) > MAX_UNSENT:
                    raise OSError(f"Redis unreachable for {away:.0f} s: {exc}") from None
                return
            self._unsent.clear()
            self._failing_since = None

    def _beat(self) -> None:
        while not self._closed.wait(self.beat_s):
            try:
                self._push("beat")
            except OSError:
                pass  # Redis is away; the peer times out unless it comes back in time

    def send(self, msg: dict[str, Any]) -> None:
        if self._closed.is_set():
            raise OSError(f"{self!r} is closed")
        self._push("msg", msg)

    def read(self, timeout: float | None = None) -> dict[str, Any] | None:
        deadline = None if timeout is None else self.clock() + timeout
        while True:
            if self._peer_closed:
                raise EOFError("the peer closed the session")
            if self._closed.is_set():
                raise EOFError("this side closed the session")
            silent = self.clock() - self._last_in
            if silent > self.peer_timeout_s:
                if self._read_failed:  # Redis was away meanwhile: not the peer's silence
                    self.redis_trouble = f"Redis unreachable while nothing came for {silent:.0f} s"
                    raise PeerSilentError(self.redis_trouble)
                if (junk := self.dropped - self._dropped_at_last_in) > 0:
                    # someone without the secret flooded this list: the peer's envelopes may be
                    # behind the junk, and the host is not to blame
                    self.redis_trouble = (f"{junk} envelopes that are not the peer's flooded {self.inbox} "
                                          f"while nothing genuine came for {silent:.0f} s")
                    raise PeerSilentError(self.redis_trouble)
                raise PeerSilentError(
                    f"nothing from the peer for {silent:.0f} s (it sends every {self.beat_s:g} s)"
                )
            wait = 1.0 if deadline is None else min(1.0, deadline - self.clock())
            try:
                raw = self._next(wait)
            except redis_error_types():
                raw = None  # counts as silence: the peer timeout decides
                self._read_failed = True
                time.sleep(min(0.2, max(wait, 0.0)))
            if raw is None:
                if deadline is not None and self.clock() >= deadline:
                    return None
                continue
            msg = self._accept(raw)
            if msg is not None:
                return msg

    def _next(self, wait: float) -> bytes | None:
        """The next envelope of the inbox: from the batch already taken, else one blocking pop
        and, behind it, up to READ_BATCH - 1 more in the same round trip (a list flooded with
        junk is drained in bulk, not one round trip per envelope)."""
        if self._batch:
            return self._batch.popleft()
        if wait > 0.001:
            item = self.redis.blpop([self.inbox], timeout=wait)
            if item is None:
                return None
            first = item[1]
        else:
            first = self.redis.lpop(self.inbox)
            if first is None:
                return None
        more = self.redis.lpop(self.inbox, READ_BATCH - 1)
        if more:
            self._batch.extend(more)
        return first

    def _accept(self, raw: bytes) -> dict[str, Any] | None:
        # Anyone who can write to Redis can push onto a session's list, secret or not: what does
        # not verify (or repeats a message already taken) is dropped, never the session's end,
        # or one junk push would fail a running chunk. Only a gap in the signed sequence, a
        # genuine message gone missing, is an error.
        try:
            body = self.signer.open(self.inbox, raw)
        except AgentProtocolError as exc:
            self.dropped += 1
            _DROPPED.warning("dropped a message on %s: %s", self.inbox, exc)
            return None
        seq, kind = body.get("seq"), body.get("kind")
        if type(seq) is int and seq <= self._seq_in:
            self.dropped += 1
            _DROPPED.warning("dropped a replayed message %d on %s (at %d)", seq, self.inbox, self._seq_in)
            return None
        if type(seq) is not int:
            raise AgentProtocolError(f"message {seq!r} on {self.inbox}: 'seq' must be an integer")
        if seq != self._seq_in + 1:
            self.redis_trouble = (
                f"message {seq} on {self.inbox} out of order (expected {self._seq_in + 1}): a message "
                "was lost in Redis (restarted without persistence, flushed, or an element removed)"
            )
            raise MessageLostError(self.redis_trouble)
        self._seq_in = seq
        self._last_in = self.clock()
        self._dropped_at_last_in = self.dropped
        self._read_failed = False
        if kind == "beat":
            return None
        if kind == "close":
            self._peer_closed = True
            raise EOFError("the peer closed the session")
        if kind != "msg" or not isinstance(body.get("msg"), dict):
            raise AgentProtocolError(f"envelope kind {kind!r} on {self.inbox}: expected msg, beat or close")
        return body["msg"]

    def close(self) -> None:
        if self._closed.is_set():
            return
        try:
            self._push("close")
        except OSError:
            pass  # the peer times out instead
        self._closed.set()
