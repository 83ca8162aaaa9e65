"""The factory of optimizers on flat parameter shards (the ZeRO and mixed-precision path).

Each optimizer updates a list of 1-D shards (views of the live parameters, of any dtype, laid
out by :class:`~loom.parallel.layout.FlatLayout`) through fp32 master weights
(:mod:`loom.optim.master`), reading g = float32(grad) · ``grad_scale`` (the loss-scale unscale,
never done in fp16, where it would flush gradients below 6·10⁻⁸ to zero).

Optimizers (``train.optimizer``), with their state bytes per shard element (+ 4 for a master):

    adamw      8                    m, v in fp32 (:class:`~loom.optim.adamw.ShardedAdamW`; torch's
                                    fused kernel where the device has one, else ``_foreach`` ops)
    adafactor  4(R + C) per matrix  row/column statistics (:mod:`loom.optim.adafactor`)
               4 per vector elem
    adam8bit   2 + 8/B              m, v as 8-bit codes, an fp32 absmax per block of B
                                    (:mod:`loom.optim.adam8bit`)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loom.optim.adafactor import FlatAdafactor
from loom.optim.adam8bit import FlatAdam8bit
from loom.optim.adamw import ShardedAdamW
from loom.optim.store import StateStore


def build_flat_optimizer(layouts: Sequence, shards: Sequence[torch.Tensor], store: StateStore, train_cfg):
    """The ``train_cfg.optimizer`` for these shards (decay on the ndim >= 2 runs, as AdamW's groups)."""
    kind = getattr(train_cfg, "optimizer", "adamw")
    if kind == "adafactor":
        return FlatAdafactor(layouts, shards, store, weight_decay=train_cfg.weight_decay)
    decay = [lay.local_ranges(lambda s: s.decay) for lay in layouts]
    if kind == "adam8bit":
        split = any(s.tp_sharded for lay in layouts for s in lay.slots)  # tensor parallelism
        tp_runs = [
            (lay.local_ranges(lambda s: not s.tp_sharded), lay.local_ranges(lambda s: s.tp_sharded))
            for lay in layouts
        ]
        return FlatAdam8bit(
            shards,
            decay,
            store,
            (train_cfg.beta1, train_cfg.beta2),
            train_cfg.eps,
            train_cfg.weight_decay,
            tp_runs if split else (),
        )
    if kind != "adamw":
        raise ValueError(f"train.optimizer: unknown optimizer {kind!r}")
    return ShardedAdamW(
        shards, decay, store, (train_cfg.beta1, train_cfg.beta2), train_cfg.eps, train_cfg.weight_decay
    )
