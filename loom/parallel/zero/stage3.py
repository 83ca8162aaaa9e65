"""ZeRO stage 3 / fully sharded data parallelism: parameters, gradients and optimizer state sharded.

The model is cut into *units* (:func:`find_units`): each transformer block, the modules before
the blocks (embedding) and the modules after them (final norm + output head); units sharing a
parameter (tied embeddings) are merged into one. Each unit's parameters live in one flat buffer
(:class:`~loom.parallel.layout.FlatLayout`) of which a rank keeps only its 1/N shard; the
parameters are views of the buffer, whose *storage* is resized to 0 while the unit is sharded
and re-allocated, then filled by an all-gather, when it is needed.

Forward: a unit's forward pre-hook all-gathers it (or waits for its prefetch) and starts the
all-gather of the next unit in the previous forward's order (prefetch, overlapped with this
unit's compute); its forward hook frees the buffer again (``reshard_after_forward``), except
for the unit that finishes forward last, which backward needs at once (as FSDP2 does for the
root), or when ``reshard_after_forward=False`` (one all-gather saved per unit, memory kept).

Backward: the forward hook registers a tensor hook on the unit's outputs; it fires when the
gradient of an output is ready, i.e. just before the unit's backward runs, and all-gathers the
unit again, prefetching the unit that backward reaches next (reverse order of last use in
forward). Autograd saved the parameters themselves (views of the flat buffer), so once the
buffer is refilled their saved values are valid again: no saved-tensor hooks are needed. When
every parameter of the unit has accumulated its gradient (``register_post_accumulate_grad_hook``),
no backward node needs the unit's weights any more: its gradients, folded into a flat buffer,
are reduce-scattered asynchronously (hybrid: the shard then all-reduced across replicas), the
full gradient buffer freed once its shard is formed, and the parameters resharded.

Pipelines: a pipeline rank's chunks (``PipelineModule.stages``) are wrapped one after the other,
and each chunk's first unit marks the start of its forward. Every unit reshards after forward,
because the chunk's next action is often another micro-batch's forward. A unit counts its open
backwards: a pre-backward hook fired but not all of its weight gradients have arrived, as between
a zero-bubble BI and its deferred BW. Such a unit stays gathered, since a BW under recomputation
re-runs the forward. A recomputation is told apart from a new forward by autograd's running
graph task. A tied embedding/head copy is a unit of its own (:func:`~loom.parallel.layout.tied_copy`).

Expert parallelism: a MoE layer's expert weights (this rank's E/ep experts) are a unit of their own,
gathered around the layer's forward and backward and sharded over their edp group (the N_e = dp·cp/ep
ranks holding the same experts) instead of the sharding group; the rest of the block is its unit.
Per rank: 16·(Φ_dense'/N + Φ_experts'/N_e) bytes (fp32 Adam).

Frozen parameters (LoRA's base, QLoRA's NF4 codes and scales) get flat buffers of their own per
unit (one per dtype), sharded, gathered and freed with the unit's, never reduced nor updated: a
rank holds Φ_f'·b/N of them, and a unit holding some stays gathered in backward until the gradient
of its input is formed (dx = dy·W needs W after the adapters' gradients have arrived); a unit of
frozen parameters only has no gradient and no optimizer state.

Bytes held per rank between steps, fp32 (Φ' = Σ over units of the padded unit size Φ_u'):

    params 4Φ'/N + grads 4Φ'/N + Adam 8Φ'/N = 16Φ'/N      (mixed precision: (2+2+12)Φ/N)

plus, while a step runs, the gathered units (at most the computing one, the prefetched one and
the last unit) and the gradient buffers in flight.

Bytes moved per rank per step with k micro-batches (b bytes per element, ring all-gather and
reduce-scatter; Φ_re' = units resharded after forward = all but the last, 0 without resharding):

    k·(Φ' + Φ_re')·b·(N-1)/N  [all-gathers]  +  Φ'·b·(N-1)/N  [reduce-scatter]
        [+ 2·(Φ'/N)·b·(R-1)/R  all-reduce across R replicas]

i.e. ≈ 3Φ(N-1)/N per step for k = 1, 1.5x data parallelism (ZeRO paper, §7.2.2).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom import comm
from loom.comm import CommMeter, Group
from loom.parallel.hooks import weak_hook
from loom.parallel.layout import FlatLayout, decayed_ids, tied_copy, unique_params
from loom.parallel.placement import is_expert
from loom.parallel.reducer import MAX_INFLIGHT, AllReduce, GradReducer
from loom.parallel.state import gather_module_state
from loom.parallel.zero.common import OptimizerFactory, ShardedStrategy

SHARDED, GATHERING, UNSHARDED = "sharded", "gathering", "unsharded"


def find_roots(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward is one pass over a set of units: the model itself, or each chunk
    (virtual stage) of a pipeline rank (``model.stages``), which the pipeline runs on its own."""
    stages = getattr(model, "stages", None)
    if isinstance(stages, nn.ModuleList) and all(hasattr(s, "layers") for s in stages):
        return list(stages)
    return [model]


def find_units(model: nn.Module, alone: frozenset[int] = frozenset()) -> list[tuple[str, list[nn.Module]]]:
    """Wrap units ``(name, modules)``: the children before ``model.layers``, each block, the children
    after it; units that share a parameter are merged (into the later one); a child holding a
    parameter whose id is in ``alone`` is a unit of its own. A pipeline rank's chunks
    (:func:`find_roots`) are wrapped one after the other; a model without ``layers`` is one unit."""
    roots = find_roots(model)
    if roots != [model]:
        alone = alone | tied_copy(model)
        return [(f"stages.{i}.{n}", mods) for i, r in enumerate(roots) for n, mods in find_units(r, alone)]
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleList, nn.ModuleDict)):
        return [("model", [model])]
    if any(True for _ in model.parameters(recurse=False)):
        raise ValueError("ZeRO-3: parameters registered directly on the root module are not supported")
    children = list(model.named_children())
    at = next(i for i, (_, m) in enumerate(children) if m is layers)
    name = next(n for n, m in children if m is layers)

    def group(items: list[tuple[str, nn.Module]]) -> list[tuple[str, list[nn.Module]]]:
        items = [
            (n, m) for n, m in items if any(True for _ in m.parameters())
        ]  # frozen ones too (LoRA's base)
        single = [(n, [m]) for n, m in items if any(id(p) in alone for p in m.parameters())]
        rest = [(n, m) for n, m in items if not any(id(p) in alone for p in m.parameters())]
        return ([("+".join(n for n, _ in rest), [m for _, m in rest])] if rest else []) + single

    blocks = layers.items() if isinstance(layers, nn.ModuleDict) else enumerate(layers)
    units = group(children[:at]) + [(f"{name}.{i}", [b]) for i, b in blocks] + group(children[at + 1 :])
    merged: list[tuple[str, list[nn.Module]]] = []
    for unit in units:
        ids = {id(p) for m in unit[1] for p in m.parameters()}
        for i, (n, mods) in enumerate(merged):
            if ids & {id(p) for m in mods for p in m.parameters()}:
                merged.pop(i)
                unit = (f"{n}+{unit[0]}", mods + unit[1])
                break
        merged.append(unit)
    return merged


def expert_layers(mods: list[nn.Module]) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(layer, its expert-parallel weights) for each module under ``mods`` whose children hold expert
    shards: the MoE layer, whose forward reads them (they get a unit of their own, over edp)."""
    out = []
    for m in nn.ModuleList(mods).modules():
        ps = [
            p for c in m.children() for p in c.parameters(recurse=False) if is_expert(p)
        ]  # frozen ones too (LoRA)
        if ps:
            out.append((m, ps))
    return out


@dataclass
class _Order:
    """Units of one root in the order of the forward under way (for prefetching)."""

    prev: list[Unit] = field(default_factory=list)  # by first use in the previous forward
    first: list[Unit] = field(default_factory=list)  # ... in this forward
    last: list[Unit] = field(default_factory=list)  # by last use in this forward (reversed: backward order)


@dataclass(eq=False)
class Frozen:
    """A unit's frozen parameters (LoRA's base): sharded and gathered with it, never reduced or updated."""

    layout: FlatLayout
    full: torch.Tensor  # storage size 0 while sharded; the frozen parameters are views of it
    shard: torch.Tensor  # this rank's part


@dataclass(eq=False)
class Unit:
    """One wrapped unit: its flat parameter buffer (sharded at rest) and its gradient shard."""

    index: int
    name: str
    root: int  # which root (pipeline chunk) the unit belongs to
    modules: list[nn.Module]
    layout: FlatLayout
    full: torch.Tensor  # Φ_u' elements, storage size 0 while sharded; parameters are views of it
    shard: torch.Tensor  # this rank's Φ_u'/N parameters: what the optimizer updates
    grad_shard: torch.Tensor  # this rank's reduced Φ_u'/N gradient
    reshard_after_forward: bool
    frozen: list[Frozen] = field(
        default_factory=list
    )  # its frozen parameters (LoRA's base), one buffer per dtype
    # False: only frozen parameters (``layout`` is then an empty stand-in, never reduced)
    trained: bool = True
    # the group its shards are spread over: the sharding group, or an expert layer's edp group
    group: Group = None
    reducer: GradReducer | None = None  # sums its gradient over ``group`` (and the replicas)
    grad_full: torch.Tensor | None = None
    state: str = UNSHARDED
    work: Any = None  # the all-gather in flight (a torch.distributed Work)
    pending: int = 0  # parameters whose gradient has not arrived in this backward
    reduced: bool = False
    open: int = 0  # backwards begun (pre-backward fired) whose weight gradients are not all in yet
    token: list[bool] = field(default_factory=lambda: [False])  # set when this forward's backward begins

    @property
    def full_bytes(self) -> int:
        return self.layout.padded * self.full.element_size() * self.trained

    def buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(full buffer, this rank's shard) of its trainable and of its frozen parameters."""
        out = [(self.full, self.shard)] if self.trained else []
        return out + [(f.full, f.shard) for f in self.frozen]

    @property
    def gathered_bytes(self) -> int:
        return sum(f.numel() * f.element_size() for f, _ in self.buffers())


class FullyShardedZero(ShardedStrategy):
    """ZeRO-3 over ``shard_group`` (hybrid: all-reduce of gradient shards across ``replicate_group``)."""

    shards_parameters = True

    def __init__(
        self,
        module: nn.Module,
        shard_group: Group,
        replicate_group: Group,
        make_optimizer: OptimizerFactory,
        meter: CommMeter | None = None,
        reduce_dtype: torch.dtype | None = None,
        tp_group: Group = None,
        reshard_after_forward: bool = True,
        max_inflight: int = MAX_INFLIGHT,
        fill: Callable[[torch.Tensor, tuple[int, int]], torch.Tensor] | None = None,
        device: torch.device | None = None,
        allreduce: AllReduce = comm.all_reduce,
        gather_group: Group = None,
    ) -> None:
        """``fill``, ``device``: parameters still on the meta device are materialized unit by unit on
        ``device`` (``fill(p, rows)``: the values of its rows [r0, r1) this rank's shard reaches), so a
        rank never holds more than one whole unit. ``allreduce``: the all-reduce of gradient shards
        across replicas (``parallel.allreduce``, picked by the caller). ``gather_group``: a second
        communicator over the sharding group's ranks for the all-gathers (default: the sharding
        group itself); on NCCL each communicator has its own stream, so a prefetch all-gather does
        not queue behind the reduce-scatters of the units before it (which the compute stream
        would then wait for through the all-gather it does read)."""
        super().__init__(shard_group, replicate_group, tp_group, meter)
        self.gather_group = shard_group if gather_group is None else gather_group
        self._fill, self._device = fill, device
        self.module = module
        self.world = comm.group_size(shard_group)
        dp = self.world * comm.group_size(replicate_group)
        self.reducer = GradReducer(
            shard_group, replicate_group, dp, meter, reduce_dtype, max_inflight, allreduce
        )
        decayed = decayed_ids(module)
        specs = find_units(module)
        covered = {id(p) for _, mods in specs for m in mods for p in m.parameters()}
        if any(id(p) not in covered for p in unique_params(module)):
            raise ValueError("ZeRO-3: some trainable parameters belong to no unit")
        roots = find_roots(module)
        self.pipelined = roots != [module]
        root_of = {id(m): r for r, root in enumerate(roots) for m in root.modules()}
        self._orders = [_Order() for _ in roots]
        self.units: list[Unit] = []
        self._handles = (
            [] if self.pipelined else [module.register_forward_pre_hook(partial(self._root_pre_forward, 0))]
        )
        for i, (name, mods) in enumerate(specs):
            r = root_of[id(mods[0])]
            if self.pipelined and (i == 0 or root_of[id(specs[i - 1][1][0])] != r):  # a chunk's first unit
                self._handles.append(mods[0].register_forward_pre_hook(partial(self._chunk_pre_forward, r)))
            # the last unit of a whole model: backward needs it next; a pipeline's next action may be a forward
            reshard = reshard_after_forward and (self.pipelined or i < len(specs) - 1)
            experts = expert_layers(mods)
            claimed = {id(p) for _, ps in experts for p in ps}
            params = [p for p in unique_params(nn.ModuleList(mods)) if id(p) not in claimed]
            frozen = [
                p
                for p in dict.fromkeys(nn.ModuleList(mods).parameters())
                if not p.requires_grad and id(p) not in claimed
            ]
            self.units.append(
                self._make_unit(len(self.units), name, r, mods, params, decayed, reshard, frozen=frozen)
            )
            for k, (layer, ps) in enumerate(
                experts
            ):  # sharded over their edp group, gathered around the layer
                self.units.append(
                    self._make_unit(
                        len(self.units),
                        f"{name}.experts{k}",
                        r,
                        [layer],
                        [p for p in ps if p.requires_grad],
                        decayed,
                        reshard,
                        self._expert_group(ps[0]),
                        [p for p in ps if not p.requires_grad],
                    )
                )
        trained = [
            u for u in self.units if u.trained
        ]  # units of frozen parameters only: no gradient, no state
        self.layouts = [u.layout for u in trained]
        self.grad_shards = [u.grad_shard for u in trained]
        self.params = unique_params(module)
        self._build_optimizer(make_optimizer, [u.shard for u in trained])
        self.events: list[tuple[str, int, str]] = []  # (what, unit, how): for tests and timelines

    def _make_unit(
        self,
        index: int,
        name: str,
        root: int,
        mods: list[nn.Module],
        params: list[nn.Parameter],
        decayed: set[int],
        reshard: bool,
        group: Group | None = None,
        frozen: list[nn.Parameter] | None = None,
    ) -> Unit:
        """Flatten ``params`` (the modules' own, or an expert layer's weights), keep this rank's shard of
        ``group`` (default: the sharding group), free the rest, attach the hooks to ``mods``. ``frozen``
        parameters get a flat buffer of their own, gathered and freed with the unit's, never reduced."""
        group = self.shard_group if group is None else group
        world = comm.group_size(group)
        rank = dist.get_rank(group) if world > 1 else 0
        parts = []
        for dtype in dict.fromkeys(
            p.dtype for p in frozen or []
        ):  # QLoRA's NF4 codes are uint8: a buffer per dtype
            flay = FlatLayout([p for p in frozen or [] if p.dtype == dtype], world, rank, set(), self._device)
            ffull = flay.new_flat()
            flay.bind(ffull, self._fill)
            parts.append(Frozen(flay, ffull, flay.shard_of(ffull).clone()))
        trained = bool(params)
        lay = FlatLayout(
            params or (frozen or [])[:1], world, rank, decayed, self._device
        )  # frozen only: a stand-in
        full = lay.new_flat() if trained else lay.new_flat()[:0]
        if trained:
            lay.bind(full, self._fill)
        u = Unit(
            index,
            name,
            root,
            mods,
            lay,
            full,
            lay.shard_of(full).clone(),
            lay.new_shard() if trained else full,
            reshard,
            parts,
            trained,
            group,
            self._reducer_for(params[0]) if params else self.reducer,
        )
        u.pending = len(params)
        self._reshard(u)
        for k, m in enumerate(mods):
            post = partial(self._post_forward, u, k == len(mods) - 1)
            self._handles += [
                m.register_forward_pre_hook(partial(self._pre_forward, u, k == 0)),
                m.register_forward_hook(post),
            ]
        for j, p in enumerate(params):
            self._handles.append(
                p.register_post_accumulate_grad_hook(weak_hook(self._post_accumulate, u.index, j))
            )
        return u

    # ------------------------------------------------------------------ gather / free
    def _gather(self, u: Unit, how: str) -> None:
        works = []
        for full, shard in u.buffers():  # the trainable parameters' buffer, and the frozen ones'
            full.untyped_storage().resize_(full.numel() * full.element_size())
            works.append(comm.all_gather(full, shard, self._gather_group(u), self.meter, async_op=True))
        u.work = works
        u.state = GATHERING
        self.events.append(("gather", u.index, how))
        self._track()

    def _gather_group(self, u: Unit) -> Group:
        """Where ``u``'s all-gathers run: the sharding group's twin (``gather_group``) when ``u`` is
        sharded over the sharding group, else ``u.group`` (an expert layer's edp group)."""
        return self.gather_group if u.group is self.shard_group else u.group

    def _unshard(self, u: Unit) -> None:
        if u.state == SHARDED:
            self._gather(u, "demand")
        if u.state == GATHERING:
            _wait(u.work)
            u.work, u.state = None, UNSHARDED

    def _prefetch(self, order: list[Unit], current: Unit) -> None:
        """Start the all-gather of the unit after ``current`` in ``order`` if it is sharded."""
        if current in order:
            i = order.index(current) + 1
            if i < len(order) and order[i].state == SHARDED:
                self._gather(order[i], "prefetch")

    def _reshard(self, u: Unit) -> None:
        if u.state == GATHERING:
            _wait(u.work)
        if u.state != SHARDED:
            for full, _ in u.buffers():
                full.untyped_storage().resize_(0)
            u.work, u.state = None, SHARDED

    # ------------------------------------------------------------------ hooks
    def _root_pre_forward(self, root: int, module: nn.Module, args) -> None:
        """A new forward of ``root``. Of the whole model: any previous backward is over. Of a
        pipeline chunk: earlier micro-batches' backwards may still be open (BI done, BW not)."""
        order = self._orders[root]
        if order.first:
            order.prev = order.first
        order.first, order.last = [], []
        if not self.pipelined:
            for u in self.units:
                u.pending, u.open = len(u.layout.params), 0

    def _chunk_pre_forward(self, root: int, module: nn.Module, args) -> None:
        """A pipeline chunk's first unit starts a forward, unless autograd re-runs it (recomputation)."""
        if not _in_backward():
            self._root_pre_forward(root, module, args)

    def _pre_forward(self, u: Unit, first_module: bool, module: nn.Module, args) -> None:
        if _in_backward():  # forward re-run inside backward (activation recomputation)
            self._unshard(u)
            return
        if u.frozen and first_module and torch.is_grad_enabled():
            # frozen weights serve backward until the gradient of the unit's input is formed (dx = dy W),
            # which comes after its trainable parameters' gradients: only then is its backward over
            for t in _tensors(args):
                if t.requires_grad:
                    t.register_hook(partial(self._input_grad, u))
        order = self._orders[u.root]
        first_use = u not in order.first
        if first_use:
            order.first.append(u)
            u.token = [False]  # this forward's backward has not begun
        if u in order.last:
            order.last.remove(u)
        order.last.append(u)
        self._unshard(u)
        self.events.append(("forward", u.index, module.__class__.__name__))
        if first_use:
            self._prefetch(order.prev, u)

    def _post_forward(self, u: Unit, last_module: bool, module: nn.Module, args, output) -> None:
        if _in_backward():
            return
        grad = torch.is_grad_enabled()
        if grad:
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(partial(self._pre_backward, u, u.token))
        # an open backward (pipeline: BI done, BW not) may recompute with these weights: keep them
        if last_module and (not grad or u.reshard_after_forward) and u.open == 0:
            self._reshard(u)

    def _pre_backward(self, u: Unit, token: list[bool], grad: torch.Tensor) -> None:
        if token[0]:  # a later output of a unit already in backward (tied head: the embedding)
            return
        token[0] = True
        u.open += 1
        self._unshard(u)
        self.events.append(("backward", u.index, ""))
        self._prefetch(self._orders[u.root].last[::-1], u)

    @torch.no_grad()
    def _post_accumulate(self, index: int, j: int, p: torch.Tensor) -> None:
        u = self.units[index]
        if u.grad_full is None:
            u.grad_full = u.layout.new_flat()
            self._track()
        s = u.layout.slots[j]
        if p.grad is not None:
            u.grad_full[s.offset : s.offset + s.numel].view_as(p).add_(p.grad)
        p.grad = None
        u.pending -= 1
        if u.pending == 0:  # one backward of this unit is complete
            self._post_backward(u)

    def _post_backward(self, u: Unit) -> None:
        u.pending = len(u.layout.params)
        if not u.frozen:  # with frozen weights, the input's gradient ends the unit's backward
            self._end_backward(u)
        if self.sync_enabled:
            self._reduce(u)

    def _end_backward(self, u: Unit, grad: torch.Tensor | None = None) -> None:
        u.open = max(0, u.open - 1)
        if u.open == 0:  # no backward node needs this unit's weights any more
            self._reshard(u)

    def _input_grad(self, u: Unit, grad: torch.Tensor) -> None:
        """The gradient of the input of a unit with frozen weights is formed: its backward is over."""
        self._end_backward(u)

    def _reduce(self, u: Unit) -> None:
        if not u.trained:
            return
        if u.grad_full is None:  # no gradient reached this unit: reduce zeros, every rank alike
            u.grad_full = u.layout.new_flat()
        self.events.append(("reduce", u.index, ""))
        assert u.reducer is not None
        u.reducer.launch(u.grad_full, u.grad_shard)
        u.grad_full = None  # freed once the reducer has formed its shard
        u.reduced = True
        self._track()

    def _transient_bytes(self) -> int:
        """Gathered units, full-size unit gradients being filled, reductions in flight."""
        gathered = sum(u.gathered_bytes for u in self.units if u.state != SHARDED)
        filling = sum(
            u.grad_full.numel() * u.grad_full.element_size() for u in self.units if u.grad_full is not None
        )
        return gathered + filling + sum(r.inflight_bytes for r in self._reducers)

    # ------------------------------------------------------------------ Strategy
    def _reduce_all(self) -> None:
        """Reduce what backward did not (unused parameters), wait for every reduction, reshard all."""
        for u in self.units:
            if u.open or u.state != SHARDED:
                u.open = 0
                self._reshard(u)
            if not u.reduced:
                self._reduce(u)
        for r in self._reducers:
            r.drain()
        for u in self.units:
            u.reduced = False
            u.pending = len(u.layout.params)

    def zero_grad(self) -> None:
        for u in self.units:
            u.grad_full = None
            for p in u.layout.params:
                p.grad = None
        self.events.clear()
        self.transient_peak = 0

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """Update this rank's shards; the next forward gathers them."""
        self.optim.step(self.grad_shards, lr, grad_scale)

    def state_bytes(self) -> dict[str, int]:
        """Held between steps: parameter shards 4Φ'/N, gradient shards 4Φ'/N, Adam 8Φ'/N (fp32); and
        the peak of transient bytes during the last step (gathered units, gradient buffers in flight);
        with frozen parameters (LoRA's base), their shards' bytes."""
        out = {
            "param_bytes": sum(u.shard.numel() * u.shard.element_size() for u in self.units),
            "grad_bytes": sum(g.numel() * g.element_size() for g in self.grad_shards),
            "optim_bytes": self.optim.state_bytes,
            "optim_offload_bytes": self.optim.store.offloaded_bytes,
            "transient_peak_bytes": self.transient_peak,
        }
        frozen = [f.shard for u in self.units for f in u.frozen]
        if frozen:
            out["frozen_bytes"] = sum(f.numel() * f.element_size() for f in frozen)
        return out

    @contextlib.contextmanager
    def gathered(self):
        """All units gathered inside (a collective: every rank of the group must enter), e.g. to
        read or save the full parameters; resharded on exit."""
        for u in self.units:
            self._unshard(u)
        try:
            yield self.module
        finally:
            for u in self.units:
                self._reshard(u)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's full state dict, cloned (collective; tp and expert shards gathered too)."""
        with self.gathered():
            return gather_module_state(self.module, self.tp_group)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _wait(works) -> None:
    for w in works or ():
        if w is not None:
            w.wait()


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a recomputed forward runs inside one)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)  # private; present since torch 2.0
    return task_id is not None and task_id() != -1


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []
