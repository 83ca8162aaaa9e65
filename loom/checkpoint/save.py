"""Atomic, optionally asynchronous, collective checkpoint saves.

A save of step ``s`` by every rank:

1. *snapshot* (caller's thread): this rank's share of every piece is copied to host memory.
   After this returns, training may change the live tensors: the checkpoint holds the state
   of the moment of the call (no tearing).
2. *write* (background thread if async): ``<root>/.tmp-step-s/shard-r-of-n.safetensors``,
   fsynced, hashed while written.
3. *agree*: over a dedicated gloo group, every rank sends rank 0 a JSON record (tag, step,
   file, hash, pieces, its RNG state). Rank 0 refuses the save if ranks disagree on the tag
   or step, or if the pieces do not tile every tensor exactly once.
4. *commit* (rank 0): ``index.json``, ``train_state.json``, ``manifest.json`` written and
   fsynced into the temporary directory, which is renamed to ``<root>/step-s``; then the
   ``latest`` pointer is replaced atomically; then old checkpoints beyond ``keep`` are pruned.
   Every rank learns the outcome. A kill at any point leaves ``latest`` on a complete
   checkpoint; leftovers are cleaned up when the next job starts.

The gloo group keeps the background thread's collectives off the training group (so this
works unchanged when training runs on NCCL).
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

from loom.checkpoint import format as F
from loom.checkpoint.integrity import ChunkHasher, hash_bytes, manifest_bytes, sha256_file
from loom.checkpoint.protocol import Region, ShardedTensor, region_from_json
from loom.checkpoint.regions import overlaps, share, take
from loom.mesh import world_gloo_group

log = logging.getLogger("loom")
TMP_PREFIX, OLD_PREFIX = ".tmp-", ".old-"


@dataclass
class Snapshot:
    """Host copies of this rank's shares, plus what the index needs to know about them."""

    step: int
    tag: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    entries: dict[str, dict] = field(default_factory=dict)
    rank_state: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def snapshot(
    step: int,
    state: dict[str, ShardedTensor],
    rank_state: dict,
    meta: dict,
    buffers: dict | None = None,
    copy: bool = True,
) -> Snapshot:
    """Copy this rank's write share of every piece to (pinned, on CUDA) host memory.

    ``buffers`` (name -> host tensor) are reused when shape and dtype match: after the first
    save, a snapshot is a plain copy into memory that is already mapped (no page faults).
    ``copy=False`` (a blocking save: nothing changes the tensors while it writes) keeps CPU
    tensors as they are and copies only device ones.
    """
    snap = Snapshot(step, F.tag_for(step), rank_state=rank_state, meta=meta)
    for name, st in state.items():
        i, n = st.replica
        part = share(st.region, st.global_shape, i, n)
        if part is None and i == 0 and st.region.numel == 0:
            part = st.region  # an empty tensor still needs an index entry
        if part is None:
            continue
        src = take(st.local.detach(), st.region, part)
        if not copy and src.device.type == "cpu":
            snap.tensors[name] = src.contiguous()
            snap.entries[name] = {
                "shape": list(st.global_shape),
                "dtype": F.dtype_name(src.dtype),
                **part.to_json(),
            }
            continue
        host = buffers.get(name) if buffers is not None else None
        if host is None or host.shape != src.shape or host.dtype != src.dtype:
            host = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
            if buffers is not None:
                buffers[name] = host
        host.copy_(src)
        snap.tensors[name] = host
        snap.entries[name] = {
            "shape": list(st.global_shape),
            "dtype": F.dtype_name(src.dtype),
            **part.to_json(),
        }
    return snap


def write_shard(tmp: Path, snap: Snapshot, rank: int, world: int) -> dict:
    """Write this rank's shard into ``tmp``; return its record for the commit."""
    tmp.mkdir(parents=True, exist_ok=True)
    name = F.shard_name(rank, world)
    hasher = ChunkHasher()
    size = F.write_safetensors(
        tmp / name, snap.tensors, {"format": F.FORMAT, "tag": snap.tag, "rank": str(rank)}, hasher
    )
    return {
        "rank": rank,
        "tag": snap.tag,
        "step": snap.step,
        "file": name,
        "sha256": hasher.hexdigests(),
        "bytes": size,
        "tensors": snap.entries,
        "rank_state": snap.rank_state,
        "meta": snap.meta if rank == 0 else {},
    }


def _tiles(name: str, shape: tuple[int, ...], regions: list[Region]) -> str | None:
    """None if ``regions`` cover a tensor of ``shape`` exactly once, else the reason."""
    total = 1
    for s in shape:
        total *= s
    got = sum(r.numel for r in regions)
    if got != total:
        return f"{name}: pieces hold {got} elements, the tensor has {total}"
    if len(regions) <= 64:
        for i in range(len(regions)):
            for j in range(i + 1, len(regions)):
                if overlaps(regions[i], regions[j], shape):
                    return f"{name}: pieces {regions[i]} and {regions[j]} overlap"
    return None


def build_index(records: list[dict], world: int) -> dict:
    """Merge every rank's record into the index; raise CheckpointError if they do not agree."""
    tags = {(r["tag"], r["step"]) for r in records}
    if len(tags) != 1:
        seen = ", ".join(f"rank {r['rank']}: {r['tag']}" for r in records)
        raise F.CheckpointError(f"ranks disagree on the checkpoint being saved ({seen}); save refused")
    tag, step = tags.pop()
    tensors: dict[str, dict] = {}
    for r in sorted(records, key=lambda r: r["rank"]):
        for name, e in r["tensors"].items():
            t = tensors.setdefault(name, {"shape": e["shape"], "dtype": e["dtype"], "pieces": []})
            if t["shape"] != e["shape"] or t["dtype"] != e["dtype"]:
                raise F.CheckpointError(
                    f"{name}: rank {r['rank']} has global shape {e['shape']} {e['dtype']}, "
                    f"another rank {t['shape']} {t['dtype']}; save refused"
                )
            piece = {"file": r["file"], "key": name}
            piece.update({k: e[k] for k in ("box", "flat", "within") if k in e})
            t["pieces"].append(piece)
    for name, t in tensors.items():
        problem = _tiles(name, tuple(t["shape"]), [region_from_json(p) for p in t["pieces"]])
        if problem:
            raise F.CheckpointError(f"pieces do not tile the tensor, save refused: {problem}")
    return {
        "format": F.FORMAT,
        "version": F.VERSION,
        "tag": tag,
        "step": step,
        "world_size": world,
        "files": [r["file"] for r in sorted(records, key=lambda r: r["rank"])],
        "tensors": tensors,
    }


def commit(root: Path, records: list[dict], world: int, keep: int = 0) -> Path:
    """Rank 0: write index, train state, manifest; rename into place; move ``latest``; prune."""
    index = build_index(records, world)
    tag = index["tag"]
    tmp = root / (TMP_PREFIX + tag)
    meta = next(r["meta"] for r in records if r["rank"] == 0)
    train_state = {
        "format": F.FORMAT,
        "version": F.VERSION,
        "tag": tag,
        "step": index["step"],
        "world_size": world,
        **meta,
        "ranks": [r["rank_state"] for r in sorted(records, key=lambda r: r["rank"])],
    }
    files = {r["file"]: (r["sha256"], r["bytes"]) for r in records}
    for name, obj, compact in ((F.INDEX, index, True), (F.TRAIN_STATE, train_state, False)):
        data = F.dump_json(obj, compact)
        F.write_bytes_atomic(tmp / name, data)
        files[name] = (hash_bytes(data), len(data))
    F.write_bytes_atomic(tmp / F.MANIFEST, manifest_bytes(files))
    manifest_sha = sha256_file(tmp / F.MANIFEST)
    final = root / tag
    old = root / (OLD_PREFIX + tag)
    if final.exists():  # re-saving a step (e.g. resumed from an older checkpoint): keep it until replaced
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    F.fsync_dir(root)
    F.write_bytes_atomic(
        root / F.LATEST,
        F.dump_json(
            {
                "tag": tag,
                "step": index["step"],
                "manifest_sha256": manifest_sha,
                "manifests": {**_kept_manifests(root), tag: manifest_sha},
            }
        ),
    )
    shutil.rmtree(old, ignore_errors=True)
    prune(root, keep, tag)
    return final


def _kept_manifests(root: Path) -> dict[str, str]:
    """The manifest hashes the current ``latest`` records for checkpoints that still exist: carried
    forward, so a checkpoint named directly (``train.resume RUN/checkpoints/step-60``) is checked
    against a hash kept outside it, like the one ``latest`` names."""
    try:
        latest = F.read_json(root / F.LATEST)
    except (F.CheckpointError, OSError, ValueError):
        return {}
    known = dict(latest.get("manifests") or {})
    if isinstance(latest.get("tag"), str) and latest.get("manifest_sha256"):
        known.setdefault(latest["tag"], latest["manifest_sha256"])
    return {t: str(h) for t, h in known.items() if F.is_tag(t) and (root / t).is_dir()}


def describe_error(e: BaseException, where: Path) -> str:
    """One line for a failed write: an OS error (disk full, permissions) names its file, or the
    directory being written when the error carries none (a failed ``write`` does not)."""
    if isinstance(e, OSError):
        return f"{e.filename or where}: {e.strerror or e} ({type(e).__name__} while saving a checkpoint)"
    return f"{type(e).__name__}: {e}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoint directories under ``root`` (complete or not), by step."""
    out = []
    for p in root.glob("step-*") if root.is_dir() else []:
        try:
            out.append((int(p.name.split("-", 1)[1]), p))
        except ValueError:
            continue
    return sorted(out)


def prune(root: Path, keep: int, current: str) -> None:
    """Remove all but the newest ``keep`` checkpoints (0 keeps all); never ``current``."""
    if keep <= 0:
        return
    ckpts = list_checkpoints(root)
    for _, p in ckpts[: max(0, len(ckpts) - keep)]:
        if p.name != current:
            shutil.rmtree(p, ignore_errors=True)


def clean_stale(root: Path) -> None:
    """Remove leftovers of interrupted saves; put back a checkpoint moved aside and not replaced."""
    if not root.is_dir():
        return
    for p in root.glob(TMP_PREFIX + "*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(OLD_PREFIX + "*"):
        final = root / p.name[len(OLD_PREFIX) :]
        if final.exists():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.rename(final)
    for p in root.glob("*.tmp"):
        p.unlink(missing_ok=True)


def _to_bytes(obj: object) -> torch.Tensor:
    return torch.frombuffer(bytearray(F.dump_json(obj)), dtype=torch.uint8)


def _from_bytes(t: torch.Tensor, n: int) -> object:
    return json.loads(t[:n].numpy().tobytes().decode())


def gather_json(obj: object, rank: int, world: int, group) -> list | None:
    """Every rank's JSON object on rank 0 (None elsewhere), through ``group`` (gloo, CPU tensors)."""
    if world == 1:
        return [obj]
    data = _to_bytes(obj)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    cap = max(int(s) for s in sizes)
    padded = torch.zeros(cap, dtype=torch.uint8)
    padded[: data.numel()] = data
    bufs = [torch.zeros(cap, dtype=torch.uint8) for _ in range(world)] if rank == 0 else None
    dist.gather(padded, bufs, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if bufs is None:  # rank != 0
        return None
    return [_from_bytes(b, int(s)) for b, s in zip(bufs, sizes)]


def broadcast_json(obj: object, rank: int, world: int, group) -> object:
    """Rank 0's JSON object on every rank."""
    if world == 1:
        return obj
    data = _to_bytes(obj) if rank == 0 else torch.zeros(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(size, src=src, group=group)
    buf = data if rank == 0 else torch.zeros(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return _from_bytes(buf, int(size))


def new_group(world: int, timeout_s: float):
    """A gloo group over every rank for checkpoint coordination (None for one process)."""
    if world == 1 or not dist.is_initialized():
        return None
    return world_gloo_group(timedelta(seconds=timeout_s))


class Checkpointer:
    """Saves under ``root``; one asynchronous save in flight at a time. Every rank makes one.

    Host memory: the snapshot buffers (this rank's write share of the state: 1/n of it for n
    data-parallel replicas) are kept between saves, trading that memory for a short stall.
    """

    def __init__(self, root: str | Path, rank: int = 0, world: int = 1, group=None, keep: int = 0) -> None:
        self.root = Path(root)
        self.rank, self.world, self.group, self.keep = rank, world, group, keep
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._saved: Path | None = None
        self._buffers: dict[str, torch.Tensor] = {}  # host snapshot memory, reused by every save
        self.last_stall_s = 0.0
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            clean_stale(self.root)
        if world > 1:
            dist.barrier(group=group)

    def save(
        self, step: int, state: dict[str, ShardedTensor], rank_state: dict, meta: dict, blocking: bool = True
    ):
        """Save ``state`` as step ``step``; returns the committed path (blocking) or None (async)."""
        t0 = time.perf_counter()
        self.wait()
        snap = snapshot(step, state, rank_state, meta, self._buffers, copy=not blocking)
        if blocking:
            self._finish(snap)
            self.last_stall_s = time.perf_counter() - t0
            return self.wait()
        self._thread = threading.Thread(
            target=self._finish, args=(snap,), name="loom-checkpoint", daemon=True
        )
        self._thread.start()
        self.last_stall_s = time.perf_counter() - t0
        return None

    def _finish(self, snap: Snapshot) -> None:
        try:
            tmp = self.root / (TMP_PREFIX + snap.tag)
            try:
                record = write_shard(tmp, snap, self.rank, self.world)
            except Exception as e:  # report it to rank 0 instead of leaving the others waiting
                record = {
                    "rank": self.rank,
                    "tag": snap.tag,
                    "step": snap.step,
                    "error": describe_error(e, tmp),
                }
            records = gather_json(record, self.rank, self.world, self.group)
            status: dict = {}
            if self.rank == 0:
                if records is None:  # gather_json hands rank 0 every rank's record
                    raise RuntimeError("checkpoint: rank 0 gathered no shard records")
                status = self._commit_or_explain(records)
            status = cast(dict, broadcast_json(status, self.rank, self.world, self.group))  # rank 0's dict
            if status.get("error"):
                raise F.CheckpointError(status["error"])
            self._saved = self.root / status["tag"]
        except BaseException as e:  # noqa: BLE001 - surfaced by wait()
            self._error = e

    def _commit_or_explain(self, records: list[dict]) -> dict:
        failed = [f"rank {r['rank']}: {r['error']}" for r in records if "error" in r]
        try:
            if failed:
                raise F.CheckpointError("save failed on " + "; ".join(failed))
            path = commit(self.root, records, self.world, self.keep)
            return {"tag": path.name}
        except Exception as e:  # noqa: BLE001 - every rank must hear about it
            for tag in {r["tag"] for r in records}:
                shutil.rmtree(self.root / (TMP_PREFIX + tag), ignore_errors=True)
            return {"error": str(e) if isinstance(e, F.CheckpointError) else describe_error(e, self.root)}

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is committed; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, self._error = self._error, None
        if err is not None:
            raise err
        saved, self._saved = self._saved, None
        return saved

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
