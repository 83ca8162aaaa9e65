"""StarCoder 2 (``Starcoder2ForCausalLM``): RoPE with LayerNorm (weights and biases), a GELU MLP
(``c_fc``, ``c_proj``), biases on every linear but the head (``use_bias``) and a sliding window on
every layer. Tiny random models built by ``transformers`` (nothing downloaded) import with its
logits (with and without biases, windowed or not, tied or not); the export loads back as StarCoder 2
with the same logits and the KV cache agrees; what no family holds is refused naming the fields."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

from tests.helpers import (
    HF_TINY,
    assert_export_round_trips,
    assert_field_bites,
    imported_with_their_logits,
    saved_random,
)

CASES = {
    "biases, tied": {},
    "no biases, untied": {"use_bias": False, "tie_word_embeddings": False},
    "windowed, exact gelu": {"sliding_window": 8, "hidden_act": "gelu"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_starcoder2_imports_with_transformers_logits_and_exports_as_starcoder2(tmp_path, case):
    from loom.model.hf import open_dir

    torch.manual_seed(0)
    fields = HF_TINY | {"bos_token_id": 1, "eos_token_id": 2, "norm_epsilon": 1e-5}
    ref = transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(**(fields | CASES[case]))).eval()
    saved_random(ref, tmp_path / "src")
    hf = open_dir(tmp_path / "src", 32)
    cfg = hf.config
    assert (cfg.hf_architecture, cfg.norm, cfg.bias) == (
        "Starcoder2ForCausalLM",
        "layernorm",
        "no biases" not in case,
    )
    assert cfg.mlp == ("gelu" if "exact" in case else "gelu_tanh")
    model, x, logits = imported_with_their_logits(hf, ref)
    if "windowed" in case:
        assert_field_bites(model, x, logits, sliding_window=0)
    assert_export_round_trips(model, x, tmp_path / "out", transformers.Starcoder2ForCausalLM)


def test_a_rope_model_with_layernorm_and_what_starcoder2_lacks_is_refused():
    from loom.config import ModelConfig
    from loom.model.hf import HFError, architecture_of

    cfg = ModelConfig(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, norm="layernorm", mlp="gelu_tanh"
    )
    assert architecture_of(cfg) == "Starcoder2ForCausalLM"
    with pytest.raises(HFError, match=r"which also needs mlp = gelu_tanh or gelu, qk_norm = false$"):
        architecture_of(replace(cfg, mlp="swiglu", qk_norm=True))
