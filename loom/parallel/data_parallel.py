"""Data parallelism: bucketed gradient all-reduce overlapped with backward.

Gradients live in flat bucket buffers (``param.grad`` is a view into its bucket), filled in
reverse registration order, which is roughly the order backward produces them. When the last
gradient of a bucket has been accumulated, that bucket's all-reduce is launched asynchronously
while backward goes on; :meth:`DataParallel.finish_sync` waits for all of them.

Averaging: each bucket is divided by n before the sum-all-reduce, so the result is the mean
over ranks; with equal micro-batches that equals the gradient of the global-batch mean loss.

Collective order: a bucket launches only after every lower-numbered bucket of its group has, so
every rank issues each group's all-reduces in the same order (as NCCL requires) even when
ranks complete buckets in different orders (an expert that received no tokens on one rank).

Gradient accumulation: during micro-steps that are not the last, :meth:`no_sync` keeps hooks
from communicating; gradients accumulate in the buffers; the last micro-step communicates once.

Memory: parameters Φ and gradients Φ are replicated (grad buffers add no copy, they *are* the
gradients). Communication per rank per optimizer step, ring all-reduce over n ranks:
    bytes = 2 · Φ · b · (n-1)/n,   b = bytes per element of ``reduce_dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from loom import comm
from loom.comm import CommMeter, Group
from loom.parallel.sync import SyncSwitch
from loom.parallel.zero.layout import unique_params
from loom.train.optim import build_optimizer, optimizer_state_bytes, set_lr
from loom.train.step import clip_grad_norm, grad_norm_sq


@dataclass
class Bucket:
    """A flat gradient buffer shared by a run of parameters."""

    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor  # grads live here (param.grad are views)
    comm_buffer: torch.Tensor  # == buffer, or a copy in reduce_dtype
    offsets: list[tuple[int, int]] = field(default_factory=list)
    pending: int = 0
    work: object | None = None
    launched: bool = False
    ready: bool = False  # every gradient of the step accumulated (launches once its predecessors have)
    group: Group = None  # where it is summed: the dp group, or an expert's edp group (expert parallelism)


@dataclass
class LaunchRecord:
    """For instrumentation: which bucket launched, and how many params were still waiting then."""

    bucket: int
    params_not_ready: int


class DataParallel(SyncSwitch):
    """Attach bucketed, overlapped gradient all-reduce to ``module`` over ``group``.

    Not an ``nn.Module`` wrapper: the model is called as usual; this object owns the gradient
    buffers and the communication. Call :meth:`zero_grad` (not ``set_to_none``) between steps.
    """

    def __init__(
        self,
        module: nn.Module,
        group: Group,
        meter: CommMeter | None = None,
        bucket_mb: float = 25.0,
        reduce_dtype: torch.dtype | None = None,
        tp_group: Group = None,
    ) -> None:
        self.module = module
        self.group = group
        self.tp_group = tp_group  # tensor-parallel peers: sharded params' squares add over it in the norm
        self.world = comm.group_size(group)
        self.meter = meter
        self.params = unique_params(module)
        self.reduce_dtype = reduce_dtype
        self.sync_enabled = True
        self.optimizer: torch.optim.Optimizer | None = None
        self.launch_log: list[LaunchRecord] = []
        self._ready_count = 0
        self.buckets = self._build_buckets(int(bucket_mb * 1024 * 1024))
        self._slot: dict[int, tuple[Bucket, int, int]] = {}  # id(param) -> (bucket, offset, numel)
        for b in self.buckets:
            for p, (off, n) in zip(b.params, b.offsets):
                self._slot[id(p)] = (b, off, n)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

    # ------------------------------------------------------------------ construction
    def _build_buckets(self, cap_bytes: int) -> list[Bucket]:
        groups: list[list[nn.Parameter]] = []
        dense = [p for p in self.params if getattr(p, "ep_shard", None) is None]
        experts = [p for p in self.params if getattr(p, "ep_shard", None) is not None]  # own buckets, own group
        for params in (dense, experts):
            current: list[nn.Parameter] = []
            size = 0
            for p in reversed(params):
                nb = p.numel() * p.element_size()
                if current and (size + nb > cap_bytes or p.dtype != current[0].dtype or p.device != current[0].device):
                    groups.append(current)
                    current, size = [], 0
                current.append(p)
                size += nb
            if current:
                groups.append(current)
        buckets = []
        for i, ps in enumerate(groups):
            numel = sum(p.numel() for p in ps)
            buf = torch.zeros(numel, dtype=ps[0].dtype, device=ps[0].device)
            rd = self.reduce_dtype or buf.dtype
            cbuf = buf if rd == buf.dtype else torch.zeros(numel, dtype=rd, device=buf.device)
            b = Bucket(index=i, params=ps, buffer=buf, comm_buffer=cbuf, group=_reduce_group(ps[0], self.group))
            off = 0
            for p in ps:
                b.offsets.append((off, p.numel()))
                view = buf[off : off + p.numel()].view_as(p)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                off += p.numel()
            b.pending = len(ps)
            buckets.append(b)
        return buckets

    # ------------------------------------------------------------------ hooks
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        b, off, n = self._slot[id(p)]
        view = b.buffer[off : off + n].view_as(p)
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            # Someone replaced .grad (e.g. set_to_none); fold it back into the bucket.
            view.add_(p.grad)
            p.grad = view
        if not self.sync_enabled:
            return
        self._ready_count += 1
        b.pending -= 1
        if b.pending == 0:
            b.ready = True
            for other in self.buckets:  # this group's buckets in index order, up to the first not ready
                if other.group is b.group and not other.launched:
                    if not other.ready:
                        break
                    self._launch(other)

    def _launch(self, b: Bucket) -> None:
        self.launch_log.append(LaunchRecord(b.index, len(self.params) - self._ready_count))
        if self.world > 1:
            if b.comm_buffer is not b.buffer:
                b.comm_buffer.copy_(b.buffer)
            b.comm_buffer.div_(self.world)  # the mean over all dp ranks, also for an expert's edp sum
            b.work = comm.all_reduce(b.comm_buffer, b.group, self.meter, async_op=True)
        b.launched = True

    # ------------------------------------------------------------------ public API

    def finish_sync(self) -> None:
        """Wait for every bucket's all-reduce (launching any bucket left, e.g. unused params)."""
        if not self.sync_enabled:
            return
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            if b.comm_buffer is not b.buffer:
                b.buffer.copy_(b.comm_buffer)
            b.launched = b.ready = False
            b.pending = len(b.params)
        self._ready_count = 0

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()
            for p, (off, n) in zip(b.params, b.offsets):
                view = b.buffer[off : off + n].view_as(p)
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
        self.launch_log.clear()

    def grad_bytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    # ------------------------------------------------------------------ Strategy: optimizer side
    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> DataParallel:
        """Own the (replicated) optimizer, so this object is a complete training Strategy."""
        self.optimizer = optimizer
        return self

    def clip_grad_norm(self, max_norm: float) -> float:
        """Gradients are replicated over dp after the all-reduce; tensor-parallel shards add their
        squares over tp, replicated parameters (norms) count once; expert shards add theirs over ep."""
        experts = [p for p in self.params if getattr(p, "ep_shard", None) is not None]
        if not experts:
            return clip_grad_norm(self.params, max_norm, tp_group=self.tp_group)
        dense = [p for p in self.params if getattr(p, "ep_shard", None) is None]
        device = experts[0].device
        sq = grad_norm_sq(experts, device)
        comm.all_reduce(sq, experts[0].ep_shard[2])
        norm = (sq + grad_norm_sq(dense, device)).sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            grads = [p.grad for p in self.params if p.grad is not None]
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return float(norm)

    def step(self, lr: float) -> None:
        set_lr(self.optimizer, lr)
        self.optimizer.step()

    def state_bytes(self) -> dict[str, int]:
        """Replicated state: params Φ·b, grads Φ·b, Adam moments 2·Φ·4 (fp32)."""
        return {
            "param_bytes": sum(p.numel() * p.element_size() for p in self.params),
            "grad_bytes": self.grad_bytes(),
            "optim_bytes": optimizer_state_bytes(self.optimizer),
        }

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _reduce_group(p: torch.Tensor, group: Group) -> Group:
    """The group ``p``'s gradient is summed over: its experts' edp group, or the data-parallel one."""
    shard = getattr(p, "ep_shard", None)
    return group if shard is None else shard[3]


def broadcast_params(module: nn.Module, group: Group, meter: CommMeter | None = None) -> None:
    """Make every rank's parameters equal to those of the group's first rank."""
    for p in unique_params(module):
        comm.broadcast(p.data, 0, group, meter)


REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_data_parallel(module: nn.Module, mesh, cfg, meter: CommMeter | None = None) -> DataParallel:
    """Entry point used by ``parallelize``: data parallelism over the mesh's ``dp_cp`` group (dp, and cp
    whose ranks hold the same parameters too), with AdamW."""
    dp = DataParallel(
        module,
        mesh.group("dp_cp"),
        meter=meter,
        bucket_mb=cfg.parallel.bucket_mb,
        reduce_dtype=REDUCE_DTYPES[cfg.parallel.reduce_dtype],
        tp_group=mesh.group("tp"),
    )
    return dp.attach_optimizer(build_optimizer(module, cfg.train))
