"""``[finetune]``: the LoRA targets a model has, their shapes, and the checks of the section."""

from __future__ import annotations

from loom.config.sections import LORA_TARGETS, NF4_BLOCK, LoomConfig, ModelConfig, _require, _require_none
from loom.rules import adapters_expert_tp_problem, qlora_layout_problem

# capacity under cp/sp and router losses under asynchronous pipelines: rules.layout_problems


def model_linears(m: ModelConfig) -> tuple[str, ...]:
    """The LoRA targets this model has: q, k, v, o, and the dense MLP's w1, w2 (and SwiGLU's w3);
    a mixture of experts' MLP weights are not linear layers LoRA wraps."""
    mlp = () if m.moe else ("w1", "w2", "w3") if m.gated_mlp else ("w1", "w2")
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
    _require_none(adapters_expert_tp_problem(f.method, p.tp, p.expert_tp))
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


# model.from_hf: fine-tuning values of the [train] fields a run does not set (pretraining's are
# lr 3e-3 and weight decay 0.1, far too hot for a pretrained model). lr: transformers' Trainer
# default for a full fine-tune; LoRA/QLoRA: the QLoRA paper's (adapters start at zero and need more).
FINETUNE_LR = {"full": 2e-5, "lora": 2e-4, "qlora": 2e-4}
FINETUNE_WARMUP = 0.03  # share of train.steps warmed up (transformers' common warmup_ratio)


def finetune_defaults(cfg: LoomConfig) -> str | None:
    """With ``model.from_hf``, each of ``train.lr``, ``min_lr``, ``warmup_steps`` and
    ``weight_decay`` not given explicitly (:func:`~loom.config.parse.explicit`) takes its fine-tuning
    value: lr = :data:`FINETUNE_LR` [finetune.method], min_lr = lr / 10 (the cosine floor), warmup =
    max(1, round(0.03·steps)) steps (below steps), weight decay 0. Returns the line stating what
    was set (None: every one was given, or no from_hf)."""
    from loom.config.parse import explicit

    if not cfg.model.from_hf:
        return None
    t, given, set_ = cfg.train, explicit(cfg), []
    if "train.lr" not in given:
        t.lr = FINETUNE_LR[cfg.finetune.method]
        set_.append(f"train.lr {t.lr:g} ({cfg.finetune.method})")
    if "train.min_lr" not in given:
        t.min_lr = float(f"{t.lr / 10:.6g}")  # 2e-06, not 2.0000000000000003e-06 in config.toml
        set_.append(f"train.min_lr {t.min_lr:g} (lr / 10, cosine)")
    if "train.warmup_steps" not in given:
        t.warmup_steps = min(max(1, round(FINETUNE_WARMUP * t.steps)), max(0, t.steps - 1))
        set_.append(f"train.warmup_steps {t.warmup_steps} ({FINETUNE_WARMUP:.0%} of {t.steps} steps)")
    if "train.weight_decay" not in given:
        t.weight_decay = 0.0
        set_.append("train.weight_decay 0")
    if not set_:
        return None
    return "model.from_hf: fine-tuning defaults for the [train] values not given: " + ", ".join(set_)


def check_finetune_data(cfg: LoomConfig) -> None:
    """A run from ``model.from_hf`` names its data: the stdlib corpus (the default source) is a
    pretraining demo, never what a pretrained model is meant to be fine-tuned on unless asked."""
    from loom.config.parse import explicit

    given = explicit(cfg)
    _require(
        not cfg.model.from_hf or bool({"data.source", "data.sources", "data.prepared_dir"} & given),
        "data.source: model.from_hf fine-tunes a pretrained model; give its data (data.source FILE, "
        "DIR or GLOB, or [[data.sources]]); the default stdlib corpus is used only when named",
    )
