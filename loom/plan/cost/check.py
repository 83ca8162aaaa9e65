"""Which layouts the formulas apply to (:func:`check`) and which ``loom train`` refuses
(:func:`refused`, :func:`loom.rules.layout_problems`); the layout rules themselves live in :mod:`loom.rules`."""

from __future__ import annotations

from loom.plan.cost.base import CostBase
from loom.plan.cost.layout import RECOMPUTE, SCHEDULES, Layout
from loom.rules import (
    ModelFacts,
    batch_problem,
    context_parallel_problem,
    expert_problem,
    interleaved_chunks_problem,
    interleaved_microbatches_problem,
    layout_problems,
    param_server_problem,
    pipeline_depth_problem,
    qlora_layout_problem,
    sequence_parallel_problem,
    sharding_problem,
    tensor_parallel_problem,
    virtual_stages_problem,
    zero3_options_problem,
    zero_stage_problem,
)


def tp_reason(model: ModelFacts, tp: int, per_node: int, expert_tp: str = "split") -> str | None:
    """Why tensor-parallel degree ``tp`` cannot split ``model`` (:mod:`loom.rules`) on nodes of
    ``per_node`` devices, or None; ``expert_tp``: whether tp cuts an MoE's experts (replicate: their
    width need not divide)."""
    why = tensor_parallel_problem(model, tp, expert_tp)
    if why is None and (tp > per_node or per_node % tp):
        why = "tp must divide devices_per_node (stay inside a node)"
    return why


def check(cm: CostBase, lay: Layout) -> str | None:
    """Why the formulas cannot evaluate ``lay`` for this model/workload on this cluster, or None.

    What the formulas assume (degrees, the cluster's size, a modelled schedule and recomputation,
    whole blocks per chunk, whole micro-batches, tp inside a node); divisibility of the model's
    shapes, the degrees, the stages and the batch are :mod:`loom.rules`' (called, not restated).
    Whether ``loom train`` runs ``lay`` too is :func:`refused`. Stated here only: what the formulas
    model (degrees >= 1, the cluster's size, the modelled schedules and recomputations, a sharding
    group for ZeRO, interleaving with pp, v >= 2, a split covering every block, tp inside a node)."""
    m, t = cm.model, cm.train
    if min(lay.dp, lay.dp_shard, lay.tp, lay.pp, lay.cp, lay.ep, lay.v, lay.micro_batch) < 1:
        return "every degree must be >= 1"
    if lay.world_size > cm.cluster.world_size:
        return "more devices than the cluster has"
    folded = t.expert_folding  # Megatron-Core's MoE parallel folding: ep drawn from tp x dp x cp
    why = zero_stage_problem(lay.zero) or sharding_problem(
        dp=lay.dp, dp_shard=lay.dp_shard, cp=lay.cp, ep=1 if folded else lay.ep
    )
    if why:
        return why
    if folded and (lay.tp * lay.dp * lay.cp) % lay.ep:
        return f"ep must divide tp*dp*cp = {lay.tp * lay.dp * lay.cp} (expert folding), got {lay.ep}"
    if folded and cm.expert_cut(lay.tp, lay.expert_tp) > 1:
        return "expert_tp: split experts (expert tensor parallelism = tp) and expert folding (1) exclude each other"
    if lay.zero > 0 and lay.dp_shard * lay.cp == 1:
        return "zero > 0 needs a sharding group dp_shard*cp > 1"
    if lay.schedule not in SCHEDULES:
        return f"schedule must be one of {', '.join(SCHEDULES)}"
    if lay.recompute not in RECOMPUTE:
        return f"recompute must be one of {', '.join(RECOMPUTE)}"
    # the model's shapes over tp, sp and cp: loom.rules (tp inside a node: the planner's cluster)
    why = tp_reason(cm.facts, lay.tp, cm.cluster.devices_per_node, lay.expert_tp)
    why = why or (sequence_parallel_problem(lay.tp, lay.cp, t.seq_len) if lay.sp else None)
    why = why or context_parallel_problem(lay.cp, t.seq_len)
    if why:
        return why
    why = virtual_stages_problem(lay.schedule, lay.v) or pipeline_depth_problem(cm.facts, lay.pp, lay.v)
    if why:
        return why
    if lay.schedule == "interleaved" and lay.pp < 2:
        return "interleaved needs pp >= 2"
    why = interleaved_chunks_problem(lay.schedule, lay.pp, lay.v)
    if why:  # in a layout line the chunks per rank follow the schedule: interleaved:v4
        return f"{why} (in a layout line: interleaved:vN)"
    if lay.split and (len(lay.split) != lay.pp or sum(lay.split) != m.n_layers or min(lay.split) < lay.v):
        return (
            f"split must give each of the pp={lay.pp} stages at least v={lay.v} blocks, {m.n_layers} in all"
        )
    why = batch_problem(t.global_batch, lay.micro_batch, lay.dp)
    why = why or interleaved_microbatches_problem(
        lay.schedule, lay.pp, t.global_batch // (lay.dp * lay.micro_batch)
    )
    return why or expert_problem(cm.facts, lay.ep)


OVERLAP_REFUSED = (
    "tp-overlap and ep-overlap are Megatron-Core's communication overlaps (priced for its published runs); "
    "loom train does not run them"
)


def refused(cm: CostBase, lay: Layout) -> str | None:
    """Why ``loom train`` refuses ``lay`` for this model and workload, or None: the rules of
    :mod:`loom.rules` that ``config.validate`` applies to a layout (degrees, QLoRA, ZeRO-3's options,
    the parameter server). :meth:`check` asks only whether the formulas apply; the search ranks neither kind."""
    t = cm.train
    problems = layout_problems(
        cm.facts,
        seq_len=t.seq_len,
        precision=t.precision,
        optimizer=t.optimizer,
        tp=lay.tp,
        pp=lay.pp,
        cp=lay.cp,
        ep=lay.ep,
        zero=lay.zero,
        sp=lay.sp,
        schedule=lay.schedule,
        virtual_stages=lay.v,
        cp_mode=lay.cp_mode,
        microbatches=t.global_batch // (lay.dp * lay.micro_batch),
        offload="cpu" if lay.offload else "none",
        allreduce=t.allreduce,
        dp=lay.dp,
        dp_shard=lay.dp_shard,
        recompute=lay.recompute,
        expert_tp=lay.expert_tp,
    )
    if problems:
        return problems[0]
    if lay.tp_overlap or lay.ep_overlap:
        return OVERLAP_REFUSED
    if t.expert_folding:
        return (
            "expert folding (expert tensor parallelism 1) is Megatron-Core's: Loom keeps a rank's experts "
            "on every tp rank, whole or split (parallel.expert_tp)"
        )
    why = qlora_layout_problem("qlora" if t.qlora else "lora", lay.tp) or zero3_options_problem(
        zero=lay.zero,
        offload_params="cpu" if lay.offload_params else "none",
        qwz=lay.qwz,
        hpz=lay.hpz > 0,
        qgz=lay.qgz > 0,
        qgz_bits=lay.qgz or 8,
        hpz_group=lay.hpz,
        dp_shard=lay.dp_shard,
        cp=lay.cp,
    )
    if why is None and t.ps_shards > 0:
        why = param_server_problem(
            shards=t.ps_shards,
            colocate=t.ps_colocate,
            sync=t.ps_sync,
            n_params=cm.params.total,
            workers=lay.dp,
            tp=lay.tp,
            pp=lay.pp,
            cp=lay.cp,
            ep=lay.ep,
            zero=lay.zero,
            precision=t.precision,
            optimizer=t.optimizer,
        )
    return why
