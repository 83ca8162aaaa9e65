"""RoPE's long-context rules and partial rotation (:mod:`loom.model.rope`): linear, YaRN (with its
truncation, betas, DeepSeek's mscale pair, an explicit attention factor), LongRoPE (short and long
factors), dynamic NTK within its length, Phi-4-mini's rotation of 3/4 of each head, Gemma 3's linear
scaling of its full layers. Tiny random ``transformers`` models (nothing downloaded) import with
their logits, each rule shown to bite, and Loom's export loads back in ``transformers`` with the same
logits and cached decoding; a native model with a rule trains equal to one process under tp2 + sp
and cp2; what transformers reads otherwise is refused in one line naming the field."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from torch.testing import assert_close

from tests.helpers import HF_TINY, assert_export_round_trips

BASE = HF_TINY | {
    "rope_theta": 1e4
}  # head_dim 16: 8 frequencies, every band of each rule hit on 32 positions
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
SHORT, LONG = [1.0 + 0.25 * i for i in range(8)], [2.0 + 0.5 * i for i in range(8)]
CASES = {
    "llama linear": ("Llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "llama yarn": ("Llama", {"rope_scaling": YARN}),
    "qwen2 yarn betas untruncated": (
        "Qwen2",
        {"rope_scaling": YARN | {"beta_fast": 8.0, "beta_slow": 2.0, "truncate": False}},
    ),
    "llama yarn mscale pair": ("Llama", {"rope_scaling": YARN | {"mscale": 1.0, "mscale_all_dim": 0.5}}),
    "mistral yarn attention factor": ("Mistral", {"rope_scaling": YARN | {"attention_factor": 1.5}}),
    "llama dynamic within its length": ("Llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "phi3 longrope short": (
        "Phi3",
        {
            "original_max_position_embeddings": 32,
            "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
        },
    ),
    "phi3 longrope long": (
        "Phi3",
        {
            "original_max_position_embeddings": 16,
            "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
        },
    ),
    "phi4-mini partial longrope": (
        "Phi3",
        {
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 16,
            "rope_scaling": {"type": "longrope", "short_factor": SHORT[:6], "long_factor": LONG[:6]},
        },
    ),
    "phi3 partial": ("Phi3", {"partial_rotary_factor": 0.5}),
    "gemma3 linear": (
        "Gemma3",
        {
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        },
    ),
}


def save_hf(path: Path, case: str) -> torch.nn.Module:
    """A random model of ``case`` saved at ``path`` in several shards (norm weights around 1, Gemma's
    around 0: its scale is 1 + w)."""
    family, extra = CASES[case]
    torch.manual_seed(0)
    text = "TextConfig" if family == "Gemma3" else "Config"
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2} if family == "Phi3" else {}  # not 32000
    config = getattr(transformers, f"{family}{text}")(**(BASE | ids | extra))
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name and family != "Gemma3" else 0.0))
    model.eval().save_pretrained(path, max_shard_size="20KB")
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_import_gives_the_logits_of_transformers_and_export_round_trips(tmp_path, case):
    """Logits equal transformers' on 32 positions and differ from the default RoPE's (the rule bites;
    dynamic NTK, within max_position_embeddings, is the default); the export loads back in
    transformers with the same logits, its rule re-read as the same fields; the cached forward gives
    the model's logits."""
    from loom.model.hf import load_into, open_dir
    from loom.model.llama import Transformer

    ref = save_hf(tmp_path / "src", case)
    hf = open_dir(tmp_path / "src", 32)
    cfg = hf.config
    model = Transformer(cfg).eval()
    load_into(model, hf)
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    plain = replace(cfg, rope_scaling=0.0, rope_fraction=1.0)
    with torch.no_grad():
        logits = model(x)
        assert_close(logits, ref(x).logits)
        if "dynamic" in case:
            assert cfg == plain
        else:
            other = Transformer(plain).eval()
            other.load_state_dict(model.state_dict())
            assert (other(x) - logits).abs().max() > 1e-3
    if "longrope" in case:
        assert cfg.rope_kind == "longrope" and cfg.rope_long == (not case.endswith("short"))
    assert_export_round_trips(model, x, tmp_path / "out", type(ref))
    assert open_dir(tmp_path / "out", 32).config == replace(cfg, max_seq_len=32)


def test_the_rules_equal_transformers_frequencies():
    """Loom's ω and factor equal transformers' ``ROPE_INIT_FUNCTIONS`` for each rule over a sweep of
    factors, lengths and bases (d = 128, as the models ship)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from loom.config import ModelConfig
    from loom.model.rope import frequencies

    for s, length, theta in ((2.0, 4096, 1e4), (8.0, 8192, 5e5), (32.0, 4096, 1e6), (0.5, 2048, 1e4)):
        for kind, extra in (
            ("linear", {}),
            ("yarn", {"original_max_position_embeddings": length, "beta_fast": 16.0, "beta_slow": 2.0}),
            ("yarn", {"original_max_position_embeddings": length, "truncate": False}),
            (
                "llama3",
                {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": length},
            ),
        ):
            params = {"rope_type": kind, "rope_theta": theta, "factor": s} | extra
            hf = transformers.LlamaConfig(
                hidden_size=1024,
                num_attention_heads=8,
                max_position_embeddings=4 * length,
                rope_parameters=params,
            )
            want, want_m = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
            mine = ModelConfig(
                dim=1024,
                n_heads=8,
                rope_theta=theta,
                rope_scaling=s,
                rope_kind=kind,
                rope_original_len=length,
                rope_beta_fast=extra.get("beta_fast", 32.0),
                rope_beta_slow=extra.get("beta_slow", 1.0),
                rope_truncate=extra.get("truncate", True),
            )
            got, m = frequencies(mine, theta)
            assert_close(got.float(), want, rtol=1e-5, atol=0, msg=f"{kind} {s} {length}")  # theirs: fp32
            assert m == pytest.approx(want_m, rel=1e-12)


def test_a_native_model_with_yarn_and_partial_rotation_trains_equal_to_one_process(pools):
    """YaRN's tables (the factor m on cos and sin, part of each head passed unrotated) on every rank's
    rows: 3 steps of 2 micro-batches under tp2 + sp and cp2 ring equal one process."""
    from tests.helpers import ADAM_STATE_TOL, assert_layouts_equal, train_layout

    model = {"rope_scaling": 4.0, "rope_kind": "yarn", "rope_original_len": 8, "rope_fraction": 0.5}
    ref = train_layout({}, 3, 4, 2, model)
    names = ["tp2 sp", "cp2 ring"]
    layouts = [{"tp": 2, "sp": True}, {"cp": 2, "cp_mode": "ring"}]
    assert_layouts_equal(ref, pools(2).run(_layouts, model, layouts), names)
    plain = train_layout({}, 3, 4, 2, {})
    moved = max(
        (plain["state"][k] - v).abs().max().item() for k, v in ref["state"].items() if "attention.w" in k
    )
    assert moved > 100 * ADAM_STATE_TOL["atol"]  # the rule and the partial rotation bite


def _layouts(model: dict, layouts: list[dict]) -> list[dict]:
    from tests.helpers import train_layout

    return [train_layout(layout, 3, 4, 2, model) for layout in layouts]


@pytest.mark.parametrize(
    "family,edit,says",
    [
        (
            "Llama",
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 16},
            "config.json: rope_scaling.rope_type = 'dynamic' rescales RoPE for sequences beyond "
            "max_position_embeddings = 16 by their length; Loom prepares fixed tables: keep the sequences "
            "within it (got 32)",
        ),
        (
            "Llama",
            {"rope_scaling": {"rope_type": "mrope", "factor": 2.0}},
            "config.json: rope_scaling.rope_type = 'mrope' is not supported for LlamaForCausalLM (Loom: "
            "default, dynamic, llama3, linear, yarn, longrope)",
        ),
        (
            "Phi3",
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
            "config.json: rope_scaling.rope_type = 'linear' is not supported for Phi3ForCausalLM (Loom: "
            "default, longrope)",
        ),
        (
            "Llama",
            {"partial_rotary_factor": 0.5},
            "config.json: partial_rotary_factor = 0.5 is not supported for LlamaForCausalLM (transformers "
            "rotates part of a head in Phi3ForCausalLM and Glm4ForCausalLM alone; Loom: 1.0)",
        ),
        (
            "Phi3",
            {"rope_scaling": {"type": "longrope", "short_factor": "1,2", "long_factor": LONG}},
            'config.json: rope_scaling.short_factor = "1,2": want a list of numbers',
        ),
        (
            "Phi3",
            {"rope_scaling": {"type": "longrope", "short_factor": SHORT[:3], "long_factor": LONG}},
            "model.rope_short_factor: LongRoPE needs 8 finite numbers > 0 (one per frequency of the 16 "
            "rotated dims), got 3",
        ),
        (
            "Llama",
            {"rope_scaling": YARN | {"factor": -2.0}},
            "config.json: rope_scaling.factor = -2.0 is out of range: want a number > 0",
        ),
    ],
    ids=[
        "dynamic beyond",
        "unknown rule",
        "phi3 linear",
        "partial on llama",
        "factor text",
        "factor count",
        "factor < 0",
    ],
)
def test_what_transformers_reads_otherwise_is_one_line_naming_the_field(tmp_path, family, edit, says):
    from loom.config import ConfigError, LoomConfig, validate_shape
    from loom.model.hf import HFError
    from loom.model.hf.config import model_config

    raw = transformers.AutoConfig.for_model(family.lower(), **BASE).to_dict()
    raw.pop("rope_parameters", None)
    with pytest.raises((HFError, ConfigError)) as e:
        validate_shape(
            LoomConfig(model=model_config(raw | {"architectures": [f"{family}ForCausalLM"]} | edit, 32))
        )
    assert str(e.value) == says


YARN_ON = ["--model.rope_scaling=4", "--model.rope_kind=yarn"]


@pytest.mark.parametrize(
    "overrides,says",
    [
        (
            ["--model.rope_fraction=0.4"],
            "model.rope_fraction: must be in (0, 1] with r = int(head_dim * it) even",
        ),
        (["--model.rope_kind=ntk"], "model.rope_kind"),
        (["--model.rope_short_factor=1,x"], "model.rope_short_factor: expected a list of numbers"),
        (
            [*YARN_ON, "--model.rope_beta_fast=1"],
            "model.rope_beta_fast: must exceed model.rope_beta_slow > 0",
        ),
        ([*YARN_ON, "--model.rope_attn_factor=-1"], "model.rope_attn_factor: must be >= 0"),
        (
            ["--model.rope_scaling=4", "--model.rope_kind=longrope"],
            "model.rope_short_factor: LongRoPE needs 4",
        ),
        (["--model.nope_layers=1,9"], "model.nope_layers: 'all' or comma-separated layer indices in [0, 2)"),
        (["--model.logit_divisor=0"], "model.logit_divisor: must be a finite number > 0 (1 = none), got 0.0"),
        (["--model.embed_multiplier=inf"], "model.embed_multiplier: must be a finite number"),
        (["--model.residual_multiplier=-1"], "model.residual_multiplier: must be a finite number > 0"),
    ],
    ids=lambda v: v if isinstance(v, str) else " ".join(v),
)
def test_bad_model_settings_of_the_new_fields_are_one_line(overrides, says):
    """Each new model field's bad value fails validation (before any rank starts) in one line naming it."""
    import re

    from loom.config import ConfigError, LoomConfig, apply_overrides, validate_shape
    from tests.helpers import tiny_model

    with pytest.raises(ConfigError, match=re.escape(says)) as e:
        validate_shape(apply_overrides(LoomConfig(model=tiny_model()), overrides))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["--model.rope_kind=yarn"], "model.rope_kind"),
        (["--model.rope_scaling=4", "--model.rope_beta_fast=8"], "model.rope_beta_fast"),
        (["--model.positions=learned", "--model.nope_layers=1"], "model.nope_layers"),
    ],
)
def test_a_rope_field_the_rule_does_not_read_is_refused_on_the_command_line(overrides, field):
    """A RoPE setting with no effect under the others (``ModelConfig.rope_idle_fields``) given as an
    override is refused naming it, never silently unused."""
    from loom.config import ConfigError, LoomConfig, apply_overrides, check_intent
    from tests.helpers import tiny_model

    with pytest.raises(ConfigError, match=f"^{field}: has no effect with "):
        check_intent(apply_overrides(LoomConfig(model=tiny_model()), overrides))


def test_longrope_factors_bind_a_resume_where_max_seq_len_crosses_the_original_length():
    """A resume may lengthen RoPE's tables (max_seq_len) but not switch LongRoPE's short factors for its
    long ones: that is another model."""
    from loom.checkpoint.recorded import free_on_resume, model_changes
    from loom.config import from_dict, to_dict

    model = dict(
        rope_scaling=4.0,
        rope_kind="longrope",
        rope_original_len=64,
        rope_short_factor=[1.0] * 4,
        rope_long_factor=[2.0] * 4,
        dim=32,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=32,
    )
    saved = from_dict({"model": model})
    for seq, changed in ((48, False), (128, True)):
        now = from_dict({"model": model | {"max_seq_len": seq}})
        assert bool(model_changes(saved, now, free_on_resume(saved))) == changed, seq
    assert to_dict(saved)["model"]["rope_long_factor"] == [2.0] * 4  # written back as a list


def test_gemma3s_legacy_rope_scaling_scales_its_full_layers_as_transformers_reads_it(tmp_path):
    """A Gemma 3 config.json with the older top-level ``rope_scaling`` (its 4B+ text configs): transformers
    merges it into the full-attention layers' parameters; Loom reads the same, with the same logits."""
    from loom.model.hf import load_into, open_dir
    from loom.model.llama import Transformer

    save_hf(tmp_path, "gemma3 linear")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_parameters"]["full_attention"] = {"rope_type": "default", "rope_theta": BASE["rope_theta"]}
    (tmp_path / "config.json").write_text(
        json.dumps(raw | {"rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    )
    ref = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path).eval()
    hf = open_dir(tmp_path, 32)
    assert (hf.config.rope_kind, hf.config.rope_scaling) == ("linear", 8.0)
    model = Transformer(hf.config).eval()
    load_into(model, hf)
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(model(x), ref(x).logits)
