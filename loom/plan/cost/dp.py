"""Data-parallel and ZeRO communication per step (all-reduce, reduce-scatter + all-gather, ZeRO-3's
gathers, hybrid sharding, parameter servers), its overlap with compute, and the step's scalar
synchronisation (formulas: :mod:`loom.plan.cost`)."""

from __future__ import annotations

from loom.plan import collectives
from loom.plan.cost.base import CostBase
from loom.plan.cost.layout import Layout
from loom.plan.zero_options import zeropp_time


def exposed(total: float, calls: int, window: float, share: float) -> float:
    """Seconds of ``total`` communication in ``calls`` calls left showing beside ``window`` seconds of
    compute when a ``share`` of overlapped traffic is truly hidden: the last call always (nothing
    left to hide it behind), what does not fit the window, and the unhidden part of what does::

        last + max(0, rest - window) + (1 - share) min(rest, window),  last = total / calls, rest = total - last
    """
    if total <= 0 or share <= 0 or calls <= 0:
        return max(0.0, total)
    last = total / calls
    rest = total - last
    return last + max(0.0, rest - window) + (1 - share) * min(rest, window)


def dp_time(cm: CostBase, lay: Layout, m: int, t_mb: float, t_compute: float) -> float:
    """Exposed data-parallel / ZeRO communication per step, of ``total`` seconds in ``calls`` calls.

    Without overlap (``Layout.dp_overlap`` off, or a device whose ``comm_overlap`` is 0: gloo on
    the CPU cores that compute) all of it. With it, bucket by bucket: ZeRO 0 reduces each bucket
    while the last micro-batch's backward ``t_b`` goes on, ZeRO 1/2 also gather the updated
    parameters under the next forward ``t_f``, ZeRO-3 prefetches every unit under all ``m``
    micro-batches; what does not fit the window shows, and at least the last call (nothing
    left to hide it behind)::

        exposed = last + max(0, rest - window) + (1 - comm_overlap) min(rest, window)
        (last = total / calls, rest = total - last)

    window = t_b | t_b + t_f | m t_mb; the last term: collectives running beside compute slow it
    (NCCL's channels take SMs and HBM bandwidth), the device's ``comm_overlap`` share (0.8) hidden;
    on a CPU the profile's measured share (gloo's thread waits beside the compute, but its copies
    and reductions take the same cores).
    """
    total = cm.memo(dp_comm)(
        lay.dp, lay.dp_shard, lay.tp, lay.pp, lay.cp, lay.ep, lay.zero, m, lay.world_size, lay.split
    )
    if lay.zero == 3 and (lay.qwz or lay.hpz or lay.qgz):
        total = zeropp_time(cm, lay, m)
    share = cm.machine.comm_overlap(lay.world_size)
    if total <= 0 or not lay.dp_overlap or share <= 0:
        return total
    r = cm.bwd_ratio
    t_b, t_f = t_mb * r / (1 + r), t_mb / (1 + r)
    window = {0: t_b, 1: t_b + t_f, 2: t_b + t_f}.get(lay.zero, t_compute)
    if lay.zero == 3:
        units = max(cm.zero3_units(lay.pp, lay.tp, s, lay.split)[0] for s in (False, True))
        calls = units + (
            m * (2 * units - 1) if lay.pp == 1 else 0
        )  # a pipeline's gathers: zero3_stage_gathers
    else:
        dense, expert = cm._params_on(lay.tp, lay.pp, lay.ep, True, lay.pp == 1)
        calls = max(1, -(-int((dense + expert) * cm.R) // int(cm.train.bucket_bytes))) * (
            2 if lay.zero else 1
        )
    return exposed(total, calls, window, share)


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
) -> float:
    """Seconds of data-parallel / ZeRO collectives per step, as Loom issues them (with gradient
    accumulation, reductions happen once, after the last micro-batch):

    - ZeRO 0: an all-reduce of Phi R bytes in ceil(Phi R / bucket) bucket calls;
    - ZeRO 1/2: a reduce-scatter of Phi R and an all-gather of Phi W, per bucket (the gather after
      the optimizer, the ranks in step: the profile's back-to-back fit);
    - ZeRO 3 (u units): per micro-batch, all-gathers of Phi W forward (u calls) and of
      (Phi - Phi_kept) W backward (u - 1 calls; u in a pipeline, which keeps no unit gathered);
      a reduce-scatter of Phi R per step (u calls);
    - hybrid sharding: an all-reduce of the shard Phi R / N across the dp / dp_shard replicas;
    - a parameter server (K shards): a push and a pull phase, the busiest server's link carrying
      W' Phi 4 / K bytes in each (point-to-point; W' = W workers, W - 1 co-located).
    """
    mach, W, R = cm.machine, cm.W, cm.R
    wd = world or None
    dense, expert = cm._params_on(tp, pp, ep_deg, True, pp == 1)
    dense_l, expert_l = cm._params_on(tp, pp, ep_deg, False, True)
    total = 0.0
    tpcp = tp * cp
    if cm.train.ps_shards:  # push then pull, each one message per (worker, server): the server's link carries
        # W' Φ b / K per phase (W' = W, or W - 1 when server k lives in worker k), b = 4 (fp32)
        k, through = cm.train.ps_shards, dp - (1 if cm.train.ps_colocate else 0)
        return 2 * mach.collective("p2p", 2, through * dense * 4 / k, tpcp * dp, wd) if through > 0 else 0.0
    for phi, ep in ((max(dense, dense_l), 1), (max(expert, expert_l), ep_deg)):
        if phi <= 0:
            continue
        buckets = max(1, -(-int(phi * R) // int(cm.train.bucket_bytes)))
        if zero == 0:
            n, span = dp * cp // ep, tpcp * dp
            total += grad_all_reduce(cm, n, phi * R, span, wd, buckets)
            continue
        ns = max(1, ds * cp // ep)
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
        total += grad_all_reduce(cm, dp // ds, phi * R / ns, tpcp * dp, wd)
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
        dense, expert = cm._params_on(lay.tp, lay.pp, lay.ep, first, last, lay.split)
        t = 0.0
        for phi, ep in ((dense, 1), (expert, lay.ep)):
            if phi > 0:
                ns = max(1, ns_dense // ep)
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
