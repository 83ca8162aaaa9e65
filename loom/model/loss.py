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
  beyond one chunk. Forward per chunk: z = h_c Wᵀ (c, V) in the working dtype, its fp32
  log_softmax (the row kernel, in z's buffer in fp32) and the target's entry; saves h, W (both alive
  anyway) and targets. Backward recomputes z per chunk and its softmax by the row kernel,
  g = (softmax(z) - onehot)·grad (c, V), dh_c = g W, dW += gᵀ h_c (fp32 accumulation; in a
  low-precision dtype each chunk's fp32 product joins the sum, on CUDA from tensor cores). Peak extra
  memory: one chunk's logits, c·V·max(e, 4) bytes (c·V·(e + 4) in a low-precision dtype: z and its
  fp32 softmax), besides dh (N·h·e), dW (V·h·4; V·h·8 with a low-precision chunk's product) and a
  few fp32 vectors of N. With a logit cap k (``model.logit_softcap``, :mod:`loom.model.softcap`)
  each chunk's z is capped in place, y = k·tanh(z/k), before its log_softmax, and backward scales
  g by the slope 1 - (y/k)², formed in y's buffer: both directions hold c·V·(e + 4) bytes at most
  (in fp32 too, where backward's softmax then needs a buffer beside y).

Kernels over a chunk's c·V elements (memory-bound), bf16 on CUDA: forward a cast and an in-place
log_softmax; backward a cast, an in-place softmax and one multiply that scales and casts back: 5,
where the max / subtract / exp / sum chain and its backward (subtract, exp, multiply, cast) ran 10
(an H100 profile of gpt-125m: exp and subtract alone took 40 of ~390 ms of a step's device time).
A logit cap adds 3 in-place kernels to each direction (divide, tanh, multiply) and 5 to backward
(the slope's 4 and its multiply into g).

Rows whose target is ``ignore_index`` add 0 to the loss and get a zero gradient. No host sync:
chunks are cut by shape only, masks multiply rather than index.
"""

from __future__ import annotations

from typing import Any

import torch

from loom.model.softcap import cap_slope, cap_values

IGNORE_INDEX = -100
CHUNK_ROWS = 1024  # rows per chunk: 1024·V·4 bytes in fp32 (512 MiB at V = 128k)


def _log_softmax32(z: torch.Tensor, own: bool = False) -> torch.Tensor:
    """log_softmax of a chunk (c, V) in fp32 (c, V): torch's row kernel, whose result for a row does not
    depend on how many rows the chunk has, so every layout's rows round alike. One (c, V) fp32 buffer:
    a low-precision chunk is cast once and normalised in place (``log_softmax(z, dtype=float32)``
    would keep the cast and its result, two); an fp32 chunk in place when ``own`` (z is ours)."""
    zf = z.float()
    if zf is z and not own:
        return torch.log_softmax(z, dim=-1)  # z is a view of the logits: a new buffer
    return torch._log_softmax(zf, -1, False, out=zf)


def _softmax32(z: torch.Tensor, own: bool = False) -> torch.Tensor:
    """softmax of a chunk (c, V) in fp32, as :func:`_log_softmax32`: the row kernel, one fp32 buffer."""
    zf = z.float()
    if zf is z and not own:
        return torch.softmax(z, dim=-1)
    return torch._softmax(zf, -1, False, out=zf)


def _capped(z: torch.Tensor, cap: float) -> torch.Tensor:
    """A chunk's logits z (c, V), ours, capped in place: cap·tanh(z/cap) (:mod:`loom.model.softcap`),
    or as they are when ``cap`` is 0."""
    return cap_values(z, cap, out=z) if cap else z


def _minus_onehot(p: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """p (c, V) - onehot(targets), in place; an ignored row keeps p (the caller's scale zeroes it)."""
    valid = targets != ignore_index
    p.scatter_add_(1, torch.where(valid, targets, 0)[:, None], -valid.to(p.dtype)[:, None])
    return p


def _row_scale(targets: torch.Tensor, scale: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """(c, 1): ``scale`` for a trained row, 0 for an ignored one."""
    return ((targets != ignore_index).to(torch.float32) * scale)[:, None]


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
            g = _minus_onehot(_softmax32(logits[i : i + c]), t, ctx.ignore_index)  # (c, V) fp32
            torch.mul(g, _row_scale(t, grad, ctx.ignore_index), out=out[i : i + c])  # scaled and cast at once
            del g
        return out, None, None, None


class _LinearCrossEntropy(torch.autograd.Function):
    """Σ over rows of the cross-entropy of z = h Wᵀ, computing z one chunk of rows at a time."""

    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
        ignore_index: int,
        cap: float,
    ):
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for i in range(0, h.shape[0], chunk):
            t = targets[i : i + chunk]
            valid = t != ignore_index
            z = _capped(h[i : i + chunk] @ weight.t(), cap)  # (c, V) logits, capped in place
            lsm = _log_softmax32(z, own=True)  # (c, V) fp32, the logits' buffer
            total -= (lsm.gather(1, torch.where(valid, t, 0)[:, None])[:, 0] * valid).sum()
            del z, lsm
        ctx.save_for_backward(h, weight, targets)
        ctx.chunk, ctx.ignore_index, ctx.cap = chunk, ignore_index, cap
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        h, weight, targets = ctx.saved_tensors
        c, cap = ctx.chunk, ctx.cap
        dh = torch.empty_like(h) if ctx.needs_input_grad[0] else None  # (N, h)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # (V, h) fp32 sum
        for i in range(0, h.shape[0], c):
            hc, t = h[i : i + c], targets[i : i + c]  # (c, h), (c,)
            y = _capped(hc @ weight.t(), cap)  # (c, V) logits, capped in place
            g32 = _minus_onehot(_softmax32(y, own=not cap), t, ctx.ignore_index)  # (c, V) fp32
            if cap:  # dz = dy · (1 - (y/cap)²), the slope formed in y's buffer, which then goes
                g32.mul_(cap_slope(y, cap, out=y))
            del y
            scale = _row_scale(t, grad, ctx.ignore_index)
            if h.dtype == torch.float32:
                g = g32.mul_(scale)
            elif g32.is_cuda:  # scaled and cast in one pass; the fp32 chunk goes before dW's product
                g = torch.mul(g32, scale, out=torch.empty(g32.shape, dtype=h.dtype, device=h.device))
                g32 = g  # (frees the fp32 chunk)
            else:
                g = g32.mul_(scale).to(h.dtype)  # (g32 kept: the CPU's dW product is fp32 x fp32)
            if dh is not None:
                torch.mm(g, weight, out=dh[i : i + c])  # (c, h)
            if h.dtype == torch.float32:
                dw.addmm_(g.t(), hc)  # (V, h) in place
            else:  # an fp32 product (V, h) joins the sum: on CUDA from tensor cores (an fp32 GEMM is 15x slower)
                product = torch.mm(g.t(), hc, out_dtype=torch.float32) if g.is_cuda else g32.t() @ hc.float()
                dw.add_(product)
                del product
            del g, g32  # before the next chunk's logits: one chunk alive at a time
        return dh, dw.to(weight.dtype), None, None, None, None


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
    cap: float = 0.0,
) -> torch.Tensor:
    """Summed cross-entropy of the logits h Wᵀ (h (..., h), W (V, h)) against targets (...),
    never holding more than ``chunk_rows`` rows of logits; ``cap`` > 0: of the capped logits
    cap·tanh(h Wᵀ / cap) (:mod:`loom.model.softcap`), chunk by chunk."""
    return _LinearCrossEntropy.apply(
        h.flatten(0, -2), weight, targets.flatten(), chunk_rows, ignore_index, cap
    )
