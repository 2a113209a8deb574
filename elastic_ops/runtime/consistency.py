"""How one iteration's gradient is computed and combined across workers.

``bitwise``: the global batch of ``B`` samples is cut into ``V`` fixed virtual shards of
``B / V`` samples. Shard ``k`` always gets the same samples and its own RNG seed from
``(data_seed, iteration, k)``. Each worker computes the gradient of its contiguous shards
separately (micro-batched inside a shard if ``micro_batch`` is set), each scaled by its share
of the global batch; all workers ``all_gather`` the per-shard flat gradients and sum them in
shard order ``0..V-1``. Every floating-point operation is then the same for any worker count,
so the result is bitwise identical to a 1-worker run. Cost: ``V/N`` backward passes on smaller
batches per worker, an ``all_gather`` that moves ``V x`` the gradient size instead of one
allreduce, and ``V`` sequential vector additions.

``fast``: worker ``r`` takes a contiguous slice of the batch (uneven slices allowed), accumulates
the gradient over micro-batches, each scaled by its share of the global batch, and one
``all_reduce(SUM)`` gives the gradient of the global mean. Summation order depends on the
worker count, so results agree within floating-point tolerance only.

Both keep the loss as one extra element at the end of the flat gradient buffer, so the global
loss travels with the gradients and costs no extra collective; before it, one element for the
gradient noise measurement (``measure``: an adaptive job's, see :func:`noise_estimate`) and,
before that, one flag per
parameter says whether autograd gave it a gradient (a hook adds it to a set; the flags are
written once per iteration). Summed with the gradients, the flags tell which parameters no
worker's loss used in this iteration: their ``p.grad`` is ``None``, as in a plain loop and
under DDP with ``find_unused_parameters``, so the optimizer skips them (no weight decay, no
momentum) instead of stepping on a zero gradient.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elastic_ops.runtime.data_order import even_split, iteration_seed, shards_of_worker


class FlatGrads:
    """``rows`` flat buffers of ``numel + len(params) + 2`` elements (gradients, used flags,
    noise measurement, loss); ``bind(r)`` points every ``p.grad`` at row r.

    Autograd accumulates into an existing ``.grad`` in place, so backward writes straight into
    the buffer that is then communicated (as DDP's ``gradient_as_bucket_view`` does).
    """

    def __init__(self, params: list[torch.nn.Parameter], rows: int, device: torch.device) -> None:
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.width = self.numel + len(params) + 2
        self.buf = torch.zeros(rows, self.width, device=device, dtype=params[0].dtype)
        self._views = [self.row_views(self.buf[r]) for r in range(rows)]
        self._seen: set[int] = set()  # parameters autograd reached since the last record_used
        self._used: set[int] = set()  # ... in this worker's rows of the running iteration
        self._ids = [id(p) for p in params]
        self._hooks = [p.register_post_accumulate_grad_hook(self._mark) for p in params]

    def row_views(self, row: torch.Tensor) -> list[torch.Tensor]:
        views, off = [], 0
        for p in self.params:
            views.append(row[off : off + p.numel()].view_as(p))
            off += p.numel()
        return views

    def bind(self, row: int) -> None:
        for p, v in zip(self.params, self._views[row], strict=True):
            if p.grad is not v:  # re-point only what user code (or another row) replaced
                p.grad = v

    def _mark(self, param: torch.Tensor) -> None:
        self._seen.add(id(param))

    def flags(self, row: torch.Tensor) -> torch.Tensor:
        return row[self.numel : self.numel + len(self.params)]

    def record_used(self, row: torch.Tensor) -> None:
        """Write which parameters got a gradient since the last call into ``row``'s flags."""
        flags, seen = self.flags(row), self._seen
        if len(seen) == len(self.params):  # the common case: one fill
            flags.fill_(1)
        elif seen:
            flags.copy_(torch.tensor([1.0 if i in seen else 0.0 for i in self._ids], dtype=flags.dtype))
        self._used |= seen
        self._seen = set()

    def give_grads(self, row: torch.Tensor, views: list[torch.Tensor] | None = None) -> None:
        """Point every ``p.grad`` at its part of the reduced ``row`` (``views``; None: row 0's,
        where ``bind(0)`` pointed them already), or at ``None`` where no worker's loss used
        ``p`` (its flags summed to 0). When this worker's own loss used every parameter, the
        sums are all positive: nothing to read."""
        used_here, self._used = len(self._used) == len(self.params), set()
        used = None if used_here else (self.flags(row) > 0).tolist()
        if used is None or all(used):
            if views is not None:
                for p, v in zip(self.params, views, strict=True):
                    p.grad = v
            return
        views = self._views[0] if views is None else views
        for p, v, u in zip(self.params, views, used, strict=True):
            p.grad = v if u else None


def trainable_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters gradients are computed for. They share one dtype: their gradients live in
    one flat buffer that is reduced in one piece (bitwise mode: in a fixed order)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            "build_model() returned a model with no parameter that requires grad: nothing to train"
        )
    names = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            names.setdefault(p.dtype, name)
    if len(names) > 1:
        mixed = ", ".join(f"{dtype} (e.g. {name!r})" for dtype, name in names.items())
        raise TypeError(
            f"the model's trainable parameters mix dtypes: {mixed}; elastic_ops reduces their gradients "
            "as one flat tensor, so cast the model to one dtype (model.to(torch.float32)) or set "
            "requires_grad=False on the parameters of the other"
        )
    return params


_split = functools.lru_cache(maxsize=256)(lambda total, parts: tuple(even_split(total, parts)))


def noise_estimate(small: float, big: float, batch: int, parts: int) -> tuple[float, float] | None:
    """Unbiased estimates ``(sqr, var)`` of the true gradient's squared norm and of the
    per-sample gradient variance (trace of the covariance), from one iteration: ``big`` the
    squared norm of its gradient over all ``batch`` samples, ``small`` the sum over its
    ``parts`` (workers, shards or halves, sizes ``b_i``) of ``b_i`` times the squared norm of
    each part's gradient. As ``E|g_b|^2 = sqr + var / b`` for a mean over ``b`` samples,
    ``E[small] = batch * sqr + parts * var`` and ``E[batch * big] = batch * sqr + var``
    (McCandlish et al. 2018, appendix A, for parts of any sizes). None with fewer than 2 parts."""
    if parts < 2 or batch < 2:
        return None
    var = (small - batch * big) / (parts - 1)
    return big - var / batch, var


def _chunks(indices: torch.Tensor, size: int | None) -> list[torch.Tensor]:
    if not size or len(indices) <= size:
        return [indices]
    return list(torch.split(indices, size))


class GradientEngine:
    """Computes one iteration's reduced gradient into ``p.grad`` and returns the global loss."""

    def __init__(
        self,
        *,
        mode: str,
        model: torch.nn.Module,
        loss_fn: Callable[[Any], torch.Tensor],
        fetch: Callable[[torch.Tensor], Any],
        rank: int,
        workers: int,
        virtual_shards: int | None,
        micro_batch: int | None,
        data_seed: int,
        device: torch.device,
        guard: Callable[[], Any] = contextlib.nullcontext,
        measure: bool = False,
    ) -> None:
        self.guard = guard  # wraps user code (loss, fetch, backward) so its errors are attributed
        # measure the gradient noise (an adaptive job): ``noise`` after each step, the same on
        # every rank (computed from reduced values only)
        self.measure, self.noise = measure, None
        self.mode, self.rank, self.workers = mode, rank, workers
        self.loss_fn, self.fetch = loss_fn, fetch
        self.micro_batch, self.data_seed, self.device = micro_batch, data_seed, device
        params = trainable_params(model)
        if mode == "bitwise":
            self.shards = virtual_shards or 1
            self.my_shards = shards_of_worker(self.shards, workers, rank)
            self.max_rows = math.ceil(self.shards / workers)
            self.grads = FlatGrads(params, self.max_rows, device)
            self.out = torch.zeros(self.grads.width, device=device, dtype=self.grads.buf.dtype)
            self.row_owner = [
                (r, k - shards_of_worker(self.shards, workers, r).start)
                for r in range(workers)
                for k in shards_of_worker(self.shards, workers, r)
            ]
            self._gathered = [torch.empty_like(self.grads.buf) for _ in range(workers)]
            self._out_views = self.grads.row_views(self.out)
        else:
            self.grads = FlatGrads(params, 1, device)

    def _seed(self, seed: int) -> None:
        # Not torch.manual_seed: it also queues lazy CUDA/XPU/MTIA seeding, formatting a stack
        # trace each time (~3 ms per call), which is a large share of a small model's iteration.
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.default_generators[self.device.index or 0].manual_seed(seed)

    def seed_shared(self, iteration: int, stream: int) -> None:
        """Seed torch's generator alike on every rank, whatever the worker count: for the code
        all ranks run on the same data after the gradients (the optimizer's and scheduler's
        steps, rank 0's evaluation), whose draws would otherwise follow each rank's last shard."""
        self._seed(iteration_seed(self.data_seed, iteration, stream))

    def step(self, iteration: int, batch: torch.Tensor) -> float:
        if self.mode == "bitwise":
            return self._bitwise(iteration, batch)
        return self._fast(iteration, batch)

    def _accumulate(self, indices: torch.Tensor, total: int, loss_out: torch.Tensor) -> None:
        """Backward of every micro-batch into the bound grads; losses summed into ``loss_out``.

        Each micro-batch's mean loss is scaled by its share of the global batch, so the sum
        over all micro-batches of all workers is the gradient of the global mean.
        """
        for micro in _chunks(indices, self.micro_batch):
            loss = self.loss_fn(self.fetch(micro))
            if len(micro) != total:  # a share of 1 needs no extra autograd node
                loss = loss * (len(micro) / total)
            loss.backward()
            loss_out.add_(loss.detach())

    def _fast(self, iteration: int, batch: torch.Tensor) -> float:
        lo, hi = _split(len(batch), self.workers)[self.rank]
        total = len(batch)
        buf = self.grads.buf[0]
        buf.zero_()
        self.grads.bind(0)
        self._seed(iteration_seed(self.data_seed, iteration, self.rank))
        grads = buf[: self.grads.numel]
        if hi > lo:
            with self.guard():
                if self.measure and self.workers == 1 and hi - lo >= 2:
                    # alone: the two halves of the batch are the parts the noise is measured from
                    mid = (lo + hi) // 2
                    self._accumulate(batch[lo:mid], total, buf[-1])
                    first = grads.clone()
                    self._accumulate(batch[mid:hi], total, buf[-1])
                    second = grads - first
                    buf[-2] = (first.dot(first) / (mid - lo) + second.dot(second) / (hi - mid)) * total**2
                else:
                    self._accumulate(batch[lo:hi], total, buf[-1])
                    if self.measure:  # this worker's part: b_i |g_i|^2, its gradient scaled by b_i / B
                        buf[-2] = grads.dot(grads) * (total**2 / (hi - lo))
        self.grads.record_used(buf)
        if self.workers > 1:
            dist.all_reduce(buf)
        self.grads.give_grads(buf)
        if not self.measure:
            return buf[-1].item()
        small, big, loss = torch.stack([buf[-2], grads.dot(grads), buf[-1]]).tolist()  # one device sync
        parts = 2 if self.workers == 1 else min(self.workers, total)
        self.noise = noise_estimate(small, big, total, parts)
        return loss

    def _bitwise(self, iteration: int, batch: torch.Tensor) -> float:
        size = len(batch) // self.shards
        self.grads.buf.zero_()
        for row, k in enumerate(self.my_shards):
            self.grads.bind(row)
            self._seed(iteration_seed(self.data_seed, iteration, k))
            with self.guard():
                self._accumulate(batch[k * size : (k + 1) * size], len(batch), self.grads.buf[row, -1])
            self.grads.record_used(self.grads.buf[row])
        if self.workers > 1:
            dist.all_gather(self._gathered, self.grads.buf)
            rows = self._gathered
        else:
            rows = [self.grads.buf]
        # Sum in shard order 0..V-1, one vector add at a time: the same operations for any N.
        out = self.out
        for k, (r, j) in enumerate(self.row_owner):
            if k == 0:
                out.copy_(rows[r][j])
            else:
                out.add_(rows[r][j])
        self.grads.give_grads(out, self._out_views)
        if not self.measure:
            return out[-1].item()
        # the shards are the parts: each row is its gradient scaled by size / B (one device sync).
        # Each norm on a fresh float64 copy: a dot product's rounding follows where the vector
        # lies in memory (SIMD alignment), and a shard's row lies elsewhere for another worker
        # count; the gain these feed moves the learning rate, so they must not differ in a bit.
        n, total = self.grads.numel, len(batch)
        norms = torch.stack([_sqnorm(rows[r][j][:n]) for r, j in self.row_owner])
        small, big, loss = torch.stack([norms.sum(), _sqnorm(out[:n]), out[-1].double()]).tolist()
        self.noise = noise_estimate(small * total**2 / max(size, 1), big, total, self.shards)
        return loss


def _sqnorm(v: torch.Tensor) -> torch.Tensor:
    """``|v|^2`` computed the same wherever ``v`` lies: on a fresh float64 copy."""
    w = v.to(torch.float64, copy=True)
    return w.dot(w)


def lr_factor(ramp: dict[str, float], iteration: int, warmup: int) -> float:
    """The learning-rate multiplier of the scaling modes, ramped linearly over ``warmup`` iterations.

    ``ramp`` = ``{"from": f0, "to": f1, "start": i0}``: the factor moves from ``f0`` at iteration
    ``i0`` to ``f1`` at ``i0 + warmup`` (Goyal et al.'s gradual warmup; a rescale starts a new ramp
    from the factor in force).
    """
    if not ramp:
        return 1.0
    f0, f1, i0 = ramp["from"], ramp["to"], ramp["start"]
    if warmup <= 0 or iteration - i0 >= warmup:
        return f1
    return f0 + (f1 - f0) * max(0, iteration - i0) / warmup


def target_factor(scaling: str, workers: int, min_workers: int) -> float:
    if scaling == "linear_lr":
        return workers / min_workers
    if scaling == "sqrt_lr":
        return math.sqrt(workers / min_workers)
    return 1.0
