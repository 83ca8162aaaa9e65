"""The user's path for the families and rules this Loom reads beyond Llama's: ``model.from_hf`` a tiny
random directory (its own tokenizer), one full fine-tuning step through the trainer, the model the
run records (what ``loom generate`` and ``loom export hf`` read) equal to the directory's, and the
exported directory loading back in ``transformers`` as the same family with the run's logits."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.testing import assert_close

from tests.helpers import HF_TINY, saved_random
from tests.test_finetune import prepared  # noqa: F401

BASE = HF_TINY | {"vocab_size": 384, "head_dim": 16}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
RUNS = {
    "GLM-4": ("Glm4", BASE | {"pad_token_id": 0}, {"rope_fraction": 0.5, "norm_placement": "sandwich"}),
    "SmolLM3": ("SmolLM3", BASE | {"num_hidden_layers": 4, "pad_token_id": 0}, {"nope_layers": "3"}),
    "OLMo 3, YaRN on its full layers": (
        "Olmo3",
        BASE | {"num_hidden_layers": 4, "sliding_window": 8, "rope_scaling": YARN},
        {"window_layers": "0,1,2", "rope_kind": "yarn", "rope_local_theta": 5e5},
    ),
    "StarCoder 2": ("Starcoder2", BASE | {"sliding_window": 8}, {"norm": "layernorm", "sliding_window": 8}),
    "Phi-4-mini's LongRoPE": (
        "Phi3",
        BASE
        | {"pad_token_id": 0, "partial_rotary_factor": 0.75, "original_max_position_embeddings": 16}
        | {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}},
        {"rope_fraction": 0.75, "rope_kind": "longrope"},
    ),
}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", list(RUNS))
def test_a_run_from_the_directory_records_its_model_and_exports_it(prepared, tmp_path, name):  # noqa: F811
    from loom import config as C
    from loom.checkpoint.hf_export import export_hf
    from loom.checkpoint.load import CheckpointReader
    from loom.data.tokenizer import load_tokenizer
    from loom.model.hf import load_into, open_dir
    from loom.model.llama import Transformer
    from tests.test_finetune import hf_lora_config, trainer_fit

    family, fields, expect = RUNS[name]
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}{'TextConfig' if family == 'Gemma3' else 'Config'}")(**fields)
    base = tmp_path / "base"
    saved_random(getattr(transformers, f"{family}ForCausalLM")(config).eval(), base)
    load_tokenizer(prepared).save(str(base / "tokenizer.json"))
    run = tmp_path / "run"
    cfg = hf_lora_config(prepared, base, run, finetune={"method": "full"}, train={"steps": 1})
    losses = trainer_fit(cfg)
    assert len(losses) == 1 and losses[0] == losses[0]
    with CheckpointReader(run) as reader:
        saved = C.from_dict(reader.train_state["config"]).model
    assert saved.hf_architecture == f"{family}ForCausalLM"
    for field, value in expect.items():
        assert getattr(saved, field) == value, field
    out = tmp_path / "out"
    export_hf(run, out, dtype="fp32")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == f"{family}ForCausalLM"
    hf = open_dir(out, 32)
    ours = Transformer(hf.config).eval()
    load_into(ours, hf)
    x = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(ours(x), back(x).logits)
