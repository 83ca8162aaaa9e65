"""The gradient noise scale (``train.log_gns``): McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training", appendix A, the two-batch-size estimator.

For a batch of B samples, E|G_B|^2 = |G|^2 + tr(Sigma) / B (G the true gradient, Sigma the
per-sample covariance). Two batch sizes B_small < B_big give unbiased estimates

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

and the simple noise scale B_noise = tr(Sigma) / |G|^2 (sequences). Here B_big is the global batch
(|G_big| the step's gradient norm before clipping) and B_small one micro-batch: on a logged step each
data-parallel rank runs one extra forward/backward of its first micro-batch, without
communication, before the step; |G_small|^2 is the mean over ranks of its squared norm (one
all-reduce of three scalars).

Batch sizes count trained targets, in sequences: the loss is a mean over trained targets (chat data
trains answers only), so a micro-batch of c trained targets is b = c / t sequences, t = N / B_big the
mean trained targets per sequence of the global batch (N of them). Ranks' micro-batches differ in c,
and the mean over ranks of |G_b|^2 is |G|^2 + tr(Sigma) mean(1 / b_i): B_small = 1 / (t mean(1 / c_i)),
which is the micro-batch size when every target is trained. Cost: one micro-batch of compute per logged step, nothing otherwise. Per-row estimates
are noisy (either may be negative); average ``gns_g2`` and ``gns_trace`` over rows before dividing
(:func:`loom.cluster.jobs.gns_from_metrics`). Layouts: data parallel with whole gradients on every
rank (ZeRO 0 or 1, no tp/pp/cp/ep, no parameter servers), as ``config.validate`` requires.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from loom import comm
from loom.comm import Group
from loom.parallel.base import LossFn, Strategy, mean_over, sum_sq


def gns_estimate(g_small_sq: float, g_big_sq: float, b_small: float, b_big: float) -> dict[str, float]:
    """``gns_g2`` (|G|^2), ``gns_trace`` (tr Sigma) and ``gns`` (their ratio) from the module doc's formulas."""
    g2 = (b_big * g_big_sq - b_small * g_small_sq) / (b_big - b_small)
    trace = (g_small_sq - g_big_sq) / (1.0 / b_small - 1.0 / b_big)
    return {"gns_g2": g2, "gns_trace": trace, "gns": trace / g2 if g2 != 0 else math.nan}


def small_batch(
    model: nn.Module,
    strategy: Strategy,
    loss_fn: LossFn,
    micro_batches: Sequence[Sequence[torch.Tensor]],
    global_batch: int,
    group: Group,
) -> tuple[float, float]:
    """(|G_small|^2, B_small): this rank's gradient of its first micro-batch's mean loss, squared norm,
    averaged over ``group`` (the data-parallel ranks), and the small batch in sequences (module doc).
    Leaves the gradients zeroed."""
    from loom.model.loss import IGNORE_INDEX

    strategy.zero_grad()
    x, y, *packed = micro_batches[0]
    with strategy.no_sync():
        loss_fn(model(x, *packed), y).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    dev, f64 = strategy.comm_device, torch.float64
    mine = torch.stack([(b[1] != IGNORE_INDEX).sum() for b in micro_batches]).sum()  # this rank's targets
    c = (y != IGNORE_INDEX).sum().clamp(min=1)
    local = torch.stack([sum_sq(grads, dev).to(dev, f64), 1.0 / c.to(dev, f64), mine.to(dev, f64)])
    strategy.zero_grad()
    sq, inv_c, mean_mine = mean_over(local, group).tolist()  # one host sync, on a logged step
    per_sequence = mean_mine * comm.group_size(group) / global_batch  # t = N / B_big
    return sq, 1.0 / (per_sequence * inv_c) if per_sequence else math.nan  # nothing trained
