"""Data package: corpus reading, tokenizer, prepare (idempotent, atomic), dataset and sampler."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from loom.config import DataConfig
from loom.data import (
    BatchSampler,
    PreparedData,
    TokenDataset,
    eval_batches,
    load_tokenizer,
    prepare_data,
    stream,
)
from loom.data import prepare as prepare_mod
from loom.data.chat import segments, template_render
from loom.data.corpus import read_documents, stdlib_files, stdlib_root
from loom.data.dataset import epoch_permutation
from loom.data.prepare import split_documents, token_dtype
from loom.data.tokenizer import EOT, encode_documents, eot_id, train_tokenizer
from tests.helpers import one_thread  # noqa: F401 (fixture)

DOCS = [
    f"def f{i}(x):\n    return x * {i}  # naïve ünïcode → ok\n\n\tprint('doc {i}')\n" * (1 + i % 3)
    for i in range(40)
]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test prepares into its own cache, never ~/.cache/loom."""
    root = tmp_path / "cache"
    monkeypatch.setenv("LOOM_CACHE_DIR", str(root))
    return root


def write_txt_dir(d, docs=DOCS):
    d.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (d / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    return d


def write_bin(path, n_tokens, dtype=np.uint16):
    np.arange(n_tokens, dtype=dtype).tofile(path)
    return path


# ----------------------------------------------------------------------------- corpus


def test_stdlib_corpus_found_and_deterministic():
    files = stdlib_files()
    assert len(files) > 100
    rel = [p.relative_to(stdlib_root()).as_posix() for p in files]
    assert rel == sorted(rel)
    assert not any(
        part in ("test", "tests", "idlelib", "site-packages") for r in rel for part in r.split("/")
    )
    assert "os.py" in rel
    a = read_documents("stdlib", max_mb=0.3)
    b = read_documents("stdlib", max_mb=0.3)
    assert a == b
    n_bytes = sum(len(d.encode()) for d in a)
    assert 0.29e6 < n_bytes <= 0.3e6
    assert a[0] == files[0].read_text(encoding="utf-8")


def test_txt_jsonl_parquet_sources(tmp_path):
    d = write_txt_dir(tmp_path / "txt", ["alpha", "beta", "", "gamma"])
    assert read_documents(str(d)) == ["alpha", "beta", "gamma"]  # sorted, empty dropped
    assert read_documents(str(d / "doc001.txt")) == ["beta"]
    assert read_documents(str(tmp_path / "txt" / "doc00[03].txt")) == ["alpha", "gamma"]

    jl = tmp_path / "c.jsonl"
    jl.write_text("\n".join(json.dumps({"body": t, "id": i}) for i, t in enumerate(["one", "two"])) + "\n\n")
    assert read_documents(str(jl), text_field="body") == ["one", "two"]

    pqf = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": ["x y", None, "z"], "n": [1, 2, 3]}), pqf)
    assert read_documents(str(pqf)) == ["x y", "z"]

    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text("first")
    (mixed / "b.jsonl").write_text(json.dumps({"text": "second"}))
    (mixed / "ignored.md").write_text("not read")
    assert read_documents(str(mixed)) == ["first", "second"]


def test_json_files_as_datasets_and_alpaca_write_them(tmp_path):
    """A ``.json`` source (refused before) is JSON Lines, as ``datasets``' ``to_json`` writes it, or one
    array of records (Alpaca's), in the text and the instruction formats; a record is named by
    ``FILE[INDEX]``."""
    import datasets

    from loom.config import ConfigError
    from loom.data.chat import read_records

    lines = tmp_path / "lines.json"
    datasets.Dataset.from_dict({"text": ["one", "two"]}).to_json(str(lines))
    assert read_documents(str(lines)) == ["one", "two"]
    array = tmp_path / "alpaca.json"
    records = [{"prompt": "Q: 1+1?\nA:", "completion": " 2"}, {"prompt": "Q: 2+2?\nA:", "completion": " 4"}]
    array.write_text("\ufeff" + json.dumps(records, indent=2), encoding="utf-8")  # a BOM, as editors write
    assert [r for _, r in read_records([array])] == records
    assert read_documents(str(array), text_field="completion") == [" 2", " 4"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"text": "x"}, 3]))
    with pytest.raises(ConfigError, match=r"bad.json\[1\] is a JSON int, not an object"):
        list(read_records([bad]))


def test_text_is_text_a_bom_and_a_special_tokens_spelling_are_no_document_marks(tmp_path, cache):
    """A literal ``<|endoftext|>`` in a document (web text quoting GPT-2 data) was encoded as the
    end-of-document id, splitting the document (and, packed, resetting its positions); it is text,
    as tiktoken's encode_ordinary reads it. A .txt file's leading byte order mark was trained on."""
    d = tmp_path / "c"
    d.mkdir()
    (d / "a.txt").write_text("\ufeff" + "def f(): return '<|endoftext|>' " * 20, encoding="utf-8")
    for i in range(9):
        (d / f"b{i}.txt").write_text(f"document {i} " * 20, encoding="utf-8")
    p = prepare_data(DataConfig(source=str(d), vocab_size=300, val_fraction=0.1), progress=False)
    tok = load_tokenizer(p.dir)
    ids = np.concatenate([np.fromfile(p.dir / f"{s}.bin", dtype=p.dtype) for s in ("train", "val")])
    assert int((ids == eot_id(tok)).sum()) == 10  # one after each document, none inside
    text = tok.decode(ids.tolist(), skip_special_tokens=False)
    assert text.startswith("def f(): return '<|endoftext|>'") and "\ufeff" not in text


@pytest.mark.parametrize("block", [7, 1 << 16], ids=["separators across blocks", "one block"])
def test_a_separator_of_line_breaks_splits_a_windows_file(tmp_path, block):
    """``doc_separator = "\\n\\n"`` left a file written with \\r\\n line breaks one document."""
    from loom.data.corpus import _read_txt

    f = tmp_path / "w.txt"
    f.write_bytes(b"one\r\nline\r\n\r\ntwo\r\n\r\nthree\n\nfour")
    pieces = list(_read_txt(f, "strict", None, "\n\n", block=block))
    docs, cur = [], ""
    for text, end in pieces:
        cur += text
        if end:
            docs.append(cur)
            cur = ""
    assert docs == ["one\r\nline", "two", "three", "four"]


def test_a_glob_names_the_files_it_does_not_read(tmp_path, cache, caplog):
    d = tmp_path / "g"
    d.mkdir()
    (d / "a.txt").write_text("alpha beta gamma " * 50)
    (d / "b.txt.gz").write_bytes(b"\x1f\x8b")
    (d / "c.jsonl.zst").write_bytes(b"(\xb5/\xfd")
    with caplog.at_level("INFO", logger="loom"):
        p = prepare_data(DataConfig(source=str(d / "*"), vocab_size=300), progress=False)
    unread = p.meta()["unread_files"]
    assert unread["count"] == 2 and unread["examples"][0].endswith("g/b.txt.gz"), unread
    assert any("2 file(s) in" in r.getMessage() for r in caplog.records), caplog.text


def test_corpus_cap_cuts_at_max_mb(tmp_path):
    d = write_txt_dir(tmp_path / "t", ["a" * 600, "b" * 600, "c" * 600])
    docs = read_documents(str(d), max_mb=0.001)
    assert docs == ["a" * 600, "b" * 400]


def _notes(caplog, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if needle in r.getMessage() and r.levelname == "INFO"]


def test_corpus_cap_is_said_where_it_stops(tmp_path, caplog):
    """When data.max_corpus_mb stops reading, one INFO line says how much was read of how much, where
    it stopped, how many files were not read and the setting; nothing when all was read."""
    d = write_txt_dir(tmp_path / "t", ["a" * 600, "b" * 600, "c" * 600, "d" * 600])
    with caplog.at_level("INFO", logger="loom"):
        assert read_documents(str(d), max_mb=0.001) == ["a" * 600, "b" * 400]
    (line,) = _notes(caplog, "data.max_corpus_mb")
    assert "\n" not in line and "data.max_corpus_mb = 0.001: read only the first 0.001 MB" in line, line
    assert "of at least 0.0012 MB" in line and f"stopped in {d / 'doc001.txt'}" in line, line
    assert "2 later file(s) (0.0012 MB on disk) not read" in line and "0 = no cap" in line, line

    caplog.clear()  # the cap at the end of a file: nothing of it is cut, the later files are not read
    with caplog.at_level("INFO", logger="loom"):
        assert read_documents(str(d), max_mb=0.0006) == ["a" * 600]
    (line,) = _notes(caplog, "data.max_corpus_mb")
    assert f"first 0.0006 MB of text: stopped at the end of {d / 'doc000.txt'}, and 3 later" in line, line

    jl = tmp_path / "one.jsonl"  # one huge record (the audit's case): the record it stopped in
    jl.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": "x" * 5000}) + "\n")
    caplog.clear()
    with caplog.at_level("INFO", logger="loom"):
        read_documents(str(jl), max_mb=0.001)
    (line,) = _notes(caplog, "data.max_corpus_mb")
    assert f"of at least 0.005 MB: stopped in document 2 of {jl}; raise it" in line, line

    caplog.clear()  # all read: the cap exactly at the end of the corpus, or no cap
    with caplog.at_level("INFO", logger="loom"):
        assert len(read_documents(str(d), max_mb=0.0024)) == 4
        assert len(read_documents(str(d), max_mb=0)) == 4
        assert len(read_documents(str(d))) == 4
    assert not _notes(caplog, "data.max_corpus_mb"), caplog.text


def test_directory_files_not_read_are_said(tmp_path, caplog):
    """A directory source's files of formats Loom does not read are named in one INFO line (count, a
    few names, the formats it reads), and recorded in meta.json."""
    d = write_txt_dir(tmp_path / "mixed", DOCS)
    for name in ("notes.csv", "blob.bin", "README", "sub/more.md"):
        (d / name).parent.mkdir(exist_ok=True)
        (d / name).write_text("not read")
    with caplog.at_level("INFO", logger="loom"):
        assert read_documents(str(d)) == [doc for doc in DOCS if doc]
    (line,) = _notes(caplog, "not read")
    assert f"4 file(s) in {d} not read" in line and "e.g. README, blob.bin, notes.csv)" in line, line
    assert ".txt, .jsonl" in line and "\n" not in line, line

    caplog.clear()
    with caplog.at_level("INFO", logger="loom"):
        p = prepare_data(DataConfig(source=str(d), vocab_size=300), progress=False)
    assert len(_notes(caplog, "4 file(s)")) == 1, caplog.text
    assert p.meta()["unread_files"] == {"count": 4, "examples": ["README", "blob.bin", "notes.csv"]}
    caplog.clear()
    with caplog.at_level("INFO", logger="loom"):  # said where it is prepared, not at every reuse
        prepare_data(DataConfig(source=str(d), vocab_size=300), progress=False)
    assert not _notes(caplog, "4 file(s)"), caplog.text

    write_txt_dir(tmp_path / "clean", DOCS)
    caplog.clear()
    with caplog.at_level("INFO", logger="loom"):
        read_documents(str(tmp_path / "clean"))
    assert not _notes(caplog, "not read"), caplog.text


def test_prepare_records_the_cap_and_says_it_where_it_prepares(tmp_path, cache, caplog):
    """meta.json records where data.max_corpus_mb stopped (corpus_cut); the line is said where the data
    is prepared, not again at every reuse (each run's ranks); an uncut corpus records null."""
    jl = tmp_path / "c.jsonl"
    jl.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in DOCS))  # about 6 KB of text
    cfg = DataConfig(source=str(jl), vocab_size=300, max_corpus_mb=0.003)
    with caplog.at_level("INFO", logger="loom"):
        p = prepare_data(cfg, progress=False)
    assert len(_notes(caplog, "data.max_corpus_mb = 0.003")) == 1, caplog.text
    cut = p.meta()["corpus_cut"]
    assert cut["max_corpus_mb"] == 0.003 and cut["files_not_read"] == 0, cut
    assert cut["stopped"].startswith("in document ") and cut["stopped"].endswith(f"of {jl}"), cut
    assert cut["at_least_mb"] > 0.003 and p.meta()["corpus_mb"] == pytest.approx(0.003)
    caplog.clear()
    with caplog.at_level("INFO", logger="loom"):
        assert prepare_data(cfg, progress=False) == p
    assert not _notes(caplog, "data.max_corpus_mb = 0.003"), caplog.text

    whole = prepare_data(DataConfig(source=str(jl), vocab_size=300), progress=False)
    assert whole.meta()["corpus_cut"] is None and whole.meta()["unread_files"] is None


def _one_line_error(fn, *words):
    with pytest.raises(ValueError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and "data.source" in msg, msg
    for w in words:
        assert w in msg, msg


def test_bad_sources_give_one_line_errors(tmp_path):
    _one_line_error(lambda: read_documents(str(tmp_path / "nope")), "does not exist")
    (tmp_path / "x.csv").write_text("a,b")
    _one_line_error(lambda: read_documents(str(tmp_path / "x.csv")), "unsupported", ".csv")
    _one_line_error(lambda: read_documents(str(tmp_path / "*.csv")), "unsupported")
    _one_line_error(lambda: read_documents(str(tmp_path / "*.txt")), "no .txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(lambda: read_documents(str(empty)), "no .txt")
    jl = tmp_path / "bad.jsonl"
    jl.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"content": "x"}) + "\n")
    _one_line_error(lambda: read_documents(str(jl)), "bad.jsonl:2", "'text'")
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    _one_line_error(lambda: read_documents(str(tmp_path / "broken.jsonl")), "not valid JSON")
    pqf = tmp_path / "p.parquet"
    pq.write_table(pa.table({"body": ["x"]}), pqf)
    _one_line_error(lambda: read_documents(str(pqf)), "no column 'text'")


def test_bad_source_fails_in_prepare_before_work(tmp_path, cache):
    _one_line_error(lambda: prepare_data(DataConfig(source=str(tmp_path / "missing")), progress=False))
    assert not cache.exists()


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_eot():
    tok = train_tokenizer(DOCS, vocab_size=300)
    assert tok.get_vocab_size() <= 300
    assert tok.token_to_id(EOT) == eot_id(tok) == 0
    for text in DOCS[:3] + ["  spaces\t\ttabs\r\n", "emoji 🧵 and 中文", "never seen: zqxj"]:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
    assert tok.encode(f"a{EOT}b").ids.count(0) == 1  # EOT is one special token
    again = train_tokenizer(DOCS, vocab_size=300)
    assert again.get_vocab() == tok.get_vocab()  # training is deterministic


def test_encode_documents_appends_eot_and_matches_single_encode():
    tok = train_tokenizer(DOCS, vocab_size=300)
    eot = eot_id(tok)
    chunks = list(encode_documents(tok, DOCS, eot, chunk_chars=500))
    assert len(chunks) > 1
    ids = np.concatenate(chunks)
    expected = [i for d in DOCS for i in [*tok.encode(d).ids, eot]]
    assert ids.tolist() == expected
    with pytest.raises(ValueError, match="data.vocab_size"):
        train_tokenizer(DOCS, vocab_size=100)


# ----------------------------------------------------------------------------- prepare


def _check_prepared(p: PreparedData):
    meta = p.meta()
    assert meta["vocab_size"] == p.vocab_size
    assert np.dtype(meta["dtype"]) == token_dtype(p.vocab_size)
    for name, path, n in (
        ("train.bin", p.train_path, p.n_train_tokens),
        ("val.bin", p.val_path, p.n_val_tokens),
    ):
        raw = path.read_bytes()
        assert hashlib.sha256(raw).hexdigest() == meta["sha256"][name]
        assert len(raw) == n * np.dtype(p.dtype).itemsize


def test_prepare_txt_idempotent_and_consistent(tmp_path, cache):
    src = write_txt_dir(tmp_path / "corpus")
    cfg = DataConfig(source=str(src), vocab_size=300, val_fraction=0.1)
    p = prepare_data(cfg, progress=False)
    assert p.dir.parent == cache / "data"
    _check_prepared(p)
    assert p.dtype == "uint16" and p.vocab_size <= 300
    stamp = (p.dir / "meta.json").stat().st_mtime_ns
    p2 = prepare_data(cfg, progress=False)
    assert p2 == p and (p.dir / "meta.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert PreparedData.load(p.dir) == p
    assert sorted(x.name for x in (cache / "data").iterdir()) == [p.dir.name]  # no temp dirs left

    # val = the last 10% of documents, each followed by EOT; train = the rest
    tok = load_tokenizer(p.dir)
    val = np.fromfile(p.val_path, dtype=p.dtype)
    assert tok.decode(val.tolist(), skip_special_tokens=False) == "".join(d + EOT for d in DOCS[-4:])
    train = np.fromfile(p.train_path, dtype=p.dtype)
    assert tok.decode(train.tolist(), skip_special_tokens=False) == "".join(d + EOT for d in DOCS[:-4])

    other = prepare_data(DataConfig(source=str(src), vocab_size=280, val_fraction=0.1), progress=False)
    assert other.dir != p.dir  # the cache key includes the vocabulary


def test_prepare_jsonl_explicit_dir_and_given_tokenizer(tmp_path, cache, caplog):
    jl = tmp_path / "c.jsonl"
    jl.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    first = prepare_data(DataConfig(source=str(jl), vocab_size=300), progress=False)
    out = tmp_path / "prepared"
    cfg = DataConfig(source=str(jl), prepared_dir=str(out), tokenizer=str(first.tokenizer_path))
    p = prepare_data(cfg, progress=False)
    assert p.dir == out
    _check_prepared(p)
    assert np.array_equal(np.fromfile(p.train_path, p.dtype), np.fromfile(first.train_path, first.dtype))
    with caplog.at_level("WARNING", logger="loom"):  # an explicit dir is reused, with a one-line warning
        assert prepare_data(DataConfig(source=str(jl), prepared_dir=str(out)), progress=False) == p
    (warning,) = [r.getMessage() for r in caplog.records if "reusing" in r.getMessage()]
    assert "prepared with different tokenizer" in warning and "\n" not in warning
    with pytest.raises(ValueError, match="data.tokenizer: .* does not exist"):
        prepare_data(DataConfig(source=str(jl), tokenizer=str(tmp_path / "nope.json")), progress=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="data.prepared_dir: .* not empty"):
        prepare_data(DataConfig(source=str(jl), prepared_dir=str(tmp_path / "busy")), progress=False)


def test_prepare_stdlib_small(cache):
    p = prepare_data(DataConfig(vocab_size=512, max_corpus_mb=0.3), progress=False)
    _check_prepared(p)
    assert p.dir.name.startswith("stdlib-512-")
    assert p.vocab_size == 512
    n = p.n_train_tokens + p.n_val_tokens
    assert n > 50_000 and 0.01 * n < p.n_val_tokens < 0.04 * n  # few, uneven files: cut by text
    tok = load_tokenizer(p.tokenizer_path)
    text = stdlib_files()[0].read_text()
    assert tok.decode(tok.encode(text).ids) == text


def test_prepare_single_document_is_split(tmp_path, cache):
    f = tmp_path / "one.txt"
    f.write_text("".join(DOCS))
    p = prepare_data(DataConfig(source=str(f), vocab_size=300, val_fraction=0.1), progress=False)
    assert p.n_val_tokens > 0 and p.n_train_tokens > 5 * p.n_val_tokens
    train, val = split_documents(["l1\nl2\nl3\nl4\n"], 0.3)
    assert train == ["l1\nl2\n"] and val == ["l3\nl4\n"]
    assert split_documents(list("abcdefghij"), 0.1) == (list("abcdefghi"), ["j"])
    # one huge last document would be all of val by count: cut by characters instead
    train, val = split_documents(["a\n" * 10, "b\n" * 10, "c\n" * 80], 0.1)
    assert train == ["a\n" * 10, "b\n" * 10, "c\n" * 70] and val == ["c\n" * 10]
    with pytest.raises(ValueError, match="too small"):
        split_documents(["x"], 0.1)


def test_split_plan_reads_lengths_in_blocks():
    """The plan from lengths read block by block (memory-mapped in preparation) is the same for any block."""
    import random

    rng = random.Random(1)
    for _ in range(300):
        lengths = [rng.choice([1, 2, 3, 50, 400]) for _ in range(rng.randint(2, 30))]
        vf = rng.choice([0.01, 0.1, 0.3, 0.49])
        assert len({stream.split_plan(lengths, vf, block=b) for b in (1, 2, 3, 7, 1 << 20)}) == 1


def test_a_relative_cache_dir_is_made_absolute(tmp_path, monkeypatch):
    """A relative LOOM_CACHE_DIR names a directory from where Loom was started: the prepared directory
    (a run's config.toml records it as data.prepared_dir) is absolute, so it holds from anywhere."""
    src = write_txt_dir(tmp_path / "corpus")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOOM_CACHE_DIR", "relcache")
    assert prepare_mod.cache_root() == tmp_path / "relcache"
    p = prepare_data(DataConfig(source=str(src), vocab_size=300), progress=False)
    assert p.dir.is_absolute() and p.dir.parent == tmp_path / "relcache" / "data"


def test_prepare_killed_midway_leaves_nothing(tmp_path, cache, monkeypatch):
    src = write_txt_dir(tmp_path / "corpus")
    cfg = DataConfig(source=str(src), vocab_size=300)

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(prepare_mod, "encode_stream", boom)
        prepare_data(cfg, progress=False)
    assert list((cache / "data").iterdir()) == []

    # a temp dir of a dead process (hard kill) is swept by the next prepare
    final = prepare_mod.default_dir(cfg)
    stale = final.parent / f".{final.name}.tmp-{socket.gethostname()}-999999999-abc"
    stale.mkdir(parents=True)
    (stale / "train.bin").write_bytes(b"half")
    p = prepare_data(cfg, progress=False)
    assert not stale.exists() and p.dir == final and final.parent == cache / "data"
    assert [x.name for x in final.parent.iterdir()] == [final.name]


def test_prepare_race_keeps_existing_dir(tmp_path, cache, monkeypatch):
    """If another process finishes while we build, its directory stays and ours is discarded."""
    src = write_txt_dir(tmp_path / "corpus")
    cfg = DataConfig(source=str(src), vocab_size=300)
    real_build = prepare_mod._build
    winner: list[PreparedData] = []

    def build_while_other_wins(cfg_, key, out, progress):
        real_build(cfg_, key, out, progress)
        monkeypatch.setattr(prepare_mod, "_build", real_build)
        winner.append(prepare_data(cfg, progress=False))  # the "other process"
        (winner[0].dir / "marker").write_text("winner")

    monkeypatch.setattr(prepare_mod, "_build", build_while_other_wins)
    p = prepare_data(cfg, progress=False)
    assert p.dir == winner[0].dir and (p.dir / "marker").read_text() == "winner"
    assert [x.name for x in p.dir.parent.iterdir()] == [p.dir.name]


def test_prepare_is_identical_for_any_worker_count(tmp_path, cache, monkeypatch, capfd):
    """Chunks of ~300 characters: many chunks in flight, finished in any order, written in order."""
    jl = tmp_path / "c.jsonl"
    jl.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 3))
    monkeypatch.setattr(stream, "CHUNK_CHARS", 300)
    base = dict(source=str(jl), vocab_size=300, val_fraction=0.1)
    ref = prepare_data(DataConfig(**base, prepared_dir=str(tmp_path / "w1"), workers=1), progress=False)
    for w in (2, 3):
        p = prepare_data(DataConfig(**base, prepared_dir=str(tmp_path / f"w{w}"), workers=w), progress=w == 3)
        for name in ("train.bin", "val.bin", "tokenizer.json"):
            assert (p.dir / name).read_bytes() == (ref.dir / name).read_bytes(), (w, name)
        assert p.meta()["sha256"] == ref.meta()["sha256"]
    assert "B/s" in capfd.readouterr().err  # the progress bar shows bytes per second
    # the streamed prepare equals encoding the documents held in memory
    tok = load_tokenizer(ref.dir)
    train, val = split_documents(DOCS * 3, 0.1)
    enc = [np.concatenate(list(encode_documents(tok, part, eot_id(tok)))) for part in (train, val)]
    assert np.array_equal(np.fromfile(ref.train_path, ref.dtype), enc[0])
    assert np.array_equal(np.fromfile(ref.val_path, ref.dtype), enc[1])
    assert ref.meta()["n_train_docs"] == len(train) and ref.meta()["n_val_docs"] == len(val)


MEMORY_CHILD = """
import json, resource, shutil, sys
from loom.config import DataConfig
from loom.data import prepare, stream

def peak():  # peak resident set size of this process so far, bytes
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))

stream.CHUNK_CHARS = int(sys.argv[4])
prepare.SCAN_BYTES = 0  # loading would map the token file to check every id: not preparation memory
small, big, tok, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[5]
run = lambda src, d: prepare.prepare_data(DataConfig(source=src, tokenizer=tok, prepared_dir=d, workers=2,
                                                     max_corpus_mb=0), progress=False)
run(small, out + "/warm")  # imports, pool start-up, first allocations: the same for any corpus
main0, kids0 = peak(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
p = run(big, out + "/big")
print(json.dumps({"main": peak() - main0, "workers": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
                  - kids0, "tokens": p.n_train_tokens + p.n_val_tokens}))
"""


def _corpus(path, mb, seed=0):
    """Generated .jsonl of about ``mb`` MB: documents of 50-800 long words from a vocabulary of five
    (each one token of a tokenizer trained on it: fast to encode)."""
    import random

    words = ["interdependency", "loomweaverthread", "alphabetagamma", "transformerblock", "tokenization"]
    rng, n = random.Random(seed), 0
    with path.open("w") as f:
        while n < mb * 1e6:
            line = (
                json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(50, 800)))}) + "\n"
            )
            f.write(line)
            n += len(line)
    return path


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads peak RSS from /proc")
def test_prepare_memory_is_flat_in_corpus_size(tmp_path, cache):
    """A 21 MB corpus prepared with 2 workers against a 1 MiB memory cap (20x smaller): the peak RSS of
    the preparing process, and of its workers, rises by less than the cap over the peak of a warm-up
    prepare of a 0.2 MB corpus (chunks of 16K characters: at most (2*2+1)*16K characters of text held).
    Before streaming, a 30 MB corpus peaked at 2.1 GiB."""
    import subprocess
    import sys

    cap = 1 << 20
    small, big = (
        _corpus(tmp_path / "small.jsonl", 0.2, seed=1),
        _corpus(tmp_path / "big.jsonl", 20 * cap / 1e6),
    )
    tok = prepare_data(DataConfig(source=str(small), vocab_size=400), progress=False).tokenizer_path
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            MEMORY_CHILD,
            str(small),
            str(big),
            str(tok),
            str(16 * 1024),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["tokens"] > 20 * cap / 17  # the corpus was tokenized (one token per word and space)
    assert got["main"] < cap and got["workers"] < cap, got


def test_load_reports_missing_files(tmp_path, cache):
    p = prepare_data(DataConfig(source=str(write_txt_dir(tmp_path / "c")), vocab_size=300), progress=False)
    with pytest.raises(ValueError, match="holds no meta.json"):
        PreparedData.load(tmp_path)
    os.remove(p.val_path)
    with pytest.raises(ValueError, match="val.bin"):
        PreparedData.load(p.dir)
    assert token_dtype(65535) == np.uint16 and token_dtype(65536) == np.uint32


# ----------------------------------------------------------------------------- dataset and sampler


def test_a_word_longer_than_the_trainer_takes_whole_reaches_it_in_pieces():
    """The BPE trainer rescans a word per merge: one 400k-character word took over 200 s. A pre-token
    over MAX_TRAIN_WORD characters reaches it cut every MAX_TRAIN_WORD characters (the text joined back
    is the text), other texts pass as they are, and such a corpus trains in seconds."""
    import time

    from tokenizers import pre_tokenizers

    from loom.data.tokenizer import MAX_TRAIN_WORD, bounded_words

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = "hello world " + "x" * (2 * MAX_TRAIN_WORD + 500) + " then" + " " * (MAX_TRAIN_WORD + 7) + "end"
    parts = list(bounded_words([text, "short text"], pre))
    assert "".join(parts[:-1]) == text and parts[-1] == "short text" and len(parts) > 4
    assert max(b - a for part in parts for _, (a, b) in pre.pre_tokenize_str(part)) <= MAX_TRAIN_WORD
    start = time.perf_counter()
    train_tokenizer(DOCS + ["a" * 400_000, "Zm9v" * 100_000], 300)
    assert time.perf_counter() - start < 30


def test_token_dataset_windows(tmp_path):
    ds = TokenDataset(write_bin(tmp_path / "t.bin", 101), seq_len=10)
    assert len(ds) == ds.n_windows == 10
    w = ds.window(3)
    assert w.dtype == torch.int64 and w.tolist() == list(range(30, 41))
    assert ds.window(9).tolist() == list(range(90, 101))
    with pytest.raises(IndexError):
        ds.window(10)
    assert len(TokenDataset(write_bin(tmp_path / "u.bin", 100), seq_len=10)) == 9
    big = TokenDataset(write_bin(tmp_path / "b.bin", 70_001, np.uint32), seq_len=7, dtype=np.uint32)
    assert big.window(9999).tolist() == list(range(69_993, 70_001))
    with pytest.raises(ValueError, match="data.seq_len"):
        TokenDataset(write_bin(tmp_path / "s.bin", 10), seq_len=10)


def _global_rows(sampler: BatchSampler, step: int) -> torch.Tensor:
    return torch.cat([x for x, _ in sampler.micro_batches(step)])


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_rank_slices_concatenate_to_global_batch(tmp_path, dp):
    ds = TokenDataset(write_bin(tmp_path / "t.bin", 8 * 37 + 1), seq_len=8)  # 37 windows: epochs cross steps
    ref = BatchSampler(ds, global_batch=16, micro_batch=2, seed=7)
    ranks = [
        BatchSampler(ds, 16, micro_batch=16 // dp // 2, dp_rank=r, dp_size=dp, seed=7) for r in range(dp)
    ]
    for step in range(8):
        mbs = ranks[0].micro_batches(step)
        assert len(mbs) == 2
        for x, y in mbs:
            assert x.shape == y.shape == (16 // dp // 2, 8) and x.dtype == y.dtype == torch.int64
            assert torch.equal(x[:, 1:], y[:, :-1])
        got = torch.cat([_global_rows(s, step) for s in ranks])
        assert torch.equal(got, _global_rows(ref, step))


def test_sampler_resumes_at_any_step(tmp_path):
    ds = TokenDataset(write_bin(tmp_path / "t.bin", 4 * 50 + 1), seq_len=4)
    running = BatchSampler(ds, 12, 3, dp_rank=1, dp_size=2, seed=3)
    seen = [running.micro_batches(s) for s in range(12)]
    for k in (0, 4, 5, 11):
        fresh = BatchSampler(ds, 12, 3, dp_rank=1, dp_size=2, seed=3)
        for s in range(k, 12):
            for (x, y), (x2, y2) in zip(fresh.micro_batches(s), seen[s]):
                assert torch.equal(x, x2) and torch.equal(y, y2)


def test_epochs_cover_each_window_once(tmp_path):
    n, gb = 30, 8
    ds = TokenDataset(write_bin(tmp_path / "t.bin", 5 * n + 1), seq_len=5)
    s = BatchSampler(ds, gb, 4, seed=11)
    order = [i for step in range(3 * n // gb + 1) for i in s.indices(step)]
    for e in range(3):
        assert sorted(order[e * n : (e + 1) * n]) == list(range(n))
        assert order[e * n : (e + 1) * n] == epoch_permutation(n, 11, e).tolist()
    assert order[:n] != order[n : 2 * n]  # reshuffled every epoch
    assert BatchSampler(ds, gb, 4, seed=12).indices(0) != s.indices(0)
    x, _ = s.micro_batches(0)[0]
    assert x[0].tolist() == list(range(5 * order[0], 5 * order[0] + 5))


def test_sampler_validates_layout(tmp_path):
    ds = TokenDataset(write_bin(tmp_path / "t.bin", 101), seq_len=10)
    with pytest.raises(ValueError, match="train.global_batch"):
        BatchSampler(ds, 10, 4)
    with pytest.raises(ValueError, match="train.global_batch"):
        BatchSampler(ds, 12, 2, dp_rank=0, dp_size=4)
    with pytest.raises(ValueError, match="parallel.dp"):
        BatchSampler(ds, 8, 2, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="step"):
        BatchSampler(ds, 8, 2).micro_batches(-1)


def test_eval_batches_fixed_and_layout_independent(tmp_path):
    ds = TokenDataset(write_bin(tmp_path / "v.bin", 4 * 5 + 1), seq_len=4)  # 5 windows: wraps
    one = eval_batches(ds, n_batches=4, micro_batch=2)
    assert len(one) == 4
    starts = [x[:, 0].tolist() for x, _ in one]
    assert starts == [[0, 4], [8, 12], [16, 0], [4, 8]]
    again = eval_batches(ds, 4, 2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(one, again))
    for dp in (2, 4):
        parts = [eval_batches(ds, 4, 2, dp_rank=r, dp_size=dp) for r in range(dp)]
        assert {len(p) for p in parts} == {4 // dp}
        union = sorted(tuple(x[:, 0].tolist()) for p in parts for x, _ in p)
        assert union == sorted(tuple(s) for s in starts)
    three = [eval_batches(ds, 4, 2, dp_rank=r, dp_size=3) for r in range(3)]
    assert {len(p) for p in three} == {2}  # every rank runs the same count: the last 2 are pads
    trained = sorted(tuple(x[:, 0].tolist()) for p in three for x, y in p if (y != -100).any())
    assert trained == sorted(tuple(s) for s in starts)  # the pads train nothing: dp=1's set
    assert sum(bool((y == -100).all()) for p in three for _, y in p) == 2


def test_eval_loss_is_the_one_process_loss_on_any_dp():
    """The token mean weighs a pad (every target -100, its mean NaN) by zero: an eval over 3 ranks of
    4 batches is the mean of the 4."""
    from loom.parallel.base import token_mean

    losses = [torch.tensor(v) for v in (2.0, 4.0, 6.0, float("nan"))]
    targets = [torch.zeros(2, 3, dtype=torch.long)] * 3 + [torch.full((2, 3), -100)]
    assert float(token_mean(losses, targets, None)) == pytest.approx(4.0)


def test_prepared_data_feeds_sampler(tmp_path, cache):
    p = prepare_data(DataConfig(source=str(write_txt_dir(tmp_path / "c")), vocab_size=300), progress=False)
    ds = TokenDataset(p.train_path, seq_len=16)
    assert ds.n_tokens == p.n_train_tokens
    x, y = BatchSampler(ds, 4, 2, seed=0).micro_batches(0)[0]
    assert int(x.max()) < p.vocab_size and int(y.min()) >= 0


def test_binary_and_undecodable_input_is_named(tmp_path, caplog):
    import logging

    from loom.config import ConfigError

    binary = tmp_path / "bin" / "blob.txt"
    binary.parent.mkdir()
    binary.write_bytes(b"\x7fELF\x00\x00\x01" + bytes(range(256)))
    with pytest.raises(ConfigError, match=r"data.source: .*blob.txt looks binary \(NUL bytes\)"):
        read_documents(str(binary))
    latin = tmp_path / "latin" / "doc.txt"
    latin.parent.mkdir()
    latin.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    with pytest.raises(
        ConfigError,
        match=r"doc.txt is not UTF-8 \(byte 3: b'\\xe9'\); fix the file or set "
        r"data.errors = replace",
    ):
        read_documents(str(latin))
    with caplog.at_level(logging.WARNING, logger="loom"):
        assert read_documents(str(latin), errors="replace") == ["caf\ufffd cr\ufffdme"]
    assert any("2 undecodable bytes replaced in 1 file(s)" in r.message for r in caplog.records)
    jl = tmp_path / "j" / "d.jsonl"
    jl.parent.mkdir()
    jl.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(ConfigError, match=r"d.jsonl:2 is not UTF-8"):
        read_documents(str(jl))


# ----------------------------------------------------------------------------- verification on load


def _prepared(tmp_path, **kw):
    return prepare_data(
        DataConfig(source=str(write_txt_dir(tmp_path / "c")), vocab_size=300, **kw), progress=False
    )


def test_sample_spans_cover_small_files_and_spread_over_large_ones():
    assert prepare_mod.sample_spans(1000, blocks=4, block=512) == [(0, 1000)]
    spans = prepare_mod.sample_spans(10_000, blocks=4, block=512)
    assert len(spans) == 4 and spans[0] == (0, 512) and spans[-1] == (10_000 - 512, 512)
    assert all(b[0] > a[0] for a, b in zip(spans, spans[1:]))


def test_prepare_records_what_load_checks(tmp_path):
    p = _prepared(tmp_path)
    meta = p.meta()
    assert set(meta["sampled_sha256"]) == set(meta["max_id"]) == {"train.bin", "val.bin"}
    assert meta["sha256"]["tokenizer.json"] == hashlib.sha256(p.tokenizer_path.read_bytes()).hexdigest()
    ids = np.fromfile(p.train_path, dtype=np.uint16)
    assert meta["max_id"]["train.bin"] == int(ids.max()) < p.vocab_size
    assert prepare_mod.verify_full(p.dir).dir == p.dir


def test_load_checks_sampled_blocks_and_verify_checks_every_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_mod, "SAMPLE_BLOCKS", 2)
    monkeypatch.setattr(prepare_mod, "SAMPLE_BYTES", 64)  # spans: the first and the last 64 bytes
    p = _prepared(tmp_path)
    ids = np.memmap(p.train_path, dtype=np.uint16, mode="r+")
    middle = len(ids) // 2
    ids[middle] = (int(ids[middle]) + 1) % p.vocab_size  # still a valid id, outside the sampled blocks
    ids.flush()
    PreparedData.load(p.dir)  # the cheap check does not read it
    with pytest.raises(
        ValueError, match=rf"data.prepared_dir: {p.train_path} differs from the SHA-256 recorded"
    ):
        prepare_mod.verify_full(p.dir)
    ids[3] = (int(ids[3]) + 1) % p.vocab_size  # inside the first block
    ids.flush()
    with pytest.raises(ValueError, match=rf"{p.train_path} differs from the SHA-256 of 2 sampled blocks"):
        PreparedData.load(p.dir)


def test_out_of_vocabulary_ids_are_refused_on_load_and_on_read(tmp_path, monkeypatch):
    p = _prepared(tmp_path)
    ids = np.memmap(p.train_path, dtype=np.uint16, mode="r+")
    ids[77] = p.vocab_size + 5
    ids.flush()
    with pytest.raises(
        ValueError, match=rf"{p.train_path} holds token id {p.vocab_size + 5} at token 77, outside"
    ):
        PreparedData.load(p.dir)
    # a file too large to scan on load (pretend): its batches are checked as they are read
    monkeypatch.setattr(prepare_mod, "SCAN_BYTES", 0)
    meta = p.meta()
    del meta["sampled_sha256"], meta["max_id"]
    (p.dir / "meta.json").write_text(json.dumps(meta))
    PreparedData.load(p.dir)
    ds = TokenDataset(p.train_path, seq_len=16)
    assert ds.vocab_size == p.vocab_size
    ds.batch([0])  # tokens 0..16: fine
    with pytest.raises(ValueError, match=rf"{p.train_path} holds token id {p.vocab_size + 5} at token 77"):
        ds.batch([1, 4])  # window 4 covers tokens 64..80


def test_parquet_binary_text_is_decoded_and_bad_rows_named(tmp_path):
    from loom.config import ConfigError

    good = tmp_path / "b.parquet"
    pq.write_table(pa.table({"text": pa.array([b"caf\xc3\xa9", None, b"ok"], type=pa.binary())}), good)
    assert read_documents(str(good)) == ["café", "ok"]
    bad = tmp_path / "bad" / "b.parquet"
    bad.parent.mkdir()
    pq.write_table(pa.table({"text": pa.array([b"fine", b"\xff\xfe"], type=pa.binary())}), bad)
    with pytest.raises(ConfigError, match=r"b.parquet row 1 is not UTF-8"):
        read_documents(str(bad))
    torn = tmp_path / "torn" / "t.parquet"
    torn.parent.mkdir()
    pq.write_table(pa.table({"text": ["a" * 1000] * 50}), torn)
    torn.write_bytes(torn.read_bytes()[:200] + torn.read_bytes()[-300:])
    with pytest.raises(
        ConfigError,
        match=r"data.source: .*t.parquet (is not a readable parquet file|cannot be read "
        r"at row \d+)",
    ):
        read_documents(str(torn))


def test_disk_full_while_preparing_names_the_file(tmp_path, cache, monkeypatch):
    import errno

    from loom.config import ConfigError

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(
        ConfigError, match=r"^LOOM_CACHE_DIR \(the data cache; .*\): cannot write .*/train.bin: No space left"
    ) as e:
        _prepared(tmp_path)
    assert "\n" not in str(e.value)
    assert list((cache / "data").iterdir()) == []  # nothing half-written kept
    with pytest.raises(ConfigError, match=r"^data.prepared_dir: cannot write .*/train.bin: No space left"):
        _prepared(tmp_path, prepared_dir=str(tmp_path / "prepared"))


def test_a_cache_dir_that_is_a_file_names_loom_cache_dir(tmp_path, monkeypatch):
    """The directory came from LOOM_CACHE_DIR, not from data.prepared_dir: the line says so."""
    from loom.config import ConfigError

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "file"))
    with pytest.raises(ConfigError, match=r"^LOOM_CACHE_DIR \(the data cache; or set data.prepared_dir\): "):
        _prepared(tmp_path)


# ----------------------------------------------------------------------------- packing


def test_packed_positions_restart_after_each_document_end():
    from loom.data.dataset import packed_positions

    x = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 0, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9]])
    assert packed_positions(x, 0).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7, 8]]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_packed_batch_equals_each_document_alone(tmp_path, positions):
    """Three documents (with their end token) packed into one 16-token window, read through
    TokenDataset: each document's logits, loss and the gradients of the summed per-document losses
    equal those of the documents run alone (attention inside documents, positions restarting)."""
    from loom.model.llama import build_model, loss_fn
    from tests.helpers import tiny_model

    eot, lengths = 0, [5, 7, 4]
    g = torch.Generator().manual_seed(3)
    docs = [torch.cat([torch.randint(1, 128, (n - 1,), generator=g), torch.tensor([eot])]) for n in lengths]
    stream_ = torch.cat([*docs, torch.tensor([9])])  # + the last window's last target
    stream_.numpy().astype(np.uint16).tofile(tmp_path / "t.bin")
    x, y, pos = TokenDataset(tmp_path / "t.bin", seq_len=16, pack_eot=eot).batch([0])
    assert pos.tolist() == [[*range(5), *range(7), *range(4)]]
    model = build_model(tiny_model(positions=positions), seed=1)
    packed = model(x, pos)  # (1, 16, V)
    bounds = np.cumsum([0, *lengths]).tolist()
    packed_losses, alone_losses, alone_logits = [], [], []
    for s, e in zip(bounds, bounds[1:]):
        alone = model(x[:, s:e])
        alone_logits.append(alone)
        target = y[
            :, s : e - 1
        ]  # the document's own next tokens (the end token's target is the next document)
        packed_losses.append(loss_fn(packed[:, s : e - 1], target))
        alone_losses.append(loss_fn(alone[:, :-1], target))
    torch.testing.assert_close(packed, torch.cat(alone_logits, dim=1))
    torch.testing.assert_close(torch.stack(packed_losses), torch.stack(alone_losses))
    grads = []
    for losses in (packed_losses, alone_losses):
        model.zero_grad()
        torch.stack(losses).sum().backward(retain_graph=True)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=lambda m, n=name: f"{n}: {m}")
    # not vacuous: without positions the later documents see the earlier ones
    assert not torch.allclose(model(x)[:, 5:12], alone_logits[1], atol=1e-4)


PACK_BATCH, PACK_MICRO, PACK_STEPS = 8, 4, 3
PACKED_LAYOUTS = {"tp2": {"tp": 2}, "tp2 sp": {"tp": 2, "sp": True}, "pp2": {"pp": 2}}


@pytest.fixture(scope="module")
def packed_reference():
    from tests.helpers import tiny_model, tiny_train, train_dp

    ref = train_dp(None, tiny_model(), tiny_train(steps=PACK_STEPS), PACK_BATCH, PACK_MICRO, packed=True)
    plain = train_dp(None, tiny_model(), tiny_train(steps=PACK_STEPS), PACK_BATCH, PACK_MICRO)
    assert ref["losses"] != plain["losses"]  # the positions changed the computation
    return ref


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", list(PACKED_LAYOUTS))
def test_packed_training_equals_single_process(pools, packed_reference, name):
    """Packed batches (several documents per sequence, positions) trained 3 steps under tp2, tp2 with
    sequence parallelism and pp2: losses and final parameters equal one process's."""
    from tests.helpers import train_layout

    results = pools(2).run(
        train_layout, PACKED_LAYOUTS[name], PACK_STEPS, PACK_BATCH, PACK_MICRO, packed=True
    )
    _assert_equal_to_one_process(results, packed_reference)


def _assert_equal_to_one_process(results: list[dict], ref: dict) -> None:
    """Every rank's losses, and the final state of the ranks that return it, equal one process's."""
    for r in results:
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-5
        )
        if r["state"] is not None:
            for k, v in ref["state"].items():
                torch.testing.assert_close(
                    r["state"][k], v, rtol=1e-4, atol=5e-5, msg=lambda m, k=k: f"{k}: {m}"
                )


MASKED_LAYOUTS = {
    "dp2": {"dp_replicate": 2},
    "cp2": {"cp": 2},
    "pp2": {"pp": 2},
    "dp2 zero3": {"zero": 3, "dp_shard": 2},
}


@pytest.fixture(scope="module")
def masked_reference():
    """One process, the whole global batch one micro-batch, on chat-like targets (unequal numbers of
    trained targets per row, a row with none)."""
    from tests.helpers import tiny_model, tiny_train, train_dp

    return train_dp(None, tiny_model(), tiny_train(steps=PACK_STEPS), PACK_BATCH, PACK_BATCH, mask=True)


def test_masked_targets_are_one_mean_over_the_global_batch_whatever_the_micro_batch(masked_reference):
    """The loss is the mean over every trained target of the global batch (transformers' Trainer and
    Megatron's per-token loss normalise so): accumulating 8 micro-batches of one row, some with no
    trained target, equals one batch of 8 (a mean of micro-batch means weighted the short rows up)."""
    from tests.helpers import global_batch, masked, tiny_model, tiny_train, train_dp

    ref = masked_reference
    y = masked(global_batch(0, PACK_BATCH)[1], 0)
    counts = (y != -100).sum(1)
    assert counts.min() == 0 and len(set(counts.tolist())) > 3  # not vacuous: unequal rows
    for micro in (1, 2):
        got = train_dp(None, tiny_model(), tiny_train(steps=PACK_STEPS), PACK_BATCH, micro, mask=True)
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6
        )
        for k, v in ref["state"].items():
            torch.testing.assert_close(
                got["state"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}"
            )


def test_held_out_loss_of_masked_targets_weighs_each_trained_target_alike():
    """Evaluation on chat-like targets: batches of 1 row give the loss of the whole set as one batch."""
    from loom.model.llama import build_model, loss_fn
    from loom.train.step import evaluate
    from tests.helpers import global_batch, masked, tiny_model

    model = build_model(tiny_model(), 0)
    x, y = global_batch(0, PACK_BATCH)
    y = masked(y, 3)
    whole = evaluate(model, [(x, y)], loss_fn, None)
    rows = evaluate(model, [(x[i : i + 1], y[i : i + 1]) for i in range(PACK_BATCH)], loss_fn, None)
    assert rows == pytest.approx(whole, rel=1e-6)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
    assert whole == pytest.approx(float(want), rel=1e-5)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", list(MASKED_LAYOUTS))
def test_masked_targets_train_equal_to_single_process(pools, masked_reference, name):
    """Chat-like targets under dp2, cp2 (the ranks hold different halves of each row), pp2 and ZeRO-3:
    losses and final parameters equal one process's (each rank's mean weighted by its share of the
    global batch's trained targets, one all-reduce of the count per step)."""
    from tests.helpers import train_layout

    results = pools(2).run(train_layout, MASKED_LAYOUTS[name], PACK_STEPS, PACK_BATCH, PACK_MICRO, mask=True)
    _assert_equal_to_one_process(results, masked_reference)


# ----------------------------------------------------------------------------- chat and instruction data

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _chats(n: int = 8, long_every: int = 0) -> list[dict]:
    out = []
    for i in range(n):
        reply = f"answer {i}: " + ("la " * 200 if long_every and i % long_every == 1 else f"x = {i * 7}")
        out.append(
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": f"q{i}?"},
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": "thanks"},
                    {"role": "assistant", "content": f"ok {i}"},
                ]
            }
        )
    return out


def _chat_tokenizer(tmp_path):
    """A tokenizer directory with ChatML special tokens and template (as an HF checkpoint ships)."""
    d = tmp_path / "tok"
    d.mkdir()
    tok = train_tokenizer([json.dumps(c) for c in _chats()] + DOCS, vocab_size=400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return d


def _trained_text(p: PreparedData, split: str = "train") -> str:
    tok = load_tokenizer(p.dir)
    ids = np.fromfile(p.dir / f"{split}.bin", dtype=p.dtype)
    mask = np.fromfile(p.dir / f"{split}.mask.bin", dtype=np.uint8)
    return tok.decode(ids[mask == 1].tolist(), skip_special_tokens=False)


def test_chat_labels_only_assistant_turns(tmp_path, cache):
    chats = _chats()
    jl = tmp_path / "chat.jsonl"
    jl.write_text("".join(json.dumps(c) + "\n" for c in chats))
    tok_dir = _chat_tokenizer(tmp_path)
    cfg = DataConfig(source=str(jl), tokenizer=str(tok_dir), format="chat", seq_len=64, val_fraction=0.25)
    p = prepare_data(cfg, progress=False)
    meta = p.meta()
    assert (meta["n_train_docs"], meta["n_val_docs"]) == (6, 2)
    # rendered with the template; trained: each assistant message's content and its <|im_end|>\n, then EOT
    tok = load_tokenizer(p.dir)
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in chats[0]["messages"])
    assert tok.decode(np.fromfile(p.train_path, p.dtype).tolist(), skip_special_tokens=False).startswith(
        rendered + EOT
    )
    expected = "".join(
        "".join(f"{m['content']}<|im_end|>\n" for m in c["messages"] if m["role"] == "assistant") + EOT
        for c in chats[:6]
    )
    assert _trained_text(p) == expected
    assert meta["trained_tokens"]["train"] == int(np.fromfile(p.dir / "train.mask.bin", np.uint8).sum())
    # batches: targets are -100 wherever the target token is not trained on
    ds = TokenDataset(p.train_path, seq_len=16)
    x, y = ds.batch([0, 1])
    raw = torch.from_numpy(np.fromfile(p.train_path, p.dtype).astype(np.int64))
    mask = torch.from_numpy(np.fromfile(p.dir / "train.mask.bin", np.uint8))
    for row, i in enumerate([0, 1]):
        t = slice(i * 16 + 1, i * 16 + 17)
        assert torch.equal(y[row], raw[t].masked_fill(mask[t] == 0, -100))
    assert (y == -100).any() and (y != -100).any()
    # train_on_prompt: every token
    every = prepare_data(DataConfig(**{**asdict_(cfg), "train_on_prompt": True}), progress=False)
    assert np.fromfile(every.dir / "train.mask.bin", np.uint8).all()


def test_sharegpt_records_prepare_as_their_messages(tmp_path, cache):
    """ShareGPT's ``conversations`` of from/value (human, gpt, system; a top-level system string) prepare
    to the tokens and trained mask of the same chats as ``messages``; an unknown speaker and a per-turn
    weight (which Loom would not honour) are refused naming the line."""
    from loom.config import ConfigError

    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    chats = _chats()
    share = []
    for i, c in enumerate(chats):
        turns = [{"from": speaker[m["role"]], "value": m["content"]} for m in c["messages"]]
        share.append(
            {"system": turns[0]["value"], "conversations": turns[1:]} if i % 2 else {"conversations": turns}
        )
    tok_dir = _chat_tokenizer(tmp_path)
    prepared = []
    for name, records in (("messages", chats), ("sharegpt", share)):
        jl = tmp_path / f"{name}.jsonl"
        jl.write_text("".join(json.dumps(r) + "\n" for r in records))
        cfg = DataConfig(source=str(jl), tokenizer=str(tok_dir), format="chat", seq_len=64, val_fraction=0.25)
        prepared.append(prepare_data(cfg, progress=False))
    for f in ("train.bin", "train.mask.bin", "val.bin", "val.mask.bin"):
        assert (prepared[0].dir / f).read_bytes() == (prepared[1].dir / f).read_bytes(), f
    for turn, says in (
        ({"from": "wizard", "value": "hi"}, "ShareGPT turn from 'wizard' (allowed: system, human"),
        ({"from": "gpt", "value": "hi", "weight": 0}, "a 'weight', which Loom does not read"),
        ({"speaker": "gpt", "text": "hi"}, "ShareGPT turn that is not an object of from/value"),
    ):
        jl = tmp_path / "bad.jsonl"
        jl.write_text(json.dumps(share[0]) + "\n" + json.dumps({"conversations": [turn]}) + "\n")
        with pytest.raises(ConfigError) as e:
            prepare_data(DataConfig(source=str(jl), tokenizer=str(tok_dir), format="chat"), progress=False)
        assert f"{jl}:2" in str(e.value) and says in str(e.value) and "\n" not in str(e.value)


def test_chat_records_from_parquet_and_datasets_files_prepare_as_from_jsonl(tmp_path, cache):
    """Chat records as `datasets` writes them (to_parquet, save_to_disk, a loose .arrow file) prepare to
    the bytes of the same records in JSON Lines (save_to_disk was refused for chat data)."""
    import shutil

    import datasets

    chats = _chats()
    tok_dir = _chat_tokenizer(tmp_path)
    jl = tmp_path / "chat.jsonl"
    jl.write_text("".join(json.dumps(c) + "\n" for c in chats))
    ds = datasets.Dataset.from_list(chats)
    ds.to_parquet(str(tmp_path / "chat.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    shutil.copy(arrow, tmp_path / "loose.arrow")
    dirs = []
    for src in (jl, tmp_path / "chat.parquet", tmp_path / "saved", tmp_path / "loose.arrow"):
        cfg = DataConfig(
            source=str(src), tokenizer=str(tok_dir), format="chat", seq_len=64, val_fraction=0.25
        )
        dirs.append(prepare_data(cfg, progress=False).dir)
    for f in ("train.bin", "train.mask.bin", "val.bin", "val.mask.bin"):
        assert len({(d / f).read_bytes() for d in dirs}) == 1, f


def test_chat_reads_whole_records_up_to_max_corpus_mb(tmp_path, cache, caplog):
    """data.max_corpus_mb caps chat records as it caps text (it was ignored): whole records, up to the
    one whose rendered text reaches the cap, said in one line and kept in meta.json."""
    jl = tmp_path / "chat.jsonl"
    jl.write_text("".join(json.dumps(c) + "\n" for c in _chats(12)))
    tok_dir = _chat_tokenizer(tmp_path)
    render = template_render(str(tok_dir))
    sizes = [len(segments(c, "", "chat", render)[0].encode()) for c in _chats(12)]
    cap = (sum(sizes[:5]) - 1) / 1e6  # reached inside the fifth record
    cfg = DataConfig(source=str(jl), tokenizer=str(tok_dir), format="chat", seq_len=64, max_corpus_mb=cap)
    with caplog.at_level("INFO", logger="loom"):
        p = prepare_data(cfg, progress=False)
    meta = p.meta()
    assert meta["n_train_docs"] + meta["n_val_docs"] == 5
    assert meta["corpus_cut"]["stopped"] == f"after {jl}:5"
    assert meta["corpus_cut"]["at_least_mb"] * 1e6 == pytest.approx(sum(sizes[:6]))
    (line,) = _notes(caplog, "data.max_corpus_mb")
    assert f"stopped after {jl}:5" in line and "\n" not in line
    whole = prepare_data(DataConfig(**{**asdict_(cfg), "max_corpus_mb": sum(sizes) / 1e6}), progress=False)
    assert whole.meta()["n_train_docs"] + whole.meta()["n_val_docs"] == 12 and not whole.meta()["corpus_cut"]


def test_an_edited_chat_template_prepares_anew(tmp_path, cache):
    """The template renders the examples: editing it after a preparation reused the stale tokens."""
    jl = tmp_path / "chat.jsonl"
    jl.write_text("".join(json.dumps(c) + "\n" for c in _chats(4)))
    tok_dir = _chat_tokenizer(tmp_path)
    cfg = DataConfig(source=str(jl), tokenizer=str(tok_dir), format="chat", seq_len=64, val_fraction=0.25)
    first = prepare_data(cfg, progress=False)
    config = tok_dir / "tokenizer_config.json"
    edited = json.loads(config.read_text()) | {
        "chat_template": CHATML.replace("\n{{ m['content'] }}", ": {{ m['content'] }}")
    }
    config.write_text(json.dumps(edited))
    second = prepare_data(cfg, progress=False)
    assert second.dir != first.dir
    assert "<|im_start|>system: be brief" in load_tokenizer(second.dir).decode(
        np.fromfile(second.train_path, second.dtype).tolist(), skip_special_tokens=False
    )


def asdict_(cfg: DataConfig) -> dict:
    from dataclasses import asdict

    return asdict(cfg)


def test_prompt_completion_builtin_and_overlong(tmp_path, cache, caplog):
    recs = [{"prompt": f"Q{i}: add {i} and 1\nA:", "completion": f" {i + 1}"} for i in range(9)]
    recs[2]["completion"] = " " + "very long " * 80
    jl = tmp_path / "pc.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    base = dict(source=str(jl), format="prompt_completion", vocab_size=300, seq_len=32, val_fraction=0.2)
    with caplog.at_level("INFO", logger="loom"):
        cut = prepare_data(DataConfig(**base), progress=False)
    assert cut.meta()["overlong"] == {"mode": "truncate", "truncated": 1, "dropped": 0}
    assert "1 truncated, 0 dropped" in caplog.text
    kept = [r for i, r in enumerate(recs[:7]) if i != 2]
    dropped = prepare_data(DataConfig(**base, overlong="drop"), progress=False)
    assert dropped.meta()["overlong"] == {"mode": "drop", "truncated": 0, "dropped": 1}
    assert dropped.meta()["n_train_docs"] == 6
    assert _trained_text(dropped) == "".join(r["completion"] + EOT for r in kept)
    mask = np.fromfile(cut.dir / "train.mask.bin", np.uint8)
    assert len(mask) == cut.n_train_tokens and cut.n_train_tokens <= 7 * 33


def test_chat_and_instruction_records_refused_naming_the_line(tmp_path, cache):
    from loom.config import ConfigError

    def refused(records, fmt, *words):
        jl = tmp_path / f"bad{len(list(tmp_path.iterdir()))}.jsonl"
        jl.write_text("".join(json.dumps(r) + "\n" for r in records))
        with pytest.raises(ConfigError) as e:
            prepare_data(DataConfig(source=str(jl), format=fmt, vocab_size=300), progress=False)
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in (f"{jl}:", *words)), str(e.value)
        assert not (cache / "data").exists() or not list(
            (cache / "data").iterdir()
        )  # nothing half-written kept

    good = _chats(2)
    refused([*good, {"messages": [{"role": "user", "content": "hi"}]}], "chat", ":3", "no assistant turn")
    refused(
        [*good, {"messages": [{"role": "wizard", "content": "hi"}]}], "chat", ":3", "unknown role 'wizard'"
    )
    refused([{"messages": "hello"}, *good], "chat", ":1", "'messages'")
    refused([{"prompt": "p"}, {"prompt": "a", "completion": "b"}], "prompt_completion", ":1", "'completion'")
    with pytest.raises(ValueError, match="data.format: chat needs a data.source"):
        from loom import config as C

        cfg = C.LoomConfig()
        cfg.data.format = "chat"
        C.validate(cfg, 1)


# ----------------------------------------------------------------------------- mixtures


def test_mixture_sources_cached_and_sampled_by_weight(tmp_path, cache, caplog):
    """[[data.sources]]: a .jsonl.gz and a `datasets` save_to_disk directory (another text field), weights
    3:1. Each source is prepared once into its own cache directory with one tokenizer; batches are a pure
    function of (seed, step), split over dp ranks like BatchSampler's, and the realized mixture is the weights'."""
    import gzip

    import datasets

    from loom import config as C
    from loom.config import SourceConfig
    from loom.data import MixtureSampler, prepare_sources

    gz = tmp_path / "a.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in DOCS)
    other = [f"second source {i}: " + "lorem ipsum " * (i % 5 + 1) for i in range(30)]
    datasets.Dataset.from_dict({"body": other}).save_to_disk(str(tmp_path / "saved"))
    assert read_documents(str(tmp_path / "saved"), text_field="body") == other  # read through `datasets`
    assert read_documents(str(gz)) == DOCS

    toml = f'[data]\nvocab_size = 300\n[[data.sources]]\npath = "{gz}"\nweight = 3\n[[data.sources]]\npath = "{tmp_path / "saved"}"\nweight = 1\ntext_field = "body"\n'
    (tmp_path / "mix.toml").write_text(toml)
    cfg = C.load(str(tmp_path / "mix.toml"), [])
    assert cfg.data.sources == [
        SourceConfig(str(gz), 3.0),
        SourceConfig(str(tmp_path / "saved"), 1.0, "body"),
    ]
    assert (
        C.from_dict(C.tomllib.loads(C.dump_toml(cfg))).data.sources == cfg.data.sources
    )  # config.toml round trip
    with caplog.at_level("INFO", logger="loom"):
        prepared = prepare_sources(cfg.data, progress=False)
    assert "data source 1" in caplog.text and "25.0% of sequences" in caplog.text
    assert len({p.dir for p in prepared}) == 2
    assert prepared[0].tokenizer_path.read_bytes() == prepared[1].tokenizer_path.read_bytes()
    tok = load_tokenizer(prepared[1].dir)
    assert tok.decode(
        np.fromfile(prepared[1].train_path, prepared[1].dtype).tolist(), skip_special_tokens=False
    ).startswith(other[0] + EOT)
    stamps = [(p.dir / "meta.json").stat().st_mtime_ns for p in prepared]
    assert prepare_sources(cfg.data, progress=False) == prepared  # cached: loaded, not prepared again
    assert [(p.dir / "meta.json").stat().st_mtime_ns for p in prepared] == stamps

    sets = [TokenDataset(p.train_path, seq_len=16) for p in prepared]
    one = MixtureSampler(sets, [3, 1], global_batch=8, micro_batch=4, seed=5)
    shares = one.realized(50)
    assert abs(shares[0] - 0.75) < 0.01 and abs(shares[1] - 0.25) < 0.01
    for step in (0, 7):
        picks = one.picks(step)
        x = torch.cat([b[0] for b in one.micro_batches(step)])
        for row, (k, w) in enumerate(picks):
            assert torch.equal(x[row], sets[k].window(w)[:-1])
        halves = [MixtureSampler(sets, [3, 1], 8, 2, r, 2, seed=5).micro_batches(step) for r in (0, 1)]
        assert torch.equal(torch.cat([b[0] for h in halves for b in h]), x)  # dp ranks concatenate to it
        assert torch.equal(
            torch.cat([b[0] for b in one.micro_batches(step)]), x
        )  # a pure function of the step
    assert {k for s in range(4) for k, _ in one.picks(s)} == {0, 1}
    with pytest.raises(ValueError, match="data.sources"):
        MixtureSampler(sets, [1, 0], 8, 4)

    # a chat source beside a text one: its rows carry -100 outside the assistant turns, the text rows none
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(c) + "\n" for c in _chats(12)))
    mixed = C.from_dict(
        {
            "data": {
                "vocab_size": 300,
                "seq_len": 64,
                "sources": [{"path": str(gz)}, {"path": str(chat), "format": "chat", "weight": 1}],
            }
        }
    )
    C.validate(mixed, 1)
    both = prepare_sources(mixed.data, progress=False)
    assert both[0].tokenizer_path.read_bytes() == prepared[0].tokenizer_path.read_bytes()
    assert (both[1].dir / "train.mask.bin").is_file()
    both_sets = [TokenDataset(p.train_path, seq_len=16) for p in both]
    sampler = MixtureSampler(both_sets, [1, 1], 8, 8, seed=1)
    (x, y), picks = sampler.micro_batches(0)[0], sampler.picks(0)
    for row, (k, w) in enumerate(picks):  # each row's labels are its source's, masked or not
        assert torch.equal(y[row], both_sets[k].batch([w])[1][0])
        assert not (k == 0 and bool((y[row] == -100).any()))
    assert any(bool((y[row] == -100).any()) for row, (k, _) in enumerate(picks) if k == 1)
    bad = C.from_dict({"data": {"sources": [{"path": str(gz), "weight": -1}]}})
    with pytest.raises(ValueError, match=r"data.sources\[0\].weight: must be a positive number, got -1.0"):
        C.validate(bad, 1)


def test_a_micro_batch_with_no_trained_token_has_loss_zero_not_nan():
    """Chat data can leave a micro-batch without one trained target: its loss (plain and
    vocabulary-parallel) is 0 with zero gradients, and otherwise equals the mean cross entropy."""
    import torch.nn.functional as F

    from loom.model.llama import loss_fn
    from loom.parallel.tensor.parallelize import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 8, 50, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (2, 8), generator=g)
    targets[0, :3] = -100
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1), ignore_index=-100)
    torch.testing.assert_close(loss_fn(logits, targets), expected)  # chunked: the sum, then / count
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, targets, None), expected)
    none = torch.full_like(targets, -100)
    for fn in (loss_fn, lambda z, t: vocab_parallel_cross_entropy(z, t, None)):
        loss = fn(logits, none)
        (grad,) = torch.autograd.grad(loss, logits)
        assert loss.item() == 0.0 and not grad.any()


def test_a_held_out_split_too_small_for_one_window_matters_only_with_eval(tmp_path, cache):
    """With train.eval_every = 0 no held-out loss is taken, so a validation split shorter than one
    window was refused for nothing; with evaluation the refusal names data.val_fraction."""
    from loom import config as C
    from loom.cli import _check_data

    d = tmp_path / "c"
    d.mkdir()
    for i in range(40):
        (d / f"{i:02d}.txt").write_text(f"document number {i} " * 30 + ("end" if i == 39 else ""))
    (d / "zz.txt").write_text("tiny")  # the last document: the held-out split
    # its own run.dir: the checkout's runs/default (the README's first command trains it) holds a run
    # of other data, which _check_data rightly refuses to resume on this one
    argv = ["--data.source", str(d), "--data.vocab_size", "300", "--data.seq_len", "64"]
    cfg = C.load(None, [*argv, "--run.dir", str(tmp_path / "run")])
    cfg.train.eval_every = 0
    _check_data(cfg)
    cfg.train.eval_every = 10
    cfg.data.prepared_dir = ""
    with pytest.raises(
        C.ConfigError, match=r"data.seq_len: .*val.bin has \d+ tokens.*raise data.val_fraction"
    ):
        _check_data(cfg)


def test_prepare_refuses_what_train_refuses_a_prepared_dir_beside_sources(tmp_path, capsys):
    """``loom prepare MIX.toml --data.prepared_dir D`` prepared each source into the cache and ignored D
    without a word (``loom train`` refuses it): prepare checks explicit settings as train does."""
    from loom.cli import main

    mix = tmp_path / "mix.toml"
    mix.write_text(f'[data]\nvocab_size = 300\n[[data.sources]]\npath = "{tmp_path}"\n')
    assert main(["prepare", str(mix), "--data.prepared_dir", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "loom: error: data.prepared_dir: has no effect with [[data.sources]]"
    )
    assert not (tmp_path / "p").exists()


def test_a_token_file_truncated_under_the_run_is_one_line_not_sigbus(tmp_path):
    """train.bin truncated in place while it is mapped: the next batch is a one-line error naming it
    (reading past the new end killed a one-rank run with SIGBUS and no line); a file deleted or
    replaced by another leaves the mapping its old data, and training goes on."""
    import os

    import numpy as np

    from loom.config import ConfigError
    from loom.data.dataset import TokenDataset

    path = tmp_path / "train.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    ds = TokenDataset(path, seq_len=8, dtype="uint16", vocab_size=1000)
    before = ds.batch([0, 100])
    path.unlink()  # the mapping keeps its inode
    assert torch.equal(ds.batch([0, 100])[0], before[0])
    np.arange(1000, dtype=np.uint16).tofile(path)  # a new file at the path: not what is mapped
    assert torch.equal(ds.batch([0, 100])[0], before[0])
    mapped = TokenDataset(path, seq_len=8, dtype="uint16", vocab_size=1000)
    os.truncate(path, 1000)
    with pytest.raises(
        ConfigError, match=rf"^data\.prepared_dir: {re.escape(str(path))} shrank to 1000 bytes"
    ):
        mapped.batch([100])
