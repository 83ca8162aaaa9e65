"""A padded vocabulary reloaded on another layout (issue 34): a tp2 run pads a vocabulary of 385 to 512
rows (automatic ``model.pad_vocab_to``); resumed in one process or dp2 × ZeRO-3 (flat shards), where
the same automatic rule gives 385 rows, the checkpoint's vocabulary tensors (weights and optimizer state) read as 385 rows (the rows
past them were padding), and the run continues as tp2 does; ``train.init_from`` reads them the same
way; ``loom export hf`` writes 385 rows that ``transformers`` loads with Loom's logits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers
from torch.testing import assert_close

from loom import config as C
from loom.config import ConfigError
from tests.test_hf import _config, _train, prepared  # noqa: F401 (fixture)

V, PADDED = 385, 512  # 384 tokens + 1: tp2 pads to 512 = 2 * 128 * 2; tp1 keeps 385


def _final(run: Path) -> tuple[C.ModelConfig, dict[str, torch.Tensor]]:
    from loom.checkpoint.load import CheckpointReader

    with CheckpointReader(run) as reader:
        model = C.from_dict(reader.train_state["config"]).model
        return model, {n[6:]: reader.read(n) for n in reader.names() if n.startswith("model.")}


def _logits(model: C.ModelConfig, state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    from loom.model.llama import Transformer

    m = Transformer(model)
    m.load_state_dict(state)
    with torch.no_grad():
        return m.eval()(x)


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines() if r.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_a_tp2_padded_checkpoint_resumes_in_one_process_and_exports_the_real_rows(
    pools,
    prepared,  # noqa: F811
    tmp_path,
):
    from loom.checkpoint.hf_export import export_hf
    from loom.model.llama import build_model
    from loom.train.init_from import CheckpointSource

    tp2 = _config(prepared, tmp_path / "tp2", tp=2)
    tp2["model"]["vocab_size"] = V
    tp2["train"] |= {"steps": 4, "checkpoint_every": 3, "checkpoint_keep": 0, "checkpoint_async": False}
    pools(2).run(_train, tp2)
    saved, padded = _final(tmp_path / "tp2")
    assert saved.pad_vocab_to == PADDED and padded["tok_embeddings.weight"].shape[0] == PADDED

    for layout, parallel in (("one", {}), ("dp2 zero3", {"zero": 3})):  # resumed at step 3: 385 rows
        cfg = json.loads(json.dumps(tp2))
        cfg["parallel"] = parallel
        cfg["run"]["dir"] = str(tmp_path / layout)
        cfg["train"]["resume"] = str(tmp_path / "tp2" / "checkpoints" / "step-00000003")
        if parallel:
            pools(2).run(_train, cfg)  # ZeRO-3: flat shards of the 385 rows
        else:
            _train(cfg)
        loss = _losses(tmp_path / layout)[4]
        assert_close(loss, _losses(tmp_path / "tp2")[4], rtol=1e-5, atol=1e-6, msg=layout)
        resumed, state = _final(tmp_path / layout)
        assert resumed.padded_vocab == V
        for name, t in state.items():  # Adam's moments of the padded rows were zero: the same update
            assert_close(
                t, padded[name][: t.shape[0]], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )
    x = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(0))
    want = _logits(saved, padded, x)
    assert want.shape == (2, 32, V)
    assert_close(_logits(resumed, state, x), want, rtol=1e-5, atol=1e-5)

    meta = build_model(resumed, 0, meta=True)  # train.init_from's reads: any box of the 385 rows
    src = CheckpointSource(tmp_path / "tp2", meta)
    box = src("output.weight", (V, 64), (slice(300, V), slice(0, 64)))
    assert torch.equal(box, padded["output.weight"][300:V])
    # another tokenizer's vocabulary is not padding: its rows would start as other tokens' vectors
    other = build_model(dataclasses.replace(resumed, vocab_size=V + 10, pad_vocab_to=0), 0, meta=True)
    with pytest.raises(ConfigError, match=f"vocabulary of {V} tokens, this run's has {V + 10}"):
        CheckpointSource(tmp_path / "tp2", other)

    export_hf(tmp_path / "tp2", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.vocab_size == V and hf.lm_head.weight.shape[0] == V
    with torch.no_grad():
        assert_close(hf(x).logits, want, rtol=1e-5, atol=1e-5)
