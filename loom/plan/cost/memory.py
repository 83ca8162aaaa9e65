"""Memory terms: model states (ZeRO, offload, LoRA/QLoRA, Adafactor), activations of the layers in
flight, logits, gradients kept across micro-batches, the optimizer's temporaries and overhead
(formulas: :mod:`loom.plan.cost`)."""

from __future__ import annotations

from loom.config import target_shapes
from loom.finetune.nf4 import nf4_bytes
from loom.memory.precision import runs_8bit
from loom.model.loss import CHUNK_ROWS
from loom.model.moe import grouped_mm_aligned
from loom.plan.cost.base import CostBase
from loom.plan.cost.comm import halo_share
from loom.plan.cost.layout import Layout
from loom.plan.cost.pipeline import inflight_layers
from loom.plan.zero_options import zero3_memory
from loom.rules import ASYNC_SCHEDULES

FRAGMENTATION = 0.10  # share of dynamic memory lost to allocator fragmentation (assumption)


def state_memory(cm: CostBase, lay: Layout, first: bool = True, last: bool = True) -> dict[str, float]:
    """Weights, gradients, optimizer state and ZeRO-3 gather buffer on one device (bytes)."""
    return dict(
        cm.memo(state_terms)(
            lay.tp,
            lay.pp,
            lay.cp,
            lay.ep,
            lay.zero,
            lay.dp_shard,
            lay.offload,
            first,
            last,
            lay.split,
            lay.expert_tp,
        )
    )


def adapters_on(
    cm: CostBase, t: int, pp: int, first: bool, last: bool, split: tuple[int, ...] = ()
) -> tuple[float, float]:
    """(LoRA adapter parameters, target base elements) on one device of a stage: per block and
    target of shape (d_out, d_in), r·(d_in + d_out/t) for a column-parallel target (q, k, v, w1, w3:
    B split with W's rows), r·(d_in/t + d_out) for a row-parallel one (o, w2: A split with W's
    columns); the base weight d_out·d_in/t."""
    r, layers = cm.train.lora_rank, cm.stage_layers(pp, first, last, split)
    shapes = target_shapes(cm.model)
    adapters = base = 0.0
    for name in cm.train.lora_targets:
        d_out, d_in = shapes[name]
        adapters += r * ((d_in / t + d_out) if name in ("o", "w2") else (d_in + d_out / t))
        base += d_out * d_in / t
    return layers * adapters, layers * base


def lora_state(
    cm: CostBase,
    tp: int,
    pp: int,
    first: bool,
    last: bool,
    split: tuple[int, ...],
    dense: float,
    expert: float,
    shard: tuple[int, ...],
    shard_e: tuple[int, ...],
) -> dict[str, float]:
    """A LoRA/QLoRA rank's states: the frozen base at W bytes per element (no gradient, no optimizer
    state; QLoRA's targets in NF4: n/2 + n/64 + 4·ceil(n/16384) + 4 bytes), sharded like the weights;
    the adapters' weights, gradients and optimizer state as any trained parameter's."""
    W, G, O = cm.W, cm.G, cm.O  # noqa: E741 (the module doc's names)
    adapters, targets = adapters_on(cm, tp, pp, first, last, split)
    frozen = W * (dense / shard[0] + expert / shard_e[0])
    if cm.train.qlora:  # each target's weight is quantized on its own (QLoRA refuses tp > 1)
        shapes, layers = target_shapes(cm.model), cm.stage_layers(pp, first, last, split)
        nf4 = layers * sum(nf4_bytes(shapes[n][0] * shapes[n][1]) for n in cm.train.lora_targets)
        frozen += (nf4 - W * targets) / shard[0]
    return {
        "weights": frozen + W * adapters / shard[0],
        "gradients": G * adapters / shard[1],
        "optimizer": O * adapters / shard[2],
    }


def state_terms(
    cm: CostBase,
    tp: int,
    pp: int,
    cp: int,
    ep: int,
    zero: int,
    dp_shard: int,
    offload: bool,
    first: bool,
    last: bool,
    split: tuple[int, ...] = (),
    expert_tp: str = "replicate",
) -> tuple[tuple[str, float], ...]:
    W, G, O = cm.W, cm.G, cm.O  # noqa: E741 (the module doc's names)
    dense, expert = cm._params_on(tp, pp, ep, first, last, split, expert_tp)
    n = dp_shard * cp if zero else 1
    n_e = cm.expert_group(n, ep, tp) if zero else 1
    shard = {0: (1, 1, 1), 1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}[zero]
    shard_e = {0: (1, 1, 1), 1: (1, 1, n_e), 2: (1, n_e, n_e), 3: (n_e, n_e, n_e)}[zero]
    weights = W * (dense / shard[0] + expert / shard_e[0])
    buffer = 0.0
    if zero == 3:
        buffer = zero3_transient(cm, tp, pp, ep, first, last, n, expert_tp=expert_tp)
    optim = O * (dense / shard[2] + expert / shard_e[2])
    if cm.train.ps_shards:  # the moments live on the servers: worker 0 holds server 0's shard if co-located
        optim = O * dense / cm.train.ps_shards if cm.train.ps_colocate else 0.0
    if cm.train.optimizer == "adafactor":  # 4 (R + C) per matrix, 4 per vector element
        optim += factored_bytes(cm, tp, pp, ep, first, last) / shard[2]
    grads = G * (dense / shard[1] + expert / shard_e[1])
    if cm.train.lora_rank:
        lora = lora_state(cm, tp, pp, first, last, split, dense, expert, shard, shard_e)
        weights, grads, optim = lora["weights"], lora["gradients"], lora["optimizer"]
    return (
        ("weights", weights),
        ("gradients", grads),
        ("optimizer", 0.0 if offload else optim),
        ("zero3 buffer", buffer),
    )


def zero3_transient(
    cm: CostBase,
    tp: int,
    pp: int,
    ep: int,
    first: bool,
    last: bool,
    n: int,
    filling: bool = True,
    expert_tp: str = "replicate",
) -> float:
    """ZeRO-3's gathered units and gradients at the step's peak (bytes), as Loom runs them: the
    largest, over the units u of the stage in backward order, of

        W·u + W·next(u) + G·(p(u) + x(u)) + G·u·filling + G·(last two reduced)·filling + held(u)

    A unit in backward is gathered (W·u) and prefetches the one backward reaches next (W·next:
    none when that one stays gathered or there is none); autograd forms the gradients p(u) of one
    node at once (G·p: the widest matrix, or a column-parallel group: ``zero3_unit_sizes``) beside
    the unit's full gradient buffer (G·u, filling), and at most ``MAX_INFLIGHT`` = 2 full buffers of
    the units before it are being reduce-scattered.
    Units in backward order: final norm + head on the last stage; the stage's blocks (under ep > 1 a
    block's experts are a unit of their own, run first in backward: the next block's dense part is
    what they prefetch); the embedding on the first stage. Without a pipeline a tied embedding and
    head are one unit, gathered from the head's backward to the embedding's while autograd holds the
    head's gradient (held beside every block: W·u_t + G·p_t [+ G·u_t, filling]), then adds the
    embedding's to it (x = p beyond the embedding's own; at tp 1 a third tensor, x = 2p:
    ``CostBase.zero3_unit_sizes``). ``filling=False`` (gradient
    accumulation): every unit's full gradient buffer is already held (:func:`accumulated_gradients`),
    so the filling one does not count again, and each unit reduced before u has freed its G·u (at
    launch when cast, below; else once its reduction completes: all but the last two).

    A reduction in flight costs c = :func:`reduction_bytes` per element: G (the buffer itself) when
    gradients are reduced in their own dtype, else R·(1 + 1/N) (the cast copy sent and the shard
    received in the reduce dtype R; the G buffer is freed at launch). With R ≠ G the launch of u is a
    moment of its own: W·next + G·u·filling + c·(u + last two reduced), its weights resharded."""
    W, G, f = cm.W, cm.G, float(filling)
    pc = cm.params
    (block, p_block, _), *ends = cm.zero3_unit_sizes(tp, pp, ep, first, last, expert_tp)
    table = cm.model.vocab_size * cm.model.dim / tp
    tied = first and last and pp == 1 and not pc.head  # one unit: embedding + head (+ final norm)
    cut = cm.expert_cut(tp, expert_tp)
    experts = (
        pc.mlp / (ep * cut) if cm.moe and ep > 1 else 0.0
    )  # a unit of its own (loom.parallel.zero.stage3)
    # a block's units as its reducers see them: (elements, reduced over the experts' group)
    reduced_block = [(block - experts, False), (experts, True)] if experts else [(block, False)]
    # (name, elements, largest parameter, extra gradients, reduced units), in backward order
    order: list[tuple[str, float, float, float, list[tuple[float, bool]]]] = []
    if tied:
        order.append(("head", ends[0][0], table, 0.0, []))
    elif last and (pc.head or pp > 1):
        order.append(("head", ends[-1][0], table, 0.0, [(ends[-1][0], False)]))
    order += [("block", block, p_block, 0.0, reduced_block)] * int(cm.stage_layers(pp, first, last))
    if tied:
        order.append(("embedding", ends[0][0], table, ends[0][2], []))  # the head's (and their sum at tp 1)
    elif first:
        order.append(("embedding", table, table, 0.0, [(table, False)]))
    held_tied = W * ends[0][0] + G * table + G * ends[0][0] * f if tied else 0.0
    cast = cm.R != G
    c = {
        False: reduction_bytes(cm, n),
        True: reduction_bytes(cm, cm.expert_group(n, ep, tp)),
    }  # dense, experts
    worst = 0.0
    reduced: dict[bool, list[float]] = {False: [], True: []}  # per reducer (its own in-flight window)
    # running sums of each reducer's units, all and all but the last two, added in the order a sum of
    # the list would (the same floats; the walk stays linear in the layers)
    total = {False: 0.0, True: 0.0}
    older = {False: 0.0, True: 0.0}
    for i, (name, u, p, extra, done) in enumerate(order):
        nxt = order[i + 1] if i + 1 < len(order) else None
        prefetch = 0.0
        if nxt is not None and not (tied and nxt[0] == "embedding"):
            prefetch = nxt[1] - (experts if nxt[0] == "block" else 0.0)  # a block: its dense part first
        # reductions in flight beside u, the last two of each reducer; accumulating, less the buffers
        # of the units reduced before u (freed at launch when cast, else once their reduction completes)
        flight = 0.0
        for k, r in reduced.items():
            if filling:
                flight += c[k] * sum(r[-2:])
            elif cast:
                flight += c[k] * sum(r[-2:]) - G * total[k]
            else:
                flight -= G * older[k]
        held = held_tied if tied and name == "block" else 0.0
        moment = W * (u + prefetch) + G * (p + extra + u * f) + flight
        worst = max(worst, moment + held)
        if cast and done:  # u's launch: its cast copy and received shard beside its buffer
            own = sum(c[k] * e for e, k in done)
            worst = max(worst, W * prefetch + G * u * f + own + flight + held)
        for e, k in done:
            if len(reduced[k]) >= 2:  # leaves the window of the last two
                older[k] += reduced[k][-2]
            reduced[k].append(e)
            total[k] += e
    return worst


def reduction_bytes(cm: CostBase, n: int) -> float:
    """Bytes per gradient element of one reduction in flight (:class:`loom.parallel.reducer.GradReducer`):
    G, the buffer sent in place, when gradients are reduced in the dtype they are kept in; else
    R·(1 + 1/N), its copy cast to the reduce dtype (``parallel.reduce_dtype``, R bytes) and the shard
    received in it over the N-rank sharding group (the G buffer is freed at launch, or kept as state);
    N = 1 (replicated masters): R, the copy reduced in place across replicas."""
    return cm.G if cm.R == cm.G else cm.R * (1 + 1 / n if n > 1 else 1)


def gradient_in_flight(
    cm: CostBase, tp: int, pp: int, ep: int, first: bool, last: bool, expert_tp: str = "replicate"
) -> float:
    """G·(p + x)_max: the gradients autograd forms at once for the stage's largest parameter (the
    embedding or head table V·h/t, else a block's widest matrix or column-parallel group) before
    they are added into the flat gradient buffer or bucket of ZeRO-1/2; a tied embedding and head
    without a pipeline: 3·G·V·h/t at the embedding's backward at tp 1 (the head's gradient, held by
    autograd, the embedding's, and their sum), 2·G·V·h/t under tp > 1 (added in place; both
    measured). ZeRO-3 counts it in its transient; under plain data
    parallelism autograd's tensor becomes the parameter's gradient, measured: no second copy. LoRA:
    adapters only."""
    if cm.train.lora_rank:
        return 0.0
    return cm.G * max(p + extra for _, p, extra in cm.zero3_unit_sizes(tp, pp, ep, first, last, expert_tp))


def sharding(lay: Layout) -> int:
    """N, the ranks the optimizer state is sharded over: dp_shard·cp under ZeRO, else 1."""
    return lay.dp_shard * lay.cp if lay.zero else 1


def flat_stage(cm: CostBase, lay: Layout) -> int:
    """The stage of Loom's flat-bucket ZeRO path a layout runs (:func:`loom.train.build.data_parallel`):
    ZeRO-1/2 as set; without ZeRO under mixed precision or an optimizer other than AdamW, the same
    path over a sharding group of one rank (replicated masters or state) with stage 2's hooks, stage
    1's under a pipeline; else 0 (ZeRO-3, or plain data parallelism, whose gradient is the
    parameter's own)."""
    if lay.zero in (1, 2):
        return lay.zero
    flat = cm.train.mixed or cm.train.optimizer != "adamw"  # loom.memory.precision.needs_master_path
    return (2 if lay.pp == 1 else 1) if lay.zero == 0 and flat else 0


def reduction_moment(
    cm: CostBase, lay: Layout, stage: int, first: bool, last: bool, act: float, accumulated: float
) -> float:
    """The flat path's (``stage``: :func:`flat_stage`) bytes beyond the model states when a table's
    bucket (V·h/t elements, its own bucket: larger than ``parallel.bucket_mb``) is reduced in a wider
    dtype than its gradients (R ≠ G; else 0, the buffer is sent in place), c = :func:`reduction_bytes`
    per element in flight:

        head's bucket, first reduced in backward (last stage):  act + A + c·V h/t   (ZeRO-2 without
            accumulation: + G·V h/t, the bucket cast while it lives)
        embedding's, last reduced (first stage):  c·(V h/t + q + k) + G·V h/t (ZeRO-2's buffer)

    where A = the accumulated full-size gradients (ZeRO-2 with m > 1), and q + k the two buckets
    reduced just before the embedding's, still in flight: the first block's wq (or a full bucket of
    smaller parameters) and wk, at most the stage's blocks (measured: llama3-70b on the H100,
    gpt-125m on the CPU); the activations are freed by then. Under ep > 1 the experts reduce over
    their own group, with their own window: its last two stacked weights (E/ep·f·h each) too."""
    if cm.R == cm.G or not stage:
        return 0.0
    c = reduction_bytes(cm, sharding(lay))
    table = cm.model.vocab_size * cm.model.dim / lay.tp
    own = cm.G * table if stage == 2 else 0.0
    moment = 0.0
    if last and (cm.params.head or lay.pp > 1):
        moment = act + (accumulated or own) + c * table
    if first:
        end = own + c * (table + embedding_companions(cm, lay, first, last))
        if cm.moe and lay.ep > 1:  # the experts' reducer (their group): its last two stacked weights
            n_e = cm.expert_group(sharding(lay), lay.ep, lay.tp)
            stacked = cm.n_experts / lay.ep * cm.ffn * cm.model.dim / cm.expert_cut(lay.tp, lay.expert_tp)
            end += reduction_bytes(cm, n_e) * 2 * stacked
        moment = max(moment, end)
    return moment


def embedding_companions(cm: CostBase, lay: Layout, first: bool, last: bool) -> float:
    """Elements of the two buckets reduced just before the embedding's, in flight beside it: the
    first block's wq (or a full ``parallel.bucket_mb`` bucket of smaller parameters) and wk, at most
    the stage's blocks."""
    cap = cm.train.bucket_bytes / cm.G
    q = cm.model.n_heads * cm.model.head_dim * cm.model.dim / lay.tp
    k = cm.kv_width(lay.tp) * cm.model.dim
    blocks = cm.zero3_unit_sizes(lay.tp, lay.pp, lay.ep, first, last, lay.expert_tp)[0][0]
    return min(max(q, cap) + k, blocks * cm.stage_layers(lay.pp, first, last, lay.split))


def keeps_full_gradients(cm: CostBase, lay: Layout, m: int) -> bool:
    """Whether ZeRO-2/3 keep full-size gradient buffers between the micro-batches of a step, as
    Loom's runtime does: the trainer's accumulation loop and the pipeline's synchronous schedules
    (every backward of a chunk but its last) run under ``no_sync``, which folds each gradient into
    the unit's (ZeRO-3) or bucket's (ZeRO-2) full-size buffer and reduces once, after the last
    micro-batch. Not kept with one micro-batch, nor under the asynchronous pipeline schedules
    (PipeDream, 2BW: no ``no_sync``, every micro-batch reduced at once), nor by a stack that
    reduce-scatters every micro-batch (:attr:`Stack.microbatch_reduce`). Without ZeRO, stage 2's hooks
    of the flat path (:func:`flat_stage`: mixed precision or a non-AdamW optimizer) keep them too,
    beside the full-size gradient they reduce into."""
    stage = 3 if lay.zero == 3 else flat_stage(cm, lay)
    if stage < 2 or m <= 1 or cm.stack.microbatch_reduce:
        return False
    return not (lay.pp > 1 and lay.schedule in ASYNC_SCHEDULES)


def accumulated_gradients(
    cm: CostBase,
    tp: int,
    pp: int,
    ep: int,
    first: bool,
    last: bool,
    split: tuple[int, ...] = (),
    expert_tp: str = "replicate",
) -> float:
    """Full-size gradient buffers held between micro-batches (bytes), beside the persistent 1/N
    shard: G·Φ_stage, the stage's trained parameters (LoRA: the adapters only)."""
    if cm.train.lora_rank:
        return cm.G * adapters_on(cm, tp, pp, first, last, split)[0]
    dense, expert = cm._params_on(tp, pp, ep, first, last, split, expert_tp)
    return cm.G * (dense + expert)


def factored_bytes(cm: CostBase, tp: int, pp: int, ep: int, first: bool, last: bool) -> float:
    """Adafactor's factored second moments on one device before ZeRO: 4 (R + C) bytes per
    (R x C) weight matrix slice it holds, 4 bytes per vector element (norms, biases)."""
    m, h, f, kd, V, pc = cm.model, cm.model.dim, cm.ffn, cm.kd, cm.model.vocab_size, cm.params
    experts = cm.n_experts / ep if cm.moe else 1
    kv_rows = kd / tp if m.n_kv_heads % tp == 0 else kd
    qd, mats = m.n_heads * m.head_dim, (3 if m.gated_mlp else 2)
    biases = (qd / tp + 2 * kv_rows if m.qkv_bias or m.bias else 0) + pc.attn_whole
    biases += (f / tp if pc.mlp_whole else 0) + pc.mlp_whole  # w1's rows, w2's whole bias
    layer = 4 * ((qd / tp + h) * 2 + (kv_rows + h) * 2 + experts * mats * (f / tp + h)) + 4 * (
        cm.norms_on(tp) + biases
    )
    total = cm.stage_layers(pp, first, last) * layer
    if first:
        total += 4 * (V / tp + h) + (4 * (m.max_seq_len + h) if pc.positions else 0)
    if last:
        total += 4 * pc.final_norm + (4 * (V / tp + h) if pc.head or pp > 1 else 0)
    return total


def step_workspace(cm: CostBase, lay: Layout, first: bool = True, last: bool = True) -> float:
    """Temporaries of Loom's optimizer step on one device: under mixed precision the fp32 copy of the
    gradient shard, 4·Φ_opt·mixed bytes for the Φ_opt elements whose optimizer state it holds.
    torch's fused AdamW kernel (CPU and CUDA: :func:`loom.optim.adamw.fused_supported`) computes
    the denominators sqrt(v) in registers; the ``_foreach`` fallback would add 4·Φ_opt for them.
    Adafactor builds one piece's V̂ = r cᵀ at a time (:mod:`loom.optim.adafactor`): 4 bytes per
    element of its largest matrix on the rank (the embedding or head table, else a block's widest).
    8-bit Adam works in chunks: not counted."""
    if cm.train.optimizer not in ("adamw", "adafactor") or lay.offload:
        return 0.0
    dense, expert = cm._params_on(lay.tp, lay.pp, lay.ep, first, last, lay.split, lay.expert_tp)
    n = sharding(lay)
    elements = dense / n + expert / (cm.expert_group(n, lay.ep, lay.tp) if lay.zero else 1)
    grads32 = 4.0 * elements if cm.train.mixed else 0.0
    if cm.train.optimizer == "adamw":
        return grads32
    widest = max(p for _, p, _ in cm.zero3_unit_sizes(lay.tp, lay.pp, lay.ep, first, last, lay.expert_tp))
    return grads32 + 4.0 * min(widest, elements)


def layer_activation(cm: CostBase, lay: Layout) -> tuple[float, float, float]:
    """Bytes of one layer, one micro-batch: (no recomputation, selective, block input)."""
    return cm.memo(activation_terms)(
        lay.tp, lay.sp, lay.cp, lay.micro_batch, lay.cp_mode, lay.ep, lay.expert_tp
    )


def norm_activation(cm: CostBase) -> float:
    """Bytes a norm saves per token: its input B_a h and fp32 statistics 4 (1/rms; LayerNorm 8: mean,
    1/σ) (:mod:`loom.model.norms`, as the fused kernels of apex and Transformer Engine), and its
    output B_a h, the next matmul's input: 2 B_a h + 4 (8)."""
    stats = 2 if cm.model.norm == "layernorm" else 1
    return 2 * cm.act_bytes * cm.model.dim + 4 * stats


def final_norm_activation(cm: CostBase, t: int, sp: bool, cp: int, mb: int) -> float:
    """Bytes the final norm saves on the last stage, one micro-batch of T = b·s/cp tokens: as a
    block's norm (:func:`norm_activation`), its output the head's input; on T/t tokens with sp."""
    return mb * cm.train.seq_len / cp * norm_activation(cm) / (t if sp else 1)


def moe_saved(cm: CostBase, t: int, sp: bool, T: float, ep: int, expert_tp: str = "replicate") -> float:
    """Bytes a MoE layer saves on one tp rank, T = b·s/cp tokens of its tp group:
    :func:`moe_activation` on the tokens the rank routes and the rows it computes
    (:meth:`~loom.plan.cost.base.CostBase.moe_tokens`). Experts whole on every tp rank: its tokens,
    T/t with sp, else T. Split experts (f/t per rank, ``expert_tp = "split"``): the tp group's T tokens'
    rows at f/t; routed on T, the sequence all-gathered under sp (Loom: the gathered input B_a T h is
    saved, the router's and the rows' source, where the norm's output shard B_a T h / t was), or on the
    rank's own shard where the stack gathers the routed rows (``Stack.etp_gathers_rows``). Loom's split
    experts under ep (:meth:`~loom.plan.cost.base.CostBase.rows_pooled`) get back, and weight, the rows of
    their 1/t of the tokens only: 2 B_a k h per token on T/t."""
    routed, rows = cm.moe_tokens(T, t, sp, expert_tp)
    cut = cm.expert_cut(t, expert_tp)
    out = moe_activation(cm, routed, ep, cut, rows if cut > 1 else None)
    if cut > 1 and sp and not cm.expert_rows_gathered(t, sp, expert_tp):
        out += cm.act_bytes * T * cm.model.dim * (1 - 1 / t)
    if cm.rows_pooled(t, expert_tp, ep):  # the returned rows, weighted: only this rank's 1/t of the tokens'
        out -= 2 * cm.act_bytes * cm.top_k * cm.model.dim * routed * (1 - 1 / t)
    return out


def moe_activation(cm: CostBase, T: float, ep: int, cut: int = 1, rows: float | None = None) -> float:
    """Bytes a MoE layer (:mod:`loom.model.moe`; ep > 1 :mod:`loom.parallel.expert.parallelize`)
    saves for backward on T tokens, k = top_k, E experts, beside its norm's output (the router's
    input, counted with the norms); measured with balanced routing (tests/test_plan_activations.py):

        router     fp32 scores 4 E, expert ids 8 k, renormalized weights: fp32 gathered scores and
                   their sum 4 k + 4                                                   per token
        sort       assignment order and token ids 16 k (ep > 1: the partition's order too, 24 k),
                   the sorted weights B_a k, the capacity's keep mask k (ep 1, capacity_factor > 0)
        combine    weighted rows B_a k h (ep > 1: and the rows returned, 2 B_a k h)
        experts    per row received, T k ``moe_load`` rows: sorted input and expert output 2 B_a h,
                   SwiGLU 4 B_a f (w1 x, silu, w3 x, product), its place (ep > 1) 8
        offsets    4 E / ep bytes per layer (the grouped matmul's int32 group ends; none with
                   ``moe.compute = loop``, which runs each expert on its slice)
        shared     S shared experts (``moe.n_shared_experts``): their SwiGLU 4 B_a S f per token
                   (of the ``rows`` tokens)
        z-loss     the fp32 logits and their log-sum-exp 4 E + 4 per token (``moe.z_loss_coef``)
        aux loss   f_e 4 E per layer (``moe.aux_loss_coef``); sigmoid scores add their per-token
                   sum 4 (the loss normalizes them)

    Where the device has no ``torch._grouped_mm`` for the activations' dtype (``DeviceSpec.grouped_mm``:
    CUDA below sm90, fp32 or fp16 on CUDA, fp16 on the CPU), or h or f rows are not 16-byte
    multiples (:func:`loom.model.moe.grouped_mm_aligned`), the experts run a zero-padded batched
    matmul over an (E/ep, W, h) batch, W = T at ep 1 (every expert padded to the tokens) and
    ep T k ``moe_load`` / E at ep > 1 (the busiest expert's rows): per row its output B_a h and
    its (expert, slot) index 16 (not the sorted input, no offsets), per layer the batch and its
    SwiGLU (E/ep) W (B_a h + 4 B_a f). Not counted: hot experts.

    Split experts (``cut`` = t, :func:`moe_saved`): f is f/t, and the rows a rank computes are those of
    ``rows`` tokens (their input, SwiGLU, place; the shared experts' tokens), the per-token terms and
    the rows' weighted output (B_a h, as they return) of the T tokens it routes.

    A stack whose MoE layer is Megatron-Core's (``Stack.moe_saves = "megatron"``) keeps another set:
    :func:`megatron_moe_activation`."""
    if cm.stack.moe_saves == "megatron":
        return megatron_moe_activation(cm, T, cut, rows)
    B, k, E, f = cm.act_bytes, cm.top_k, cm.n_experts, cm.ffn / cut
    R = T if rows is None else rows
    router = 4 * E + 8 * k + 4 * k + 4
    sort = (24 if ep > 1 else 16) * k + B * k
    if ep == 1 and cm.train.capacity_factor > 0:
        sort += k
    combine = (2 if ep > 1 else 1) * B * k * cm.model.dim
    tr, h = cm.train, cm.model.dim
    place = 8 if ep > 1 else 0
    per_row = k * tr.moe_load * (2 * B * h + 4 * B * f + place)
    per_layer = (4 * E / ep) * (tr.moe_compute != "loop") + 4 * E * tr.moe_aux_loss
    dtype = {"fp32": "fp32", "tf32": "fp32", "fp16": "fp16"}.get(tr.precision, "bf16")
    grouped = dtype in cm.cluster.device.grouped_mm and grouped_mm_aligned(h, round(f), B)
    if tr.moe_compute == "grouped" and not grouped:  # the padded batch
        width = R if ep == 1 else ep * R * k * tr.moe_load / E
        per_row = k * tr.moe_load * (B * h + 16 + place)
        per_layer += E / ep * width * (B * h + 4 * B * f) - 4 * E / ep
    shared = 4 * B * tr.moe_shared * f
    losses = (4 * E + 4) * tr.moe_z_loss + 4 * (tr.moe_aux_loss and tr.moe_score == "sigmoid")
    if rows is None:  # every term on the rank's T tokens
        return T * (router + sort + combine + per_row + shared + losses) + per_layer
    out = k * tr.moe_load * B * h  # a row's output, weighted where it returns
    return T * (router + sort + combine + losses + out) + R * (per_row - out + shared) + per_layer


def megatron_moe_activation(cm: CostBase, T: float, cut: int = 1, rows: float | None = None) -> float:
    """Bytes Megatron-Core's MoE layer (``MoELayer``: ``TopKRouter``, the alltoall or flex dispatcher,
    ``TEGroupedMLP`` under ``moe_grouped_gemm`` and ``bias_activation_fusion``) saves for backward on
    the T tokens a rank routes, the R = ``rows`` tokens' rows it computes (R = T unless split),
    k = top_k, ``moe_load`` l, E experts, f = f/``cut``, u = 2 GLU matrices (SwiGLU, GPT-OSS's
    gated QuickGELU) or 1::

        per token (T)   4 E         the router's fp32 logits, kept by its fused softmax and top-k
                        4 (2 E + 1)  the fused permutation's int32 row map (Transformer Engine's
                                    ``moe_permute``; its backward and the unpermutation's need only it)
                        + the z / aux losses' terms (:func:`moe_activation`)
                        + B_a k l h  ``moe_weighting = "output"`` only: each row's output, kept by the
                                    unpermutation that weights it (Megatron-Core before 0.13)
        per row (R k l) s1 h        the first grouped GEMM's input
                        B_a u f     the fused weighted bias-GLU's input, all it keeps beside
                        4           the row's routing weight (fp32)
                        s2 f        the second grouped GEMM's input (the GLU's output)
        shared experts  S (B_a u f + s2 f) + s1 h per token (R), one MLP of width S f

    with s1, s2 = :func:`saved_input_bytes` of the two GEMMs where the stack runs experts 8-bit
    (``Stack.lowp_experts``: Transformer Engine keeps the fp8 cast it made, 1 byte), else B_a. The
    all-to-alls and the permutations keep no rows (their backward is the reverse exchange and an
    index gather), and the weighting of Megatron-Core 0.13+ (``weighted_bias_swiglu``, its April
    2025 "memory efficient token permutation") happens inside the GLU, so no row's output is kept
    (``moe_weighting = "activation"``). The router's input, the pre-MLP norm's output, is counted with
    the norms (:func:`layer_saved`). Split experts: per-token terms on T, per-row terms on R at f/t."""
    B, k, E, f, h = cm.act_bytes, cm.top_k, cm.n_experts, cm.ffn / cut, cm.model.dim
    tr = cm.train
    R = T if rows is None else rows
    u = 2 if cm.model.gated_mlp else 1
    s1 = saved_input_bytes(cm, h, u * f) if cm.stack.lowp_experts else B
    s2 = saved_input_bytes(cm, f, h) if cm.stack.lowp_experts else B
    losses = (4 * E + 4) * tr.moe_z_loss + 4 * (tr.moe_aux_loss and tr.moe_score == "sigmoid")
    per_token: float = 4 * E + 4 * (2 * E + 1) + losses
    if tr.moe_weighting == "output":
        per_token += B * k * tr.moe_load * h
    per_row = k * tr.moe_load * (s1 * h + B * u * f + 4 + s2 * f)
    S = tr.moe_shared
    shared = S * (B * u * f + s2 * f) + s1 * h if S else 0.0
    per_layer = 4 * E * tr.moe_aux_loss
    return T * per_token + R * (per_row + shared) + per_layer


def activation_terms(
    cm: CostBase,
    t: int,
    sp: bool,
    cp: int,
    mb: int,
    cp_mode: str = "allgather",
    ep: int = 1,
    expert_tp: str = "replicate",
) -> tuple[float, float, float]:
    """Bytes one block saves for backward, one micro-batch of T = b·s/cp tokens: (no recomputation,
    selective, block input). No recomputation: :func:`layer_saved`'s kept set and the attention
    core's own; selective: the stack's policy, :func:`selective_saved`; both less the outputs of the
    modules the workload recomputes alone (:func:`module_recompute_saved`)."""
    kept, core, block_in = layer_saved(cm, t, sp, cp, mb, cp_mode, ep, expert_tp)
    modules = module_recompute_saved(cm, t, sp, cp, mb, expert_tp)
    sel = selective_saved(cm, t, sp, cp, mb, ep, kept, expert_tp)
    return kept + core - modules, sel - modules, block_in


def module_recompute_saved(
    cm: CostBase, t: int, sp: bool, cp: int, mb: int, expert_tp: str = "replicate"
) -> float:
    """Bytes one block does not keep, one micro-batch of T = b·s/cp tokens, for the modules of
    ``Workload.recompute_modules`` (Megatron-Core's output-discarding checkpoints: the module's output
    is freed once its consumers ran and recomputed from its kept input before their backward)::

        moe_act    k l R s2 f   an MoE layer's second grouped GEMM input, the GLU's output (s2 =
                                :func:`saved_input_bytes`, 1 under Transformer Engine's fp8), on the
                                R rows' tokens (:meth:`~loom.plan.cost.base.CostBase.moe_tokens`);
                                the GLU's input stays (the checkpoint's)
        layernorm  B_a T_r h    an MoE layer's pre-MLP norm output (the router's input), on the
                                T_r tokens it routes (T/t with sp); a dense layer's norms and the
                                attention's are fused into their Linear (Transformer Engine's
                                LayerNormLinear: ``IdentityOp`` norms, nothing to discard)

    Dense models: 0."""
    mods = cm.train.recompute_modules
    if not mods or not cm.moe:
        return 0.0
    routed, rows = cm.moe_tokens(mb * cm.train.seq_len / cp, t, sp, expert_tp)
    f, h = cm.ffn / cm.expert_cut(t, expert_tp), cm.model.dim
    out = 0.0
    if "moe_act" in mods:
        s2 = saved_input_bytes(cm, f, h) if cm.stack.lowp_experts else cm.act_bytes
        out += cm.top_k * cm.train.moe_load * rows * s2 * f
    if "layernorm" in mods:
        out += cm.act_bytes * routed * h
    return out


def selective_saved(
    cm: CostBase,
    t: int,
    sp: bool,
    cp: int,
    mb: int,
    ep: int,
    kept: float,
    expert_tp: str = "replicate",
) -> float:
    """Bytes one block saves under "selective" recomputation, as the stack defines it by g =
    ``Stack.selective_gemms``, the share of the block's GEMMs (and of their outputs) the policy
    recomputes; the same g prices the recomputation's time (g of the GEMMs' forward, beside the
    attention core: :func:`loom.plan.cost.compute.microbatch_times`).

    g = 0 (Korthikanti et al.'s policy, Loom's and Megatron's): ``kept``, all the block saves but what
    the attention core alone saves (its log-sum-exp, unfused scores; :func:`layer_saved`).

    g > 0 (an op-level policy, torchtitan's: every other matmul's output, the flash kernel's outputs
    kept, everything else recomputed from them), on T tokens, u = 2 GEMMs up (SwiGLU) or 1 (GELU)::

        B_a T h / (t with sp)                             the block input
        + B_a T a d / t + 4 T a / t                       the core's output and log-sum-exp
        + (1 - g) B_a T (a d / t + 2 k d / t + 2 h + u f / t)
                                                          the GEMM outputs q, k, v, wo, w1 (w3), w2
                                                          (wo's and w2's on each tp rank: T x h)

    (torchtitan keeps wq, wv, w1, w2 of a Llama block, g = 0.5: the share's count differs from its by
    B_a T a d / 2t at h = a d). An MoE layer keeps its experts' set whole (:func:`moe_saved`),
    (1 - g) of the attention GEMMs' outputs and of wo's."""
    g = cm.stack.selective_gemms
    if g <= 0:
        return kept
    m, B, h = cm.model, cm.act_bytes, cm.model.dim
    T = mb * cm.train.seq_len / cp
    rep_div = t if sp else 1
    qd, kv = m.n_heads * m.head_dim / t, cm.kv_width(t)
    ups = 2 if m.gated_mlp else 1
    gemm_out = qd + 2 * kv + h  # q, k, v and wo
    mlp = 0.0
    if cm.moe:
        mlp = moe_saved(cm, t, sp, T, ep, expert_tp)
    else:
        gemm_out += ups * cm.ffn / t + h  # w1 (w3) and w2
    core = B * T * qd + 4 * T * m.n_heads / t
    return B * T * h / rep_div + core + (1 - g) * B * T * gemm_out + mlp


def layer_saved(
    cm: CostBase,
    t: int,
    sp: bool,
    cp: int,
    mb: int,
    cp_mode: str = "allgather",
    ep: int = 1,
    expert_tp: str = "replicate",
) -> tuple[float, float, float]:
    """Bytes one block saves for backward without recomputation, one micro-batch of T = b·s/cp
    tokens: (all but the attention core's own, the core's own, block input), term by term as
    :mod:`loom.plan.cost` states them. Each norm keeps its input in B_a and fp32 statistics, and its
    output x̂·w in B_a where a matmul takes it. A MoE layer: :func:`moe_saved` (experts whole on every
    tp rank: the rank's tokens, T/t with sp; split: the tp group's rows at f/t). The first is also one layer's working set
    under full recomputation (:func:`stage_memory`), whatever the stack's selective policy. The input
    a block Linear keeps for its weight gradient (the norms' outputs, the core's output, the MLP's
    last product) takes :func:`saved_input_bytes` per element."""
    m, tr = cm.model, cm.train
    B, h = cm.act_bytes, m.dim
    T = mb * tr.seq_len / cp
    rep_div = t if sp else 1
    qd, kv = m.n_heads * m.head_dim / t, cm.kv_width(t)
    ffn = cm.ffn / t
    into_mlp = B if cm.moe else saved_input_bytes(cm, h, ffn)  # the MLP norm's output: w1's (and w3's) input
    into_qkv = saved_input_bytes(cm, h, qd + 2 * kv)
    rep = T * (2 * norm_activation(cm) - (B - into_qkv) * h - (B - into_mlp) * h) / rep_div  # two norms
    if m.norm_placement == "sandwich":  # Gemma 2: norms after attention and MLP (input and statistics;
        rep += 2 * T * (norm_activation(cm) - B * h) / rep_div  # their outputs go to the residual)
    qkv = B * T * (qd + 2 * kv)
    if m.qk_norm:  # per head (or per rank, scope all); their outputs go to RoPE, which saves none
        heads = (1, 1) if m.qk_norm_scope == "all" else (qd / m.head_dim, kv / m.head_dim)
        # their inputs (B_a; over a width cut by tp, ShardedRMSNorm: in fp32 and x̂, 4 + B_a)
        own = 4 + B if m.qk_norm_scope == "all" and t > 1 else B
        qkv += T * (own * (qd + kv) + 4 * sum(heads))
    if cm.moe:  # the rank's tokens (T/t with sp) through whole experts, or the group's rows at f/t
        mlp = moe_saved(cm, t, sp, T, ep, expert_tp)
    else:  # w1 x, silu, w3 x, product | w1 x, gelu: the last is w2's input
        mlp = ((3 if m.gated_mlp else 1) * B + saved_input_bytes(cm, ffn, h)) * T * ffn
    out = saved_input_bytes(cm, qd, h) * T * qd  # the core's output, wo's input: kept under selective too
    core = 4 * T * m.n_heads / t  # the fp32 log-sum-exp
    halo = halo_share(cm, cp, cp_mode)  # windowed layers within a chunk keep the halo rows they received
    core += halo * min(2, cp - 1) * 2 * B * mb * (m.sliding_window - 1) * kv
    if cp > 1 and cp_mode == "allgather":  # the other ranks' keys and values, gathered (the other layers)
        core += (1 - halo) * 2 * B * T * (cp - 1) * kv
    elif (
        cp > 1 and cp_mode == "alltoall"
    ):  # kv heads repeated to whole groups per rank; the core's own output
        core += 2 * B * T * (cm._kv_repeat(t, cp) - 1) * kv + B * T * qd
    if not tr.flash_attention:
        core += B * m.n_heads * T * tr.seq_len / t
    return rep + qkv + out + mlp, core, B * T * h / rep_div


def saved_input_bytes(cm: CostBase, k: float, n: float) -> float:
    """Bytes per element of the input a block Linear of k -> n features on a rank keeps for its
    weight gradient: 1 where it runs in 8 bits on a stack that keeps the 8-bit cast
    (``Stack.saves_8bit_inputs``: Transformer Engine), else B_a."""
    tr = cm.train
    if cm.stack.saves_8bit_inputs and runs_8bit(tr.precision, k, n, tr.fp8_recipe, tr.fp8_layers):
        return 1.0
    return cm.act_bytes


def peak_states(cm: CostBase, lay: Layout) -> float:
    """Model-state bytes (no activations) on the busiest stage, plus the runtime constant."""
    worst = max(
        sum(
            v
            for _, v in cm.memo(state_terms)(
                lay.tp,
                lay.pp,
                lay.cp,
                lay.ep,
                lay.zero,
                lay.dp_shard,
                lay.offload,
                f,
                la,
                lay.split,
                lay.expert_tp,
            )
        )
        for _, f, la, _ in cm._stages(lay.pp)
    )
    return worst + cm.cluster.device.runtime_overhead_bytes


def peak_memory(cm: CostBase, lay: Layout) -> tuple[float, dict[str, float], str]:
    """(peak bytes, breakdown, stage) over the first and last pipeline stage."""
    best: tuple[float, dict[str, float], str] = (-1.0, {}, "")
    for name, _, _, idx in cm._stages(lay.pp):
        bd = stage_memory(cm, lay, idx)
        total = sum(bd.values())
        if total > best[0]:
            best = (total, bd, name)
    return best


def head_in_loss(cm: CostBase, lay: Layout) -> bool:
    """Whether Loom runs the head inside the loss, chunk by chunk (Loom's own stack ``""`` only; no
    tp, no pipeline, more than ``CHUNK_ROWS`` rows per micro-batch): then no logits are saved for
    backward. Every other stack materialises the whole logits (:func:`logit_bytes`)."""
    T = lay.micro_batch * cm.train.seq_len / lay.cp
    return cm.stack.name == "" and lay.tp == 1 and lay.pp == 1 and T > CHUNK_ROWS


def logit_bytes(cm: CostBase, lay: Layout) -> float:
    """Bytes of the loss's peak on the last stage, T = b·s / cp rows of V / t logits, whole::

        T · V / t · (Stack.logit_bytes, or B_a + 8 where it is 0: the logits, an fp32 copy and the
                     fp32 log-softmax)

    for every stack (torchtitan, Megatron, DeepSpeed: their loss sees all the logits at once;
    llm-foundry's fused cross entropy 4 bytes), and for Loom under tp or a pipeline. Loom's own stack
    moves the head into the loss where it can (:func:`head_in_loss`: no tp, no pipeline, T > c rows,
    :func:`~loom.model.llama.fused_head_loss`): one chunk of c = ``CHUNK_ROWS`` rows, c·V·(B_a + 4)
    (c·V·4 in fp32: the chunk is its own softmax, unless ``model.logit_softcap`` caps the logits:
    backward's softmax beside the capped chunk), and the head's fp32 gradient sum V·h·4 (V·h·8 in a
    low-precision dtype: a chunk's fp32 product joins it; :func:`~loom.model.loss.linear_cross_entropy`).
    A run whose loss is a fused in-place cross entropy (``Workload.fused_cross_entropy``: Transformer
    Engine's ``parallel_cross_entropy``, Megatron-Core's ``cross_entropy_fusion_impl = "te"``, which
    reduces each row in fp32 registers, writes the gradient over the logits and keeps that tensor and
    a few fp32 statistics per row): T·V/t·B_a."""
    T = lay.micro_batch * cm.train.seq_len / lay.cp
    V = cm.model.vocab_size
    if head_in_loss(cm, lay):
        low = cm.act_bytes < 4
        own = not low and cm.model.logit_softcap <= 0  # the fp32 chunk is its own softmax
        return CHUNK_ROWS * V * (4.0 if own else cm.act_bytes + 4) + V * cm.model.dim * (8 if low else 4)
    if cm.train.fused_cross_entropy:
        return T * V / lay.tp * cm.act_bytes
    return T * V / lay.tp * (cm.stack.logit_bytes or cm.act_bytes + 8)


def stage_memory(cm: CostBase, lay: Layout, stage: int, microbatches: int | None = None) -> dict[str, float]:
    """Bytes on a device of pipeline stage ``stage`` at its peak, by kind: model states, saved
    activations of the layers in flight (``inflight_layers`` of the schedule; the last stage's final
    norm for each micro-batch it holds: m under GPipe, min(m, p) ZB-H1, else 1), logits, full-size
    gradients kept across micro-batches, overhead; ``microbatches`` default: the workload's."""
    m = microbatches or cm.train.global_batch // (lay.dp * lay.micro_batch)
    first, last = stage == 0, stage == lay.pp - 1
    etp = lay.expert_tp
    full_act, sel_act, block_in = cm.memo(activation_terms)(
        lay.tp, lay.sp, lay.cp, lay.micro_batch, lay.cp_mode, lay.ep, etp
    )
    working = cm.memo(layer_saved)(lay.tp, lay.sp, lay.cp, lay.micro_batch, lay.cp_mode, lay.ep, etp)[0]
    bd = state_memory(cm, lay, first, last)
    ep_overlap = lay.ep_overlap and lay.ep > 1 and cm.moe
    n = inflight_layers(lay.schedule, lay.pp, stage, m, lay.v, cm.model.n_layers, ep_overlap)
    held = 1.0 if lay.schedule == "interleaved" and lay.v > 1 else n * lay.pp / cm.model.n_layers
    if lay.pp > 1 and (cm.model.n_layers % lay.pp or lay.split):  # uneven: this stage's blocks, not L / pp
        n *= cm.stage_layers(lay.pp, first, last, lay.split) * lay.pp / cm.model.n_layers
    if lay.recompute == "none":
        act = n * full_act
    elif lay.recompute == "selective":
        act = n * sel_act
    else:
        act = max(n - 1.0, 0.0) * block_in + working  # the layer recomputed in backward
    if last:  # micro-batches holding the final norm: ``held`` (its last chunk's one, interleaved)
        act += held * cm.memo(final_norm_activation)(lay.tp, lay.sp, lay.cp, lay.micro_batch)
    logits = logit_bytes(cm, lay) if last else 0.0
    bd["activations"] = act
    bd["logits"] = logits
    bd["accumulation"] = 0.0
    if keeps_full_gradients(cm, lay, m):  # full-size gradients kept between micro-batches (no_sync)
        bd["accumulation"] = cm.memo(accumulated_gradients)(
            lay.tp, lay.pp, lay.ep, first, last, lay.split, etp
        )
        if lay.zero == 3:  # the unit in backward fills its buffer inside the accumulation
            n = lay.dp_shard * lay.cp
            bd["zero3 buffer"] = cm.memo(zero3_transient)(lay.tp, lay.pp, lay.ep, first, last, n, False, etp)
    stage = flat_stage(cm, lay)
    if stage:  # autograd's gradient of the largest parameter, before it joins its bucket
        gif = cm.memo(gradient_in_flight)(lay.tp, lay.pp, lay.ep, first, last, etp)
        block = cm.G * cm.zero3_unit_sizes(lay.tp, lay.pp, lay.ep, first, last, etp)[0][1]
        if lay.pp == 1 and gif > block:  # the table's, formed at the embedding's backward, the last of
            # a micro-batch's: its activations and logits are freed, and (a tied table) the accumulated
            # buffers of the buckets reduced before it (at launch when cast, else but the last two)
            freed = flight = 0.0
            if not cm.params.head:  # tied: its gradient forms there (untied: the head's, at the start)
                table = cm.G * cm.model.vocab_size * cm.model.dim / lay.tp
                companions = embedding_companions(cm, lay, first, last)
                kept = 0.0 if cm.R != cm.G else cm.G * companions
                freed = max(0.0, bd["accumulation"] - table - kept)
                if cm.R != cm.G and stage == 2:  # the two buckets before it still reducing (stage 1
                    # reduces after backward), in the reduce dtype
                    flight = reduction_bytes(cm, sharding(lay)) * companions
            gif = max(0.0, gif - act - logits - freed + flight)
        bd["gradient in flight"] = gif
        moment = reduction_moment(cm, lay, stage, first, last, act, bd["accumulation"])
        bd["reduction in flight"] = max(0.0, moment - act - logits - bd["accumulation"] - gif)
    # The optimizer step runs after backward's transients are freed (activations, logits, ZeRO-3's
    # gathered units, gradients and reductions in flight, accumulated full-size gradients): its
    # temporaries count only beyond them.
    freed = (
        act
        + logits
        + bd["zero3 buffer"]
        + bd.get("gradient in flight", 0.0)
        + bd.get("reduction in flight", 0.0)
        + bd["accumulation"]  # the full-size buffers, freed once reduced after the last micro-batch
    )
    bd["optimizer step"] = max(0.0, step_workspace(cm, lay, first, last) - freed)
    bd["overhead"] = cm.cluster.device.runtime_overhead_bytes + FRAGMENTATION * (
        act + logits + bd["zero3 buffer"]
    )
    return zero3_memory(cm, lay, bd, first, last) if lay.offload_params or lay.hpz else bd
