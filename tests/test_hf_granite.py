"""Granite (``GraniteForCausalLM``, IBM Granite 3.x): Llama's tensors with four scales, the token
embeddings' (``embedding_multiplier``: ``model.embed_multiplier``), each branch's before its residual
add (``residual_multiplier``), the scores' in place of 1/sqrt(d) (``attention_multiplier``:
``model.attn_scale``) and the logits' divisor (``logits_scaling``: ``model.logit_divisor``, applied to
the head's input so every head path and the fused loss take it). A tiny random Granite built by
``transformers`` (nothing downloaded) imports with its logits, each scale biting; the export loads back
as Granite with them and the KV cache agrees; a native model with the scales trains equal to one
process under tp2 + sp and pp2 (the head on the last stage)."""

from __future__ import annotations

import torch
import transformers

from tests.helpers import (
    HF_TINY,
    assert_export_round_trips,
    assert_field_bites,
    imported_with_their_logits,
    saved_random,
)

SCALES = {
    "embedding_multiplier": 3.0,
    "residual_multiplier": 0.5,
    "attention_multiplier": 0.3,
    "logits_scaling": 4.0,
}


def test_granite_imports_with_transformers_logits_and_exports_as_granite(tmp_path):
    from loom.model.hf import open_dir

    torch.manual_seed(0)
    ref = transformers.GraniteForCausalLM(transformers.GraniteConfig(**(HF_TINY | SCALES))).eval()
    saved_random(ref, tmp_path / "src")
    hf = open_dir(tmp_path / "src", 32)
    cfg = hf.config
    assert cfg.hf_architecture == "GraniteForCausalLM"
    assert (cfg.embed_multiplier, cfg.residual_multiplier, cfg.attn_scale, cfg.logit_divisor) == (
        3.0,
        0.5,
        0.3,
        4.0,
    )
    model, x, logits = imported_with_their_logits(hf, ref)
    for field in ("embed_multiplier", "residual_multiplier", "logit_divisor"):
        assert_field_bites(model, x, logits, **{field: 1.0})
    assert_field_bites(model, x, logits, attn_scale=0.0)
    assert_export_round_trips(model, x, tmp_path / "out", transformers.GraniteForCausalLM)


GRANITE = {"embed_multiplier": 3.0, "residual_multiplier": 0.5, "logit_divisor": 4.0, "attn_scale": 0.3}


def _layouts(layouts: list[dict]) -> list[dict]:
    from tests.helpers import train_layout

    return [train_layout(layout, 3, 4, 2, GRANITE) for layout in layouts]


def test_granites_scales_train_equal_to_one_process(pools):
    from tests.helpers import assert_layouts_equal, train_layout

    ref = train_layout({}, 3, 4, 2, GRANITE)
    names, layouts = ["tp2 sp", "pp2"], [{"tp": 2, "sp": True}, {"pp": 2}]
    assert_layouts_equal(ref, pools(2).run(_layouts, layouts), names)
