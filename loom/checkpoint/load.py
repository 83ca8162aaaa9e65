"""Finding a checkpoint and reading any slice of it into any layout.

:func:`resolve` turns what the user gave (a run directory, a ``checkpoints`` directory, or one
checkpoint) into one complete checkpoint: through ``latest`` if it points at a complete one,
else the newest complete ``step-*`` directory (a torn save or a damaged pointer is skipped
with a warning). :class:`CheckpointReader` verifies the whole checkpoint against its manifest
*before* anything is read (the work split over the ranks, one verdict for all: see
:mod:`~loom.checkpoint.integrity`), then serves regions: for each wanted region it opens only
the files whose pieces overlap it and reads only the overlapping slices (safetensors slices are
memory-mapped reads; no file is ever unpickled), each after its stored shape and dtype (from the
file's header) matched the index's piece. Pieces replicated over a ``read_group`` are
read 1/n per rank and all-gathered (:mod:`~loom.checkpoint.shared_read`).

The index is parsed lazily: a tensor's entry is checked and its pieces' row spans computed the
first time it is asked for, so a rank pays for the tensors it loads, and finding a region's
pieces skips those of other rows with one comparison each.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from loom.checkpoint import format as F
from loom.checkpoint.integrity import read_manifest, verify
from loom.checkpoint.protocol import Box, Flat, Region, ShardedTensor, full_box
from loom.checkpoint.regions import intersect, local_slices, region_boxes, row_span, view_box
from loom.checkpoint.save import list_checkpoints
from loom.checkpoint.shared_read import fill_shared, group_order
from loom.notes import LAUNCHER_SAYS

log = logging.getLogger("loom")
# a padded vocabulary's tensors (model.pad_vocab_to): V' rows, those >= V zeros; their optimizer state too
VOCAB_ROWS = ("tok_embeddings.weight", "output.weight")


_WARNED: set[str] = set()  # what find() said in this process: said once, however often it is called


def _warn_once(fmt: str, *args: object) -> None:
    line = fmt % args
    if line not in _WARNED:
        _WARNED.add(line)
        log.warning("%s", line, extra=LAUNCHER_SAYS)  # the launcher found it first (loom.notes)


def _complete(ckpt: Path) -> bool:
    return (ckpt / F.MANIFEST).is_file()


def find(path: str | Path) -> tuple[Path, str | None] | None:
    """(checkpoint dir, expected manifest SHA-256 or None) under ``path``, or None if it holds none."""
    p = Path(path)
    if p.is_file():
        raise F.CheckpointError(
            f"{p}: is a file; a Loom checkpoint is a directory with manifest.json, index.json and "
            ".safetensors shards (pickle-based files such as .pt or .distcp are never loaded)"
        )
    if not p.is_dir():
        raise F.CheckpointError(f"{p}: no such checkpoint directory")
    if _complete(p) or (p / F.INDEX).exists():
        return p, _recorded_sha(p)
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    pointer = root / F.LATEST
    if pointer.is_file():
        try:
            latest = F.read_json(pointer)
        except F.CheckpointError as e:
            _warn_once("%s is unusable (%s); looking for the newest complete checkpoint", pointer, e)
            latest = {"tag": None}
        tag = latest.get("tag")
        if tag is not None and not F.is_tag(tag):  # written by hand: never followed out of this run
            raise F.CheckpointError(
                f"{pointer}: names {tag!r}, which is not a checkpoint of {root} (step-<number>); "
                "refusing to resume from outside this run"
            )
        if tag is not None:
            ckpt = root / tag
            if _complete(ckpt) and latest.get("manifest_sha256"):
                return ckpt, str(latest["manifest_sha256"])
    for _, ckpt in reversed(list_checkpoints(root)):
        if _complete(ckpt):
            if (named := dangling_latest(p)) is not None:  # said only when there is one to fall back to
                _warn_once(
                    "%s names %s, missing or incomplete; using the newest complete checkpoint", pointer, named
                )
            if pointer.exists():
                _warn_once("using %s instead of the checkpoint 'latest' names", ckpt)
            return ckpt, _recorded_sha(ckpt)
    return None


def dangling_latest(path: str | Path) -> Path | None:
    """The checkpoint ``latest`` under ``path`` names when it is missing or incomplete (no
    manifest.json, or no recorded hash), else None."""
    p = Path(path)
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    try:
        latest = F.read_json(root / F.LATEST) if (root / F.LATEST).is_file() else {}
    except F.CheckpointError:
        return None
    tag = latest.get("tag") if isinstance(latest, dict) else None
    if not isinstance(tag, str) or not F.is_tag(tag):
        return None
    ckpt = root / tag
    return None if _complete(ckpt) and latest.get("manifest_sha256") else ckpt


def _recorded_sha(ckpt: Path) -> str | None:
    """The manifest hash the ``latest`` beside ``ckpt`` records for it (None if none does): a
    checkpoint named directly is checked end to end like one reached through ``latest``."""
    try:
        latest = F.read_json(ckpt.parent / F.LATEST)
    except (F.CheckpointError, OSError):
        return None
    kept = latest.get("manifests")
    known: dict = kept if isinstance(kept, dict) else {}
    sha = known.get(ckpt.name) or (latest.get("manifest_sha256") if latest.get("tag") == ckpt.name else None)
    return str(sha) if sha else None


def _no_checkpoint_why(p: Path, named: Path | None) -> str:
    """What a directory without a checkpoint is instead, and what to give (the reason of the refusal)."""
    if named is not None:
        return f" ({named.name}, which {F.LATEST} names, has no {F.MANIFEST}: incomplete or deleted)"
    if (p / "model.safetensors").is_file() and (p / "meta.json").is_file():  # a run's checkpoints/final
        return (
            " (a run's final model, one consolidated file, not a checkpoint: give the run directory or one "
            "of its step-N checkpoints)"
        )
    if (p / "config.json").is_file():
        return " (a Hugging Face model directory, already in that format; give a Loom run or checkpoint)"
    return " (give a run directory, its checkpoints/ folder or one step-N checkpoint)"


class CheckpointReader:
    """Verified, read-only view of one checkpoint; implements :class:`~loom.checkpoint.protocol.ShardReader`.

    ``verified``: the files this rank checked; ``opened``: the shard files it read from;
    ``bytes_read``: tensor bytes it read from them (the wanted elements, plus, from a flat
    piece, the rest of the rows that hold them).
    """

    def __init__(
        self,
        path: str | Path,
        rank: int = 0,
        world: int = 1,
        group=None,
        check: bool = True,
        manifest_sha: str | None = None,
    ) -> None:
        """``manifest_sha``: the manifest's SHA-256 the caller expects (what ``latest`` recorded when
        the checkpoint was chosen through it); a manifest with another hash is refused."""
        found = find(path)
        if found is None:
            named = dangling_latest(path)
            raise F.CheckpointError(f"{path}: holds no checkpoint{_no_checkpoint_why(Path(path), named)}")
        self.dir, found_sha = found
        manifest_sha = manifest_sha or found_sha
        files, chunk_bytes = read_manifest(self.dir, manifest_sha)
        self.verified = verify(self.dir, files, rank, world, group, chunk_bytes) if check else []
        index = F.read_json(self.dir / F.INDEX)
        self._files = F.check_index_header(index, self.dir)
        for name in sorted(self._files):
            if name not in files:
                raise F.CheckpointError(
                    f"{self.dir / F.INDEX}: names {name}, which the manifest does not cover"
                )
        self._entries: dict[str, dict] = index.get("tensors", {})
        self._parsed: dict[str, tuple] = {}
        self.train_state = F.read_json(self.dir / F.TRAIN_STATE)
        self.step = int(self.train_state.get("step", index.get("step", 0)))
        self._handles: dict[str, object] = {}
        self._stored: dict[str, dict[str, tuple[str, list[int]]]] = {}  # file -> key -> (dtype code, shape)
        self.opened: set[str] = set()
        self.bytes_read = 0

    # ------------------------------------------------------------------ ShardReader
    def names(self) -> list[str]:
        return sorted(self._entries)

    def global_shape(self, name: str) -> tuple[int, ...]:
        return self._meta(name)[0]

    def dtype(self, name: str) -> torch.dtype:
        return self._meta(name)[1]

    def read(
        self, name: str, region: Region | None = None, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """``region`` (None: all) of ``name``, of the global ``shape`` (None: the stored one; another
        padded vocabulary's: :meth:`resized`)."""
        stored, dtype, _ = self._meta(name)
        shape = tuple(shape) if shape is not None else stored
        region = region if region is not None else full_box(shape)
        out = torch.empty(region.lengths if isinstance(region, Box) else (region.length,), dtype=dtype)
        self._fill_one(name, ShardedTensor(out, shape, region))
        return out

    def fill(self, state: dict[str, ShardedTensor]) -> None:
        missing = [n for n in state if n not in self._entries]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise F.CheckpointError(f"{self.dir}: has no tensor {', '.join(missing[:5])}{more}")
        for name, st in state.items():
            shape = self._meta(name)[0]
            if tuple(shape) != tuple(st.global_shape) and not self.resized(name, st.global_shape):
                raise F.CheckpointError(
                    f"{self.dir}: {name} has global shape {list(shape)}, this run expects {list(st.global_shape)} "
                    "(different model config?)"
                )
        shared: dict[tuple, tuple] = {}
        with torch.no_grad():
            for name, st in state.items():
                rg = st.read_group
                if rg is None or rg.size <= 1:
                    self._fill_one(name, st)
                else:
                    key = (group_order(rg), str(rg.device))
                    shared.setdefault(key, (rg, []))[1].append((name, st))
            for key in sorted(shared):  # one global order of groups: no waiting in a cycle
                rg, entries = shared[key]
                fill_shared(entries, rg, self._read_into)

    def resized(self, name: str, shape: tuple[int, ...]) -> bool:
        """``name`` is a vocabulary tensor stored with V'_s rows and wanted with V'_w (a layout of
        another automatic ``model.pad_vocab_to``), both >= the saved run's V, other dims equal: rows
        below min(V'_s, V'_w) are the same elements, the others padding (zeros)."""
        stored = self._meta(name)[0]
        model = (self.train_state.get("config") or {}).get("model") or {}
        vocab = int(model.get("vocab_size") or 0)
        return (
            any(f".{v}." in f".{name}." for v in VOCAB_ROWS)  # model.<v>, optim.<v>.exp_avg, ...
            and len(stored) == len(shape) >= 2
            and tuple(stored[1:]) == tuple(shape[1:])
            and 0 < vocab <= min(stored[0], shape[0])
        )

    def _fill_resized(self, name: str, st: ShardedTensor) -> None:
        """Fill ``st`` (of another padded row count, :meth:`resized`) from the stored rows of its row
        span; rows past the stored ones are zeros."""
        stored, want = self._meta(name)[0], tuple(st.global_shape)
        lo, hi = row_span(st.region, want)
        rest = want[1:]
        outer = Box((lo,) + (0,) * len(rest), (hi - lo, *rest))
        window = torch.zeros(outer.lengths, dtype=st.local.dtype)
        have = min(hi, stored[0])
        if have > lo:
            rows = Box(outer.offsets, (have - lo, *rest))
            self._fill_one(name, ShardedTensor(window[: have - lo], stored, rows))
        for off, box in region_boxes(st.region, want):
            view_box(st.local, st.region, off, box).copy_(window[local_slices(outer, box)])

    # ------------------------------------------------------------------ internals
    def _meta(self, name: str):
        if name not in self._parsed:
            if name not in self._entries:
                raise F.CheckpointError(f"{self.dir}: has no tensor {name}")
            shape, dtype, pieces = F.parse_entry(name, self._entries[name], self._files, self.dir)
            spans = [(*row_span(region, shape), file, key, region) for file, key, region in pieces]
            self._parsed[name] = (shape, dtype, spans)
        return self._parsed[name]

    def _read_into(self, name: str, region: Region, out: torch.Tensor) -> None:
        self._fill_one(name, ShardedTensor(out, self._meta(name)[0], region))

    def _open(self, file: str):
        if file not in self._handles:
            path = self.dir / file
            self._stored[file] = F.read_header(path)
            try:
                self._handles[file] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise F.CheckpointError(f"{path}: unreadable safetensors file ({e})") from None
            self.opened.add(file)
        return self._handles[file]

    def _fill_one(self, name: str, st: ShardedTensor) -> None:
        shape, dtype, pieces = self._meta(name)
        if tuple(shape) != tuple(st.global_shape):
            if not self.resized(name, st.global_shape):
                raise F.CheckpointError(
                    f"{self.dir}: {name} has global shape {list(shape)}, {list(st.global_shape)} was asked for"
                )
            return self._fill_resized(name, st)
        copied = 0
        lo, hi = row_span(st.region, shape)
        dst_boxes = region_boxes(st.region, shape)
        for plo, phi, file, key, region in pieces:
            if phi <= lo or hi <= plo:  # no common row
                continue
            self._check_stored(name, dtype, file, key, region)
            for soff, sbox in region_boxes(region, shape):
                for doff, dbox in dst_boxes:
                    common = intersect(dbox, sbox) if shape else dbox
                    if common is None:
                        continue
                    src = self._read_box(file, key, region, soff, sbox, common)
                    view_box(st.local, st.region, doff, dbox)[local_slices(dbox, common)].copy_(src)
                    copied += common.numel
        if copied != st.region.numel:
            raise F.CheckpointError(
                f"{self.dir}: {name} covers {copied} of the {st.region.numel} elements wanted ({st.region})"
            )

    def _check_stored(self, name: str, dtype: torch.dtype, file: str, key: str, region: Region) -> None:
        """``file``'s tensor ``key`` has the shape and dtype of ``name``'s piece ``region`` in the index
        (as the file's header, read once, says): an edited index must not load another tensor."""
        self._open(file)
        if key not in self._stored[file]:
            raise F.CheckpointError(
                f"{self.dir / file}: holds no tensor {key} ({self.dir / F.INDEX} names it there)"
            )
        code, shape = self._stored[file][key]
        want = [region.length] if isinstance(region, Flat) else list(region.lengths)
        if (shape, code) != (want, F.DTYPES[dtype][1]):
            stored = next((n for n, c in F.DTYPES.values() if c == code), code)
            raise F.CheckpointError(
                f"{self.dir / file}: {key} is stored as {stored} {shape}, but {self.dir / F.INDEX} gives "
                f"{name}'s piece there as {F.dtype_name(dtype)} {want} (edited or damaged index? resume "
                "from another checkpoint)"
            )

    def _read_box(
        self, file: str, key: str, region: Region, soff: int, sbox: Box, common: Box
    ) -> torch.Tensor:
        """Elements of ``common`` (inside stored box ``sbox`` of piece ``region``) from ``file``.

        From a flat piece only the rows of ``sbox`` that hold ``common`` are read: ``sbox`` is
        contiguous (dims of length 1, one dim k with a range, full trailing dims), so rows of dim k
        are one contiguous run of the stored range.
        """
        handle = self._open(file)
        try:
            if not sbox.offsets:
                t = raw = handle.get_tensor(key)
            elif isinstance(region, Flat):
                k = next((d for d, n in enumerate(sbox.lengths) if n != 1), len(sbox.lengths) - 1)
                inner = sbox.numel // sbox.lengths[k] if sbox.lengths[k] else 0
                a, n = common.offsets[k] - sbox.offsets[k], common.lengths[k]
                rows = Box(
                    sbox.offsets[:k] + (common.offsets[k],) + sbox.offsets[k + 1 :],
                    sbox.lengths[:k] + (n,) + sbox.lengths[k + 1 :],
                )
                raw = handle.get_slice(key)[soff + a * inner : soff + (a + n) * inner]
                t = raw.view(rows.lengths)[local_slices(rows, common)]
            else:
                t = raw = handle.get_slice(key)[local_slices(sbox, common)]
        except F.CheckpointError:
            raise
        except Exception as e:
            raise F.CheckpointError(f"{self.dir / file}: cannot read {key} ({e})") from None
        self.bytes_read += raw.numel() * raw.element_size()
        return t

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
