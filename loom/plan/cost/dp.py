"""Data-parallel and ZeRO communication per step (all-reduce, reduce-scatter + all-gather, ZeRO-3's
gathers, hybrid sharding, parameter servers), its overlap with compute, and the step's scalar
synchronisation (formulas: :mod:`loom.plan.cost`)."""

from __future__ import annotations

import math

from loom.plan import collectives
from loom.plan.cost.base import CostBase
from loom.plan.cost.layout import Layout
from loom.plan.zero_options import zeropp_time


def contended(shown: float, hidden: float, share: float) -> float:
    """Seconds that communication costs the step when ``shown`` seconds of it run alone and ``hidden``
    seconds run beside compute, of which a ``share`` is truly hidden (``Machine.comm_overlap``: 0.8
    on GPUs, NCCL's kernels taking SMs and HBM bandwidth from the compute they overlap; 0 where
    nothing overlaps)::

        shown + (1 - share) hidden

    The one rule for every overlap the model prices: data parallel and ZeRO (:func:`dp_time`,
    :func:`exposed`) and tensor parallel's chunked collectives (``Layout.tp_overlap``,
    :func:`loom.plan.cost.compute.microbatch_times`)."""
    return shown + (1 - max(0.0, share)) * hidden


def exposed(total: float, calls: int, window: float, share: float) -> float:
    """Seconds of ``total`` communication in ``calls`` calls left showing beside ``window`` seconds of
    compute when a ``share`` of overlapped traffic is truly hidden: the last call always (nothing
    left to hide it behind), what does not fit the window, and the unhidden part of what does
    (:func:`contended`)::

        last + max(0, rest - window) + (1 - share) min(rest, window),  last = total / calls, rest = total - last
    """
    if total <= 0 or share <= 0 or calls <= 0:
        return max(0.0, total)
    last = total / calls
    rest = total - last
    return contended(last + max(0.0, rest - window), min(rest, window), share)


def serial_finish(ready: list[float], comm: list[float]) -> float:
    """When the last of a stream's calls ends: call i starts at max(its ``ready`` time, the end of
    call i - 1) and runs ``comm[i]`` seconds (one communication stream, calls in issue order)."""
    end = -math.inf
    for r, c in zip(ready, comm):
        end = max(end, r) + c
    return end if ready else 0.0


def reduce_ready_times(t_b: float, buckets: int, p: int, v: int) -> list[float]:
    """When each gradient bucket of a stage is complete, the stage's last backward ending at ``t_b``
    (one micro-batch's backward over all its chunks), buckets in backward order.

    Without interleaving the buckets fill in turn during the last micro-batch's backward:
    ``t_b i / K`` for i = 1..K. With v model chunks (interleaved 1F1B) a chunk's gradients are final
    after its own last backward, and in the cool-down chunk j (j = v-1 first ... 0 last) runs its last
    backward ``j p`` chunk-backwards (``t_b / v`` each) before the end, in
    ``[t_b - (j p + 1) t_b / v, t_b - j p t_b / v]``, its K / v buckets filling in turn (Megatron's
    per-chunk gradient buffers)."""
    if v <= 1 or p <= 1:
        return [t_b * (i + 1) / buckets for i in range(buckets)]
    per_chunk = max(1, buckets // v)
    chunk_t = t_b / v
    out = []
    for j in range(v - 1, -1, -1):  # the chunk finished first is the last one of the stage
        start = t_b - (j * p + 1) * chunk_t  # the stage's backward ends at t_b, chunk 0's last
        out += [start + chunk_t * (i + 1) / per_chunk for i in range(per_chunk)]
    return out


def queue_finish(t_b: float, buckets: int, p: int, v: int, c: float) -> float:
    """:func:`serial_finish` of ``buckets`` equal calls of ``c`` seconds at :func:`reduce_ready_times`,
    in closed form: with call i (0-based) ready at r_i, the stream ends at max_i (r_i + (K - i) c);
    r_i is linear within a chunk, so only each chunk's first and last bucket can hold the maximum."""
    if buckets <= 2 * max(1, v):
        return serial_finish(reduce_ready_times(t_b, buckets, p, v), [c] * buckets)
    chunks = v if v > 1 and p > 1 else 1
    per = max(1, buckets // chunks)
    chunk_t = t_b / chunks
    best = 0.0
    for k, j in enumerate(range(chunks - 1, -1, -1)):
        start = t_b - (j * p + 1) * chunk_t if chunks > 1 else 0.0
        for i in (0, per - 1):
            idx = k * per + i
            best = max(best, start + chunk_t * (i + 1) / per + (chunks * per - idx) * c)
    return best


def dp_time(cm: CostBase, lay: Layout, m: int, t_mb: float, t_compute: float) -> float:
    """Exposed data-parallel / ZeRO communication per step, from a bucket-level timeline.

    Without overlap (``Layout.dp_overlap`` off, or a device whose ``comm_overlap`` is 0: gloo on
    the CPU cores that compute) all of it. With it, as Megatron's distributed optimizer with
    ``--overlap-grad-reduce --overlap-param-gather`` and DDP run it (ZeRO 0/1/2): the K buckets'
    reduce (all-reduce, or reduce-scatter) calls, ``c = total_reduce / K`` each, queue on one stream
    as their gradients complete in the last micro-batch's backward ``t_b``
    (:func:`reduce_ready_times`; interleaved chunks finish earlier in the cool-down)::

        exposed_reduce = max(0, serial_finish(ready, c) - t_b)

    and ZeRO 1/2's all-gathers of the updated parameters are issued at the start of the next forward
    ``t_f``, bucket j (g each) needed when the forward reaches it, ``(j - 1) t_f / K``::

        exposed_gather = max_j (j g - (j - 1) t_f / K) = g + (K - 1) max(0, g - t_f / K)

    What runs beside compute slows it: ``(1 - comm_overlap)`` of the hidden part shows (NCCL's
    channels take SMs and HBM bandwidth; 0.8 hidden on GPUs, the profile's measured share on a CPU).
    ZeRO-3 prefetches every unit under all ``m`` micro-batches (window ``m t_mb``; the last call
    always shows)::

        exposed = last + max(0, rest - window) + (1 - comm_overlap) min(rest, window)
    """
    total = cm.memo(dp_comm)(
        lay.dp,
        lay.dp_shard,
        lay.tp,
        lay.pp,
        lay.cp,
        lay.ep,
        lay.zero,
        m,
        lay.world_size,
        lay.split,
        lay.expert_tp,
    )
    if lay.zero == 3 and (lay.qwz or lay.hpz or lay.qgz):
        total = zeropp_time(cm, lay, m)
    share = cm.machine.comm_overlap(lay.world_size)
    if total <= 0 or not lay.dp_overlap or share <= 0:
        return total
    r = cm.bwd_ratio
    t_b, t_f = t_mb * r / (1 + r), t_mb / (1 + r)
    if lay.zero == 3:
        units = max(cm.zero3_units(lay.pp, lay.tp, s, lay.split)[0] for s in (False, True))
        calls = units + (
            m * (2 * units - 1) if lay.pp == 1 else 0
        )  # a pipeline's gathers: zero3_stage_gathers
        return exposed(total, calls, t_compute, share)
    dense, expert = cm._params_on(lay.tp, lay.pp, lay.ep, True, lay.pp == 1, (), lay.expert_tp)
    buckets = cm.buckets((dense + expert) * cm.R, lay.dp * lay.cp)
    gather = (
        total * cm.W / (cm.W + cm.R) if lay.zero else 0.0
    )  # the all-gather's share (Phi W of Phi (R + W))
    reduce = total - gather
    c = reduce / buckets
    v = lay.v if lay.schedule == "interleaved" else 1
    shown = max(0.0, queue_finish(t_b, buckets, lay.pp, v, c) - t_b)
    hidden = reduce - min(reduce, shown)
    if gather > 0:
        g = gather / buckets
        g_shown = g + (buckets - 1) * max(0.0, g - t_f / buckets)
        shown += g_shown
        hidden += gather - min(gather, g_shown)
    return contended(shown, hidden, share)


def sync_time(cm: CostBase, lay: Layout) -> float:
    """Scalar collectives of every step, one call latency each: the logged loss averaged over
    dp, the gradient norm summed over tp, over the ZeRO group and over pp, and the loss
    broadcast over pp."""
    mach, world = cm.machine, lay.world_size
    calls = [
        ("all_reduce", lay.dp * lay.cp, lay.tp * lay.cp * lay.dp),
        ("all_reduce", lay.tp, lay.tp),
        ("all_reduce", lay.pp, world),
        ("all_reduce", lay.pp, world),
    ]
    if lay.zero:
        calls.append(("all_reduce", lay.dp_shard * lay.cp, lay.tp * lay.cp * lay.dp_shard))
    return sum(mach.latency(op, n, span, world, synced=True) for op, n, span in calls)


def dp_comm(
    cm: CostBase,
    dp: int,
    ds: int,
    tp: int,
    pp: int,
    cp: int,
    ep_deg: int,
    zero: int,
    m: int,
    world: int = 0,
    split: tuple[int, ...] = (),
    expert_tp: str = "replicate",
) -> float:
    """Seconds of data-parallel / ZeRO collectives per step, as Loom issues them (with gradient
    accumulation, reductions happen once, after the last micro-batch):

    - ZeRO 0: an all-reduce of Phi R bytes in ceil(Phi R / bucket) bucket calls;
    - ZeRO 1/2: a reduce-scatter of Phi R and an all-gather of Phi W, per bucket (the gather after
      the optimizer, the ranks in step: the profile's back-to-back fit);
    - ZeRO 3 (u units): per micro-batch, all-gathers of Phi W forward (u calls) and of
      (Phi - Phi_kept) W backward (u - 1 calls; u in a pipeline, which keeps no unit gathered);
      a reduce-scatter of Phi R per step (u calls);
    - hybrid sharding: an all-reduce of the shard Phi R / N across the dp / dp_shard replicas, per bucket;
    - a parameter server (K shards): a push and a pull phase, the busiest server's link carrying
      W' Phi 4 / K bytes in each (point-to-point; W' = W workers, W - 1 co-located).
    """
    mach, W, R = cm.machine, cm.W, cm.R
    wd = world or None
    dense, expert = cm._params_on(tp, pp, ep_deg, True, pp == 1, (), expert_tp)
    dense_l, expert_l = cm._params_on(tp, pp, ep_deg, False, True, (), expert_tp)
    total = 0.0
    tpcp = tp * cp
    if cm.train.ps_shards:  # push then pull, each one message per (worker, server): the server's link carries
        # W' Φ b / K per phase (W' = W, or W - 1 when server k lives in worker k), b = 4 (fp32)
        k, through = cm.train.ps_shards, dp - (1 if cm.train.ps_colocate else 0)
        return 2 * mach.collective("p2p", 2, through * dense * 4 / k, tpcp * dp, wd) if through > 0 else 0.0
    for phi, ep, experts in ((max(dense, dense_l), 1, False), (max(expert, expert_l), ep_deg, True)):
        if phi <= 0:
            continue
        buckets = cm.buckets(phi * R, dp * cp)
        if zero == 0:
            n, span = cm.expert_group(dp * cp, ep, tp) if experts else dp * cp, tpcp * dp
            total += grad_all_reduce(cm, n, phi * R, span, wd, buckets)
            continue
        ns = cm.expert_group(ds * cp, ep, tp) if experts else max(1, ds * cp)
        span = tpcp * ds
        lat_rs, lat_ag = (
            mach.latency("reduce_scatter", ns, span, wd),
            mach.latency("all_gather", ns, span, wd),
        )
        rs = mach.collective("reduce_scatter", ns, phi * R, span, wd)
        if zero in (1, 2):  # the gather of the updated shards follows the optimizer, every rank in step
            lat_ag = mach.latency("all_gather", ns, span, wd, synced=True)
            ag = mach.collective("all_gather", ns, phi * W, span, wd, synced=True)
            total += rs + ag + (buckets - 1) * (lat_rs + lat_ag)
        else:  # a pipeline's gathers are in its stage time (zero3_stage_gathers), its busiest end stage's reduces here
            units = max(cm.zero3_units(pp, tp, s, split)[0] for s in (False, True))
            reduces = m if cm.stack.microbatch_reduce else 1
            total += reduces * (rs + (units - 1) * lat_rs)
            if pp == 1:
                total += m * zero3_gathers(cm, phi, ep, ns, span, wd, tp)
        # each bucket's shard all-reduced across the replicas (Loom's reducer, Megatron's and FSDP's
        # hybrid sharding): the bucket calls' latencies, as ZeRO 0's all-reduce pays them
        total += grad_all_reduce(cm, dp // ds, phi * R / ns, tpcp * dp, wd, buckets)
    return total


def zero3_gathers(
    cm: CostBase,
    phi: float,
    ep: int,
    ns: int,
    span: int,
    world: int | None,
    tp: int,
    pp: int = 1,
    last_stage: bool = False,
    split: tuple[int, ...] = (),
) -> float:
    """ZeRO-3 all-gathers of one micro-batch over ``ns`` ranks: forward, the stage's ``u`` units of
    Φ W bytes in all, ``u`` latencies; backward again, but for the kept unit (none in a pipeline)."""
    mach = cm.machine
    units, kept = cm.zero3_units(pp, tp, last_stage, split)
    kept = min(kept, phi) if ep == 1 else 0.0
    lat = mach.latency("all_gather", ns, span, world)
    fwd = mach.collective("all_gather", ns, phi * cm.W, span, world) + (units - 1) * lat
    calls = units - 1 if kept > 0 else units  # backward gathers all but the kept unit
    bwd = mach.collective("all_gather", ns, (phi - kept) * cm.W, span, world) + max(0, calls - 1) * lat
    return fwd + bwd


def zero3_stage_gathers(cm: CostBase, lay: Layout) -> tuple[float, int]:
    """(seconds, calls) of ZeRO-3's all-gathers per micro-batch on the busier end stage of a
    pipeline (:meth:`_zero3_gathers` of its dense and expert parameters); they run inside each
    micro-batch's stage time, so the bubble stretches with them."""
    wd, out = lay.world_size, (0.0, 0)
    ns_dense = max(1, lay.dp_shard * lay.cp)
    for first, last in ((True, False), (False, True)):
        dense, expert = cm._params_on(lay.tp, lay.pp, lay.ep, first, last, lay.split, lay.expert_tp)
        t = 0.0
        for phi, ep, experts in ((dense, 1, False), (expert, lay.ep, True)):
            if phi > 0:
                ns = cm.expert_group(ns_dense, ep, lay.tp) if experts else ns_dense
                t += zero3_gathers(
                    cm, phi, ep, ns, lay.tp * lay.cp * lay.dp_shard, wd, lay.tp, lay.pp, last, lay.split
                )
        calls = 2 * cm.zero3_units(lay.pp, lay.tp, last, lay.split)[0]
        out = max(out, (t, calls))
    return out


def grad_all_reduce(cm: CostBase, n: int, size: float, span: int, world: int | None, calls: int = 1) -> float:
    """Seconds of the gradient all-reduce of ``size`` bytes over ``n`` ranks in ``calls`` bucket
    calls, by ``Workload.allreduce``: the backend's (``native``: the machine's ring, or the profile's
    fit), else the algorithm's α-β time (:mod:`loom.plan.collectives`: rounds·α + volume·β, the
    link's latency and bandwidth), every further call paying its rounds' α again."""
    mach, algorithm = cm.machine, cm.train.allreduce
    if n <= 1 or size <= 0:
        return 0.0
    if algorithm == "native":
        return mach.collective("all_reduce", n, size, span, world) + (calls - 1) * mach.latency(
            "all_reduce", n, span, world
        )
    if algorithm == "butterfly" and n & (n - 1):  # refused by the rules; timed as a ring meanwhile
        algorithm = "ring"
    alpha, beta = mach.alpha_beta(n, span)
    return (
        collectives.time(algorithm, size, n, alpha, beta)
        + (calls - 1) * collectives.rounds(algorithm, n) * alpha
    )
