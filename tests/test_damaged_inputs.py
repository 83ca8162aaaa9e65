"""Damaged inputs are one line naming the file and field, never a traceback nor another file read:
a Hugging Face index whose weight_map leads outside the model directory, config.json sizes of 0
(a division by them came first) or of the wrong type (the field unnamed), and a data.source that
exists but is no regular file (a FIFO, a symbolic link loop: "does not exist", and a FIFO must never
be opened, its reader would wait forever)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from loom.cli import main
from loom.config import ConfigError
from loom.model.hf import CONFIG, INDEX, HFError, model_config, open_dir, read_state

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny Llama saved in shards with an index (as tests/test_hf.py saves its models)."""
    import torch

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
    )
    out = tmp_path_factory.mktemp("hf") / "llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(out, max_shard_size="40KB")
    assert (out / INDEX).is_file()
    return out


def _copy(hf_dir: Path, tmp_path: Path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(hf_dir, d)
    return d


def _edit(path: Path, change) -> None:
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def _generate(capsys, d: Path) -> tuple[int, str]:
    rc = main(["generate", "--model.from_hf", str(d), "--prompt", "hello", "--max-new-tokens", "2"])
    return rc, capsys.readouterr().err


def _one_line(rc: int, err: str, *says: str) -> None:
    assert rc == 2 and err.startswith("loom: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and all(s in err for s in says), err


# ----------------------------------------------------------------------------- 1: weight_map outside


def _first_shard(d: Path) -> tuple[str, str]:
    """(a tensor, its shard) of the index."""
    wm = json.loads((d / INDEX).read_text())["weight_map"]
    name = "model.embed_tokens.weight"
    return name, wm[name]


def _move_shard(d: Path, shard: str, to: str) -> None:
    """Move ``shard`` to ``to`` (relative to ``d``) and point every weight_map entry of it there."""
    (d / to).parent.mkdir(parents=True, exist_ok=True)
    (d / shard).rename(d / to)
    _edit(
        d / INDEX,
        lambda raw: raw["weight_map"].update({k: to for k, v in raw["weight_map"].items() if v == shard}),
    )


def test_a_weight_map_leading_out_of_the_directory_is_refused(hf_dir, tmp_path, capsys):
    """``../other/model.safetensors`` was read (and generate exited 0): now one line naming the
    index and the entry, with the real shard sitting there to be read."""
    d = _copy(hf_dir, tmp_path)
    name, shard = _first_shard(d)
    _move_shard(d, shard, "../other/model.safetensors")
    assert (tmp_path / "other" / "model.safetensors").is_file()
    rc, err = _generate(capsys, d)
    _one_line(rc, err, f"{d / INDEX}: weight_map[{name!r}]", "../other/model.safetensors", "inside the model")


@pytest.mark.parametrize("bad", ["/etc/passwd", "sub/../../x.safetensors", "..", "."])
def test_absolute_and_climbing_weight_map_names_are_refused_before_any_open(hf_dir, tmp_path, bad):
    d = _copy(hf_dir, tmp_path)
    name, _ = _first_shard(d)
    _edit(d / INDEX, lambda raw: raw["weight_map"].update({name: bad}))
    with pytest.raises(HFError, match="is not a file inside the model directory") as e:
        open_dir(d)
    assert str(d / INDEX) in str(e.value) and repr(bad) in str(e.value)


def test_shards_in_a_subdirectory_or_linked_from_a_cache_still_load(hf_dir, tmp_path):
    """What transformers joins to the directory keeps working: a plain name, ``./x``, a name in a
    subdirectory, and a shard that is a link to a file elsewhere (a Hugging Face cache snapshot's
    shards link into ../../blobs): the check is of the name, not of where links lead."""
    d = _copy(hf_dir, tmp_path)
    shards = sorted({v for v in json.loads((d / INDEX).read_text())["weight_map"].values()})
    _move_shard(d, shards[0], "sub/dir/" + shards[0])
    _move_shard(d, shards[1], "./" + shards[1])
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (d / shards[2]).rename(blobs / "abc123")
    (d / shards[2]).symlink_to(os.path.relpath(blobs / "abc123", d))
    model = open_dir(d)
    assert set(model.files.values()) >= {f"sub/dir/{shards[0]}", f"./{shards[1]}", shards[2]}
    assert sum(1 for _ in read_state(model)) == 2 * 9 + 3  # every tensor read


# ----------------------------------------------------------------------------- 2: sizes of 0


@pytest.mark.parametrize(
    "field,value,says",
    [
        ("num_attention_heads", 0, "num_attention_heads = 0 is out of range: want an integer >= 1"),
        ("num_key_value_heads", 0, "num_key_value_heads = 0 is out of range"),
        ("head_dim", 0, "head_dim = 0 is out of range"),
        ("hidden_size", 0, "hidden_size = 0 is out of range"),
        ("num_key_value_heads", 3, "num_key_value_heads = 3 does not divide num_attention_heads = 4"),
        ("head_dim", 15, "head_dim = 15 is odd"),
        ("intermediate_size", 0, "intermediate_size = 0 is out of range"),
        ("vocab_size", 0, "vocab_size = 0 is out of range"),
    ],
)
def test_config_sizes_of_zero_are_one_line_naming_the_field(hf_dir, tmp_path, capsys, field, value, says):
    """``num_attention_heads: 0`` ended in a ZeroDivisionError (a division before the bounds); with a
    head_dim given too, it still divided; a 0 taken as 'unset' (num_key_value_heads, head_dim,
    intermediate_size, vocab_size) silently became another value."""
    d = _copy(hf_dir, tmp_path)
    _edit(d / CONFIG, lambda raw: raw.update({field: value}))
    rc, err = _generate(capsys, d)
    _one_line(rc, err, "model.from_hf: config.json: " + says)


def test_zero_heads_beside_a_head_dim_and_gpt2_zero_heads_are_refused():
    base = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 256,
    }
    with pytest.raises(HFError, match="num_attention_heads = 0 is out of range"):
        model_config(base | {"num_attention_heads": 0, "head_dim": 16})
    with pytest.raises(HFError, match="hidden_size = 2 is narrower than num_attention_heads = 4"):
        model_config(base | {"hidden_size": 2, "num_attention_heads": 4})
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2, "vocab_size": 256}
    with pytest.raises(HFError, match="n_head = 0 is out of range"):
        model_config(gpt2 | {"n_head": 0})
    with pytest.raises(HFError, match="n_embd = 64 is not divisible by n_head = 3"):
        model_config(gpt2 | {"n_head": 3})


# ----------------------------------------------------------------------------- 3: wrong types named


@pytest.mark.parametrize(
    "field,value,says",
    [
        ("hidden_size", "abc", 'hidden_size = "abc", want an integer >= 1'),
        ("num_attention_heads", "4", 'num_attention_heads = "4", want an integer >= 1'),
        ("hidden_size", 64.5, "hidden_size = 64.5, want an integer"),
        ("hidden_size", True, "hidden_size = true, want an integer"),
        ("num_attention_heads", None, "num_attention_heads = null, want an integer"),
        ("rms_norm_eps", "x", 'rms_norm_eps = "x", want a number'),
        ("tie_word_embeddings", "no", 'tie_word_embeddings = "no", want true or false'),
        ("rope_scaling", "abc", 'rope_scaling = "abc", want an object'),
    ],
)
def test_a_config_value_of_the_wrong_type_names_field_value_and_type(
    hf_dir, tmp_path, capsys, field, value, says
):
    """``"hidden_size": "abc"`` said only "a field has a value of the wrong type (invalid literal for
    int()...)"; a bool or a fraction was read as a number, "no" as true."""
    d = _copy(hf_dir, tmp_path)
    _edit(d / CONFIG, lambda raw: raw.update({field: value}))
    rc, err = _generate(capsys, d)
    _one_line(rc, err, "config.json: a field has a value of the wrong type: " + says)


def test_an_integral_float_is_still_an_integer():
    cfg = model_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64.0,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "vocab_size": 256,
        }
    )
    assert cfg.dim == 64 and isinstance(cfg.dim, int)


# ----------------------------------------------------------------------------- 4: no regular file


@pytest.fixture
def no_hang():
    """A FIFO opened for reading blocks until a writer comes: fail instead of hanging the suite."""

    def _late(*_):
        raise TimeoutError("data.source: the FIFO was opened for reading")

    old = signal.signal(signal.SIGALRM, _late)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _prepare(capsys, tmp_path: Path, monkeypatch, source: Path) -> tuple[int, str]:
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    rc = main(["prepare", "--data.source", os.path.relpath(source, tmp_path)])
    return rc, capsys.readouterr().err


def test_a_fifo_source_is_not_a_regular_file_and_never_opened(tmp_path, capsys, monkeypatch, no_hang):
    d = tmp_path / "d"
    d.mkdir()
    os.mkfifo(d / "fifo.txt")
    rc, err = _prepare(capsys, tmp_path, monkeypatch, d / "fifo.txt")
    _one_line(rc, err, "data.source: 'd/fifo.txt' is a FIFO (named pipe), not a regular file")
    assert "does not exist" not in err


def test_a_symlink_loop_and_a_dangling_link_say_so(tmp_path, capsys, monkeypatch):
    from loom.data.corpus import find_files

    d = tmp_path / "d"
    d.mkdir()
    (d / "loop2.txt").symlink_to("loop1.txt")
    (d / "loop1.txt").symlink_to("loop2.txt")
    (d / "dangling.txt").symlink_to("nothere.txt")
    rc, err = _prepare(capsys, tmp_path, monkeypatch, d / "loop2.txt")
    _one_line(rc, err, "data.source: 'd/loop2.txt' is a symbolic link loop")
    assert "does not exist" not in err
    with pytest.raises(ConfigError, match="is a symbolic link to 'nothere.txt', which does not exist"):
        find_files(str(d / "dangling.txt"))
    with pytest.raises(ConfigError, match=r"'.*nothing.txt' does not exist \(want 'stdlib'"):
        find_files(str(d / "nothing.txt"))
    if os.path.exists("/dev/null"):
        with pytest.raises(ConfigError, match="'/dev/null' is a character device, not a regular file"):
            find_files("/dev/null")
