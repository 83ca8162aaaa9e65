"""Which ZeRO-3 runs for a ``[parallel]`` section: plain, with parameter offload (ZeRO-Infinity,
:mod:`.param_offload`) or with the ZeRO++ options (:mod:`.zeropp`); and where the optimizer state
lives (with parameter offload the step runs on the host, so ``offload = none`` means "with them")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from loom.optim.store import make_store
from loom.parallel.zero.stage3 import FullyShardedZero


def optimizer_offload(p: Any) -> str:
    """``parallel.offload`` for ZeRO 1-3, or ``offload_params`` when that is set and offload is none."""
    if not p.zero:
        return "none"
    if p.zero == 3 and p.offload == "none":
        return getattr(p, "offload_params", "none")
    return p.offload


def stage3_strategy(
    module: nn.Module, p: Any, directory: str | Path, tag: str, **kwargs: Any
) -> FullyShardedZero:
    """ZeRO-3 over ``kwargs`` (FullyShardedZero's arguments), with the options ``p`` asks for;
    ``directory``, ``tag``: where and under which name a disk store keeps its files."""
    if p.offload_params != "none":
        from loom.parallel.zero.param_offload import OffloadedZero

        device = kwargs.get("device") or torch.device("cpu")
        store = make_store(p.offload_params, device, directory, tag=f"{tag}-param")
        return OffloadedZero(module, param_store=store, **kwargs)
    if p.zeropp_qwz or p.zeropp_hpz or p.zeropp_qgz:
        from loom.parallel.zero.zeropp import ZeroPlusPlus

        return ZeroPlusPlus(
            module,
            qwz=p.zeropp_qwz,
            hpz_group=hpz_size(p) if p.zeropp_hpz else 0,
            qgz=p.zeropp_qgz,
            qgz_bits=p.zeropp_qgz_bits,
            qgz_node=hpz_size(p) if p.zeropp_qgz else 0,  # the sharding group's ranks on one node
            **kwargs,
        )
    return FullyShardedZero(module, **kwargs)


def hpz_size(p: Any) -> int:
    """Ranks per hpZ secondary partition (:func:`loom.rules.hpz_partition`), with the launcher's
    ``LOCAL_WORLD_SIZE`` as the ranks of one node."""
    import os

    from loom.rules import hpz_partition

    local = int(os.environ.get("LOCAL_WORLD_SIZE", p.dp_shard * p.cp * p.tp))
    g, problem = hpz_partition(p.hpz_group, p.dp_shard, p.cp, p.tp, local)
    if problem:
        raise ValueError(problem)
    return g
