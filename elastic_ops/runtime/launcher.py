"""Where worker processes run. ``LocalLauncher``: processes on this host.

Built on ``torch.distributed.elastic.multiprocessing.start_processes`` (the process layer under
``torchrun``/``elastic_launch``), not on ``elastic_launch`` itself, because:

- the runner must stay in control between launches: it polls the target, commits checkpoints
  and relaunches with a *different* worker count at an iteration boundary; ``elastic_launch``
  blocks inside its agent and restarts failed workers at the same size, which would hide the
  failures we must report (a lost worker is a retryable chunk failure, not a silent restart);
- ``start_processes`` gives a non-blocking ``PContext`` with per-rank exit codes and signals,
  so a SIGKILLed worker is reported as such, and tears the other ranks down.

Workers start with the ``forkserver`` method, with ``torch`` and the worker module preloaded in
the fork server: importing torch costs seconds of CPU per process, and a rescale relaunches
every worker, so each process forks from the already-initialised server instead (the server
is single-threaded and never touches CUDA, so forking it is safe). Workers never need the
runner's ``__main__`` module (everything they run is importable by name), so the launcher
stops multiprocessing from re-running it in each worker, and a script that calls ``run_job``
at top level, without an ``if __name__ == "__main__":`` guard, works too.

Rendezvous follows torchelastic's agent-store convention: the runner hosts a ``TCPStore`` per
segment (``TORCHELASTIC_USE_AGENT_STORE=True``, ``MASTER_ADDR``/``MASTER_PORT``), and the
workers join it as clients through a store that signs every value with the segment's key
(:mod:`elastic_ops.runtime.rendezvous`: ``TCPStore`` itself lets anyone who connects read and
write every key). The store listens on loopback only (:func:`loopback_store`),
except for a segment that spans hosts (``LaunchRequest.remote``: a node agent's launcher starts
the other hosts' ranks), whose store listens on the address the node agent advertises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.machinery
import multiprocessing
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import (
    DefaultLogsSpecs,
    PContext,
    RunProcsResult,
    Std,
    start_processes,
)

from elastic_ops.runtime.rendezvous import KEY_ENV, new_key
from elastic_ops.runtime.worker import LAUNCHER_PID_ENV, worker_entry


def loopback_store(address: str = "127.0.0.1") -> dist.TCPStore:
    """A segment's rendezvous store, reachable from this host only (or at ``address``).

    ``TCPStore("127.0.0.1", 0, is_master=True)`` listens on every interface (the host argument
    only says where clients connect), so anyone on the network could read or overwrite the
    rendezvous keys of a running segment. Its socket is bound to 127.0.0.1 here and handed over
    with ``master_listen_fd``; the store then owns the descriptor and closes it with itself.
    A segment spanning hosts binds it to the one ``address`` its node agent advertises to the
    others (``elastic-ops node --advertise-addr``), not to every interface."""
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((address, 0))
        sock.listen(128)
        store = dist.TCPStore(
            address, sock.getsockname()[1], is_master=True, wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        # the store may have taken (and closed) the descriptor before a SIGTERM's SystemExit:
        # a second close's EBADF must not replace what is being raised
        with contextlib.suppress(OSError):
            sock.close()
        raise
    sock.detach()  # the store closes it
    return store


@dataclass(frozen=True)
class RemotePart:
    """Ranks ``rank_offset .. rank_offset + count - 1`` of a segment, run on another ``host``'s
    node agent, on its GPU ``slots`` (the pool's slot indices there, in rank order)."""

    host: str
    rank_offset: int
    count: int
    slots: tuple[int, ...]


@dataclass(frozen=True)
class LaunchRequest:
    workers: int
    script: str | None  # a user script (script mode), else the Trainable worker
    master_addr: str
    master_port: int
    segment: int  # becomes TORCHELASTIC_RESTART_COUNT
    log_dir: Path
    env: Mapping[str, str]  # extra variables for every rank
    device: str = "cpu"  # "cpu" or "cuda"
    threads_per_worker: int = 1
    # The GPU slots the pool granted this job on this host, in worker order (rank r gets slot
    # ``slots[r]``, slot i = the host's i-th visible GPU); None: no grant names them (the CLI,
    # tests), and rank r takes the r-th visible GPU. Ignored on CPU.
    slots: tuple[int, ...] | None = None
    # A segment spanning hosts: this host runs ranks rank_offset .. rank_offset + workers - 1 of
    # world_size (None: workers, one host), as the group_rank-th host; the leader's request
    # (rank 0 is always there) lists the other hosts' ranks in ``remote``.
    rank_offset: int = 0
    world_size: int | None = None
    group_rank: int = 0
    remote: tuple[RemotePart, ...] = ()
    # The key that signs the segment's rendezvous (runtime/rendezvous.py), every rank's; None: the
    # launcher makes one. In the ranks' environment only: never in argv, a repr or a log.
    rendezvous_key: str | None = dataclasses.field(default=None, repr=False)

    @property
    def world(self) -> int:
        return self.workers if self.world_size is None else self.world_size


def worker_env(req: LaunchRequest, rank: int, gpus: Sequence[str] = ()) -> dict[str, str]:
    """The environment of this host's worker ``rank`` (its local rank): PyTorch's names plus
    IBM WML's (1-based)."""
    global_rank, world = req.rank_offset + rank, req.world
    env = {
        "RANK": str(global_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(req.workers),
        "GROUP_RANK": str(req.group_rank),
        "ROLE_RANK": str(global_rank),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": req.master_addr,
        "MASTER_PORT": str(req.master_port),
        "LEARNER_ID": str(global_rank + 1),
        "NUM_LEARNERS": str(world),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": str(req.segment),
        "OMP_NUM_THREADS": str(req.threads_per_worker),
        "ELASTIC_OPS_DEVICE": req.device,
        LAUNCHER_PID_ENV: str(os.getpid()),  # the workers exit if this process dies (worker.py)
    }
    if req.rendezvous_key is not None:
        env[KEY_ENV] = req.rendezvous_key
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if world == req.workers:
        # All ranks share this host: gloo on loopback, no hostname resolution (seconds when DNS is slow).
        env["GLOO_SOCKET_IFNAME"] = ifname or "lo"
    elif ifname:  # across hosts: the interface the node agent was told to use, else gloo's own choice
        env["GLOO_SOCKET_IFNAME"] = ifname
    env.update(req.env)
    if req.device == "cuda":
        if req.slots is None:
            env["CUDA_VISIBLE_DEVICES"] = gpus[rank % len(gpus)] if gpus else str(rank)
        else:
            env["CUDA_VISIBLE_DEVICES"] = slot_gpus(req.slots, req.workers, gpus)[rank]
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # needed by deterministic cuBLAS
    return env


def slot_gpus(slots: Sequence[int], workers: int, gpus: Sequence[str]) -> list[str]:
    """The GPU of each of ``workers`` ranks: rank r runs on granted slot ``slots[r]``, and slot i
    is the i-th of this host's visible ``gpus``. Slots past ``workers`` are not used.

    Raises :class:`SpecError` (field ``slots``) when the grant names fewer slots on this host
    than there are workers or names one twice, and :class:`WorkerLostError` (retryable, held
    against the host by the chunk task) when it names a slot this host has no GPU for: the
    pool lists more slots for the host than CUDA can use there (a GPU failed or fell off the
    bus, the host was registered with too many slots, or it has no GPU at all). The job's spec
    is not at fault, and another host may have the GPUs; the message says what to fix.
    """
    from elastic_ops.errors import SpecError, WorkerLostError

    used = list(slots[:workers])
    if len(used) < workers:
        raise SpecError(
            "slots",
            list(slots),
            f"one granted GPU slot on this host per worker ({workers} workers)",
            hint="the runner starts every worker on its own host; a grant must place them all there",
        )
    for slot in used:
        if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
            raise SpecError("slots", slot, "a GPU slot index: an integer >= 0")
    missing = [slot for slot in used if slot >= len(gpus)]
    if missing and not gpus and not nvidia_driver_loaded():
        # Not a GPU host at all: no retry on it can succeed, and a failure held against it would
        # cool a healthy CPU host for other jobs. The job's placement is what to fix.
        raise SpecError(
            "device",
            "cuda",
            f"a host with GPUs: this one has no NVIDIA driver, so no GPU for granted slot(s) {missing}",
            hint="give the job a host_selector that only GPU hosts carry (e.g. {gpu: h100}; hosts get "
            "labels with `elastic-ops pool add-host HOST N --label gpu=h100`), or device 'auto' to train "
            "on the CPU where a host has no GPU",
        )
    if missing:
        have = (f"{len(gpus)} GPU(s) CUDA can use, {list(gpus)} (slots 0..{len(gpus) - 1})" if gpus
                else "no GPU CUDA can use (torch.cuda.device_count() is 0: no GPU or driver, a CPU build "
                "of torch, or CUDA_VISIBLE_DEVICES hides them)")
        raise WorkerLostError(
            f"no GPU for granted slot(s) {missing} on this host: it has {have}",
            hint="the pool lists more slots for this host than it has GPUs: check them (nvidia-smi), then "
            "resize the host (`elastic-ops pool add-host HOST N`) or drain it; a CUDA job on a host "
            "without GPUs needs a host_selector for GPU hosts. The retry's grant avoids this host",
        )
    if len(set(used)) < len(used):
        raise SpecError("slots", used, "distinct slots, one GPU per worker")
    return [gpus[slot] for slot in used]


def nvidia_driver_loaded() -> bool:
    """Whether this host runs the NVIDIA kernel driver (``/proc/driver/nvidia`` or a
    ``/dev/nvidiaN`` device): one without it is no GPU host; one with it and no GPU CUDA can use
    has lost its GPUs (a host fault)."""
    return os.path.exists("/proc/driver/nvidia") or any(Path("/dev").glob("nvidia[0-9]*"))


def parse_visible_devices(text: str) -> list[str]:
    """``$CUDA_VISIBLE_DEVICES`` as CUDA reads it (and ``torch.cuda``'s own parser): a list of
    ordinals, or of ``GPU-``/``MIG-`` UUIDs, cut at the first entry that is not one (``-1``, an
    empty string: no GPU at all), and empty altogether when an entry repeats. Ordinals read like
    ``strtoul`` (``" 1"`` and ``"1gpu"`` are ``1``) and come back as plain numbers."""
    entries = [e.strip() for e in text.split(",")]
    out: list[str] = []
    prefix = next((p for p in ("GPU-", "MIG-") if text.strip().startswith(p)), None)
    for entry in entries:
        if prefix is not None:
            if not entry.startswith(prefix):
                break
            value = entry
        else:
            digits = re.match(r"\+?[0-9]+", entry)
            if digits is None:  # "-1", "", a word: CUDA stops reading here
                break
            value = str(int(digits.group()))
        if value in out:  # CUDA makes no device visible when one is listed twice
            return []
        out.append(value)
    return out


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out, one per worker slot, as the ``CUDA_VISIBLE_DEVICES``
    value each worker gets: those CUDA makes visible here. Without ``$CUDA_VISIBLE_DEVICES``,
    ordinals ``0 .. torch.cuda.device_count() - 1``; with it, its entries as CUDA reads them
    (:func:`parse_visible_devices`: ``""`` and ``"-1"`` hide every GPU, they are not "no
    restriction"), cut to the devices that exist (``torch.cuda.device_count()`` counts the valid
    prefix). MIG instances are not cut: CUDA enumerates one MIG device per process, so the count
    here would say 1 for any list, while each worker gets one of them."""
    import torch

    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count()
    if listed is None:
        return [str(i) for i in range(count)]
    gpus = parse_visible_devices(listed)
    if gpus and gpus[0].startswith("MIG-"):
        return gpus if count > 0 else []
    return gpus[:count]


def start_on(launcher: Launcher, req: LaunchRequest, host: str) -> Segment:
    """``launcher.start(req)`` for ranks on ``host``: a host fault the launcher raises without
    naming a host (no GPU for a granted slot) is ``host``'s, so the chunk task reports that host
    and the retry's grant avoids it (the leader's runner, for a follower's ranks, would otherwise
    have only its own host to blame)."""
    from elastic_ops.errors import WorkerLostError

    try:
        return launcher.start(req)
    except WorkerLostError as exc:
        if exc.host is not None:
            raise
        raise WorkerLostError(f"{host}: {exc.message}", host=host, hint=exc.hint) from exc


# torch._dynamo: every torch.optim.Optimizer imports it on construction (~4 s of CPU per process).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "elastic_ops.runtime.worker"]


@dataclasses.dataclass(frozen=True)
class FailureReport:
    """What a failed segment's handle knows beyond its ranks' exit codes (the runner's verdict,
    :mod:`elastic_ops.runtime.verdict`, reads it)."""

    #: this host's ranks that a signal other than the teardown's SIGTERM ended: rank -> signal name
    killed: Mapping[int, str] = dataclasses.field(default_factory=dict)
    #: what the other hosts' ranks reported (a segment spanning hosts)
    remote_reports: tuple[Mapping[str, Any], ...] = ()
    #: the other hosts' ranks a signal ended: global rank -> (host, signal name)
    remote_killed: Mapping[int, tuple[str, str]] = dataclasses.field(default_factory=dict)
    lost_host: str | None = None  # a host whose node agent went silent
    stopped_host: str | None = None  # a host whose node agent stopped its ranks (shutting down)


class Segment(Protocol):
    """A started segment, shaped like ``torch.distributed.elastic.multiprocessing.PContext``:
    ``wait(timeout, period)`` returns ``None`` while the ranks run and their ``RunProcsResult``
    (per-rank exit codes, failures) once they have all exited or one has failed; ``close()``
    stops any left; ``abort()`` stops every rank now, the other hosts' too (from another thread:
    only pids are read here, the runner's thread polls); ``failure_report()`` says more of a
    failure."""

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None: ...

    def pids(self) -> dict[int, int]: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...

    def failure_report(self) -> FailureReport: ...


class Launcher(Protocol):
    """Where a segment's workers run (DESIGN.md "Launchers"); the runner needs only this.

    ``start(req)`` starts ``req.workers`` ranks and returns at once with their :class:`Segment`.
    ``address``: where the other hosts reach this one (a node agent started with
    ``--advertise-addr``), which a segment spanning hosts needs; ``None``: this host only.
    :class:`LocalLauncher` (this host) is the one built in; the agent wraps it to abort a chunk
    whose task went away.
    """

    address: str | None

    def start(self, req: LaunchRequest) -> Segment: ...


class LocalSegment:
    """The workers :class:`LocalLauncher` started: torch's ``PContext``, as a :class:`Segment`."""

    def __init__(self, pc: PContext) -> None:
        self.pc = pc

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        return self.pc.wait(timeout=timeout, period=period)

    def pids(self) -> dict[int, int]:
        return self.pc.pids()

    def close(self) -> None:
        self.pc.close()

    def abort(self) -> None:
        for pid in list(self.pc.pids().values()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def failure_report(self) -> FailureReport:
        return FailureReport(killed=signalled_ranks(self.pc))


def signalled_ranks(pc: Any) -> dict[int, str]:
    """Ranks of ``pc`` (torch's ``PContext``) that a signal other than our own teardown's
    SIGTERM ended.

    ``start_processes`` reports only the first rank it saw fail, and when one worker is
    SIGKILLed its peers often exit with 1 (their collective broke) before the poll sees the
    kill; the dead worker is the one the error should name. Torch keeps the processes on its
    multiprocessing context (``_pc.processes``), not in the result.
    """
    processes = getattr(getattr(pc, "_pc", None), "processes", None) or []
    killed = {}
    for rank, proc in enumerate(processes):
        code = proc.exitcode
        if code is not None and code < 0 and -code != signal.SIGTERM:
            try:
                killed[rank] = signal.Signals(-code).name
            except ValueError:
                killed[rank] = f"signal {-code}"
    return killed


class LocalLauncher:
    """Starts a segment's workers as processes on this host."""

    host = "localhost"
    address: str | None = None  # this host only

    def __init__(self) -> None:
        # Only takes effect if this process has not started a fork server yet.
        multiprocessing.set_forkserver_preload(PRELOAD)

    def start(self, req: LaunchRequest) -> LocalSegment:
        if req.remote:
            from elastic_ops.errors import SpecError

            raise SpecError(
                "workers",
                req.world,
                f"at most the {req.workers} worker(s) this host runs: this launcher starts workers on "
                "this host only",
                hint="a segment spanning hosts runs on node agents (elastic-ops node --advertise-addr)",
            )
        if req.rendezvous_key is None:
            req = dataclasses.replace(req, rendezvous_key=new_key())
        gpus = visible_gpus() if req.device == "cuda" else []
        if req.device == "cuda" and req.slots is not None:
            slot_gpus(req.slots, req.workers, gpus)  # every rank's GPU, checked before any starts
        elif req.device == "cuda" and len(gpus) < req.workers:
            from elastic_ops.errors import SpecError

            raise SpecError(
                "workers", req.workers, f"needs one GPU per worker; {len(gpus)} visible",
                hint=None if gpus else "CUDA sees no GPU here (torch.cuda.device_count() is 0: no GPU or "
                "driver, a CPU build of torch, or CUDA_VISIBLE_DEVICES hides them); device 'auto' "
                "trains on the CPU then",
            )
        envs = {r: worker_env(req, r, gpus) for r in range(req.workers)}
        args = {r: (req.script,) for r in range(req.workers)}
        logs = DefaultLogsSpecs(log_dir=str(req.log_dir), redirects=Std.NONE, tee=Std.NONE)
        # start() installs SIGTERM/SIGINT handlers when called from the main thread; the host
        # process (an Airflow task, the CLI) owns those, so put its handlers back afterwards.
        # From any other thread (the agent runs each chunk in its own) signal.signal would raise:
        # torch then installs none and we restore none, and the agent's main thread owns the
        # teardown. One start at a time: _main_not_rerun swaps a process-wide attribute.
        with _START_LOCK:
            saved = _save_handlers()
            before = set(multiprocessing.active_children())
            try:
                try:
                    with _main_not_rerun():
                        segment = LocalSegment(start_processes(
                            name="elastic-ops-worker",
                            entrypoint=worker_entry,
                            args=args,
                            envs=envs,
                            logs_specs=logs,
                            start_method="forkserver",
                        ))
                finally:
                    _restore_handlers(saved)
            except BaseException:
                # A start cut short (a SIGTERM between two ranks' starts, a fork server's
                # FileNotFoundError) leaves the ranks started so far on no PContext: alive,
                # non-daemonic, waiting in their rendezvous for ranks that never come, and
                # multiprocessing's exit handler joins them, so the process hung for the
                # group's timeout instead of exiting. Stop them before the error goes on.
                stop_processes(p for p in multiprocessing.active_children() if p not in before)
                raise
        return segment


def stop_processes(processes: Iterable[multiprocessing.process.BaseProcess], timeout: float = 10.0) -> None:
    """SIGKILL ``processes`` (workers no segment owns: nothing of theirs can be committed) and
    reap them, waiting at most ``timeout`` seconds in all."""
    procs = list(processes)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, ValueError):  # exited; closed
            proc.kill()
    deadline = time.monotonic() + timeout
    for proc in procs:
        with contextlib.suppress(ValueError):
            proc.join(max(deadline - time.monotonic(), 0.0))


@contextlib.contextmanager
def _main_not_rerun() -> Iterator[None]:
    """Make multiprocessing treat ``__main__`` as unimportable while workers are started.

    ``spawn.get_preparation_data`` skips re-running the main module when its spec is named
    ``__main__``; the workers' preparation data is captured synchronously in ``start``.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    had, old = hasattr(main, "__spec__"), getattr(main, "__spec__", None)
    main.__spec__ = importlib.machinery.ModuleSpec("__main__", None)
    try:
        yield
    finally:
        if had:
            main.__spec__ = old
        else:
            del main.__spec__


_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
_START_LOCK = threading.Lock()


def _save_handlers() -> dict[int, object]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {getattr(signal, s): signal.getsignal(getattr(signal, s)) for s in _SIGNALS if hasattr(signal, s)}


def _restore_handlers(saved: dict[int, object]) -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # signal.signal works in the main thread only (and nothing was saved here)
    for sig, handler in saved.items():
        if handler is not None:
            signal.signal(sig, handler)
