"""The composition root: the only module that imports both :mod:`loom.parallel` and :mod:`loom.memory`.

:func:`build_run` applies the parallel dimensions to a built model in a fixed order and returns
the :class:`~loom.train.step.Run` this rank trains:

    LoRA adapters (``finetune.method``; base frozen) -> fp8 / int8 Linears (``train.precision``;
    torchao, before any dimension wraps them, as torchtitan) -> tensor/sequence parallel -> context parallel -> expert parallel -> pipeline split (keep this
    rank's stages) -> recomputation -> precision (half parameters) -> materialization (a model
    built on the meta device gets only this rank's values: :mod:`loom.parallel.materialize`;
    ZeRO-3 unit by unit; QLoRA: the targets' base weights to NF4) -> data parallel / ZeRO (last, so it sees the final parameters; fp32
    masters and the optimizer live here) -> ``torch.compile`` of the blocks or the model, and the
    loss (``train.compile``: :mod:`loom.train.compile`) -> the pipeline strategy around it -> the
    fp16 loss scaler (an argument of the step, not a wrapper)

Adding a parallel dimension: its module under ``loom/parallel/``, one line in
:func:`parallelize`, its rules in :mod:`loom.rules`, its costs in the planner.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from loom.comm import CommMeter
from loom.config import (
    LoomConfig,
    Precision,
    check_tensor_parallel,
    grad_accum_steps,
    lora_targets,
    offload_dir,
    ps_servers,
)
from loom.device import DTYPES, resolve_precision, set_fp32_matmul
from loom.memory import precision
from loom.memory.activation_offload import make_offloader
from loom.memory.compress import SavedActivations
from loom.memory.loss_scale import scaler_for, training_loss_fn
from loom.memory.recompute import apply_recompute
from loom.mesh import ParallelDims, ParallelMesh
from loom.model.llama import fused_head_loss
from loom.model.llama import loss_fn as plain_loss_fn
from loom.model.moe import configure_moe
from loom.optim.flat import build_flat_optimizer
from loom.optim.groups import build_optimizer
from loom.optim.store import make_store
from loom.parallel import allreduce
from loom.parallel.base import LossFn, Strategy
from loom.parallel.data.strategy import REDUCE_DTYPES, DataParallel
from loom.parallel.expert.parallelize import stats_sum
from loom.parallel.materialize import (
    Fill,
    Source,
    check_materialized,
    filler,
    init_source,
    materialize,
    tag_origins,
)
from loom.parallel.zero.options import optimizer_offload, stage3_strategy
from loom.parallel.zero.stage12 import ZeroDataParallel
from loom.train.compile import apply_compile
from loom.train.step import LossScaler, Run, plain_run

if TYPE_CHECKING:
    from loom.parallel.pipeline.stage import PipelineModule
    from loom.parallel.pipeline.strategy import PipelineStrategy

log = logging.getLogger("loom")


def build_mesh(cfg: LoomConfig, device_type: str) -> ParallelMesh:
    """The mesh of the ranks that train: every rank, or with dedicated parameter-server ranks the
    workers only (:func:`loom.train.ps_run.worker_mesh`; a collective over every rank)."""
    if ps_servers(cfg):
        from loom.train.ps_run import worker_mesh

        return worker_mesh(cfg, device_type)
    return ParallelMesh(ParallelDims.from_config(cfg.parallel), device_type)


def build_run(
    cfg: LoomConfig,
    mesh: ParallelMesh,
    model: nn.Module,
    meter: CommMeter | None = None,
    source: Source | None = None,
) -> Run:
    """Parallelize ``model`` under ``cfg`` on ``mesh``; see the module docstring. ``model`` may be built
    whole, or on the meta device (``build_model(..., meta=True)``): then each parameter's values come
    from ``source(name, shape)`` (default: the layout-independent init of ``cfg.train.seed``).

    With tp > 1 the loss is the one on vocabulary-sharded logits (``model.loss_fn``); with pp > 1
    ``Run.model`` is this rank's pipeline stages and the rest of the model is no longer referenced.
    """
    return parallelize(model, mesh, cfg, meter, source)


def pipeline_run(
    pipe: PipelineModule, strategy: PipelineStrategy, loss_fn: LossFn, scaler: LossScaler | None = None
) -> Run:
    """A run whose forward and backward are the pipeline schedule's (:mod:`loom.parallel.pipeline.step`)."""
    from loom.parallel.pipeline import step as pipeline_step

    return Run(
        pipe,
        strategy,
        loss_fn,
        partial(pipeline_step.forward_backward, pipe, strategy),
        partial(pipeline_step.evaluate, pipe),
        scaler,
    )


def parallelize(
    model: nn.Module,
    mesh: ParallelMesh,
    cfg: LoomConfig,
    meter: CommMeter | None = None,
    source: Source | None = None,
) -> Run:
    """The :class:`Run` of this rank (what it runs, its Strategy, the loss on its output, the loss
    scaler): the dimensions of the module docstring, in order."""
    device = next(model.buffers()).device  # buffers are built on the run's device, also for a meta model
    # auto, in a config that skipped validate: bf16 on CUDA, fp32 on the CPU
    cfg.train.precision = cast(Precision, resolve_precision(cfg.train.precision, device.type))
    set_fp32_matmul(device, tf32=cfg.train.precision == "tf32")
    tag_origins(model, cfg.model.vocab_size)
    finetune = cfg.finetune.method != "full"
    if finetune:  # LoRA adapters on the frozen base, before any dimension cuts it (tp splits them with W)
        from loom.finetune.lora import apply_lora

        apply_lora(model, targets=lora_targets(cfg), finetune=cfg.finetune)
        tag_origins(model, cfg.model.vocab_size)
    low_precision(model, cfg, mesh.size("tp"), device)
    loss_fn: LossFn = plain_loss_fn
    if mesh.size("tp") > 1:  # the loss on vocabulary-sharded logits
        from loom.parallel.tensor.parallelize import apply_tensor_parallel

        check_tensor_parallel(cfg)
        loss_fn = apply_tensor_parallel(
            model, mesh, sp=cfg.parallel.sp, meter=meter, expert_tp=cfg.parallel.expert_tp
        )
    elif mesh.size("pp") == 1:  # the head inside the loss, in chunks of rows: no B·T·V logits
        rows = cfg.train.micro_batch * cfg.data.seq_len // mesh.size("cp")
        loss_fn = fused_head_loss(model, rows) or plain_loss_fn
    if mesh.size("cp") > 1:
        from loom.parallel.context.parallelize import apply_context_parallel

        apply_context_parallel(
            model,
            mesh,
            mode=cfg.parallel.cp_mode,
            seq_len=cfg.data.seq_len,
            dropout=cfg.model.dropout,
            meter=meter,
        )
    if mesh.size("ep") > 1:
        from loom.parallel.expert.parallelize import apply_expert_parallel

        apply_expert_parallel(model, mesh, meter)
    # sequence parallelism with whole experts: tp ranks route different tokens (split experts: the same)
    split = mesh.size("tp") > 1 and cfg.parallel.sp and cfg.parallel.expert_tp == "replicate"
    tokens = (mesh.group("tp"),) if split else ()
    configure_moe(
        model,
        stats_sum((mesh.group("cp"), *tokens)),  # the aux loss's f_e: over a micro-batch's sequences
        1.0 / mesh.size("tp") if split else 1.0,
        stats_sum((mesh.group("dp_cp"), *tokens)),  # a step's loads: over every data-parallel rank
    )
    pipe = None
    if mesh.size("pp") > 1:  # keep this rank's stages; the strategies below see only them
        from loom.parallel.pipeline.profile import choose_layout
        from loom.parallel.pipeline.strategy import apply_pipeline

        bounds = choose_layout(model, cfg, grad_accum_steps(cfg), loss_fn, log.info)
        seq_div = cfg.parallel.tp if cfg.parallel.sp else 1
        model = pipe = apply_pipeline(model, mesh, bounds=bounds, seq_div=seq_div)
    apply_recompute(model, cfg.train.recompute)
    precision.cast_parameters(model, DTYPES[cfg.train.precision])
    source = source or init_source(cfg.model, cfg.train.seed)
    if finetune:  # adapters: their own layout-independent init (A uniform, B zero)
        from loom.finetune.lora import lora_source

        source = lora_source(source, cfg.train.seed)
    if cfg.parallel.zero != 3:  # ZeRO-3 materializes unit by unit as it shards
        materialize(model, device, source)
    if (
        cfg.finetune.method == "qlora"
    ):  # the targets' frozen base weights into NF4 (ZeRO-3: materialized one by one)
        from loom.finetune.lora import quantize_base

        quantize_base(model, partial(materialize, device=device, source=source))
    strategy = data_parallel(model, mesh, cfg, meter, filler(source), device)
    check_materialized(model)
    zb = cfg.parallel.pp > 1 and cfg.parallel.schedule == "zb-h1"  # last: sees every module and hook above
    loss_fn, _ = apply_compile(model, cfg.train.compile, loss_fn, compress=cfg.train.compress, zero_bubble=zb)
    scaler = scaler_for(cfg.train, mesh.size("dp_cp"))  # the backward at S/(dp·cp): one process's fp16 terms
    if pipe is None:
        run = plain_run(model, strategy, loss_fn, scaler)
    else:
        from loom.parallel.pipeline.strategy import PipelineStrategy

        p, path = cfg.parallel, f"{cfg.run.dir}/pipeline_timeline.png" if mesh.rank == 0 else None
        pipeline = PipelineStrategy(
            strategy,
            pipe,
            p.schedule,
            p.virtual_stages,
            mesh.group("tp"),
            meter,
            p.vertical_sync,
            record_step=min(2, cfg.train.steps - 1),
            timeline_path=path,
            timeout_s=cfg.run.timeout_s,
        )
        run = pipeline_run(pipe, pipeline, loss_fn, scaler)
    if scaler is not None:
        run.scaled_loss_fn = training_loss_fn(scaler, loss_fn)
    return run


def low_precision(model: nn.Module, cfg: LoomConfig, tp: int, device: torch.device) -> None:
    """fp8 / int8: swap the Linears that run in 8 bits (:func:`loom.memory.precision.apply_low_precision`)
    and say in one line how many do and how many ``train.fp8_layers = auto`` keeps in bf16."""
    t = cfg.train
    _, kept = precision.low_precision_split(model, t.precision, t.fp8_recipe, t.fp8_layers, tp)
    swapped = precision.apply_low_precision(model, t.precision, t.fp8_recipe, tp, t.fp8_layers)
    small = (
        f'{len(kept)} stay bf16, too small for float8 to pay on an H100 (train.fp8_layers = "auto"; '
        'train.fp8_layers = "all" converts them)'
    )
    if not swapped and kept:
        log.warning(
            "train.precision = %s: no Linear layer runs %s matmuls, %s: this run is bf16 in effect",
            t.precision,
            t.precision,
            small,
        )
    if not swapped:
        return
    log.info(
        "train.precision = %s: %d Linear layers run %s matmuls%s",
        t.precision,
        swapped,
        t.precision,
        f", {small}" if kept else "",
    )
    if t.compile == "none" and device.type == "cuda":
        log.warning(
            "train.precision = %s with train.compile = none: torchao's scaling and casts run as "
            "separate eager kernels (fp8 measured 0.49x bf16's tokens/s on an H100, docs/gpu/); "
            'train.compile = "blocks" fuses them',
            t.precision,
        )


def data_parallel(
    model: nn.Module,
    mesh: ParallelMesh,
    cfg: LoomConfig,
    meter: CommMeter | None = None,
    fill: Fill | None = None,
    device: torch.device | None = None,
) -> Strategy:
    """The data-parallel strategy over ``dp × cp`` (cp ranks hold the same parameters too):

    - ``parallel.zero`` = 1-3: ZeRO over ``dp_shard × cp``, hybrid across ``dp_replicate``;
    - zero = 0 with half precision or a non-AdamW optimizer: ZeRO's flat path with a sharding group
      of one rank (fp32 masters and optimizer state replicated; stage 2 hooks, stage 1 under a
      pipeline, which reduces once after the last micro-batch);
    - zero = 0, fp32 AdamW: :class:`DataParallel` with ``torch.optim.AdamW``;
    - ``parallel.dp_mode = "ps"``: co-located parameter servers (:mod:`loom.parallel.ps.strategy`), or a
      worker of dedicated server ranks (``ps_colocate = false``: :func:`loom.train.ps_run.ps_worker`).

    ``fill``, ``device``: ZeRO-3 materializes parameters still on the meta device there.
    """
    p = cfg.parallel
    reduce_dtype = REDUCE_DTYPES[p.reduce_dtype]
    if p.dp_mode == "ps" and not p.ps_colocate:  # a worker of dedicated server ranks
        from loom.train.ps_run import ps_worker

        return ps_worker(model, mesh, cfg, meter)
    if p.dp_mode == "ps":  # co-located parameter servers (config refuses the layouts they cannot run)
        from loom.parallel.ps.strategy import ColocatedParamServer

        return ColocatedParamServer(
            model, mesh.group("dp_cp"), p.ps_shards, cfg.train, meter, cfg.run.timeout_s
        )
    if p.zero == 0 and not precision.needs_master_path(cfg):
        return DataParallel(
            model,
            mesh.group("dp_cp"),
            meter,
            p.bucket_mb,
            reduce_dtype,
            mesh.group("tp"),
            optimizer=build_optimizer(model, cfg.train),
            allreduce=allreduce.by_name(p.allreduce),
        )
    device = device or next(model.parameters()).device
    store = make_store(optimizer_offload(p), device, offload_dir(cfg), tag=f"rank{mesh.rank}")
    make_optimizer = partial(build_flat_optimizer, store=store, train_cfg=cfg.train)
    if p.zero == 0:
        if mesh.size("dp_shard") != 1:
            raise ValueError("parallel.zero = 0 needs a dp_shard group of one rank")
        return ZeroDataParallel(
            model,
            1 if mesh.size("pp") > 1 else 2,
            shard_group=mesh.group("dp_shard"),
            replicate_group=mesh.group("dp_cp"),  # = dp_replicate x cp, as dp_shard is one rank
            make_optimizer=make_optimizer,
            meter=meter,
            bucket_mb=p.bucket_mb,
            reduce_dtype=reduce_dtype,
            tp_group=mesh.group("tp"),
            allreduce=allreduce.by_name(p.allreduce),
        )
    common: dict[str, Any] = dict(
        shard_group=mesh.group("dp_shard_cp"),
        replicate_group=mesh.group("dp_replicate"),
        make_optimizer=make_optimizer,
        meter=meter,
        reduce_dtype=reduce_dtype,
        tp_group=mesh.group("tp"),
        allreduce=allreduce.by_name(p.allreduce),
    )
    if p.zero == 3:
        return stage3_strategy(
            model,
            p,
            offload_dir(cfg),
            f"rank{mesh.rank}",  # offload_params, ZeRO++
            reshard_after_forward=p.reshard_after_forward,
            fill=fill,
            device=device,
            gather_group=mesh.twin("dp_shard_cp"),  # all-gathers on a communicator (stream) of their own
            **common,
        )
    return ZeroDataParallel(model, p.zero, bucket_mb=p.bucket_mb, **common)


def saved_activations(cfg: LoomConfig, model: nn.Module, device: torch.device) -> SavedActivations:
    """The saved-tensor hooks around each step: activation accounting, compression, host offload."""
    return SavedActivations(model, cfg.train.compress, make_offloader(cfg.train.offload_activations, device))
