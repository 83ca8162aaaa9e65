"""What ``loom plan calibrate`` runs to measure: a block of compute (:func:`layer_work`), timing
helpers, and the pairs of row/column tensor-parallel layers and of an expert-parallel mixture of
experts whose calls through Loom's layers it prices beside the bare collectives
(:func:`layer_call_excess`)."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

from loom.plan.hardware import CollectiveFit

if TYPE_CHECKING:
    import torch


def _timed(fn, repeats: int, device: torch.device | None = None, best: bool = False) -> float:
    """Median (``best``: least) seconds of ``fn()`` after two warm-up calls; on an accelerator
    (``device``) each call is timed between synchronisations, so queued kernels and collectives are counted."""
    from loom.device import synchronize

    fn()
    fn()
    times = []
    for _ in range(repeats):
        if device is not None:
            synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device is not None:
            synchronize(device)
        times.append(time.perf_counter() - t0)
    return min(times) if best else statistics.median(times)


def hidden_share(alone, sequential, overlapped, calls: int, device=None, trials: int = 15) -> float:
    """Share of a collective's time hidden behind compute, ``1 - (Σ t_overlapped - Σ t_alone) /
    (Σ t_sequential - Σ t_alone)`` in [0, 1], each t a block of ``calls`` calls, the three blocks of
    a trial back to back and the sums over ``trials`` trials (a trial's own ratio swings from 0
    to 0.8 here; the sums weigh each by its time)."""
    from loom.device import synchronize

    def block(fn) -> float:
        if device is not None:
            synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if device is not None:
            synchronize(device)
        return time.perf_counter() - t0

    for fn in (alone, sequential, overlapped):  # warm-up
        fn()
    a = s = o = 0.0
    for _ in range(trials):
        a, s, o = a + block(alone), s + block(sequential), o + block(overlapped)
    return min(1.0, max(0.0, 1.0 - (o - a) / (s - a))) if s > a else 0.0


def layer_work(tokens: int, width: int, device=None):
    """A callable running what a rank does between two collectives of a layer: a few of the
    model's GEMMs (``tokens x width @ width x width``) with elementwise ops, forward and backward
    through autograd, so both the FLOPs and the per-op framework cost are in it."""
    import torch

    x = torch.randn(tokens, width, device=device)
    w = (torch.randn(width, width, device=device) / width**0.5).requires_grad_()

    def work() -> None:
        y = x
        for _ in range(2):
            y = torch.nn.functional.silu(y @ w) * 0.5 + y
        y.sum().backward()
        w.grad = None

    return work


def tp_layer_pair(tokens: int, width: int, group, rank: int, size: int, device=None):
    """(through the layers, the GEMMs alone): a sequence-parallel column -> row pair of Loom's
    tensor-parallel layers (``width`` -> ``2 width`` -> ``width``, as a block's attention or MLP)
    forward + backward over ``group`` of ``size`` ranks, issuing :data:`LAYER_CALLS` ``["tp"]``
    collectives (forward: the sequence's all-gather and the reduce-scatter; backward: the row
    layer's all-gather, the column layer's re-gather and reduce-scatter behind its GEMMs); and the
    same GEMMs on the whole sequence without the layers."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from loom.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
    from loom.parallel.tensor.shard import TPContext

    g = torch.Generator().manual_seed(0)
    w_in = nn.Parameter((torch.randn(2 * width // size, width, generator=g) / width**0.5).to(device))
    w_out = nn.Parameter((torch.randn(width, 2 * width // size, generator=g) / width**0.5).to(device))
    ctx = TPContext(group=group, rank=rank, size=size, sp=True)
    col, row = ColumnParallelLinear(w_in, ctx), RowParallelLinear(w_out, ctx)
    shard = torch.randn(1, tokens // size, width, generator=g).to(device).requires_grad_()
    whole = torch.randn(1, tokens, width, generator=g).to(device).requires_grad_()

    def through_layers() -> None:
        row(F.silu(col(shard))).sum().backward()
        shard.grad = w_in.grad = w_out.grad = None

    def gemms_alone() -> None:
        F.linear(F.silu(F.linear(whole, w_in)), w_out).sum().backward()
        whole.grad = w_in.grad = w_out.grad = None

    return through_layers, gemms_alone


def ep_layer_pair(tokens: int, width: int, group, rank: int, size: int, device=None):
    """(through the layer, on one rank): a mixture of :data:`EP_EXPERTS` SwiGLU experts (top
    :data:`EP_TOP_K`, hidden ``2 width``) forward + backward on ``tokens`` tokens, as Loom's
    :class:`~loom.parallel.expert.parallelize.ExpertParallelMoE` over ``group`` of ``size`` ranks runs
    it (:data:`LAYER_CALLS` ``["ep"]`` all-to-alls: the counts, dispatch and combine, both again in
    backward), and the plain layer with every expert on this rank (the same rows computed)."""
    import copy

    import torch

    from loom.model.moe import MoEFeedForward
    from loom.parallel.expert.parallelize import ExpertParallelMoE

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        plain = MoEFeedForward(width, 2 * width, EP_EXPERTS, EP_TOP_K).to(device)
        spread = ExpertParallelMoE(copy.deepcopy(plain), rank, size, group, group)
        x = (
            torch.randn(1, tokens, width, generator=torch.Generator().manual_seed(1 + rank))
            .to(device)
            .requires_grad_()
        )

    def run(layer) -> None:
        layer(x).sum().backward()
        x.grad = None
        layer.zero_grad(set_to_none=True)

    return (lambda: run(spread)), (lambda: run(plain))


EP_EXPERTS, EP_TOP_K = 4, 2
LAYER_CALLS = {"tp": 5, "ep": 5}  # collectives one tp_layer_pair / ep_layer_pair issues
# kinds whose wall time through the layer is what a step pays: ep's all-to-alls are synchronous (the
# counts must arrive before the rows), while tp's backward calls are asynchronous behind the GEMMs, and
# how much of them a step's other work hides is not the loop's (the trainer measured its tp calls at
# their bare fits, and its all-to-alls near twice theirs); the CPU of both counts in full
WALL_KINDS = ("ep",)


def layer_call_excess(
    kind: str, rows: list[tuple[str, int, int, float]], fits: list[CollectiveFit], scope: str
) -> float:
    """What a ``kind`` call through Loom's layers costs beyond the collective fits in ``scope``
    (``intra``: wall, ``cpu``: CPU), per call, at least 0: the layer measurement (``rows``:
    ``kind_layer[:cpu]``, at its full activation bytes S over 2 ranks) minus the mean fit of the
    calls it issued, each moving S/2 (tp: 3 all-gathers and 2 reduce-scatters of the sequence;
    ep: 4 all-to-alls of the top-k rows and one of the per-expert counts)."""
    key = f"{kind}_layer" + ("" if scope == "intra" else f":{scope}")
    measured = next(((t, s) for o, _, s, t in rows if o == key), None)
    fit = {c.op: c for c in fits if c.scope == scope and c.group_size == 2 and c.world == 2}
    if measured is None:
        return 0.0
    t, size = measured

    def call(op: str, nbytes: float) -> float:
        return fit[op].latency + nbytes / 2 / fit[op].bus_bandwidth if op in fit else 0.0

    if kind == "tp":
        bare = 3 * call("all_gather", size) + 2 * call("reduce_scatter", size)
    else:
        bare = 4 * call("all_to_all", size * EP_TOP_K) + call("all_to_all", 8 * EP_EXPERTS)
    return max(0.0, t - bare / LAYER_CALLS[kind])


def busy_calls(work, seconds: float, device: torch.device | None = None) -> int:
    """How many ``work()`` calls finish in ``seconds`` of wall time. Ranks started together each run
    for the same time, so none runs alone after the others finish (a fixed number of calls would
    let the late ranks do); on an accelerator each call is waited for, not only queued."""
    from loom.device import synchronize

    work()
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        work()
        if device is not None:
            synchronize(device)
        n += 1
    return n


def work_rate(work, calls: int = 200, blocks: int = 5, device: torch.device | None = None) -> float:
    """Seconds per ``work()`` call: the median over ``blocks`` blocks of ``calls`` calls, each block
    long enough (tens of ms) to span the scheduler's time slices."""

    def block() -> None:
        for _ in range(calls):
            work()

    return _timed(block, blocks, device) / calls
