"""SmolLM3 (``SmolLM3ForCausalLM``): Llama's tensors with no RoPE on every fourth layer
(``no_rope_layers``: ``model.nope_layers``) and, with ``use_sliding_window``, a window on the NoPE
layers (or those ``layer_types`` names). Tiny random models built by ``transformers`` (nothing
downloaded) import with its logits; the export loads back as SmolLM3 with the same logits and the KV
cache agrees; a native model with NoPE layers trains equal to one process under tp2 + sp, pp2 and
cp2 ring; a family without NoPE is refused at export naming the field."""

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
    "every fourth layer NoPE": {},
    "NoPE layers listed": {"no_rope_layers": [0, 1, 1, 0]},
    "windowed NoPE layers": {"use_sliding_window": True, "sliding_window": 8},
}


@pytest.mark.parametrize("case", list(CASES))
def test_smollm3_imports_with_transformers_logits_and_exports_as_smollm3(tmp_path, case):
    from loom.model.hf import open_dir

    torch.manual_seed(0)
    fields = HF_TINY | {"num_hidden_layers": 4, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    ref = transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(**(fields | CASES[case]))).eval()
    saved_random(ref, tmp_path / "src")
    cfg = open_dir(tmp_path / "src", 32).config
    nope = "0,3" if "listed" in case else "3"
    assert (cfg.hf_architecture, cfg.nope_layers) == ("SmolLM3ForCausalLM", nope)
    assert (cfg.sliding_window, cfg.window_layers) == ((8, "3") if "windowed" in case else (0, "all"))
    model, x, logits = imported_with_their_logits(open_dir(tmp_path / "src", 32), ref)
    assert_field_bites(model, x, logits, nope_layers="")  # NoPE bites
    assert_export_round_trips(model, x, tmp_path / "out", transformers.SmolLM3ForCausalLM)


LAYOUTS = {"tp2 sp": {"tp": 2, "sp": True}, "pp2": {"pp": 2}, "cp2 ring": {"cp": 2, "cp_mode": "ring"}}
NOPE = {"nope_layers": "1", "init_std": 0.2}


def _layouts(names: list[str]) -> list[dict]:
    from tests.helpers import train_layout

    return [train_layout(LAYOUTS[n], 3, 4, 2, NOPE) for n in names]


def test_a_model_with_nope_layers_trains_equal_to_one_process(pools):
    """Layer 1 of the tiny model rotates nothing into q and k: tp2 + sp (each rank's heads), pp2 and
    cp2 ring (its rows of the tables, unused there) train 3 steps as one process does."""
    from tests.helpers import assert_layouts_equal, train_layout

    ref = train_layout({}, 3, 4, 2, NOPE)
    names = list(LAYOUTS)
    assert_layouts_equal(ref, pools(2).run(_layouts, names), names)


def test_nope_layers_outside_smollm3_are_refused_at_export():
    from loom.config import ModelConfig
    from loom.model.hf import HFError, architecture_of

    cfg = ModelConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, nope_layers="3")
    assert architecture_of(cfg) == "SmolLM3ForCausalLM"
    with pytest.raises(HFError, match=r"^model.nope_layers: among the supported Hugging Face families only"):
        architecture_of(replace(cfg, qk_norm=True))
    with pytest.raises(HFError, match=r"^model.nope_layers: .*this model's are LlamaForCausalLM's"):
        architecture_of(replace(cfg, hf_architecture="LlamaForCausalLM"))
