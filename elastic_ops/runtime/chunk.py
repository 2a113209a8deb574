"""The chunk runner: train iterations ``[start, end)`` with a changing number of workers.

``run_chunk`` restores the latest committed checkpoint, then runs *segments*: one launch of
``N`` worker processes that train until the chunk's end or until the target for an iteration
boundary differs from ``N``, or (given ``slots``) names the same count on other slots: the pool
moved the job, e.g. off a draining host. Between segments the full training state moves through
a staging file (``torch.save``, loaded with ``weights_only=True``) and the runner relaunches with
the new count on the new slots; target ``0`` commits a checkpoint and returns ``PREEMPTED``.

A background *controller* thread follows rank 0 through the shared control channel
(:mod:`elastic_ops.runtime.control`): it asks ``target(i)`` for boundaries up to
a short time ahead of rank 0 (so the poll never stalls training), commits the
checkpoints rank 0 leaves at ``checkpoint_interval`` boundaries (in the background, in order)
and reports progress.

Given ``spans`` (a node agent's runner), a segment may span hosts: the target's count is
placed on this host's granted slots first (rank 0 always runs here, with the control channel)
and then on the other hosts' slots in the order the pool listed them; the launcher starts those
hosts' ranks through their node agents, and the workers form one process group
(:mod:`elastic_ops.runtime.segment`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import operator
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_ops.errors import (
    AgentLostError,
    CheckpointNotFoundError,
    NonFiniteLossError,
    SpecError,
    StaleEpochError,
    TrainingError,
    UserCodeError,
    WorkerLostError,
    short_repr,
)
from elastic_ops.runtime.control import ControlChannel, count_of, moved
from elastic_ops.runtime.launcher import (
    Launcher,
    LaunchRequest,
    LocalLauncher,
    RemotePart,
    loopback_store,
    start_on,
)
from elastic_ops.runtime.outcome import ChunkResult, ChunkStatus, Progress
from elastic_ops.runtime.segment import (
    PG_TIMEOUT_DEFAULT_S,
    PG_TIMEOUT_ENV,
    STALL_ENV,
    pg_timeout,
    stall_timeout,
)
from elastic_ops.runtime.state import load_state, param_sha256, save_atomic
from elastic_ops.spec import JobSpec

if TYPE_CHECKING:
    from elastic_ops.checkpoint.store import CheckpointRef, CheckpointStore

log = logging.getLogger("elastic_ops.runtime")

WORKDIR_PREFIX = "elastic-ops-"  # a chunk's own work directory in the temp folder
OWNER_FILE = "owner.pid"  # in it: the pid of the process running the chunk (stale-directory sweep)
LOOKAHEAD = 2  # boundaries decided ahead of rank 0, at least
POLL_S = 0.01  # the controller's poll interval: few wake-ups, whatever the iteration rate
HORIZON_S = 0.05  # ...and it decides the boundaries expected within this time (>= LOOKAHEAD)


@dataclasses.dataclass
class _Segment:
    """What one launch left behind (read from rank 0's ``result.json``)."""

    iteration: int
    next_workers: int
    state_path: str
    loss: float
    evaluation: dict[str, float]
    train_seconds: float
    samples: int


Spans = tuple[tuple[str, tuple[int, ...]], ...]  # other hosts' granted slots: ((host, slots), ...)
Placement = tuple[tuple[int, ...], Spans]  # this host's slots, then the other hosts'


def place(workers: int, slots: Sequence[int], spans: Spans) -> tuple[int, tuple[RemotePart, ...]]:
    """Where ``workers`` ranks run: ``(ranks on this host, the other hosts' parts)``. This host's
    slots come first (rank 0 is here), then each other host's, in order; ranks left over when
    the slots run out stay on this host (on CPU the slots are bookkeeping; on CUDA the launcher
    then refuses, naming the slots), and so does rank 0 when this host has no slot (the control
    channel is here)."""
    here = max(min(workers, len(slots)), min(workers, 1)) if spans else workers
    parts, offset = [], here
    for host, theirs in spans:
        n = min(workers - offset, len(theirs))
        if n <= 0:
            break
        parts.append(RemotePart(host=host, rank_offset=offset, count=n, slots=tuple(theirs[:n])))
        offset += n
    return here + (workers - offset), tuple(parts)


def used(workers: int, placement: Placement, host: str) -> set[tuple[str, int]]:
    """The ``(host, slot)`` pairs ``workers`` ranks use under ``placement``."""
    slots, spans = placement
    here, parts = place(workers, slots, spans)
    return {(host, s) for s in slots[:here]} | {(p.host, s) for p in parts for s in p.slots}


class _SlotsByBoundary:
    """The granted GPU slots (a :data:`Placement`) that came with the target of each decided
    boundary.

    ``slots()`` is read right after every ``target(i)``, from the same thread, so a segment
    launched at boundary ``i`` gets the slots of the very pool target that decided its worker
    count; reading them at launch instead could see a later target (boundaries are decided
    ahead of rank 0). Only changes are kept: one entry per slot change, not per boundary.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[int, Placement]] = []  # (first boundary, placement), ascending

    def note(self, iteration: int, slots: Placement) -> None:
        # A boundary decided again (a new segment re-decides the ones after its start)
        # supersedes what was noted for it and every later one.
        entries = [e for e in self._entries if e[0] < iteration]
        if not entries or entries[-1][1] != slots:
            entries.append((iteration, slots))
        self._entries = entries

    def at(self, iteration: int) -> Placement | None:
        """The slots in force at ``iteration`` (``None`` if nothing was noted up to it)."""
        k = max((k for k, e in enumerate(self._entries) if e[0] <= iteration), default=None)
        if k is None:
            return None
        del self._entries[:k]  # segments launch in ascending order: older entries are done
        return self._entries[0][1]


class _Committer:
    """Commits staged states to the store, in order, off the training path.

    When the store is slower than the checkpoint interval, a staged state that a newer one has
    overtaken in the queue is dropped instead of committed (its file removed): the queue, and
    the staged files on disk, stay bounded, and the newest state still goes first to the
    store. States retention keeps for good (``keep_every``) are always committed.
    """

    def __init__(self, store: Any, epoch: int, spec_hash: str, keep_every: int | None = None) -> None:
        self.store, self.epoch, self.spec_hash, self.keep_every = store, epoch, spec_hash, keep_every
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="elastic-ops-commit")
        self.futures: list[Future] = []
        self.last_ref: Any = None
        self.newest = -1  # the newest iteration submitted
        self.dropped: list[int] = []

    def submit(self, iteration: int, path: str, metrics: dict[str, Any], *, remove: bool) -> Future:
        self.newest = max(self.newest, iteration)
        fut = self.pool.submit(self._commit, iteration, path, metrics, remove)
        self.futures.append(fut)
        return fut

    def _overtaken(self, iteration: int, remove: bool) -> bool:
        """A staged state (``remove``: a file of its own) that a newer submission supersedes."""
        kept = self.keep_every is not None and iteration % self.keep_every == 0
        return remove and not kept and iteration < self.newest

    def _commit(self, iteration: int, path: str, metrics: dict[str, Any], remove: bool) -> Any:
        if self._overtaken(iteration, remove):
            Path(path).unlink(missing_ok=True)
            if not self.dropped:
                log.warning(
                    "the checkpoint store is slower than checkpoint_interval: the state staged at "
                    "iteration %d is dropped for the newer one at %d (only the newest waiting state "
                    "is committed)", iteration, self.newest,
                )
            self.dropped.append(iteration)
            return None
        # the staged file is committed as it is (save_atomic wrote the bytes the store would);
        # mapped, not read, to hash the model's parameters
        model = load_state(path, mmap=True)["model"]
        metrics = {**metrics, "param_sha256": param_sha256(model)}
        del model  # the mapping goes with it
        ref = self.store.save_file(
            iteration, path, epoch=self.epoch, spec_hash=self.spec_hash, metrics=metrics
        )
        self.last_ref = ref
        if remove:
            Path(path).unlink(missing_ok=True)
        log.info("committed checkpoint at iteration %d: %s", iteration, ref.uri)
        return ref

    def check(self) -> None:
        """Raise the first commit failure (e.g. a stale fencing epoch) now."""
        for fut in self.futures:
            if fut.done() and fut.exception() is not None:
                raise fut.exception()

    def drain(self) -> None:
        for fut in self.futures:
            fut.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class _Runner:
    def __init__(
        self,
        spec: JobSpec,
        start: int,
        end: int,
        target: Callable[[int], int],
        store: Any,
        epoch: int,
        on_progress: Callable[[Progress], None] | None,
        host: str,
        launcher: Any,
        workdir: Path,
        slots: Callable[[], Sequence[int]] | None = None,
        on_segment: Callable[..., None] | None = None,
        spans: Callable[[], Sequence[tuple[str, Sequence[int]]]] | None = None,
    ) -> None:
        self.spec, self.start, self.end = spec, start, end
        self.on_segment = on_segment
        self.slots_fn, self.spans_fn = slots, spans
        self.slots = _SlotsByBoundary()
        self._noted: Placement = ((), ())  # the slots that came with the last target()
        self._stay_warned: Placement | None = None
        self.device = _device(spec)
        self.target_fn, self.store, self.epoch = target, store, epoch
        self.on_progress, self.host, self.launcher, self.workdir = on_progress, host, launcher, workdir
        self.committer = _Committer(store, epoch, spec.spec_hash(), spec.keep_every)
        self.timeline: list[tuple[int, int, float]] = []
        self._last_log = 0.0
        self._t0 = time.time()
        # a lone worker has no collective to time out: the longest it may take between two boundaries
        self.stall_s = stall_timeout()

    def target(self, iteration: int) -> int:
        """The wanted worker count, clamped to the spec's bounds (0 = preempt); notes the
        granted slots that came with it."""
        n = _worker_count(self.target_fn(iteration), iteration)
        if self.slots_fn is not None:
            spans = self.spans_fn() if self.spans_fn is not None else ()
            self._noted = (
                tuple(int(s) for s in self.slots_fn()),
                tuple((str(h), tuple(int(s) for s in ss)) for h, ss in spans),
            )
            self.slots.note(iteration, self._noted)
        if n <= 0:
            return 0
        return max(self.spec.min_workers, min(self.spec.max_workers, n))

    def decide(self, iteration: int, workers: int, slots: Placement | None) -> int:
        """What the control channel gets for boundary ``iteration`` of a segment running
        ``workers`` on ``slots``: the target's count, or :func:`moved` of it when the pool wants
        the same count on other slots (the workers end the segment there and are relaunched)."""
        n = self.target(iteration)
        if n != workers or slots is None or not self._moves(n, slots, self._noted):
            return n
        return moved(n)

    def _moves(self, n: int, old: Placement, new: Placement) -> bool:
        # Only the slots the ranks use count, as a set: a reordered grant is not worth a relaunch.
        if new == old or used(n, new, self.host) == used(n, old, self.host):
            return False
        if self.device == "cuda" and len(new[0]) + sum(len(ss) for _, ss in new[1]) < n:
            # The pool placed (some of) the job on another host, where the local launcher cannot
            # start workers. Stay on the GPUs in use: the lease keeps reporting them, so the pool
            # keeps them this job's (no other job is handed a busy GPU) until the chunk ends.
            if self._stay_warned != new:
                self._stay_warned = new
                log.warning(
                    "the pool moved %d worker(s) to slots %s, %d of them on this host: the workers "
                    "stay on slots %s until the chunk ends (this launcher cannot start workers on "
                    "the other hosts)",
                    n,
                    list(new[0]),
                    len(new[0]),
                    list(old[0][:n]),
                )
            return False
        return True

    # --- one segment ------------------------------------------------------------------------

    def _span_address(self, workers: int, here: int, remote: tuple[RemotePart, ...]) -> str | None:
        """Where the other hosts' ranks reach this host's, for a segment spanning hosts (None for
        one on this host alone); refused before anything is announced or launched when this
        launcher has none (the per-host agent, a plain local run)."""
        if not remote:
            return None
        address = getattr(self.launcher, "address", None)
        if not address:
            raise SpecError(
                "workers", workers, f"at most the {here} worker(s) this host has slots for",
                hint="this launcher has no address the other hosts can reach "
                "(elastic-ops node --advertise-addr)",
            )
        return address

    def run_segment(
        self,
        index: int,
        it: int,
        workers: int,
        state_path: str | None,
        placement: Placement | None,
        layout: tuple[int, tuple[RemotePart, ...]],
    ) -> _Segment:
        """One launch of ``workers`` at boundary ``it``: ``layout`` is :func:`place` of them under
        ``placement`` (ranks here, the other hosts' parts)."""
        segdir = self.workdir / f"seg-{index}"
        segdir.mkdir(parents=True)
        length = self.end - it + 1
        chan = ControlChannel(segdir, length, create=True)
        chan.decide(0, workers)
        for j in range(1, LOOKAHEAD + 1):
            if not chan.decided(j):
                chan.decide(j, self.decide(it + j, workers, placement))
        launch_slots = placement[0] if placement is not None else None
        here, remote = layout
        # across hosts the store listens where the other hosts reach this one (the node's address)
        address = self._span_address(workers, here, remote)
        store = loopback_store(address or "127.0.0.1")
        cfg = {
            "spec": self.spec.to_dict(),
            "start": it,
            "end": self.end,
            "workers": workers,
            "segment": index,
            "dir": str(segdir),
            "state_path": state_path,
            "span": bool(remote),
            "leader": True,
        }
        (segdir / "segment.json").write_text(json.dumps(cfg))
        req = LaunchRequest(
            workers=here,
            script=_script(self.spec),
            master_addr=address or "127.0.0.1",
            master_port=store.port,
            segment=index,
            log_dir=segdir / "logs",
            env={"ELASTIC_OPS_SEGMENT": str(segdir / "segment.json")},
            device=self.device,
            threads_per_worker=self.spec.threads_per_worker,
            slots=launch_slots,
            world_size=workers,
            remote=remote,
        )
        stop = threading.Event()
        errors: list[BaseException] = []
        ctl = threading.Thread(
            target=self._control,
            args=(chan, it, workers, placement, stop, errors, segdir),
            name="elastic-ops-control",
            daemon=True,
        )
        pc = start_on(self.launcher, req, self.host)
        ctl.start()
        try:
            result = None
            while result is None:
                result = pc.wait(timeout=0.5, period=0.05)
                self.committer.check()
                if errors:
                    raise errors[0]
        except BaseException:
            pc.close()
            raise
        finally:
            stop.set()
            ctl.join()
            del store
        if errors:
            raise errors[0]
        if result.failures:
            raise self._failure(segdir, result.failures, _killed_ranks(pc), pc)
        if not (segdir / "result.json").exists():
            raise TrainingError(
                f"the workers exited without handing over their state (iterations {it}..{self.end})",
                hint="a script must run `for it in ctx.iterations(): ... ctx.commit(it, loss)` to the end",
            )
        info = json.loads((segdir / "result.json").read_text())
        return _Segment(
            iteration=info["iteration"],
            next_workers=count_of(info["next_workers"]),
            state_path=info["state_path"],
            loss=info["loss"],
            evaluation=info["evaluation"],
            train_seconds=info["train_seconds"],
            samples=info["samples"],
        )

    def _control(
        self,
        chan: ControlChannel,
        start: int,
        workers: int,
        slots: Placement | None,
        stop: threading.Event,
        errors: list[BaseException],
        segdir: Path,
    ) -> None:
        seen, ahead = 0, LOOKAHEAD
        row0 = None
        rate_from: tuple[int, float] | None = None  # (boundary, time) rank 0's rate is measured from
        last, moved_at = -1, time.monotonic()  # the last boundary rank 0 reached, and when
        try:
            while True:
                finished = stop.is_set()  # read before the last sweep, so no row is missed
                reached = chan.reached()
                now = time.monotonic()
                if reached != last:
                    last, moved_at = reached, now
                elif not finished and workers == 1 and reached >= 0 and now - moved_at > self.stall_s:
                    self._stalled(chan, start, reached, workers)
                for j in range(seen + 1, reached + 1):
                    if row0 is None:
                        row0 = chan.row(0)
                    self._boundary(chan, start, j, workers, row0, segdir)
                if reached > seen and row0 is not None:
                    ahead, rate_from = lookahead(chan, reached, rate_from or (0, row0[1]))
                seen = max(seen, reached)
                base = max(reached, 0)
                for j in range(base + 1, min(base + ahead, chan.length - 2) + 1):
                    if chan.decided(j):
                        continue
                    chan.decide(j, self.decide(start + j, workers, slots))
                if finished:
                    return
                time.sleep(POLL_S)
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    def _stalled(self, chan: ControlChannel, start: int, j: int, workers: int) -> None:
        """Raise for a lone worker that trains on past boundary ``j`` and has not reached the next
        one within ``stall_s``: hung (user code, a stopped process). Not after the last boundary
        or one where it leaves (it evaluates, stages its state and exits: the wait ends that)."""
        if j >= chan.length - 1 or chan.value(j) != workers:  # a moved or other count: it leaves
            return
        raise WorkerLostError(
            f"worker lost on {self.host}: rank 0 reached no iteration boundary for {self.stall_s:.0f} s "
            f"after iteration {start + j} (hung in user code, or its process stopped); it was stopped",
            host=self.host,
            hint=f"{STALL_ENV} sets how long a lone worker may take between two boundaries (a group's "
            f"collectives wait {PG_TIMEOUT_ENV}); the retry resumes from the last committed checkpoint",
        )

    def _boundary(
        self,
        chan: ControlChannel,
        start: int,
        j: int,
        workers: int,
        row0: tuple[float, float, int],
        segdir: Path,
    ) -> None:
        it = start + j
        loss, t, cursor = chan.row(j)
        ckpt = segdir / f"ckpt-{it}.pt"
        if ckpt.exists():
            self.committer.submit(it, str(ckpt), {"loss": loss}, remove=True)
        elapsed = max(t - row0[1], 1e-9)
        rate = (cursor - row0[2]) / elapsed
        its = j / elapsed
        eta = (self.end - it) / its if its > 0 else math.inf
        prog = Progress(
            iteration=it, end=self.end, loss=loss, workers=workers, samples_per_sec=rate, eta_s=eta
        )
        if self.on_progress is not None:
            self.on_progress(prog)
        now = time.monotonic()
        if now - self._last_log >= 2.0 or it == self.end:
            self._last_log = now
            log.info(
                "iteration %d/%d loss %.5f workers %d %.0f samples/s ETA %.0fs",
                it,
                self.end,
                loss,
                workers,
                rate,
                eta,
            )

    def _failure(
        self, segdir: Path, failures: dict[int, Any], killed: dict[int, str], pc: Any = None
    ) -> Exception:
        reports = []
        for path in sorted(segdir.glob("error-*.json")):
            try:
                reports.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        # a segment spanning hosts: what the other hosts' ranks reported, and who killed them
        reports += list(getattr(pc, "remote_reports", lambda: [])())
        remote_killed: dict[int, tuple[str, str]] = dict(getattr(pc, "remote_killed", lambda: {})())
        lost = getattr(pc, "lost_host", lambda: None)()
        stopped = getattr(pc, "stopped_host", lambda: None)()
        signals = {rank: f.signal_name() for rank, f in failures.items() if f.exitcode < 0}
        signals = dict(sorted({**killed, **signals}.items()))
        # A user's error wins over a dead rank or a silent host: those often follow from it (our
        # teardown SIGKILLs a rank that ignored its SIGTERM; a spanning host busy past the grace
        # period counts as lost). A collective failing inside user code because a peer died is
        # reported as "comm", not "user", by the worker (worker._gloo_transport_error).
        for kind, cls in (("user", UserCodeError), ("nonfinite", NonFiniteLossError)):
            found = [r for r in reports if r["kind"] == kind]
            if found:
                r = min(found, key=lambda r: r["time"])
                when = "before training" if r["iteration"] is None else f"at iteration {r['iteration']}"
                msg = f"rank {r['rank']} {when}: {r['message']}"
                if r["traceback"]:
                    msg += "\n" + r["traceback"]
                return cls(msg)
        for kind, what, fix in _HOST_FAULTS:  # the host's, reported by the rank that met it
            found = [r for r in reports if r["kind"] == kind]
            if found:
                r = min(found, key=lambda r: r["time"])
                host = r.get("host") or self.host
                return WorkerLostError(
                    f"worker lost on {host}: rank {r['rank']} {what}: {r['message']}",
                    host=host,
                    hint=f"{fix}; the retry's grant avoids this host and resumes from the last committed "
                    "checkpoint",
                )
        internal = [r for r in reports if r["kind"] == "internal"]
        if not signals and not remote_killed and stopped:
            return AgentLostError(  # an upgrade or restart, not the host failing: not held against it
                f"the elastic-ops node agent of host {stopped} stopped mid-segment",
                hint="retry resumes from the last committed checkpoint",
            )
        if not signals and (remote_killed or lost):
            # this host's ranks only lost their peers: the host whose ranks died is the one to blame
            host, what = lost, f"the node agent of host {lost} went away"
            if remote_killed:
                host = next(iter(remote_killed.values()))[0]
                what = ", ".join(f"rank {r} killed by {s}" for r, (_, s) in sorted(remote_killed.items()))
            return WorkerLostError(
                f"worker lost on {host}: {what}", host=host,
                hint="retry resumes from the last committed checkpoint",
            )
        if internal and not signals:
            r = internal[0]
            return TrainingError(f"runtime error on rank {r['rank']}: {r['message']}\n{r['traceback']}")
        what = ", ".join(f"rank {r} killed by {s}" for r, s in signals.items()) or ", ".join(
            f"rank {r} exited with {f.exitcode}" for r, f in failures.items()
        )
        hint = "retry resumes from the last committed checkpoint"
        comm = sorted((r for r in reports if r["kind"] == "comm"), key=lambda r: r["time"])
        timed_out = bool(comm) and _TIMED_OUT.search(comm[0]["message"]) is not None
        if comm and (not signals or timed_out):
            # no rank died (a peer stopped answering: hung, stopped, or slower than the process
            # group's timeout), or one that hung was then killed by the teardown (SIGKILL after
            # ignoring SIGTERM, e.g. a stopped process): say what the collective reported
            what += f" (rank {comm[0]['rank']}'s collective failed: {comm[0]['message']})"
            hint = (f"a rank that stops answering for {PG_TIMEOUT_ENV} seconds (default "
                    f"{PG_TIMEOUT_DEFAULT_S}) fails its peers' collectives, and one that does not "
                    f"exit on SIGTERM is killed with SIGKILL 30 s later; {hint}")
        return WorkerLostError(f"worker lost on {self.host}: {what}", host=self.host, hint=hint)

    # --- the whole chunk -----------------------------------------------------------------------

    def commit_now(self, iteration: int, path: str, metrics: dict[str, Any]) -> Any:
        self.committer.drain()
        return self.committer.submit(iteration, path, metrics, remove=False).result()

    def run(self, it: int, state_path: str | None, first_workers: int) -> ChunkResult:
        workers, segments, index = first_workers, [], 0
        last: _Segment | None = None
        while True:
            if workers == 0:
                return self._preempted(it, last)
            placement = self.slots.at(it) if self.slots_fn is not None else None
            self.timeline.append((it, workers, time.time()))
            here, parts = place(workers, *placement) if placement is not None else (workers, ())
            slots = placement[0][:here] if placement is not None else None
            self._span_address(workers, here, parts)  # a refusal is not announced as applied first
            if self.on_segment is not None:
                if self.spans_fn is None:
                    self.on_segment(it, workers, slots)
                else:
                    self.on_segment(it, workers, slots, tuple((p.host, p.slots) for p in parts))
            log.info(
                "segment %d: iterations %d..%d with %d worker(s) on %s%s%s",
                index,
                it,
                self.end,
                workers,
                self.device if self.spec.device.value != "auto" else f"{self.device} (device auto)",
                "" if slots is None else f", slots {list(slots)}",
                "".join(f", {p.count} on {p.host} slots {list(p.slots)}" for p in parts),
            )
            last = self.run_segment(index, it, workers, state_path, placement, (here, parts))
            segments.append(last)
            index += 1
            it, state_path, workers = last.iteration, last.state_path, last.next_workers
            if it >= self.end:
                break
            if it % int(self.spec.checkpoint_interval) == 0 and workers != 0:
                self.committer.submit(it, state_path, {"loss": last.loss}, remove=False)
        metrics = {"loss": last.loss, **last.evaluation}
        ref = self.commit_now(it, state_path, metrics)
        return self._result(ChunkStatus.COMPLETED, it, ref, last, segments)

    def _preempted(self, it: int, last: _Segment | None) -> ChunkResult:
        ref = None
        if last is not None:
            ref = self.commit_now(it, last.state_path, {"loss": last.loss})
        else:
            self.committer.drain()
            ref = self.store.latest(spec_hash=self.spec.spec_hash(), decode=False)
        log.info("preempted at iteration %d", it)
        return self._result(ChunkStatus.PREEMPTED, it, ref, last, [])

    def _result(
        self, status: ChunkStatus, it: int, ref: Any, last: _Segment | None, segments: list[_Segment]
    ) -> ChunkResult:
        duration = time.time() - self._t0
        samples = sum(s.samples for s in segments)
        train_s = sum(s.train_seconds for s in segments)
        metrics = dict(ref.metrics) if ref is not None else {}
        return ChunkResult(
            status=status,
            start=self.start,
            end=self.end,
            iteration=it,
            checkpoint_uri=ref.uri if ref is not None else None,
            loss=last.loss if last is not None else metrics.get("loss"),
            metrics=dict(last.evaluation) if last is not None else {},
            workers_timeline=list(self.timeline),
            samples_per_sec=samples / duration if duration else 0.0,
            duration_s=duration,
            param_sha256=metrics.get("param_sha256"),
            train_samples_per_sec=samples / train_s if train_s else 0.0,
        )


_TIMED_OUT = re.compile(r"timed out|timing out|timeout", re.IGNORECASE)  # gloo's and NCCL's words


def _worker_count(value: Any, iteration: int) -> int:
    """``target(iteration)``'s answer as a worker count: an integer (numpy's too) >= 0. Anything
    else used to be taken through ``int()``: a float truncated, a string parsed, a negative count
    taken for a preemption, and ``None`` or NaN a bare ``TypeError``/``ValueError`` naming neither
    the target nor the boundary."""
    if not isinstance(value, bool):
        try:
            n = operator.index(value)
        except TypeError:
            n = None
        if n is not None and n >= 0:
            return n
    raise SpecError(
        "target", value,
        f"target({iteration}) must return a worker count: an integer >= 0 (0 preempts the job; "
        "counts outside [min_workers, max_workers] are clamped)",
    )


def _script(spec: JobSpec) -> str | None:
    return str(Path(spec.entrypoint).resolve()) if spec.is_script() else None


def _device(spec: JobSpec) -> str:
    """The device the chunk's workers train on: ``auto`` is resolved here, once per chunk, by the
    process running the chunk (the task, the host's agent, or the leading node agent), and every
    rank of every segment gets the result, those a spanning segment runs on other hosts too
    (``ranks`` requests carry ``cpu`` or ``cuda``). A retry or the next chunk may resolve it
    differently on another host; the checkpoint resumes either way (CPU tensors), the spec hash
    leaves the device out, and the segment's log line says which it was."""
    if spec.device.value == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return spec.device.value


# A worker's report kinds that are its host's fault: (kind, what the rank could not do, the fix)
_HOST_FAULTS = (
    ("storage", "could not write to its local disk",
     "free space where the host stages states (the chunk's work directory)"),
    ("device", "cannot use its GPU",
     "check the host's GPUs (nvidia-smi: a failed GPU, one busy in exclusive-process mode or held by a "
     "stray process, a driver older than torch's CUDA)"),
)


def lookahead(chan: ControlChannel, reached: int, since: tuple[int, float]) -> tuple[int, tuple[int, float]]:
    """How many boundaries past ``reached`` to decide now: as far as rank 0 gets in
    ``HORIZON_S`` (at least ``LOOKAHEAD``) at its rate since boundary ``since`` (the last poll's),
    and the point to measure the next rate from. Not its mean since the segment began: the first
    iterations (CUDA's warm-up, cold caches) are no guide to the rest: with a first iteration of
    0.5 s and 0.8 ms after it, that mean kept rank 0 waiting for decisions 48 times in 600
    iterations (0.24 s; 2 waits, 0.01 s, at the recent rate)."""
    j0, t0 = since
    now = chan.row(reached)[1]
    per_it = max(now - t0, 1e-6) / max(reached - j0, 1)
    return max(LOOKAHEAD, math.ceil(HORIZON_S / per_it)), (reached, now)


def _check_range(spec: JobSpec, start: int, end: int) -> None:
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < spec.total_iterations:
        raise SpecError("start", start, f"must be an integer in [0, {spec.total_iterations})")
    if isinstance(end, bool) or not isinstance(end, int) or not start < end <= spec.total_iterations:
        raise SpecError("end", end, f"must be an integer in ({start}, {spec.total_iterations}]")


def _check_entrypoint(spec: JobSpec, import_it: bool = True) -> None:
    """Fail before any worker starts on an entrypoint that cannot load. ``import_it=False``
    (a long-lived agent): only find the Trainable's module, running none of its code here."""
    if spec.is_script():  # its consistency, scaling and micro_batch: JobSpec checks them
        if not Path(spec.entrypoint).is_file():
            from elastic_ops.errors import EntrypointError

            raise EntrypointError("entrypoint", spec.entrypoint, "script file does not exist")
        return
    from elastic_ops.runtime.trainable import find_trainable_module, load_trainable_class

    if import_it:
        load_trainable_class(spec.entrypoint)
    else:
        find_trainable_module(spec.entrypoint)



def _check_one_job(store: CheckpointStore, spec: JobSpec, ref: CheckpointRef | None) -> None:
    """Refuse to train at a location holding newer checkpoints of another job definition (a
    spec changed, its checkpoint location kept): its commits would meet theirs at the first
    iteration both reach, as a conflict blaming another writer. Then record this spec's fields,
    so a later change is told what changed."""
    mine, newest = spec.spec_hash(), -1 if ref is None else ref.iteration
    others = [r for r in store.newer_than(newest) if r.spec_hash != mine]
    if others:
        other = others[-1]
        old = store.recorded_spec(other.spec_hash)
        changed = ("not recorded (written before this version)" if old is None
                   else _changed_fields(old, spec.trajectory()))
        raise SpecError(
            "checkpoint", store.uri,
            f"a location holding checkpoints of this job definition only: it holds checkpoints of "
            f"another (spec hash {other.spec_hash}, up to iteration {other.iteration}; this spec's "
            f"is {mine}; changed: {changed})",
            hint="give the changed job a new checkpoint location (the spec's `checkpoint`, or "
            f"--checkpoint), and warm_start={store.uri} to start from the old job's weights",
        )
    store.record_spec(mine, spec.trajectory())


def _changed_fields(old: dict[str, Any], new: dict[str, Any]) -> str:
    """``params.lr 0.1 -> 0.05, total_iterations 200 -> 400``: what differs, nested dicts by key."""
    out: list[str] = []
    missing = "(unset)"

    def walk(prefix: str, a: Any, b: Any) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                walk(f"{prefix}.{k}" if prefix else str(k), a.get(k, missing), b.get(k, missing))
        elif a != b:
            shown = [x if x is missing else short_repr(x, 40) for x in (a, b)]
            out.append(f"{prefix} {shown[0]} -> {shown[1]}")

    walk("", old, new)
    return ", ".join(out) or "nothing the hash covers (the old definition hashed differently)"

def run_chunk(
    spec: JobSpec,
    start: int,
    end: int,
    *,
    target: Callable[[int], int],
    store: Any = None,
    epoch: int = 0,
    on_progress: Callable[[Progress], None] | None = None,
    host: str = "localhost",
    warm_start: str | None = None,
    launcher: Launcher | None = None,
    workdir: str | Path | None = None,
    warm_start_store: Any = None,
    slots: Callable[[], Sequence[int]] | None = None,
    on_segment: Callable[..., None] | None = None,
    spans: Callable[[], Sequence[tuple[str, Sequence[int]]]] | None = None,
    import_entrypoint: bool = True,
) -> ChunkResult:
    """Train iterations ``[start, end)`` from the latest committed checkpoint; see the module doc.

    ``target(i)`` is called for every boundary ``i`` of the chunk, from a background thread, up
    to ~``HORIZON_S`` (at least ``LOOKAHEAD`` iterations) before ``i`` runs; it must be cheap
    (cache a pool heartbeat).
    ``workdir`` holds the staging files (a temporary directory by default, removed afterwards).
    ``import_entrypoint=False``: the Trainable's module is only found here, not imported (a
    long-lived process such as the agent runs no user code; the workers import it).
    ``warm_start_store`` is the already-open store at ``warm_start`` (e.g. built with the caller's
    S3 client and endpoint); without it ``open_store(warm_start)`` and boto3's default chain apply.
    ``slots()``: the GPU slots the pool granted on this host with the target ``target`` just
    returned (called right after each ``target(i)``, from the same thread); on CUDA, rank r of
    a segment launched at boundary ``i`` runs on the r-th slot noted with ``target(i)`` (see
    :func:`elastic_ops.runtime.launcher.slot_gpus`). ``None``: ranks take the visible GPUs in order.
    When the slots noted with a boundary's target differ from the running segment's (as a set,
    the ranks' ones) at the same count, the segment ends there and the same count is relaunched
    on the new slots, on CPU too (there the slots are the pool's bookkeeping; the move costs one
    relaunch). On CUDA, a move that leaves fewer slots on this host than workers (the pool placed
    the job on another host, which the local launcher cannot reach) is not followed: the workers
    stay on their GPUs, with a warning, until the chunk ends.
    ``on_segment(i, n, slots)`` is called when ``n`` workers are about to start at boundary ``i``
    on ``slots`` (those noted with ``target(i)``; ``None`` without ``slots``), after the previous
    segment's workers have exited: the moment a shrink or a move has really given its old slots
    up, so the caller reports it to the pool then (not when ``target`` announced it).
    ``spans()`` (with ``slots``; called right after it): the slots the same target grants on
    other hosts, ``[(host, slots), ...]``. A count beyond this host's slots then spans hosts
    (:func:`place`): the launcher, which must have an ``address`` the other hosts can reach,
    starts their ranks (``LaunchRequest.remote``), and ``on_segment`` gets a fourth argument,
    the other hosts' slots in use, ``((host, slots), ...)``.
    """
    _check_range(spec, start, end)
    _check_entrypoint(spec, import_entrypoint)
    pg_timeout()  # read by every worker: a bad value is refused here, once
    stall_timeout()
    if store is None:
        from elastic_ops.checkpoint import open_store

        store = open_store(spec.checkpoint_uri(), keep_last=spec.keep_last, keep_every=spec.keep_every)
    t0 = time.time()
    own_dir = workdir is None
    if own_dir:
        sweep_stale_workdirs()
    work = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX)) if own_dir else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    if own_dir:
        (work / OWNER_FILE).write_text(_owner())
    try:
        if epoch > 0:
            # fence before reading: from here on no writer of an older lease (an earlier try
            # that is not quite dead) can commit, so the checkpoint read next stays the newest
            # anyone may build on; a newer fence means this lease is already superseded
            fenced = store.fence(epoch)
            if fenced > epoch:
                raise StaleEpochError(epoch, fenced, hint="a newer lease of this job holds the store")
        # the workers get the restored state as the committed file itself (a local store links
        # it), verified; it is not decoded and encoded again on the way
        restore = work / "restore.pt"
        ref = store.latest(spec_hash=spec.spec_hash(), into=restore)
        if ref is not None and ref.iteration >= end:
            log.info("chunk [%d, %d) already done: checkpoint at iteration %d", start, end, ref.iteration)
            m = dict(ref.metrics)
            return ChunkResult(
                status=ChunkStatus.ALREADY_DONE,
                start=start,
                end=end,
                iteration=ref.iteration,
                checkpoint_uri=ref.uri,
                loss=m.get("loss"),
                metrics={k: v for k, v in m.items() if k not in ("loss", "param_sha256")},
                workers_timeline=[],
                samples_per_sec=0.0,
                duration_s=time.time() - t0,
                param_sha256=m.get("param_sha256"),
            )
        _check_one_job(store, spec, ref)
        if ref is None and start > 0:
            raise CheckpointNotFoundError(
                f"no committed checkpoint for spec hash {spec.spec_hash()} in {store.uri} "
                f"to resume iteration {start} from",
                hint="run the earlier chunks first, or start at 0",
            )
        launcher = launcher or LocalLauncher()
        runner = _Runner(
            spec, start, end, target, store, epoch, on_progress, host, launcher, work, slots, on_segment,
            spans,
        )
        it, state_path = 0, None
        if ref is not None:
            it, state_path = ref.iteration, str(restore)
            log.info("resuming from checkpoint at iteration %d (%s)", it, ref.uri)
        elif warm_start or warm_start_store is not None:
            state_path = str(work / "warm-start.pt")
            save_atomic(_warm_state(warm_start, warm_start_store), state_path)
        try:
            return runner.run(it, state_path, runner.target(it))
        finally:
            runner.committer.close()
    finally:
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)


def sweep_stale_workdirs(root: str | None = None) -> list[Path]:
    """Remove the work directories (staged checkpoints, logs) that chunks of processes killed
    outright left behind: those whose owner process, on this host, is gone. A directory
    without an owner file, of another host (a temp folder shared between containers), or whose
    owner lives (or cannot be checked), is left alone."""
    removed = []
    for d in Path(root or tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*"):
        try:
            pid_text, _, host = (d / OWNER_FILE).read_text().partition(" ")
            pid = int(pid_text)
        except (OSError, ValueError):
            continue
        if host != socket.gethostname() or pid == os.getpid() or _alive(pid):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    if removed:
        log.info("removed %d work directories of chunks whose processes are gone", len(removed))
    return removed


def _owner() -> str:
    return f"{os.getpid()} {socket.gethostname()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive as far as we may know
        return True
    return True


def _warm_state(uri: str | None, store: Any = None) -> dict[str, Any]:
    """Model weights of the latest checkpoint at ``uri`` (any job), to initialise a fresh job.

    ``store`` is that checkpoint store already open (with the caller's credentials); else
    ``open_store(uri)``.
    """
    if store is None:
        from elastic_ops.checkpoint import open_store

        store = open_store(uri, create=False)  # only read: a missing folder is not created
    ref = store.latest()
    if ref is None:
        raise CheckpointNotFoundError(f"warm_start {uri!r} holds no committed checkpoint")
    return {"model": store.load(ref)["model"], "warm": True}


def _killed_ranks(pc: Any) -> dict[int, str]:
    """Ranks that a signal other than our own teardown's SIGTERM ended.

    ``start_processes`` reports only the first rank it saw fail, and when one worker is
    SIGKILLed its peers often exit with 1 (their collective broke) before the poll sees the
    kill; the dead worker is the one the error should name.
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
