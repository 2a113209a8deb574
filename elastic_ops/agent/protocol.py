"""The agent's wire protocol: one JSON object per line over a Unix stream socket (the per-host
agent), or the same objects as sealed envelopes on Redis lists (a cluster's node agents, which
take ``run`` and ``latest``: :mod:`elastic_ops.agent.redis_channel`).

Never pickle: a message is data only, parsed with ``json`` and validated field by field, so a
peer can make the other side do nothing but what the protocol names.

Client → agent (the first message names the operation; only ``run`` takes further messages)::

    {"op": "ping", "version": 2}
    {"op": "latest", "version": 2, "store": STORE, "spec_hash": "..."}
    {"op": "run", "version": 2, "spec": {...JobSpec.to_dict()}, "start": 0, "end": 40,
     "epoch": 3, "host": "h1", "workers": 2, "slots": [4, 5] | null, "store": STORE,
     "warm_start": STORE | null}
    {"op": "target", "workers": 1, "slots": [4] | null}  # the pool's target changed (0 = preempt)

A node agent's ``run`` and ``target`` may also carry ``"spans": [["h2", [0, 1]], ...]``, the
slots the same target grants on other hosts: a count beyond ``slots`` then runs one process
group across the hosts (:mod:`elastic_ops.agent.span`), and ``applied`` carries the other hosts'
slots in use the same way.

``slots``: the GPU slots the pool's target names on the agent's host (``Target.placements`` of
that host, in order); null in ``run`` means "not known" (workers take the visible GPUs in
order), and then every ``target`` carries null too; otherwise every ``target`` carries the slots
that come with its count.

Agent → client::

    {"type": "pong", "version": 2, "pid": 123, "chunks": 0}
    {"type": "latest", "iteration": 40 | null, "uri": "..." | null}
    {"type": "progress", "iteration": i, "end": e, "loss": x, "workers": n,
     "samples_per_sec": r, "eta_s": s}
    {"type": "applied", "iteration": i, "workers": n, "slots": [4, 5] | null}
        # n workers start at boundary i on those slots (old ones exited): sent when the count or
        # the slots change (a move to other slots at the same count, e.g. off a draining host)
    {"type": "result", "result": {...ChunkResult.to_dict()}}
    {"type": "error", "class": "WorkerLostError", "message": "...", "hint": ..., "retryable": true,
     "attrs": {"host": "h1"}, "traceback": "..."}

``STORE`` is :class:`StoreConfig` on the wire: the checkpoint URI, retention, and for ``s3://``
the endpoint, region and credentials the task resolved from its Airflow ``aws`` connection
(:class:`S3Config`; its secrets never appear in a ``repr`` or a log line).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import select
import socket
import struct
import time
from collections.abc import Mapping
from typing import Any

from elastic_ops import errors
from elastic_ops.errors import AgentProtocolError, ElasticOpsError, SpecError
from elastic_ops.runtime.outcome import Progress
from elastic_ops.runtime.outcome import finite as _finite
from elastic_ops.spec import MAX_WORKERS_LIMIT, check_checkpoint_uri, check_int

PROTOCOL_VERSION = 2  # 2: batch and import_path in run requests, the drain op
AGENT_SOCKET_ENV = "ELASTIC_OPS_AGENT_SOCKET"
MAX_MESSAGE_BYTES = 1 << 20  # one line; a spec with large params still fits
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes on Linux, NUL included
OPS = ("ping", "latest", "run", "drain")

# Attributes of elastic_ops errors that travel with them (plain JSON values only).
ERROR_ATTRS = ("host", "field", "value", "allowed", "epoch", "current", "job", "name")


class AgentRemoteError(RuntimeError):
    """An exception outside the elastic_ops hierarchy raised in the agent (e.g. from torch).

    Deliberately not an ``ElasticOpsError``: in a task process the same exception would reach
    Airflow's default retry handling, and so does this one.
    """

    def __init__(self, remote_class: str, message: str, remote_traceback: str | None = None) -> None:
        self.remote_class = remote_class
        self.remote_traceback = remote_traceback
        text = f"{remote_class}: {message} (raised in the elastic-ops agent)"
        if remote_traceback:
            text += "\n" + remote_traceback
        super().__init__(text)


# --- configuration ---------------------------------------------------------------------------


def check_socket_path(value: object, field: str = AGENT_SOCKET_ENV) -> str:
    """``value`` as a Unix socket path, or :class:`SpecError` naming ``field``."""
    allowed = f"an absolute path of at most {MAX_SOCKET_PATH} bytes"
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise SpecError(field, value, allowed)
    if len(os.fsencode(value)) > MAX_SOCKET_PATH:
        raise SpecError(field, value, allowed, hint="use a shorter directory, e.g. under /tmp or /run")
    return value


def peer_uid(conn: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket, or None where the OS cannot
    tell (not Linux: the socket file's 0600 mode is then the only gate)."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (AttributeError, OSError):
        return None
    return struct.unpack("3i", creds)[1]


def trusted_peer(uid: int | None) -> bool:
    """Whether the agent and a task may talk: the same user, or root."""
    return uid is None or uid in (os.getuid(), 0)


def agent_socket_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The agent socket configured for this host (``ELASTIC_OPS_AGENT_SOCKET``), or ``None``.

    Unset or empty means "no agent": chunks run in the task process. A set value must be a valid
    socket path; a typo fails loudly instead of silently running every chunk the slow way.
    """
    value = (os.environ if environ is None else environ).get(AGENT_SOCKET_ENV, "")
    return check_socket_path(value) if value else None


def _require(
    msg: dict[str, Any], key: str, kinds: tuple[type, ...], allowed: str, optional: bool, field: str | None
) -> Any:
    if key not in msg or msg[key] is None:
        if optional:
            return None
        raise SpecError(field or key, None, allowed)
    value = msg[key]
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise SpecError(field or key, value, allowed)
    return value


MAX_INT = 2**63 - 1  # what the ledger, the store's names and C's integers hold
MAX_SLOT = 1_000_000  # slots on one host (as the pool's add_host allows)


def require_int(
    msg: dict[str, Any], key: str, minimum: int = 0, *, optional: bool = False, field: str | None = None,
    maximum: int = MAX_INT,
) -> int | None:
    """``msg[key]`` as an integer in ``[minimum, maximum]`` (``None`` if ``optional`` and absent);
    errors name ``field`` (default ``key``)."""
    value = _require(msg, key, (int,), f"an integer >= {minimum} and <= {maximum}", optional, field)
    return None if value is None else check_int(field or key, value, minimum, maximum)


def require_str(
    msg: dict[str, Any], key: str, *, optional: bool = False, field: str | None = None
) -> str | None:
    value = _require(msg, key, (str,), "a non-empty string", optional, field)
    if value is not None and not value:
        raise SpecError(field or key, value, "a non-empty string")
    return value


def require_slots(msg: dict[str, Any], key: str = "slots") -> tuple[int, ...] | None:
    """``msg[key]`` as distinct GPU slot indices (``None`` if absent or null)."""
    value = msg.get(key)
    if value is None:
        return None
    allowed = f"a list of at most {MAX_WORKERS_LIMIT} distinct integers in [0, {MAX_SLOT}) (GPU slot indices)"
    if not isinstance(value, list) or len(value) > MAX_WORKERS_LIMIT:
        raise SpecError(key, value, allowed)
    for slot in value:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < MAX_SLOT:
            raise SpecError(key, value, allowed)
    if len(set(value)) < len(value):
        raise SpecError(key, value, allowed)
    return tuple(value)


def latest_of(msg: dict[str, Any]) -> tuple[int, str, dict[str, Any]] | None:
    """A ``latest`` reply as ``(iteration, uri, metrics)`` (None: no checkpoint yet); an agent
    from before metrics were sent answers without them (``{}``)."""
    if msg.get("iteration") is None:
        return None
    metrics = msg.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise AgentProtocolError(f"'metrics' of a latest reply must be an object, not {metrics!r}")
    return require_int(msg, "iteration", 0), require_str(msg, "uri"), metrics


def require_spans(msg: dict[str, Any], key: str = "spans") -> tuple[tuple[str, tuple[int, ...]], ...] | None:
    """``msg[key]``, the slots of other hosts ``[[host, [slot, ...]], ...]``, as a tuple of
    ``(host, slots)`` (``None`` if absent or null)."""
    from elastic_ops.spec import check_host_name

    value = msg.get(key)
    if value is None:
        return None
    allowed = "a list of [host, [slot, ...]] pairs, each host once"
    if not isinstance(value, list) or len(value) > MAX_WORKERS_LIMIT:
        raise SpecError(key, value, allowed)
    out = []
    for pair in value:
        if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], str):
            raise SpecError(key, value, allowed)
        out.append((check_host_name(key, pair[0]), require_slots({key: pair[1]}, key) or ()))
    if len({h for h, _ in out}) < len(out):
        raise SpecError(key, value, allowed)
    return tuple(out)


def applied_from_wire(
    msg: dict[str, Any],
) -> tuple[int, int, tuple[int, ...] | None, tuple[tuple[str, tuple[int, ...]], ...] | None]:
    """``(iteration, workers, slots, spans)`` of an agent's ``applied`` message; a malformed one
    raises :class:`AgentProtocolError` (the agent broke the protocol, nothing the task sent was
    wrong)."""
    try:
        return (require_int(msg, "iteration"), require_int(msg, "workers", 1), require_slots(msg),
                require_spans(msg))
    except SpecError as exc:
        raise AgentProtocolError(f"malformed 'applied' message from the agent: {exc}") from None


@dataclasses.dataclass(frozen=True)
class S3Config:
    """What the agent needs to build the same boto3 S3 client as the task's ``aws`` connection."""

    endpoint_url: str | None = None
    region_name: str | None = None
    access_key_id: str | None = dataclasses.field(default=None, repr=False)
    secret_access_key: str | None = dataclasses.field(default=None, repr=False)
    session_token: str | None = dataclasses.field(default=None, repr=False)

    FIELDS = ("endpoint_url", "region_name", "access_key_id", "secret_access_key", "session_token")

    def __repr__(self) -> str:
        secret = "***" if self.secret_access_key or self.session_token else None
        return (
            f"S3Config(endpoint_url={self.endpoint_url!r}, region_name={self.region_name!r}, secret={secret})"
        )

    def to_wire(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.FIELDS if getattr(self, k) is not None}

    @classmethod
    def from_wire(cls, value: object) -> S3Config:
        if not isinstance(value, dict):
            raise SpecError("store.s3", type(value).__name__, f"an object with keys {', '.join(cls.FIELDS)}")
        unknown = sorted(set(value) - set(cls.FIELDS))
        if unknown:
            raise SpecError("store.s3", unknown, f"known keys are {', '.join(cls.FIELDS)}")
        return cls(**{k: require_str(value, k, optional=True, field=f"store.s3.{k}") for k in cls.FIELDS})

    def client(self) -> Any:
        """A boto3 S3 client with exactly these settings (no default credential chain mixed in
        when keys are given) and the store's botocore settings (``client_config``)."""
        import boto3

        from elastic_ops.checkpoint.s3 import client_config

        session = boto3.session.Session(
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
            aws_session_token=self.session_token,
            region_name=self.region_name,
        )
        return session.client("s3", endpoint_url=self.endpoint_url, config=client_config())


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    """A checkpoint store as the task would open it: URI, retention, S3 client settings."""

    uri: str
    keep_last: int = 3
    keep_every: int | None = None
    s3: S3Config | None = None

    def to_wire(self) -> dict[str, Any]:
        return {
            "uri": self.uri,
            "keep_last": self.keep_last,
            "keep_every": self.keep_every,
            "s3": self.s3.to_wire() if self.s3 is not None else None,
        }

    @classmethod
    def from_wire(cls, value: object, field: str = "store") -> StoreConfig:
        if not isinstance(value, dict):
            raise SpecError(field, type(value).__name__, "an object with uri, keep_last, keep_every, s3")
        unknown = sorted(set(value) - {"uri", "keep_last", "keep_every", "s3"})
        if unknown:
            raise SpecError(field, unknown, "known keys are uri, keep_last, keep_every, s3")
        uri = require_str(value, "uri", field=f"{field}.uri")
        check_checkpoint_uri(f"{field}.uri", uri)
        s3 = S3Config.from_wire(value["s3"]) if value.get("s3") is not None else None
        if s3 is not None and not uri.startswith("s3://"):
            raise SpecError(f"{field}.s3", "...", "S3 settings only apply to s3:// URIs")
        keep_last = require_int(value, "keep_last", 1, optional=True, field=f"{field}.keep_last")
        keep_every = require_int(value, "keep_every", 1, optional=True, field=f"{field}.keep_every")
        return cls(uri=uri, keep_last=3 if keep_last is None else keep_last, keep_every=keep_every, s3=s3)

    def open(self, *, create: bool = True) -> Any:
        """Open the store (imports the checkpoint layer, hence torch: call it in the agent);
        ``create=False``: only to read it (a local directory is not created)."""
        from elastic_ops.checkpoint import open_store

        client = self.s3.client() if self.s3 is not None else None
        return open_store(self.uri, s3_client=client, keep_last=self.keep_last, keep_every=self.keep_every,
                          create=create)


# --- errors on the wire ----------------------------------------------------------------------


def _plain(value: object) -> Any:
    """``value`` if JSON can carry it as is, else its ``repr``."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, str)) for v in value):
        return list(value)
    return repr(value)


def error_to_wire(exc: BaseException, traceback_text: str | None = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"type": "error", "class": type(exc).__name__, "traceback": traceback_text}
    if isinstance(exc, ElasticOpsError):
        msg.update(
            message=exc.message,
            hint=exc.hint,
            retryable=bool(exc.retryable),
            attrs={k: _plain(getattr(exc, k)) for k in ERROR_ATTRS if k in vars(exc)},
        )
        msg["traceback"] = None  # the message says what happened; tracebacks are for surprises
    else:
        msg.update(message=str(exc), hint=None, retryable=None, attrs={})
    return msg


def error_from_wire(msg: dict[str, Any]) -> BaseException:
    """The exception ``msg`` describes: the same ``elastic_ops.errors`` class with the same
    message, hint and attributes (so retry classification is unchanged), else
    :class:`AgentRemoteError`."""
    name = str(msg.get("class") or "Exception")
    cls = getattr(errors, name, None)  # the agent's own errors are in the hierarchy too
    message = str(msg.get("message") or "")
    if not (isinstance(cls, type) and issubclass(cls, ElasticOpsError)):
        return AgentRemoteError(name, message, msg.get("traceback"))
    exc = cls.__new__(cls)
    ElasticOpsError.__init__(exc, message, hint=msg.get("hint"))
    attrs = msg.get("attrs") if isinstance(msg.get("attrs"), dict) else {}
    for key in ERROR_ATTRS:
        if key in attrs:
            setattr(exc, key, attrs[key])
    if isinstance(cls, type) and issubclass(cls, errors.WorkerLostError) and not hasattr(exc, "host"):
        exc.host = None
    retryable = msg.get("retryable")
    if isinstance(retryable, bool) and retryable != cls.retryable:
        exc.retryable = retryable
    return exc


# --- framing ---------------------------------------------------------------------------------


def encode(msg: dict[str, Any]) -> bytes:
    data = json.dumps(msg, separators=(",", ":"), allow_nan=False).encode() + b"\n"
    if len(data) > MAX_MESSAGE_BYTES:
        raise AgentProtocolError(f"message of {len(data)} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")
    return data


def progress_to_wire(p: Progress) -> dict[str, Any]:
    """A runtime ``Progress`` as a ``progress`` message (``client.progress_from_wire`` reverses it)."""
    return {"type": "progress", **{f.name: _finite(getattr(p, f.name)) for f in dataclasses.fields(Progress)}}


class MessageReader:
    """Reads newline-delimited JSON objects from a stream socket, at most ``MAX_MESSAGE_BYTES`` each."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.closed = False
        self._poller = select.poll()  # not select(): it cannot watch a descriptor above 1023
        self._poller.register(sock, select.POLLIN)

    def read(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next message; ``None`` if none arrived within ``timeout`` (in all: a peer that
        sends a byte now and then cannot keep it waiting longer); ``EOFError`` at the end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            line = self._line()
            if line is not None:
                return decode(line)
            if self.closed:
                raise EOFError("the peer closed the connection")
            # wait here, not in recv: the socket's own timeout bounds sends (a peer that stops
            # reading), and a blocking read must not end with it
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._poller.poll(None if left is None else left * 1000):
                return None
            try:
                data = self.sock.recv(65536)
            except (ConnectionResetError, BrokenPipeError) as exc:
                raise EOFError(f"the connection broke: {exc}") from None
            if not data:
                self.closed = True
            self.buf += data

    def _line(self) -> bytes | None:
        nl = self.buf.find(b"\n")
        if nl < 0:
            if len(self.buf) > MAX_MESSAGE_BYTES:
                raise AgentProtocolError(f"a message exceeds the limit of {MAX_MESSAGE_BYTES} bytes")
            return None
        line = bytes(self.buf[:nl])
        del self.buf[: nl + 1]
        return line


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for ``json.loads`` that refuses a key given twice (the standard
    parser keeps the last, so two readers of one message could see different values)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def decode(line: bytes) -> dict[str, Any]:
    """One message: strict JSON (no NaN/Infinity, no key given twice, bounded nesting)."""
    try:
        msg = json.loads(line, parse_constant=_no_constant, object_pairs_hook=unique_keys)
    except RecursionError:
        raise AgentProtocolError("a message is nested too deeply") from None
    except ValueError as exc:
        raise AgentProtocolError(f"a message is not valid JSON: {exc}") from None
    if not isinstance(msg, dict):
        raise AgentProtocolError(f"a message must be a JSON object, got {type(msg).__name__}")
    return msg
