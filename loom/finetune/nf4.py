"""4-bit NormalFloat (NF4) storage of frozen base weights, for QLoRA (Dettmers et al. 2023).

A weight of n elements (flattened) is cut into blocks of 64. Block j keeps its absmax s_j, and
each element x the index of the nearest of the 16 NF4 levels q_k (quantiles of N(0, 1) scaled to
[-1, 1]) to x / s_j: 4 bits, two per byte. The absmaxes are double-quantized: their mean μ is
subtracted and each group of 256 is stored as int8 round(c_g·(s_j - μ)) with one fp32 factor
c_g = 256 / (2·max_g |s_j - μ|) per group. Dequantized per use: x̂ = q_k · (int8_j / c_g + μ).

Bytes per base weight of n elements (the formula ``nf4_bytes`` and the test measure):

    n/2 (codes) + n/64 (int8 absmax) + 4·ceil(n/(64·256)) (fp32 factors) + 4 (μ)
    ≈ 0.5 + 1/64 + 1/4096 = 0.51587 bytes per parameter (vs 2 in bf16, 4 in fp32)

The linear layer :class:`NF4Linear` dequantizes W in its forward and again in its backward (for
dx = dy·W), saving only the 4-bit form for backward: no whole-precision copy of W outlives a use.

Why our own, not a library: torchao 0.18's ``NF4Tensor`` (``to_nf4``) runs on CPU with torch 2.13
and is the reference of the test (the same levels, blocks and double quantization, bit for bit),
but it asks n to be a multiple of 64·256 (no partial group of absmaxes: most weights of a small
model fail), is a tensor subclass that Loom's flat ZeRO buffers, meta-device materialization and
checkpoints would each have to special-case, and importing it tries to load CUDA kernels. The
format is 60 lines; plain uint8/int8/fp32 buffers compose with everything else. bitsandbytes'
CPU path was not needed.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd import Function

from loom.config import NF4_BLOCK

GROUP = 256  # absmaxes per double-quantization group
LEVELS = (
    -1.0,
    -0.6962,
    -0.5251,
    -0.3949,
    -0.2844,
    -0.1848,
    -0.0911,
    0.0,
    0.0796,
    0.1609,
    0.2461,
    0.3379,
    0.4407,
    0.5626,
    0.7230,
    1.0,
)  # the NF4 levels (QLoRA, as torchao and bitsandbytes)


def nf4_bytes(numel: int) -> int:
    """Bytes NF4 keeps for a weight of ``numel`` elements (module docstring)."""
    blocks = numel // NF4_BLOCK
    return numel // 2 + blocks + 4 * (-(-blocks // GROUP)) + 4


@torch.no_grad()
def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """``w`` -> its NF4 buffers: codes (n/2 uint8), absmax (n/64 int8), factor (fp32 per group), mean."""
    flat = w.detach().float().flatten()
    if flat.numel() % NF4_BLOCK:
        raise ValueError(f"NF4: {flat.numel()} elements is not a multiple of {NF4_BLOCK}")
    blocks = flat.view(-1, NF4_BLOCK)
    absmax = blocks.abs().amax(dim=1)  # (n/64,)
    levels = torch.tensor(LEVELS, dtype=torch.float32, device=flat.device)
    scaled = (blocks / absmax.clamp(min=torch.finfo(torch.float32).tiny)[:, None]).flatten()
    codes = torch.empty(flat.numel(), dtype=torch.uint8, device=flat.device)
    for i in range(0, flat.numel(), 1 << 20):  # nearest level, a chunk at a time: (chunk, 16) distances
        part = scaled[i : i + (1 << 20)]
        codes[i : i + part.numel()] = (part[:, None] - levels).abs().argmin(dim=1).to(torch.uint8)
    mean = absmax.mean()
    centred = absmax - mean
    pad = -centred.numel() % GROUP
    groups = torch.cat((centred, centred.new_zeros(pad))).view(-1, GROUP)
    factor = 256 / (2 * groups.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny))  # (groups,)
    q = (groups * factor[:, None]).round().clamp(-128, 127).to(torch.int8).flatten()[: centred.numel()]
    return {"codes": codes[::2] << 4 | codes[1::2], "absmax": q, "factor": factor, "mean": mean.reshape(1)}


def dequantize(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    factor: torch.Tensor,
    mean: torch.Tensor,
    shape: torch.Size | tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """The weight of ``shape`` back from its NF4 buffers, in ``dtype``."""
    levels = torch.tensor(LEVELS, dtype=torch.float32, device=codes.device)
    idx = torch.stack(((codes >> 4), (codes & 0xF)), dim=1).flatten().long()  # (n,)
    scale = absmax.float() / factor.repeat_interleave(GROUP)[: absmax.numel()] + mean  # (n/64,)
    return (levels[idx].view(-1, NF4_BLOCK) * scale[:, None]).view(shape).to(dtype)


def as_trained(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight a QLoRA run computes with for the base weight ``w``, in fp32: Ŵ = dequantize(
    quantize(w in ``dtype``)), ``dtype`` the run's parameter dtype (its base weights are cast to it
    before they are quantized). A merge W + (α/r)·B A must start from Ŵ, not W, to be the model the
    run trained and evaluated."""
    q = quantize(w.to(dtype))
    return dequantize(q["codes"], q["absmax"], q["factor"], q["mean"], tuple(w.shape), torch.float32)


class _NF4Matmul(Function):
    """y = x Ŵᵀ with Ŵ dequantized in forward and again in backward (dx = dy Ŵ); Ŵ is frozen."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: NF4Weight) -> torch.Tensor:
        ctx.weight = weight
        return x @ weight.dequantized(x.dtype).t()

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return dy @ ctx.weight.dequantized(dy.dtype), None


class NF4Weight(nn.Module):
    """A frozen weight held in NF4: four frozen parameters (codes uint8, absmax int8, factor and mean
    fp32), so data parallelism leaves them out and ZeRO-3 shards and gathers them with their unit like
    any frozen weight; checkpoints skip them (the base is referenced, not saved). Called as a linear
    layer: ``weight(x, bias)`` = x Ŵᵀ + b."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.shape = tuple(w.shape)
        for name, t in quantize(w).items():
            setattr(self, name, nn.Parameter(t, requires_grad=False))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.codes, self.absmax, self.factor, self.mean, self.shape, dtype)  # type: ignore[arg-type]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.parameters())

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = _NF4Matmul.apply(x, self)
        return y if bias is None else y + bias
