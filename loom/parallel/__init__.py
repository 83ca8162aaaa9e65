"""Parallel strategies, one module per dimension, composed by :func:`parallelize`."""

from __future__ import annotations

from torch import nn

from loom.comm import CommMeter


def parallelize(model: nn.Module, mesh, cfg, meter: CommMeter | None = None):
    """Apply the strategies in a fixed order and return the training Strategy.

    Order: tensor/sequence parallel -> expert parallel -> pipeline split -> recomputation ->
    data parallel / ZeRO (last, so it sees the final parameters). With tp > 1 the model then
    exposes ``model.loss_fn``, the loss on its vocabulary-sharded logits.
    """
    from loom.parallel.data_parallel import apply_data_parallel

    if mesh.size("tp") > 1:
        from loom.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh, cfg, meter)
    if cfg.parallel.zero > 0:
        from loom.parallel.zero import apply_zero

        return apply_zero(model, mesh, cfg, meter)
    return apply_data_parallel(model, mesh, cfg, meter)
