"""Config: TOML + overrides, types, validation messages, presets, the mesh arithmetic."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loom import config as C
from loom.mesh import ParallelDims

ROOT = Path(__file__).resolve().parent.parent


def test_overrides_and_types():
    cfg = C.apply_overrides(
        C.LoomConfig(), ["--model.dim", "128", "--train.lr=1e-3", "--run.progress", "false"]
    )
    assert cfg.model.dim == 128 and cfg.train.lr == 1e-3 and cfg.run.progress is False


@pytest.mark.parametrize(
    "args,field",
    [
        (["--model.nope", "1"], "model.nope"),
        (["--nosection.x", "1"], "nosection"),
        (["--model.dim", "abc"], "model.dim"),
        (["--run.progress", "maybe"], "run.progress"),
    ],
)
def test_bad_override_names_field(args, field):
    with pytest.raises(C.ConfigError, match=field):
        C.apply_overrides(C.LoomConfig(), args)


def test_a_field_given_twice_takes_the_later_value_and_says_so(caplog):
    """Command-line convention (a script's common flags, then one changed): the later value, with a
    one-line warning naming both when they differ; the same value twice says nothing."""
    with caplog.at_level("WARNING", logger="loom"):
        cfg = C.apply_overrides(C.LoomConfig(), ["--train.steps", "3", "--train.steps=5"])
    assert cfg.train.steps == 5
    assert [r.getMessage() for r in caplog.records] == [
        "loom: warning: --train.steps given twice ('3', then '5'): the later is used"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="loom"):
        C.apply_overrides(C.LoomConfig(), ["--train.global-batch", "8", "--train.global_batch", "8"])
    assert not caplog.records


def test_a_leading_tilde_in_a_path_field_is_the_home_directory(tmp_path, monkeypatch):
    """A TOML file has no shell: run.dir = "~/r" used to write into ./~/r (and data paths expanded it)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    toml = tmp_path / "c.toml"
    toml.write_text('[run]\ndir = "~/r"\n[[data.sources]]\npath = "~/a.jsonl"\n')
    cfg = C.load(str(toml), ["--model.from_hf", "~/hf", "--train.init_from=~/old", "--data.text_field", "~x"])
    assert cfg.run.dir == str(tmp_path / "r") and cfg.data.sources[0].path == str(tmp_path / "a.jsonl")
    assert cfg.model.from_hf == str(tmp_path / "hf") and cfg.train.init_from == str(tmp_path / "old")
    assert cfg.data.text_field == "~x"  # not a path
    assert "run.dir" in C.explicit(cfg)


def test_nproc_and_run_nproc_that_disagree_are_refused(capsys):
    from loom.cli import main

    assert main(["train", "debug", "--nproc", "1", "--run.nproc", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--nproc 1 and --run.nproc 2: both given; give one" in err and "\n" not in err


@pytest.mark.parametrize(
    "args,world,field",
    [
        (["--model.n_heads", "6"], 1, "model.dim"),
        (["--model.n_kv_heads", "3"], 1, "model.n_kv_heads"),
        (["--train.global_batch", "10"], 4, "train.global_batch"),
        (["--parallel.zero", "4"], 1, "parallel.zero"),
        (["--parallel.dp", "3"], 4, "parallel"),
        (["--train.precision", "fp4"], 1, "train.precision"),
        (["--data.seq_len", "4096"], 1, "data.seq_len"),
        (["--run.device", "tpu"], 1, "run.device"),
        (["--parallel.profile", "no-such-profile.json"], 1, "parallel.profile"),
    ],
)
def test_validation_names_field(args, world, field):
    cfg = C.apply_overrides(C.LoomConfig(), args)
    with pytest.raises(C.ConfigError, match=field.replace(".", r"\.")) as e:
        C.validate(cfg, world)
    assert "\n" not in str(e.value)


def test_resolve_layout_fills_dp():
    cfg = C.validate(C.LoomConfig(), 4)
    assert cfg.parallel.dp == 4 and C.grad_accum_steps(cfg) == 16 // (4 * 4)


@pytest.mark.parametrize("preset", sorted((ROOT / "configs").glob("*.toml")))
def test_presets_load_and_roundtrip(preset, tmp_path):
    cfg = C.load_toml(preset)
    again = tmp_path / "c.toml"
    again.write_text(C.dump_toml(cfg))
    assert C.to_dict(C.load_toml(again)) == C.to_dict(cfg)
    assert C.to_dict(C.load_toml(preset.stem)) == C.to_dict(cfg)  # by name, from the package


def test_presets_ship_inside_the_package_and_feed_the_planner():
    from loom.plan.cli import MODELS
    from loom.plan.hardware import CLUSTER_DIR

    assert C.PRESET_DIR.parent == Path(C.__file__).resolve().parents[1]  # loom/: package data, not a checkout
    assert CLUSTER_DIR.is_relative_to(C.PRESET_DIR) and any(CLUSTER_DIR.glob("*.toml"))
    data = C.tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "loom"
    ]
    assert {"configs/*.toml", "configs/clusters/*.toml"} <= set(data)
    assert set(MODELS) == set(C.presets()) and MODELS["llama3-70b"].n_layers == 80  # one source of shapes
    with pytest.raises(C.ConfigError, match="unknown preset 'llama9'; known: debug"):
        C.preset_path("llama9")
    with pytest.raises(C.ConfigError, match="does not exist"):
        C.load_toml("llama9")


def test_mesh_dims_for_4096_ranks():
    d = ParallelDims(dp_replicate=4, dp_shard=8, tp=8, pp=16, cp=1, ep=8)
    assert d.world_size == 4096 and d.dp == 32
    seen = set()
    for rank in range(d.world_size):
        c = d.coords(rank)
        seen.add(tuple(c[k] for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp")))
    assert len(seen) == 4096
    tp_peers = d.group_ranks(1234, ("tp",))
    assert tp_peers == list(range(1232, 1240))  # tp innermost: neighbours
    dp_peers = d.group_ranks(0, ("dp_replicate", "dp_shard"))
    assert len(dp_peers) == 32 and dp_peers[1] == 8
    with pytest.raises(ValueError, match="ep"):
        ParallelDims(dp_shard=2, ep=3)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--parallel.zero", "7"], "parallel.zero"),
        (["--model.dim", "100", "--model.n_heads", "3"], "model.dim"),
        (["--train.global_batch", "7"], "train.global_batch"),
        (["--bogus", "1"], "--bogus"),
        (["--model.typo", "1"], "model.typo"),
        (["llama9"], "a preset (debug, gpt-125m"),
        (["--parallel.auto", "true", "--profile", "missing.json"], "parallel.profile"),
        (["--parallel.profile", "a.json", "--profile", "b.json"], "--profile 'b.json' and parallel.profile"),
    ],
)
def test_cli_rejects_before_start(tmp_path, args, needle):
    run_dir = tmp_path / "run"
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-m", "loom", "train", "--run.dir", str(run_dir), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("loom: error:")
    assert not run_dir.exists()  # nothing started, nothing written
    assert time.perf_counter() - t0 < 30


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--train.lr", "nan"], "train.lr: must be a finite number"),
        (["--train.lr", "inf"], "train.lr: must be a finite number"),
        (["--train.eps", "-1e-8"], "train.eps: must be > 0"),
        (["--model.rope_theta", "0"], "model.rope_theta: must be > 0"),
        (["--train.seed", "-3"], "train.seed: must be >= 0"),
        (["--train.global_batch", "0"], "train.global_batch: must be >= 1"),
        (["--run.master_port", "70000"], "run.master_port: must be in [0, 65535]"),
        (["--train.weight_decay", "-0.1"], "train.weight_decay: must be >= 0"),
        (["--model.norm_eps", "0"], "model.norm_eps: must be > 0"),
    ],
)
def test_numeric_fields_are_bounded_and_finite(args, needle):
    cfg = C.apply_overrides(C.LoomConfig(), args)
    with pytest.raises(C.ConfigError, match=re.escape(needle)) as e:
        C.validate(cfg, 2)
    assert "\n" not in str(e.value)


def test_train_seed_is_bounded_as_torch_takes_it():
    """torch.manual_seed takes 64 bits: 2**64 - 1 passes, 2**64 is refused before any process starts."""
    C.validate(C.apply_overrides(C.LoomConfig(), ["--train.seed", str(2**64 - 1)]), 2)
    cfg = C.apply_overrides(C.LoomConfig(), ["--train.seed", str(2**64)])
    with pytest.raises(
        C.ConfigError, match=re.escape(f"train.seed: must be below 2**64 = {2**64}, got {2**64}")
    ):
        C.validate(cfg, 2)


@pytest.mark.parametrize(
    "value,needle",
    [("abc", "--nproc: expected an integer, got 'abc'"), ("0", "--nproc: must be >= 1, got 0")],
)
def test_a_bad_nproc_names_the_option_given(capsys, value, needle):
    from loom.cli import main

    assert main(["config", "debug", "--nproc", value]) == 2
    assert capsys.readouterr().err.strip() == f"loom: error: {needle}"


def test_a_new_output_directory_that_is_a_file_or_a_link_says_so(tmp_path):
    (tmp_path / "ofile").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    for name, what in (("ofile", "is a file, not a directory"), ("link", "is a symbolic link")):
        with pytest.raises(C.ConfigError, match=f"{name}: {what}; choose a new directory"):
            C.check_new_output(tmp_path / name, directory=True)
    assert (tmp_path / "ofile").read_text() == "x"


def test_explicit_degrees_must_agree_with_nproc(capsys, tmp_path):
    from loom.cli import main

    assert main(["train", "--run.dir", str(tmp_path / "r"), "--nproc", "2", "--parallel.dp", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "loom: error: run.nproc: 2 ranks, but parallel.dp*tp*pp*cp = 3*1*1*1 = 3; give --nproc 3, "
        "or leave parallel.dp unset so it follows run.nproc"
    )
    assert not (tmp_path / "r").exists()


def test_stale_launcher_variables_are_named(monkeypatch, capsys, tmp_path):
    from loom.cli import main

    monkeypatch.setattr(
        os,
        "environ",
        {k: v for k, v in os.environ.items() if not k.startswith("MASTER_")}
        | {"RANK": "0", "WORLD_SIZE": "2"},
    )
    assert main(["train", "--run.dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(
            "loom: error: environment: RANK=0 and WORLD_SIZE=2 are set but MASTER_ADDR and "
            "MASTER_PORT are not"
        )
        and "\n" not in err
    )


def test_reference_documents_every_field_with_its_default():
    """``loom config --reference`` reads each field's type, default and doc from the source, however the
    formatter wraps it: every field of every section, a default equal to the dataclass's, a doc."""
    import ast
    import dataclasses

    from loom.config.parse import field_docs

    reference = C.reference()
    for section, cls in C.SECTIONS.items():
        docs = field_docs(cls)
        fields = dataclasses.fields(cls)
        assert set(docs) == {f.name for f in fields}, section
        for f in fields:
            typ, default, doc = docs[f.name]
            assert doc, f"{section}.{f.name}: no doc comment"
            if f.default is not dataclasses.MISSING:
                assert ast.literal_eval(default) == f.default, f"{section}.{f.name}: {default!r}"
        assert all(f"  {section}.{f.name} " in reference for f in fields)


def test_config_flag_is_the_positional_config_as_loom_plan_spells_it():
    """``loom train --config debug`` (as ``loom plan --config``) was "--config: unknown option"."""
    from loom.cli import _load

    by_flag, _ = _load(["--config", "debug", "--train.steps", "3"], ())
    by_position, _ = _load(["debug", "--train.steps", "3"], ())
    assert C.to_dict(by_flag) == C.to_dict(by_position) and by_flag.train.steps == 3
    assert C.to_dict(_load(["debug", "--config=debug"], ())[0]) == C.to_dict(_load(["debug"], ())[0])
    with pytest.raises(
        C.ConfigError, match="--config: 'llama-1b' beside the config 'debug'; give one config"
    ):
        _load(["debug", "--config", "llama-1b"], ())


def test_a_config_file_with_a_byte_order_mark_reads_as_without(tmp_path):
    """Windows editors write a UTF-8 byte order mark: it was refused as "Invalid statement" at line 1."""
    text = "[model]\ndim = 64\n[train]\nsteps = 3\n"
    plain, marked = tmp_path / "plain.toml", tmp_path / "marked.toml"
    plain.write_text(text, encoding="utf-8")
    marked.write_text(text, encoding="utf-8-sig")
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    assert C.to_dict(C.load(str(marked), [])) == C.to_dict(C.load(str(plain), []))
