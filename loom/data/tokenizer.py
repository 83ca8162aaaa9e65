"""Byte-level BPE tokenizer (HF ``tokenizers``): train on a corpus, load, encode fast.

Byte-level means every string round-trips exactly: ``decode(encode(text)) == text``.
``<|endoftext|>`` is the only special token; it separates documents in the token stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from numpy.typing import DTypeLike
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from loom.config import ConfigError

EOT = "<|endoftext|>"
# End-of-document tokens of common pretrained tokenizers, tried in order when loading one.
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


def train_tokenizer(
    docs: Iterable[str], vocab_size: int, progress: bool = False, length: int | None = None
) -> Tokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` tokens (256 bytes + EOT + merges) on ``docs``
    (any iterable: documents stream through; ``length`` = their number, for the progress bar)."""
    if vocab_size < 257:
        raise ConfigError(f"data.vocab_size: must be >= 257 (256 bytes + {EOT}), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    if length is None and isinstance(docs, Sequence):
        length = len(docs)
    tok.train_from_iterator(docs, trainer=trainer, length=length)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a ``tokenizer.json`` (or the one inside a prepared-data directory)."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ConfigError(f"data.tokenizer: {str(p)!r} does not exist")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # the Rust side raises a bare Exception on bad JSON
        raise ConfigError(f"data.tokenizer: {str(p)!r} is not a tokenizers JSON file ({e})") from None


def eot_id(tok: Tokenizer) -> int:
    """Id of the end-of-document token (first of :data:`EOT_CANDIDATES` the tokenizer has)."""
    for name in EOT_CANDIDATES:
        idx = tok.token_to_id(name)
        if idx is not None:
            return idx
    raise ConfigError(f"data.tokenizer: has none of the end-of-document tokens {', '.join(EOT_CANDIDATES)}")


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
