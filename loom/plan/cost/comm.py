"""Tensor-, context- and expert-parallel communication, and the collective calls of a step as
:class:`loom.comm.CommMeter` counts them (formulas: :mod:`loom.plan.cost`)."""

from __future__ import annotations

from loom.memory.precision import runs_8bit
from loom.plan.cost.base import CostBase
from loom.plan.cost.layout import Layout
from loom.plan.cost.params import qk_norm_params, qk_norm_partial


def tp_calls(
    cm: CostBase,
    tp: int,
    sp: bool,
    recompute: str,
    mb: int,
    part: str,
    cp: int = 1,
    expert_tp: str = "replicate",
    ep: int = 1,
) -> dict[tuple[str, float], float]:
    """Tensor-parallel collectives of one micro-batch, fwd + bwd, as Loom issues them:
    ``{(op, message bytes): calls}`` for one ``layer``, the ``first`` stage's extras (the
    vocabulary-parallel embedding) or the ``last`` stage's (final norm, head, loss).

    With S = T h B_a (the full sequence's hidden states; all-gather output = reduce-scatter
    input = S), per layer: without sp, 4 all-reduces of S (g after attention and MLP forward,
    f before them backward); with sp, 6 all-gathers (2 forward, 2 re-gathered for the weight
    gradients, 2 as the reduce-scatters' backward) and 4 reduce-scatters of S. Full
    recomputation repeats the forward's 2 (no sp: all-reduce; sp: all-gather +
    reduce-scatter). First stage: the embedding's all-reduce (sp: reduce-scatter, all-gather
    backward). Last stage: the head input's backward all-reduce (sp: 2 all-gathers + 1
    reduce-scatter) and the vocab-parallel loss's 2 all-reduces (row max: 4T bytes; sum-exp
    and target logit: 8T). Gradients held in part per rank are summed once per step
    (:meth:`tp_partial_params`), not here. OLMo-2's q/k norms over all heads
    (``qk_norm_scope = all``, ``ShardedRMSNorm``) add per layer 4 all-reduces of their (B, T, 1)
    fp32 sums of squares, 4T bytes (q and k, forward and backward; the forward's 2 again under
    full recomputation). fp8 / int8 add the amax MAX all-reduces of the 8-bit GEMMs on shards
    (:func:`amax_calls`).

    An MoE layer with experts whole on every tp rank (``replicate``) issues only its attention's calls
    (the experts run on the tokens each rank holds: every token without sp, its shard with sp).
    Split experts (``expert_tp = "split"``, :meth:`~loom.plan.cost.base.CostBase.expert_cut`): the
    attention's calls and the MoE's own, per layer. Without sp the MoE's are the dense MLP's (its input
    replicated; its output summed in an all-reduce of S forward, its input gradient backward): 4
    all-reduces of S in all, as above. With sp, Loom's (the sequence all-gathered before the router,
    the partial outputs reduce-scattered; backward a reduce-scatter of the input gradient and an
    all-gather of the output's, no re-gather: the gathered input is saved): the attention's 3
    all-gathers + 2 reduce-scatters and the MoE's 2 + 2 of S, 5 + 4; full recomputation repeats each
    sublayer's forward but the MoE's exit (its sum feeds nothing saved, and PyTorch's checkpoint stops
    before it): 2 + 1 more, 1 more all-reduce without sp. Loom's also all-reduces, in backward, the routing weights' gradient (each rank's
    from its partial rows): one call of 4 T k bytes (fp32) (:mod:`loom.parallel.tensor.experts`). A stack
    gathering the routed rows instead (``Stack.etp_gathers_rows``, Megatron-Core: A2A(EP) -> AG(TP)
    ... RS(TP) -> A2A(EP), the weights applied to the reduced rows) moves R = k·load·S, the rows the
    tp group computes, in the MoE's 2 + 2, and its shared experts (if any) run the dense MLP's 3 + 2 of S.
    Loom's split experts under ep > 1 (:meth:`~loom.plan.cost.base.CostBase.rows_pooled`,
    :mod:`loom.parallel.expert.tp_rows`) pool the received rows over tp besides: an all-gather and a
    reduce-scatter of R = k·load·S each way (the forward's again under full recomputation) and an
    all-gather of the peers' counts (8 E tp bytes).
    """
    if tp <= 1:
        return {}
    T = mb * cm.train.seq_len / cp
    S = T * cm.model.dim * cm.act_bytes
    again = 2 if recompute == "full" else 0
    calls: list[tuple[str, float, int]]
    if part == "layer" and cm.expert_cut(tp, expert_tp) > 1 and sp:  # split experts: attention + MoE
        a = again // 2  # each sublayer's forward again under full recomputation
        calls = [("all_gather", S, 3 + a), ("reduce_scatter", S, 2 + a)]  # attention
        gathers_rows = cm.expert_rows_gathered(tp, sp, expert_tp)
        rows = S * cm.top_k * cm.train.moe_load if gathers_rows else S  # the busiest rank's rows
        # the experts; recomputation stops before the exit's reduce-scatter (nothing saved needs it)
        calls += [("all_gather", rows, 2 + a), ("reduce_scatter", rows, 2 + a * gathers_rows)]
        if gathers_rows and cm.train.moe_shared:  # the stack's shared experts: a dense MLP of their own
            calls += [("all_gather", S, 3 + a), ("reduce_scatter", S, 2 + a)]
    elif part == "layer" and cm.expert_cut(tp, expert_tp) > 1:  # split, no sp: attention's 2 + the MoE's 2
        calls = [("all_reduce", S, 4 + again // 2)]  # the MoE's forward sum is not recomputed (not saved)
    elif part == "layer" and cm.moe and cm.expert_cut(tp, expert_tp) == 1:  # whole experts: attention's
        a = again // 2
        calls = (
            [("all_reduce", S, 2 + a)] if not sp else [("all_gather", S, 3 + a), ("reduce_scatter", S, 2 + a)]
        )
    elif part == "layer":
        calls = (
            [("all_reduce", S, 4 + again)]
            if not sp
            else [("all_gather", S, 6 + again), ("reduce_scatter", S, 4 + again)]
        )
    if part == "layer":
        if cm.expert_cut(tp, expert_tp) > 1 and not cm.expert_rows_gathered(tp, sp, expert_tp):
            calls.append(("all_reduce", 4.0 * T * cm.top_k, 1))  # the routing weights' gradient (fp32)
        if cm.model.qk_norm and cm.model.qk_norm_scope == "all":  # the norms' sums over tp
            calls.append(("all_reduce", 4.0 * T, 4 + again))
        if cm.rows_pooled(tp, expert_tp, ep):  # Loom's split experts under ep: rows pooled over tp
            a = again // 2  # forward again under full recomputation (the rows' sums are saved)
            R = S * cm.top_k * cm.train.moe_load  # the tp group's rows, each message padded to the busiest's
            calls += [("all_gather", R, 2 + a), ("reduce_scatter", R, 2 + a)]
            calls.append(("all_gather", 8.0 * cm.n_experts * tp, 1 + a))  # the peers' received counts
        calls += amax_calls(cm, tp, T, recompute)
    elif part == "first":
        calls = [("all_reduce", S, 1)] if not sp else [("reduce_scatter", S, 1), ("all_gather", S, 1)]
    else:
        calls = [("all_reduce", 4.0 * T, 1), ("all_reduce", 8.0 * T, 1)]  # the loss
        calls += [("all_reduce", S, 1)] if not sp else [("all_gather", S, 2), ("reduce_scatter", S, 1)]
    out: dict[tuple[str, float], float] = {}
    for op, size, k in calls:
        out[(op, size)] = out.get((op, size), 0) + k
    return out


def lowp_linears(cm: CostBase, tp: int) -> tuple[int, int]:
    """(column-, row-parallel) Linears of a block whose GEMMs run in 8 bits (fp8 / int8) under tp:
    those with both dims multiples of 16·tp (``loom.memory.precision.low_precision_target``) whose
    GEMM on a rank runs in 8 bits (``loom.memory.precision.runs_8bit``: under fp8 ``auto`` where float8
    pays): wq, wk, wv, w1 (and SwiGLU's w3) column-parallel, wo and w2 row-parallel; an MoE block's
    experts (shared ones too) are replicated over tp and run no collective, so only attention's count there."""
    m, tr = cm.model, cm.train
    h, f, q, kv = m.dim, m.resolved_ffn_dim(), m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim

    def ok(i: int, o: int, rank_i: float, rank_o: float) -> int:
        tiles = i % (16 * tp) == 0 and o % (16 * tp) == 0
        return int(tiles and runs_8bit(tr.precision, rank_i, rank_o, tr.fp8_recipe, tr.fp8_layers))

    col = ok(h, q, h, q / tp) + 2 * ok(h, kv, h, cm.kv_width(tp))
    row = ok(q, h, q / tp, h)
    if not cm.moe:
        col += ok(h, f, h, f / tp) * (2 if m.gated_mlp else 1)
        row += ok(f, h, f / tp, h)
    return col, row


def amax_calls(cm: CostBase, tp: int, T: float, recompute: str) -> list[tuple[str, float, int]]:
    """The MAX all-reduces of fp32 amaxes of one block's 8-bit GEMMs per micro-batch
    (:mod:`loom.memory.lowp_gemm`), T tokens: with C column- and R row-parallel 8-bit Linears
    (:func:`lowp_linears`), K = C + R. fp8 tensorwise: per Linear 3 calls, one per GEMM (column:
    the output's W, 4 bytes; the input gradient's dY and W, 8; the weight gradient's dY, 4; row: 8,
    4, 4), 3K calls of 16K bytes; rowwise and int8: one call per Linear of (T + h) fp32 amaxes (the
    rows of dY and columns of W for the column layer's input gradient, the rows of x and W for the
    row layer's output). Full recomputation runs the forward GEMMs again: K more calls (C of 4 bytes
    and R of 8) tensorwise, R more rowwise. Only for a stack that reduces per GEMM
    (:attr:`Stack.amax_per_gemm`: Loom's)."""
    if tp <= 1 or cm.train.precision not in ("fp8", "int8") or not cm.stack.amax_per_gemm:
        return []
    col, row = lowp_linears(cm, tp)
    again = recompute == "full"
    if cm.train.precision == "fp8" and cm.train.fp8_recipe == "tensorwise":
        return [
            ("all_reduce", 4.0, 2 * (col + row) + again * col),
            ("all_reduce", 8.0, col + row + again * row),
        ]
    return [("all_reduce", 4.0 * (T + cm.model.dim), col + row + again * row)]


def tp_payload(cm: CostBase, lay: Layout) -> dict[str, float]:
    """Bytes handed to tensor-parallel collectives per step on one device of the first stage, by op
    (what :class:`loom.comm.CommMeter` counts as payload): :func:`tp_calls`' messages times their
    calls, per micro-batch; the once-a-step sum of the gradients held in part
    (:func:`tp_partial_params`) is not included (its dtype is the strategy's gradient buffers')."""
    m = cm.train.global_batch // (lay.dp * lay.micro_batch)
    out: dict[str, float] = {}
    parts = [("layer", cm.model.n_layers // lay.pp), ("first", 1)] + [("last", 1)] * (lay.pp == 1)
    for part, times in parts:
        for (op, size), k in tp_calls(
            cm, lay.tp, lay.sp, lay.recompute, lay.micro_batch, part, lay.cp, lay.expert_tp, lay.ep
        ).items():
            out[op] = out.get(op, 0.0) + m * times * k * size
    return out


def tp_partial_params(
    cm: CostBase,
    tp: int,
    sp: bool,
    pp: int,
    last: bool = True,
    ep: int = 1,
    expert_tp: str = "replicate",
) -> float:
    """Parameters whose gradient each tp rank holds in part, summed over tp in one all-reduce
    per step (``loom.parallel.partial.sum_partial_grads``, ``tensor.parallelize.partial_numel``): with sp the norms'
    weights and LayerNorm biases (2 per layer + the final norm on the last stage), the
    row-parallel biases and the position table (on the first stage); replicated key/value
    weights and biases (k < t); q/k norm weights; with sp, the router, the shared experts and this
    rank's E/ep experts (replicated over tp, each rank routing its sequence shard). Split experts
    (``expert_tp = "split"``): none of the MoE's (the router routes the tp group's gathered tokens,
    the experts' slices are each rank's own), but the router's where the stack routes each rank's
    shard (``Stack.etp_gathers_rows``, Megatron-Core: its router weight is sequence-parallel)."""
    if tp <= 1:
        return 0.0
    m, pc = cm.model, cm.params
    layers, h, first = (
        m.n_layers / pp,
        m.dim,
        pp == 1 or not last,
    )  # pp > 1: the largest stage is the first
    qk_norms = qk_norm_partial(m, tp)  # per layer: whole on every rank, summed (sp or not)
    seq = layers * (pc.norms - qk_norm_params(m) + pc.attn_whole + pc.mlp_whole) + (
        pc.final_norm if last else 0
    )
    seq += pc.positions if first else 0
    kv = 2 * layers * cm.kd * (h + (1 if m.qkv_bias or m.bias else 0)) if m.n_kv_heads % tp else 0.0
    folded = cm.train.expert_folding  # the experts are this rank's own: nothing to sum over tp
    moe = layers * (pc.router + pc.shared + (0.0 if folded else pc.mlp / ep)) if cm.moe else 0.0
    if cm.expert_cut(tp, expert_tp) > 1:  # split: the router alone, where each rank routes its shard
        moe = layers * pc.router if cm.expert_rows_gathered(tp, sp, expert_tp) else 0.0
    return (seq + moe if sp else 0.0) + kv + layers * qk_norms


def collective_calls(cm: CostBase, lay: Layout) -> dict[str, int]:
    """Tensor-parallel and data-parallel/ZeRO collective calls per step on one device of the
    first stage, by op (what :class:`loom.comm.CommMeter` counts): :meth:`tp_calls` per
    micro-batch, one call per bucket (ZeRO 0: all-reduce; 1/2: reduce-scatter + all-gather),
    ZeRO-3 2u - 1 all-gathers per micro-batch (2u in a pipeline) and u reduce-scatters per step; hybrid sharding
    adds an all-reduce over the replicas per bucket (unit)."""
    m = cm.train.global_batch // (lay.dp * lay.micro_batch)
    out: dict[str, int] = {}

    def add(op: str, k: float) -> None:
        out[op] = out.get(op, 0) + int(k)

    parts = [("layer", cm.model.n_layers // lay.pp), ("first", 1)] + [("last", 1)] * (lay.pp == 1)
    for part, times in parts:
        for (op, _), k in tp_calls(
            cm, lay.tp, lay.sp, lay.recompute, lay.micro_batch, part, lay.cp, lay.expert_tp, lay.ep
        ).items():
            add(op, m * times * k)
    if (
        lay.ep > 1 and cm.moe
    ):  # per MoE layer: counts + dispatch + combine forward (again when recomputed), 2 backward
        add("all_to_all", m * (cm.model.n_layers // lay.pp) * (5 + 3 * (lay.recompute == "full")))
    if lay.cp > 1:  # per layer and micro-batch, forward again when recomputed (_cp_layer_time)
        layers, passes = cm.model.n_layers // lay.pp, 1 + (lay.recompute == "full")
        halo = round(layers * halo_share(cm, lay.cp, lay.cp_mode))
        if halo:  # a halo to each neighbour, dK/dV back
            add("send", m * halo * min(2, lay.cp - 1) * (passes + 1))
        layers -= halo
        if lay.cp_mode == "ring":  # one send per K/V hop (cp - 1 a pass), cp dK/dV hops
            add("send", m * layers * ((lay.cp - 1) * (passes + 1) + lay.cp))
        elif lay.cp_mode == "alltoall":  # q, k, v, output; their gradients
            add("all_to_all", m * layers * 4 * (passes + 1))
        else:  # K and V all-gathered, dK and dV reduce-scattered
            add("all_gather", m * layers * 2 * passes)
            add("reduce_scatter", m * layers * 2)
    if tp_partial_params(cm, lay.tp, lay.sp, lay.pp, lay.pp == 1, lay.ep, lay.expert_tp):
        add("all_reduce", 1)
    n = lay.dp_shard * lay.cp if lay.zero else lay.dp * lay.cp
    if n > 1:
        dense, expert = cm._params_on(lay.tp, lay.pp, lay.ep, True, lay.pp == 1, (), lay.expert_tp)
        if lay.ep == 1:  # experts, if any, share the dense buckets
            dense, expert = dense + expert, 0.0
        buckets = cm.buckets(dense * cm.R, lay.dp * lay.cp)
        if lay.zero == 0:  # expert shards: buckets of their own, summed over their edp group
            edp = cm.expert_group(lay.dp * lay.cp, lay.ep, lay.tp)
            add(
                "all_reduce",
                buckets + (cm.buckets(expert * cm.R, lay.dp * lay.cp) if edp > 1 and expert > 0 else 0),
            )
        elif lay.zero in (1, 2):
            add("reduce_scatter", buckets)
            add("all_gather", buckets)
        else:
            units, kept = cm.zero3_units(lay.pp, lay.tp)
            add("all_gather", m * (2 * units - (kept > 0)))
            add("reduce_scatter", units)
        if lay.zero and lay.dp > lay.dp_shard:  # hybrid: each reduced shard all-reduced over replicas
            add("all_reduce", buckets if lay.zero < 3 else cm.zero3_units(lay.pp, lay.tp)[0])
    return out


def halo_share(cm: CostBase, cp: int, mode: str) -> float:
    """The share of the layers whose window reaches at most one chunk back (w − 1 <= s/(2·cp)): under
    ring and all-gather they exchange only their halo rows (:mod:`loom.parallel.context.halo`)."""
    w, s = cm.model.sliding_window, cm.train.seq_len
    if cp < 2 or mode == "alltoall" or w <= 0 or w - 1 > s // (2 * cp):
        return 0.0
    return len(cm.model.windowed_layers()) / cm.model.n_layers


def cp_layer_time(
    cm: CostBase, tp: int, cp: int, T: float, recompute: str, mode: str, core_f: float, world: int
) -> float:
    """Exposed context-parallel communication of one layer and micro-batch (forward, backward and,
    under full recomputation, the forward again), T = tokens per device, averaged over the layers:
    a windowed layer within one chunk (:func:`halo_share`) sends each neighbour its H = w − 1 last
    rows of K and V per sequence, 2·H·kd·B_a, and gets their fp32 gradients back, 2·H·kd·4, the two
    directions at once and not overlapped; every other layer as its mode:

    - allgather: all-gathers of K and V before the core, reduce-scatters of dK, dV; not overlapped.
    - ring: cp − 1 K/V messages of 2 T kd B_a forward and again backward, plus cp fp32 dK/dV
      messages of 2 T kd 4 backward, each overlapped with one block's attention (the core's
      time / cp): exposed max(0, message − block) per hop.
    - alltoall: q, k, v and the output exchanged forward (their gradients backward), not
      overlapped; kv heads repeated by cp / gcd(k, cp).
    """
    mach, B, kv = cm.machine, cm.act_bytes, cm.kv_width(tp)
    span, w = tp * cp, world or None
    passes = 2 if recompute == "full" else 1  # forwards per step
    share = halo_share(cm, cp, mode)
    rows = (cm.model.sliding_window - 1) * T * cp / cm.train.seq_len  # H per sequence, the micro-batch's
    halo = passes * mach.collective("p2p", 2, 2 * rows * kv * B, span, w)
    halo += mach.collective("p2p", 2, 2 * rows * kv * 4, span, w)
    whole = _cp_whole_layer(cm, tp, cp, T, recompute, mode, core_f, world) if share < 1 else 0.0
    return share * halo + (1 - share) * whole


def _cp_whole_layer(
    cm: CostBase, tp: int, cp: int, T: float, recompute: str, mode: str, core_f: float, world: int
) -> float:
    """:func:`cp_layer_time` of a layer attending over the whole sequence (its mode's exchange)."""
    mach, B, kv, h = cm.machine, cm.act_bytes, cm.kv_width(tp), cm.model.dim
    span, w = tp * cp, world or None
    passes = 2 if recompute == "full" else 1  # forwards per step
    if mode == "ring":
        block = core_f / cp
        kv_hop = max(0.0, mach.collective("p2p", 2, 2 * T * kv * B, span, w) - block)
        dkv_hop = max(0.0, mach.collective("p2p", 2, 2 * T * kv * 4, span, w) - cm.bwd_ratio * block)
        return (cp - 1) * kv_hop * (passes + 1) + cp * dkv_hop
    if mode == "alltoall":
        f = cm._kv_repeat(tp, cp)
        one = 2 * mach.collective("all_to_all", cp, T * h / tp * B, span, w)  # q and the output
        one += 2 * mach.collective("all_to_all", cp, T * kv * f * B, span, w)  # k and v
        return one * (passes + 1)
    kv_full = B * T * cp * kv
    gathers = 2 * passes
    return gathers * mach.collective("all_gather", cp, kv_full, span, w) + 2 * mach.collective(
        "reduce_scatter", cp, kv_full, span, w
    )
