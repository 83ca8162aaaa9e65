"""Hugging Face `datasets` outputs as corpora: null and empty text, save_to_disk directories (splits,
`.map()` cache files), and what preparing tells the user from the launcher process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loom.config import ConfigError, DataConfig
from loom.data import prepare_data
from loom.data.corpus import read_documents

datasets = pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 4) for i in range(24)]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test prepares into its own cache, never ~/.cache/loom."""
    root = tmp_path / "cache"
    monkeypatch.setenv("LOOM_CACHE_DIR", str(root))
    return root


def _write(ds, tmp_path: Path, kind: str) -> Path:
    """``ds`` as a .jsonl file, a .parquet file or a save_to_disk directory."""
    if kind == "jsonl":
        ds.to_json(str(tmp_path / "c.jsonl"))
        return tmp_path / "c.jsonl"
    if kind == "parquet":
        ds.to_parquet(str(tmp_path / "c.parquet"))
        return tmp_path / "c.parquet"
    ds.save_to_disk(str(tmp_path / "saved"))
    return tmp_path / "saved"


# ----------------------------------------------------------------------------- finding 1: null text


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "saved"])
def test_null_and_empty_text_skipped_and_reported(tmp_path, kind, caplog):
    """Records whose text is null (2) or "" (1) are skipped the same way in all three formats, and
    said: one warning line naming the count and the first record, and meta.json's skipped_records."""
    texts: list[str | None] = list(TEXTS)
    texts[3], texts[5], texts[9] = None, "", None
    src = _write(datasets.Dataset.from_dict({"text": texts}), tmp_path, kind)
    kept = [t for t in texts if t]

    with caplog.at_level("WARNING", logger="loom"):
        assert read_documents(str(src)) == kept
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1, lines
    first = f"{src}:4" if kind == "jsonl" else f"{src} row 3"
    assert "2 record(s) whose text field is null and 1 whose text is empty" in lines[0], lines[0]
    assert f"first at {first}" in lines[0], lines[0]

    caplog.clear()
    with caplog.at_level("WARNING", logger="loom"):
        prepared = prepare_data(DataConfig(source=str(src), vocab_size=300), progress=False)
    assert prepared.meta()["skipped_records"] == {"null": 2, "empty": 1}
    assert sum("skipped 2 record(s)" in r.getMessage() for r in caplog.records) == 1


def test_only_null_text_refused_in_one_line(tmp_path, cache):
    src = _write(datasets.Dataset.from_dict({"text": [None, None, ""]}), tmp_path, "parquet")
    with pytest.raises(ConfigError) as e:
        prepare_data(DataConfig(source=str(src), vocab_size=300), progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "holds no text" in msg and "null in 2 and empty in 1" in msg, msg
    assert not (cache / "data").exists() or not any((cache / "data").iterdir())


def test_a_text_field_that_is_not_a_string_is_still_refused(tmp_path):
    src = _write(datasets.Dataset.from_dict({"text": [1, 2, 3]}), tmp_path, "saved")
    with pytest.raises(ConfigError, match=r"row 0 column 'text' holds a int, not a string"):
        read_documents(str(src))


# ----------------------------------------------------------------------------- finding 2: save_to_disk


def test_dataset_dict_refused_naming_its_splits(tmp_path, cache):
    """A DatasetDict saved with train and test splits is not read as one corpus (the test split
    trained on): refused in one line naming the splits and the directory of one."""
    d = tmp_path / "dd"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": TEXTS[:20]}),
            "test": datasets.Dataset.from_dict({"text": TEXTS[20:]}),
        }
    ).save_to_disk(str(d))
    for source in (str(d), str(tmp_path), str(tmp_path / "d*")):  # named, under a directory, by a glob
        with pytest.raises(ConfigError) as e:
            read_documents(source)
        msg = str(e.value)
        assert "\n" not in msg and "DatasetDict" in msg and "'train', 'test'" in msg, msg
        assert f"e.g. {d / 'train'}" in msg, msg
    with pytest.raises(ConfigError, match="DatasetDict"):
        prepare_data(DataConfig(source=str(d), vocab_size=300), progress=False)
    assert not (cache / "data").exists() or not any((cache / "data").iterdir())
    assert read_documents(str(d / "train")) == TEXTS[:20]  # one split, as the line says


def test_map_cache_files_are_not_read_twice(tmp_path):
    """`.map()` on a loaded save_to_disk directory leaves cache-*.arrow files in it: the directory is
    read through `datasets` (its state.json), each record once, by directory, parent or glob."""
    d = tmp_path / "corpus" / "saved"
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(d))
    loaded = datasets.load_from_disk(str(d))
    loaded.map(lambda b: {"text": [t.upper() for t in b["text"]]}, batched=True)
    assert list(d.glob("cache-*.arrow")), "map() left no cache file; the test would prove nothing"
    for source in (d, d.parent, d / "*.arrow", tmp_path / "**" / "*.arrow"):
        assert read_documents(str(source)) == TEXTS, source
    once = prepare_data(DataConfig(source=str(d), vocab_size=300), progress=False)
    jl = tmp_path / "c.jsonl"
    datasets.Dataset.from_dict({"text": TEXTS}).to_json(str(jl))
    same = prepare_data(DataConfig(source=str(jl), vocab_size=300), progress=False)
    assert (once.n_train_tokens, once.n_val_tokens) == (same.n_train_tokens, same.n_val_tokens)


def test_loose_arrow_files_still_read(tmp_path):
    """An .arrow file outside a save_to_disk directory (no state.json beside it) is read as itself."""
    d = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(d))
    loose = tmp_path / "loose"
    loose.mkdir()
    for i, shard in enumerate(sorted(d.glob("data-*.arrow"))):
        shutil.copy(shard, loose / f"part{i}.arrow")
    assert read_documents(str(loose)) == TEXTS
    assert read_documents(str(loose / "part0.arrow")) == TEXTS


# ----------------------------------------------------------------------------- finding 3: the log


def _loom(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOOM_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "loom", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _prompt_completion(tmp_path: Path, n: int = 9) -> Path:
    recs = [{"prompt": f"Q{i}: add {i} and 1\nA:", "completion": f" {i + 1}"} for i in range(n)]
    recs[2]["completion"] = " " + "very long " * 80
    jl = tmp_path / "pc.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return jl


def test_prepare_shows_truncated_and_dropped_once(tmp_path):
    """`loom prepare` of instruction data says how many examples were cut or left out (meta.json has the
    same counts), in one line on stderr; stdout keeps its one "prepared" line."""
    jl = _prompt_completion(tmp_path)
    args = ["prepare", "--data.source", str(jl), "--data.format", "prompt_completion"]
    args += ["--data.vocab_size", "300", "--data.seq_len", "32", "--run.progress", "false"]
    out = _loom(args, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("1 truncated, 0 dropped") == 1, out.stderr
    assert out.stderr.count("\n") == 1, out.stderr  # that line only
    assert out.stdout.count("\n") == 1 and out.stdout.startswith("prepared "), out.stdout


def test_train_shows_truncated_and_dropped_once(tmp_path):
    """`loom train` prepares in its launcher before any rank starts: the counts appear once there, and
    the ranks' own lines keep their `[rank 0]` format."""
    jl = _prompt_completion(tmp_path, 40)
    args = ["train", "configs/debug.toml", "--nproc", "1", "--run.dir", str(tmp_path / "run")]
    args += ["--data.source", str(jl), "--data.format", "prompt_completion", "--data.overlong", "drop"]
    args += ["--data.vocab_size", "300", "--data.seq_len", "32", "--run.progress", "false"]
    args += [
        "--data.val_fraction",
        "0.25",
        "--train.steps",
        "1",
        "--train.global_batch",
        "2",
        "--train.eval_every",
        "0",
    ]
    out = _loom(args, tmp_path)
    assert out.returncode == 0, out.stderr
    said = out.stdout + out.stderr
    assert said.count("0 truncated, 1 dropped") == 1, said
    assert "[rank 0] step" in said or "[rank 0]" in said, said


def test_train_says_the_corpus_cap_once(tmp_path):
    """`loom train` on a corpus data.max_corpus_mb cuts: the launcher prepares it and says where the cap
    stopped reading, once; rank 0, which reuses it, says nothing more (meta.json's corpus_cut keeps it)."""
    jl = tmp_path / "c.jsonl"
    jl.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))  # about 2.9 KB
    args = ["train", "configs/debug.toml", "--nproc", "1", "--run.dir", str(tmp_path / "run")]
    args += ["--data.source", str(jl), "--data.max_corpus_mb", "0.002", "--data.vocab_size", "300"]
    args += ["--data.seq_len", "32", "--data.val_fraction", "0.25", "--run.progress", "false"]
    args += ["--train.steps", "1", "--train.global_batch", "2", "--train.eval_every", "0"]
    out = _loom(args, tmp_path)
    assert out.returncode == 0, out.stderr
    said = out.stdout + out.stderr
    assert said.count("data.max_corpus_mb = 0.002: read only the first 0.002 MB") == 1, said
    assert "\ndata.max_corpus_mb = 0.002: read only the first 0.002 MB of text, of at least" in "\n" + said
    assert f"of {jl}; raise it (0 = no cap) to read more" in said, said
