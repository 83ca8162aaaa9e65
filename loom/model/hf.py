"""Hugging Face checkpoints in and out of Loom's model, without ``transformers`` (JSON + safetensors).

Families: ``LlamaForCausalLM``, ``MistralForCausalLM`` (the same tensors; Mistral's sliding window
only when every sequence fits in it), ``Qwen2ForCausalLM`` (q/k/v biases: ``model.qkv_bias``; also a
Llama with ``attention_bias`` whose o biases are zero, :func:`zero_tensors`, as auto exports it; a
Llama with ``attention_bias`` and ``mlp_bias``, up's zero: ``model.bias`` on a RoPE model) and
``Qwen3ForCausalLM`` (per-head q/k RMSNorm: ``model.qk_norm``) and
``MixtralForCausalLM`` (into Loom's mixture of experts: the router, and each expert's w1/w3/w2
stacked into the (E, ...) weights), ``Qwen3MoeForCausalLM`` (Qwen3's attention, Mixtral's
experts under ``mlp.`` as ``gate_proj``/``up_proj``/``down_proj``, of width ``moe_intermediate_size``;
top-k renormalized or not: ``norm_topk_prob`` -> ``moe.norm_topk``), ``Olmo2ForCausalLM`` (norms
after attention and MLP: ``model.norm_placement = post``, its ``post_attention_layernorm`` and
``post_feedforward_layernorm`` in ``attention_norm`` and ``ffn_norm``; q/k RMSNorm over all heads at
once, a·d and k·d wide: ``model.qk_norm_scope = all``), ``Phi3ForCausalLM`` (Llama's
tensors, q/k/v and gate/up fused: ``model.hf_architecture`` records the family, which export writes) and ``GPT2LMHeadModel`` (``norm =
layernorm``, ``mlp = gelu_tanh``, ``positions = learned``, ``bias``). Every family but GPT-2 may give a ``head_dim`` d
with a·d != h (Mistral-Nemo: h = 5120, a = 32 heads, d = 128): ``model.attn_head_dim``, the width
of the q/k/v/o projections (a·d and k·d) and of RoPE (d). Names map one to one::

    model.embed_tokens.weight                 tok_embeddings.weight
    model.layers.i.input_layernorm            layers.i.attention_norm
    model.layers.i.self_attn.{q,k,v,o}_proj   layers.i.attention.w{q,k,v,o}   (weight, bias)
    model.layers.i.self_attn.{q,k}_norm       layers.i.attention.{q,k}_norm
    model.layers.i.post_attention_layernorm   layers.i.ffn_norm
    model.layers.i.mlp.{gate,up,down}_proj    layers.i.feed_forward.w{1,3,2}
    model.norm.weight, lm_head.weight         norm.weight, output.weight

Phi-3 fuses rows: ``self_attn.qkv_proj`` ((a+2k)·d, h) holds w{q,k,v} in rows [0, a·d), [a·d, (a+k)·d),
[(a+k)·d, (a+2k)·d); ``mlp.gate_up_proj`` (2f, h) holds w1 in [0, f) and w3 in [f, 2f) (a
:class:`Mapping`'s ``part``: import reads that row range, export concatenates the parts).

Rotary layout: Hugging Face rotates the halves (x_j, x_{j+d/2}) of each head, Loom the pairs
(x_{2i}, x_{2i+1}), with the same frequencies theta^(-2i/d). The q and k projections are the same
function once each head's output rows (and biases, and the q/k norm weights) are reordered:
Loom row 2i+c = HF row i + c·d/2 (:func:`to_loom_rows`; :func:`to_hf_rows` is its inverse).

GPT-2 (names under ``transformer.``, or none in the original checkpoints)::

    wte.weight, wpe.weight                    tok_embeddings.weight, pos_embeddings.weight
    h.i.ln_1, h.i.ln_2, ln_f                  layers.i.attention_norm, layers.i.ffn_norm, norm   (weight, bias)
    h.i.attn.c_attn   (h, 3h)                 layers.i.attention.w{q,k,v}: columns [j·h, (j+1)·h), transposed
    h.i.attn.c_proj, h.i.mlp.c_fc, c_proj     layers.i.attention.wo, layers.i.feed_forward.w{1,2}   (transposed)

GPT-2's ``Conv1D`` stores a weight as (in, out), the transpose of a Linear's (out, in).

Every read is of a box (:meth:`Reader.read`): a rank reads with ``safetensors``' ``get_slice`` only
the rows and columns (and experts) its parameters hold, never a whole tensor it has a piece of.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import typing
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final, cast

import torch

from loom.config import ModelConfig, MoEConfig
from loom.config.sections import HFArchitecture

SUPPORTED: tuple[str, ...] = typing.get_args(HFArchitecture)[1:]  # model.hf_architecture's values but auto
GPT2: Final = "GPT2LMHeadModel"
PHI3: Final = "Phi3ForCausalLM"
QWEN3MOE: Final = "Qwen3MoeForCausalLM"
OLMO2: Final = "Olmo2ForCausalLM"
LLAMA: Final = "LlamaForCausalLM"
QWEN2: Final = "Qwen2ForCausalLM"
LLAMA_TENSORS = ("MistralForCausalLM", PHI3)  # Llama's tensors under other names or config fields
VOCAB_TENSORS = ("tok_embeddings.weight", "output.weight")  # V rows; padded to model.pad_vocab_to in Loom
MISSING = {  # families users ask for, and what Loom's model lacks to run them
    "Gemma2ForCausalLM": "attention and final logit soft-capping, norms after attention and MLP as well as "
    "before, alternating sliding-window layers, (1 + w) RMSNorm, sqrt(h)-scaled embeddings",
    "Gemma3ForCausalLM": "norms after attention and MLP as well as before, alternating sliding-window layers "
    "with their own RoPE base, (1 + w) RMSNorm, sqrt(h)-scaled embeddings",
    "GemmaForCausalLM": "a gated GELU MLP, (1 + w) RMSNorm, sqrt(h)-scaled embeddings",
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
    | {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "sliding_window": None},
    "Qwen3MoeForCausalLM": {k: v for k, v in _QWEN_DEFAULTS.items() if k != "max_window_layers"}
    | {"num_key_value_heads": 4, "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False},
    "Olmo2ForCausalLM": _LLAMA_DEFAULTS | {"rms_norm_eps": 1e-5},
}


# config.json's model_type -> its family, for a config without ``architectures`` (AutoModel reads it)
MODEL_TYPES: Final = {
    "llama": LLAMA,
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": QWEN3MOE,
    "phi3": PHI3,
    "olmo2": OLMO2,
    "gpt2": GPT2,
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
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


def sliding_window(raw: dict, arch: str) -> int | None:
    """The attention window transformers applies to some layer of this family, or None: Mistral,
    Mixtral and Phi-3 read ``sliding_window`` alone; Qwen's families only with ``use_sliding_window``,
    Qwen2 and Qwen3 then on the layers ``layer_types`` names (by default those from
    ``max_window_layers`` on); Llama and OLMo-2 have no window (a ``sliding_window`` in their
    config.json is ignored, as transformers ignores it)."""
    if arch not in FAMILY_DEFAULTS or "sliding_window" not in FAMILY_DEFAULTS[arch]:
        return None
    window = hf_field(raw, "sliding_window")
    if "use_sliding_window" in FAMILY_DEFAULTS[arch] and not _bool(
        "use_sliding_window", hf_field(raw, "use_sliding_window")
    ):
        return None
    if window is not None and "max_window_layers" in FAMILY_DEFAULTS[arch]:
        first = _int("max_window_layers", hf_field(raw, "max_window_layers"), low=0)
        layers = _int("num_hidden_layers", raw["num_hidden_layers"])
        types = raw.get("layer_types") or [
            "sliding_attention" if i >= first else "full" for i in range(layers)
        ]
        if "sliding_attention" not in types:
            return None
    return _opt_int("sliding_window", window, null="no window")


_WRONG = "a field has a value of the wrong type"


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


GELU = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
}  # HF activation -> model.mlp
CONFIG, INDEX, SINGLE = "config.json", "model.safetensors.index.json", "model.safetensors"


class HFError(ValueError):
    """A Hugging Face directory Loom cannot read as given; the message names the file or field."""


@dataclass(frozen=True)
class HFModel:
    """A local Hugging Face model directory: its architecture, Loom's config for it, its shards."""

    dir: Path
    architecture: str
    config: ModelConfig
    raw: dict  # config.json as read
    files: dict[str, str]  # HF tensor name -> shard file name
    prefix: str = ""  # GPT-2: "transformer." before every name but lm_head's, or "" (original checkpoints)

    @property
    def tokenizer(self) -> Path | None:
        path = self.dir / "tokenizer.json"
        return path if path.is_file() else None


def _rope(raw: dict) -> dict:
    """Loom's RoPE fields for ``config.json``: the base, and Llama 3.1's scaling if present."""
    for key in ("rope_parameters", "rope_scaling"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise HFError(f"{CONFIG}: {_WRONG}: {key} = {json.dumps(raw[key])}, want an object (or null)")
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    # transformers 5 reads rope_parameters, but a rope_scaling (the older key, and what model cards
    # tell users to add for long context) replaces it whole, its base the top-level rope_theta
    merged = scaling or params
    key = "rope_scaling" if scaling else "rope_parameters"
    kind = merged.get("rope_type", merged.get("type", "default"))
    theta = ("rope_theta", hf_field(raw, "rope_theta"))
    if "rope_theta" in merged:
        theta = (f"{key}.rope_theta", merged["rope_theta"])
    out = {"rope_theta": _float(*theta)}
    partial = merged.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):  # Phi-4-mini: RoPE on the first 3/4 of each head
        raise HFError(
            f"{CONFIG}: partial_rotary_factor = {partial!r} is not supported (Loom rotates whole heads: 1.0)"
        )
    if kind == "llama3":
        out |= {
            "rope_scaling": _float(f"{key}.factor", merged["factor"]),
            "rope_low_freq_factor": _float(f"{key}.low_freq_factor", merged["low_freq_factor"]),
            "rope_high_freq_factor": _float(f"{key}.high_freq_factor", merged["high_freq_factor"]),
            "rope_original_len": _int(
                f"{key}.original_max_position_embeddings", merged["original_max_position_embeddings"]
            ),
        }
    elif kind not in (None, "default"):
        field = f"{key}.{'rope_type' if 'rope_type' in merged else 'type'}"
        raise HFError(f"{CONFIG}: {field} = {kind!r} is not supported (Loom: default, llama3)")
    return out


def model_config(raw: dict, max_seq_len: int = 0, fit_window: bool = False) -> ModelConfig:
    """Loom's :class:`ModelConfig` for a ``config.json``; a field Loom cannot honour raises naming it.
    ``max_seq_len``: the longest sequence to prepare RoPE for (0 = ``max_position_embeddings``).
    ``fit_window``: a sliding window shorter than that becomes ``max_seq_len`` (generation, whose
    context Loom keeps within ``max_seq_len``) instead of a refusal."""
    arch = architecture(raw)
    if arch not in SUPPORTED:
        lacks = f" (Loom's model lacks {MISSING[arch]})" if arch in MISSING else ""
        what = (
            f"architectures = {arch!r}"
            if raw.get("architectures")
            else f"model_type = {raw.get('model_type')!r} (no architectures)"
        )
        raise HFError(f"{CONFIG}: {what} is not supported{lacks}; supported: {', '.join(SUPPORTED)}")
    quant = raw.get("quantization_config")
    if quant:  # fp8 with scales, GPTQ, AWQ, bitsandbytes: codes, not values
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise HFError(
            f"{CONFIG}: quantization_config (quant_method = {method!r}) is not supported: Loom loads "
            "unquantized weights (dequantize the model first, e.g. save it in bfloat16)"
        )
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
    checks: list[tuple[str, tuple[object, ...]]] = [
        ("hidden_act", ("silu", "swish", None)),  # transformers: swish is SiLU; every family's default
        ("router_jitter_noise", (0.0, 0, None)),
    ]
    # Qwen2 always has q/k/v biases (and no o bias); Llama's attention_bias adds q/k/v and o biases:
    # with mlp_bias (gate, up, down) too, Loom's model.bias (every linear but the head; up's zero),
    # alone Qwen2's q/k/v biases (o's zero); open_dir checks the zeros (zero_tensors); others: none
    llama_bias = arch == LLAMA and raw.get("attention_bias") is True
    every_bias = llama_bias and raw.get("mlp_bias") is True
    if not qwen2 and not llama_bias:
        checks.append(("attention_bias", (False, None)))
    if not every_bias:
        checks.append(("mlp_bias", (False, None)))
    for field, allowed in checks:
        if raw.get(field) not in allowed:
            raise HFError(f"{CONFIG}: {field} = {raw.get(field)!r} is not supported (Loom: {allowed[0]!r})")
    if arch == QWEN3MOE:  # no dense MLP: intermediate_size may be left out
        n_experts, ffn = _qwen3_moe_experts(raw)
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
    if window is not None and seq > window and fit_window:
        seq = window
    elif window is not None and seq > window:
        raise HFError(
            f"{CONFIG}: sliding_window = {window} is shorter than the sequences ({seq}); Loom "
            "attends to the whole sequence, so it matches only when sequences fit the window"
        )
    return ModelConfig(
        dim=dim,
        n_layers=_int("num_hidden_layers", raw["num_hidden_layers"]),
        n_heads=heads,
        n_kv_heads=kv,
        vocab_size=_int("vocab_size", raw["vocab_size"]),
        max_seq_len=seq,
        **_rope(raw),
        norm_eps=_float("rms_norm_eps", hf_field(raw, "rms_norm_eps")),
        tie_embeddings=_bool("tie_word_embeddings", hf_field(raw, "tie_word_embeddings")),
        qkv_bias=qwen2 or (llama_bias and not every_bias),
        bias=every_bias,
        qk_norm=qwen3 or arch == OLMO2,
        qk_norm_scope="all" if arch == OLMO2 else "head",
        norm_placement="post" if arch == OLMO2 else "pre",
        attn_head_dim=head_dim if head_dim * heads != dim else 0,  # 0: Loom's h / a
        ffn_dim=ffn,
        n_experts=n_experts,
        top_k=_int("num_experts_per_tok", hf_field(raw, "num_experts_per_tok")),
        hf_architecture=arch,  # type: ignore[arg-type]  # one of SUPPORTED, checked above
    )


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


def moe_options(model: HFModel) -> dict[str, object]:
    """The ``[moe]`` settings the directory's routing fixes: Qwen3-MoE's ``norm_topk_prob`` (default
    false) as ``moe.norm_topk``; Mixtral always renormalizes (Loom's default)."""
    return (
        {"norm_topk": _bool("norm_topk_prob", hf_field(model.raw, "norm_topk_prob"))}
        if model.architecture == QWEN3MOE
        else {}
    )


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


@contextmanager
def open_shard(path: Path) -> Iterator[typing.Any]:
    """``safetensors.safe_open`` of one shard (its header only), a damaged or truncated file refused
    as an :class:`HFError` naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        f = safe_open(str(path), "pt")
    except (SafetensorError, OSError) as e:
        raise HFError(
            f"{path}: not a readable safetensors file ({e}); the download may be incomplete"
        ) from None
    with f:
        yield f


def _weight_map(index: Path) -> dict[str, str]:
    """Tensor name -> shard file of ``model.safetensors.index.json``, refused naming it if malformed."""
    try:
        raw = json.loads(index.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"{index}: not valid JSON ({e})") from None
    wm = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) and v for v in wm.values()):
        raise HFError(f"{index}: needs a 'weight_map' object of tensor name -> shard file name")
    for name, file in wm.items():
        if not _inside(file):
            raise HFError(
                f"{index}: weight_map[{name!r}] = {file!r} is not a file inside the model directory; a "
                "shard file name must be a relative path that stays inside it (e.g. 'model-00001-of-00002.safetensors'), "
                "not an absolute path or one that climbs out with '..'"
            )
    return dict(wm)


def _inside(file: str) -> bool:
    """Whether the shard file name ``file`` of a weight_map names a file inside the model directory:
    a relative path (transformers joins it to the directory: a plain file name, or one in a
    subdirectory) that, its '.' and '..' taken by the name alone, never climbs out of it. By the
    name, not by following links: a Hugging Face cache snapshot's shards are links into ``../../blobs``."""
    path = PurePosixPath(file)
    if path.is_absolute():
        return False
    depth = 0
    for part in path.parts:
        depth += -1 if part == ".." else 0 if part == "." else 1
        if depth < 0:
            return False
    return depth > 0


def open_dir(path: str | Path, max_seq_len: int = 0, fit_window: bool = False) -> HFModel:
    """Read ``config.json`` and locate every tensor's shard (``model.safetensors.index.json``, else
    the ``*.safetensors`` files' headers, each checked); nothing is loaded. ``max_seq_len`` and
    ``fit_window``: as :func:`model_config`'s."""
    d = Path(path)
    if not (d / CONFIG).is_file():
        raise HFError(f"{d}: no {CONFIG} (expected a local Hugging Face model directory)")
    try:
        raw = json.loads((d / CONFIG).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"{d / CONFIG}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise HFError(f"{d / CONFIG}: not a JSON object (a Hugging Face config.json holds one)")
    try:
        cfg = model_config(raw, max_seq_len, fit_window)
    except HFError:
        raise
    except KeyError as e:
        raise HFError(f"{d / CONFIG}: has no {e.args[0]!r} (a {architecture(raw)} config holds it)") from None
    except (ValueError, TypeError, AttributeError) as e:  # a type no check above names (model_config's do)
        raise HFError(f"{d / CONFIG}: {_WRONG} ({e})") from None
    if (d / INDEX).is_file():
        files = _weight_map(d / INDEX)
    else:
        shards = sorted(p.name for p in d.glob("*.safetensors"))
        if not shards:
            pickles = sorted(p.name for p in d.glob("pytorch_model*.bin"))
            raise HFError(
                f"{d}: no *.safetensors files"
                + (
                    f" (it holds {pickles[0]}: Loom reads safetensors only, never pickles; convert it with "
                    "transformers' save_pretrained(safe_serialization=True))"
                    if pickles
                    else ""
                )
            )
        files = {}
        for name in shards:
            with open_shard(d / name) as f:
                files.update(dict.fromkeys(f.keys(), name))
    prefix = "transformer." if cfg.positions == "learned" and "transformer.wte.weight" in files else ""
    embedding = prefix + ("wte.weight" if cfg.positions == "learned" else "model.embed_tokens.weight")
    if cfg.tie_embeddings and HEAD in files and embedding in files and _differ(d, files, embedding, HEAD):
        # transformers then loads the stored head untied ("different values, so we will NOT tie them")
        if d not in _UNTIED:
            _UNTIED.add(d)
            logging.getLogger(__name__).warning(
                "%s: %s differs from %s although tie_word_embeddings = true; untied, as transformers "
                "loads it (the stored head is the model's)",
                d,
                HEAD,
                embedding,
            )
        cfg = dataclasses.replace(cfg, tie_embeddings=False)
    shapes = expected_shapes(cfg)
    wanted = {n: m.hf_shape(shapes[lm]) for lm, m in _mappings(cfg, prefix) for n in m.names()}
    zeros = dict(zero_tensors(cfg).values())
    _check_headers(d, files, wanted | zeros)
    _check_zero(d, files, sorted(zeros))
    wanted |= zeros
    unused = sorted(n for n in files.keys() - wanted.keys() if not n.endswith(BUFFERS) and n != HEAD)
    if unused and d not in _UNUSED:  # transformers drops them too ("weights not used"), and says so
        _UNUSED.add(d)
        logging.getLogger(__name__).warning(
            "%s: %d stored tensor(s) that %s does not use, ignored as transformers ignores them: %s%s",
            d,
            len(unused),
            CONFIG,
            ", ".join(unused[:3]),
            " ..." if len(unused) > 3 else "",
        )
    return HFModel(d, architecture(raw), cfg, raw, files, prefix)


HEAD: Final = "lm_head.weight"
_UNTIED: set[Path] = set()  # directories whose untied head was reported (once per process)
_UNUSED: set[Path] = set()  # directories whose unused tensors were reported
# buffers some checkpoints store that no model reads as weights: old Llama conversions' RoPE
# frequencies, the original GPT-2's causal masks (h.i.attn.bias, h.i.attn.masked_bias)
BUFFERS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def _check_zero(d: Path, files: dict[str, str], names: list[str]) -> None:
    """Each of ``names`` (:func:`zero_tensors`' HF names, one vector per layer) holds only zeros, else
    an error naming it: Loom's model has no such tensor to put other values in."""
    for name in names:
        with open_shard(d / files[name]) as f:
            if bool(f.get_slice(name)[:].float().count_nonzero()):
                raise HFError(
                    f"{d / files[name]}: {name} is not zero; Loom reads attention_bias = true only "
                    "as q/k/v biases with zero o_proj biases (Qwen2's attention in Llama's layout)"
                )


def _differ(d: Path, files: dict[str, str], a: str, b: str) -> bool:
    """Whether stored tensors ``a`` and ``b`` differ in shape or any value (read in blocks of rows,
    about 64 MiB at a time, never a whole table)."""
    with open_shard(d / files[a]) as fa, open_shard(d / files[b]) as fb:
        sa, sb = fa.get_slice(a), fb.get_slice(b)
        shape = tuple(sa.get_shape())
        if shape != tuple(sb.get_shape()) or len(shape) != 2:
            return True
        step = max(1, (1 << 24) // max(1, shape[1]))
        return any(
            not torch.equal(sa[r : r + step].float(), sb[r : r + step].float())
            for r in range(0, shape[0], step)
        )


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
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_len",
    "norm",
    "mlp",
    "positions",
    "bias",
    "hf_architecture",
)
DERIVED = ("vocab_size", "ffn_dim", "attn_head_dim")  # 0 = derived (tokenizer, 8h/3 rule, h/a): not a value
LLAMA31_FACTORS = (
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_len",
)  # used with rope_scaling


def explicit_model_field(field: str, given: object, model: ModelConfig) -> bool:
    """The one rule for an explicit ``model.<field>`` = ``given`` beside a Hugging Face directory whose
    config gives ``model``: True = honoured (``max_seq_len`` with RoPE: only how far the rotary tables
    reach, no tensor's shape), False = the directory's value stands (the same value; 0 of a
    :data:`DERIVED` field; a field the model does not use: top_k without experts, the Llama 3.1
    factors without rope_scaling); anything else contradicts the weights and raises one line naming
    the field, both values and the directory."""
    theirs = getattr(model, field)
    if (
        given == theirs
        or (field in DERIVED and given == 0)
        or (field == "hf_architecture" and given == "auto")
    ):
        return False
    unused = (field == "top_k" and not model.moe) or (field in LLAMA31_FACTORS and not model.rope_scaling)
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


def _refuse_integer(file: Path, name: str, dtype: str) -> None:
    """A weight stored as an integer type (quantized: int8, uint8, packed int4) or an 8- or 4-bit float
    (fp8 codes whose scales sit in other tensors) would be cast to floats and trained as if its codes
    were values: refused, naming the file and tensor."""
    if dtype.upper().startswith(("I", "U", "BOOL", "F8", "F4", "F6")):
        kind = "integer" if not dtype.upper().startswith("F") else "an 8-bit or smaller float"
        raise HFError(
            f"{file}: tensor {name} is stored as {dtype} ({kind}, likely quantized); Loom loads "
            "16- and 32-bit floating-point weights only (dequantize it first, e.g. save the model in bfloat16)"
        )


def _check_headers(d: Path, files: dict[str, str], shapes: dict[str, tuple[int, ...]]) -> None:
    """Every shard's header is readable (a truncated download fails here), and every tensor Loom
    reads (``shapes``: HF name -> stored shape) is in its shard, floating point and of that shape:
    headers only, nothing loaded, so a bad directory is refused before any rank starts."""
    missing = sorted(shapes.keys() - files.keys())
    if missing:
        raise HFError(f"{d}: tensor {missing[0]} is missing from the checkpoint ({len(missing)} missing)")
    by_shard: dict[str, list[str]] = {shard: [] for shard in files.values()}
    for name, shard in files.items():
        if name in shapes:
            by_shard[shard].append(name)
    for shard, names in sorted(by_shard.items()):
        if not (d / shard).is_file():
            raise HFError(f"{d / shard}: missing shard file (named by {INDEX})")
        with open_shard(d / shard) as f:
            held = set(f.keys())
            for name in sorted(names):
                if name not in held:
                    raise HFError(f"{d / shard}: holds no tensor {name} ({INDEX} names it there)")
                sl = f.get_slice(name)
                _refuse_integer(d / shard, name, sl.get_dtype())
                if tuple(sl.get_shape()) != shapes[name]:
                    raise HFError(
                        f"{d / shard}: {name} has shape {tuple(sl.get_shape())}, {CONFIG} implies {shapes[name]}"
                    )


@dataclass(frozen=True)
class Mapping:
    """Where one Loom tensor lives in the checkpoint: ``hf`` (an expert stack: one name per expert,
    stacked along dim 0), with ``heads`` whose rows :func:`to_loom_rows` reorders, ``conv1d``: stored
    transposed (in, out), and ``part`` = (offset, rows): the Loom tensor's o rows are rows
    [offset, offset + o) of an HF tensor of ``rows`` rows fusing several (GPT-2's c_attn, Phi-3's
    qkv_proj and gate_up_proj); None: the whole HF tensor."""

    hf: str | tuple[str, ...]
    heads: int | None = None
    conv1d: bool = False
    part: tuple[int, int] | None = None

    def names(self) -> tuple[str, ...]:
        return self.hf if isinstance(self.hf, tuple) else (self.hf,)

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored shape of one HF tensor (one expert's) for the Loom shape ``shape``."""
        if isinstance(self.hf, tuple):
            shape = shape[1:]
        rows = shape[0] if self.part is None else self.part[1]
        return (shape[1], rows) if self.conv1d else (rows, *shape[1:])


def _mappings(cfg: ModelConfig, prefix: str = "transformer.") -> Iterator[tuple[str, Mapping]]:
    """(Loom name, :class:`Mapping`) of every tensor; ``prefix``: GPT-2's name prefix."""
    if cfg.positions == "learned":
        yield from _gpt2_mappings(cfg, prefix)
        return
    phi3 = architecture_of(cfg) == PHI3
    yield "tok_embeddings.weight", Mapping("model.embed_tokens.weight")
    for i in range(cfg.n_layers):
        hf, lm = f"model.layers.{i}.", f"layers.{i}."
        olmo2 = cfg.norm_placement == "post"  # OLMo-2: the norms after attention and MLP
        yield (
            lm + "attention_norm.weight",
            Mapping(hf + ("post_attention" if olmo2 else "input") + "_layernorm.weight"),
        )
        if phi3:  # q, k, v fused into qkv_proj, rows [0, a·d), [a·d, (a+k)·d), [(a+k)·d, (a+2k)·d)
            qd, kd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
            for x, heads, off in (("q", cfg.n_heads, 0), ("k", cfg.n_kv_heads, qd), ("v", None, qd + kd)):
                qkv = Mapping(hf + "self_attn.qkv_proj.weight", heads, part=(off, qd + 2 * kd))
                yield lm + f"attention.w{x}.weight", qkv
        for x in "o" if phi3 else "qkvo":
            heads = {"q": cfg.n_heads, "k": cfg.n_kv_heads}.get(x)
            yield lm + f"attention.w{x}.weight", Mapping(hf + f"self_attn.{x}_proj.weight", heads)
            if cfg.bias or (cfg.qkv_bias and x != "o"):
                yield lm + f"attention.w{x}.bias", Mapping(hf + f"self_attn.{x}_proj.bias", heads)
        if cfg.qk_norm:  # one head's d weights (OLMo-2: every head's, a·d and k·d), applied before RoPE
            whole = cfg.qk_norm_scope == "all"
            yield (
                lm + "attention.q_norm.weight",
                Mapping(hf + "self_attn.q_norm.weight", cfg.n_heads if whole else 1),
            )
            yield (
                lm + "attention.k_norm.weight",
                Mapping(hf + "self_attn.k_norm.weight", cfg.n_kv_heads if whole else 1),
            )
        yield (
            lm + "ffn_norm.weight",
            Mapping(hf + ("post_feedforward" if olmo2 else "post_attention") + "_layernorm.weight"),
        )
        if cfg.moe:  # a router, and each expert's w1/w3/w2 stacked into Loom's (E, ...) weights
            # Qwen3-MoE (q/k norms): mlp.experts.e.{gate,up,down}_proj; Mixtral: block_sparse_moe.experts.e.w*
            qwen = cfg.qk_norm
            moe = hf + ("mlp." if qwen else "block_sparse_moe.")
            yield lm + "feed_forward.router.weight", Mapping(moe + "gate.weight")
            for w, proj in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                experts = tuple(
                    f"{moe}experts.{e}.{proj if qwen else w}.weight" for e in range(cfg.n_experts)
                )
                yield lm + f"feed_forward.{w}.weight", Mapping(experts)
            continue
        if phi3:  # gate and up fused into gate_up_proj: rows [0, f) and [f, 2f)
            f = cfg.resolved_ffn_dim()
            yield lm + "feed_forward.w1.weight", Mapping(hf + "mlp.gate_up_proj.weight", part=(0, 2 * f))
            yield lm + "feed_forward.w3.weight", Mapping(hf + "mlp.gate_up_proj.weight", part=(f, 2 * f))
            yield lm + "feed_forward.w2.weight", Mapping(hf + "mlp.down_proj.weight")
            continue
        for w, proj in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
            yield lm + f"feed_forward.{w}.weight", Mapping(hf + f"mlp.{proj}_proj.weight")
            if cfg.bias and w != "w3":  # Llama's mlp_bias; up_proj's is zero (zero_tensors)
                yield lm + f"feed_forward.{w}.bias", Mapping(hf + f"mlp.{proj}_proj.bias")
    yield "norm.weight", Mapping("model.norm.weight")
    if not cfg.tie_embeddings:
        yield "output.weight", Mapping(HEAD)


def _gpt2_mappings(cfg: ModelConfig, p: str) -> Iterator[tuple[str, Mapping]]:
    yield "tok_embeddings.weight", Mapping(p + "wte.weight")
    yield "pos_embeddings.weight", Mapping(p + "wpe.weight")
    for i in range(cfg.n_layers):
        hf, lm = f"{p}h.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            conv = kind == "weight"
            yield lm + f"attention_norm.{kind}", Mapping(hf + f"ln_1.{kind}")
            for j, x in enumerate("qkv"):
                yield (
                    lm + f"attention.w{x}.{kind}",
                    Mapping(hf + f"attn.c_attn.{kind}", conv1d=conv, part=(j * cfg.dim, 3 * cfg.dim)),
                )
            yield lm + f"attention.wo.{kind}", Mapping(hf + f"attn.c_proj.{kind}", conv1d=conv)
            yield lm + f"ffn_norm.{kind}", Mapping(hf + f"ln_2.{kind}")
            yield lm + f"feed_forward.w1.{kind}", Mapping(hf + f"mlp.c_fc.{kind}", conv1d=conv)
            yield lm + f"feed_forward.w2.{kind}", Mapping(hf + f"mlp.c_proj.{kind}", conv1d=conv)
    yield "norm.weight", Mapping(p + "ln_f.weight")
    yield "norm.bias", Mapping(p + "ln_f.bias")
    if not cfg.tie_embeddings:
        yield "output.weight", Mapping(HEAD)


def to_loom_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF q/k rows -> Loom's: per head, row 2i+c <- row i + c·d/2."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def to_hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Loom q/k rows -> HF's (inverse of :func:`to_loom_rows`)."""
    d = w.shape[0] // heads
    return w.reshape(heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Loom name -> shape, from the config alone (no model built)."""
    h, d, f, V = cfg.dim, cfg.head_dim, cfg.resolved_ffn_dim(), cfg.vocab_size
    qd, kd = cfg.n_heads * d, cfg.n_kv_heads * d
    leaves = {
        "tok_embeddings": (V, h),
        "output": (V, h),
        "wq": (qd, h),
        "wk": (kd, h),
        "wv": (kd, h),
        "wo": (h, qd),
        "w1": (f, h),
        "w3": (f, h),
        "w2": (h, f),
        "q_norm": (qd if cfg.qk_norm_scope == "all" else d,),
        "k_norm": (kd if cfg.qk_norm_scope == "all" else d,),
        "pos_embeddings": (cfg.max_seq_len, h),
    }
    if cfg.moe:
        E = cfg.n_experts
        leaves |= {"w1": (E, f, h), "w3": (E, f, h), "w2": (E, h, f), "router": (E, h)}
    shapes = {}
    for name, _ in _mappings(cfg):
        module, kind = name.split(".")[-2:]
        shape = leaves.get(module, (h,))
        shapes[name] = shape[:1] if kind == "bias" else shape
    return shapes


class Reader:
    """Boxes of Loom tensors read from a checkpoint's shards (each file opened once, closed with the
    reader); ``bytes_read`` counts the bytes ``get_slice`` returned."""

    def __init__(self, model: HFModel) -> None:
        self.model = model
        self.maps = dict(_mappings(model.config, model.prefix))
        self.shapes = expected_shapes(model.config)
        self.opened: dict[str, object] = {}
        self.files = ExitStack()
        self.bytes_read = 0

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.files.close()

    def check(self, names: Iterable[str]) -> None:
        """Every HF tensor of the Loom tensors ``names`` is in the checkpoint, else an error naming it."""
        for lm in names:
            for name in self.maps[lm].names():
                if name not in self.model.files:
                    raise HFError(f"{self.model.dir}: tensor {name} is missing from the checkpoint")

    def _slice(self, name: str, shape: tuple[int, ...]):
        file = self.model.files[name]
        if file not in self.opened:
            self.opened[file] = self.files.enter_context(open_shard(self.model.dir / file))
        sl = self.opened[file].get_slice(name)  # type: ignore[attr-defined]
        _refuse_integer(self.model.dir / file, name, sl.get_dtype())
        if tuple(sl.get_shape()) != shape:
            raise HFError(
                f"{self.model.dir / file}: {name} has shape {tuple(sl.get_shape())}, {CONFIG} implies {shape}"
            )
        return sl

    def read(self, lm: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The box ``index`` (slices with steps of 1; None: all) of Loom's tensor ``lm``."""
        if lm not in self.maps:
            raise HFError(f"{self.model.dir}: the checkpoint has no tensor for Loom's {lm}")
        shape = self.shapes[lm]
        box = tuple(s.indices(n)[:2] for s, n in zip(index or (), shape)) + tuple(
            (0, n) for n in shape[len(index or ()) :]
        )
        t = self._box(self.maps[lm], shape, box)
        if t.is_floating_point() and not bool(
            torch.isfinite(t).all()
        ):  # else: "non-finite gradient" at step 1
            names = ", ".join(self.maps[lm].names())
            raise HFError(
                f"{self.model.dir}: tensor {names} holds NaN or inf values; the checkpoint is damaged"
            )
        return t

    def _box(self, m: Mapping, shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        if isinstance(m.hf, tuple):  # an expert stack: only the experts in the box, each its own box
            (e0, e1), rest = box[0], box[1:]
            parts = [
                self._box(Mapping(m.hf[e], m.heads, m.conv1d, m.part), shape[1:], rest) for e in range(e0, e1)
            ]
            return torch.stack(parts) if parts else torch.empty(0, *(b - a for a, b in rest))
        if m.heads is None:
            return self._plain(m, shape, box)
        (r0, r1), d = box[0], shape[0] // m.heads  # whole heads are reordered: widen to them, then cut
        lo, hi = r0 // d * d, -(-r1 // d) * d
        t = to_loom_rows(self._plain(m, shape, ((lo, hi), *box[1:])), (hi - lo) // d)
        return t[r0 - lo : r1 - lo]

    def _plain(self, m: Mapping, shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        off = 0 if m.part is None else m.part[0]  # a fused tensor's rows of this part
        rows = slice(off + box[0][0], off + box[0][1])
        sl = self._slice(cast(str, m.hf), m.hf_shape(shape))
        if m.conv1d:  # stored (in, out): read the transposed box
            t = sl[slice(*box[1]), rows].t()
        else:
            t = sl[(rows, *(slice(a, b) for a, b in box[1:]))]
        self.bytes_read += t.numel() * t.element_size()
        return t


def read_state(model: HFModel, names: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(Loom name, whole tensor) for ``names`` (default: all), one tensor at a time (an expert stack
    is read expert by expert); each shard file is opened once."""
    with Reader(model) as reader:
        wanted = [lm for lm in reader.maps if names is None or lm in names]
        reader.check(wanted)
        for lm in wanted:
            yield lm, reader.read(lm)


class HFSource:
    """The :data:`~loom.parallel.materialize.Source` of a checkpoint: ``(name, shape, index)`` -> that
    box of Loom's parameter ``name``, read with ``get_slice`` (for materializing a model built on the
    meta device: a rank reads only what it holds). ``bytes_read`` sums over calls."""

    def __init__(self, model: HFModel) -> None:
        self.model = model
        self.bytes_read = 0

    def __call__(self, name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> torch.Tensor:
        with Reader(self.model) as reader:
            reader.check([name] if name in reader.maps else [])
            V = reader.shapes[name][0] if name in VOCAB_TENSORS and name in reader.shapes else shape[0]
            if shape[0] <= V:
                t = reader.read(name, index)
            else:  # a padded vocabulary (model.pad_vocab_to): rows >= V are zeros
                r0, r1 = index[0].indices(shape[0])[:2] if index else (0, shape[0])
                t = reader.read(name, (slice(min(r0, V), min(r1, V)), *index[1:]))
                t = torch.cat((t, t.new_zeros(r1 - r0 - t.shape[0], *t.shape[1:])))
            self.bytes_read += reader.bytes_read
            return t


def source(model: HFModel) -> HFSource:
    """The box reader of ``model``'s weights (:class:`HFSource`)."""
    return HFSource(model)


@torch.no_grad()
def load_into(module: torch.nn.Module, model: HFModel) -> None:
    """Copy the checkpoint's weights into a Loom ``Transformer`` built from ``model.config``
    (converted to each parameter's dtype and device, one tensor at a time)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    for name, t in read_state(model, set(params)):
        p: torch.Tensor = params[name]
        if name in VOCAB_TENSORS and p.shape[0] > t.shape[0]:  # a padded vocabulary: zero rows after V
            p[t.shape[0] :].zero_()
            p = p[: t.shape[0]]
        p.copy_(t)


def _is_gpt2(cfg: ModelConfig) -> bool:
    """GPT-2's tensors exactly: every GPT-2 field set, and nothing GPT-2 lacks (``bias`` alone on a
    RoPE model is Llama's attention_bias + mlp_bias)."""
    fields = {
        "positions = learned": cfg.positions == "learned",
        "norm = layernorm": cfg.norm == "layernorm",
        "mlp = gelu or gelu_tanh": cfg.mlp != "swiglu",
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
    if not moe.norm_topk and family != QWEN3MOE:
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
    if named == "auto" or named == by_shape:
        return by_shape
    if named == PHI3 and cfg.rope_scaling:
        raise HFError(
            f"model.hf_architecture: {PHI3} scales RoPE by longrope only, not Llama 3's rope_scaling; set it "
            "to auto or LlamaForCausalLM"
        )
    if by_shape == LLAMA and named in (() if cfg.bias else (QWEN2,) if cfg.qkv_bias else LLAMA_TENSORS):
        return named
    raise HFError(
        f"model.hf_architecture: {named} cannot hold this model's tensors ({by_shape} does); "
        "set it to auto or to that family"
    )


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


def _family_by_shape(cfg: ModelConfig) -> str:
    if _is_gpt2(cfg):
        return GPT2
    olmo2 = (cfg.norm_placement == "post", cfg.qk_norm and cfg.qk_norm_scope == "all")
    if any(olmo2):
        if not all(olmo2) or cfg.qkv_bias or cfg.bias or cfg.moe:
            raise HFError(
                "model: Olmo2ForCausalLM needs norm_placement = post with qk_norm = true, qk_norm_scope = all, "
                "and no q/k/v biases or experts; no other Hugging Face family holds either"
            )
        return OLMO2
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
    return "MixtralForCausalLM" if cfg.moe else LLAMA


def _gpt2_hf_config(cfg: ModelConfig, dtype: str) -> dict:
    return {
        "architectures": [GPT2],
        "model_type": "gpt2",
        "n_embd": cfg.dim,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.resolved_ffn_dim(),
        "n_positions": cfg.max_seq_len,
        "n_ctx": cfg.max_seq_len,  # the hub's GPT-2 configs carry both (llama.cpp's converter reads n_ctx)
        "vocab_size": cfg.vocab_size,
        "layer_norm_epsilon": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "activation_function": "gelu_new" if cfg.mlp == "gelu_tanh" else "gelu",
        "initializer_range": cfg.init_std,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": 0.0,
        "attn_pdrop": cfg.dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "dtype": dtype,
        "torch_dtype": dtype,  # what transformers < 4.56 reads
    }


def hf_config(
    cfg: ModelConfig, dtype: str = "float32", extra: dict | None = None, moe: MoEConfig | None = None
) -> dict:
    """``config.json`` for Loom's ``cfg`` (``extra``: fields carried over, e.g. token ids; ``moe``:
    the run's routing, Qwen3-MoE's ``norm_topk_prob``)."""
    family = architecture_of(cfg)
    if family == GPT2:
        return _gpt2_hf_config(cfg, dtype) | (extra or {})
    out = {
        "architectures": [family],
        "model_type": "qwen3_moe" if family == QWEN3MOE else family.removesuffix("ForCausalLM").lower(),
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.resolved_ffn_dim(),
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": cfg.qkv_bias or cfg.bias,
        "mlp_bias": cfg.bias,
        "initializer_range": cfg.init_std,
        "dtype": dtype,
        "torch_dtype": dtype,  # what transformers < 4.56 reads
    }
    if cfg.rope_scaling:
        rope = {
            "rope_type": "llama3",
            "rope_theta": cfg.rope_theta,
            "factor": cfg.rope_scaling,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_len,
        }
        # transformers 4.x checks rope_scaling's keys per type: the base lives beside it, not in it
        out |= {"rope_parameters": rope, "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}}
    if family in LLAMA_TENSORS:  # Loom attends to the whole sequence; Phi-3's RoPE: whole heads
        out |= {"sliding_window": None}
    if family == PHI3:
        del out["attention_bias"], out["mlp_bias"]
        out["rope_parameters"] = cast(dict, out["rope_parameters"]) | {"partial_rotary_factor": 1.0}
        out["original_max_position_embeddings"] = cfg.max_seq_len
        out |= dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id"))  # not Phi3Config's 32000s
    if family == QWEN3MOE:  # every layer sparse, no shared experts; no dense MLP: no intermediate_size
        del out["intermediate_size"]
        out |= {
            "num_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.top_k,
            "moe_intermediate_size": cfg.resolved_ffn_dim(),
            "norm_topk_prob": (moe or MoEConfig()).norm_topk,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "use_sliding_window": False,
            "sliding_window": None,
            "output_router_logits": False,
        }
    elif cfg.moe:
        out |= {
            "num_local_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.top_k,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
        }
    return out | (extra or {})


def hf_units(cfg: ModelConfig, names: list[str]) -> list[list[str]]:
    """``names`` grouped (in order) into the Loom tensors of one HF tensor each: GPT-2's q, k, v go
    together into ``c_attn``; every other tensor alone."""
    maps = dict(_mappings(cfg))
    units: dict[str, list[str]] = {}
    for name in names:
        units.setdefault(maps[name].names()[0] if name in maps else name, []).append(name)
    return list(units.values())


def hf_tensors(
    cfg: ModelConfig, state: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for a stream of Loom (name, tensor); names outside the mapping raise. The
    embedding and head keep their ``vocab_size`` real rows (a padded vocabulary's rows dropped). The
    parts of a fused tensor (GPT-2's c_attn, Phi-3's qkv_proj, gate_up_proj) are held until all its
    rows have arrived, then concatenated in row order."""
    maps, zeros = dict(_mappings(cfg)), zero_tensors(cfg)
    pending: dict[str, dict[int, torch.Tensor]] = {}  # HF name -> row offset -> that part
    for name, t in state:
        if name not in maps:
            if cfg.tie_embeddings and name == "output.weight":
                continue  # the tied head is the embedding
            raise HFError(f"{name}: no Hugging Face counterpart for this tensor")
        m = maps[name]
        t = to_hf_rows(t, m.heads) if m.heads else t
        t = t[: cfg.vocab_size] if name in VOCAB_TENSORS else t  # a padded vocabulary: the real rows
        if isinstance(m.hf, tuple):
            yield from ((n, e.contiguous()) for n, e in zip(m.hf, t.unbind(0), strict=True))
            continue
        if m.part is not None:
            parts = pending.setdefault(m.hf, {})
            parts[m.part[0]] = t
            if sum(p.shape[0] for p in parts.values()) < m.part[1]:
                continue
            del pending[m.hf]
            t = torch.cat([parts[o] for o in sorted(parts)])
        yield m.hf, (t.t() if m.conv1d else t).contiguous()
        if name in zeros:
            yield zeros[name][0], torch.zeros(zeros[name][1], dtype=t.dtype)
    if pending:
        raise HFError(f"{next(iter(pending))}: only some of its fused parts were given")
