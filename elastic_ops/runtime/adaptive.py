"""An adaptive job's batch, learning rate and progress (``scaling: adaptive``): pure
bookkeeping, the same on every rank (it only ever sees reduced values).

The pool chooses the global batch ``B`` per allocation (its target's ``batch``); the job's
``global_batch`` ``B0`` is its base, the batch its learning rate is tuned for. An iteration at
``B = s * B0`` makes the progress of ``gain(s)`` iterations at ``B0`` (the AdaScale gain,
:func:`elastic_ops.adascale.adascale_gain`, from the gradient statistics the workers measure
each iteration, smoothed): its learning rate is the job's times the gain (the gain's square
root for Adam-like optimizers, which normalise the gradient's scale themselves: AdaptDL's
``AdamScale``), and the job's iteration counter, by which chunks, checkpoints and schedulers
count, advances by the gain.
The counter stays an integer: the fraction of an iteration a step makes past it is carried, in
every checkpoint, with the smoothed statistics and the batches run, so a resumed run continues
the same trajectory. A step that would carry the counter past the chunk's end runs at the
base batch (gain 1). At the base batch the job trains exactly as with ``scaling: fixed``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from elastic_ops.adascale import adascale_gain

DECAY = 0.95  # smoothing of the per-iteration noise estimates (about the last 20 iterations)
MAX_BATCHES_KEPT = 1000  # batch changes kept in the state (the latest)


def lr_power(optimizer: object) -> float:
    """The power of the gain the learning rate is multiplied by: 1 (AdaScale) for SGD-like
    optimizers, 0.5 for those that divide by a running gradient scale (Adam, AdamW, RMSprop, ...)."""
    import torch

    adaptive = (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adamax,
                torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta)
    return 0.5 if isinstance(optimizer, adaptive) else 1.0


@dataclasses.dataclass
class AdaptiveBatch:
    """``base``: the job's global batch. ``carry``: the fraction of an iteration made past the
    counter. ``sqr_sum`` / ``var_sum`` / ``weight``: the exponentially weighted sums of the
    per-iteration estimates (the squared norm of the true gradient; the per-sample gradient
    variance), bias-corrected by ``weight``. ``batches``: ``[iteration, batch]`` at every change."""

    base: int
    carry: float = 0.0
    sqr_sum: float = 0.0
    var_sum: float = 0.0
    weight: float = 0.0
    batches: list[list[int]] = dataclasses.field(default_factory=list)

    def stats(self) -> tuple[float, float] | None:
        """``(sqr, var)`` as the pool takes them (:class:`~elastic_ops.pool.scaling.GradStats`:
        ``var`` that of one base batch's gradient), clipped at 0; None before any measurement."""
        if self.weight <= 0:
            return None
        return max(self.sqr_sum / self.weight, 0.0), max(self.var_sum / self.weight / self.base, 0.0)

    def gain(self, batch: int) -> float:
        """Base-batch iterations of progress one iteration at ``batch`` makes (>= 1)."""
        stats = self.stats()
        if batch <= self.base or stats is None:
            return 1.0
        return max(1.0, adascale_gain(stats[0], stats[1], batch / self.base))

    def plan(self, iteration: int, batch: int, end: int) -> tuple[int, float]:
        """The batch and gain of the iteration at counter ``iteration`` given the chosen
        ``batch``: the base batch where the gain would carry the counter past ``end``."""
        g = self.gain(batch)
        if iteration + int(self.carry + g) > end:
            batch, g = self.base, 1.0
        if not self.batches or self.batches[-1][1] != batch:
            self.batches = [*self.batches, [iteration, batch]][-MAX_BATCHES_KEPT:]
        return batch, g

    def measured(self, noise: tuple[float, float] | None) -> None:
        """One iteration's estimates (``GradientEngine.noise``; None: none)."""
        if noise is None:
            return
        sqr, var = noise
        self.sqr_sum = DECAY * self.sqr_sum + (1 - DECAY) * sqr
        self.var_sum = DECAY * self.var_sum + (1 - DECAY) * var
        self.weight = DECAY * self.weight + (1 - DECAY)

    def advance(self, g: float) -> int:
        """Iterations the counter moves after an iteration of gain ``g`` (>= 1)."""
        total = self.carry + g
        whole = int(total)
        self.carry = total - whole
        return whole

    def state(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def restore(cls, base: int, state: dict[str, Any] | None) -> AdaptiveBatch:
        if not state:
            return cls(base)
        return cls(base, float(state["carry"]), float(state["sqr_sum"]), float(state["var_sum"]),
                   float(state["weight"]), [[int(i), int(b)] for i, b in state["batches"]])
