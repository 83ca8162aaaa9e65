"""The gradient noise scale (``train.log_gns``): McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training", appendix A, the two-batch-size estimator.

For a batch of B samples, E|G_B|^2 = |G|^2 + tr(Sigma) / B (G the true gradient, Sigma the
per-sample covariance). Two batch sizes B_small < B_big give unbiased estimates

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

and the simple noise scale B_noise = tr(Sigma) / |G|^2 (sequences). Here B_big is the global batch
(|G_big| the step's gradient norm before clipping) and B_small one micro-batch: on a logged step each
data-parallel rank runs one extra forward/backward of its first micro-batch, without
communication, before the step; |G_small|^2 is the mean over ranks of its squared norm (one scalar
all-reduce). Cost: one micro-batch of compute per logged step, nothing otherwise. Per-row estimates
are noisy (either may be negative); average ``gns_g2`` and ``gns_trace`` over rows before dividing
(:func:`loom.cluster.jobs.gns_from_metrics`). Layouts: data parallel with whole gradients on every
rank (ZeRO 0 or 1, no tp/pp/cp/ep, no parameter servers), as ``config.validate`` requires.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from loom.comm import Group
from loom.parallel.base import LossFn, Strategy, mean_over, sum_sq


def gns_estimate(g_small_sq: float, g_big_sq: float, b_small: float, b_big: float) -> dict[str, float]:
    """``gns_g2`` (|G|^2), ``gns_trace`` (tr Sigma) and ``gns`` (their ratio) from the module doc's formulas."""
    g2 = (b_big * g_big_sq - b_small * g_small_sq) / (b_big - b_small)
    trace = (g_small_sq - g_big_sq) / (1.0 / b_small - 1.0 / b_big)
    return {"gns_g2": g2, "gns_trace": trace, "gns": trace / g2 if g2 != 0 else math.nan}


def small_batch_sq(
    model: nn.Module, strategy: Strategy, loss_fn: LossFn, batch: Sequence[torch.Tensor], group: Group
) -> float:
    """|G_small|^2: this rank's gradient of one micro-batch's mean loss, squared norm, averaged over
    ``group`` (the data-parallel ranks). Leaves the gradients zeroed."""
    strategy.zero_grad()
    x, y, *packed = batch
    with strategy.no_sync():
        loss_fn(model(x, *packed), y).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = sum_sq(grads, strategy.comm_device)
    strategy.zero_grad()
    return float(mean_over(local, group))
