"""Tensor-parallel communication primitives as autograd functions with an explicit group.

The two conjugate operators of Megatron-LM (Shoeybi et al. 2019), and the sequence-parallel
pair of Korthikanti et al. 2022, each one collective in forward and its dual in backward:

    op                  forward                      backward
    f  copy_to_tp       identity                     all-reduce (sum) over tp
    g  reduce_from_tp   all-reduce (sum) over tp     identity
    gather_seq          all-gather along the seq dim reduce-scatter along the seq dim
    scatter_seq         reduce-scatter along seq     all-gather along the seq dim

Activations are batch-first ``(B, T, ...)``; the sequence dim is 1 and rank r of the group
holds rows ``[r*T/n, (r+1)*T/n)``. Every op returns its input unchanged (no autograd node) for
a group of size 1. Bytes are metered through :mod:`loom.comm` (ring volumes: an all-reduce of
S bytes moves 2·S·(n-1)/n per rank, an all-gather or reduce-scatter S·(n-1)/n).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch.autograd import Function

from loom import comm
from loom.comm import CommMeter, Group
from loom.parallel.placement import PartialSum, place, placement_of


def _size(group: Group) -> int:
    return comm.group_size(group)


# ----------------------------------------------------------------------------- plain collectives


def all_reduce_sum(x: torch.Tensor, group: Group, meter: CommMeter | None = None) -> torch.Tensor:
    """A summed copy of ``x`` over ``group`` (out of place; ``x`` is left untouched)."""
    out = x.contiguous().clone()
    comm.all_reduce(out, group, meter)
    return out


def all_gather_seq(x: torch.Tensor, group: Group, meter: CommMeter | None = None, async_op: bool = False):
    """(B, T/n, ...) on every rank -> (B, T, ...), shards concatenated in rank order along dim 1.

    With ``async_op`` returns ``(work, finish)``: wait on ``work`` then call ``finish()``.
    """
    n = _size(group)
    x = x.contiguous()
    buf = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)  # (n, B, T/n, ...)
    work = comm.all_gather(buf.view(-1), x.view(-1), group, meter, async_op=async_op)

    def finish() -> torch.Tensor:
        return buf.transpose(0, 1).reshape(x.shape[0], n * x.shape[1], *x.shape[2:])  # (B, T, ...)

    return (work, finish) if async_op else finish()


def reduce_scatter_seq(x: torch.Tensor, group: Group, meter: CommMeter | None = None, async_op: bool = False):
    """(B, T, ...) partial sums on every rank -> this rank's (B, T/n, ...) rows of their sum.

    With ``async_op`` returns ``(work, out)``: ``out`` is valid once ``work`` is waited on.
    """
    n = _size(group)
    B, T = x.shape[:2]
    if T % n:
        raise ValueError(f"sequence length {T} is not divisible by the tensor-parallel size {n}")
    chunks = x.reshape(B, n, T // n, *x.shape[2:]).transpose(0, 1).contiguous()  # (n, B, T/n, ...)
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    work = comm.reduce_scatter(out.view(-1), chunks.view(-1), group, meter, async_op=async_op)
    return (work, out) if async_op else out


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


class _GatherSeq(Function):
    """Forward all-gather along the sequence dim; backward reduce-scatter along it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, meter: CommMeter | None) -> torch.Tensor:
        ctx.group, ctx.meter = group, meter
        return all_gather_seq(x, group, meter)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_seq(grad, ctx.group, ctx.meter), None, None


class _ScatterSeq(Function):
    """Forward reduce-scatter along the sequence dim; backward all-gather along it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, meter: CommMeter | None) -> torch.Tensor:
        ctx.group, ctx.meter = group, meter
        return reduce_scatter_seq(x, group, meter)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_seq(grad, ctx.group, ctx.meter), None, None


def copy_to_tp(x: torch.Tensor, group: Group, meter: CommMeter | None = None) -> torch.Tensor:
    """f: identity forward, all-reduce backward. Put before a column-parallel region."""
    return x if _size(group) == 1 else _CopyToTP.apply(x, group, meter)


def reduce_from_tp(x: torch.Tensor, group: Group, meter: CommMeter | None = None) -> torch.Tensor:
    """g: all-reduce forward, identity backward. Put after a row-parallel region."""
    return x if _size(group) == 1 else _ReduceFromTP.apply(x, group, meter)


def gather_seq(x: torch.Tensor, group: Group, meter: CommMeter | None = None) -> torch.Tensor:
    """(B, T/n, ...) -> (B, T, ...): all-gather forward, reduce-scatter backward (enters a TP region)."""
    return x if _size(group) == 1 else _GatherSeq.apply(x, group, meter)


def scatter_seq(x: torch.Tensor, group: Group, meter: CommMeter | None = None) -> torch.Tensor:
    """(B, T, ...) partial sums -> (B, T/n, ...): reduce-scatter forward, all-gather backward."""
    return x if _size(group) == 1 else _ScatterSeq.apply(x, group, meter)


# ----------------------------------------------------------------------------- partial gradients


def mark_partial(p: torch.Tensor, group: Group, meter: CommMeter | None = None) -> torch.Tensor:
    """Mark a parameter replicated over tp whose gradient each rank computes only in part (a
    sequence-parallel norm's weight sees this rank's sequence shard; a replicated key/value weight
    the rows of this rank's heads). Instead of f's all-reduce per use and micro-batch, the parts
    are summed once per step by :func:`sum_partial_grads`. Returns ``p``."""
    if _size(group) > 1:
        place(p, partial=PartialSum(group, meter))
    return p


def sum_partial_grads(
    params, grad_of: Callable[[torch.Tensor], torch.Tensor | None], device: torch.device | None = None
) -> None:
    """Sum over tp, in one all-reduce, the gradients of the parameters :func:`mark_partial` marked,
    after the data-parallel reduction of the step: ``grad_of(p)`` is the whole gradient (replicated
    data parallelism) or this rank's shard of it (ZeRO; tp peers share one shard layout, so their
    pieces line up). Sums commute, so reducing over dp first and tp second equals Megatron's order.
    ``device``: where the sum crosses ranks when the gradients live elsewhere (host shards under offload)."""
    marked = [p for p in params if placement_of(p).partial is not None]
    if not marked:
        return
    partial = cast(PartialSum, placement_of(marked[0]).partial)  # not None: ``marked`` is filtered on it
    pieces = [g for g in map(grad_of, marked) if g is not None and g.numel() > 0]
    if not pieces:
        return
    flat = torch.cat([g.reshape(-1) for g in pieces])
    comm.all_reduce_via(flat, partial.group, device or flat.device, partial.meter)
    offset = 0
    for g in pieces:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
