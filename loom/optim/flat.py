"""Optimizers on flat parameter shards with fp32 master weights: the ZeRO and mixed-precision path.

Each optimizer here updates a list of 1-D shards (views of the live parameters, of any dtype,
laid out by :class:`~loom.parallel.zero.layout.FlatLayout`). Where a shard is not fp32 on the
state store's device it keeps an fp32 master copy (4 bytes per shard element), runs the update
on the master and copies the result back into the parameter shard.

Loss scaling is folded into the fp32 conversion of the gradient: the optimizer reads
g = float32(grad) · ``grad_scale``, so an fp16 gradient holding S·∇ is unscaled in fp32 and no
small gradient is flushed to zero by a division in half precision (what an in-place unscale of
fp16 gradients would do below 6·10⁻⁸).

Optimizers (``train.optimizer``), with their state bytes per shard element (+ 4 for a master):

    adamw      8                    m, v in fp32 (:class:`~loom.parallel.zero.adam.ShardedAdamW`)
    adafactor  4(R + C) per matrix  row/column statistics (:mod:`loom.optim.adafactor`)
               4 per vector elem
    adam8bit   2 + 8/B              m, v as 8-bit codes, an fp32 absmax per block of B
                                    (:mod:`loom.optim.adam8bit`)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loom.comm import Group
from loom.memory.offload import StateStore
from loom.parallel.zero.adam import ShardedAdamW


class MasterWeights:
    """fp32 masters for shards that need one (half precision, or state on another device)."""

    def __init__(self, shards: Sequence[torch.Tensor], store: StateStore) -> None:
        self.params = list(shards)
        self.store = store
        self.masters: list[torch.Tensor] = []
        for i, p in enumerate(self.params):
            if p.dtype == torch.float32 and p.device == store.device:
                self.masters.append(p)  # the fp32 shard is its own master
            else:
                m = store.zeros(p.numel(), f"master{i}")
                m.copy_(p.detach())
                self.masters.append(m)

    def grads32(self, grads: Sequence[torch.Tensor], scale: float) -> list[torch.Tensor]:
        """fp32 gradients on the store's device, multiplied by ``scale`` (a copy when scaled or cast)."""
        dev = self.store.device
        out = []
        for g in grads:
            if g.device == dev and g.dtype == torch.float32 and scale == 1.0:
                out.append(g)
            else:
                g32 = g.to(dev, torch.float32, copy=True)
                out.append(g32.mul_(scale) if scale != 1.0 else g32)
        return out

    @torch.no_grad()
    def publish(self) -> None:
        """Copy updated masters into the parameter shards."""
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m, non_blocking=True)


class ScaledAdamW(ShardedAdamW):
    """ZeRO's AdamW, reading its gradients multiplied by ``grad_scale`` (the loss-scale unscale)."""

    grad_scale: float = 1.0

    def step(self, grads: Sequence[torch.Tensor], lr: float) -> None:
        if self.grad_scale != 1.0:
            dev = self.store.device
            grads = [g.to(dev, torch.float32, copy=True).mul_(self.grad_scale) for g in grads]
        super().step(grads, lr)

    def bind_groups(self, shard_group: Group, tp_group: Group) -> None:
        """AdamW is element-wise: no statistics cross shards."""


@dataclass(frozen=True)
class Piece:
    """The run of one parameter inside this rank's shard of a flat buffer.

    ``lo, hi``: elements of the parameter's own flattening; ``a, b``: the same run in the shard.
    """

    shard: int  # index of the flat buffer / shard
    slot: int  # index of the parameter in its layout
    param: torch.Tensor
    lo: int
    hi: int
    a: int
    b: int
    decay: bool
    tp_dim: int | None  # tensor-parallel shard dim of the parameter, None if replicated over tp


def pieces_of(layouts: Sequence) -> tuple[list[Piece], list[tuple[int, int]]]:
    """This rank's pieces, and (layout, slot) of *every* parameter of the layouts, in the same
    order on every rank (collectives pack per-parameter statistics in this order)."""
    pieces, every = [], []
    for i, lay in enumerate(layouts):
        for j, (p, s) in enumerate(zip(lay.params, lay.slots)):
            every.append((i, j))
            lo, hi = max(s.offset, lay.start), min(s.offset + s.numel, lay.end)
            if lo < hi:
                tp_dim = getattr(p, "tp_shard_dim", None)
                pieces.append(Piece(i, j, p, lo - s.offset, hi - s.offset, lo - lay.start, hi - lay.start,
                                    s.decay, tp_dim))  # fmt: skip
    return pieces, every


def build_flat_optimizer(layouts: Sequence, shards: Sequence[torch.Tensor], store: StateStore, train_cfg):
    """The ``train_cfg.optimizer`` for these shards (decay on the ndim >= 2 runs, as AdamW's groups)."""
    kind = getattr(train_cfg, "optimizer", "adamw")
    if kind == "adafactor":
        from loom.optim.adafactor import FlatAdafactor

        return FlatAdafactor(layouts, shards, store, weight_decay=train_cfg.weight_decay)
    decay = [lay.local_ranges(lambda s: s.decay) for lay in layouts]
    if kind == "adam8bit":
        from loom.optim.adam8bit import FlatAdam8bit

        return FlatAdam8bit(shards, decay, store, (train_cfg.beta1, train_cfg.beta2), train_cfg.eps,
                            train_cfg.weight_decay)  # fmt: skip
    if kind != "adamw":
        raise ValueError(f"train.optimizer: unknown optimizer {kind!r}")
    return ScaledAdamW(shards, decay, store, (train_cfg.beta1, train_cfg.beta2), train_cfg.eps,
                       train_cfg.weight_decay)  # fmt: skip
