"""Tensor-parallel layers: column/row-parallel linear, vocab-parallel embedding, attention, MLP.

Megatron layout over a tensor-parallel group of n ranks (rank r):

    column-parallel  Y_i = X W_i^T      W_i = rows [r·o/n, (r+1)·o/n) of the (o, i) weight
    row-parallel     Y   = Σ_r X_r W_r^T  W_r = columns [r·i/n, (r+1)·i/n); the Σ is g (all-reduce)

A block is column → local math → row, so each of attention and MLP runs one collective in
forward (g after the row-parallel layer) and one in backward (f before the column-parallel
ones). With sequence parallelism (``sp``) the residual stream is sharded along the sequence:
the entry all-gathers the sequence (and reduce-scatters in backward) and the exit
reduce-scatters it (and all-gathers in backward). The column-parallel entry keeps only the
sequence *shard* for backward and re-gathers it there (overlapped with the input-gradient
matmul), so no full-sequence activation outside attention/MLP is kept.

Biases: a column-parallel layer's bias is sharded with its rows; a row-parallel layer's bias is whole
on every rank and added once, after the Σ (with sp: to this rank's sequence shard, so its gradient is
a partial sum over tp, like a sequence-parallel norm's weight and bias and the learned position
table's rows).

fp8 / int8 (``train.precision``): a layer made from one of torchao's 8-bit Linears keeps its GEMMs
(:class:`~loom.memory.lowp_gemm.LowPrecisionGemms`) and runs them on this rank's shard with the
whole tensor's scales (a MAX all-reduce of the shards' amaxes where they differ; see that module).

Sharded parameters are placed with ``tp_dim`` (0: rows, 1: columns, :mod:`loom.parallel.placement`); replicated parameters
(norm weights, key/value weights replicated when n_kv_heads < n) have none.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from loom import comm
from loom.comm import CommMeter, Group
from loom.memory.lowp_gemm import (
    GRAD_INPUT,
    GRAD_WEIGHT,
    OUTPUT,
    LowPrecisionGemms,
    LowPrecisionLinear,
    low_precision_gemms,
)
from loom.model.llama import (
    Attention,
    CoreAttention,
    FeedForward,
    LayerNorm,
    RMSNorm,
    apply_rope,
    mlp_activation,
)
from loom.model.norms import norm_scale
from loom.parallel.partial import mark_partial
from loom.parallel.placement import copy_placement
from loom.parallel.rng import private_rng
from loom.parallel.sequence import all_gather_seq, reduce_scatter_seq, scatter_seq
from loom.parallel.tensor.comm import reduce_from_tp, sum_over_tp
from loom.parallel.tensor.lora import column_deltas, row_delta, shard_column_adapters, shard_row_adapters
from loom.parallel.tensor.shard import TPContext, sharded_param


class _ColumnParallelMatmul(Function):
    """Y_i = X_full W_i^T for several weights sharing one input (q/k/v, or w1/w3).

    Forward: sp=False, X_full = X (f: identity);  sp=True, X_full = all-gather of X along seq.
    Backward: dX = Σ_i dY_i W_i, then all-reduce (sp=False) or reduce-scatter along seq (sp=True);
    dW_i = dY_i^T X_full. With sp only the shard X is saved; X_full is re-gathered in backward.
    ``gemms``: per weight, its 8-bit GEMMs or None (a plain matmul); W_i is cut along rows (axis 0)
    and dY_i along columns (axis 1), X_full is whole.
    """

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        group: Group,
        meter: CommMeter | None,
        sp: bool,
        gemms: tuple[LowPrecisionGemms | None, ...],
        *weights: torch.Tensor,
    ):
        ctx.group, ctx.meter, ctx.sp, ctx.gemms = group, meter, sp, gemms
        x_full = all_gather_seq(x, group, meter) if sp else x
        ctx.save_for_backward(x, *weights)
        x2 = x_full.reshape(-1, x_full.shape[-1])
        return tuple(
            F.linear(x_full, w)
            if gm is None
            else gm.gemm(OUTPUT, x2, w, (None, 0), group, meter).view(*x_full.shape[:-1], w.shape[0])
            for w, gm in zip(weights, gemms)
        )

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        x, *weights = ctx.saved_tensors
        group, meter = ctx.group, ctx.meter
        if ctx.sp:  # start re-gathering the sequence while dX is computed
            gather_work, gather_finish = all_gather_seq(x, group, meter, async_op=True)
        dx, work = None, None
        if ctx.needs_input_grad[0]:
            for g, w, gm in zip(grads, weights, ctx.gemms):
                if g is None:
                    continue
                lead, g2 = g.shape[:-1], g.reshape(-1, g.shape[-1])
                if gm is not None:  # 8-bit: dY_i cut along columns, W_i along rows
                    part = gm.gemm(GRAD_INPUT, g2, w, (1, 0), group, meter)
                    dx = part if dx is None else dx.add_(part)
                else:
                    dx = g2 @ w if dx is None else dx.addmm_(g2, w)  # (B·T, in)
            if dx is not None:
                dx = dx.view(*lead, dx.shape[-1])  # (B, T, in)
        if ctx.sp:
            gather_work.wait()
            x_full = gather_finish()
            if dx is not None:
                work, dx = reduce_scatter_seq(dx, group, meter, async_op=True)
        else:
            x_full = x
            if dx is not None:
                dx = dx.contiguous()
                work = comm.all_reduce(dx, group, meter, async_op=True)
        x2 = x_full.reshape(-1, x_full.shape[-1])
        dws = [
            None
            if g is None or not ctx.needs_input_grad[5 + i]
            else g.reshape(-1, g.shape[-1]).t() @ x2
            if gm is None
            else gm.gemm(GRAD_WEIGHT, g.reshape(-1, g.shape[-1]), x2, (1, None), group, meter)
            for i, (g, gm) in enumerate(zip(grads, ctx.gemms))
        ]
        if work is not None:
            work.wait()
        return (dx, None, None, None, None, *dws)


def column_parallel_matmul(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    ctx: TPContext,
    gemms: tuple[LowPrecisionGemms | None, ...] = (),
) -> tuple[torch.Tensor, ...]:
    """Fused f (or sequence all-gather) + column-parallel matmuls sharing the input ``x``;
    ``gemms``: per weight, its 8-bit GEMMs (none given: plain matmuls)."""
    gemms = gemms or (None,) * len(weights)
    if ctx.size == 1 and all(gm is None for gm in gemms):
        return tuple(F.linear(x, w) for w in weights)
    return _ColumnParallelMatmul.apply(x, ctx.group, ctx.meter, ctx.sp, gemms, *weights)


class ColumnParallelLinear(nn.Module):
    """y = x W_r^T with W_r this rank's rows: (.., in) -> (.., out/n), no gather of the output.

    ``replicated_rows``: the weight is held whole on every rank (key/value heads replicated when
    n_kv_heads < n) and this rank uses those rows; the parts of its gradient are summed over the
    group once per step (:func:`~loom.parallel.partial.sum_partial_grads`).
    """

    def __init__(
        self,
        weight: nn.Parameter,
        ctx: TPContext,
        replicated_rows: slice | None = None,
        bias: nn.Parameter | None = None,
        gemms: LowPrecisionGemms | None = None,
    ) -> None:
        super().__init__()
        self.gemms = gemms  # fp8 / int8 GEMMs of the Linear it was made from (None: plain matmuls)
        partial = (
            (lambda p: p) if replicated_rows is None else (lambda p: mark_partial(p, ctx.group, ctx.meter))
        )
        self.weight = partial(weight)
        self.bias = None if bias is None else partial(bias)  # this rank's rows' bias (or all, replicated)
        self.ctx = ctx
        self.replicated_rows = replicated_rows

    @classmethod
    def from_linear(
        cls, lin: nn.Linear, ctx: TPContext, replicated_rows: slice | None = None
    ) -> ColumnParallelLinear:
        """Rows of ``lin`` (and of its bias) sharded over tp, or held whole when ``replicated_rows``."""
        if replicated_rows is None:
            w = sharded_param(lin.weight, 0, ctx)
            b = None if lin.bias is None else sharded_param(lin.bias, 0, ctx)
        else:
            w = copy_placement(
                lin.weight, nn.Parameter(lin.weight.detach().clone(), lin.weight.requires_grad)
            )
            b = (
                None
                if lin.bias is None
                else copy_placement(lin.bias, nn.Parameter(lin.bias.detach().clone(), lin.bias.requires_grad))
            )
        out = cls(w, ctx, replicated_rows, b, low_precision_gemms(lin))
        shard_column_adapters(lin, out, ctx, replicated_rows)  # LoRA: B's rows with the weight's
        return out

    def local_weight(self) -> torch.Tensor:
        if self.replicated_rows is None:
            return self.weight
        return self.weight[self.replicated_rows]

    def local_bias(self) -> torch.Tensor | None:
        if self.bias is None or self.replicated_rows is None:
            return self.bias
        return self.bias[self.replicated_rows]

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        b = self.local_bias()
        return y if b is None else y + b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.add_bias(column_parallel_matmul(x, (self.local_weight(),), self.ctx, (self.gemms,))[0])
        delta = column_deltas(x, (self,), self.ctx)[0]
        return y if delta is None else y + delta

    def extra_repr(self) -> str:
        return f"local={tuple(self.weight.shape)}, tp={self.ctx.size}, sp={self.ctx.sp}"


class RowParallelLinear(nn.Module):
    """y = Σ_r x_r W_r^T + b: (.., in/n) -> (.., out); Σ is g (all-reduce) or, with sp, a
    reduce-scatter; the whole bias b is added once, after the Σ (its gradient partial with sp)."""

    def __init__(
        self,
        weight: nn.Parameter,
        ctx: TPContext,
        bias: nn.Parameter | None = None,
        gemms: LowPrecisionGemms | None = None,
    ) -> None:
        super().__init__()
        self.gemms = gemms  # fp8 / int8 GEMMs of the Linear it was made from (None: plain matmul)
        self.weight = weight
        self.bias = bias if bias is None or not ctx.sp else mark_partial(bias, ctx.group, ctx.meter)
        self.ctx = ctx

    @classmethod
    def from_linear(cls, lin: nn.Linear, ctx: TPContext) -> RowParallelLinear:
        """Columns of ``lin``'s weight sharded over tp; its bias whole on every rank."""
        out = cls(sharded_param(lin.weight, 1, ctx), ctx, lin.bias, low_precision_gemms(lin))
        shard_row_adapters(lin, out, ctx)  # LoRA: A's columns with the weight's
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemms is None:
            y = F.linear(x, self.weight)  # partial sum
        else:  # 8-bit: x and W cut along their input columns (axis 1), dY whole
            y = LowPrecisionLinear.apply(
                x, self.weight, self.gemms, self.ctx.group, self.ctx.meter, (1, 1, None)
            )
        delta = row_delta(self, x)  # LoRA: this rank's part of (α/r)·B A x, summed with the layer's
        y = y if delta is None else y + delta
        if self.ctx.sp:
            y = scatter_seq(y, self.ctx.group, self.ctx.meter)  # (B, T/n, out)
        else:
            y = reduce_from_tp(y, self.ctx.group, self.ctx.meter)  # (B, T, out)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"local={tuple(self.weight.shape)}, tp={self.ctx.size}, sp={self.ctx.sp}"


class VocabParallelEmbedding(nn.Module):
    """Rows [r·V/n, (r+1)·V/n) of the table; tokens outside give 0, then g (or reduce-scatter with sp).

    e(t) = Σ_r [t in rank r's range] E_r[t - r·V/n]: exactly one term is non-zero.
    """

    def __init__(self, weight: nn.Parameter, ctx: TPContext) -> None:
        super().__init__()
        self.weight = weight
        self.ctx = ctx
        self.vocab_start = ctx.rank * weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, h)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.ctx.sp:
            return scatter_seq(out, self.ctx.group, self.ctx.meter)  # (B, T/n, h)
        return reduce_from_tp(out, self.ctx.group, self.ctx.meter)


class SequenceParallelLayerNorm(LayerNorm):
    """LayerNorm on a sequence shard: its weight and bias gradients are partial sums over tp."""

    def __init__(self, norm: LayerNorm, ctx: TPContext) -> None:
        super().__init__(norm.weight.shape[0], norm.eps)
        for p in (norm.weight, norm.bias):
            mark_partial(p, ctx.group, ctx.meter)  # summed over tp once per step
        self.weight, self.bias = norm.weight, norm.bias
        self.ctx = ctx


def sequence_parallel_norm(norm: nn.Module, ctx: TPContext) -> nn.Module:
    """The sequence-parallel counterpart of an RMSNorm or a LayerNorm (same parameters, now partial)."""
    if isinstance(norm, LayerNorm):
        return SequenceParallelLayerNorm(norm, ctx)
    return SequenceParallelRMSNorm(cast(RMSNorm, norm), ctx)


class SequenceParallelPositions(nn.Module):
    """The learned position table under sp: this rank's sequence shard's rows (positions cut along
    the last dim like :func:`~loom.parallel.sequence.scatter_seq` cuts the sequence); the table's
    gradient is a partial sum over tp. Without sp the table is used as it is (replicated)."""

    def __init__(self, table: nn.Embedding, ctx: TPContext) -> None:
        super().__init__()
        self.weight = mark_partial(table.weight, ctx.group, ctx.meter)
        self.ctx = ctx

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions.chunk(self.ctx.size, dim=-1)[self.ctx.rank], self.weight)


class SequenceParallelRMSNorm(RMSNorm):
    """RMSNorm on a sequence shard: its weight gradient is a partial sum, so f sums it over tp."""

    def __init__(self, norm: RMSNorm, ctx: TPContext) -> None:
        super().__init__(norm.weight.shape[0], norm.eps, norm.offset)
        mark_partial(norm.weight, ctx.group, ctx.meter)  # summed over tp once per step
        self.weight = norm.weight
        self.ctx = ctx


class ShardedRMSNorm(nn.Module):
    """One RMSNorm over a width D cut into head shards over tp (OLMo-2's q/k norm, ``qk_norm_scope =
    all``): s = Σ_tp Σ_local x² (:func:`sum_over_tp`: an all-reduce of (B, T, 1) fp32 in forward and
    in backward), y = x · rsqrt(s / (c·D) + eps) · w_local (1 + w_local with ``offset``), w_local this rank's slice of the weight
    (the rows of its wq/wk shard). c = ranks holding each head (1; n/k for replicated kv heads, whose
    weight is then held whole, ``rows`` used, and its gradient summed over tp)."""

    activation_kind = "norm"  # what its saved tensors count as for train.compress

    def __init__(self, norm: RMSNorm, ctx: TPContext, rows: slice | None = None, copies: int = 1) -> None:
        super().__init__()
        self.eps, self.ctx, self.rows, self.copies, self.offset = norm.eps, ctx, rows, copies, norm.offset
        self.width = norm.weight.shape[0]  # D, the whole projection's
        if rows is None:
            self.weight = sharded_param(norm.weight, 0, ctx)
        else:
            w = copy_placement(
                norm.weight, nn.Parameter(norm.weight.detach().clone(), norm.weight.requires_grad)
            )
            mark_partial(w, ctx.group, ctx.meter)  # its rows' gradient from each rank: summed over tp
            self.weight = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # (B, T, D/n)
        s = sum_over_tp(xf.pow(2).sum(-1, keepdim=True), self.ctx.group, self.ctx.meter)  # (B, T, 1)
        y = xf * torch.rsqrt(s / (self.copies * self.width) + self.eps)
        w = self.weight if self.rows is None else self.weight[self.rows]
        if self.offset:  # Gemma's 1 + w, applied in fp32 before the one rounding
            return (y * norm_scale(w, True)).type_as(x)
        return y.type_as(x) * w


class ParallelAttention(nn.Module):
    """Attention split by heads: rank r keeps query heads [r·a/n, (r+1)·a/n) and their key/value heads.

    k % n == 0: key/value heads are sharded like the queries (rank r: [r·k/n, (r+1)·k/n)).
    n % k == 0 (k < n): every rank's a/n query heads share one key/value head, r // (n/k), whose
    weights are replicated (and their gradients summed over tp).
    wq, wk, wv are column-parallel (one fused entry), wo row-parallel: one collective per pass.
    """

    activation_kind = "attention"  # what its saved tensors count as for train.compress

    def __init__(
        self,
        wq: ColumnParallelLinear,
        wk: ColumnParallelLinear,
        wv: ColumnParallelLinear,
        wo: RowParallelLinear,
        head_dim: int,
        ctx: TPContext,
        core: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo
        self.head_dim = head_dim
        self.ctx = ctx
        self.core = core if core is not None else CoreAttention()  # local heads' softmax(qkᵀ)v
        self.q_norm: nn.Module | None = None  # per-head RMSNorm of q and k (replicated weights)
        self.k_norm: nn.Module | None = None
        self.rope = True  # False with learned positions
        self.qk_norm_all = False  # q/k norms over all heads (ShardedRMSNorm), applied before the head split

    @classmethod
    def from_full(cls, attn: Attention, ctx: TPContext) -> ParallelAttention:
        n, r, d, k = ctx.size, ctx.rank, attn.head_dim, attn.n_kv_heads
        rows = None if k % n == 0 else slice((r // (n // k)) * d, (r // (n // k) + 1) * d)
        wq = ColumnParallelLinear.from_linear(attn.wq, ctx)
        wk, wv = (ColumnParallelLinear.from_linear(lin, ctx, rows) for lin in (attn.wk, attn.wv))
        wo = RowParallelLinear.from_linear(attn.wo, ctx)
        out = cls(wq, wk, wv, wo, d, ctx, attn.core)
        out.rope = getattr(attn, "rope", True)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        out.qk_norm_all = getattr(attn, "qk_norm_all", False)
        if q_norm is not None and out.qk_norm_all:  # over all heads: weights cut with the heads
            if k_norm is None:
                raise ValueError("attention has a q_norm but no k_norm: qk-norm needs both")
            out.q_norm = ShardedRMSNorm(q_norm, ctx)
            out.k_norm = ShardedRMSNorm(k_norm, ctx, rows, 1 if rows is None else n // k)
        elif q_norm is not None:  # replicated; each rank's heads give part of the grad
            if k_norm is None:
                raise ValueError("attention has a q_norm but no k_norm: qk-norm needs both")
            out.q_norm, out.k_norm = q_norm, k_norm
            for norm in (q_norm, k_norm):
                mark_partial(norm.weight, ctx.group, ctx.meter)
        return out

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``docs``: packed data's document ids (B, T) of the full sequence (see CoreAttention)."""
        q, k, v = column_parallel_matmul(
            x,
            (self.wq.weight, self.wk.local_weight(), self.wv.local_weight()),
            self.ctx,
            (self.wq.gemms, self.wk.gemms, self.wv.gemms),
        )
        q, k, v = self.wq.add_bias(q), self.wk.add_bias(k), self.wv.add_bias(v)
        deltas = column_deltas(x, (self.wq, self.wk, self.wv), self.ctx)  # LoRA adapters, if any
        q, k, v = (t if d is None else t + d for t, d in zip((q, k, v), deltas))
        # From here on the same math as loom.model.llama.Attention.forward, on the local heads.
        B, T, _ = q.shape  # T is the full sequence (gathered with sp): RoPE positions stay global
        if self.q_norm is not None and self.k_norm is not None and self.qk_norm_all:
            q, k = self.q_norm(q), self.k_norm(k)  # (B, T, a/n·d): sums of squares over tp
        q = q.view(B, T, -1, self.head_dim)  # (B, T, a/n, d)
        k = k.view(B, T, -1, self.head_dim)  # (B, T, k_local, d)
        v = v.view(B, T, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None and not self.qk_norm_all:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, d)
        dropping = self.training and getattr(self.core, "dropout", 0.0) > 0
        with private_rng(self.ctx.rank, q.device, enabled=dropping):  # masks of this rank's heads
            y = self.core(q, k, v) if docs is None else self.core(q, k, v, docs)  # (B, a/n, T, d)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, a/n·d)
        return self.wo(y)  # (B, T, h), or (B, T/n, h) with sp


class ParallelFeedForward(nn.Module):
    """The MLP split along the hidden size f: w1 (and SwiGLU's w3) column-parallel (fused entry, w1's
    bias sharded with its rows), w2 row-parallel (its bias added after the Σ)."""

    activation_kind = "mlp"  # what its saved tensors count as for train.compress

    def __init__(
        self,
        w1: ColumnParallelLinear,
        w3: ColumnParallelLinear | None,
        w2: RowParallelLinear,
        ctx: TPContext,
        kind: str = "swiglu",
    ) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = w1, w3, w2
        self.ctx = ctx
        self.kind = kind

    @classmethod
    def from_full(cls, ffn: FeedForward, ctx: TPContext) -> ParallelFeedForward:
        w3 = None if ffn.w3 is None else ColumnParallelLinear.from_linear(ffn.w3, ctx)
        return cls(
            ColumnParallelLinear.from_linear(ffn.w1, ctx),
            w3,
            RowParallelLinear.from_linear(ffn.w2, ctx),
            ctx,
            getattr(ffn, "kind", "swiglu"),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = (self.w1.weight,) if self.w3 is None else (self.w1.weight, self.w3.weight)
        mods = (self.w1,) if self.w3 is None else (self.w1, self.w3)
        a, *b = column_parallel_matmul(x, weights, self.ctx, tuple(m.gemms for m in mods))  # (B, T, f/n)
        deltas = column_deltas(x, mods, self.ctx)  # LoRA adapters, if any
        a, *b = (t if d is None else t + d for t, d in zip((a, *b), deltas))
        return self.w2(mlp_activation(self.kind, self.w1.add_bias(a), b[0] if b else None))
