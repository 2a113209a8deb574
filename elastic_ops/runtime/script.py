"""Script mode: keep an existing DDP-style training script and add a few lines.

Point the spec's ``entrypoint`` at the script (``train.py``); the runner starts it on every
worker with the usual environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``, ``LEARNER_ID``, ``NUM_LEARNERS``) and rescales it at iteration boundaries::

    import elastic_ops.runtime.script as elastic

    ctx = elastic.init(num_samples=len(dataset))    # joins the process group (gloo / NCCL)
    model = DDP(build_model())                      # the script keeps its own gradient sync
    optimizer = ...
    ctx.restore(model, optimizer)                   # resume where the job stands
    for it in ctx.iterations():                     # stops at the chunk end or a rescale
        idx = ctx.my_samples(it)                    # this worker's share of the global batch
        loss = loss_fn(model(x[idx]), y[idx])       # the mean over this worker's share
        (loss * ctx.loss_weight()).backward()       # DDP's average is then the global batch's mean
        optimizer.step()
        ctx.commit(it, loss)                        # iteration done (the job's loss: progress/NaN)

The script owns the gradient reduction (normally DDP, which averages over workers with equal
weights). Each worker's ``my_samples`` share is a near-equal split of ``global_batch``; where
the split is uneven (64 samples on 3 workers) ``loss_weight()`` (``share * workers / batch``)
weights each worker's mean so the average is the global batch's mean, and the training does not
depend on the worker count. Only ``consistency: fast`` applies. Exceptions in the script, and
its exiting with a status other than 0, are reported as ``UserCodeError``.

The script sees ``sys.argv`` = ``[script, *spec.script_args]`` (an ``argparse`` script takes its
arguments from the spec, never from the runner's command line), the spec's ``params`` as
``ctx.params``, and torch seeded with ``data_seed`` before it starts (as a Trainable's model is),
so every worker builds the same initial model unless the script seeds otherwise.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from elastic_ops.runtime.data_order import even_split, stream_slice
from elastic_ops.runtime.segment import NonFiniteLoss, Segment
from elastic_ops.runtime.state import build_state, restore_rng, unwrap

RUNNING: int | None = None  # the iteration the script is running (its error reports name it)


class ScriptContext:
    def __init__(self, seg: Segment, num_samples: int) -> None:
        self.seg = seg
        self.num_samples = int(num_samples)
        self.rank, self.workers = seg.rank, seg.workers
        self.iteration, self.cursor = seg.start, 0
        self.metrics: dict[str, list] = {"loss": [], "eval": []}
        self.model: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self._loss = math.nan

    @property
    def params(self) -> dict[str, Any]:
        """The spec's ``params`` (a copy): hyperparameters without an argument parser."""
        return copy.deepcopy(dict(self.seg.spec.params))

    @property
    def device(self) -> torch.device:
        """The device this worker trains on (its one visible GPU, or the CPU)."""
        return self.seg.device()

    def restore(self, model: torch.nn.Module, optimizer: Any, scheduler: Any = None) -> int:
        """Load the job's state into ``model``/``optimizer``/``scheduler``; return the first iteration."""
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        state = self.seg.load_state()
        if state is not None:
            unwrap(model).load_state_dict(state["model"])
            if not state.get("warm"):
                optimizer.load_state_dict(state["optimizer"])
                if scheduler is not None and state.get("scheduler"):
                    scheduler.load_state_dict(state["scheduler"])
                self.iteration, self.cursor = int(state["iteration"]), int(state["cursor"])
                self.metrics = {
                    "loss": list(state["metrics"]["loss"]),
                    "eval": list(state["metrics"]["eval"]),
                }
                restore_rng(state["rng"])
        return self.iteration

    def my_samples(self, iteration: int) -> torch.Tensor:
        """Sample indices of this worker for ``iteration`` (same data order as Trainables)."""
        if iteration != self.iteration:
            raise ValueError(f"my_samples({iteration}) called while iteration {self.iteration} runs")
        spec = self.seg.spec
        batch = stream_slice(spec.data_seed, self.num_samples, self.cursor, spec.global_batch)
        lo, hi = self._bounds()
        return batch[lo:hi]

    def _bounds(self) -> tuple[int, int]:
        """This worker's part ``[lo, hi)`` of every global batch (a near-equal split)."""
        return even_split(self.seg.spec.global_batch, self.workers)[self.rank]

    def _share(self) -> int:
        """How many of an iteration's ``global_batch`` samples are this worker's."""
        lo, hi = self._bounds()
        return hi - lo

    def loss_weight(self) -> float:
        """``share * workers / global_batch`` for the running iteration: multiply this worker's
        mean loss by it before ``backward()``, and DDP's equal-weight average over the workers is
        the mean over the global batch however it splits (exactly 1.0 when it splits evenly)."""
        return self._share() * self.workers / self.seg.spec.global_batch

    def iterations(self) -> Iterator[int]:
        if self.model is None:
            raise RuntimeError("call ctx.restore(model, optimizer) before ctx.iterations()")
        seg, next_workers, t0, c0 = self.seg, self.workers, time.time(), self.cursor
        while self.iteration < seg.end:
            it = self.iteration
            next_workers = seg.target(it)
            if next_workers != self.workers:
                break
            if self.rank == 0 and seg.checkpoint_due(it):
                seg.write_checkpoint(it, self._state())
            seg.publish(it, self._loss, self.cursor)
            global RUNNING
            RUNNING = it
            yield it
            if self.iteration != it + 1:
                raise RuntimeError(f"call ctx.commit({it}, loss) at the end of every iteration")
        RUNNING = self.iteration  # an error after the loop (a final evaluation) is at its end
        seg.publish(self.iteration, self._loss, self.cursor)
        if self.rank == 0:
            seg.write_result(
                self.iteration,
                self._state(),
                cursor=self.cursor,
                next_workers=next_workers,
                loss=self._loss,
                evaluation={},
                train_seconds=time.time() - t0,
                samples=self.cursor - c0,
                steps=self.iteration - seg.start,
            )

    def commit(self, iteration: int, loss: float | torch.Tensor | None = None) -> None:
        """Mark ``iteration`` done. ``loss``: this worker's mean loss (give it on every worker or
        on none); the job's loss is their mean weighted by share, the global batch's mean, so
        what progress, checkpoints and ``stop_when`` see does not depend on the worker count. A
        non-finite one stops the job (``NonFiniteLossError``) on every worker."""
        if iteration != self.iteration:
            raise ValueError(f"commit({iteration}) but iteration {self.iteration} is running")
        value = float(loss) if loss is not None else math.nan
        if loss is not None and self.workers > 1:
            value = self._global_mean(value)
        if loss is not None and not math.isfinite(value):
            raise NonFiniteLoss(f"loss is {value} at iteration {iteration}")
        self._loss = value
        self.metrics["loss"].append([iteration, value])
        self.cursor += self.seg.spec.global_batch
        self.iteration = iteration + 1

    def _global_mean(self, value: float) -> float:
        """The workers' mean losses weighted by their shares of the global batch (one scalar
        all-reduce; a NaN anywhere is a NaN everywhere)."""
        weighted = torch.tensor([value * self._share() / self.seg.spec.global_batch], dtype=torch.float64,
                                device=self.device)
        dist.all_reduce(weighted)
        return float(weighted.item())

    def _state(self) -> dict[str, Any]:
        return build_state(
            iteration=self.iteration,
            cursor=self.cursor,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            metrics=self.metrics,
        )


def init(num_samples: int) -> ScriptContext:
    """Join the job: threads, the process group (``env://`` on the runner's store), the context."""
    seg = Segment.from_env()
    seg.setup(always_group=True)
    return ScriptContext(seg, num_samples)
