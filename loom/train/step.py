"""One training step: forward/backward over the micro-batches, then the one optimizer step.

Shared by the trainer and the tests, so what is tested is what trains. A :class:`Run` says how
this rank computes forward and backward (the plain loop here, or the pipeline's schedule, which
replaces only that); every layout then updates through :func:`optimizer_step`:

    finish_sync  ->  (fp16) overflow agreed over the world: skip  ->  clip  ->  non-finite norm:
    refuse  ->  step(lr, 1/S)  ->  (fp16) scale update
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
from torch import nn

from loom import comm
from loom.checkpoint.protocol import ShardedTensor, ShardReader
from loom.comm import Group
from loom.model import moe
from loom.parallel.base import (
    LossFn,
    StepResult,
    Strategy,
    Update,
    any_nonfinite,
    clip_grad_norm,
    token_mean,
)
from loom.parallel.expert.parallelize import rebalance_experts
from loom.train.health import NonFiniteError
from loom.train.timings import phase

__all__ = [
    "Run",
    "StepResult",
    "evaluate",
    "forward_backward",
    "optimizer_step",
    "plain_run",
    "scaler_stats",
    "train_step",
]

Batch = tuple[torch.Tensor, ...]  # (tokens, targets), or with data.pack (tokens, targets, positions)


class LossScaler(Protocol):
    """The fp16 loss scaler as the step and the checkpoints see it
    (:class:`loom.memory.loss_scale.DynamicLossScaler`)."""

    scale: float
    skipped: int

    @property
    def backward_scale(self) -> float: ...

    @property
    def unscale(self) -> float: ...

    @property
    def overflow_bound(self) -> float: ...

    def update(self, overflow: bool) -> None: ...

    def sharded_state(self) -> dict[str, ShardedTensor]: ...

    def load_sharded(self, reader: ShardReader) -> None: ...


ForwardBackward = Callable[[Sequence[Batch], LossFn, Update, Group], StepResult]
Evaluate = Callable[[Sequence[Batch], LossFn, Group], float]


@dataclass
class Run:
    """What one rank trains: built by :func:`loom.train.build.build_run` (or :func:`plain_run`)."""

    model: nn.Module  # what this rank runs: the whole (possibly tp/ep-sharded) model, or its pipeline stages
    strategy: Strategy
    loss_fn: LossFn  # the loss on this model's output (vocabulary-sharded logits under tp)
    forward_backward: ForwardBackward
    evaluate: Evaluate
    scaler: LossScaler | None = None
    scaled_loss_fn: LossFn | None = None  # fp16: ``loss_fn`` whose backward is multiplied by the loss scale

    @property
    def train_loss_fn(self) -> LossFn:
        """The loss the backward runs on: scaled by the loss scale under fp16, else ``loss_fn``."""
        return self.scaled_loss_fn or self.loss_fn


def scaler_stats(scaler: LossScaler | None) -> dict[str, float]:
    """``loss_scale`` and ``skipped_steps`` for the metrics row (empty without loss scaling)."""
    return {} if scaler is None else {"loss_scale": scaler.scale, "skipped_steps": scaler.skipped}


def plain_run(model: nn.Module, strategy: Strategy, loss_fn: LossFn, scaler: LossScaler | None = None) -> Run:
    """A run without pipeline parallelism: the micro-batch loop of :func:`forward_backward`."""
    return Run(
        model, strategy, loss_fn, partial(forward_backward, model, strategy), partial(evaluate, model), scaler
    )


def optimizer_step(strategy: Strategy, lr: float, max_norm: float, scaler: LossScaler | None = None) -> float:
    """Finish the gradient sync, clip, update; returns the gradient norm before clipping.

    With a loss scaler (fp16): an inf/NaN gradient on any rank skips the update on every rank
    (returns inf) and lowers the scale. Without one, a non-finite norm raises
    :class:`NonFiniteError` before the update, parameters untouched.
    """
    with phase("comm_wait"):  # the exposed part of the gradient reduction
        strategy.finish_sync()
    with phase("optimizer"):
        unscale = 1.0
        if scaler is not None:
            if any_nonfinite(strategy.grads(), strategy.comm_device, scaler.overflow_bound):
                scaler.update(True)
                return math.inf
            unscale = scaler.unscale
        norm = clip_grad_norm(strategy, max_norm, unscale)
        if not math.isfinite(norm):
            raise NonFiniteError(
                f"non-finite gradient norm ({norm}): update skipped, parameters untouched; stopping "
                "(lower train.lr, check the data, or resume from a checkpoint)"
            )
        strategy.step(lr, unscale)
        if scaler is not None:
            scaler.update(False)
    return norm


def forward_backward(
    model: nn.Module,
    strategy: Strategy,
    micro_batches: Sequence[Batch],
    loss_fn: LossFn,
    update: Update,
    loss_group: Group,
) -> StepResult:
    """Accumulate over the micro-batches (loss / k each, no communication before the last), then
    ``update``, while the logged loss is averaged over ``loss_group`` (unmetered bookkeeping)."""
    k = len(micro_batches)
    total = torch.zeros(())
    for i, (x, y, *packed) in enumerate(micro_batches):  # packed data: (x, y, positions)
        with strategy.no_sync() if i < k - 1 else contextlib.nullcontext():
            with phase("forward"):
                loss = loss_fn(model(x, *packed), y) / k
            with phase("backward"):
                loss.backward()
        total = loss.detach().float() if i == 0 else total + loss.detach().float()
    n = comm.group_size(loss_group)
    work = comm.all_reduce(total, loss_group, async_op=True) if n > 1 else None
    norm = update()
    if work is not None:
        work.wait()
    return StepResult(loss=float(total) / n, grad_norm=norm)


def token_weighted(loss_fn: LossFn, micro_batches: Sequence[Batch], group: Group) -> LossFn:
    """``loss_fn`` (the mean over a micro-batch's trained targets) turned into that micro-batch's share
    of the mean over every trained target of the global batch: with c_i the micro-batch's trained
    targets, k micro-batches per rank, n ranks in ``group`` (dp·cp, whose gradients are averaged) and
    N = Σ c_i over all of them (one all-reduce, issued before the first forward)::

        loss_i · c_i · k n / N   ->   / k (accumulation), / n (the gradient average)   ->   Σ_i sum_i / N

    so masked data (chat: only answers trained) gives one process's loss and gradients whatever the
    micro-batch size, dp or cp, as a batch whose targets are all trained did before (there c_i k n = N
    and the factor is 1)."""
    from loom.model.loss import IGNORE_INDEX

    counts = torch.stack([(b[1] != IGNORE_INDEX).sum() for b in micro_batches])
    local = counts.sum().to(torch.float64)
    total = local.clone()
    n = comm.group_size(group)
    work = comm.all_reduce(total, group, async_op=True) if n > 1 else None
    arrived: list[bool] = []
    kn = float(len(micro_batches) * n)

    def weighted(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not arrived:
            if work is not None:
                work.wait()
            arrived.append(True)
        loss = loss_fn(out, targets)
        # in float64, c_i k n and N are exact integers: a batch all trained gets exactly 1
        c = (targets != IGNORE_INDEX).sum().to(torch.float64)
        return loss * (c * kn / total.to(c.device).clamp(min=1)).to(loss.dtype)

    return weighted


def train_step(
    run: Run, micro_batches: Sequence[Batch], grad_clip: float, lr: float, loss_group: Group
) -> StepResult:
    """One optimizer step of ``run`` on this rank's micro-batches of the global batch."""
    run.strategy.zero_grad()
    # MoE aux losses get each micro-batch loss's backward factor; bias balancing updates after the step
    moe.begin_step(
        run.model, (run.scaler.backward_scale if run.scaler is not None else 1.0) / max(1, len(micro_batches))
    )
    asynchronous = bool(
        getattr(run.strategy, "asynchronous", False)
    )  # PipeDream, 2BW: an update per micro-batch
    res = run.forward_backward(
        micro_batches,
        run.train_loss_fn if asynchronous else token_weighted(run.train_loss_fn, micro_batches, loss_group),
        lambda: optimizer_step(run.strategy, lr, grad_clip, run.scaler),
        loss_group,
    )
    moe.end_step(run.model)
    rebalance_experts(run.model)  # expert parallelism: replicate the hot experts (moe.rebalance_every)
    return res


@torch.no_grad()
def evaluate(model: nn.Module, batches: Sequence[Batch], loss_fn: LossFn, dp_group: Group) -> float:
    """Mean loss over every trained target of ``batches`` on the data-parallel group (:func:`token_mean`)."""
    was_training = model.training
    model.eval()
    losses = [loss_fn(model(x, *packed), y).float() for x, y, *packed in batches]
    model.train(was_training)
    return float(token_mean(losses, [b[1] for b in batches], dp_group))
