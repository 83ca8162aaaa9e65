"""Pieces every ZeRO stage shares: gradient reduction to shards, the sharded norm, the Strategy shell.

Gradient averaging over the data-parallel group of dp = R·N ranks (R replicas of N-rank
sharding groups; R = 1 without hybrid sharding): each flat gradient is divided by dp, reduced
and scattered inside the sharding group (sum), and the resulting shard all-reduced across the
R replicas. Bytes per rank for a flat gradient of Φ' elements of b bytes:

    reduce-scatter  Φ'·b·(N-1)/N   +   all-reduce across replicas  2·(Φ'/N)·b·(R-1)/R

Gradient norm for clipping: every element of the model's gradient is owned by exactly one
rank of a sharding group, so norm² = Σ over the group of each rank's Σ shard², one scalar
all-reduce over the sharding group (replicas hold identical shards and are not added again;
tensor-parallel shards also add over tp). Scalar all-reduces are bookkeeping and not metered.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loom import comm
from loom.comm import CommMeter, Group
from loom.parallel.sync import SyncSwitch
from loom.parallel.zero.adam import ShardedAdamW
from loom.parallel.zero.layout import FlatLayout

MAX_INFLIGHT = 2  # full-size gradient buffers in flight at once (beyond the one being filled)


@dataclass
class _Pending:
    work: object | None  # the reduce-scatter over the sharding group
    full: torch.Tensor  # kept alive until the collective completes
    out: torch.Tensor
    dest: torch.Tensor
    transient: int  # bytes alive only while this reduction is in flight
    replica_work: object | None = None  # the all-reduce of the shard across replicas
    replicated: bool = False  # that all-reduce has been issued


class GradReducer:
    """Asynchronous reduce-scatter of flat gradients into shards, at most ``max_inflight`` at once.

    Overlap: the all-reduce of a shard across replicas is issued asynchronously as soon as the
    next gradient is launched (its reduce-scatter is then issued too; waiting for the earlier one
    only orders the stream on an accelerator), so with R > 1 every reduction but the last is on
    the wire during backward; with N = 1 (replicated masters) the all-reduce is issued at once.
    Reductions of one group are issued in launch order on every rank, as NCCL requires.
    ``replica_log`` records, per all-reduce issued, whether it was issued before :meth:`drain`.
    """

    def __init__(
        self,
        shard_group: Group,
        replicate_group: Group,
        dp: int,
        meter: CommMeter | None,
        reduce_dtype: torch.dtype | None,
        max_inflight: int = MAX_INFLIGHT,
    ) -> None:
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.dp, self.meter = dp, meter
        self.reduce_dtype = reduce_dtype
        self.max_inflight = max_inflight
        self.inflight: deque[_Pending] = deque()
        self.replica_log: list[bool] = []

    def launch(self, full: torch.Tensor, dest: torch.Tensor, owned: bool = True) -> None:
        """Start dest = shard of (Σ over dp of full) / dp. ``full`` may be divided in place; ``owned``:
        the caller drops it now, so it lives (transiently) until this reduction completes."""
        send = full if self.reduce_dtype in (None, full.dtype) else full.to(self.reduce_dtype)
        send.div_(self.dp)
        aliased = dest.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
        out = dest if (dest.dtype == send.dtype and not aliased) else torch.empty_like(dest, dtype=send.dtype)
        transient = _nbytes(send) if (owned or send is not full) else 0
        transient += _nbytes(out) if out is not dest else 0
        work = comm.reduce_scatter(out, send, self.shard_group, self.meter, async_op=True)
        for p in self.inflight:  # the earlier shards go on to their replicas now
            self._replicate(p, during_backward=True)
        self.inflight.append(_Pending(work, send, out, dest, transient))
        if work is None:  # nothing to wait for: across replicas at once
            self._replicate(self.inflight[-1], during_backward=True)
        while len(self.inflight) > self.max_inflight:
            self._complete(self.inflight.popleft())

    def _replicate(self, p: _Pending, during_backward: bool = False) -> None:
        if p.replicated:
            return
        if p.work is not None:
            comm.wait(p.work)
            p.work = None
        p.replica_work = comm.all_reduce(p.out, self.replicate_group, self.meter, async_op=True)
        p.replicated = True
        if p.replica_work is not None:
            self.replica_log.append(during_backward)

    def _complete(self, p: _Pending) -> None:
        self._replicate(p)
        if p.replica_work is not None:
            comm.wait(p.replica_work)
        if p.out is not p.dest:
            p.dest.copy_(p.out)

    @property
    def inflight_bytes(self) -> int:
        return sum(p.transient for p in self.inflight)

    def drain(self) -> None:
        """Wait for every reduction launched so far."""
        while self.inflight:
            self._complete(self.inflight.popleft())


def build_adam(
    layouts: Sequence[FlatLayout], shards: Sequence[torch.Tensor], store, train_cfg
) -> ShardedAdamW:
    """``train_cfg.optimizer`` (AdamW by default) with the hyper-parameters of ``train_cfg``, decay on the
    ndim >= 2 runs of each shard; AdamW is ``ShardedAdamW`` reading gradients times a loss-scale unscale."""
    from loom.optim.flat import build_flat_optimizer  # AdamW, Adafactor, 8-bit Adam on flat shards

    return build_flat_optimizer(layouts, shards, store, train_cfg)


class ShardedStrategy(SyncSwitch):
    """Strategy shell for the ZeRO stages: sync switch, sharded clipping, the optimizer step.

    Subclasses set ``self.layouts`` (one per flat buffer), ``self.grad_shards`` (this rank's
    reduced gradient shard of each) and ``self.optim``, and implement the hooks.
    """

    layouts: list[FlatLayout]
    grad_shards: list[torch.Tensor]
    optim: ShardedAdamW

    def __init__(
        self, shard_group: Group, replicate_group: Group, tp_group: Group, meter: CommMeter | None
    ) -> None:
        self.shard_group, self.replicate_group, self.tp_group = shard_group, replicate_group, tp_group
        self.meter = meter
        self.sync_enabled = True
        self.transient_peak = 0  # most bytes held beyond the persistent state during this step

    def _transient_bytes(self) -> int:
        """Bytes held now beyond the persistent state (gathered parameters, gradient buffers)."""
        raise NotImplementedError

    def _track(self) -> None:
        self.transient_peak = max(self.transient_peak, self._transient_bytes())


    def _norm_sq(self) -> torch.Tensor:
        """Σ of squares of this rank's gradient shards, tp shards summed over tp (global once reduced)."""
        device = self.grad_shards[0].device if self.grad_shards else torch.device("cpu")
        tp_views, rep_views, ep_views, ep_group = [], [], [], None
        for lay, g in zip(self.layouts, self.grad_shards):
            if lay.params and getattr(lay.params[0], "ep_shard", None) is not None:  # experts: other ranks hold the rest
                ep_views.append(g)
                ep_group = lay.params[0].ep_shard[2]
            elif comm.group_size(self.tp_group) > 1:
                tp_views += [g[lo:hi] for lo, hi in lay.local_ranges(lambda s: s.tp_sharded)]
                rep_views += [g[lo:hi] for lo, hi in lay.local_ranges(lambda s: not s.tp_sharded)]
            else:
                rep_views.append(g)
        sq = _sum_sq(rep_views, device)
        if tp_views:
            tp_sq = _sum_sq(tp_views, device)
            comm.all_reduce(tp_sq, self.tp_group)
            sq = sq + tp_sq
        if ep_views:
            ep_sq = _sum_sq(ep_views, device)
            comm.all_reduce(ep_sq, ep_group)
            sq = sq + ep_sq
        return sq

    def param_grad_shard(self, p: torch.Tensor) -> torch.Tensor:
        """The part of ``p``'s reduced gradient this rank owns (a view of its gradient shard, possibly
        empty; the elements [lo, hi) of ``p.flatten()`` in shard order). E.g. to take a tied weight's
        share out of the norm, summing the squares over the sharding group."""
        for lay, g in zip(self.layouts, self.grad_shards):
            for q, s in zip(lay.params, lay.slots):
                if q is p:
                    lo, hi = max(s.offset, lay.start), min(s.offset + s.numel, lay.end)
                    return g[lo - lay.start : max(lo, hi) - lay.start]
        raise KeyError("param_grad_shard: not a parameter of this strategy")

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        """Global norm = sqrt(all-reduce over the sharding group of local Σ shard²); scale if > max_norm."""
        sq = self._norm_sq()
        comm.all_reduce(sq, self.shard_group)
        norm = sq.sqrt()
        if max_norm > 0 and self.grad_shards:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(self.grad_shards, coef.to(self.grad_shards[0].device))
        return float(norm)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _sum_sq(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float32)).pow(2).sum()  # fp32 even for half
