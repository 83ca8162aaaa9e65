"""The checkpoint adapter of replicated data parallelism (the layout: :mod:`loom.checkpoint.replicated`)."""

from __future__ import annotations

import torch
from torch import nn

from loom.checkpoint.protocol import Box, ShardedTensor, ShardReader
from loom.checkpoint.replicated import (
    Placement,
    _rank_size,
    ensure_adam_state,
    placement_state,
    read_group,
    unique_named_tensors,
)
from loom.parallel.placement import expert_geometry, placement_of, tp_geometry


class ReplicatedState:
    """:class:`Shardable` state of :class:`~loom.parallel.data.strategy.DataParallel` (module doc of
    :mod:`loom.checkpoint.replicated`).

    With tensor parallelism underneath (``tp_group``), parameters placed with ``tp_dim`` are
    this rank's contiguous 1/tp slice along that dim (a Box of the global tensor, replicated over
    dp); untagged ones (norms, replicated key/value heads) are replicated over tp·dp.
    """

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer | None, group=None, tp_group=None
    ) -> None:
        self.module, self.optimizer = module, optimizer
        self.index, self.count = _rank_size(group)
        self.tp_rank, self.tp = _rank_size(tp_group)
        self.device = next(module.parameters(), torch.empty(0)).device
        self.read_group = read_group(group, self.device)

    def placements(self) -> dict[str, Placement]:
        out = {}
        everywhere = (self.tp_rank * self.count + self.index, self.tp * self.count)
        for name, t in unique_named_tensors(self.module):
            if isinstance(t, nn.Parameter) and not t.requires_grad:
                continue  # frozen (LoRA's base): rebuilt from the base the run references, not saved
            expert = placement_of(t).expert
            if expert is not None:  # this rank's experts (rows along dim 0), repeated over its edp group
                shape, offsets = expert_geometry(t, self.tp_rank, self.tp)
                e_rank, e_size = _rank_size(expert.edp)
                whole = placement_of(t).tp_dim is None  # replicated over tp (else split: tp peers differ)
                out[name] = Placement(
                    t,
                    shape,
                    Box(offsets, tuple(t.shape)),
                    (self.tp_rank * e_size + e_rank, self.tp * e_size) if whole else (e_rank, e_size),
                    read_group(expert.edp, self.device),
                )
                continue
            shape, tp_offsets = tp_geometry(t, self.tp_rank, self.tp)
            if tp_offsets is None:
                out[name] = Placement.replicated(t, everywhere, self.read_group)
                continue
            out[name] = Placement(
                t, shape, Box(tp_offsets, tuple(t.shape)), (self.index, self.count), self.read_group
            )
        return out

    def sharded_state(self) -> dict[str, ShardedTensor]:
        """Parameters and Adam state (created as zeros if no step ran yet, so every checkpoint has it)."""
        if self.optimizer is not None:
            ensure_adam_state(self.optimizer)
        return placement_state(self.placements(), self.optimizer)

    def load_sharded(self, reader: ShardReader) -> None:
        reader.fill(self.sharded_state())
