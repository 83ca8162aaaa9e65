"""Finding a checkpoint and reading any slice of it into any layout.

:func:`resolve` turns what the user gave (a run directory, a ``checkpoints`` directory, or one
checkpoint) into one complete checkpoint: through ``latest`` if it points at a complete one,
else the newest complete ``step-*`` directory (a torn save or a damaged pointer is skipped
with a warning). :class:`CheckpointReader` verifies the whole checkpoint against its manifest
*before* anything is read, then serves regions: for each wanted region it opens only the
files whose pieces overlap it and reads only the overlapping slices (safetensors slices are
memory-mapped reads; no file is ever unpickled).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from loom.checkpoint import format as F
from loom.checkpoint.integrity import read_manifest, verify
from loom.checkpoint.protocol import Box, Flat, Region, ShardedTensor, full_box
from loom.checkpoint.regions import intersect, local_slices, region_boxes, view_box
from loom.checkpoint.save import list_checkpoints

log = logging.getLogger("loom")


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
        return p, None
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    pointer = root / F.LATEST
    if pointer.is_file():
        try:
            latest = F.read_json(pointer)
            ckpt = root / str(latest["tag"])
            if not _complete(ckpt):
                raise F.CheckpointError(f"{ckpt}: missing or incomplete")
            return ckpt, str(latest["manifest_sha256"])
        except (F.CheckpointError, KeyError) as e:
            log.warning("%s is unusable (%s); looking for the newest complete checkpoint", pointer, e)
    for _, ckpt in reversed(list_checkpoints(root)):
        if _complete(ckpt):
            if pointer.exists():
                log.warning("using %s instead of the checkpoint 'latest' names", ckpt)
            return ckpt, None
    return None


class CheckpointReader:
    """Verified, read-only view of one checkpoint; implements :class:`~loom.checkpoint.protocol.ShardReader`."""

    def __init__(
        self, path: str | Path, rank: int = 0, world: int = 1, group=None, check: bool = True
    ) -> None:
        found = find(path)
        if found is None:
            raise F.CheckpointError(f"{path}: holds no checkpoint")
        self.dir, manifest_sha = found
        files, chunk_bytes = read_manifest(self.dir, manifest_sha)
        if check:
            verify(self.dir, files, rank, world, group, chunk_bytes)
        index = F.read_json(self.dir / F.INDEX)
        self.tensors = F.validate_index(index, self.dir)
        for name in index.get("files", []):
            if name not in files:
                raise F.CheckpointError(
                    f"{self.dir / F.INDEX}: names {name}, which the manifest does not cover"
                )
        self.index = index
        self.train_state = F.read_json(self.dir / F.TRAIN_STATE)
        self.step = int(self.train_state.get("step", index.get("step", 0)))
        self._handles: dict[str, object] = {}

    # ------------------------------------------------------------------ ShardReader
    def names(self) -> list[str]:
        return sorted(self.tensors)

    def global_shape(self, name: str) -> tuple[int, ...]:
        return self._meta(name)[0]

    def dtype(self, name: str) -> torch.dtype:
        return self._meta(name)[1]

    def read(self, name: str, region: Region | None = None) -> torch.Tensor:
        shape, dtype, _ = self._meta(name)
        region = region if region is not None else full_box(shape)
        out = torch.empty(region.lengths if isinstance(region, Box) else (region.length,), dtype=dtype)
        self._fill_one(name, ShardedTensor(out, shape, region))
        return out

    def fill(self, state: dict[str, ShardedTensor]) -> None:
        missing = [n for n in state if n not in self.tensors]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise F.CheckpointError(f"{self.dir}: has no tensor {', '.join(missing[:5])}{more}")
        for name, st in state.items():
            shape = self.tensors[name][0]
            if tuple(shape) != tuple(st.global_shape):
                raise F.CheckpointError(
                    f"{self.dir}: {name} has global shape {list(shape)}, this run expects {list(st.global_shape)} "
                    "(different model config?)"
                )
        with torch.no_grad():
            for name, st in state.items():
                self._fill_one(name, st)

    # ------------------------------------------------------------------ internals
    def _meta(self, name: str):
        if name not in self.tensors:
            raise F.CheckpointError(f"{self.dir}: has no tensor {name}")
        return self.tensors[name]

    def _open(self, file: str):
        if file not in self._handles:
            path = self.dir / file
            F.check_header(path)
            try:
                self._handles[file] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise F.CheckpointError(f"{path}: unreadable safetensors file ({e})") from None
        return self._handles[file]

    def _fill_one(self, name: str, st: ShardedTensor) -> None:
        shape, _, pieces = self.tensors[name]
        copied = 0
        dst_boxes = region_boxes(st.region, shape)
        for file, key, region in pieces:
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

    def _read_box(
        self, file: str, key: str, region: Region, soff: int, sbox: Box, common: Box
    ) -> torch.Tensor:
        """Elements of ``common`` (inside stored box ``sbox`` of piece ``region``) from ``file``."""
        handle = self._open(file)
        try:
            if not sbox.offsets:
                return handle.get_tensor(key)
            part = handle.get_slice(key)
            if isinstance(region, Flat):
                seg = part[soff : soff + sbox.numel].view(sbox.lengths)
                return seg[local_slices(sbox, common)]
            return part[local_slices(sbox, common)]
        except F.CheckpointError:
            raise
        except Exception as e:
            raise F.CheckpointError(f"{self.dir / file}: cannot read {key} ({e})") from None

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
