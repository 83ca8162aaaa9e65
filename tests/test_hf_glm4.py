"""GLM-4 (``Glm4ForCausalLM``, GLM-4-9B/32B-0414): a norm before and after attention and MLP
(``post_self_attn_layernorm``, ``post_mlp_layernorm``: ``model.norm_placement = sandwich``), q/k/v
biases, gate and up fused in ``gate_up_proj``, and RoPE on half of each head with its pairs
interleaved as Loom's own (no rows reordered). Tiny random models built by ``transformers``
(nothing downloaded) import with its logits (its default half rotation and a whole one), any box of
the fused tensor reads only its rows, the export loads back as GLM-4 with the same logits and the KV
cache agrees; a native GLM-4-shaped model trains equal to one process under tp2 + sp and cp2."""

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


@pytest.mark.parametrize("partial", [None, 1.0], ids=["half of each head (default)", "whole heads"])
def test_glm4_imports_with_transformers_logits_and_exports_as_glm4(tmp_path, partial):
    from loom.model.hf import Reader, open_dir, read_state

    torch.manual_seed(0)
    fields = HF_TINY | {"head_dim": 16, "pad_token_id": 0}  # not Glm4Config's 151329
    fields |= {} if partial is None else {"partial_rotary_factor": partial}
    ref = transformers.Glm4ForCausalLM(transformers.Glm4Config(**fields)).eval()
    saved_random(ref, tmp_path / "src")
    hf = open_dir(tmp_path / "src", 32)
    cfg = hf.config
    assert (cfg.hf_architecture, cfg.norm_placement, cfg.qkv_bias) == ("Glm4ForCausalLM", "sandwich", True)
    assert cfg.rope_fraction == (0.5 if partial is None else 1.0)
    model, x, logits = imported_with_their_logits(hf, ref)
    if partial is None:
        assert_field_bites(model, x, logits, rope_fraction=1.0)
    with Reader(hf) as reader:  # rows of the fused gate_up_proj: w3's half, and a box inside it
        for name, whole in read_state(hf, {"layers.1.feed_forward.w3.weight"}):
            assert torch.equal(reader.read(name, (slice(10, 50), slice(3, 40))), whole[10:50, 3:40])
    assert_export_round_trips(model, x, tmp_path / "out", transformers.Glm4ForCausalLM)


# no q/k/v biases here: a key bias on the unrotated dims adds q·b to every score of a row, which the
# softmax ignores, so its gradient is exactly zero in theory and rounding noise in practice, which Adam
# turns into full-size updates that differ between layouts (the biases train equal under tp2 alone:
# tests/test_hf.py's Qwen2)
GLM4_NATIVE = {"norm_placement": "sandwich", "rope_fraction": 0.5, "init_std": 0.2}


def _layouts(layouts: list[dict]) -> list[dict]:
    from tests.helpers import train_layout

    return [train_layout(layout, 3, 4, 2, GLM4_NATIVE) for layout in layouts]


def test_a_glm4_shaped_model_trains_equal_to_one_process(pools):
    from tests.helpers import assert_layouts_equal, train_layout

    ref = train_layout({}, 3, 4, 2, GLM4_NATIVE)
    names, layouts = ["tp2 sp", "cp2 ring"], [{"tp": 2, "sp": True}, {"cp": 2, "cp_mode": "ring"}]
    assert_layouts_equal(ref, pools(2).run(_layouts, layouts), names)
