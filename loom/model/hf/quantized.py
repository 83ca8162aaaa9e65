"""Checkpoints whose linear weights are stored in 8-bit floats with scales, dequantized as they are
read: transformers' fine-grained FP8 (``quant_method = "fp8"``: Qwen3's and DeepSeek's ``-FP8``
releases; ``weight`` in float8 e4m3 beside ``weight_scale_inv``, one float per block of
``weight_block_size`` rows × columns) and compressed-tensors' float-quantized FP8
(``quant_method = "compressed-tensors"``, ``format = "float-quantized"``: the ``-FP8`` /
``-FP8-dynamic`` models of llm-compressor; ``weight_scale`` per tensor, per output channel or per
block). A weight is its codes times the scale of its block,

    W[i, j] = q[i, j] · s[i // b₀, j // b₁]

with the block b₀ × b₁ the config states (``weight_block_size``, ``block_structure``: a partial
last block allowed, which transformers refuses) or read from the scale's shape, b₀ = ceil(rows /
scale rows), b₁ = ceil(cols / scale cols) (a per-channel (rows, 1) scale: b₁ = cols; per tensor:
the whole weight). A box of W costs the box of codes and the scale
rows and columns that cover it (a per-tensor or per-channel scale whole: a few bytes): a
tensor-parallel rank still reads only its part. The model is the
full-precision one: Loom trains and exports it in its own precision (the export's config.json
carries no ``quantization_config``). Other methods (GPTQ, AWQ, bitsandbytes, MXFP4, int8
compressed-tensors) stay refused in one line: their codes need kernels of their own.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from loom.model.hf.families import CONFIG, HFError

FP8_DTYPES = ("F8_E4M3", "F8_E5M2")  # safetensors' names of the codes' dtypes
# per method: the scale tensor's suffix after the weight's name, and the metadata tensors not read
SCALE_SUFFIX = {"fp8": "_scale_inv", "compressed-tensors": "_scale"}
METADATA = (".weight_scale_inv", ".weight_scale", ".input_scale")


def scale_suffix(raw: dict) -> str:
    """The suffix of the scale beside each quantized weight (``weight`` + it) for ``config.json`` ``raw``;
    "" when the checkpoint is not quantized. A method or format Loom cannot dequantize raises one line
    naming it."""
    quant = raw.get("quantization_config")
    if not quant:
        return ""
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
    if method == "fp8" and isinstance(quant, dict):
        block = quant.get("weight_block_size")
        if block is not None and not (
            isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise HFError(
                f"{CONFIG}: quantization_config.weight_block_size = {json.dumps(block)}: want two integers > 0"
            )
        return SCALE_SUFFIX[method]
    if method == "compressed-tensors" and isinstance(quant, dict) and _fp8_weights(quant):
        return SCALE_SUFFIX[method]
    raise HFError(
        f"{CONFIG}: quantization_config (quant_method = {method!r}) is not supported: Loom dequantizes "
        "fp8 (weight_scale_inv) and compressed-tensors' float-quantized fp8 weights as it reads them; "
        "dequantize other methods first (e.g. save the model in bfloat16)"
    )


def weight_block(raw: dict) -> tuple[int, int] | None:
    """The (rows, cols) of a scale's block the config states (fp8's ``weight_block_size``,
    compressed-tensors' block ``block_structure``); None: read it from each scale's shape (per tensor
    or channel; a partial last block is told apart only by the stated size)."""
    quant = raw.get("quantization_config") or {}
    block = quant.get("weight_block_size")
    if block is None:
        groups = quant.get("config_groups") or {}
        found = [g.get("weights", {}).get("block_structure") for g in groups.values() if isinstance(g, dict)]
        block = next((b for b in found if b), None)
    return (int(block[0]), int(block[1])) if isinstance(block, list) and len(block) == 2 else None


def _fp8_weights(quant: dict) -> bool:
    """compressed-tensors: float-quantized, every group's weights 8-bit floats (per tensor, channel or
    block; no group-wise scales, no zero points)."""
    groups = quant.get("config_groups")
    if quant.get("format") != "float-quantized" or not isinstance(groups, dict) or not groups:
        return False
    for group in groups.values():
        w = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(w, dict) or (w.get("num_bits"), w.get("type")) != (8, "float"):
            return False
        if w.get("strategy") not in ("tensor", "channel", "block") or w.get("symmetric") is False:
            return False
    return True


def check_scale(
    file: Path, name: str, shape: tuple[int, ...], scale: tuple[int, ...], block: tuple[int, int] | None
) -> None:
    """The scale of weight ``name`` (``shape``) tiles it: a (rows, cols) grid of blocks (per tensor or
    channel its degenerate cases), and the config's block (:func:`weight_block`) where given; else one line."""
    grid = _grid(scale)
    if len(shape) != 2 or grid is None or any(n > m for n, m in zip(grid, shape, strict=True)):
        raise HFError(
            f"{file}: {name} is stored in 8-bit floats with a scale of shape {scale}, which does not tile {shape}"
        )
    if block is not None and grid != tuple(math.ceil(m / b) for m, b in zip(shape, block, strict=True)):
        raise HFError(
            f"{file}: {name}'s scale has shape {scale}; weight_block_size {list(block)} over {shape} implies "
            f"{tuple(math.ceil(m / b) for m, b in zip(shape, block, strict=True))}"
        )


def _grid(scale: tuple[int, ...]) -> tuple[int, int] | None:
    """The scale as a (rows, cols) grid: () or (1,) one block, (n,) or (n, 1) one per row block."""
    if len(scale) == 0:
        return 1, 1
    if len(scale) == 1:
        return scale[0], 1
    return (scale[0], scale[1]) if len(scale) == 2 else None


def dequantize(
    codes: torch.Tensor,
    scale,
    shape: tuple[int, ...],
    rows: slice,
    cols: slice,
    block: tuple[int, int] | None,
) -> torch.Tensor:
    """The box ``rows`` × ``cols`` of W (module formula) in float32 from its ``codes`` (that box) and
    the weight's ``scale`` (a safetensors slice, or a tensor), W of ``shape``, blocks of ``block``
    (None: read from the scale's shape)."""
    stored = tuple(scale.get_shape()) if hasattr(scale, "get_shape") else tuple(scale.shape)
    s0, s1 = _grid(stored) or (1, 1)
    b0, b1 = math.ceil(shape[0] / s0), math.ceil(shape[1] / s1)
    if block is not None and len(stored) == 2:
        b0, b1 = block
    g0, g1 = rows.start // b0, cols.start // b1  # the first block the box touches
    e0, e1 = -(-rows.stop // b0), -(-cols.stop // b1)
    if len(stored) == 2:  # only the blocks over the box
        grid = scale[g0:e0, g1:e1].float()
    else:  # one number, or one per row block: small
        grid = (scale[...] if len(stored) == 0 else scale[:]).reshape(s0, s1)[g0:e0, g1:e1].float()
    tiles = grid.repeat_interleave(b0, 0).repeat_interleave(b1, 1)
    r, c = rows.start - g0 * b0, cols.start - g1 * b1
    return codes.float() * tiles[r : r + codes.shape[0], c : c + codes.shape[1]]
