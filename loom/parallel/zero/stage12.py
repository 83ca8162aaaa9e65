"""ZeRO stages 1 and 2: optimizer state (stage 1), and gradients too (stage 2), sharded over N ranks.

Parameters stay replicated: every parameter's ``.data`` is a view into a flat bucket (buckets as
the DDP ones: reverse registration order, ``bucket_mb`` each), padded so it splits into N equal
aligned shards (:mod:`loom.parallel.layout`). Rank r owns shard r of every bucket: its
Adam state, its reduced gradient, its update. After the update every bucket is all-gathered
(in place: each rank's shard is already at its place in the flat buffer).

Stage 1: gradients accumulate in full-size flat buffers (``p.grad`` are views); after the last
backward, each bucket is reduce-scattered, the shard landing in the owner's slice of that buffer.
Stage 2: gradients are reduce-scattered bucket by bucket *during* backward, launched from a
post-accumulate hook when the bucket's last gradient arrives (overlapped, as DDP's all-reduce;
each reducer's buckets in index order, so every rank issues the same collectives in one order);
each parameter's gradient is folded into a bucket buffer allocated on its first gradient and
freed as soon as its shard is formed, at most ``MAX_INFLIGHT`` buckets being in flight, and only
the 1/N gradient shard stays. Under :meth:`no_sync` (gradient accumulation) no communication
happens and the bucket buffers persist until the last micro-batch, as FSDP's ``no_sync``.

Bytes held per rank between steps, Φ' = padded parameter count, N = sharding group size, with
fp32 parameters (mixed precision: 2-byte parameters and gradients, + a 4-byte fp32 master):

    stage 1:  4Φ' + 4Φ' + 8Φ'/N          (mixed: 2Φ + 2Φ + 12Φ/N)
    stage 2:  4Φ' + (4Φ' + 8Φ')/N        (mixed: 2Φ + (2Φ + 12Φ)/N)

Bytes moved per rank per step (ring; b = bytes per element, R replicas for hybrid sharding):

    reduce-scatter Φ'·b·(N-1)/N  +  all-gather Φ'·b·(N-1)/N  [+ all-reduce 2·(Φ'/N)·b·(R-1)/R]

the same 2Φ(N-1)/N as the data-parallel all-reduce it replaces (ZeRO paper, §7).

Expert parallelism: the experts' buckets are sharded over their edp group (N_e = dp·cp/ep ranks
holding the same experts) instead, with Φ_e their parameters on this rank in the formulas above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from loom import comm
from loom.comm import CommMeter, Group
from loom.parallel.bucket import BucketQueue, split_buckets
from loom.parallel.hooks import weak_hook
from loom.parallel.layout import (
    FlatLayout,
    decayed_ids,
    frozen_state,
    tied_copy,
    unique_params,
)
from loom.parallel.reducer import MAX_INFLIGHT, AllReduce, GradReducer
from loom.parallel.zero.common import OptimizerFactory, ShardedStrategy


@dataclass
class FlatBucket:
    """A flat parameter buffer shared by a run of parameters, and its gradient storage."""

    index: int
    layout: FlatLayout
    params: torch.Tensor  # Φ_b' elements; the parameters are views of it
    grads: torch.Tensor | None  # stage 1: full Φ_b' (p.grad are views); stage 2: transient, None at rest
    grad_shard: torch.Tensor  # this rank's reduced Φ_b'/N gradient shard
    reducer: GradReducer  # the strategy's, or the expert shards' (summed over their edp group)
    group: Group = None  # the group its shards are spread over: the sharding group, or an expert's edp group


@dataclass
class LaunchRecord:
    """For instrumentation: which bucket launched, and how many params were still waiting then."""

    bucket: int
    params_not_ready: int
    during_backward: bool  # launched from a gradient hook (overlapped), not from finish_sync


class ZeroDataParallel(ShardedStrategy):
    """ZeRO stage 1 or 2 over ``shard_group``, with hybrid all-reduce across ``replicate_group``."""

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        shard_group: Group,
        replicate_group: Group,
        make_optimizer: OptimizerFactory,
        meter: CommMeter | None = None,
        bucket_mb: float = 25.0,
        reduce_dtype: torch.dtype | None = None,
        tp_group: Group = None,
        max_inflight: int = MAX_INFLIGHT,
        allreduce: AllReduce = comm.all_reduce,
    ) -> None:
        """``allreduce``: the all-reduce across replicas (``parallel.allreduce``, picked by the caller)."""
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel runs stage 1 or 2, got {stage}")
        super().__init__(shard_group, replicate_group, tp_group, meter)
        self.stage = stage
        self.module = module
        self.world = comm.group_size(shard_group)
        dp = self.world * comm.group_size(replicate_group)
        self.reducer = GradReducer(
            shard_group, replicate_group, dp, meter, reduce_dtype, max_inflight, allreduce
        )
        self.params = unique_params(module)
        decayed = decayed_ids(module)
        self.buckets: list[FlatBucket] = []
        self._slot: dict[int, tuple[FlatBucket, int]] = {}
        for i, ps in enumerate(split_buckets(self.params, int(bucket_mb * 1024 * 1024), tied_copy(module))):
            group = self._expert_group(ps[0])
            n = comm.group_size(group)
            lay = FlatLayout(ps, n, dist.get_rank(group) if n > 1 else 0, decayed)
            flat = lay.new_flat()
            lay.bind(flat)
            if stage == 1:
                grads = lay.new_flat()
                grad_shard = lay.shard_of(grads)
            else:
                grads, grad_shard = None, lay.new_shard()
            b = FlatBucket(i, lay, flat, grads, grad_shard, reducer=self._reducer_for(ps[0]), group=group)
            for j, p in enumerate(ps):
                self._slot[id(p)] = (b, j)
            self.buckets.append(b)
        self.queue = BucketQueue(
            self.buckets, [len(b.layout.params) for b in self.buckets], lambda b: id(b.reducer), self._launch
        )
        self.layouts = [b.layout for b in self.buckets]
        self.grad_shards = [b.grad_shard for b in self.buckets]
        self._build_optimizer(make_optimizer, [b.layout.shard_of(b.params) for b in self.buckets])
        self.launch_log: list[LaunchRecord] = []
        self._ready = 0
        self._in_hook = False  # launches from a gradient hook are overlapped with backward
        self._handles = []
        if stage == 2:
            self._handles = [
                p.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready)) for p in self.params
            ]
        self.zero_grad()

    # ------------------------------------------------------------------ stage 2: backward hooks
    @torch.no_grad()
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        b, j = self._slot[id(p)]
        if b.grads is None:
            b.grads = b.layout.new_flat()
            self._track()
        s = b.layout.slots[j]
        if p.grad is not None:
            b.grads[s.offset : s.offset + s.numel].view_as(p).add_(p.grad)
        p.grad = None  # the full-size gradient lives on only inside the bucket
        if not self.sync_enabled:
            return
        self._ready += 1
        self._in_hook = True
        try:
            self.queue.grad_ready(b.index)
        finally:
            self._in_hook = False

    def _launch(self, b: FlatBucket) -> None:
        self.launch_log.append(LaunchRecord(b.index, len(self.params) - self._ready, self._in_hook))
        if b.grads is None:  # no gradient reached this bucket (unused parameters): reduce zeros
            b.grads = b.layout.new_flat()
        b.reducer.launch(b.grads, b.grad_shard, owned=self.stage == 2)
        if self.stage == 2:
            b.grads = None  # the reducer holds it until its shard is formed, then it is freed
        self._track()

    def _transient_bytes(self) -> int:
        """Stage 2: full-size bucket gradients being filled or reduced; both: reduce-scatter outputs."""
        filling = sum(
            b.grads.numel() * b.grads.element_size()
            for b in self.buckets
            if self.stage == 2 and b.grads is not None
        )
        return filling + sum(r.inflight_bytes for r in self._reducers)

    # ------------------------------------------------------------------ Strategy
    def _reduce_all(self) -> None:
        """Reduce-scatter every bucket not launched yet (all of them in stage 1); wait for all."""
        self.queue.launch_rest()
        for r in self._reducers:
            r.drain()
        self.queue.reset()
        self._ready = 0

    def zero_grad(self) -> None:
        for b in self.buckets:
            if self.stage == 1:
                assert b.grads is not None  # stage 1 keeps its full-size gradient buffers
                b.grads.zero_()
                for p, v in zip(b.layout.params, b.layout.views(b.grads)):
                    p.grad = v
            else:
                b.grads = None
                for p in b.layout.params:
                    p.grad = None
        self.launch_log.clear()
        self.transient_peak = 0

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """Update this rank's shards, then all-gather every bucket in place."""
        self.optim.step(self.grad_shards, lr, grad_scale)
        self._gather_params()

    @torch.no_grad()
    def _gather_params(self) -> None:
        """All-gather every bucket in place: each rank's shard is already at its place."""
        works = [
            comm.all_gather(b.params, b.layout.shard_of(b.params), b.group, self.meter, async_op=True)
            for b in self.buckets
        ]
        for w in works:
            if w is not None:
                w.wait()

    def state_bytes(self) -> dict[str, int]:
        """Held between steps: full params 4Φ', grads 4Φ' (stage 1) or 4Φ'/N (stage 2), Adam 8Φ'/N;
        and the peak of transient bytes during the last step (gradient buffers in flight)."""
        held = [b.grads if self.stage == 1 and b.grads is not None else b.grad_shard for b in self.buckets]
        grads = sum(g.numel() * g.element_size() for g in held)
        return {
            "param_bytes": sum(b.params.numel() * b.params.element_size() for b in self.buckets),
            "grad_bytes": grads,
            "optim_bytes": self.optim.state_bytes,
            "optim_offload_bytes": self.optim.store.offloaded_bytes,
            "transient_peak_bytes": self.transient_peak,
        } | frozen_state(self.module)  # LoRA's frozen base: replicated, outside the flat buffers

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
