"""Hugging Face interop: tiny random-init ``transformers`` models saved locally (nothing downloaded),
imported into Loom with logits equal to ``transformers``'; Loom checkpoints of any layout exported
to a directory ``AutoModelForCausalLM`` loads with logits equal to Loom's; one-line errors."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import transformers
from torch.testing import assert_close

from loom import config as C
from tests.helpers import HF_TINY

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 64}),
    # Mistral-Nemo's shape: head_dim 32 != hidden_size / heads = 16 (q/k/v/o and RoPE of width a·d, d)
    "mistral-nemo": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 64, "head_dim": 32}),
    "llama3.1": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),  # long-context RoPE: every band hit with d = 16
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v biases
    # Qwen2's attention in Llama's layout: q/k/v/o biases, o's zero (_save_hf zeroes it)
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True}),
    # biases on every linear but the head (model.bias), up_proj's zero (SwiGLU's w3 has none in Loom)
    "llama-all-bias": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),  # q/k norms, head_dim != hidden / heads
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_inner": 96},
    ),  # LayerNorm, gelu_new, learned positions, biases
}


def _save_hf(tmp: Path, family: str, tie: bool, **kw) -> tuple[Path, torch.nn.Module]:
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    fields = HF_TINY | dict(tie_word_embeddings=tie, rope_theta=5e5)
    cfg = getattr(transformers, cfg_cls)(**(fields | extra | kw))
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # every tensor random (biases and norm weights start as constants)
        for p in model.parameters():
            norm = (
                p.dim() == 1
                and any(k in _name_of(model, p) for k in ("norm.", "ln_"))
                and "bias" not in _name_of(model, p)
            )
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if norm else 0.0))
            # the bias Loom has no tensor for: o's beside q/k/v biases alone, up's beside every other
            if _name_of(model, p).endswith(
                "up_proj.bias" if getattr(cfg, "mlp_bias", False) else "o_proj.bias"
            ):
                p.zero_()
    out = tmp / f"{family}-{'tied' if tie else 'untied'}"
    model.save_pretrained(out, max_shard_size="20KB")  # several shards and an index
    return out, model


def _name_of(model: torch.nn.Module, p: torch.Tensor) -> str:
    return next(n for n, q in model.named_parameters() if q is p)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tie", [False, True])
def test_import_gives_the_logits_of_transformers(tmp_path, family, tie):
    from loom.model.hf import load_into, open_dir
    from loom.model.llama import Transformer

    path, ref = _save_hf(tmp_path, family, tie)
    assert (path / "model.safetensors.index.json").is_file()
    hf = open_dir(path, max_seq_len=32)
    model = Transformer(hf.config)
    load_into(model, hf)
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(model(x), ref(x).logits)


def test_a_rope_scaling_added_beside_rope_parameters_wins_as_in_transformers(tmp_path):
    """A transformers-5 directory carries ``rope_parameters``; a ``rope_scaling`` added to its
    config.json (model cards' long-context edit) replaces it whole in transformers (base: the
    top-level ``rope_theta``), so Loom reads it too: llama3 scaling gives transformers' logits, and an
    unsupported kind is refused, never read as the default RoPE."""
    from loom.model.hf import HFError, load_into, open_dir
    from loom.model.llama import Transformer

    path, _ = _save_hf(tmp_path, "llama", False)
    raw = json.loads((path / "config.json").read_text())
    assert raw.get("rope_parameters")  # what transformers 5 wrote
    scaling = dict(FAMILIES["llama3.1"][2]["rope_scaling"])
    (path / "config.json").write_text(json.dumps(raw | {"rope_scaling": scaling}))
    ref = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    hf = open_dir(path, max_seq_len=32)
    assert hf.config.rope_scaling == 8.0
    model = Transformer(hf.config)
    load_into(model, hf)
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(model(x), ref(x).logits)
    (path / "config.json").write_text(
        json.dumps(raw | {"rope_scaling": {"rope_type": "proportional", "factor": 4.0}})
    )
    with pytest.raises(HFError, match="rope_scaling.rope_type = 'proportional' is not supported"):
        open_dir(path, 32)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_box_is_read_alone_and_equals_that_box_of_the_whole(tmp_path, family):
    """``Reader.read(name, box)`` with ``get_slice``: any box (rows cutting through rotary heads,
    some of Mixtral's experts, part of GPT-2's fused, transposed c_attn) equals the whole tensor's
    box, and a tp2 rank's half along dim 0 costs exactly half the tensor's bytes."""
    from loom.model.hf import Reader, open_dir, read_state

    path, _ = _save_hf(tmp_path, family, False)
    hf = open_dir(path, 32)
    g = torch.Generator().manual_seed(0)
    with Reader(hf) as reader:
        for name, whole in read_state(hf):
            box = []
            for n in whole.shape:
                a = int(torch.randint(0, n, (), generator=g))
                box.append(slice(a, int(torch.randint(a + 1, n + 1, (), generator=g))))
            assert torch.equal(reader.read(name, tuple(box)), whole[tuple(box)]), name
            if whole.shape[0] % 2 == 0 and not name.endswith(
                ("q_norm.weight", "k_norm.weight")
            ):  # one head: whole
                before, half = reader.bytes_read, whole.shape[0] // 2
                assert torch.equal(reader.read(name, (slice(half, None),)), whole[half:]), name
                assert reader.bytes_read - before == whole.numel() * whole.element_size() // 2, name


def test_rope_row_order_round_trips():
    from loom.model.hf import to_hf_rows, to_loom_rows

    w = torch.randn(4 * 16, 8)
    assert torch.equal(to_hf_rows(to_loom_rows(w, 4), 4), w)
    assert not torch.equal(to_loom_rows(w, 4), w)


@pytest.mark.parametrize(
    "family,edit,match",
    [
        (
            "llama",
            {"architectures": ["GPTNeoXForCausalLM"]},
            r"architectures = 'GPTNeoXForCausalLM' is not supported \(Loom's model lacks attention and MLP in "
            r"parallel\); supported: Llama",
        ),
        ("llama", {"hidden_act": "gelu"}, r"hidden_act = 'gelu' is not supported"),
        ("mistral", {"attention_bias": True}, r"attention_bias = True is not supported"),
        ("llama", {"mlp_bias": True}, r"mlp_bias = True is not supported"),  # Loom: with attention_bias only
        # Llama's attention_bias is read (q/k/v biases, zero o biases): the biases must be there
        ("llama", {"attention_bias": True}, r"tensor model.layers.0.self_attn.k_proj.bias is missing"),
        (
            "llama",
            {"rope_scaling": {"rope_type": "proportional", "factor": 4.0}, "rope_parameters": None},
            r"rope_scaling.rope_type = 'proportional' is not",
        ),
        (
            "gpt2",
            {"activation_function": "relu"},
            r"activation_function = 'relu' is not supported \(Loom: gelu_new, ",
        ),
        (
            "gpt2",
            {"scale_attn_by_inverse_layer_idx": True},
            r"scale_attn_by_inverse_layer_idx = True is not supported",
        ),
        ("gpt2", {"reorder_and_upcast_attn": True}, r"reorder_and_upcast_attn = True is not supported"),
        ("gpt2", {"scale_attn_weights": False}, r"scale_attn_weights = False is not supported"),
        ("gpt2", {"n_positions": 16}, r"n_positions = 16 is shorter than the sequences \(32\)"),
    ],
)
def test_unsupported_config_fields_are_named(tmp_path, family, edit, match):
    from loom.model.hf import HFError, open_dir

    path, _ = _save_hf(tmp_path, family, False)
    raw = json.loads((path / "config.json").read_text()) | edit
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HFError, match=match) as e:
        open_dir(path, 32)
    assert "\n" not in str(e.value)


def test_bad_tensors_and_files_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from loom.model.hf import HFError, open_dir

    path, _ = _save_hf(tmp_path, "llama", False)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.0.mlp.up_proj.weight"]
    tensors = load_file(str(path / shard))
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(95, 64)
    save_file(tensors, str(path / shard), metadata={"format": "pt"})
    with pytest.raises(  # from the header, before anything is loaded (or any rank starts)
        HFError,
        match=r"model.layers.0.mlp.up_proj.weight has shape \(95, 64\), config.json implies \(96, 64\)",
    ):
        open_dir(path, 32)
    os.remove(path / shard)
    with pytest.raises(HFError, match=f"{shard}: missing shard file"):
        open_dir(path, 32)
    windowed = open_dir(_save_hf(tmp_path / "m", "mistral", False, sliding_window=16)[0], 32).config
    assert (windowed.sliding_window, windowed.window_layers) == (16, "all")  # a window the sequences pass
    for f in [*path.glob("*.safetensors"), path / "model.safetensors.index.json"]:
        f.unlink()
    (path / "pytorch_model.bin").write_bytes(b"a pickle")  # the weights as a pickle only
    with pytest.raises(
        HFError, match=r"no \*.safetensors files \(it holds pytorch_model.bin: .*never pickles"
    ):
        open_dir(path, 32)


@pytest.mark.parametrize(
    "kw,says",
    [
        (
            {"mlp": "gelu_tanh", "bias": True},
            "model: a RoPE model with LayerNorm or a GELU MLP is a Starcoder2ForCausalLM among the supported "
            "Hugging Face families, which also needs norm = layernorm",
        ),
        (
            {"norm": "layernorm", "mlp": "gelu", "positions": "learned", "bias": True, "n_kv_heads": 2},
            "model: among the supported Hugging Face families only GPT2LMHeadModel holds positions = learned and "
            "norm = layernorm and mlp = gelu or gelu_tanh and bias = true, and it also needs n_kv_heads = n_heads",
        ),
        (
            {"norm": "layernorm", "qk_norm": True},
            "model: a RoPE model with LayerNorm or a GELU MLP is a Starcoder2ForCausalLM among the supported "
            "Hugging Face families, which also needs mlp = gelu_tanh or gelu, qk_norm = false",
        ),
    ],
    ids=["rope+gelu+bias", "gpt2+gqa", "layernorm+qk_norm"],
)
def test_a_model_only_gpt2_or_starcoder2_could_hold_names_what_it_lacks(kw, says):
    """GPT-2's fields (LayerNorm, a GELU MLP) on a model neither GPT-2 (learned positions) nor StarCoder 2
    (RoPE) can hold are refused at export naming the fields it has or those the family needs as well,
    not a whole list."""
    from loom.model.hf import HFError, architecture_of

    with pytest.raises(HFError) as e:
        architecture_of(C.ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=64, **kw))
    assert str(e.value) == says


def test_biases_on_a_rope_model_go_out_as_a_llama_with_attention_and_mlp_biases():
    """model.bias on a RoPE SwiGLU model: Llama's attention_bias + mlp_bias (up_proj's bias zero);
    no family with q/k norms or experts holds them, nor Mistral, Phi-3 or Qwen2."""
    from loom.model.hf import HFError, architecture_of, hf_config, zero_tensors

    cfg = C.ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, ffn_dim=48, bias=True)
    raw = hf_config(cfg)
    assert (raw["model_type"], raw["attention_bias"], raw["mlp_bias"]) == ("llama", True, True)
    assert zero_tensors(cfg) == {
        f"layers.{i}.feed_forward.w3.weight": (f"model.layers.{i}.mlp.up_proj.bias", (48,)) for i in range(2)
    }
    for kw in ({"qk_norm": True}, {"n_experts": 4}):
        with pytest.raises(HFError, match="^model: bias = true on a RoPE model goes out as a Llama with"):
            architecture_of(C.ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=64, bias=True, **kw))
    for named in ("MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM"):
        with pytest.raises(HFError, match=f"model.hf_architecture: {named} cannot hold this model's tensors"):
            architecture_of(
                C.ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=64, bias=True, hf_architecture=named)
            )


def test_a_llama_with_a_nonzero_output_bias_is_refused_naming_it(tmp_path):
    """Llama's attention_bias is read as Qwen2's q/k/v biases; an o_proj bias Loom has nowhere to put is
    refused (from the shard, before any rank starts), naming the tensor."""
    from safetensors.torch import load_file, save_file

    from loom.model.hf import HFError, open_dir

    path, _ = _save_hf(tmp_path, "llama-bias", False)
    assert open_dir(path, 32).config.qkv_bias
    name = "model.layers.1.self_attn.o_proj.bias"
    shard = path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name][3] = 0.5
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(HFError, match=rf"{shard}: {name} is not zero; Loom reads attention_bias = true only"):
        open_dir(path, 32)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_quantized_weights_are_refused_in_one_line(tmp_path, dtype):
    """An fp8 (without its scales) or int8 checkpoint holds codes, not values: refused from the
    headers, naming the tensor, and a method Loom cannot dequantize from ``quantization_config``
    before any tensor is looked at."""
    from safetensors.torch import load_file, save_file

    from loom.model.hf import HFError, open_dir

    path, _ = _save_hf(tmp_path, "llama", False)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors = load_file(str(path / index["weight_map"][name]))
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(path / index["weight_map"][name]), metadata={"format": "pt"})
    with pytest.raises(HFError, match=f"tensor {name} is stored as [FI]8.*likely quantized") as e:
        open_dir(path, 32)
    assert "\n" not in str(e.value)
    raw = json.loads((path / "config.json").read_text())
    quant = {"quant_method": "awq", "bits": 4}
    (path / "config.json").write_text(json.dumps(raw | {"quantization_config": quant}))
    with pytest.raises(HFError, match=r"quantization_config \(quant_method = 'awq'\) is not supported"):
        open_dir(path, 32)
    quant = {"quant_method": "fp8", "weight_block_size": [128, 128]}  # fp8 codes without their scale
    (path / "config.json").write_text(json.dumps(raw | {"quantization_config": quant}))
    with pytest.raises(HFError, match=f"tensor {name} is stored as [FI]8.*likely quantized"):
        open_dir(path, 32)


def test_from_hf_bad_directory_fails_before_any_rank(tmp_path, capsys):
    from loom.cli import main

    assert main(["train", "--model.from_hf", str(tmp_path / "nope"), "--run.nproc", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("loom: error: model.from_hf:") and "no config.json" in err and "\n" not in err


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_trainer_starts_from_the_hf_weights_and_tokenizer(prepared, tmp_path, family):
    """``--model.from_hf``: the CLI takes shape (GPT-2's variants and position table included) and
    tokenizer from the directory, every rank loads the weights; before the first step the model is
    the Hugging Face one, tensor for tensor."""
    from loom.data.tokenizer import load_tokenizer
    from loom.model.hf import apply_to, hf_tensors
    from loom.train.trainer import RankEnv, Trainer

    path, ref = _save_hf(tmp_path, family, False, vocab_size=384)
    tok = load_tokenizer(prepared)  # a 384-token BPE stands in for the model's own tokenizer
    tok.save(str(path / "tokenizer.json"))
    d = _config("", tmp_path / "run")
    del d["model"]  # the directory decides the model (GPT-2's 4 key/value heads, not TRAIN's 2)
    cfg = C.from_dict(d)
    cfg.data.prepared_dir = ""
    apply_to(cfg, path)
    cfg.model.from_hf = str(path)
    assert cfg.data.tokenizer == str(path / "tokenizer.json") and cfg.model.dim == 64
    trainer = Trainer(cfg, RankEnv(0, 1, 0, 1))
    try:
        state = dict(hf_tensors(cfg.model, ((k, v.detach()) for k, v in trainer.model.state_dict().items())))
        for name, t in ref.state_dict().items():
            assert torch.equal(state[name], t), name
        trainer.fit()
    finally:
        trainer.heartbeat.close()


# ----------------------------------------------------------------------------- export

TRAIN = {
    "model": {
        "dim": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "max_seq_len": 64,
        "tie_embeddings": False,
    },
    "data": {"seq_len": 64, "vocab_size": 384, "max_corpus_mb": 0.3},
    "train": {
        "steps": 3,
        "global_batch": 4,
        "micro_batch": 2,
        "warmup_steps": 1,
        "log_every": 1,
        "eval_every": 0,
    },
    "run": {"progress": False, "tensorboard": False, "threads": 1},
}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    from loom.data import prepare_data

    os.environ.setdefault("LOOM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    return str(prepare_data(C.from_dict(json.loads(json.dumps(TRAIN))).data, progress=False).dir)


def _train(cfg_dict: dict) -> None:
    import torch.distributed as dist

    from loom.train.trainer import RankEnv, Trainer

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    trainer = Trainer(C.from_dict(cfg_dict), RankEnv(rank, world, rank, world))
    try:
        trainer.fit()
    finally:
        trainer.heartbeat.close()


def _config(prepared: str, run: Path, **parallel) -> dict:
    cfg = json.loads(json.dumps(TRAIN))
    cfg["data"]["prepared_dir"] = prepared
    cfg["run"]["dir"] = str(run)
    cfg["parallel"] = parallel
    return cfg


def _loom_logits(run: Path, x: torch.Tensor) -> torch.Tensor:
    from loom.model.llama import Transformer
    from loom.train.export import load_model

    cfg = C.load_toml(str(run / "config.toml"))
    model = Transformer(cfg.model)
    load_model(model, run / "checkpoints" / "final" / "model.safetensors")
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize(
    "layout",
    [
        "one process",
        "dp2 zero3",
        "tp2",
        "qwen2 tp2",
        "bias tp2",
        "qwen3 dp2",
        "mixtral ep2",
        "mixtral tp2",
        "gpt2 tp2",
    ],
)
def test_export_loads_in_transformers_with_equal_logits(pools, prepared, tmp_path, layout):
    from loom.checkpoint.hf_export import export_hf

    run = tmp_path / "run"
    par = {"tp2": {"tp": 2}, "zero3": {"zero": 3}, "ep2": {"ep": 2}}.get(layout.split()[-1], {})
    cfg = _config(prepared, run, **par)
    cfg["model"] |= {
        "qwen2": {"qkv_bias": True},
        "bias": {"bias": True},  # every linear but the head: a Llama with attention_bias and mlp_bias
        "qwen3": {"qk_norm": True, "attn_head_dim": 32},
        "mixtral": {"n_experts": 4, "top_k": 2},
        "gpt2": GPT2 | {"tie_embeddings": True},
    }.get(layout.split()[0], {})
    if layout == "one process":
        _train(cfg)
    else:
        pools(2).run(_train, cfg)
    done = export_hf(run, tmp_path / "hf", max_shard_bytes=100_000)
    assert done.shards > 1 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 384, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(hf(x).logits, _loom_logits(run, x))
    if layout.startswith(("qwen2", "bias")):  # q/k/v biases go out as a Llama (a qwen2's tokenizer is Qwen's)
        assert (hf.config.model_type, hf.config.attention_bias) == ("llama", True)
        assert hf.config.mlp_bias == layout.startswith("bias")
    _assert_auto_tokenizer_is_the_runs(tmp_path / "hf", run)
    assert done.tokenizer_problem is None


def _assert_auto_tokenizer_is_the_runs(export: Path, run: Path) -> None:
    """AutoTokenizer on the export encodes text to the ids of the run's own tokenizer.json."""
    from loom.checkpoint.hf_export import PROBE
    from loom.data.tokenizer import load_tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(export)
    for text in (PROBE, "def f():\n    return 1_000  # don't"):
        want = load_tokenizer(run / "tokenizer.json").encode(text, add_special_tokens=False).ids
        assert tok(text, add_special_tokens=False)["input_ids"] == want, text


def test_an_export_whose_tokenizer_transformers_replaces_is_named(prepared, tmp_path, caplog):
    """transformers' AutoTokenizer gives every qwen2 model Qwen2Tokenizer (Qwen's pre-tokenizer),
    whatever tokenizer.json says: an export named Qwen2 with another tokenizer (model.hf_architecture
    given) is written, with a one-line warning that names the class and the way to load it; a Llama
    export of the same tokenizer loads as it is."""
    from loom.checkpoint.hf_export import check_auto_tokenizer, export_hf

    run = tmp_path / "run"
    cfg = _config(prepared, run)
    cfg["model"] |= {"qkv_bias": True, "hf_architecture": "Qwen2ForCausalLM"}
    cfg["train"]["steps"] = 1
    _train(cfg)
    with caplog.at_level("WARNING", logger="loom.checkpoint.hf_export"):
        done = export_hf(run, tmp_path / "qwen2")
    assert json.loads((tmp_path / "qwen2" / "config.json").read_text())["model_type"] == "qwen2"
    line = done.tokenizer_problem
    assert line and line.startswith("transformers' AutoTokenizer loads the tokenizer as Qwen2Tokenizer")
    assert line.endswith("load it with transformers.PreTrainedTokenizerFast.from_pretrained")
    assert [r.getMessage() for r in caplog.records] == [f"{tmp_path / 'qwen2'}: {line}"]
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "qwen2")
    from loom.checkpoint.hf_export import PROBE
    from loom.data.tokenizer import load_tokenizer

    want = load_tokenizer(run / "tokenizer.json").encode(PROBE, add_special_tokens=False).ids
    assert fast(PROBE, add_special_tokens=False)["input_ids"] == want
    raw = json.loads((tmp_path / "qwen2" / "config.json").read_text())
    (tmp_path / "qwen2" / "config.json").write_text(json.dumps(raw | {"model_type": "llama"}))
    assert check_auto_tokenizer(tmp_path / "qwen2") is None


def test_the_tokenizer_check_needs_transformers_only_if_installed(prepared, tmp_path, monkeypatch):
    """Without transformers there is nothing to check against: the export is written, unchecked."""
    import sys

    from loom.checkpoint.hf_export import check_auto_tokenizer

    (tmp_path / "tokenizer.json").write_bytes((Path(prepared) / "tokenizer.json").read_bytes())
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ModuleNotFoundError
    assert check_auto_tokenizer(tmp_path) is None


def test_export_never_overwrites(prepared, tmp_path):
    from loom.checkpoint.format import CheckpointError
    from loom.checkpoint.hf_export import export_hf

    run = tmp_path / "run"
    _train(_config(prepared, run))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        export_hf(run, tmp_path / "taken")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"


def test_export_never_adopts_or_deletes_what_is_beside_its_output(prepared, tmp_path, monkeypatch):
    """A user's ``OUT.partial`` directory is neither deleted nor adopted (the export is built under a
    new hidden name, removed when the export fails); an existing file as OUT is refused as a file."""
    import loom.checkpoint.hf_export as hf_export

    run = tmp_path / "run"
    _train(_config(prepared, run))
    mine = tmp_path / "o9.partial"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (tmp_path / "ofile").write_text("a file")
    with pytest.raises(hf_export.CheckpointError, match=r"ofile: is a file, not a directory; choose a new"):
        hf_export.export_hf(run, tmp_path / "ofile")
    before = set(tmp_path.iterdir())

    def disk_full(path):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(hf_export, "_fsync", disk_full)  # after the first shard is written
        with pytest.raises(OSError, match="No space"):
            hf_export.export_hf(run, tmp_path / "o9")
    assert set(tmp_path.iterdir()) == before  # nothing left behind
    hf_export.export_hf(run, tmp_path / "o9")
    assert set(tmp_path.iterdir()) == before | {tmp_path / "o9"}
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"
    assert "notes.txt" not in {p.name for p in (tmp_path / "o9").iterdir()}
    assert (tmp_path / "o9").stat().st_mode & 0o777 == 0o777 & ~_umask()
    assert (tmp_path / "ofile").read_text() == "a file"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_config(d: Path, weights_from: Path, raw: dict) -> Path:
    """A copy of the directory ``weights_from`` with ``raw`` as its config.json."""
    import shutil

    shutil.copytree(weights_from, d)
    (d / "config.json").write_text(json.dumps(raw))
    return d


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_then_export_round_trips(tmp_path, family):
    """HF -> Loom (load_into) -> HF tensors: bit for bit."""
    from loom.model.hf import hf_tensors, load_into, open_dir
    from loom.model.llama import Transformer

    path, ref = _save_hf(tmp_path, family, False)
    hf = open_dir(path, 32)
    model = Transformer(hf.config)
    load_into(model, hf)
    out = dict(hf_tensors(hf.config, ((k, v.detach()) for k, v in model.state_dict().items())))
    from safetensors.torch import load_file

    on_disk = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert out.keys() == on_disk.keys()
    for name, t in on_disk.items():
        assert torch.equal(out[name], t), name
    if family == "gpt2":  # the hub's GPT-2 configs carry both lengths (llama.cpp's converter reads n_ctx)
        from loom.model.hf import hf_config

        raw = hf_config(hf.config)
        assert raw["n_ctx"] == raw["n_positions"] == hf.config.max_seq_len
        assert open_dir(_write_config(tmp_path / "again", path, raw), 32).config == hf.config


def test_export_carries_the_source_config_when_a_field_is_left_to_its_default(tmp_path):
    """GPT-2's save_pretrained writes ``"n_inner": null`` (4·n_embd) where Loom's description says
    the number: the same tensors, so the source's other fields (dropouts, special ids,
    ``task_specific_params``) are carried into the export (they were all dropped)."""
    from loom.checkpoint.hf_export import carried_config
    from loom.model.hf import hf_config, open_dir

    path, _ = _save_hf(tmp_path, "gpt2", False, n_inner=None, bos_token_id=1, eos_token_id=1)
    raw = json.loads((path / "config.json").read_text())
    raw["task_specific_params"] = {"text-generation": {"do_sample": True, "max_length": 50}}
    (path / "config.json").write_text(json.dumps(raw))
    assert raw["n_inner"] is None and raw["attn_pdrop"] == 0.1
    ours = hf_config(open_dir(path, 32).config)
    assert ours["n_inner"] == 4 * 64
    carried = carried_config(ours, path)
    for key in (
        "task_specific_params",
        "attn_pdrop",
        "resid_pdrop",
        "embd_pdrop",
        "bos_token_id",
        "eos_token_id",
    ):
        assert carried[key] == raw[key], key
    changed = carried_config(ours | {"n_layer": 3}, path)  # another shape: Loom's description alone
    assert "task_specific_params" not in changed


def test_an_export_carries_what_transformers_4x_clients_read(tmp_path, monkeypatch):
    """What a 4.x client (transformers 4.44-4.51, tokenizers 0.19-0.21, vLLM on them) reads: config.json's
    ``torch_dtype`` beside ``dtype``; Llama 3.1's ``rope_scaling`` without ``rope_theta`` (4.x checks its
    keys per type; the base stays beside it); a tokenizer class 4.x has (transformers 5's
    ``TokenizersBackend`` and a missing class become ``PreTrainedTokenizerFast``: 4.x would take the model
    type's class, whose <s> and <unk> fall beyond the vocabulary); the chat template in
    ``tokenizer_config.json`` too (4.x before 4.47 reads only that); BPE merges as "a b" strings (tokenizers
    0.19 reads no pairs). Each leaves transformers 5's reading unchanged: the same ids, template, logits."""
    from loom.checkpoint.hf_export import _tokenizer_files, carried_config, check_auto_tokenizer
    from loom.data.tokenizer import load_tokenizer, train_tokenizer
    from loom.model.hf import hf_config, open_dir

    path, _ = _save_hf(tmp_path, "llama3.1", False)
    hf = open_dir(path, 32)
    raw = hf_config(hf.config, "bfloat16")
    assert raw["dtype"] == raw["torch_dtype"] == "bfloat16"
    assert (
        "rope_theta" not in raw["rope_scaling"] and raw["rope_parameters"]["rope_theta"] == raw["rope_theta"]
    )
    assert raw["rope_scaling"]["rope_type"] == "llama3" and raw["rope_scaling"]["factor"] == 8.0
    again = _write_config(tmp_path / "again", path, raw)
    assert open_dir(again, 32).config == hf.config  # Loom reads its own export back
    assert transformers.AutoConfig.from_pretrained(again).rope_parameters["rope_theta"] == raw["rope_theta"]
    src = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(src | {"torch_dtype": "float32", "dtype": "float32"}))
    carried = carried_config(raw, path)  # the export's dtype in both keys, not the source's
    assert carried["dtype"] == carried["torch_dtype"] == "bfloat16"

    tok = train_tokenizer(["hello there, how are you today? fine thanks"] * 8, 300)
    run = tmp_path / "run"
    run.mkdir()
    tok.save(str(run / "tokenizer.json"))
    assert isinstance(json.loads((run / "tokenizer.json").read_text())["model"]["merges"][0], list)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (run / "chat_template.jinja").write_text(template)
    side = {"tokenizer_class": "TokenizersBackend", "backend": "tokenizers", "eos_token": "<|endoftext|>"}
    for given in (side, {"eos_token": "<|endoftext|>"}):  # saved by transformers 5; no class at all
        (run / "tokenizer_config.json").write_text(json.dumps(given))
        out = tmp_path / f"out{len(given)}"
        out.mkdir()
        _tokenizer_files(run, C.LoomConfig(), out, {"eos_token_id": 0})
        written = json.loads((out / "tokenizer_config.json").read_text())
        assert written["tokenizer_class"] == "PreTrainedTokenizerFast" and "backend" not in written
        assert written["clean_up_tokenization_spaces"] is False  # 4.x's default True alters decoded text
        assert written["chat_template"] == template == (out / "chat_template.jinja").read_text()
        merges = json.loads((out / "tokenizer.json").read_text())["model"]["merges"]
        assert merges and all(isinstance(m, str) and m.count(" ") == 1 for m in merges)
        text = "hello there, how are you? " * 3
        assert load_tokenizer(out / "tokenizer.json").encode(text).ids == tok.encode(text).ids
        assert check_auto_tokenizer(out) is None
        theirs = transformers.AutoTokenizer.from_pretrained(out)
        assert theirs(text)["input_ids"] == tok.encode(text).ids  # no invented special ids
        msgs = [{"role": "user", "content": "hi"}]
        assert theirs.apply_chat_template(msgs, tokenize=False) == "<user>hi"
    # a class that adds ids beyond the vocabulary (4.x's LlamaTokenizerFast prepended an <s> the
    # tokenizer.json lacks: generate's embedding lookup failed) is named by the export's check
    size, real = tok.get_vocab_size(), transformers.AutoTokenizer.from_pretrained

    class LlamaTokenizerFast4x:
        def __init__(self, d):
            self.inner = real(d)

        def __call__(self, text, add_special_tokens=True):
            ids = self.inner(text, add_special_tokens=False)["input_ids"]
            return {"input_ids": [size] * add_special_tokens + ids}

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", LlamaTokenizerFast4x)
    problem = check_auto_tokenizer(out)
    assert problem is not None and f"adds ids [{size}] beyond the {size}" in problem
    assert "LlamaTokenizerFast4x" in problem and "PreTrainedTokenizerFast.from_pretrained" in problem


def test_an_export_of_a_chat_run_carries_the_template_it_was_trained_on(tmp_path):
    """A run on chat data rendered by Loom's built-in template (its tokenizer has none) exports a
    ``chat_template.jinja`` with which transformers' ``apply_chat_template`` gives the same text, and
    the same generation prompt as ``loom generate --chat``."""
    from loom.checkpoint.hf_export import _tokenizer_files
    from loom.data.chat import ASSISTANT, builtin_render
    from loom.data.tokenizer import train_tokenizer

    tok = train_tokenizer(["hello there, how are you today? fine thanks"] * 8, 300)
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = C.LoomConfig()
    cfg.data.format = "chat"
    out = tmp_path / "out"
    out.mkdir()
    _tokenizer_files(tmp_path, cfg, out, {})
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi {{ x }} ü"},
        {"role": "assistant", "content": "hello\nthere"},
    ]
    assert theirs.apply_chat_template(msgs, tokenize=False) == builtin_render(msgs)
    with_prompt = theirs.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert with_prompt == builtin_render(msgs[:2]) + ASSISTANT
    cfg.data.format = "text"  # a run on plain text: no template is invented
    plain = tmp_path / "plain"
    plain.mkdir()
    _tokenizer_files(tmp_path, cfg, plain, {})
    assert not (plain / "chat_template.jinja").exists()
    tok = transformers.AutoTokenizer.from_pretrained(plain)  # Loom's own tokenizer pads with its EOT
    batch = tok(["hello", "how are you today"], padding=True)
    assert tok.pad_token == tok.eos_token and len(set(map(len, batch["input_ids"]))) == 1


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> Path:
    """A chat run (ChatML records, 2 steps) trained from its directory with ``--data.tokenizer tok``:
    a relative path to a ChatML tokenizer directory (template and eos <|im_end|> in its
    tokenizer_config.json, no pad token), as tests/test_data.py builds it."""
    from loom.data import prepare_data
    from tests.test_data import _chat_tokenizer, _chats

    root = tmp_path_factory.mktemp("chat")
    os.environ.setdefault("LOOM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    _chat_tokenizer(root)
    (root / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in _chats(40)))
    cfg = _config("", root / "run")
    cfg["data"] |= {"source": "chat.jsonl", "tokenizer": "tok", "format": "chat", "val_fraction": 0.1}
    cfg["train"]["steps"] = 2
    here = os.getcwd()
    os.chdir(root)
    try:
        cfg["data"]["prepared_dir"] = str(prepare_data(C.from_dict(cfg).data, progress=False).dir)
        _train(cfg)
    finally:
        os.chdir(here)
    return root / "run"


CHATML_PROMPT = "<|im_start|>user\nq1?<|im_end|>\n<|im_start|>assistant\n"


def test_a_chat_run_keeps_its_tokenizer_files_for_export_and_generate_from_anywhere(
    chat_run, tmp_path, monkeypatch, capsys
):
    """From another directory, where ``tok`` names another template: the run's own copy of its
    tokenizer's files gives export and generate the ChatML template and <|im_end|> it trained with
    (the built-in ``<|user|>`` template, or the other one, was taken silently). A run that kept none
    (an older Loom) whose ``data.tokenizer`` is not found is refused in one line; a kept file
    replaced since is refused as a replaced tokenizer.json is."""
    import shutil

    from loom.checkpoint.hf_export import export_hf
    from loom.cli import main as cli
    from loom.generate.source import load_run

    msgs = [{"role": "user", "content": "q1?"}]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tok").mkdir()
    shutil.copyfile(chat_run / "tokenizer.json", tmp_path / "tok" / "tokenizer.json")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 'other' }}"}))
    src = load_run(str(chat_run))
    assert src.render(msgs) == CHATML_PROMPT
    assert src.encode(msgs, chat=True) == src.tokenizer.encode(CHATML_PROMPT, add_special_tokens=False).ids
    export_hf(chat_run, tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == CHATML_PROMPT
    assert tok.eos_token == "<|im_end|>"
    shutil.rmtree(tmp_path / "tok")
    old = tmp_path / "old"  # as an older Loom left it: no copies, data.json without their hashes
    shutil.copytree(chat_run, old)
    (old / "tokenizer_config.json").unlink()
    record = json.loads((old / "data.json").read_text())
    (old / "data.json").write_text(json.dumps({k: v for k, v in record.items() if "/" not in k}))
    for argv in (["export", "hf", str(old), str(tmp_path / "hf2")], ["generate", "--run.dir", str(old)]):
        assert cli(argv) == 2
        err = capsys.readouterr().err
        assert (
            err.count("\n") == 1 and f"data.tokenizer: tok not found from {tmp_path}; the chat run" in err
        ), err
    edited = tmp_path / "edited"
    shutil.copytree(chat_run, edited)
    (edited / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 'other' }}"}))
    for argv in (
        ["export", "hf", str(edited), str(tmp_path / "hf3")],
        ["generate", "--run.dir", str(edited)],
    ):
        assert cli(argv) == 2
        err = capsys.readouterr().err
        said = (
            f"{edited / 'tokenizer_config.json'}: not the tokenizer's tokenizer_config.json this run trained"
        )
        assert err.count("\n") == 1 and said in err, err
    assert not (tmp_path / "hf2").exists() and not (tmp_path / "hf3").exists()


def test_the_export_of_a_chat_tokenizer_pads_batches_and_stops_at_either_end_token(chat_run, tmp_path):
    """The ChatML tokenizer's config (eos <|im_end|>, no pad token) is exported with its fields plus a
    pad token (config.json's pad id, Loom's <|endoftext|>) and model_max_length; generation_config
    lists both end ids: batched padding works and transformers' generate (and loom generate) stop
    at either."""
    from loom.checkpoint.hf_export import export_hf
    from loom.generate.source import load_run

    out = tmp_path / "hf"
    export_hf(chat_run, out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    ends = [tok.convert_tokens_to_ids("<|im_end|>"), config["eos_token_id"]]
    assert tok.eos_token_id == ends[0] != ends[1] == tok.pad_token_id == config["pad_token_id"]
    assert tok.pad_token == "<|endoftext|>" and tok.model_max_length == 64
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == ends
    assert load_run(str(chat_run)).eos == set(ends)
    tok.padding_side = "left"
    batch = tok(["q1?", "thanks a lot, be brief"], padding=True, return_tensors="pt")
    assert batch["attention_mask"][0, 0] == 0
    # a causal LM's inputs only (transformers 4.x's generate refuses a token_type_ids it is handed)
    assert set(batch) == {"input_ids", "attention_mask"}
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    for end in ends:  # each end id, made the greedy choice, ends both rows at once
        got = model.generate(**batch, do_sample=False, max_new_tokens=4, sequence_bias={(end,): 100.0})
        assert got[:, batch["input_ids"].shape[1] :].tolist() == [[end], [end]], end


# ----------------------------------------------------------------------------- parallel layouts

TP_FAMILIES = [
    "llama",
    "mistral",
    "mistral-nemo",
    "llama3.1",
    "qwen2",
    "qwen3",
    "gpt2",
]  # experts under tp: not implemented


@pytest.mark.parametrize("kv", [2, 1])
def test_import_under_tp2_gives_the_logits_of_transformers(pools, tmp_path, kv):
    """Every dense family under tp2 with sequence parallelism, built on the meta device and read box by
    box: biases (sharded with a column-parallel layer's rows, added after the Σ of a row-parallel one),
    q/k norms, LayerNorm and the learned position table (their gradients partial with sp), the GELU
    MLP; key/value heads sharded (kv = 2) or replicated with their biases (kv = 1 < tp). Each rank
    reads exactly the bytes of the parameters it holds (half of every sharded tensor)."""
    families = TP_FAMILIES if kv == 2 else ["llama", "qwen2", "qwen3"]  # GPT-2 has no grouped heads
    saved = [_save_hf(tmp_path, f, False, num_key_value_heads=kv) for f in families]
    x = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(1))
    results = pools(2).run(_layout_outputs, [str(p) for p, _ in saved], x, "tp2")
    for i, (family, (_, ref)) in enumerate(zip(families, saved)):
        with torch.no_grad():
            expected = ref(x[:, :-1]).logits
        for rank in results:
            logits, read, held, whole = rank[i]
            assert_close(logits, expected, msg=lambda m, f=family: f"{f}: {m}")
            assert read == held < whole, family  # its boxes only: less than the whole checkpoint


VARIANTS = {"qkv_bias": True, "qk_norm": True, "attn_head_dim": 16, "n_kv_heads": 1}  # dim 32 / 4 heads = 8
GPT2 = {"norm": "layernorm", "mlp": "gelu_tanh", "positions": "learned", "bias": True, "n_kv_heads": 4}


@pytest.mark.parametrize(
    "variants,layout",
    [
        (VARIANTS, {"tp": 2, "sp": True}),
        (VARIANTS, {"dp_shard": 2, "zero": 3}),
        (VARIANTS, {"pp": 2}),
        (GPT2, {"tp": 2, "sp": True}),
        (GPT2, {"tp": 2}),
        (GPT2, {"cp": 2}),
        (GPT2, {"pp": 2}),
    ],
    ids=["qwen tp2 sp", "qwen zero3", "qwen pp2", "gpt2 tp2 sp", "gpt2 tp2", "gpt2 cp2", "gpt2 pp2"],
)
def test_bias_and_qk_norm_train_equal_to_one_process(pools, variants, layout):
    """Gradients of the new tensors: q/k/v biases (sharded, or replicated with the key/value heads)
    and the replicated q/k norm weights, whose parts are summed over tp; GPT-2's row-parallel biases
    (added after the Σ), LayerNorm weights and biases and learned position rows (partial over tp with
    sp), its GELU MLP, and its position table at the global positions under cp, on the first stage
    under pp."""
    from tests.helpers import train_layout

    ref = train_layout({}, 4, 8, 2, variants)
    for r in pools(2).run(train_layout, layout, 4, 8, 2, variants, meta=True):
        assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-5)
        if r["state"] is not None:
            for k, v in ref["state"].items():
                assert_close(r["state"][k], v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_planner_counts_bias_and_qk_norm_parameters():
    from loom.model.llama import build_model, count_params
    from loom.plan.cost import ParamCounts
    from tests.helpers import tiny_model

    for kw in (
        VARIANTS,
        {"qkv_bias": True},
        {"qk_norm": True, "attn_head_dim": 16},
        {"qk_norm": True, "qk_norm_scope": "all", "norm_placement": "post"},  # OLMo-2
        GPT2,
        GPT2 | {"tie_embeddings": False, "mlp": "gelu"},
    ):
        cfg = tiny_model(**kw)
        assert ParamCounts.of(cfg).total == count_params(build_model(cfg, 0)), kw


def _ep2_logits(path: str, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The imported Mixtral with its experts split over 2 ranks (tokens travel by all-to-all), built
    on the meta device and read box by box: (logits of this rank's sequence, bytes read, bytes held)."""
    from loom.model.hf import open_dir, source
    from loom.model.llama import build_model
    from loom.train.build import build_run
    from tests.dist import get_mesh

    hf = open_dir(path, x.shape[1])
    mesh = get_mesh(dp_replicate=2, ep=2)
    cfg = C.LoomConfig(model=hf.config)
    cfg.run.dir = tempfile.mkdtemp(prefix="loom-hf-")
    cfg.data.seq_len, cfg.train.global_batch, cfg.train.micro_batch = x.shape[1], 2, 1
    cfg.parallel.dp, cfg.parallel.ep = 2, 2
    reader = source(hf)
    run = build_run(cfg, mesh, build_model(cfg.model, 0, meta=True), source=reader)
    held = sum(p.numel() * p.element_size() for p in run.model.parameters())
    with torch.no_grad():
        return (
            run.model(x[mesh.local_rank("dp")][None]),
            reader.bytes_read,
            held,
        )  # each rank its own sequence


def test_mixtral_under_ep2_gives_the_logits_of_transformers(pools, tmp_path):
    """Each rank reads only its experts' rows of the checkpoint (exactly the bytes it holds)."""
    path, ref = _save_hf(tmp_path, "mixtral", False)
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(x).logits
    for rank, (logits, read, held) in enumerate(pools(2).run(_ep2_logits, str(path), x)):
        assert_close(logits[0], expected[rank])
        assert read == held


# ----------------------------------------------------------------------------- train.init_from


def _first_losses(cfg_dict: dict) -> list[float]:
    import torch.distributed as dist

    _train(cfg_dict)
    if dist.is_initialized() and dist.get_rank() != 0:
        return []
    rows = (Path(cfg_dict["run"]["dir"]) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(r)["loss"] for r in rows]


def test_init_from_takes_weights_only_into_any_layout(pools, prepared, tmp_path):
    """A dp2 × ZeRO-3 run's weights start a one-process run and a tp2 run at step 0: both begin from
    the same model (equal first losses) with a fresh optimizer and schedule."""
    from loom.checkpoint.load import CheckpointReader
    from loom.train.trainer import RankEnv, Trainer

    source = tmp_path / "source"
    pools(2).run(_train, _config(prepared, source, zero=3))
    cfg = _config(prepared, tmp_path / "one")
    cfg["train"] |= {"init_from": str(source), "lr": 1e-3}
    trainer = Trainer(C.from_dict(cfg), RankEnv(0, 1, 0, 1))
    try:
        assert trainer.start_step == 0
        with CheckpointReader(source) as reader:
            for name, p in trainer.model.named_parameters():
                assert torch.equal(p.detach(), reader.read("model." + name)), name
    finally:
        trainer.heartbeat.close()
    one = _first_losses(cfg)
    tp = _config(prepared, tmp_path / "tp2", tp=2)
    tp["train"] |= {"init_from": str(source), "lr": 1e-3}
    tp2 = pools(2).run(_first_losses, tp)[0]
    assert_close(torch.tensor(tp2), torch.tensor(one), rtol=1e-4, atol=1e-5)
    source_losses = [json.loads(r)["loss"] for r in (source / "metrics.jsonl").read_text().splitlines()]
    assert one[0] < source_losses[0]  # it starts from the trained weights, not from a fresh init


def test_init_from_errors_name_the_field(tmp_path, prepared):
    from loom.model.llama import Transformer
    from loom.train.init_from import initial_source

    with pytest.raises(C.ConfigError, match="train.init_from: .* is not a directory"):
        C.validate(C.apply_overrides(C.LoomConfig(), ["--train.init_from", str(tmp_path / "nope")]), 1)
    path, _ = _save_hf(tmp_path, "llama", False)
    with pytest.raises(
        C.ConfigError, match=r"holds tok_embeddings.weight of shape \(128, 64\), this model has"
    ):
        initial_source(
            Transformer(
                C.ModelConfig(
                    dim=32,
                    n_layers=2,
                    n_heads=4,
                    n_kv_heads=2,
                    vocab_size=128,
                    max_seq_len=32,
                    multiple_of=16,
                )
            ),
            path,
        )
    from dataclasses import replace

    from loom.model.hf import open_dir

    same = open_dir(path, 32).config
    initial_source(Transformer(same), path)  # the directory's own fields: taken
    with pytest.raises(
        C.ConfigError,
        match=r"config.json gives rope_theta = 500000.0, this model has model.rope_theta = 10000.0",
    ):
        initial_source(Transformer(replace(same, rope_theta=1e4)), path)  # same shapes, other RoPE
    qwen2, _ = _save_hf(tmp_path, "qwen2", False)  # q/k/v biases this Llama-shaped model lacks
    with pytest.raises(
        C.ConfigError, match=r"holds layers.0.attention.wk.bias and 5 more, which this model lacks"
    ):
        initial_source(
            Transformer(replace(open_dir(qwen2, 32).config, qkv_bias=False, hf_architecture="auto")), qwen2
        )


def _layout_outputs(paths: list[str], x: torch.Tensor, layout: str) -> list:
    """Each imported model built on the meta device and materialized from its directory box by box
    (``model.from_hf``'s path), under ZeRO-3 (full logits), cp2 (this rank's positions and their
    logits), pp2 (the mean loss through the pipeline, returned by every rank) or tp2 with sp (the
    gathered logits, the bytes this rank read, the bytes of its parameters, the checkpoint's bytes)."""
    from loom.model.hf import open_dir, source
    from loom.model.llama import build_model, loss_fn
    from loom.parallel.state import gather_dim
    from loom.train.build import build_run
    from tests.dist import get_mesh

    dims = {"zero3": {"dp_shard": 2}, "cp2": {"cp": 2}, "pp2": {"pp": 2}, "tp2": {"tp": 2}}[layout]
    mesh = get_mesh(**dims)
    out = []
    for path in paths:
        hf = open_dir(path, x.shape[1] - 1)
        cfg = C.LoomConfig(model=hf.config)
        cfg.run.dir = tempfile.mkdtemp(
            prefix="loom-hf-"
        )  # never the checkout's runs/default (pp2 draws a timeline there)
        cfg.data.seq_len, cfg.train.global_batch, cfg.train.micro_batch = x.shape[1] - 1, 2, 1
        cfg.parallel.dp, cfg.parallel.dp_shard = mesh.size("dp"), mesh.size("dp_shard")
        cfg.parallel.zero, cfg.parallel.cp, cfg.parallel.pp = (
            (3 if layout == "zero3" else 0),
            mesh.size("cp"),
            mesh.size("pp"),
        )
        cfg.parallel.tp, cfg.parallel.sp = mesh.size("tp"), layout == "tp2"
        reader = source(hf)
        run = build_run(cfg, mesh, build_model(cfg.model, 0, meta=True), source=reader)
        tokens, targets = x[:, :-1], x[:, 1:]
        with torch.no_grad():
            if layout == "pp2":
                out.append(
                    run.evaluate([(tokens[i : i + 1], targets[i : i + 1]) for i in range(2)], loss_fn, None)
                )
            elif layout == "cp2":
                from loom.parallel.context.parallelize import local_positions

                pos = local_positions(tokens.shape[1], 2, mesh.local_rank("cp"))
                out.append((pos, run.model(tokens[:, pos])))
            elif layout == "tp2":
                held = sum(p.numel() * p.element_size() for p in run.model.parameters())
                whole = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
                out.append(
                    (gather_dim(run.model(tokens), -1, mesh.group("tp")), reader.bytes_read, held, whole)
                )
            else:  # ZeRO-3: the logits, and the share of the checkpoint this rank read (its shard's rows)
                whole = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
                out.append((run.model(tokens), reader.bytes_read / whole))
    return out


@pytest.mark.parametrize("layout", ["zero3", "cp2", "pp2"])
def test_import_under_zero3_cp2_pp2_matches_transformers(pools, tmp_path, layout):
    """Every family, in one pool call per layout, built on the meta device from its directory."""
    from loom.model.llama import loss_fn

    saved = [_save_hf(tmp_path, f, False) for f in FAMILIES]
    x = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(2))
    results = pools(2).run(_layout_outputs, [str(p) for p, _ in saved], x, layout)
    for i, (family, (_, ref)) in enumerate(zip(FAMILIES, saved)):
        with torch.no_grad():
            expected = ref(x[:, :-1]).logits
        for rank in results:
            out = rank[i]
            if layout == "pp2":
                assert out == pytest.approx(float(loss_fn(expected, x[:, 1:])), rel=1e-5), family
            elif layout == "cp2":
                pos, logits = out
                assert_close(logits, expected[:, pos], msg=lambda m, f=family: f"{f}: {m}")
            else:  # each ZeRO-3 rank reads the rows of its 1/2 shard of each unit, not the whole model
                logits, share = out
                assert_close(logits, expected, msg=lambda m, f=family: f"{f}: {m}")
                assert 0.4 < share < 0.6, (family, share)


def _state_bytes_tp2(model_kw: dict, optimizer: str = "adamw") -> tuple[int, int, int]:
    """(parameter bytes, elements of the parameters marked partial over tp, optimizer bytes) of a tp2 sp rank."""
    from loom.comm import CommMeter
    from loom.model.llama import build_model
    from loom.parallel.placement import placement_of
    from loom.train.build import parallelize
    from tests.dist import get_mesh
    from tests.helpers import SEQ, tiny_model

    cfg = C.LoomConfig(model=tiny_model(**model_kw))
    cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.sp, cfg.data.seq_len = 2, 1, True, SEQ
    cfg.train.optimizer = optimizer  # type: ignore[assignment]
    run = parallelize(build_model(cfg.model, 0), get_mesh(tp=2), cfg, CommMeter())
    model, strategy = run.model, run.strategy
    b = strategy.state_bytes()
    partial = sum(p.numel() for p in model.parameters() if placement_of(p).partial is not None)
    return b["param_bytes"], partial, b["optim_bytes"]


@pytest.mark.parametrize(
    "kw",
    [
        VARIANTS,
        {"qkv_bias": True},
        {"qk_norm": True, "attn_head_dim": 16},
        {"qk_norm": True, "qk_norm_scope": "all", "norm_placement": "post"},
        {"qk_norm": True, "qk_norm_scope": "all", "norm_placement": "post", "n_kv_heads": 1},
        GPT2,
    ],
    ids=["qwen", "qkv_bias", "qk_norm", "olmo2", "olmo2_kv1", "gpt2"],
)
def test_planner_state_of_bias_and_qk_norm_under_tp2_is_exact(pools, kw):
    """Weights and Adafactor's factored state per tp2 rank as predicted (biases of row-parallel
    layers and the position table whole on every rank), and the gradients summed over tp once per
    step (sp) as the formula of ``tensor_parallel.partial_numel`` and the planner's count them."""
    from loom.parallel.tensor.parallelize import partial_numel
    from loom.plan.cost import CostModel, Layout, Workload
    from loom.plan.hardware import ClusterSpec
    from tests.helpers import SEQ, tiny_model

    cfg = tiny_model(**kw)
    cm = CostModel(cfg, Workload(8, SEQ, precision="fp32"), ClusterSpec.single_node("cpu", 2))
    predicted = cm.state_memory(Layout(dp=1, tp=2, sp=True))["weights"]
    for measured, partial, _ in pools(2).run(_state_bytes_tp2, kw):
        assert predicted == measured, kw
        assert partial == partial_numel(cfg, 2, True) == cm.tp_partial_params(2, True, 1), kw
    ada = CostModel(
        cfg, Workload(8, SEQ, precision="fp32", optimizer="adafactor"), ClusterSpec.single_node("cpu", 2)
    )
    for _, _, optim in pools(2).run(_state_bytes_tp2, kw, "adafactor"):
        assert optim == ada.state_memory(Layout(dp=1, tp=2, sp=True))["optimizer"], kw


def test_export_refuses_moe_routing_mixtral_cannot_hold(prepared, tmp_path):
    """A MoE run with sigmoid scores (or shared experts, a selection bias, unnormalized top-k) would load
    in transformers as a Mixtral with other routing: refused in one line, nothing written."""
    from loom.checkpoint.format import CheckpointError
    from loom.checkpoint.hf_export import export_hf
    from loom.model.hf import moe_export_problem

    run = tmp_path / "run"
    cfg = _config(prepared, run)
    cfg["model"] |= {"n_experts": 4, "top_k": 2}
    cfg["moe"] = {"score": "sigmoid"}
    _train(cfg)
    with pytest.raises(
        CheckpointError, match=r"cannot be exported to Hugging Face: moe.score = 'sigmoid'"
    ) as e:
        export_hf(run, tmp_path / "hf")
    assert "\n" not in str(e.value) and not (tmp_path / "hf").exists()
    for field, value, message in [
        ("norm_topk", False, "moe.norm_topk = false"),
        ("n_shared_experts", 1, "shared"),
        ("bias_update_rate", 0.01, "selection bias"),
    ]:
        assert message in (moe_export_problem(C.MoEConfig(**{field: value})) or "")
    assert moe_export_problem(C.MoEConfig()) is None


def _trainer_counts(cfg_dict: dict) -> tuple[int, float]:
    import torch.distributed as dist

    from loom.train.trainer import RankEnv, Trainer

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    trainer = Trainer(C.from_dict(cfg_dict), RankEnv(rank, world, rank, world))
    trainer.heartbeat.close()
    return trainer.n_params, trainer.flops_per_token


def test_mfu_counts_the_whole_model_under_tensor_parallelism(pools, prepared, tmp_path):
    """The parameter count behind the logged size and the MFU is the whole model's in every layout (a tp
    rank's slices once made the MFU of tp2 half of what it is)."""
    one = _trainer_counts(_config(prepared, tmp_path / "one"))
    assert pools(2).run(_trainer_counts, _config(prepared, tmp_path / "tp2", tp=2)) == [one, one]


def test_export_keeps_the_sources_config_tokenizer_and_dtype(prepared, tmp_path):
    """A Mistral (sliding window, max_position_embeddings 128 > the training seq_len, distinct BOS,
    EOS and pad, bf16, chat template in chat_template.jinja) trained 2 steps, then exported: it
    loads in transformers as MistralForCausalLM with the source's config fields and special tokens,
    apply_chat_template works, the weights are bf16 (the source's) or the --dtype asked, mode 0644."""
    import stat

    from loom.checkpoint.hf_export import export_hf
    from loom.cli import main as cli
    from loom.data.tokenizer import load_tokenizer
    from loom.model.hf import apply_to

    tok = load_tokenizer(prepared)
    names = {i: tok.id_to_token(i) for i in (0, 5, 7)}
    special = dict(bos_token_id=5, eos_token_id=0, pad_token_id=7)
    first, _ = _save_hf(
        tmp_path, "mistral", False, vocab_size=384, max_position_embeddings=128, sliding_window=128, **special
    )
    path = tmp_path / "src"
    transformers.AutoModelForCausalLM.from_pretrained(first).to(torch.bfloat16).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"),
        bos_token=names[5],
        eos_token=names[0],
        pad_token=names[7],
    )
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    )
    fast.save_pretrained(path)
    assert (path / "chat_template.jinja").is_file()
    d = _config("", tmp_path / "run")
    d["data"]["seq_len"], d["train"]["steps"] = 32, 2
    cfg = C.from_dict(d)
    cfg.data.prepared_dir = ""
    apply_to(cfg, path)
    cfg.model.from_hf = str(path)
    cfg.train.precision = "fp32"
    _train(C.to_dict(cfg))
    old = os.umask(0o022)
    try:
        export_hf(tmp_path / "run", tmp_path / "out")
        assert cli(["export", "hf", str(tmp_path / "run"), str(tmp_path / "out32"), "--dtype", "fp32"]) == 0
    finally:
        os.umask(old)
    source = json.loads((path / "config.json").read_text())
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    for out, dtype in ((tmp_path / "out", torch.bfloat16), (tmp_path / "out32", torch.float32)):
        model = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert type(model).__name__ == "MistralForCausalLM" and model.dtype == dtype
        assert next(model.parameters()).dtype == dtype
        config = json.loads((out / "config.json").read_text())
        for field in (
            "sliding_window",
            "max_position_embeddings",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
        ):
            assert config[field] == source[field], field
        assert config["max_position_embeddings"] == 128
        got = transformers.AutoTokenizer.from_pretrained(out)
        assert (got.bos_token, got.eos_token, got.pad_token) == (names[5], names[0], names[7])
        assert got.pad_token_id == 7 and got.bos_token_id == 5
        assert got.apply_chat_template(messages, tokenize=False) == fast.apply_chat_template(
            messages, tokenize=False
        )
        for f in out.glob("*.safetensors"):
            assert stat.S_IMODE(f.stat().st_mode) == 0o644, f
        x = torch.randint(0, 384, (1, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.isfinite(model(x).logits).all()


def test_a_nan_in_a_weight_is_named_at_load(tmp_path):
    """A damaged weight is refused where it is read, naming the tensor, instead of surfacing as a
    non-finite gradient (with advice about the learning rate) at step 1."""
    from safetensors.torch import load_file, save_file

    from loom.model.hf import HFError, open_dir, read_state

    path, _ = _save_hf(tmp_path, "llama", False)
    shard = sorted(path.glob("*.safetensors"))[0]
    tensors = load_file(str(shard))
    name = sorted(tensors)[0]
    tensors[name].view(-1)[3] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(HFError, match=f"{name} holds NaN or inf"):
        list(read_state(open_dir(path, 32)))


def test_a_sources_dropout_is_named_when_loom_does_not_apply_it(tmp_path, caplog):
    """config.json's attention_dropout (GPT-2's *_pdrop) is what transformers applies in train mode;
    Loom fine-tunes with model.dropout: one warning names the source's rates unless model.dropout is set."""
    from loom.data.tokenizer import train_tokenizer
    from loom.model.hf import resolve_from_hf

    path, _ = _save_hf(tmp_path, "llama", False, attention_dropout=0.1)
    train_tokenizer(["some words to learn a few merges from"] * 4, 300).save(str(path / "tokenizer.json"))
    for given in ((), ("--model.dropout", "0.05")):
        cfg = C.load(None, ["--model.from_hf", str(path), "--data.source", str(tmp_path / "d.jsonl"), *given])
        caplog.clear()
        with caplog.at_level("WARNING", logger="loom"):
            resolve_from_hf(cfg)
        said = [r.getMessage() for r in caplog.records if "dropout" in r.getMessage()]
        if given:
            assert said == []
        else:
            assert said == [
                "loom: warning: model.from_hf: config.json's attention_dropout = 0.1 is not applied; Loom "
                "trains with model.dropout = 0 (set it to train with dropout)"
            ]
