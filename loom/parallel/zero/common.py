"""The Strategy shell every ZeRO stage shares: sync switch, the sharded norm, the optimizer step.

Gradient averaging and its bytes: :mod:`loom.parallel.reducer`. Gradient norm for clipping:
every element of the model's gradient is owned by exactly one rank of a sharding group, so
norm² = Σ over the group of each rank's Σ shard², one scalar all-reduce over the sharding group
(replicas hold identical shards and are not added again; tensor-parallel shards also add over
tp, expert shards over ep). Scalar all-reduces are bookkeeping and not metered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from loom import comm
from loom.comm import CommMeter, Group
from loom.parallel.base import StrategyBase, SyncSwitch, scale_all, sum_sq, to_device
from loom.parallel.layout import FlatLayout
from loom.parallel.partial import sum_partial_grads
from loom.parallel.placement import expert_group, placement_of
from loom.parallel.reducer import GradReducer
from loom.parallel.state import gather_module_state

# ShardedAdamW, FlatAdafactor or FlatAdam8bit: step(grads, lr, grad_scale), state_bytes, store
FlatOptimizer = Any
OptimizerFactory = Callable[[Sequence[FlatLayout], Sequence[torch.Tensor]], FlatOptimizer]


class ShardedStrategy(SyncSwitch, StrategyBase):
    """Strategy shell for the ZeRO stages (and replicated masters, N = 1).

    Subclasses set ``self.layouts`` (one per flat buffer), ``self.grad_shards`` (this rank's
    reduced gradient shard of each), ``self.params``, then call :meth:`_build_optimizer`; they
    implement :meth:`_reduce_all` and :meth:`_transient_bytes`.
    """

    layouts: list[FlatLayout]
    grad_shards: list[torch.Tensor]
    params: list[torch.nn.Parameter]
    module: torch.nn.Module
    optim: FlatOptimizer
    shards_parameters = False  # stage 3: parameters sharded too (units gathered while they compute)

    def __init__(
        self, shard_group: Group, replicate_group: Group, tp_group: Group, meter: CommMeter | None
    ) -> None:
        self.shard_group, self.replicate_group, self.tp_group = shard_group, replicate_group, tp_group
        self.meter = meter
        self.sync_enabled = True
        self.transient_peak = 0  # most bytes held beyond the persistent state during this step
        self._expert_reducers: dict[int, GradReducer] = {}  # by edp group (see _reducer_for)

    # subclasses set these two before building their buffers
    reducer: GradReducer  # sums the dense gradients (reduce-scatter over the sharding group, replicas)
    world: int  # ranks of the sharding group

    def _expert_group(self, p: torch.Tensor) -> Group:
        """The group ``p``'s flat buffer is sharded over: an expert shard's edp group (the ranks holding
        the same experts) when the strategy shards, else the sharding group."""
        edp = expert_group(p)
        return edp if edp is not None and self.world > 1 else self.shard_group

    def _reducer_for(self, p: torch.Tensor) -> GradReducer:
        """Dense parameters: the strategy's reducer. Expert shards: summed over their edp group and
        divided by all dp ranks, reduce-scattered over it when the strategy shards, else all-reduced."""
        edp = expert_group(p)
        if edp is None:
            return self.reducer
        r = self.reducer
        if id(edp) not in self._expert_reducers:
            shard, replicas = (edp, None) if self.world > 1 else (r.shard_group, edp)
            self._expert_reducers[id(edp)] = GradReducer(
                shard, replicas, r.dp, r.meter, r.reduce_dtype, r.max_inflight, r.all_reduce
            )
        return self._expert_reducers[id(edp)]

    @property
    def _reducers(self) -> list[GradReducer]:
        return [self.reducer, *self._expert_reducers.values()]

    def _build_optimizer(self, make_optimizer: OptimizerFactory, shards: Sequence[torch.Tensor]) -> None:
        """The optimizer of this rank's shards, told which groups hold the other pieces (Adafactor's
        statistics are summed over them)."""
        self.optim = make_optimizer(self.layouts, shards)
        self.optim.bind_groups(self.shard_group, self.tp_group)

    def _reduce_all(self) -> None:
        """Finish every gradient reduction of the step (the gradient shards are final after it)."""
        raise NotImplementedError

    def _transient_bytes(self) -> int:
        """Bytes held now beyond the persistent state (gathered parameters, gradient buffers)."""
        raise NotImplementedError

    def _track(self) -> None:
        self.transient_peak = max(self.transient_peak, self._transient_bytes())

    # ------------------------------------------------------------------ Strategy
    def finish_sync(self) -> None:
        """Every reduction done, then tensor-parallel partial gradients summed over tp (on their shards)."""
        if not self.sync_enabled:
            return
        self._reduce_all()
        sum_partial_grads(self.params, self.param_grad_shard, self.comm_device)

    def grads(self) -> list[torch.Tensor]:
        return list(self.grad_shards)

    def grad_sq(self) -> torch.Tensor:
        """Σ of squares of this rank's gradient shards (tp shards summed over tp), summed over the
        sharding group; expert shards summed over their edp group (when sharded there), tp (when split
        there) and ep."""
        device = self.comm_device or (self.grad_shards[0].device if self.grad_shards else torch.device("cpu"))
        tp_views, rep_views, ep_views, expert, ep_split = [], [], [], None, False
        for lay, g in zip(self.layouts, self.grad_shards):
            pl = placement_of(lay.params[0]).expert if lay.params else None
            if pl is not None:  # experts: other ranks hold the rest (their edp peers other shards)
                ep_views.append(g)
                expert, ep_sharded = pl, lay.world > 1
                ep_split = placement_of(lay.params[0]).tp_sharded  # parallel.expert_tp = split
            elif comm.group_size(self.tp_group) > 1:
                tp_views += [g[lo:hi] for lo, hi in lay.local_ranges(lambda s: s.tp_sharded)]
                rep_views += [g[lo:hi] for lo, hi in lay.local_ranges(lambda s: not s.tp_sharded)]
            else:
                rep_views.append(g)
        sq = to_device(sum_sq(rep_views, device), device)  # (shards on the host: the sums go to the device)
        if tp_views:
            tp_sq = to_device(sum_sq(tp_views, device), device)
            comm.all_reduce(tp_sq, self.tp_group)
            sq = sq + tp_sq
        comm.all_reduce(sq, self.shard_group)
        if expert is not None:
            ep_sq = to_device(sum_sq(ep_views, device), device)
            if ep_sharded:
                comm.all_reduce(ep_sq, expert.edp)
            if ep_split:
                comm.all_reduce(ep_sq, self.tp_group)
            comm.all_reduce(ep_sq, expert.group)
            sq = sq + ep_sq
        return sq

    @torch.no_grad()
    def scale_grads(self, coef: torch.Tensor) -> None:
        scale_all(self.grad_shards, coef)

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

    def param_grad_sq(self, p: torch.Tensor) -> torch.Tensor:
        """Σ g² over ``p``'s reduced gradient: this rank's shard's squares summed over the sharding group."""
        sq = self.param_grad_shard(p).float().pow(2).sum()
        comm.all_reduce(sq, self.shard_group)
        return sq

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's single-device state dict (stages 1-2 hold whole parameters; tp and expert
        shards gathered): a collective."""
        return gather_module_state(self.module, self.tp_group)

    # ------------------------------------------------------------------ checkpoints (Shardable)
    def sharded_state(self):
        from loom.parallel.zero.checkpoint import ZeroState

        return ZeroState(self).sharded_state()

    def load_sharded(self, reader) -> None:
        from loom.parallel.zero.checkpoint import ZeroState

        ZeroState(self).load_sharded(reader)
