"""One optimizer step: micro-batch forward/backward with accumulation, gradient sync, clip, update.

Shared by the trainer and the tests, so what is tested is what trains.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from loom import comm
from loom.comm import Group
from loom.parallel.tp_comm import sum_partial_grads


class Strategy(Protocol):
    """What a data-parallel / sharding strategy offers the step (DataParallel, ZeRO, FSDP, ...)."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Inside: backward accumulates locally, no communication."""

    def finish_sync(self) -> None:
        """After the last backward: wait for (or run) the gradient reduction."""

    def zero_grad(self) -> None: ...

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient norm over every rank's share, counted once; clip if max_norm > 0."""

    def step(self, lr: float) -> None:
        """Optimizer update at learning rate ``lr`` (and whatever re-gathering it implies)."""

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds: ``param_bytes``, ``grad_bytes``, ``optim_bytes``."""


@dataclass
class StepResult:
    loss: float  # mean loss over the global batch
    grad_norm: float  # global gradient norm before clipping


def grad_norm_sq(params: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """Σ g² in fp32 over the parameters' gradients, on their device (``device`` if there are none:
    a rank with no gradients still joins the collective that sums this, with a device tensor)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        where = device if device is not None else (params[0].device if len(params) else None)
        return torch.zeros((), dtype=torch.float32, device=where)
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)  # fp32 accumulation, also for half grads
    return torch.stack(norms).pow(2).sum()


def clip_grad_norm(
    params: Sequence[torch.Tensor], max_norm: float, sum_groups: Sequence[Group] = (), tp_group: Group = None
) -> float:
    """Global L2 norm of the gradients, then scale them by min(1, max_norm / norm) if max_norm > 0.

    norm^2 = sum over ``sum_groups`` of the local sums of squares (for sharded gradients; for
    replicated ones pass no group so each element counts once). With ``tp_group``, tensor-parallel
    shards (params with ``tp_shard_dim`` set) add their squares over it; the parameters replicated
    across tp (norm weights) count once.
    """
    device = params[0].device if len(params) else None
    if comm.group_size(tp_group) > 1:
        sharded = [p for p in params if getattr(p, "tp_shard_dim", None) is not None]
        sq = grad_norm_sq(sharded, device)
        comm.all_reduce(sq, tp_group)
        sq = sq + grad_norm_sq([p for p in params if getattr(p, "tp_shard_dim", None) is None], device)
    else:
        sq = grad_norm_sq(params, device)
    for g in sum_groups:
        comm.all_reduce(sq, g)
    norm = sq.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
    return float(norm)


def mean_over(value: torch.Tensor, group: Group) -> torch.Tensor:
    """Average a scalar over ``group`` (unmetered: bookkeeping, not training traffic)."""
    n = comm.group_size(group)
    if n > 1:
        value = value.clone()
        comm.all_reduce(value, group)
        value /= n
    return value


def train_step(
    model: nn.Module,
    strategy: Strategy,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    grad_clip: float,
    lr: float,
    dp_group: Group,
) -> StepResult:
    """Accumulate over the micro-batches (loss / k each), sync once, clip, step."""
    strategy.zero_grad()
    k = len(micro_batches)
    total = None
    for i, (x, y) in enumerate(micro_batches):
        ctx = strategy.no_sync() if i < k - 1 else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(model(x), y) / k
            loss.backward()
        total = loss.detach().float() if total is None else total + loss.detach().float()
    strategy.finish_sync()
    sum_partial_grads(model.parameters(), strategy)  # tp-partial gradients (sequence-parallel norms)
    # The logged loss is averaged over dp while the optimizer runs (unmetered bookkeeping).
    n = comm.group_size(dp_group)
    work = comm.all_reduce(total, dp_group, async_op=True) if n > 1 else None
    norm = strategy.clip_grad_norm(grad_clip)
    strategy.step(lr)
    if work is not None:
        work.wait()
    return StepResult(loss=float(total) / n, grad_norm=norm)


@torch.no_grad()
def evaluate(model: nn.Module, batches, loss_fn, dp_group: Group) -> float:
    """Mean loss over ``batches`` on this rank, averaged over the data-parallel group."""
    was_training = model.training
    model.eval()
    losses = [loss_fn(model(x), y).float() for x, y in batches]
    model.train(was_training)
    return float(mean_over(torch.stack(losses).mean(), dp_group))
