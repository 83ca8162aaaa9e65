"""The single-device state dict of a module whose parameters may be tensor- or expert-parallel shards."""

from __future__ import annotations

import torch
from torch import nn

from loom import comm
from loom.comm import Group
from loom.parallel.placement import is_expert


def gather_module_state(module: nn.Module, tp_group: Group = None) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with tensor-parallel shards gathered over ``tp_group`` and expert
    shards over their ep group (a collective over those groups), cloned; names as in ``module``."""
    state = None
    if comm.group_size(tp_group) > 1:
        from loom.parallel.tensor.parallelize import gather_full_state

        state = gather_full_state(module, tp_group)
    if any(is_expert(p) for p in module.parameters()):  # experts are whole over tp: gathered over ep
        from loom.parallel.expert.parallelize import gather_experts

        return gather_experts(module, state)
    return state if state is not None else {k: v.detach().clone() for k, v in module.state_dict().items()}
