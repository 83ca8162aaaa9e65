"""``check_intent``: a field given explicitly that has no effect under the other settings."""

from __future__ import annotations

import logging

import pytest

from loom import config as C


def _intent(tmp_path, toml: str, *overrides: str) -> C.LoomConfig:
    path = tmp_path / "c.toml"
    path.write_text(toml)
    cfg = C.load(str(path), list(overrides))
    C.check_intent(cfg)
    return cfg


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["--finetune.lora_rank", "8"], "finetune.lora_rank: has no effect with finetune.method = full"),
        (["--finetune.lora_targets", "q,v"], "finetune.lora_targets: has no effect"),
        (
            ["--parallel.ps_shards", "2"],
            "parallel.ps_shards: has no effect with parallel.dp_mode = allreduce",
        ),
        (["--parallel.ps_sync", "asp"], "parallel.ps_sync: has no effect"),
        (["--parallel.reshard_after_forward", "false"], "parallel.reshard_after_forward: has no effect"),
        (["--parallel.zero", "3", "--parallel.hpz_group", "2"], "parallel.hpz_group: has no effect"),
        (["--parallel.offload_dir", "/tmp/x"], "parallel.offload_dir: has no effect"),
        (
            ["--data.tokenizer", "t.json", "--data.vocab_size", "512"],
            "data.vocab_size: has no effect with data.tokenizer = 't.json'",
        ),
        (["--parallel.sp", "true"], "parallel.sp: has no effect with parallel.tp = 1"),
        (["--parallel.cp_mode", "ring"], "parallel.cp_mode: has no effect with parallel.cp = 1"),
        (["--parallel.schedule", "zb-h1"], "parallel.schedule: has no effect with parallel.pp = 1"),
        (["--moe.aux_loss_coef", "0.01"], "moe.aux_loss_coef: has no effect with model.n_experts = 1"),
        (["--data.train_on_prompt", "true"], "data.train_on_prompt: has no effect with data.format = text"),
        (["--data.overlong", "drop"], "data.overlong: has no effect with data.format = text"),
    ],
)
def test_a_field_without_effect_given_on_the_command_line_is_refused(tmp_path, overrides, named):
    with pytest.raises(C.ConfigError) as e:
        _intent(tmp_path, "", *overrides)
    assert str(e.value).startswith(named) and "\n" not in str(e.value)


def test_with_its_mode_it_is_accepted(tmp_path):
    _intent(tmp_path, "", "--finetune.method", "lora", "--finetune.lora_rank", "8")
    _intent(tmp_path, "", "--parallel.dp_mode", "ps", "--parallel.ps_shards", "2")
    _intent(tmp_path, "", "--parallel.zero", "3", "--parallel.reshard_after_forward", "false")
    _intent(
        tmp_path, "", "--parallel.offload", "disk", "--parallel.zero", "1", "--parallel.offload_dir", "/x"
    )


def test_a_config_files_value_is_warned_about_once(tmp_path, caplog):
    """A LoRA config trained with ``--finetune.method full`` (a comparison): one line, the run goes on."""
    toml = '[finetune]\nmethod = "lora"\nlora_rank = 8\n'
    with caplog.at_level(logging.WARNING, logger="loom"):
        _intent(tmp_path, toml, "--finetune.method", "full")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("loom: warning: finetune.lora_rank: the config's 8"), lines


def test_a_dumped_config_repeating_the_defaults_says_nothing(tmp_path, caplog):
    """``loom config debug > my.toml`` writes every field; the defaults it repeats express no intent."""
    with caplog.at_level(logging.WARNING, logger="loom"):
        _intent(tmp_path, C.dump_toml(C.load("debug", [])))
    assert not caplog.records


def test_a_prepared_dir_beside_sources_is_refused(tmp_path):
    """A mixture prepares each source into a cache directory of its own: nothing is written there."""
    toml = '[[data.sources]]\npath = "a.jsonl"\nweight = 1.0\n'
    with pytest.raises(C.ConfigError, match=r"data.prepared_dir: has no effect with \[\[data.sources\]\]"):
        _intent(tmp_path, toml, "--data.prepared_dir", str(tmp_path / "p"))
