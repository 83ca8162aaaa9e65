"""LoRA: a frozen base linear layer plus a trained low-rank update (Hu et al. 2021).

For a target W (d_out, d_in) with bias b, rank r, alpha α and dropout p:

    y = x Wᵀ + b + (α/r) · B(A(dropout_p(x)))        A: (r, d_in), B: (d_out, r)

W and b are frozen (``requires_grad`` False: no gradient, no optimizer state, no gradient buffer
in any data-parallel strategy); A and B train, r·(d_in + d_out) parameters per target. Init as
PEFT's: A ~ U(-1/sqrt(d_in), 1/sqrt(d_in)) (kaiming-uniform with a = sqrt(5)), B = 0, so the
adapted model starts equal to the base. A's values come from a generator keyed by the seed and
the parameter's name (:func:`lora_init_value`), like the base init of :mod:`loom.model.llama`, so
they do not depend on the layout; each rank materializes only its box of them.

Targets (``finetune.lora_targets``): ``q, k, v, o`` (attention.w{q,k,v,o}), ``w1, w2, w3``
(feed_forward.w*), or ``all-linear`` (every one the model has; never the output head or the
embeddings, as PEFT's all-linear). Names: the adapters of ``layers.0.attention.wq`` are
``layers.0.attention.wq.lora_A.weight`` and ``...lora_B.weight`` (PEFT's names, less its
adapter name); the base keeps its own names.

Tensor parallelism (:mod:`loom.parallel.tensor.lora`) splits the adapters as the layer it wraps:
column-parallel (q, k, v, w1, w3): B along d_out with W's rows, A whole; row-parallel (o, w2): A
along d_in with W's columns, B whole. Each adds one collective of (B, T, r) values per pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from loom.config import NF4_BLOCK, TARGET_NAMES, FinetuneConfig, LoomConfig, lora_targets
from loom.device import DTYPES, resolve_precision
from loom.finetune.nf4 import NF4Weight, nf4_bytes
from loom.model.llama import _param_seed

LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
Source = Callable[[str, tuple[int, ...], tuple[slice, ...]], torch.Tensor]


def is_adapter(name: str) -> bool:
    """Whether the parameter ``name`` is a LoRA adapter (A or B)."""
    return name.endswith(LORA_SUFFIXES)


def lora_init_value(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The initial fp32 value of the whole adapter ``name``: A ~ U(-1/sqrt(d_in), 1/sqrt(d_in)) from
    its own generator (seed, name); B = 0."""
    if name.endswith(".lora_B.weight"):
        return torch.zeros(shape)
    g = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.rand(shape, generator=g, dtype=torch.float32).mul_(2 * bound).sub_(bound)


def lora_source(base: Source, seed: int) -> Source:
    """``base`` for the base weights, :func:`lora_init_value` (cut to the box) for the adapters."""

    def source(name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> torch.Tensor:
        if is_adapter(name):
            return lora_init_value(seed, name, shape)[index]
        return base(name, shape, index)

    return source


def add_adapters(module: nn.Module, d_in: int, d_out: int, cfg: FinetuneConfig) -> None:
    """Register ``lora_A`` (r, d_in) and ``lora_B`` (d_out, r) on ``module`` (on the meta device: they
    are materialized with the rest of the model), its scale α/r and dropout."""
    a = nn.Linear(d_in, cfg.lora_rank, bias=False, device="meta")
    b = nn.Linear(cfg.lora_rank, d_out, bias=False, device="meta")
    set_adapters(module, a.weight, b.weight, cfg.lora_alpha / cfg.lora_rank, cfg.lora_dropout)


def set_adapters(module: nn.Module, a: torch.Tensor, b: torch.Tensor, scale: float, dropout: float) -> None:
    """``module.lora_A.weight = a``, ``module.lora_B.weight = b`` (PEFT's names), its scale and dropout."""
    for name, w in (("lora_A", a), ("lora_B", b)):
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        lin.weight = cast(nn.Parameter, w)
        setattr(module, name, lin)
    setattr(module, "lora_scale", scale)  # noqa: B010 - plain attributes on a Module (typed for tensors)
    setattr(module, "lora_dropout", dropout)  # noqa: B010


def adapter_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """(A, B, α/r, dropout) of a module with adapters."""
    a, b = cast(nn.Linear, module.lora_A), cast(nn.Linear, module.lora_B)
    return (
        a.weight,
        b.weight,
        float(cast(float, module.lora_scale)),
        float(getattr(module, "lora_dropout", 0.0)),
    )


def lora_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A(dropout(x)): (.., d_in) -> (.., r)."""
    a, _, _, p = adapter_weights(module)
    if p > 0 and module.training:
        x = F.dropout(x, p, training=True)
    return F.linear(x, a)


def lora_output(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """(α/r) · B h: (.., r) -> (.., d_out)."""
    _, b, scale, _ = adapter_weights(module)
    return F.linear(h, b) * scale


def has_adapters(module: nn.Module) -> bool:
    return isinstance(getattr(module, "lora_A", None), nn.Linear)


class LoRALinear(nn.Linear):
    """A frozen ``nn.Linear`` (the same weight and bias Parameters, names unchanged) with adapters:
    y = x Wᵀ + b + (α/r)·B(A(dropout(x))). With QLoRA the weight is an NF4 buffer instead
    (:mod:`loom.finetune.nf4`), dequantized per use."""

    def __init__(self, base: nn.Linear, cfg: FinetuneConfig) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = cast(nn.Parameter, base.weight.requires_grad_(False))
        self.bias = None if base.bias is None else cast(nn.Parameter, base.bias.requires_grad_(False))
        self.nf4: NF4Weight | None = None  # QLoRA: the quantized weight (then ``weight`` is gone)
        add_adapters(self, base.in_features, base.out_features, cfg)

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nf4 is not None:
            return self.nf4(x, self.bias)
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_forward(x) + lora_output(self, lora_input(self, x))


@torch.no_grad()
def quantize_base(model: nn.Module, materialize: Callable[[nn.Module], None] | None = None) -> int:
    """Replace the frozen weight of every :class:`LoRALinear` of ``model`` by its NF4 form
    (:class:`~loom.finetune.nf4.NF4Weight`), one weight at a time (``materialize(linear)`` first
    gives a meta weight its values, so at most one full-precision target weight exists at once);
    returns the bytes of NF4 storage."""
    total = 0
    for name, mod in model.named_modules():
        if isinstance(mod, LoRALinear) and mod.nf4 is None:
            if materialize is not None:
                materialize(mod)
            if mod.weight.numel() % NF4_BLOCK:
                raise ValueError(
                    f"finetune.method: qlora cannot quantize {name}.weight ({mod.weight.numel()} "
                    f"elements, not a multiple of {NF4_BLOCK})"
                )
            nf4 = NF4Weight(mod.weight)
            del mod.weight
            mod.nf4 = nf4
            total += nf4.nbytes
    return total


def target_modules(model: nn.Module, targets: tuple[str, ...]) -> Iterator[tuple[str, nn.Module, str]]:
    """(module name, module, target) of every linear the targets name, block by block."""
    layers = getattr(model, "layers", ())
    blocks = layers.items() if isinstance(layers, nn.ModuleDict) else enumerate(layers)
    for i, block in blocks:
        modules = dict(block.named_modules())
        for t in targets:
            mod = modules.get(TARGET_NAMES[t])
            if isinstance(mod, nn.Linear):  # a MoE layer's w1/w2/w3 are expert stacks, not linears
                yield f"layers.{i}.{TARGET_NAMES[t]}", mod, t


def apply_lora(model: nn.Module, *, targets: tuple[str, ...], finetune: FinetuneConfig) -> list[str]:
    """Freeze every parameter of ``model`` and wrap each linear of ``targets`` (resolved and checked by
    :func:`loom.config.lora_targets`) in a :class:`LoRALinear` of ``finetune``'s rank, alpha and
    dropout (before any parallel dimension cuts the model); returns the wrapped modules' names."""
    for p in model.parameters():
        p.requires_grad_(False)
    done = []
    for name, mod, _ in list(target_modules(model, targets)):
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, LoRALinear(mod, finetune))  # type: ignore[arg-type]
        done.append(name)
    return done


def adapter_numel(cfg: LoomConfig) -> int:
    """Trained parameters: Σ over targets r·(d_in + d_out), over all layers."""
    from loom.config import target_shapes

    shapes = target_shapes(cfg.model)
    per_layer = sum(cfg.finetune.lora_rank * sum(shapes[t]) for t in lora_targets(cfg))
    return cfg.model.n_layers * per_layer


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + (α/r)·B A, in fp32 then cast back to W's dtype."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)


def state_bytes_formula(cfg: LoomConfig, n: int = 1) -> dict[str, float]:
    """Bytes one rank holds between steps in a LoRA/QLoRA run with AdamW, no tp/pp, over a sharding
    group of ``n`` ranks (ZeRO ``parallel.zero``; n = 1 without), before the flat buffers' padding:

        Φ_A adapters, e bytes per element (2 in bf16/fp16, 4 in fp32), Φ_B the frozen base
        param_bytes   e·Φ_A            (ZeRO-3: /n)
        grad_bytes    e·Φ_A            (ZeRO-2, 3: /n)
        optim_bytes   (8 + 4·mixed)·Φ_A  (ZeRO-1, 2, 3: /n)   moments, and fp32 masters when mixed
        frozen_bytes  e·Φ_B            (ZeRO-3: /n); QLoRA: each target's e·n_t replaced by its NF4 bytes

    The rest of a full fine-tune's 16 bytes per parameter (mixed) is gone: the base costs e·Φ_B."""
    from loom.config import target_shapes
    from loom.model.llama import build_model, count_params

    precision = resolve_precision(cfg.train.precision, cfg.run.device)
    zero, mixed = cfg.parallel.zero, DTYPES[precision] != torch.float32  # tf32 stores fp32
    e = 2 if mixed else 4
    adapters = adapter_numel(cfg)
    base = count_params(build_model(cfg.model, cfg.train.seed, meta=True, moe=cfg.moe))
    frozen = e * base
    if cfg.finetune.method == "qlora":
        shapes = target_shapes(cfg.model)
        for t in lora_targets(cfg):
            numel = shapes[t][0] * shapes[t][1]
            frozen += cfg.model.n_layers * (nf4_bytes(numel) - e * numel)
    return {
        "param_bytes": e * adapters / (n if zero == 3 else 1),
        "grad_bytes": e * adapters / (n if zero >= 2 else 1),
        "optim_bytes": (8 + 4 * mixed) * adapters / (n if zero >= 1 else 1),
        "frozen_bytes": frozen / (n if zero == 3 else 1),
    }
