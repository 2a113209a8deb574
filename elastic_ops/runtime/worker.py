"""One worker process of a Trainable job: ``python -m elastic_ops.runtime.worker``.

Started by the launcher with the PyTorch environment (``RANK``, ``WORLD_SIZE``, ...) and
``ELASTIC_OPS_SEGMENT``. Trains iterations ``[start, end)`` of its segment, stops early at a
boundary whose target worker count differs, and leaves its state for the runner.
"""

from __future__ import annotations

import errno
import math
import os
import select
import sys
import threading
import time
import traceback
from typing import Any

import torch

from elastic_ops.checkpoint.codec import check_state
from elastic_ops.runtime.adaptive import AdaptiveBatch, lr_power
from elastic_ops.runtime.consistency import GradientEngine, lr_factor, target_factor, trainable_params
from elastic_ops.runtime.control import batch_of, continues
from elastic_ops.runtime.data_order import EVALUATE_STREAM, OPTIMIZER_STREAM, batch_size, stream_slice
from elastic_ops.runtime.model_checks import check_scheduler, metric_values, norm_layer_warning, warn
from elastic_ops.runtime.rendezvous import RendezvousForgeryError, segment_key
from elastic_ops.runtime.segment import DeviceUnusable, NonFiniteLoss, Segment, UserFailure, user_code
from elastic_ops.runtime.state import build_state, restore_rng
from elastic_ops.runtime.trainable import load_trainable, to_device

CURRENT_ITERATION = -1  # the iteration this process is running (for diagnostics and test hooks)


class TrainableWorker:
    def __init__(self, seg: Segment) -> None:
        self.seg = seg
        spec = seg.spec
        self.device = seg.device()
        with user_code():
            self.trainable = load_trainable(spec.entrypoint, spec.params)
            # Same seed on every rank: every worker builds identical initial parameters.
            torch.manual_seed(spec.data_seed)
            self.model = self.trainable.build_model().to(self.device)
            self.optimizer = self.trainable.build_optimizer(self.model)
            self.scheduler = self.trainable.build_scheduler(self.optimizer)
            check_scheduler(self.scheduler)
            self.dataset = self.trainable.train_dataset()
            self.num_samples = len(self.dataset)
            trainable_params(self.model)  # one dtype, at least one: the user's model to change
        self.iteration, self.cursor = seg.start, 0
        self.metrics: dict[str, list] = {"loss": [], "eval": []}
        self.scaled = spec.scaling.value in ("linear_lr", "sqrt_lr")
        self.adaptive = AdaptiveBatch(spec.global_batch) if spec.scaling.value == "adaptive" else None
        self.gain_power = lr_power(self.optimizer)
        self.lr_ramp: dict[str, float] = {}
        self._restore(seg.load_state())
        if seg.rank == 0:  # what the user's optimizer and scheduler keep must load safely: say so now
            with user_code():
                check_state({"optimizer": self.optimizer.state_dict(),
                             "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {}})
        if self.scaled:
            self._ramp_to(seg.workers)
        if seg.rank == 0 and (norms := norm_layer_warning(self.model, spec.consistency.value)):
            warn(norms)
        self.engine = GradientEngine(
            mode=spec.consistency.value,
            model=self.model,
            loss_fn=self._loss,
            fetch=self._fetch,
            rank=seg.rank,
            workers=seg.workers,
            virtual_shards=spec.virtual_shards,
            micro_batch=spec.micro_batch,
            data_seed=spec.data_seed,
            device=self.device,
            guard=user_code,
            measure=self.adaptive is not None,
        )

    def _restore(self, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        with user_code():
            self.model.load_state_dict(state["model"])
            if state.get("warm"):  # warm start: weights only, a fresh job otherwise
                return
            self.optimizer.load_state_dict(state["optimizer"])
            if self.scheduler is not None and state.get("scheduler"):
                self.scheduler.load_state_dict(state["scheduler"])
        self.iteration, self.cursor = int(state["iteration"]), int(state["cursor"])
        self.metrics = {"loss": list(state["metrics"]["loss"]), "eval": list(state["metrics"]["eval"])}
        self.lr_ramp = dict(state.get("lr_ramp") or {})
        if self.adaptive is not None:
            self.adaptive = AdaptiveBatch.restore(self.seg.spec.global_batch, state.get("adaptive"))
        restore_rng(state["rng"])

    def _ramp_to(self, workers: int) -> None:
        spec = self.seg.spec
        goal = target_factor(spec.scaling.value, workers, spec.min_workers)
        if self.lr_ramp.get("to") == goal:
            return
        now = lr_factor(self.lr_ramp, self.iteration, spec.warmup_iterations) if self.lr_ramp else 1.0
        self.lr_ramp = {"from": now, "to": goal, "start": self.iteration}

    def _fetch(self, indices: torch.Tensor) -> Any:
        batch = self.trainable.fetch(self.dataset, indices)
        return batch if self.device.type == "cpu" else to_device(batch, self.device)

    def _loss(self, batch: Any) -> torch.Tensor:
        return self.trainable.loss(self.model, batch)

    def state(self) -> dict[str, Any]:
        return build_state(
            iteration=self.iteration,
            cursor=self.cursor,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            metrics=self.metrics,
            lr_ramp=self.lr_ramp,
            adaptive=self.adaptive.state() if self.adaptive is not None else None,
        )

    def _publish(self, it: int, since: int, loss: float, steps: int, batch: int) -> None:
        """Boundaries ``since..it`` reached (an adaptive step may cross several)."""
        grad = self.adaptive.stats() if self.adaptive is not None else None
        self.seg.publish(it, loss, self.cursor, since=since, steps=steps, grad=grad,
                         batch=batch if self.adaptive is not None else 0)

    def _optimizer_step(self, gain: float = 1.0, steps: int = 1) -> None:
        """The optimizer's step, the learning rate times the scaling mode's factor and an
        adaptive job's ``gain`` (its square root for Adam-like optimizers:
        :func:`~elastic_ops.runtime.adaptive.lr_power`); the scheduler's ``steps`` steps (the
        iterations it advanced)."""
        factor = lr_factor(self.lr_ramp, self.iteration, self.seg.spec.warmup_iterations)
        factor *= gain**self.gain_power
        groups = self.optimizer.param_groups
        base = [g["lr"] for g in groups]
        if factor != 1.0:
            for g in groups:
                g["lr"] = g["lr"] * factor
        with user_code():
            self.trainable.before_step(self.model)  # the reduced gradient: clip it, say
            self.optimizer.step()
        if factor != 1.0:
            for g, lr in zip(groups, base, strict=True):
                g["lr"] = lr
        if self.scheduler is not None:
            with user_code():
                for _ in range(steps):
                    self.scheduler.step()

    def run(self) -> None:
        seg, spec = self.seg, self.seg.spec
        loss, next_workers = math.nan, seg.workers
        t0, c0 = time.time(), self.cursor
        last, steps, batch = seg.start - 1, 0, 0  # the last boundary published; steps run; batch run
        while True:
            it = self.iteration
            if it >= seg.end:
                break
            next_workers = seg.target(it)
            if not continues(next_workers, seg.workers):
                break
            if seg.rank == 0 and seg.checkpoint_due(it, since=last + 1):
                seg.write_checkpoint(it, self.state())
            self._publish(it, last + 1, loss, steps, batch)
            last = it
            global CURRENT_ITERATION
            CURRENT_ITERATION = it
            gain = 1.0
            if self.adaptive is not None:
                b, gain = self.adaptive.plan(it, spec.step_batch(batch_of(next_workers)), seg.end)
            else:
                b = batch_size(spec.global_batch, spec.min_workers, seg.workers, self.scaled)
            loss = self.engine.step(it, stream_slice(spec.data_seed, self.num_samples, self.cursor, b))
            if not math.isfinite(loss):
                raise NonFiniteLoss(f"loss is {loss} at iteration {it}")
            self.engine.seed_shared(it, OPTIMIZER_STREAM)  # replicas that draw alike stay alike
            advance = 1
            if self.adaptive is not None:
                self.adaptive.measured(self.engine.noise)
                advance = self.adaptive.advance(gain)
            self._optimizer_step(gain, advance)
            self.metrics["loss"].append([it, loss])
            self.cursor += b
            self.iteration = it + advance
            steps, batch = steps + 1, b
        self._publish(self.iteration, last + 1, loss, steps, batch)
        train_s = time.time() - t0
        if seg.rank != 0:
            return
        evaluation: dict[str, float] = {}
        if self.iteration >= seg.end:
            was_training = self.model.training
            self.model.eval()  # evaluation without dropout, without autograd
            self.engine.seed_shared(self.iteration, EVALUATE_STREAM)  # draws alike for every schedule
            with user_code(), torch.no_grad():
                evaluation = metric_values(self.trainable.evaluate(self.model))
            self.model.train(was_training)
            self.metrics["eval"].append([self.iteration, evaluation])
        seg.write_result(
            self.iteration,
            self.state(),
            cursor=self.cursor,
            next_workers=next_workers,
            loss=loss,
            evaluation=evaluation,
            train_seconds=train_s,
            samples=self.cursor - c0,
            steps=steps,
        )


LAUNCHER_PID_ENV = "ELASTIC_OPS_LAUNCHER_PID"


def die_with_launcher(environ: Any = None) -> threading.Thread | None:
    """On Linux, end this worker at once when the process that launched it dies.

    The launcher is the process running the chunk (a task, the per-host agent, a node agent:
    ``ELASTIC_OPS_LAUNCHER_PID``); the worker's parent is the fork server, which outlives it (it
    only exits once every holder of its "alive" pipe is gone, and each worker holds one). A
    launcher killed outright (SIGKILL, OOM kill) would otherwise leave its workers waiting at
    their next boundary for a decision that never comes (10 minutes), holding their GPU memory
    after the pool has given their slots to another job. Nothing of theirs is lost: the
    launcher, which commits, is gone. A thread waits on a pidfd (no polling; no pid reuse)."""
    env = os.environ if environ is None else environ
    pid = env.get(LAUNCHER_PID_ENV)
    if not pid or not hasattr(os, "pidfd_open"):
        return None
    try:
        fd = os.pidfd_open(int(pid))
    except ProcessLookupError:  # gone before this worker got here
        os._exit(1)
    except (OSError, ValueError):  # an old kernel, a foreign pid namespace: no watchdog
        return None

    def watch() -> None:
        select.select([fd], [], [])  # readable once the launcher has exited
        os._exit(1)

    thread = threading.Thread(target=watch, name="elastic-ops-launcher-watch", daemon=True)
    thread.start()
    return thread


def worker_entry(script: str | None) -> None:
    """What each worker process runs (a picklable function for the fork server)."""
    die_with_launcher()
    segment_key()  # out of the environment before any user code runs (and any process it starts)
    code = run_script(script) if script else main()
    if code:
        raise SystemExit(code)


def run_script(path: str) -> int:
    """Script mode: run the user's file as ``__main__`` with ``sys.argv`` = the script and the
    spec's ``script_args``, torch seeded with ``data_seed`` as a Trainable's model is (every
    worker builds the same initial model). Its exceptions, and its exiting with a status other
    than 0 (``sys.exit("message")``, an argparse error), are user errors: the same on any host,
    never retried as a lost worker."""
    import runpy

    seg = Segment.from_env()
    sys.argv = [path, *seg.spec.script_args]
    torch.manual_seed(seg.spec.data_seed)
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        from elastic_ops.runtime import script

        if exc.code is None or exc.code == 0:
            return 0
        how = f"with status {exc.code}" if isinstance(exc.code, int) else f"with the message {exc.code!r}"
        seg.write_error("user", f"the script exited {how} (sys.exit; argparse exits with 2 on arguments "
                        f"it does not take: sys.argv[1:] is the spec's script_args "
                        f"{list(seg.spec.script_args)})", "", script.RUNNING)
        return 1
    except Exception as exc:
        from elastic_ops.runtime import script

        # the iteration it failed in (None: before ctx.iterations() ran one), not "before training"
        seg.write_error(script_error_kind(exc), f"{type(exc).__name__}: {exc}", traceback.format_exc(),
                        script.RUNNING)
        return 1
    return 0


def script_error_kind(exc: BaseException) -> str:
    """How the runner reads an exception out of a script: a collective failing because a peer
    died, or a rendezvous someone else wrote to (:class:`RendezvousForgeryError`), is a lost
    worker (``comm``), not a bug in the script; an unusable GPU is the host's (``device``)."""
    import torch.distributed as dist

    if isinstance(exc, NonFiniteLoss):
        return "nonfinite"
    if isinstance(exc, DeviceUnusable):  # ctx = elastic.init(): this worker's GPU, not the script
        return "device"
    if isinstance(exc, (dist.DistError, RendezvousForgeryError)) or _gloo_transport_error(exc):
        return "comm"
    return "user"


def _gloo_transport_error(exc: BaseException) -> bool:
    """A gloo collective that failed because a peer died, hung or stopped answering. NCCL raises
    ``DistError``s; gloo a plain ``RuntimeError`` naming its transport's source file
    (``[.../gloo/transport/tcp/pair.cc:537] Read error ...: Connection reset by peer``,
    ``[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv
    operation``), which only gloo's own collectives raise."""
    return isinstance(exc, RuntimeError) and "gloo/transport/" in str(exc)


def _debug(what: str) -> None:
    if os.environ.get("ELASTIC_OPS_DEBUG"):
        print(f"[{time.time():.3f}] rank {os.environ.get('RANK')}: {what}", file=sys.stderr, flush=True)


# the host's disk failing the worker (staging its state): the host's fault, not a bug
HOST_DISK_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})


def error_kind(exc: BaseException, workers: int) -> str:
    """How the runner reads a worker's exception outside user code: ``storage`` (a full or
    failing local disk), ``device`` (its GPU is unusable: :class:`DeviceUnusable`), ``comm`` (a
    collective failing because a peer died; a lone worker has no peer to lose, so its
    RuntimeError is a bug) or ``internal``."""
    if isinstance(exc, OSError) and not isinstance(exc, ConnectionError) and exc.errno in HOST_DISK_ERRORS:
        return "storage"
    if isinstance(exc, DeviceUnusable):
        return "device"
    if workers > 1 and isinstance(exc, (RuntimeError, TimeoutError, ConnectionError)):
        return "comm"
    return "internal"


def main() -> int:
    _debug("entry")
    seg = Segment.from_env()
    iteration = None
    try:
        seg.setup()
        _debug("process group ready")
        if seg.spec.parameter_server:
            from elastic_ops.runtime.paramserver.worker import PSWorker

            worker = PSWorker(seg)
        else:
            worker = TrainableWorker(seg)
        _debug("trainable built")
        iteration = worker.iteration
        try:
            worker.run()
        finally:
            iteration = worker.iteration
    except UserFailure as exc:
        seg.write_error("user", str(exc), exc.text, iteration)
        return 1
    except NonFiniteLoss as exc:
        seg.write_error("nonfinite", str(exc), "", iteration)
        return 1
    except Exception as exc:  # collectives failing because a peer died, a full disk, or our own bug
        peers = seg.workers + (int(seg.spec.servers or 0) if seg.spec.parameter_server else 0)
        seg.write_error(error_kind(exc, peers), f"{type(exc).__name__}: {exc}", traceback.format_exc(),
                        iteration)
        return 1
    finally:
        seg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
