"""The worker side of one *segment*: a run of iterations at a fixed worker count.

Shared by Trainable workers (:mod:`elastic_ops.runtime.worker`) and script mode
(:mod:`elastic_ops.runtime.script`). The runner writes ``segment.json`` into a fresh directory
and points ``ELASTIC_OPS_SEGMENT`` at it. Files written here, read by the runner:

- ``ckpt-<i>.pt`` (rank 0): the state at checkpoint boundary ``i``, written before boundary
  ``i`` is published, so the runner finds it complete when it sees the boundary;
- ``state-<i>.pt`` + ``result.json`` (rank 0): the state where the segment stopped (the chunk's
  end, or a boundary where the target differs from the current worker count);
- ``error-<rank>.json``: why a rank failed (``user``, ``nonfinite``, ``comm``, ``internal``).

A segment that *spans hosts* (``"span": true``) has one process group across them; rank 0 runs
on the leader, the host whose runner holds the control channel. There rank 0 alone reads each
boundary's target and broadcasts it to every rank (one small collective per iteration: the
other hosts cannot map the leader's file), and the state the segment starts from is read by
rank 0 and broadcast as bytes, which every rank loads with ``weights_only=True``. The other
hosts' ``segment.json`` say ``"leader": false``: they have no control channel.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic_ops.errors import SpecError
from elastic_ops.runtime.control import ControlChannel, continues, with_batch
from elastic_ops.spec import JobSpec

ENV_VAR = "ELASTIC_OPS_SEGMENT"
PG_TIMEOUT_ENV = "ELASTIC_OPS_PG_TIMEOUT_S"
PG_TIMEOUT_DEFAULT_S = 600
PG_TIMEOUT_MAX_S = 7 * 86400


def pg_timeout() -> datetime.timedelta:
    """The process group's collective timeout, from ``$ELASTIC_OPS_PG_TIMEOUT_S`` (whole seconds).
    The chunk runner reads it before it starts workers, so a bad value is a :class:`SpecError`
    there, not a traceback in every worker."""
    return datetime.timedelta(seconds=_seconds(PG_TIMEOUT_ENV, PG_TIMEOUT_DEFAULT_S))


STALL_ENV = "ELASTIC_OPS_STALL_S"
STALL_DEFAULT_S = 3600


def stall_timeout() -> float:
    """How long the chunk runner waits for a lone worker (no collective to time out) to reach its
    next iteration boundary before it stops it, from ``$ELASTIC_OPS_STALL_S`` (whole seconds;
    longer than the collectives' default: in-loop work a group shares, one worker does alone)."""
    return float(_seconds(STALL_ENV, STALL_DEFAULT_S))


def _seconds(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= PG_TIMEOUT_MAX_S:
        raise SpecError(name, raw, f"whole seconds, 1..{PG_TIMEOUT_MAX_S}")
    return int(text)


class UserFailure(Exception):
    """An exception raised by the user's code; carries the user's traceback text."""

    def __init__(self, exc: BaseException) -> None:
        self.text = "".join(traceback.format_exception(exc))
        super().__init__(f"{type(exc).__name__}: {exc}")


class NonFiniteLoss(Exception):
    pass


class DeviceUnusable(Exception):
    """This worker's GPU cannot be used: CUDA finds no device behind its ``CUDA_VISIBLE_DEVICES``,
    the device is busy (exclusive-process mode, another process on it), failed (ECC, fallen off
    the bus) or the driver does not match torch's CUDA. The host's fault, not the job's: the
    runner reports it as a retryable :class:`~elastic_ops.errors.WorkerLostError` on the host."""


def _stage(state: dict[str, Any], path: Path) -> None:
    """Write a state for the runner to commit. A value the safe loader would refuse (a numpy
    scalar in a scheduler's state) is the user's to fix: refused here, at the first state,
    naming where it is, not when the runner loads the file to commit it."""
    from elastic_ops.checkpoint.codec import check_state
    from elastic_ops.runtime.state import save_atomic

    with user_code():
        check_state(state)
    save_atomic(state, path)


@contextlib.contextmanager
def user_code() -> Iterator[None]:
    """Attribute any exception raised inside to the user's code, ``sys.exit()`` included: a
    Trainable that exits (data missing, an argument parser refusing) is the user's error, as a
    script's non-zero exit is, not a worker lost (it was retried and blamed on the host, its
    message dropped)."""
    try:
        yield
    except UserFailure:
        raise
    except (Exception, SystemExit) as exc:
        raise UserFailure(exc) from exc


def _set_title(cfg: dict[str, Any]) -> None:
    """Name this worker in ``ps``/``top`` (``elastic-ops worker digits chunk 300-400 rank 1/4
    segment 2``), not by the fork server's command line it inherited. Without setproctitle
    (a host given only the runtime's own dependencies) the title stays."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    chunk = cfg.get("chunk") or [cfg["start"], cfg["end"]]
    name = str(cfg["spec"].get("name", "?"))
    setproctitle(f"elastic-ops worker {name} chunk {chunk[0]}-{chunk[1]} rank {os.environ.get('RANK', '?')}/"
                 f"{os.environ.get('WORLD_SIZE', cfg['workers'])} segment {cfg['segment']} "
                 f"from iteration {cfg['start']}")


@dataclass
class Segment:
    spec: JobSpec
    start: int
    end: int
    workers: int
    index: int
    dir: Path
    state_path: str | None
    rank: int
    local_rank: int
    channel: ControlChannel | None  # None on the hosts of a spanning segment other than the leader
    span: bool = False
    batch: int = 0  # the global batch the runner chose for the first iteration (adaptive; 0: own)
    _pending: Any = None  # spanning: (tensor, work) of the next boundary's broadcast decision

    @classmethod
    def from_env(cls) -> Segment:
        path = os.environ.get(ENV_VAR)
        if not path:
            raise RuntimeError(
                f"{ENV_VAR} is not set: this process was not started by the elastic_ops runner"
            )
        cfg = json.loads(Path(path).read_text())
        if cfg.get("import_path"):  # the task's folders (a chunk on an agent): before any user import
            from elastic_ops.runtime.entrypoints import extend_import_path

            extend_import_path(cfg["import_path"])
        length = cfg["end"] - cfg["start"] + 1
        _set_title(cfg)
        return cls(
            spec=JobSpec.from_dict(cfg["spec"]),
            start=cfg["start"],
            end=cfg["end"],
            workers=cfg["workers"],
            index=cfg["segment"],
            dir=Path(cfg["dir"]),
            state_path=cfg["state_path"],
            rank=int(os.environ["RANK"]),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            channel=ControlChannel(cfg["dir"], length, create=False) if cfg.get("leader", True) else None,
            span=bool(cfg.get("span", False)),
            batch=int(cfg.get("batch", 0)),
        )

    # --- setup ---------------------------------------------------------------------------

    def device(self) -> torch.device:
        # The launcher gives each CUDA worker exactly one visible GPU.
        return (
            torch.device("cuda", 0) if os.environ.get("ELASTIC_OPS_DEVICE") == "cuda" else torch.device("cpu")
        )

    def setup(self, *, always_group: bool = False) -> None:
        """Threads, determinism and the process group (a signed rendezvous on the runner's store).

        Trainable workers skip the group at one worker (no collective to run); scripts always
        get one, since DDP needs it even alone. A parameter-server job's group holds the
        servers too (ranks ``workers .. workers + servers - 1``), even with one worker.
        """
        servers = int(self.spec.servers or 0) if self.spec.parameter_server else 0
        always_group = always_group or servers > 0
        torch.set_num_threads(self.spec.threads_per_worker)
        if self.spec.consistency.value == "bitwise":
            torch.use_deterministic_algorithms(True)
        if self.device().type == "cuda":
            self._claim_gpu()
        if (self.workers > 1 or always_group) and not dist.is_initialized():
            from elastic_ops.runtime.rendezvous import worker_store

            backend = "nccl" if self.device().type == "cuda" else "gloo"
            timeout = pg_timeout()
            # the runner's store, every value signed with the segment's key (rendezvous.py): not
            # a plain env:// join, which anyone who can connect to the store could redirect
            dist.init_process_group(backend, store=worker_store(timeout), rank=self.rank,
                                    world_size=self.workers + servers, timeout=timeout)

    def _claim_gpu(self) -> None:
        """Make this worker's one visible GPU current and create its context (a tiny allocation):
        a missing, busy or broken GPU fails here, as :class:`DeviceUnusable`, before any user code."""
        try:
            torch.cuda.init()  # "No CUDA GPUs are available", "Torch not compiled with CUDA enabled"
            torch.cuda.set_device(0)
            torch.zeros(1, device="cuda")
        except Exception as exc:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise DeviceUnusable(f"{type(exc).__name__}: {exc} (CUDA_VISIBLE_DEVICES={visible!r})") from exc

    def load_state(self) -> dict[str, Any] | None:
        if self.span:
            return self._broadcast_state()
        if not self.state_path:
            return None
        from elastic_ops.runtime.state import load_state

        return load_state(self.state_path)

    def _comm_device(self) -> torch.device:
        return self.device() if dist.get_backend() == "nccl" else torch.device("cpu")

    def _broadcast_state(self) -> dict[str, Any] | None:
        """Rank 0's starting state on every rank: its file's bytes, broadcast, loaded with
        ``weights_only=True`` (no code runs, whoever sent them)."""
        import io

        from elastic_ops.runtime.state import load_state

        data = b""
        if self.rank == 0 and self.state_path:
            data = Path(self.state_path).read_bytes()
        size = torch.tensor([len(data)], dtype=torch.int64, device=self._comm_device())
        dist.broadcast(size, 0)
        n = int(size.item())
        if n == 0:
            return None
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
        buf = buf.to(self._comm_device())
        dist.broadcast(buf, 0)
        return load_state(io.BytesIO(buf.cpu().numpy().tobytes()))

    # --- boundaries ----------------------------------------------------------------------

    def target(self, iteration: int) -> int:
        """The decision at boundary ``iteration`` (same value on every rank): the worker count
        wanted, :func:`~elastic_ops.runtime.control.continues` tells whether this segment goes
        on, :func:`~elastic_ops.runtime.control.batch_of` its batch.

        Spanning hosts, the broadcast of boundary ``i + 1``'s decision starts at boundary ``i``
        (asynchronously: it travels while iteration ``i`` computes), whenever ``i`` goes on at
        this size; the runner decides boundaries ahead of rank 0, so it is there to be read.
        Every rank issues the same broadcasts in the same order (they all see the same values).
        """
        if self.span:
            return self._spanning_target(iteration)
        if iteration == self.start:
            return with_batch(self.workers, self.batch)
        return self.channel.target(iteration - self.start)

    def _spanning_target(self, iteration: int) -> int:
        if iteration == self.start:
            value = with_batch(self.workers, self.batch)
        else:
            decided, work = self._pending
            work.wait()
            value = int(decided.item())
        self._pending = None
        # an adaptive step may cross boundaries: the next read gets the decision of the one after
        # this, which every rank reads alike
        if continues(value, self.workers) and iteration + 1 < self.end:
            ahead = self.channel.target(iteration + 1 - self.start) if self.rank == 0 else 0
            decided = torch.tensor([ahead], dtype=torch.int64, device=self._comm_device())
            self._pending = (decided, dist.broadcast(decided, 0, async_op=True))
        return value

    def checkpoint_due(self, iteration: int, since: int | None = None) -> bool:
        """Whether a checkpoint is due at boundary ``iteration``: a multiple of the interval in
        ``since..iteration`` (default: ``iteration`` alone; an adaptive step crosses several)."""
        every = int(self.spec.checkpoint_interval)
        first = iteration if since is None else since
        return self.start < iteration < self.end and iteration // every > (first - 1) // every

    def publish(self, iteration: int, loss: float, cursor: int, *, since: int | None = None,
                steps: int | None = None,
                grad: tuple[float, float] | None = None, batch: int = 0) -> None:
        """Rank 0: boundaries ``since..iteration`` reached (see ``ControlChannel.publish``)."""
        if self.rank == 0:
            first = None if since is None else max(since, self.start) - self.start
            self.channel.publish(iteration - self.start, loss, cursor, since=first, steps=steps, grad=grad,
                                 batch=batch)

    def write_checkpoint(self, iteration: int, state: dict[str, Any]) -> None:
        _stage(state, self.dir / f"ckpt-{iteration}.pt")

    def write_result(self, iteration: int, state: dict[str, Any], **info: Any) -> None:
        """Rank 0: the state where this segment stopped, then ``result.json`` (written last)."""
        path = self.dir / f"state-{iteration}.pt"
        _stage(state, path)
        info = {"iteration": iteration, "state_path": str(path), **info}
        tmp = self.dir / ".result.json.tmp"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, self.dir / "result.json")

    def write_error(self, kind: str, message: str, text: str, iteration: int | None) -> None:
        data = {
            "kind": kind,
            "message": message,
            "traceback": text,
            "iteration": iteration,
            "rank": self.rank,
            "time": time.time(),
        }
        (self.dir / f"error-{self.rank}.json").write_text(json.dumps(data))

    def close(self) -> None:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
