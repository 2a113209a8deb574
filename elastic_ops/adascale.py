"""The AdaScale gain (Johnson et al., ICML 2020), written once for the pool, which weighs batches
by it (:mod:`elastic_ops.pool.scaling`), and for the runtime, which scales an adaptive job's
learning rate and progress by it (:mod:`elastic_ops.runtime.worker`). Numpy only, so importing
it costs a worker nothing."""

from __future__ import annotations

import numpy as np


def adascale_gain(sqr, var, scale):
    """The progress of one iteration at ``scale`` times the base batch, in base-batch iterations:
    ``(var + sqr) / (var / scale + sqr)``, with ``sqr`` the squared norm of the true gradient and
    ``var`` the variance of one base batch's gradient. Element-wise over numbers or arrays; 1
    where nothing was measured (``sqr + var <= 0``)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(sqr + var > 0, (var + sqr) / (var / scale + sqr), 1.0)
    return float(out) if np.ndim(out) == 0 else out
