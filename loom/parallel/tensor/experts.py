"""An MoE layer's experts split over the tensor-parallel group (``parallel.expert_tp = "split"``).

Megatron-Core's expert tensor parallelism (= tp): each expert is cut like the dense MLP, over n
tp ranks, rank r holding

    w1, w3   rows [r·f/n, (r+1)·f/n) of every expert's (f, h)    (the stacked (E, f/n, h))
    w2       columns [r·f/n, (r+1)·f/n) of every (h, f)           (the stacked (E, h, f/n))
    shared   the shared experts' SwiGLU of S·f cut the same way
    router   whole (replicated)

so the experts' weights, gradients and optimizer state per rank are 1/n of ``replicate``'s (whole
experts on every tp rank). Every rank routes all the group's tokens (the same choices, weights and
capacity as one process on them), runs its f/n slice of each chosen expert (SwiGLU is elementwise
in f, so the slices' outputs are partial sums of the expert's), and the partial outputs are summed
over tp. With S = b·s·h·e the bytes of the group's hidden states and ρ = (n-1)/n, per layer and
micro-batch (one collective each, ring volumes per rank):

    no sp   forward  all-reduce of the output (g)                      2ρS
            backward all-reduce of the experts' input gradient (f)      2ρS
    sp      forward  all-gather of the sequence, reduce-scatter out    ρS + ρS
            backward reduce-scatter of the input gradient, all-gather  ρS + ρS

plus, in backward, an all-reduce of the routing weights' gradient (4·b·s·k bytes, fp32: 2ρ of that):
each rank's is <output gradient, its slice's partial row>, so they sum to the whole expert's. Full
recomputation repeats the entry's gather under sp, not the exit's sum (nothing saved needs it: PyTorch's
checkpoint stops before it). The router's input gradient is the same on every rank
(it saw the same tokens), so it is counted once: without sp it is added after f's all-reduce;
with sp each rank keeps its own sequence rows of it (:class:`_OwnRows`) before the gather's
reduce-scatter sums the experts' parts. No MoE gradient is partial: the router's is whole on each
rank, the experts' are their slices'. Under expert parallelism (:mod:`loom.parallel.expert`) each
tp rank sends its 1/n of the group's tokens' rows to the same tp rank of the other ep ranks, and the
tp ranks there pool what they received before computing their slices
(:mod:`loom.parallel.expert.tp_rows`, Megatron-Core's order): the all-to-all carries b·s·k/n rows
per rank, as many as ``replicate`` + sp's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.autograd import Function

from loom.model.moe import MoEFeedForward, SharedExperts
from loom.parallel.sequence import gather_seq, scatter_seq
from loom.parallel.tensor.comm import copy_to_tp, reduce_from_tp
from loom.parallel.tensor.shard import TPContext, sharded_param

__all__ = ["SplitTokens", "split_experts"]


class _OwnRows(Function):
    """Forward: identity on the gathered (B, T, ...) sequence; backward: only this rank's rows
    [r·T/n, (r+1)·T/n) of the gradient (zeros elsewhere), so the gather's reduce-scatter counts a
    gradient every rank computed alike once."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rank: int, n: int) -> torch.Tensor:
        ctx.rank, ctx.n = rank, n
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows = grad.shape[1] // ctx.n
        mine = slice(ctx.rank * rows, (ctx.rank + 1) * rows)
        out = torch.zeros_like(grad)
        out[:, mine] = grad[:, mine]
        return out, None, None


@dataclass
class SplitTokens:
    """:class:`~loom.model.moe.TokenSplit` over a tp group (module doc): the group's tokens in, the
    partial outputs summed out (all-reduce, or reduce-scatter along the sequence with sp)."""

    ctx: TPContext

    def inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.ctx
        if not c.sp:
            return x, copy_to_tp(x, c.group, c.meter)
        whole = gather_seq(x, c.group, c.meter)
        return _OwnRows.apply(whole, c.rank, c.size), whole

    def weights(self, w: torch.Tensor) -> torch.Tensor:
        return copy_to_tp(w, self.ctx.group, self.ctx.meter)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        c = self.ctx
        return scatter_seq(out, c.group, c.meter) if c.sp else reduce_from_tp(out, c.group, c.meter)


def _cut_linear(lin: nn.Linear, dim: int, ctx: TPContext) -> None:
    """``lin``'s weight becomes this rank's 1/n slice along ``dim`` (0: rows, 1: columns), in place."""
    lin.weight = sharded_param(lin.weight, dim, ctx)
    lin.out_features, lin.in_features = lin.weight.shape


def split_experts(moe: MoEFeedForward, ctx: TPContext) -> None:
    """Cut ``moe``'s experts (and shared experts) over ``ctx``'s group in place (module doc); the
    router stays whole. Parameter names are unchanged."""
    for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
        weights = getattr(moe, name)
        weights.weight = sharded_param(weights.weight, dim, ctx)
    if moe.shared is not None:
        shared = cast(SharedExperts, moe.shared)
        for lin, dim in ((shared.w1, 0), (shared.w3, 0), (shared.w2, 1)):
            _cut_linear(lin, dim, ctx)
    moe.split = SplitTokens(ctx)
