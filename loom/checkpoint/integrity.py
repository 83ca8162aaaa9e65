"""SHA-256 manifest of every file of a checkpoint, checked before any state is applied.

``manifest.json``::

    {"format": "loom-checkpoint", "version": 1, "chunk_bytes": 67108864,
     "files": {"index.json": {"sha256": ["…"], "bytes": 5123},
               "shard-00000-of-00002.safetensors": {"sha256": ["…", "…", ...], "bytes": 741000000}}}

``sha256`` lists the SHA-256 of each ``chunk_bytes`` piece of the file (one entry, i.e. the
file's plain SHA-256, for files up to 64 MiB), so verification runs on every core: chunks are
dealt to the ranks and hashed by a thread pool on each (hashlib releases the GIL).

The manifest's own hash is stored in the ``latest`` pointer, so a checkpoint reached through
``latest`` is covered end to end.

Verification is split over the ranks, and no rank touches every file: the manifest's chunks
(in file order) are cut into ``world`` contiguous runs of near-equal bytes (:func:`assign`),
and a rank stats and hashes only the files of its run. With F files of B bytes in all (each
file also weighing ``OPEN_COST``), a rank checks about (B + F·OPEN_COST)/world of that weight:
with one shard per rank, its run lies in 1 to 3 consecutive files, whatever the world. One
all-reduce (MAX) of a status code per file, over the checkpoint's gloo group (CPU tensors),
combines the verdicts *before* any rank reads a tensor, so every rank refuses with the same
one-line message naming each bad file: missing, truncated (size), or altered (hash) — also a
file that this rank would never have read. This detects corruption and torn writes, not a
deliberate forgery (no signature).
"""

from __future__ import annotations

import hashlib
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeGuard

import torch

from loom import comm
from loom.checkpoint.format import FORMAT, MANIFEST, VERSION, CheckpointError, dump_json, read_json

CHUNK_BYTES = 64 << 20  # unit of hashing and of parallel verification
READ = 8 << 20
OPEN_COST = 1 << 20  # bytes a file open + stat is worth, when spreading the work over ranks
OK, MISSING, SIZE, HASH = 0, 1, 2, 3
PROBLEMS = {
    MISSING: "missing (listed in manifest.json)",
    SIZE: "truncated or resized (its size differs from manifest.json's entry)",
    HASH: "content altered (its SHA-256 differs from manifest.json's entry: this file or manifest.json was changed)",
}


class ChunkHasher:
    """SHA-256 of every ``CHUNK_BYTES`` piece of a byte stream, fed in any sized parts."""

    def __init__(self, chunk: int = CHUNK_BYTES) -> None:
        self.chunk, self.size = chunk, 0
        self.done: list[str] = []  # hex digests of the completed chunks
        self._h, self._fill = hashlib.sha256(), 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.chunk - self._fill)
            self._h.update(view[:take])
            self._fill += take
            self.size += take
            view = view[take:]
            if self._fill == self.chunk:
                self.done.append(self._h.hexdigest())
                self._h, self._fill = hashlib.sha256(), 0

    def hexdigests(self) -> list[str]:
        return self.done + ([self._h.hexdigest()] if self._fill or not self.done else [])


def hash_bytes(data: bytes) -> list[str]:
    h = ChunkHasher()
    h.update(data)
    return h.hexdigests()


def sha256_file(path: Path) -> str:
    """Plain SHA-256 of a whole file (for the manifest itself)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(READ):
            h.update(block)
    return h.hexdigest()


def _hash_range(path: Path, offset: int, length: int) -> str:
    """SHA-256 of ``length`` bytes at ``offset``, hashed straight from a read-only memory map."""
    h = hashlib.sha256()
    if length:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                h.update(view[offset : offset + length])
            finally:
                view.release()
    return h.hexdigest()


def manifest_bytes(files: dict[str, tuple[list[str], int]]) -> bytes:
    """The manifest for {file name: (chunk SHA-256s, size)}."""
    table = {n: {"sha256": list(h), "bytes": s} for n, (h, s) in files.items()}
    return dump_json({"format": FORMAT, "version": VERSION, "chunk_bytes": CHUNK_BYTES, "files": table})


def read_manifest(ckpt: Path, expect_sha256: str | None = None) -> tuple[dict[str, dict], int]:
    """The manifest's ``files`` table and chunk size; checks the manifest's own hash when given."""
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
    chunk_bytes = m.get("chunk_bytes", CHUNK_BYTES)
    if not _count(chunk_bytes) or chunk_bytes < 1:
        raise CheckpointError(f"{path}: chunk_bytes is {chunk_bytes!r}; must be an integer >= 1 (damaged?)")
    for name, entry in files.items():
        if "/" in name or "\\" in name or name.startswith("."):
            raise CheckpointError(f"{path}: file name {name!r} is not a plain file of the checkpoint")
        problem = _entry_problem(entry, chunk_bytes)
        if problem:
            raise CheckpointError(
                f"{path}: entry {name!r} {problem} (damaged? resume from another checkpoint)"
            )
    return files, chunk_bytes


def _count(value: object) -> TypeGuard[int]:
    """``value`` is an integer >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_problem(entry: object, chunk_bytes: int) -> str | None:
    """What is wrong with one file's manifest entry (None: nothing): ``{"sha256": [one hex string
    per chunk_bytes piece, at least one], "bytes": integer >= 0}``."""
    if not isinstance(entry, dict):
        return f"is {entry!r:.40}; must be an object with 'sha256' and 'bytes'"
    size, hashes = entry.get("bytes"), entry.get("sha256")
    if not _count(size):
        return f"has bytes {size!r:.40}; must be an integer >= 0"
    chunks = max(1, -(-size // chunk_bytes))
    if not isinstance(hashes, list) or len(hashes) != chunks or not all(isinstance(h, str) for h in hashes):
        return f"has sha256 {hashes!r:.40}; must be a list of {chunks} SHA-256 strings for {size} bytes"
    return None


Task = tuple[str, int, int, str]  # (file, offset, length, SHA-256 of those bytes)


def chunk_tasks(files: dict[str, dict], chunk_bytes: int = CHUNK_BYTES) -> list[Task]:
    """Every hashing task of the manifest, in file-name order (from the manifest alone: no stat)."""
    tasks = []
    for name in sorted(files):
        size, hashes = int(files[name]["bytes"]), files[name]["sha256"]
        chunk = chunk_bytes if len(hashes) > 1 else max(size, 1)
        tasks += [(name, k * chunk, max(0, min(chunk, size - k * chunk)), h) for k, h in enumerate(hashes)]
    return tasks


def assign(tasks: list[Task], rank: int, world: int) -> list[Task]:
    """``rank``'s contiguous run of ``tasks``: task i goes to ⌊world · (bytes before its middle) / B⌋.

    Each task also weighs ``OPEN_COST`` bytes, so many small files spread as well as few large ones.
    """
    weights = [length + OPEN_COST for _, _, length, _ in tasks]
    total, before, mine = sum(weights), 0, []
    for t, w in zip(tasks, weights):
        if min(world - 1, (2 * before + w) * world // (2 * total)) == rank:
            mine.append(t)
        before += w
    return mine


def verify(
    ckpt: Path,
    files: dict[str, dict],
    rank: int = 0,
    world: int = 1,
    group=None,
    chunk_bytes: int = CHUNK_BYTES,
) -> list[str]:
    """Check this rank's share of the manifest (see module doc), combine the verdicts over ``group``
    (a gloo group: the codes are CPU tensors); return the files this rank checked.

    Raises CheckpointError naming every bad file (same message on every rank).
    """
    names = sorted(files)
    where = {name: i for i, name in enumerate(names)}
    codes = torch.zeros(len(names), dtype=torch.int64)
    mine = assign(chunk_tasks(files, chunk_bytes), rank, world)
    checked = sorted({t[0] for t in mine})
    for name in checked:
        path = ckpt / name
        if not path.is_file():
            codes[where[name]] = MISSING
        elif path.stat().st_size != int(files[name]["bytes"]):
            codes[where[name]] = SIZE
    todo = [t for t in mine if codes[where[t[0]]] == OK]
    with ThreadPoolExecutor(max_workers=max(1, min(len(todo), os.cpu_count() or 1))) as pool:
        results = list(pool.map(lambda t: _hash_range(ckpt / t[0], t[1], t[2]) == t[3], todo))
    for (name, *_), ok in zip(todo, results):
        if not ok:
            codes[where[name]] = HASH
    if world > 1:
        comm.all_reduce_max(codes, group)
    bad = [f"{ckpt / names[i]}: {PROBLEMS[int(c)]}" for i, c in enumerate(codes.tolist()) if c != OK]
    if bad:
        raise CheckpointError("checkpoint failed its integrity check, nothing was loaded: " + "; ".join(bad))
    return checked
