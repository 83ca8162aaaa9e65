"""Compute of one micro-batch: GEMMs, the attention core, elementwise work, recomputation, the
framework's per-operator cost, and the stage's tp/cp/ep communication beside them (formulas:
:mod:`loom.plan.cost`)."""

from __future__ import annotations

from functools import partial

from loom.memory.precision import runs_8bit
from loom.plan.cost.base import CostBase
from loom.plan.cost.comm import cp_layer_time, tp_calls
from loom.plan.cost.dp import contended, exposed

FLASH_BWD = 2.5  # flash attention backward / forward time (it recomputes the scores; Dao 2023)


def attention_core(cm: CostBase, tp: int, cp: int, mb: int) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core of one layer and micro-batch, per kernel:

    - flash (``Workload.flash_attention``): a causal kernel computes half the 4 T s a·d / t FLOPs
      of the square score matrix (masked blocks skipped; a sliding window's too, times
      ``ModelConfig.attention_share``): forward ``2 T s a·d / t`` at the
      device's ``flash_fwd`` share of peak, backward 2.5x those FLOPs (it recomputes the scores)
      at ``flash_bwd``;
    - unfused (Megatron 2021): per (sequence, head) two batched GEMMs, Q K^T (s x d x s) and
      A V (s x s x d), each through :meth:`Machine.gemm` (tiles over the whole batch), the
      full square; the scores are written, read and written by the softmax and read by A V,
      4 B a s^2 bytes; backward twice the GEMMs and the traffic again.
    """
    mc, tr, mach, B = cm.model, cm.train, cm.machine, cm.act_bytes
    s, qd = tr.seq_len, mc.n_heads * mc.head_dim  # a·d: h unless attn_head_dim sets d apart
    T = mb * s / cp
    io = B * T * (2 * qd / tp + 2 * cm.kv_width(tp)) / mach.hbm  # q, k, v in; o out
    if tr.flash_attention:  # the blocks a sliding window hides skipped too (attention_share)
        flops = 2.0 * T * s * qd / tp * mc.attention_share(s)
        return max(mach.attention(flops, False), io), mach.attention(2.5 * flops, True) + 2 * io
    heads = mb * mc.n_heads / tp
    d = mc.head_dim
    gemms = mach.gemm(s, d, s, B, batch=heads) + mach.gemm(s, s, d, B, batch=heads)
    scores = (cm.other if cm.kernels else 1.0) * 4 * B * heads * s * s / mach.hbm
    return gemms + scores + io, 2 * (gemms + scores + io)


def linear_gemm(cm: CostBase, m: float, k: float, n: float, expert: bool = False) -> float:
    """Seconds of a block Linear's GEMM (m x k) @ (k x n) on a rank, k its input and n its output
    features there: 1-byte operands at the 8-bit rate where the Linear runs in 8 bits
    (:func:`loom.memory.precision.runs_8bit`: fp8 / int8, under ``fp8_layers = auto`` only where float8
    pays; a routed ``expert``'s only where the stack runs experts in 8 bits, ``Stack.lowp_experts``),
    else the activations' bytes at the bf16 rate (the precision's own outside fp8 / int8)."""
    tr = cm.train
    eight_ok = cm.stack.lowp_experts or not expert
    if eight_ok and runs_8bit(tr.precision, k, n, tr.fp8_recipe, tr.fp8_layers):
        return cm.machine.gemm(m, k, n, 1)
    return cm.machine.gemm(m, k, n, cm.act_bytes, bf16=True)


# bytes an fp8 Linear's dynamic scaling moves per element of its input and weight in the forward, and
# of its weight and grad_output in the backward, by recipe, as torchao's roofline counts its kernels
# (torchao/testing/training/roofline_utils.py), unfused with the op before:
#   tensorwise  input: amax read 2 + cast read 2, writing both fp8 layouts 2 = 6 (the backward's layout
#               made here); weight: amax 2 + a cast 3 forward, a cast 3 backward; grad_output as input
#   rowwise     input: cast read 2 + fp8 1 + a bf16 transpose 2, its cast 2 + 1 = 8; weight: a cast 3
#               forward, transpose 4 + cast 3 backward; grad_output as input
SCALE_CAST_BYTES = {"tensorwise": (6.0, 5.0, 3.0, 6.0), "rowwise": (8.0, 3.0, 7.0, 8.0)}


def scale_cast_bytes(cm: CostBase, m: float, k: float, n: float, expert: bool = False) -> tuple[float, float]:
    """(forward, backward) HBM bytes of the dynamic-scaling casts of a block Linear (m x k) @ (k x n) in
    one micro-batch, where it runs in fp8 on a stack that casts in kernels of their own
    (``Stack.scale_casts``): ``(b_x m k + b_w k n, b_w' k n + b_g m n)`` (:data:`SCALE_CAST_BYTES`),
    else zeros."""
    tr = cm.train
    if not cm.stack.scale_casts or tr.precision != "fp8" or (expert and not cm.stack.lowp_experts):
        return 0.0, 0.0
    if not runs_8bit(tr.precision, k, n, tr.fp8_recipe, tr.fp8_layers):
        return 0.0, 0.0
    b_x, b_w, b_wb, b_g = SCALE_CAST_BYTES.get(tr.fp8_recipe, SCALE_CAST_BYTES["tensorwise"])
    return b_x * m * k + b_w * k * n, b_wb * k * n + b_g * m * n


def moe_routing_bytes(
    cm: CostBase, T_route: float, T_perm: float, rows: float, ep: int, experts_here: float
) -> tuple[float, float]:
    """(forward, backward) HBM bytes of an MoE layer's routing on a rank in one micro-batch, beyond its
    GEMMs and its SwiGLU: with B_a bytes per element, h hidden, E experts, k = top_k, T_r the tokens the
    rank routes (``T_route``), T_p those whose rows it permutes (``T_perm``: T_r, or Loom's split experts
    under ep its 1/t of them), n_s = k T_p the routed copies it sends and n_e the rows its experts
    compute (``rows``: k T load over its experts)::

        router    fwd 12 E T_r + 12 k T_r  fp32 logits read, scores written and read by top-k; k fp32
                                           weights and int64 ids written
                  bwd 16 E T_r             the weights' gradient scattered into E, the softmax's backward
                                           (scores and their gradient read, the logits' written)
        permute   fwd 2 n_s B_a h          each copy's row gathered (read and written)
                  bwd (n_s + T_p) B_a h    the copies' gradients summed into their tokens
        combine   fwd (n_s + T_p) B_a h    the copies read, weighted by their probabilities and summed
                  bwd (2 n_s + T_p) B_a h  the token's gradient read, each copy's written; each copy's
                                           output read again for its weight's gradient
        regroup   fwd = bwd 4 n_e B_a h    under ep > 1 with several experts here: the received rows
                                           sorted by expert before the experts and back after them
    """
    B, h, E, k = cm.act_bytes, cm.model.dim, cm.n_experts, cm.top_k
    n_s = k * T_perm
    regroup = 4.0 * rows * B * h if ep > 1 and experts_here > 1 else 0.0
    fwd = (12 * E + 12 * k) * T_route + (3 * n_s + T_perm) * B * h + regroup
    bwd = 16 * E * T_route + (3 * n_s + 2 * T_perm) * B * h + regroup
    return fwd, bwd


def module_recompute_bytes(cm: CostBase, T_route: float, rows: float, f: float) -> float:
    """HBM bytes of recomputing, in one micro-batch's backward, the modules of
    ``Workload.recompute_modules`` of an MoE layer on a rank (:func:`~loom.plan.cost.memory.
    module_recompute_saved`), with B_a bytes per element, u = 2 GLU matrices (1 without a gate) and
    the ``rows`` its experts compute (k T load) at width f::

        moe_act    rows ((u + 1) B_a f + 4)   the GLU's input and the row's weight read, its output written
        layernorm  T_route (2 B_a h + 4)      the norm's input read, its output and 1/rms written
    """
    mods, B, h = cm.train.recompute_modules, cm.act_bytes, cm.model.dim
    u = 2 if cm.model.gated_mlp else 1
    act = rows * ((u + 1) * B * f + 4) if "moe_act" in mods else 0.0
    norm = T_route * (2 * B * h + 4) if "layernorm" in mods else 0.0
    return act + norm


def expert_backward(cm: CostBase, m: float, k: float, n: float) -> tuple[float, float]:
    """(backward, weight-gradient) seconds of a routed expert's GEMM (m x k) @ (k x n) on a datasheet GPU
    (``CostBase.kernels``): its input gradient (m x n) @ (n x k) and its weight gradient (k x m) @ (m x n)
    each through :meth:`Machine.gemm` at its own tile and wave quantization (an expert's few rows make a
    small weight-shaped output of few tiles), at the forward's precision; elsewhere r and r/2 times the
    forward (as a dense Linear's)."""
    fwd = linear_gemm(cm, m, k, n, expert=True)
    if not cm.kernels:
        return cm.bwd_ratio * fwd, cm.bwd_ratio / 2 * fwd
    tr = cm.train
    eight = cm.stack.lowp_experts and runs_8bit(tr.precision, k, n, tr.fp8_recipe, tr.fp8_layers)
    elem, bf16 = (1, False) if eight else (cm.act_bytes, True)
    wgrad = cm.machine.gemm(k, m, n, elem, bf16=bf16)
    return cm.machine.gemm(m, n, k, elem, bf16=bf16) + wgrad, wgrad


def microbatch_times(
    cm: CostBase,
    tp: int,
    sp: bool,
    cp: int,
    ep: int,
    mb: int,
    recompute: str,
    pp: int,
    world: int = 0,
    cp_mode: str = "allgather",
    tp_overlap: bool = False,
    split: tuple[int, ...] = (),
    expert_tp: str = "replicate",
    ep_overlap: bool = False,
) -> tuple[float, float, dict[str, float]]:
    """(t_mb of the slowest stage, its weight-grad time t_W, per-term times) for one micro-batch.

    An MoE layer on a tp rank (:meth:`~loom.plan.cost.base.CostBase.moe_tokens`): experts whole on
    every tp rank route and compute the rank's tokens (T/t with sp, else T: every rank all of them)
    at f; split experts compute the tp group's T tokens' rows at f/t (with sp the FLOPs of whole
    experts on T/t, without sp 1/t of them), shared experts too, and route T (Loom's: the sequence
    gathered) or the rank's shard (a stack gathering the routed rows); the ep all-to-all carries the
    rows of the tokens the rank routes. With ``ep_overlap`` the layer's all-to-alls (A: dispatch and
    combine, forward and backward) run beside another micro-batch's compute of the layer (C: forward,
    backward and recomputation): ``max(0, A - C) + (1 - comm_overlap) min(A, C)``
    (:func:`~loom.plan.cost.dp.contended`)."""
    mc, tr, mach = cm.model, cm.train, cm.machine
    B, h, f, s = cm.act_bytes, mc.dim, cm.ffn, tr.seq_len
    T = mb * s / cp
    head_8bit = tr.precision in ("fp8", "int8") and cm.stack.lowp_head  # the head's GEMM in 8 bits
    lin = partial(linear_gemm, cm)  # a block Linear's GEMM: 8-bit where it runs in 8 bits (m, in, out)
    # tokens per expert GEMM: T_r*top_k routed rows (T_r = T/tp with sp, else T, for experts whole on
    # every tp rank; the tp group's T for split ones, at f/t) spread over this device's experts, the
    # busiest ``moe_load`` times the mean; the router and the ep all-to-all on the tokens it routes
    T_route, T_moe = cm.moe_tokens(T, tp, sp, expert_tp)
    cut = cm.expert_cut(tp, expert_tp)
    ups = 2 if mc.gated_mlp else 1  # SwiGLU's w1 and w3, or GELU's w1
    # the block's Linears on this rank: (how many, m, in, out, a routed expert's)
    linears = [(1.0, T, h, h / tp, False), (2.0, T, h, cm.kv_width(tp), False), (1.0, T, h / tp, h, False)]
    if cm.moe:
        experts_here = cm.n_experts / ep
        Te = T_moe * cm.top_k / experts_here * tr.moe_load
        linears += [(experts_here * ups, Te, h, f / cut, True), (experts_here, Te, f / cut, h, True)]
        if tr.moe_shared:  # shared experts: one SwiGLU of S·f (S·f/t split) on every token of the rank
            fs = tr.moe_shared * f / cut
            linears += [(2.0, T_moe, h, fs, False), (1.0, T_moe, fs, h, False)]
    else:
        linears += [(float(ups), T, h, f / tp, False), (1.0, T, f / tp, h, False)]
    gemm_f = sum(c * lin(m, k, n, expert=e) for c, m, k, n, e in linears)
    r = cm.bwd_ratio  # 2 when GEMM FLOPs set the time; measured (profile) when per-op cost does
    # backward GEMMs r x forward, a routed expert's at its own shapes; weight gradients half of that
    expert_f = sum(c * lin(m, k, n, expert=True) for c, m, k, n, e in linears if e)
    expert_bw = [(c, expert_backward(cm, m, k, n)) for c, m, k, n, e in linears if e]
    gemm_b = r * (gemm_f - expert_f) + sum(c * bw for c, (bw, _) in expert_bw)
    gemm_w = r / 2 * (gemm_f - expert_f) + sum(c * w for c, (_, w) in expert_bw)
    other = cm.other if cm.kernels else 1.0  # a calibrated profile measured its own kernels
    route_f = route_b = 0.0
    if cm.moe:  # the router's logits (T x h) @ (h x E), outside the 8-bit swap (model FLOPs count it)
        router = mach.gemm(T_route, h, cm.n_experts, B, bf16=True)
        gemm_f, gemm_b, gemm_w = gemm_f + router, gemm_b + r * router, gemm_w + r / 2 * router
        T_perm = T_route / tp if cm.rows_pooled(tp, expert_tp, ep) else T_route  # Loom's split: 1/tp each
        fwd, bwd = moe_routing_bytes(cm, T_route, T_perm, Te * experts_here, ep, experts_here)
        route_f, route_b = other * fwd / mach.hbm, other * bwd / mach.hbm
    cast_bytes = [scale_cast_bytes(cm, m, k, n, e) for _, m, k, n, e in linears]
    cast_f = sum(lin_[0] * fb[0] for lin_, fb in zip(linears, cast_bytes)) / mach.hbm
    cast_b = sum(lin_[0] * fb[1] for lin_, fb in zip(linears, cast_bytes)) / mach.hbm
    a_t = mc.n_heads / tp
    qd = mc.n_heads * mc.head_dim
    core_bytes = B * T * (2 * qd / tp + 2 * cm.kv_width(tp))
    if not tr.flash_attention:
        core_bytes += 4 * B * a_t * T * s  # scores written, softmax read+write, read by AV
    mlp_elt = (
        3 * f * (cm.top_k * tr.moe_load + tr.moe_shared) / (tp if sp or cut > 1 else 1)  # f/t split
        if cm.moe
        else (3 if mc.gated_mlp else 2) * f / tp
    )
    elt_bytes = B * T * (10 * h / (tp if sp else 1) + 2 * (h / tp + cm.kv_width(tp)) + mlp_elt)
    elt_f = other * elt_bytes / mach.hbm
    if cm.kernels:  # per-kernel model (a GPU from the datasheet): flash kernels, batched GEMMs
        core_f, core_b = attention_core(cm, tp, cp, mb)
    else:
        core_f = max(4.0 * T * s * qd / tp * mc.attention_share(s) / mach.flops, core_bytes / mach.hbm)
        core_b = (FLASH_BWD if tr.flash_attention else 2.0) * r / 2 * core_f
    # fp8's scaling casts (torchao) and an MoE's routing bytes are redone when recomputed
    layer_f = gemm_f + core_f + elt_f + cast_f + route_f
    # LoRA: a frozen target computes no weight gradient (its adapters' rank-r GEMMs are left out)
    lora_wgrad = 0.0
    if tr.lora_rank:
        target_gemm = {
            "q": (h, h / tp),
            "k": (h, cm.kv_width(tp)),
            "v": (h, cm.kv_width(tp)),
            "o": (h / tp, h),
            "w1": (h, f / tp),
            "w3": (h, f / tp),
            "w2": (f / tp, h),
        }
        lora_wgrad = r / 2 * sum(lin(T, *target_gemm[n]) for n in tr.lora_targets)
    # backward: GEMMs (experts' at their shapes) and elementwise 2x forward; flash recomputes the scores (2.5x)
    layer_b = gemm_b + r * elt_f + core_b - lora_wgrad + cast_b + route_b
    recomp = {"none": 0.0, "selective": core_f + cm.stack.selective_gemms * gemm_f, "full": layer_f}[
        recompute
    ]
    if cm.moe and recompute != "full":  # single modules recomputed beside the policy (memory-bound)
        recomp += other * module_recompute_bytes(cm, T_route, Te * experts_here, f / cut) / mach.hbm
    ops, c_op = cm.ops, mach.op_time
    if ops is not None:  # the framework's per-operator cost: tp/cp/pp split FLOPs, not the op count; the
        # trainer's per-block hooks fire again in the recomputed forward (in proportion to its operators)
        again = ops.microbatch(1, recompute) - ops.microbatch(1)
        recomp += c_op * again + mach.microbatch_overhead * again / max(1.0, ops.layer_fb)
    n_tp = {"none": 4, "selective": 4, "full": 6}[recompute]

    def tp_time(
        calls: dict[tuple[str, float], float],
    ) -> float:  # each call: its collective + the layer's own cost
        extra = mach.call_overhead.get("tp", 0.0)
        return sum(
            k * (mach.collective(op, tp, size, tp, world or None) + extra) for (op, size), k in calls.items()
        )

    tp_layer = tp_time(tp_calls(cm, tp, sp, recompute, mb, "layer", cp, expert_tp, ep))
    if tp_overlap and tp > 1:  # each collective cut in tp chunks, pipelined with its GEMM: the first
        # chunk shows, the rest hides behind the layer's GEMMs at the cost of what runs beside compute
        gemms = gemm_f + gemm_b + (gemm_f if recompute == "full" else 0.0)
        tp_layer = exposed(tp_layer, tp, gemms, mach.comm_overlap(world or tp))
    cp_layer = cp_layer_time(cm, tp, cp, T, recompute, cp_mode, core_f, world) if cp > 1 else 0.0
    ep_layer = 0.0
    if cm.moe and ep > 1:
        # rows of the tokens this rank sends (T_sent·k, at most the capacity's), the busiest rank receiving ``moe_load`` x
        T_sent = T_route / tp if cm.rows_pooled(tp, expert_tp, ep) else T_route  # Loom's split: 1/tp each
        span = ep if tr.expert_folding else tp * ep  # folded: ep consecutive ranks, tp's among them
        ep_layer = n_tp * mach.collective(
            "all_to_all", ep, T_sent * cm.top_k * h * B * tr.moe_load, span, world or None
        )
        ep_layer += (
            (n_tp - 2) // 2 * mach.latency("all_to_all", ep, span, world or None)
        )  # the per-expert counts
        ep_layer += (n_tp + (n_tp - 2) // 2) * mach.call_overhead.get(
            "ep", 0.0
        )  # each call's cost in the layer
        if ep_overlap:  # beside another micro-batch's layer: what hides still costs 1 - comm_overlap
            window = layer_f + layer_b + recomp
            share = mach.comm_overlap(world or ep)
            ep_layer = contended(max(0.0, ep_layer - window), min(ep_layer, window), share)
    head = (1 + r) * (
        mach.gemm(T, h, mc.vocab_size / tp, 1)
        if head_8bit
        else mach.gemm(T, h, mc.vocab_size / tp, B, bf16=True)
    )
    cap = 5 * B if mc.logit_softcap > 0 else 0  # logit cap: z read, y written; y, dy read, dz written
    head += other * (16 + cap) * T * mc.vocab_size / tp / mach.hbm  # the loss's passes over the logits
    per_layer = {
        "compute": layer_f + layer_b,
        "recompute": recomp,
        "tp comm": tp_layer,
        "cp comm": cp_layer,
        "ep comm": ep_layer,
        "framework": c_op * ops.layer_fb if ops else 0.0,
    }
    first_tp = tp_time(tp_calls(cm, tp, sp, recompute, mb, "first", cp))
    last_tp = tp_time(tp_calls(cm, tp, sp, recompute, mb, "last", cp))

    def stage(layers: float, first: bool, last: bool) -> dict[str, float]:
        terms = {k: layers * v for k, v in per_layer.items()}
        terms["compute"] += head if last else 0.0
        if ops:  # the head's operators; the trainer's per-micro-batch cost per block (saved-tensor and
            # gradient hooks), and once more for the rest (embedding, head, loss, data)
            terms["framework"] += (c_op * ops.fixed_fb if last else 0.0) + (
                layers + 1
            ) * mach.microbatch_overhead
        terms["tp comm"] += (first_tp if first else 0.0) + (last_tp if last else 0.0)
        return terms

    kinds = [(True, True)] if pp == 1 else [(True, False), (False, True)] + [(False, False)] * (pp > 2)
    Ls, terms = max(
        (
            (cm.stage_layers(pp, f, la, split), stage(cm.stage_layers(pp, f, la, split), f, la))
            for f, la in kinds
        ),
        key=lambda st: sum(st[1].values()),
    )
    t_w = Ls * (gemm_w - lora_wgrad)  # weight-gradient GEMMs (trained ones)
    return sum(terms.values()), t_w, terms
