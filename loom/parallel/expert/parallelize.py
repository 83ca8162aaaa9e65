"""Expert parallelism: the experts of every MoE layer split over ``ep`` ranks; tokens travel to them.

Ranks. ep borrows from dp x cp (:meth:`loom.mesh.ParallelMesh._expert_groups`): rank i of an ep
group holds experts [i·E/ep, (i+1)·E/ep) of every layer, and the ranks holding the same experts
form its expert-data-parallel group ("edp", dp·cp/ep ranks). The router and every other
parameter stay replicated.

Forward of one MoE layer, on this rank's N tokens (the plain model's routing, unchanged):

    route       top-k experts and weights per token (router replicated)
    dispatch    the A = N·k (token, expert) rows, sorted by expert, go to the rank holding the
                expert (all-to-all; the per-expert counts first, in a small all-to-all)
    experts     each rank runs its E/ep experts on the rows it received, regrouped by expert, as
                one grouped matmul per weight (SwiGLU, no weights)
    combine     the results return by the reverse all-to-all; each token sums its rows times
                its routing weights, in expert order as the single-device layer does

Routing, capacity, shared experts and the balancing losses are the plain layer's
(:mod:`loom.model.moe`) on this rank's tokens; with ``moe.aux_loss_coef`` > 0 its counts add one
all-reduce of E + 1 numbers per layer and micro-batch over dp x cp (not metered, not counted below).

Backward runs the two all-to-alls in reverse. Calls per layer and micro-batch: 5 all-to-alls
(counts, dispatch and combine forward, both again backward), 8 under full recomputation, which
repeats the forward's 3. Bytes sent: the rows for other ranks, A_off·h·b, in each row all-to-all,
with A_off ≈ A·(ep-1)/ep under uniform routing, plus 8·E·(ep-1)/ep for the counts.

Split experts (``parallel.expert_tp = split``, :mod:`loom.parallel.tensor.experts`): every tp rank
holds the group's tokens, sends only its 1/tp of them, and pools the rows it receives with its tp
peers' (:mod:`loom.parallel.expert.tp_rows`) before computing its slice of its experts on all of
them; the partial rows are summed back over tp before the combine's all-to-all.

Gradients. An expert's gradient on its rank already sums the tokens of the whole ep group. The
data-parallel reduction sums it over the edp group and divides by dp·cp, like every other
gradient, so all of them are the gradient of the global mean loss
(:class:`loom.parallel.data.strategy.DataParallel` reduces each bucket over its parameters'
group). Clipping sums the experts' squares over the ep group. Under ZeRO 1-2 the experts' buckets
are sharded over their edp group instead of dp x cp (:mod:`loom.parallel.zero.stage12`).

Hot experts (``moe.rebalance_every`` = s > 0). Every s steps up to ``moe.hot_experts`` experts of
each layer are replicated on every ep rank, chosen on the loads since the last rebalance
(assignments summed over the world: the same on every rank) to lower the busiest rank's rows
(:func:`choose_hot`). A rank then computes its own tokens' rows for a hot
expert itself, with a replica of its weights, instead of sending them to the owner: the owner's
load of it, up to A_e rows, becomes A_e/ep on each rank. The replicas come from their owners in
one all-reduce per weight and micro-batch (the owner's rows, zeros elsewhere: 3·H·f·h elements for
H hot experts), and backward sums the replicas' gradients into the owner's rows the same way, so
the numerics are those of the plain layer (up to the order of the sums).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Function

from loom import comm
from loom.comm import CommMeter, Group
from loom.model.moe import ExpertWeights, MoEFeedForward, StatsSum, grouped_swiglu, recomputing
from loom.parallel.expert.tp_rows import TpRows, gather_rows, my_tokens, scatter_rows
from loom.parallel.placement import ExpertShard, place, setattr_placement, slice_of

__all__ = ["ExpertParallelMoE", "apply_expert_parallel", "choose_hot", "rebalance_experts", "stats_sum"]


def _all_to_all(
    x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: Group, meter: CommMeter | None, me: int
) -> torch.Tensor:
    """Rows ``in_rows[j]`` of x (in order) to rank j; returns the rows received, by source rank."""
    out = x.new_empty(sum(out_rows), *x.shape[1:])
    if meter is not None:
        row = x[0].numel() * x.element_size() if x.shape[0] else 0
        meter.record("all_to_all", row * (sum(in_rows) - in_rows[me]), 2)  # bytes leaving this rank
    x = x.contiguous()
    comm.check_tensors("all_to_all", group, out, x)
    dist.all_to_all_single(out, x, out_rows, in_rows, group=group)
    return out


class _AllToAll(Function):
    """Forward: :func:`_all_to_all`; backward: the same with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_rows, in_rows, group, meter, me):
        ctx.args = (out_rows, in_rows, group, meter, me)
        return _all_to_all(x, out_rows, in_rows, group, meter, me)

    @staticmethod
    def backward(ctx, grad):
        out_rows, in_rows, group, meter, me = ctx.args
        return _all_to_all(grad, in_rows, out_rows, group, meter, me), None, None, None, None, None


class _HotReplicas(Function):
    """Forward: rows ``owned`` (local index, or -1 where another rank owns the expert) of this rank's
    expert weight ``w`` stacked for the hot experts and summed over ``group`` (each hot expert's owner
    contributes it, the others zeros: a broadcast in one call). Backward: the replicas' gradients
    summed over ``group``, into the owner's rows."""

    @staticmethod
    def forward(ctx, w, owned, group, meter):
        ctx.args = (owned, group, meter, w.shape)
        buf = w.new_zeros(len(owned), *w.shape[1:])
        for i, j in enumerate(owned):
            if j >= 0:
                buf[i] = w[j]
        comm.all_reduce(buf, group, meter)
        return buf

    @staticmethod
    def backward(ctx, grad):
        owned, group, meter, shape = ctx.args
        total = grad.contiguous().clone()
        comm.all_reduce(total, group, meter)
        out = total.new_zeros(shape)
        for i, j in enumerate(owned):
            if j >= 0:
                out[j] = total[i]
        return out, None, None, None


class ExpertParallelMoE(MoEFeedForward):
    """:class:`~loom.model.moe.MoEFeedForward` with this rank's E/ep experts (same parameter names);
    routing, capacity, shared experts and balancing are the plain layer's, on this rank's tokens."""

    def __init__(
        self,
        moe: MoEFeedForward,
        rank: int,
        ep: int,
        group: Group,
        edp_group: Group,
        meter: CommMeter | None = None,
        tp_rows: TpRows | None = None,
    ) -> None:
        nn.Module.__init__(self)
        n_experts = moe.router.weight.shape[0]
        if n_experts % ep:
            raise ValueError(f"model.n_experts={n_experts} must be divisible by parallel.ep={ep}")
        self.top_k, self.n_experts, self.options = moe.top_k, n_experts, moe.options
        self.rank, self.ep, self.group, self.meter = rank, ep, group, meter
        self.local = n_experts // ep
        self.hot: list[int] = []  # experts replicated on every ep rank (module doc: hot experts)
        self.window_load: torch.Tensor | None = None  # assignments per expert since the last rebalance
        self.steps_seen = 0
        self.rows_computed = 0  # rows this rank's experts (and replicas) computed, since reset by a reader
        self.router = moe.router  # replicated
        self.shared = moe.shared  # replicated
        self.register_buffer("expert_bias", moe.expert_bias)
        self._init_state()
        self.layer_id, self.sum_stats, self.loss_share = moe.layer_id, moe.sum_stats, moe.loss_share
        self.sum_step, self.split = moe.sum_step, moe.split  # split: experts also cut over tp
        self.tp_rows = tp_rows  # split experts: the routed rows pooled over tp (tp_rows module doc)
        for name in ("w1", "w3", "w2"):
            full = getattr(moe, name).weight
            mine = ExpertWeights(
                self.local, full.shape[1], full.shape[2], device=full.device, dtype=full.dtype
            )
            part, placement = slice_of(full, 0, rank, ep)
            with torch.no_grad():
                mine.weight.copy_(part)
            mine.weight.requires_grad_(full.requires_grad)  # frozen under LoRA
            setattr_placement(mine.weight, placement)
            place(
                mine.weight, expert=ExpertShard(rank, ep, group, edp_group)
            )  # read by data parallelism and checkpoints
            setattr(self, name, mine)

    def expert_outputs(
        self,
        flat: torch.Tensor,
        token: torch.Tensor,
        expert: torch.Tensor,
        weight: torch.Tensor,
        keep: torch.Tensor | None = None,
        bound: int | None = None,
    ) -> torch.Tensor:
        """Dispatch the rows (sorted by expert; without those ``keep`` drops) to their experts' ranks,
        compute, combine; rows of a hot expert are computed here, on its replica.

        One host sync per call: the all-to-all's sizes. The rows are partitioned on the device (a
        stable sort by class: sent, hot, dropped; each class stays sorted by expert) and the class
        sizes come back with the exchanged counts, in the same read."""
        if self.options.rebalance_every and self.training and not recomputing():
            load = torch.bincount(expert, minlength=self.n_experts).float()
            self.window_load = load if self.window_load is None else self.window_load + load
        out = torch.zeros_like(flat)
        cls = torch.zeros_like(expert)  # 0: sent to the expert's rank, 1: hot (here), 2: dropped
        hot = torch.tensor(self.hot, dtype=expert.dtype, device=flat.device) if self.hot else None
        if hot is not None:
            cls = cls + torch.isin(expert, hot).long()
        if keep is not None:
            cls = torch.where(keep, cls, 2)
        tp = self.tp_rows
        if tp is not None:  # split experts: this tp rank sends its 1/tp of the tokens (hot rows: all)
            lo, hi = my_tokens(flat.shape[0], tp)
            cls = torch.where((cls == 0) & ((token < lo) | (token >= hi)), 2, cls)
        part = torch.argsort(cls, stable=True)
        token, expert, weight, cls = token[part], expert[part], weight[part], cls[part]
        sent = cls == 0
        per_expert = torch.bincount(  # rows per expert (the others counted in a spare bin)
            torch.where(sent, expert, self.n_experts), minlength=self.n_experts + 1
        )[: self.n_experts]
        # got[src*local + j]: rows rank src sends for my expert j (a small all-to-all of counts)
        got = _all_to_all(
            per_expert, [self.local] * self.ep, [self.local] * self.ep, self.group, self.meter, self.rank
        )
        tables = got if tp is None else _gather_counts(got, tp)  # what each tp peer received, too
        sizes = torch.cat([per_expert, tables, (cls == 1).sum().view(1)]).tolist()  # the one host sync
        E, L = self.n_experts, self.local
        sources = tables.numel() // L  # (tp peer,) ep rank: the blocks of received rows, in order
        send = [sum(sizes[r * L : (r + 1) * L]) for r in range(self.ep)]
        mine = E * (1 + (tp.rank if tp is not None else 0))  # this rank's received counts in ``tables``
        recv = [sum(sizes[mine + r * L : mine + (r + 1) * L]) for r in range(self.ep)]
        widest = max(sum(sizes[E + r * L + j] for r in range(sources)) for j in range(L))  # rows of an expert
        n_out, n_hot = sum(send), sizes[-1]
        if hot is not None:
            at = slice(n_out, n_out + n_hot)
            out = self._hot_outputs(out, flat, token[at], expert[at], weight[at], hot)
        token, weight = token[:n_out], weight[:n_out]
        rows = _AllToAll.apply(flat.index_select(0, token), recv, send, self.group, self.meter, self.rank)
        pooled = [sum(sizes[E + q * E : E + (q + 1) * E]) for q in range(sources // self.ep)]  # per tp peer
        if tp is not None:
            rows = gather_rows(rows, pooled, tp)
        # received rows: by (tp peer,) source rank, within it by expert; regroup them by local expert
        recv_table = tables.view(sources, self.local)
        expert_of_row = (
            torch.arange(self.local, device=flat.device)
            .repeat(sources)
            .repeat_interleave(recv_table.reshape(-1), output_size=rows.shape[0])
        )
        by_expert = torch.argsort(expert_of_row, stable=True)
        w1, w3, w2 = (cast(ExpertWeights, getattr(self, n)).weight for n in ("w1", "w3", "w2"))
        y = grouped_swiglu(
            rows.index_select(0, by_expert),
            recv_table.sum(0),
            w1,
            w3,
            w2,
            self.options.compute,
            widest,
        )
        out_rows = torch.empty_like(y).index_copy(0, by_expert, y)  # back to the received order
        if tp is not None:  # the slices' partial rows summed; this rank's received ones kept
            out_rows = scatter_rows(out_rows, pooled, tp)
        back = _AllToAll.apply(out_rows, send, recv, self.group, self.meter, self.rank)  # sorted order again
        if not recomputing():
            self.rows_computed += rows.shape[0]
        return out.index_add(0, token, back * weight[:, None])

    def _hot_outputs(
        self,
        out: torch.Tensor,
        flat: torch.Tensor,
        h_token: torch.Tensor,
        h_expert: torch.Tensor,
        h_weight: torch.Tensor,
        hot: torch.Tensor,
    ) -> torch.Tensor:
        """The hot experts' rows (sorted by expert) computed on their replicas into ``out``."""
        owned = [e - self.rank * self.local if e // self.local == self.rank else -1 for e in self.hot]
        w1, w3, w2 = (
            _HotReplicas.apply(cast(ExpertWeights, getattr(self, n)).weight, owned, self.group, self.meter)
            for n in ("w1", "w3", "w2")
        )
        counts = torch.bincount(torch.searchsorted(hot, h_expert), minlength=len(self.hot))
        y = grouped_swiglu(
            flat.index_select(0, h_token), counts, w1, w3, w2, self.options.compute, h_token.shape[0]
        )
        if not recomputing():
            self.rows_computed += y.shape[0]
        return out.index_add(0, h_token, y * h_weight[:, None])


def _gather_counts(got: torch.Tensor, tp: TpRows) -> torch.Tensor:
    """The rows per (source rank, local expert) every tp peer received, stacked in tp order (flat)."""
    out = got.new_empty(tp.size * got.numel())
    comm.all_gather(out, got, tp.group, tp.meter)
    return out


def stats_sum(groups: Sequence[Group]) -> StatsSum:
    """The sum of a MoE layer's balancing counts over ``groups`` in place (the f_e's over cp [x tp],
    a step's loads over dp x cp [x tp]): one all-reduce per group of size > 1, unmetered (E + 1
    numbers per layer and micro-batch). Given to the plain layers by
    :func:`~loom.model.moe.configure_moe`, so the model holds no process group."""
    live = tuple(g for g in groups if comm.group_size(g) > 1)

    def sum_stats(counts: torch.Tensor) -> None:
        for group in live:
            comm.all_reduce(counts, group)

    return sum_stats


def apply_expert_parallel(model: nn.Module, mesh, meter: CommMeter | None = None) -> None:
    """Swap every :class:`MoEFeedForward` for this rank's :class:`ExpertParallelMoE` (in place)."""
    ep = mesh.size("ep")
    if ep == 1:
        return
    rank, group, edp = mesh.local_rank("ep"), mesh.group("ep"), mesh.group("edp")
    tp = (
        TpRows(mesh.group("tp"), mesh.local_rank("tp"), mesh.size("tp"), meter)
        if mesh.size("tp") > 1
        else None
    )
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, MoEFeedForward) and not isinstance(child, ExpertParallelMoE):
                rows = tp if child.split is not None else None  # experts split over tp: pool the rows
                setattr(module, name, ExpertParallelMoE(child, rank, ep, group, edp, meter, rows))


@torch.no_grad()
def rebalance_experts(model: nn.Module) -> None:
    """After a step: every ``moe.rebalance_every`` steps, each layer's ``moe.hot_experts`` most loaded
    experts since the last rebalance become its hot set (loads summed over the layers' statistics
    groups in one all-reduce of L·E numbers, so every rank picks the same)."""
    layers = [
        m for m in model.modules() if isinstance(m, ExpertParallelMoE) and m.options.rebalance_every > 0
    ]
    if not layers:
        return
    for m in layers:
        m.steps_seen += 1
    if layers[0].steps_seen % layers[0].options.rebalance_every:
        return
    zeros = torch.zeros(layers[0].n_experts, device=layers[0].router.weight.device)
    loads = torch.stack([m.window_load if m.window_load is not None else zeros for m in layers])
    layers[0].sum_step(loads)
    for m, load in zip(layers, loads):
        m.hot = choose_hot(load.tolist(), m.ep, m.options.hot_experts)
        m.window_load = None


def rank_loads(load: list[float], ep: int, hot: list[int]) -> list[float]:
    """Rows each ep rank computes for per-expert loads ``load`` when ``hot`` is replicated: its own
    experts' loads, plus 1/ep of each hot expert's (every rank computes its own tokens' rows)."""
    local = len(load) // ep
    shared = sum(load[e] for e in hot) / ep
    return [
        sum(load[e] for e in range(r * local, (r + 1) * local) if e not in hot) + shared for r in range(ep)
    ]


def choose_hot(load: list[float], ep: int, most: int) -> list[int]:
    """Up to ``most`` experts to replicate, chosen greedily: each time the one whose replication lowers
    the busiest rank's rows (:func:`rank_loads`) the most, while it lowers them (ties: lower index)."""
    hot: list[int] = []
    best = max(rank_loads(load, ep, hot))
    for _ in range(most):
        options = [(max(rank_loads(load, ep, [*hot, e])), e) for e in range(len(load)) if e not in hot]
        if not options or min(options)[0] >= best:
            break
        best, e = min(options)
        hot.append(e)
    return sorted(hot)
