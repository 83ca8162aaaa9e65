"""The pipeline's forward and backward, and its evaluation: what the pipeline replaces in a step.

:func:`forward_backward` runs this rank's action list over the micro-batches (loss / m each);
at every STEP action it calls ``update`` (the shared :func:`loom.train.step.optimizer_step`:
once, at the end, for synchronous schedules; several times for PipeDream and 2BW, which then
zero the gradients for the next update). The loss is computed on the last stage, averaged over
dp, and broadcast over pp.

Micro-batches: the pipeline's micro-batches are the gradient-accumulation micro-batches,
m = global_batch / (micro_batch · dp); every pipeline rank of a data-parallel replica reads the
same ones (the first stage uses the tokens, the last the targets).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from loom import comm
from loom.comm import Group
from loom.parallel.base import LossFn, StepResult, Update, mean_over, token_mean
from loom.parallel.pipeline.runtime import Batch
from loom.parallel.pipeline.schedules import Action
from loom.parallel.pipeline.stage import PipelineModule
from loom.parallel.pipeline.strategy import PipelineStrategy


def forward_backward(
    pipe: PipelineModule,
    strategy: PipelineStrategy,
    micro_batches: Sequence[Batch],
    loss_fn: LossFn,
    update: Update,
    loss_group: Group,
) -> StepResult:
    """One step's forward and backward through the pipeline, with ``update`` at each STEP."""
    norms: list[float] = []

    def on_step(_: Action) -> None:
        norms.append(update())
        if strategy.asynchronous:
            strategy.zero_grad()

    stats = strategy.run(micro_batches, loss_fn, on_step)
    loss = _last_stage_mean(pipe, loss_group, list(stats.losses.values()))
    if strategy.asynchronous:  # root-mean-square of this step's per-update stage norms, summed over stages
        sq = torch.tensor(
            sum(n * n for n in norms) / max(1, len(norms)),
            dtype=torch.float64,
            device=next(pipe.parameters()).device,
        )
        comm.all_reduce(sq, pipe.group)
        return StepResult(loss=loss, grad_norm=math.sqrt(float(sq)))
    return StepResult(loss=loss, grad_norm=norms[-1])


def _last_stage_mean(
    pipe: PipelineModule,
    dp_group: Group,
    losses: list[torch.Tensor],
    targets: list[torch.Tensor] | None = None,
) -> float:
    """Mean of the last stage's losses, averaged over dp (with ``targets``: over every trained target,
    :func:`~loom.parallel.base.token_mean`), known on every pipeline rank."""
    device = next(pipe.parameters()).device
    value = torch.zeros((), dtype=torch.float32, device=device)
    if pipe.is_last:
        if targets is None:  # training: the losses are already weighted by their targets (token_weighted)
            value = mean_over(torch.stack(losses).float().mean(), dp_group)
        else:
            value = token_mean(losses, targets, dp_group)
    comm.broadcast(value, (pipe.n_stages - 1) % pipe.p, pipe.group)
    return float(value)


@torch.no_grad()
def evaluate(pipe: PipelineModule, batches: Sequence[Batch], loss_fn: LossFn, dp_group: Group) -> float:
    """Mean loss over ``batches`` (as :func:`loom.train.step.evaluate`): a forward-only pipeline,
    each micro-batch through the stages in order (sends never block, so no deadlock)."""
    was_training = pipe.training
    p, dim, dtype = pipe.p, pipe.cfg.dim, next(pipe.parameters()).dtype
    losses, targets, works, keep = [], [], [], []
    pipe.eval()
    for x, y, *packed in batches:  # packed data: (x, y, positions)
        for s in pipe.stage_ids:
            stage = pipe.stage(s)
            if stage.is_first:
                h = stage(x, *packed)
            else:
                h = torch.empty(x.shape[0], x.shape[1] // pipe.seq_div, dim, dtype=dtype, device=x.device)
                group, peer = pipe.link((s - 1) % p, pipe.rank)
                for w in comm.batch_p2p([], [(h, peer)], group):
                    w.wait()
                h = stage(h, *packed)
            if stage.is_last:
                losses.append(loss_fn(h, y).float())
                targets.append(y)
            else:
                group, peer = pipe.link(pipe.rank, (s + 1) % p)
                works += comm.batch_p2p([(h, peer)], [], group)
                keep.append(h)
    for w in works:
        w.wait()
    pipe.train(was_training)
    return _last_stage_mean(pipe, dp_group, losses, targets)
