"""Text for people: the ranked layout table, one estimate's breakdown, and the pre-launch fit check."""

from __future__ import annotations

import copy

from loom.config import (
    ConfigError,
    LoomConfig,
    ModelConfig,
    lora_targets,
    ps_servers,
    resolve_layout,
    world_size_of,
)
from loom.plan.cost import CostModel, Estimate, Layout, PlanError, Workload
from loom.plan.hardware import ClusterSpec, GiB, Profile
from loom.plan.search import SearchResult, search
from loom.plan.zero_options import zero3_options

COLUMNS = (
    "#",
    "dp",
    "tp",
    "pp",
    "cp",
    "ep",
    "zero",
    "sp",
    "schedule",
    "mb",
    "recompute",
    "offload",
    "mem GiB",
    "step s",
    "tok/s",
    "TFLOP/s",
    "MFU",
    "bound by",
)


def _row(i: int, e: Estimate) -> list[str]:
    lay = e.layout
    # as the layout line writes it (Layout.spec): zero S/G shards stage S over G of the dp ranks (and
    # the cp ranks beside them); G is left out where it is all of dp
    zero = str(lay.zero) + (f"/{lay.dp_shard}" if lay.zero and lay.dp_shard != lay.dp else "")
    sched = "-" if lay.pp == 1 else lay.schedule + (f"(v{lay.v})" if lay.v > 1 else "")
    return [
        str(i),
        str(lay.dp),
        str(lay.tp),
        str(lay.pp),
        str(lay.cp) + (f" {lay.cp_mode}" if lay.cp > 1 else ""),  # allgather | ring | alltoall
        str(lay.ep) + " etp" * (lay.expert_tp == "split"),  # experts split over tp
        zero,
        "y" if lay.sp else "-",
        sched,
        str(lay.micro_batch),
        lay.recompute,
        "y" if lay.offload else "-",
        f"{e.memory / GiB:.1f}",
        f"{e.step_time:.3g}",
        f"{e.tokens_per_s:,.0f}",
        f"{e.tflops_per_device:.4g}",
        f"{100 * e.mfu:.1f}%",
        e.dominant,
    ]


def format_table(estimates: list[Estimate], top: int = 10) -> str:
    """The ``top`` estimates as an aligned text table (``zero 3/8``: stage 3 sharded over 8 of dp, as
    ``Layout.spec`` writes it)."""
    rows = [list(COLUMNS)] + [_row(i + 1, e) for i, e in enumerate(estimates[:top])]
    widths = [max(len(r[c]) for r in rows) for c in range(len(COLUMNS))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_search(result: SearchResult, top: int = 10) -> str:
    """Table of the best layouts, the rejection counts, and (if nothing fits) the closest miss."""
    out = []
    if result.ranked:
        cap = result.ranked[0].capacity / GiB
        out.append(
            f"{len(result.ranked)} layouts fit {result.world} devices of {cap:.0f} GiB "
            f"({result.considered} evaluated in {result.elapsed_s:.2f} s); best {min(top, len(result.ranked))}:"
        )
        out.append(format_table(result.ranked, top))
        out.append("as --layout for `loom plan verify`:")
        out += [f"  {i + 1:>2}  {e.layout.spec()}" for i, e in enumerate(result.ranked[:top])]
    else:
        out.append(explain_no_fit(result))
    if result.rejected:
        out.append(format_dropped(result))
    return "\n".join(out)


def format_dropped(result: SearchResult, top: int = 5, width: int = 72) -> str:
    """The dropped layouts as a short table: the ``top`` reasons by count, each with one layout
    dropped for it, and one line for the rest."""
    reasons = result.rejected.most_common()
    total = sum(n for _, n in reasons)
    rows = [
        (f"{n:,}", why if len(why) <= width else why[: width - 3] + "...", result.examples.get(why, ""))
        for why, n in reasons[:top]
    ]
    wc, wr = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    lines = [f"dropped {total:,} candidate layouts; top reasons:"]
    lines += [f"  {c:>{wc}}  {r:<{wr}}  e.g. {e}".rstrip().removesuffix(" e.g.") for c, r, e in rows]
    rest = reasons[top:]
    if rest:
        lines.append(
            f"  {sum(n for _, n in rest):,} more for {len(rest)} other reason{'s' * (len(rest) > 1)} (--json lists all)"
        )
    return "\n".join(lines)


def explain_no_fit(result: SearchResult) -> str:
    """Why nothing fits: the closest layout, its shortfall and its largest memory terms."""
    head = f"no layout fits on {result.world} device(s)"
    c = result.closest
    if c is None:
        reasons = ", ".join(why for why, _ in result.rejected.most_common(3)) or "no valid layout"
        return f"{head}: {reasons}"
    terms = sorted(c.memory_breakdown.items(), key=lambda kv: -kv[1])[:3]
    listed = ", ".join(f"{k} {v / GiB:.1f} GiB" for k, v in terms)
    return (
        f"{head}: the closest, {c.layout.short()} mb{c.layout.micro_batch} recompute={c.layout.recompute}"
        f"{' offload' if c.layout.offload else ''}, needs {c.memory / GiB:.1f} GiB per device of "
        f"{c.capacity / GiB:.1f} (short by {(c.memory - c.capacity) / GiB:.1f} GiB); largest: {listed}. "
        f"More devices, a smaller model or shorter sequences are needed."
    )


def format_breakdown(e: Estimate) -> str:
    """One estimate: its memory terms (GiB, share) and time terms (s, share)."""
    lay = e.layout
    lines = [
        f"layout {lay.short()} sp={lay.sp} schedule={lay.schedule} v={lay.v} micro_batch={lay.micro_batch} "
        f"recompute={lay.recompute} offload={lay.offload}",
        f"memory per device {e.memory / GiB:.2f} GiB of {e.capacity / GiB:.1f} "
        f"({'fits' if e.fits else 'DOES NOT FIT'}; {e.peak_stage} stage)",
    ]
    for k, v in sorted(e.memory_breakdown.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {k:<14}{v / GiB:9.2f} GiB {100 * v / e.memory:6.1f}%")
    lines.append(
        f"step {e.step_time:.4g} s, {e.microbatches} micro-batches, bubble {100 * e.bubble_fraction:.1f}%, "
        f"{e.tokens_per_s:,.0f} tok/s, {e.tflops_per_device:.4g} TFLOP/s per device, MFU {100 * e.mfu:.1f}%"
    )
    for k, v in sorted(e.time_breakdown.items(), key=lambda kv: -kv[1]):
        if v > 0:
            lines.append(f"  {k:<14}{v:9.4g} s   {100 * v / e.step_time:6.1f}%")
    lines.append(f"bound by {e.dominant}")
    return "\n".join(lines)


# ------------------------------------------------------------------ from a training config


def model_of(cfg: LoomConfig) -> ModelConfig:
    """The config's model with its vocabulary resolved (``data.vocab_size`` when the model's is 0)."""
    m = copy.deepcopy(cfg.model)
    if m.vocab_size <= 0:
        m.vocab_size = cfg.data.vocab_size
    return m


def workload_of(cfg: LoomConfig) -> Workload:
    return Workload(
        global_batch=cfg.train.global_batch,
        seq_len=cfg.data.seq_len,
        precision=cfg.train.precision,
        fp8_recipe=cfg.train.fp8_recipe,
        fp8_layers=cfg.train.fp8_layers,
        compile=cfg.train.compile != "none",
        reduce_dtype=cfg.parallel.reduce_dtype,
        bucket_bytes=cfg.parallel.bucket_mb * 2**20,
        optimizer=cfg.train.optimizer,
        moe_imbalance=cfg.moe.imbalance,
        capacity_factor=cfg.moe.capacity_factor,
        moe_aux_loss=cfg.moe.aux_loss_coef > 0,
        moe_z_loss=cfg.moe.z_loss_coef > 0,
        moe_score=cfg.moe.score,
        moe_shared=cfg.moe.n_shared_experts,
        moe_compute=cfg.moe.compute,
        lora_rank=cfg.finetune.lora_rank if cfg.finetune.method != "full" else 0,
        lora_targets=lora_targets(cfg) if cfg.finetune.method != "full" else (),
        qlora=cfg.finetune.method == "qlora",
        allreduce=cfg.parallel.allreduce,
        ps_shards=cfg.parallel.ps_shards if cfg.parallel.dp_mode == "ps" else 0,
        ps_colocate=cfg.parallel.ps_colocate,
        ps_sync=cfg.parallel.ps_sync,
    )


def layout_of(cfg: LoomConfig) -> Layout:
    """The layout a config asks for; fields the config does not have yet take the plain default.

    ``parallel.offload`` may be a bool or a place (``"none"``, ``"cpu"``, ``"disk"``): any place but
    none counts as offloaded optimizer state.
    """
    c = copy.deepcopy(cfg)
    resolve_layout(c, world_size_of(c) - ps_servers(c))  # the layout of the workers (dedicated servers aside)
    p, t = c.parallel, c.train
    offload = getattr(p, "offload", False)
    return Layout(
        dp=p.dp,
        dp_shard=p.dp_shard,
        tp=p.tp,
        pp=p.pp,
        cp=p.cp,
        cp_mode=str(getattr(p, "cp_mode", "allgather")),
        ep=p.ep,
        expert_tp=str(getattr(p, "expert_tp", "replicate")),
        zero=p.zero,
        sp=bool(getattr(p, "sp", False)),
        schedule=p.schedule,
        v=int(getattr(p, "virtual_stages", 1)),
        micro_batch=t.micro_batch,
        recompute=str(getattr(t, "recompute", "none")),
        offload=offload not in (False, None, "", "none"),
        split=_split_of(
            str(getattr(p, "pp_layout", "") or ""),
            cfg.model.n_layers,
            p.pp,
            int(getattr(p, "virtual_stages", 1)),
        ),
        **zero3_options(p),  # parameter offload, ZeRO++ (loom.plan.zero_options)
    )


def _split_of(pp_layout: str, n_layers: int, pp: int, v: int) -> tuple[int, ...]:
    """Blocks per device of a manual ``parallel.pp_layout`` (chunk k on device k mod pp), or ()."""
    if not pp_layout or pp < 2:
        return ()
    from loom.rules import parse_layout

    bounds = parse_layout(pp_layout, n_layers, pp * max(v, 1))
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    return tuple(sum(sizes[d::pp]) for d in range(pp))


def config_verdict(cfg: LoomConfig, cluster: ClusterSpec, profile: Profile | None = None) -> tuple[bool, str]:
    """(fits, one line) for the config's own layout: "the config's layout dp2 does not fit:
    activations 93 GiB > 80 GiB" (the largest term alone exceeds the device), else the total
    against the device with the largest term named."""
    try:
        lay = layout_of(cfg)
        cm = CostModel(model_of(cfg), workload_of(cfg), cluster, profile)
    except (ConfigError, PlanError) as e:
        return False, f"the config cannot be planned: {e}"
    head = f"the config's layout {lay.short()}"
    why = cm.check(lay)
    if why:
        return False, f"{head} is not valid here: {why}"
    est = cm.estimate(lay)
    cap, mem = est.capacity / GiB, est.memory / GiB
    term, size = max(est.memory_breakdown.items(), key=lambda kv: kv[1])
    if est.fits:
        return True, (
            f"{head} fits: {mem:.1f} GiB of {cap:.0f} GiB per device ({est.peak_stage} stage); predicted "
            f"step {est.step_time:.3g} s, {est.tokens_per_s:,.0f} tok/s, MFU {100 * est.mfu:.1f}%"
        )
    if size > est.capacity:
        return False, f"{head} does not fit: {term} {size / GiB:.0f} GiB > {cap:.0f} GiB"
    return False, f"{head} does not fit: {mem:.1f} GiB > {cap:.0f} GiB (largest: {term} {size / GiB:.1f} GiB)"


def dropped_rows(result: SearchResult) -> list[dict]:
    """Every reason a layout was dropped, most frequent first: reason, count, one example."""
    return [
        {"reason": why, "count": n, "example": result.examples.get(why, "")}
        for why, n in result.rejected.most_common()
    ]


def check_fit(cfg: LoomConfig, cluster: ClusterSpec, profile: Profile | None = None) -> tuple[bool, str]:
    """Before launch: does the config's layout fit the cluster's devices? (fits, one-paragraph message).

    When it does not, the message says by how much, which terms are largest, and names the best
    layout of the same world size that fits (or the closest miss).
    """
    try:
        lay = layout_of(cfg)
        cm = CostModel(model_of(cfg), workload_of(cfg), cluster, profile)
    except (ConfigError, PlanError) as e:
        return False, f"cannot plan this config: {e}"
    why = cm.check(lay)
    if why:
        return False, f"layout {lay.short()} is not valid here: {why}"
    est = cm.estimate(lay)
    summary = (
        f"{est.memory / GiB:.2f} GiB per device of {est.capacity / GiB:.1f} ({est.peak_stage} stage); "
        f"predicted step {est.step_time:.3g} s, {est.tokens_per_s:,.0f} tok/s, MFU {100 * est.mfu:.1f}%"
    )
    if est.fits:
        return True, f"fits: {lay.short()}: {summary}"
    terms = sorted(est.memory_breakdown.items(), key=lambda kv: -kv[1])[:3]
    msg = (
        f"does not fit: {lay.short()} needs {summary}; short by {(est.memory - est.capacity) / GiB:.2f} GiB. "
        f"Largest: {', '.join(f'{k} {v / GiB:.2f} GiB' for k, v in terms)}."
    )
    found = search(cm.model, cm.train, cluster, lay.world_size, profile=profile)
    if found.best is not None:
        b = found.best.layout
        msg += (
            f" Fits instead: {b.short()} sp={b.sp} schedule={b.schedule} micro_batch={b.micro_batch} "
            f"recompute={b.recompute}{' offload' if b.offload else ''} "
            f"({found.best.memory / GiB:.2f} GiB, step {found.best.step_time:.3g} s)."
        )
    else:
        msg += " " + explain_no_fit(found)
    return False, msg
