"""``elastic-ops agent``: a long-lived per-host process that runs chunks for local tasks.

It imports torch once, starts the launcher's fork server once (torch, ``torch._dynamo`` and the
worker module preloaded) and keeps it warm, then serves chunk requests on a Unix socket (mode
0600, peers of the same user only), one thread per connection, several chunks (of different
jobs) at a time. Each chunk is the runtime's ``run_chunk``, unchanged: the connection's thread
runs it, a reader thread feeds it the pool's target as the task forwards it, and its progress,
target changes, result or typed error go back as JSON lines (:mod:`elastic_ops.agent.protocol`).

If the task goes away (its process died or was killed: the connection closes), the agent kills
that chunk's workers at once; the runner then fails the segment, so nothing past the last
committed checkpoint is committed and that checkpoint stays intact. On SIGINT (or a second
SIGTERM) the agent does the same for every chunk, removes its socket and exits. SIGTERM (a spot
instance's termination notice) or a ``drain`` request first *drains*: no new chunk is taken, and
every running chunk commits at its next iteration boundary and ends ``preempted`` (its task asks
the pool again and resumes from that checkpoint); what has not ended within the grace is killed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import stat
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_ops.agent.channel import Channel, SocketChannel
from elastic_ops.agent.protocol import (
    OPS,
    PROTOCOL_VERSION,
    StoreConfig,
    check_socket_path,
    encode,
    error_to_wire,
    peer_uid,
    progress_to_wire,
    require_int,
    require_slots,
    require_spans,
    require_str,
    trusted_peer,
)
from elastic_ops.errors import AgentLostError, AgentProtocolError, SpecError, WorkerLostError
from elastic_ops.runtime.allocation import Allocation
from elastic_ops.runtime.outcome import jsonable
from elastic_ops.spec import MAX_ADAPTIVE_BATCH, check_host_name

if TYPE_CHECKING:
    from elastic_ops.runtime.launcher import Launcher, LaunchRequest, Segment
    from elastic_ops.runtime.outcome import Progress
    from elastic_ops.spec import JobSpec

log = logging.getLogger("elastic_ops.agent")

MAX_CONNECTIONS = 256  # open at once (a thread each): chunks, pings and latest questions
PROGRESS_EVERY_S = 0.5  # progress messages per chunk, at most (the last iteration always goes)
RUN_KEYS = frozenset(
    "op version spec start end epoch host workers slots spans batch store warm_start import_path".split()
)
MAX_IMPORT_PATH = 256  # folders of the task's import path a run request may carry
DRAIN_GRACE_S = 30.0  # a drain's default wait for running chunks to commit and end
MAX_DRAIN_GRACE_S = 3600.0


def _batch(msg: dict[str, Any]) -> int:
    """An adaptive job's batch in a run or target message (absent: its own, 0)."""
    return require_int(msg, "batch", optional=True, maximum=MAX_ADAPTIVE_BATCH) or 0



def check_grace(field: str, value: object) -> float:
    """A drain's grace in seconds (a number, or its text on a command line), or :class:`SpecError`
    naming ``field``: finite, from 0 (kill at once, as before drains) to an hour."""
    number: object = value
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = value
    allowed = f"a number of seconds from 0 (kill at once) to {MAX_DRAIN_GRACE_S:g}"
    if (isinstance(number, bool) or not isinstance(number, int | float) or not math.isfinite(number)
            or not 0 <= number <= MAX_DRAIN_GRACE_S):
        raise SpecError(field, value, allowed)
    return float(number)


def require_import_path(req: dict[str, Any]) -> tuple[str, ...]:
    """The task's import folders (``import_path``, optional): absolute paths, for the workers."""
    value = req.get("import_path")
    if value is None:
        return ()
    if (not isinstance(value, list) or len(value) > MAX_IMPORT_PATH
            or not all(isinstance(p, str) and 0 < len(p) <= 4096 and p.startswith("/") and "\0" not in p
                       for p in value)):
        raise SpecError("import_path", value, f"a list of at most {MAX_IMPORT_PATH} absolute paths")
    return tuple(value)


class _ChildThreadWarning(logging.Filter):
    """Drop torch's warning that a launch from a non-main thread installs no signal handlers:
    in the agent that is by design (the main thread's handler tears every chunk down)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "running on a child thread" not in record.getMessage()


class AbortableLauncher:
    """Wraps the shared launcher for one chunk, so that the chunk's workers can be killed from
    another thread (client gone, agent stopping) while the runner waits on them."""

    def __init__(self, base: Launcher) -> None:
        self.base = base
        self.address = base.address  # where other hosts reach it (spanning segments)
        self._lock = threading.Lock()
        self._contexts: list[Any] = []
        self.aborted = False

    def start(self, req: LaunchRequest) -> Segment:
        with self._lock:
            if self.aborted:
                raise WorkerLostError("chunk aborted before its workers started: the task went away")
        pc = self.base.start(req)
        with self._lock:
            self._contexts.append(pc)
            aborted = self.aborted
        if aborted:  # aborted while they were starting
            _kill(pc)
        return pc

    def abort(self) -> None:
        with self._lock:
            self.aborted = True
            contexts = list(self._contexts)
        for pc in contexts:
            _kill(pc)


def _kill(pc: Segment) -> None:
    """Stop every worker of ``pc`` now (a segment spanning hosts: their nodes stop their ranks
    too); the runner's thread then sees the failure and closes it."""
    try:
        pc.abort()
    except Exception:  # noqa: BLE001 - a segment that never started has no pids
        return


class ChunkSession:
    """One ``run`` request: the chunk, its target stream and its replies."""

    def __init__(
        self,
        channel: Channel,
        request: dict[str, Any],
        launcher: Launcher,
        progress_every_s: float = PROGRESS_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.channel, self.clock = channel, clock
        self.stopping = False  # set when the agent itself kills the workers (it is stopping)
        self.draining = False  # set by a drain: the target is 0 from now on (commit and end)
        self.progress_every_s = progress_every_s
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self.gone = threading.Event()  # the task's connection is closed (or broken)
        self.done = threading.Event()  # run_chunk returned or raised
        # how it ended, once it has: the result's status, "failed" (an error went to the task) or
        # "aborted" (the task went away); ``error``: the failure's error class
        self.outcome: str | None = None
        self.error: str | None = None
        self.launcher = AbortableLauncher(launcher)
        self._last_progress = float("-inf")
        self.request = self._validate(request)
        r = self.request
        self.wanted = Allocation.split(r["workers"], r["host"], r["slots"], r["spans"], r["batch"])
        # a node agent leading segments across hosts: the other hosts' slots are its to use
        self.span_hosts = r["slots"] is not None and r["spans"] is not None
        # the running segment as last told to the task: none yet, so the first segment is
        # announced too (the task learns the slots it runs on)
        self.applied: Allocation | None = None

    @staticmethod
    def _validate(req: dict[str, Any]) -> dict[str, Any]:
        from elastic_ops.spec import JobSpec

        unknown = sorted(set(req) - RUN_KEYS)
        if unknown:
            raise SpecError(
                "request", unknown, f"known keys of a run request are {', '.join(sorted(RUN_KEYS))}"
            )
        if not isinstance(req.get("spec"), dict):
            raise SpecError("spec", type(req.get("spec")).__name__, "an object (JobSpec.to_dict())")
        spec = JobSpec.from_dict(req["spec"])
        warm = req.get("warm_start")
        return {
            "spec": spec,
            "start": require_int(req, "start"),
            "end": require_int(req, "end", 1),
            "epoch": require_int(req, "epoch"),
            "host": check_host_name("host", require_str(req, "host")),  # it is logged
            "workers": require_int(req, "workers"),
            "slots": require_slots(req),
            "spans": require_spans(req),
            "batch": _batch(req),
            "store": StoreConfig.from_wire(req.get("store")),
            "warm_start": StoreConfig.from_wire(warm, "warm_start") if warm is not None else None,
            "import_path": require_import_path(req),
        }

    # --- called by the runner's threads ------------------------------------------------------

    def send(self, msg: dict[str, Any]) -> None:
        if self.gone.is_set():
            return
        with self._send_lock:
            try:
                self.channel.send(msg)
            except OSError as exc:  # the task is gone, or reads nothing any more: its chunk ends
                self.gone.set()
                if not self.done.is_set():
                    log.warning("job %s: cannot reach the task (%s); killing its workers",
                                self.request["spec"].name, exc)
                    self.launcher.abort()

    def target(self, iteration: int) -> Allocation:
        with self._lock:
            # draining: 0 workers, whatever the pool forwards meanwhile (the runner commits at
            # this boundary and returns preempted)
            return self.wanted.with_workers(0) if self.draining else self.wanted

    def segment(self, iteration: int, running: Allocation) -> None:
        """``running.workers`` start at ``iteration`` on its slots (this host's and, spanning,
        the other hosts'), the previous segment's have exited: tell the task, whose lease keeper
        then reports count and slots (the slots a shrink or a move gave up are free only now)."""
        with self._lock:
            changed, self.applied = running != self.applied, running
        if changed:
            self.send({"type": "applied", "iteration": iteration,
                       **running.to_wire(self.request["host"], spans=self.span_hosts)})

    def progress(self, p: Progress) -> None:
        now = self.clock()
        if now - self._last_progress < self.progress_every_s and p.iteration < p.end:
            return
        self._last_progress = now
        self.send(progress_to_wire(p))

    # --- the connection ----------------------------------------------------------------------

    def _read_targets(self) -> None:
        """Apply target messages until the task closes the connection; then kill the workers."""
        try:
            while True:
                msg = self.channel.read()
                if msg is None:
                    continue
                if msg.get("op") != "target":
                    raise SpecError("op", msg.get("op"), "only 'target' messages may follow a run request")
                workers = require_int(msg, "workers")
                slots, spans = require_slots(msg), require_spans(msg)
                if (slots is None) != (self.request["slots"] is None):
                    raise SpecError(
                        "slots", slots, "a list in every target if the run request had one, else null"
                    )
                if (spans is None) != (self.request["spans"] is None):
                    raise SpecError(
                        "spans", spans, "a list in every target if the run request had one, else absent"
                    )
                with self._lock:
                    self.wanted = Allocation.split(workers, self.request["host"], slots, spans, _batch(msg))
        except EOFError:
            if not self.done.is_set():
                log.warning(
                    "job %s: the task closed its connection mid-chunk; killing its workers",
                    self.request["spec"].name,
                )
        except (AgentProtocolError, SpecError) as exc:
            log.warning(
                "job %s: bad message from the task (%s); aborting the chunk", self.request["spec"].name, exc
            )
            self.send(error_to_wire(exc))
        self.gone.set()
        if not self.done.is_set():
            self.launcher.abort()

    def run(self) -> None:
        from elastic_ops.runtime.chunk import run_chunk

        r = self.request
        reader = threading.Thread(
            target=self._read_targets, name=f"{threading.current_thread().name}-targets", daemon=True
        )
        reader.start()
        spec = r["spec"]
        log.info(
            "job %s: chunk [%d, %d) on %d worker(s), host %s, epoch %d",
            spec.name,
            r["start"],
            r["end"],
            r["workers"],
            r["host"],
            r["epoch"],
        )
        try:
            self._run(run_chunk, spec, r)
        finally:
            self.channel.close()  # wakes the reader; what was sent is still delivered
            reader.join(timeout=10)

    def _run(self, run_chunk: Callable[..., Any], spec: JobSpec, r: dict[str, Any]) -> None:
        try:
            warm = r["warm_start"]
            result = run_chunk(
                spec,
                r["start"],
                r["end"],
                target=self.target,
                store=r["store"].open(),
                epoch=r["epoch"],
                on_progress=self.progress,
                host=r["host"],
                launcher=self.launcher,
                on_segment=self.segment,
                span_hosts=self.span_hosts,
                warm_start=warm.uri if warm is not None else None,
                # only read: a warm start never creates the folder it names
                warm_start_store=warm.open(create=False) if warm is not None else None,
                import_entrypoint=False,  # the user's module runs in the workers, not in the agent
                import_path=r["import_path"],  # where the task imports it from
            )
        except BaseException as exc:  # noqa: BLE001 - every outcome goes back to the task
            self.done.set()
            if self.gone.is_set():
                self.outcome = "aborted"
                log.info("job %s: chunk aborted (%s: %s)", spec.name, type(exc).__name__, exc)
                return
            if self.stopping and isinstance(exc, WorkerLostError):
                exc = AgentLostError(  # the agent killed the workers: not the host failing
                    f"the elastic-ops agent stopped mid-chunk ({exc})",
                    hint="retry resumes from the last committed checkpoint",
                )
            self.outcome, self.error = "failed", type(exc).__name__
            log.info("job %s: chunk failed: %s: %s", spec.name, type(exc).__name__, exc)
            self.send(error_to_wire(exc, traceback.format_exc()))
            return
        self.done.set()
        self.outcome = result.status.value
        log.info(
            "job %s: chunk [%d, %d) %s at iteration %d",
            spec.name,
            r["start"],
            r["end"],
            result.status.value,
            result.iteration,
        )
        self.send({"type": "result", "result": jsonable(result.to_dict())})

    def abort(self) -> None:
        """Kill the workers (the agent is stopping); the task gets :class:`AgentLostError`."""
        self.stopping = True
        self.launcher.abort()

    def drain(self) -> None:
        """Commit at the next undecided iteration boundary and end ``preempted`` (a termination
        notice): the task's next grant resumes from that checkpoint, on another host. Safe in the
        main thread's signal handler (only the runner's and the reader's threads take the lock)."""
        with self._lock:
            first, self.draining = not self.draining, True
        if first:
            log.info("job %s: draining: the chunk commits at its next iteration boundary and stops",
                     self.request["spec"].name)


class Drain:
    """A termination notice to an agent (per-host or node): its grace and the moment it ends."""

    def __init__(self, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s, self.clock = grace_s, clock
        self.deadline = clock() + grace_s

    def start(self, sessions: dict[Any, Any]) -> None:
        """Tell every running chunk now. Called from the main thread's signal handler too: no
        lock of the agent's (its main thread may hold one), the dict copied as it stands."""
        for s in list(sessions.values()):
            if isinstance(s, ChunkSession):
                s.drain()

    def wait(self, lock: threading.Lock, sessions: dict[Any, Any], interrupted: threading.Event,
             meanwhile: Callable[[], None] | None = None) -> int:
        """Drain every running chunk (those registered since :meth:`start` too) and wait until
        they have ended, until the grace's end or ``interrupted``; the number still running
        then (the caller kills them). Other sessions (a node's ranks of a segment another host
        leads) are not waited for. ``meanwhile()`` runs once the chunks are told."""
        def chunks() -> list[ChunkSession]:
            with lock:
                return [s for s in sessions.values() if isinstance(s, ChunkSession)]

        running = chunks()
        if running:
            log.info("draining: %d running chunk(s) commit at their next iteration boundary (grace %g s)",
                     len(running), self.grace_s)
        self.start({id(s): s for s in running})
        if meanwhile is not None:
            meanwhile()
        while (left := chunks()) and self.clock() < self.deadline and not interrupted.wait(0.05):
            pass
        if left and not interrupted.is_set():
            log.warning("draining: %d chunk(s) reached no iteration boundary within the grace (%g s); "
                        "killing their workers (their tasks resume from their last commit)", len(left),
                        self.grace_s)
        return len(left)


def end_sessions(
    lock: threading.Lock, sessions: dict[Any, ChunkSession], threads: list[threading.Thread]
) -> None:
    """Kill the workers of every running chunk (each task gets ``AgentLostError``), then wait for
    the request threads to send that and end."""
    with lock:
        running = list(sessions.values())
    if running:
        log.info("stopping: killing the workers of %d running chunk(s)", len(running))
    for s in running:
        s.abort()
    deadline = time.monotonic() + 60  # in all, not per thread
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))


def latest_reply(req: dict[str, Any]) -> dict[str, Any]:
    """The answer to a ``latest`` request: the newest committed checkpoint of ``spec_hash`` in
    ``store``, verified by its checksums and not decoded (which one, not its state)."""
    store = StoreConfig.from_wire(req.get("store"))
    spec_hash = req.get("spec_hash")
    if spec_hash is not None and not isinstance(spec_hash, str):
        raise SpecError("spec_hash", spec_hash, "a string or null")
    # a question creates nothing: a store that does not exist holds no checkpoint
    ref = store.open(create=False).latest(spec_hash=spec_hash, decode=False)
    return {"type": "latest", "iteration": ref.iteration if ref else None, "uri": ref.uri if ref else None,
            "metrics": dict(ref.metrics) if ref else None}


def warm_launcher(launcher: Launcher | None = None, warm: bool = True) -> Launcher:
    """Import the runtime (torch) and start the fork server with its preload, once; returns the
    launcher every chunk of this process shares (``launcher`` if given, else a ``LocalLauncher``)."""
    t0 = time.monotonic()
    import multiprocessing

    from elastic_ops.runtime.launcher import LocalLauncher, _main_not_rerun

    if launcher is None:
        launcher = LocalLauncher()
    if warm:
        # One throwaway process through the fork server: it returns once the server has
        # imported its preload, so "serving" below means warm.
        with _main_not_rerun():
            proc = multiprocessing.get_context("forkserver").Process(target=os.getpid, daemon=True)
            proc.start()
        proc.join()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_ChildThreadWarning())
    log.info("runtime loaded and fork server warm in %.1fs", time.monotonic() - t0)
    return launcher


class Drainable:
    """:meth:`stop` (kill the running chunks' workers now) and :meth:`drain` (let them commit at
    their next boundary first), shared by the per-host agent and the node agent: their serve
    loops end on ``_leaving``, and their shutdown waits for ``_drain`` unless ``_stop`` is set."""

    grace_s: float
    sessions: dict[Any, Any]
    _stop: threading.Event
    _leaving: threading.Event
    _drain: Drain | None

    def stop(self) -> None:
        self._stop.set()
        self._leaving.set()

    def drain(self, grace_s: float | None = None) -> None:
        """Take no more chunks; running ones commit at their next boundary and end within
        ``grace_s`` (default: the agent's ``--grace``), then the agent stops."""
        grace = self.grace_s if grace_s is None else check_grace("grace_s", grace_s)
        if self._drain is not None:  # no lock: this runs in a signal handler too
            return
        self._drain = Drain(grace)
        self._leaving.set()
        self._drain.start(self.sessions)  # now, not when the serve loop next wakes
        log.info("%r draining (grace %g s): no new chunks; running chunks commit at their next iteration "
                 "boundary and end", self, grace)

    @property
    def draining(self) -> bool:
        return self._drain is not None


class Agent(Drainable):
    """The server. :meth:`serve` runs in the main thread until :meth:`stop`, SIGINT, or SIGTERM
    (which drains it first)."""

    def __init__(
        self,
        path: str,
        *,
        launcher: Any = None,
        warm: bool = True,
        progress_every_s: float = PROGRESS_EVERY_S,
        grace_s: float = DRAIN_GRACE_S,
    ) -> None:
        self.path = check_socket_path(path, "--socket")
        self.progress_every_s = progress_every_s
        self.grace_s = check_grace("--grace", grace_s)
        self.warm = warm
        self._launcher = launcher
        self._stop = threading.Event()  # stop now: kill the running chunks' workers
        self._leaving = threading.Event()  # take no more chunks (a stop or a drain)
        self._drain: Drain | None = None  # set by a drain (SIGTERM): its grace
        self._lock = threading.Lock()
        self.sessions: dict[int, ChunkSession] = {}
        self._threads: list[threading.Thread] = []
        self._sock: socket.socket | None = None
        self.ready = threading.Event()

    # --- start-up ----------------------------------------------------------------------------

    def _warm_up(self) -> None:
        self._launcher = warm_launcher(self._launcher, self.warm)

    def _bind(self) -> socket.socket:
        path = Path(self.path)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise SpecError(
                    "--socket", self.path, "a path that is free or an old socket (this is another file)"
                )
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(self.path)
            except OSError:
                path.unlink()  # a socket left by an agent that died
            else:
                raise SpecError(
                    "--socket",
                    self.path,
                    "a socket no other agent is serving",
                    hint="another elastic-ops agent is running there",
                )
            finally:
                probe.close()
        path.parent.mkdir(parents=True, exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is born 0600: no window in which others may connect
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        sock.listen(socket.SOMAXCONN)  # a burst of tasks must not find the queue full (EAGAIN)
        sock.settimeout(0.2)
        return sock

    # --- serving -----------------------------------------------------------------------------

    def serve(self) -> None:
        self._warm_up()
        self._sock = self._bind()
        install_stop_signals(self)
        log.info("elastic-ops agent (pid %d) serving on %s", os.getpid(), self.path)
        self.ready.set()
        n = 0
        try:
            while not self._leaving.is_set():
                try:
                    conn, _ = self._sock.accept()
                except TimeoutError:
                    continue
                except OSError:
                    if self._leaving.is_set():
                        break
                    raise
                n += 1
                self._threads = [x for x in self._threads if x.is_alive()]
                if len(self._threads) >= MAX_CONNECTIONS:
                    log.warning("refused connection %d: %d connections open already", n, MAX_CONNECTIONS)
                    conn.close()
                    continue
                t = threading.Thread(target=self._handle, args=(conn, n), name=f"conn-{n}", daemon=True)
                t.start()
                self._threads = [x for x in self._threads if x.is_alive()] + [t]
        finally:
            self._shutdown()

    def __repr__(self) -> str:
        return f"Agent({self.path!r})"

    def _shutdown(self) -> None:
        self._leaving.set()
        if self._sock is not None:  # no new connection waits in the backlog for an agent that drains
            self._sock.close()
        if self._drain is not None and not self._stop.is_set():
            self._drain.wait(self._lock, self.sessions, self._stop)
        end_sessions(self._lock, self.sessions, self._threads)
        if self._sock is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        log.info("elastic-ops agent stopped")

    def _handle(self, conn: socket.socket, n: int) -> None:
        with conn:
            uid = peer_uid(conn)
            if not trusted_peer(uid):
                log.warning("refused a connection from uid %d", uid)
                return
            channel = SocketChannel(conn)
            try:
                request = channel.read(timeout=30)
                if request is None:
                    raise AgentProtocolError("no request within 30 s")
                self._dispatch(conn, channel, request, n)
            except EOFError:
                return
            except Exception as exc:  # noqa: BLE001 - a bad request is answered, never fatal
                log.warning("connection %d: rejected: %s", n, exc)
                with contextlib.suppress(OSError):
                    conn.sendall(encode(error_to_wire(exc)))

    def _dispatch(self, conn: socket.socket, channel: SocketChannel, req: dict[str, Any], n: int) -> None:
        op = req.get("op")
        if op not in OPS:
            raise SpecError("op", op, f"one of {', '.join(OPS)}")
        if type(req.get("version")) is not int or req["version"] != PROTOCOL_VERSION:  # true == 1
            raise SpecError(
                "version", req.get("version"), f"{PROTOCOL_VERSION} (this agent's protocol version)"
            )
        if op == "ping":
            conn.sendall(
                encode(
                    {
                        "type": "pong",
                        "version": PROTOCOL_VERSION,
                        "pid": os.getpid(),
                        "chunks": len(self.sessions),
                    }
                )
            )
        elif op == "latest":
            conn.sendall(encode(latest_reply(req)))
        elif op == "drain":
            grace = req.get("grace_s")
            self.drain(None if grace is None else check_grace("grace_s", grace))
            drain = self._drain
            conn.sendall(encode({"type": "draining", "pid": os.getpid(), "chunks": len(self.sessions),
                                 "grace_s": drain.grace_s if drain is not None else None}))
        else:
            session = ChunkSession(channel, req, self._launcher, self.progress_every_s)
            threading.current_thread().name = f"chunk-{session.request['spec'].name}"
            with self._lock:
                self.sessions[n] = session
                stopping = self._leaving.is_set()
            try:
                if stopping:
                    raise AgentLostError(
                        "the elastic-ops agent is stopping" + (" (draining)" if self.draining else ""),
                        hint="retry resumes from the last committed checkpoint",
                    )
                session.run()
            finally:
                with self._lock:
                    self.sessions.pop(n, None)


def install_stop_signals(server: Drainable) -> None:
    """In the main thread: SIGTERM drains ``server`` (a termination notice; a second SIGTERM stops
    it at once), SIGINT and SIGHUP stop it at once."""
    if threading.current_thread() is not threading.main_thread():
        return

    def notice(*_: Any) -> None:
        if server.draining:
            server.stop()
        else:
            server.drain()

    signal.signal(signal.SIGTERM, notice)
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: server.stop())


def main(socket_path: str, grace_s: float = DRAIN_GRACE_S) -> int:
    """Run an agent in this process (the CLI's ``elastic-ops agent``)."""
    Agent(socket_path, grace_s=grace_s).serve()
    return 0
