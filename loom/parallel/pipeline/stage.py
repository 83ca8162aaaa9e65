"""Cut the model into pipeline stages; split a stage's backward into input and weight parts.

Stages. The model's L blocks are cut by boundaries ``[0, b1, ..., L]`` into n = p*v
virtual stages. Virtual stage s holds blocks ``bounds[s]:bounds[s+1]``, plus the token
embedding if s == 0 and the final norm and output head if s == n-1, and lives on pipeline
rank ``s % p`` (Megatron's looping placement, as in :mod:`.schedules`). The stage modules
hold the *same* submodule objects as the full model under the same names
(``layers.5.attention.wq.weight``), so a stage's state dict uses the reference names and
``init_weights`` (seeded per name) gives the reference values: build the full model, split,
and drop the rest.

Tied embeddings with p > 1: the first stage holds ``tok_embeddings.weight`` and the last
stage ``output.weight``, two copies of one matrix with equal initial values. Each step the two
gradients are summed between the first and last pipeline rank (:func:`exchange_tied_grad`),
so both copies take the same optimizer update and stay equal, and the gradient norm counts
the matrix once.

Backward split (zero-bubble BI/BW), our method. After the forward, the stage's autograd
graph has a *spine*, the nodes on a path from the stage input x to the output, and for every
parameter a short side branch that joins the spine at a *join node* (``MmBackward`` of a
Linear, ``MulBackward`` of an RMSNorm weight, the embedding lookup of the first stage).

* BI: ``torch.autograd.grad(y, x, dy, retain_graph=True)``. The engine runs only what leads
  to x, so join nodes compute their spine input gradients and skip dW (their weight outputs
  are masked off). Pre-hooks on the join nodes capture the gradient arriving at each.
* BW: for each group of parameters behind the same join nodes,
  ``torch.autograd.backward(GradientEdge(join, i), captured_i, inputs=params)``: the engine
  re-enters the graph at the join node with the saved gradient and runs only the side
  branch, e.g. dW = dY^T X of one matmul. Gradients accumulate into ``.grad`` through
  AccumulateGrad, so data-parallel gradient hooks fire as with a plain backward.

Cost: BI + BW do the FLOPs of one full backward (each matmul's dX in BI, its dW in BW); the
graph is retained from BI to BW, the memory price of deferring BW that ZB-H1 bounds. Measured
on this CPU (dim 256, 4 blocks, 2x128 tokens): B 52 ms, BI 34 + BW 24 ms, i.e. 1.1x, the extra
being one autograd engine call per parameter group.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from loom import comm
from loom.comm import Group
from loom.model.llama import Transformer, embed, final_norm, layer_args
from loom.model.softcap import softcap
from loom.parallel.state import gather_module_state

__all__ = [
    "PipelineModule",
    "StageModule",
    "WeightGrad",
    "backward_input",
    "backward_weight",
    "exchange_tied_grad",
    "gather_full_state",
    "split_model",
]


class StageModule(nn.Module):
    """Virtual stage ``index`` of ``n_stages``: [embedding] + blocks[lo:hi] + [norm, output head].

    ``forward(x)``: tokens (B, T) on the first stage, activations (B, T, h) otherwise; returns
    activations (B, T, h), or logits (B, T, V) on the last stage.
    """

    def __init__(self, model: Transformer, index: int, n_stages: int, lo: int, hi: int) -> None:
        super().__init__()
        self.index, self.n_stages, self.lo, self.hi = index, n_stages, lo, hi
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        if self.is_first:
            self.tok_embeddings = model.tok_embeddings
            self.pos_embeddings = model.pos_embeddings  # learned positions (None with RoPE)
            self.embed_scale = model.embed_scale  # Gemma's sqrt(h), or None
            self.embed_multiplier = model.embed_multiplier  # Granite's
            self.register_buffer("pos_ids", cast(torch.Tensor | None, model.pos_ids), persistent=False)
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(lo, hi)})
        if self.is_last:
            self.norm = model.norm
            self.output = model.output
            self.logit_softcap = model.cfg.logit_softcap  # the head's cap, as Transformer.logits
            self.logit_divisor = (
                model.cfg.logit_divisor
            )  # the head's input divided by it, as Transformer.head_input
        self.register_buffer("rope_cos", cast(torch.Tensor, model.rope_cos), persistent=False)  # buffers
        self.register_buffer("rope_sin", cast(torch.Tensor, model.rope_sin), persistent=False)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return embed(
            self.tok_embeddings,
            self.pos_embeddings,
            cast(torch.Tensor | None, self.pos_ids),
            tokens,
            positions,
            self.embed_scale,
            self.embed_multiplier,
        )  # (B, T, h)

    def body(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks (and the head on the last stage) applied to activations h: (B, T, h); packed data's
        ``positions`` (B, T) give every stage its RoPE rows and document mask (each rank has the batch):
        one flex block mask per micro-batch and stage where its layers take it (:func:`layer_args`)."""
        args = layer_args(
            cast(torch.Tensor, self.rope_cos),
            cast(torch.Tensor, self.rope_sin),
            positions,
            self.layers.values(),
            h.shape[1],
        )
        for layer in self.layers.values():
            h = layer(h, *args)
        if not self.is_last:
            return h
        return softcap(self.output(final_norm(self.norm, h, self.logit_divisor)), self.logit_softcap)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.body(self.embed(x, positions) if self.is_first else x, positions)


class PipelineModule(nn.Module):
    """This rank's virtual stages: chunk c is stage c*p + rank (v chunks, v = n_stages / p)."""

    def __init__(
        self,
        model: Transformer,
        rank: int,
        p: int,
        bounds: list[int],
        group: Group = None,
        links: dict[tuple[int, int], Group] | None = None,
    ) -> None:
        super().__init__()
        self.group = group  # the pp process group (peers are group-local ranks = pipeline ranks)
        self.links = dict(links or {})  # (src, dst) pipeline ranks -> their one-way two-rank group
        self.seq_div = 1  # sequence parallelism: activations between stages are (B, T / tp, h)
        self.tp_group: Group = None  # tensor parallelism underneath: stage weights are tp shards
        n = len(bounds) - 1
        if n % p or not 0 <= rank < p:
            raise ValueError(f"{n} stages cannot be placed on {p} pipeline ranks (rank {rank})")
        if (
            bounds[0] != 0
            or bounds[-1] != model.cfg.n_layers
            or any(b >= c for b, c in zip(bounds, bounds[1:]))
        ):
            raise ValueError(f"bad stage boundaries {bounds} for {model.cfg.n_layers} layers")
        self.rank, self.p, self.n_stages, self.bounds = rank, p, n, list(bounds)
        self.cfg = model.cfg
        self.stages = nn.ModuleList(
            StageModule(model, s, n, bounds[s], bounds[s + 1]) for s in range(rank, n, p)
        )
        self.stage_ids = list(range(rank, n, p))

    def link(self, src: int, dst: int) -> tuple[Group, int]:
        """The group carrying pipeline rank src -> dst and the peer's rank in it; the pp group when the
        pipeline was built without links (gloo only: one group can deadlock on NCCL, see ``posting``)."""
        peer = dst if src == self.rank else src
        group = self.links.get((src, dst))
        if group is None:
            if comm.strict() and self.p > 1:
                raise RuntimeError(
                    f"pipeline rank {self.rank}: no link group for {src} -> {dst}; build the "
                    "pipeline with links=mesh.pp_links() (one pp group deadlocks on NCCL)"
                )
            return self.group, peer
        if self.group is None:
            raise ValueError(
                f"pipeline rank {self.rank}: link groups were given but no pp group to map "
                f"pipeline rank {peer} to its global rank"
            )
        return group, dist.get_group_rank(group, dist.get_global_rank(self.group, peer))

    def stage(self, s: int) -> StageModule:
        if s % self.p != self.rank:
            raise KeyError(f"stage {s} lives on pipeline rank {s % self.p}, not {self.rank}")
        return cast(StageModule, self.stages[s // self.p])

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == (self.n_stages - 1) % self.p

    def tied_weight(self) -> nn.Parameter | None:
        """The copy of the tied embedding/head matrix this rank holds (first or last rank), if tied."""
        if not self.cfg.tie_embeddings or self.p == 1:
            return None
        if self.is_first:
            return cast(nn.Parameter, self.stage(0).tok_embeddings.weight)
        if self.is_last:
            return cast(nn.Parameter, self.stage(self.n_stages - 1).output.weight)
        return None


def split_model(
    model: Transformer,
    rank: int,
    p: int,
    bounds: list[int],
    group: Group = None,
    links: dict[tuple[int, int], Group] | None = None,
) -> PipelineModule:
    """Keep pipeline rank ``rank``'s stages of ``model`` (cut at ``bounds``); ``group`` = the pp group,
    ``links`` = :meth:`loom.mesh.ParallelMesh.pp_links` (the runtime's point-to-point groups)."""
    return PipelineModule(model, rank, p, bounds, group, links)


def exchange_tied_grad(
    pipe: PipelineModule,
    meter: comm.CommMeter | None = None,
    grad: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> None:
    """Sum the tied embedding/head gradient between the first and the last pipeline rank.

    g <- g_first + g_last on both ranks (one send and one receive of V*h values each, or of the
    V*h/N elements of a ZeRO shard: ``grad``, which the two ranks hold alike, see
    :func:`loom.parallel.layout.tied_copy`); IEEE addition is commutative, so both copies
    get bitwise the same gradient. A shard in a host store (``offload_params``) crosses through a
    copy on ``device``: sent, summed there and copied back (NCCL moves device memory only).
    """
    w = pipe.tied_weight()
    host = w.grad if grad is None and w is not None else grad
    if w is None or host is None or host.numel() == 0:
        return
    grad = comm.device_copy(host, device)
    peer = (pipe.n_stages - 1) % pipe.p if pipe.is_first else 0
    other = torch.empty_like(grad)
    out_group, out_peer = pipe.link(pipe.rank, peer)
    in_group, in_peer = pipe.link(peer, pipe.rank)
    works = comm.batch_p2p([(grad, out_peer)], [], out_group, meter)
    works += comm.batch_p2p([], [(other, in_peer)], in_group)
    for work in works:
        work.wait()
    grad.add_(other)
    if grad is not host:
        host.copy_(grad)  # (blocking: the host reads the shard next, for the norm and the step)


def gather_full_state(pipe: PipelineModule) -> dict[str, torch.Tensor] | None:
    """The full model's state dict (reference names; both tied copies) on pipeline rank 0, else None.

    A collective over the pp group (and the tp or ep group, whose shards are gathered first).
    """
    local = {k: v.cpu() for k, v in gather_module_state(pipe.stages, pipe.tp_group).items()}
    local = {k.split(".", 1)[1]: v for k, v in local.items()}  # drop the "<chunk>." prefix
    if comm.group_size(pipe.group) == 1:
        return local
    out: list[dict[str, torch.Tensor]] | None = [{}] * pipe.p if pipe.rank == 0 else None
    dist.gather_object(local, out, group=pipe.group, group_dst=0)
    if out is None:
        return None
    full: dict[str, torch.Tensor] = {}
    for part in out:
        full.update(part)
    return full


# ----------------------------------------------------------------------------- backward split


@dataclass
class WeightGrad:
    """What BI leaves for BW: per parameter group, the join-node edges and their captured gradients."""

    groups: list[tuple[list[torch.Tensor], list[GradientEdge], list[torch.Tensor]]] = field(
        default_factory=list
    )


def _node(t: torch.Tensor) -> Node:
    """The autograd node producing t: its grad_fn, or for a leaf its AccumulateGrad node."""
    if t.grad_fn is not None:
        return t.grad_fn
    view = t.view_as(t).grad_fn
    node = None if view is None else view.next_functions[0][0]
    if node is None:
        raise ValueError("a tensor that does not require grad has no autograd node")
    return node


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """Reverse edges of the graph below ``root``: node -> nodes that feed it gradients."""
    rev: dict[Node, list[Node]] = defaultdict(list)
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            rev[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return rev


def _closure(starts: list[Node], rev: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reachable from ``starts`` along reverse edges, not entering ``stop``; and the stop nodes hit."""
    seen, hit, stack = set(starts), set(), list(starts)
    while stack:
        for c in rev.get(stack.pop(), ()):
            if c in stop:
                hit.add(c)
            elif c not in seen:
                seen.add(c)
                stack.append(c)
    return seen, hit


def backward_input(
    output: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor, params: list[nn.Parameter]
) -> tuple[torch.Tensor | None, WeightGrad]:
    """BI: dL/dx only (weight gradients deferred); returns it and what :func:`backward_weight` needs.
    An input that needs no gradient (the first stage's, from a frozen embedding: LoRA, QLoRA) has no
    spine: dx is None, and the whole backward, all weight gradients, is deferred to BW."""
    if not x.requires_grad:
        trained: list[torch.Tensor] = [p for p in params if p.requires_grad]
        dy = torch.ones_like(output) if grad is None else grad
        pending = WeightGrad([(trained, [get_gradient_edge(output)], [dy])] if trained else [])
        return None, pending
    out_node, in_node = _node(output), _node(x)
    rev = _consumers(out_node)
    spine, _ = _closure([in_node], rev, set())
    joins_of: dict[int, set[Node]] = {}
    for i, p in enumerate(params):
        if p.requires_grad:
            _, joins_of[i] = _closure([_node(p)], rev, spine)
    # params sharing a join node form one group (one backward call in BW)
    group_of: dict[Node, int] = {}
    groups: list[tuple[list[int], set[Node]]] = []
    for i, joins in joins_of.items():
        ids = {group_of[j] for j in joins if j in group_of}
        merged = ([i], set(joins))
        for g in sorted(ids, reverse=True):
            merged[0].extend(groups[g][0])
            merged[1].update(groups[g][1])
            groups[g] = ([], set())
        groups.append(merged)
        for j in merged[1]:
            group_of[j] = len(groups) - 1
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = [j.register_prehook(lambda g, j=j: captured.__setitem__(j, g)) for j in group_of]
    try:
        (dx,) = torch.autograd.grad(output, x, grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    captured[in_node] = (dx,)  # a join that is the input node itself (the embedding lookup)
    pending = WeightGrad()
    for members, join_nodes in groups:
        if not members:
            continue
        edges: list[GradientEdge] = []
        grads: list[torch.Tensor] = []
        for j in join_nodes:
            for k, gk in enumerate(captured.get(j, ())):
                if gk is not None:
                    edges.append(GradientEdge(j, k))
                    grads.append(gk)
        if edges:
            pending.groups.append(([params[i] for i in members], edges, grads))
    return dx, pending


def backward_weight(pending: WeightGrad) -> None:
    """BW: accumulate the deferred weight gradients into ``.grad`` (hooks fire as usual)."""
    for params, edges, grads in pending.groups:
        torch.autograd.backward(edges, grads, retain_graph=True, inputs=params)
    pending.groups.clear()
