"""Gradients computed in part on each rank of a group, summed once per step.

Tensor parallelism replicates some parameters over tp whose gradient each rank computes only in
part: a sequence-parallel norm's weight sees this rank's sequence shard, a replicated key/value
weight the rows of this rank's heads. Instead of an all-reduce per use and micro-batch (the
``f`` of Megatron-LM), :func:`mark_partial` records the group on the parameter
(:class:`~loom.parallel.placement.PartialSum`) and every data-parallel strategy sums the parts
in one all-reduce after its own reduction (:func:`sum_partial_grads`): with P marked elements of
b bytes, 2·P·b·(n-1)/n bytes per rank and step over a group of n.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from loom import comm
from loom.comm import CommMeter, Group
from loom.parallel.placement import PartialSum, place, placement_of


def mark_partial(p: torch.Tensor, group: Group, meter: CommMeter | None = None) -> torch.Tensor:
    """Mark a parameter replicated over ``group`` whose gradient each rank computes only in part
    (module docstring); its parts are summed once per step by :func:`sum_partial_grads`. Returns ``p``."""
    if comm.group_size(group) > 1:
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
