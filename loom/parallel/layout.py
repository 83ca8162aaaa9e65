"""Flat, aligned, equally sharded parameter buffers: the storage layout of every ZeRO stage and of
the parameter server's shards.

A group of parameters (a stage-1/2 bucket or a stage-3 unit) is laid end to end in one flat
buffer of Φ_g elements, then padded with zeros to

    Φ_g' = ceil(Φ_g / (N·a)) · N·a,      a = ALIGN_BYTES / bytes per element,

so that it splits into N equal shards of Φ_g'/N elements, each starting on an ALIGN_BYTES
boundary. Rank r of the sharding group owns elements [r·Φ_g'/N, (r+1)·Φ_g'/N). Padding is at
most N·a - 1 elements per group; padded elements hold zeros in parameters, gradients and Adam
state, so they never change and never add to the gradient norm.

Parameters keep their identity (the same ``nn.Parameter`` objects stay registered in the
module); only their ``.data`` becomes a view into the flat buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from loom.optim.groups import param_groups
from loom.parallel.placement import placement_of

ALIGN_BYTES = 16  # shard starts on 16-byte boundaries: the vector width of CPU kernels, NCCL's preference


def tied_copy(module: nn.Module) -> frozenset[int]:
    """Ids of the parameters that must sit alone in their flat buffer: a pipeline rank's copy of the
    tied embedding/head matrix (``module.tied_weight()``). The first and the last stage then shard
    their copies alike, so the pipeline can sum the two copies' reduced gradient shards element
    for element."""
    tied_weight = getattr(module, "tied_weight", None)
    tied = tied_weight() if callable(tied_weight) else None
    return frozenset() if tied is None else frozenset({id(tied)})


def unique_params(module: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters in registration order, each shared (tied) parameter once."""
    seen: set[int] = set()
    out = []
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def frozen_state(module: nn.Module) -> dict[str, int]:
    """``{"frozen_bytes": b}``: the bytes of the frozen parameters (LoRA's base, QLoRA's NF4 tensors),
    each shared one once; empty when there are none (a state_bytes entry only fine-tuning has)."""
    frozen = {id(p): p for p in module.parameters() if not p.requires_grad}
    total = sum(p.numel() * p.element_size() for p in frozen.values())
    return {"frozen_bytes": total} if total else {}


def decayed_ids(module: nn.Module) -> set[int]:
    """ids of the parameters AdamW decays: the rule of :func:`loom.optim.groups.param_groups`."""
    return {id(p) for p in param_groups(module, 1.0)[0]["params"]}


def padded_numel(numel: int, world: int, element_size: int) -> int:
    """Φ' = ceil(Φ / (N·a)) · N·a with a = ALIGN_BYTES / element_size (at least 1)."""
    unit = world * max(1, ALIGN_BYTES // element_size)
    return -(-numel // unit) * unit


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in the flat buffer."""

    offset: int
    numel: int
    decay: bool  # AdamW weight decay applies (ndim >= 2)
    tp_dim: int | None  # the tensor-parallel shard dim of the parameter (None: replicated over tp)
    rows: int | None = None  # real rows of the global parameter (a padded vocabulary's V; None: all)

    @property
    def tp_sharded(self) -> bool:
        return self.tp_dim is not None


class FlatLayout:
    """Offsets of ``params`` in one flat buffer, padded for ``world`` equal shards; ``rank``'s range."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        world: int,
        rank: int,
        decayed: set[int],
        device: torch.device | None = None,
    ) -> None:
        """``device``: where the buffer lives, for parameters still on the meta device."""
        if not params:
            raise ValueError("FlatLayout needs at least one parameter")
        self.params = list(params)
        self.dtype = params[0].dtype
        self.device = device if params[0].is_meta and device is not None else params[0].device
        self.world, self.rank = world, rank
        self.slots: list[Slot] = []
        off = 0
        for p in self.params:
            if p.dtype != self.dtype or (p.device != self.device and not p.is_meta):
                raise ValueError("a flat buffer holds parameters of one dtype and device")
            pl = placement_of(p)
            rows = pl.origin.rows if pl.origin is not None else None
            self.slots.append(Slot(off, p.numel(), id(p) in decayed, pl.tp_dim, rows))
            off += p.numel()
        self.numel = off  # Φ_g
        self.padded = padded_numel(off, world, params[0].element_size())  # Φ_g'
        self.shard_numel = self.padded // world
        self.start = rank * self.shard_numel
        self.end = self.start + self.shard_numel

    def local_ranges(self, keep: Callable[[Slot], bool]) -> list[tuple[int, int]]:
        """Shard-local [lo, hi) runs covered by the parameters whose slot satisfies ``keep``, merged."""
        runs: list[tuple[int, int]] = []
        for s in self.slots:
            if not keep(s):
                continue
            lo, hi = max(s.offset, self.start), min(s.offset + s.numel, self.end)
            if lo >= hi:
                continue
            lo, hi = lo - self.start, hi - self.start
            if runs and runs[-1][1] == lo:
                runs[-1] = (runs[-1][0], hi)
            else:
                runs.append((lo, hi))
        return runs

    def new_flat(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.zeros(self.padded, dtype=dtype or self.dtype, device=self.device)

    def new_shard(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.zeros(self.shard_numel, dtype=dtype or self.dtype, device=self.device)

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a flat buffer laid out like this one (a view)."""
        return flat[self.start : self.end]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view into ``flat``, in its own shape."""
        return [flat[s.offset : s.offset + s.numel].view_as(p) for p, s in zip(self.params, self.slots)]

    @torch.no_grad()
    def bind(
        self, flat: torch.Tensor, fill: Callable[[torch.Tensor, tuple[int, int]], torch.Tensor] | None = None
    ) -> None:
        """Copy the parameters' values into ``flat`` and make each ``p.data`` a view of it; a parameter
        still on the meta device becomes a view of ``flat`` in place, and only the rows of it that
        reach this rank's shard are filled, ``fill(p, (r0, r1))`` (the rest of ``flat`` is the other
        ranks' and stays zero: from a checkpoint a rank reads about 1/N of each unit; the init draws
        each parameter its shard touches whole, as its random stream is the whole parameter's)."""
        from loom.parallel.materialize import swap_in

        for p, v, s in zip(self.params, self.views(flat), self.slots):
            if p.is_meta:
                if fill is None:
                    raise ValueError("a parameter on the meta device and nothing to initialize it with")
                lo, hi = max(s.offset, self.start) - s.offset, min(s.offset + s.numel, self.end) - s.offset
                if lo < hi:
                    if p.dim() == 0:
                        raise ValueError("ZeRO-3: a 0-dimensional parameter cannot be filled by rows")
                    row = s.numel // p.shape[0]  # elements per row along dim 0
                    r0, r1 = lo // row, -(-hi // row)
                    v[r0:r1].copy_(fill(p, (r0, r1)))
                swap_in(p, v.new_empty(0))  # a real parameter first (its own version counter), then the view
                p.data = v
            else:
                v.copy_(p.data)
                p.data = v
