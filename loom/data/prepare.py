"""Prepare a corpus once: tokenizer.json, train.bin, val.bin, meta.json in one directory.

The directory is built under a temporary name next to its final place and renamed into
place in one step, so a concurrent or killed prepare never leaves a half-written directory;
if another process finished first, its directory is kept. Preparing again is a no-op.

Prepared data is checked every time it is loaded, cheaply: each token file's size, the SHA-256
of ``SAMPLE_BLOCKS`` blocks of ``SAMPLE_BYTES`` spread evenly over it (the whole file when it is
smaller than that, so ~1 MiB is read per file), the tokenizer's SHA-256, and the largest token
id (every id of files up to ``SCAN_BYTES``; the recorded maximum beyond, where
:class:`~loom.data.dataset.TokenDataset` checks each batch as it is read) against the
tokenizer's vocabulary. ``loom prepare --verify`` hashes every byte (:func:`verify_full`).
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from loom.config import ConfigError, DataConfig
from loom.data.chat import (
    LABELS_VERSION,
    ExampleEncoder,
    builtin_render,
    read_records,
    segments,
    template_render,
)
from loom.data.corpus import (
    STDLIB,
    DecodeStats,
    fingerprint,
    iter_pieces,
    note_cut,
    note_unread,
    source_files,
    unread_files,
    warn_replaced,
    warn_skipped,
)
from loom.data.report import REPEATED_BY_RANKS
from loom.data.stream import (
    CHUNK_CHARS,
    LengthLog,
    Split,
    TokenWriter,
    default_workers,
    encode_stream,
    split_plan,
    split_stream,
)
from loom.data.tokenizer import (
    eot_id,
    load_tokenizer,
    start_ids,
    tokenizer_file,
    train_pieces,
    train_tokenizer,
)
from loom.notes import LAUNCHER_SAYS
from loom.numbers import is_whole

log = logging.getLogger("loom")
_SAID: set[str] = set()  # warnings this process printed (once each)

FORMAT_VERSION = 1
META = "meta.json"
TOKEN_FILES = ("train.bin", "val.bin")
_TMP_TAG = ".tmp-"
SAMPLE_BLOCKS = 16  # blocks hashed when loading (first and last included)
SAMPLE_BYTES = 1 << 16  # bytes per sampled block
SCAN_BYTES = 1 << 28  # token files up to this size have every id checked on load


@dataclass
class PreparedData:
    """Paths and sizes of a prepared corpus."""

    dir: Path
    train_path: Path
    val_path: Path
    tokenizer_path: Path
    vocab_size: int  # the tokenizer's vocabulary (may be below data.vocab_size on a tiny corpus)
    n_train_tokens: int
    n_val_tokens: int
    dtype: str = "uint16"  # numpy dtype of the .bin files
    eot_id: int = 0  # id of the end-of-document token

    @classmethod
    def load(cls, dir: str | Path, verify: bool = True) -> PreparedData:
        """Read ``meta.json`` of a prepared directory and check its files (see the module doc;
        ``verify=False``: only that they are there, with the sizes it records)."""
        d = Path(dir).expanduser()
        meta_path = d / META
        if not meta_path.is_file():
            raise ConfigError(f"data.prepared_dir: {str(d)!r} holds no {META}; run `loom prepare` first")
        meta = read_meta(d)
        try:
            data = cls(
                dir=d,
                train_path=d / "train.bin",
                val_path=d / "val.bin",
                tokenizer_path=d / "tokenizer.json",
                vocab_size=int(meta["vocab_size"]),
                n_train_tokens=int(meta["n_train_tokens"]),
                n_val_tokens=int(meta["n_val_tokens"]),
                dtype=np.dtype(str(meta["dtype"])).name,
                eot_id=int(meta["eot_id"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(
                f"data.prepared_dir: {meta_path} is not a Loom {META} ({type(e).__name__}: {e}); give "
                f"{_FOREIGN_TODO}"
            ) from None
        if data.dtype not in ("uint16", "uint32"):
            raise ConfigError(
                f"data.prepared_dir: {meta_path} names dtype {data.dtype!r}; token files are uint16 or "
                f"uint32. Delete {str(d)!r} and prepare again"
            )
        itemsize = np.dtype(data.dtype).itemsize
        for path, n in ((data.train_path, data.n_train_tokens), (data.val_path, data.n_val_tokens)):
            if not path.is_file():
                what = (
                    "is a directory"
                    if path.is_dir()
                    else "is a symbolic link that leads nowhere"
                    if path.is_symlink()
                    else "is not a regular file"
                    if os.path.lexists(path)
                    else "is missing"
                )
                raise ConfigError(
                    f"data.prepared_dir: {str(path)!r} {what}; delete {str(d)!r} and prepare again"
                )
            if path.stat().st_size != n * itemsize:
                raise ConfigError(
                    f"data.prepared_dir: {str(path)!r} has {path.stat().st_size} bytes, meta.json says "
                    f"{n} tokens of {data.dtype}; delete {str(d)!r} and prepare again"
                )
        masks = _table(meta, "mask_sha256")  # chat / prompt_completion: one trained-or-not byte per token
        for name, n in (("train.mask.bin", data.n_train_tokens), ("val.mask.bin", data.n_val_tokens)):
            if name in masks and (not (d / name).is_file() or (d / name).stat().st_size != n):
                raise ConfigError(
                    f"data.prepared_dir: {d / name} is missing or not {n} bytes (one per token); "
                    f"delete {str(d)!r} and prepare again"
                )
        if not data.tokenizer_path.is_file():
            raise ConfigError(f"data.prepared_dir: {str(data.tokenizer_path)!r} is missing")
        if verify:
            data.check(meta)
        return data

    def check(self, meta: dict[str, Any], full: bool = False) -> None:
        """Token files and tokenizer against what ``meta.json`` recorded at prepare time: the sampled
        blocks' SHA-256 (every byte's with ``full``), the tokenizer's SHA-256, token ids below the
        vocabulary. Raises ConfigError naming the file."""
        sha = _table(meta, "sha256")
        tok_sha = sha.get("tokenizer.json")
        if tok_sha and _sha256(self.tokenizer_path) != tok_sha:
            raise self._altered(self.tokenizer_path, "SHA-256")
        for name in TOKEN_FILES:
            path = self.dir / name
            recorded = _table(meta, "max_id").get(name)
            self.check_ids(path, full, recorded if isinstance(recorded, int) else None)
            if full:
                if sha.get(name) and _sha256(path) != sha[name]:
                    raise self._altered(path, "SHA-256")
            else:
                sampled = _table(meta, "sampled_sha256").get(name)
                spec = _table(meta, "sample")  # the sampling it was recorded with
                blocks, block = spec.get("blocks"), spec.get("block_bytes")
                blocks = blocks if isinstance(blocks, int) and blocks > 0 else SAMPLE_BLOCKS
                block = block if isinstance(block, int) and block > 0 else SAMPLE_BYTES
                if sampled and sampled_sha256(path, blocks, block) != sampled:
                    raise self._altered(path, f"SHA-256 of {blocks} sampled blocks")

    def check_ids(self, path: Path, full: bool = False, recorded_max: int | None = None) -> None:
        """Every token id of ``path`` (files up to ``SCAN_BYTES``, or any with ``full``), else the
        maximum recorded at prepare time, is below the tokenizer's vocabulary."""
        if recorded_max is not None and recorded_max >= self.vocab_size:
            raise ConfigError(
                f"data.prepared_dir: {path} holds token ids up to {recorded_max} (meta.json), outside the "
                f"tokenizer's vocabulary of {self.vocab_size}; prepare the data again"
            )
        if not full and path.stat().st_size > SCAN_BYTES:
            return
        bad = first_out_of_vocab(path, np.dtype(self.dtype), self.vocab_size)
        if bad is not None:
            pos, value = bad
            raise ConfigError(
                f"data.prepared_dir: {path} holds token id {value} at token {pos}, outside the "
                f"tokenizer's vocabulary of {self.vocab_size}; the file was altered or prepared with "
                "another tokenizer: delete the directory and prepare again"
            )

    def _altered(self, path: Path, what: str) -> ConfigError:
        return ConfigError(
            f"data.prepared_dir: {path} differs from the {what} recorded in {self.dir / META} at "
            f"prepare time (altered or corrupt); delete {str(self.dir)!r} and prepare again"
        )

    def meta(self) -> dict[str, Any]:
        """The full ``meta.json`` contents."""
        return read_meta(self.dir)


def _table(meta: dict[str, Any], key: str) -> dict[str, Any]:
    """``meta[key]`` if it is a JSON object, else an empty one (older or hand-edited files)."""
    value = meta.get(key)
    return value if isinstance(value, dict) else {}


# what to do with a meta.json Loom did not write (the directory may be the user's: never "delete it")
_FOREIGN_TODO = (
    "a directory `loom prepare` wrote (it never writes over one it did not), or prepare into a new one"
)


def read_meta(d: Path) -> dict[str, Any]:
    """``d/meta.json`` as a dict; anything else is refused in one line naming the file."""
    path = d / META
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"data.prepared_dir: {path} is missing; run `loom prepare` first") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = (
            f" (line {e.lineno}, column {e.colno}: {e.msg})" if isinstance(e, json.JSONDecodeError) else ""
        )
        raise ConfigError(
            f"data.prepared_dir: {path} is not valid JSON{where}: not a Loom {META}; give {_FOREIGN_TODO}"
        ) from None
    if not isinstance(meta, dict):
        raise ConfigError(
            f"data.prepared_dir: {path} is not a JSON object: not a Loom {META}; give {_FOREIGN_TODO}"
        )
    return meta


def sample_spans(size: int, blocks: int | None = None, block: int | None = None) -> list[tuple[int, int]]:
    """(offset, length) of the blocks hashed on load: the whole file if it is at most ``blocks *
    block`` bytes (default ``SAMPLE_BLOCKS * SAMPLE_BYTES``), else ``blocks`` blocks evenly spaced
    from the first byte to the last."""
    blocks = SAMPLE_BLOCKS if blocks is None else blocks
    block = SAMPLE_BYTES if block is None else block
    if size <= blocks * block or blocks < 2:
        return [(0, size)]
    step = (size - block) / (blocks - 1)
    return [(round(i * step), block) for i in range(blocks)]


def sampled_sha256(path: Path, blocks: int | None = None, block: int | None = None) -> str:
    """SHA-256 of the file's size and its :func:`sample_spans` bytes."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        for offset, length in sample_spans(size, blocks, block):
            f.seek(offset)
            h.update(f.read(length))
    return h.hexdigest()


def first_out_of_vocab(
    path: Path, dtype: np.dtype, vocab: int, chunk: int = 1 << 22
) -> tuple[int, int] | None:
    """(position, id) of the first token id ``>= vocab`` in ``path``, or None; reads ``chunk`` tokens
    at a time into one buffer (not memory-mapped: mapped pages would count towards the resident
    memory of ``loom prepare`` in proportion to the corpus)."""
    raw = bytearray(chunk * dtype.itemsize)
    start = 0
    with path.open("rb") as f:
        while n := f.readinto(raw) // dtype.itemsize:
            part = np.frombuffer(raw, dtype, count=n)
            if int(part.max()) >= vocab:
                i = int(np.argmax(part >= vocab))
                return start + i, int(part[i])
            start += n
    return None


def verify_full(dir: str | Path) -> PreparedData:
    """``loom prepare --verify``: every byte of the token files and the tokenizer against the SHA-256
    recorded at prepare time, and every token id against the vocabulary."""
    data = PreparedData.load(dir, verify=False)
    meta = data.meta()
    missing = [n for n in (*TOKEN_FILES, "tokenizer.json") if not _table(meta, "sha256").get(n)]
    data.check(meta, full=True)
    if missing == ["tokenizer.json"]:
        log.warning(
            "%s records no SHA-256 of tokenizer.json (prepared by an older Loom); token files verified",
            data.dir / META,
        )
    elif missing:
        raise ConfigError(
            f"data.prepared_dir: {data.dir / META} records no SHA-256 of {', '.join(missing)}; "
            "prepare the data again to verify it"
        )
    return data


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size < 2**16 else np.uint32)


# how text documents are read and encoded, in prepared text's cache key: 2 = a leading byte order mark
# dropped, special tokens' spellings in the text encoded as text (tokenizer.ordinary), a
# doc_separator's line breaks matching \r\n too; 3 = a trained tokenizer sees a word over
# tokenizer.MAX_TRAIN_WORD characters in pieces
# 4 = the tokenizer's start tokens before each document (data.bos)
TEXT_READING = 4


def cache_key(cfg: DataConfig) -> dict[str, Any]:
    """Everything the prepared bytes depend on (also checks the source exists)."""
    tok = ""
    if cfg.tokenizer:
        tok_path = tokenizer_file(cfg.tokenizer).resolve()
        tok = f"{tok_path}:{_sha256(tok_path)[:16]}"
    return {
        "format": FORMAT_VERSION,
        "source": cfg.source if cfg.source == STDLIB else str(Path(cfg.source).expanduser().absolute()),
        "corpus": fingerprint(cfg.source),
        "vocab_size": cfg.vocab_size,
        "max_corpus_mb": cfg.max_corpus_mb,
        "tokenizer": tok,
        "text_field": cfg.text_field,
        "val_fraction": cfg.val_fraction,
        **({"doc_separator": cfg.doc_separator} if cfg.doc_separator else {}),
        **({"bos": cfg.bos} if cfg.bos != "auto" else {}),
        **(
            {"reading": TEXT_READING}  # a cache of the old rule is stale
            if cfg.format == "text"
            else {  # examples: labels and lengths depend on these too
                "data_format": cfg.format,
                "labels": LABELS_VERSION,  # which tokens are trained: a cache of the old rule is stale
                **(
                    {"template": _template_digest(cfg.tokenizer)}
                    if cfg.tokenizer and cfg.format == "chat"
                    else {}
                ),
                "train_on_prompt": cfg.train_on_prompt,
                "overlong": cfg.overlong,
                "seq_len": cfg.seq_len,
            }
        ),
    }


def _template_digest(tokenizer: str) -> str:
    """The files beside the tokenizer that render chat examples (:func:`loom.data.chat.template_render`):
    an edited template is another preparation."""
    d = tokenizer_file(tokenizer).parent
    h = hashlib.sha256()
    for name in ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        f = d / name
        h.update(name.encode() + b"\0" + (f.read_bytes() if f.is_file() else b"-") + b"\0")
    return h.hexdigest()[:16]


def cache_root() -> Path:
    """``$LOOM_CACHE_DIR`` or ``~/.cache/loom``, made absolute (a relative one names the directory it
    names from here, so a run's recorded ``data.prepared_dir`` holds from any other directory)."""
    return Path(os.environ.get("LOOM_CACHE_DIR") or "~/.cache/loom").expanduser().absolute()


def default_dir(cfg: DataConfig, key: dict[str, Any] | None = None) -> Path:
    """``<cache>/data/<name>-<vocab>-<hash of the cache key>``."""
    key = key if key is not None else cache_key(cfg)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    plain = [part for part in Path(cfg.source).parts if not glob.has_magic(part)]
    stem = Path(plain[-1]).stem if plain else "data"
    stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in stem)[:32] or "data"
    return cache_root() / "data" / f"{stem}-{cfg.vocab_size}-{digest}"


def prepare_sources(cfg: DataConfig, progress: bool = True) -> list[PreparedData]:
    """Each ``[[data.sources]]`` prepared once into its own cache directory (keyed, like any source, by
    its files, the tokenizer and the settings), all with one tokenizer: ``data.tokenizer``, or the one
    trained on the first source. Logs each source's token count and its share of the weights."""
    out: list[PreparedData] = []
    total = sum(src.weight for src in cfg.sources)
    for i, src in enumerate(cfg.sources):
        tok = cfg.tokenizer or (str(out[0].tokenizer_path) if out else "")
        sub = replace(
            cfg,
            source=src.path,
            text_field=src.text_field,
            format=src.format,
            tokenizer=tok,
            prepared_dir="",
            sources=[],
        )
        try:
            out.append(prepare_data(sub, progress))
        except ConfigError as e:
            raise ConfigError(f"data.sources[{i}] ({src.path}): {e}") from None
        log.info(
            "data source %d: %s, weight %.3g (%.1f%% of sequences), %s train tokens, %s",
            i,
            src.path,
            src.weight,
            100 * src.weight / total,
            f"{out[-1].n_train_tokens:,}",
            out[-1].dir,
            extra=REPEATED_BY_RANKS,  # rank 0 of `loom train` logs it again when it loads the sources
        )
    return out


def prepare_data(
    cfg: DataConfig, progress: bool = True, explicit: frozenset[str] = frozenset()
) -> PreparedData:
    """Prepare ``cfg.source`` into ``cfg.prepared_dir`` (or the cache dir) unless already done; with
    ``data.sources``, every source (:func:`prepare_sources`), returning the first.

    A file that cannot be written (disk full, permissions) is refused in one line naming it. An
    existing ``data.prepared_dir`` prepared with other settings is reused with a one-line warning, or
    refused when one of them is among ``explicit`` (the ``data.*`` fields given on the command line:
    a config file's or preset's own values are not a request to prepare again)."""
    if cfg.sources:  # data.prepared_dir is not used: each source has its own cache directory
        return prepare_sources(cfg, progress)[0]
    if cfg.prepared_dir and (Path(cfg.prepared_dir).expanduser() / META).is_file():
        return _reuse(Path(cfg.prepared_dir).expanduser(), cfg, explicit)
    key = cache_key(cfg)
    final = Path(cfg.prepared_dir).expanduser() if cfg.prepared_dir else default_dir(cfg, key)
    if (final / META).is_file():
        return PreparedData.load(final)
    field = _dir_field(cfg)
    if final.exists() and not final.is_dir():
        raise ConfigError(f"{field}: {str(final)!r} is a file, not a directory")
    if final.is_dir() and any(final.iterdir()):
        raise ConfigError(f"{field}: {str(final)!r} is not empty and holds no {META}")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(final)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}{_TMP_TAG}{_owner()}-"))
    except OSError as e:
        raise _unwritable(e, final, field) from None
    try:
        _build(cfg, key, tmp, progress)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is a shared cache entry
        try:
            os.rename(tmp, final)  # atomic; fails if another process created a non-empty final
        except OSError:
            if not (final / META).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _unwritable(e, final, field) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PreparedData.load(final)


def _dir_field(cfg: DataConfig) -> str:
    """What chose the directory a prepare writes: ``data.prepared_dir``, else the cache root's
    ``LOOM_CACHE_DIR`` (or its default)."""
    if cfg.prepared_dir:
        return "data.prepared_dir"
    if os.environ.get("LOOM_CACHE_DIR"):
        return "LOOM_CACHE_DIR (the data cache; or set data.prepared_dir)"
    return "the data cache ~/.cache/loom (set LOOM_CACHE_DIR or data.prepared_dir)"


def _unwritable(e: OSError, final: Path, field: str) -> ConfigError:
    """One line naming the file a prepare could not write (and the directory it was preparing)."""
    where = e.filename or final
    return ConfigError(
        f"{field}: cannot write {where}: {e.strerror or e} (preparing {final}); nothing was kept"
    )


# cache_key entries that are data.* fields of another name; "format" (the file format's version) and
# "corpus" (the source's fingerprint) are none
_KEY_FIELDS = {
    "data_format": "format",
    "format": "",
    "corpus": "",
    "labels": "",
    "reading": "",
    "template": "",
}


def _reuse(final: Path, cfg: DataConfig, explicit: frozenset[str] = frozenset()) -> PreparedData:
    """Load an explicit ``data.prepared_dir``; warn if it was prepared from other settings, refuse it
    if one of them is a field given explicitly (``explicit``: ``data.*`` names), which the prepared
    data would silently override."""
    data = PreparedData.load(final)
    try:
        key = cache_key(cfg)
    except ConfigError:  # the source may be gone; the prepared data is what was asked for
        return data
    old = data.meta().get("key", {})
    changed = [k for k in key if old.get(k) != key[k]]
    for k in changed:
        name = _KEY_FIELDS.get(k, k)
        if k == "source" and "corpus" not in changed:
            continue  # the same corpus, named by another path
        if name and f"data.{name}" in explicit:
            raise ConfigError(
                f"data.{name}: {key[k]!r} was given, but data.prepared_dir {str(final)!r} was prepared with "
                f"{old.get(k)!r}; give a new data.prepared_dir to prepare it, or leave data.{name} out"
            )
    line = f"data.prepared_dir: reusing {str(final)!r}, prepared with different {', '.join(changed)}"
    if (
        changed and line not in _SAID
    ):  # once per process; a rank of Loom's launcher leaves it out (loom.notes)
        _SAID.add(line)
        log.warning("%s", line, extra=LAUNCHER_SAYS)
    return data


def _build(cfg: DataConfig, key: dict[str, Any], out: Path, progress: bool) -> None:
    """Read, split, tokenize and write everything into ``out``, streaming (see :mod:`loom.data.stream`):
    one pass measures the documents, one trains the tokenizer (unless given), one encodes. Documents
    stream through as pieces (:func:`~loom.data.corpus.iter_pieces`), so memory is flat in the size
    of the corpus and of its largest document."""
    if cfg.format != "text":
        return _build_examples(cfg, key, out, progress)
    t0 = time.perf_counter()

    def pieces() -> Iterator[tuple[str, bool]]:
        return iter_pieces(
            cfg.source, cfg.text_field, cfg.max_corpus_mb, cfg.errors, stats, cfg.doc_separator
        )

    stats = DecodeStats()
    log_, n_bytes, n_chars = LengthLog(out / ".lengths"), 0, 0  # characters of each document, on disk
    bar = tqdm(desc="measure", unit="B", unit_scale=True, disable=not progress, leave=False)
    for text, end in pieces():
        n_chars += len(text)
        if end:
            log_.append(n_chars)
            n_chars = 0
        size = len(text.encode("utf-8"))
        n_bytes += size
        bar.update(size)
    bar.close()
    lengths = log_.close()
    warn_replaced(cfg.source, stats)
    skipped = dict(stats.skipped)  # null and empty records, counted once (this pass)
    if not len(lengths):
        null, empty = skipped["null"], skipped["empty"]
        why = f" (its records' text is null in {null} and empty in {empty})" if null or empty else ""
        raise ConfigError(f"data.source: {cfg.source!r} holds no text{why}")
    warn_skipped(stats)
    cut, unread = stats.cut, unread_files(cfg.source)
    note_cut(cut)  # said where the data is prepared (loom prepare, loom train's launcher); meta.json keeps it
    note_unread(cfg.source, unread)
    if cfg.doc_separator and len(lengths) <= len(source_files(cfg.source)):
        log.warning(
            "data.doc_separator %r split no file of %s into documents (on a command line, write "
            "$'\\n\\n' for two line breaks)",
            cfg.doc_separator,
            cfg.source,
        )
    plan = split_plan(lengths, cfg.val_fraction)
    del lengths
    os.remove(out / ".lengths")
    stats = DecodeStats()  # counted once above
    if cfg.tokenizer:
        tok = load_tokenizer(cfg.tokenizer)
    else:
        train = ((text, end) for split, text, end in split_stream(pieces(), plan) if split == "train")
        tok = train_pieces(train, cfg.vocab_size, progress)
    try:
        tok.save(str(out / "tokenizer.json"))
    except Exception as e:  # the Rust side raises a bare Exception (disk full, permissions)
        raise OSError(None, str(e), str(out / "tokenizer.json")) from None
    vocab = tok.get_vocab_size()
    dtype = token_dtype(vocab)
    eot = eot_id(tok, cfg.tokenizer)
    bos = start_ids(tok, eot) if cfg.bos == "auto" else ()
    writers: dict[Split, TokenWriter] = {}
    try:
        writers = {name: TokenWriter(out / f"{name}.bin") for name in ("train", "val")}
        encode_stream(
            tok,
            split_stream(pieces(), plan),
            writers,
            eot,
            dtype,
            cfg.workers or default_workers(),
            total_bytes=n_bytes,
            progress=progress,
            bos=bos,
        )
        digests = {name: w.close() for name, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    extra = {
        "corpus_mb": n_bytes / 1e6,
        "skipped_records": skipped,
        "corpus_cut": cut,
        "unread_files": unread,
        "bos_ids": list(bos),
    }
    _write_meta(out, cfg, key, t0, (vocab, dtype, eot), writers, digests, extra)


def _write_meta(
    out: Path,
    cfg: DataConfig,
    key: dict[str, Any],
    t0: float,
    vocab_dtype_eot: tuple[int, Any, int],
    writers: Mapping[Any, Any],
    digests: Mapping[Any, str],
    extra: dict[str, Any],
) -> None:
    """``meta.json`` of a prepared directory (written last: its presence means the data is whole):
    counts, SHA-256 of every file and of sampled blocks, max token ids, the config and cache key."""
    vocab, dtype, eot = vocab_dtype_eot
    train, val = writers["train"], writers["val"]
    meta = {
        "format": FORMAT_VERSION,
        "source": cfg.source,
        "vocab_size": vocab,
        "dtype": dtype.name,
        "eot_id": eot,
        "n_train_tokens": train.n_tokens,
        "n_val_tokens": val.n_tokens,
        "n_train_docs": train.n_docs,
        "n_val_docs": val.n_docs,
        **extra,
        "sha256": {
            "train.bin": digests["train"],
            "val.bin": digests["val"],
            "tokenizer.json": _sha256(out / "tokenizer.json"),
        },
        "sampled_sha256": {n: sampled_sha256(out / n) for n in TOKEN_FILES},
        "sample": {"blocks": SAMPLE_BLOCKS, "block_bytes": SAMPLE_BYTES},
        "max_id": {"train.bin": train.max_id, "val.bin": val.max_id},
        "prepare_seconds": round(time.perf_counter() - t0, 2),
        "config": asdict(cfg),
        "key": key,
    }
    _write_durable(out / META, json.dumps(meta, indent=2).encode())


def _build_examples(cfg: DataConfig, key: dict[str, Any], out: Path, progress: bool) -> None:
    """Chat / prompt_completion records (:mod:`loom.data.chat`): tokens and a trained-or-not mask per
    token; the last ``val_fraction`` of the examples (at least one) are validation."""
    t0 = time.perf_counter()
    files = source_files(cfg.source)
    render = (template_render(cfg.tokenizer) if cfg.tokenizer else None) or builtin_render

    n, cut = _count_examples(files, cfg.format, render, cfg.max_corpus_mb)

    def examples() -> Iterator[tuple[str, list[tuple[int, int]]]]:
        records = (segments(rec, where, cfg.format, render) for where, rec in read_records(files))
        return itertools.islice(records, n)

    note_cut(cut)
    unread = unread_files(cfg.source)
    note_unread(cfg.source, unread)
    if n < 2:
        raise ConfigError(
            f"data.source: {cfg.source!r} holds {n} example(s); at least 2 are needed (train and val)"
        )
    k = n - min(max(1, round(n * cfg.val_fraction)), n - 1)
    if cfg.tokenizer:
        tok = load_tokenizer(cfg.tokenizer)
    else:
        tok = train_tokenizer(
            (text for i, (text, _) in enumerate(examples()) if i < k), cfg.vocab_size, progress, k
        )
    tok.save(str(out / "tokenizer.json"))
    vocab, eot = tok.get_vocab_size(), eot_id(tok, cfg.tokenizer)
    dtype = token_dtype(vocab)
    bos = start_ids(tok, eot) if cfg.bos == "auto" else ()
    enc = ExampleEncoder(tok, eot, dtype, cfg.seq_len + 1, cfg.overlong, cfg.train_on_prompt, bos)
    names = ("train", "val", "train.mask", "val.mask")
    writers: dict[str, TokenWriter] = {}
    try:
        writers = {name: TokenWriter(out / f"{name}.bin") for name in names}
        group: list[tuple[str, list[tuple[int, int]]]] = []
        for i, example in enumerate(examples()):
            group.append(example)
            if i == k - 1 or i == n - 1 or sum(len(t) for t, _ in group) >= CHUNK_CHARS:
                ids, mask, kept = enc(group)
                split = "train" if i < k else "val"
                writers[split].write(ids, kept)
                writers[f"{split}.mask"].write(mask, kept)
                group = []
        digests = {name: w.close() for name, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    for split in ("train", "val"):
        if not writers[split].n_tokens:
            why = "over" if cfg.overlong == "drop" else "cut before any trained token at"
            raise ConfigError(
                f"data.overlong: no {split} examples left in {cfg.source!r}: {enc.dropped} dropped ({why} "
                f"data.seq_len + 1 = {cfg.seq_len + 1} tokens); raise data.seq_len"
            )
    log.info(
        "%s: %d examples (%d train, %d val); over %d tokens: %d truncated, %d dropped",
        cfg.format,
        n,
        k,
        n - k,
        cfg.seq_len + 1,
        enc.truncated,
        enc.dropped,
    )
    _write_meta(
        out,
        cfg,
        key,
        t0,
        (vocab, dtype, eot),
        writers,
        digests,
        {
            "data_format": cfg.format,
            "bos_ids": list(bos),
            "corpus_cut": cut,
            "unread_files": unread,
            "overlong": {"mode": cfg.overlong, "truncated": enc.truncated, "dropped": enc.dropped},
            "trained_tokens": {"train": int(writers["train.mask"].sum), "val": int(writers["val.mask"].sum)},
            "mask_sha256": {"train.mask.bin": digests["train.mask"], "val.mask.bin": digests["val.mask"]},
        },
    )


def _count_examples(
    files: list[Path], fmt: str, render: Callable[..., str], max_mb: float
) -> tuple[int, dict[str, Any] | None]:
    """(examples read, what ``data.max_corpus_mb`` left unread, for :func:`note_cut`): records are read
    whole, up to and including the one whose rendered text reaches ``max_mb`` MB (10^6 bytes), as the
    text format reads its pieces up to the cap."""
    budget, n, read = int(max_mb * 1e6), 0, 0
    for i, path in enumerate(files):
        records = read_records([path])
        for where, rec in records:
            read += len(segments(rec, where, fmt, render)[0].encode("utf-8"))
            n += 1
            if budget and read >= budget:
                more = next(records, None)
                over = _rendered_bytes(more, fmt, render) if more else 0
                later = files[i + 1 :]
                if not more and not later:
                    return n, None
                return n, {
                    "max_corpus_mb": max_mb,
                    "read_mb": read / 1e6,
                    "at_least_mb": (read + over) / 1e6,
                    "stopped": f"after {where}" if more else f"at the end of {path}",
                    "files_not_read": len(later),
                    "files_not_read_mb": sum(p.stat().st_size for p in later) / 1e6,
                }
    return n, None


def _rendered_bytes(record: tuple[str, dict[str, Any]], fmt: str, render: Callable[..., str]) -> int:
    """Bytes of a record's rendered text; 1 (there is more) for one the format refuses."""
    try:
        return len(segments(record[1], record[0], fmt, render)[0].encode("utf-8"))
    except ConfigError:
        return 1


def split_documents(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """(train, val) of a list of documents by :func:`~loom.data.stream.split_plan` (the streaming
    preparation applies the same plan without holding the documents)."""
    parts: dict[Split, list[str]] = {"train": [], "val": []}
    plan = split_plan([len(d) for d in docs], val_fraction)
    for split, text, _ in split_stream(((d, True) for d in docs), plan):
        parts[split].append(text)
    return parts["train"], parts["val"]


def _write_durable(path: Path, raw: bytes) -> None:
    try:
        with path.open("wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _owner() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _remove_stale_tmp(final: Path) -> None:
    """Delete temp dirs of earlier prepares of ``final`` on this host whose process is gone."""
    host = socket.gethostname()
    for p in final.parent.glob(f".{final.name}{_TMP_TAG}{host}-*"):
        pid_str = p.name[len(f".{final.name}{_TMP_TAG}{host}-") :].split("-", 1)[0]
        if is_whole(pid_str) and not _alive(int(pid_str)):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
