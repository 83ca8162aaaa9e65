"""The learning-rate schedule."""

from __future__ import annotations

import math

from loom.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at ``steps``.

    lr(s) = lr * (s+1)/W                                   for s < W
          = min_lr + (lr - min_lr) * (1 + cos(pi * (s-W)/(S-W))) / 2   otherwise
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
