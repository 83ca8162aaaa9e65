"""Data parallelism: bucketed gradient all-reduce overlapped with backward.

Gradients live in flat bucket buffers (``param.grad`` is a view into its bucket), filled in
reverse registration order, which is roughly the order backward produces them. When the last
gradient of a bucket has been accumulated, that bucket's all-reduce is launched asynchronously
while backward goes on; :meth:`DataParallel.finish_sync` waits for all of them.

Averaging: each bucket is divided by n before the sum-all-reduce, so the result is the mean
over ranks; with equal micro-batches that equals the gradient of the global-batch mean loss.

Buckets and their launch order are the shared ones of :mod:`loom.parallel.bucket`, the
reduction the shared :class:`~loom.parallel.reducer.GradReducer` with a sharding group of one
rank (the whole buffer all-reduced in place): the same engine as ZeRO, without the optimizer
sharding. Why a separate strategy rather than ZeRO with N = 1: fp32 AdamW keeps
``torch.optim.AdamW`` on the parameters themselves, with no flat fp32 master copy to hold
(precision or other optimizers without ZeRO run ZeRO's flat path with N = 1).

Gradient accumulation: during micro-steps that are not the last, :meth:`no_sync` keeps hooks
from communicating; gradients accumulate in the buffers; the last micro-step communicates once.

Memory: parameters Φ and gradients Φ are replicated (grad buffers add no copy, they *are* the
gradients). Communication per rank per optimizer step, ring all-reduce over n ranks:
    bytes = 2 · Φ · b · (n-1)/n,   b = bytes per element of ``reduce_dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loom import comm
from loom.comm import CommMeter, Group
from loom.device import DTYPES
from loom.optim.groups import optimizer_state_bytes, set_lr
from loom.parallel.base import StrategyBase, SyncSwitch, grad_norm_sq, scale_all
from loom.parallel.bucket import BucketQueue, split_buckets
from loom.parallel.hooks import weak_hook
from loom.parallel.layout import frozen_state, unique_params
from loom.parallel.partial import sum_partial_grads
from loom.parallel.placement import expert_group, expert_shard, is_expert, placement_of
from loom.parallel.reducer import AllReduce, GradReducer
from loom.parallel.state import gather_module_state


@dataclass
class Bucket:
    """A flat gradient buffer shared by a run of parameters (``param.grad`` are views of it)."""

    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor
    offsets: list[tuple[int, int]]
    group: Group  # where it is summed: the dp group, or an expert's edp group (expert parallelism)


@dataclass
class LaunchRecord:
    """For instrumentation: which bucket launched, and how many params were still waiting then."""

    bucket: int
    params_not_ready: int


class DataParallel(SyncSwitch, StrategyBase):
    """Bucketed, overlapped gradient all-reduce of ``module`` over ``group``, and its optimizer.

    Not an ``nn.Module`` wrapper: the model is called as usual; this object owns the gradient
    buffers, the communication and the (replicated) optimizer. Call :meth:`zero_grad` (not
    ``set_to_none``) between steps.
    """

    def __init__(
        self,
        module: nn.Module,
        group: Group,
        meter: CommMeter | None = None,
        bucket_mb: float = 25.0,
        reduce_dtype: torch.dtype | None = None,
        tp_group: Group = None,
        optimizer: torch.optim.Optimizer | None = None,
        allreduce: AllReduce = comm.all_reduce,
    ) -> None:
        """``allreduce``: the bucket all-reduce (``parallel.allreduce``, picked by the caller)."""
        self.module, self.group, self.meter = module, group, meter
        self.tp_group = tp_group  # tensor-parallel peers: sharded params' squares add over it in the norm
        self.world = comm.group_size(group)
        self.params = unique_params(module)
        self.optimizer = optimizer
        self.sync_enabled = True
        self.launch_log: list[LaunchRecord] = []
        self._ready_count = 0
        self.buckets: list[Bucket] = []
        self._slot: dict[int, tuple[Bucket, int, int]] = {}  # id(param) -> (bucket, offset, numel)
        cap = int(bucket_mb * 1024 * 1024)
        dense = [p for p in self.params if not is_expert(p)]
        experts = [p for p in self.params if is_expert(p)]  # after the dense ones: one run per edp group
        for ps in split_buckets(dense, cap) + split_buckets(experts, cap):
            self.buckets.append(self._make_bucket(len(self.buckets), ps))
        self.reducers: dict[int, GradReducer] = {}
        for b in self.buckets:  # every reduction in flight until finish_sync (in place: no buffer is kept)
            self.reducers.setdefault(
                id(b.group),
                GradReducer(
                    None,
                    b.group,
                    self.world,
                    meter,
                    reduce_dtype,
                    max_inflight=len(self.buckets),
                    all_reduce=allreduce,
                ),
            )
        self.queue = BucketQueue(
            self.buckets, [len(b.params) for b in self.buckets], lambda b: id(b.group), self._launch
        )
        self._handles = [
            p.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready)) for p in self.params
        ]

    def _make_bucket(self, index: int, params: list[nn.Parameter]) -> Bucket:
        buf = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        group = expert_group(params[0]) or self.group
        b = Bucket(index, params, buf, [], group)
        off = 0
        for p in params:
            view = buf[off : off + p.numel()].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            b.offsets.append((off, p.numel()))
            self._slot[id(p)] = (b, off, p.numel())
            off += p.numel()
        return b

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
        self.queue.grad_ready(b.index)

    def _launch(self, b: Bucket) -> None:
        self.launch_log.append(LaunchRecord(b.index, len(self.params) - self._ready_count))
        if self.world > 1:  # the mean over all dp ranks, also for an expert's edp sum
            self.reducers[id(b.group)].launch(b.buffer, b.buffer, owned=False)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> DataParallel:
        """Own ``optimizer`` (replicated, over the parameters themselves); returns self."""
        self.optimizer = optimizer
        return self

    # ------------------------------------------------------------------ Strategy
    def finish_sync(self) -> None:
        """Launch any bucket left (unused parameters), wait for every all-reduce, then sum the
        tensor-parallel partial gradients over tp."""
        if not self.sync_enabled:
            return
        self.queue.launch_rest()
        for r in self.reducers.values():
            r.drain()
        self.queue.reset()
        self._ready_count = 0
        sum_partial_grads(self.params, lambda p: p.grad)

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()
            for p, (off, n) in zip(b.params, b.offsets):
                view = b.buffer[off : off + n].view_as(p)
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
        self.launch_log.clear()

    def grads(self) -> list[torch.Tensor]:
        return [b.buffer for b in self.buckets]

    def grad_sq(self) -> torch.Tensor:
        """Gradients are replicated over dp after the all-reduce: tensor-parallel shards add their
        squares over tp, replicated parameters (norms) count once, expert shards add theirs over ep
        (and over tp when split there)."""
        dense = [p for p in self.params if not is_expert(p)]
        experts = [p for p in self.params if is_expert(p)]
        device = self.params[0].device if self.params else None
        if comm.group_size(self.tp_group) > 1:
            sq = grad_norm_sq([p for p in dense if placement_of(p).tp_sharded], device)
            comm.all_reduce(sq, self.tp_group)
            sq = sq + grad_norm_sq([p for p in dense if not placement_of(p).tp_sharded], device)
        else:
            sq = grad_norm_sq(dense, device)
        if experts:  # their squares over ep, and over tp too where split there (parallel.expert_tp)
            ep_sq = grad_norm_sq(experts, device)
            if placement_of(experts[0]).tp_sharded:
                comm.all_reduce(ep_sq, self.tp_group)
            comm.all_reduce(ep_sq, expert_shard(experts[0]).group)
            sq = ep_sq + sq
        return sq

    @torch.no_grad()
    def scale_grads(self, coef: torch.Tensor) -> None:
        scale_all(self.grads(), coef)

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        if self.optimizer is None:
            raise RuntimeError("DataParallel.step: no optimizer (pass optimizer=)")
        if grad_scale != 1.0:
            raise ValueError("loss-scaled gradients need Loom's master-weight optimizers (ZeRO's flat path)")
        set_lr(self.optimizer, lr)
        self.optimizer.step()

    def grad_bytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    def state_bytes(self) -> dict[str, int]:
        """Replicated state: params Φ·b, grads Φ·b, Adam moments 2·Φ·4 (fp32), of the trained parameters;
        frozen ones (LoRA's base) apart, as ``frozen_bytes``."""
        return {
            "param_bytes": sum(p.numel() * p.element_size() for p in self.params),
            "grad_bytes": self.grad_bytes(),
            "optim_bytes": optimizer_state_bytes(self.optimizer) if self.optimizer is not None else 0,
        } | frozen_state(self.module)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return gather_module_state(self.module, self.tp_group)

    # ------------------------------------------------------------------ checkpoints (Shardable)
    def sharded_state(self):
        from loom.parallel.data.checkpoint import ReplicatedState

        return ReplicatedState(self.module, self.optimizer, self.group, self.tp_group).sharded_state()

    def load_sharded(self, reader) -> None:
        from loom.parallel.data.checkpoint import ReplicatedState

        ReplicatedState(self.module, self.optimizer, self.group, self.tp_group).load_sharded(reader)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


REDUCE_DTYPES = DTYPES  # parallel.reduce_dtype -> torch dtype (loom.device)
