"""The three GEMMs of a Linear in float8 or int8 on a tensor-parallel shard, with the scales of the
whole tensor (``train.precision = fp8 | int8`` under ``parallel.tp > 1``).

A Linear y = x Wᵀ runs three GEMMs, each contracting one axis (x: (M, i), W: (o, i), g = dy: (M, o)):

    output       y  = x  · Wᵀ     contracts i     fp8: x, W cast with scales s = fmax / amax
    grad_input   dx = g  · W      contracts o     int8: rows of the left operand and columns of
    grad_weight  dW = gᵀ · x      contracts M     the right one quantized as round(v · 127 / amax)

An operand's amax is taken over the whole tensor (fp8 ``tensorwise``) or, per row or column, along
the contracted axis (fp8 ``rowwise``, int8). On a tensor-parallel rank an operand may be a shard
(``split``: the axis cut over the group, None when every rank holds the same tensor). Its amax
then equals the one-process amax only after a MAX all-reduce over the group, needed when

    split is not None  and  (tensorwise  or  split == contracted axis)

(a rowwise amax along an uncut axis is already whole). With those amaxes every scale, every 8-bit
code and every integer or float8 product equals the single-process torchao Linear's; only the sums
of partial products over the group (row-parallel outputs, column-parallel input gradients) are
added in another order, in the activations' dtype.

Cost: one MAX all-reduce per GEMM with an operand to reduce (both operands' amaxes in one fp32
buffer). A block with C column-parallel Linears (W cut along rows: x whole, dY cut along columns)
and R row-parallel ones (x and W cut along their input columns, dY whole), model width h and M
tokens a micro-batch (SwiGLU: C = 5, R = 2) runs per micro-batch (:func:`amax_all_reduces`):

    fp8 tensorwise    3(C + R) all-reduces of 4(C + R) amaxes   (fwd C + R, bwd 2(C + R))
    rowwise, int8     C + R    all-reduces of (C + R)(M + h)    (fwd R: rows of x, W; bwd C: rows of dY, columns of W)

The casts, scales and scaled matmuls are torchao's (``torchao.float8`` tensors and
``torch._scaled_mm``, emulated on the CPU; int8 through ``torch._int_mm``); only the amax is ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from loom import comm
from loom.comm import CommMeter, Group

# the contracted axis of each operand per GEMM: (left, right) in the docstring's orientation
OUTPUT, GRAD_INPUT, GRAD_WEIGHT = "output", "grad_input", "grad_weight"
_EPS = 1e-12  # int8: the smallest scale (torchao's quantize_int8_rowwise)


def _group_max(amaxes: list[torch.Tensor], group: Group, meter: CommMeter | None) -> list[torch.Tensor]:
    """Element-wise MAX over ``group`` of every tensor in ``amaxes`` with one all-reduce (fp32: exact
    for bf16 and fp32 amaxes)."""
    if not amaxes or comm.group_size(group) == 1:
        return amaxes
    flat = torch.cat([a.float().reshape(-1) for a in amaxes])
    comm.all_reduce_max(flat, group, meter)
    out, at = [], 0
    for a in amaxes:
        out.append(flat[at : at + a.numel()].view(a.shape).to(a.dtype))
        at += a.numel()
    return out


@dataclass(frozen=True)
class LowPrecisionGemms:
    """One Linear's 8-bit GEMMs: ``precision`` fp8 (with torchao's ``config`` and ``mm_config``) or int8."""

    precision: str
    config: Any = None  # torchao Float8LinearConfig (fp8)
    mm_config: Any = None  # torchao LinearMMConfig (fp8)

    @property
    def tensorwise(self) -> bool:
        if self.precision != "fp8":
            return False
        from torchao.float8.config import ScalingGranularity

        return self.config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE

    def _reduce(self, split: int | None, contracted: int) -> bool:
        return split is not None and (self.tensorwise or split == contracted)

    def gemm(
        self,
        kind: str,
        left: torch.Tensor,
        right: torch.Tensor,
        splits: tuple[int | None, int | None],
        group: Group,
        meter: CommMeter | None = None,
    ) -> torch.Tensor:
        """One GEMM ``kind`` on 2-D operands as the module docstring orients them: output (x, W) ->
        (M, o); grad_input (g, W) -> (M, i); grad_weight (g, x) -> (o, i). ``splits``: each
        operand's axis cut over ``group`` (None: whole on every rank)."""
        # the contracted axis of (left, right) in their given layouts
        axes = {OUTPUT: (1, 1), GRAD_INPUT: (1, 0), GRAD_WEIGHT: (0, 0)}[kind]
        reduce = [self._reduce(s, a) for s, a in zip(splits, axes)]
        if self.precision == "fp8":
            return self._fp8(kind, left, right, reduce, group, meter)
        return self._int8(kind, left, right, axes, reduce, group, meter)

    # ------------------------------------------------------------------ fp8 (torchao float8)

    def _fp8(self, kind, left, right, reduce, group, meter) -> torch.Tensor:
        from torchao.float8.float8_training_tensor import GemmInputRole

        c = self.config
        # torchao's orientation of each operand, its cast config, role and axiswise dim (the contracted axis)
        if kind == OUTPUT:  # x (M, i) and Wᵀ (i, o), both scaled along i
            ops = [
                (left, c.cast_config_input, GemmInputRole.INPUT, -1),
                (right.t(), c.cast_config_weight, GemmInputRole.WEIGHT, 0),
            ]
        elif kind == GRAD_INPUT:  # g (M, o) along o; Wᵀ (i, o) along o
            ops = [
                (left, c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1),
                (right.t(), c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1),
            ]
        else:  # g (M, o) and x (M, i), both along M
            ops = [
                (left, c.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT, 0),
                (right, c.cast_config_input_for_grad_weight, GemmInputRole.INPUT, 0),
            ]
        amaxes = [self._fp8_amax(t, cc, dim) for t, cc, _, dim in ops]
        todo = [(i, m) for i, m in enumerate(amaxes) if reduce[i] and m is not None]
        for (i, _), m in zip(todo, _group_max([m for _, m in todo], group, meter)):
            amaxes[i] = m
        a, b = (self._fp8_cast(t, cc, role, dim, amax) for (t, cc, role, dim), amax in zip(ops, amaxes))
        if kind == OUTPUT:
            return torch.mm(a, b)
        if kind == GRAD_INPUT:
            return torch.mm(a, b.t())
        return torch.mm(a.t(), b)

    @staticmethod
    def _fp8_amax(t: torch.Tensor, cc, dim: int) -> torch.Tensor | None:
        from torchao.float8.config import ScalingGranularity, ScalingType

        if cc.scaling_type is ScalingType.DISABLED:
            return None
        with torch.no_grad():
            if cc.scaling_granularity is ScalingGranularity.TENSORWISE:
                return t.abs().max()
            return t.abs().amax(dim=dim, keepdim=True)

    def _fp8_cast(self, t: torch.Tensor, cc, role, dim: int, amax: torch.Tensor | None):
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import amax_to_scale

        if amax is None:  # this operand's scaling is disabled: it stays in high precision
            return t
        scale = amax_to_scale(amax, cc.target_dtype, self.config.round_scales_to_power_of_2)
        axis = dim if cc.scaling_granularity is ScalingGranularity.AXISWISE else None
        return hp_tensor_and_scale_to_float8(t, scale, cc.target_dtype, self.mm_config, role, axis)

    # ------------------------------------------------------------------ int8 (torchao int8 mixed precision)

    def _int8(self, kind, left, right, axes, reduce, group, meter) -> torch.Tensor:
        from torchao.prototype.quantized_training.int8_mixed_precision import scaled_int8_mm

        # torchao's A·B with A's rows and Bᵀ's rows quantized (the contracted axis made the last one);
        # its grad_weight is (xᵀ·g)ᵀ: A = xᵀ, Bᵀ = gᵀ, so the scales multiply in torchao's order
        a = left if axes[0] == 1 else left.t()
        b_t = right if axes[1] == 1 else right.t()
        if kind == GRAD_WEIGHT:
            a, b_t, reduce = b_t, a, reduce[::-1]
        with torch.no_grad():
            absmax = [a.abs().amax(1), b_t.abs().amax(1)]
        todo = [i for i in range(2) if reduce[i]]
        for i, m in zip(todo, _group_max([absmax[i] for i in todo], group, meter)):
            absmax[i] = m
        (qa, sa), (qb, sb) = (_quantize_rows(t, m) for t, m in zip((a, b_t), absmax))
        out = scaled_int8_mm(qa.contiguous(), qb.contiguous().t(), sa.contiguous(), sb.contiguous())
        return out.t() if kind == GRAD_WEIGHT else out  # (M, o), (M, i), or (i, o)ᵀ = (o, i)


def _quantize_rows(t: torch.Tensor, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes q = round(t / s) clipped to [-128, 127], s = absmax / 127 per row (in
    t's dtype), as torchao's ``quantize_int8_rowwise`` given the row's absmax."""
    scale = absmax / 127
    inv = 1.0 / scale.float().clip(_EPS)
    q = (t.float() * inv.view(-1, 1)).round().clip(-128, 127).to(torch.int8)
    return q, scale


def amax_all_reduces(tensorwise: bool, columns: int, rows: int, tokens: int, dim: int) -> tuple[int, int]:
    """(all-reduces, fp32 amaxes) of one block's GEMMs per micro-batch under tp (module docstring):
    ``columns`` / ``rows`` parallel Linears, ``tokens`` = M rows of x, ``dim`` = h."""
    k = columns + rows
    return (3 * k, 4 * k) if tensorwise else (k, k * (tokens + dim))


def low_precision_gemms(module: torch.nn.Module) -> LowPrecisionGemms | None:
    """The 8-bit GEMMs of a Linear swapped by :func:`loom.memory.precision.apply_low_precision`
    (torchao's Float8Linear or int8 mixed-precision Linear), else None."""
    name = type(module).__name__
    if name == "Float8Linear":
        return LowPrecisionGemms("fp8", module.config, module.linear_mm_config)
    if name == "Int8MixedPrecisionTrainingLinear":
        return LowPrecisionGemms("int8")
    return None


class LowPrecisionLinear(torch.autograd.Function):
    """y = x Wᵀ through :class:`LowPrecisionGemms` on shards: forward the output GEMM, backward the
    grad_input and grad_weight GEMMs; only the amax MAX all-reduces run on ``group`` (the sums over
    the group are the caller's). ``splits``: (x, W, g) cut axes of their 2-D forms."""

    @staticmethod
    def forward(ctx, x, w, gemms: LowPrecisionGemms, group: Group, meter, splits):
        ctx.gemms, ctx.group, ctx.meter, ctx.splits = gemms, group, meter, splits
        ctx.save_for_backward(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        y = gemms.gemm(OUTPUT, x2, w, (splits[0], splits[1]), group, meter)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        gemms, group, meter, (sx, sw, sg) = ctx.gemms, ctx.group, ctx.meter, ctx.splits
        g2 = grad.reshape(-1, grad.shape[-1])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = gemms.gemm(GRAD_INPUT, g2, w, (sg, sw), group, meter).view(*x.shape)
        if ctx.needs_input_grad[1]:
            dw = gemms.gemm(GRAD_WEIGHT, g2, x.reshape(-1, x.shape[-1]), (sg, sx), group, meter)
        return dx, dw, None, None, None, None
