"""Sequence-sharded activations: gathering and scattering along the sequence dim, as autograd
functions with an explicit group.

Tensor parallelism's sequence-parallel pair (Korthikanti et al. 2022) and context parallelism's
all-gather of keys and values both cut activations the same way. Each op runs one collective in
forward and its dual in backward:

    op             forward                        backward
    gather_seq     all-gather along the seq dim   reduce-scatter along the seq dim
    scatter_seq    reduce-scatter along seq       all-gather along the seq dim

Activations are batch-first ``(B, T, ...)``; the sequence dim is 1 and rank r of the group
holds rows ``[r*T/n, (r+1)*T/n)``. Every op returns its input unchanged (no autograd node) for
a group of size 1. Bytes are metered through :mod:`loom.comm` (ring volumes: an all-gather or
reduce-scatter of S bytes moves S·(n-1)/n per rank).
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from loom import comm
from loom.comm import CommMeter, Group


def all_gather_seq(x: torch.Tensor, group: Group, meter: CommMeter | None = None, async_op: bool = False):
    """(B, T/n, ...) on every rank -> (B, T, ...), shards concatenated in rank order along dim 1.

    With ``async_op`` returns ``(work, finish)``: wait on ``work`` then call ``finish()``.
    """
    n = comm.group_size(group)
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
    n = comm.group_size(group)
    B, T = x.shape[:2]
    if T % n:
        raise ValueError(f"sequence length {T} is not divisible by the group size {n}")
    chunks = x.reshape(B, n, T // n, *x.shape[2:]).transpose(0, 1).contiguous()  # (n, B, T/n, ...)
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    work = comm.reduce_scatter(out.view(-1), chunks.view(-1), group, meter, async_op=async_op)
    return (work, out) if async_op else out


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


def gather_seq(x: torch.Tensor, group: Group, meter: CommMeter | None = None) -> torch.Tensor:
    """(B, T/n, ...) -> (B, T, ...): all-gather forward, reduce-scatter backward (enters a TP region)."""
    return x if comm.group_size(group) == 1 else _GatherSeq.apply(x, group, meter)


def scatter_seq(x: torch.Tensor, group: Group, meter: CommMeter | None = None) -> torch.Tensor:
    """(B, T, ...) partial sums -> (B, T/n, ...): reduce-scatter forward, all-gather backward."""
    return x if comm.group_size(group) == 1 else _ScatterSeq.apply(x, group, meter)
