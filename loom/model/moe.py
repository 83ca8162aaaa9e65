"""Mixture of experts: routing, capacity, balancing losses and grouped compute of one MoE layer.

Shapes: N tokens, h = dim, f = expert hidden size, E experts, k = top_k, A = N·k assignments.

Routing (``moe.score``): logits z = x W_rᵀ in fp32; scores s = softmax(z) (Mixtral) or sigmoid(z)
(DeepSeek-V3). Each token takes the k experts of highest s + b (b: the aux-loss-free selection
bias, 0 unless ``moe.bias_update_rate`` > 0) and weights them by s, divided by Σ_topk s when
``moe.norm_topk``. Shared experts (``moe.n_shared_experts`` = S) are one SwiGLU of width S·f that
every token goes through, added to the routed output.

Capacity (``moe.capacity_factor`` c > 0, training only): expert e keeps at most
C = ceil(c·N·k/E) of its assignments in a micro-batch, the highest-score ones
(``drop_policy = probability``) or the earliest tokens (``position``); a dropped assignment
contributes nothing, so a token dropped by all its experts passes through the residual alone.

Balancing, added to the objective of every micro-batch like its loss (scaled by 1/micro-batches
and the fp16 loss scale: :class:`_InjectAux` passes the activations through and feeds the aux
loss its gradient in backward, so it reaches the router under every schedule, pipeline stages
included):

    aux    α·E·Σ_e f_e·P_e        f_e = assignments to e / (N·k), before dropping,
                                   P_e = mean over tokens of s_e / Σ_e' s_e'
    z      β·mean_t (logsumexp_e z_t,e)²
    bias   after each step  b_e += γ·sign(mean_e' load_e' − load_e), load over the step's tokens

f_e and the loads are global: their counts are summed over the dp × cp ranks of the micro-step
(one all-reduce of E + 1 numbers per layer and micro-batch, one of L·E per step for the bias),
so they are those of one process running the dp ranks' micro-batches as one. P_e and the z-loss
are local means; the data-parallel gradient average makes them global.

Compute: the assignments sorted by expert run as one grouped matmul per weight
(``torch._grouped_mm`` where this build and device have it, else a zero-padded (E, max_e n_e, h)
batched matmul); ``moe.compute = loop`` runs the experts one by one (the reference).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from loom.config import MoEConfig

StatsSum = Callable[[torch.Tensor], None]  # sums a tensor of counts in place over a micro-step's ranks


def one_process(counts: torch.Tensor) -> None:
    """The :data:`StatsSum` of a single process: its counts are already the micro-step's."""


class ExpertWeights(nn.Module):
    """One weight matrix per expert, stacked: ``weight`` of shape (E, out, in)."""

    def __init__(
        self,
        n_experts: int,
        out_features: int,
        in_features: int,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(n_experts, out_features, in_features, device=device, dtype=dtype)
        )


class Routing(NamedTuple):
    weights: torch.Tensor  # (N, k) in x's dtype
    experts: torch.Tensor  # (N, k) int64
    scores: torch.Tensor  # (N, E) fp32
    logits: torch.Tensor  # (N, E) fp32


def route(
    x: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    score: str = "softmax",
    norm_topk: bool = True,
    bias: torch.Tensor | None = None,
) -> Routing:
    """Top-k routing of tokens x (N, h) over E experts (module doc): the k experts of highest
    score (+ selection bias), weighted by their scores (renormalized when ``norm_topk``)."""
    logits = F.linear(x, router).float()  # (N, E)
    scores = torch.sigmoid(logits) if score == "sigmoid" else F.softmax(logits, dim=-1)
    chosen = scores if bias is None else scores + bias
    experts = chosen.topk(top_k, dim=-1).indices  # (N, k)
    weights = scores.gather(-1, experts)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    return Routing(weights.to(x.dtype), experts, scores, logits)


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(E,) int64: how many entries of ``experts`` (any shape, values in [0, E)) name each expert.
    A fixed-size scatter-add, not ``bincount`` (whose size depends on the data: a graph break under
    ``torch.compile``, a host sync on CUDA)."""
    flat = experts.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int64)
    )


def capacity(n_tokens: int, top_k: int, n_experts: int, factor: float) -> int:
    """Assignments one expert takes: ceil(factor·N·k/E)."""
    return math.ceil(factor * n_tokens * top_k / n_experts)


def keep_mask(
    priority: torch.Tensor, experts: torch.Tensor, n_experts: int, cap: int, policy: str
) -> torch.Tensor:
    """(N, k) bool: per expert, its ``cap`` first assignments in order of decreasing ``priority``
    (N, k) (``probability``) or of token position (``position``), ties by position."""
    flat = experts.reshape(-1)
    n = flat.numel()
    if policy == "probability":
        order = torch.argsort(-priority.reshape(-1).float(), stable=True)
    else:
        order = torch.arange(n, device=flat.device)
    by_expert = torch.argsort(flat[order], stable=True)  # priority order kept within each expert
    ranked = order[by_expert]  # assignments grouped by expert, best first
    counts = expert_counts(flat, n_experts)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(n, device=flat.device) - starts[flat[ranked]]  # rank inside its expert
    keep = torch.zeros(n, dtype=torch.bool, device=flat.device)
    keep[ranked] = position < cap
    return keep.view_as(experts)


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """w2( silu(w1 x) * w3 x ) for one expert's (f, h), (f, h), (h, f) weights; x: (n, h) -> (n, h)."""
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def experts_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    first: int = 0,
) -> torch.Tensor:
    """The reference loop: Σ over each token's routed experts of weight · SwiGLU_e(x), for the experts
    ``first .. first + len(w1) - 1`` held in the stacked (E', f, h), (E', f, h), (E', h, f) weights;
    tokens routed elsewhere get nothing from here. x: (N, h) -> (N, h)."""
    out = torch.zeros_like(x)
    for j in range(w1.shape[0]):
        token, slot = (experts == first + j).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        y = swiglu(x.index_select(0, token), w1[j], w3[j], w2[j])
        out = out.index_add(0, token, y * weights[token, slot, None])
    return out


class _ContiguousGrad(Function):
    """Identity whose backward makes the incoming gradient contiguous (``_grouped_mm`` needs it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs here for x's dtype: CPU fp32/bf16, or bf16 on a CUDA
    device of compute capability >= 9.0; under ``torch.compile`` bf16 only (its fake kernel
    refuses fp32: the padded batched matmul then)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16)
    if x.device.type == "cuda" and x.dtype == torch.bfloat16:
        return torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


def grouped_mm_aligned(h: int, f: int, itemsize: int) -> bool:
    """Whether ``torch._grouped_mm`` takes an expert of width f on rows of h features: every row
    stride (h and f elements of ``itemsize`` bytes) a multiple of 16 bytes, else it refuses and the
    experts run the padded batched matmul (e.g. f = 100 split over tp 4: 25 fp32 = 100 bytes)."""
    return (h * itemsize) % 16 == 0 and (f * itemsize) % 16 == 0


def _gmm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows x[offs[e-1]:offs[e]] times w[e]ᵀ for every e: x (A, in), w (E, out, in) -> (A, out)."""
    return _ContiguousGrad.apply(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))


def grouped_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    compute: str = "grouped",
    max_rows: int | None = None,
) -> torch.Tensor:
    """SwiGLU_e on rows x (A, h) sorted by expert, ``counts[e]`` rows for expert e of the stacked
    weights; -> (A, h). ``grouped``: one grouped (or padded batched) matmul per weight; ``loop``: per expert.
    ``max_rows``: a bound on any counts[e] known on the host (the padded batch's width, so that no
    host sync reads max(counts); A when not given); ``loop`` reads the counts (one sync)."""
    if compute == "loop":
        out, start = [], 0
        for e, n in enumerate(counts.tolist()):
            out.append(swiglu(x[start : start + n], w1[e], w3[e], w2[e]))
            start += n
        return torch.cat(out) if out else x.new_zeros(0, w2.shape[1])
    if (
        grouped_mm_available(x)
        and x.shape[0] > 0
        and grouped_mm_aligned(x.shape[1], w1.shape[1], x.element_size())
    ):
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return _gmm(F.silu(_gmm(x, w1, offs)) * _gmm(x, w3, offs), w2, offs)
    # padded: expert e's rows at (e, 0 .. n_e - 1) of an (E, max n_e, h) batch
    n_experts, rows = counts.shape[0], x.shape[0]
    starts = torch.cumsum(counts, 0) - counts
    expert = torch.repeat_interleave(torch.arange(n_experts, device=x.device), counts, output_size=rows)
    slot = torch.arange(rows, device=x.device) - starts[expert]
    width = min(rows, rows if max_rows is None else max_rows)
    batch = x.new_zeros(n_experts, width, x.shape[1]).index_put((expert, slot), x)
    hidden = F.silu(torch.bmm(batch, w1.transpose(1, 2))) * torch.bmm(batch, w3.transpose(1, 2))
    return torch.bmm(hidden, w2.transpose(1, 2))[expert, slot]


class _InjectAux(Function):
    """Forward: ``out`` unchanged; backward: ``out``'s gradient, and ``layer.grad_scale`` as the
    gradient of the scalar aux loss (what the main loss of the micro-batch gets)."""

    @staticmethod
    def forward(ctx, out, aux, layer):
        ctx.layer = layer
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.layer.grad_scale, dtype=torch.float32, device=grad.device), None


def recomputing() -> bool:
    """True inside a backward pass (a checkpointed forward running again): statistics are not recounted."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class SharedExperts(nn.Module):
    """The shared experts as one SwiGLU of hidden size S·f: w2( silu(w1 x) * w3 x )."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


N_STATS = 4  # after the E loads: dropped assignments, aux sum, z sum, forwards


class TokenSplit(Protocol):
    """How a layer's tokens reach experts cut over a tensor-parallel group (each rank computes a slice
    of every expert: :mod:`loom.parallel.tensor.experts`), so the model holds no process group."""

    def inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the router's input, the experts'): every token of the group, the same on every rank."""
        ...

    def weights(self, w: torch.Tensor) -> torch.Tensor:
        """The routing weights ``w``, their gradient (from partial expert outputs) summed over the group."""
        ...

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """This rank's part of the layer's output, from its partial sums ``out`` over every token."""
        ...


class MoEFeedForward(nn.Module):
    """Mixture of SwiGLU experts (module doc): y = Σ_{e kept} w_e · w2_e( silu(w1_e x) * w3_e x )
    (+ shared experts). Dropless by default (every routed token is computed)."""

    activation_kind = "mlp"  # what its saved tensors (router and experts) count as for train.compress
    expert_bias: torch.Tensor | None  # (E,) fp32 selection bias (a buffer) with bias balancing, else None

    def __init__(
        self, dim: int, hidden: int, n_experts: int, top_k: int, options: MoEConfig | None = None
    ) -> None:
        super().__init__()
        self.top_k, self.n_experts = top_k, n_experts
        self.options = options or MoEConfig()
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w1 = ExpertWeights(n_experts, hidden, dim)
        self.w3 = ExpertWeights(n_experts, hidden, dim)
        self.w2 = ExpertWeights(n_experts, dim, hidden)
        s = self.options.n_shared_experts
        self.shared = SharedExperts(dim, s * hidden) if s else None
        rate = self.options.bias_update_rate
        self.register_buffer("expert_bias", torch.zeros(n_experts) if rate > 0 else None)
        self._init_state()

    def _init_state(self) -> None:
        self.layer_id = -1  # the block's index (metrics)
        self.sum_stats: StatsSum = one_process  # f_e's counts over the ranks of a micro-batch (configure_moe)
        self.sum_step: StatsSum = one_process  # a step's loads over every data-parallel rank (configure_moe)
        self.loss_share = 1.0  # this rank's share of the aux/z loss terms: 1/tp when sp splits tokens over tp
        self.grad_scale = 1.0  # the main loss's backward factor for this micro-batch (set by begin_step)
        self.step_load: torch.Tensor | None = None  # assignments per expert this step (bias update)
        self.stats: torch.Tensor | None = None  # (E + N_STATS,) since the last metrics row
        self.split: TokenSplit | None = None  # experts cut over a tp group: how tokens reach them (forward)

    def expert_outputs(
        self,
        flat: torch.Tensor,
        token: torch.Tensor,
        expert: torch.Tensor,
        weight: torch.Tensor,
        keep: torch.Tensor | None = None,
        bound: int | None = None,
    ) -> torch.Tensor:
        """Σ_a weight_a · SwiGLU_{expert_a}(flat[token_a]) into each token's row, for the
        assignments a sorted by expert, those with ``keep`` false (dropped by capacity) left out: (N, h).
        Dropped rows are computed with weight 0 here (no host sync to size the kept set; exactly the
        same sums); ``bound``: at most that many rows per expert."""
        counts = expert_counts(expert, self.n_experts)
        rows = grouped_swiglu(
            flat.index_select(0, token),
            counts,
            self.w1.weight,
            self.w3.weight,
            self.w2.weight,
            self.options.compute,
            bound,
        )
        if keep is not None:
            weight = weight * keep
        return torch.zeros_like(flat).index_add(0, token, rows * weight[:, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        opt, k = self.options, self.top_k
        x_route, x_experts = (x, x) if self.split is None else self.split.inputs(x)
        flat = x_route.reshape(-1, x_route.shape[-1])  # (N = B·T, h)
        r = route(flat, self.router.weight, k, opt.score, opt.norm_topk, self.expert_bias)
        keep, bound = None, flat.shape[0]  # k distinct experts per token: at most N rows per expert
        if opt.capacity_factor > 0 and self.training:
            cap = capacity(flat.shape[0], k, self.n_experts, opt.capacity_factor)
            keep = keep_mask(r.scores.gather(-1, r.experts), r.experts, self.n_experts, cap, opt.drop_policy)
        order = torch.argsort(r.experts.reshape(-1), stable=True)  # assignments sorted by expert
        to_experts = flat if self.split is None else x_experts.reshape(flat.shape)
        weight = r.weights.reshape(-1)[order]
        out = self.expert_outputs(
            to_experts,
            order // k,
            r.experts.reshape(-1)[order],
            weight if self.split is None else self.split.weights(weight),
            None if keep is None else keep.reshape(-1)[order],
            bound,
        )
        if self.shared is not None:
            out = out + self.shared(to_experts)
        out = self._balance(out, r, keep).view_as(x_route)
        return out if self.split is None else self.split.output(out)

    def _balance(self, out: torch.Tensor, r: Routing, keep: torch.Tensor | None) -> torch.Tensor:
        """Attach the aux and z losses to ``out`` (training with gradients) and count the statistics.
        Eager under ``torch.compile`` (one graph break per layer, :func:`keep_eager_under_compile`):
        it all-reduces the counts (``sum_stats``), asks :func:`recomputing` and keeps statistics on
        the module."""
        opt, n_tokens = self.options, r.experts.shape[0]
        load = expert_counts(r.experts, self.n_experts).float()  # before dropping
        aux = z = torch.zeros((), device=out.device)
        losses = self.training and torch.is_grad_enabled() and (opt.aux_loss_coef > 0 or opt.z_loss_coef > 0)
        if losses:
            total = torch.zeros((), device=out.device)
            if opt.aux_loss_coef > 0:
                counts = torch.cat([load, load.new_full((1,), n_tokens)])
                self.sum_stats(counts)  # f_e over the ranks of this micro-batch's sequences (cp [x tp])
                f = counts[:-1] / (counts[-1] * self.top_k)
                s = r.scores if opt.score == "softmax" else r.scores / r.scores.sum(-1, keepdim=True)
                aux = self.n_experts * (f * s.mean(0)).sum()
                total = total + opt.aux_loss_coef * aux
            if opt.z_loss_coef > 0:
                z = torch.logsumexp(r.logits, -1).square().mean()
                total = total + opt.z_loss_coef * z
            out = _InjectAux.apply(out, total * self.loss_share, self)
        if self.training and not recomputing():
            dropped = load.new_zeros(()) if keep is None else (~keep).sum().float()
            row = torch.cat(
                [load, torch.stack([dropped, aux.detach().float(), z.detach().float(), load.new_ones(())])]
            )
            self.stats = row if self.stats is None else self.stats + row
            if self.expert_bias is not None:
                self.step_load = load if self.step_load is None else self.step_load + load
        return out


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The MoE layers of ``model`` (a whole model, or a pipeline rank's stages), in module order."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def configure_moe(
    model: nn.Module, sum_stats: StatsSum, loss_share: float = 1.0, sum_step: StatsSum | None = None
) -> None:
    """How the layers' counts are summed: ``sum_stats``, the aux loss's f_e counts over the ranks
    holding the other tokens of a micro-batch's sequences (cp; and tp when sequence parallelism
    splits the tokens: then each tp rank's aux and z terms are 1/tp of the loss, ``loss_share``, as
    its tokens are), so each data-parallel rank's micro-batch is balanced as one process balances
    the same micro-batch, with or without accumulation; ``sum_step`` (default ``sum_stats``), a step's
    loads for the selection bias and hot experts, over every data-parallel rank too (dp x cp [x tp]).
    Both come from the parallel layer (:func:`loom.parallel.expert.parallelize.stats_sum`): the
    model holds no process group."""
    for m in moe_layers(model):
        m.sum_stats, m.loss_share = sum_stats, loss_share
        m.sum_step = sum_stats if sum_step is None else sum_step


def begin_step(model: nn.Module, grad_scale: float) -> None:
    """Before a step's forwards: the aux losses' backward factor, that of each micro-batch's loss
    (1/micro-batches, times the fp16 loss scale); the step's loads start from zero."""
    for m in moe_layers(model):
        m.grad_scale = grad_scale
        m.step_load = None  # only this step's forwards count (not, e.g., a pipeline's profiling runs)


@torch.no_grad()
def end_step(model: nn.Module) -> None:
    """After a step: b_e += γ·sign(mean load − load_e) with the step's loads summed over the layers'
    statistics groups (one all-reduce of L·E numbers per group, none without bias balancing)."""
    layers = [m for m in moe_layers(model) if m.expert_bias is not None and m.step_load is not None]
    if not layers:
        return
    loads = torch.stack([m.step_load for m in layers if m.step_load is not None])  # (L, E)
    layers[0].sum_step(loads)
    for m, load in zip(layers, loads):
        bias = m.expert_bias
        assert bias is not None
        bias += m.options.bias_update_rate * torch.sign(load.mean() - load)
        m.step_load = None


def real_buffers(model: nn.Module, device: torch.device | str) -> None:
    """Selection biases of a model built on the meta device, as zeros on ``device``."""
    for m in moe_layers(model):
        if m.expert_bias is not None and m.expert_bias.is_meta:
            m.expert_bias = torch.zeros(m.n_experts, device=device)


def keep_eager_under_compile() -> None:
    """``torch.compiler.disable`` on :meth:`MoEFeedForward._balance`, once: applied by
    :mod:`loom.train.compile` before it compiles, not at import (``torch.compiler.disable`` imports
    ``torch._dynamo``, about 1 s in every process that never compiles)."""
    if not hasattr(MoEFeedForward._balance, "_torchdynamo_disable"):
        MoEFeedForward._balance = torch.compiler.disable(MoEFeedForward._balance)  # type: ignore[method-assign]
