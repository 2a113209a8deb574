"""``PacedDigitsMLP``: the digits MLP, each ``loss`` call at least ``pace_s`` long (for the e2e
SIGKILL test, whose chunk must still be training when the test looks for a worker to kill,
however fast the machine). Sleeping changes no number: it ends on ``DigitsMLP``'s bits."""

from __future__ import annotations

import time
from typing import Any

from elastic_ops.examples.digits import DigitsMLP


class PacedDigitsMLP(DigitsMLP):
    def __init__(self, **params: Any) -> None:
        self.pace_s = float(params.pop("pace_s", 0.0))
        super().__init__(**params)

    def loss(self, model: Any, batch: Any) -> Any:
        time.sleep(self.pace_s)
        return super().loss(model, batch)
