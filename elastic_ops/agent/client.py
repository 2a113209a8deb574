"""The task side of the agent protocol: send a chunk, stream its target, get the outcome.

Never imports torch (a task process that delegates its chunk stays light) nor Airflow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from collections.abc import Callable
from typing import Any

from elastic_ops.agent.channel import Channel, SocketChannel
from elastic_ops.agent.protocol import (
    PROTOCOL_VERSION,
    MessageReader,
    StoreConfig,
    applied_from_wire,
    check_socket_path,
    encode,
    error_from_wire,
    latest_of,
    peer_uid,
    trusted_peer,
)
from elastic_ops.errors import AgentLostError, AgentProtocolError, AgentUnavailableError, SpecError
from elastic_ops.runtime.allocation import Allocation
from elastic_ops.runtime.outcome import ChunkResult, Progress

POLL_S = 0.05  # how often the client looks for a new pool target between agent messages (the
# lease heartbeats every ~2 s, so this adds nothing noticeable to a rescale or preemption)


def progress_from_wire(msg: dict[str, Any]) -> Progress:
    """The runtime's ``Progress`` from a ``progress`` message (non-finite numbers arrive as None)."""
    return Progress(**{f.name: msg.get(f.name) for f in dataclasses.fields(Progress)})


def result_from_wire(d: object) -> ChunkResult:
    """The runtime's ``ChunkResult`` from the agent's ``result`` message."""
    if not isinstance(d, dict):
        raise AgentProtocolError(f"a result must be an object, got {type(d).__name__}")
    try:
        return ChunkResult.from_dict(d)
    except (KeyError, TypeError, ValueError) as exc:
        raise AgentProtocolError(f"malformed result from the agent: {exc!r}") from None


class AgentClient:
    """Talks to the agent at ``path``. One connection per operation."""

    def __init__(self, path: str, *, connect_timeout_s: float = 5.0) -> None:
        self.path = check_socket_path(path, "agent socket")
        self.connect_timeout_s = connect_timeout_s
        self._running: set[socket.socket] = set()  # the connections of chunks running now

    def abort(self) -> None:
        """End the chunks this client runs (the task is being killed): the agent sees the
        connection close and kills their workers at once. Safe in a signal handler (Airflow's
        on_kill): no lock, one ``shutdown`` per connection; the thread driving the chunk then
        reads the end of the connection."""
        for sock in list(self._running):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def __repr__(self) -> str:
        return f"AgentClient({self.path!r})"

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.connect_timeout_s)
        try:
            sock.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError, PermissionError, TimeoutError, OSError) as exc:
            sock.close()
            raise AgentUnavailableError(
                f"no elastic-ops agent at {self.path}: {exc.strerror or exc}",
                hint="start one with `elastic-ops agent --socket PATH`",
            ) from None
        uid = peer_uid(sock)
        if not trusted_peer(uid):
            # not our agent: another user's process holds the path; it must not see the store's
            # credentials nor decide the chunk's outcome
            sock.close()
            raise AgentUnavailableError(
                f"the process serving {self.path} runs as uid {uid}, not as this user "
                f"(uid {os.getuid()}) or root: not using it",
                hint="point ELASTIC_OPS_AGENT_SOCKET at a socket in a directory only you can write",
            )
        sock.settimeout(None)
        return sock

    def _error(self, msg: dict[str, Any]) -> BaseException:
        """The agent's error; one about the protocol version (an agent of another elastic_ops
        release) means this agent cannot be used: the chunk runs in the task process instead."""
        exc = error_from_wire(msg)
        if isinstance(exc, SpecError) and getattr(exc, "field", None) == "version":
            return AgentUnavailableError(
                f"the elastic-ops agent at {self.path} speaks another protocol version ({exc})",
                hint="restart the agent with the elastic_ops release the tasks use",
            )
        return exc

    def _call(self, request: dict[str, Any], expect: str) -> dict[str, Any]:
        with self._connect() as sock:
            sock.sendall(encode({"version": PROTOCOL_VERSION, **request}))
            reader = MessageReader(sock)
            try:
                msg = reader.read(timeout=60)
            except EOFError:
                raise AgentUnavailableError(f"the agent at {self.path} closed the connection") from None
            if msg is None:
                raise AgentUnavailableError(f"the agent at {self.path} did not answer within 60 s")
            if msg.get("type") == "error":
                raise self._error(msg)
            if msg.get("type") != expect:
                raise AgentProtocolError(f"expected a {expect!r} message, got {msg.get('type')!r}")
            return msg

    def ping(self) -> dict[str, Any]:
        """The agent's ``pong`` (pid, protocol version, chunks running); raises if none answers."""
        return self._call({"op": "ping"}, "pong")

    def drain(self, grace_s: float | None = None) -> dict[str, Any]:
        """Drain the agent (as SIGTERM does): its running chunks commit at their next boundary and
        end within ``grace_s`` (None: the agent's own ``--grace``), then it stops. Its answer."""
        return self._call({"op": "drain", "grace_s": grace_s}, "draining")

    def latest(self, store: StoreConfig, spec_hash: str | None) -> tuple[int, str, dict[str, Any]] | None:
        """``(iteration, uri, metrics)`` of the latest committed checkpoint of ``spec_hash`` in
        ``store``."""
        msg = self._call({"op": "latest", "store": store.to_wire(), "spec_hash": spec_hash}, "latest")
        return latest_of(msg)

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
    ) -> ChunkResult:
        """Run iterations ``[start, end)`` of ``spec`` on the agent; see ``run_chunk`` in the runtime.

        ``target()`` is the pool's current target (0 = preempt) with its slots; it is sent to the
        agent whenever it changes (the slots on ``host``; a bare count: the agent's workers take
        its visible GPUs in order). ``on_applied(iteration, allocation)`` is called when a new
        worker count, or the same count on other slots, starts at a boundary (the previous
        segment's workers have exited). Raises :class:`AgentUnavailableError` if
        no agent accepts the connection (nothing ran; the caller may run the chunk itself), the
        chunk's own ``elastic_ops`` error as the runtime raised it, or :class:`AgentLostError`
        if the agent went away mid-chunk (its workers went with it; not the host's fault).
        """

        current = target_reader(target, host)
        sock = self._connect()
        channel = SocketChannel(sock)
        self._running.add(sock)
        try:
            sent = current()
            from elastic_ops.runtime.entrypoints import task_import_path

            channel.send(run_request(spec, start, end, epoch, host, sent, store, warm_start,
                                     import_path=task_import_path()))

            def lost(_: str) -> BaseException:
                return AgentLostError(
                    f"the elastic-ops agent at {self.path} closed the connection mid-chunk "
                    f"(iterations {start}..{end})",
                    hint="the agent stopped or crashed; retry resumes from the last committed checkpoint",
                )

            return drive_chunk(
                channel, host, sent, current, on_progress=on_progress, on_applied=on_applied,
                poll_s=poll_s, lost=lost, error=lambda msg: elsewhere(self._error(msg), spec),
            )
        finally:
            self._running.discard(sock)
            sock.close()


Target = dict[str, Any]  # an Allocation's wire fields: workers, slots and (spanning) spans


def target_reader(target: Callable[[], Allocation], host: str, spans: bool = False) -> Callable[[], Target]:
    """``() -> fields``: the pool's current target as the protocol sends it for ``host``
    (``spans``: with the other hosts' slots, ``[[host, [slot, ...]], ...]``)."""
    return lambda: target().to_wire(host, spans=spans)


def run_request(
    spec: dict[str, Any],
    start: int,
    end: int,
    epoch: int,
    host: str,
    target: Target,
    store: StoreConfig,
    warm_start: StoreConfig | None,
    *,
    import_path: list[str] | None = None,
) -> dict[str, Any]:
    """The ``run`` message (docs: :mod:`elastic_ops.agent.protocol`); only node agents that lead
    segments across hosts get ``spans`` in ``target``; ``import_path``: the task's import
    folders, for the per-host agent's workers (a node agent's host has its own)."""
    extra = {} if import_path is None else {"import_path": import_path}
    return {
        **extra,
        "op": "run",
        "version": PROTOCOL_VERSION,
        "spec": spec,
        "start": start,
        "end": end,
        "epoch": epoch,
        "host": host,
        **target,
        "store": store.to_wire(),
        "warm_start": warm_start.to_wire() if warm_start is not None else None,
    }


def drive_chunk(
    channel: Channel,
    host: str,
    sent: Target,
    current: Callable[[], Target],
    *,
    on_progress: Callable[[Progress], None] | None,
    on_applied: Callable[[int, Allocation], None] | None,
    poll_s: float,
    lost: Callable[[str], BaseException],
    error: Callable[[dict[str, Any]], BaseException],
) -> ChunkResult:
    """The task's side of a running chunk, once its run request has gone: forward the pool's
    target (``current()``: workers, slots and spans) whenever it changes from ``sent``, hand
    progress and segment changes to the callbacks (``on_applied(iteration, allocation)``: the
    slots in use on ``host`` and the other hosts), return the result or raise the
    chunk's error (``error(msg)``) or, when the channel ends first, ``lost(why)``.

    A target that cannot be sent (the agent has closed its side) is not yet a lost chunk: the
    agent closes right after its last message, so the result of a chunk that just ended may be
    waiting to be read; only the end of the channel, read, decides."""
    unsent = ""  # why the last target could not be sent
    while True:
        try:
            msg = channel.read(timeout=poll_s)
        except EOFError as exc:
            raise lost(f"{exc}; {unsent}" if unsent else str(exc)) from None
        now = current()
        if now != sent:
            try:
                channel.send({"op": "target", **now})
            except OSError as exc:
                unsent = f"a target could not be sent ({exc})"
            sent = now
        if msg is None:
            continue
        kind = msg.get("type")
        if kind == "progress":
            if on_progress is not None:
                on_progress(progress_from_wire(msg))
        elif kind == "applied":
            iteration, workers, slots, spans = applied_from_wire(msg)
            if on_applied is not None:
                on_applied(iteration, Allocation.split(workers, host, slots, spans))
        elif kind == "result":
            return result_from_wire(msg.get("result"))
        elif kind == "error":
            raise error(msg)
        else:
            raise AgentProtocolError(f"unexpected message type {kind!r} from the agent")


def elsewhere(exc: BaseException, spec: dict[str, Any]) -> BaseException:
    """An agent's "entrypoint cannot be found" about a module this task finds: say that the
    task imports it and the process running the chunk does not, as a retryable
    :class:`EntrypointElsewhereError` (the deployment is wrong, not the job)."""
    from elastic_ops.errors import EntrypointElsewhereError, EntrypointError
    from elastic_ops.runtime.entrypoints import find_trainable_module, this_process

    entry = spec.get("entrypoint")
    if type(exc) is not EntrypointError or not isinstance(entry, str):
        return exc
    try:
        find_trainable_module(entry)
    except EntrypointError:
        return exc  # not importable here either: the job's own error
    return EntrypointElsewhereError(
        "entrypoint", entry,
        f"imports in this task, {this_process()}, but not where the chunk runs: {exc.allowed}",
        hint=exc.hint,
    )
