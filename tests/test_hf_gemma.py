"""Gemma (``GemmaForCausalLM``) and Gemma 2 (``Gemma2ForCausalLM``) in and out. Gemma is Llama's
tensors with an RMSNorm scaling by 1 + w (``model.norm_offset``), embeddings times sqrt(h) rounded to
the activation dtype (``model.embed_scale``) and a gated GELU-tanh MLP (``mlp = geglu_tanh``); Gemma 2
adds a norm after attention and after the MLP (``norm_placement = sandwich``), the attention scale
``query_pre_attn_scalar``^-1/2 (``attn_scale``) and the attention and final-logit soft-caps
(``attn_softcap``, ``logit_softcap``). A tiny random model built by ``transformers`` (nothing
downloaded; Gemma 2 in its eager attention, the one that soft-caps) imports with its logits under 1
process, tp2 + sp, ZeRO-3 and pp2 (loss); Loom's export loads in ``transformers`` with the same
weights and logits; what Loom cannot hold is refused in one line naming the field; the fields train
equal to one process under tp2 + sp, pp2 and ZeRO-3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from torch.testing import assert_close

from tests.helpers import GEMMA2_FIELDS, HF_TINY
from tests.test_finetune import prepared  # noqa: F401

FIELDS = HF_TINY | dict(head_dim=32, rope_theta=5e5)  # a·d = 128 != h, as Gemma 7B's 16 x 256 against 3072
# soft-caps small enough to bite on a tiny random model (Gemma 2 ships 50 and 30)
GEMMA2 = dict(attn_logit_softcapping=1.0, final_logit_softcapping=0.5, query_pre_attn_scalar=24)
# Gemma 3: a window of 8 on its sliding layer (the sequences are 32), whose RoPE base is the local one
GEMMA3 = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24)
FAMILIES = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", GEMMA2),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3),
}


def save_gemma(path: Path, family: str, **kw) -> torch.nn.Module:
    """A random model of ``family`` saved at ``path`` in several shards (norm weights around 0: a
    scale around 1, which an importer ignoring the offset would turn into one around 0)."""
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_cls)(**(FIELDS | extra | kw))
    config._attn_implementation = "eager"  # Gemma 2's soft-cap lives in its eager attention only
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(path, max_shard_size="20KB")
    return model


def _loom(path: Path):
    from loom.model.hf import load_into, open_dir
    from loom.model.llama import Transformer

    hf = open_dir(path, 32)
    model = Transformer(hf.config)
    load_into(model, hf)
    return hf, model.eval()


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
def test_import_gives_the_logits_of_transformers_and_export_round_trips(tmp_path, family):
    """Logits equal transformers' (and differ from them without the soft-caps or the offset: each
    field is doing something); Loom's export (hf_config, hf_tensors) equals the checkpoint bit for bit
    and loads in transformers as the same family with the same logits; generation's cached forward
    gives the model's logits."""
    from dataclasses import replace

    from safetensors.torch import load_file, save_file

    from loom.model.hf import hf_config, hf_tensors
    from loom.model.kv_cache import forward_cached, new_cache
    from loom.model.llama import Transformer

    ref = save_gemma(tmp_path / "src", family)
    hf, model = _loom(tmp_path / "src")
    cfg = hf.config
    assert cfg.hf_architecture == FAMILIES[family][1]
    assert (cfg.norm_offset, cfg.embed_scale, cfg.mlp) == (True, True, "geglu_tanh")
    if family == "gemma2":
        assert (cfg.norm_placement, cfg.attn_softcap, cfg.logit_softcap) == ("sandwich", 1.0, 0.5)
        assert cfg.attn_scale == pytest.approx(24**-0.5)
    if family == "gemma3":  # q/k norms, its window on layer 0, which turns at the local RoPE base
        assert (cfg.norm_placement, cfg.qk_norm, cfg.attn_softcap) == ("sandwich", True, 0.0)
        assert (cfg.sliding_window, cfg.window_layers, cfg.rope_theta, cfg.rope_local_theta) == (
            8,
            "0",
            5e5,
            1e4,
        )
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(x)
        assert_close(logits, ref(x).logits)
        changed = {"norm_offset": False} | {
            "gemma": {},
            "gemma2": {"attn_softcap": 0.0, "logit_softcap": 0.0},
            "gemma3": {"rope_local_theta": 0.0, "sliding_window": 0},
        }[family]
        for field, value in changed.items():
            other = Transformer(replace(cfg, **{field: value}))
            other.load_state_dict(model.state_dict())
            assert (other.eval()(x) - logits).abs().max() > 1e-2, field
    out = dict(hf_tensors(cfg, ((k, v.detach()) for k, v in model.state_dict().items())))
    on_disk = {
        k: v for f in sorted((tmp_path / "src").glob("*.safetensors")) for k, v in load_file(f).items()
    }
    assert out.keys() == on_disk.keys()
    for name, t in on_disk.items():
        assert torch.equal(out[name], t), name
    dst = tmp_path / "out"
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(hf_config(cfg)))
    back = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
    assert type(back) is type(ref)
    for name, t in back.state_dict().items():
        assert torch.equal(t, ref.state_dict()[name]), name
    with torch.no_grad():
        assert_close(back(x).logits, logits)
        cache = new_cache(model, 2, 32)
        cached = torch.cat(
            (forward_cached(model, x[:, :31], cache), forward_cached(model, x[:, 31:], cache)), 1
        )
    assert_close(cached, logits)


def test_import_under_tp2_zero3_cp2_and_pp2_gives_the_logits_of_transformers(pools, tmp_path):
    """Built on the meta device and read box by box: under tp2 + sp each rank reads exactly its
    parameters' bytes (the sandwich norms' whole, replicated) and the gathered logits are
    transformers'; under ZeRO-3 the logits, under cp2 (all-gather) each rank's positions' logits,
    under pp2 the loss through the pipeline."""
    from loom.model.llama import loss_fn
    from tests.test_hf import _layout_outputs

    paths = [str(tmp_path / f) for f in FAMILIES]
    x = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = [save_gemma(Path(p), f)(x[:, :-1]).logits for p, f in zip(paths, FAMILIES)]
    for rank in pools(2).run(_layout_outputs, paths, x, "tp2"):
        for (logits, read, held, whole), want in zip(rank, expected):
            assert_close(logits, want)
            assert read == held < whole
    for rank in pools(2).run(_layout_outputs, paths, x, "zero3"):
        for (logits, share), want in zip(rank, expected):
            assert_close(logits, want)
            assert share < 1
    for rank in pools(2).run(_layout_outputs, paths, x, "cp2"):  # Gemma 2's capped blocks: fp32 products
        for (pos, logits), want in zip(rank, expected):
            assert_close(logits, want[:, pos])
    for loss in pools(2).run(_layout_outputs, paths, x, "pp2"):
        for got, want in zip(loss, expected):
            assert got == pytest.approx(float(loss_fn(want, x[:, 1:])), rel=1e-5)


@pytest.mark.parametrize(
    "family,edit,says",
    [
        (
            "gemma2",
            {"hidden_activation": "gelu"},
            "config.json: hidden_activation = 'gelu' is not supported (Loom's gated GELU: gelu_pytorch_tanh, "
            "gelu_new)",
        ),
        (
            "gemma",
            {"hidden_act": "silu"},
            "config.json: hidden_act = 'silu' is not supported (Loom's gated GELU: gelu_pytorch_tanh, "
            "gelu_new, gelu)",
        ),
        (
            "gemma",
            {"use_bidirectional_attention": True},
            "config.json: use_bidirectional_attention = true is not supported (Loom's attention is causal)",
        ),
        (
            "gemma2",
            {"query_pre_attn_scalar": 0},
            "config.json: query_pre_attn_scalar = 0.0 is out of range: want a number > 0",
        ),
    ],
    ids=["gemma2 exact gelu", "gemma silu", "bidirectional", "scalar 0"],
)
def test_what_loom_cannot_hold_is_one_line_naming_the_field(tmp_path, family, edit, says):
    from loom.model.hf import HFError, open_dir

    save_gemma(tmp_path, family)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | edit))
    with pytest.raises(HFError) as e:
        open_dir(tmp_path, 32)
    assert str(e.value) == says


@pytest.mark.parametrize(
    "kw,window,layers",
    [({}, 16, "0"), ({"layer_types": ["full_attention"] * 2}, 0, "all"), ({"sliding_window": 64}, 0, "0")],
    ids=["every other layer", "no windowed layer", "window covering the sequences"],
)
def test_gemma2s_window_applies_on_its_sliding_layers(tmp_path, kw, window, layers):
    """Gemma 2's window applies on its sliding layers only (by default every other one, from layer 0):
    a window of 16 on sequences of 32 there, none where ``layer_types`` names none or where the
    sequences fit it; the logits transformers' (its eager attention)."""
    ref = save_gemma(tmp_path / "src", "gemma2", **({"sliding_window": 16} | kw))
    hf, model = _loom(tmp_path / "src")
    assert (hf.config.sliding_window, hf.config.window_layers) == (window, layers)
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(model(x), ref(x).logits)


def test_gemma3_without_sliding_layers_turns_every_layer_at_the_full_base(tmp_path):
    """A Gemma 3 whose ``layer_types`` names no sliding layer: no window and no layer at the local RoPE
    base (rope_local_base_freq applies to the sliding layers only); the logits transformers'."""
    ref = save_gemma(tmp_path / "src", "gemma3", layer_types=["full_attention"] * 2)
    hf, model = _loom(tmp_path / "src")
    assert (hf.config.sliding_window, hf.config.local_layers()) == (0, frozenset())
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(model(x), ref(x).logits)


@pytest.mark.parametrize(
    "fields,says",
    [
        (
            {"embed_scale": True},
            "model: among the supported Hugging Face families only GemmaForCausalLM holds embed_scale = true, "
            "and it also needs norm_offset = true, mlp = geglu_tanh",
        ),
        (
            {"logit_softcap": 30.0},
            "model: among the supported Hugging Face families only GemmaForCausalLM holds logit_softcap, and it "
            "also needs norm_offset = true, embed_scale = true, mlp = geglu_tanh, norm_placement = sandwich "
            "(Gemma 2)",
        ),
    ],
    ids=["embed scale alone", "soft-cap on a llama"],
)
def test_a_model_with_some_of_gemmas_fields_is_refused_at_export(fields, says):
    from loom.model.hf import HFError, architecture_of
    from tests.helpers import tiny_model

    with pytest.raises(HFError) as e:
        architecture_of(tiny_model(**fields))
    assert str(e.value) == says


GEMMA2_NATIVE = GEMMA2_FIELDS
# Gemma 3's: no caps, per-head q/k norms, layer 0 windowed (5 of the tiny model's 16 tokens) at the local
# RoPE base
GEMMA3_NATIVE = {k: v for k, v in GEMMA2_NATIVE.items() if "softcap" not in k} | {
    "qk_norm": True,
    "sliding_window": 5,
    "window_layers": "0",
    "rope_local_theta": 100.0,
}
LAYOUTS = {
    "tp2 sp": {"tp": 2, "sp": True},
    "pp2": {"pp": 2},
    "zero3": {"dp_shard": 2, "zero": 3},
    "cp2 ring": {"cp": 2, "cp_mode": "ring"},
}


def _gemma_layouts(model: dict, names: list[str]) -> list[dict]:
    from tests.helpers import train_layout

    return [train_layout(LAYOUTS[n], 3, 4, 2, model, meta=True) for n in names]


@pytest.mark.parametrize("model", [GEMMA2_NATIVE, GEMMA3_NATIVE], ids=["gemma2", "gemma3"])
def test_gemma_fields_train_equal_to_one_process(pools, model):
    """A Gemma-2-shaped model (every field above; test_strict_comm.py steps it with torch's default
    device meta), and a Gemma-3-shaped one (its two RoPE bases, the window), train 3 steps of 2
    micro-batches under tp2 + sp (the sandwich norms on sequence shards, their weights' gradients
    summed over tp), pp2, ZeRO-3 and cp2 ring (each rank's rows of both RoPE tables) with the losses
    and every parameter of one process; the norm weights start at 0."""
    from tests.helpers import assert_layouts_equal, train_layout

    ref = train_layout({}, 3, 4, 2, model)
    assert {k for k in ref["state"] if "post_ffn_norm" in k} == {
        f"layers.{i}.post_ffn_norm.weight" for i in (0, 1)
    }
    names = list(LAYOUTS)
    assert_layouts_equal(ref, pools(2).run(_gemma_layouts, model, names), names)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_run_from_gemma2_exports_it_with_its_weights(prepared, tmp_path, method):  # noqa: F811
    """2 fine-tuning steps from a Gemma 2 directory (full, or LoRA merged at export); ``export hf``
    writes a Gemma 2 whose tensors are the checkpoint's (merged), its source's config fields carried
    over (window, layer types), that transformers loads with Loom's logits; LoRA's ``export peft``
    adapters on transformers' base give the same logits through PEFT."""
    from loom import config as C
    from loom.checkpoint.hf_export import export_hf
    from loom.data.tokenizer import load_tokenizer
    from tests.test_finetune import hf_lora_config, trainer_fit

    base = tmp_path / "base"
    save_gemma(base, "gemma2", vocab_size=384)
    load_tokenizer(prepared).save(str(base / "tokenizer.json"))
    run = tmp_path / "run"
    cfg = hf_lora_config(prepared, base, run, finetune={"method": method}, train={"steps": 2})
    trainer_fit(cfg)
    from loom.finetune.export import MergedReader

    export_hf(run, tmp_path / "out", dtype="fp32", wrap=MergedReader if method == "lora" else None)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    source = json.loads((base / "config.json").read_text())
    assert written["architectures"] == ["Gemma2ForCausalLM"]
    assert (written["sliding_window"], written["layer_types"]) == (
        source["sliding_window"],
        source["layer_types"],
    )
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    hf, model = _loom(tmp_path / "out")
    assert hf.config.norm_placement == "sandwich" and isinstance(cfg, C.LoomConfig)
    x = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(0))
    before = save_gemma(tmp_path / "again", "gemma2", vocab_size=384)
    with torch.no_grad():
        assert_close(theirs.eval()(x).logits, model(x))
        assert (theirs(x).logits - before(x).logits).abs().max() > 1e-4  # the steps changed the weights
    if method == "lora":  # the adapters under PEFT's names, on transformers' Gemma 2: the merged logits
        import peft

        from loom.finetune.export import export_peft

        export_peft(run, tmp_path / "adapter")
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager")
        adapted = peft.PeftModel.from_pretrained(hf_base, str(tmp_path / "adapter")).eval()
        with torch.no_grad():
            assert_close(adapted(x).logits, model(x), rtol=1e-4, atol=1e-5)


def test_every_model_field_is_taken_from_the_directory_or_named_the_runs_own():
    """A run from a Hugging Face directory takes every model field its config.json decides
    (``HF_FIELDS``): a field added to ModelConfig must be listed there or among the run's own
    (``RUN_FIELDS``), else a from_hf run would train another model than the directory's (Gemma 3's
    ``rope_local_theta`` was left out at first: its runs turned every layer at the full base)."""
    import dataclasses

    from loom.config import ModelConfig
    from loom.model.hf.run_config import HF_FIELDS, RUN_FIELDS

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(HF_FIELDS) | set(RUN_FIELDS) == fields
    assert not set(HF_FIELDS) & set(RUN_FIELDS)


def test_a_run_from_gemma3_trains_the_directorys_model(prepared, tmp_path):  # noqa: F811
    """The run's recorded model is the directory's: both RoPE bases and the window (the config a
    from_hf run records, read back as ``loom generate`` reads it)."""
    from loom import config as C
    from loom.checkpoint.load import CheckpointReader
    from loom.data.tokenizer import load_tokenizer
    from tests.test_finetune import hf_lora_config, trainer_fit

    base = tmp_path / "base"
    save_gemma(base, "gemma3", vocab_size=384)
    load_tokenizer(prepared).save(str(base / "tokenizer.json"))
    run = tmp_path / "run"
    cfg = hf_lora_config(prepared, base, run, finetune={"method": "full"}, train={"steps": 1})
    trainer_fit(cfg)
    with CheckpointReader(run) as reader:
        saved = C.from_dict(reader.train_state["config"]).model
    assert (saved.rope_theta, saved.rope_local_theta, saved.window_layers) == (5e5, 1e4, "0")


def _edited(tmp_path, family: str, edit: dict, drop: tuple[str, ...] = (), **kw) -> Path:
    save_gemma(tmp_path, family, **kw)
    raw = json.loads((tmp_path / "config.json").read_text()) | edit
    for key in drop:
        raw.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize(
    "family,edit,drop,says",
    [
        (
            "gemma3",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e4},
                }
            },
            (),
            "config.json: rope_parameters.sliding_attention.rope_type = 'linear' is not supported (Loom: default "
            "on Gemma3ForCausalLM's sliding layers)",
        ),
        (
            "gemma3",
            {"rope_parameters": [1, 2]},
            (),
            "config.json: a field has a value of the wrong type: rope_parameters = [1, 2], want an object (or null)",
        ),
        (
            "gemma3",
            {"rope_theta": 1e6, "rope_local_base_freq": 0},
            ("rope_parameters",),
            "config.json: rope_local_base_freq = 0 is out of range: want a number > 0",
        ),
        (
            "gemma2",
            {"layer_types": ["sliding", "full_attention"]},
            (),
            "config.json: layer_types holds 'sliding'; Loom: full_attention, sliding_attention",
        ),
    ],
    ids=[
        "gemma3 scaled sliding layers",
        "gemma3 rope_parameters list",
        "gemma3 local base 0",
        "unknown layer type",
    ],
)
def test_configs_transformers_refuses_or_reads_otherwise_are_one_line(tmp_path, family, edit, drop, says):
    from loom.model.hf import HFError, open_dir

    with pytest.raises(HFError) as e:
        open_dir(_edited(tmp_path, family, edit, drop), 32)
    assert str(e.value) == says


def test_gemma3s_attention_cap_is_ignored_as_transformers_ignores_it(tmp_path):
    """transformers' Gemma 3 keeps ``attn_logit_softcapping`` in its config but applies none: imported
    as no cap (the logits transformers'); exporting a Gemma-3-shaped model with a cap is refused."""
    from dataclasses import replace

    from loom.model.hf import HFError, hf_config

    ref = save_gemma(tmp_path, "gemma3", attn_logit_softcapping=0.5)
    hf, model = _loom(tmp_path)
    assert hf.config.attn_softcap == 0.0
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(model(x), ref(x).logits)
    with pytest.raises(HFError, match=r"Gemma3ForCausalLM holds .*attn_softcap = 0 \(Gemma 3 applies none\)"):
        hf_config(replace(hf.config, attn_softcap=5.0))


def test_a_mistral_with_layer_types_is_windowed_on_those_layers_as_transformers_reads_it(tmp_path):
    """transformers reads a Mistral config with ``layer_types`` as a Ministral: the window on the
    sliding layers only; Loom's import and export do the same."""
    from loom.model.hf import hf_config, load_into, open_dir
    from loom.model.llama import Transformer

    torch.manual_seed(0)
    fields = {k: v for k, v in FIELDS.items() if k != "head_dim"} | {"sliding_window": 8}
    config = transformers.MistralConfig(**fields)
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["layer_types"] = ["sliding_attention", "full_attention"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    hf = open_dir(tmp_path, 32)
    assert (hf.config.sliding_window, hf.config.window_layers) == (8, "0")
    model = Transformer(hf.config)
    load_into(model, hf)
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(model.eval()(x), ref(x).logits)
    assert hf_config(hf.config)["layer_types"] == ["sliding_attention", "full_attention"]


def test_window_layers_are_read_as_a_set_of_ascii_indices():
    """An equal list in another order is the same model on resume; a non-ASCII digit or a list naming no
    layer beside a window is one line."""
    from dataclasses import replace

    from loom.checkpoint.recorded import RESOLVED
    from loom.config import ConfigError, LoomConfig, validate
    from loom.plan.opcount import tiny_config
    from tests.helpers import tiny_model

    a, b = tiny_model(n_layers=3, sliding_window=4, window_layers="0,2"), None
    b = replace(a, window_layers="2, 0")
    assert RESOLVED["window_layers"](a) == RESOLVED["window_layers"](b)
    for bad, says in (("²", "comma-separated layer indices"), ("", "names no layer")):
        cfg = LoomConfig(model=replace(a, window_layers=bad))
        with pytest.raises(ConfigError, match=f"model.window_layers: .*{says}"):
            validate(cfg, 1)
    tiny = tiny_config(replace(a, n_layers=30, window_layers="0,2,29"), 2)  # the planner's counting model
    assert (tiny.local_layers(), tiny.sliding_window) == (frozenset({0}), 4)


@pytest.mark.parametrize(
    "layer_types", [None, ["sliding_attention", "full_attention"]], ids=["every layer", "alternate"]
)
def test_a_ministral_imports_with_its_window_and_exports_as_ministral(tmp_path, layer_types):
    """``MinistralForCausalLM`` (Ministral-8B): Mistral's tensors, windowed on every layer or on those
    ``layer_types`` names: transformers' logits, and the export loads back as a Ministral with them."""
    from loom.model.hf import open_dir
    from tests.helpers import assert_export_round_trips, imported_with_their_logits

    torch.manual_seed(0)
    # head_dim given: transformers' Ministral reads a null one as None (h / a = 16 here)
    fields = FIELDS | {"head_dim": 16, "sliding_window": 8, "layer_types": layer_types}
    ref = transformers.MinistralForCausalLM(transformers.MinistralConfig(**fields)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    ref.save_pretrained(tmp_path / "src")
    hf = open_dir(tmp_path / "src", 32)
    assert (hf.config.hf_architecture, hf.config.sliding_window) == ("MinistralForCausalLM", 8)
    assert hf.config.window_layers == ("all" if layer_types is None else "0")
    model, x, _ = imported_with_their_logits(hf, ref)
    assert_export_round_trips(model, x, tmp_path / "out", transformers.MinistralForCausalLM)


def test_gemma3s_multimodal_checkpoint_imports_its_text_model(tmp_path):
    """``Gemma3ForConditionalGeneration`` (Gemma 3 4B and up): Loom reads ``text_config`` and the
    ``language_model.`` tensors (linear RoPE scaling on the full layers, as the 4B+ configs have), the
    vision tower left out without a warning; logits equal the multimodal model's on text alone, and the
    export is the text model, a ``Gemma3ForCausalLM`` with them."""
    import logging

    from loom.model.hf import open_dir
    from tests.helpers import assert_export_round_trips, imported_with_their_logits, saved_random

    torch.manual_seed(0)
    text = FIELDS | GEMMA3 | {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    vision = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28
    )
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision | {"patch_size": 14},
        mm_tokens_per_image=4,
        image_token_index=127,
    )
    ref = transformers.Gemma3ForConditionalGeneration(config).eval()
    saved_random(ref, tmp_path / "src")
    records = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("loom.model.hf.directory").addHandler(handler)
    try:
        hf = open_dir(tmp_path / "src", 32)
    finally:
        logging.getLogger("loom.model.hf.directory").removeHandler(handler)
    assert not records  # the vision tower is not "unused"
    cfg = hf.config
    assert (hf.architecture, cfg.hf_architecture, hf.prefix) == (
        "Gemma3ForConditionalGeneration",
        "Gemma3ForCausalLM",
        "language_model.",
    )
    assert (cfg.rope_kind, cfg.rope_scaling, cfg.rope_local_theta) == ("linear", 8.0, 1e4)
    model, x, _ = imported_with_their_logits(hf, ref)
    assert_export_round_trips(model, x, tmp_path / "out", transformers.Gemma3ForCausalLM)


@pytest.mark.parametrize("tie", [False, True])
def test_mistral3s_multimodal_checkpoint_imports_its_text_model(tmp_path, tie):
    """``Mistral3ForConditionalGeneration`` (Mistral Small 3.1/3.2): its ``text_config`` (a Mistral) and
    the ``language_model.`` tensors, the head under that prefix too (or tied, as the top level says);
    logits equal the multimodal model's on text; exported as a ``MistralForCausalLM``."""
    from loom.model.hf import open_dir
    from tests.helpers import assert_export_round_trips, imported_with_their_logits, saved_random

    torch.manual_seed(0)
    text = {k: v for k, v in FIELDS.items()} | {
        "model_type": "mistral",
        "head_dim": 16,
        "sliding_window": None,
    }
    vision = dict(
        model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2
    )
    config = transformers.Mistral3Config(
        text_config=text, vision_config=vision | {"image_size": 28, "patch_size": 14, "head_dim": 16},
        image_token_index=127, tie_word_embeddings=tie,
    )  # fmt: skip
    ref = transformers.Mistral3ForConditionalGeneration(config).eval()
    saved_random(ref, tmp_path / "src")
    hf = open_dir(tmp_path / "src", 32)
    assert (hf.config.hf_architecture, hf.config.tie_embeddings) == ("MistralForCausalLM", tie)
    model, x, _ = imported_with_their_logits(hf, ref)
    assert_export_round_trips(model, x, tmp_path / "out", transformers.MistralForCausalLM)
