"""Mixed precision: half-precision weights and activations, fp32 master weights and optimizer state.

Policy (``train.precision`` = bf16 | fp16; the FSDP2 ``MixedPrecisionPolicy`` shape):

- parameters are cast to the half dtype *in the model* (buffers such as the RoPE tables stay
  fp32), so every matmul and every saved activation is half precision; RMSNorm statistics,
  RoPE rotation, softmax (inside the attention kernel), logits → loss and the gradient norm
  are computed in fp32;
- the optimizer keeps an fp32 master copy of the parameters and its state in fp32 (or 8-bit),
  updates the masters and copies them back into the half parameters (:mod:`loom.optim.flat`);
  with ZeRO the masters and the state are sharded like the state they belong to;
- gradients are produced in the half dtype, reduced in ``parallel.reduce_dtype`` (fp32 by
  default: cast up before the collective, the sum rounded back once);
- fp16 adds dynamic loss scaling (:mod:`loom.memory.loss_scale`); bf16 has fp32's exponent
  range and needs none.

Why not ``torch.autocast`` over fp32 parameters: autocast keeps 4-byte weights and gradients
and re-casts every weight at every forward; casting the model once is the layout whose memory
is the textbook's:

    bytes per rank = 2Φ_w + 2Φ_g + (4 + s)·Φ/N      s = optimizer state per element:
                                                    8 (adamw), 2 + 8/256 (adam8bit),
                                                    4(R + C)/(R·C) per matrix (adafactor)
    Φ_w = Φ/N with ZeRO-3 else Φ;   Φ_g = Φ/N with ZeRO-2/3 else Φ

i.e. 16 bytes per parameter for mixed-precision Adam without ZeRO (2 + 2 + 12), each Φ rounded
up per flat buffer as :mod:`loom.parallel.layout` says.

Without ZeRO (``parallel.zero = 0``) master weights still need an owner: the flat-buffer
machinery of ZeRO runs with a sharding group of one rank and every data-parallel rank a replica
(:func:`loom.train.build.data_parallel`).
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Parameters (not buffers) to ``dtype`` in place; the Parameter objects and their attributes
    (``tp_shard_dim``) stay, so every strategy applied afterwards sees the half parameters."""
    for p in model.parameters():
        if p.dtype != dtype:
            p.data = p.data.to(dtype)


def needs_master_path(cfg) -> bool:
    """Runs that need Loom's flat-shard optimizers even without ZeRO (half params or non-AdamW)."""
    return cfg.train.precision != "fp32" or cfg.train.optimizer != "adamw"


def state_bytes_formula(
    numels: list[int], precision: str, optimizer: str, zero: int, n: int, factored: int = 0
) -> dict[str, int]:
    """Bytes per rank of the module docstring for flat buffers of Φ_g' = ``numels`` (padded)
    elements each, sharded over ``n`` ranks (n = 1 without ZeRO).

    ``factored``: for adafactor, the bytes of its statistics on this rank (Σ 4(R + C) over the
    matrices it touches + 4 per vector element it holds), which no per-element rule gives.
    """
    e = 2 if precision != "fp32" else 4
    shard = [m // n for m in numels]
    state = {
        "adamw": sum(8 * s for s in shard),
        "adam8bit": sum(2 * s + 8 * -(-s // 256) for s in shard),
        "adafactor": factored,
    }[optimizer]
    masters = sum(4 * s for s in shard) if precision != "fp32" else 0
    total = sum(numels)
    return {
        "param_bytes": e * total // (n if zero == 3 else 1),
        "grad_bytes": e * total // (n if zero >= 2 else 1),
        "optim_bytes": state + masters,
    }
