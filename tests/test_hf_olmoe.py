"""OLMoE (``OlmoeForCausalLM``): Llama's block with q/k RMSNorms over all heads (``model.qk_norm_scope
= all``, as OLMo 2's) and every MLP a mixture of experts under Qwen3-MoE's names (``mlp.gate``,
``mlp.experts.e.{gate,up,down}_proj``), top-k not renormalized by default (``norm_topk_prob`` ->
``moe.norm_topk``). A tiny random OLMoE built by ``transformers`` (nothing downloaded) imports with its
logits, with the routing taken over; the export loads back as OLMoE with them and the KV cache
agrees; a ``clip_qkv`` (a clamp Loom does not apply) is refused naming the field."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from tests.helpers import HF_TINY, assert_export_round_trips, imported_with_their_logits, saved_random


def _save(path, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    fields = HF_TINY | {"num_experts": 4, "num_experts_per_tok": 2, "pad_token_id": 0} | kw
    ref = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**fields)).eval()
    saved_random(ref, path)
    return ref


@pytest.mark.parametrize("norm_topk", [False, True])
def test_olmoe_imports_with_transformers_logits_and_exports_as_olmoe(tmp_path, norm_topk):
    from loom.model.hf import moe_options, open_dir

    ref = _save(tmp_path / "src", norm_topk_prob=norm_topk)
    hf = open_dir(tmp_path / "src", 32)
    cfg = hf.config
    assert (cfg.hf_architecture, cfg.n_experts, cfg.top_k, cfg.qk_norm_scope) == (
        "OlmoeForCausalLM",
        4,
        2,
        "all",
    )
    assert moe_options(hf) == {"norm_topk": norm_topk}
    model, x, _ = imported_with_their_logits(hf, ref)
    assert_export_round_trips(model, x, tmp_path / "out", transformers.OlmoeForCausalLM)


def test_olmoes_clip_qkv_is_refused_naming_the_field(tmp_path):
    from loom.model.hf import HFError, open_dir

    _save(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text()) | {"clip_qkv": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HFError, match=r"^config.json: clip_qkv = 8.0 is not supported \(Loom: None\)$"):
        open_dir(tmp_path, 32)
