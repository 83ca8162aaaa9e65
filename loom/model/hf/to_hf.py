"""Loom's model -> a Hugging Face family: ``config.json`` (:func:`hf_config`) and the tensors under
their names and layouts (:func:`hf_tensors`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import torch

from loom.config import ModelConfig, MoEConfig
from loom.model.hf.families import (
    ERNIE45,
    EXAONE4,
    GEMMA,
    GEMMA2,
    GEMMA3,
    GLM4,
    GPT2,
    GRANITE,
    MINISTRAL,
    OLMO3,
    OLMOE,
    PHI3,
    QWEN3MOE,
    SEED_OSS,
    SMOLLM3,
    STARCODER2,
    HFError,
    architecture_of,
    zero_tensors,
)
from loom.model.hf.names import VOCAB_TENSORS, _mappings, to_hf_rows


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


# token ids left unset, where the family's config class would default them to ids of its own vocabulary
# (the export's tokenizer files and generation_config.json carry the run's)
NO_TOKEN_IDS: dict = dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id"))


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
        "model_type": {QWEN3MOE: "qwen3_moe", GEMMA3: "gemma3_text", SEED_OSS: "seed_oss"}.get(
            family, family.removesuffix("ForCausalLM").lower()
        ),
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
        rope = rope_parameters(cfg)
        # transformers 4.x checks rope_scaling's keys per type: the base lives beside it, not in it
        out |= {"rope_parameters": rope, "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}}
    out |= window_fields(cfg, family)
    if family == PHI3:
        del out["attention_bias"], out["mlp_bias"]
        out["partial_rotary_factor"] = cfg.rope_fraction  # what Phi-3 reads beside a rope_scaling
        out["rope_parameters"] = cast(dict, out["rope_parameters"]) | {
            "partial_rotary_factor": cfg.rope_fraction
        }
        # read before rope_parameters' own (transformers' order): LongRoPE's pretraining length
        out["original_max_position_embeddings"] = (
            cfg.rope_original_len if cfg.rope_scaling else cfg.max_seq_len
        )
        out |= NO_TOKEN_IDS  # not Phi3Config's 32000s
    if family in (GEMMA, GEMMA2, GEMMA3):
        out |= _gemma_hf_fields(cfg, family)
    if family == OLMO3:
        out |= layer_type_rope_fields(cfg, family)
    if family == GLM4:  # q/k/v biases (attention_bias), half of each head rotated by default
        del out["mlp_bias"]
        out["partial_rotary_factor"] = cfg.rope_fraction
        out["rope_parameters"] = cast(dict, out["rope_parameters"]) | {
            "partial_rotary_factor": cfg.rope_fraction
        }
        out |= NO_TOKEN_IDS
    if family == GRANITE:  # its four scales
        out |= {
            "embedding_multiplier": cfg.embed_multiplier,
            "residual_multiplier": cfg.residual_multiplier,
            "logits_scaling": cfg.logit_divisor,
            "attention_multiplier": cfg.attn_scale or cfg.head_dim**-0.5,
        }
    if family == SEED_OSS:  # q/k/v biases; none on o
        out |= {"attention_out_bias": False, "mlp_bias": False}
    if family == ERNIE45:  # one bias switch (off)
        del out["attention_bias"], out["mlp_bias"]
        out["use_bias"] = False
    if family == STARCODER2:  # LayerNorm's epsilon, one bias switch, the GELU
        del out["rms_norm_eps"], out["attention_bias"], out["mlp_bias"]
        act = {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}[cfg.mlp]
        out |= {"norm_epsilon": cfg.norm_eps, "use_bias": cfg.bias, "hidden_act": act} | NO_TOKEN_IDS
    if family == SMOLLM3:  # 1: the layer rotates q and k, 0: NoPE
        nope = cfg.nope_layer_set()
        out["no_rope_layers"] = [int(i not in nope) for i in range(cfg.n_layers)]
        out |= NO_TOKEN_IDS  # not SmolLM3Config's 128000s
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
    elif family == OLMOE:  # every layer sparse, of width intermediate_size
        out |= {
            "num_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.top_k,
            "norm_topk_prob": (moe or MoEConfig()).norm_topk,
            "clip_qkv": None,
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


def rope_parameters(cfg: ModelConfig) -> dict:
    """transformers' ``rope_parameters`` for the base and the long-context rule ``model.rope_kind``
    (:mod:`loom.model.rope`): its factor and its own numbers (a YaRN or LongRoPE attention factor only
    when set: 0 is transformers' own default)."""
    rope: dict = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if not cfg.rope_scaling:
        return rope
    rope |= {"rope_type": cfg.rope_kind, "factor": cfg.rope_scaling}
    if cfg.rope_kind == "llama3":
        rope |= {"low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor}
    if cfg.rope_kind != "linear":
        rope["original_max_position_embeddings"] = cfg.rope_original_len
    if cfg.rope_kind == "yarn":
        rope |= {
            "beta_fast": cfg.rope_beta_fast,
            "beta_slow": cfg.rope_beta_slow,
            "truncate": cfg.rope_truncate,
        }
    if cfg.rope_kind == "longrope":
        rope |= {"short_factor": list(cfg.rope_short_factor), "long_factor": list(cfg.rope_long_factor)}
    if cfg.rope_kind in ("yarn", "longrope") and cfg.rope_attn_factor:
        rope["attention_factor"] = cfg.rope_attn_factor
    return rope


def _gemma_hf_fields(cfg: ModelConfig, family: str) -> dict:
    """Gemma's activation field (Gemma reads ``hidden_act``, Gemma 2 ``hidden_activation``) and Gemma
    2's attention scale, soft-caps (0: null) and layers: every one full, as Loom attends, the window
    set to cover the sequences though no layer reads it (a source
    directory's own ``sliding_window`` and ``layer_types`` are carried over by the export)."""
    out: dict = {"hidden_act": "gelu_pytorch_tanh"}
    if family == GEMMA:
        return out
    scalar = cfg.head_dim if not cfg.attn_scale else cfg.attn_scale**-2
    return (
        out
        | {
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 * scalar else scalar,
            "attn_logit_softcapping": cfg.attn_softcap or None,
            "final_logit_softcapping": cfg.logit_softcap or None,
        }
        | (layer_type_rope_fields(cfg, family) if family == GEMMA3 else {})
    )


def layer_type_rope_fields(cfg: ModelConfig, family: str) -> dict:
    """Gemma 3's and OLMo 3's RoPE per layer type (transformers 5's form): the full layers' base and
    rule, the local (sliding) layers' ``rope_local_theta`` (Gemma 3 also names it
    ``rope_local_base_freq``)."""
    local = cfg.rope_local_theta or cfg.rope_theta
    return {
        "rope_parameters": {
            "full_attention": rope_parameters(cfg),
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        },
        "rope_theta": cfg.rope_theta,
    } | ({"rope_local_base_freq": local} if family == GEMMA3 else {})


WINDOW_ALL = (
    "MistralForCausalLM",
    MINISTRAL,
    PHI3,
    "MixtralForCausalLM",
    QWEN3MOE,
    STARCODER2,
)  # a window on every layer or none
# layer_types (a Mistral's: transformers reads it as a Ministral, windowed on those layers)
WINDOW_PER_LAYER = (
    GEMMA2,
    GEMMA3,
    OLMO3,
    SMOLLM3,
    MINISTRAL,
    EXAONE4,
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)


def window_fields(cfg: ModelConfig, family: str) -> dict:
    """``config.json``'s window fields for ``model.sliding_window`` and ``window_layers``: Mistral,
    Mixtral, Phi-3 and Qwen3-MoE window every layer (``sliding_window``, and Qwen's
    ``use_sliding_window``), Gemma 2, Qwen2 and Qwen3 the layers ``layer_types`` names; a window no
    layer of the family can hold is refused naming the fields. No window: none (Gemma 2's window
    covering the sequences, as transformers builds its mask whatever the layers)."""
    windowed = cfg.windowed_layers()
    qwen = family in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", QWEN3MOE)
    switch = (
        {"use_sliding_window": bool(windowed)} if qwen or family == SMOLLM3 else {}
    )  # their window's switch
    if not windowed:
        if family in (GEMMA2, GEMMA3, OLMO3) or (family == EXAONE4 and cfg.nope_layer_set()):
            # Gemma 3's, OLMo 3's local layers (their RoPE) stay sliding, EXAONE 4's (the others: NoPE)
            local = (
                cfg.local_layers()
                if (family in (GEMMA3, OLMO3) and cfg.rope_local_theta) or family == EXAONE4
                else frozenset()
            )
            types = ["sliding_attention" if i in local else "full_attention" for i in range(cfg.n_layers)]
            return {"sliding_window": cfg.max_seq_len, "layer_types": types}
        if family == EXAONE4:  # no window, RoPE on every layer (its default: windows, NoPE between)
            return {"sliding_window": None, "layer_types": ["full_attention"] * cfg.n_layers}
        if family in WINDOW_ALL or switch:
            return {"sliding_window": None} | switch
        return {}
    every = len(windowed) == cfg.n_layers
    if family in WINDOW_ALL and every:
        return {"sliding_window": cfg.sliding_window} | switch
    if family in WINDOW_PER_LAYER:
        types = ["sliding_attention" if i in windowed else "full_attention" for i in range(cfg.n_layers)]
        out = {"sliding_window": cfg.sliding_window, "layer_types": types}
        return out | switch | ({"max_window_layers": min(windowed)} if qwen else {})
    raise HFError(
        f"model.sliding_window: {family} holds "
        + ("no attention window" if family not in WINDOW_ALL else "a window on every layer only")
        + f" (window_layers = {cfg.window_layers!r}); families with one per layer: {', '.join(WINDOW_PER_LAYER)}"
    )


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
        t = to_hf_rows(t, m.heads, m.rotary) if m.heads else t
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
