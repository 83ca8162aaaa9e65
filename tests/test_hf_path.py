"""The Hugging Face user's path from the command line (issue 34, item 7): ``loom config`` and
``loom plan`` read ``--model.from_hf``; explicit ``model.*`` settings are refused where they
contradict the directory's config.json (max_seq_len honoured); a from_hf run gets fine-tuning
defaults for the [train] values it does not give, and is refused without its own data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from loom import config as C
from loom.cli import main


def _save(path: Path, family: str = "llama", **kw) -> Path:
    """A tiny random transformers model (nothing downloaded) and a word-level tokenizer.json."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, **kw)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cls = {"llama": "Llama", "nemo": "Mistral"}[family]
        fields = dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
        )
        if family == "nemo":  # Mistral-Nemo's shape: head_dim 16 != 32 / 4
            fields |= {"head_dim": 16, "sliding_window": 512}
        cfg = getattr(transformers, f"{cls}Config")(**(fields | kw))
        model = getattr(transformers, f"{cls}ForCausalLM")(cfg)
    model.save_pretrained(path)
    Tokenizer(WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0")).save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-path")
    return {f: _save(root / f, f) for f in ("llama", "nemo", "gpt2")}


def _config(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["config", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _toml(out: str) -> dict:
    return C.tomllib.loads(out)


def test_loom_config_shows_the_directorys_model_and_fine_tuning_defaults(dirs, capsys, tmp_path):
    """``loom config --model.from_hf`` prints the directory's model (Mistral-Nemo's head_dim
    included) with the fine-tuning defaults, stated in a comment line; explicit [train] values stay;
    the printed config read back with the same directory is the same config (no field refused)."""
    rc, out, err = _config(capsys, "--model.from_hf", str(dirs["nemo"]), "--data.source", "corpus.txt")
    assert rc == 0, err
    got = _toml(out)
    m = got["model"]
    assert (m["dim"], m["n_heads"], m["n_kv_heads"], m["attn_head_dim"], m["ffn_dim"], m["vocab_size"]) == (
        32,
        4,
        2,
        16,
        64,
        64,
    )
    assert m["from_hf"] == str(dirs["nemo"].absolute()) and m["max_seq_len"] == 256  # data.seq_len
    t = got["train"]
    assert (t["lr"], t["min_lr"], t["warmup_steps"], t["weight_decay"]) == (2e-5, 2e-6, 6, 0.0)
    note = out.splitlines()[0]
    assert note.startswith("# model.from_hf: fine-tuning defaults") and "train.lr 2e-05 (full)" in note
    assert "train.warmup_steps 6 (3% of 200 steps)" in note and "train.weight_decay 0" in note
    (tmp_path / "again.toml").write_text(out)
    rc, again, err = _config(capsys, str(tmp_path / "again.toml"), "--model.from_hf", str(dirs["nemo"]))
    assert rc == 0, err
    assert _toml(again) == got and not again.startswith("#")  # every [train] value is given now
    rc, out, err = _config(
        capsys,
        "--model.from_hf",
        str(dirs["llama"]),
        "--data.source",
        "c.txt",
        "--finetune.method",
        "lora",
        "--train.lr",
        "1e-3",
        "--train.steps",
        "10",
    )
    t = _toml(out)["train"]
    assert rc == 0 and (t["lr"], t["min_lr"], t["warmup_steps"]) == (1e-3, 1e-4, 1), err
    note = out.splitlines()[0]
    assert "train.min_lr 0.0001 (lr / 10, cosine)" in note and "train.lr " not in note  # lr was given


@pytest.mark.parametrize(
    "family,argv,says",
    [
        (
            "llama",
            ["--model.dim", "256"],
            "model.dim: 256 was given, but model.from_hf's config.json gives 32",
        ),
        (
            "llama",
            ["--model.n_kv_heads", "4"],
            "model.n_kv_heads: 4 was given, but model.from_hf's config.json gives 2",
        ),
        (
            "nemo",
            ["--model.attn_head_dim", "8"],
            "model.attn_head_dim: 8 was given, but model.from_hf's config.json gives 16",
        ),
        (
            "llama",
            ["--model.norm_eps", "1e-5"],
            "model.norm_eps: 1e-05 was given, but model.from_hf's config.json gives 1e-06",
        ),
        (
            "gpt2",
            ["--model.max_seq_len", "32", "--data.seq_len", "32"],
            "model.max_seq_len: 32 was given, but model.from_hf's config.json gives 64",
        ),
        ("llama", [], "data.source: model.from_hf fine-tunes a pretrained model; give its data"),
    ],
)
def test_conflicting_or_missing_settings_are_one_line(dirs, capsys, family, argv, says):
    """An explicit model field the directory contradicts (GPT-2's position table fixes max_seq_len),
    and a from_hf run without data.source, are refused in one line naming the field and both values,
    by loom config and by loom train before any rank starts."""
    data = [] if not argv else ["--data.source", "c.txt"]
    for cmd in ("config", "train"):
        capsys.readouterr()
        assert (
            main([cmd, "--model.from_hf", str(dirs[family]), *data, *argv, "--run.dir", "/nonexistent/r"])
            == 2
        )
        err = capsys.readouterr().err
        assert err.startswith(f"loom: error: {says}") and err.count("\n") == 1, err


def test_max_seq_len_is_honoured_and_equal_values_pass(dirs, capsys):
    """max_seq_len with RoPE only says how far the rotary tables reach: an explicit value is kept;
    explicit values equal to the directory's pass."""
    argv = ["--model.from_hf", str(dirs["llama"]), "--data.source", "c.txt", "--model.max_seq_len", "512"]
    rc, out, err = _config(capsys, *argv, "--model.dim", "32", "--model.vocab_size", "0")
    assert rc == 0, err
    m = _toml(out)["model"]
    assert m["max_seq_len"] == 512 and m["vocab_size"] == 64 and m["dim"] == 32


def test_loom_plan_plans_the_directorys_model(dirs, capsys, tmp_path):
    """``loom plan --model.from_hf`` plans the directory's model: the same ranking as for the same
    model given field by field (the config loom config prints), not the default model's."""

    def plan(*argv: str) -> dict:
        capsys.readouterr()
        rc = main(["plan", "--json", "--world", "2", *argv])
        out = json.loads(capsys.readouterr().out)
        assert rc in (0, 1)
        return {k: v for k, v in out.items() if k != "elapsed_s"}

    rc, out, _ = _config(capsys, "--model.from_hf", str(dirs["nemo"]), "--data.source", "c.txt")
    spelled = _toml(out)
    spelled["model"]["from_hf"] = ""
    (tmp_path / "spelled.toml").write_text(C.dump_toml(C.from_dict(spelled)))
    got = plan("--model.from_hf", str(dirs["nemo"]))
    assert got == plan("--config", str(tmp_path / "spelled.toml"))
    assert got != plan("--config", str(tmp_path / "spelled.toml"), "--model.attn_head_dim", "0")
