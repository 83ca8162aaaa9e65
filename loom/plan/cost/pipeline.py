"""Pipeline shapes: blocks per stage, the bubble of each schedule, the layers a stage holds in flight."""

from __future__ import annotations

from loom.plan.cost.layout import SCHEDULES, PlanError


def default_split(n_layers: int, pp: int) -> tuple[int, ...]:
    """Blocks per stage when none are given: ``L = q pp + r``, the r spare blocks on middle stages
    first, then the last, then the first (those two also hold the embedding and the head):
    70 on 12 -> 5, 6 x 10, 5 (BLOOM's split); 30 on 4 -> 7, 8, 8, 7."""
    q, rem = divmod(n_layers, pp)
    counts = [q] * pp
    order = list(range(1, pp - 1)) + [pp - 1, 0]
    for i in order[:rem]:
        counts[i] += 1
    return tuple(counts)


def split_layout(counts: tuple[int, ...], v: int = 1) -> str:
    """``parallel.pp_layout`` of per-device block counts over p·v chunks (chunk j·p + d on device d):
    device d's c_d blocks cut into v chunks of ⌊c_d / v⌋ or one more, the spare ones on its later
    chunks (the last device's on its earlier ones: its last chunk holds the head). (1, 3) -> "0-0,1-3";
    (3, 4) with v = 2 -> chunks 1, 2 | 2, 2: "0-0,1-2,3-4,5-6"."""
    if any(c < v for c in counts):
        raise ValueError(f"blocks per device {counts}: each device needs at least v = {v} (one per chunk)")
    shares = []
    for d, c in enumerate(counts):
        q, r = divmod(c, v)
        share = [q + (j >= v - r) for j in range(v)]
        shares.append(share[::-1] if d == len(counts) - 1 else share)
    bounds, lo = [], 0
    for j in range(v):
        for share in shares:
            bounds.append(f"{lo}-{lo + share[j] - 1}")
            lo += share[j]
    return ",".join(bounds)


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1, w_share: float = 1 / 3) -> float:
    """Share of the step a device idles in the pipeline bubble.

    GPipe/1F1B (p-1)/(m+p-1); interleaved ((p-1)/v)/(m + (p-1)/v); ZB-H1 (p-1)(1-2w)/(m + (p-1)(1-2w))
    with w = t_W / t_mb the weight-gradient share of a micro-batch (1/3 when F = B = W).
    """
    if p <= 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        idle = p - 1.0
    elif schedule == "interleaved":
        idle = (p - 1.0) / v
    elif schedule == "zb-h1":
        idle = (p - 1.0) * (1.0 - 2.0 * w_share)
    else:
        raise PlanError(f"schedule: must be one of {SCHEDULES}, got {schedule!r}")
    return idle / (m + idle)


def inflight_layers(
    schedule: str, p: int, stage: int, m: int, v: int, n_layers: int, ep_overlap: bool = False
) -> float:
    """Layer activations (micro-batches x layers) stage ``stage`` holds at its peak (module doc).
    ``ep_overlap`` (Megatron-Core's ``--overlap-moe-expert-parallel-comm``) runs one more warm-up
    forward before the interleaved schedule's steady state, each of whose steps then runs a chunk's
    forward beside another's backward: one more chunk in flight, 2(p-i-1) + (v-1)p + 2 (its
    ``get_pp_rank_microbatches``); without a pipeline the combined schedule's forward of micro-batch
    i+1 runs layer by layer beside micro-batch i's backward, which frees a layer per layer formed:
    no more than L."""
    per_stage = n_layers / p
    if schedule == "gpipe":
        return m * per_stage
    if schedule == "interleaved" and v > 1:
        chunks = min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1 + int(ep_overlap))
        return chunks * per_stage / v
    if schedule == "zb-h1":  # deferred weight-gradient passes keep p micro-batches alive on every stage
        return min(m, p) * per_stage
    return min(m, p - stage) * per_stage
