"""Bounded memory for any document size (issue 35, item 1): a long document is read in blocks,
trained on and encoded in pieces cut where the tokens are those of the whole document, and
``loom prepare``'s peak memory does not grow with the document."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from loom.config import ConfigError, DataConfig, LoomConfig, validate
from loom.data.corpus import _read_txt, iter_documents, stdlib_files
from loom.data.prepare import prepare_data
from loom.data.stream import TokenWriter, encode_stream, split_plan, split_stream
from loom.data.tokenizer import (
    encode_cut_check,
    eot_id,
    recut,
    train_pieces,
    train_tokenizer,
)

# Llama-3's pre-tokenizer pattern: punctuation takes the line breaks after it, a letter the one
# character before it, so cutting where a whitespace run starts is not always exact for it.
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ATOMS = [
    "word", "Zz", "9", "1234", " ", "  ", "\n", "\n\n", "\t", " \n ", ".", "'s", "'", "é", "日本語",
    "🙂", "\u00a0", "\u2028", "\u3000", "\x1c", "_", "(", "\r\n", "\u0301", "    ", "x.\n", "def f(x):\n    return x\n",
]  # fmt: skip


def stress_docs(n_chars: int, seed: int = 0) -> list[str]:
    """Documents that stress cut points: a long line, no line breaks, no whitespace at all (letters,
    digits and punctuation), Unicode, whitespace runs, and everything mixed."""
    rng = random.Random(seed)

    def doc(atoms: list[str]) -> str:
        out, n = [], 0
        while n < n_chars:
            out.append(rng.choice(atoms))
            n += len(out[-1])
        return "".join(out)

    runs = [" " * k for k in (1, 2, 3, 7, 40)] + ["\n" * k for k in (1, 2, 5)] + ["\t\t", "a", "b."]
    return [
        doc(["word ", "x=1; ", "🙂 ", "naïve "]),  # one long line
        doc([a for a in ATOMS if "\n" not in a and "\r" not in a and "\u2028" not in a]),  # no breaks
        doc(["abc", "日本", "é", ".", ",", "9", "(", "_", "\u0301"]),  # no whitespace at all
        doc(["日本語", "\u3000", "🙂", "\u00a0", "\u2028", "é", "\u0301"]),  # Unicode
        doc(runs),  # whitespace runs
        doc(ATOMS),  # everything
    ]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_tokenizer([p.read_text(errors="replace") for p in stdlib_files()[:60]], 1000)


def _pieces_of(doc: str, rng: random.Random) -> list[tuple[str, str, bool]]:
    """``doc`` as raw pieces cut anywhere (as the .txt reader's blocks are)."""
    cuts = sorted(rng.sample(range(1, len(doc)), 8))
    return [("train", doc[a:b], False) for a, b in zip([0, *cuts], cuts)] + [("train", doc[cuts[-1] :], True)]


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def test_pieces_encode_to_the_whole_documents_tokens(tmp_path, tok):
    """encode_stream of raw pieces cut anywhere (re-cut into pieces of ~300 characters) writes exactly
    the ids of encoding each whole document, then EOT; the pieces really are short."""
    docs = stress_docs(6000)
    rng = random.Random(1)
    items = [item for d in docs for item in _pieces_of(d, rng)]
    pieces = list(recut(items, encode_cut_check(tok), max_chars=300))
    assert "".join(t for _, t, _ in pieces) == "".join(docs)
    assert sum(end for *_, end in pieces) == len(docs)
    assert len(pieces) > 6 * 6000 / (300 + 256)  # cut, not held whole
    assert max(len(t) for _, t, _ in pieces) <= 300 + 256
    eot = eot_id(tok)
    writer = TokenWriter(tmp_path / "train.bin")
    encode_stream(tok, items, {"train": writer}, eot, np.dtype(np.uint16), workers=1, piece_chars=300)
    writer.close()
    got = np.fromfile(tmp_path / "train.bin", dtype=np.uint16).tolist()
    assert got == [i for d in docs for i in [*_ids(tok, d), eot]]
    assert writer.n_docs == len(docs)


def test_cut_points_are_exact_for_byte_level_bpe_and_checked_for_other_pre_tokenizers(tok):
    """For the GPT-2 pattern (Loom's own tokenizer) every candidate cut is exact even unchecked; for
    Llama-3's pattern unchecked candidates change the tokens and the encoding check keeps them exact."""
    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    other.train_from_iterator(
        [p.read_text(errors="replace") for p in stdlib_files()[:30]],
        trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    docs = stress_docs(3000, seed=2)

    def differing(t: Tokenizer, check) -> int:
        rng = random.Random(3)
        n = 0
        for d in docs:
            pieces = [p for _, p, _ in recut(_pieces_of(d, rng), check, max_chars=80, context=64)]
            n += [i for p in pieces for i in _ids(t, p)] != _ids(t, d)
        return n

    def unchecked(text: str, i: int) -> bool:
        return True

    assert differing(tok, unchecked) == 0
    assert differing(other, unchecked) > 0
    assert differing(other, encode_cut_check(other, context=64)) == 0


def test_training_on_pieces_learns_the_whole_documents_tokenizer():
    """Word counts of pieces equal those of whole documents: the same merges, the same JSON."""
    text = "".join(p.read_text(errors="replace") for p in stdlib_files()[60:90])
    docs = [text, *stress_docs(4000, seed=4)]
    rng = random.Random(5)
    raw = [(t, end) for d in docs for _, t, end in _pieces_of(d, rng)]
    whole = train_tokenizer(docs, 700)
    pieces = train_pieces(raw, 700, piece_chars=2000)
    assert pieces.to_str() == whole.to_str()


def test_txt_is_read_in_blocks_and_split_at_the_separator(tmp_path):
    """_read_txt with blocks of 1-7 bytes (characters and separators split across blocks) gives the
    documents of ``text.split(separator)``; an invalid byte is named at its offset in the file."""
    rng = random.Random(6)
    f = tmp_path / "a.txt"
    for sep in ("", "\n\n", "é|"):
        for _ in range(40):
            text = "".join(
                rng.choice(["a", "\n", "\n\n", "é", "|", "日本", " "]) for _ in range(rng.randrange(60))
            )
            f.write_bytes(text.encode())
            docs, parts = [], []
            for t, end in _read_txt(f, "strict", None, sep, block=rng.randint(1, 7)):
                parts.append(t)
                if end:
                    docs.append("".join(parts))
                    parts = []
            assert docs == (text.split(sep) if sep else [text])
            assert list(iter_documents(str(f), separator=sep)) == [d for d in docs if d]
    f.write_bytes(b"ok " * 5 + b"caf\xe9")
    with pytest.raises(ConfigError, match=r"a.txt is not UTF-8 \(byte 18: b'\\xe9'\)"):
        list(_read_txt(f, "strict", None, block=4))


def test_split_plan_cuts_a_document_given_in_pieces_as_when_whole():
    doc = "".join(f"line {i}\n" for i in range(500))
    plan = split_plan([len(doc)], 0.1)
    whole = [(s, t) for s, t, _ in split_stream([(doc, True)], plan)]
    rng = random.Random(7)
    pieced = list(split_stream([(t, end) for _, t, end in _pieces_of(doc, rng)], plan))
    joined = {s: "".join(t for s2, t, _ in pieced if s2 == s) for s in ("train", "val")}
    assert joined == dict(whole)  # the cut fell on the piece holding it: the same line break
    assert [(s, end) for s, _, end in pieced if end] == [("train", True), ("val", True)]


def test_doc_separator_makes_documents(tmp_path, caplog):
    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(f"document {i}\nwith two lines" for i in range(30)))
    cfg = DataConfig(source=str(src), vocab_size=300, prepared_dir=str(tmp_path / "p"), doc_separator="\n\n")
    data = prepare_data(cfg, progress=False)
    meta = json.loads((data.dir / "meta.json").read_text())
    assert meta["n_train_docs"] + meta["n_val_docs"] == 30
    assert meta["key"]["doc_separator"] == "\n\n"
    literal = DataConfig(
        source=str(src), vocab_size=300, prepared_dir=str(tmp_path / "q"), doc_separator="\\n\\n"
    )
    with caplog.at_level("WARNING", logger="loom"):
        prepare_data(literal, progress=False)  # a shell's '\n\n' is four characters: no document split
    assert any("data.doc_separator '\\\\n\\\\n' split no file" in r.message for r in caplog.records)
    cfg = LoomConfig()
    cfg.data.doc_separator, cfg.data.format = "\n\n", "chat"
    with pytest.raises(ConfigError, match=r"^data.doc_separator: splits .txt files of data.format = text"):
        validate(cfg, 1)


MEMORY_PROBE = textwrap.dedent(
    """
    import resource, sys
    from pathlib import Path
    from loom.config import DataConfig
    from loom.data.corpus import stdlib_files
    from loom.data.prepare import prepare_data

    out = Path(sys.argv[1])
    text = "".join(p.read_text(errors="replace") for p in stdlib_files()[:400])[:500_000]
    peaks = []
    for copies in (1, 12):  # the same words (the trainer's table), a 12x longer document
        (out / f"{copies}.txt").write_text(text * copies)
        cfg = DataConfig(source=str(out / f"{copies}.txt"), vocab_size=300, max_corpus_mb=0, workers=1,
                         prepared_dir=str(out / f"p{copies}"))
        prepare_data(cfg, progress=False)
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(peaks[0], peaks[1])
    """
)


def test_peak_memory_does_not_grow_with_the_document(tmp_path):
    """One process prepares a 0.5 MB single-document .txt file, then one of the same text 12 times
    (6 MB), under a 4 GiB address-space limit: the peak RSS grows by < 64 MiB, under 12 bytes per
    byte of document (before: ~200 bytes per byte, ~1.1 GB; beyond ~6 MB it stays flat: 30 MB and
    120 MB peak within 21 MiB of each other)."""
    script = "import resource; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n" + MEMORY_PROBE
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    small, big = map(float, out.stdout.split())
    assert big - small < 64, (small, big)
