"""Decay groups and the replicated AdamW (``torch.optim.AdamW``) used without master weights."""

from __future__ import annotations

import torch
from torch import nn

from loom.config import TrainConfig
from loom.optim.adamw import fused_supported


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (ndim >= 2), none on norms and biases. Tied weights appear once."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay): torch's fused kernel where the parameters' device and dtypes
    have one (:func:`~loom.optim.adamw.fused_supported`), else its ``foreach`` implementation."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(fused_supported(p.device, p.dtype) for p in params)
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        foreach=None if fused else True,
        fused=fused or None,
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors held in the optimizer state (e.g. Adam's two moments: 8 bytes/param in fp32)."""
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.dim() > 0:
                total += v.numel() * v.element_size()
    return total
