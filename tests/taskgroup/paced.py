"""``PacedDigits``: the digits MLP, paced by a gate file the test writes (for the seed scenario).

The gate holds a worker count or ``release``. While it names the current world size, every
worker waits in ``loss`` (the job holds its allocation, as if its training were long); while it
names another count (the pool wants a rescale), each ``loss`` call sleeps ``PACE_S`` so the job
reaches its next iteration boundary, where the runtime rescales, after only a few iterations
(however fast this machine is); ``release`` trains at full speed to the end. So the order of the
scenario's steps is set by the test, not by how fast anything runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from elastic_ops.examples.digits import DigitsMLP

PACE_S = 0.05
HOLD_POLL_S = 0.02


def world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class PacedDigits(DigitsMLP):
    def __init__(self, **params: Any) -> None:
        self.gate = Path(params.pop("gate"))
        super().__init__(**params)

    def _gate(self) -> str:
        try:
            return self.gate.read_text().strip()
        except OSError:  # being replaced this instant
            return ""

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        gate = self._gate()
        if gate != "release":
            while gate == str(world_size()):
                time.sleep(HOLD_POLL_S)
                gate = self._gate()
            if gate != "release":
                time.sleep(PACE_S)
        return super().loss(model, batch)
