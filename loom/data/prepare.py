"""Prepare a corpus once: tokenizer.json, train.bin, val.bin, meta.json in one directory.

The directory is built under a temporary name next to its final place and renamed into
place in one step, so a concurrent or killed prepare never leaves a half-written directory;
if another process finished first, its directory is kept. Preparing again is a no-op.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loom.config import ConfigError, DataConfig
from loom.data.corpus import STDLIB, fingerprint, read_documents
from loom.data.tokenizer import encode_documents, eot_id, load_tokenizer, train_tokenizer

FORMAT_VERSION = 1
META = "meta.json"
_TMP_TAG = ".tmp-"


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
    def load(cls, dir: str | Path) -> PreparedData:
        """Read ``meta.json`` of a prepared directory and check its files are all there."""
        d = Path(dir).expanduser()
        meta_path = d / META
        if not meta_path.is_file():
            raise ConfigError(f"data.prepared_dir: {str(d)!r} holds no {META}; run `loom prepare` first")
        meta = json.loads(meta_path.read_text())
        data = cls(
            dir=d,
            train_path=d / "train.bin",
            val_path=d / "val.bin",
            tokenizer_path=d / "tokenizer.json",
            vocab_size=int(meta["vocab_size"]),
            n_train_tokens=int(meta["n_train_tokens"]),
            n_val_tokens=int(meta["n_val_tokens"]),
            dtype=str(meta["dtype"]),
            eot_id=int(meta["eot_id"]),
        )
        itemsize = np.dtype(data.dtype).itemsize
        for path, n in ((data.train_path, data.n_train_tokens), (data.val_path, data.n_val_tokens)):
            if not path.is_file():
                raise ConfigError(
                    f"data.prepared_dir: {str(path)!r} is missing; delete {str(d)!r} and prepare again"
                )
            if path.stat().st_size != n * itemsize:
                raise ConfigError(
                    f"data.prepared_dir: {str(path)!r} has {path.stat().st_size} bytes, meta.json says "
                    f"{n} tokens of {data.dtype}; delete {str(d)!r} and prepare again"
                )
        if not data.tokenizer_path.is_file():
            raise ConfigError(f"data.prepared_dir: {str(data.tokenizer_path)!r} is missing")
        return data

    def meta(self) -> dict[str, Any]:
        """The full ``meta.json`` contents."""
        return json.loads((self.dir / META).read_text())


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size < 2**16 else np.uint32)


def cache_key(cfg: DataConfig) -> dict[str, Any]:
    """Everything the prepared bytes depend on (also checks the source exists)."""
    tok = ""
    if cfg.tokenizer:
        tok_path = Path(cfg.tokenizer).expanduser().resolve()
        tok_path = tok_path / "tokenizer.json" if tok_path.is_dir() else tok_path
        if not tok_path.is_file():
            raise ConfigError(f"data.tokenizer: {cfg.tokenizer!r} does not exist")
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
    }


def cache_root() -> Path:
    """``$LOOM_CACHE_DIR`` or ``~/.cache/loom``."""
    return Path(os.environ.get("LOOM_CACHE_DIR") or "~/.cache/loom").expanduser()


def default_dir(cfg: DataConfig, key: dict[str, Any] | None = None) -> Path:
    """``<cache>/data/<name>-<vocab>-<hash of the cache key>``."""
    key = key if key is not None else cache_key(cfg)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    plain = [part for part in Path(cfg.source).parts if not glob.has_magic(part)]
    stem = Path(plain[-1]).stem if plain else "data"
    stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in stem)[:32] or "data"
    return cache_root() / "data" / f"{stem}-{cfg.vocab_size}-{digest}"


def prepare_data(cfg: DataConfig, progress: bool = True) -> PreparedData:
    """Prepare ``cfg.source`` into ``cfg.prepared_dir`` (or the cache dir) unless already done."""
    if cfg.prepared_dir and (Path(cfg.prepared_dir).expanduser() / META).is_file():
        return _reuse(Path(cfg.prepared_dir).expanduser(), cfg)
    key = cache_key(cfg)
    final = Path(cfg.prepared_dir).expanduser() if cfg.prepared_dir else default_dir(cfg, key)
    if (final / META).is_file():
        return PreparedData.load(final)
    if final.is_dir() and any(final.iterdir()):
        raise ConfigError(f"data.prepared_dir: {str(final)!r} is not empty and holds no {META}")
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(final)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}{_TMP_TAG}{_owner()}-"))
    try:
        _build(cfg, key, tmp, progress)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is a shared cache entry
        try:
            os.rename(tmp, final)  # atomic; fails if another process created a non-empty final
        except OSError:
            if not (final / META).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PreparedData.load(final)


def _reuse(final: Path, cfg: DataConfig) -> PreparedData:
    """Load an explicit ``data.prepared_dir``; warn if it was prepared from other settings."""
    data = PreparedData.load(final)
    try:
        key = cache_key(cfg)
    except ConfigError:  # the source may be gone; the prepared data is what was asked for
        return data
    old = data.meta().get("key", {})
    changed = [k for k in key if old.get(k) != key[k]]
    if changed:
        warnings.warn(
            f"data.prepared_dir: reusing {str(final)!r}, prepared with different {', '.join(changed)}",
            stacklevel=3,
        )
    return data


def _build(cfg: DataConfig, key: dict[str, Any], out: Path, progress: bool) -> None:
    """Read, split, tokenize and write everything into ``out``."""
    t0 = time.perf_counter()
    docs = read_documents(cfg.source, cfg.text_field, cfg.max_corpus_mb, progress, cfg.errors)
    train_docs, val_docs = split_documents(docs, cfg.val_fraction)
    if cfg.tokenizer:
        tok = load_tokenizer(cfg.tokenizer)
    else:
        tok = train_tokenizer(train_docs, cfg.vocab_size, progress)
    tok.save(str(out / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    dtype = token_dtype(vocab)
    eot = eot_id(tok)
    counts, digests = {}, {}
    for name, part in (("train", train_docs), ("val", val_docs)):
        chunks = encode_documents(tok, part, eot, dtype=dtype, progress=progress, desc=f"encode {name}")
        counts[name], digests[name] = _write_bin(out / f"{name}.bin", chunks)
    meta = {
        "format": FORMAT_VERSION,
        "source": cfg.source,
        "vocab_size": vocab,
        "dtype": dtype.name,
        "eot_id": eot,
        "n_train_tokens": counts["train"],
        "n_val_tokens": counts["val"],
        "n_train_docs": len(train_docs),
        "n_val_docs": len(val_docs),
        "corpus_mb": sum(len(d.encode("utf-8")) for d in docs) / 1e6,
        "sha256": {"train.bin": digests["train"], "val.bin": digests["val"]},
        "prepare_seconds": round(time.perf_counter() - t0, 2),
        "config": asdict(cfg),
        "key": key,
    }
    _write_durable(out / META, json.dumps(meta, indent=2).encode())


def split_documents(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """(train, val): the last ``val_fraction`` of the documents (at least one) are validation.

    When that would put more than twice ``val_fraction`` of the text into validation (one
    document, or a few of very uneven size), the corpus is instead cut at ``1 - val_fraction``
    of its characters, at a line break inside the document that straddles that point.
    """
    total = sum(len(d) for d in docs)
    n_val = min(max(1, round(len(docs) * val_fraction)), len(docs) - 1)
    if n_val >= 1 and sum(len(d) for d in docs[-n_val:]) <= 2 * val_fraction * total:
        return docs[:-n_val], docs[-n_val:]
    pos, k = int(total * (1.0 - val_fraction)), 0
    while pos >= len(docs[k]):  # find the document holding character ``pos``
        pos -= len(docs[k])
        k += 1
    nl = docs[k].rfind("\n", 0, pos)
    cut = nl + 1 if nl >= 0 else pos
    head, tail = docs[k][:cut], docs[k][cut:]
    train = docs[:k] + ([head] if head else [])
    val = [tail, *docs[k + 1 :]]
    if not train:
        raise ConfigError("data.source: the corpus is too small to hold out a validation split")
    return train, val


def _write_bin(path: Path, chunks: Any) -> tuple[int, str]:
    """Write token chunks to ``path``; return (token count, sha256 of the bytes)."""
    h, n = hashlib.sha256(), 0
    with path.open("wb") as f:
        for chunk in chunks:
            raw = chunk.tobytes()
            f.write(raw)
            h.update(raw)
            n += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return n, h.hexdigest()


def _write_durable(path: Path, raw: bytes) -> None:
    with path.open("wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())


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
        if pid_str.isdigit() and not _alive(int(pid_str)):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
