"""``data.bos``: a tokenizer whose post-processor puts a start token before a sequence (Llama 3's
``<|begin_of_text|>``, Gemma's ``<bos>``: what ``transformers``' ``tokenizer(text)`` starts with) gets
it before every document it prepares and every chat / prompt-completion example (never trained,
never twice where a chat template writes it), whatever the worker count and however a long document
is cut into pieces; ``data.bos = none`` and tokenizers without one (GPT-2's, Qwen's, Loom's own) write
documents as before."""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers
from tokenizers import processors

from loom.config import DataConfig
from loom.data import load_tokenizer, prepare_data, stream
from loom.data.tokenizer import start_ids, train_tokenizer

DOCS = [f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 3) for i in range(30)]
LONG = "alpha beta gamma delta\n" * 9000  # ~200k characters: cut into pieces of ~64k


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))


def _tokenizers(tmp_path):
    """(Loom's own tokenizer file, the same with Gemma's ``<bos> $A`` post-processor), and <bos>'s id."""
    tok = train_tokenizer(DOCS + [LONG[:2000]], 300)
    plain = tmp_path / "plain.json"
    tok.save(str(plain))
    tok.add_special_tokens(["<bos>"])
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos)]
    )
    with_bos = tmp_path / "bos" / "tokenizer.json"
    with_bos.parent.mkdir()
    tok.save(str(with_bos))
    return plain, with_bos, bos


def test_start_ids_are_what_transformers_starts_a_sequence_with(tmp_path):
    plain, with_bos, bos = _tokenizers(tmp_path)
    for path, want in ((plain, ()), (with_bos, (bos,))):
        tok = load_tokenizer(path)
        theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))("def f(x)")["input_ids"]
        assert start_ids(tok, 0) == want == tuple(theirs[: len(want)])
    assert start_ids(load_tokenizer(with_bos), bos) == ()  # a start token that ends documents: none


def _documents(ids: np.ndarray, eot: int) -> list[list[int]]:
    cuts = np.flatnonzero(ids == eot)
    return [list(d) for d in np.split(ids, cuts + 1) if len(d)]


@pytest.mark.parametrize("workers", [1, 2])
def test_every_document_starts_with_the_start_token(tmp_path, monkeypatch, workers):
    """Each document of train.bin and val.bin is [<bos>, text, eot] (the long one cut into pieces has
    one <bos>, at its start), the bytes the same for 1 and 2 workers; ``data.bos = none`` writes the
    same tokens without the <bos>, as Loom wrote them before."""
    _, with_bos, bos = _tokenizers(tmp_path)
    jl = tmp_path / "c.jsonl"
    jl.write_text("".join(json.dumps({"text": d}) + "\n" for d in [*DOCS[:10], LONG, *DOCS[10:]]))
    monkeypatch.setattr(stream, "CHUNK_CHARS", 3000)  # many chunks in flight
    base = dict(source=str(jl), tokenizer=str(with_bos), val_fraction=0.1, workers=workers)
    p = prepare_data(DataConfig(**base, prepared_dir=str(tmp_path / "auto")), progress=False)
    off = prepare_data(DataConfig(**base, prepared_dir=str(tmp_path / "none"), bos="none"), progress=False)
    eot = p.meta()["eot_id"]
    assert p.meta()["bos_ids"] == [bos] and off.meta()["bos_ids"] == []
    for name in ("train.bin", "val.bin"):
        ids = np.fromfile(p.dir / name, p.dtype)
        docs = _documents(ids, eot)
        assert docs and all(d[0] == bos and d[-1] == eot and d.count(bos) == 1 for d in docs), name
        plain = np.fromfile(off.dir / name, off.dtype)
        assert np.array_equal(ids[ids != bos], plain), name
    longest = max(_documents(np.fromfile(p.train_path, p.dtype), eot), key=len)
    # its pieces of ~64k characters: one <bos>, then its text whole
    assert longest.count(bos) == 1 and load_tokenizer(with_bos).decode(longest[1:-1]) == LONG
    if workers == 2:
        one = prepare_data(
            DataConfig(**(base | {"workers": 1}), prepared_dir=str(tmp_path / "w1")), progress=False
        )
        assert (one.dir / "train.bin").read_bytes() == (p.dir / "train.bin").read_bytes()


def test_examples_start_with_it_once_and_never_train_it(tmp_path):
    """prompt_completion examples get the <bos> (mask 0); a chat template writing ``{{ bos_token }}``
    keeps its one <bos>; a tokenizer without one writes the examples as before."""
    plain, with_bos, bos = _tokenizers(tmp_path)
    (with_bos.parent / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<bos>",
                "eos_token": "<|endoftext|>",
                "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                "{% endfor %}",
            }
        )
    )
    rows = [{"prompt": f"q{i} def f", "completion": f" return x * {i}"} for i in range(12)]
    chats = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"x * {i}"}]}
        for i in range(12)
    ]
    for fmt, records in (("prompt_completion", rows), ("chat", chats)):
        jl = tmp_path / f"{fmt}.jsonl"
        jl.write_text("".join(json.dumps(r) + "\n" for r in records))
        for tok, starts in ((with_bos, True), (plain, False)):
            out = tmp_path / f"{fmt}-{starts}"
            p = prepare_data(
                DataConfig(source=str(jl), tokenizer=str(tok), format=fmt, prepared_dir=str(out), seq_len=64),
                progress=False,
            )
            ids = np.fromfile(p.train_path, p.dtype)
            mask = np.fromfile(out / "train.mask.bin", np.uint8)
            eot = p.meta()["eot_id"]
            docs = _documents(ids, eot)
            assert len(docs) == p.meta()["n_train_docs"]
            assert all((d[0] == bos) == starts and d.count(bos) == int(starts) for d in docs), (fmt, starts)
            assert not mask[ids == bos].any()
