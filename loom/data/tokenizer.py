"""Byte-level BPE tokenizer (HF ``tokenizers``): train on a corpus, load, encode fast.

Byte-level means every string round-trips exactly: ``decode(encode(text)) == text``.
``<|endoftext|>`` is the only special token; it separates documents in the token stream.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
from numpy.typing import DTypeLike
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from loom.config import ConfigError

log = logging.getLogger("loom")
EOT = "<|endoftext|>"
# End-of-document tokens of common pretrained tokenizers, tried in order when loading one.
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


def train_tokenizer(
    docs: Iterable[str], vocab_size: int, progress: bool = False, length: int | None = None
) -> Tokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` tokens (256 bytes + EOT + merges) on ``docs``
    (any iterable: documents stream through; ``length`` = their number, for the progress bar)."""
    if length is None and isinstance(docs, Sequence):
        length = len(docs)
    return train_pieces(((doc, True) for doc in docs), vocab_size, progress, length)


def train_pieces(
    pieces: Iterable[tuple[str, bool]],
    vocab_size: int,
    progress: bool = False,
    length: int | None = None,
    piece_chars: int | None = None,
) -> Tokenizer:
    """:func:`train_tokenizer` on documents given as ``(text, ends_document)`` pieces. The trainer
    sees pieces of about ``piece_chars`` (default :data:`TRAIN_PIECE_CHARS`) characters, cut
    (:func:`recut`) only where the pre-tokenizer splits the whole document the same way, so it
    counts the same words and learns the same merges as on whole documents, in memory bounded by
    the 256 pieces it buffers, not by a document."""
    if vocab_size < 257:
        raise ConfigError(f"data.vocab_size: must be >= 257 (256 bytes + {EOT}), got {vocab_size}")
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    items = ((None, text, end) for text, end in pieces)
    texts = (text for _, text, _ in recut(items, pretoken_cut_check(pre), piece_chars or TRAIN_PIECE_CHARS))
    tok.train_from_iterator(bounded_words(texts, pre), trainer=trainer, length=length)
    return tok


# characters of one pre-token (word) the BPE trainer sees whole: each merge it learns rescans the words
# holding the pair, so one 200k-character word (a base64 blob, a minified file) took 40 s and 400k over
# 200 s; a longer word reaches it in pieces of this length (only its pairs across the cuts go uncounted)
MAX_TRAIN_WORD = 1024
_LONG_RUN = re.compile(rf"\S{{{MAX_TRAIN_WORD},}}|\s{{{MAX_TRAIN_WORD},}}")


def bounded_words(texts: Iterable[str], pre: pre_tokenizers.PreTokenizer) -> Iterator[str]:
    """``texts`` for the trainer, each cut into separate texts inside any pre-token longer than
    :data:`MAX_TRAIN_WORD` characters (every MAX_TRAIN_WORD characters from its start); a text
    without such a run (a whitespace or non-whitespace run that long: the regex's cheap test) passes
    as it is."""
    for text in texts:
        if not _LONG_RUN.search(text):
            yield text
            continue
        cuts = [
            cut
            for _, (a, b) in pre.pre_tokenize_str(text)
            if b - a > MAX_TRAIN_WORD
            for cut in range(a + MAX_TRAIN_WORD, b, MAX_TRAIN_WORD)
        ]
        start = 0
        for cut in cuts:
            yield text[start:cut]
            start = cut
        yield text[start:]


def tokenizer_file(path: str | Path) -> Path:
    """The ``tokenizer.json`` that ``data.tokenizer`` names (the file, or the one in a directory);
    anything else (missing, a directory without one, a FIFO or a device) is one line saying which."""
    given = Path(path).expanduser()
    p = given / "tokenizer.json" if given.is_dir() else given
    if given.is_dir() and not p.exists():
        raise ConfigError(f"data.tokenizer: {str(given)!r} is a directory without a tokenizer.json")
    if not p.exists():
        raise ConfigError(f"data.tokenizer: {str(p)!r} does not exist")
    if not p.is_file():
        kind = (
            "a FIFO"
            if p.is_fifo()
            else "a device"
            if p.is_char_device() or p.is_block_device()
            else "not a file"
        )
        raise ConfigError(f"data.tokenizer: {str(p)!r} is {kind}, not a tokenizer.json file")
    return p


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a ``tokenizer.json`` (or the one inside a prepared-data directory)."""
    p = tokenizer_file(path)
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # the Rust side raises a bare Exception on bad JSON
        raise ConfigError(f"data.tokenizer: {str(p)!r} is not a tokenizers JSON file ({e})") from None


def ordinary(tok: Tokenizer) -> Tokenizer:
    """``tok`` encoding corpus text as text: a special token's spelling inside a document (a literal
    ``<|endoftext|>`` in web text) is encoded as ordinary text, as tiktoken's ``encode_ordinary``
    does, so only the end-of-document ids Loom writes between documents separate them. (Chat
    examples keep the template's special tokens special, as transformers' ``apply_chat_template``
    does.) The setting is not saved with the tokenizer: set it where text is encoded."""
    tok.encode_special_tokens = True
    return tok


def eot_id(tok: Tokenizer, path: str | Path = "") -> int:
    """Id of the end-of-document token (first of :data:`EOT_CANDIDATES` the tokenizer has); ``path``:
    the file it was read from, named in the refusal."""
    for name in EOT_CANDIDATES:
        idx = tok.token_to_id(name)
        if idx is not None:
            return idx
    where = f" {str(path)!r}" if path else ""
    raise ConfigError(
        f"data.tokenizer:{where} has none of the end-of-document tokens {', '.join(EOT_CANDIDATES)}"
    )


def start_ids(tok: Tokenizer, eot: int) -> tuple[int, ...]:
    """The special tokens ``tok``'s post-processor puts before one sequence, as ``transformers``'
    ``tokenizer(text)`` starts with them (Llama 3's ``<|begin_of_text|>``, Gemma's ``<bos>``, Llama 2's
    and Mistral's ``<s>``); () for none (GPT-2, Qwen, Loom's own tokenizers), and () where they hold
    the end-of-document token ``eot`` (a document would then seem to end before it starts)."""
    enc = tok.encode("a", add_special_tokens=True)
    ids = []
    for i, special in zip(enc.ids, enc.special_tokens_mask, strict=True):
        if not special:
            break
        ids.append(i)
    return () if eot in ids else tuple(ids)


def encode_documents(
    tok: Tokenizer,
    docs: Sequence[str],
    eot: int,
    chunk_chars: int = 1 << 20,
    dtype: DTypeLike = np.int64,
    progress: bool = False,
    desc: str = "encode",
) -> Iterator[np.ndarray]:
    """Token ids of ``docs``, each followed by ``eot``, yielded in chunks of ~``chunk_chars``.

    Uses ``encode_batch_fast`` (no offsets, parallel in Rust) over chunks of documents, so
    memory stays bounded and a progress bar can advance.
    """
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    bar = tqdm(total=len(docs), desc=desc, unit="doc", disable=not progress, leave=False)
    start = 0
    while start < len(docs):
        end, size = start, 0
        while end < len(docs) and (end == start or size + len(docs[end]) <= chunk_chars):
            size += len(docs[end])
            end += 1
        encs = encode(list(docs[start:end]), add_special_tokens=False)
        pieces: list[np.ndarray] = []
        tail = np.array([eot], dtype=dtype)
        for enc in encs:
            pieces.append(np.asarray(enc.ids, dtype=dtype))
            pieces.append(tail)
        yield np.concatenate(pieces)
        bar.update(end - start)
        start = end
    bar.close()


# ----------------------------------------------------------------------------- pieces of long documents

PIECE_CHARS = 1 << 16  # characters of a document encoded at once (about)
# characters of a document trained on at once: the trainer holds 256 of them (its input buffer)
TRAIN_PIECE_CHARS = 1 << 14
CUT_CONTEXT = 256  # characters each side of a cut that the check encodes together and apart
CUT_TRIES = 64  # candidates checked per search before more text is read
CutCheck = Callable[[str, int], bool]
T = TypeVar("T")

# Unicode White_Space, what the pre-tokenizers' regular expressions call \s
_WS = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_CANDIDATES = (
    re.compile(f"[^{_WS}](?=[{_WS}])"),  # cut where a whitespace run starts (preferred)
    re.compile(f"[^\\W_](?=[^\\w{_WS}])"),  # else between a letter or digit and punctuation
)


def encode_cut_check(tok: Tokenizer, context: int = CUT_CONTEXT) -> CutCheck:
    """``check(text, i)``: the tokens of ``text`` cut at ``i`` are those of ``text`` whole, as
    ``context`` characters each side show: ``ids(a + b) == ids(a) + ids(b)`` with
    ``a = text[i - context : i]``, ``b = text[i : i + context]``."""

    def ids(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False).ids

    def check(text: str, i: int) -> bool:
        a, b = text[max(i - context, 0) : i], text[i : i + context]
        return ids(a + b) == ids(a) + ids(b)

    return check


def pretoken_cut_check(pre: pre_tokenizers.PreTokenizer, context: int = CUT_CONTEXT) -> CutCheck:
    """:func:`encode_cut_check` for the words of a pre-tokenizer (what a BPE trainer counts)."""

    def words(s: str) -> list[str]:
        return [w for w, _ in pre.pre_tokenize_str(s)]

    def check(text: str, i: int) -> bool:
        a, b = text[max(i - context, 0) : i], text[i : i + context]
        return words(a + b) == words(a) + words(b)

    return check


def recut(
    items: Iterable[tuple[T, str, bool]],
    check: CutCheck,
    max_chars: int = PIECE_CHARS,
    context: int = CUT_CONTEXT,
) -> Iterator[tuple[T, str, bool]]:
    """Pieces ``(tag, text, ends_document)`` of documents (cut anywhere) cut again into pieces of at
    most ``max_chars + context`` characters, only at points ``check`` accepts: where a whitespace run
    starts (for the GPT-2 pattern of a byte-level BPE every such point splits the whole text the
    same way: no pre-token spans it, and the pre-tokens after it depend only on the text after it),
    else between a letter or digit and punctuation. Encoding (or counting the words of) the pieces
    gives exactly the tokens of the whole document. A stretch of text with no accepted point is
    held until one comes (memory grows with it: logged once). Tags pass through."""
    carry, clear, warned = "", 0, False  # carry[:clear] was searched and holds no accepted cut
    for tag, text, end in items:
        buf = carry + text if carry else text
        start = 0
        while len(buf) - start > max_chars + context:
            limit = len(buf) - context  # a cut needs ``context`` characters after it to be checked
            cut = None
            if clear < max_chars:
                cut = _search(buf, start + clear, start + max_chars, check, last=True)
            if cut is None:
                cut = _search(buf, start + max(clear, max_chars), limit, check, last=False)
            if cut is None:
                clear = limit - start
                break
            yield tag, buf[start:cut], False
            start, clear = cut, 0
        if end:
            yield tag, buf[start:], True
            carry, clear = "", 0
        else:
            carry = buf[start:] if start else buf
            if len(carry) > 16 * max_chars and not warned:
                warned = True
                log.warning(
                    "no cut point that keeps the tokens in %d characters of one document: it is held "
                    "whole until one comes (memory grows with it)",
                    len(carry),
                )


def _search(text: str, lo: int, hi: int, check: CutCheck, last: bool) -> int | None:
    """The last (``last``) or first cut candidate ``i`` in ``(lo, hi]`` that ``check`` accepts, trying
    at most :data:`CUT_TRIES`; whitespace candidates before the others."""
    tries = CUT_TRIES
    for pattern in _CANDIDATES:
        step = 1 << 12
        edges = range(hi, lo, -step) if last else range(lo, hi, step)
        for edge in edges:
            a, b = (max(lo, edge - step), edge) if last else (edge, min(hi, edge + step))
            found = [m.end() for m in pattern.finditer(text, a, b + 1)]
            for i in reversed(found) if last else found:
                if check(text, i):
                    return i
                tries -= 1
                if not tries:
                    return None
    return None
