"""OLMo 3 (``Olmo3ForCausalLM``): OLMo 2's block (norms after attention and MLP, q/k norms over all
heads) with a sliding window on three layers of four and RoPE per layer type (a long-context rule on
the full layers alone). Tiny random models built by ``transformers`` (nothing downloaded) import
with its logits, with and without YaRN on the full layers and with the window shorter than the
sequences; the export loads back as OLMo 3 with the same logits and the KV cache agrees."""

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

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "attention_factor": 1.2}
CASES = {
    "window": {"sliding_window": 8},
    "window + yarn on the full layers": {"sliding_window": 8, "rope_scaling": YARN},
    "window beyond the sequences": {"sliding_window": 64},
}


@pytest.mark.parametrize("case", list(CASES))
def test_olmo3_imports_with_transformers_logits_and_exports_as_olmo3(tmp_path, case):
    from loom.model.hf import open_dir

    torch.manual_seed(0)
    config = transformers.Olmo3Config(**(HF_TINY | {"num_hidden_layers": 4} | CASES[case]))  # RoPE base 5e5
    ref = transformers.Olmo3ForCausalLM(config).eval()
    saved_random(ref, tmp_path / "src")
    hf = open_dir(tmp_path / "src", 32)
    cfg = hf.config
    assert (cfg.hf_architecture, cfg.norm_placement, cfg.qk_norm_scope) == ("Olmo3ForCausalLM", "post", "all")
    windowed = "beyond" not in case
    assert (cfg.sliding_window, cfg.window_layers) == ((8, "0,1,2") if windowed else (0, "0,1,2"))
    assert (cfg.rope_kind, cfg.rope_local_theta) == (("yarn", 5e5) if "yarn" in case else ("llama3", 0.0))
    model, x, logits = imported_with_their_logits(hf, ref)
    if windowed:  # the window and the full layers' rule each bite
        assert_field_bites(model, x, logits, sliding_window=0)
        if "yarn" in case:
            assert_field_bites(model, x, logits, rope_scaling=0.0)
    assert_export_round_trips(model, x, tmp_path / "out", transformers.Olmo3ForCausalLM)


def test_olmo_blocks_with_what_no_olmo_holds_are_refused_at_export():
    from loom.config import ModelConfig
    from loom.model.hf import HFError, architecture_of

    olmo = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, norm_placement="post",
                       qk_norm=True, qk_norm_scope="all")  # fmt: skip
    assert architecture_of(olmo) == "Olmo2ForCausalLM"
    assert architecture_of(replace(olmo, sliding_window=8, window_layers="0")) == "Olmo3ForCausalLM"
    with pytest.raises(HFError, match=r"this model has Gemma's fields, a logit cap\); no other"):
        architecture_of(replace(olmo, attn_softcap=5.0, logit_softcap=3.0))
    with pytest.raises(HFError, match=r"this model has part of it\)"):
        architecture_of(replace(olmo, qk_norm=False))
    assert architecture_of(replace(olmo, qk_norm_scope="head")) == "Exaone4ForCausalLM"  # per-head norms
