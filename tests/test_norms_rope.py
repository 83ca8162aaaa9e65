"""The block's norms and RoPE (:mod:`loom.model.norms`, :func:`loom.model.llama.apply_rope`):
equal to their fp64 formulas, forward and backward, and cheap in eager mode: the tensors they
save and the passes they make over their input are counted and held to the stated budget."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from loom.config import ModelConfig
from loom.model.llama import apply_rope, rope_tables
from loom.model.norms import RMSNorm, layer_norm, rms_norm

B, T, H, D = 2, 48, 4, 32
WIDTH = H * D
TABLES = ModelConfig(dim=WIDTH, n_heads=H, n_kv_heads=H, max_seq_len=64)  # RoPE base 10,000


class PassCounter(TorchDispatchMode):
    """Counts the ops that write a new tensor of at least ``numel`` elements (views excluded; a
    complex element counts as one): the passes an eager step makes over an activation."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, tuple | list) else (out,)
        big = any(isinstance(o, torch.Tensor) and o.numel() >= self.numel for o in outs)
        if big and not func.is_view:
            self.ops.append(func.__name__)
        return out


def _rms64(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _real_rope64(x, cos, sin):
    """(x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos) on pairs, in fp64."""
    c, s = cos[:T, None, :].double(), sin[:T, None, :].double()
    xf = x.double().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1).flatten(-2)


def _fwd_bwd(fn, x, *params):
    x = x.detach().clone().requires_grad_()
    ps = [p.detach().clone().requires_grad_() for p in params]
    y = fn(x, *ps)
    g = torch.linspace(-1, 1, y.numel(), dtype=torch.float64).reshape(y.shape)
    y.backward(g.to(y.dtype))
    return y, [x.grad, *[p.grad for p in ps]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_equals_its_fp64_formula_forward_and_backward(dtype):
    """y = x·r·w rounded once; dx and dw against autograd of the fp64 formula (bf16: within its
    rounding of y and dx; dw sums B·T products)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, WIDTH, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(WIDTH, generator=gen)).to(dtype)

    y, (dx, dw) = _fwd_bwd(lambda x, w: rms_norm(x, w, 1e-5), x, w)
    y64, (dx64, dw64) = _fwd_bwd(lambda x, w: _rms64(x, w, 1e-5), x.double(), w.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    assert_close(y.double(), y64, **tol)
    assert_close(dx.double(), dx64, **tol)
    assert_close(dw.double(), dw64, **(tol if dtype == torch.float32 else dict(rtol=2e-2, atol=0.05)))


def test_layernorm_equals_torch_in_fp64():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, WIDTH, generator=gen)
    w, b = 1 + 0.1 * torch.randn(WIDTH, generator=gen), 0.1 * torch.randn(WIDTH, generator=gen)

    def ref(x, w, b):
        return F.layer_norm(x.double(), (WIDTH,), w.double(), b.double(), 1e-5)

    y, grads = _fwd_bwd(lambda x, w, b: layer_norm(x, w, b, 1e-5), x, w, b)
    y64, grads64 = _fwd_bwd(ref, x.double(), w.double(), b.double())
    assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    for a, e in zip(grads, grads64, strict=True):
        assert_close(a.double(), e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_the_real_rotation(dtype):
    """The complex product equals the pairwise rotation in fp32 (exactly, as the same products and
    sums), and its backward is the inverse rotation of the gradient."""
    cos, sin = rope_tables(TABLES)
    x = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(2)).to(dtype)
    y, (gx,) = _fwd_bwd(lambda x: apply_rope(x, cos, sin), x)
    y64, (gx64,) = _fwd_bwd(lambda x: _real_rope64(x, cos, sin), x.double())
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    assert_close(y.double(), y64, **tol)
    assert_close(gx.double(), gx64, **tol)


def test_rope_and_norm_passes_and_saved_bytes_in_bf16():
    """Eager cost over a (B, T, heads, d) bf16 input: RoPE makes 3 passes forward (upcast, complex
    product, round) and 3 backward where the real form made 9 and 12, and saves only its tables;
    RMSNorm saves x (B_a per element) and 1/rms (4 per row), not x in fp32 nor x̂."""
    cos, sin = rope_tables(TABLES)
    x = torch.randn(B, T, H, D).bfloat16().requires_grad_()
    with PassCounter(x.numel() // 2) as fwd:  # the complex product: d/2 complex per head
        y = apply_rope(x, cos, sin)
    g = torch.ones_like(y)
    with PassCounter(x.numel() // 2) as bwd:
        y.backward(g)
    assert len(fwd.ops) == 3, fwd.ops
    assert len(bwd.ops) == 3, bwd.ops

    saved = []
    norm = RMSNorm(WIDTH).bfloat16()
    xn = torch.randn(B, T, WIDTH).bfloat16().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        apply_rope(x, cos, sin)
        norm(xn)
    activations = [
        t for t in saved if t.data_ptr() not in {cos.data_ptr(), sin.data_ptr(), norm.weight.data_ptr()}
    ]
    assert sorted((str(t.dtype), t.numel()) for t in activations) == [
        ("torch.bfloat16", xn.numel()),
        ("torch.float32", B * T),
    ]


def test_rope_under_compile_takes_the_real_form_with_the_same_values(monkeypatch):
    """Inductor generates no code for complex operators, so under ``torch.compile`` the rotation is
    the real form (fused by inductor); it equals the complex product, forward and backward."""
    cos, sin = rope_tables(TABLES)
    x = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(3))
    y, (gx,) = _fwd_bwd(lambda x: apply_rope(x, cos, sin), x)
    seen, complex_view = [], torch.view_as_complex
    monkeypatch.setattr(torch, "view_as_complex", lambda t: seen.append(t) or complex_view(t))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    y_real, (gx_real,) = _fwd_bwd(lambda x: apply_rope(x, cos, sin), x)
    assert not seen
    assert_close(y_real, y, rtol=1e-6, atol=1e-6)
    assert_close(gx_real, gx, rtol=1e-6, atol=1e-6)
