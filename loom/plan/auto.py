"""``parallel.auto``: let the planner choose the layout of a training run, and compare after it.

:func:`local_cluster` describes the machine a run is on: ``loom/configs/clusters/cpu-local.toml``
widened to the world size (one node, every rank on it) for CPU runs, ``DEVICE:1xN`` for a
known GPU. :func:`load_profile` reads the profile the caller names (``parallel.profile``, ``loom train --profile``)
or :data:`DEFAULT_PROFILE` when present (written by ``loom plan calibrate``; no environment variable),
scaled by :func:`~loom.plan.hardware.profiles.contended` when more ranks than cores share the CPU. :func:`apply_auto` searches the layouts of the world size and
writes the fastest into ``cfg.parallel`` and ``cfg.train`` (:data:`AUTO_FIELDS`; a field the config sets
explicitly is a constraint of the search, never replaced); :func:`prediction`
gives the estimate of a config's own layout (what the trainer logs beside its measurement).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from loom.config import ConfigError, LoomConfig, world_size_of
from loom.plan.cost import CostModel, Estimate, Layout, PlanError
from loom.plan.hardware import (
    DEVICES,
    ClusterSpec,
    HardwareError,
    Profile,
    contended,
    cores,
    datasheet_profile,
    resolve_cluster,
)
from loom.plan.report import layout_of, model_of, workload_of
from loom.plan.search import search

log = logging.getLogger("loom")
DEFAULT_PROFILE = "profile.json"  # the calibration profile read when none is named, if present (cwd)


def local_cluster(world: int, device: str = "cpu") -> ClusterSpec:
    """This machine as a one-node cluster of ``world`` ranks (CPU: cpu-local.toml's links and memory)."""
    if device == "cpu":
        base = resolve_cluster("cpu-local")
        return dataclasses.replace(base, name=f"cpu-local:1x{world}", nodes=1, devices_per_node=world)
    return resolve_cluster(f"{device}:1x{world}")


def load_profile(world: int, path: str | None = None, device: str = "cpu") -> Profile | None:
    """The calibration profile at ``path`` (which must exist), else :data:`DEFAULT_PROFILE` if present;
    without one None (the datasheet), or on a CPU whose cores the ranks outnumber, the datasheet scaled
    by :func:`contended`."""
    p = path or DEFAULT_PROFILE
    if not Path(p).is_file():
        if path:
            raise HardwareError(
                f"parallel.profile: {p!r} is not a file (write one with `loom plan calibrate`)"
            )
        # nothing measured: the CPU's datasheet numbers, shared by the ranks when they outnumber the cores
        return (
            contended(datasheet_profile(DEVICES["cpu"]), world)
            if device == "cpu" and world > cores()
            else None
        )
    prof = Profile.load(p)
    return contended(prof, world) if prof.device == "cpu" else prof


def _device_of(cfg: LoomConfig) -> str:
    """The hardware table's key for this machine's accelerator (``cpu`` without one or if unknown)."""
    if cfg.run.device != "cpu":
        import torch

        from loom.device import cuda_available, device_name

        if cuda_available():
            from loom.plan.hardware import device_key

            return device_key(device_name(torch.device("cuda", 0))) or "cpu"
    return "cpu"


# every Layout field parallel.auto sets -> the config field it writes; an explicit one constrains the search
AUTO_FIELDS = {
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "cp": "parallel.cp",
    "ep": "parallel.ep",
    "dp": "parallel.dp",
    "dp_shard": "parallel.dp_shard",
    "zero": "parallel.zero",
    "sp": "parallel.sp",
    "cp_mode": "parallel.cp_mode",
    "expert_tp": "parallel.expert_tp",
    "schedule": "parallel.schedule",
    "v": "parallel.virtual_stages",
    "offload": "parallel.offload",
    "micro_batch": "train.micro_batch",
    "recompute": "train.recompute",
}


def _config_value(lay: Layout, field: str) -> Any:
    """The value ``lay`` gives the Layout field ``field`` as the config spells it."""
    v = getattr(lay, field)
    return ("cpu" if v else "none") if field == "offload" else v


def _to_config(cfg: LoomConfig, lay: Layout, keep: frozenset[str] = frozenset()) -> None:
    """Write ``lay`` into ``cfg``, except the Layout fields in ``keep`` (explicit: the layout has their value)."""
    for field, name in AUTO_FIELDS.items():
        if field not in keep:
            section, key = name.split(".")
            setattr(getattr(cfg, section), key, _config_value(lay, field))


def refusal(cfg: LoomConfig, lay: Layout) -> str | None:
    """Why the runtime refuses ``lay`` for this config (its own validation, on a copy), or None."""
    from loom.config import validate

    keep = frozenset(fixed_fields(cfg))
    trial = _copy(cfg)
    trial.parallel.auto = False
    _to_config(trial, lay, keep)
    try:
        validate(trial, lay.world_size)
    except ConfigError as e:
        return str(e)
    return None


def runnable(cfg: LoomConfig, lay: Layout) -> bool:
    """Whether the runtime accepts ``lay`` for this config."""
    return refusal(cfg, lay) is None


def _copy(cfg: LoomConfig) -> LoomConfig:
    from loom.config import from_dict, to_dict

    return from_dict(to_dict(cfg))


def choose(cfg: LoomConfig, world: int | None = None, profile: Profile | None = None) -> Estimate:
    """The fastest layout of ``world`` ranks that fits and that the runtime can run; ``profile``, else
    the one ``parallel.profile`` names (:func:`load_profile`)."""
    world = world or world_size_of(cfg)
    cluster = local_cluster(world, _device_of(cfg))
    if profile is None:
        profile = load_profile(world, cfg.parallel.profile or None, device=_device_of(cfg))
    fixed = fixed_fields(cfg)
    result = search(model_of(cfg), workload_of(cfg), cluster, world, profile=profile, fixed=fixed)
    refused: list[str] = []
    for est in result.ranked:  # ranked: only layouts with the explicit values, passing the layout rules
        why = refusal(cfg, est.layout) if est.layout.world_size == world else "not the world size"
        if why is None:  # the rest of validate too
            return est
        refused.append(why)
    given = ", ".join(f"{AUTO_FIELDS[k]} = {_toml(cfg, AUTO_FIELDS[k])}" for k in fixed)
    raise PlanError(
        f"parallel.auto: no layout of {world} rank(s){' with ' + given if given else ''} fits and runs: "
        f"{_reasons(result.rejected, refused)}; closest: "
        f"{result.closest.layout.short() if result.closest else 'none'}"
    )


# reasons the search counts for layouts it skipped as no better, not as impossible
PRUNED = ("dominated", "cp_mode: another mode", "does not fit: larger micro-batches skipped")


def _reasons(rejected: dict[str, int], refused: list[str]) -> str:
    """The commonest reasons the search dropped layouts (pruning aside) and the runtime's first refusal."""
    drops = sorted(((n, why) for why, n in rejected.items() if not why.startswith(PRUNED)), reverse=True)
    out = {why.split(":")[0]: why for _, why in reversed(drops)}  # one per field, the commonest kept
    return "; ".join([*list(out.values())[::-1][:3], *refused[:1]]) or "no candidate layout"


def _toml(cfg: LoomConfig, name: str) -> str:
    """The value of config field ``name`` as TOML spells it."""
    section, key = name.split(".")
    v = getattr(getattr(cfg, section), key)
    return str(v).lower() if isinstance(v, bool) else f'"{v}"' if isinstance(v, str) else str(v)


# the degrees parallel.auto chooses, as a Layout names them; an explicit one constrains the search
AUTO_DEGREES = ("tp", "pp", "cp", "ep", "dp", "dp_shard", "zero")


def fixed_fields(cfg: LoomConfig) -> dict[str, Any]:
    """The Layout fields of :data:`AUTO_FIELDS` set explicitly, as the Layout spells them, which
    ``parallel.auto`` keeps: ``{"micro_batch": 3, "offload": True}`` for ``--train.micro_batch 3
    --parallel.offload cpu``. A degree counts when a file or an option sets it
    (:func:`loom.config.explicit`); the other fields when an option does
    (:func:`loom.config.overridden`): every preset sets ``train.micro_batch``, a default the search
    may change (the chosen line names what it set). ``dp``/``dp_shard`` of 0 or less mean "follow
    the world size" and constrain nothing."""
    from loom.config import explicit, overridden

    given, options = explicit(cfg), overridden(cfg)
    out: dict[str, Any] = {}
    for field, name in AUTO_FIELDS.items():
        if name in (given if field in AUTO_DEGREES else options):
            section, key = name.split(".")
            value = getattr(getattr(cfg, section), key)
            out[field] = value != "none" if field == "offload" else value
    return {k: v for k, v in out.items() if k not in ("dp", "dp_shard") or v > 0}


def fixed_degrees(cfg: LoomConfig) -> dict[str, int]:
    """The parallel degrees among :func:`fixed_fields`: ``{"tp": 2}`` for ``--parallel.tp 2``."""
    return {k: int(v) for k, v in fixed_fields(cfg).items() if k in AUTO_DEGREES}


def apply_auto(cfg: LoomConfig, world: int | None = None, profile: Profile | None = None) -> Estimate:
    """Write the planner's best layout into ``cfg`` (:data:`AUTO_FIELDS`), explicit fields kept as given."""
    world = world or world_size_of(cfg)
    est = choose(cfg, world, profile)
    _to_config(cfg, est.layout, frozenset(fixed_fields(cfg)))
    cfg.parallel.auto = False  # chosen: a relaunched rank must not search again
    log.info("%s", describe(est, cfg))
    return est


def describe(est: Estimate, cfg: LoomConfig | None = None) -> str:
    """One line naming a chosen layout (every field of :data:`AUTO_FIELDS`) and its prediction;
    ``cfg``: the config it was written into, whose offload target (cpu or disk) the layout does not
    record."""
    lay = est.layout
    offload = cfg.parallel.offload if cfg is not None else _config_value(lay, "offload")
    return (
        f"parallel.auto chose {lay.short()} zero={lay.zero} sp={str(lay.sp).lower()} cp_mode={lay.cp_mode} "
        f"schedule={lay.schedule} virtual_stages={lay.v} micro_batch={lay.micro_batch} "
        f"recompute={lay.recompute} offload={offload}: predicted "
        f"{est.step_time:.3g} s/step, {est.memory / 2**20:.1f} MiB per rank"
    )


def _cost_model(cfg: LoomConfig, world: int, profile: Profile | None) -> CostModel:
    cluster = local_cluster(world, _device_of(cfg))
    return CostModel(
        model_of(cfg),
        workload_of(cfg),
        cluster,
        profile or load_profile(world, cfg.parallel.profile or None, device=_device_of(cfg)),
    )


def prediction(cfg: LoomConfig, world: int, profile: Profile | None = None) -> Estimate:
    """The planner's estimate for the config's own (resolved) layout on this machine."""
    return _cost_model(cfg, world, profile).estimate(layout_of(cfg))


def predicted_fields(cfg: LoomConfig, world: int, profile: Profile | None = None) -> dict[str, float]:
    """Predicted step time, rank-0 model-state bytes (first stage) and peak bytes of the config's layout."""
    cm = _cost_model(cfg, world, profile)
    lay = layout_of(cfg)
    est = cm.estimate(lay)
    states = cm.state_memory(lay, first=True, last=lay.pp == 1)
    return {
        "plan_step_time_s": est.step_time,
        "plan_state_bytes": states["weights"] + states["gradients"] + states["optimizer"],
        "plan_peak_mem_bytes": est.memory,
    }


# --------------------------------------------------------------------------- bounds before allocation


def host_memory_bytes() -> int:
    """This machine's physical memory (0 if the OS does not say)."""
    import os

    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 0


def rank_memory(cfg: LoomConfig, local_ranks: int | None = None) -> tuple[float, str, int]:
    """(bytes one rank may use, what they are, how many ranks share them): the device's memory when
    the run computes on CUDA (``torch.cuda.mem_get_info``), else the host's memory shared by
    ``local_ranks`` (default ``run.nproc``)."""
    if cfg.run.device != "cpu":
        from loom.device import cuda_available

        if cuda_available():
            import torch

            return float(torch.cuda.mem_get_info(0)[1]), "memory of one CUDA device", 1
    host = host_memory_bytes()
    n = max(1, cfg.run.nproc if local_ranks is None else local_ranks)
    return host / n, "host memory" + (f" shared by run.nproc = {n} ranks" if n > 1 else ""), n


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB"


def table_bytes(cfg: LoomConfig) -> float:
    """Bytes every rank allocates for the position tables of ``model.max_seq_len`` positions, whatever
    the layout: RoPE's float64 angles and cos/sin (positions x head_dim/2), or learned embeddings."""
    m = cfg.model
    if m.positions == "rope":
        return float(m.max_seq_len) * (8 + 8 * 3 * max(1, m.head_dim // 2))
    return float(m.max_seq_len) * (8 + 4 * m.dim)


def fit_problem(
    cfg: LoomConfig, world: int, profile: Profile | None = None, local_ranks: int | None = None
) -> str | None:
    """Why a validated config cannot fit this machine, before anything is allocated (one line naming
    the field and the bytes), or None. The oracle is the planner's estimate of the config's layout
    (:func:`prediction`, what ``parallel.auto`` ranks by) plus the position tables it does not count."""
    cap, where, sharing = rank_memory(cfg, local_ranks)
    if cap <= 0:  # unknown machine: nothing to compare with
        return None
    tables = table_bytes(cfg)
    m = cfg.model
    if tables > cap:
        return (
            f"model.max_seq_len: {m.max_seq_len} positions need {_gib(tables)} of "
            f"{'RoPE' if m.positions == 'rope' else 'position'} tables on every rank, more than the "
            f"{_gib(cap)} of {where}"
        )
    try:
        est = prediction(cfg, world, profile)
    except (PlanError, HardwareError, ValueError, KeyError, ZeroDivisionError, OverflowError):
        return None  # a layout the cost model cannot price: validation and the ranks judge it
    need = est.memory + tables
    if need <= cap:
        return None
    bd = est.memory_breakdown
    term = max(bd, key=bd.__getitem__) if bd else "weights"
    if sharing > 1 and (fit := int(cap * sharing // need)) >= 1:  # one rank fits: too many of them here
        return (
            f"run.nproc: {sharing} ranks on this machine need about {_gib(need)} each (planner estimate of "
            f"{layout_of(cfg).short()}; {term} {_gib(bd.get(term, 0.0))}), {_gib(need * sharing)} in all, "
            f"more than its {_gib(cap * sharing)} of host memory; give --nproc {fit} or fewer"
        )
    vocab_field = "model.vocab_size" if m.vocab_size else "data.vocab_size"
    if term == "logits":
        field, hint = vocab_field, "a smaller vocabulary, or lower train.micro_batch or data.seq_len"
    elif term in ("activations", "accumulation"):
        field = "train.micro_batch"
        hint = "lower train.micro_batch or data.seq_len, or recompute (train.recompute)"
    else:
        vocab = m.vocab_size or cfg.data.vocab_size
        emb = vocab * m.dim * (1 if m.tie_embeddings else 2)
        body = m.n_layers * m.dim * (2 * m.dim + 3 * m.resolved_ffn_dim())
        field = vocab_field if emb > body else "model.dim"
        hint = "a smaller model (model.dim, model.n_layers, vocab), or shard it (parallel.zero, tp, pp, more ranks)"
    return (
        f"{field}: this run needs about {_gib(need)} per rank (planner estimate of "
        f"{layout_of(cfg).short()}; {term} {_gib(bd.get(term, 0.0))}), more than the {_gib(cap)} of {where}; {hint}"
    )


def check_fits(cfg: LoomConfig, world: int, profile: Profile | None = None) -> None:
    """Raise :class:`ConfigError` with :func:`fit_problem`'s line."""
    problem = fit_problem(cfg, world, profile)
    if problem is not None:
        raise ConfigError(problem)


# --------------------------------------------------------------------------- the end-of-run line


def profile_source(cfg: LoomConfig, world: int) -> str:
    """What the prediction's machine numbers come from (:func:`load_profile`'s choice)."""
    p = cfg.parallel.profile or DEFAULT_PROFILE
    if Path(p).is_file():
        return f"calibration profile {p}"
    shared = _device_of(cfg) == "cpu" and world > cores()
    return "datasheet, no calibration profile" + (" (cores shared by the ranks)" if shared else "")


def core_load(ranks_here: int, threads_per_rank: int) -> tuple[float, float, int]:
    """(1-minute load average, the part of it beyond this run's own runnable threads, cores):
    the run keeps min(cores, ranks_here · threads_per_rank) threads runnable; whatever the load
    average holds beyond that was other processes using the cores."""
    import os

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    n = cores()
    return load, max(0.0, load - min(n, ranks_here * threads_per_rank)), n


def prediction_line(cfg: LoomConfig, world: int, row: dict, measured_state: float) -> str:
    """The end-of-run line: predicted against measured step time and rank-0 state, what the
    prediction is based on, and whether other processes were using the cores during the run."""
    import os

    import torch

    here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    threads = torch.get_num_threads() if _device_of(cfg) == "cpu" else 1
    load, other, n = core_load(here, threads)
    busy = (
        f"other processes were using the cores (load {load:.1f} on {n} cores, about {other:.1f} beyond "
        f"this run's {min(n, here * threads)}): the measurement is slowed by them"
        if other >= 0.5
        else f"the cores were not shared with other processes (load {load:.1f} on {n} cores)"
    )
    return (
        f"planner: step {row['plan_step_time_s']:.4g} s predicted, {row['step_time_s']:.4g} measured | "
        f"rank-0 state {row['plan_state_bytes'] / 2**20:.3f} MiB predicted, {measured_state / 2**20:.3f} "
        f"measured | {profile_source(cfg, world)}; {busy}"
    )
