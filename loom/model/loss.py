"""Next-token cross-entropy over chunks of rows: no B·T·V tensor in fp32, or none at all.

Two autograd functions, both equal to ``F.cross_entropy(logits.float(), targets, ignore_index=-100,
reduction="sum")`` (a sum: the caller divides by the count of trained targets). N = B·T rows, V
vocabulary, h = dim, c rows per chunk, e bytes per element of the working dtype:

- :func:`chunked_cross_entropy` (logits (N, V) given, the model's output): per chunk torch's fp32
  log_softmax (its row kernel: a row rounds the same whatever the chunk or the layout) and the
  target's entry; saves only the logits (already alive as the model's output). Backward recomputes
  the chunk's log_softmax and writes softmax - onehot chunk by chunk into the (N, V) gradient, in the
  working dtype. Extra memory beyond the logits and their gradient: one chunk in fp32, c·V·4
  (forward's logsumexp and backward's softmax), where ``F.cross_entropy(logits.float())`` keeps an
  fp32 copy (bf16 logits) and an fp32 log-softmax, N·V·4 each, and an fp32 gradient.
- :func:`linear_cross_entropy` (h (N, h) and the head W (V, h) given): the logits never exist
  beyond one chunk. Forward per chunk: z = h_c Wᵀ (c, V) in the working dtype, lse and target
  logit in fp32; saves h, W (both alive anyway), targets and lse. Backward recomputes z per chunk,
  g = (softmax(z) - onehot)·grad (c, V), dh_c = g W, dW += gᵀ h_c (fp32 accumulation; in a
  low-precision dtype each chunk's fp32 product joins the sum, on CUDA from tensor cores). Peak extra
  memory: one chunk's logits, c·V·max(e, 4) bytes (c·V·(e + 4) in a low-precision dtype: z and its
  fp32 softmax), besides dh (N·h·e), dW (V·h·4; V·h·8 with a low-precision chunk's product) and a
  few fp32 vectors of N.

Rows whose target is ``ignore_index`` add 0 to the loss and get a zero gradient. No host sync:
chunks are cut by shape only, masks multiply rather than index.
"""

from __future__ import annotations

from typing import Any

import torch

IGNORE_INDEX = -100
CHUNK_ROWS = 1024  # rows per chunk: 1024·V·4 bytes in fp32 (512 MiB at V = 128k)


def _fp32(z: torch.Tensor, own: bool) -> tuple[torch.Tensor, bool]:
    """z in fp32, and whether it may be written in place (a fresh copy, or ``own``: z is ours)."""
    zf = z.float()
    return zf, own or zf is not z


def _target_logit_lse(
    z: torch.Tensor, targets: torch.Tensor, ignore_index: int, own: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 log-sum-exp (c,), the target's logit (c,) and the validity (c,) of one chunk z (c, V);
    ``own``: z may be overwritten (then no second (c, V) buffer is made)."""
    valid = targets != ignore_index
    zt = z.gather(1, torch.where(valid, targets, 0)[:, None])[:, 0].float()  # (c,)
    zf, inplace = _fp32(z, own)
    m = zf.amax(dim=-1, keepdim=True)  # (c, 1); finite: a row has finite logits
    e = zf.sub_(m) if inplace else zf - m  # (c, V) fp32: the chunk's one buffer
    lse = e.exp_().sum(dim=-1).log_() + m[:, 0]  # (c,)
    return lse, zt, valid


def _softmax_minus_onehot(
    z: torch.Tensor,
    lse: torch.Tensor,
    targets: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    own: bool,
) -> torch.Tensor:
    """(softmax(z) - onehot(target)) · scale per row, (c, V) fp32; a zero row where ignored."""
    valid = targets != ignore_index
    zf, inplace = _fp32(z, own)
    g = (zf.sub_(lse[:, None]) if inplace else zf - lse[:, None]).exp_()  # (c, V) fp32 softmax
    g.scatter_add_(1, torch.where(valid, targets, 0)[:, None], -torch.ones_like(lse)[:, None])
    return g.mul_((valid.to(g.dtype) * scale)[:, None])


def _log_softmax32(z: torch.Tensor) -> torch.Tensor:
    """log_softmax of a chunk (c, V) in fp32 (c, V): torch's row kernel, whose result for a row does not
    depend on how many rows the chunk has, so every layout's rows round alike. One (c, V) fp32 buffer:
    a low-precision chunk is cast once and normalised in place (``log_softmax(z, dtype=float32)``
    would keep the cast and its result, two)."""
    if z.dtype == torch.float32:
        return torch.log_softmax(z, dim=-1)  # z is a view of the logits: a new buffer
    zf = z.float()
    return torch._log_softmax(zf, -1, False, out=zf)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Σ over rows of -log_softmax(z_i)[target_i] from logits z (N, V), one chunk of rows at a time;
    backward recomputes each chunk's log_softmax (one fp32 chunk alive, nothing of (N, V) saved)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, chunk: int, ignore_index: int):
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for i in range(0, logits.shape[0], chunk):
            t = targets[i : i + chunk]
            valid = t != ignore_index
            lsm = _log_softmax32(logits[i : i + chunk])  # (c, V) fp32
            total -= (lsm.gather(1, torch.where(valid, t, 0)[:, None])[:, 0] * valid).sum()
            del lsm
        ctx.save_for_backward(logits, targets)
        ctx.chunk, ctx.ignore_index = chunk, ignore_index
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        logits, targets = ctx.saved_tensors
        out = torch.empty_like(logits)  # (N, V) in the logits' dtype
        c = ctx.chunk
        for i in range(0, logits.shape[0], c):
            t = targets[i : i + c]
            valid = t != ctx.ignore_index
            g = _log_softmax32(logits[i : i + c]).exp_()  # (c, V) fp32 softmax
            g.scatter_add_(1, torch.where(valid, t, 0)[:, None], -torch.ones_like(g[:, :1]))
            out[i : i + c] = g.mul_((valid.to(g.dtype) * grad)[:, None])
            del g
        return out, None, None, None


class _LinearCrossEntropy(torch.autograd.Function):
    """Σ over rows of the cross-entropy of z = h Wᵀ, computing z one chunk of rows at a time."""

    @staticmethod
    def forward(
        ctx: Any, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, ignore_index: int
    ):
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)  # (N,)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for i in range(0, h.shape[0], chunk):
            z = h[i : i + chunk] @ weight.t()  # (c, V) working dtype
            lse_c, zt, valid = _target_logit_lse(z, targets[i : i + chunk], ignore_index, own=True)
            del z
            lse[i : i + chunk] = lse_c
            total += ((lse_c - zt) * valid).sum()
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.chunk, ctx.ignore_index = chunk, ignore_index
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        h, weight, targets, lse = ctx.saved_tensors
        c = ctx.chunk
        dh = torch.empty_like(h) if ctx.needs_input_grad[0] else None  # (N, h)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # (V, h) fp32 sum
        for i in range(0, h.shape[0], c):
            hc = h[i : i + c]  # (c, h)
            z = hc @ weight.t()  # (c, V) recomputed
            g32 = _softmax_minus_onehot(z, lse[i : i + c], targets[i : i + c], grad, ctx.ignore_index, True)
            del z  # in fp32 g32 is z's own buffer
            g = g32.to(h.dtype)  # (c, V) working dtype; in fp32 the same tensor
            if dh is not None:
                torch.mm(g, weight, out=dh[i : i + c])  # (c, h)
            if g.dtype == torch.float32:
                dw.addmm_(g32.t(), hc)  # (V, h) in place
            else:  # an fp32 product (V, h) joins the sum: on CUDA from tensor cores (an fp32 GEMM is 15x slower)
                product = torch.mm(g.t(), hc, out_dtype=torch.float32) if g.is_cuda else g32.t() @ hc.float()
                dw.add_(product)
                del product
            del g32, g  # before the next chunk's logits: one chunk alive at a time
        return dh, dw.to(weight.dtype), None, None, None


def chunked_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    chunk_rows: int = CHUNK_ROWS,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Summed cross-entropy of logits (..., V) against targets (...), ``chunk_rows`` rows at a time."""
    return _ChunkedCrossEntropy.apply(logits.flatten(0, -2), targets.flatten(), chunk_rows, ignore_index)


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_rows: int = CHUNK_ROWS,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Summed cross-entropy of the logits h Wᵀ (h (..., h), W (V, h)) against targets (...),
    never holding more than ``chunk_rows`` rows of logits."""
    return _LinearCrossEntropy.apply(h.flatten(0, -2), weight, targets.flatten(), chunk_rows, ignore_index)
