"""Routed rows across the tensor-parallel group of split experts (``parallel.expert_tp = split``).

With experts split over tp (:mod:`loom.parallel.tensor.experts`) and ep > 1, the tp ranks of a
group share the routed rows as Megatron-Core's dispatcher does: each tp rank sends through the ep
all-to-all only its 1/tp of the group's tokens (:func:`my_tokens`), and the ranks receiving them
pool what they received over tp before computing their f/tp slice of the experts:

    gather_rows    forward: rows of every tp rank, concatenated in rank order (R_q rows from rank q)
                   backward: the sum over tp of the gradient, rank q keeping its R_q rows
    scatter_rows   forward: the sum over tp of partial rows, rank q keeping its R_q rows
                   backward: the gradient's rows of every rank, concatenated

The counts R_q differ by rank: each message is padded to max_q R_q rows (one all-gather or
reduce-scatter of tp · max R_q · h elements). So the all-to-all carries b·s·k/tp rows per rank
instead of the tp group's b·s·k, and the tp group (a node's fast links) the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd import Function

from loom import comm
from loom.comm import CommMeter, Group

__all__ = ["TpRows", "gather_rows", "my_tokens", "scatter_rows"]


@dataclass(frozen=True)
class TpRows:
    """The tp group the rows are pooled over: this rank's place in it, and the meter."""

    group: Group
    rank: int
    size: int
    meter: CommMeter | None = None


def my_tokens(n_tokens: int, tp: TpRows) -> tuple[int, int]:
    """[lo, hi): the tokens this tp rank dispatches, its contiguous 1/tp of the group's ``n_tokens``."""
    per = -(-n_tokens // tp.size)
    return min(tp.rank * per, n_tokens), min((tp.rank + 1) * per, n_tokens)


def _gather(x: torch.Tensor, sizes: list[int], tp: TpRows) -> torch.Tensor:
    widest = max(sizes)
    mine = x.new_zeros(widest, *x.shape[1:])
    mine[: x.shape[0]] = x
    full = x.new_empty(tp.size * widest, *x.shape[1:])
    comm.all_gather(full, mine, tp.group, tp.meter)
    return torch.cat([full[q * widest : q * widest + n] for q, n in enumerate(sizes)])


def _scatter(x: torch.Tensor, sizes: list[int], tp: TpRows) -> torch.Tensor:
    widest, starts = max(sizes), [sum(sizes[:q]) for q in range(len(sizes))]
    padded = x.new_zeros(tp.size * widest, *x.shape[1:])
    for q, (at, n) in enumerate(zip(starts, sizes)):
        padded[q * widest : q * widest + n] = x[at : at + n]
    out = x.new_empty(widest, *x.shape[1:])
    comm.reduce_scatter(out, padded, tp.group, tp.meter)
    return out[: sizes[tp.rank]]


class _GatherRows(Function):
    @staticmethod
    def forward(ctx, x, sizes, tp):
        ctx.args = (sizes, tp)
        return _gather(x, sizes, tp)

    @staticmethod
    def backward(ctx, grad):
        return _scatter(grad.contiguous(), *ctx.args), None, None


class _ScatterRows(Function):
    @staticmethod
    def forward(ctx, x, sizes, tp):
        ctx.args = (sizes, tp)
        return _scatter(x, sizes, tp)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad.contiguous(), *ctx.args), None, None


def gather_rows(x: torch.Tensor, sizes: list[int], tp: TpRows) -> torch.Tensor:
    """Every tp rank's rows (``sizes[q]`` from rank q), concatenated; backward sums and splits them."""
    return _GatherRows.apply(x, sizes, tp)


def scatter_rows(x: torch.Tensor, sizes: list[int], tp: TpRows) -> torch.Tensor:
    """This rank's ``sizes[rank]`` rows of the sum over tp of ``x`` (the concatenated rows of every rank)."""
    return _ScatterRows.apply(x, sizes, tp)
