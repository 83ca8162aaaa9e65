"""A ``config.json`` means what ``transformers`` reads from it: a field left out takes the family's own
default (Mixtral's RoPE base 1e6 and norm epsilon 1e-5, OLMo-2's and Phi-3's 1e-5, Qwen3-MoE's 8
experts per token), not one family's values for all; and a checkpoint that says
``tie_word_embeddings = true`` but stores an ``lm_head.weight`` unlike its embedding runs that head,
untied, as ``transformers`` loads it. Logits equal transformers' on tiny random models built from
configs (nothing downloaded)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
import transformers
from torch.testing import assert_close

from loom import config as C
from tests.helpers import HF_TINY

BASE = HF_TINY


def _save(path: Path, config_class: str, drop: tuple[str, ...] = (), **kw) -> torch.nn.Module:
    """A random model (norm weights around 1) saved at ``path``, then ``drop``'s fields removed from
    its config.json; returns transformers' model read back from that directory."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**(BASE | kw)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    for key in drop:
        raw.pop(key, None)
    (path / "config.json").write_text(json.dumps(raw))
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _loom_logits(path: Path, x: torch.Tensor):
    from loom.model.hf import load_into, moe_options, open_dir
    from loom.model.llama import Transformer

    hf = open_dir(path, BASE["max_position_embeddings"])
    model = Transformer(hf.config, C.MoEConfig(**moe_options(hf))).eval()  # type: ignore[arg-type]
    load_into(model, hf)
    with torch.no_grad():
        return hf.config, model(x)


def test_family_defaults_are_those_of_transformers():
    from loom.model.hf import FAMILY_DEFAULTS

    for arch, defaults in FAMILY_DEFAULTS.items():
        cls = getattr(transformers, arch).config_class
        params = inspect.signature(cls.__init__).parameters
        theta = getattr(cls, "default_theta", None) or params["rope_theta"].default
        if isinstance(theta, dict):  # Gemma 3: the full layers' base and the sliding (local) ones'
            assert (defaults["rope_theta"], defaults["rope_local_base_freq"]) == (
                theta["global"],
                theta["local"],
            )
            theta = theta["global"]
        assert defaults["rope_theta"] == theta, arch
        shared = [k for k in defaults if k in params and k != "rope_theta"]
        eps = "norm_epsilon" if arch == "Starcoder2ForCausalLM" else "rms_norm_eps"  # its LayerNorm's
        assert {eps, "max_position_embeddings", "tie_word_embeddings"} <= set(shared), arch
        for key in shared:
            want = params[key].default  # num_key_value_heads / head_dim None: from the heads, as Loom's
            assert defaults[key] == want, (arch, key, defaults[key], want)


@pytest.mark.parametrize(
    "config_class,kw,drop",
    [
        ("MixtralConfig", {"num_local_experts": 4}, ("rope_theta", "rope_parameters")),
        ("MixtralConfig", {"num_local_experts": 4}, ("rms_norm_eps",)),
        ("Olmo2Config", {}, ("rms_norm_eps",)),
        ("Phi3Config", {"pad_token_id": 0}, ("rms_norm_eps",)),
        (
            "Qwen3MoeConfig",
            {"num_experts": 8, "moe_intermediate_size": 48, "head_dim": 16},
            ("num_experts_per_tok",),
        ),
        (
            "Gemma2Config",
            {"head_dim": 16},
            (
                "query_pre_attn_scalar",
                "attn_logit_softcapping",
                "final_logit_softcapping",
                "hidden_activation",
            ),
        ),
    ],
    ids=[
        "mixtral rope base",
        "mixtral norm eps",
        "olmo2 norm eps",
        "phi3 norm eps",
        "qwen3-moe top-k",
        "gemma2 scale, caps, activation",
    ],
)
def test_a_field_left_out_takes_the_family_default(tmp_path, config_class, kw, drop):
    ref = _save(tmp_path, config_class, drop, **kw)
    x = torch.randint(0, BASE["vocab_size"], (1, 48), generator=torch.Generator().manual_seed(0))
    cfg, logits = _loom_logits(tmp_path, x)
    assert_close(logits, ref(x).logits.detach(), atol=2e-5, rtol=1e-5)
    want = ref.config
    assert cfg.norm_eps == want.rms_norm_eps and cfg.rope_theta == want.rope_parameters["rope_theta"]
    if cfg.moe:
        assert cfg.top_k == want.num_experts_per_tok
    if cfg.norm_placement == "sandwich":  # Gemma 2: 256^-1/2, caps 50 and 30
        assert (cfg.attn_scale, cfg.attn_softcap, cfg.logit_softcap) == (1 / 16, 50.0, 30.0)


@pytest.mark.parametrize("same", [False, True], ids=["another head", "a copy of the embedding"])
def test_a_stored_head_under_tie_word_embeddings_is_read_as_transformers_reads_it(tmp_path, same):
    """transformers unties a tied config whose checkpoint stores a different ``lm_head.weight`` (and
    warns); Loom does the same, with one warning; an identical copy stays tied."""
    from safetensors.torch import load_file, save_file

    _save(tmp_path, "LlamaConfig", tie_word_embeddings=True)
    tensors = load_file(tmp_path / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embed.clone() if same else torch.randn_like(embed) * 0.1
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = torch.randint(0, BASE["vocab_size"], (1, 48), generator=torch.Generator().manual_seed(0))
    cfg, logits = _loom_logits(tmp_path, x)
    assert cfg.tie_embeddings == same
    assert_close(logits, ref(x).logits.detach(), atol=2e-5, rtol=1e-5)


def test_stored_tensors_the_config_does_not_use_are_named_in_one_warning(tmp_path, caplog):
    """q/k/v biases under a config without attention_bias: transformers ignores them (and warns), so
    Loom computes what transformers computes, and says which tensors it did not read."""
    import logging

    from safetensors.torch import load_file, save_file

    _save(tmp_path, "LlamaConfig")
    tensors = load_file(tmp_path / "model.safetensors")
    for x in "qkv":
        tensors[f"model.layers.0.self_attn.{x}_proj.bias"] = torch.full((64 if x == "q" else 32,), 5.0)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # a buffer: not reported
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = torch.randint(0, BASE["vocab_size"], (1, 48), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="loom.model.hf"):
        _, logits = _loom_logits(tmp_path, x)
    assert_close(logits, ref(x).logits.detach(), atol=2e-5, rtol=1e-5)
    (line,) = [r.getMessage() for r in caplog.records if "does not use" in r.getMessage()]
    assert "3 stored tensor(s)" in line and "model.layers.0.self_attn.k_proj.bias" in line
    assert "inv_freq" not in line


def _edit(path: Path, **fields) -> None:
    """Set (or, with None, remove) config.json fields."""
    raw = json.loads((path / "config.json").read_text())
    for k, v in fields.items():
        raw.pop(k) if v is None else raw.__setitem__(k, v)
    (path / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize(
    "config_class,kw,edit",
    [
        ("LlamaConfig", {}, {"sliding_window": 16}),  # Llama has no window: transformers ignores it
        ("Olmo2Config", {}, {"sliding_window": 16}),
        ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}, {}),
        # its windowed layers from max_window_layers on: layer 1 of 2 sees 16 keys of 48
        ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, {}),
        ("LlamaConfig", {}, {"hidden_act": "swish"}),  # SiLU by another name
        ("LlamaConfig", {}, {"hidden_act": None}),  # left out: the family's SiLU
        ("LlamaConfig", {}, {"architectures": None}),  # AutoModel goes by model_type
        ("GPT2Config", {"max_position_embeddings": 1024}, {"n_positions": None}),  # its default
    ],
    ids=[
        "llama window",
        "olmo2 window",
        "qwen2 no window layer",
        "qwen2 windowed layer",
        "swish",
        "no hidden_act",
        "no architectures",
        "gpt2 no n_positions",
    ],
)
def test_configs_transformers_reads_are_read_as_it_reads_them(tmp_path, config_class, kw, edit):
    """Each was refused (or, for a window, would be applied where transformers applies none)."""
    _save(tmp_path, config_class, **kw)
    _edit(tmp_path, **edit)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = torch.randint(0, BASE["vocab_size"], (1, 48), generator=torch.Generator().manual_seed(0))
    _, logits = _loom_logits(tmp_path, x)
    assert_close(logits, ref(x).logits.detach(), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("config_class", ["MistralConfig", "MixtralConfig", "Phi3Config"])
def test_a_window_transformers_applies_is_never_dropped(tmp_path, config_class):
    """Mistral, Mixtral and Phi-3 read sliding_window alone: a stray ``use_sliding_window: false`` left
    Loom attending to the whole sequence (logits off by up to 2.9); the window of 16 on sequences of
    48 is applied on every layer, the logits transformers'."""
    extra = {"MixtralConfig": {"num_local_experts": 4}, "Phi3Config": {"pad_token_id": 0}}
    ref = _save(tmp_path, config_class, sliding_window=16, **extra.get(config_class, {}))
    _edit(tmp_path, use_sliding_window=False)
    x = torch.randint(0, BASE["vocab_size"], (1, 48), generator=torch.Generator().manual_seed(0))
    cfg, logits = _loom_logits(tmp_path, x)
    assert (cfg.sliding_window, cfg.window_layers) == (16, "all")
    assert_close(logits, ref(x).logits.detach(), atol=2e-5, rtol=1e-5)


def test_exports_loom_reads_back_and_families_that_cannot_hold_the_model(tmp_path):
    """A Qwen3-MoE export (no intermediate_size, as transformers writes one) imports back with equal
    logits; q/k/v biases with experts (no family holds both: it was written as a dense Qwen2) and
    Phi-3 with Llama 3's RoPE scaling (Phi-3 reads longrope only) are refused in one line."""
    from safetensors.torch import save_file

    from loom.model.hf import HFError, hf_config, hf_tensors
    from loom.model.llama import build_model

    cfg = C.ModelConfig(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=128,
        max_seq_len=48,
        ffn_dim=96,
        qk_norm=True,
        n_experts=4,
        top_k=2,
    )
    model = build_model(cfg, 0).eval()
    tensors = dict(hf_tensors(cfg, ((k, v.detach()) for k, v in model.state_dict().items())))
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(hf_config(cfg)))
    assert "intermediate_size" not in json.loads((tmp_path / "config.json").read_text())
    x = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    _, logits = _loom_logits(tmp_path, x)
    with torch.no_grad():
        assert_close(logits, model(x), atol=2e-5, rtol=1e-5)
    with pytest.raises(HFError, match="no supported Hugging Face family"):
        hf_config(C.ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=128, qkv_bias=True, n_experts=4))
    with pytest.raises(HFError, match="model.hf_architecture: Phi3ForCausalLM scales RoPE by longrope only"):
        hf_config(
            C.ModelConfig(
                dim=64,
                n_layers=2,
                n_heads=4,
                vocab_size=128,
                rope_scaling=8.0,
                hf_architecture="Phi3ForCausalLM",
            )
        )
