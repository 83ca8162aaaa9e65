"""The single-device state dict of a module whose parameters may be tensor- or expert-parallel shards.

What a local tensor is a piece of is recorded on it (:mod:`loom.parallel.placement`): ``tp_dim``
for a tensor-parallel shard, ``expert`` for this rank's rows of all experts. Gathering them needs
those facts only, so every strategy's ``full_state_dict`` and the tests share these functions.
All are collectives over the groups the placements name, unmetered (bookkeeping).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from loom import comm
from loom.comm import Group
from loom.parallel.placement import is_expert, placement_of


def gather_dim(t: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Concatenate every rank's ``t`` along ``dim`` in rank order (unmetered: bookkeeping)."""
    n = comm.group_size(group)
    if n == 1:
        return t.detach().clone()
    x = t.detach().movedim(dim, 0).contiguous()
    buf = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(buf.view(-1), x.view(-1), group)
    return buf.flatten(0, 1).movedim(0, dim).contiguous()


@torch.no_grad()
def gather_full_state(model: nn.Module, group: Group) -> dict[str, torch.Tensor]:
    """The single-device ``state_dict``: shards (``Placement.tp_dim``) gathered, replicated ones copied.

    A collective: every rank of ``group`` must call it.
    """
    done: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in done:
            dim = placement_of(t).tp_dim
            done[id(t)] = t.detach().clone() if dim is None else gather_dim(t, dim, group)
        out[name] = done[id(t)]
    return out


def gather_experts(
    module: nn.Module, state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """``module``'s state dict (or ``state``, its tp-gathered one) with every expert weight whole
    (all E experts, gathered over ep); a collective over each ep group."""
    if state is None:
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    for name, p in module.named_parameters():
        shard = placement_of(p).expert
        if shard is None or name not in state:
            continue
        mine = state[name].contiguous()  # gathered over tp already when split there (expert_tp = split)
        parts = [torch.empty_like(mine) for _ in range(shard.ep)]
        comm.check_tensors("all_gather", shard.group, mine, *parts)
        dist.all_gather(parts, mine, group=shard.group)
        state[name] = torch.cat(parts)
    return state


def gather_module_state(module: nn.Module, tp_group: Group = None) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with tensor-parallel shards gathered over ``tp_group`` and expert
    shards over their ep group (a collective over those groups), cloned; names as in ``module``."""
    state = gather_full_state(module, tp_group) if comm.group_size(tp_group) > 1 else None
    if any(is_expert(p) for p in module.parameters()):  # experts: then gathered over ep
        return gather_experts(module, state)
    return state if state is not None else {k: v.detach().clone() for k, v in module.state_dict().items()}
