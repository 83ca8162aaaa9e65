"""On-disk format: one safetensors shard per rank, a JSON index, JSON training state, a manifest.

A checkpoint is a directory (``<run.dir>/checkpoints/step-00000100``)::

    shard-00000-of-00002.safetensors   rank 0's pieces (safetensors: a JSON header + raw bytes)
    shard-00001-of-00002.safetensors   rank 1's pieces
    index.json          for every tensor: global shape, dtype, and the piece each file holds
    train_state.json    step, data position, every rank's RNG states, config, layout
    manifest.json       SHA-256 and size of every file above (see integrity.py)

``index.json``::

    {"format": "loom-checkpoint", "version": 1, "tag": "step-00000100", "step": 100,
     "world_size": 2, "files": ["shard-00000-of-00002.safetensors", ...],
     "tensors": {"model.norm.weight": {"shape": [64], "dtype": "float32",
                   "pieces": [{"file": "shard-00000-of-00002.safetensors", "key": "model.norm.weight",
                               "box": [[0], [32]]},
                              {"file": "shard-00001-of-00002.safetensors", "key": "model.norm.weight",
                               "box": [[32], [32]]}]},
                 "model.layers.0.attention.wq.weight": {..., "pieces": [{..., "flat": [0, 2048]}, ...]}}}

Nothing is pickled: tensors are safetensors (parsed by its own header reader, no code
execution), everything else is JSON. Shards are written by :func:`write_safetensors`,
which hands the bytes to the manifest's hasher as they go out (no second read).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import torch

from loom.checkpoint.protocol import Region, check_region, region_from_json

FORMAT = "loom-checkpoint"
# the header of every model file Loom writes (exports, final models, adapters), as torch's save_file
# writes it: transformers 4.x refuses a safetensors file whose metadata lacks format = pt
MODEL_FILE_METADATA: dict[str, str] = {"format": "pt"}
VERSION = 1
INDEX = "index.json"
TRAIN_STATE = "train_state.json"
MANIFEST = "manifest.json"
LATEST = "latest"

DTYPES: dict[torch.dtype, tuple[str, str]] = {  # torch dtype -> (index name, safetensors code)
    torch.float64: ("float64", "F64"),
    torch.float32: ("float32", "F32"),
    torch.bfloat16: ("bfloat16", "BF16"),
    torch.float16: ("float16", "F16"),
    torch.int64: ("int64", "I64"),
    torch.int32: ("int32", "I32"),
    torch.int16: ("int16", "I16"),
    torch.int8: ("int8", "I8"),
    torch.uint8: ("uint8", "U8"),
    torch.bool: ("bool", "BOOL"),
}
DTYPE_BY_NAME = {name: dt for dt, (name, _) in DTYPES.items()}
PIECE = 16 << 20  # bytes per write; the hashing thread follows piece by piece
HEADER_LIMIT = 100 << 20  # bytes a safetensors header may have (the safetensors library's own bound)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or must not be loaded; the message names the file."""


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def is_tag(name: object) -> bool:
    """``name`` is a checkpoint's own name (``step-<digits>``): no path, nothing outside its root."""
    return isinstance(name, str) and re.fullmatch(r"step-\d+", name) is not None


def enclosing_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint (or a run's ``checkpoints`` directory) that ``path`` lies in or is, if any: a
    run there would write into a checkpoint another run resumes from."""
    p = Path(path).expanduser().resolve()
    for d in (p, *p.parents):
        if (
            (d / MANIFEST).is_file()
            or (d / INDEX).is_file()
            or (d.name == "checkpoints" and (d / LATEST).is_file())
        ):
            return d
    return None


def check_outside_checkpoints(out: str | Path, what: str = "an export") -> None:
    """Refuse to write ``out`` (``what``) inside a checkpoint or a run's ``checkpoints`` directory:
    training prunes and replaces what lies there, so the export would vanish, or a resume would read it."""
    inside = enclosing_checkpoint(out)
    if inside is not None:
        raise CheckpointError(
            f"{out}: inside {inside}, which training prunes and replaces; write {what} elsewhere "
            "(nothing was written)"
        )


def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


def dtype_name(dt: torch.dtype) -> str:
    if dt not in DTYPES:
        raise CheckpointError(
            f"dtype {dt} cannot be stored; supported: {', '.join(n for n, _ in DTYPES.values())}"
        )
    return DTYPES[dt][0]


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def naming_writes(where: str | Path) -> Iterator[None]:
    """An OS error without a file name (a failed ``write``: disk full, quota) says what was being written."""
    try:
        yield
    except OSError as e:
        if e.filename:
            raise
        raise OSError(e.errno, f"{e.strerror or e} (while writing {where})") from None


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """tmp file, fsync, rename, fsync the directory; a failed write (disk full) names ``path`` and
    leaves no tmp file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with naming_writes(path), open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def umask_mode(path: Path, full: int = 0o666) -> None:
    """Give ``path`` the mode a new file (``full`` 0o666; a directory: 0o777) gets under the process
    umask (0644 / 0755 under 022), where ``mkstemp``, ``mkdtemp`` and safetensors make it private."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, full & ~mask)


_WRITER = f"{socket.gethostname()[:32]}-{os.getpid()}"  # this process, in a staged output's hidden name


def _remove_orphans(out: Path) -> None:
    """Remove the hidden outputs a killed process (SIGKILL, the OOM killer) left staged for ``out``
    (:func:`staged`): those named by this host and a process id no longer running; each removal is
    one warning line with its size. Another host's, or a running process's, are left alone."""
    host = socket.gethostname()[:32]
    pattern = re.compile(re.escape(f".{out.name[:160]}.{host}-") + r"(\d+)\..*\.(partial|tmp)$")
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        m = pattern.match(entry.name)
        if m is None or _running(int(m.group(1))):
            continue
        size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file()) if entry.is_dir() else 0
        size = size or (entry.stat().st_size if entry.is_file() else 0)
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        logging.getLogger("loom").warning(
            "loom: warning: removed %s (%.1f MB), left unfinished by process %s, which no longer runs",
            entry,
            size / 1e6,
            m.group(1),
        )


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


@contextmanager
def staged(out: Path, directory: bool = False) -> Iterator[Path]:
    """A new output (file, or ``directory``) built under a hidden temporary name beside ``out``, made
    by ``mkstemp``/``mkdtemp`` (so never a path that exists: nothing there is written into, replaced
    or adopted), with the umask's mode; renamed to ``out`` when the block completes (a directory only
    onto an empty one or none), removed if anything fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    # hidden, naming its writer (a killed one's is removed by the next: _remove_orphans); room for
    # mkstemp's random part within NAME_MAX
    prefix = f".{out.name[:160]}.{_WRITER}."
    _remove_orphans(out)
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=".partial", dir=out.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=out.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        umask_mode(tmp, 0o777 if directory else 0o666)
        yield tmp
        fsync_dir(tmp if directory else out.parent)
        os.replace(tmp, out)
    except BaseException:  # a failed write (disk full) or rename leaves nothing behind
        if directory:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(out.parent)


def dump_json(obj: object, compact: bool = False) -> bytes:
    """UTF-8 JSON; ``compact`` for machine-sized files (the index of a many-rank checkpoint)."""
    text = (
        json.dumps(obj, sort_keys=True, separators=(",", ":"))
        if compact
        else json.dumps(obj, indent=1, sort_keys=True)
    )
    return (text + "\n").encode()


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], hasher=None
) -> int:
    """Write CPU tensors as a safetensors file, fsync it; return its size. ``hasher.update`` sees
    every byte written (the manifest's hashes cost no second read).

    Layout: 8-byte little-endian header length, JSON header padded with spaces to a multiple of
    8, then each tensor's bytes back to back in header order (what ``safetensors`` reads).
    """
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    order = sorted(tensors)
    for key in order:
        t = tensors[key]
        nbytes = t.numel() * t.element_size()
        header[key] = {
            "dtype": DTYPES[t.dtype][1],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    parts = [memoryview(struct.pack("<Q", len(head))), memoryview(head)]
    for key in order:
        t = tensors[key]
        if t.numel():
            flat = (
                t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data
            )  # a memoryview of the bytes
            parts += [flat[i : i + PIECE] for i in range(0, len(flat), PIECE)]
    # The hash runs in a second thread, one piece behind the writes (both release the GIL).
    pending: queue.Queue = queue.Queue(maxsize=4)
    hashing = threading.Thread(target=_drain, args=(pending, hasher), daemon=True) if hasher else None
    if hashing:
        hashing.start()
    size = 0
    try:
        with open(path, "wb") as fh:
            for part in parts:
                fh.write(part)
                size += len(part)
                if hashing:
                    pending.put(part)
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        if hashing:
            pending.put(None)
            hashing.join()
    return size


def _drain(pending: queue.Queue, hasher) -> None:
    while (part := pending.get()) is not None:
        hasher.update(part)


def check_header(path: Path) -> None:
    """Refuse a file that is not safetensors before any parser touches it (e.g. a pickle)."""
    with open(path, "rb") as fh:
        _check_head(path, fh.read(9))


def _check_head(path: Path, head: bytes) -> None:
    if len(head) < 9 or head[8:9] != b"{":
        raise CheckpointError(
            f"{path}: not a safetensors file (only safetensors shards are read, never pickle)"
        )


def read_header(path: Path) -> dict[str, tuple[str, list[int]]]:
    """``{key: (safetensors dtype code, shape)}`` of the tensors ``path`` stores, from its header
    alone (no tensor read); a file that is not safetensors is refused first (:func:`check_header`)."""
    with open(path, "rb") as fh:
        head = fh.read(9)
        _check_head(path, head)
        length = int.from_bytes(head[:8], "little")
        raw = head[8:] + fh.read(max(0, min(length, HEADER_LIMIT) - 1))
    try:
        if len(raw) != length:
            raise ValueError(f"header length {length} is past the file's end or over {HEADER_LIMIT} bytes")
        header = json.loads(raw)
        return {
            key: (str(entry["dtype"]), [int(n) for n in entry["shape"]])
            for key, entry in header.items()
            if key != "__metadata__"
        }
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None


def check_index_header(index: dict, path: Path) -> set[str]:
    """Check ``index.json``'s format and version; return the files it lists."""
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointError(
            f"{path / INDEX}: not a {FORMAT} v{VERSION} index (format={index.get('format')!r}, version={index.get('version')!r})"
        )
    files = index.get("files", [])
    if not isinstance(files, list) or not isinstance(index.get("tensors", {}), dict):
        raise CheckpointError(f"{path / INDEX}: 'files' must be a list and 'tensors' an object")
    return set(files)


def parse_entry(
    name: str, entry: dict, files: set[str], path: Path
) -> tuple[tuple[int, ...], torch.dtype, list[tuple[str, str, Region]]]:
    """One tensor's index entry as (shape, dtype, [(file, key, region)]), every field checked."""
    try:
        shape = tuple(int(s) for s in entry["shape"])
        dtype = DTYPE_BY_NAME[entry["dtype"]]
        pieces = []
        for p in entry["pieces"]:
            region = region_from_json(p)
            check_region(region, shape, name)
            if p["file"] not in files:
                raise ValueError(f"piece in {p['file']!r}, which the index does not list")
            pieces.append((p["file"], p["key"], region))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path / INDEX}: bad entry for tensor {name!r}: {e}") from None
    return shape, dtype, pieces


def read_json(path: Path) -> dict:
    """Parse a JSON file of a checkpoint; anything else (a pickle, garbage) is refused."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{path}: not valid JSON ({e.__class__.__name__}); refusing to read it"
        ) from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    # Every reader of a sealed checkpoint's state comes through here (CheckpointReader among them);
    # a file without a manifest beside it is no checkpoint yet, and CheckpointReader refuses it first.
    if path.name == TRAIN_STATE and (path.parent / MANIFEST).is_file():
        check_train_state(obj, path)
    return obj


def _shown(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bad(path: Path, field: str, value: object, allowed: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: {field} is {_shown(value)}; {allowed} (edited or damaged? resume from another checkpoint)"
    )


def _integer(obj: dict, key: str, path: Path, field: str, low: int = 0, required: bool = False) -> int | None:
    """``obj[key]``, an integer >= ``low`` (not a bool); None when absent and not ``required``."""
    if key not in obj and not required:
        return None
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _bad(path, field, value, f"must be an integer >= {low}")
    return value


def _object(obj: dict, key: str, path: Path, field: str, null: bool = False) -> dict | None:
    """``obj[key]``, a JSON object (or null, where ``null``); None when absent."""
    value = obj.get(key)
    if value is None and (null or key not in obj):
        return None
    if not isinstance(value, dict):
        raise _bad(path, field, value, "must be an object" + (" or null" if null else ""))
    return value


def check_train_state(ts: dict, path: Path) -> None:
    """Refuse, in one line naming ``path`` and the field, a ``train_state.json`` whose fields its
    readers cannot trust (:func:`read_json` checks every sealed checkpoint's on reading it):

    * ``format``/``version``: this Loom's (a newer writer's or another program's is refused);
    * ``step``: an integer >= 0, the step of the checkpoint's directory (``step-<step>``) and of ``tag``;
    * ``world_size``: an integer >= 1; ``ranks`` (if present): one object per rank;
    * ``data`` (the sampler's position, if present): its counters integers >= 0, ``global_batch`` >= 1,
      ``step`` the checkpoint's, ``sources`` a list of objects with numeric ``weight``;
    * ``config``: an object of sections; ``loss_scale``/``finetune_base``: an object or null.
    """
    if ts.get("format") != FORMAT or ts.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: format {_shown(ts.get('format'))}, version {_shown(ts.get('version'))}; this Loom "
            f"reads format {FORMAT!r} version {VERSION} only (written by a newer Loom or another program?)"
        )
    step = cast(int, _integer(ts, "step", path, "step", required=True))
    folder = path.parent.name
    if is_tag(folder) and int(folder[5:]) != step:
        raise _bad(path, "step", step, f"must be {int(folder[5:])}, the step of its checkpoint {folder}")
    if ts.get("tag") != tag_for(step):
        raise _bad(path, "tag", ts.get("tag"), f"must be {tag_for(step)!r}, the tag of its step {step}")
    world = cast(int, _integer(ts, "world_size", path, "world_size", low=1, required=True))
    ranks = ts.get("ranks", [])
    if not isinstance(ranks, list) or len(ranks) != world:
        raise _bad(path, "ranks", ranks, f"must be a list of world_size = {world} objects")
    for r, entry in enumerate(ranks):
        if not isinstance(entry, dict):
            raise _bad(path, f"ranks[{r}]", entry, "must be an object")
        _object(entry, "rng", path, f"ranks[{r}].rng")
    data = _object(ts, "data", path, "data", null=True)
    if data is not None:
        if _integer(data, "step", path, "data.step") not in (None, step):
            raise _bad(path, "data.step", data["step"], f"must be {step}, the checkpoint's step")
        _integer(data, "global_sequences", path, "data.global_sequences")
        _integer(data, "global_batch", path, "data.global_batch", low=1)
        sources = data.get("sources", [])
        if not isinstance(sources, list):
            raise _bad(path, "data.sources", sources, "must be a list of objects")
        for k, src in enumerate(sources):
            where = f"data.sources[{k}]"
            if not isinstance(src, dict):
                raise _bad(path, where, src, "must be an object")
            for key in ("consumed", "epoch", "windows"):
                _integer(src, key, path, f"{where}.{key}")
            weight = src.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
                raise _bad(path, f"{where}.weight", weight, "must be a number >= 0")
    config = _object(ts, "config", path, "config")
    for section in ("train", "data", "model"):
        _object(config or {}, section, path, f"config.{section}")
    scale = _object(ts, "loss_scale", path, "loss_scale", null=True)
    for key, value in (scale or {}).items():
        if not isinstance(value, (bool, int, float)):
            raise _bad(path, f"loss_scale.{key}", value, "must be a number or a boolean")
    _object(ts, "finetune_base", path, "finetune_base", null=True)


DATA_IDENTITY = "data.json"  # run.dir: SHA-256 of the tokenizer and token files the run trained on


TOKENIZER_SHA256 = "tokenizer_sha256"  # train_state.json: the SHA-256 of the tokenizer the run trained with


def check_trained_tokenizer(ts: dict, sha: str, ckpt: Path, what: str) -> None:
    """A checkpoint whose ``train_state.json`` ``ts`` records the tokenizer it was trained with is
    used only with that tokenizer (``sha``: the SHA-256 of the one at hand, ``what`` names it; ""
    or a checkpoint from before the record: not checked). Another's ids would be other text."""
    saved = ts.get(TOKENIZER_SHA256)
    if not isinstance(saved, str) or not saved or not sha or saved == sha:
        return
    raise CheckpointError(
        f"{ckpt}: trained with another tokenizer (sha256 {saved[:12]}) than {what} (sha256 {sha[:12]}); "
        "its token ids would mean other text: use it with the tokenizer it was trained with"
    )


def check_run_tokenizer(run_dir: Path) -> None:
    """``run_dir/tokenizer.json`` is the tokenizer the run trained with: the SHA-256 that its
    :data:`DATA_IDENTITY` recorded (a run without one is not checked); so is each side file the run
    kept beside it (its ``run.dir/NAME`` entries: loom.checkpoint.hf_export.keep_tokenizer_files;
    "" = it keeps none). A replaced, missing or added file would encode prompts, and ship in
    exports, as another tokenizer's ids, chat template or end token for the same weights."""
    import hashlib

    ident = run_dir / DATA_IDENTITY
    try:
        record = json.loads(ident.read_text()) if ident.is_file() else {}
    except (OSError, ValueError):
        return  # an unreadable record: the run's own checks report it
    record = record if isinstance(record, dict) else {}
    want = record.get("tokenizer")
    files = {"tokenizer.json": want} if isinstance(want, str) and want else {}
    files |= {k.removeprefix("run.dir/"): v for k, v in record.items() if k.startswith("run.dir/")}
    for name, sha in files.items():
        path = run_dir / name
        have = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
        if not isinstance(sha, str) or "/" in name or have == sha:
            continue
        if not sha:
            raise CheckpointError(f"{path}: added after the run started ({ident} records none); remove it")
        what = "tokenizer" if name == "tokenizer.json" else f"tokenizer's {name}"
        raise CheckpointError(
            f"{path}: not the {what} this run trained with ({f'sha256 {have[:12]}' if have else 'missing'}; "
            f"{ident} records {sha[:12]}); put the run's {'tokenizer' if name == 'tokenizer.json' else name} back"
        )
