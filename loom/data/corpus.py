"""Corpus discovery and reading.

A corpus is a list of documents (strings). ``source = "stdlib"`` is the embedded default: the
Python standard library sources that ship with the interpreter, so every fresh machine can
train offline. Otherwise ``source`` is a file, a directory or a glob of ``.txt`` (one file =
one document, or the parts between ``data.doc_separator``; read in blocks), ``.jsonl`` or
``.jsonl.gz`` (one record = one document, text under ``text_field``), ``.json`` (JSON Lines, as
``datasets``' ``to_json`` writes it, or one array of records, read whole), ``.parquet`` (one row = one document,
column ``text_field``), loose ``.arrow`` files, or ``datasets`` ``save_to_disk`` directories (read
through ``datasets.load_from_disk``: the files its ``state.json`` names, not the ``cache-*.arrow``
files ``.map()`` leaves beside them; a saved ``DatasetDict`` is refused, naming its splits). A
record whose text is null or empty is skipped and counted (:class:`DecodeStats`, reported by
:func:`warn_skipped`). Files are read in sorted path order until ``max_mb`` megabytes (10^6 bytes of
UTF-8) of text, so a corpus is deterministic; where that cap stops reading is said in one line
(:func:`note_cut`), and so are the files of a directory that are of no format read (:func:`note_unread`).
"""

from __future__ import annotations

import codecs
import errno
import glob
import gzip
import hashlib
import json
import logging
import os
import re
import stat
import sys
import sysconfig
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loom.config import ConfigError

FORMATS = (".txt", ".jsonl", ".jsonl.gz", ".json", ".parquet", ".arrow")
JSON_FORMATS = (".jsonl", ".jsonl.gz", ".json")  # JSON Lines; a .json file may hold one array instead


def supported(p: Path) -> bool:
    """A file of one of :data:`FORMATS` (a loose ``.arrow`` file; a ``datasets`` save_to_disk directory
    is read whole, :func:`saved_dataset`)."""
    return p.name.endswith(FORMATS)


def saved_dataset(d: Path) -> bool:
    """``d`` is a directory a ``datasets.Dataset.save_to_disk`` wrote (``state.json`` names its data
    files; ``datasets.load_from_disk`` tells a Dataset from a DatasetDict by the same files)."""
    return (d / "state.json").is_file() and (d / "dataset_info.json").is_file()


def _refuse_dataset_dict(d: Path) -> None:
    """A ``DatasetDict.save_to_disk`` directory holds several splits; training on all of them at once
    (a test split included) is never what was meant: refused, naming the splits."""
    if not (d / "dataset_dict.json").is_file():
        return
    splits = list(load_saved(d).keys())
    pick = "train" if "train" in splits else splits[0] if splits else "SPLIT"
    raise ConfigError(
        f"data.source: {d} is a datasets DatasetDict with splits {', '.join(map(repr, splits))}; Loom "
        f"reads one split: point data.source (or a [[data.sources]] path) at its directory, e.g. {d / pick}"
    )


def load_saved(path: Path) -> Any:
    """``datasets.load_from_disk`` of a save_to_disk directory, or ``Dataset.from_file`` of a loose
    ``.arrow`` file (memory-mapped); one it cannot read is one line."""
    try:
        from datasets import Dataset, load_from_disk
    except ImportError:
        raise ConfigError(
            f"data.source: reading {path} needs the datasets package (pip install datasets)"
        ) from None
    try:
        return load_from_disk(str(path)) if path.is_dir() else Dataset.from_file(str(path))
    except Exception as e:  # datasets and pyarrow raise many kinds
        what = "datasets save_to_disk directory" if path.is_dir() else "Arrow file"
        raise ConfigError(f"data.source: {path} is not a readable {what} ({_first_line(e)})") from None


def _scan(root: Path) -> tuple[list[Path], list[Path]]:
    """(read, not read) files under ``root``: supported files, each ``save_to_disk`` directory as one
    entry (not its shards nor the cache files beside them), and the files of other formats; a
    ``DatasetDict`` anywhere under it is refused."""
    found: list[Path] = []
    other: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        _refuse_dataset_dict(d)
        if saved_dataset(d):
            found.append(d)
            dirnames[:] = []
            continue
        for n in filenames:
            if supported(d / n) and (d / n).is_file():
                found.append(d / n)
            elif (d / n).is_file():
                other.append(d / n)
    return sorted(found), sorted(other)


def _walk(root: Path) -> list[Path]:
    """Supported files under ``root`` (:func:`_scan`)."""
    return _scan(root)[0]


def unread_files(source: str) -> dict[str, Any] | None:
    """The files of a directory or glob ``data.source`` that are not read, being of no format of
    :data:`FORMATS` (``a.txt.gz``, ``b.jsonl.zst``): ``{"count", "examples"}`` (a few paths, relative to
    a directory), or None when there are none (or ``source`` is one file)."""
    src = os.path.expanduser(source)
    if source == STDLIB:
        return None
    if glob.has_magic(src):
        matches = sorted(Path(p) for p in glob.glob(src, recursive=True))
        read = set(_from_glob(matches))
        other = [
            m for m in matches if m.is_file() and m not in read and not any(r in m.parents for r in read)
        ]
        names = [m.as_posix() for m in other[:3]]
    elif os.path.isdir(src):
        other = _scan(Path(src))[1]
        names = [m.relative_to(src).as_posix() for m in other[:3]]
    else:
        return None
    return {"count": len(other), "examples": names} if other else None


def note_unread(source: str, unread: dict[str, Any] | None, extra: dict[str, Any] | None = None) -> None:
    """Log, in one line, the files of a directory or glob source that are not read (:func:`unread_files`)."""
    if unread:
        log.info(
            "data.source: %d file(s) in %s not read, of formats Loom does not read (e.g. %s); it reads "
            "%s files and datasets save_to_disk directories",
            unread["count"],
            source,
            ", ".join(unread["examples"]),
            ", ".join(FORMATS),
            extra=extra,
        )


def _from_glob(matches: list[Path]) -> list[Path]:
    """Supported files among ``matches`` and the ``save_to_disk`` directories matched or holding a
    matched ``.arrow`` shard (each once, read through ``datasets``)."""
    out: set[Path] = set()
    for p in matches:
        if p.is_dir():
            _refuse_dataset_dict(p)
            if saved_dataset(p):
                out.add(p)
        elif p.is_file() and supported(p):
            out.add(p.parent if p.suffix == ".arrow" and saved_dataset(p.parent) else p)
    return sorted(out)


STDLIB = "stdlib"
log = logging.getLogger("loom")
# Directories of the standard library that are tests, bundled apps, third-party packages or
# generated text rather than library code.
STDLIB_SKIP_DIRS = frozenset(
    {
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "pydoc_data",
        "ensurepip",
        "lib-dynload",
    }
)
STDLIB_SKIP_PREFIXES = ("_sysconfigdata",)  # machine-specific build settings


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The ``*.py`` files of the standard library (minus tests etc.), in sorted path order."""
    root = stdlib_root()
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py") and not name.startswith(STDLIB_SKIP_PREFIXES):
                p = Path(dirpath) / name
                found.append((p.relative_to(root).as_posix(), p))
    return [p for _, p in sorted(found)]


def find_files(source: str) -> list[Path]:
    """Files a non-stdlib ``data.source`` names, sorted. Raises ConfigError if none or unsupported."""
    src = os.path.expanduser(source)
    if glob.has_magic(src):
        matches = sorted(Path(p) for p in glob.glob(src, recursive=True))
        files = _from_glob(matches)
        plain = [p for p in matches if p.is_file()]
        if plain and not files:
            raise ConfigError(
                f"data.source: {source!r} matches only unsupported files (e.g. {plain[0].name}); "
                f"use {', '.join(FORMATS)}"
            )
    elif os.path.isdir(src):
        files = _walk(Path(src))
    elif os.path.isfile(src):
        p = Path(src)
        if not supported(p):
            raise ConfigError(
                f"data.source: unsupported format {p.suffix or '(none)'!r} of {source!r}; "
                f"use {', '.join(FORMATS)} or 'stdlib'"
            )
        files = [p]
    else:
        raise ConfigError(f"data.source: {source!r} {_not_readable(src)}")
    if not files:
        raise ConfigError(f"data.source: no {', '.join(FORMATS)} files found in {source!r}")
    return files


_SPECIAL = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _not_readable(src: str) -> str:
    """Why ``src``, neither a directory nor a regular file, cannot be read (the end of a one-line
    refusal): a FIFO, socket or device (never opened: a FIFO's reader waits for a writer forever),
    a symbolic link loop, a link to nothing, a path it has no permission to look at, or nothing there.
    Only ``stat`` and ``lstat`` look at it."""
    want = "want 'stdlib', a file, a directory or a glob"
    try:
        mode = os.stat(src).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"is a symbolic link loop (its links never reach a file); {want}"
        if isinstance(e, PermissionError):
            return f"cannot be looked at (permission denied on a directory above it); {want}"
        if os.path.islink(src):
            return f"is a symbolic link to {os.readlink(src)!r}, which does not exist; {want}"
        return f"does not exist ({want})"
    kind = next((f"is {name}, not" for test, name in _SPECIAL if test(mode)), "is not")
    return f"{kind} a regular file (Loom reads regular files only); {want}"


def source_files(source: str) -> list[Path]:
    """Files of ``data.source``: the stdlib sources or :func:`find_files`."""
    return stdlib_files() if source == STDLIB else find_files(source)


def fingerprint(source: str) -> str:
    """Short digest identifying the corpus content: interpreter version for the stdlib,
    (path, size, mtime) of every file otherwise. Changes when the inputs change."""
    h = hashlib.sha256()
    if source == STDLIB:
        h.update(f"{stdlib_root()}|{sys.version}".encode())
    else:
        for entry in find_files(source):  # a save_to_disk directory: each file in it
            for p in sorted(entry.iterdir()) if entry.is_dir() else [entry]:
                st = p.stat()
                h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


class DecodeStats:
    """What reading changed, reported after it: undecodable bytes replaced under ``data.errors =
    "replace"``, and records skipped because their text is null or empty (:func:`warn_skipped`)."""

    def __init__(self) -> None:
        self.replaced: dict[str, int] = {}
        self.skipped = {"null": 0, "empty": 0}  # records of .jsonl/.parquet/.arrow/save_to_disk
        self.first_skipped = ""  # where the first one is (file:line, or file row N)
        self.cut: dict[str, Any] | None = None  # where data.max_corpus_mb stopped reading (note_cut)

    def skip(self, text: str | bytes | None, where: str) -> None:
        """Count a record skipped at ``where`` because its text is null or empty (no document)."""
        self.skipped["null" if text is None else "empty"] += 1
        self.first_skipped = self.first_skipped or where


def _decode(raw: bytes, where: str, errors: str, stats: DecodeStats | None) -> str:
    """UTF-8 text of ``raw``; binary data (NUL bytes) and, unless ``errors == "replace"``, invalid
    UTF-8 raise one line naming ``where`` (a file, or file:line)."""
    if b"\x00" in raw[:8192]:
        raise ConfigError(
            f"data.source: {where} looks binary (NUL bytes), not text; remove it from the source"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if errors != "replace":
            raise ConfigError(
                f"data.source: {where} is not UTF-8 (byte {e.start}: {raw[e.start : e.start + 1]!r}); fix "
                "the file or set data.errors = replace"
            ) from None
    text = raw.decode("utf-8", errors="replace")
    if stats is not None:
        stats.replaced[where] = text.count("\ufffd")
    return text


TXT_BLOCK = 1 << 20  # bytes of a .txt file read at a time


def _read_txt(
    path: Path, errors: str, stats: DecodeStats | None, separator: str = "", block: int = TXT_BLOCK
) -> Iterator[tuple[str, bool]]:
    """Pieces ``(text, ends_document)`` of a ``.txt`` file read ``block`` bytes at a time, so memory is
    flat in the file's size: the file is one document, or with ``separator`` the parts of
    ``text.split(separator)``. Pieces are cut anywhere (:func:`loom.data.tokenizer.recut` cuts them
    again where tokens allow). Binary data and invalid UTF-8 are refused as by :func:`_decode`, naming
    the byte offset in the file."""
    # utf-8-sig: a leading byte order mark (editors on Windows write one) is no text of the document
    decoder = codecs.getincrementaldecoder("utf-8-sig")("replace" if errors == "replace" else "strict")
    split = _separator(separator)
    keep = max(len(separator.replace("\r\n", "\n").replace("\n", "\r\n")) - 1, 0)  # may begin one
    carry, offset, replaced = "", 0, 0
    with path.open("rb") as f:
        while True:
            raw = f.read(block)
            if not offset and b"\x00" in raw[:8192]:
                raise ConfigError(
                    f"data.source: {path} looks binary (NUL bytes), not text; remove it from the source"
                )
            held = len(decoder.getstate()[0])  # bytes of a character split by the previous block
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise ConfigError(
                    f"data.source: {path} is not UTF-8 (byte {offset - held + e.start}: "
                    f"{e.object[e.start : e.start + 1]!r}); fix the file or set data.errors = replace"
                ) from None
            if errors == "replace" and stats is not None:  # U+FFFD written, less the file's own
                replaced += max(text.count("\ufffd") - raw.count("\ufffd".encode()), 0)
                if replaced:
                    stats.replaced[str(path)] = replaced
            buf = carry + text if carry else text
            if split is not None:
                *docs, buf = split(buf)
                for doc in docs:
                    yield doc, True
            if not raw:
                break
            cut = len(buf) - keep
            if cut > 0:
                yield buf[:cut], False
            carry = buf[max(cut, 0) :]
            offset += len(raw)
    yield buf, True


def _separator(separator: str) -> Callable[[str], list[str]] | None:
    """How ``data.doc_separator`` splits text: a line break in it matches ``\n`` or ``\r\n`` (a file
    written on Windows: ``"\n\n"`` splits its ``\r\n\r\n``), as Python's text mode reads lines."""
    if not separator:
        return None
    if "\n" not in separator:
        return lambda text: text.split(separator)
    pattern = re.compile(re.escape(separator.replace("\r\n", "\n")).replace("\n", "\r?\n"))
    return pattern.split


def parse_json_line(raw: str | bytes, where: str) -> Any:
    """One JSON line; invalid JSON, nesting deeper than the parser goes, or a lone UTF-16 surrogate
    anywhere in it (``"\\ud800"``: valid JSON, not Unicode text) is one line naming ``where``."""
    try:
        record = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        detail = f"column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise ConfigError(f"data.source: {where} is not valid JSON ({detail})") from None
    except RecursionError:
        raise ConfigError(f"data.source: {where} is JSON nested too deeply to read") from None
    bad = lone_surrogate(record)
    if bad is not None:
        raise ConfigError(f"data.source: {where} holds a lone surrogate {bad}, which is not Unicode text")
    return record


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """Where a string inside ``value`` holds a lone UTF-16 surrogate (``"\\ud800"`` decodes to one;
    a valid pair decodes to one character), as ``\\uXXXX in field F at character N``; None if none."""
    stack = [(path, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            m = _SURROGATE.search(v)
            if m is not None:
                field = f" in field {where!r}" if where else ""
                return f"\\u{ord(m.group()):04x}{field} at character {m.start()}"
        elif isinstance(v, dict):
            stack += [(f"{where}.{k}" if where else str(k), x) for k, x in v.items()]
        elif isinstance(v, list):
            stack += [(f"{where}[{i}]", x) for i, x in enumerate(v)]
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")


def json_records(
    path: Path, errors: str = "strict", stats: DecodeStats | None = None
) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` of a JSON file of :data:`JSON_FORMATS`: one record per non-blank line
    (JSON Lines, what ``datasets``' ``to_json`` writes, also as ``.json``), or a ``.json`` file that
    is one array of records (Alpaca's; read whole). ``where``: ``file:line`` or ``file[index]``."""
    if path.suffix == ".json" and _starts_with(path, b"["):
        text = _decode(path.read_bytes(), str(path), errors, stats).removeprefix("\ufeff")
        records = parse_json_line(text, str(path))
        if not isinstance(records, list):  # pragma: no cover - a file starting with "[" holds an array
            raise ConfigError(f"data.source: {path} is not JSON Lines or one array of records")
        yield from ((f"{path}[{i}]", r) for i, r in enumerate(records))
        return
    lineno = 0
    with gzip.open(path, "rb") if path.name.endswith(".gz") else path.open("rb") as f:
        lines = iter(f)
        while True:
            try:
                raw = next(lines)
            except StopIteration:
                return
            except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # a truncated or damaged .gz
                raise ConfigError(
                    f"data.source: {path} is truncated or corrupt after line {lineno} ({_first_line(e)})"
                ) from None
            lineno += 1
            line = _decode(raw, f"{path}:{lineno}", errors, stats)
            if line.strip():
                yield f"{path}:{lineno}", parse_json_line(line, f"{path}:{lineno}")


def _starts_with(path: Path, prefix: bytes) -> bool:
    """The file's first non-whitespace bytes (after a UTF-8 byte order mark) are ``prefix``."""
    with path.open("rb") as f:
        head = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()
    return head.startswith(prefix)


def _read_jsonl(
    path: Path, text_field: str, errors: str = "strict", stats: DecodeStats | None = None
) -> Iterator[str]:
    """Field ``text_field`` of every record (:func:`json_records`); null and empty ones are counted in
    ``stats`` and skipped."""
    stats = stats if stats is not None else DecodeStats()
    for where, record in json_records(path, errors, stats):
        if not isinstance(record, dict) or text_field not in record:
            raise ConfigError(f"data.source: {where} has no field {text_field!r} (set data.text_field)")
        text = record[text_field]
        if text is not None and not isinstance(text, str):
            raise ConfigError(
                f"data.source: {where} field {text_field!r} holds a {type(text).__name__}, not a string"
            )
        if text:
            yield text
        else:
            stats.skip(text, where)


def _read_parquet(
    path: Path, text_field: str, errors: str = "strict", stats: DecodeStats | None = None
) -> Iterator[str]:
    """Rows of column ``text_field``: strings, or binary decoded as UTF-8 text; a file pyarrow cannot
    read, a column of another type or a row that cannot be decoded is refused naming the file and row;
    null and empty rows are counted in ``stats`` and skipped."""
    import pyarrow as pa

    stats = stats if stats is not None else DecodeStats()
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"data.source: {path} is not a readable parquet file ({_first_line(e)})") from None
    if text_field not in pf.schema_arrow.names:
        raise ConfigError(
            f"data.source: {path} has no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}; "
            "set data.text_field)"
        )
    kind = pf.schema_arrow.field(text_field).type
    binary = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
    if not (binary or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ConfigError(
            f"data.source: {path} column {text_field!r} holds {kind}, not text (string or binary)"
        )
    row = 0
    batches = pf.iter_batches(columns=[text_field], batch_size=1024)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as e:
            raise ConfigError(f"data.source: {path} cannot be read at row {row} ({_first_line(e)})") from None
        for text in batch.column(0).to_pylist():
            if text:
                yield _decode(text, f"{path} row {row}", errors, stats) if binary else text
            else:
                stats.skip(text, f"{path} row {row}")
            row += 1


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _read_arrow(path: Path, text_field: str, stats: DecodeStats | None = None) -> Iterator[str]:
    """Rows of column ``text_field`` of a loose Arrow file, or of a ``save_to_disk`` directory (through
    ``datasets.load_from_disk``), memory-mapped by ``datasets``; null and empty rows are counted in
    ``stats`` and skipped."""
    ds = load_saved(path)
    if text_field not in ds.column_names:
        raise ConfigError(
            f"data.source: {path} has no column {text_field!r} (columns: {', '.join(ds.column_names)}; "
            "set data.text_field)"
        )
    stats = stats if stats is not None else DecodeStats()
    row = 0
    for batch in ds.with_format(None).select_columns([text_field]).iter(batch_size=1024):
        for text in batch[text_field]:
            if text is not None and not isinstance(text, str):
                raise ConfigError(
                    f"data.source: {path} row {row} column {text_field!r} holds a "
                    f"{type(text).__name__}, not a string"
                )
            if text:
                yield text
            else:
                stats.skip(text, f"{path} row {row}")
            row += 1


def _iter_file(
    path: Path, text_field: str, errors: str, stats: DecodeStats, separator: str = ""
) -> Iterator[tuple[str, bool]]:
    """``(text, ends_document)`` pieces of one file (a record of the other formats is one piece)."""
    if path.name.endswith(JSON_FORMATS):
        return _whole(_read_jsonl(path, text_field, errors, stats))
    if path.suffix == ".arrow" or path.is_dir():  # a loose .arrow file or a save_to_disk directory
        return _whole(_read_arrow(path, text_field, stats))
    if path.suffix == ".parquet":
        return _whole(_read_parquet(path, text_field, errors, stats))
    return _read_txt(path, errors, stats, separator)  # .txt and the stdlib's .py


def _whole(docs: Iterator[str]) -> Iterator[tuple[str, bool]]:
    return ((text, True) for text in docs)


def iter_pieces(
    source: str,
    text_field: str = "text",
    max_mb: float = 24.0,
    errors: str = "strict",
    stats: DecodeStats | None = None,
    separator: str = "",
) -> Iterator[tuple[str, bool]]:
    """The documents of ``source`` in deterministic order as ``(text, ends_document)`` pieces, at most
    ``max_mb`` MB of UTF-8 in total (``max_mb <= 0``: no cap). A ``.txt`` file is one document, or
    with ``separator`` (``data.doc_separator``) its parts between separators; it is read in blocks
    (:data:`TXT_BLOCK`), so memory is bounded by a block, not by a document or the corpus.

    The document that crosses the cap is cut at the cap; empty documents are dropped (every piece
    yielded belongs to a document with some text; its last piece may be empty; records whose text
    is null or empty are counted in ``stats``, :func:`warn_skipped`; where the cap stopped reading is
    ``stats.cut``, :func:`note_cut`). Binary files are
    refused; invalid UTF-8 too unless ``errors == "replace"`` (the stdlib corpus always replaces: a
    few of its files declare other encodings), counted in ``stats``.
    """
    files = source_files(source)
    errors = "replace" if source == STDLIB else errors
    separator = "" if source == STDLIB else separator
    stats = stats if stats is not None else DecodeStats()
    budget = int(max_mb * 1e6) if max_mb > 0 else -1
    for i, path in enumerate(files):
        try:
            open_doc = False  # a piece of the current document was yielded
            docs = 0  # documents of this file yielded whole
            pieces = _iter_file(path, text_field, errors, stats, separator)
            for text, end in pieces:
                if budget >= 0:
                    raw = text.encode("utf-8")
                    if len(raw) >= budget:
                        doc = (
                            f"document {docs + 1} of {path}" if separator or not _is_txt(path) else str(path)
                        )
                        at = (doc, end, path)  # the piece the cap falls in, and whether it ends a document
                        stats.cut = _cut(max_mb, files[i + 1 :], at, len(raw) - budget, pieces, stats)
                        text, end = raw[:budget].decode("utf-8", errors="ignore"), True
                        budget = 0
                    else:
                        budget -= len(raw)
                if text or (end and open_doc):
                    yield text, end
                    open_doc = not end
                    docs += end
                if budget == 0:
                    return
        except OSError as e:  # unreadable (permissions, a directory named *.txt, I/O error)
            raise ConfigError(f"data.source: cannot read {e.filename or path}: {e.strerror or e}") from None


def _is_txt(path: Path) -> bool:
    """A file :func:`_read_txt` reads (one document unless ``data.doc_separator`` splits it)."""
    return not (path.is_dir() or path.name.endswith((*JSON_FORMATS, ".parquet", ".arrow")))


def _disk_bytes(entry: Path) -> int:
    """Bytes on disk of a file, or of the files of a ``save_to_disk`` directory."""
    try:
        return sum(p.stat().st_size for p in entry.iterdir()) if entry.is_dir() else entry.stat().st_size
    except OSError:
        return 0


def _cut(
    max_mb: float,
    later: list[Path],
    at: tuple[str, bool, Path],
    over: int,
    rest: Iterator[tuple[str, bool]],
    stats: DecodeStats,
) -> dict[str, Any] | None:
    """What the ``max_mb`` cap left unread, for :func:`note_cut` and meta.json (``corpus_cut``), or None
    when the cap fell exactly at the end of the corpus. ``at``: the document the cap falls in (its
    name), whether that piece ends it, and its file; ``over``: bytes of that piece past the cap;
    ``rest``: the file's pieces after it, of which at most the first with text is read (records skipped
    on the way are not counted: they lie past the cap)."""
    doc, ends, path = at
    where = f"in {doc}"
    if not over:  # the cap fell between pieces: is there more text in this file?
        skipped, first = dict(stats.skipped), stats.first_skipped
        over = next((len(t.encode("utf-8")) for t, _ in rest if t), 0)
        stats.skipped, stats.first_skipped = skipped, first
        if not over and not later:
            return None
        where = f"after {doc}" if over and ends else where if over else f"at the end of {path}"
    return {
        "max_corpus_mb": max_mb,
        "read_mb": int(max_mb * 1e6) / 1e6,
        "at_least_mb": (int(max_mb * 1e6) + over) / 1e6,
        "stopped": where,
        "files_not_read": len(later),
        "files_not_read_mb": sum(_disk_bytes(p) for p in later) / 1e6,
    }


def _mb(x: float) -> str:
    return f"{x:.3g}" if x < 1000 else f"{x:,.0f}"


def note_cut(cut: dict[str, Any] | None, extra: dict[str, Any] | None = None) -> None:
    """Log, in one line, that ``data.max_corpus_mb`` stopped reading the corpus, and where (the record
    of :func:`iter_pieces`, kept in meta.json as ``corpus_cut``)."""
    if not cut:
        return
    n = cut["files_not_read"]
    later = f", and {n} later file(s) ({_mb(cut['files_not_read_mb'])} MB on disk) not read" if n else ""
    more = cut["at_least_mb"] > cut["read_mb"]  # text past the cap in the file it stopped in
    log.info(
        "data.max_corpus_mb = %g: read only the first %s MB of text%s: stopped %s%s; raise it (0 = no "
        "cap) to read more",
        cut["max_corpus_mb"],
        _mb(cut["read_mb"]),
        f", of at least {_mb(cut['at_least_mb'])} MB" if more else "",
        cut["stopped"],
        later,
        extra=extra,
    )


def iter_documents(
    source: str,
    text_field: str = "text",
    max_mb: float = 24.0,
    errors: str = "strict",
    stats: DecodeStats | None = None,
    separator: str = "",
) -> Iterator[str]:
    """Whole documents of :func:`iter_pieces` one at a time (each is held whole: preparation streams
    the pieces instead)."""
    parts: list[str] = []
    for text, end in iter_pieces(source, text_field, max_mb, errors, stats, separator):
        parts.append(text)
        if end:
            yield "".join(parts)
            parts = []


def warn_replaced(source: str, stats: DecodeStats) -> None:
    """Log how many undecodable bytes ``data.errors = replace`` replaced (never for the stdlib)."""
    replaced = {k: v for k, v in stats.replaced.items() if v}
    if replaced and source != STDLIB:
        log.warning(
            "data.errors = replace: %d undecodable bytes replaced in %d file(s), first %s",
            sum(replaced.values()),
            len(replaced),
            next(iter(replaced)),
        )


def warn_skipped(stats: DecodeStats) -> None:
    """Log, in one line, how many records were skipped because their text was null or empty."""
    null, empty = stats.skipped["null"], stats.skipped["empty"]
    if null or empty:
        log.warning(
            "data.source: skipped %d record(s) whose text field is null and %d whose text is empty "
            "(first at %s); counted in meta.json (skipped_records)",
            null,
            empty,
            stats.first_skipped,
        )


def read_documents(
    source: str,
    text_field: str = "text",
    max_mb: float = 24.0,
    progress: bool = False,
    errors: str = "strict",
) -> list[str]:
    """All documents of :func:`iter_documents` in a list (small corpora and tests; preparation
    streams them instead)."""
    stats = DecodeStats()
    bar = tqdm(desc="read corpus", unit="doc", disable=not progress, leave=False)
    docs: list[str] = []
    for text in iter_documents(source, text_field, max_mb, errors, stats):
        docs.append(text)
        bar.update()
    bar.close()
    warn_replaced(source, stats)
    warn_skipped(stats)
    note_cut(stats.cut)
    note_unread(source, unread_files(source))
    if not docs:
        raise ConfigError(f"data.source: {source!r} holds no text")
    return docs
