"""A run pointed at a Hugging Face directory (``model.from_hf``): the model's fields taken from its
``config.json``, explicit settings checked against them, its tokenizer and routing taken over."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from loom.config import ModelConfig
from loom.model.hf.directory import HFModel, moe_options, open_dir
from loom.model.hf.families import CONFIG, HFError

# The model fields a config.json decides (Loom's names), set by apply_to.
HF_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "vocab_size",
    "max_seq_len",
    "rope_theta",
    "norm_eps",
    "tie_embeddings",
    "qkv_bias",
    "qk_norm",
    "qk_norm_scope",
    "norm_placement",
    "attn_head_dim",
    "n_experts",
    "top_k",
    "rope_scaling",
    "rope_kind",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_len",
    "rope_beta_fast",
    "rope_beta_slow",
    "rope_truncate",
    "rope_attn_factor",
    "rope_short_factor",
    "rope_long_factor",
    "rope_fraction",
    "norm",
    "mlp",
    "positions",
    "bias",
    "norm_offset",
    "embed_scale",
    "attn_scale",
    "attn_softcap",
    "logit_softcap",
    "embed_multiplier",
    "residual_multiplier",
    "logit_divisor",
    "sliding_window",
    "window_layers",
    "nope_layers",
    "rope_local_theta",
    "hf_architecture",
)
# the model fields a config.json does not decide (the run's own); every other field is in HF_FIELDS
# (tests/test_hf_gemma.py holds the two lists to every ModelConfig field)
RUN_FIELDS = ("multiple_of", "pad_vocab_to", "init_std", "dropout", "from_hf")
DERIVED = ("vocab_size", "ffn_dim", "attn_head_dim")  # 0 = derived (tokenizer, 8h/3 rule, h/a): not a value


def explicit_model_field(field: str, given: object, model: ModelConfig) -> bool:
    """The one rule for an explicit ``model.<field>`` = ``given`` beside a Hugging Face directory whose
    config gives ``model``: True = honoured (``max_seq_len`` with RoPE: only how far the rotary tables
    reach, no tensor's shape), False = the directory's value stands (the same value; 0 of a
    :data:`DERIVED` field; a field the model does not use: top_k without experts, a RoPE rule's
    numbers the model's rule does not read, :meth:`~loom.config.ModelConfig.rope_idle_fields`); anything else contradicts the weights and raises one line naming
    the field, both values and the directory."""
    theirs = getattr(model, field)
    if (
        given == theirs
        or (field in DERIVED and given == 0)
        or (field == "hf_architecture" and given == "auto")
    ):
        return False
    unused = (field == "top_k" and not model.moe) or field in model.rope_idle_fields()
    if unused:
        return False
    if field == "max_seq_len" and model.positions == "rope":
        return True
    from loom.config import ConfigError

    raise ConfigError(
        f"model.{field}: {given!r} was given, but model.from_hf's {CONFIG} gives {theirs!r}; the "
        f"pretrained weights fix it: leave model.{field} out"
    )


def apply_to(cfg, path: str | Path) -> HFModel:
    """Point a :class:`~loom.config.LoomConfig` at the HF directory ``path``: the model's shape from
    its ``config.json`` (RoPE prepared for ``data.seq_len``, or an explicit ``model.max_seq_len``),
    explicit ``model.*`` settings checked against it (:func:`explicit_model_field`), and its
    ``tokenizer.json`` as the data tokenizer unless one is set. Returns the opened directory."""
    from loom.config import explicit

    given = explicit(cfg)
    longest = cfg.data.seq_len
    if "model.max_seq_len" in given:  # a sliding window must hold it, a learned table must have its rows
        longest = max(longest, cfg.model.max_seq_len)
    model = open_dir(path, longest)
    for field in HF_FIELDS:
        mine = getattr(cfg.model, field)
        if f"model.{field}" in given and explicit_model_field(field, mine, model.config):
            continue
        setattr(cfg.model, field, getattr(model.config, field))
    for field, value in moe_options(model).items():  # the routing the weights were trained with
        if f"moe.{field}" in given and getattr(cfg.moe, field) != value:
            raise HFError(
                f"moe.{field}: {getattr(cfg.moe, field)!r} contradicts {model.dir / CONFIG}, whose routing "
                f"gives {value!r}; leave it unset"
            )
        setattr(cfg.moe, field, value)
    if not cfg.data.tokenizer:
        if model.tokenizer is None:
            raise HFError(f"{model.dir}: no tokenizer.json; give data.tokenizer")
        cfg.data.tokenizer = str(model.tokenizer)
    return model


def resolve_from_hf(cfg, need_data: bool = True) -> str | None:
    """What ``loom train``, ``loom config`` and ``loom plan`` do with ``model.from_hf`` (nothing
    without it): the path made absolute (a run's config.toml then names the base from anywhere),
    :func:`apply_to` (its errors as one ``model.from_hf:`` line), the fine-tuning defaults of
    :func:`loom.config.finetune_defaults`, and with ``need_data`` the refusal of a run without
    data (:func:`loom.config.check_finetune_data`). Returns the defaults' line (None: none set)."""
    from loom import config as C

    if not cfg.model.from_hf:
        return None
    cfg.model.from_hf = str(Path(cfg.model.from_hf).expanduser().absolute())
    try:
        apply_to(cfg, cfg.model.from_hf)
    except (HFError, KeyError, ValueError) as e:
        if isinstance(e, C.ConfigError):
            raise
        raise C.ConfigError(f"model.from_hf: {e}") from None
    if need_data:
        C.check_finetune_data(cfg)
        _say_dropout_not_read(cfg)
    return C.finetune_defaults(cfg)


# config.json's dropout rates, which transformers applies in train mode and Loom does not read
HF_DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop")


def _say_dropout_not_read(cfg) -> None:
    """One warning when the directory's config.json asks for dropout and ``model.dropout`` is not set:
    Loom fine-tunes with ``model.dropout`` (0 unless given), not the source's rates."""
    from loom import config as C

    if "model.dropout" in C.explicit(cfg):
        return
    try:
        raw = json.loads((Path(cfg.model.from_hf) / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    rates = {k: raw[k] for k in HF_DROPOUT_FIELDS if isinstance(raw.get(k), (int, float)) and raw[k] > 0}
    if rates:
        named = ", ".join(f"{k} = {v:g}" for k, v in rates.items())
        logging.getLogger("loom").warning(
            "loom: warning: model.from_hf: config.json's %s is not applied; Loom trains with "
            "model.dropout = %g (set it to train with dropout)",
            named,
            cfg.model.dropout,
        )
