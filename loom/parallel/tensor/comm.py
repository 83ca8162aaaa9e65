"""Tensor-parallel communication primitives as autograd functions with an explicit group.

The two conjugate operators of Megatron-LM (Shoeybi et al. 2019), each one collective in forward
and its dual in backward:

    op                  forward                      backward
    f  copy_to_tp       identity                     all-reduce (sum) over tp
    g  reduce_from_tp   all-reduce (sum) over tp     identity
       sum_over_tp      all-reduce (sum) over tp     all-reduce (sum) over tp

``sum_over_tp`` is for a value every rank's loss depends on (OLMo-2's q/k sum of squares over the
head shards): s = Σ_r x_r, so dL/dx_r = Σ_r' dL_r'/ds, the gradient's sum over the group.

The sequence-parallel pair (``gather_seq``, ``scatter_seq``) is shared with context parallelism,
in :mod:`loom.parallel.sequence`; gradients summed once per step (``mark_partial``) in
:mod:`loom.parallel.partial`. Every op returns its input unchanged (no autograd node) for a
group of size 1. Bytes are metered through :mod:`loom.comm` (ring volume: an all-reduce of S
bytes moves 2·S·(n-1)/n per rank).
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from loom import comm
from loom.comm import CommMeter, Group


def _size(group: Group) -> int:
    return comm.group_size(group)


# ----------------------------------------------------------------------------- plain collectives


def all_reduce_sum(x: torch.Tensor, group: Group, meter: CommMeter | None = None) -> torch.Tensor:
    """A summed copy of ``x`` over ``group`` (out of place; ``x`` is left untouched)."""
    out = x.contiguous().clone()
    comm.all_reduce(out, group, meter)
    return out


# ----------------------------------------------------------------------------- autograd functions


class _CopyToTP(Function):
    """f: forward identity; backward all-reduce (sum) of the gradient over the group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, meter: CommMeter | None) -> torch.Tensor:
        ctx.group, ctx.meter = group, meter
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce_sum(grad, ctx.group, ctx.meter), None, None


class _ReduceFromTP(Function):
    """g: forward all-reduce (sum) over the group; backward identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, meter: CommMeter | None) -> torch.Tensor:
        return all_reduce_sum(x, group, meter)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class _SumOverTP(Function):
    """forward all-reduce (sum) over the group; backward all-reduce (sum) of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, meter: CommMeter | None) -> torch.Tensor:
        ctx.group, ctx.meter = group, meter
        return all_reduce_sum(x, group, meter)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce_sum(grad, ctx.group, ctx.meter), None, None


def copy_to_tp(x: torch.Tensor, group: Group, meter: CommMeter | None = None) -> torch.Tensor:
    """f: identity forward, all-reduce backward. Put before a column-parallel region."""
    return x if _size(group) == 1 else _CopyToTP.apply(x, group, meter)


def reduce_from_tp(x: torch.Tensor, group: Group, meter: CommMeter | None = None) -> torch.Tensor:
    """g: all-reduce forward, identity backward. Put after a row-parallel region."""
    return x if _size(group) == 1 else _ReduceFromTP.apply(x, group, meter)


def sum_over_tp(x: torch.Tensor, group: Group, meter: CommMeter | None = None) -> torch.Tensor:
    """Σ over the group in forward and of the gradient in backward (a sum every rank uses)."""
    return x if _size(group) == 1 else _SumOverTP.apply(x, group, meter)
