"""Llama's tensors under other families' names and fields: Seed-OSS (``SeedOssForCausalLM``: q/k/v
biases, none on o), Helium (``HeliumForCausalLM``) and ERNIE 4.5 (``Ernie4_5ForCausalLM``), the last
two rotating q/k pairs interleaved as Loom does (no rows reordered). Tiny random models built by
``transformers`` (nothing downloaded) import with its logits; the export loads back as the same family
with them and the KV cache agrees; a Seed-OSS with o biases is refused naming the field."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from tests.helpers import HF_TINY, assert_export_round_trips, imported_with_their_logits, saved_random

FAMILIES = {
    "SeedOss": {"attention_bias": True, "head_dim": 16},
    "Helium": {"head_dim": 16, "pad_token_id": 0},
    "Ernie4_5": {"head_dim": 16, "tie_word_embeddings": False},
}


def _save(path, family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**(HF_TINY | FAMILIES[family]))
    ref = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    saved_random(ref, path)
    return ref


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_llama_likes_import_with_transformers_logits_and_export_as_themselves(tmp_path, family):
    from loom.model.hf import open_dir

    ref = _save(tmp_path / "src", family)
    hf = open_dir(tmp_path / "src", 32)
    assert hf.config.hf_architecture == f"{family}ForCausalLM"
    assert hf.config.qkv_bias == (family == "SeedOss")
    model, x, _ = imported_with_their_logits(hf, ref)
    assert_export_round_trips(model, x, tmp_path / "out", type(ref))


def test_a_seed_oss_with_o_biases_is_refused_naming_the_field(tmp_path):
    from loom.model.hf import HFError, open_dir

    _save(tmp_path, "SeedOss")
    raw = json.loads((tmp_path / "config.json").read_text()) | {"attention_out_bias": True}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        HFError, match=r"^config.json: attention_out_bias = True is not supported \(Loom: False\)$"
    ):
        open_dir(tmp_path, 32)
