"""Building a strategy's sharded state from per-parameter placements.

Most strategies only need to say, for each parameter of the reference model, which local
tensor holds which region of it and how many ranks hold the same piece (a
:class:`Placement`); :func:`placement_state` then names the parameter and its Adam state
(``exp_avg``, ``exp_avg_sq`` shaped like the parameter, ``step`` a scalar) for the checkpoint.

Data parallelism (:class:`loom.parallel.data.checkpoint.ReplicatedState`): every parameter and its optimizer state is
replicated over the ``dp`` group. Replica ``i`` of ``n`` writes rows ``[i·R/n, (i+1)·R/n)``
of each tensor (R = its first dimension; scalars by replica 0), so the n ranks write 1/n of
the state each, in parallel, and the checkpoint holds one copy. On load the n ranks of the
``dp`` group (an expert's: its ``edp`` group) form the piece's read group: each reads the same
1/n from disk and they all-gather the rest (:mod:`~loom.checkpoint.shared_read`), so a rank
reads ≈ (P + S_opt)/n bytes of the P parameter and S_opt optimizer bytes it holds (with tensor
parallelism, of its tp slice), not all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from loom.checkpoint.format import CheckpointError
from loom.checkpoint.protocol import (
    Flat,
    ReadGroup,
    Region,
    ShardedTensor,
    full_box,
)


@dataclass
class Placement:
    """Where a local tensor sits in the global parameter: region and replication (i of n)."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    region: Region
    replica: tuple[int, int] = (0, 1)
    read_group: ReadGroup | None = None  # the holders of this same piece, which load it together

    @classmethod
    def replicated(
        cls, t: torch.Tensor, replica: tuple[int, int] = (0, 1), read_group: ReadGroup | None = None
    ) -> Placement:
        return cls(t, tuple(t.shape), full_box(tuple(t.shape)), replica, read_group)

    @property
    def holds_origin(self) -> bool:
        """True on exactly one holder per replica set: the piece that holds element 0."""
        r = self.region
        if isinstance(r, Flat):
            return r.start == 0 and r.length > 0 and (r.within is None or not any(r.within.offsets))
        return all(o == 0 for o in r.offsets)


def unique_named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters then persistent buffers, each shared tensor once under its first name."""
    keys = set(module.state_dict().keys())
    seen: set[int] = set()
    out = []
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if id(t) in seen or name not in keys:
            continue
        seen.add(id(t))
        out.append((name, t))
    return out


def ensure_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam/AdamW state for parameters that have none yet (as the first step would).

    Loading needs the state tensors to exist so they can be filled in place.
    """
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam
        raise CheckpointError(
            f"optimizer {type(optimizer).__name__}: only Adam/AdamW state can be created for loading"
        )
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in optimizer.param_groups:
        on_device = group.get("capturable") or group.get("fused")
        for p in group["params"]:
            st = optimizer.state[p]
            if st:
                continue
            st["step"] = torch.zeros((), dtype=scalar, device=p.device if on_device else "cpu")
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def placement_state(
    placements: dict[str, Placement], optimizer: torch.optim.Optimizer | None = None
) -> dict[str, ShardedTensor]:
    """``model.<fqn>`` for every placement, ``optim.<fqn>.<key>`` for its optimizer state."""
    out: dict[str, ShardedTensor] = {}
    by_id = {}
    for fqn, pl in placements.items():
        out[f"model.{fqn}"] = ShardedTensor(
            pl.tensor.detach(), pl.global_shape, pl.region, pl.replica, pl.read_group
        )
        by_id[id(pl.tensor)] = (fqn, pl)
    if optimizer is None:
        return out
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                continue
            fqn, pl = by_id[id(p)]
            for key, v in optimizer.state.get(p, {}).items():
                if not torch.is_tensor(v):
                    continue
                if v.dim() == 0:  # a counter shared by every holder: exactly one of them writes it
                    writer = pl.holds_origin and pl.replica[0] == 0
                    out[f"optim.{fqn}.{key}"] = ShardedTensor(
                        v, (), full_box(()), (0, 1) if writer else (1, 2), pl.read_group
                    )
                elif tuple(v.shape) == tuple(pl.tensor.shape):
                    out[f"optim.{fqn}.{key}"] = ShardedTensor(
                        v, pl.global_shape, pl.region, pl.replica, pl.read_group
                    )
                else:
                    raise CheckpointError(
                        f"optimizer state {fqn}.{key}: shape {tuple(v.shape)} is not the parameter's"
                    )
    return out


def _rank_size(group) -> tuple[int, int]:
    """(rank, size) in ``group``; (0, 1) for None (a one-process dimension)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def read_group(group, device: torch.device) -> ReadGroup | None:
    """The ranks of ``group`` as the read group of pieces they all hold; None for one rank."""
    rank, size = _rank_size(group)
    return ReadGroup(group, rank, size, torch.device(device)) if size > 1 else None
