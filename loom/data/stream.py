"""Streaming tokenization: documents in, token files out, memory bounded by a few chunks.

Documents arrive as ``(text, ends_document)`` pieces (:func:`loom.data.corpus.iter_pieces`). A long
document is cut again into pieces of about :data:`~loom.data.tokenizer.PIECE_CHARS` characters at
points where encoding the pieces gives exactly the tokens of the whole document
(:func:`~loom.data.tokenizer.recut`); pieces are grouped into chunks of about ``chunk_chars``
characters, encoded by ``workers`` processes, and the token ids (the tokenizer's start tokens before a
document's first piece, ``data.bos``; an end-of-document token after its last) are appended to the ``.bin`` file in order, whatever order the workers
finish in; so the bytes do not depend on the worker count. At most ``2 * workers`` chunks are in
flight, so the text held is at most ``(2 * workers + 1) * chunk_chars`` characters plus one block
being read, independent of the corpus size and of the largest document. One worker encodes in this
process (the tokenizer's own Rust threads).

The split into train and validation needs one number of every document, its length in characters;
:func:`split_plan` computes the split from those lengths alone (first pass), and
:func:`split_stream` applies it while the pieces stream by (second pass).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.pool import AsyncResult, Pool
from pathlib import Path
from typing import Literal

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from loom.config import ConfigError
from loom.data.tokenizer import PIECE_CHARS, encode_cut_check, ordinary, recut

Split = Literal["train", "val"]
CHUNK_CHARS = 1 << 20  # characters of text per encoding task


def default_workers() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class SplitPlan:
    """Documents ``[0, k)`` are train, ``(k, n)`` validation; document k is cut at the last line
    break before character ``pos`` in the piece holding that character (at ``pos`` if there is
    none): its head is train, its tail validation (``pos = 0``: all of it validation)."""

    k: int
    pos: int


def split_plan(lengths: Sequence[int] | np.ndarray, val_fraction: float, block: int = 1 << 20) -> SplitPlan:
    """The last ``val_fraction`` of the documents (at least one) are validation.

    When that would put more than twice ``val_fraction`` of the text into validation (one
    document, or a few of very uneven size), the corpus is instead cut at ``1 - val_fraction``
    of its characters, inside the document that straddles that point. ``lengths`` may be a
    memory-mapped array (:class:`LengthLog`): it is read in blocks.
    """
    lengths = np.asarray(lengths, dtype=np.int64) if not isinstance(lengths, np.ndarray) else lengths
    n = len(lengths)
    total = sum(int(lengths[i : i + block].sum()) for i in range(0, n, block))
    n_val = min(max(1, round(n * val_fraction)), n - 1)
    if (
        n_val >= 1
        and sum(int(lengths[i : i + block].sum()) for i in range(n - n_val, n, block))
        <= 2 * val_fraction * total
    ):
        return SplitPlan(n - n_val, 0)
    pos = int(total * (1.0 - val_fraction))
    for start in range(0, n, block):  # find the document holding character ``pos``
        ends = np.cumsum(lengths[start : start + block])
        if pos < int(ends[-1]):
            j = int(np.searchsorted(ends, pos, side="right"))
            return SplitPlan(start + j, pos - (int(ends[j - 1]) if j else 0))
        pos -= int(ends[-1])
    raise AssertionError("pos lies inside the corpus")  # pragma: no cover


class LengthLog:
    """Each document's length in characters, appended to a file (8 bytes a document on disk, a
    bounded buffer in memory) and read back memory-mapped."""

    def __init__(self, path: Path, buffer: int = 1 << 16) -> None:
        self.path, self.buffer = path, buffer
        self._f = path.open("wb")
        self._pending: list[int] = []
        self.n = 0

    def append(self, length: int) -> None:
        self._pending.append(length)
        self.n += 1
        if len(self._pending) >= self.buffer:
            self._flush()

    def _flush(self) -> None:
        self._f.write(np.asarray(self._pending, dtype=np.int64).tobytes())
        self._pending.clear()

    def close(self) -> np.ndarray:
        self._flush()
        self._f.close()
        return np.memmap(self.path, dtype=np.int64, mode="r") if self.n else np.zeros(0, np.int64)


def split_stream(pieces: Iterable[tuple[str, bool]], plan: SplitPlan) -> Iterator[tuple[Split, str, bool]]:
    """``(split, text, ends_document)`` of every piece, cut by ``plan`` (the head of document k ends a
    train document); refuses a split that leaves no train text."""
    i = offset = 0  # document index, characters of it before this piece
    for text, end in pieces:
        if i != plan.k:
            yield ("train" if i < plan.k else "val"), text, end
        elif offset + len(text) <= plan.pos and not end:
            yield "train", text, False
        elif offset <= plan.pos:  # the piece holding character ``pos`` (or the document's last)
            pos = plan.pos - offset
            nl = text.rfind("\n", 0, pos)
            cut = nl + 1 if nl >= 0 else pos
            if offset + cut:
                yield "train", text[:cut], True
            elif plan.k == 0:
                raise ConfigError("data.source: the corpus is too small to hold out a validation split")
            yield "val", text[cut:], end
        else:
            yield "val", text, end
        offset += len(text)
        if end:
            i, offset = i + 1, 0


class TokenWriter:
    """Appends token chunks to a ``.bin`` file: counts them, hashes the bytes, tracks the largest id."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.n_tokens = self.n_docs = 0
        self.max_id = -1
        self.sum = 0  # sum of the values written (trained tokens, for a mask file)
        self._sha = hashlib.sha256()
        try:
            self._f = path.open("wb")
        except OSError as e:
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None

    def write(self, ids: np.ndarray, n_docs: int) -> None:
        raw = ids.tobytes()
        try:
            self._f.write(raw)
        except OSError as e:  # a failed write() carries no file name: add it
            raise OSError(e.errno, e.strerror or str(e), str(self.path)) from None
        self._sha.update(raw)
        self.n_tokens += len(ids)
        self.n_docs += n_docs
        if len(ids):
            self.max_id = max(self.max_id, int(ids.max()))
            if ids.dtype == np.uint8:
                self.sum += int(ids.sum())

    def close(self) -> str:
        """Flush, fsync and close; returns the SHA-256 of the bytes written."""
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as e:
            raise OSError(e.errno, e.strerror or str(e), str(self.path)) from None
        finally:
            self._f.close()
        return self._sha.hexdigest()

    def abort(self) -> None:
        self._f.close()


# ----------------------------------------------------------------------------- encoding

_WORKER: dict[str, object] = {}


def encode_chunk(
    tok: Tokenizer,
    docs: list[str],
    eot: int,
    dtype: np.dtype,
    ends: list[bool] | None = None,
    starts: list[bool] | None = None,
    bos: Sequence[int] = (),
) -> np.ndarray:
    """Token ids of ``docs`` (pieces of documents: ``bos`` before those whose ``starts`` is true,
    ``eot`` after those whose ``ends`` is true, each by default around every one), as one array of
    ``dtype``."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    pieces: list[np.ndarray] = []
    tail, head = np.array([eot], dtype=dtype), np.array(bos, dtype=dtype)
    for j, enc in enumerate(encode(docs, add_special_tokens=False)):
        if len(head) and (starts is None or starts[j]):
            pieces.append(head)
        pieces.append(np.asarray(enc.ids, dtype=dtype))
        if ends is None or ends[j]:
            pieces.append(tail)
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype)


def _init_worker(tok_json: str, eot: int, dtype: str, bos: tuple[int, ...] = ()) -> None:
    _WORKER.update(tok=ordinary(Tokenizer.from_str(tok_json)), eot=eot, dtype=np.dtype(dtype), bos=bos)


def _worker_encode(docs: list[str], ends: list[bool], starts: list[bool]) -> np.ndarray:
    tok = _WORKER["tok"]
    assert isinstance(tok, Tokenizer)
    return encode_chunk(tok, docs, int(_WORKER["eot"]), _WORKER["dtype"], ends, starts, _WORKER["bos"])  # type: ignore[call-overload, arg-type]


def _chunks(
    pieces: Iterable[tuple[Split, str, bool]], chunk_chars: int
) -> Iterator[tuple[Split, list[str], list[bool], list[bool], int]]:
    """(split, pieces, ends_document, starts_document, UTF-8 bytes) groups of about ``chunk_chars``
    characters, never mixing splits (a piece starts a document when the one before it ended one)."""
    split: Split | None = None
    group: list[str] = []
    ends: list[bool] = []
    starts: list[bool] = []
    size = nbytes = 0
    first = True  # the next piece starts a document
    for s, text, end in pieces:
        if group and (s != split or size + len(text) > chunk_chars):
            assert split is not None
            yield split, group, ends, starts, nbytes
            group, ends, starts, size, nbytes = [], [], [], 0, 0
        split = s
        group.append(text)
        ends.append(end)
        starts.append(first)
        first = end
        size += len(text)
        nbytes += len(text.encode("utf-8"))
    if group:
        assert split is not None
        yield split, group, ends, starts, nbytes


def _pool(tok: Tokenizer, eot: int, dtype: np.dtype, workers: int, bos: tuple[int, ...] = ()) -> Pool:
    """``workers`` processes holding the tokenizer, each encoding on one thread (no Rust thread pool
    per worker; a forked child of a process that used it would also warn)."""
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # inherited by the workers only
    try:
        return ctx.Pool(workers, _init_worker, (tok.to_str(), eot, dtype.name, bos))
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def encode_stream(
    tok: Tokenizer,
    docs: Iterable[tuple[Split, str, bool]],
    writers: dict[Split, TokenWriter],
    eot: int,
    dtype: np.dtype,
    workers: int = 1,
    chunk_chars: int | None = None,
    total_bytes: int | None = None,
    progress: bool = False,
    piece_chars: int = PIECE_CHARS,
    bos: Sequence[int] = (),
) -> None:
    """Encode ``(split, text, ends_document)`` pieces into ``writers[split]`` in order (see the module
    doc; ``bos`` before each document), in chunks of ``chunk_chars`` (default :data:`CHUNK_CHARS`) of pieces of about ``piece_chars``;
    a progress bar counts UTF-8 bytes, with their rate and the time left."""
    bar = tqdm(
        total=total_bytes, desc="tokenize", unit="B", unit_scale=True, disable=not progress, leave=False
    )
    tok = ordinary(Tokenizer.from_str(tok.to_str()))  # a copy: the caller's keeps its mode
    chunks = _chunks(recut(docs, encode_cut_check(tok), piece_chars), chunk_chars or CHUNK_CHARS)
    try:
        if workers <= 1:
            for split, group, ends, starts, nbytes in chunks:
                writers[split].write(encode_chunk(tok, group, eot, dtype, ends, starts, bos), sum(ends))
                bar.update(nbytes)
            return
        pool = _pool(tok, eot, dtype, workers, tuple(bos))
        try:
            pending: deque[tuple[Split, int, int, AsyncResult[np.ndarray]]] = deque()
            for split, group, ends, starts, nbytes in chunks:
                if len(pending) >= 2 * workers:
                    _drain_one(pending, writers, bar)
                task = pool.apply_async(_worker_encode, (group, ends, starts))
                pending.append((split, sum(ends), nbytes, task))
                del group
            while pending:
                _drain_one(pending, writers, bar)
            pool.close()
            pool.join()
        finally:
            pool.terminate()
    finally:
        bar.close()


def _drain_one(
    pending: deque[tuple[Split, int, int, AsyncResult[np.ndarray]]],
    writers: dict[Split, TokenWriter],
    bar: tqdm,
) -> None:
    split, n_docs, nbytes, result = pending.popleft()
    writers[split].write(result.get(), n_docs)
    bar.update(nbytes)
