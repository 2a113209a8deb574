"""``elastic-ops node --host NAME``: the node agent that runs chunks granted on its host.

In a cluster the Airflow task of a chunk runs wherever the executor put it, but the pool grants
slots on named hosts: the chunk must train *there*. Each host runs one node agent. It keeps the
runtime warm (like the per-host agent), announces itself in Redis (``{ns}:node:{host}``, renewed
every 2 s, gone 10 s after the agent is), and pops the run requests that tasks push for its host
(:mod:`elastic_ops.agent.cluster`). A request is a sealed envelope (HMAC with the cluster's
secret, :mod:`elastic_ops.agent.redis_channel`); a verified one is claimed once (a replay runs
nothing) and must be fresh. The chunk then runs exactly as on the per-host agent
(``ChunkSession``: the runtime's ``run_chunk``, the pool's targets streamed in, progress and the
outcome streamed out), over a :class:`RedisChannel` instead of a Unix socket.

If the task goes silent (its process or host died, or it was killed) the node kills that chunk's
workers after the channel's peer timeout, so nothing past the last committed checkpoint is
committed. On SIGINT (or a second SIGTERM) the node withdraws its announcement first (no new
chunks come), kills the workers of running chunks (their tasks get the retryable
``AgentLostError``) and exits. SIGTERM (a spot instance's termination notice) or a sealed
``drain`` request (``elastic-ops node --drain``) *drains* it instead: the announcement is
withdrawn, the host is drained in the pool when the node has a pool URL (no new grants), every
running chunk commits at its next iteration boundary and ends ``preempted`` (its task gives the
lease back and resumes from that checkpoint on another host: a preemption, not a failure), and
what has not ended within the grace is killed as on a stop.

Metrics (``node.*``, tagged with the host; docs/airflow.md "Metrics") go to the ``metrics`` it is
given: the CLI passes Airflow's Stats set up from the host's ``[metrics]`` configuration.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from elastic_ops.agent.cluster import ALIVE_EVERY_S, ALIVE_TTL_S, CLOCK_SKEW_S, NodeConfig
from elastic_ops.agent.protocol import PROTOCOL_VERSION, error_to_wire
from elastic_ops.agent.redis_channel import (
    BEAT_S,
    PEER_TIMEOUT_S,
    SESSION_TTL_S,
    RedisChannel,
    key_type,
    redis_error_types,
    wrong_type,
)
from elastic_ops.agent.server import (
    DRAIN_GRACE_S,
    PROGRESS_EVERY_S,
    ChunkSession,
    Drain,
    Drainable,
    check_grace,
    end_sessions,
    install_stop_signals,
    latest_reply,
    warm_launcher,
)
from elastic_ops.agent.span import RanksSession, check_advertise_addr
from elastic_ops.agent.throttle import ThrottledLog
from elastic_ops.errors import AgentLostError, AgentProtocolError, SpecError
from elastic_ops.metrics import NO_METRICS, Metrics
from elastic_ops.spec import check_host_name
from elastic_ops.urls import shown_url

log = logging.getLogger("elastic_ops.node")

REQUEST_MAX_AGE_S = CLOCK_SKEW_S  # a request older than this (by the sender's clock) is refused
RUNS_BATCH = 512  # run-queue envelopes taken per round trip
MAX_SESSIONS = 256  # requests served at once (chunks, latest-checkpoint questions, spanned ranks)
_SESSION_RE = re.compile(r"[0-9a-f]{32}")


# how long a node agent waits for another's announcement of its host to lapse before it refuses
HOST_TAKEN_WAIT_S = ALIVE_TTL_S + ALIVE_EVERY_S
NOT_RENEWED_S = 2 * ALIVE_EVERY_S + 1.0  # an announcement unchanged this long is renewed by no one


class NodeAgent(Drainable):
    """The server. :meth:`serve` runs until :meth:`stop`, SIGINT, or SIGTERM or :meth:`drain`
    (which drain it first)."""

    def __init__(
        self,
        host: str,
        config: NodeConfig,
        *,
        launcher: Any = None,
        warm: bool = True,
        progress_every_s: float = PROGRESS_EVERY_S,
        peer_timeout_s: float = PEER_TIMEOUT_S,
        beat_s: float = BEAT_S,
        request_max_age_s: float = REQUEST_MAX_AGE_S,
        wall_clock: Callable[[], float] = time.time,
        advertise_addr: str | None = None,
        metrics: Metrics = NO_METRICS,
        grace_s: float = DRAIN_GRACE_S,
        pool_url: str | None = None,
    ) -> None:
        self.host = check_host_name("--host", host)
        self.grace_s = check_grace("--grace", grace_s)  # what a drain gives running chunks (SIGTERM's)
        self.pool_url = pool_url  # set: a drain drains the host in this pool ledger too
        self.metrics, self._tags = metrics, {"host": self.host}
        self._refusals = ThrottledLog(log)  # every refusal is counted; the log gets a bounded share
        self._blocked = ThrottledLog(log)  # the queue's key of the wrong type, tried every second
        # where the other hosts' ranks reach this host's (segments spanning hosts); None: no spanning
        self.address = None if advertise_addr is None else check_advertise_addr(advertise_addr)
        self.config = config
        self.signer = config.signer()
        self._launcher, self.warm = launcher, warm
        self.progress_every_s, self.peer_timeout_s, self.beat_s = progress_every_s, peer_timeout_s, beat_s
        self.request_max_age_s, self.wall_clock = request_max_age_s, wall_clock
        self._stop = threading.Event()  # stop now: kill the running chunks' workers
        self._leaving = threading.Event()  # take no more requests (a stop or a drain)
        self._drain: Drain | None = None  # set by a drain (SIGTERM, --drain): its grace
        self._lock = threading.Lock()
        self.sessions: dict[str, Any] = {}  # ChunkSession or RanksSession (both abort())
        self.accepted = 0  # chunks taken since the start
        self.ranks_served = 0  # parts of segments other hosts' nodes led, since the start
        self._threads: list[threading.Thread] = []
        self._redis: Any = None
        self._announcer: threading.Thread | None = None
        self.instance = secrets.token_hex(8)  # tells this agent's announcements from another's
        self.ready = threading.Event()

    def __repr__(self) -> str:
        return f"NodeAgent(host={self.host!r}, {self.config!r})"

    # --- announcing ------------------------------------------------------------------------------

    def _announce(self) -> None:
        info = {
            "host": self.host,
            "pid": os.getpid(),
            "version": PROTOCOL_VERSION,
            "chunks": len(self.sessions),
            "addr": self.address,  # set: this node can lead a segment spanning hosts
            "instance": self.instance,
            "at": self.wall_clock(),  # signed: a replayed announcement goes stale (node_client)
        }
        self._send_gauges()
        self._redis.set(self.config.alive_key(self.host), self.config.announcement(self.host, info),
                        ex=ALIVE_TTL_S)

    def _wait_for_the_host_name(self, client: Any, poll_s: float = 1.0) -> None:
        """Refuse to serve a host another live node agent announces (a cloned VM's hostname, an
        agent left running): both would take its chunks, and either's stop would withdraw the
        other's announcement. An announcement a dead agent left lapses within ``ALIVE_TTL_S``:
        this waits that long (plus one renewal) before it refuses. One whose signed time does not
        move for two renewals is no live agent's (a stopped one's, re-SET by someone without the
        secret): this node supersedes it."""
        started = time.monotonic()
        deadline = started + HOST_TAKEN_WAIT_S
        first: Any = None
        while (other := client.alive(self.host)) is not None and other.get("instance") != self.instance:
            seen = (other.get("instance"), other.get("at"))
            first = first or seen
            if seen == first and time.monotonic() - started >= NOT_RENEWED_S:
                log.warning("host %s: the announcement of node agent pid %s is not renewed (a stopped "
                            "agent's, replayed); this node supersedes it", self.host, other.get("pid"))
                return
            if time.monotonic() >= deadline:
                raise SpecError(
                    "--host", self.host,
                    f"a host name no other live node agent serves (pid {other.get('pid')} announces it, "
                    f"renewing it every {ALIVE_EVERY_S:g} s)",
                    hint="stop that agent, or give each its own --host",
                )
            log.info("host %s is announced by another node agent (pid %s); waiting up to %.0f s for it to "
                     "lapse", self.host, other.get("pid"), deadline - time.monotonic())
            time.sleep(poll_s)

    def _send_gauges(self) -> None:
        """What the node runs now: its own chunks, and parts of segments other nodes lead."""
        with self._lock:
            ranks = sum(isinstance(s, RanksSession) for s in self.sessions.values())
            chunks = len(self.sessions) - ranks
        self.metrics.gauge("node.chunks_running", chunks, tags=self._tags)
        self.metrics.gauge("node.ranks_running", ranks, tags=self._tags)

    def _redis_error(self, what: str, exc: Exception) -> None:
        self.metrics.incr("node.redis_errors", tags=self._tags)
        log.warning("cannot reach Redis %s: %s", what, exc)

    def _queue_error(self, runs: str, exc: Exception) -> None:
        """Waiting for requests failed: Redis is away, or the queue's key holds another type."""
        if not wrong_type(exc):
            self._redis_error("for requests (retrying)", exc)
            return
        self.metrics.incr("node.redis_errors", tags=self._tags)
        self._blocked.warning(
            "the Redis key %s holds a %s, not a list of run requests: no task can send this node a "
            "chunk until it is deleted (another program writing in namespace %r?); retrying",
            runs, key_type(self._redis, runs), self.config.namespace,
        )

    def _refuse(self, reason: str, message: str, *args: Any) -> None:
        """Log a refused request (its sender gets no answer) and count it by ``reason``."""
        self.metrics.incr("node.requests_refused", tags={**self._tags, "reason": reason})
        self._refusals.warning(message, *args)

    def _keep_announcing(self) -> None:
        while not self._leaving.wait(ALIVE_EVERY_S):
            try:
                self._announce()
            except redis_error_types() as exc:
                self._redis_error("to renew this node's announcement", exc)

    # --- serving ---------------------------------------------------------------------------------

    def serve(self) -> None:
        self._redis = reachable_redis(self.config)
        from elastic_ops.agent.node_client import NodeClient
        from elastic_ops.agent.span import NodeSpanLauncher

        self._wait_for_the_host_name(NodeClient(self.config, redis=self._redis, wall_clock=self.wall_clock))

        self._local_launcher = warm_launcher(self._launcher, self.warm)
        self._launcher = NodeSpanLauncher(self._local_launcher, NodeClient(self.config, redis=self._redis),
                                          self.address)
        install_stop_signals(self)
        self._announce()
        self._announcer = threading.Thread(target=self._keep_announcing, name="announce", daemon=True)
        self._announcer.start()
        log.info(
            "elastic-ops node agent for host %s (pid %d) serving %s, namespace %s",
            self.host,
            os.getpid(),
            shown_url(self.config.url),
            self.config.namespace,
        )
        self.ready.set()
        runs = self.config.runs_key(self.host)
        try:
            while not self._leaving.is_set():
                try:
                    item = self._redis.blpop([runs], timeout=1)
                    # behind it, more in the same round trip: a queue flooded with junk is
                    # drained in bulk, and each envelope is checked here, with no thread for one
                    # that is not genuine
                    batch = [item[1], *(self._redis.lpop(runs, RUNS_BATCH - 1) or ())] if item else []
                except redis_error_types() as exc:
                    self._queue_error(runs, exc)
                    self._leaving.wait(1.0)
                    continue
                for raw in batch:
                    self._take(raw)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._leaving.set()
        if self._announcer is not None:
            self._announcer.join(timeout=10)  # no renewal may land after the withdrawal below
        with contextlib.suppress(*redis_error_types()):
            self._redis.delete(self.config.alive_key(self.host))  # first: no task routes here any more
        if self._drain is not None and not self._stop.is_set():
            self._drain.wait(self._lock, self.sessions, self._stop, meanwhile=self._drain_host)
        self._stop.set()
        end_sessions(self._lock, self.sessions, self._threads)
        self._send_gauges()
        log.info("elastic-ops node agent for host %s stopped", self.host)

    def _drain_host(self) -> None:
        """Drain this host in the pool (no new grants) when the node has a pool URL; a ledger
        that cannot be reached does not hold the drain up (its tasks avoid a host whose node is
        not announced anyway)."""
        if not self.pool_url:
            return
        from elastic_ops.pool import PoolClient

        try:
            client = PoolClient(self.pool_url)
            try:
                client.drain_host(self.host)
            finally:
                client.close()
        except Exception as exc:  # noqa: BLE001 - the chunks' drain goes on
            log.warning("could not drain host %s in the pool (%s: %s); its tasks avoid it while no node "
                        "agent announces it", self.host, type(exc).__name__, exc)
            return
        log.info("host %s drained in the pool: no new grants (`elastic-ops pool set-host-state %s up` "
                 "undoes it)", self.host, self.host)

    # --- one request -----------------------------------------------------------------------------

    def _verified(self, raw: bytes) -> tuple[str, str, dict[str, Any]] | None:
        """``(kind, session, request)`` of a genuine, fresh, first-seen envelope (``kind``: a
        ``run`` request or a ``drain``), else ``None`` (logged: an unverified sender gets no
        answer)."""
        runs = self.config.runs_key(self.host)
        try:
            body = self.signer.open(runs, raw)
        except AgentProtocolError as exc:
            self._refuse("unverified", "refused a run request: %s", exc)
            return None
        session, issued, msg = body.get("session"), body.get("issued"), body.get("msg")
        kind = body.get("kind")
        if kind not in ("run", "drain") or not isinstance(session, str) or not _SESSION_RE.fullmatch(session):
            self._refuse("malformed", "refused a run request: malformed envelope (kind %r)", body.get("kind"))
            return None
        if isinstance(issued, bool) or not isinstance(issued, int | float) or not isinstance(msg, dict):
            self._refuse(
                "malformed", "refused run request %s: needs a numeric 'issued' and an object 'msg'", session
            )
            return None
        try:
            age = self.wall_clock() - float(issued)  # JSON has no NaN; a huge integer has no float
        except OverflowError:
            age = -math.inf
        if abs(age) > self.request_max_age_s:
            why = (f"{_issued(age)} by this node's clock (at most {self.request_max_age_s:.0f} s either way; "
                   "are the hosts' clocks in sync?)")
            self._refuse("stale", "refused run request %s: %s", session, why)
            self._leave_refusal(session, why)
            return None
        if not self._redis.set(
            self.config.session_key(session, "claimed"), self.host, nx=True, ex=SESSION_TTL_S
        ):
            self._refuse("replay", "refused run request %s: already taken (a replay)", session)
            return None
        return kind, session, msg

    def _leave_refusal(self, session: str, why: str) -> None:
        """Say why a genuine request was refused where its task looks when no node answers it
        (it gets no reply: a stale request may be a replay, whose task is long gone)."""
        key = self.config.session_key(session, "refused")
        self._redis.set(key, self.signer.seal(key, {"why": why}), ex=SESSION_TTL_S)

    def _take(self, raw: bytes) -> None:
        """One popped envelope: verified here (a signature, then one claim in Redis), and only a
        genuine, fresh, first-seen request gets a thread, while fewer than MAX_SESSIONS run."""
        try:
            verified = self._verified(raw)
        except redis_error_types() as exc:
            self._redis_error("for a run request, dropped (its task times out and retries)", exc)
            return
        if verified is None:
            return
        kind, session, msg = verified
        if kind == "drain":
            try:
                grace = msg.get("grace_s")
                self.drain(None if grace is None else check_grace("grace_s", grace))
            except SpecError as exc:
                self._refuse("invalid", "refused drain request %s: %s", session, exc)
            return
        self._threads = [x for x in self._threads if x.is_alive()]
        if len(self._threads) >= MAX_SESSIONS:
            why = f"this node agent serves {MAX_SESSIONS} sessions already"
            self._refuse("busy", "refused run request %s: %s", session, why)
            with contextlib.suppress(*redis_error_types()):
                self._leave_refusal(session, why)
            return
        t = threading.Thread(target=self._handle, args=(session, msg), name="request", daemon=True)
        t.start()
        self._threads.append(t)

    def _handle(self, session_id: str, req: dict[str, Any]) -> None:
        channel = RedisChannel(
            self._redis,
            self.signer,
            inbox=self.config.session_key(session_id, "to_node"),
            outbox=self.config.session_key(session_id, "to_task"),
            peer_timeout_s=self.peer_timeout_s,
            beat_s=self.beat_s,
        )
        threading.current_thread().name = f"session-{session_id[:8]}"
        try:
            self._run(session_id, channel, req)
        except Exception as exc:  # noqa: BLE001 - a bad request is answered, never fatal
            self._refuse("stopping" if isinstance(exc, AgentLostError) else "invalid",
                         "session %s: rejected: %s", session_id[:8], exc)
            with contextlib.suppress(OSError):
                channel.send(error_to_wire(exc))
        finally:
            channel.close()

    def _run(self, session_id: str, channel: RedisChannel, req: dict[str, Any]) -> None:
        if req.get("op") not in ("run", "latest", "ranks"):
            raise SpecError("op", req.get("op"), "'run', 'latest' or 'ranks' (what a node agent does)")
        if type(req.get("version")) is not int or req["version"] != PROTOCOL_VERSION:
            raise SpecError(
                "version", req.get("version"), f"{PROTOCOL_VERSION} (this node's protocol version)"
            )
        if req.get("host") != self.host:
            raise SpecError("host", req.get("host"), f"{self.host!r}, the host this node agent runs on")
        if req["op"] == "latest":
            channel.send(latest_reply(req))
            return
        if req["op"] == "ranks":
            self._run_ranks(session_id, channel, req)
            return
        session = ChunkSession(channel, req, self._launcher, self.progress_every_s)
        threading.current_thread().name = f"chunk-{session.request['spec'].name}"
        with self._registered(session_id, session):
            channel.send({"type": "accepted", "host": self.host, "pid": os.getpid()})
            with self._lock:
                self.accepted += 1
            try:
                session.run()
            finally:
                tags = {**self._tags, "outcome": session.outcome or "failed"}
                if session.error:
                    tags["error"] = session.error
                self.metrics.incr("node.chunks", tags=tags)

    def _run_ranks(self, session_id: str, channel: RedisChannel, req: dict[str, Any]) -> None:
        """This host's part of a segment another host's node leads (:mod:`elastic_ops.agent.span`)."""
        session = RanksSession(channel, req, self._local_launcher, self.host, self.signer)
        with self._registered(session_id, session):
            with self._lock:
                self.ranks_served += 1
            self.metrics.incr("node.ranks", tags=self._tags)
            session.run()

    @contextlib.contextmanager
    def _registered(self, session_id: str, session: Any) -> Iterator[None]:
        """``session`` among the running ones (a stopping node aborts them all), unless the node
        is already stopping: then :class:`AgentLostError`, which the requester gets."""
        with self._lock:
            self.sessions[session_id] = session
            stopping = self._leaving.is_set()
        try:
            if stopping:
                raise AgentLostError(
                    f"the elastic-ops node agent of host {self.host} is "
                    + ("draining" if self.draining else "stopping"),
                    hint="retry resumes from the last committed checkpoint",
                )
            self._send_gauges()
            yield
        finally:
            with self._lock:
                self.sessions.pop(session_id, None)
            self._send_gauges()


def _issued(age: float) -> str:
    """When a request was issued, by its age on this host's clock (negative: in the future)."""
    if age >= 0:
        return f"issued {age:.0f} s ago"
    if math.isinf(age):
        return "issued at a time no clock reaches"
    return f"issued {-age:.0f} s in the future"


def reachable_redis(config: NodeConfig) -> Any:
    """A client of the cluster's Redis, which answered a ping; else :class:`SpecError`."""
    client = config.redis()
    try:
        client.ping()
    except redis_error_types() as exc:
        raise SpecError(
            "ELASTIC_OPS_NODE_REDIS_URL",
            shown_url(config.url),
            "a Redis server this host can reach",
            hint=str(exc),
        ) from None
    return client


def register_host(
    host: str, slots: int, pool_url: str | None = None, labels: dict[str, str] | None = None
) -> bool:
    """Add ``host`` with ``slots`` slots (and ``labels``) to the pool ledger unless the pool
    knows it already (then its slots, labels and state, e.g. a drain an operator set, stay as
    they are). True if added."""
    from elastic_ops.pool import PoolClient

    check_host_name("--host", host)
    if type(slots) is not int or slots < 1:
        raise SpecError("--register-slots", slots, "a whole number of slots >= 1")
    client = PoolClient(pool_url)
    try:
        if any(h["name"] == host for h in client.status()["hosts"]):
            log.info("host %s is in the pool already; its slots and state are left as they are", host)
            return False
        client.add_host(host, slots, labels)
        log.info("added host %s with %d slots%s to the pool", host, slots,
                 f" and labels {labels}" if labels else "")
        return True
    finally:
        client.close()


def main(
    host: str, config: NodeConfig, advertise_addr: str | None = None, metrics: Metrics = NO_METRICS,
    grace_s: float = DRAIN_GRACE_S, pool_url: str | None = None,
) -> int:
    """Run a node agent in this process (the CLI's ``elastic-ops node``)."""
    NodeAgent(host, config, advertise_addr=advertise_addr, metrics=metrics, grace_s=grace_s,
              pool_url=pool_url).serve()
    return 0
