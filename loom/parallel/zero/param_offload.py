"""ZeRO-Infinity parameter offload: ZeRO-3 whose parameter and gradient shards live off the device.

``parallel.offload_params = cpu | disk`` keeps each unit's parameter shard (Φ_u'/N elements) and
its reduced gradient shard in the same :class:`~loom.optim.store.StateStore` the optimizer-state
offload uses (host memory, pinned on a GPU; or memory-mapped files whose blocks are reserved with
``posix_fallocate`` when they are created, so a full disk is an error before training, never a
SIGBUS later). The optimizer state goes to the host with them (``parallel.offload = none`` is taken
as the same place), so the optimizer step runs on the host shard, in place.

Fetch: a unit's all-gather first copies its shard from the store into a staging buffer on the
device, then all-gathers from it. The copy is *read ahead*: when the all-gather of the next unit is
prefetched (:class:`~loom.parallel.zero.stage3.FullyShardedZero`'s prefetch, forward and backward
order), the copy of the unit after it is started on a reader thread, so the host or disk read
overlaps the current unit's compute and the next unit's all-gather. Reads still pending when the
optimizer steps are dropped (they hold the old weights).

Bytes per rank (fp32 AdamW; Φ' = Σ padded unit sizes, N the sharding group):

    device, between steps   0                                     (ZeRO-3 alone: 16Φ'/N)
    store (host or disk)    params 4Φ'/N + grads 4Φ'/N + Adam 8Φ'/N = 16Φ'/N
    device, during a step   ZeRO-3's gathered units and gradient buffers
                            + staging: at most 2 shards of a unit (one gathering, one read ahead)
                            + reduced gradient shards not yet landed in the store (ZeRO-3's
                              reductions in flight: the same bytes its reducer holds on a GPU)

Gradient shard: the reducer forms each unit's reduced shard in a device buffer; once its reduction
has completed (checked at each later unit's reduction, and at the end of the step's reductions)
the shard is copied into the store without blocking (pinned host memory on a GPU), and the host
waits once, on the event after the last copy, where ``finish_sync`` ends: the norm and the
optimizer step read the host shards next. No host wait inside backward, one per step.

so the largest model that fits a per-rank device budget M is set by one unit and the activations,
not by Φ/N: ZeRO-3 needs 16Φ'/N + transient ≤ M, ZeRO-Infinity transient ≤ M (and 16Φ'/N of host
memory or disk). Bytes moved are ZeRO-3's; the store adds 4Φ'/N read (per gather) and 4Φ'/N written
(the gradient shard) over PCIe or the disk per step.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from loom import comm
from loom.optim.store import StateStore
from loom.parallel.base import to_device
from loom.parallel.zero.quantized import Then
from loom.parallel.zero.stage3 import GATHERING, SHARDED, FullyShardedZero, Unit


class OffloadedZero(FullyShardedZero):
    """ZeRO-3 with parameter and gradient shards in ``param_store`` (host memory or disk)."""

    def __init__(self, module: torch.nn.Module, *, param_store: StateStore, **kwargs: Any) -> None:
        self.param_store = param_store
        self._owned: set[int] = set()  # storages handed out by the store
        self._reads: dict[int, Future] = {}  # unit index -> its shards being read into staging buffers
        self._staged_bytes = 0  # staging buffers alive (reading, feeding an all-gather, or landing)
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-param-fetch")
        self._landing: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device shard, its store shard)
        self._landed: Any = None  # the event after the last device -> host gradient copy (CUDA)
        super().__init__(module, **kwargs)
        self.comm_device = kwargs.get("device")  # the norm's sums of host gradient shards cross ranks there
        self.optim.comm_device = self.comm_device  # so do the optimizer's statistics (Adafactor)

    # ------------------------------------------------------------------ placement
    def _to_store(self, t: torch.Tensor, name: str) -> torch.Tensor:
        s = self.param_store.zeros(t.numel(), name, t.dtype)
        s.copy_(t)
        self._owned.add(s.untyped_storage().data_ptr())
        return s

    def _make_unit(self, *args: Any, **kwargs: Any) -> Unit:
        """ZeRO-3's unit, its parameter, gradient (and frozen) shards moved into the store."""
        u = super()._make_unit(*args, **kwargs)
        if u.trained:
            u.shard = self._to_store(u.shard, f"param{u.index}")
            u.grad_shard = self._to_store(u.grad_shard, f"grad{u.index}")
        for k, f in enumerate(u.frozen):  # LoRA's base, a buffer per dtype
            f.shard = self._to_store(f.shard, f"frozen{u.index}.{k}")
        return u

    def _in_store(self, t: torch.Tensor) -> bool:
        return t.numel() > 0 and t.untyped_storage().data_ptr() in self._owned

    # ------------------------------------------------------------------ fetch
    def _read(self, u: Unit) -> Future:
        """Start copying ``u``'s shards from the store into new staging buffers on the device."""
        pin = self.param_store.device != u.full.device  # a real host -> device copy
        stages = [torch.empty(s.numel(), dtype=s.dtype, device=full.device) for full, s in u.buffers()]
        self._staged_bytes += sum(comm.nbytes(s) for s in stages)

        def copy() -> list[torch.Tensor]:
            for stage, (_, shard) in zip(stages, u.buffers()):
                stage.copy_(shard, non_blocking=pin)
            return stages

        return self._reader.submit(copy)

    def _gather(self, u: Unit, how: str) -> None:
        """Copy (or take the read-ahead copy of) the shards to the device, then all-gather them."""
        future = self._reads.pop(u.index, None)
        self.events.append(("fetch", u.index, "demand" if future is None else "prefetch"))
        stages = (future or self._read(u)).result()
        works = []
        for (full, _), stage in zip(u.buffers(), stages):
            full.untyped_storage().resize_(full.numel() * full.element_size())
            works.append(comm.all_gather(full, stage, self._gather_group(u), self.meter, async_op=True))
        nbytes = sum(comm.nbytes(s) for s in stages)
        u.work = [Then(works, [lambda: self._release(nbytes, stages)])]  # waiting frees the staging buffers
        u.state = GATHERING
        self.events.append(("gather", u.index, how))
        self._track()

    def _release(self, nbytes: int, stages: list[torch.Tensor]) -> None:
        stages.clear()
        self._staged_bytes -= nbytes

    def _prefetch(self, order: list[Unit], current: Unit) -> None:
        """ZeRO-3's prefetch of the next unit's all-gather, and the read of the unit after it."""
        super()._prefetch(order, current)
        if current in order:
            i = order.index(current) + 2
            if i < len(order) and order[i].state == SHARDED and order[i].index not in self._reads:
                self._reads[order[i].index] = self._read(order[i])
                self._track()

    def _drop_reads(self) -> None:
        for future in self._reads.values():
            stages = future.result()
            self._release(sum(comm.nbytes(s) for s in stages), stages)
        self._reads.clear()

    def _transient_bytes(self) -> int:
        return super()._transient_bytes() + self._staged_bytes

    # ------------------------------------------------------------------ gradient shards
    def _reduce(self, u: Unit) -> None:
        """ZeRO-3's reduction of ``u``'s gradient into a device buffer (not the store: NCCL writes
        device memory); earlier units' completed shards start their copies to the store."""
        if not u.trained:
            super()._reduce(u)
            return
        host = u.grad_shard
        u.grad_shard = torch.empty(host.numel(), dtype=host.dtype, device=u.full.device)
        try:
            super()._reduce(u)
        finally:
            u.grad_shard, stage = host, u.grad_shard
        self._landing.append((stage, host))
        self._staged_bytes += comm.nbytes(stage)
        self._land()

    def _land(self) -> None:
        """Copy every completed reduced shard into the store (non-blocking into pinned memory)."""
        pending = {id(p.dest) for r in self._reducers for p in r.inflight}
        keep = []
        for stage, host in self._landing:
            if id(stage) in pending:
                keep.append((stage, host))
                continue
            pinned = host.device != stage.device and host.is_pinned()
            host.copy_(stage, non_blocking=pinned)
            self._staged_bytes -= comm.nbytes(stage)
            if pinned and stage.device.type == "cuda":
                self._landed = torch.cuda.Event()
                self._landed.record()
        self._landing = keep

    def _reduce_all(self) -> None:
        """ZeRO-3's, then the last shards copied to the store and the host's one wait for them."""
        super()._reduce_all()
        self._land()
        if self._landed is not None:
            self._landed.synchronize()
            self._landed = None

    def param_grad_sq(self, p: torch.Tensor) -> torch.Tensor:
        """Σ g² over ``p``'s reduced gradient, the host shard's squares summed over the sharding
        group on the device (a scalar in host memory cannot cross NCCL)."""
        sq = self.param_grad_shard(p).float().pow(2).sum()
        sq = to_device(sq, self.comm_device) if self.comm_device is not None else sq
        comm.all_reduce(sq, self.shard_group)
        return sq

    # ------------------------------------------------------------------ Strategy
    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """The optimizer step on the host (or disk) shards; read-ahead copies of old weights dropped."""
        self._drop_reads()
        super().step(lr, grad_scale)

    def state_bytes(self) -> dict[str, int]:
        """ZeRO-3's keys, measured: ``param_bytes``/``grad_bytes``/``frozen_bytes`` count the shards
        resident outside the store, ``*_offload_bytes`` those in it; ``device_bytes`` is every byte of
        persistent state outside the stores (0 when the optimizer state is offloaded too)."""
        out = super().state_bytes()
        groups = {
            "param": [u.shard for u in self.units if u.trained],
            "grad": list(self.grad_shards),
            "frozen": [f.shard for u in self.units for f in u.frozen],
        }
        for key, ts in groups.items():
            if ts or key != "frozen":
                out[f"{key}_bytes"] = sum(comm.nbytes(t) for t in ts if not self._in_store(t))
                out[f"{key}_offload_bytes"] = sum(comm.nbytes(t) for t in ts if self._in_store(t))
        optim_device = out["optim_bytes"] - out["optim_offload_bytes"]
        out["device_bytes"] = (
            out["param_bytes"] + out["grad_bytes"] + out.get("frozen_bytes", 0) + optim_device
        )
        return out

    def load_sharded(self, reader) -> None:
        self._drop_reads()  # copies read ahead of the loaded values
        super().load_sharded(reader)

    def remove(self) -> None:
        self._drop_reads()
        self._reader.shutdown(wait=True)
        super().remove()
