"""``[finetune]``: the LoRA targets a model has, their shapes, and the checks of the section."""

from __future__ import annotations

from loom.config.sections import LORA_TARGETS, NF4_BLOCK, LoomConfig, ModelConfig, _require, _require_none
from loom.rules import qlora_layout_problem

# capacity under cp/sp and router losses under asynchronous pipelines: rules.layout_problems


def model_linears(m: ModelConfig) -> tuple[str, ...]:
    """The LoRA targets this model has: q, k, v, o, and the dense MLP's w1, w2 (and SwiGLU's w3);
    a mixture of experts' MLP weights are not linear layers LoRA wraps."""
    mlp = () if m.moe else ("w1", "w2", "w3") if m.mlp == "swiglu" else ("w1", "w2")
    return ("q", "k", "v", "o", *mlp)


def lora_targets(cfg: LoomConfig) -> tuple[str, ...]:
    """``finetune.lora_targets`` resolved for ``cfg.model`` (in :data:`LORA_TARGETS` order); raises
    ConfigError for an unknown name or one this model lacks, and when nothing is left to target."""
    spec, have = cfg.finetune.lora_targets.replace(" ", ""), model_linears(cfg.model)
    names = have if spec == "all-linear" else tuple(t for t in spec.split(",") if t)
    for t in names:
        _require(
            t in LORA_TARGETS,
            f"finetune.lora_targets: unknown target {t!r}; valid: {', '.join(LORA_TARGETS)} or all-linear",
        )
    missing = [t for t in names if t not in have]
    why = "its MLP is a mixture of experts" if cfg.model.moe else f"model.mlp = {cfg.model.mlp}"
    _require(
        bool(names) and len(missing) < len(names),
        f"finetune.lora_targets: nothing to target in this model "
        f"({cfg.finetune.lora_targets!r}; it has {', '.join(have)}: {why})",
    )
    _require(
        not missing,
        f"finetune.lora_targets: this model has no {', '.join(missing)} linear layer ({why}); "
        f"its targets: {', '.join(have)}",
    )
    return tuple(t for t in LORA_TARGETS if t in names)


def target_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """(d_out, d_in) of each LoRA target's weight."""
    qd, kd, f = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim, m.resolved_ffn_dim()
    return {
        "q": (qd, m.dim),
        "k": (kd, m.dim),
        "v": (kd, m.dim),
        "o": (m.dim, qd),
        "w1": (f, m.dim),
        "w3": (f, m.dim),
        "w2": (m.dim, f),
    }


TARGET_NAMES = {
    "q": "attention.wq",
    "k": "attention.wk",
    "v": "attention.wv",
    "o": "attention.wo",
    "w1": "feed_forward.w1",
    "w2": "feed_forward.w2",
    "w3": "feed_forward.w3",
}


def check_finetune(cfg: LoomConfig) -> None:
    """[finetune]: rank >= 1, alpha > 0, dropout in [0, 1), targets this model has; QLoRA's base
    weights split into 64-element NF4 blocks, and no tensor parallelism (each rank would quantize a slice)."""
    f, p = cfg.finetune, cfg.parallel
    if f.method == "full":
        return
    _require(f.lora_rank >= 1, f"finetune.lora_rank: must be >= 1, got {f.lora_rank}")
    _require(f.lora_alpha > 0, f"finetune.lora_alpha: must be > 0, got {f.lora_alpha}")
    _require(0.0 <= f.lora_dropout < 1.0, f"finetune.lora_dropout: must be in [0, 1), got {f.lora_dropout}")
    targets = lora_targets(cfg)
    shapes = target_shapes(cfg.model)
    t = min(targets, key=lambda t: min(shapes[t]))
    _require(  # a rank above min(d_in, d_out) adds parameters, never expressiveness (and may not fit)
        f.lora_rank <= min(shapes[t]),
        f"finetune.lora_rank: {f.lora_rank} exceeds the smallest dimension of layers.*.{TARGET_NAMES[t]} "
        f"({shapes[t][1]} -> {shapes[t][0]}); give a rank <= {min(shapes[t])}",
    )
    if f.method != "qlora":
        return
    for t in targets:
        out, inp = target_shapes(cfg.model)[t]
        _require(
            out * inp % NF4_BLOCK == 0,
            f"finetune.method: qlora cannot quantize layers.*.{TARGET_NAMES[t]}.weight "
            f"({out} x {inp} = {out * inp} elements, not a multiple of the {NF4_BLOCK}-element NF4 block); "
            f"use method = lora or drop {t} from finetune.lora_targets",
        )
    _require_none(qlora_layout_problem(f.method, p.tp))
