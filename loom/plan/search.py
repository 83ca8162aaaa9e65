"""Layout search: enumerate the valid layouts of a world size, keep those that fit, rank by step time.

Enumeration, outermost first: tp (:func:`~loom.plan.cost.tp_reason`: divides n_heads, ffn_dim,
vocab and the node; divides n_kv_heads or is a multiple of it), pp (at most n_layers; an uneven split puts the spare blocks on middle stages, and an even one is
also tried with lighter first and last stages, :func:`lighter_ends`), cp (seq_len divisible by 2 cp) with each of its modes
(``allgather``, ``ring``, ``alltoall`` when the query heads per tp rank divide by cp), dp = world / (tp pp cp) (divides the
global batch), ep (MoE only), the experts under tp (MoE with tp > 1: whole on every tp rank or split
over it, ``expert_tp``), ZeRO stage with its sharding group, micro-batch, schedule with
its virtual stages, recomputation, offload. ``sp`` is always on when tp > 1.

Explicit values (``fixed``, what ``parallel.auto`` keeps of the config): only layouts with them are
enumerated, and no pruning rule drops them (an explicit micro-batch, recomputation, offload or
schedule the search would call dominated is evaluated as given).

Validity: a layout ``loom train`` refuses (:func:`loom.rules.layout_problems`, the rules
``config.validate`` applies) is never ranked; it is counted in ``rejected`` under the rule's message.

Pruning (each rule only drops layouts the cost model can prove no better; counted in
``SearchResult.rejected``):

- sp dominates no-sp: same communication volume, less memory and elementwise time.
- ZeRO sharding group: the whole dp group, or the part of it inside one node (hybrid
  sharding); other group sizes only trade between these two.
- model states that alone exceed memory skip every activation choice under them.
- memory never decreases with the micro-batch (activations scale with b min(m, p), logits
  with b), so micro-batches stop growing at the first that does not fit.
- recomputation only adds time: the cheapest policy (none, selective, full) that fits is kept.
- offload only adds time: it is tried only where the same layout without it does not fit.
- context-parallel modes (a heuristic, not a proof): each layout is searched in one mode, the one
  whose estimate at micro-batch 1 without recomputation is fastest among those that fit (the
  smallest if none fits); the others are counted.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loom.config import ModelConfig
from loom.plan.cost import RECOMPUTE, CostModel, Estimate, Layout, PlanError, Workload, tp_reason
from loom.plan.hardware import ClusterSpec, Profile
from loom.rules import (
    CP_MODES,
    EXPERT_TP_MODES,
    ScheduleName,
    context_mode_problem,
    context_parallel_problem,
    sequence_parallel_problem,
)


class Drops(Counter):
    """Layouts dropped, by reason, with the first one dropped for each (``examples``): the loops
    set ``current`` to the layout (or degrees) at hand before counting."""

    def __init__(self) -> None:
        super().__init__()
        self.current = ""
        self.examples: dict[str, str] = {}

    def __setitem__(self, why: str, n: int) -> None:
        if n > 0 and why not in self.examples:
            self.examples[why] = self.current
        super().__setitem__(why, n)


@dataclass
class SearchResult:
    """Ranked layouts that fit, and why the others were dropped."""

    world: int
    ranked: list[Estimate]  # fitting layouts, fastest first
    rejected: Counter = field(default_factory=Counter)  # reason -> candidates dropped for it
    examples: dict[str, str] = field(default_factory=dict)  # reason -> one layout dropped for it
    considered: int = 0  # layouts whose memory was evaluated
    elapsed_s: float = 0.0
    closest: Estimate | None = None  # least memory of all evaluated layouts (useful when none fit)

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _schedules(pp: int, layers: int, m_of_mb: int) -> list[tuple[ScheduleName, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out: list[tuple[ScheduleName, int]] = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1)]
    if m_of_mb % pp == 0:
        out += [("interleaved", v) for v in divisors(layers // pp) if v > 1]
    return out


def search(
    model: ModelConfig,
    train: Workload,
    cluster: ClusterSpec,
    world: int | None = None,
    *,
    profile: Profile | None = None,
    n_experts: int | None = None,
    top_k: int | None = None,
    fixed: Mapping[str, Any] | None = None,
) -> SearchResult:
    """Every valid, fitting layout of ``world`` devices (default: the whole cluster), fastest first;
    ``fixed`` (:class:`Layout` field -> value) keeps only layouts with those values (:func:`_keep`, :func:`_only`)."""
    fixed = dict(fixed or {})
    start = time.perf_counter()
    W = world or cluster.world_size
    if not 1 <= W <= cluster.world_size:
        raise PlanError(
            f"world: {W} devices requested, the cluster {cluster.name!r} has {cluster.world_size}"
        )
    cm = CostModel(model, train, cluster, profile, n_experts, top_k)
    cap = cluster.device.memory_bytes
    per_node = cluster.devices_per_node
    gb, seq, L = train.global_batch, train.seq_len, model.n_layers
    rejected = Drops()
    ranked: list[Estimate] = []
    considered = 0
    closest: tuple[float, Layout, dict, str] | None = None

    for tp in _keep(fixed, "tp", divisors(W)):
        rejected.current = f"tp{tp}"
        why = tp_reason(cm.facts, tp, per_node, "replicate")  # split experts: checked per layout
        if why:
            rejected[why] += 1
            continue
        for pp in _keep(fixed, "pp", divisors(W // tp)):
            rejected.current = f"tp{tp} pp{pp}"
            if pp > L:
                rejected["pp exceeds n_layers (a stage needs a block)"] += 1
                continue
            for cp in _keep(fixed, "cp", divisors(W // (tp * pp))):
                rejected.current = f"tp{tp} pp{pp} cp{cp}"
                why = context_parallel_problem(cp, seq) or sequence_parallel_problem(tp, cp, seq)
                if why:
                    rejected[why] += 1
                    continue
                dp = W // (tp * pp * cp)
                if not _keep(fixed, "dp", [dp]):
                    continue
                rejected.current = f"dp{dp} tp{tp} pp{pp} cp{cp}"
                if gb % dp:
                    rejected["dp must divide global_batch (more replicas than the batch feeds)"] += 1
                    continue
                eps = [e for e in divisors(dp * cp) if cm.n_experts % e == 0] if cm.moe else [1]
                eps = _keep(fixed, "ep", eps)
                node_shard = max(1, per_node // (tp * cp))
                shards = sorted({dp, node_shard, *_only(fixed, "dp_shard", [])} & set(divisors(dp)))
                zeros = [(0, 1)] + [(z, ds) for z in (1, 2, 3) for ds in shards if ds * cp > 1]
                zeros = [
                    zd for zd in zeros if _keep(fixed, "zero", [zd[0]]) and _keep(fixed, "dp_shard", [zd[1]])
                ]
                rejected["dominated: dp_shard other than full or node-local"] += 3 * sum(
                    1 for d in divisors(dp) if d * cp > 1 and d not in shards
                )
                mbs = _only(fixed, "micro_batch", divisors(gb // dp))
                modes = (
                    [m for m in CP_MODES if context_mode_problem(cm.facts, cp, m, tp) is None]
                    if cp > 1
                    else ["allgather"]
                )
                rejected["cp_mode alltoall: query heads per tp rank not divisible by cp"] += (
                    len(CP_MODES) - len(modes) if cp > 1 and "cp_mode" not in fixed else 0
                )
                modes = _only(fixed, "cp_mode", modes)
                sp = _only(fixed, "sp", [tp > 1])[0]
                etps = _only(fixed, "expert_tp", EXPERT_TP_MODES if cm.moe and tp > 1 else ["replicate"])
                for ep, etp, (zero, ds) in itertools.product(eps, etps, zeros):
                    base = Layout(
                        dp=dp, dp_shard=ds, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, sp=sp, expert_tp=etp
                    )
                    base = dataclasses.replace(base, cp_mode=modes[0])
                    if len(modes) > 1:
                        base = _pick_cp_mode(cm, base, modes)
                        rejected["cp_mode: another mode of the layout is faster (micro-batch 1)"] += (
                            len(modes) - 1
                        )
                    splits = [()] + [
                        sp_ for sp_ in [lighter_ends(L, pp)] if sp_
                    ]  # even, and lighter first/last
                    for split in splits:
                        n, c = _search_block(
                            cm,
                            cap,
                            L,
                            gb,
                            ranked,
                            rejected,
                            dataclasses.replace(base, split=split),
                            mbs,
                            fixed,
                        )
                        considered += n
                        if c is not None and (closest is None or c[0] < closest[0]):
                            closest = c
    ranked.sort(key=lambda e: (e.step_time, e.memory))
    kept = +rejected  # + drops zeros
    result = SearchResult(
        world=W,
        ranked=ranked,
        rejected=kept,
        examples={k: v for k, v in rejected.examples.items() if k in kept},
        considered=considered,
    )
    if closest is not None:
        mem, lay, bd, stage = closest
        result.closest = cm.timed(lay, mem, bd, stage)
    result.elapsed_s = time.perf_counter() - start
    return result


def _search_block(
    cm: CostModel,
    cap: float,
    L: int,
    gb: int,
    ranked: list[Estimate],
    rejected: Drops,
    base: Layout,
    mbs: list[int],
    fixed: Mapping[str, Any],
) -> tuple[int, tuple[float, Layout, dict, str] | None]:
    """Micro-batch x schedule x recompute x offload under one (degrees, ZeRO) choice."""
    considered = 0
    closest = None
    fits_without_offload = False
    for offload in _only(fixed, "offload", [False, True]):
        rejected.current = _with(base, offload=offload).spec()
        if offload and fits_without_offload:
            rejected["dominated: offload where it fits without"] += 1
            continue
        why = _refused(
            cm, _with(base, offload=offload), fixed
        )  # degrees, ZeRO and offload as loom train sees them
        if why:
            rejected[why] += 1
            continue
        if cm.peak_states(_with(base, offload=offload)) > cap:
            rejected["model states alone exceed device memory"] += 1
            lay = _with(base, offload=offload, recompute="full", micro_batch=mbs[0])
            if cm.check(lay) is None:
                mem, bd, stage = cm.memory(lay)
                closest = _closer(closest, (mem, lay, bd, stage))
            continue
        for sched, v in _schedule_choices(fixed, base.pp, L, gb // (base.dp * mbs[0])):
            for mb in mbs:
                rejected.current = _with(base, schedule=sched, v=v, micro_batch=mb, offload=offload).spec()
                why = _refused(cm, _with(base, schedule=sched, v=v, micro_batch=mb, offload=offload), fixed)
                if why:
                    rejected[why] += 1
                    continue
                fitted = False
                for rec in _only(fixed, "recompute", RECOMPUTE):
                    lay = _with(base, schedule=sched, v=v, micro_batch=mb, recompute=rec, offload=offload)
                    considered += 1
                    mem, bd, stage = cm.memory(lay)
                    if mem <= cap:
                        ranked.append(cm.timed(lay, mem, bd, stage))
                        fitted = True
                        fits_without_offload |= not offload
                        rejected["dominated: more recomputation than needed to fit"] += (
                            0 if "recompute" in fixed else 2 - RECOMPUTE.index(rec)
                        )
                        break
                    closest = _closer(closest, (mem, lay, bd, stage))
                if not fitted:
                    rejected["activations exceed device memory"] += 1
                    rejected["does not fit: larger micro-batches skipped"] += len(mbs) - 1 - mbs.index(mb)
                    break
    return considered, closest


def _keep(fixed: Mapping[str, Any], name: str, choices: list) -> list:
    """``choices`` narrowed to the explicit value of ``name`` (a degree the world size must allow)."""
    return [c for c in choices if name not in fixed or c == fixed[name]]


def _only(fixed: Mapping[str, Any], name: str, choices: list | tuple) -> list:
    """``choices``, or only the explicit value of ``name``, tried even where the search would not
    (a dominated or unenumerated value: the rules and the memory judge it)."""
    return [fixed[name]] if name in fixed else list(choices)


def _schedule_choices(fixed: Mapping[str, Any], pp: int, layers: int, m: int) -> list[tuple[Any, int]]:
    """The (schedule, virtual stages) pairs to try, narrowed to explicit ones; an explicit pair the
    search does not enumerate is tried as given."""
    out = [
        (s, v)
        for s, v in _schedules(pp, layers, m)
        if fixed.get("schedule", s) == s and fixed.get("v", v) == v
    ]
    if out or ("schedule" not in fixed and "v" not in fixed):
        return out
    v = int(fixed.get("v", 1))
    return [(fixed.get("schedule", "interleaved" if v > 1 else "1f1b"), v)]


def _refused(cm: CostModel, lay: Layout, fixed: Mapping[str, Any]) -> str | None:
    """Why ``loom train`` refuses ``lay`` or (with explicit values, which may be unmodelled) the
    formulas cannot price it."""
    return cm.refused(lay) or (cm.check(lay) if fixed else None)


def _with(
    b: Layout,
    schedule: ScheduleName = "1f1b",
    v: int = 1,
    micro_batch: int = 1,
    recompute: str = "none",
    offload: bool = False,
) -> Layout:
    """``base`` with the inner choices set (every other field, ZeRO++ and overlap options included, kept)."""
    return dataclasses.replace(
        b, schedule=schedule, v=v, micro_batch=micro_batch, recompute=recompute, offload=offload
    )


def lighter_ends(n_layers: int, pp: int) -> tuple[int, ...]:
    """An even split with one block moved off the first and the last stage (which also hold the
    embedding and the head) onto middle ones: 32 on 4 -> 7, 9, 9, 7; () where it cannot apply."""
    q, rem = divmod(n_layers, pp)
    if pp < 3 or rem or q < 2:
        return ()
    split = [q - 1] + [q] * (pp - 2) + [q - 1]
    split[1] += 1
    split[-2] += 1
    return tuple(split)


def _pick_cp_mode(cm: CostModel, base: Layout, modes: list[str]) -> Layout:
    """``base`` with the context-parallel mode of its micro-batch-1 estimate without recomputation
    (module doc): the fastest mode that fits, else the smallest."""
    estimates = []
    for mode in modes:
        lay = dataclasses.replace(base, cp_mode=mode)
        if cm.check(lay) is None:
            e = cm.estimate(lay)
            estimates.append((not e.fits, e.step_time if e.fits else e.memory, mode))
    return dataclasses.replace(base, cp_mode=min(estimates)[2]) if estimates else base


def _closer(a, b):
    return b if a is None or b[0] < a[0] else a
