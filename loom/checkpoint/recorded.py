"""The model a checkpoint recorded (``train_state.json``'s ``config``) against the config at hand.

A checkpoint's weights belong to the model it was trained as: its ``[model]`` section, the routing
of its ``[moe]`` section (score, top-k renormalization, shared experts) and, for a LoRA run, the
adapters' method, rank, scale and targets. :func:`model_changes` lists the fields of these a
config changed that change what the weights compute, for a resume
(:class:`~loom.checkpoint.training.TrainCheckpoints`, which may also change RoPE's
``max_seq_len``: :func:`free_on_resume`) and for ``loom generate`` (which builds the
recorded model, :func:`adopt_model`, within its trained ``max_seq_len``). Never compared:

- ``model.from_hf``: where the base is (the user may move it; a LoRA base is bound by its SHA-256,
  :func:`~loom.checkpoint.training.check_base`), and ``model.hf_architecture``: export naming;
- ``model.init_std``: the init, overwritten by the loaded weights; ``model.dropout``: training
  regularization (none at generation);
- ``model.pad_vocab_to``: rows that are zeros and take no part in any logit (the reader reshapes them);
- a field that has no effect on the recorded model: ``top_k`` and ``[moe]`` of a dense model, RoPE's
  of learned positions, a RoPE rule's numbers the recorded rule does not read
  (:meth:`~loom.config.ModelConfig.rope_idle_fields`), ``qk_norm_scope`` without
  ``qk_norm``, the LoRA fields of a full fine-tune; ``ffn_dim``, ``multiple_of`` or ``attn_head_dim``
  changed where the resolved MLP width and head size stay the same;
- a field the checkpoint did not record (written by an older Loom), and a ``model.vocab_size`` of 0
  at hand (not yet read from the tokenizer, which ``run.dir/data.json`` binds to the run).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from loom import config as C

FREE = frozenset(
    {"model.from_hf", "model.hf_architecture", "model.init_std", "model.dropout", "model.pad_vocab_to"}
)
MOE_FIELDS = ("score", "norm_topk", "n_shared_experts")  # the routing; the rest trains or places experts
LORA_FIELDS = ("method", "lora_rank", "lora_alpha", "lora_targets")  # lora_dropout trains only

# fields whose raw values may differ where the model they resolve to does not
RESOLVED: dict[str, Callable[[C.ModelConfig], object]] = {
    "ffn_dim": C.ModelConfig.resolved_ffn_dim,
    "multiple_of": C.ModelConfig.resolved_ffn_dim,
    "attn_head_dim": lambda m: m.head_dim,
    "window_layers": lambda m: m.local_layers(),  # "0,2" and "2,0" list the same layers
    "nope_layers": lambda m: m.nope_layer_set(),
    "max_seq_len": lambda m: m.rope_long if _longrope(m) else m.max_seq_len,  # LongRoPE: which factors
}


def _longrope(m: C.ModelConfig) -> bool:
    """LongRoPE, whose factors (short or long) ``max_seq_len`` selects."""
    return m.positions == "rope" and bool(m.rope_scaling) and m.rope_kind == "longrope"


Change = tuple[str, object, object]  # (section.key, the recorded value, the value at hand)


def recorded_config(ts: dict) -> C.LoomConfig | None:
    """The model sections (:data:`MOE_FIELDS` with ``[moe]``, LoRA's ``[finetune]``) the checkpoint's
    ``train_state.json`` ``ts`` recorded, on defaults; None when it recorded no config (an older
    Loom). A key this Loom does not know is left out (nothing to compare it with)."""
    saved = ts.get("config") or {}
    if not isinstance(saved.get("model"), dict) or not saved["model"]:
        return None
    tables = {}
    for section in ("model", "moe", "finetune"):
        known = {f.name for f in dataclasses.fields(C.SECTIONS[section])}
        table = saved.get(section)
        tables[section] = {k: v for k, v in (table if isinstance(table, dict) else {}).items() if k in known}
    return C.from_dict(tables)


def _fields(saved: C.LoomConfig) -> Iterator[tuple[str, str]]:
    """(section, key) of every field that has an effect on the model ``saved`` describes."""
    m = saved.model
    for f in dataclasses.fields(C.ModelConfig):
        key = f.name
        idle = (
            (key == "top_k" and not m.moe)
            or key in m.rope_idle_fields()
            or (key == "qk_norm_scope" and not m.qk_norm)
        )
        if not idle:
            yield "model", key
    if m.moe:
        yield from (("moe", key) for key in MOE_FIELDS)
    if saved.finetune.method != "full":
        yield from (("finetune", key) for key in LORA_FIELDS)


def free_on_resume(saved: C.LoomConfig) -> frozenset[str]:
    """What a resume may change besides :data:`FREE`: ``model.max_seq_len`` of a RoPE model (context
    extension: a position's angles do not depend on it; LongRoPE's do where it crosses
    ``rope_original_len``: compared by :data:`RESOLVED`); a learned position table keeps its rows."""
    m = saved.model
    return FREE | ({"model.max_seq_len"} if m.positions == "rope" and not _longrope(m) else set())


def model_changes(saved: C.LoomConfig, now: C.LoomConfig, free: frozenset[str] = FREE) -> list[Change]:
    """The fields (module doc) whose value in ``now`` differs from the recorded ``saved``
    (:func:`recorded_config`), but those named in ``free``."""
    recorded = C.explicit(saved)
    out: list[Change] = []
    for section, key in _fields(saved):
        name = f"{section}.{key}"
        if name in free or name not in recorded or (name == "model.vocab_size" and not now.model.vocab_size):
            continue  # vocab_size 0: to be read from the tokenizer (bound to the run by its data.json)
        old, new = getattr(getattr(saved, section), key), getattr(getattr(now, section), key)
        resolve = RESOLVED.get(key) if section == "model" else None
        if old != new and (resolve is None or resolve(saved.model) != resolve(now.model)):
            out.append((name, old, new))
    return out


def adopt_model(cfg: C.LoomConfig, saved: C.LoomConfig) -> None:
    """Give ``cfg`` every model field the checkpoint recorded (``saved``), ``model.from_hf`` excepted
    (where the base is now)."""
    for name in sorted(C.explicit(saved)):
        section, key = name.split(".", 1)
        if name != "model.from_hf":
            setattr(getattr(cfg, section), key, getattr(getattr(saved, section), key))
