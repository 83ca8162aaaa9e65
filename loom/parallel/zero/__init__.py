"""ZeRO: data parallelism without redundant model state, stages 1-3, hybrid sharding, offload.

With Φ parameters, N ranks in the sharding group and R replicas of it (dp = R·N; hybrid
sharding when R > 1, ``parallel.dp_shard`` = N), bytes held per rank (fp32 training; mixed
precision in brackets, 2-byte weights and gradients + 12 bytes of fp32 master and Adam state):

    stage 0 (data parallel)   4Φ + 4Φ + 8Φ          [2Φ + 2Φ + 12Φ]
    stage 1 (optimizer)       4Φ + 4Φ + 8Φ/N        [2Φ + 2Φ + 12Φ/N]
    stage 2 (+ gradients)     4Φ + (4Φ + 8Φ)/N      [2Φ + (2Φ + 12Φ)/N]
    stage 3 (+ parameters)    16Φ/N                 [16Φ/N]

with Φ rounded up per flat buffer to a multiple of N·16 bytes (:mod:`loom.parallel.layout`). Bytes moved per
rank per step: 2Φ·b·(N-1)/N for stages 1-2 (reduce-scatter + all-gather), about 3Φ·b·(N-1)/N
for stage 3 (two all-gathers + reduce-scatter), plus 2(Φ/N)·b·(R-1)/R across replicas.
Each stage module states its exact formula. ``parallel.offload`` moves the optimizer state to
host memory or to memory-mapped files (:mod:`loom.optim.store`). ZeRO-3's options
(:mod:`.options`): ``parallel.offload_params`` puts the parameter and gradient shards there too
(ZeRO-Infinity, :mod:`.param_offload`: 0 bytes of model state on the device between steps), and
``parallel.zeropp_*`` quantize and localise its collectives (ZeRO++, :mod:`.zeropp`). The
strategies are built by :func:`loom.train.build.data_parallel`.
"""

from __future__ import annotations

from loom.parallel.layout import FlatLayout, padded_numel
from loom.parallel.zero.stage3 import FullyShardedZero, find_units
from loom.parallel.zero.stage12 import ZeroDataParallel

__all__ = ["FlatLayout", "FullyShardedZero", "ZeroDataParallel", "find_units", "padded_numel"]
