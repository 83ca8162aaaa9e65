"""Tensor (Megatron) and sequence parallelism, applied to the plain model by module swap.

:func:`apply_tensor_parallel` replaces, in place, every Linear/Embedding of the reference
:class:`~loom.model.llama.Transformer` by its sharded counterpart (``tp_layers``), sliced from the
full, deterministically initialised weights, so a tp run starts from exactly the single-device
parameters. Parameter names are unchanged (``layers.0.attention.wq.weight`` is now a row shard).

Layout over the tp group of n ranks (h = dim, a heads, k kv-heads, f = ffn, V = vocab, L layers):

    embedding   vocab-parallel rows V/n, then g                (sp: reduce-scatter along seq)
    positions   learned table replicated, added after g        (sp: the shard's rows, gradient partial)
    attention   wq, wk, wv column (a/n, k/n heads), wo row       (k < n, n % k == 0: kv replicated)
    mlp         w1 (, w3) column (f/n), w2 row                   (biases: column's sharded, row's whole)
    moe         router and experts replicated: without sp every rank computes every token (the same
                gradients); with sp each routes its sequence shard (gradients partial, summed over tp);
                ``expert_tp = split``: experts cut like the MLP (:mod:`loom.parallel.tensor.experts`)
    head        column over the vocabulary: local logits (B, T, V/n), never gathered
    loss        vocab-parallel cross-entropy on the local logits
    padding     a padded vocabulary V' (``model.pad_vocab_to``) is cut V'/n rows per rank; the
                loss masks the padded columns (ids >= V) out of the max, the sum and the gradient

Bytes moved per rank per micro-batch (ring, ρ = (n-1)/n, S = b·s·h·e, e bytes per element):

    no sp:  2ρ·[(4L + 2)·S + 3·b·s·4]
            i.e. 2 all-reduces of S per layer per pass, the embedding's g, the head's f, and the
            loss's max and (sum-exp, target-logit) all-reduces of b·s fp32 values.
    sp:     ρ·[(10L + 5)·S + 6·b·s·4]
            per layer: forward 2 all-gathers + 2 reduce-scatters (= the 2 all-reduces), backward
            the same plus 2 re-gathers of the saved shard.

plus once per step, one all-reduce of the parameters whose gradient each rank holds in part
(:func:`loom.parallel.partial.sum_partial_grads`, as Megatron sums sequence-parallel norm gradients):
2ρ·e·P, P = :func:`partial_numel`: with sp the norms' (2L + 1)·h weights (and as many LayerNorm
biases), the 2L row-parallel biases of h and the learned position table S·h; replicated key/value
weights 2L·k·d·h (and their biases 2L·k·d) when k < n; the q/k norm weights 2L·d (per head), or
with ``qk_norm_scope = all`` (OLMo-2: the norm weights cut with the heads) the k norm's L·k·d when
k < n. That scope also all-reduces the q and k sums of squares (b·s fp32 each) per layer in forward
and in backward: 2ρ·4L·b·s·4 more per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from loom import comm
from loom.comm import CommMeter, Group
from loom.config import ModelConfig, lora_targets, target_shapes
from loom.model.llama import Block, FeedForward, Transformer
from loom.model.loss import CHUNK_ROWS
from loom.model.moe import MoEFeedForward
from loom.parallel.partial import mark_partial
from loom.parallel.rng import private_rng
from loom.parallel.tensor.experts import split_experts
from loom.parallel.tensor.layers import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelFeedForward,
    SequenceParallelPositions,
    VocabParallelEmbedding,
    sequence_parallel_norm,
)
from loom.parallel.tensor.shard import TPContext, sharded_param

IGNORE_INDEX = -100


def apply_tensor_parallel(
    model: nn.Module, mesh, *, sp: bool = False, meter: CommMeter | None = None, expert_tp: str = "replicate"
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Shard ``model`` over ``mesh.group("tp")`` in place (``sp``: with sequence parallelism; ``expert_tp``:
    an MoE's experts whole on every rank, or split, :mod:`loom.parallel.tensor.experts`); return
    (and set ``model.loss_fn`` to) the loss that takes the local logits shard. The shapes must divide
    by tp: the caller checks them (:func:`loom.config.check_tensor_parallel`)."""
    n = mesh.size("tp")
    ctx = TPContext(mesh.group("tp"), mesh.local_rank("tp"), n, meter, sp)
    full = cast(Transformer, model)  # the single-device model, before its modules are swapped
    tied = full.output.weight is full.tok_embeddings.weight
    emb = VocabParallelEmbedding(sharded_param(full.tok_embeddings.weight, 0, ctx), ctx)
    head_weight = emb.weight if tied else sharded_param(full.output.weight, 0, ctx)
    model.tok_embeddings = emb
    model.output = ColumnParallelLinear(head_weight, ctx)
    for layer in full.layers:
        parallelize_block(layer, ctx, expert_tp)
    if ctx.sp:
        model.norm = sequence_parallel_norm(full.norm, ctx)
        if full.pos_embeddings is not None:  # learned positions: this rank's sequence shard's rows
            model.pos_embeddings = SequenceParallelPositions(full.pos_embeddings, ctx)
    loss = partial(vocab_parallel_cross_entropy, group=ctx.group, meter=meter, vocab=full.cfg.vocab_size)
    model.loss_fn = loss  # type: ignore[assignment]  # Module.__setattr__ is typed for Tensor | Module; a plain callable attribute is fine
    return loss


def parallelize_block(block: nn.Module, ctx: TPContext, expert_tp: str = "replicate") -> nn.Module:
    """Swap one transformer Block's attention and MLP (and, with sp, its norms) in place.

    Input and output of the block: (B, T, h) replicated, or (B, T/n, h) sequence shards with sp.
    """
    full = cast(Block, block)  # the single-device block, before its modules are swapped
    block.attention = ParallelAttention.from_full(full.attention, ctx)
    if isinstance(full.feed_forward, MoEFeedForward) and expert_tp == "split":
        split_experts(full.feed_forward, ctx)  # cut like the MLP; every rank routes the group's tokens
    elif isinstance(
        full.feed_forward, MoEFeedForward
    ):  # experts replicated over tp, each rank routes its tokens
        if ctx.sp:  # this rank's sequence shard: its part of every MoE gradient, summed over tp once a step
            for p in full.feed_forward.parameters():
                mark_partial(p, ctx.group, ctx.meter)
    else:
        block.feed_forward = ParallelFeedForward.from_full(cast(FeedForward, full.feed_forward), ctx)
    if ctx.sp:
        block.attention_norm = sequence_parallel_norm(full.attention_norm, ctx)
        block.ffn_norm = sequence_parallel_norm(full.ffn_norm, ctx)
        for name in ("post_attention_norm", "post_ffn_norm"):  # sandwich norms (Gemma 2 and 3)
            if getattr(full, name, None) is not None:
                setattr(block, name, sequence_parallel_norm(getattr(full, name), ctx))
        if getattr(block, "dropout", 0.0) > 0:  # residual dropout on this rank's sequence shard
            block._drop = partial(_shard_dropout, block, ctx.rank)  # type: ignore[assignment]  # Module.__setattr__ is typed for Tensor | Module; this overrides a method
    return block


def _shard_dropout(block: nn.Module, tp_rank: int, x: torch.Tensor) -> torch.Tensor:
    """A block's residual dropout on a sequence shard: masks drawn per tp rank (:mod:`loom.parallel.rng`)."""
    if not block.training:
        return x
    with private_rng(tp_rank, x.device):
        return F.dropout(x, cast(float, block.dropout), training=True)


# ----------------------------------------------------------------------------- loss


class _VocabParallelCrossEntropy(Function):
    """Mean cross-entropy over non-ignored tokens from vocabulary-sharded logits, in chunks of rows.

    With z the logits, m = max_v z (all-reduce max), Z = Σ_v exp(z - m) and z_t the target's
    logit (one all-reduce of both): loss_i = log Z - (z_t - m), over the real vocabulary only: of a
    padded one (ids >= ``vocab``) a rank's columns [0, r) are real, r = clamp(vocab - start, 0, V/n),
    the rest masked (out of m and Z, gradient 0). Backward on the local shard:
    dz = (softmax(z) - onehot(t)) / N_valid. The full (B, T, V) logits never exist on a rank, and of
    the local (N, V/n) ones no fp32 copy does either: m is the max in the logits' dtype (exact), Z
    and backward's softmax are formed c rows at a time (c = ``chunk`` rows, one (c, V/n) fp32
    buffer), and the saved state is the logits themselves (alive as the head's output) plus fp32
    vectors of N. Extra memory: c·V/n·4 bytes besides the logits and their gradient, where the
    unchunked loss held two (N, V/n) fp32 tensors (the copy and the saved softmax). The same two
    all-reduces of 4·N and 8·N bytes as ever, whatever c.
    """

    @staticmethod
    def forward(
        ctx, logits, targets, group, meter, vocab_start: int, ignore_index: int, chunk: int, real: int
    ):
        vl = logits.shape[-1]
        z = logits.reshape(-1, vl)[:, :real]  # (N, r) real columns, in the logits' dtype: no copy
        zmax = (
            z.amax(dim=-1) if real else torch.full(z.shape[:1], -torch.inf, device=z.device)
        ).float()  # (N,)
        comm.all_reduce_max(zmax, group, meter)
        t = targets.reshape(-1)
        valid = t != ignore_index
        local = t - vocab_start
        mine = valid & (local >= 0) & (local < real)
        idx = local.clamp(0, max(real - 1, 0)).unsqueeze(1)  # (N, 1)
        picked = (
            (z.gather(1, idx).squeeze(1).float() - zmax) * mine if real else torch.zeros_like(zmax)
        )  # z_t - m where this rank owns t
        sumexp = torch.empty_like(zmax)  # (N,)
        for i in range(0, z.shape[0], chunk):
            e = (
                z[i : i + chunk].to(torch.float32, copy=True).sub_(zmax[i : i + chunk, None])
            )  # (c, V/n): the one buffer
            sumexp[i : i + chunk] = e.exp_().sum(dim=-1)
            del e
        stats = torch.stack((sumexp, picked))  # (2, N)
        comm.all_reduce(stats, group, meter)
        sumexp, picked = stats
        count = valid.sum().to(zmax.dtype).clamp(min=1)  # none trained (chat data): loss 0, not NaN
        loss = ((sumexp.log() - picked) * valid).sum() / count
        ctx.save_for_backward(logits, zmax, sumexp, idx, mine, valid, count)
        ctx.chunk, ctx.real = chunk, real
        return loss

    @staticmethod
    def backward(ctx, grad):
        logits, zmax, sumexp, idx, mine, valid, count = ctx.saved_tensors
        real = ctx.real
        z = logits.reshape(-1, logits.shape[-1])[:, :real]  # (N, r)
        full = logits.reshape(-1, logits.shape[-1])
        out = torch.empty_like(full) if real == full.shape[1] else torch.zeros_like(full)  # padded columns: 0
        scale = valid.to(zmax.dtype) * (grad / count)  # (N,)
        c = ctx.chunk
        for i in range(0, z.shape[0] if real else 0, c):
            g = z[i : i + c].to(torch.float32, copy=True).sub_(zmax[i : i + c, None]).exp_()  # (c, V/n) fp32
            g.div_(sumexp[i : i + c, None])  # softmax
            g.scatter_add_(1, idx[i : i + c], -mine[i : i + c].to(g.dtype).unsqueeze(1))  # softmax - onehot
            out[i : i + c, :real] = g.mul_(scale[i : i + c, None])
            del g
        return out.view(logits.shape), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    targets: torch.Tensor,
    group: Group,
    meter: CommMeter | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_rows: int = CHUNK_ROWS,
    vocab: int | None = None,
) -> torch.Tensor:
    """Mean next-token cross-entropy from this rank's logits (B, T, V'/n) and the full targets (B, T),
    ``chunk_rows`` rows at a time (:class:`_VocabParallelCrossEntropy`).

    Equals ``F.cross_entropy`` of the gathered logits' first ``vocab`` columns (None: all of them;
    the rest are a padded vocabulary's) with ``ignore_index``; rank r of ``group`` holds vocabulary
    rows [r·V'/n, (r+1)·V'/n).
    """
    rank = dist.get_rank(group) if comm.group_size(group) > 1 else 0
    vl = local_logits.shape[-1]
    start = rank * vl
    real = vl if vocab is None else min(max(vocab - start, 0), vl)
    return _VocabParallelCrossEntropy.apply(
        local_logits, targets, group, meter, start, ignore_index, chunk_rows, real
    )


def partial_numel(cfg: ModelConfig, tp: int, sp: bool) -> int:
    """Elements of the parameters whose gradient each tp rank holds in part (module docstring)."""
    L, h, d, k = cfg.n_layers, cfg.dim, cfg.head_dim, cfg.n_kv_heads
    norms = (2 * L + 1) * h * (2 if cfg.norm == "layernorm" else 1)
    seq_sharded = norms + 2 * L * h * cfg.bias + cfg.max_seq_len * h * (cfg.positions == "learned")
    replicated_kv = 2 * L * k * d * (h + (cfg.qkv_bias or cfg.bias)) if k < tp else 0
    if cfg.qk_norm_scope == "all":  # sharded with the heads; the k norm's k·d replicated when k < tp
        qk = L * k * d * (k < tp) * cfg.qk_norm
    else:  # per head: the 2·d weights replicated
        qk = 2 * L * d * cfg.qk_norm
    return (seq_sharded if sp else 0) + replicated_kv + qk


def comm_bytes_formula(
    cfg: ModelConfig, batch: int, seq: int, tp: int, sp: bool, elem: int = 4, micro_batches: int = 1
) -> float:
    """Bytes one rank moves per step of ``micro_batches`` micro-batches (forward + backward) under
    TP; see the module docstring."""
    if tp == 1:
        return 0.0
    rho = (tp - 1) / tp
    L, h = cfg.n_layers, cfg.dim
    S = batch * seq * h * elem
    partial = partial_numel(cfg, tp, sp)  # summed once per step
    per_mb = (
        2 * rho * ((4 * L + 2) * S + 3 * batch * seq * 4)
        if not sp
        else rho * ((10 * L + 5) * S + 6 * batch * seq * 4)
    )
    norm_sums = 2 * rho * 4 * L * batch * seq * 4 if cfg.qk_norm and cfg.qk_norm_scope == "all" else 0
    return micro_batches * (per_mb + norm_sums) + 2 * rho * partial * elem


def lora_comm_bytes(
    cfg, batch: int, seq: int, tp: int, sp: bool, elem: int = 4, micro_batches: int = 1
) -> float:
    """Bytes one rank moves per step under tp in a LoRA run of ``cfg`` (a LoomConfig): the layers'
    activation collectives of :func:`comm_bytes_formula` less those
    no gradient reaches (the frozen base's backward runs only behind the first adapter: the
    embedding's, every entry's before it, and there a ``qk_norm_scope = all`` norm's (B, T) sum
    unless its own projection has an adapter), plus the adapters' (:mod:`loom.parallel.tensor.lora`)."""
    if tp == 1:
        return 0.0
    rho, r, m = (tp - 1) / tp, cfg.finetune.lora_rank, cfg.model
    targets, shapes = set(lora_targets(cfg)), target_shapes(m)
    S = batch * seq * m.dim * elem
    base = comm_bytes_formula(m, batch, seq, tp, sp, elem) - 2 * rho * elem * partial_numel(m, tp, sp)
    skipped, grad = (rho * S if sp else 0.0), False  # the embedding's backward (sp: an all-gather)
    norm_sum = 2 * rho * batch * seq * 4 if m.qk_norm and m.qk_norm_scope == "all" else 0.0
    for _ in range(m.n_layers):
        for entry, row in ((("q", "k", "v"), "o"), (("w1", "w3"), "w2")):
            skipped += 0.0 if grad else 2 * rho * S  # the entry's backward: dx reduce (+ re-gather with sp)
            if entry[0] == "q" and not grad:  # a q/k norm's backward sum runs only behind its adapter
                skipped += norm_sum * len({"q", "k"} - targets)
            grad = grad or bool(targets & {*entry, row})
            skipped += rho * S if sp and not grad else 0.0  # the row layer's backward all-gather (sp)
    ranks = [len(targets & set(group)) * r for group in (("q", "k", "v"), ("w1", "w3"))]
    adapters = sum(2 * rho * batch * seq * R * elem for R in ranks) * m.n_layers
    partial = sum(shapes[t][0] * r for t in ("o", "w2") if t in targets)
    partial += sum(r * shapes[t][1] for t in ("q", "k", "v", "w1", "w3") if t in targets) if sp else 0
    partial += sum(shapes[t][0] * r for t in ("k", "v") if t in targets) if m.n_kv_heads < tp else 0
    return micro_batches * (base - skipped + adapters) + 2 * rho * elem * partial * m.n_layers
