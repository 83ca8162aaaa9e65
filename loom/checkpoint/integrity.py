"""SHA-256 manifest of every file of a checkpoint, checked before any state is applied.

``manifest.json``::

    {"format": "loom-checkpoint", "version": 1,
     "files": {"index.json": {"sha256": "…", "bytes": 5123}, "shard-00000-of-00002.safetensors": {...}}}

The manifest's own hash is stored in the ``latest`` pointer, so a checkpoint reached through
``latest`` is covered end to end. Verification of large shards is spread over the ranks
(rank r hashes files r, r+n, ...), and the verdicts are combined so that every rank refuses
with the same message, naming each bad file: missing, truncated (size), or altered (hash).
This detects corruption and torn writes, not a deliberate forgery (no signature).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.distributed as dist

from loom.checkpoint.format import FORMAT, MANIFEST, VERSION, CheckpointError, dump_json, read_json

CHUNK = 8 << 20
OK, MISSING, SIZE, HASH = 0, 1, 2, 3
PROBLEMS = {MISSING: "missing", SIZE: "truncated or resized", HASH: "content altered (SHA-256 mismatch)"}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def manifest_bytes(files: dict[str, tuple[str, int]]) -> bytes:
    """The manifest for {file name: (sha256, size)}."""
    return dump_json(
        {
            "format": FORMAT,
            "version": VERSION,
            "files": {n: {"sha256": h, "bytes": s} for n, (h, s) in files.items()},
        }
    )


def read_manifest(ckpt: Path, expect_sha256: str | None = None) -> dict[str, dict]:
    """The manifest's ``files`` table; checks the manifest's own hash when one is given."""
    path = ckpt / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing; {ckpt} is not a complete Loom checkpoint (torn or unfinished save?)"
        )
    if expect_sha256 is not None and sha256_file(path) != expect_sha256:
        raise CheckpointError(f"{path}: content altered (SHA-256 differs from the one recorded in 'latest')")
    m = read_json(path)
    files = m.get("files")
    if m.get("format") != FORMAT or not isinstance(files, dict):
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    for name in files:
        if "/" in name or "\\" in name or name.startswith("."):
            raise CheckpointError(f"{path}: file name {name!r} is not a plain file of the checkpoint")
    return files


def check_file(ckpt: Path, name: str, entry: dict) -> int:
    """OK, MISSING, SIZE or HASH for one file against its manifest entry."""
    path = ckpt / name
    if not path.is_file():
        return MISSING
    if path.stat().st_size != int(entry["bytes"]):
        return SIZE
    return OK if sha256_file(path) == entry["sha256"] else HASH


def verify(ckpt: Path, files: dict[str, dict], rank: int = 0, world: int = 1, group=None) -> None:
    """Check every file of the manifest; with ``world > 1`` the work is split over ``group``.

    Raises CheckpointError naming every bad file (same message on every rank).
    """
    names = sorted(files)
    codes = torch.zeros(len(names), dtype=torch.int64)
    for i in range(rank, len(names), world):
        codes[i] = check_file(ckpt, names[i], files[names[i]])
    if world > 1:
        dist.all_reduce(codes, op=dist.ReduceOp.MAX, group=group)
    bad = [f"{ckpt / names[i]}: {PROBLEMS[int(c)]}" for i, c in enumerate(codes.tolist()) if c != OK]
    if bad:
        raise CheckpointError("checkpoint failed its integrity check, nothing was loaded: " + "; ".join(bad))
