"""The chunk runner: train iterations ``[start, end)`` with a changing number of workers.

``run_chunk`` restores the latest committed checkpoint, then runs *segments*: one launch of
``N`` worker processes that train until the chunk's end or until the target for an iteration
boundary differs from ``N``, or (an :class:`~elastic_ops.runtime.allocation.Allocation` with
slots) names the same count on other slots: the pool
moved the job, e.g. off a draining host. Between segments the full training state moves through
a staging file (``torch.save``, loaded with ``weights_only=True``) and the runner relaunches with
the new count on the new slots; target ``0`` commits a checkpoint and returns ``PREEMPTED``.

A background *controller* thread follows rank 0 through the shared control channel
(:mod:`elastic_ops.runtime.control`): it asks ``target(i)`` for boundaries up to
a short time ahead of rank 0 (so the poll never stalls training), commits the
checkpoints rank 0 leaves at ``checkpoint_interval`` boundaries (in the background, in order)
and reports progress.

Given ``span_hosts`` (a node agent's runner), a segment may span hosts: the target's count is
placed on this host's granted slots first (rank 0 always runs here, with the control channel)
and then on the other hosts' slots in the order the pool listed them
(:mod:`elastic_ops.runtime.placement`); the launcher starts those hosts' ranks through their
node agents, and the workers form one process group (:mod:`elastic_ops.runtime.segment`).

Around the runner: :mod:`~elastic_ops.runtime.commit` commits staged states in order,
:mod:`~elastic_ops.runtime.verdict` turns a failed segment into the error the chunk ends with,
:mod:`~elastic_ops.runtime.workdir` keeps the chunk's work directory and sweeps stale ones.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import operator
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_ops.errors import (
    CheckpointNotFoundError,
    EntrypointError,
    SpecError,
    StaleEpochError,
    TrainingError,
    WorkerLostError,
    short_repr,
)
from elastic_ops.runtime.allocation import Allocation
from elastic_ops.runtime.commit import Committer
from elastic_ops.runtime.control import ControlChannel, count_of, moved, with_batch
from elastic_ops.runtime.launcher import (
    Launcher,
    LaunchRequest,
    LocalLauncher,
    RemotePart,
    Segment,
    loopback_store,
    start_on,
)
from elastic_ops.runtime.outcome import ChunkResult, ChunkStatus, Progress, loss_steps
from elastic_ops.runtime.placement import Placement, SlotsByBoundary, place, used
from elastic_ops.runtime.rendezvous import new_key
from elastic_ops.runtime.segment import (
    PG_TIMEOUT_ENV,
    STALL_ENV,
    pg_timeout,
    stall_timeout,
)
from elastic_ops.runtime.state import save_atomic
from elastic_ops.runtime.verdict import segment_failure
from elastic_ops.runtime.workdir import OWNER_FILE, WORKDIR_PREFIX, owner, sweep_stale_workdirs
from elastic_ops.spec import JobSpec, Scaling

if TYPE_CHECKING:
    from elastic_ops.checkpoint.store import CheckpointRef, CheckpointStore

log = logging.getLogger("elastic_ops.runtime")

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
    steps: int


class _Runner:
    def __init__(
        self,
        spec: JobSpec,
        start: int,
        end: int,
        target: Callable[[int], int | Allocation],
        store: CheckpointStore,
        epoch: int,
        on_progress: Callable[[Progress], None] | None,
        host: str,
        launcher: Launcher,
        workdir: Path,
        on_segment: Callable[[int, Allocation], None] | None = None,
        span_hosts: bool = False,
        import_path: tuple[str, ...] = (),
    ) -> None:
        self.spec, self.start, self.end = spec, start, end
        self.import_path = import_path
        self.on_segment = on_segment
        self.span_hosts = span_hosts
        self.slots = SlotsByBoundary()
        self._noted: Placement = ((), ())  # the slots that came with the last target()
        self._stay_warned: Placement | None = None
        self.device = _device(spec)
        self.target_fn, self.store, self.epoch = target, store, epoch
        self.on_progress, self.host, self.launcher, self.workdir = on_progress, host, launcher, workdir
        self.committer = Committer(store, epoch, spec.spec_hash(), spec.keep_every)
        self.timeline: list[tuple[int, int, float]] = []
        self._batch = 0  # the batch of the latest target (an adaptive job's; 0: its own)
        self._steps = 0  # optimizer steps of the chunk's finished segments
        # boundaries decided ahead of rank 0, at least: more than an adaptive job's step may cross
        # (its gain is at most its largest batch over its base), so the next is always decided
        most = spec.max_global_batch or spec.global_batch
        self.min_ahead = LOOKAHEAD + math.ceil(most / spec.global_batch)
        self._last_log = 0.0
        self._t0 = time.time()
        # a lone worker has no collective to time out: the longest it may take between two boundaries
        self.stall_s = stall_timeout()
        self.servers: Any = None  # strategy parameter_server: the chunk's ServerGroup

    def target(self, iteration: int) -> int:
        """The wanted worker count, clamped to the spec's bounds (0 = preempt); notes the
        granted slots that came with it."""
        value = self.target_fn(iteration)
        alloc = value if isinstance(value, Allocation) else Allocation(_worker_count(value, iteration))
        n = _worker_count(alloc.workers, iteration)
        if alloc.placements is not None:
            self._noted = (alloc.on(self.host), alloc.elsewhere(self.host) if self.span_hosts else ())
            self.slots.note(iteration, self._noted)
        self._batch = self.spec.step_batch(alloc.batch) if alloc.batch > self.spec.global_batch else 0
        if n <= 0:
            return 0
        return max(self.spec.min_workers, min(self.spec.max_workers, n))

    def decide(self, iteration: int, workers: int, slots: Placement | None) -> int:
        """What the control channel gets for boundary ``iteration`` of a segment running
        ``workers`` on ``slots``: the target's count, or :func:`moved` of it when the pool wants
        the same count on other slots (the workers end the segment there and are relaunched);
        with the batch the target chose (an adaptive job follows it without a relaunch)."""
        n = self.target(iteration)
        if n != workers or slots is None or not self._moves(n, slots, self._noted):
            return with_batch(n, self._batch)
        return with_batch(moved(n), self._batch)

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
        address = self.launcher.address
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
        if self.spec.scaling is Scaling.ADAPTIVE:
            self.target(it)  # the batch of the target at ``it`` (deciding ahead moved it on)
        first_batch = self._batch
        chan.decide(0, with_batch(workers, first_batch))
        for j in range(1, self.min_ahead + 1):
            if not chan.decided(j):
                chan.decide(j, self.decide(it + j, workers, placement))
        launch_slots = placement[0] if placement is not None else None
        here, remote = layout
        # across hosts the store listens where the other hosts reach this one (the node's address)
        address = self._span_address(workers, here, remote)
        store = loopback_store(address or "127.0.0.1")
        key = new_key()  # every rank's, this host's and (loopback tests) the others'
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
            "batch": first_batch,
            "chunk": [self.start, self.end],  # for the workers' process titles
        }
        if self.import_path:
            cfg["import_path"] = list(self.import_path)
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
            rendezvous_key=key,
        )
        if self.servers is not None:  # the servers join the segment's group beside its workers
            self.servers.join({
                "index": index, "addr": address or "127.0.0.1", "port": store.port, "key": key,
                "workers": workers, "world": workers + int(self.spec.servers), "start": it,
                "timeout_s": pg_timeout().total_seconds(),
            })
        stop = threading.Event()
        errors: list[BaseException] = []
        ctl = threading.Thread(
            target=self._control,
            args=(chan, it, workers, placement, stop, errors, segdir),
            name="elastic-ops-control",
            daemon=True,
        )
        pc: Segment | None = None
        try:
            # the launch inside the try: a SIGTERM as the controller starts (Thread.start waits,
            # and a signal's handler runs there) must stop the workers, not leave them running
            pc = start_on(self.launcher, req, self.host)
            # the pids, so `ps`/`kill` find this segment's workers (their titles name job and rank)
            pids = " ".join(f"rank{r}={p}" for r, p in sorted(pc.pids().items()))
            log.info("job %s: segment %d, %d worker(s) from iteration %d on %s, pids %s", self.spec.name,
                     index, here, it, self.host, pids)
            ctl.start()
            result = None
            while result is None:
                result = pc.wait(timeout=0.5, period=0.05)
                self.committer.check()
                if errors:
                    raise errors[0]
                if self.servers is not None:
                    self.servers.check()  # a server killed: the workers then wait on it
        except BaseException:
            if pc is not None:
                pc.close()
            raise
        finally:
            stop.set()
            if ctl.ident is not None:  # joining a thread never started raises over the error
                ctl.join()
            del store
        if errors:
            raise errors[0]
        if result.failures:
            if self.servers is not None and (lost := self.servers.failure(grace=2.0)) is not None:
                raise lost  # a server's end first: the workers' broken collectives follow from it
            raise segment_failure(self.host, segdir, result.failures, pc.failure_report())
        if self.servers is not None:
            self.servers.wait_left(index)
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
            steps=int(info.get("steps", 0)),
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
                for j in range(base + 1, min(base + max(ahead, self.min_ahead), chan.length - 2) + 1):
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
        steps, sqr, var, batch = chan.measured(j)
        prog = Progress(
            iteration=it, end=self.end, loss=loss, workers=workers, samples_per_sec=rate, eta_s=eta,
            steps=self._steps + steps, batch=batch or None, grad_sqr=sqr, grad_var=var,
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
            placement = self.slots.at(it)
            self.timeline.append((it, workers, time.time()))
            here, parts = place(workers, *placement) if placement is not None else (workers, ())
            slots = placement[0][:here] if placement is not None else None
            self._span_address(workers, here, parts)  # a refusal is not announced as applied first
            if parts and self.servers is not None:
                raise SpecError(
                    "workers", workers, f"at most the {here} worker(s) this host has slots for with strategy "
                    "'parameter_server'", hint="a parameter-server job's segments run on the host that runs "
                    "its servers (spanning hosts is all-reduce only for now)",
                )
            if self.on_segment is not None:
                spans = tuple((p.host, p.slots) for p in parts)
                self.on_segment(it, Allocation.split(workers, self.host, slots, spans))
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
            self._steps += last.steps
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
        self, status: ChunkStatus, it: int, ref: CheckpointRef | None, last: _Segment | None,
        segments: list[_Segment],
    ) -> ChunkResult:
        duration = time.time() - self._t0
        samples = sum(s.samples for s in segments)
        train_s = sum(s.train_seconds for s in segments)
        metrics = dict(ref.metrics) if ref is not None else {}
        history = _loss_history(last.state_path, self.start, it) if last is not None else []
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
            loss_history=history,
            **self._ps_result(),
        )

    def _ps_result(self) -> dict[str, Any]:
        if self.servers is None:
            return {}
        self.servers.failure()  # reads the last stats they sent
        stats = self.servers.stats
        return {"ps_bytes": stats["bytes_sent"] + stats["bytes_received"], "ps_steps": stats["steps"],
                "ps_snapshot_bytes": stats["snapshot_bytes"]}


def _loss_history(state_path: str | Path, start: int, upto: int) -> list[tuple[int, float]]:
    """The losses of chunk ``[start, ...)``'s steps up to iteration ``upto`` that the state at
    ``state_path`` carries (its last ``LOSS_HISTORY_MAX``, those of earlier tries included).
    Read with ``mmap``: the tensors stay on disk. Only the tracker uses them: a state that
    cannot be read for them (a damaged restore file) gives none, with a warning."""
    from elastic_ops.runtime.state import load_state

    try:
        state = load_state(state_path, mmap=True)
        return loss_steps(state["metrics"]["loss"], int(state["iteration"]), start, upto)
    except Exception as exc:  # noqa: BLE001 - a history is not worth failing a trained chunk
        log.warning("the chunk's loss history could not be read from %s (%s: %s)", state_path,
                    type(exc).__name__, exc)
        return []


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


def _check_entrypoint(spec: JobSpec, import_it: bool = True, import_path: Sequence[str] = ()) -> None:
    """Fail before any worker starts on an entrypoint that cannot load. ``import_it=False``
    (a long-lived agent): only find the Trainable's module, running none of its code here, on
    this process's ``sys.path`` and then ``import_path`` (the task's folders)."""
    if spec.is_script():  # its consistency, scaling and micro_batch: JobSpec checks them
        if not Path(spec.entrypoint).is_file():
            raise EntrypointError("entrypoint", spec.entrypoint, "script file does not exist")
        return
    if import_it:
        from elastic_ops.runtime.entrypoints import check_params
        from elastic_ops.runtime.trainable import load_trainable_class

        check_params(load_trainable_class(spec.entrypoint), spec.params)  # before workers start
        return
    from elastic_ops.runtime.entrypoints import find_trainable_module, this_process

    try:
        find_trainable_module(spec.entrypoint, import_path)
    except EntrypointError as exc:  # say which process could not, and where it looked
        raise EntrypointError(
            "entrypoint", spec.entrypoint,
            f"{exc.allowed} in the process that runs the chunk, {this_process()}; it searched its "
            f"sys.path {sys.path} and the task's {list(import_path)}",
            hint="start it with PYTHONPATH set to the folder that holds the module (the DAG "
            "folder for a model kept beside the DAG), or install the module into its virtualenv",
        ) from exc


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
    target: Callable[[int], int | Allocation],
    store: CheckpointStore | None = None,
    epoch: int = 0,
    on_progress: Callable[[Progress], None] | None = None,
    host: str = "localhost",
    warm_start: str | None = None,
    launcher: Launcher | None = None,
    workdir: str | Path | None = None,
    warm_start_store: CheckpointStore | None = None,
    on_segment: Callable[[int, Allocation], None] | None = None,
    span_hosts: bool = False,
    import_entrypoint: bool = True,
    import_path: Sequence[str] = (),
) -> ChunkResult:
    """Train iterations ``[start, end)`` from the latest committed checkpoint; see the module doc.

    ``target(i)`` is called for every boundary ``i`` of the chunk, from a background thread, up
    to ~``HORIZON_S`` (at least ``LOOKAHEAD`` iterations) before ``i`` runs; it must be cheap
    (cache a pool heartbeat). It returns the worker count (0 preempts), or an
    :class:`~elastic_ops.runtime.allocation.Allocation`: the count and the ``(host, slot)`` pairs
    the pool granted with it.
    ``workdir`` holds the staging files (a temporary directory by default, removed afterwards).
    ``import_entrypoint=False``: the Trainable's module is only found here, not imported (a
    long-lived process such as the agent runs no user code; the workers import it).
    ``import_path``: folders the workers append to their ``sys.path`` before they import the
    Trainable (the task's DAG, plugins and ``PYTHONPATH`` folders, sent by the task to an agent).
    ``warm_start_store`` is the already-open store at ``warm_start`` (e.g. built with the caller's
    S3 client and endpoint); without it ``open_store(warm_start)`` and boto3's default chain apply.
    The allocation's slots on ``host``: on CUDA, rank r of a segment launched at boundary ``i``
    runs on the r-th of those ``target(i)`` granted (see
    :func:`elastic_ops.runtime.launcher.slot_gpus`); a bare count: ranks take the visible GPUs
    in order. When the slots of a boundary's target differ from the running segment's (as a set,
    the ranks' ones) at the same count, the segment ends there and the same count is relaunched
    on the new slots, on CPU too (there the slots are the pool's bookkeeping; the move costs one
    relaunch). On CUDA, a move that leaves fewer slots on this host than workers (the pool placed
    the job on another host, which the local launcher cannot reach) is not followed: the workers
    stay on their GPUs, with a warning, until the chunk ends.
    ``on_segment(i, allocation)`` is called when ``allocation.workers`` are about to start at
    boundary ``i`` on ``allocation.placements`` (the slots of ``target(i)`` they use; ``None``
    after a bare count), after the previous segment's workers have exited: the moment a shrink
    or a move has really given its old slots up, so the caller reports it to the pool then (not
    when ``target`` announced it).
    ``span_hosts`` (a node agent leading segments across hosts): the slots the target grants on
    other hosts count too; a count beyond this host's slots then spans hosts (:func:`place`):
    the launcher, which must have an ``address`` the other hosts can reach, starts their ranks
    (``LaunchRequest.remote``), and ``on_segment`` names them. Without it only ``host``'s slots
    count.
    """
    _check_range(spec, start, end)
    _check_entrypoint(spec, import_entrypoint, import_path)
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
        (work / OWNER_FILE).write_text(owner())
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
                # a try that trained the chunk but whose task died before it told the tracker
                loss_history=_loss_history(restore, start, end),
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
            spec, start, end, target, store, epoch, on_progress, host, launcher, work, on_segment, span_hosts,
            tuple(import_path),
        )
        it, state_path = 0, None
        if ref is not None:
            it, state_path = ref.iteration, str(restore)
            log.info("resuming from checkpoint at iteration %d (%s)", it, ref.uri)
        elif warm_start or warm_start_store is not None:
            state_path = str(work / "warm-start.pt")
            save_atomic(_warm_state(warm_start, warm_start_store), state_path)
        if spec.parameter_server:
            from elastic_ops.runtime.paramserver.group import ServerGroup

            # the servers start from the state the chunk resumes from, and live until it ends
            runner.servers = ServerGroup(spec, state_path, host, import_path, spec.threads_per_worker)
        try:
            if runner.servers is not None:
                runner.servers.wait_ready()
            return runner.run(it, state_path, runner.target(it))
        finally:
            if runner.servers is not None:
                runner.servers.close()
            runner.committer.close()
    finally:
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)


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


