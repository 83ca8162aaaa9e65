"""EXAONE 4 (``Exaone4ForCausalLM``): OLMo 2's norms after attention and MLP with per-head q/k norms
(``model.qk_norm_scope = head``), a window on three layers of four (``sliding_window_pattern``) and no
RoPE on the others (``model.nope_layers``). Tiny random models built by ``transformers`` (nothing
downloaded) import with its logits (the window shorter than the sequences, and covering them: the
full layers still without RoPE); the export loads back as EXAONE 4 with them and the KV cache agrees."""

from __future__ import annotations

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


@pytest.mark.parametrize("window", [8, 64], ids=["window 8", "window beyond the sequences"])
def test_exaone4_imports_with_transformers_logits_and_exports_as_exaone4(tmp_path, window):
    from loom.model.hf import open_dir

    torch.manual_seed(0)
    fields = HF_TINY | {"num_hidden_layers": 4, "sliding_window": window, "head_dim": 16}
    ref = transformers.Exaone4ForCausalLM(transformers.Exaone4Config(**fields)).eval()
    saved_random(ref, tmp_path / "src")
    cfg = open_dir(tmp_path / "src", 32).config
    assert (cfg.hf_architecture, cfg.norm_placement, cfg.qk_norm_scope) == (
        "Exaone4ForCausalLM",
        "post",
        "head",
    )
    assert (cfg.sliding_window, cfg.window_layers, cfg.nope_layers) == (8 if window == 8 else 0, "0,1,2", "3")
    model, x, logits = imported_with_their_logits(open_dir(tmp_path / "src", 32), ref)
    assert_field_bites(model, x, logits, nope_layers="")
    assert_export_round_trips(model, x, tmp_path / "out", transformers.Exaone4ForCausalLM)


def test_an_exaone4_block_whose_nope_layers_are_not_its_full_ones_is_refused():
    from dataclasses import replace

    from loom.config import ModelConfig
    from loom.model.hf import HFError, architecture_of

    cfg = ModelConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, norm_placement="post", qk_norm=True,
                      sliding_window=8, window_layers="0,1,2", nope_layers="3")  # fmt: skip
    assert architecture_of(cfg) == "Exaone4ForCausalLM"
    with pytest.raises(HFError, match=r"^model.nope_layers: Exaone4ForCausalLM turns no RoPE on exactly"):
        architecture_of(replace(cfg, nope_layers="2,3"))
    with pytest.raises(HFError, match=r"^model.nope_layers: Exaone4ForCausalLM"):
        architecture_of(replace(cfg, nope_layers=""))
