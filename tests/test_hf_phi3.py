"""Phi-3 (``Phi3ForCausalLM``) in and out of Loom (issue 34, item 10): Llama's tensors with q/k/v fused
into ``qkv_proj`` and gate/up into ``gate_up_proj``. A tiny random Phi-3 built by ``transformers`` from a
config (nothing downloaded) imports with its logits (1 process, tp2), exports bit for bit, and a run
from it exports a directory ``transformers`` loads as Phi-3 with the run's weights; LoRA adapters on the
fused tensors load in PEFT; what Loom cannot run (a RoPE rule Phi-3 does not read, a short sliding
window) is refused in one line naming the field. (LongRoPE and partial rotation: tests/test_hf_rope.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from torch.testing import assert_close

from loom import config as C
from tests.test_finetune import _loom_lora_model, hf_lora_config, prepared, trainer_fit  # noqa: F401

SUPPORTED = (
    "LlamaForCausalLM, MistralForCausalLM, MinistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, "
    "GPT2LMHeadModel, Phi3ForCausalLM, Qwen3MoeForCausalLM, Olmo2ForCausalLM, Olmo3ForCausalLM, GemmaForCausalLM, "
    "Gemma2ForCausalLM, "
    "Gemma3ForCausalLM, SmolLM3ForCausalLM, Starcoder2ForCausalLM, Glm4ForCausalLM, SeedOssForCausalLM, "
    "HeliumForCausalLM, Ernie4_5ForCausalLM, GraniteForCausalLM, OlmoeForCausalLM, Exaone4ForCausalLM"
)
FIELDS = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # q, k, v of unequal rows in qkv_proj: 64, 32, 32
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def save_phi3(path: Path, vocab: int = 128, **kw) -> torch.nn.Module:
    """A random Phi-3 saved at ``path`` in several shards; every tensor random (norms around 1)."""
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**(FIELDS | {"vocab_size": vocab} | kw)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.eval().save_pretrained(path, max_shard_size="20KB")
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_import_gives_the_logits_of_transformers_and_exports_bit_for_bit(tmp_path, tie):
    """open_dir records the family; the fused rows land in wq/wk/wv and w1/w3 (the q/k heads
    reordered to Loom's rotary pairs); logits equal; hf_tensors writes qkv_proj and gate_up_proj back
    bit for bit; any box of a part reads only its rows of the fused tensor (a tp2 half: half the bytes)."""
    from loom.model.hf import Reader, hf_tensors, load_into, open_dir, read_state
    from loom.model.llama import Transformer

    ref = save_phi3(tmp_path, tie_word_embeddings=tie)
    hf = open_dir(tmp_path, 32)
    assert hf.config.hf_architecture == "Phi3ForCausalLM" and hf.config.tie_embeddings == tie
    model = Transformer(hf.config)
    load_into(model, hf)
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(model(x), ref(x).logits)
    out = dict(hf_tensors(hf.config, ((k, v.detach()) for k, v in model.state_dict().items())))
    theirs = ref.state_dict()
    if tie:
        theirs.pop("lm_head.weight")
    assert out.keys() == theirs.keys()
    for name, t in theirs.items():
        assert torch.equal(out[name], t), name
    g = torch.Generator().manual_seed(0)
    with Reader(hf) as reader:
        for name, whole in read_state(
            hf, {"layers.1.attention.wk.weight", "layers.0.feed_forward.w3.weight"}
        ):
            a = int(torch.randint(0, whole.shape[0] - 1, (), generator=g))
            box = (slice(a, int(torch.randint(a + 1, whole.shape[0] + 1, (), generator=g))), slice(3, 40))
            assert torch.equal(reader.read(name, box), whole[box]), name
            before, half = reader.bytes_read, whole.shape[0] // 2
            assert torch.equal(reader.read(name, (slice(half, None),)), whole[half:]), name
            assert reader.bytes_read - before == whole.numel() * whole.element_size() // 2, name


def test_import_under_tp2_pp2_zero3_cp2_gives_the_logits_of_transformers(pools, tmp_path):
    """Built on the meta device and read box by box under tp2 with sequence parallelism: each rank's
    q/k/v and gate/up rows come out of the fused tensors; its bytes read are exactly its parameters'.
    Under pp2 the loss through the pipeline is transformers'; under ZeRO-3 (each rank reading about
    half the checkpoint: its shards' rows) and cp2 (this rank's positions) the logits."""
    from loom.model.llama import loss_fn
    from tests.test_hf import _layout_outputs

    ref = save_phi3(tmp_path)
    x = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(x[:, :-1]).logits
    for rank in pools(2).run(_layout_outputs, [str(tmp_path)], x, "tp2"):
        logits, read, held, whole = rank[0]
        assert_close(logits, expected)
        assert read == held < whole
    for loss in pools(2).run(_layout_outputs, [str(tmp_path)], x, "pp2"):
        assert loss[0] == pytest.approx(float(loss_fn(expected, x[:, 1:])), rel=1e-5)
    for rank in pools(2).run(_layout_outputs, [str(tmp_path)], x, "zero3"):  # flat shards cut the fused rows
        logits, share = rank[0]
        assert_close(logits, expected)
        assert 0.4 < share < 0.6, share
    for rank in pools(2).run(_layout_outputs, [str(tmp_path)], x, "cp2"):
        pos, logits = rank[0]
        assert_close(logits, expected[:, pos])


def test_a_run_from_phi3_exports_phi3_with_its_weights(prepared, tmp_path):  # noqa: F811
    """2 full fine-tuning steps from a Phi-3 directory; the saved config records the family, so
    ``export hf`` writes a Phi-3 directory (the source's config and token ids) that transformers loads
    with the run's weights (equal to the checkpoint's, fused) and Loom's logits."""
    from loom.checkpoint.hf_export import export_hf
    from loom.checkpoint.load import CheckpointReader
    from loom.data.tokenizer import load_tokenizer
    from loom.model.hf import hf_tensors
    from loom.model.llama import Transformer

    base = tmp_path / "phi3"
    save_phi3(base, vocab=384)
    load_tokenizer(prepared).save(str(base / "tokenizer.json"))
    run = tmp_path / "run"
    cfg = hf_lora_config(prepared, base, run, finetune={"method": "full"}, train={"steps": 2})
    trainer_fit(cfg)
    export_hf(run, tmp_path / "out", dtype="fp32")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["Phi3ForCausalLM"] and written["pad_token_id"] == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(theirs) is transformers.Phi3ForCausalLM
    with CheckpointReader(run) as reader:
        saved = C.from_dict(reader.train_state["config"]).model
        assert saved.hf_architecture == "Phi3ForCausalLM"
        state = {n[len("model.") :]: reader.read(n) for n in reader.names() if n.startswith("model.")}
    want = dict(hf_tensors(saved, iter(state.items())))
    got = theirs.state_dict()
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    model = Transformer(saved)
    model.load_state_dict(state)
    x = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(theirs(x).logits, model.eval()(x))


@pytest.mark.parametrize("targets", ["all-linear", "q,v,w3"])
def test_peft_adapters_on_the_fused_tensors_load_with_equal_logits(tmp_path, targets):
    """Loom's adapters on wq/wk/wv (w1/w3) become one block-diagonal adapter of qkv_proj (gate_up_proj)
    of rank n·r, B_j at its part's rows (unequal: 64, 32, 32), zeros for a part not targeted; PEFT
    loads it on the Phi-3 base with Loom's LoRA logits."""
    import peft
    from safetensors.torch import save_file

    from loom.finetune.export import peft_state

    base = save_phi3(tmp_path / "base")
    cfg, model = _loom_lora_model(tmp_path / "base", targets)
    pairs = {
        f"{name}.weight": (m.lora_A.weight.detach(), m.lora_B.weight.detach())
        for name, m in model.named_modules()
        if hasattr(m, "lora_A")
    }
    tensors, config = peft_state(cfg, pairs)
    qkv = "self_attn.qkv_proj"
    assert config["rank_pattern"][qkv] == 3 * cfg.finetune.lora_rank
    assert ("mlp.gate_up_proj" in config["rank_pattern"]) == (targets == "all-linear" or "w3" in targets)
    out = tmp_path / "adapter"
    out.mkdir()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config))
    theirs = peft.PeftModel.from_pretrained(base, str(out)).eval()
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(theirs(x).logits, model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "edit,says",
    [
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
            "config.json: rope_parameters.rope_type = 'linear' is not supported for Phi3ForCausalLM (Loom: "
            "default, longrope)",
        ),
        (
            {"architectures": ["Gemma3ForConditionalGeneration"]},  # its text model is read from text_config
            "config.json: a field has a value of the wrong type: text_config = null, want an object "
            "(Gemma3ForConditionalGeneration's text model)",
        ),
        (
            {"architectures": ["Llama4ForConditionalGeneration"]},
            "config.json: architectures = 'Llama4ForConditionalGeneration' is not supported (Loom's model "
            "lacks a vision encoder); supported: " + SUPPORTED,
        ),
        (
            {"architectures": ["GPTNeoXForCausalLM"]},
            "config.json: architectures = 'GPTNeoXForCausalLM' is not supported (Loom's model lacks attention "
            "and MLP in parallel); supported: " + SUPPORTED,
        ),
    ],
    ids=["linear rope", "gemma3 with vision, no text_config", "llama4 with vision", "unknown"],
)
def test_what_loom_cannot_run_is_one_line_naming_the_field(tmp_path, edit, says):
    from loom.model.hf import HFError, open_dir

    save_phi3(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text()) | edit
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HFError) as e:
        open_dir(tmp_path, 32)
    assert str(e.value) == says


def test_a_family_that_cannot_hold_the_tensors_is_refused_in_one_line():
    """model.hf_architecture names the family export writes; Phi-3 (or Mistral) holds Llama's tensors
    only: q/k/v biases under Phi-3 are refused naming the field."""
    from loom.model.hf import HFError, architecture_of, hf_config

    llama = C.ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64)
    assert architecture_of(llama) == "LlamaForCausalLM"
    llama.hf_architecture = "Phi3ForCausalLM"
    assert hf_config(llama)["model_type"] == "phi3"
    llama.qkv_bias = True
    with pytest.raises(HFError) as e:
        architecture_of(llama)
    assert str(e.value) == (
        "model.hf_architecture: Phi3ForCausalLM cannot hold this model's tensors (LlamaForCausalLM "
        "does); set it to auto or to that family"
    )
    llama.hf_architecture = "Qwen2ForCausalLM"  # Qwen2 holds q/k/v biases, Llama with zero o biases
    assert hf_config(llama)["model_type"] == "qwen2"
    llama.hf_architecture = "auto"
    assert (hf_config(llama)["model_type"], hf_config(llama)["attention_bias"]) == ("llama", True)
