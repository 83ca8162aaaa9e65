"""Parallel strategies, one module per dimension, composed by :func:`parallelize`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import time: config validation imports loom.parallel.pipeline
    from torch import nn

    from loom.comm import CommMeter


def parallelize(model: nn.Module, mesh, cfg, meter: CommMeter | None = None):
    """Apply the strategies in a fixed order and return the training Strategy.

    Order: tensor/sequence parallel -> context parallel -> expert parallel -> pipeline split -> recomputation ->
    precision (half parameters) -> data parallel / ZeRO (last, so it sees the final parameters;
    fp32 masters and the optimizer live here) -> fp16 loss scaling around the whole Strategy
    (:mod:`loom.memory`). With tp > 1 the model then
    exposes ``model.loss_fn``, the loss on its vocabulary-sharded logits. With pp > 1 the
    result is a ``PipelineStrategy`` (train with ``pipeline_train_step``; ``.pipe`` = the stages).
    """
    from loom.parallel.data_parallel import apply_data_parallel

    if mesh.size("tp") > 1:
        from loom.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh, cfg, meter)
    if mesh.size("cp") > 1:
        from loom.parallel.context_parallel import apply_context_parallel

        apply_context_parallel(model, mesh, cfg, meter)
    if mesh.size("ep") > 1:
        from loom.parallel.expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, mesh, meter)
    pipe = None
    if mesh.size("pp") > 1:  # keep this rank's stages; the strategies below see only them
        import logging

        from loom.model.llama import loss_fn
        from loom.parallel.pipeline.strategy import apply_pipeline

        info = logging.getLogger("loom").info
        model = pipe = apply_pipeline(model, mesh, cfg, getattr(model, "loss_fn", loss_fn), info)
    from loom.memory import precision
    from loom.memory.loss_scale import apply_loss_scaling
    from loom.memory.recompute import apply_recompute

    apply_recompute(model, cfg.train.recompute)
    precision.cast_parameters(model, precision.DTYPES[cfg.train.precision])
    if cfg.parallel.zero > 0:
        from loom.parallel.zero import apply_zero

        strategy = apply_zero(model, mesh, cfg, meter)
        precision.bind_optimizer_groups(strategy)
    elif precision.needs_master_path(cfg):  # fp32 masters / Loom optimizers without ZeRO: N = 1 shards
        strategy = precision.apply_replicated_masters(model, mesh, cfg, meter)
    else:
        strategy = apply_data_parallel(model, mesh, cfg, meter)
    if pipe is not None:
        from loom.parallel.pipeline.strategy import PipelineStrategy

        p, path = cfg.parallel, f"{cfg.run.dir}/pipeline_timeline.png" if mesh.rank == 0 else None
        strategy = PipelineStrategy(strategy, pipe, p.schedule, p.virtual_stages, mesh.group("tp"), meter,
                                    p.vertical_sync, record_step=min(2, cfg.train.steps - 1), timeline_path=path,
                                    timeout_s=cfg.run.timeout_s)  # fmt: skip
    return apply_loss_scaling(strategy, cfg)
