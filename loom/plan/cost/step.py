"""One step: every term summed per micro-batch and step, the pipeline bubble and p2p, the optimizer,
the CPU bound of ranks sharing cores; throughput, TFLOP/s and MFU (formulas: :mod:`loom.plan.cost`)."""

from __future__ import annotations

from loom.plan.cost.base import CostBase
from loom.plan.cost.check import check
from loom.plan.cost.comm import tp_partial_params
from loom.plan.cost.compute import microbatch_times
from loom.plan.cost.dp import dp_time, exposed, sync_time, zero3_stage_gathers
from loom.plan.cost.layout import Estimate, Layout, PlanError
from loom.plan.cost.memory import peak_memory

HOST_ADAM_BANDWIDTH = 100e9  # host memory bandwidth for CPU Adam, bytes/s per node (assumption)


ADAM_BYTES = 28  # bytes read + written per parameter by one Adam step


def estimate_layout(cm: CostBase, lay: Layout) -> Estimate:
    """Full prediction for ``lay``; raises :class:`PlanError` if the layout is invalid."""
    why = check(cm, lay)
    if why:
        raise PlanError(f"layout {lay.short()}: {why}")
    mem, breakdown, stage = peak_memory(cm, lay)
    return timed(cm, lay, mem, breakdown, stage)


def timed(cm: CostBase, lay: Layout, mem: float, breakdown: dict[str, float], stage: str) -> Estimate:
    """Add the time prediction to a checked layout whose memory is known."""
    tr, mach = cm.train, cm.machine
    m = tr.global_batch // (lay.dp * lay.micro_batch)
    p = lay.pp
    world = lay.world_size
    t_mb, t_w, terms = cm.memo(microbatch_times)(
        lay.tp,
        lay.sp,
        lay.cp,
        lay.ep,
        lay.micro_batch,
        lay.recompute,
        p,
        world,
        lay.cp_mode,
        lay.tp_overlap,
        lay.split,
        lay.expert_tp,
        lay.ep_overlap,
    )
    w_share = t_w / t_mb
    if p == 1:
        idle = 0.0
    elif lay.schedule == "interleaved":
        idle = (p - 1) / lay.v
    elif lay.schedule == "zb-h1":
        idle = (p - 1) * (1 - 2 * w_share)
    else:
        idle = p - 1.0
    time = {k: m * val for k, val in terms.items()}
    gathers = 0.0  # ZeRO-3 in a pipeline: each micro-batch's gathers, prefetched under its stage compute
    if p > 1 and lay.zero == 3 and not (lay.qwz or lay.hpz or lay.qgz):  # ZeRO++: zeropp_time counts its own
        g, calls = zero3_stage_gathers(cm, lay)
        gathers = exposed(g, calls, t_mb, mach.comm_overlap(world) if lay.dp_overlap else 0.0)
    time["pp bubble"] = idle * (t_mb + gathers)
    time["pp p2p"] = 0.0
    if p > 1:
        B = cm.act_bytes
        msg = lay.micro_batch * tr.seq_len / lay.cp * cm.model.dim * B / lay.tp
        span = lay.tp * lay.cp * lay.dp * p
        time["pp p2p"] = (
            2 * m * lay.v * mach.collective("p2p", 2, msg, span, synced=True)
        )  # the receiver waits
    partial = tp_partial_params(cm, lay.tp, lay.sp, p, p == 1, lay.ep, lay.expert_tp) * cm.R
    time["tp comm"] += mach.collective("all_reduce", lay.tp, partial, lay.tp, world)
    time["step sync"] = sync_time(cm, lay)
    time["dp comm"] = dp_time(cm, lay, m, terms["compute"], m * t_mb) + m * gathers
    dense, expert = cm._stage_params(lay, True, p == 1)
    n = lay.dp_shard * lay.cp if lay.zero else 1
    local = dense / n + expert / (cm.expert_group(n, lay.ep, lay.tp) if lay.zero else 1)
    if tr.ps_shards:  # each server steps its shard; the workers wait for it (bsp)
        local = dense / tr.ps_shards
    if lay.offload:
        W, G = cm.W, cm.G
        host_adam = HOST_ADAM_BANDWIDTH / cm.cluster.devices_per_node
        time["optimizer"] = local * ((W + G) / cm.cluster.host_bandwidth + ADAM_BYTES / host_adam)
    else:  # its bytes over the memory bandwidth, or its arithmetic where that is slower (8-bit Adam on a CPU)
        rate = mach.optimizer_rates.get(tr.optimizer, 0.0)
        time["optimizer"] = max(local * ADAM_BYTES / mach.hbm, local / rate if rate > 0 else 0.0)
    if cm.ops is not None:  # the optimizer's operators (foreach calls, or per-parameter ones: adafactor)
        time["optimizer"] += mach.op_time * cm.ops.optimizer(cm.stage_layers(p, True, p == 1, lay.split))
    time["cpu bound"] = 0.0
    if cm.cpu_model is not None:  # the cores cannot run more than their share of every rank's CPU work
        time["cpu bound"] = max(
            0.0, cpu_demand(cm.cpu_model, lay, mem, breakdown, stage) - sum(time.values())
        )
    step = sum(time.values())
    tokens = tr.global_batch * tr.seq_len
    world = lay.world_size
    rec_tokens = {
        "none": 0.0,
        "selective": 4.0 * cm.model.n_layers * cm.model.dim * tr.seq_len,
        "full": 2.0 * cm.params.n_layers * (cm.params.attn + cm.params.mlp_active)
        + 4.0 * cm.model.n_layers * cm.model.dim * tr.seq_len,
    }[lay.recompute]
    hw_flops = cm.model_flops + rec_tokens * tokens
    return Estimate(
        layout=lay,
        step_time=step,
        tokens_per_s=tokens / step,
        tflops_per_device=hw_flops / step / world / 1e12,
        mfu=cm.model_flops / step / world / mach.peak,
        memory=mem,
        capacity=cm.cluster.device.memory_bytes,
        memory_breakdown=breakdown,
        time_breakdown=time,
        microbatches=m,
        bubble_fraction=time["pp bubble"] / (m * t_mb + time["pp bubble"]),
        peak_stage=stage,
    )


def cpu_demand(cm: CostBase, lay: Layout, mem: float, breakdown: dict[str, float], stage: str) -> float:
    """Seconds of one rank's work in a step, without the pipeline bubble (a waiting rank spends
    nothing): on a CPU twin (:meth:`Profile.cpu_twin`) the rank's CPU demand."""
    return sum(v for k, v in timed(cm, lay, mem, breakdown, stage).time_breakdown.items() if k != "pp bubble")
