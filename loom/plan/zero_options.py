"""The planner's model of ZeRO-3's options: ZeRO-Infinity parameter offload
(:mod:`loom.parallel.zero.param_offload`) and ZeRO++ (:mod:`loom.parallel.zero.zeropp`).

Bytes moved per rank per step (:func:`zero3_bytes`; units of Φ_u' padded elements of b bytes, N
ranks sharding, k micro-batches, the last unit kept gathered from forward to backward, G ranks per
hpZ group, q(x) = N·ceil(x/(N·B))·(B + 4) with B = 256)::

    all_gather        k·Σ_u g(Φ_u')·(N-1)/N  [+ k·Σ_re g(Φ_u')·(N-1)/N without hpZ]   g = q with qwZ, else b·x
    all_gather_hpz    k·Σ_re b·Φ_u'·(G-1)/G                                               (hpZ, inside a node)
    reduce_scatter    Σ_u b·Φ_u'·(N-1)/N      or   all_to_all  Σ_u q(Φ_u')·(N-1)/N          (qgZ; int4: B/2 + 4
                                                                                       bytes per block)

Device memory (:func:`zero3_memory`): with parameter offload the weights, the gradient shards and
the optimizer state leave the device (the full gradients kept across micro-batches do not), and
its staging buffers come in: at most 2 shards of the largest unit, 2·b·max_u Φ_u'/N (one gathering,
one read ahead); hpZ adds the secondary partition, b·Φ_re/G (the units resharded after forward).
"""

from __future__ import annotations

from typing import Any

from loom.parallel.zero.quantized import BLOCK, SCALE_BYTES


def quantized(numel: float, n: int, bits: int = 8) -> float:
    """q(x): bytes of a unit of ``numel`` elements sharded over ``n`` ranks, as ``bits``-bit blocks + scales."""
    return n * -(-int(numel // n) // BLOCK) * (BLOCK * bits // 8 + SCALE_BYTES)


def zero3_bytes(
    units: list[int],
    n: int,
    b: int,
    k: int = 1,
    qwz: bool = False,
    hpz_group: int = 0,
    qgz: bool = False,
    qgz_bits: int = 8,
    qgz_node: int = 0,
) -> dict[str, float]:
    """Bytes per collective kind one rank sends per step (module formula); ``units`` in forward
    order, the last one kept gathered for backward. ``qgz_node`` = G < n: qgZ in two hops, q(Φ_u')·(G-1)/G
    inside the node (``all_to_all_hpz``) and q(Φ_u')/G·(M-1)/M across (M = n/G,
    :mod:`loom.parallel.zero.quantized`)."""
    frac, resharded = (n - 1) / n, units[:-1]
    gather = (lambda x: quantized(x, n)) if qwz else (lambda x: b * x)
    out = {"all_gather": k * frac * sum(gather(u) for u in units)}
    if hpz_group:
        out["all_gather_hpz"] = k * b * sum(resharded) * (hpz_group - 1) / hpz_group
    else:
        out["all_gather"] += k * frac * sum(gather(u) for u in resharded)
    if qgz and 0 < qgz_node < n:
        g, m = qgz_node, n // qgz_node
        q = sum(quantized(u, n, qgz_bits) for u in units)
        out["all_to_all_hpz"] = q * (g - 1) / g  # inside the node (metered apart, as hpZ's gathers)
        out["all_to_all"] = q / g * (m - 1) / m
    elif qgz:
        out["all_to_all"] = frac * sum(quantized(u, n, qgz_bits) for u in units)
    else:
        out["reduce_scatter"] = frac * b * sum(units)
    return {key: v for key, v in out.items() if v}


def zero3_options(p: Any) -> dict[str, Any]:
    """The :class:`~loom.plan.cost.Layout` fields of a ``[parallel]`` section's ZeRO-3 options."""
    if getattr(p, "zero", 0) != 3:
        return {}
    from loom.parallel.zero.options import hpz_size

    return dict(
        offload_params=getattr(p, "offload_params", "none") != "none",
        qwz=bool(getattr(p, "zeropp_qwz", False)),
        hpz=hpz_size(p) if getattr(p, "zeropp_hpz", False) else 0,
        qgz=int(getattr(p, "zeropp_qgz_bits", 8)) if getattr(p, "zeropp_qgz", False) else 0,
    )


def zero3_memory(cm: Any, lay: Any, bd: dict[str, float], first: bool, last: bool) -> dict[str, float]:
    """``bd`` (a stage's bytes by kind, :meth:`CostModel.stage_memory`) with parameter offload and hpZ."""
    if getattr(lay, "offload_params", False):
        bd["weights"] = bd["gradients"] = bd["optimizer"] = bd["optimizer step"] = (
            0.0  # the step runs on the host
        )
        largest = max(
            u for u, _, _ in cm.zero3_unit_sizes(lay.tp, lay.pp, lay.ep, first, last, lay.expert_tp)
        )
        bd["zero3 buffer"] += (
            2 * cm.W * largest / max(1, lay.dp_shard * lay.cp)
        )  # staging: one gathering, one read ahead
    if getattr(lay, "hpz", 0):
        dense, _ = cm._params_on(lay.tp, lay.pp, lay.ep, first, last, (), lay.expert_tp)
        kept = cm.zero3_units(lay.pp, lay.tp)[1] if last else 0.0  # the unit kept gathered: no secondary
        bd["zero3 buffer"] += cm.W * (dense - kept) / lay.hpz
    return bd


def zeropp_time(cm: Any, lay: Any, m: int) -> float:
    """Seconds of ZeRO-3's collectives per step under the ZeRO++ options (dense parameters, one
    stage): qwZ gathers (B + 4)/B bytes per element; hpZ's backward gathers span a node group of
    ``lay.hpz`` ranks; qgZ's gradient all-to-all moves the quantized full gradient (across nodes in
    two hops: all of it inside the node, 1/G of it between nodes); plus the replicas' all-reduce of the
    shard (hybrid sharding)."""
    mach, W, R, wd = cm.machine, cm.W, cm.R, lay.world_size
    dense, _ = cm._params_on(lay.tp, lay.pp, lay.ep, True, lay.pp == 1, (), lay.expert_tp)
    ns, span = max(1, lay.dp_shard * lay.cp), lay.tp * lay.cp * lay.dp_shard
    units, kept = cm.zero3_units(lay.pp, lay.tp)
    q = (BLOCK + SCALE_BYTES) / BLOCK
    w = q if lay.qwz else W
    lat = mach.latency("all_gather", ns, span, wd)
    fwd = mach.collective("all_gather", ns, dense * w, span, wd) + (units - 1) * lat
    if lay.hpz:
        bwd = mach.collective("all_gather", lay.hpz, (dense - kept) * W, lay.tp * lay.hpz, wd)
    else:
        bwd = mach.collective("all_gather", ns, (dense - kept) * w, span, wd)
    bwd += (units - 2) * lat
    qg = (BLOCK * lay.qgz / 8 + SCALE_BYTES) / BLOCK  # bytes per gradient element, quantized
    node = max(1, cm.cluster.devices_per_node // lay.tp)  # the sharding group's ranks on one node
    if lay.qgz and node < ns and ns % node == 0:  # two hops: inside the node, then 1/G of it across
        grads = mach.collective("all_to_all", node, dense * qg, lay.tp * node, wd)
        grads += mach.collective("all_to_all", ns // node, dense * qg / node, span, wd)
    else:
        grads = mach.collective(
            "all_to_all" if lay.qgz else "reduce_scatter", ns, dense * (qg if lay.qgz else R), span, wd
        )
    rep = lay.dp // max(1, lay.dp_shard)
    replicas = (
        mach.collective("all_reduce", rep, dense * R / ns, lay.tp * lay.cp * lay.dp, wd) if rep > 1 else 0.0
    )
    return m * (fwd + bwd) + grads + (units - 1) * mach.latency("reduce_scatter", ns, span, wd) + replicas
