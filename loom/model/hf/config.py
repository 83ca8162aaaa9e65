"""``config.json`` -> Loom's :class:`~loom.config.ModelConfig`: every field Loom cannot honour refused
by name (RoPE types, quantization, biases, windows, experts); GPT-2's fields apart."""

from __future__ import annotations

import json
import math

from loom.config import ModelConfig
from loom.model.hf.families import (
    _WRONG,
    CONFIG,
    ERNIE45,
    EXAONE4,
    GEMMA,
    GEMMA2,
    GEMMA3,
    GLM4,
    GPT2,
    GRANITE,
    LLAMA,
    MISSING,
    OLMO3,
    OLMOE,
    OLMOS,
    PHI3,
    QWEN2,
    QWEN3MOE,
    SEED_OSS,
    SMOLLM3,
    STARCODER2,
    SUPPORTED,
    TEXT_TOWERS,
    HFError,
    _bool,
    _float,
    _int,
    _opt_int,
    architecture,
    hf_field,
    nope_layers,
    sliding_window,
)
from loom.model.hf.quantized import scale_suffix

GELU = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
}  # HF activation -> model.mlp


def _rope(raw: dict, arch: str, seq: int) -> dict:
    """Loom's RoPE fields for ``config.json``: the base, the rotated share (Phi-3's
    ``partial_rotary_factor``) and the long-context rule (:func:`_scaling`); ``seq``: the longest
    sequence the run prepares RoPE for."""
    for key in ("rope_parameters", "rope_scaling"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise HFError(f"{CONFIG}: {_WRONG}: {key} = {json.dumps(raw[key])}, want an object (or null)")
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    # transformers 5 reads rope_parameters, but a rope_scaling (the older key, and what model cards
    # tell users to add for long context) replaces it whole, its base the top-level rope_theta
    merged = scaling or params
    key = "rope_scaling" if scaling else "rope_parameters"
    theta = ("rope_theta", hf_field(raw, "rope_theta"))
    if "rope_theta" in merged:
        theta = (f"{key}.rope_theta", merged["rope_theta"])
    out: dict = {"rope_theta": _float(*theta)}
    said = f"{key}.partial_rotary_factor" if "partial_rotary_factor" in merged else "partial_rotary_factor"
    partial = merged.get("partial_rotary_factor", hf_field(raw, "partial_rotary_factor"))
    if partial not in (None, 1, 1.0):  # Phi-4-mini: RoPE on the first 3/4 of each head; GLM-4: half
        if arch not in (PHI3, GLM4):
            raise HFError(
                f"{CONFIG}: {said} = {partial!r} is not supported for {arch} (transformers rotates part of a "
                f"head in {PHI3} and {GLM4} alone; Loom: 1.0)"
            )
        out["rope_fraction"] = _float(said, partial)
    return out | _scaling(raw, merged, key, arch, seq)


ROPE_RULES = ("llama3", "linear", "yarn", "longrope")  # model.rope_kind


def _scaling(raw: dict, p: dict, key: str, arch: str, seq: int) -> dict:
    """Loom's long-context RoPE fields for the RoPE parameters ``p`` (read from ``key``) as
    transformers applies them: ``rope_scaling`` = the factor (YaRN's and LongRoPE's default
    max_position_embeddings / original), ``rope_kind`` and the rule's own numbers; the pretraining
    length from a top-level ``original_max_position_embeddings`` first (transformers' order; Phi-3's
    default 4096), else ``p``'s, else max_position_embeddings; YaRN's DeepSeek ``mscale`` pair folded
    into ``rope_attn_factor``. ``dynamic`` is the default rule within max_position_embeddings (it
    rescales only beyond: refused for longer sequences)."""
    kind = p.get("rope_type", p.get("type", "default"))
    field = f"{key}.{'rope_type' if 'rope_type' in p else 'type'}"
    if arch == PHI3 and kind in ("su", "yarn"):
        kind = "longrope"  # transformers' Phi-3 reads both as LongRoPE
    if kind in (None, "default"):
        return {}
    longest = _int("max_position_embeddings", hf_field(raw, "max_position_embeddings"))
    if kind == "dynamic":
        if seq > longest:
            raise HFError(
                f"{CONFIG}: {field} = 'dynamic' rescales RoPE for sequences beyond max_position_embeddings = "
                f"{longest} by their length; Loom prepares fixed tables: keep the sequences within it (got {seq})"
            )
        return {}
    if kind not in ROPE_RULES or (arch == PHI3 and kind != "longrope"):
        allowed = "default, longrope" if arch == PHI3 else f"default, dynamic, {', '.join(ROPE_RULES)}"
        raise HFError(f"{CONFIG}: {field} = {kind!r} is not supported for {arch} (Loom: {allowed})")
    top = hf_field(raw, "original_max_position_embeddings")
    original = (
        ("original_max_position_embeddings", top)
        if top is not None
        else (f"{key}.original_max_position_embeddings", p.get("original_max_position_embeddings", longest))
    )
    length = _int(*original)
    factor = p.get("factor")
    if factor is None and kind in ("yarn", "longrope"):
        factor = longest / length  # transformers: the ratio of the two lengths
    s = _float(f"{key}.factor", factor)
    if not s > 0:
        raise HFError(f"{CONFIG}: {key}.factor = {factor} is out of range: want a number > 0")
    out: dict = {"rope_kind": kind, "rope_scaling": s}
    if kind == "llama3":
        return out | {
            "rope_low_freq_factor": _float(f"{key}.low_freq_factor", p["low_freq_factor"]),
            "rope_high_freq_factor": _float(f"{key}.high_freq_factor", p["high_freq_factor"]),
            "rope_original_len": length,
        }
    if kind == "linear":
        return out
    out["rope_original_len"] = length
    if p.get("attention_factor") is not None:
        out["rope_attn_factor"] = _float(f"{key}.attention_factor", p["attention_factor"])
    if kind == "longrope":
        for name in ("short_factor", "long_factor"):
            v = p.get(name)
            if not isinstance(v, list) or not all(
                isinstance(x, int | float) and not isinstance(x, bool) for x in v
            ):
                raise HFError(f"{CONFIG}: {key}.{name} = {json.dumps(v)[:80]}: want a list of numbers")
            out[f"rope_{name}"] = [float(x) for x in v]
        return out
    mscale, all_dims = p.get("mscale"), p.get("mscale_all_dim")
    if "rope_attn_factor" not in out and mscale and all_dims:  # DeepSeek's ratio of two YaRN scales
        out["rope_attn_factor"] = (
            (0.1 * _float(f"{key}.mscale", mscale) * math.log(s) + 1)
            / (0.1 * _float(f"{key}.mscale_all_dim", all_dims) * math.log(s) + 1)
            if s > 1
            else 1.0
        )
    truncate = p.get("truncate", True)
    if not isinstance(truncate, bool):
        raise HFError(f"{CONFIG}: {key}.truncate = {json.dumps(truncate)}: want true or false")
    return out | {
        "rope_beta_fast": _float(f"{key}.beta_fast", p.get("beta_fast") or 32),
        "rope_beta_slow": _float(f"{key}.beta_slow", p.get("beta_slow") or 1),
        "rope_truncate": truncate,
    }


def model_config(raw: dict, max_seq_len: int = 0) -> ModelConfig:
    """Loom's :class:`ModelConfig` for a ``config.json``; a field Loom cannot honour raises naming it.
    ``max_seq_len``: the longest sequence to prepare RoPE for (0 = ``max_position_embeddings``); a
    sliding window the sequences fit in is left out (it hides no key)."""
    arch = architecture(raw)
    if arch in TEXT_TOWERS:  # a multimodal checkpoint: its text model (the top level's tying, if given)
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise HFError(
                f"{CONFIG}: {_WRONG}: text_config = {json.dumps(text)[:60]}, want an object ({arch}'s text model)"
            )
        tie = {"tie_word_embeddings": raw["tie_word_embeddings"]} if "tie_word_embeddings" in raw else {}
        return model_config(text | tie | {"architectures": [architecture(text)]}, max_seq_len)
    if arch not in SUPPORTED:
        lacks = f" (Loom's model lacks {MISSING[arch]})" if arch in MISSING else ""
        what = (
            f"architectures = {arch!r}"
            if raw.get("architectures")
            else f"model_type = {raw.get('model_type')!r} (no architectures)"
        )
        raise HFError(f"{CONFIG}: {what} is not supported{lacks}; supported: {', '.join(SUPPORTED)}")
    scale_suffix(raw)  # fp8 with scales is dequantized as read; GPTQ, AWQ, bitsandbytes, MXFP4 refused
    if arch == GPT2:
        return _gpt2_config(raw, max_seq_len)
    # every size is a checked integer (its field named) before any division by it
    dim, heads = (
        _int("hidden_size", raw["hidden_size"]),
        _int("num_attention_heads", raw["num_attention_heads"]),
    )
    derived = "hidden_size // num_attention_heads"
    head_dim = _opt_int("head_dim", hf_field(raw, "head_dim"), null=derived)
    if head_dim is None:  # transformers: hidden_size // num_attention_heads (floored)
        head_dim = dim // heads
        if head_dim < 1:
            raise HFError(
                f"{CONFIG}: hidden_size = {dim} is narrower than num_attention_heads = {heads}: no head width "
                f"({derived} = 0; give head_dim)"
            )
    if head_dim % 2:
        said = "head_dim" if hf_field(raw, "head_dim") is not None else derived
        raise HFError(f"{CONFIG}: {said} = {head_dim} is odd; RoPE rotates pairs: want an even head width")
    kv = _opt_int("num_key_value_heads", hf_field(raw, "num_key_value_heads"), null="num_attention_heads")
    kv = heads if kv is None else kv
    if heads % kv:
        raise HFError(
            f"{CONFIG}: num_key_value_heads = {kv} does not divide num_attention_heads = {heads}; want a "
            "divisor of it (each key/value head serves the same number of query heads)"
        )
    qwen2, qwen3 = arch == QWEN2, arch in ("Qwen3ForCausalLM", QWEN3MOE)
    gemma = (
        _gemma_fields(raw, arch, head_dim)
        | _starcoder2_fields(raw, arch)
        | _granite_fields(raw, arch, head_dim)
    )
    if arch == GLM4:  # a norm before and after attention and MLP (its post_self_attn, post_mlp)
        gemma["norm_placement"] = "sandwich"
    checks: list[tuple[str, tuple[object, ...]]] = [("router_jitter_noise", (0.0, 0, None))]
    if arch not in (GEMMA, GEMMA2, GEMMA3, STARCODER2):  # theirs checked above; swish is SiLU, the default
        checks.append(("hidden_act", ("silu", "swish", None)))
    # Qwen2 always has q/k/v biases (and no o bias); Llama's attention_bias adds q/k/v and o biases:
    # with mlp_bias (gate, up, down) too, Loom's model.bias (every linear but the head; up's zero),
    # alone Qwen2's q/k/v biases (o's zero); open_dir checks the zeros (zero_tensors); others: none
    llama_bias = arch == LLAMA and raw.get("attention_bias") is True
    every_bias = llama_bias and raw.get("mlp_bias") is True
    # q/k/v biases without o's: GLM-4's attention_bias, Seed-OSS's (its o's attention_out_bias: none)
    glm_bias = arch in (GLM4, SEED_OSS) and _bool("attention_bias", hf_field(raw, "attention_bias"))
    if arch == SEED_OSS:
        checks.append(("attention_out_bias", (False, None)))
    if arch == OLMOE:  # OLMoE's clamp of q, k and v: none
        checks.append(("clip_qkv", (None,)))
    if arch == ERNIE45:
        checks.append(("use_bias", (False, None)))
    if not qwen2 and not llama_bias and arch not in (GLM4, SEED_OSS):
        checks.append(("attention_bias", (False, None)))
    if not every_bias:
        checks.append(("mlp_bias", (False, None)))
    for field, allowed in checks:
        if raw.get(field) not in allowed:
            raise HFError(f"{CONFIG}: {field} = {raw.get(field)!r} is not supported (Loom: {allowed[0]!r})")
    if arch == QWEN3MOE:  # no dense MLP: intermediate_size may be left out
        n_experts, ffn = _qwen3_moe_experts(raw)
    elif arch == OLMOE:  # every layer sparse: num_experts of width intermediate_size
        n_experts, ffn = (
            _int("num_experts", hf_field(raw, "num_experts"), low=2),
            _int("intermediate_size", raw["intermediate_size"]),
        )
    else:
        n_experts = _int("num_local_experts", hf_field(raw, "num_local_experts"))
        ffn = _int("intermediate_size", raw["intermediate_size"])
        if arch == "MixtralForCausalLM" and n_experts < 2:
            raise HFError(
                f"{CONFIG}: num_local_experts = {n_experts} is not supported (Loom's Mixtral has 2 or more "
                "experts; one expert is a dense MLP: a Llama)"
            )
    seq = max_seq_len or _int("max_position_embeddings", hf_field(raw, "max_position_embeddings"))
    window = sliding_window(raw, arch)
    # the windowed layers, windowed or not: Gemma 3's local RoPE base applies there (none of its layers
    # sliding: none at the local base)
    layers = window[1] if window else ("" if arch in (GEMMA3, OLMO3) else "all")
    if window is not None and seq <= window[0]:
        window = None  # every sequence fits it: no key falls outside, attention is whole (the fast kernels)
    return ModelConfig(
        dim=dim,
        n_layers=_int("num_hidden_layers", raw["num_hidden_layers"]),
        n_heads=heads,
        n_kv_heads=kv,
        vocab_size=_int("vocab_size", raw["vocab_size"]),
        max_seq_len=seq,
        **(_layer_type_rope(raw, seq, arch) if arch in (GEMMA3, OLMO3) else _rope(raw, arch, seq)),
        norm_eps=gemma.pop("norm_eps", None) or _float("rms_norm_eps", hf_field(raw, "rms_norm_eps")),
        tie_embeddings=_bool("tie_word_embeddings", hf_field(raw, "tie_word_embeddings")),
        qkv_bias=qwen2 or glm_bias or (llama_bias and not every_bias),
        bias=gemma.pop("bias", every_bias),
        qk_norm=gemma.pop("qk_norm", qwen3 or arch in (*OLMOS, OLMOE, EXAONE4)),
        qk_norm_scope="all" if arch in (*OLMOS, OLMOE) else "head",
        norm_placement=gemma.pop("norm_placement", "post" if arch in (*OLMOS, EXAONE4) else "pre"),
        attn_head_dim=head_dim if head_dim * heads != dim else 0,  # 0: Loom's h / a
        ffn_dim=ffn,
        n_experts=n_experts,
        top_k=_int("num_experts_per_tok", hf_field(raw, "num_experts_per_tok")),
        hf_architecture=arch,  # type: ignore[arg-type]  # one of SUPPORTED, checked above
        sliding_window=window[0] if window else 0,
        window_layers=layers,
        nope_layers=_nope(raw, arch, layers),
        **gemma,
    )


def _nope(raw: dict, arch: str, local: str) -> str:
    """``model.nope_layers``: SmolLM3's ``no_rope_layers`` zeros; EXAONE 4's layers without a window
    when it has one (``local``: the windowed layers, ``all`` or indices); "" for other families."""
    if arch == SMOLLM3:
        return ",".join(map(str, nope_layers(raw)))
    if arch != EXAONE4 or hf_field(raw, "sliding_window") is None or local == "all":
        return ""
    windowed = {int(i) for i in local.split(",") if i}
    n = _int("num_hidden_layers", raw["num_hidden_layers"])
    return ",".join(str(i) for i in range(n) if i not in windowed)


def _granite_fields(raw: dict, arch: str, head_dim: int) -> dict:
    """Granite's scales: ``embedding_multiplier``, ``residual_multiplier``, ``logits_scaling`` (a divisor)
    and ``attention_multiplier`` (the scores' scale, not 1/sqrt(d): ``model.attn_scale``, 0 when it is
    1/sqrt(d)); {} for other families."""
    if arch != GRANITE:
        return {}
    out = {}
    for field, loom in (
        ("embedding_multiplier", "embed_multiplier"),
        ("residual_multiplier", "residual_multiplier"),
        ("logits_scaling", "logit_divisor"),
        ("attention_multiplier", "attn_scale"),
    ):
        v = _float(field, hf_field(raw, field))
        if not 0 < v < float("inf"):
            raise HFError(f"{CONFIG}: {field} = {v} is out of range: want a finite number > 0")
        out[loom] = v
    if abs(out["attn_scale"] - head_dim**-0.5) <= 1e-12 * out["attn_scale"]:
        out["attn_scale"] = 0.0  # Loom's own 1/sqrt(d)
    return out


def _starcoder2_fields(raw: dict, arch: str) -> dict:
    """StarCoder 2's fields: LayerNorm (``norm_epsilon``), a GELU MLP (``hidden_act``: the tanh form or
    the exact), biases on every linear but the head (``use_bias``); {} for other families."""
    if arch != STARCODER2:
        return {}
    act = hf_field(raw, "hidden_act")
    if act not in GELU:
        raise HFError(f"{CONFIG}: hidden_act = {act!r} is not supported (Loom: {', '.join(GELU)})")
    return {
        "norm": "layernorm",
        "mlp": GELU[act],
        "bias": _bool("use_bias", hf_field(raw, "use_bias")),
        "norm_eps": _float("norm_epsilon", hf_field(raw, "norm_epsilon")),
    }


GEMMA_GELU = ("gelu_pytorch_tanh", "gelu_new")  # the gated GELU-tanh Loom's geglu_tanh computes


def _gemma_fields(raw: dict, arch: str, head_dim: int) -> dict:
    """Loom's fields for a Gemma (1 + w RMSNorm, sqrt(h)-scaled embeddings, the gated GELU-tanh MLP)
    and a Gemma 2 (also sandwich norms, the attention scale ``query_pre_attn_scalar``^-1/2 and the
    attention and final-logit soft-caps); {} for other families. Gemma reads ``hidden_act`` (its
    legacy ``gelu`` meaning the tanh form, as transformers reads it), Gemma 2 ``hidden_activation``."""
    if arch not in (GEMMA, GEMMA2, GEMMA3):
        return {}
    field = "hidden_act" if arch == GEMMA else "hidden_activation"
    allowed = GEMMA_GELU + (("gelu",) if arch == GEMMA else ())
    act = hf_field(raw, field)
    if act not in allowed:
        raise HFError(
            f"{CONFIG}: {field} = {act!r} is not supported (Loom's gated GELU: {', '.join(allowed)})"
        )
    if raw.get("use_bidirectional_attention"):
        raise HFError(
            f"{CONFIG}: use_bidirectional_attention = true is not supported (Loom's attention is causal)"
        )
    out = {"norm_offset": True, "embed_scale": True, "mlp": "geglu_tanh"}
    if arch == GEMMA:
        return out
    scalar = _float("query_pre_attn_scalar", hf_field(raw, "query_pre_attn_scalar"))
    if scalar <= 0:
        raise HFError(f"{CONFIG}: query_pre_attn_scalar = {scalar} is out of range: want a number > 0")
    caps = {"attn_softcap": 0.0}  # Gemma 3 keeps attn_logit_softcapping but applies none, as transformers
    for name, loom in (
        ("attn_logit_softcapping", "attn_softcap"),
        ("final_logit_softcapping", "logit_softcap"),
    )[1 if arch == GEMMA3 else 0 :]:
        cap = hf_field(raw, name)
        caps[loom] = 0.0 if cap is None else _float(name, cap)
        if caps[loom] < 0:
            raise HFError(f"{CONFIG}: {name} = {cap} is out of range: want a number > 0, or null (none)")
    scale = 0.0 if scalar == head_dim else scalar**-0.5  # 0: Loom's own 1/sqrt(head_dim)
    qk = {"qk_norm": True} if arch == GEMMA3 else {}  # Gemma 3: per-head q/k norms, (1 + w) too
    return out | {"norm_placement": "sandwich", "attn_scale": scale} | caps | qk


def _layer_type_rope(raw: dict, seq: int, arch: str) -> dict:
    """Gemma 3's and OLMo 3's RoPE per layer type: the full-attention layers' base (``rope_theta``, or
    transformers 5's ``rope_parameters.full_attention.rope_theta``) with a long-context rule on them
    alone (:func:`_scaling`: Gemma 3's larger models' linear factor 8, OLMo 3's YaRN), and the
    sliding layers' (``rope_parameters.sliding_attention.rope_theta``, else Gemma 3's
    ``rope_local_base_freq``, OLMo 3's ``rope_theta``), of the default type: ``model.rope_local_theta``
    (OLMo 3 with one base and no rule: none, one table for all)."""
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise HFError(f"{CONFIG}: {_WRONG}: rope_parameters = {json.dumps(params)}, want an object (or null)")
    legacy = raw.get("rope_scaling")
    if legacy is not None and not isinstance(legacy, dict):
        raise HFError(f"{CONFIG}: {_WRONG}: rope_scaling = {json.dumps(legacy)}, want an object (or null)")
    local_field = "rope_local_base_freq" if arch == GEMMA3 else "rope_theta"
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        out: dict = {}
        for kind, loom, fallback in (
            ("full_attention", "rope_theta", "rope_theta"),
            ("sliding_attention", "rope_local_theta", local_field),
        ):
            p = params.get(kind) or {}
            if not isinstance(p, dict):
                raise HFError(f"{CONFIG}: {_WRONG}: rope_parameters.{kind}, want an object")
            if kind == "sliding_attention" and p.get("rope_type", "default") != "default":
                raise HFError(
                    f"{CONFIG}: rope_parameters.{kind}.rope_type = {p['rope_type']!r} is not supported "
                    f"(Loom: default on {arch}'s sliding layers)"
                )
            key = f"rope_parameters.{kind}.rope_theta" if "rope_theta" in p else fallback
            out[loom] = _positive(key, p.get("rope_theta", hf_field(raw, fallback)))
            if kind == "full_attention":
                # a rope_scaling updates the full layers' parameters (transformers' Gemma 3, OLMo 3)
                key = "rope_scaling" if legacy else f"rope_parameters.{kind}"
                out |= _scaling(raw, p | (legacy or {}), key, arch, seq)
    else:
        out = {
            "rope_theta": _positive("rope_theta", hf_field(raw, "rope_theta")),
            "rope_local_theta": _positive(local_field, hf_field(raw, local_field)),
        } | _scaling(raw, legacy or {}, "rope_scaling", arch, seq)
    if arch != GEMMA3 and out["rope_local_theta"] == out["rope_theta"] and not out.get("rope_scaling"):
        out["rope_local_theta"] = 0.0  # one table serves every layer
    return out


def _positive(field: str, value: object) -> float:
    """:func:`_float`, above 0 (a RoPE base), else one line naming the field."""
    out = _float(field, value)
    if not out > 0:
        raise HFError(f"{CONFIG}: {field} = {value} is out of range: want a number > 0")
    return out


def _qwen3_moe_experts(raw: dict) -> tuple[int, int]:
    """Qwen3-MoE's experts: every layer sparse (``decoder_sparse_step`` 1, no ``mlp_only_layers``:
    Loom's blocks are all MoE or all dense), E = ``num_experts`` of width ``moe_intermediate_size``."""
    for field, allowed in (("decoder_sparse_step", (1, None)), ("mlp_only_layers", ([], None))):
        if raw.get(field) not in allowed:
            raise HFError(
                f"{CONFIG}: {field} = {raw.get(field)!r} is not supported (Loom: {allowed[0]!r}: "
                "every layer a mixture of experts)"
            )
    field = (
        "num_local_experts"
        if raw.get("num_experts") is None and raw.get("num_local_experts") is not None
        else "num_experts"
    )  # 5 writes the latter
    n = _int(field, hf_field(raw, field), low=0) if hf_field(raw, field) is not None else 0
    if n < 2:
        raise HFError(f"{CONFIG}: {field} = {n} is not supported (Loom: >= 2 for Qwen3MoeForCausalLM)")
    return n, _int("moe_intermediate_size", raw["moe_intermediate_size"])


def _gpt2_config(raw: dict, max_seq_len: int) -> ModelConfig:
    """Loom's config for GPT-2: LayerNorm, GELU MLP, learned positions (the whole ``n_positions``
    table), biases everywhere, one key/value head per query head."""
    act = raw.get("activation_function", "gelu_new")
    if act not in GELU:
        raise HFError(f"{CONFIG}: activation_function = {act!r} is not supported (Loom: {', '.join(GELU)})")
    for field, allowed in (
        ("scale_attn_weights", (True, None)),
        ("scale_attn_by_inverse_layer_idx", (False, None)),
        ("reorder_and_upcast_attn", (False, None)),
        ("add_cross_attention", (False, None)),
    ):
        if raw.get(field) not in allowed:
            raise HFError(f"{CONFIG}: {field} = {raw.get(field)!r} is not supported (Loom: {allowed[0]!r})")
    dim, heads = _int("n_embd", raw["n_embd"]), _int("n_head", raw["n_head"])
    n_pos = _int("n_positions", raw.get("n_positions", 1024))
    if dim % heads:
        raise HFError(
            f"{CONFIG}: n_embd = {dim} is not divisible by n_head = {heads}; GPT-2's heads split the width evenly"
        )
    if max_seq_len > n_pos:
        raise HFError(
            f"{CONFIG}: n_positions = {n_pos} is shorter than the sequences ({max_seq_len}); the learned "
            "position table has no rows beyond it"
        )
    return ModelConfig(
        dim=dim,
        n_layers=_int("n_layer", raw["n_layer"]),
        n_heads=heads,
        n_kv_heads=heads,
        ffn_dim=_opt_int("n_inner", raw.get("n_inner"), null="4 * n_embd") or 4 * dim,
        vocab_size=_int("vocab_size", raw["vocab_size"]),
        max_seq_len=n_pos,
        norm_eps=_float("layer_norm_epsilon", raw.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=_bool("tie_word_embeddings", raw.get("tie_word_embeddings", True)),
        norm="layernorm",
        mlp=GELU[act],  # type: ignore[arg-type]
        positions="learned",
        bias=True,
        hf_architecture=GPT2,
    )
