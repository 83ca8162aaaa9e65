"""What every tensor-parallel layer needs: the group and this rank's place in it
(:class:`TPContext`), and this rank's slice of a full weight (:func:`sharded_param`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loom.comm import CommMeter, Group
from loom.parallel.placement import place, setattr_placement, slice_of


@dataclass
class TPContext:
    """What every tensor-parallel layer needs: the group, this rank's place in it, the meter, sp."""

    group: Group
    rank: int
    size: int
    meter: CommMeter | None = None
    sp: bool = False


def sharded_param(full: torch.Tensor, dim: int, ctx: TPContext) -> nn.Parameter:
    """This rank's contiguous 1/n slice of ``full`` along ``dim``, placed with ``tp_dim``."""
    part, placement = slice_of(full, dim, ctx.rank, ctx.size)
    frozen = isinstance(full, nn.Parameter) and not full.requires_grad  # LoRA's base stays frozen
    p = nn.Parameter(part.clone(), requires_grad=not frozen)
    setattr_placement(p, placement)
    place(p, tp_dim=dim)
    return p
