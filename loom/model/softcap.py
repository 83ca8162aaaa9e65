"""Logit soft-capping (Gemma 2's ``final_logit_softcapping``): the one rule for every path that makes logits.

    y = c·tanh(z / c)            |y| < c, y ≈ z where |z| << c; c = 0: off, y = z
    dy/dz = 1 - tanh²(z / c) = 1 - (y / c)²

The derivative needs the output y alone, so :func:`softcap` saves only y, the very tensor the loss
after it saves as its logits: the cap keeps no (B, T, V) tensor of its own (``torch.tanh(z / c) * c``
under autograd would keep tanh's output as well). The chunked loss applies the same two kernels,
:func:`cap_values` and :func:`cap_slope`, to one chunk of rows at a time, in place
(:func:`~loom.model.loss.linear_cross_entropy`). Every path caps in the logits' own dtype, as
Hugging Face's Gemma 2 does.
"""

from __future__ import annotations

from typing import Any

import torch


def cap_values(z: torch.Tensor, cap: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = cap·tanh(z / cap), without autograd, written into ``out`` (z itself: in place; None: a new
    tensor). ``cap`` > 0."""
    return torch.div(z, cap, out=out).tanh_().mul_(cap)


def cap_slope(y: torch.Tensor, cap: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """dy/dz = 1 - (y / cap)² from the capped y = cap·tanh(z / cap), into ``out`` as :func:`cap_values`."""
    return torch.div(y, cap, out=out).square_().neg_().add_(1.0)


class _SoftCap(torch.autograd.Function):
    """y = cap·tanh(z / cap); saves y only, backward dz = dy · (1 - (y / cap)²)."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, cap: float) -> torch.Tensor:
        y = cap_values(z, cap)  # one new tensor; z is not kept
        ctx.save_for_backward(y)
        ctx.cap = cap
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (y,) = ctx.saved_tensors
        return cap_slope(y, ctx.cap).mul_(grad), None


def softcap(z: torch.Tensor, cap: float) -> torch.Tensor:
    """Logits z (..., V) -> cap·tanh(z / cap) (the module docstring's rule); ``cap`` <= 0 (off): z itself."""
    return _SoftCap.apply(z, cap) if cap > 0 else z
