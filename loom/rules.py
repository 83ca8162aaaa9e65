"""Layout validity: the rules ``loom train`` enforces, shared with the planner's search.

:func:`layout_problems` is the one place that says whether a parallel layout can run a model:
``config.validate`` raises the first problem it returns, and ``loom.plan.search`` drops every
candidate with one, so ``loom plan`` never ranks a layout that training refuses. The degrees
and options around it are rules here too (``config.validate`` applies each in turn): the world size
and its products (:func:`world_problem`, :func:`sharding_problem`, :func:`resolve_degrees`), ZeRO
stages and the ZeRO-3 options (:func:`zero_stage_problem`, :func:`zero3_options_problem`), the batch
(:func:`batch_problem`), parameter servers (:func:`server_ranks_problem`, :func:`param_server_problem`),
expert rebalancing and QLoRA under tp. Pure functions over plain numbers and strings (standard
library only); each problem is one line naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, get_args

ScheduleName = Literal["gpipe", "1f1b", "interleaved", "zb-h1", "pipedream", "2bw"]
AsyncScheduleName = Literal["pipedream", "2bw"]  # stage-local weight versions, optimizer steps per stage
SCHEDULES: tuple[str, ...] = get_args(ScheduleName)
CpModeName = Literal[
    "allgather", "ring", "alltoall"
]  # how attention spans the cp ranks (loom.parallel.context)
CP_MODES: tuple[str, ...] = get_args(CpModeName)
ExpertTpName = Literal[
    "replicate", "split"
]  # an MoE's experts under tp: whole on every tp rank, or split like the dense MLP (loom.parallel.tensor.experts)
EXPERT_TP_MODES: tuple[str, ...] = get_args(ExpertTpName)
ASYNC_SCHEDULES: tuple[str, ...] = get_args(AsyncScheduleName)
AllReduceName = Literal[
    "native", "ring", "tree", "butterfly"
]  # gradient all-reduce (loom.parallel.allreduce)


@dataclass(frozen=True)
class ModelFacts:
    """What the layout rules need to know of a model."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int  # resolved SwiGLU hidden size
    vocab_size: int = 0  # 0 = not known yet (taken from the tokenizer later)
    vocab_field: str = "model.vocab_size"  # the config field that sets vocab_size
    pad_vocab_to: int = 0  # rows of the embedding and head; 0 = automatic (padded to 128·tp if tp needs it)
    n_experts: int = 1
    dropout: float = 0.0
    tie_embeddings: bool = True
    moe_capacity: bool = False  # moe.capacity_factor > 0: capacity counted over a rank's tokens
    moe_router_losses: bool = False  # moe.aux_loss_coef or moe.z_loss_coef > 0

    @classmethod
    def of(cls, model: Any, **overrides: Any) -> ModelFacts:
        """Facts of a ``loom.config.ModelConfig`` (read by attribute), with ``overrides``."""
        facts = dict(
            n_layers=model.n_layers,
            n_heads=model.n_heads,
            n_kv_heads=model.n_kv_heads,
            ffn_dim=model.resolved_ffn_dim(),
            vocab_size=max(0, model.vocab_size),
            pad_vocab_to=getattr(model, "pad_vocab_to", 0),
            n_experts=model.n_experts,
            dropout=model.dropout,
            tie_embeddings=model.tie_embeddings,
        )
        return cls(**(facts | overrides))


def vocab_padding_problem(m: ModelFacts, tp: int) -> str | None:
    """An explicit ``model.pad_vocab_to`` holds the vocabulary and divides by tp (0: automatic, always fine)."""
    p = m.pad_vocab_to
    if p < 0 or (p and (p < m.vocab_size or p % tp)):
        return f"model.pad_vocab_to: {p} must be 0 (automatic) or >= the vocabulary {m.vocab_size} and divisible by parallel.tp={tp}"
    return None


def tensor_parallel_problem(m: ModelFacts, tp: int, expert_tp: str = "split") -> str | None:
    """Shapes tp splits must divide by tp; kv heads may instead be replicated (n_kv_heads < tp, tp % n_kv_heads == 0).
    A vocabulary tp does not divide is padded (``model.pad_vocab_to``), not refused. The MLP's hidden size
    divides where tp cuts it: a dense MLP, or experts split over tp (``expert_tp = "split"``; the default,
    for a caller that does not know the layout's); replicated experts are whole on every tp rank."""
    if problem := vocab_padding_problem(m, tp):
        return problem
    if tp == 1:
        return None
    if m.n_heads % tp:
        return f"model.n_heads: {m.n_heads} must be divisible by parallel.tp={tp}"
    if m.n_kv_heads % tp and tp % m.n_kv_heads:
        return f"model.n_kv_heads: {m.n_kv_heads} must be divisible by parallel.tp={tp}, or divide it (kv heads replicated)"
    # model.dim = n_heads * head_dim, so it is divisible by tp once n_heads is.
    if m.ffn_dim % tp and (m.n_experts <= 1 or expert_tp == "split"):
        split = (
            " (experts split: parallel.expert_tp = split; replicate keeps them whole)"
            if m.n_experts > 1
            else ""
        )
        return (
            f"model.ffn_dim: the SwiGLU hidden size {m.ffn_dim} must be divisible by parallel.tp={tp}{split}"
        )
    return None


def sequence_parallel_problem(tp: int, cp: int, seq_len: int) -> str | None:
    """With sequence parallelism each rank holds seq_len / (tp*cp) positions of the norms and residual."""
    if tp > 1 and seq_len % (tp * cp):
        return f"data.seq_len: {seq_len} must be divisible by parallel.tp*cp={tp * cp} with parallel.sp"
    return None


def context_parallel_problem(cp: int, seq_len: int) -> str | None:
    """Each cp rank holds two chunks of seq_len / (2 cp) positions (causal load balance)."""
    if cp > 1 and seq_len % (2 * cp):
        return f"data.seq_len: {seq_len} must be divisible by 2*parallel.cp={2 * cp} (two chunks per cp rank)"
    return None


def context_mode_problem(m: ModelFacts, cp: int, mode: str, tp: int = 1) -> str | None:
    """A known ``parallel.cp_mode``; all-to-all (Ulysses) gives each cp rank (n_heads/tp)/cp query heads."""
    if mode not in CP_MODES:
        return f"parallel.cp_mode: must be one of {CP_MODES}, got {mode!r}"
    if cp > 1 and mode == "alltoall" and (m.n_heads // tp) % cp:
        return (
            f"parallel.cp_mode: alltoall splits the {m.n_heads // tp} query heads per tp rank "
            f"(model.n_heads={m.n_heads} / parallel.tp={tp}) over parallel.cp={cp}; they must divide"
        )
    return None


def parse_layout(text: str, n_layers: int, n_stages: int) -> list[int]:
    """Parse a manual layout like "0-3,4-7" (inclusive layer ranges, one per stage) into boundaries."""
    where = f"pp_layout {text!r}"
    parts = [part.strip() for part in text.split(",")]
    if len(parts) != n_stages:
        raise ValueError(f"{where}: {len(parts)} stages given, expected {n_stages}")
    bounds = [0]
    for k, part in enumerate(parts):
        first, sep, last = part.partition("-")
        try:
            lo, hi = int(first), int(last if sep else first)
        except ValueError:
            raise ValueError(f"{where}: stage {k} {part!r} is not 'a-b' or 'a'") from None
        if lo != bounds[-1]:
            raise ValueError(
                f"{where}: stage {k} starts at layer {lo}, expected {bounds[-1]} "
                "(stages must be contiguous and cover every layer once)"
            )
        if hi < lo:
            raise ValueError(f"{where}: stage {k} range {part!r} is empty")
        bounds.append(hi + 1)
    if bounds[-1] != n_layers:
        raise ValueError(
            f"{where}: covers layers 0-{bounds[-1] - 1} but the model has {n_layers} (0-{n_layers - 1})"
        )
    return bounds


def layout_problems(
    m: ModelFacts,
    *,
    seq_len: int,
    precision: str,
    optimizer: str,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    zero: int = 0,
    sp: bool = False,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    microbatches: int = 1,
    offload: str = "none",
    pp_layout: str = "",
    vertical_sync: bool = False,
    cp_mode: str = "allgather",
    allreduce: str = "native",
    dp: int = 1,
    dp_shard: int = 1,
    recompute: str = "none",
    expert_tp: str = "replicate",
) -> list[str]:
    """Why this layout cannot train this model (first problem first), or []. Degrees are assumed
    to multiply to the world size with ep | dp*cp (``config.resolve_layout`` checks that), and
    ``microbatches`` = global_batch / (micro_batch * dp) to be whole."""
    out = []
    if m.n_experts > 1 and optimizer == "adafactor":
        out.append(
            "train.optimizer: adafactor factors 2-D weights; the experts' (E, f, h) weights need adamw or adam8bit"
        )
    if (why := expert_tp_problem(m, expert_tp)) is not None:
        out.append(why)
    # split experts route the tp group's whole sequences (gathered under sp): capacity as one process's
    if m.n_experts > 1 and m.moe_capacity and (cp > 1 or (tp > 1 and sp and expert_tp != "split")):
        split = f"parallel.cp = {cp}" if cp > 1 else f"sequence parallelism over parallel.tp = {tp}"
        out.append(
            f"moe.capacity_factor: capacity is counted over a rank's tokens, and {split} splits every sequence; "
            "use 0 (dropless)"
        )
    if m.n_experts > 1 and m.moe_router_losses and pp > 1 and schedule in ASYNC_SCHEDULES:
        out.append(
            f"moe.aux_loss_coef: the router losses need a synchronous pipeline schedule, got parallel.schedule = "
            f"{schedule!r}; use 0 for moe.aux_loss_coef and moe.z_loss_coef or another schedule"
        )
    if (why := expert_problem(m, ep)) is not None:
        out.append(why)
    if (why := allreduce_problem(allreduce, dp=dp, dp_shard=dp_shard, cp=cp, ep=ep, zero=zero)) is not None:
        out.append(why)
    if (why := zero_sharding_problem(zero, dp_shard)) is not None:
        out.append(why)
    if offload != "none" and zero < 1:
        out.append(
            f"parallel.offload: {offload!r} offloads ZeRO optimizer state; it needs parallel.zero >= 1"
        )
    sp_problem = sequence_parallel_problem(tp, cp, seq_len) if sp else None
    out += [
        why
        for why in (
            tensor_parallel_problem(m, tp, expert_tp),
            sp_problem,
            context_parallel_problem(cp, seq_len),
        )
        if why
    ]
    if (why := context_mode_problem(m, cp, cp_mode, tp)) is not None:
        out.append(why)
    if recompute == "selective" and cp > 1:  # loom.memory.recompute wraps CoreAttention modules
        out.append(
            f"train.recompute: 'selective' recomputes the attention core, which under parallel.cp = {cp} is the "
            f"context-parallel {cp_mode} kernel (it already keeps O(T·d) per block, no scores); use none, full "
            "or every:<k>"
        )
    if (why := low_precision_problem(m, precision, tp)) is not None:
        out.append(why)
    if precision == "fp16" and schedule in ASYNC_SCHEDULES and pp > 1:
        out.append(
            f"train.precision: fp16 skips a step when any rank overflows, agreed by all ranks at the step; the "
            f"asynchronous schedule {schedule!r} steps each stage's optimizer on its own and cannot unscale and "
            "skip together; use bf16 or a synchronous schedule"
        )
    out += _pipeline_problems(m, schedule, pp, virtual_stages, microbatches, pp_layout, vertical_sync, zero)
    return out


def low_precision_problem(m: ModelFacts, precision: str, tp: int) -> str | None:
    """fp8 / int8 run a block's Linear in 8 bits only where every tensor-parallel shard of its dims is a
    multiple of 16 (float8 / int8 tensor-core tiles: ``loom.memory.precision.low_precision_target``);
    the tp layers then run torchao's GEMMs on their shards (``loom.memory.lowp_gemm``). A dense MLP
    whose hidden size f has f % (16·tp) != 0 would stay in bf16 with most of the block's GEMMs: refused."""
    if precision in ("fp8", "int8") and m.n_experts <= 1 and m.ffn_dim % (16 * tp):
        return (
            f"train.precision: {precision} runs a Linear in 8 bits only where its dims are multiples of "
            f"16·parallel.tp = {16 * tp}; the MLP's hidden size {m.ffn_dim} (model.ffn_dim, model.multiple_of) "
            f"is not; set model.multiple_of = {16 * tp} or use train.precision = bf16"
        )
    return None


def expert_problem(m: ModelFacts, ep: int) -> str | None:
    """Expert parallelism spreads whole experts: ep > 1 needs experts, and ep | n_experts."""
    if ep > 1 and m.n_experts <= 1:
        return f"parallel.ep: expert parallelism needs experts (model.n_experts > 1), got ep={ep}"
    if ep > 1 and m.n_experts % ep:
        return f"parallel.ep: {ep} must divide model.n_experts={m.n_experts}"
    return None


def expert_tp_problem(m: ModelFacts, expert_tp: str) -> str | None:
    """``parallel.expert_tp`` is one of :data:`EXPERT_TP_MODES`; ``split`` cuts experts, so it needs them."""
    if expert_tp not in EXPERT_TP_MODES:
        return f"parallel.expert_tp: must be one of {EXPERT_TP_MODES}, got {expert_tp!r}"
    if expert_tp == "split" and m.n_experts <= 1:
        return "parallel.expert_tp: 'split' cuts an MoE's experts over tp, but the model has none (model.n_experts = 1)"
    return None


def zero_sharding_problem(zero: int, dp_shard: int) -> str | None:
    """``parallel.dp_shard`` is ZeRO's sharding group: ZeRO-0 shards nothing (its master-weight path
    runs over a sharding group of one rank), so a group of more ranks is a setting it cannot honour."""
    if zero == 0 and dp_shard > 1:
        return (
            f"parallel.dp_shard: {dp_shard} ranks is ZeRO's sharding group, but parallel.zero = 0 shards "
            "nothing; set parallel.zero >= 1 (hybrid sharding), or leave dp_shard at -1 (automatic) or 1"
        )
    return None


def virtual_stages_problem(schedule: str, v: int) -> str | None:
    """Virtual stages (v chunks per device) are the interleaved schedule's."""
    if v < 1:
        return f"parallel.virtual_stages: must be >= 1, got {v}"
    if v > 1 and schedule != "interleaved":
        return f"parallel.virtual_stages: {v} > 1 needs parallel.schedule = 'interleaved', got {schedule!r}"
    return None


def interleaved_chunks_problem(schedule: str, pp: int, v: int) -> str | None:
    """The interleaved schedule runs v >= 2 chunks per pipeline rank (v = 1 is 1F1B's order)."""
    if schedule == "interleaved" and pp > 1 and v < 2:
        return (
            f"parallel.virtual_stages: the interleaved schedule runs >= 2 chunks per rank, got {v} (that is "
            "1F1B); give parallel.virtual_stages 2 or more, or parallel.schedule = '1f1b'"
        )
    return None


def pipeline_depth_problem(m: ModelFacts, pp: int, v: int) -> str | None:
    """Every one of the pp*v pipeline chunks holds at least one block."""
    n = pp * max(v, 1)
    if pp > 1 and n > m.n_layers:
        return (
            f"parallel.pp: pp*virtual_stages = {n} pipeline stages but model.n_layers = {m.n_layers} "
            "(each stage needs at least one block)"
        )
    return None


def interleaved_microbatches_problem(schedule: str, pp: int, micro: int) -> str | None:
    """The interleaved schedule runs micro-batches in groups of pp."""
    if pp > 1 and schedule == "interleaved" and micro % pp:
        return (
            f"train.global_batch: the interleaved schedule needs the micro-batch count "
            f"global_batch/(micro_batch*dp) = {micro} divisible by parallel.pp = {pp}"
        )
    return None


def gradient_allreduce_groups(*, dp: int, dp_shard: int, cp: int, ep: int, zero: int) -> dict[str, int]:
    """The groups gradients are all-reduced over (name -> ranks): dp*cp without ZeRO, the replicas
    dp/dp_shard with it; experts' edp group dp*cp/ep where their shards are not reduce-scattered."""
    groups = {"dp*cp": dp * cp} if zero == 0 else {"dp/dp_shard": dp // max(dp_shard, 1)}
    if ep > 1 and (zero == 0 or dp_shard * cp == 1):
        groups["dp*cp/ep"] = dp * cp // ep
    return groups


def allreduce_problem(algorithm: str, *, dp: int, dp_shard: int, cp: int, ep: int, zero: int) -> str | None:
    """Butterfly (recursive halving-doubling) pairs rank r with r XOR 2^k: it refuses (no fallback)
    any gradient all-reduce group whose size is not a power of two."""
    if algorithm != "butterfly":
        return None
    for name, n in gradient_allreduce_groups(dp=dp, dp_shard=dp_shard, cp=cp, ep=ep, zero=zero).items():
        if n > 1 and n & (n - 1):
            return (
                f"parallel.allreduce: butterfly (recursive halving-doubling) needs a power-of-two group, but "
                f"gradients are all-reduced over {name} = {n} ranks; use ring or tree"
            )
    return None


def _pipeline_problems(
    m: ModelFacts, schedule: str, pp: int, v: int, micro: int, pp_layout: str, vertical_sync: bool, zero: int
) -> list[str]:
    """At least one block per stage, enough micro-batches, a layout covering every block, and the
    combinations the pipeline runtime cannot run."""
    out = [why] if (why := virtual_stages_problem(schedule, v)) is not None else []
    if vertical_sync and schedule != "pipedream":
        out.append("parallel.vertical_sync: only for schedule 'pipedream'")
    if pp == 1:
        if pp_layout:
            out.append("parallel.pp_layout: a stage layout needs parallel.pp > 1")
        return out
    n = pp * max(v, 1)
    out += [
        why
        for why in (
            interleaved_chunks_problem(schedule, pp, v),
            pipeline_depth_problem(m, pp, v),
            interleaved_microbatches_problem(schedule, pp, micro),
        )
        if why
    ]
    if schedule == "2bw" and (micro % 2 or micro // 2 < pp):
        out.append(
            f"train.global_batch: 2bw splits a step's {micro} micro-batches into 2 batches of at least "
            f"parallel.pp = {pp}; need global_batch/(micro_batch*dp) even and >= {2 * pp}"
        )
    if pp_layout:
        try:
            parse_layout(pp_layout, m.n_layers, n)
        except ValueError as e:
            out.append(f"parallel.{e}")
    if schedule in ASYNC_SCHEDULES and m.tie_embeddings:
        out.append(
            f"model.tie_embeddings: schedule {schedule!r} keeps stage-local weight versions, so the embedding "
            "and head copies cannot stay tied; set it to false or use a synchronous schedule"
        )
    if zero > 1 and schedule in ASYNC_SCHEDULES:
        out.append(
            f"parallel.zero: ZeRO-{zero} with schedule {schedule!r}: the stashed weight versions need whole "
            "weights and gradients on every rank; use 0 or 1, or a synchronous schedule"
        )
    return out


DpModeName = Literal[
    "allreduce", "ps"
]  # parallel.dp_mode: how data-parallel gradients meet (loom.parallel.ps.strategy)
PS_ALIGN = 4  # a parameter server's shard is a whole number of 16-byte blocks of fp32 (loom.parallel.layout)


def parse_ps_sync(spec: str) -> int | None:
    """``parallel.ps_sync`` -> the staleness bound S: bsp -> 0 (synchronous rounds), ssp:S -> S, asp -> None
    (unbounded). Raises ValueError (one line naming the field) for anything else or S < 0."""
    if spec == "bsp":
        return 0
    if spec == "asp":
        return None
    head, sep, bound = spec.partition(":")
    if head != "ssp" or not sep or not re.fullmatch(r"-?[0-9]+", bound):  # ASCII digits: int() reads them
        raise ValueError(f"parallel.ps_sync: must be bsp | asp | ssp:S (S >= 0 steps), got {spec!r}")
    if int(bound) < 0:
        raise ValueError(f"parallel.ps_sync: the staleness bound S of ssp:S must be >= 0, got {bound}")
    return int(bound)


def param_server_problem(
    *,
    shards: int,
    colocate: bool,
    sync: str,
    n_params: int,
    workers: int,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    zero: int = 0,
    precision: str = "fp32",
    optimizer: str = "adamw",
    reduce_dtype: str = "fp32",
    allreduce: str = "native",
) -> str | None:
    """Why ``parallel.dp_mode = "ps"`` cannot run this layout, or None. ``n_params``: the model's parameter
    count (a lower bound will do); each of the K servers must own at least one aligned block of it:
    K · PS_ALIGN <= Φ. Co-located servers live in workers 0..K-1 (K <= workers) and are serviced at the
    step boundary, so they run bsp only; asp and ssp:S need dedicated server ranks."""
    try:
        parse_ps_sync(sync)
    except ValueError as e:
        return str(e)
    if shards < 1:
        return f"parallel.ps_shards: must be >= 1, got {shards}"
    if shards * PS_ALIGN > n_params:
        return (
            f"parallel.ps_shards: {shards} servers need {PS_ALIGN} parameters each (one 16-byte block), but the "
            f"model has at least {n_params}; use at most {max(1, n_params // PS_ALIGN)}"
        )
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("zero", zero)):
        if value != (0 if name == "zero" else 1):
            return (
                f"parallel.{name}: the parameter server (parallel.dp_mode = 'ps') shards whole-model data "
                f"parallelism only; got {name} = {value} (use dp_mode = 'allreduce')"
            )
    if precision not in ("fp32", "tf32"):  # tf32: fp32 parameters, TF32 matmuls on CUDA
        return (
            f"train.precision: the parameter server updates fp32 parameters (fp32 or tf32); got {precision!r}"
        )
    if optimizer != "adamw":
        return f"train.optimizer: the parameter server's shards run adamw; got {optimizer!r}"
    for name, option, its in (("reduce_dtype", reduce_dtype, "fp32"), ("allreduce", allreduce, "native")):
        if option != its:  # options of the all-reduce path, which a parameter server does not take
            return (
                f"parallel.{name}: {option!r} is an option of the gradient all-reduce; the parameter server "
                f"(parallel.dp_mode = 'ps') pushes and pulls fp32 shards point to point; leave it at {its!r}"
            )
    if colocate and shards > workers:
        return (
            f"parallel.ps_shards: {shards} co-located servers live in workers 0..{shards - 1}, but there are "
            f"{workers} workers; use at most {workers}, or parallel.ps_colocate = false"
        )
    if colocate and sync != "bsp":
        return (
            f"parallel.ps_sync: {sync!r} needs dedicated server ranks (parallel.ps_colocate = false); co-located "
            "servers are serviced at the step boundary and run bsp"
        )
    return None


# ----------------------------------------------------------------------------- degrees and options
# The rules ``config.validate`` applies to the layout's degrees and options beyond :func:`layout_problems`
# (which takes them as resolved): each returns the first problem, one line naming the field, or None.


def zero_stage_problem(zero: int) -> str | None:
    """ZeRO stages: 0 (plain data parallel), 1 (optimizer state), 2 (+ gradients), 3 (+ weights)."""
    return None if zero in (0, 1, 2, 3) else f"parallel.zero: must be 0, 1, 2 or 3, got {zero}"


def resolve_degrees(
    world: int, *, dp: int, dp_shard: int, tp: int, pp: int, cp: int, zero: int
) -> tuple[int, int]:
    """(dp, dp_shard) with their automatic values (-1) filled: dp = world / (tp pp cp); dp_shard = all
    of dp under ZeRO, else 1. Assumes :func:`world_problem` found none."""
    if dp == -1:
        dp = world // (tp * pp * cp)
    if dp_shard == -1:
        dp_shard = dp if zero > 0 else 1
    return dp, dp_shard


def world_problem(world: int, *, dp: int, tp: int, pp: int, cp: int, ep: int) -> str | None:
    """Degrees >= 1 whose product is the world size: world = dp * tp * pp * cp (``dp`` -1: automatic)."""
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if value < 1:
            return f"parallel.{name}: must be >= 1, got {value}"
    inner = tp * pp * cp
    if dp == -1:
        if world % inner:
            return f"parallel: world size {world} is not divisible by tp*pp*cp = {inner}"
        dp = world // inner
    if dp < 1:
        return f"parallel.dp: must be >= 1 or -1 (auto), got {dp}"
    if dp * inner != world:
        return f"parallel: dp*tp*pp*cp = {dp}*{tp}*{pp}*{cp} = {dp * inner} must equal the world size {world}"
    return None


def sharding_problem(*, dp: int, dp_shard: int, cp: int, ep: int) -> str | None:
    """Resolved degrees: dp = dp_replicate * dp_shard;  ep | dp * cp (experts borrow from dp*cp)."""
    if not (dp_shard >= 1 and dp % dp_shard == 0):
        return f"parallel.dp_shard: must divide dp={dp}, got {dp_shard}"
    if (dp * cp) % ep:
        return f"parallel.ep: must divide dp*cp = {dp * cp}, got {ep}"
    return None


def mesh_problem(
    world: int, *, dp: int, dp_shard: int, tp: int, pp: int, cp: int, ep: int, zero: int
) -> str | None:
    """:func:`world_problem`, then :func:`sharding_problem` of the degrees :func:`resolve_degrees` fills."""
    if (why := world_problem(world, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)) is not None:
        return why
    dp, dp_shard = resolve_degrees(world, dp=dp, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp, zero=zero)
    return sharding_problem(dp=dp, dp_shard=dp_shard, cp=cp, ep=ep)


def server_ranks_problem(world: int, *, servers: int, dp: int) -> str | None:
    """Dedicated parameter servers (``parallel.ps_colocate = false``): world = parallel.dp workers +
    ``servers`` (parallel.ps_shards) server ranks, at least one worker; ``dp`` -1 = world - servers."""
    if servers < 1:
        return f"parallel.ps_shards: must be >= 1, got {servers}"
    if world <= servers:
        return (
            f"run.nproc: {world} ranks cannot hold parallel.ps_shards = {servers} dedicated servers "
            f"and a worker (run.nproc = workers + ps_shards); give at least --nproc {servers + 1}"
        )
    if dp not in (-1, world - servers):
        return (
            f"run.nproc: {world} ranks, but parallel.dp + parallel.ps_shards = "
            f"{dp} workers + {servers} dedicated servers = {dp + servers}; give --nproc {dp + servers}, "
            "or leave parallel.dp unset (= run.nproc - ps_shards)"
        )
    return None


def batch_problem(global_batch: int, micro_batch: int, dp: int) -> str | None:
    """Each optimizer step is a whole number of micro-batches on every data-parallel rank."""
    if micro_batch < 1:
        return f"train.micro_batch: must be >= 1, got {micro_batch}"
    if global_batch % (micro_batch * dp):
        return (
            f"train.global_batch: {global_batch} must be divisible by micro_batch*dp = "
            f"{micro_batch}*{dp} = {micro_batch * dp}"
        )
    return None


def expert_rebalance_problem(
    *, rebalance_every: int, hot_experts: int, n_experts: int, ep: int
) -> str | None:
    """Hot-expert replication (``moe.rebalance_every``) works over expert-parallel ranks, on fewer
    experts than the layer has."""
    if rebalance_every < 0:
        return f"moe.rebalance_every: must be >= 0 (0 = off), got {rebalance_every}"
    if not rebalance_every:
        return None
    if ep <= 1:
        return (
            "moe.rebalance_every: replicates hot experts over expert-parallel ranks; it needs "
            f"parallel.ep > 1, got {ep}"
        )
    if not 1 <= hot_experts < n_experts:
        return f"moe.hot_experts: must be in [1, model.n_experts) = [1, {n_experts}), got {hot_experts}"
    return None


def compress_layout_problem(formats: dict[str, str], tp: int, cp: int) -> str | None:
    """fp8 and int8 compression scale each saved tensor by its max: under tp or cp a rank holds a
    slice, whose max is not the whole tensor's, so training would differ from one process's."""
    scaled = sorted({f for f in formats.values() if f in ("fp8", "int8")})
    if scaled and (tp > 1 or cp > 1):
        split = f"parallel.tp = {tp}" if tp > 1 else f"parallel.cp = {cp}"
        return (
            f"train.compress: {' and '.join(scaled)} scale each saved tensor by its max, and under {split} a "
            "rank holds a slice whose max is not the tensor's (training would differ from one process); "
            "use bf16 or none for those kinds, or tp = cp = 1"
        )
    return None


def qlora_layout_problem(method: str, tp: int) -> str | None:
    """QLoRA quantizes whole base weights: each tensor-parallel rank would quantize its own slice."""
    if method == "qlora" and tp != 1:
        return (
            f"finetune.method: qlora with parallel.tp = {tp} is not supported (each rank would "
            "quantize its own slice); use method = lora, or tp = 1"
        )
    return None


def adapters_expert_tp_problem(method: str, tp: int, expert_tp: str) -> str | None:
    """LoRA adapters are cut over tp with the dense Linears only: split experts would leave a shared
    expert's adapters whole beside its sliced base weight."""
    if method != "full" and tp > 1 and expert_tp == "split":
        return (
            f"parallel.expert_tp: 'split' does not cut LoRA adapters (finetune.method = {method}); "
            "use expert_tp = replicate for fine-tuning"
        )
    return None


def zero3_options_problem(
    *,
    zero: int,
    offload_params: str = "none",
    qwz: bool = False,
    hpz: bool = False,
    qgz: bool = False,
    qgz_bits: int = 8,
    hpz_group: int = 0,
    dp_shard: int = 1,
    cp: int = 1,
) -> str | None:
    """ZeRO-Infinity parameter offload and the ZeRO++ options (qwZ, hpZ, qgZ) are options of ZeRO-3;
    an hpZ group divides the sharding group dp_shard * cp."""
    zpp = [f"zeropp_{name}" for name, on in (("qwz", qwz), ("hpz", hpz), ("qgz", qgz)) if on]
    if offload_params != "none" and zero != 3:
        return f"parallel.offload_params: {offload_params!r} offloads ZeRO-3's parameter shards; it needs parallel.zero = 3"
    for f in zpp:
        if zero != 3:
            return f"parallel.{f}: a ZeRO++ option of ZeRO-3; it needs parallel.zero = 3"
    if zpp and offload_params != "none":
        return f"parallel.offload_params: not combined with ZeRO++ ({', '.join(zpp)}) yet"
    if hpz_group < 0:
        return f"parallel.hpz_group: must be >= 0, got {hpz_group}"
    if qgz_bits not in (4, 8):
        return f"parallel.zeropp_qgz_bits: must be 4 or 8, got {qgz_bits}"
    n = dp_shard * cp
    if (hpz or qgz) and hpz_group > 0 and n > 0 and n % hpz_group != 0:
        return f"parallel.hpz_group: {hpz_group} must divide the sharding group (dp_shard*cp = {n})"
    return None


def hpz_partition(
    hpz_group: int, dp_shard: int, cp: int, tp: int, local_world: int
) -> tuple[int, str | None]:
    """Ranks G per hpZ secondary partition: ``hpz_group``, else the sharding group's ranks on one node
    (``local_world // tp``: tp is the innermost mesh dimension, dp_shard x cp the next), at most the
    sharding group n = dp_shard * cp; and the problem when G < n does not divide n."""
    n = max(1, dp_shard * cp)
    g = hpz_group or max(1, local_world // tp)
    if n % g and g < n:
        source = "" if hpz_group else f" (unset: {local_world} ranks per node / tp {tp})"
        return g, (
            f"parallel.hpz_group: {g}{source} does not divide the sharding group dp_shard*cp = {n}; "
            f"set parallel.hpz_group to a divisor of {n}"
        )
    return min(g, n), None
