"""Mixed precision: half-precision weights and activations, fp32 master weights and optimizer state.

Policy (``train.precision`` = bf16 | fp16 | fp8 | int8; the FSDP2 ``MixedPrecisionPolicy`` shape):

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

The other values of ``train.precision`` (their parameter dtype is :data:`loom.device.DTYPES`):

- ``auto``: bf16 on CUDA, fp32 on the CPU (resolved by ``config.validate``);
- ``tf32``: fp32 parameters and math, fp32 matmuls on TF32 tensor cores on CUDA (10-bit mantissa
  products, fp32 accumulation: H100 SXM 494.5 TFLOP/s dense against 67 in FP32); on the CPU exactly
  fp32. Memory as fp32 (no masters);
- ``fp8``: bf16 as above, and every Linear of the blocks (not the output head, not a router, not
  one whose dims are not multiples of 16) swapped for torchao's ``Float8Linear``
  (:func:`apply_low_precision`): each matmul casts its operands to float8 with a scale per tensor
  (``train.fp8_recipe = tensorwise``: e4m3 forward, e5m2 gradients) or per row (``rowwise``, e4m3
  throughout) and runs ``torch._scaled_mm`` (fp8 tensor cores, sm_89+; emulated on the CPU). With
  ``train.fp8_layers = auto`` (the default) only the Linears whose GEMM on a tensor-parallel rank is
  large enough for float8 to pay (:func:`fp8_pays`) are swapped, the others stay bf16; ``all`` swaps
  every target. The weights, gradients, masters and state are stored as in bf16, so the bytes are bf16's;
- ``int8``: bf16, and the same Linears run torchao's int8 mixed-precision matmuls (rowwise dynamic
  int8 quantization of both operands in forward and in both backward matmuls, int32 accumulation).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from loom.device import DTYPES
from loom.model.llama import Attention
from loom.model.moe import SharedExperts


@torch.no_grad()
def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Parameters (not buffers) to ``dtype`` in place; the Parameter objects and their attributes
    (``tp_shard_dim``) stay, so every strategy applied afterwards sees the half parameters."""
    for p in model.parameters():
        if p.dtype != dtype:
            p.data = p.data.to(dtype)


def half_parameters(precision: str) -> bool:
    """Whether parameters are stored in 2 bytes under ``precision`` (bf16, fp16, fp8, int8), with fp32 masters."""
    return DTYPES[precision] != torch.float32


def needs_master_path(cfg) -> bool:
    """Runs that need Loom's flat-shard optimizers even without ZeRO (half params or non-AdamW)."""
    return half_parameters(cfg.train.precision) or cfg.train.optimizer != "adamw"


COLUMN_PARALLEL = ("wq", "wk", "wv", "w1", "w3")  # leaf names whose output features tp cuts
ROW_PARALLEL = ("wo", "w2")  # leaf names whose input features tp cuts (loom.parallel.tensor)


def low_precision_target(fqn: str, module: nn.Module, tp: int = 1) -> bool:
    """The Linears whose matmuls fp8 / int8 can run (torchtitan's filter): the blocks' projections, not the
    output head or an MoE router (whose logits pick experts), and only where both dims are multiples of
    16·tp (float8 tensor-core tiles, torch._int_mm likewise, on every tensor-parallel shard)."""
    if type(module) is not nn.Linear or fqn.split(".")[-1] in ("output", "router"):
        return False
    return module.in_features % (16 * tp) == 0 and module.out_features % (16 * tp) == 0


def fp8_pays(in_features: float, out_features: float, recipe: str = "tensorwise") -> bool:
    """Whether a Linear's GEMMs run faster in float8 than in bf16 on an H100: with K = ``in_features``
    and N = ``out_features`` (the forward GEMM (M x K) @ (K x N), weight (N, K)), float8 does not pay

        tensorwise   where K <= 4096 and N <= 1024
        rowwise      where N <= 2048, or K <= 1024, or (N <= 4096 and K <= 2048)

    (there the amaxes and casts cost more than the faster matmul saves). Source: torchao's H100
    microbenchmarks of float8 training (torchao/float8/README.md, "Performance"), the thresholds as
    torchao 0.18's ``torchao.float8._auto_filter_for_recipe`` reads them (torchtitan's
    ``filter_fqns = ["auto_filter_small_kn"]``)."""
    K, N = in_features, out_features
    if recipe == "tensorwise":
        return not (K <= 4096 and N <= 1024)
    if recipe == "rowwise":
        return not (N <= 2048 or K <= 1024 or (N <= 4096 and K <= 2048))
    raise ValueError(f"fp8 recipe: must be tensorwise or rowwise, got {recipe!r}")


def runs_8bit(
    precision: str,
    in_features: float,
    out_features: float,
    fp8_recipe: str = "tensorwise",
    fp8_layers: str = "auto",
) -> bool:
    """Whether a target Linear whose GEMM on a rank has these features runs in 8 bits: every one under
    int8 and under fp8 with ``fp8_layers = all``; with ``auto`` only where :func:`fp8_pays`. The trainer's
    swap and the planner's pricing (:mod:`loom.plan.cost.compute`) both ask here."""
    if precision == "int8" or (precision == "fp8" and fp8_layers == "all"):
        return True
    return precision == "fp8" and fp8_pays(in_features, out_features, fp8_recipe)


def rank_features(model: nn.Module, fqn: str, module: nn.Linear, tp: int = 1) -> tuple[int, int]:
    """(in, out) features of the GEMM one tensor-parallel rank runs for the Linear ``fqn`` of ``model``:
    column-parallel layers (:data:`COLUMN_PARALLEL`) out/tp, row-parallel ones (:data:`ROW_PARALLEL`)
    in/tp; key/value heads replicated over tp (kv heads k, tp % k == 0, k < tp) one head each; an MoE's
    shared experts (replicated over tp) whole."""
    i, o = module.in_features, module.out_features
    parent_name, _, leaf = fqn.rpartition(".")
    parent = model.get_submodule(parent_name)
    if tp == 1 or isinstance(parent, SharedExperts):
        return i, o
    if leaf in ("wk", "wv") and isinstance(parent, Attention) and parent.n_kv_heads % tp:
        return i, parent.head_dim
    if leaf in COLUMN_PARALLEL:
        return i, o // tp
    if leaf in ROW_PARALLEL:
        return i // tp, o
    return i, o


def low_precision_split(
    model: nn.Module, precision: str, fp8_recipe: str = "tensorwise", fp8_layers: str = "auto", tp: int = 1
) -> tuple[list[str], list[str]]:
    """(the :func:`low_precision_target` Linears that run in 8 bits, those left in bf16 as too small for
    float8 to pay under ``fp8_layers = auto``), by name; both empty unless ``precision`` is fp8 / int8."""
    if precision not in ("fp8", "int8"):
        return [], []
    eight: list[str] = []
    kept: list[str] = []
    for fqn, mod in model.named_modules():
        if low_precision_target(fqn, mod, tp):
            i, o = rank_features(model, fqn, cast(nn.Linear, mod), tp)
            (eight if runs_8bit(precision, i, o, fp8_recipe, fp8_layers) else kept).append(fqn)
    return eight, kept


def apply_low_precision(
    model: nn.Module, precision: str, fp8_recipe: str = "tensorwise", tp: int = 1, fp8_layers: str = "auto"
) -> int:
    """Swap the Linears of ``model`` that :func:`low_precision_split` puts in 8 bits for torchao's float8
    (``fp8``) or int8 mixed-precision (``int8``) training Linears, keeping their Parameter objects (a
    model on the meta device stays there); nothing for any other precision. Returns how many were
    swapped. Under tensor parallelism (``tp`` > 1) the row/column layers made from them run the same
    GEMMs on their shards (:mod:`loom.memory.lowp_gemm`)."""
    targets, _ = low_precision_split(model, precision, fp8_recipe, fp8_layers, tp)
    if not targets:
        return 0
    chosen = set(targets)
    if precision == "fp8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model,
            config=Float8LinearConfig.from_recipe_name(fp8_recipe),
            module_filter_fn=lambda mod, fqn: fqn in chosen,
        )
    else:
        from torchao import quantize_
        from torchao.prototype.quantized_training import Int8MixedPrecisionTrainingConfig

        # module swap (the class changes in place): the weight stays a plain Parameter for the flat buffers
        quantize_(
            model,
            Int8MixedPrecisionTrainingConfig(module_swap=True),
            filter_fn=lambda mod, fqn: fqn in chosen,
        )
    return len(targets)


def state_bytes_formula(
    numels: list[int], precision: str, optimizer: str, zero: int, n: int, factored: int = 0
) -> dict[str, int]:
    """Bytes per rank of the module docstring for flat buffers of Φ_g' = ``numels`` (padded)
    elements each, sharded over ``n`` ranks (n = 1 without ZeRO).

    ``factored``: for adafactor, the bytes of its statistics on this rank (Σ 4(R + C) over the
    matrices it touches + 4 per vector element it holds), which no per-element rule gives.
    """
    e = 2 if half_parameters(precision) else 4
    shard = [m // n for m in numels]
    state = {
        "adamw": sum(8 * s for s in shard),
        "adam8bit": sum(2 * s + 8 * -(-s // 256) for s in shard),
        "adafactor": factored,
    }[optimizer]
    masters = sum(4 * s for s in shard) if half_parameters(precision) else 0
    total = sum(numels)
    return {
        "param_bytes": e * total // (n if zero == 3 else 1),
        "grad_bytes": e * total // (n if zero >= 2 else 1),
        "optim_bytes": state + masters,
    }
