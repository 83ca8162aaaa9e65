"""ZeRO: data parallelism without redundant model state, stages 1-3, hybrid sharding, offload.

With Φ parameters, N ranks in the sharding group and R replicas of it (dp = R·N; hybrid
sharding when R > 1, ``parallel.dp_shard`` = N), bytes held per rank (fp32 training; mixed
precision in brackets, 2-byte weights and gradients + 12 bytes of fp32 master and Adam state):

    stage 0 (data parallel)   4Φ + 4Φ + 8Φ          [2Φ + 2Φ + 12Φ]
    stage 1 (optimizer)       4Φ + 4Φ + 8Φ/N        [2Φ + 2Φ + 12Φ/N]
    stage 2 (+ gradients)     4Φ + (4Φ + 8Φ)/N      [2Φ + (2Φ + 12Φ)/N]
    stage 3 (+ parameters)    16Φ/N                 [16Φ/N]

with Φ rounded up per flat buffer to a multiple of N·16 bytes (:mod:`.layout`). Bytes moved per
rank per step: 2Φ·b·(N-1)/N for stages 1-2 (reduce-scatter + all-gather), about 3Φ·b·(N-1)/N
for stage 3 (two all-gathers + reduce-scatter), plus 2(Φ/N)·b·(R-1)/R across replicas.
Each stage module states its exact formula. ``parallel.offload`` moves the optimizer state to
host memory or to memory-mapped files (:mod:`loom.memory.offload`).
"""

from __future__ import annotations

from torch import nn

from loom.comm import CommMeter
from loom.config import offload_dir
from loom.memory.offload import make_store
from loom.parallel.zero.layout import FlatLayout, padded_numel
from loom.parallel.zero.stage3 import FullyShardedZero, find_units
from loom.parallel.zero.stage12 import ZeroDataParallel

__all__ = ["FlatLayout", "FullyShardedZero", "ZeroDataParallel", "apply_zero", "find_units", "padded_numel"]


def apply_zero(
    module: nn.Module, mesh, cfg, meter: CommMeter | None = None
) -> ZeroDataParallel | FullyShardedZero:
    """Entry point used by ``parallelize``: ZeRO stage ``cfg.parallel.zero`` over the mesh's
    ``dp_shard_cp`` group (dp_shard x cp), hybrid across ``dp_replicate``, AdamW with ``cfg.train``."""
    from loom.parallel.data_parallel import REDUCE_DTYPES

    p = cfg.parallel
    device = next(module.parameters()).device
    store = make_store(p.offload, device, offload_dir(cfg), tag=f"rank{mesh.rank}")
    common = dict(
        shard_group=mesh.group("dp_shard_cp"),  # cp ranks hold the same parameters: they share the shards
        replicate_group=mesh.group("dp_replicate"),
        train_cfg=cfg.train,
        store=store,
        meter=meter,
        reduce_dtype=REDUCE_DTYPES[p.reduce_dtype],
        tp_group=mesh.group("tp"),
    )
    if p.zero == 3:
        return FullyShardedZero(module, reshard_after_forward=p.reshard_after_forward, **common)
    return ZeroDataParallel(module, p.zero, bucket_mb=p.bucket_mb, **common)
