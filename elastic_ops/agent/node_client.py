"""The task side of a node agent: send a chunk to the host the pool granted, stream its target,
get its outcome. Never imports torch nor Airflow.

The S3 credentials the task resolved from its Airflow connection are *not* sent: Redis is shared
by the whole cluster, so a node agent opens ``s3://`` stores with its own host's credentials
(boto3's standard chain: instance role, environment, config files); the endpoint and region do
travel.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from elastic_ops.agent.client import POLL_S, drive_chunk, run_request, target_reader
from elastic_ops.agent.cluster import ALIVE_EVERY_S, ANNOUNCEMENT_MAX_AGE_S, CLOCK_SKEW_S, NodeConfig
from elastic_ops.agent.protocol import (
    PROTOCOL_VERSION,
    StoreConfig,
    error_from_wire,
    latest_of,
)
from elastic_ops.agent.redis_channel import (
    BEAT_S,
    PEER_TIMEOUT_S,
    RedisChannel,
    key_type,
    redis_error_types,
    wrong_type,
)
from elastic_ops.errors import (
    AgentLostError,
    AgentProtocolError,
    NodeLostError,
    NodeUnavailableError,
    SpecError,
)
from elastic_ops.runtime.allocation import Allocation
from elastic_ops.runtime.outcome import ChunkResult, Progress
from elastic_ops.spec import check_host_name
from elastic_ops.urls import shown_url

ACCEPT_TIMEOUT_S = 30.0  # a live node takes a request within a second; this covers a busy Redis
DECIDE_S = 1.0  # how long a node that popped a request has to claim or refuse it, as the task sees it


def without_credentials(store: StoreConfig | None) -> StoreConfig | None:
    """``store`` as a node agent gets it: endpoint and region, no keys."""
    if store is None or store.s3 is None:
        return store
    s3 = dataclasses.replace(store.s3, access_key_id=None, secret_access_key=None, session_token=None)
    return dataclasses.replace(store, s3=s3)


def _announcement(config: NodeConfig, host: str, raw: bytes | None, now: float) -> dict[str, Any] | None:
    """The fields of ``host``'s announcement, or ``None`` when there is none, it is not signed
    with the cluster's secret (a forged one: its address would decide how chunks are run), or
    its signed time ``at`` is more than ANNOUNCEMENT_MAX_AGE_S from ``now`` (a captured one
    replayed; one from a node that predates the field). They end up in tables and pages: only
    short printable strings and plain numbers are kept."""
    if raw is None:
        return None
    try:
        info = config.signer().open(config.alive_key(host), raw)
    except AgentProtocolError:
        return None
    if not isinstance(info, dict):
        return None
    at = _signed_at(info)
    if at is None or not -CLOCK_SKEW_S <= now - at <= ANNOUNCEMENT_MAX_AGE_S:
        return None
    return {k: v for k, v in info.items() if _printable(k) and (_printable(v) or _plain_number(v))}


def _signed_at(info: object) -> float | None:
    """The time an opened announcement says it was written (None: it says none usable)."""
    at = info.get("at") if isinstance(info, dict) else None
    if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
        return None
    return float(at)


def _printable(value: object) -> bool:
    return isinstance(value, str) and len(value) <= 255 and value.isprintable()


def _plain_number(value: object) -> bool:
    return value is None or isinstance(value, bool | int | float)


def _announced(config: NodeConfig, host: str, raw: bytes | None, now: float) -> bool:
    info = _announcement(config, host, raw, now)
    return info is not None and info.get("version") == PROTOCOL_VERSION


class NodeClient:
    """Runs chunks on the node agents of a cluster (one Redis, one namespace, one secret)."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        accept_timeout_s: float | None = None,  # None: ACCEPT_TIMEOUT_S
        peer_timeout_s: float = PEER_TIMEOUT_S,
        beat_s: float = BEAT_S,
        redis: Any = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.signer = config.signer()
        self.accept_timeout_s = ACCEPT_TIMEOUT_S if accept_timeout_s is None else accept_timeout_s
        self.peer_timeout_s, self.beat_s = peer_timeout_s, beat_s
        self._redis = redis if redis is not None else config.redis()
        self.wall_clock = wall_clock
        self._lock = threading.Lock()
        self._channels: list[RedisChannel] = []

    def __repr__(self) -> str:
        return f"NodeClient({self.config!r})"

    def _unreachable(self, exc: BaseException | str, what: str = "is unreachable") -> AgentLostError:
        # not the granted host's fault: retryable, and not reported against it
        return AgentLostError(
            f"the cluster's Redis at {shown_url(self.config.url)} {what}: {exc}",
            hint="check ELASTIC_OPS_NODE_REDIS_URL and the Redis server (a chunk task's retry resumes from "
            "the last committed checkpoint)",
        )

    def alive(self, host: str) -> dict[str, Any] | None:
        """The announcement of ``host``'s node agent (pid, protocol version, chunks), or ``None``."""
        try:
            raw = self._redis.get(self.config.alive_key(check_host_name("host", host)))
        except redis_error_types() as exc:
            raise self._unreachable(exc) from None
        return _announcement(self.config, host, raw, self.wall_clock())

    def _clock_off(self, host: str) -> float | None:
        """How far ``host``'s genuine (signed) announcement is from this host's clock, when that
        is why it is not trusted (None: there is none, or it is not signed)."""
        try:
            raw = self._redis.get(self.config.alive_key(host))
        except redis_error_types() as exc:
            raise self._unreachable(exc) from None
        if raw is None:
            return None
        try:
            info = self.config.signer().open(self.config.alive_key(host), raw)
        except AgentProtocolError:
            return None
        at = _signed_at(info)
        return None if at is None else self.wall_clock() - at

    def live_hosts(self, hosts: Sequence[str]) -> set[str]:
        """Those of ``hosts`` whose node agent is announced and speaks this protocol version."""
        hosts = [check_host_name("host", h) for h in hosts]
        if not hosts:
            return set()
        try:
            raws = self._redis.mget([self.config.alive_key(h) for h in hosts])
        except redis_error_types() as exc:
            raise self._unreachable(exc) from None
        now = self.wall_clock()
        return {h for h, raw in zip(hosts, raws, strict=True) if _announced(self.config, h, raw, now)}

    def announced(self) -> dict[str, dict[str, Any]]:
        """Every node agent announced in this namespace: host → its announcement (pid, protocol
        version, chunks running)."""
        prefix = self.config.alive_key("")
        try:
            keys = sorted(k for k in self._redis.scan_iter(match=f"{prefix}*", count=500)
                          if not k.endswith(b":runs"))
            raws = self._redis.mget(keys) if keys else []
        except redis_error_types() as exc:
            raise self._unreachable(exc) from None
        out, now = {}, self.wall_clock()
        for key, raw in zip(keys, raws, strict=True):
            try:  # a key a node agent could not have written (not UTF-8, not a host name): skipped
                host = check_host_name("host", key.decode()[len(prefix):])
            except (UnicodeDecodeError, SpecError):
                continue
            info = _announcement(self.config, host, raw, now)
            if info is not None:
                out[host] = info
        return out

    def abort(self) -> None:
        """End every chunk this client is running (the task is being killed): each node agent
        sees the session close and kills its workers now rather than after the peer timeout."""
        with self._lock:
            channels = list(self._channels)
        # from threads: abort() runs in a signal handler (Airflow's on_kill), possibly while this
        # very thread is inside a channel's send holding its lock; waiting here would deadlock
        closers = [threading.Thread(target=ch.close, name="abort", daemon=True) for ch in channels]
        for t in closers:
            t.start()
        for t in closers:
            t.join(timeout=1.0)

    def run_chunk(
        self,
        spec: dict[str, Any],
        start: int,
        end: int,
        *,
        epoch: int,
        host: str,
        store: StoreConfig,
        target: Callable[[], Allocation],
        warm_start: StoreConfig | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        on_applied: Callable[[int, Allocation], None] | None = None,
        poll_s: float = POLL_S,
        spans: bool = False,
    ) -> ChunkResult:
        """Run iterations ``[start, end)`` of ``spec`` on the node agent of ``host``; the arguments
        are those of :meth:`AgentClient.run_chunk`. Raises :class:`NodeUnavailableError` (naming
        the host) when no node agent runs for ``host`` or none took the chunk in time,
        :class:`NodeLostError` when the node went silent mid-chunk, the chunk's own error as the
        runtime raised it, or :class:`AgentLostError` when Redis is unreachable or the node agent
        stopped (neither is the host's fault).
        ``spans``: the target's slots on the other hosts are sent too; a count beyond ``host``'s
        slots then trains one process group across the hosts (the node must have been started
        with ``--advertise-addr``), and ``on_applied`` names the other hosts' slots in use."""
        self._require_node(host)

        current = target_reader(target, host, spans)
        sent = current()
        run = run_request(spec, start, end, epoch, host, sent, without_credentials(store),
                          without_credentials(warm_start))
        channel, request = self._open(host, run)
        try:
            first = self._first(channel, request, host, "the chunk")
            if first.get("type") != "accepted":
                raise AgentProtocolError(
                    f"expected 'accepted' from the node agent, got {first.get('type')!r}"
                )

            def lost(why: str) -> BaseException:
                if channel.redis_trouble:  # Redis was away or lost a message: not the host's fault
                    return self._unreachable(channel.redis_trouble, "failed this session")
                return NodeLostError(
                    f"the node agent of host {host} went away mid-chunk (iterations {start}..{end}): {why}",
                    host=host,
                    hint="its host or process died or the network failed; the retry's grant avoids this "
                    "host and resumes from the last committed checkpoint",
                )

            return drive_chunk(
                channel,
                host,
                sent,
                current,
                on_progress=on_progress,
                on_applied=on_applied,
                poll_s=poll_s,
                lost=lost,
                error=error_from_wire,
            )
        finally:
            self._close(channel)

    def start_ranks(self, host: str, msg: dict[str, Any]) -> Any:
        """Have ``host``'s node agent start its part of a spanning segment (a ``ranks`` request,
        :mod:`elastic_ops.agent.span`); the :class:`~elastic_ops.agent.span.RedisRanks` that
        follows them once the node says they started. Raises as :meth:`run_chunk` does."""
        from elastic_ops.agent.span import RedisRanks

        self._require_node(host)
        channel, request = self._open(host, msg)
        try:
            first = self._first(channel, request, host, "its part of a segment")
            if first.get("type") != "started":
                raise AgentProtocolError(f"expected 'started' from the node agent, got {first.get('type')!r}")
        except BaseException:
            self._close(channel)
            raise
        return RedisRanks(host, channel, self._close)

    def latest(
        self, host: str, store: StoreConfig, spec_hash: str | None
    ) -> tuple[int, str, dict[str, Any]] | None:
        """``(iteration, uri, metrics)`` of the latest committed checkpoint of ``spec_hash`` in
        ``store``, read by ``host``'s node agent (verified by its checksums, not decoded): the task's
        "already done?" check without importing torch. Raises as :meth:`run_chunk` does."""
        self._require_node(host)
        msg = {"op": "latest", "version": PROTOCOL_VERSION, "host": host,
               "store": without_credentials(store).to_wire(), "spec_hash": spec_hash}
        channel, request = self._open(host, msg)
        try:
            reply = self._first(channel, request, host, "the question")
        finally:
            self._close(channel)
        if reply.get("type") != "latest":
            raise AgentProtocolError(f"expected 'latest' from the node agent, got {reply.get('type')!r}")
        return latest_of(reply)

    def drain(self, host: str, grace_s: float | None = None) -> dict[str, Any]:
        """Drain ``host``'s node agent (``elastic-ops node --drain``, as its SIGTERM does): its
        running chunks commit at their next boundary and end within ``grace_s`` (None: the
        node's own ``--grace``), then it stops. Returns its announcement, once the node has
        withdrawn it (it took the drain); :class:`NodeUnavailableError` if none takes it."""
        if grace_s is not None:
            from elastic_ops.agent.server import check_grace

            grace_s = check_grace("--grace", grace_s)
        self._require_node(host)
        info = self.alive(host) or {}
        runs = self.config.runs_key(host)
        envelope = self.signer.seal(runs, {"seq": 1, "kind": "drain", "session": secrets.token_hex(16),
                                           "issued": self.wall_clock(), "msg": {"grace_s": grace_s}})
        try:
            self._redis.rpush(runs, envelope)
        except redis_error_types() as exc:
            raise (self._blocked(host, runs) if wrong_type(exc) else self._unreachable(exc)) from None
        deadline, taken = time.monotonic() + self.accept_timeout_s, False
        while self.alive(host) is not None:
            if time.monotonic() >= deadline:
                if taken or self._withdraw(runs, envelope):
                    raise NodeUnavailableError(
                        f"the node agent of host {host} did not {'act on' if taken else 'take'} the drain "
                        f"in time" + (" (it refused it? see its log)" if taken else ""), host=host)
                # taken: it withdraws its announcement next
                deadline, taken = time.monotonic() + ALIVE_EVERY_S * 5, True
            time.sleep(POLL_S)
        return info

    # --- sessions --------------------------------------------------------------------------------

    def _require_node(self, host: str) -> None:
        info = self.alive(host)
        if info is None and (off := self._clock_off(host)) is not None:
            when = f"{abs(off):.0f} s {'ago' if off > 0 else 'in the future'}"
            raise NodeUnavailableError(
                f"the node agent of host {host} last announced itself {when} by this host's clock "
                f"(an announcement is renewed every {ALIVE_EVERY_S:g} s and trusted within "
                f"{CLOCK_SKEW_S:g} s of skew)",
                host=host,
                hint="are the hosts' clocks in sync? If they are, that node agent stopped and its "
                "announcement is being replayed",
            )
        if info is None:
            raise NodeUnavailableError(
                f"no elastic-ops node agent is running for host {host} "
                f"(namespace {self.config.namespace!r} on {shown_url(self.config.url)})",
                host=host,
                hint=f"start `elastic-ops node --host {host}` on that host with the same Redis URL, "
                "namespace and secret; the retry's grant avoids this host meanwhile",
            )
        if info.get("version") != PROTOCOL_VERSION:
            raise NodeUnavailableError(
                f"the node agent of host {host} speaks protocol version {info.get('version')!r}, "
                f"this task {PROTOCOL_VERSION}",
                host=host,
                hint="run the same elastic_ops release on the node agents and the Airflow workers",
            )

    def _open(self, host: str, msg: dict[str, Any]) -> tuple[RedisChannel, tuple[str, bytes, str]]:
        """Push the sealed request ``msg`` onto ``host``'s queue; the session's channel and
        ``(queue, envelope, session)``, to withdraw it if no node takes it."""
        session = secrets.token_hex(16)
        runs = self.config.runs_key(host)
        envelope = self.signer.seal(
            runs, {"seq": 1, "kind": "run", "session": session, "issued": self.wall_clock(), "msg": msg}
        )
        channel = RedisChannel(
            self._redis,
            self.signer,
            inbox=self.config.session_key(session, "to_task"),
            outbox=self.config.session_key(session, "to_node"),
            peer_timeout_s=max(self.peer_timeout_s, self.accept_timeout_s),
            beat_s=self.beat_s,
        )
        with self._lock:
            self._channels.append(channel)
        try:
            self._redis.rpush(runs, envelope)
        except redis_error_types() as exc:
            self._close(channel)
            raise (self._blocked(host, runs) if wrong_type(exc) else self._unreachable(exc)) from None
        return channel, (runs, envelope, session)

    def _blocked(self, host: str, runs: str) -> NodeUnavailableError:
        # Redis is up, but this host's queue is not a list: no node agent can take from it
        return NodeUnavailableError(
            f"the run queue of host {host}, Redis key {runs}, holds a {key_type(self._redis, runs)}, not a "
            "list of run requests: no node agent can take a chunk from it",
            host=host,
            hint=f"delete the key (another program writing in namespace {self.config.namespace!r}?); "
            "the retry's grant avoids this host meanwhile",
        )

    def _first(
        self, channel: RedisChannel, request: tuple[str, bytes, str], host: str, what: str
    ) -> dict[str, Any]:
        """The node's first reply (raised if an error); :class:`NodeUnavailableError` if none
        comes within the accept timeout (the request is withdrawn)."""
        try:
            first = channel.read(timeout=self.accept_timeout_s)
        except redis_error_types() as exc:
            raise self._unreachable(exc) from None
        except EOFError:
            first = None
        if first is None:
            raise NodeUnavailableError(
                f"the node agent of host {host} did not take {what} within {self.accept_timeout_s:g} s"
                + self._not_taken(*request),
                host=host,
                hint="the node agent may be hung or its clock far off; see its log",
            )
        if first.get("type") == "error":
            raise error_from_wire(first)
        channel.peer_timeout_s = self.peer_timeout_s
        return first

    def _close(self, channel: RedisChannel) -> None:
        channel.close()
        with self._lock:
            if channel in self._channels:
                self._channels.remove(channel)

    def _not_taken(self, runs: str, envelope: bytes, session: str) -> str:
        """What became of a request no node answered in time, for the error: withdrawn from the
        queue (``''``), taken too late, or taken off it and refused (and why, if the node said)."""
        if self._withdraw(runs, envelope):
            return ""
        deadline = time.monotonic() + DECIDE_S  # it may have popped it a moment ago
        while True:
            try:
                refused, claimed = self._redis.mget(
                    [self.config.session_key(session, "refused"), self.config.session_key(session, "claimed")]
                )
            except redis_error_types():
                return " (it took the request off its queue; what it did with it is unknown)"
            why = self._refusal(session, refused)
            if why:
                return f": it refused the request, {why}"
            if claimed:
                return " (it took it too late; ended)"
            if time.monotonic() >= deadline:
                return (": it took the request off its queue and refused it without a reason this task "
                        "can read (not sealed with its ELASTIC_OPS_NODE_SECRET?)")
            time.sleep(0.05)

    def _refusal(self, session: str, raw: bytes | None) -> str | None:
        """The reason a node left for refusing ``session``'s request, if genuine and printable."""
        if raw is None:
            return None
        key = self.config.session_key(session, "refused")
        try:
            why = self.signer.open(key, raw).get("why")
        except AgentProtocolError:
            return None
        return why if _printable(why) else None

    def _withdraw(self, runs: str, envelope: bytes) -> bool:
        """Take a request nobody took back off the queue; ``False`` if a node took it meanwhile."""
        try:
            return bool(self._redis.lrem(runs, 1, envelope))
        except redis_error_types():
            return False
