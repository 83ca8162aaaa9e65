"""The factory of optimizers on flat parameter shards (the ZeRO and mixed-precision path), and the
per-parameter pieces of a shard.

Each optimizer updates a list of 1-D shards (views of the live parameters, of any dtype, laid
out by :class:`~loom.parallel.layout.FlatLayout`) through fp32 master weights
(:mod:`loom.optim.master`), reading g = float32(grad) · ``grad_scale`` (the loss-scale unscale,
never done in fp16, where it would flush gradients below 6·10⁻⁸ to zero).

Optimizers (``train.optimizer``), with their state bytes per shard element (+ 4 for a master):

    adamw      8                    m, v in fp32 (:class:`~loom.optim.adamw.ShardedAdamW`)
    adafactor  4(R + C) per matrix  row/column statistics (:mod:`loom.optim.adafactor`)
               4 per vector elem
    adam8bit   2 + 8/B              m, v as 8-bit codes, an fp32 absmax per block of B
                                    (:mod:`loom.optim.adam8bit`)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loom.optim.adamw import ShardedAdamW
from loom.optim.store import StateStore


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
                tp_dim = s.tp_dim
                pieces.append(
                    Piece(
                        i, j, p, lo - s.offset, hi - s.offset, lo - lay.start, hi - lay.start, s.decay, tp_dim
                    )
                )
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

        return FlatAdam8bit(
            shards, decay, store, (train_cfg.beta1, train_cfg.beta2), train_cfg.eps, train_cfg.weight_decay
        )
    if kind != "adamw":
        raise ValueError(f"train.optimizer: unknown optimizer {kind!r}")
    return ShardedAdamW(
        shards, decay, store, (train_cfg.beta1, train_cfg.beta2), train_cfg.eps, train_cfg.weight_decay
    )
