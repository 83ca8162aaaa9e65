"""Parallel strategies, one module per dimension, composed by :func:`parallelize`."""

from __future__ import annotations

from torch import nn

from loom.comm import CommMeter


def parallelize(model: nn.Module, mesh, cfg, meter: CommMeter | None = None):
    """Apply the strategies in a fixed order and return the training Strategy.

    Order: tensor/sequence parallel -> expert parallel -> pipeline split -> recomputation ->
    data parallel / ZeRO (last, so it sees the final parameters). Only the data-parallel
    family is wired so far.
    """
    from loom.parallel.data_parallel import apply_data_parallel

    return apply_data_parallel(model, mesh, cfg, meter)
