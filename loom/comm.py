"""Thin collectives layer that counts what it moves.

Every collective goes through here with an explicit group and a :class:`CommMeter`. Groups of
size 1 (or ``None``) return at once. Bytes moved per rank are the ring-algorithm volumes,
for a full tensor of S bytes over n ranks:

    all_reduce      2 S (n-1)/n
    reduce_scatter    S (n-1)/n      (S = the full, unscattered input)
    all_gather        S (n-1)/n      (S = the full, gathered output)
    broadcast         S
    send / recv       S

Strict mode (``LOOM_STRICT_COMM=1``; on in the test suite) checks what NCCL requires and gloo
forgives, so CPU runs fail where a GPU run would: every tensor contiguous, of a dtype NCCL
moves, on the group's device type (``cuda`` for NCCL, ``cpu`` for gloo; never ``meta``, which
catches a tensor created on the default device when tests make that the meta device), and
each group's point-to-point batches executed one after another in issue order, as NCCL's
one stream per group does (a posting order that would deadlock on NCCL hangs here, and the
receiver's timeout reports it). Every collective is also logged per group as
``op(dtype[shape])``; :func:`take_order_log` hands the log over so that the members of each
group can be compared (the test pool compares them after every call, the strict trainer at
every step): a rank issuing another collective, or the same ones in another order, is named.

Host-tensor sentinel (strict mode): tensors owned by host stores (offloaded parameter, gradient
and optimizer shards, fp32 masters, pinned staging buffers) are tagged where they are created
(:func:`mark_host`), by storage, so their views are tagged too. A collective or point-to-point
handed one fails with one line naming the collective and the Loom caller: NCCL moves device
memory only. On a CPU run every tensor is on the CPU, so the tag, not the device, tells a
host-store tensor from a "device" one; :func:`device_copy` is the way across.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import warnings
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeAlias

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

# torch >= 2.13 names all_gather_into_tensor / reduce_scatter_tensor deprecated in favour of
# *_single; both run the same collective, and the old names work on every torch this supports.
warnings.filterwarnings(
    "ignore", message=r".*is deprecated\. Please use `torch\.distributed\.\w+_single`", category=FutureWarning
)

Group: TypeAlias = dist.ProcessGroup | None
STRICT_ENV = "LOOM_STRICT_COMM"
# dtypes NCCL reduces and moves (bool travels as uint8)
NCCL_DTYPES = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)


class StrictCommError(RuntimeError):
    """A collective that NCCL would reject or hang on (strict mode)."""


# LOOM_STRICT_COMM's values, as shells and CI files write a switch (any other is refused at launch)
STRICT_ON, STRICT_OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def strict() -> bool:
    """Whether ``LOOM_STRICT_COMM`` asks for NCCL's rules on every backend (:data:`STRICT_ON`)."""
    return os.environ.get(STRICT_ENV, "").strip().lower() in STRICT_ON


def check_strict_env() -> None:
    """``LOOM_STRICT_COMM`` set to a value that is neither on nor off is refused in one line (``maybe``
    turned strict mode on, ``false`` too)."""
    value = os.environ.get(STRICT_ENV, "")
    if value.strip().lower() not in STRICT_ON + STRICT_OFF:
        raise ValueError(
            f"environment: {STRICT_ENV}={value!r} is neither on ({', '.join(STRICT_ON)}) nor off "
            f"({', '.join(v for v in STRICT_OFF if v)} or unset)"
        )


def _device_type(group: Group) -> str | None:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return "cuda"
    if "gloo" in backend and "nccl" not in backend:
        return "cpu"
    return None


_ORDER_LOG: dict[tuple[str, tuple[int, ...]], list[str]] = defaultdict(list)


def _group_key(group: Group) -> tuple[str, tuple[int, ...]]:
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError("comm: no process group given and torch.distributed has no default group")
    return pg.group_name, tuple(dist.get_process_group_ranks(pg))


def take_order_log() -> dict[tuple[str, tuple[int, ...]], list[str]]:
    """This rank's collectives since the last call, per group ``(name, global ranks)`` (strict mode)."""
    out = dict(_ORDER_LOG)
    _ORDER_LOG.clear()
    return out


def first_order_mismatch(logs: list[dict[tuple[str, tuple[int, ...]], list[str]]]) -> str | None:
    """Compare per-rank order logs (index = global rank): the first collective on which two members
    of a group differ, as one line, or None when every group's members agree."""
    for key in sorted({k for log in logs for k in log}):
        name, ranks = key
        seqs = {r: logs[r].get(key, []) for r in ranks if r < len(logs)}
        ref_rank = ranks[0]
        for r, seq in seqs.items():
            ref = seqs[ref_rank]
            if seq == ref:
                continue
            i = next(
                (i for i, (a, b) in enumerate(zip(ref, seq, strict=False)) if a != b), min(len(ref), len(seq))
            )
            mine = seq[i] if i < len(seq) else "nothing"
            theirs = ref[i] if i < len(ref) else "nothing"
            return (
                f"collective order differs on group {name} (ranks {list(ranks)}): collective #{i} is "
                f"{theirs} on rank {ref_rank} but {mine} on rank {r}"
            )
    return None


def verify_order() -> None:
    """Strict mode: gather every rank's order log since the last call and raise
    :class:`StrictCommError` naming the first collective two members of a group disagree on.
    Collective itself (over the default group): every rank calls it at the same point (a step end)."""
    if not strict() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    logs: list = [None] * dist.get_world_size()
    dist.all_gather_object(logs, take_order_log())
    if (mismatch := first_order_mismatch(logs)) is not None:
        raise StrictCommError(mismatch)


# storage address -> (the storage, alive or not; what owns it): tensors of host stores (strict mode)
_HOST_OWNED: dict[int, tuple[StorageWeakRef, str]] = {}
_HOST_PURGE_AT = 1024  # purge freed storages when the table doubles past this


def mark_host(t: torch.Tensor, owner: str) -> torch.Tensor:
    """Tag ``t``'s storage as host memory owned by ``owner`` (e.g. "cpu store 'grad3'"), so that a
    collective handed it, or any view of it, fails in strict mode. Returns ``t``. Kept in strict mode
    only (no cost otherwise)."""
    global _HOST_PURGE_AT
    if not strict() or t.numel() == 0:
        return t
    storage = t.untyped_storage()
    _HOST_OWNED[storage.data_ptr()] = (StorageWeakRef(storage), owner)
    if len(_HOST_OWNED) > _HOST_PURGE_AT:
        for key in [k for k, (ref, _) in _HOST_OWNED.items() if ref.expired()]:
            del _HOST_OWNED[key]
        _HOST_PURGE_AT = max(1024, 2 * len(_HOST_OWNED))
    return t


def host_owner(t: torch.Tensor) -> str | None:
    """The host store owning ``t``'s storage (:func:`mark_host`), or None."""
    if not _HOST_OWNED or t.numel() == 0 or t.device.type == "meta":
        return None
    key = t.untyped_storage().data_ptr()
    entry = _HOST_OWNED.get(key)
    if entry is None:
        return None
    if entry[0].expired():  # freed: the address may belong to another tensor now
        del _HOST_OWNED[key]
        return None
    return entry[1]


def device_copy(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """``t`` itself when it is device memory on ``device`` (None: its own), else a copy there (a host
    store's tensor on a CPU run included): what a collective may be handed. Copy results back with
    ``t.copy_(copy)`` when ``copy is not t``."""
    device = t.device if device is None else torch.device(device)
    if t.device == device and host_owner(t) is None:
        return t
    return t.to(device, copy=True)


def _caller() -> str:
    """``path:line function`` of the innermost frame outside this module (the Loom caller)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    short = path[path.rfind("/loom/") + 1 :] if "/loom/" in path else os.path.basename(path)
    return f"{short}:{frame.f_lineno} {frame.f_code.co_name}"


def check_tensors(op: str, group: Group, *tensors: torch.Tensor) -> None:
    """Strict mode: raise :class:`StrictCommError` for a tensor NCCL would not take (see module doc),
    a host store's tensor included, and log the collective (point-to-point excepted) for the
    cross-rank order comparison."""
    if not strict():
        return
    for t in tensors:
        if (owner := host_owner(t)) is not None:
            raise StrictCommError(
                f"{op} called from {_caller()}: tensor of shape {tuple(t.shape)} ({t.dtype}) is host "
                f"memory of the {owner}; NCCL moves device memory only: use comm.device_copy first"
            )
    if op != "send/recv":
        # all-to-all row counts differ by rank by design: only the row width is compared
        shape = (lambda t: ["*", *t.shape[1:]]) if op == "all_to_all" else (lambda t: list(t.shape))
        _ORDER_LOG[_group_key(group)].append(
            f"{op}(" + ", ".join(f"{str(t.dtype).removeprefix('torch.')}{shape(t)}" for t in tensors) + ")"
        )
    want = _device_type(group)
    for t in tensors:
        where = f"{op}: tensor of shape {tuple(t.shape)} ({t.dtype}, {t.device})"
        if t.device.type == "meta" or (want is not None and t.device.type != want):
            raise StrictCommError(
                f"{where} is not on the group's device ({want}); create it on the mesh's device"
            )
        if not t.is_contiguous():
            raise StrictCommError(f"{where} is not contiguous; NCCL needs contiguous buffers")
        if t.dtype not in NCCL_DTYPES:
            raise StrictCommError(f"{where}: NCCL does not move {t.dtype}")


class _QueuedWork:
    """The handle of one operation of an in-order batch (strict mode)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = None if timeout is None else timeout.total_seconds()
        if not self.done.wait(seconds):
            raise RuntimeError(
                f"point-to-point operation timed out after {seconds:.1f} s (strict in-order stream)"
            )
        if self.error is not None:
            raise RuntimeError(str(self.error).splitlines()[0] if str(self.error) else repr(self.error))
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


class _InOrderStream:
    """Runs one group's point-to-point batches one after another, in issue order (NCCL's stream).

    Its thread holds no reference to the group between batches, and ends once the group is freed
    (each gloo group keeps threads of its own: a stream that kept its group kept them too)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, args=(self.jobs,), daemon=True, name="loom-p2p-stream").start()

    def submit(self, ops: list) -> list[_QueuedWork]:
        works = [_QueuedWork() for _ in ops]
        self.jobs.put((ops, tuple(works)))
        return works

    def close(self) -> None:
        self.jobs.put(None)

    @staticmethod
    def _loop(jobs: queue.SimpleQueue) -> None:
        failed: BaseException | None = None
        while (job := jobs.get()) is not None:
            ops, works = job
            del job
            if failed is None:
                try:
                    with _ISSUE_LOCK:  # torch's batch_isend_irecv is not safe to enter from two threads
                        issued = dist.batch_isend_irecv(ops)
                    for w in issued:
                        w.wait()
                    del issued
                except BaseException as e:  # noqa: BLE001 - handed to every waiter
                    failed = e.with_traceback(None)  # its frames held the ops
            del ops  # its group: the next batch may be long in coming, or never
            for w in works:
                w.error = failed
                w.done.set()
            del works


_ISSUE_LOCK = threading.Lock()
_STREAMS: dict[int, _InOrderStream] = {}  # by id(group) while the group lives
_STREAMS_LOCK = threading.Lock()


def _stream(group: Group) -> _InOrderStream:
    key = id(group)
    with _STREAMS_LOCK:
        if key not in _STREAMS:
            _STREAMS[key] = _InOrderStream()
            if group is not None:  # the default group lives as long as the process group does
                weakref.finalize(group, _close_stream, key)
        return _STREAMS[key]


def _close_stream(key: int) -> None:
    with _STREAMS_LOCK:
        stream = _STREAMS.pop(key, None)
    if stream is not None:
        stream.close()


def wait(work, timeout: timedelta | None = None) -> None:
    """Wait for ``work``: with ``timeout`` on the CPU (a peer that never answers raises), plainly on
    an accelerator, where ``wait`` only orders the current stream after the communication."""
    if timeout is not None and not isinstance(work, _QueuedWork) and torch.accelerator.is_available():
        timeout = None
    work.wait(timeout) if timeout is not None else work.wait()


def group_size(group: Group) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def ring_bytes(op: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends for ``op`` on a tensor of ``nbytes`` over ``n`` ranks (ring algorithm)."""
    if n <= 1:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n}
    return nbytes * factor.get(op, 1.0)


@dataclass
class CommMeter:
    """Counts calls, payload bytes and ring bytes-moved per collective kind, reset per step."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    payload: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    moved: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def record(self, op: str, tensor_bytes: int, n: int) -> None:
        self.calls[op] += 1
        self.payload[op] += tensor_bytes
        self.moved[op] += ring_bytes(op, tensor_bytes, n)

    def record_sent(self, op: str, tensor_bytes: int, sent_bytes: int) -> None:
        """One ``op`` whose bytes sent by this rank were counted, not derived from the ring volumes
        (the point-to-point all-reduces of :mod:`loom.parallel.allreduce`)."""
        self.calls[op] += 1
        self.payload[op] += tensor_bytes
        self.moved[op] += sent_bytes

    @property
    def total_moved(self) -> float:
        return float(sum(self.moved.values()))

    def snapshot(self) -> dict[str, float]:
        out: dict[str, float] = {f"comm_{k}_bytes": v for k, v in self.moved.items()}
        out |= {f"comm_{k}_calls": c for k, c in self.calls.items()}
        out["comm_bytes"] = self.total_moved
        return out

    def reset(self) -> None:
        self.calls.clear()
        self.payload.clear()
        self.moved.clear()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(t: torch.Tensor, group: Group, meter: CommMeter | None = None, async_op: bool = False):
    """Sum ``t`` in place over ``group``. Returns a work handle when ``async_op`` (else None)."""
    n = group_size(group)
    if n == 1:
        return None
    check_tensors("all_reduce", group, t)
    if meter is not None:
        meter.record("all_reduce", nbytes(t), n)
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_via(
    t: torch.Tensor, group: Group, device: torch.device, meter: CommMeter | None = None
) -> None:
    """Sum ``t`` in place over ``group`` through a copy on ``device`` when it lives elsewhere (host
    memory under offload): NCCL reduces only device memory."""
    if group_size(group) == 1:
        return
    on_device = device_copy(t, device)
    all_reduce(on_device, group, meter)
    if on_device is not t:
        t.copy_(on_device)


def all_reduce_max(t: torch.Tensor, group: Group, meter: CommMeter | None = None) -> None:
    n = group_size(group)
    if n == 1:
        return
    check_tensors("all_reduce_max", group, t)
    if meter is not None:
        meter.record("all_reduce", nbytes(t), n)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)


def reduce_scatter(
    out: torch.Tensor,
    full: torch.Tensor,
    group: Group,
    meter: CommMeter | None = None,
    async_op: bool = False,
):
    """``out`` = this rank's 1/n slice of the sum of ``full`` over ``group`` (flat, equal slices)."""
    n = group_size(group)
    if n == 1:
        out.copy_(full)
        return None
    check_tensors("reduce_scatter", group, out, full)
    if meter is not None:
        meter.record("reduce_scatter", nbytes(full), n)
    return dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather(
    full: torch.Tensor,
    shard: torch.Tensor,
    group: Group,
    meter: CommMeter | None = None,
    async_op: bool = False,
):
    """``full`` = concatenation over ``group`` of every rank's ``shard`` (flat, equal slices)."""
    n = group_size(group)
    if n == 1:
        full.copy_(shard)
        return None
    check_tensors("all_gather", group, full, shard)
    if meter is not None:
        meter.record("all_gather", nbytes(full), n)
    return dist.all_gather_into_tensor(full, shard, group=group, async_op=async_op)


def batch_p2p(
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
    group: Group,
    meter: CommMeter | None = None,
) -> list:
    """Post isend/irecv to/from group-local peers as one ``batch_isend_irecv``; returns the works
    (sends first, then recvs, in the given order). Messages between two ranks match in post order.
    Strict mode: the batch runs after this rank's earlier batches of ``group`` have completed."""
    check_tensors("send/recv", group, *(t for t, _ in sends), *(t for t, _ in recvs))
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=peer) for t, peer in recvs]
    if not ops:
        return []
    if meter is not None:
        for t, _ in sends:
            meter.record("send", nbytes(t), 2)
    if strict() and _device_type(group) != "cuda":  # NCCL orders its stream itself
        return _stream(group).submit(ops)
    return dist.batch_isend_irecv(ops)


def broadcast(t: torch.Tensor, src_local: int, group: Group, meter: CommMeter | None = None) -> None:
    """Broadcast from the ``src_local``-th rank of ``group``."""
    n = group_size(group)
    if n == 1:
        return
    check_tensors("broadcast", group, t)
    if meter is not None:
        meter.record("broadcast", nbytes(t), n)
    dist.broadcast(t, group_src=src_local, group=group)
