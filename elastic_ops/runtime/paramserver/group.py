"""The runner's side of the parameter servers: start them when a chunk starts, hand each
segment's rendezvous to them, watch them, stop them when the chunk ends.

Servers run on the host that runs the chunk, beside its worker ranks, and take no slot: a slot
is a worker's (one GPU on a GPU host), and the pool decides the workers only; the servers come
with every grant of the job (docs/runtime.md, "Parameter-server strategy").

A server lives for the whole chunk: rescales relaunch the workers, never the servers, whose
shards and optimizer state stay in memory. A server lost (killed, its host's memory gone) ends
the chunk as a :class:`~elastic_ops.errors.WorkerLostError` naming it, retryable like a lost
worker; the retry starts every server from the latest committed checkpoint, which holds each
server's shard and optimizer state.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

from elastic_ops.errors import NonFiniteLossError, TrainingError, UserCodeError, WorkerLostError

log = logging.getLogger("elastic_ops.runtime")

READY_TIMEOUT_S = 600.0  # building the model and loading the state (a large table: a while)
LEFT_TIMEOUT_S = 120.0


class ServerGroup:
    """``spec.servers`` server processes of one chunk (see the module doc)."""

    def __init__(self, spec: Any, state_path: str | None, host: str, import_path: Sequence[str] = (),
                 threads: int = 1) -> None:
        from elastic_ops.runtime.launcher import _START_LOCK, PRELOAD, _main_not_rerun
        from elastic_ops.runtime.paramserver.server import SERVER_ENV, server_entry
        from elastic_ops.runtime.worker import LAUNCHER_PID_ENV

        multiprocessing.set_forkserver_preload(PRELOAD)  # only if no fork server runs yet
        ctx = multiprocessing.get_context("forkserver")
        self.spec, self.host, self.count = spec, host, int(spec.servers)
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.ready: dict[int, int] = {}
        self.left: dict[int, set[int]] = {}
        self.errors: dict[int, tuple[str, str, str, int]] = {}
        self.stats: dict[str, int] = {"bytes_sent": 0, "bytes_received": 0, "snapshot_bytes": 0, "steps": 0}
        self.workers = 0  # of the segment they serve now (their ranks follow the workers')
        try:
            for s in range(self.count):
                parent, child = ctx.Pipe()
                env = {
                    SERVER_ENV: str(s),
                    LAUNCHER_PID_ENV: str(os.getpid()),
                    "OMP_NUM_THREADS": str(threads),
                    "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
                }
                cfg = {"spec": spec.to_dict(), "server": s, "state_path": state_path,
                       "import_path": list(import_path), "env": env}
                proc = ctx.Process(target=server_entry, args=(child, cfg), name=f"elastic-ops-ps-{s}",
                                   daemon=True)
                with _START_LOCK, _main_not_rerun():  # the server never needs the runner's __main__
                    proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
        except BaseException:
            self.close()
            raise
        log.info("job %s: %d parameter server(s) on %s, pids %s", spec.name, self.count, host,
                 " ".join(f"server{s}={p.pid}" for s, p in enumerate(self.procs)))

    # --- messages ------------------------------------------------------------------------

    def _poll(self) -> None:
        for s, conn in enumerate(self.conns):
            try:
                while conn.poll():
                    msg = conn.recv()
                    if msg[0] == "ready":
                        self.ready[s] = int(msg[2])
                    elif msg[0] == "left":
                        self.left.setdefault(int(msg[1]), set()).add(s)
                        for k in ("bytes_sent", "bytes_received", "snapshot_bytes"):
                            self.stats[k] += int(msg[2].get(k, 0))
                        if s == 0:  # every server steps every iteration: count one's
                            self.stats["steps"] += int(msg[2].get("steps", 0))
                    elif msg[0] == "error":
                        self.errors[s] = (msg[1], msg[2], msg[3], msg[4])
            except (EOFError, OSError):
                continue  # gone: its exit code says how

    def failure(self, grace: float = 0.0, *, comm: bool = False) -> Exception | None:
        """The error a server's end means for the chunk (None: none ended). A server killed by a
        signal is lost (retryable); one that reported its user code's error ends the chunk with
        it. ``comm``: count a server whose group broke (a worker died: that is the worker's
        verdict, not this) as lost too. ``grace``: wait that long for a dying server's status."""
        deadline = time.monotonic() + grace
        while True:
            self._poll()
            err = self._judge(comm)
            if err is not None or time.monotonic() >= deadline:
                return err
            time.sleep(0.02)

    def _judge(self, comm: bool) -> Exception | None:
        for s, proc in enumerate(self.procs):
            code = proc.exitcode
            if code is not None and code < 0:
                try:
                    name = signal.Signals(-code).name
                except ValueError:
                    name = f"signal {-code}"
                return WorkerLostError(
                    f"worker lost on {self.host}: parameter server {s} (rank {self.workers + s}) killed by "
                    f"{name}",
                    host=self.host,
                    hint="the retry starts every server from the last committed checkpoint (each server's "
                    "shard and optimizer state)",
                )
        for s, (kind, message, text, iteration) in sorted(self.errors.items()):
            when = "before training" if iteration is None or iteration < 0 else f"at iteration {iteration}"
            if kind == "user":
                tail = f"\n{text}" if text else ""
                return UserCodeError(f"parameter server {s} {when}: {message}{tail}")
            if kind == "nonfinite":
                return NonFiniteLossError(f"parameter server {s} {when}: {message}")
            if kind == "internal":
                return TrainingError(f"parameter server {s} failed {when}: {message}\n{text}")
            if comm:
                return WorkerLostError(f"worker lost on {self.host}: parameter server {s} lost its workers "
                                       f"{when}: {message}", host=self.host)
        for s, proc in enumerate(self.procs):
            if proc.exitcode is not None and s not in self.errors and comm:
                return WorkerLostError(f"worker lost on {self.host}: parameter server {s} exited with status "
                                       f"{proc.exitcode}", host=self.host)
        return None

    def check(self) -> None:
        err = self.failure()
        if err is not None:
            raise err

    def _wait(self, done: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            err = self.failure(comm=True)
            if err is not None:
                raise err
            if time.monotonic() >= deadline:
                raise WorkerLostError(f"worker lost on {self.host}: the parameter servers did not {what} "
                                      f"within "
                                      f"{timeout:.0f} s", host=self.host)
            time.sleep(0.005)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        self._wait(lambda: len(self.ready) == self.count, timeout, "start")

    def join(self, info: dict[str, Any]) -> None:
        """Hand segment ``info``'s rendezvous (address, port, key, worker count) to every server."""
        self.workers = int(info["workers"])
        for conn in self.conns:
            conn.send(("segment", info))

    def wait_left(self, index: int, timeout: float = LEFT_TIMEOUT_S) -> None:
        self._wait(lambda: len(self.left.get(index, ())) == self.count, timeout, f"leave segment {index}")

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError, BrokenPipeError):
                conn.send(("stop",))
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            with contextlib.suppress(ValueError, AssertionError):
                proc.join(max(deadline - time.monotonic(), 0.0))
        for proc in self.procs:
            with contextlib.suppress(ValueError, AssertionError, ProcessLookupError):
                if proc.exitcode is None:
                    proc.kill()
                    proc.join(5.0)
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.close()
