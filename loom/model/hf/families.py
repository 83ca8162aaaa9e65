"""The Hugging Face families Loom reads and writes: their names, ``config.json``'s defaults per family
(transformers' own), checked reads of its fields (one line naming the field), and the family a Loom
model's tensors make (:func:`architecture_of`)."""

from __future__ import annotations

import json
import typing
from typing import Final

from loom.config import ModelConfig, MoEConfig
from loom.config.sections import HFArchitecture

SUPPORTED: tuple[str, ...] = typing.get_args(HFArchitecture)[1:]  # model.hf_architecture's values but auto
GPT2: Final = "GPT2LMHeadModel"
PHI3: Final = "Phi3ForCausalLM"
QWEN3MOE: Final = "Qwen3MoeForCausalLM"
OLMO2: Final = "Olmo2ForCausalLM"
OLMO3: Final = "Olmo3ForCausalLM"
OLMOE: Final = "OlmoeForCausalLM"  # Llama's block, q/k norms over all heads, Qwen3-MoE's expert names
# EXAONE 4: OLMo 2's norms after attention and MLP with per-head q/k norms; windows on 3 layers of 4, the
# others without RoPE
EXAONE4: Final = "Exaone4ForCausalLM"
OLMOS = (OLMO2, OLMO3)  # norms after attention and MLP, q/k norms over all heads; OLMo 3: windows too
LLAMA: Final = "LlamaForCausalLM"
QWEN2: Final = "Qwen2ForCausalLM"
GEMMA: Final = "GemmaForCausalLM"
GEMMA2: Final = "Gemma2ForCausalLM"
GEMMA3: Final = "Gemma3ForCausalLM"
# multimodal checkpoints whose text model Loom reads (text_config, the language_model. tensors), the
# vision tower left out: Gemma 3's (4B and up), Mistral 3's (Mistral Small 3.1/3.2)
GEMMA3_MM: Final = "Gemma3ForConditionalGeneration"
TEXT_TOWERS: Final = {GEMMA3_MM: "language_model.", "Mistral3ForConditionalGeneration": "language_model."}
MISTRAL: Final = "MistralForCausalLM"
MINISTRAL: Final = "MinistralForCausalLM"  # Mistral's tensors, windowed on the layers layer_types names
SMOLLM3: Final = "SmolLM3ForCausalLM"
STARCODER2: Final = "Starcoder2ForCausalLM"
GLM4: Final = "Glm4ForCausalLM"  # q/k pairs interleaved as Loom's: no rows reordered; sandwich norms
SEED_OSS: Final = "SeedOssForCausalLM"  # Llama's tensors, q/k/v biases (attention_bias), none on o
HELIUM: Final = "HeliumForCausalLM"  # Llama's tensors, q/k pairs interleaved
ERNIE45: Final = "Ernie4_5ForCausalLM"  # Llama's tensors, q/k pairs interleaved
GRANITE: Final = "GraniteForCausalLM"  # Llama's tensors; embedding, residual, attention and logit scales
INTERLEAVED = (GLM4, HELIUM, ERNIE45)  # families rotating pairs (x_2i, x_2i+1), as Loom: q/k rows kept
LAYER_TYPES = ("full_attention", "sliding_attention")  # config.json's layer_types Loom reads
LLAMA_TENSORS = (
    "MistralForCausalLM",
    MINISTRAL,
    PHI3,
    SMOLLM3,
    HELIUM,
    ERNIE45,
)  # Llama's tensors under other names or config fields


# families users ask for, and what Loom's model lacks to run them (named in the refusal)
MISSING: dict[str, str] = {
    "GptOssForCausalLM": "attention sinks and biased, clamped SwiGLU experts",
    "DeepseekV3ForCausalLM": "multi-head latent attention",
    "DeepseekV2ForCausalLM": "multi-head latent attention",
    "Qwen2MoeForCausalLM": "a gated shared expert",
    "Qwen3NextForCausalLM": "linear-attention layers",
    "Llama4ForCausalLM": "chunked attention and a shared expert",
    "Llama4ForConditionalGeneration": "a vision encoder",
    "Mistral3ForConditionalGeneration": "a vision encoder",
    "CohereForCausalLM": "attention and MLP in parallel",
    "Cohere2ForCausalLM": "attention and MLP in parallel",
    "PhiForCausalLM": "attention and MLP in parallel",
    "GPTNeoXForCausalLM": "attention and MLP in parallel",
    "FalconForCausalLM": "attention and MLP in parallel",
    "MambaForCausalLM": "state-space layers",
    "Mamba2ForCausalLM": "state-space layers",
    "FalconH1ForCausalLM": "state-space layers",
    "Lfm2ForCausalLM": "convolution layers",
    "GraniteMoeHybridForCausalLM": "state-space layers",
}
# transformers' own defaults (its config classes') for the config.json fields Loom reads, by family: a
# field a config.json leaves out means these there, not one family's values for all
# (tests/test_hf_families.py compares them with the installed transformers)
_LLAMA_DEFAULTS: dict[str, object] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "num_key_value_heads": None,  # None: one per query head
    "head_dim": None,  # None: hidden_size / num_attention_heads
    "tie_word_embeddings": False,
    "num_local_experts": 1,
    "num_experts_per_tok": 2,
}
_QWEN_DEFAULTS = _LLAMA_DEFAULTS | {
    "max_position_embeddings": 32768,
    "num_key_value_heads": 32,
    "sliding_window": 4096,
    "use_sliding_window": False,
    "max_window_layers": 28,
}
_GEMMA_DEFAULTS = _LLAMA_DEFAULTS | {
    "max_position_embeddings": 8192,
    "num_key_value_heads": 16,
    "head_dim": 256,
    "tie_word_embeddings": True,
    "hidden_act": "gelu_pytorch_tanh",
}
FAMILY_DEFAULTS: Final[dict[str, dict[str, object]]] = {
    "LlamaForCausalLM": _LLAMA_DEFAULTS,
    "MistralForCausalLM": _LLAMA_DEFAULTS
    | {"max_position_embeddings": 131072, "num_key_value_heads": 8, "sliding_window": 4096},
    "Qwen2ForCausalLM": _QWEN_DEFAULTS,
    "Qwen3ForCausalLM": _QWEN_DEFAULTS | {"head_dim": 128},
    "MixtralForCausalLM": _LLAMA_DEFAULTS
    | {
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "max_position_embeddings": 131072,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "sliding_window": None,
    },
    "Phi3ForCausalLM": _LLAMA_DEFAULTS
    | {
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "sliding_window": None,
    },
    "Qwen3MoeForCausalLM": {k: v for k, v in _QWEN_DEFAULTS.items() if k != "max_window_layers"}
    | {"num_key_value_heads": 4, "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False},
    "Olmo2ForCausalLM": _LLAMA_DEFAULTS | {"rms_norm_eps": 1e-5},
    OLMO3: _LLAMA_DEFAULTS | {"rms_norm_eps": 1e-5, "rope_theta": 500000.0, "sliding_window": 4096},
    STARCODER2: {k: v for k, v in _LLAMA_DEFAULTS.items() if k != "rms_norm_eps"}
    | {
        "norm_epsilon": 1e-5,
        "max_position_embeddings": 4096,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "use_bias": True,
        "hidden_act": "gelu_pytorch_tanh",
        "sliding_window": None,
    },
    GLM4: _LLAMA_DEFAULTS
    | {
        "rms_norm_eps": 1.5625e-07,
        "max_position_embeddings": 131072,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
    },
    EXAONE4: _LLAMA_DEFAULTS
    | {
        "rms_norm_eps": 1e-5,
        "num_key_value_heads": 32,
        "sliding_window": 4096,
        "sliding_window_pattern": 4,
    },
    OLMOE: _LLAMA_DEFAULTS
    | {
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "clip_qkv": None,
    },
    GRANITE: _LLAMA_DEFAULTS
    | {
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "logits_scaling": 1.0,
        "attention_multiplier": 1.0,
    },
    SEED_OSS: _LLAMA_DEFAULTS
    | {
        "max_position_embeddings": 524288,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "attention_bias": True,
        "attention_out_bias": False,
    },
    HELIUM: _LLAMA_DEFAULTS
    | {
        "rms_norm_eps": 1e-8,
        "rope_theta": 100000.0,
        "max_position_embeddings": 4096,
        "num_key_value_heads": 20,
        "head_dim": 128,
    },
    ERNIE45: _LLAMA_DEFAULTS
    | {
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "tie_word_embeddings": True,
        "use_bias": False,
    },
    SMOLLM3: _LLAMA_DEFAULTS
    | {
        "rope_theta": 2000000.0,
        "max_position_embeddings": 32768,
        "num_key_value_heads": 4,
        "tie_word_embeddings": True,
        "sliding_window": None,
        "use_sliding_window": False,
        "no_rope_layer_interval": 4,
    },
    GEMMA: _GEMMA_DEFAULTS,
    GEMMA2: _GEMMA_DEFAULTS
    | {
        "num_key_value_heads": 4,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    GEMMA3: _GEMMA_DEFAULTS
    | {
        "max_position_embeddings": 131072,
        "num_key_value_heads": 4,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "rope_theta": 1e6,  # full-attention layers; the sliding ones: rope_local_base_freq
        "rope_local_base_freq": 10000.0,
        "sliding_window_pattern": 6,
    },
}
FAMILY_DEFAULTS[MINISTRAL] = FAMILY_DEFAULTS["MistralForCausalLM"]  # MinistralConfig's are Mistral's


# config.json's model_type -> its family, for a config without ``architectures`` (AutoModel reads it)
MODEL_TYPES: Final = {
    "llama": LLAMA,
    "mistral": "MistralForCausalLM",
    "ministral": MINISTRAL,
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": QWEN3MOE,
    "phi3": PHI3,
    "olmo2": OLMO2,
    "olmo3": OLMO3,
    "smollm3": SMOLLM3,
    "starcoder2": STARCODER2,
    "glm4": GLM4,
    "granite": GRANITE,
    "olmoe": OLMOE,
    "exaone4": EXAONE4,
    "seed_oss": SEED_OSS,
    "helium": HELIUM,
    "ernie4_5": ERNIE45,
    "gpt2": GPT2,
    "gemma": GEMMA,
    "gemma2": GEMMA2,
    "gemma3_text": GEMMA3,
}


def architecture(raw: dict) -> str:
    """The family of a ``config.json``: its first ``architectures`` entry, else its ``model_type``'s
    (:data:`MODEL_TYPES`), else ``"?"``."""
    names = raw.get("architectures")
    if isinstance(names, str):
        return names
    if isinstance(names, list) and names and isinstance(names[0], str):
        return names[0]
    return MODEL_TYPES.get(raw.get("model_type"), "?")  # type: ignore[arg-type]


def hf_field(raw: dict, name: str) -> typing.Any:
    """``config.json``'s ``name``, or the family's default (:data:`FAMILY_DEFAULTS`) where it is left out."""
    if name in raw:
        return raw[name]
    return FAMILY_DEFAULTS.get(architecture(raw), _LLAMA_DEFAULTS).get(name)


def sliding_window(raw: dict, arch: str) -> tuple[int, str] | None:
    """(w, the windowed layers: ``all`` or their indices) as transformers applies the family's attention
    window, or None: Mixtral and Phi-3 read ``sliding_window`` alone (every layer), Mistral too unless
    it has ``layer_types`` (transformers then reads it as a Ministral: those layers), Gemma 2
    on the layers ``layer_types`` names (by default every other one, from layer 0), Gemma 3 too (by
    default all but every ``sliding_window_pattern``-th); Qwen's families
    only with ``use_sliding_window``, Qwen2 and Qwen3 then on the layers ``layer_types`` names (by
    default those from ``max_window_layers`` on); Llama and OLMo-2 have no window (a
    ``sliding_window`` in their config.json is ignored, as transformers ignores it)."""
    if arch not in FAMILY_DEFAULTS or "sliding_window" not in FAMILY_DEFAULTS[arch]:
        return None
    window = _opt_int("sliding_window", hf_field(raw, "sliding_window"), null="no window")
    if "use_sliding_window" in FAMILY_DEFAULTS[arch] and not _bool(
        "use_sliding_window", hf_field(raw, "use_sliding_window")
    ):
        return None
    if window is None:
        return None
    n = _int("num_hidden_layers", raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is not None and (
        not isinstance(types, list) or len(types) != n or not all(isinstance(t, str) for t in types)
    ):
        raise HFError(f"{CONFIG}: {_WRONG}: layer_types, want one string per layer ({n})")
    odd = sorted({t for t in types or () if t not in LAYER_TYPES})
    if odd:
        raise HFError(
            f"{CONFIG}: layer_types holds {', '.join(map(repr, odd))}; Loom: {', '.join(LAYER_TYPES)}"
        )
    if types is None and arch == GEMMA2:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    elif types is None and arch == GEMMA3:  # every sliding_window_pattern-th layer full
        pattern = _int("sliding_window_pattern", hf_field(raw, "sliding_window_pattern"))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    elif types is None and arch == EXAONE4:  # every sliding_window_pattern-th layer full
        every = _int("sliding_window_pattern", hf_field(raw, "sliding_window_pattern"))
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    elif types is None and arch == OLMO3:  # every fourth layer full
        types = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
    elif types is None and arch == SMOLLM3:  # its NoPE layers
        nope = nope_layers(raw)
        types = ["sliding_attention" if i in nope else "full_attention" for i in range(n)]
    elif types is None and "max_window_layers" in FAMILY_DEFAULTS[arch]:
        first = _int("max_window_layers", hf_field(raw, "max_window_layers"), low=0)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    elif (
        arch not in (GEMMA2, GEMMA3, MISTRAL, MINISTRAL, OLMO3, SMOLLM3, EXAONE4)
        and "max_window_layers" not in FAMILY_DEFAULTS[arch]
    ):
        types = None  # Mixtral, Phi-3, Qwen3-MoE: every layer, whatever layer_types says
    if types is None:
        return window, "all"
    layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if not layers:
        return None
    return window, "all" if len(layers) == n else ",".join(map(str, layers))


_WRONG = "a field has a value of the wrong type"


def nope_layers(raw: dict) -> list[int]:
    """SmolLM3's layers without RoPE: those ``no_rope_layers`` marks 0 (1: RoPE), by default every
    ``no_rope_layer_interval``-th."""
    n = _int("num_hidden_layers", raw["num_hidden_layers"])
    marks = raw.get("no_rope_layers")
    if marks is None:
        every = _int("no_rope_layer_interval", hf_field(raw, "no_rope_layer_interval"))
        return [i for i in range(n) if (i + 1) % every == 0]
    if (
        not isinstance(marks, list)
        or len(marks) != n
        or any(m not in (0, 1) or isinstance(m, float) for m in marks)
    ):
        raise HFError(
            f"{CONFIG}: {_WRONG}: no_rope_layers = {json.dumps(marks)[:80]}, want one 0 or 1 per layer ({n})"
        )
    return [i for i, m in enumerate(marks) if not m]


def _int(field: str, value: object, low: int = 1, null: str = "") -> int:
    """``config.json``'s ``field`` = ``value`` as an integer >= ``low``: a JSON integer (or a float of
    an integral value, 4096.0), never a bool, a string or a fraction; else one line naming the field,
    its value and what it allows (``null``: what a null means, where :func:`_opt_int` allows one)."""
    want = f"an integer >= {low}" + (f", or null ({null})" if null else "")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise HFError(f"{CONFIG}: {_WRONG}: {field} = {json.dumps(value)}, want {want}")
    if value < low:
        raise HFError(f"{CONFIG}: {field} = {value} is out of range: want {want}")
    return value


def _opt_int(field: str, value: object, low: int = 1, null: str = "") -> int | None:
    """:func:`_int`, with a null (None) kept: ``null`` says what it means."""
    return None if value is None else _int(field, value, low, null)


def _float(field: str, value: object) -> float:
    """``config.json``'s ``field`` = ``value`` as a float: a JSON number (not a bool or a string), else
    one line naming the field (bounds and finiteness: :func:`loom.config.validate_shape`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HFError(f"{CONFIG}: {_WRONG}: {field} = {json.dumps(value)}, want a number")
    return float(value)


def _bool(field: str, value: object) -> bool:
    """``config.json``'s ``field`` = ``value``: true or false (null: false), never a string or a number
    read by its truth (``"false"`` is true in Python)."""
    if value is not None and not isinstance(value, bool):
        raise HFError(f"{CONFIG}: {_WRONG}: {field} = {json.dumps(value)}, want true or false")
    return bool(value)


CONFIG, INDEX, SINGLE = "config.json", "model.safetensors.index.json", "model.safetensors"


class HFError(ValueError):
    """A Hugging Face directory Loom cannot read as given; the message names the file or field."""


def _is_gpt2(cfg: ModelConfig) -> bool:
    """GPT-2's tensors exactly: every GPT-2 field set, and nothing GPT-2 lacks (``bias`` alone on a
    RoPE model is Llama's attention_bias + mlp_bias)."""
    fields = {
        "positions = learned": cfg.positions == "learned",
        "norm = layernorm": cfg.norm == "layernorm",
        "mlp = gelu or gelu_tanh": not cfg.gated_mlp,
        "bias = true": cfg.bias,
    }
    if not any(v for k, v in fields.items() if k != "bias = true"):
        return False
    unmet = {  # what else GPT-2 needs -> whether the model breaks it
        "n_kv_heads = n_heads": cfg.n_kv_heads != cfg.n_heads,
        "qkv_bias = false": cfg.qkv_bias,
        "qk_norm = false": cfg.qk_norm,
        "no experts": cfg.moe,
    }
    if not all(fields.values()) or any(unmet.values()):
        have = " and ".join(k for k, v in fields.items() if v)
        lack = [k for k, v in fields.items() if not v] + [k for k, v in unmet.items() if v]
        raise HFError(
            f"model: among the supported Hugging Face families only GPT2LMHeadModel holds {have}, and it also "
            f"needs {', '.join(lack)}"
        )
    return True


def moe_export_problem(moe: MoEConfig, family: str = "MixtralForCausalLM") -> str | None:
    """Why a MoE model trained with these routing options is not a ``family`` (softmax over the
    experts, no shared experts, no selection bias; Mixtral: top-k renormalized, Qwen3-MoE: either,
    its ``norm_topk_prob``), or None."""
    if moe.score != "softmax":
        return f"moe.score = {moe.score!r}: {family} routes by a softmax over the experts"
    if not moe.norm_topk and family not in (QWEN3MOE, OLMOE):
        return f"moe.norm_topk = false: {family} renormalizes the top-k routing weights"
    if moe.n_shared_experts:
        return f"moe.n_shared_experts = {moe.n_shared_experts}: {family} has no shared experts"
    if moe.bias_update_rate > 0:
        return f"moe.bias_update_rate > 0: {family} has no expert selection bias"
    return None


def architecture_of(cfg: ModelConfig) -> str:
    """The Hugging Face family of ``cfg``: ``model.hf_architecture``, which must hold exactly its
    tensors (Mistral and Phi-3 hold Llama's), or with ``auto`` the family that does."""
    by_shape = _family_by_shape(cfg)
    named = cfg.hf_architecture
    if named == PHI3 and cfg.rope_scaling and cfg.rope_kind != "longrope":
        raise HFError(
            f"model.hf_architecture: {PHI3} scales RoPE by longrope only, not rope_kind = {cfg.rope_kind}; set "
            "it to auto or LlamaForCausalLM"
        )
    if cfg.positions == "rope" and cfg.rope_fraction != 1:  # only Phi-3 and GLM-4 rotate part of a head
        if named in ("auto", PHI3) and by_shape in (LLAMA, "MistralForCausalLM"):
            return _phi3_rope(cfg)
        if named in ("auto", GLM4) and by_shape == GLM4:
            return GLM4
        raise HFError(
            f"model.rope_fraction = {cfg.rope_fraction}: among the supported Hugging Face families only {PHI3} "
            f"(Llama's tensors) and {GLM4} (sandwich norms) rotate part of a head (this model's tensors are "
            f"{by_shape}'s)"
        )
    if cfg.nope_layer_set():  # only SmolLM3 and EXAONE 4 have layers without RoPE
        plain = by_shape in (LLAMA, "MistralForCausalLM") and not (cfg.bias or cfg.qkv_bias)
        if named in ("auto", SMOLLM3) and plain:
            return SMOLLM3
        if by_shape == EXAONE4 and named in ("auto", EXAONE4):
            return _exaone4_nope(cfg)
        raise HFError(
            f"model.nope_layers: among the supported Hugging Face families only {SMOLLM3} has layers "
            f"without RoPE, and it holds Llama's tensors without biases (this model's are {by_shape}'s)"
        )
    if by_shape == EXAONE4 and named in ("auto", EXAONE4):
        return _exaone4_nope(cfg)
    if named == "auto" or named == by_shape:
        return by_shape
    if by_shape == "MistralForCausalLM" and named == SMOLLM3:  # Llama's tensors windowed
        return named
    if by_shape == LLAMA and named in (
        () if cfg.bias else (QWEN2, SEED_OSS) if cfg.qkv_bias else LLAMA_TENSORS
    ):
        return named
    if by_shape == "MistralForCausalLM" and named in (PHI3, MINISTRAL):  # Llama's tensors windowed
        return named
    if by_shape == OLMO2 and named == OLMO3:  # OLMo 2's block: an OLMo 3 whose windows hide nothing
        return named
    raise HFError(
        f"model.hf_architecture: {named} cannot hold this model's tensors ({by_shape} does); "
        "set it to auto or to that family"
    )


def _phi3_rope(cfg: ModelConfig) -> str:
    """Phi-3, for a model rotating part of each head: its RoPE scaled by longrope alone."""
    if cfg.rope_scaling and cfg.rope_kind != "longrope":
        raise HFError(
            f"model.rope_fraction = {cfg.rope_fraction}: only {PHI3} rotates part of a head, and it scales RoPE "
            f"by longrope only, not rope_kind = {cfg.rope_kind}"
        )
    return PHI3


def zero_tensors(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Loom name -> (HF name, shape) of each tensor the family holds beside that Loom tensor and
    Loom's model lacks, always zero: Llama's ``o_proj.bias`` when its ``attention_bias`` carries
    Loom's q/k/v biases (Qwen2's, with no o bias), its ``up_proj.bias`` when ``mlp_bias`` carries
    ``model.bias``'s (SwiGLU's up projection w3 has none). Export writes zeros; import requires zeros."""
    if not (cfg.qkv_bias or cfg.bias) or architecture_of(cfg) != LLAMA:
        return {}
    if cfg.bias:
        return {
            f"layers.{i}.feed_forward.w3.weight": (
                f"model.layers.{i}.mlp.up_proj.bias",
                (cfg.resolved_ffn_dim(),),
            )
            for i in range(cfg.n_layers)
        }
    return {
        f"layers.{i}.attention.wo.weight": (f"model.layers.{i}.self_attn.o_proj.bias", (cfg.dim,))
        for i in range(cfg.n_layers)
    }


def _gemma_family(cfg: ModelConfig) -> str | None:
    """Gemma's fields (a (1 + w) RMSNorm, sqrt(h)-scaled embeddings, the gated GELU-tanh MLP) make a
    Gemma, with sandwich norms a Gemma 2 (which alone has the scale and soft-caps), with per-head q/k
    norms as well a Gemma 3; None: none of them.
    A model with some of them, or with what neither holds, is refused naming them."""
    gemma = {
        "norm_offset = true": cfg.norm_offset,
        "embed_scale = true": cfg.embed_scale,
        "mlp = geglu_tanh": cfg.mlp == "geglu_tanh",
    }
    gemma2 = {
        "norm_placement = sandwich": cfg.norm_placement == "sandwich",
        "rope_local_theta": cfg.rope_local_theta > 0,
        "attn_scale": cfg.attn_scale > 0,
        "attn_softcap": cfg.attn_softcap > 0,
        "logit_softcap": cfg.logit_softcap > 0,
    }
    if not any(gemma.values()) and not any(gemma2.values()):
        return None
    family = GEMMA2 if gemma2["norm_placement = sandwich"] else GEMMA
    if family == GEMMA2 and cfg.qk_norm:  # Gemma 3: Gemma 2's block with per-head q/k norms
        family = GEMMA3
    unmet = {
        "norm = rmsnorm": cfg.norm != "rmsnorm",
        "positions = rope": cfg.positions != "rope",
        "no biases": cfg.bias or cfg.qkv_bias,
        "qk_norm = false": cfg.qk_norm and family != GEMMA3,
        "qk_norm_scope = head": cfg.qk_norm and cfg.qk_norm_scope != "head",
        "rope_local_theta = 0 (Gemma 3's alone)": cfg.rope_local_theta > 0 and family != GEMMA3,
        "attn_softcap = 0 (Gemma 3 applies none)": cfg.attn_softcap > 0 and family == GEMMA3,
        "no experts": cfg.moe,
    }
    if not all(gemma.values()) or any(unmet.values()) or (family == GEMMA and any(gemma2.values())):
        have = " and ".join(k for k, v in (gemma | gemma2).items() if v)
        lack = [k for k, v in gemma.items() if not v] + [k for k, v in unmet.items() if v]
        if family == GEMMA and any(gemma2.values()):
            lack.append("norm_placement = sandwich (Gemma 2)")
        raise HFError(
            f"model: among the supported Hugging Face families only {family} holds {have}, and it also "
            f"needs {', '.join(lack)}"
        )
    return family


def _starcoder2_family(cfg: ModelConfig) -> str | None:
    """StarCoder 2's block: RoPE with LayerNorm and a GELU MLP (biases on every linear but the head, or
    none); None: a RoPE model with neither, or no RoPE (GPT-2's). What else it has is refused."""
    if cfg.positions != "rope" or (cfg.norm != "layernorm" and cfg.gated_mlp):
        return None
    unmet = {
        "norm = layernorm": cfg.norm != "layernorm",
        "mlp = gelu_tanh or gelu": cfg.gated_mlp,
        "q/k/v biases only with bias = true": cfg.qkv_bias and not cfg.bias,
        "qk_norm = false": cfg.qk_norm,
        "no experts": cfg.moe,
        "norm_placement = pre": cfg.norm_placement != "pre",
        "none of Gemma's fields": cfg.norm_offset or cfg.embed_scale or cfg.attn_scale > 0 or cfg.attn_softcap > 0
        or cfg.logit_softcap > 0,
    }  # fmt: skip
    if any(unmet.values()):
        raise HFError(
            f"model: a RoPE model with LayerNorm or a GELU MLP is a {STARCODER2} among the supported Hugging Face "
            f"families, which also needs {', '.join(k for k, v in unmet.items() if v)}"
        )
    return STARCODER2


def _glm4_family(cfg: ModelConfig) -> str | None:
    """GLM-4's block: a norm before and after attention and MLP (sandwich) without Gemma's fields (the
    (1 + w) norm, scaled embeddings, GeGLU, the scale, caps, a local base, q/k norms); None: not it.
    Its q/k/v biases (without o's) and part of a head rotated are its own; experts or every bias refused."""
    gemma = (
        cfg.norm_offset or cfg.embed_scale or cfg.mlp != "swiglu" or cfg.attn_scale > 0 or cfg.attn_softcap > 0
        or cfg.logit_softcap > 0 or cfg.rope_local_theta > 0 or cfg.qk_norm
    )  # fmt: skip
    if cfg.norm_placement != "sandwich" or gemma:
        return None
    if cfg.moe or cfg.bias or cfg.norm != "rmsnorm":
        raise HFError(
            f"model: norm_placement = sandwich without Gemma's fields is a {GLM4}, which has no experts, no "
            "biases but q/k/v's and an RMSNorm"
        )
    return GLM4


def _granite_family(cfg: ModelConfig) -> str | None:
    """Granite's scales (``embed_multiplier``, ``residual_multiplier``, ``logit_divisor``, or an
    ``attn_scale`` without Gemma's other fields) on Llama's block make a Granite; None: none of them.
    What Granite lacks beside them is refused naming it."""
    scales = cfg.embed_multiplier != 1 or cfg.residual_multiplier != 1 or cfg.logit_divisor != 1
    gemma = cfg.norm_offset or cfg.embed_scale or cfg.mlp != "swiglu" or cfg.norm_placement != "pre"
    if not scales and not (
        cfg.attn_scale > 0 and not gemma and not cfg.attn_softcap and not cfg.logit_softcap
    ):
        return None
    unmet = {
        "a Llama block (rmsnorm, SwiGLU, pre norms, no Gemma fields)": gemma or cfg.norm != "rmsnorm",
        "no biases": cfg.bias or cfg.qkv_bias,
        "no q/k norms": cfg.qk_norm,
        "no experts": cfg.moe,
        "no soft-caps": cfg.attn_softcap > 0 or cfg.logit_softcap > 0,
        "no window": cfg.sliding_window > 0,
    }
    if any(unmet.values()):
        raise HFError(
            f"model: embed_multiplier, residual_multiplier, logit_divisor and attn_scale make a {GRANITE} among "
            f"the supported Hugging Face families, which also needs {', '.join(k for k, v in unmet.items() if v)}"
        )
    return GRANITE


def _exaone4_nope(cfg: ModelConfig) -> str:
    """EXAONE 4, whose layers without RoPE are exactly those ``window_layers`` leaves out (its
    full-attention ones; with no window, none)."""
    full = frozenset(range(cfg.n_layers)) - cfg.local_layers() if cfg.nope_layer_set() else frozenset()
    if cfg.nope_layer_set() != full or (cfg.sliding_window and not full):
        raise HFError(
            f"model.nope_layers: {EXAONE4} turns no RoPE on exactly its layers without a window (here "
            f"{','.join(map(str, sorted(full))) or 'none'}), got {cfg.nope_layers!r}"
        )
    return EXAONE4


def _olmo_family(cfg: ModelConfig) -> str | None:
    """OLMo's block (norms after attention and MLP, q/k norms over all heads) makes an OLMo 2, with a
    sliding window or a second RoPE table for its sliding layers an OLMo 3; None: not OLMo's block.
    Part of it, or what neither holds, is refused naming the fields."""
    olmo = (cfg.norm_placement == "post", cfg.qk_norm and cfg.qk_norm_scope == "all")
    if not any(olmo):
        return None
    if olmo[0] and cfg.qk_norm and cfg.qk_norm_scope == "head" and not cfg.moe:  # EXAONE 4's per-head norms
        if (
            cfg.qkv_bias
            or cfg.bias
            or cfg.mlp != "swiglu"
            or cfg.norm_offset
            or cfg.attn_softcap
            or cfg.logit_softcap
        ):
            raise HFError(
                f"model: {EXAONE4} (norms after attention and MLP, per-head q/k norms) has no biases or Gemma fields"
            )
        return EXAONE4
    if cfg.moe and cfg.norm_placement == "pre" and olmo[1]:  # OLMoE: Llama's block, OLMo's q/k norms
        if cfg.qkv_bias or cfg.bias or cfg.mlp != "swiglu" or cfg.sliding_window or cfg.norm_offset:
            raise HFError(
                f"model: {OLMOE} (experts, q/k norms over all heads) has no biases, window or Gemma fields"
            )
        return OLMOE
    other = {
        "q/k/v biases": cfg.qkv_bias or cfg.bias,
        "experts": cfg.moe,
        "Gemma's fields": cfg.norm_offset or cfg.embed_scale or cfg.attn_scale > 0 or cfg.attn_softcap > 0,
        "a logit cap": cfg.logit_softcap > 0,
        f"mlp = {cfg.mlp}": cfg.mlp != "swiglu",
    }
    if not all(olmo) or any(other.values()):
        has = ", ".join(k for k, v in other.items() if v) or "part of it"
        raise HFError(
            f"model: {OLMO2} and {OLMO3} need norm_placement = post with qk_norm = true, qk_norm_scope = all, "
            f"a SwiGLU MLP and none of q/k/v biases, experts, Gemma's fields or a logit cap (this model has "
            f"{has}); no other Hugging Face family holds OLMo's block"
        )
    return OLMO3 if cfg.sliding_window or cfg.rope_local_theta else OLMO2


def _family_by_shape(cfg: ModelConfig) -> str:
    if (starcoder := _starcoder2_family(cfg)) is not None:
        return starcoder
    if (glm := _glm4_family(cfg)) is not None:
        return glm
    if (granite := _granite_family(cfg)) is not None:
        return granite
    if _is_gpt2(cfg):
        return GPT2
    if (olmo := _olmo_family(cfg)) is not None:
        return olmo
    if (gemma := _gemma_family(cfg)) is not None:
        return gemma
    if cfg.bias:  # Llama with attention_bias and mlp_bias: every linear but the head (up_proj's zero)
        if cfg.qk_norm or cfg.moe:
            raise HFError(
                "model: bias = true on a RoPE model goes out as a Llama with attention_bias and mlp_bias, "
                "which has no q/k norms or experts; no other supported Hugging Face family holds it"
            )
        return LLAMA
    if cfg.qk_norm and not cfg.qkv_bias:
        return QWEN3MOE if cfg.moe else "Qwen3ForCausalLM"
    if cfg.qkv_bias and not cfg.qk_norm and not cfg.moe:  # attention_bias, zero o biases (zero_tensors)
        return LLAMA  # not Qwen2: transformers' AutoTokenizer gives a qwen2 Qwen's pre-tokenizer whatever it ships
    if cfg.qkv_bias:
        raise HFError(
            "model: no supported Hugging Face family has this combination of q/k/v biases, q/k norms "
            "and experts"
        )
    if cfg.sliding_window and not cfg.moe:  # Llama's tensors with a window on every layer: a Mistral
        return "MistralForCausalLM"
    return "MixtralForCausalLM" if cfg.moe else LLAMA
