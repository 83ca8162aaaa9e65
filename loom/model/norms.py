"""The norms of a block, each a single-device module whose saved tensors are the input and its
row statistics only (B_a h + 4 per row for RMSNorm, + 8 for LayerNorm): the planner's
``norm_activation``, measured in tests/test_plan_activations.py.

RMSNorm: y = x · r · w, r = (mean(x²) + eps)^(-1/2), in fp32, rounded to x's dtype once. With
    ``model.norm_offset`` (Gemma) the scale is 1 + w, w starting at 0, formed in fp32.
    Backward, x̂ = x·r, ĝ = g·w: dx = r · (ĝ - x̂ · mean(ĝ · x̂)), dw = Σ_rows g · x̂.
    On CUDA forward and backward are torch's fused kernels (``aten::_fused_rms_norm`` and its
    backward: one kernel each, where the fp32 chain makes 5 passes over x forward and 12
    backward); elsewhere, and under ``torch.compile`` (which fuses the chain itself), the same
    formulas in plain ops. Both save the same tensors.
LayerNorm: y = (x - mean(x)) / sqrt(var(x) + eps) · w + b, torch's kernels in fp32, rounded
    once, saving x and the fp32 mean and 1/σ.
"""

from __future__ import annotations

import torch
from torch import nn

from loom.config import ModelConfig


def _fused_rms_norm_available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_fused_rms_norm") and hasattr(ops, "_fused_rms_norm_backward")


_FUSED = _fused_rms_norm_available()
_FUSED_CUDA_BACKWARD = [True]  # False once a build lacks the CUDA kernel


def rms_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, r): y = x · r · w rounded once to x's dtype, r (…, 1) fp32."""
    # torch's kernel where x and w share a dtype, outside torch.compile (inductor fuses the chain)
    if _FUSED and x.dtype == weight.dtype and not torch.compiler.is_compiling():
        return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * r * weight.float()).to(x.dtype), r


def rms_backward(
    g: torch.Tensor, x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, needs: tuple[bool, bool]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx, dw) of :func:`rms_forward` for the output gradient g (see the module's formulas)."""
    fused = _FUSED and g.is_cuda and x.dtype == weight.dtype == g.dtype and _FUSED_CUDA_BACKWARD[0]
    if fused and not torch.compiler.is_compiling():
        try:
            dx, dw = torch.ops.aten._fused_rms_norm_backward(g, x, [x.shape[-1]], r, weight, list(needs))
            return dx, dw
        except NotImplementedError:  # a build without the CUDA kernel: the plain ops from now on
            _FUSED_CUDA_BACKWARD[0] = False
    xhat = x.float() * r
    dx = dw = None
    if needs[0]:
        gh = g.float() * weight.float()
        dx = (r * (gh - xhat * (gh * xhat).mean(-1, keepdim=True))).to(x.dtype)
    if needs[1]:
        dw = (g.float() * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return dx, dw


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm saving x and r only (the autograd of the plain chain saves x in fp32, x̂ and x̂·w); with
    ``offset`` the scale 1 + w is formed again in backward, never saved (dw is the scale's gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:  # type: ignore[override]
        y, r = rms_forward(x, norm_scale(weight, offset), eps)
        ctx.save_for_backward(x, r, weight)
        ctx.offset = offset
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:  # type: ignore[override]
        x, r, weight = ctx.saved_tensors
        dx, dw = rms_backward(
            g.contiguous(),
            x,
            r,
            norm_scale(weight, ctx.offset),
            (ctx.needs_input_grad[0], ctx.needs_input_grad[1]),
        )
        return dx, None if dw is None else dw.to(weight.dtype), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """RMSNorm over x's last dim (see the module's formulas); ``offset``: the scale is 1 + w."""
    return _RMSNormFunction.apply(x, weight, eps, offset)


def norm_scale(weight: torch.Tensor, offset: bool) -> torch.Tensor:
    """An RMSNorm's scale: w, or with ``offset`` (Gemma's norms) 1 + w in fp32."""
    return weight.float() + 1.0 if offset else weight


class RMSNorm(nn.Module):
    """y = x · r · w, r = (mean(x²) + eps)^(-1/2), in fp32, rounded once; saves x and r. ``offset``:
    the scale is 1 + w (:func:`norm_scale`), the weight starting at 0."""

    activation_kind = "norm"  # what its saved tensors count as for train.compress

    def __init__(self, dim: int, eps: float = 1e-5, offset: bool = False) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)


class _LayerNormFunction(torch.autograd.Function):
    """LayerNorm in fp32 over x, rounded once; saves x and the fp32 mean and 1/σ, on every device
    (torch's own kernel keeps the statistics in x's dtype on the CPU and in fp32 on CUDA)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        shape = x.shape[-1:]
        y, mean, rstd = torch.native_layer_norm(x.float(), shape, weight.float(), bias.float(), eps)
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        return y.to(x.dtype)

    @staticmethod
    def backward(
        ctx, g: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:  # type: ignore[override]
        x, mean, rstd, weight, bias = ctx.saved_tensors
        needs = [bool(n) for n in ctx.needs_input_grad[:3]]
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            g.float(), x.float(), x.shape[-1:], mean, rstd, weight.float(), bias.float(), needs
        )
        return (
            None if dx is None else dx.to(x.dtype),
            None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype),
            None,
        )


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over x's last dim (see the module's formulas)."""
    return _LayerNormFunction.apply(x, weight, bias, eps)


class LayerNorm(nn.Module):
    """y = (x - mean(x)) / sqrt(var(x) + eps) · w + b in fp32, rounded once (``model.norm =
    layernorm``); saves x, the mean and 1/σ."""

    activation_kind = "norm"  # what its saved tensors count as for train.compress

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """The norm ``cfg.norm`` names, over ``dim`` features."""
    if cfg.norm == "layernorm":
        return LayerNorm(dim, cfg.norm_eps)
    return RMSNorm(dim, cfg.norm_eps, cfg.norm_offset)
