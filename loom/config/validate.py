"""Validation: every field and combination of a :class:`~loom.config.sections.LoomConfig`, before any
process starts. The layout rules are :mod:`loom.rules` (shared with the planner); this module applies
them to a config, in a fixed order, raising the first problem as a :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
import typing
from pathlib import Path

from loom.config.finetune import check_finetune
from loom.config.sections import (
    SECTIONS,
    CompressFormat,
    ConfigError,
    DataConfig,
    DataFormat,
    LoomConfig,
    ModelConfig,
    ParallelConfig,
    Precision,
    RecomputePolicy,
    RunConfig,
    TensorKind,
    TrainConfig,
    _field_types,
    _require,
    _require_none,
    choices,
    grad_accum_steps,
    offload_dir,
    ps_servers,
)
from loom.numbers import is_whole
from loom.rules import (
    ModelFacts,
    batch_problem,
    compress_layout_problem,
    expert_rebalance_problem,
    layout_problems,
    param_server_problem,
    resolve_degrees,
    sequence_parallel_problem,
    server_ranks_problem,
    sharding_problem,
    tensor_parallel_problem,
    world_problem,
    zero3_options_problem,
    zero_stage_problem,
)


def _check_choices(cfg: LoomConfig) -> None:
    """Every field typed ``Literal[...]`` holds one of its values."""
    for section, cls in SECTIONS.items():
        for name, typ in _field_types(cls).items():
            allowed, value = choices(typ), getattr(getattr(cfg, section), name)
            _require(
                not allowed or value in allowed,
                f"{section}.{name}: must be one of {' | '.join(map(str, allowed))}, got {value!r}",
            )


def resolve_layout(cfg: LoomConfig, world_size: int) -> None:
    """Fill ``parallel.dp``/``dp_shard`` from the world size and check every product
    (:func:`loom.rules.world_problem`, :func:`~loom.rules.sharding_problem`):

    world_size = dp * tp * pp * cp;  dp = dp_replicate * dp_shard;  ep | dp * cp.
    """
    p = cfg.parallel
    _require_none(world_problem(world_size, dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep))
    p.dp, p.dp_shard = resolve_degrees(
        world_size, dp=p.dp, dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, cp=p.cp, zero=p.zero
    )
    _require_none(sharding_problem(dp=p.dp, dp_shard=p.dp_shard, cp=p.cp, ep=p.ep))


def _check_finite(cfg: LoomConfig) -> None:
    """Every float field is a finite number (no NaN or infinity slips past a ``>`` bound)."""
    import math

    for section, cls in SECTIONS.items():
        obj = getattr(cfg, section)
        for f in dataclasses.fields(cls):
            v = getattr(obj, f.name)
            if isinstance(v, float):
                _require(math.isfinite(v), f"{section}.{f.name}: must be a finite number, got {v}")


# (section.field, lowest allowed, inclusive) for numeric fields the rules below do not bound
_LOWER_BOUNDS: tuple[tuple[str, float, bool], ...] = (
    ("model.rope_theta", 0.0, False),
    ("model.norm_eps", 0.0, False),
    ("model.rope_scaling", 0.0, True),
    ("model.attn_head_dim", 0.0, True),
    ("model.top_k", 1.0, True),
    ("train.global_batch", 1.0, True),
    ("train.eps", 0.0, False),
    ("train.weight_decay", 0.0, True),
    ("train.seed", 0.0, True),
    ("train.eval_batches", 1.0, True),
    ("train.time_limit_s", 0.0, True),
    ("train.loss_scale", 0.0, True),
    ("train.loss_scale_init", 0.0, False),
    ("train.loss_scale_window", 1.0, True),
    ("train.loss_scale_hysteresis", 1.0, True),
    ("train.loss_scale_min", 0.0, False),
    ("train.max_skipped_steps", 0.0, True),
    ("run.master_port", 0.0, True),
    ("run.nproc", 1.0, True),
)


# (section.field, highest allowed, what it counts): beyond these a value is no setting but a hang, an
# allocation the host cannot make or an overflow deep in a library
_UPPER_BOUNDS: tuple[tuple[str, float, str], ...] = (
    ("data.workers", 1024, "preparation processes"),
    ("train.eval_batches", 2**20, "batches each evaluation builds and reads"),
    ("run.timeout_s", 1e7, "seconds (116 days) a collective or the store may wait"),
    ("run.preempt_grace_s", 86400, "seconds (a day) a preempted run may take to save"),
    ("run.threads", 4096, "threads per rank"),
    ("moe.capacity_factor", 1024, "x the mean tokens per expert; one >= model.n_experts never drops a token"),
    ("parallel.bucket_mb", 1e6, "MB per gradient bucket"),
)


def _check_bounds(cfg: LoomConfig) -> None:
    for path, low, inclusive in _LOWER_BOUNDS:
        section, name = path.split(".")
        v = getattr(getattr(cfg, section), name)
        ok = v >= low if inclusive else v > low
        _require(ok, f"{path}: must be {'>=' if inclusive else '>'} {low:g}, got {v}")
    for path, high, unit in _UPPER_BOUNDS:
        section, name = path.split(".")
        v = getattr(getattr(cfg, section), name)
        _require(v <= high, f"{path}: at most {high:g} ({unit}), got {v:g}")
    _require(
        cfg.run.master_port <= 65535, f"run.master_port: must be in [0, 65535], got {cfg.run.master_port}"
    )
    for path in ("train.global_batch", "data.seq_len"):  # the planner enumerates their divisors
        section, name = path.split(".")
        v = getattr(getattr(cfg, section), name)
        _require(v <= MAX_BATCH_OR_SEQ, f"{path}: at most {MAX_BATCH_OR_SEQ:,} (2^24), got {v:,}")
    _require(  # torch.manual_seed takes 64 bits, as `loom generate --seed`
        cfg.train.seed < 2**64, f"train.seed: must be below 2**64 = {2**64}, got {cfg.train.seed}"
    )


def _check_rope(m: ModelConfig) -> None:
    """The RoPE rule's numbers (those of the rule ``rope_kind`` selects, :meth:`ModelConfig.rope_idle_fields`)
    and the rotated share: r = d·rope_fraction even, at least one pair."""
    if m.positions != "rope":
        return
    _require(
        0 < m.rope_fraction <= 1 and m.rope_dims % 2 == 0 and m.rope_dims >= 2,
        f"model.rope_fraction: must be in (0, 1] with r = int(head_dim * it) even and >= 2 (head_dim "
        f"{m.head_dim}), got {m.rope_fraction} (r = {m.rope_dims})",
    )
    used = {f.name for f in dataclasses.fields(m)} - m.rope_idle_fields()
    for high, low in (
        ("rope_high_freq_factor", "rope_low_freq_factor"),
        ("rope_beta_fast", "rope_beta_slow"),
    ):
        if high in used:  # a ramp's ends: llama3's wavelength factors, YaRN's turn counts
            _require(
                getattr(m, high) > getattr(m, low) > 0,
                f"model.{high}: must exceed model.{low} > 0, got {getattr(m, high)} and {getattr(m, low)}",
            )
    if "rope_original_len" in used:
        _require(
            m.rope_original_len >= 1, f"model.rope_original_len: must be >= 1, got {m.rope_original_len}"
        )
    if "rope_attn_factor" in used:
        _require(
            m.rope_attn_factor >= 0,
            f"model.rope_attn_factor: must be >= 0 (0 = the rule's), got {m.rope_attn_factor}",
        )
    if "rope_short_factor" in used:
        for name in ("rope_short_factor", "rope_long_factor"):
            v = getattr(m, name)
            _require(
                len(v) == m.rope_dims // 2 and all(0 < x < float("inf") for x in v),
                f"model.{name}: LongRoPE needs {m.rope_dims // 2} finite numbers > 0 (one per frequency of "
                f"the {m.rope_dims} rotated dims), got {len(v)}"
                + ("" if all(0 < x < float("inf") for x in v) else f": {v}"),
            )


def _check_moe(cfg: LoomConfig) -> None:
    """The [moe] numbers: coefficients and rates >= 0, capacity factor 0 (dropless) or > 0."""
    e = cfg.moe
    for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate", "capacity_factor"):
        v = getattr(e, name)
        _require(v >= 0, f"moe.{name}: must be >= 0, got {v}")
    _require(e.n_shared_experts >= 0, f"moe.n_shared_experts: must be >= 0, got {e.n_shared_experts}")
    _require(
        e.imbalance == 0 or e.imbalance >= 1,
        f"moe.imbalance: must be >= 1 (max over mean tokens per expert), or 0 (the calibration's), got {e.imbalance}",
    )
    _require_none(
        expert_rebalance_problem(
            rebalance_every=e.rebalance_every,
            hot_experts=e.hot_experts,
            n_experts=cfg.model.n_experts,
            ep=cfg.parallel.ep,
        )
    )


def validate_shape(cfg: LoomConfig) -> None:
    """The checks of :func:`validate` that need neither a world size nor a file nor data: every float
    finite, the bounds and choices of every field, the model's shape and the precision (what ``loom
    plan`` prices a config by, whatever cluster and sequence length it is planned for). Raises
    ConfigError."""
    _check_finite(cfg)
    _check_bounds(cfg)
    _check_choices(cfg)
    _check_model(cfg.model)
    _check_precision(cfg)


def validate(cfg: LoomConfig, world_size: int) -> LoomConfig:
    """Check every field and combination; resolve automatic values in place. Raises ConfigError."""
    d, p, t = cfg.data, cfg.parallel, cfg.train
    _require(world_size >= 1, f"run.nproc: must be >= 1, got {world_size}")
    validate_shape(cfg)
    _check_data(d, cfg.model.max_seq_len)
    _check_train_run(t, cfg.run)
    _require(  # a bucket under 1 kB is a collective per handful of gradients
        p.bucket_mb >= 1e-3, f"parallel.bucket_mb: must be >= 0.001 (1 kB), got {p.bucket_mb:g}"
    )
    _require(
        not p.profile or Path(p.profile).is_file(),
        f"parallel.profile: {p.profile!r} is not a file (write one with `loom plan calibrate`)",
    )
    if p.profile:
        _check_profile(p.profile)
    _require_none(zero_stage_problem(p.zero))
    resolve_layout(cfg, world_size - _check_ps_ranks(cfg, world_size))
    _require(
        not (d.record_ids and ps_servers(cfg)),
        "data.record_ids: not with dedicated parameter servers (parallel.ps_colocate = false); "
        "record on colocated servers",
    )
    _check_moe(cfg)
    check_finetune(cfg)
    _check_zero3_options(cfg.parallel)
    check_param_server(cfg)
    check_memory(cfg)
    _require_none(batch_problem(t.global_batch, t.micro_batch, p.dp))
    _require(
        not t.log_gns
        or (p.tp == p.pp == p.cp == p.ep == 1 and p.zero <= 1 and p.dp_mode != "ps" and not cfg.model.moe)
        and t.global_batch > t.micro_batch,
        "train.log_gns: needs data parallelism with whole gradients (tp = pp = cp = ep = 1, zero <= 1, no "
        f"parameter servers, no MoE) and global_batch > micro_batch; got tp {p.tp} pp {p.pp} cp {p.cp} "
        f"ep {p.ep} zero {p.zero} dp_mode {p.dp_mode} global_batch {t.global_batch} micro_batch {t.micro_batch}",
    )
    problems = layout_problems(
        model_facts(cfg),
        seq_len=d.seq_len,
        precision=t.precision,
        optimizer=t.optimizer,
        tp=p.tp,
        pp=p.pp,
        cp=p.cp,
        ep=p.ep,
        zero=p.zero,
        sp=p.sp,
        schedule=p.schedule,
        cp_mode=p.cp_mode,
        virtual_stages=p.virtual_stages,
        microbatches=grad_accum_steps(cfg),
        offload=p.offload,
        pp_layout=p.pp_layout,
        vertical_sync=p.vertical_sync,
        allreduce=p.allreduce,
        dp=p.dp,
        dp_shard=p.dp_shard,
        recompute=t.recompute,
        expert_tp=p.expert_tp,
    )
    _require_none(problems[0] if problems else None)
    if p.offload == "disk":
        problem = _unwritable(offload_dir(cfg))
        _require(problem is None, f"parallel.offload_dir: {problem}")
    return cfg


def _check_profile(path: str) -> None:
    """``parallel.profile`` holds a calibration profile as far as this layer can tell: UTF-8 JSON, an
    object naming its ``device`` (a wrong or damaged file was found only at the end of a run, as a
    warning and no ``plan_*`` metrics). What each field must hold is the planner's rule
    (:meth:`loom.plan.hardware.Profile.load`), in a package above this one in the layers."""
    import json

    from loom.config.parse import read_text_file

    hint = "; write one with `loom plan calibrate`"
    text = read_text_file(path, f"parallel.profile: {path!r}")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError; nesting deeper than the parser goes
        raise ConfigError(
            f"parallel.profile: {path!r} is not a calibration profile (not valid JSON: {e}){hint}"
        ) from None
    _require(
        isinstance(data, dict) and isinstance(data.get("device"), str),
        f'parallel.profile: {path!r} is not a calibration profile (a JSON object naming its "device"){hint}',
    )


def _check_precision(cfg: LoomConfig) -> None:
    """Resolve ``train.precision = auto`` for ``run.device`` (bf16 on CUDA, fp32 on the CPU); fp8/int8
    need a full fine-tune (LoRA wraps the Linears they swap) and fp8 a device with float8 matmuls."""
    import torch  # here: parsing and checking a config imports no torch until a precision needs it

    from loom.device import cuda_available, fp8_supported, resolve_precision

    t = cfg.train
    t.precision = typing.cast(Precision, resolve_precision(t.precision, cfg.run.device))
    if t.precision not in ("fp8", "int8"):
        return
    _require(
        cfg.finetune.method == "full",
        f"train.precision: {t.precision} swaps the Linear layers that finetune.method = "
        f"{cfg.finetune.method} wraps; use train.precision = bf16",
    )
    device = cfg.run.device
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    known = device == "cpu" or cuda_available()  # else resolve_device names the missing CUDA
    _require(
        t.precision != "fp8" or not known or fp8_supported(torch.device(device)),
        "train.precision: fp8 needs a CUDA device with float8 support (sm_89+)",
    )


MAX_LAYERS = 10_000
# sequences per step and tokens per sequence: 2^24, far beyond any run (16k sequences, 10M-token contexts)
MAX_BATCH_OR_SEQ = 2**24
# Each width of [model], with the largest trained today beside it: a typo of 4e12 would otherwise
# reach the planner (garbage tables) or an allocation. field: (bound, largest published).
MODEL_SIZE_BOUNDS: dict[str, tuple[int, str]] = {
    "dim": (2**17, "about 25,600"),
    "n_heads": (2**14, "about 160"),
    "attn_head_dim": (2**14, "256"),
    "ffn_dim": (2**20, "about 100,000"),
    "vocab_size": (2**23, "about 262,000"),
    "pad_vocab_to": (2**23, "about 262,000"),
    "n_experts": (2**16, "about 256 routed"),
    "max_seq_len": (MAX_BATCH_OR_SEQ, "about 10M"),
}


def _check_model(m: ModelConfig) -> None:
    """[model]: sizes >= 1, heads that divide the width (even for RoPE), experts that are SwiGLU."""
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len", "multiple_of"):
        _require(getattr(m, name) >= 1, f"model.{name}: must be >= 1, got {getattr(m, name)}")
    _require(  # the planner walks the layers one by one: a typo of 1e12 would never return
        m.n_layers <= MAX_LAYERS,
        f"model.n_layers: at most {MAX_LAYERS:,} (the deepest transformers trained have about 1,000), "
        f"got {m.n_layers:,}",
    )
    for name, (bound, largest) in MODEL_SIZE_BOUNDS.items():
        v = getattr(m, name)
        _require(v <= bound, f"model.{name}: at most {bound:,} (the largest trained: {largest}), got {v:,}")
    _require(
        m.attn_head_dim > 0 or m.dim % m.n_heads == 0,
        f"model.dim: {m.dim} must be divisible by model.n_heads={m.n_heads} (or set model.attn_head_dim)",
    )
    _require(
        m.positions != "rope" or m.head_dim % 2 == 0,
        f"model.dim: head_dim {m.head_dim} must be even for RoPE",
    )
    _check_rope(m)
    _require(
        m.n_heads % m.n_kv_heads == 0,
        f"model.n_kv_heads: must divide model.n_heads={m.n_heads}, got {m.n_kv_heads}",
    )
    _require(m.ffn_dim >= 0, f"model.ffn_dim: must be >= 0 (0 = automatic), got {m.ffn_dim}")
    _require(m.vocab_size >= 0, f"model.vocab_size: must be >= 0 (0 = from tokenizer), got {m.vocab_size}")
    _require(m.init_std > 0, f"model.init_std: must be > 0, got {m.init_std}")
    _require(0.0 <= m.dropout < 1.0, f"model.dropout: must be in [0, 1), got {m.dropout}")
    _require(m.n_experts >= 1, f"model.n_experts: must be >= 1 (1 = dense MLP), got {m.n_experts}")
    _require(
        not m.moe or m.mlp == "swiglu", f"model.mlp: experts are SwiGLU; {m.mlp!r} needs model.n_experts = 1"
    )
    _require(
        not m.norm_offset or m.norm == "rmsnorm",
        "model.norm_offset: scales an RMSNorm by 1 + w; model.norm = layernorm has its own bias",
    )
    _require(m.sliding_window >= 0, f"model.sliding_window: must be >= 0 (0 = none), got {m.sliding_window}")
    _require(  # a window on no layer would be an explicit setting silently without effect
        m.sliding_window == 0 or bool(m.local_layers()),
        f"model.window_layers: names no layer for model.sliding_window = {m.sliding_window}; give 'all' or indices",
    )
    m.nope_layer_set()  # its indices checked, naming the field
    _require(
        0 <= m.rope_local_theta < float("inf"),
        f"model.rope_local_theta: must be a finite number >= 0 (0 = rope_theta on every layer), got {m.rope_local_theta}",
    )
    for name in ("embed_multiplier", "residual_multiplier", "logit_divisor"):
        v = getattr(m, name)
        _require(0 < v < float("inf"), f"model.{name}: must be a finite number > 0 (1 = none), got {v}")
    for name in ("attn_scale", "attn_softcap", "logit_softcap"):
        v = getattr(m, name)
        _require(0 <= v < float("inf"), f"model.{name}: must be a finite number >= 0 (0 = off), got {v}")
    if m.moe:
        _require(
            1 <= m.top_k <= m.n_experts,
            f"model.top_k: must be in [1, model.n_experts={m.n_experts}], got {m.top_k}",
        )


def _check_data(d: DataConfig, max_seq_len: int) -> None:
    """[data]: sequence length, tokenizer vocabulary, held-out share, the sources of a mixture."""
    _require(d.seq_len >= 2, f"data.seq_len: must be >= 2, got {d.seq_len}")
    _require(
        d.seq_len <= max_seq_len,
        f"data.seq_len: {d.seq_len} exceeds model.max_seq_len={max_seq_len}",
    )
    _require(d.vocab_size >= 260, f"data.vocab_size: must be >= 260 (bytes + specials), got {d.vocab_size}")
    _require(  # the BPE trainer allocates ~70 bytes per entry up front (4e9: 283 GB, then an abort)
        d.vocab_size <= MAX_TRAINED_VOCAB,
        f"data.vocab_size: at most {MAX_TRAINED_VOCAB:,} for a tokenizer trained here (the largest "
        f"published vocabularies hold about 256k), got {d.vocab_size:,}",
    )
    _require(0.0 < d.val_fraction < 0.5, f"data.val_fraction: must be in (0, 0.5), got {d.val_fraction}")
    _require(d.max_corpus_mb >= 0, f"data.max_corpus_mb: must be >= 0 (0 = no cap), got {d.max_corpus_mb}")
    _require(d.workers >= 0, f"data.workers: must be >= 0 (0 = one per CPU core), got {d.workers}")
    _require(
        not d.doc_separator or d.format == "text",
        f'data.doc_separator: splits .txt files of data.format = text, not {d.format} records; set it to ""',
    )
    for i, src in enumerate(d.sources):
        _require(bool(src.path.strip()), f"data.sources[{i}].path: must name a file, directory or glob")
        _require(
            src.weight > 0 and src.weight != float("inf"),
            f"data.sources[{i}].weight: must be a positive number, got {src.weight}",
        )
        _require(
            src.format in typing.get_args(DataFormat),
            f"data.sources[{i}].format: must be one of "
            f"{' | '.join(typing.get_args(DataFormat))}, got {src.format!r}",
        )
    _require(
        not d.sources or d.format == "text",
        f"data.format: {d.format} is for data.source; give each [[data.sources]] table its own format",
    )
    _require(
        d.format == "text" or d.source != "stdlib",
        f"data.format: {d.format} needs a data.source of .jsonl/.parquet records, not the stdlib text",
    )


def _check_train_run(t: TrainConfig, r: RunConfig) -> None:
    """[train] loop numbers and the directories it resumes or starts from; [run] device and directory."""
    _require(t.steps >= 1, f"train.steps: must be >= 1, got {t.steps}")
    _require(r.preempt_grace_s >= 0, f"run.preempt_grace_s: must be >= 0, got {r.preempt_grace_s}")
    _require(
        0 <= r.straggler_pct < float("inf"),
        f"run.straggler_pct: must be >= 0 (0 = off), got {r.straggler_pct}",
    )
    window = re.fullmatch(r"\s*(\d+)(?:\s*-\s*(\d+))?\s*", r.profile_steps)
    first, last = (int(window[1]), int(window[2] or window[1])) if window else (0, 0)
    _require(
        not r.profile_steps.strip() or (window is not None and 1 <= first <= last <= t.steps),
        f"run.profile_steps: {r.profile_steps!r} must be a step or a range FIRST-LAST of steps in "
        f"[1, train.steps = {t.steps}], e.g. '10-12'",
    )
    _require(
        0 <= r.memory_snapshot_step <= t.steps,
        f"run.memory_snapshot_step: must be a step in [1, train.steps = {t.steps}] (0 = none), got "
        f"{r.memory_snapshot_step}",
    )
    unknown = [n for n in (t.strip() for t in r.trackers.split(",")) if n and n not in TRACKER_NAMES]
    _require(
        not unknown,
        f"run.trackers: unknown tracker {unknown[0] if unknown else ''!r}; choose from {', '.join(TRACKER_NAMES)} "
        "(comma-separated)",
    )
    _require(t.lr > 0, f"train.lr: must be > 0, got {t.lr}")
    _require(0 <= t.min_lr <= t.lr, f"train.min_lr: must be in [0, train.lr={t.lr}], got {t.min_lr}")
    _require(t.warmup_steps >= 0, f"train.warmup_steps: must be >= 0, got {t.warmup_steps}")
    _require(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "train.beta1/beta2: must be in [0, 1)")
    _require(t.grad_clip >= 0, f"train.grad_clip: must be >= 0 (0 = off), got {t.grad_clip}")
    _require(t.log_every >= 1, f"train.log_every: must be >= 1, got {t.log_every}")
    _require(t.eval_every >= 0, f"train.eval_every: must be >= 0, got {t.eval_every}")
    _require(t.checkpoint_every >= 0, f"train.checkpoint_every: must be >= 0, got {t.checkpoint_every}")
    _require(
        t.checkpoint_keep >= 0, f"train.checkpoint_keep: must be >= 0 (0 = all), got {t.checkpoint_keep}"
    )
    _require(
        not t.resume or Path(t.resume).is_dir(),
        f"train.resume: {t.resume!r} is not a directory (a run dir, its checkpoints/ or one checkpoint)",
    )
    _require(
        not t.init_from or Path(t.init_from).is_dir(),
        f"train.init_from: {t.init_from!r} is not a directory (a Loom run or checkpoint, or a Hugging Face model)",
    )
    _require(
        not (r.device == "cpu" and r.backend == "nccl"),
        "run.backend: nccl needs run.device = cuda; use gloo on cpu",
    )
    _require(  # the store and NCCL count whole seconds
        r.timeout_s >= 1, f"run.timeout_s: must be >= 1 (seconds), got {r.timeout_s:g}"
    )
    _require(r.dir.strip() != "", "run.dir: must name a directory (it holds checkpoints and metrics), got ''")
    _require(r.threads >= 0, f"run.threads: must be >= 0 (0 = automatic), got {r.threads}")


def model_facts(cfg: LoomConfig) -> ModelFacts:
    """What the layout rules need of ``cfg``'s model; its vocabulary, if known, names the field setting it."""
    m, e = cfg.model, cfg.moe
    moe = dict(moe_capacity=e.capacity_factor > 0, moe_router_losses=e.aux_loss_coef > 0 or e.z_loss_coef > 0)
    if m.vocab_size == 0 and not cfg.data.tokenizer:  # a tokenizer trained to data.vocab_size
        return ModelFacts.of(m, vocab_size=cfg.data.vocab_size, vocab_field="data.vocab_size", **moe)
    return ModelFacts.of(m, **moe)  # vocab_size 0: taken from a given tokenizer later


RECOMPUTE_HELP = f"{', '.join(typing.get_args(RecomputePolicy))} or every:<k> (k >= 1)"


COMPRESS_FORMATS: tuple[str, ...] = typing.get_args(CompressFormat)


COMPRESS_KINDS: tuple[str, ...] = typing.get_args(TensorKind)


def parse_recompute(spec: str) -> tuple[str, int]:
    """``train.recompute`` -> (policy, k): none/full/selective with k = 1, or ("every", k)."""
    if spec in typing.get_args(RecomputePolicy):
        return spec, 1
    head, _, k = spec.partition(":")
    _require(
        head == "every" and is_whole(k) and int(k) >= 1,
        f"train.recompute: must be one of {RECOMPUTE_HELP}, got {spec!r}",
    )
    return "every", int(k)


def parse_compress(spec: str) -> dict[str, str]:
    """``train.compress`` -> format per saved-tensor kind: "fp8" (every kind) or "mlp=fp8,attention=bf16"
    (kinds not named: none). Kinds: the module that saved the tensor (attention, mlp, norm, other)."""
    if "=" not in spec:
        _require(
            spec in COMPRESS_FORMATS,
            f"train.compress: must be one of {COMPRESS_FORMATS} or kind=format pairs "
            f"(kinds {COMPRESS_KINDS}), got {spec!r}",
        )
        return dict.fromkeys(COMPRESS_KINDS, spec)
    out = dict.fromkeys(COMPRESS_KINDS, "none")
    named: set[str] = set()
    for item in spec.split(","):
        kind, _, fmt = item.strip().partition("=")
        _require(
            kind in COMPRESS_KINDS, f"train.compress: unknown tensor kind {kind!r}; kinds: {COMPRESS_KINDS}"
        )
        _require(kind not in named, f"train.compress: {kind} is given twice in {spec!r}; give each kind once")
        named.add(kind)
        _require(fmt in COMPRESS_FORMATS, f"train.compress: {kind}={fmt!r}; formats: {COMPRESS_FORMATS}")
        out[kind] = fmt
    return out


def check_memory(cfg: LoomConfig) -> None:
    """Memory-technique fields (loss scaling, recomputation, compression, activation offload)."""
    t = cfg.train
    policy, k = parse_recompute(t.recompute)
    _require(
        policy != "every" or k <= cfg.model.n_layers,
        f"train.recompute: every:{k} checkpoints one block in {k}, but model.n_layers = {cfg.model.n_layers}",
    )
    _require_none(compress_layout_problem(parse_compress(t.compress), cfg.parallel.tp, cfg.parallel.cp))
    _require(t.loss_scale >= 0, f"train.loss_scale: must be >= 0 (0 = dynamic), got {t.loss_scale}")
    _require(t.loss_scale_init >= 1, f"train.loss_scale_init: must be >= 1, got {t.loss_scale_init}")
    _require(t.loss_scale_window >= 1, f"train.loss_scale_window: must be >= 1, got {t.loss_scale_window}")
    _require(
        t.loss_scale_hysteresis >= 1,
        f"train.loss_scale_hysteresis: must be >= 1, got {t.loss_scale_hysteresis}",
    )
    _require(
        0 < t.loss_scale_min <= t.loss_scale_init,
        f"train.loss_scale_min: must be in (0, train.loss_scale_init], got {t.loss_scale_min}",
    )
    _require(
        t.compile != "full" or t.compress == "none",
        f"train.compile: 'full' compiles the whole model, whose saved tensors inductor chooses and fuses, "
        f"so train.compress = {t.compress!r} cannot tell their kinds; use train.compile = blocks (regions)",
    )
    _require(
        t.compile != "full" or cfg.parallel.pp == 1 or cfg.parallel.schedule != "zb-h1",
        "train.compile: 'full' makes each stage one autograd node whose backward computes input and weight "
        "gradients together, so schedule 'zb-h1' would run it twice; use train.compile = blocks (regions)",
    )
    _require(
        not t.offload_activations or cfg.run.device != "cpu",
        "train.offload_activations: moves saved activations from GPU to pinned host memory; with "
        "run.device = cpu they are in host memory already (set it to false)",
    )


def check_param_server(cfg: LoomConfig) -> None:
    """``parallel.dp_mode = "ps"``: the parameter server's fields and the layouts it refuses (:mod:`loom.rules`).
    The parameter count is a lower bound: the layers' attention and two MLP matrices, and the embedding."""
    p, m = cfg.parallel, cfg.model
    if p.dp_mode != "ps":
        return
    vocab = m.vocab_size or (cfg.data.vocab_size if not cfg.data.tokenizer else 0)
    hd = m.head_dim
    n_params = (
        m.n_layers * m.dim * (hd * (2 * m.n_heads + 2 * m.n_kv_heads) + 2 * m.resolved_ffn_dim())
        + vocab * m.dim
    )
    _require_none(
        param_server_problem(
            shards=p.ps_shards,
            colocate=p.ps_colocate,
            sync=p.ps_sync,
            n_params=n_params,
            workers=p.dp,
            tp=p.tp,
            pp=p.pp,
            cp=p.cp,
            ep=p.ep,
            zero=p.zero,
            precision=cfg.train.precision,
            optimizer=cfg.train.optimizer,
            reduce_dtype=p.reduce_dtype,
            allreduce=p.allreduce,
        )
    )
    if not p.ps_colocate:  # what the dedicated-server run (loom.train.ps_run) does not do
        _require(
            cfg.train.time_limit_s == 0,
            "train.time_limit_s: dedicated parameter servers (parallel.ps_colocate = "
            "false) stop after the workers' last step; use train.steps (or co-located servers)",
        )
        _require(
            cfg.finetune.method == "full",
            f"finetune.method: {cfg.finetune.method} with dedicated parameter "
            "servers (parallel.ps_colocate = false) is not supported; use co-located servers or dp_mode = allreduce",
        )


def _check_ps_ranks(cfg: LoomConfig, world_size: int) -> int:
    """The rank-count rule of dedicated parameter servers (:func:`ps_servers`,
    :func:`loom.rules.server_ranks_problem`); returns the number of server ranks (0 without them)."""
    k = ps_servers(cfg)
    if k:
        _require_none(server_ranks_problem(world_size, servers=k, dp=cfg.parallel.dp))
    return k


def check_tensor_parallel(cfg: LoomConfig) -> None:
    """The shapes tensor parallelism splits (and, with sp, the sequence) divide by tp (:mod:`loom.rules`)."""
    p = cfg.parallel
    _require_none(tensor_parallel_problem(model_facts(cfg), p.tp, p.expert_tp))
    _require_none(sequence_parallel_problem(p.tp, p.cp, cfg.data.seq_len) if p.sp else None)


TRACKER_NAMES = ("tensorboard", "wandb", "mlflow")  # run.trackers (loom.train.trackers)


def _unwritable(path: str) -> str | None:
    """Why ``path`` cannot be used as a writable directory (None if it can, creating it if needed).

    Probes by creating a temporary file in ``path`` or, if it does not exist yet, in its nearest
    existing ancestor (permission bits alone lie for root and for read-only mounts).
    """
    probe = Path(path).expanduser()
    while not probe.exists() and probe.parent != probe:
        if probe.is_symlink():  # exists() follows links: a dangling one would fail at mkdir ("File exists")
            return f"{path!r} is not a writable directory ({str(probe)!r} is a dangling link to {os.readlink(probe)!r})"
        probe = probe.parent
    if not probe.is_dir():
        return f"{path!r} is not a writable directory ({str(probe)!r} is not a directory)"
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        return f"{path!r} is not a writable directory ({e.strerror or e})"
    return None


def check_new_output(out: Path, directory: bool, error: type[Exception] = ConfigError) -> None:
    """An output path a command is about to write (an export, generated scripts), checked before
    anything is read or written: Loom never replaces a file it did not write there, nor writes into
    a non-empty directory (``directory``: ``out`` is the directory to fill). Raises ``error``."""
    if directory:
        if out.is_symlink() or (out.exists() and not out.is_dir()):
            what = "is a symbolic link" if out.is_symlink() else "is a file, not a directory"
            raise error(
                f"{out}: {what}; choose a new directory (nothing was written; an existing file is never replaced)"
            )
        if out.exists() and any(out.iterdir()):
            raise error(f"{out}: exists and is not empty; choose a new directory (nothing was written)")
    elif out.exists() or out.is_symlink():
        what = "is a directory" if out.is_dir() else "exists"
        raise error(
            f"{out}: {what}; choose a new path (nothing was written; an existing file is never replaced)"
        )
    # where it will be written (the directory itself, or the file's), before any input is read
    problem = _unwritable(str(out if directory and out.is_dir() else out.parent))
    if problem is not None:
        raise error(f"{out}: cannot be written: {problem} (nothing was written)")


MAX_TRAINED_VOCAB = 1 << 24  # data.vocab_size: the tokenizer trainer's table then needs ~1.2 GB
PICTURE_FORMATS = ("png", "svg", "pdf")


def check_picture_path(option: str, path: str, formats: tuple[str, ...] = PICTURE_FORMATS) -> Path:
    """Where a command will draw a picture (``--plot``, ``--out``), checked before any work is done:
    a file name ending in one of ``formats`` (else matplotlib refuses it at the end, or a directory
    gets a file written beside it), that does not exist yet (an existing file is never replaced, as
    :func:`check_new_output` keeps it), in a directory that is or can become writable."""
    p = Path(path).expanduser()
    dotted = [f".{f}" for f in formats]
    allowed = " or ".join([", ".join(dotted[:-1]), dotted[-1]] if len(dotted) > 1 else dotted)
    _require(bool(path.strip()), f"{option}: empty; name a picture file ending in {allowed}")
    _require(not p.is_dir(), f"{option}: {path!r} is a directory; name a picture file ending in {allowed}")
    _require(p.suffix.lower().lstrip(".") in formats, f"{option}: {path!r} must end in {allowed}")
    _require(
        not (p.exists() or p.is_symlink()),
        f"{option}: {path!r} exists; choose a new path (nothing was written; an existing file is never replaced)",
    )
    problem = _unwritable(str(p.parent))
    _require(problem is None, f"{option}: cannot write {path!r}: {problem}")
    return p


def _check_zero3_options(p: ParallelConfig) -> None:
    """ZeRO-Infinity parameter offload and the ZeRO++ options are options of ZeRO-3 (:mod:`loom.rules`)."""
    _require_none(
        zero3_options_problem(
            zero=p.zero,
            offload_params=p.offload_params,
            qwz=p.zeropp_qwz,
            hpz=p.zeropp_hpz,
            qgz=p.zeropp_qgz,
            qgz_bits=p.zeropp_qgz_bits,
            hpz_group=p.hpz_group,
            dp_shard=p.dp_shard,
            cp=p.cp,
        )
    )


def check_intent(cfg: LoomConfig) -> None:
    """Explicit settings that a run would silently not honour (:func:`~loom.config.parse.explicit`):
    a warm-up of at least the whole run, set by the user (a file's warm-up counts unless an override
    shortened ``train.steps`` after it: a smoke run of a preset); a field that has no effect under the
    other settings (:func:`_without_effect`: LoRA's fields with ``finetune.method = full``, the
    parameter server's without ``dp_mode = ps``, ZeRO-3's and ZeRO++'s without them, ``offload_dir``
    without disk offload). Refused when given on the command line; a config file's own value (not the
    default a dumped config repeats) gets a one-line warning instead, as a config may serve several
    runs (a LoRA config trained once with ``--finetune.method full`` to compare)."""
    from loom.config.parse import explicit, overridden

    t, given, later = cfg.train, explicit(cfg), overridden(cfg)
    _require(
        not (cfg.data.sources and "data.source" in given),
        f"data.source: {cfg.data.source!r} is set, and so are {len(cfg.data.sources)} [[data.sources]] tables, "
        "which replace it; give one of the two",
    )
    shortened = "train.steps" in later and "train.warmup_steps" not in later
    _require(
        not ("train.warmup_steps" in given and t.warmup_steps >= t.steps and not shortened),
        f"train.warmup_steps: {t.warmup_steps} is not below train.steps = {t.steps}, so the learning rate "
        f"never reaches train.lr; give fewer warm-up steps (or more steps)",
    )
    _require(  # a config file's data.vocab_size (a preset's) beside a given tokenizer is fine: it serves runs without
        not ("data.vocab_size" in later and cfg.data.tokenizer and "data.tokenizer" in given),
        f"data.vocab_size: has no effect with data.tokenizer = {cfg.data.tokenizer!r} (its own vocabulary is "
        "the run's; data.vocab_size sizes a tokenizer trained here); leave data.vocab_size out "
        "(model.vocab_size may pad the tokenizer's)",
    )
    for name, setting, fix in _without_effect(cfg):
        section, key = name.split(".")
        value = getattr(getattr(cfg, section), key)
        _require(name not in later, f"{name}: has no effect with {setting}; {fix}")
        if name in given and value != getattr(
            SECTIONS[section](), key
        ):  # a config file's (not a dump's default)
            import logging

            logging.getLogger("loom").warning(
                "loom: warning: %s: the config's %r has no effect with %s; it is not used",
                name,
                value,
                setting,
            )


def _without_effect(cfg: LoomConfig) -> list[tuple[str, str, str]]:
    """(field, the setting under which it does nothing, how to fix) for each field that only one mode
    reads (LoRA's, the parameter server's, ZeRO-3's, disk offload's) while another is chosen."""
    p, f = cfg.parallel, cfg.finetune
    out: list[tuple[str, str, str]] = []
    if f.method == "full":
        for key in ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets"):
            out.append(
                (
                    f"finetune.{key}",
                    "finetune.method = full (it trains every weight, no adapters)",
                    "give finetune.method = lora or qlora, or leave it out",
                )
            )
    m = cfg.model
    rule = (
        "model.positions = learned (no RoPE)"
        if m.positions != "rope"
        else "model.rope_scaling = 0 (no long-context rule)"
        if not m.rope_scaling
        else f"model.rope_kind = {m.rope_kind} (another rule's number)"
    )
    for key in sorted(m.rope_idle_fields()):
        out.append((f"model.{key}", rule, "leave it out, or give the rule that reads it"))
    if p.dp_mode != "ps":
        for key in ("ps_shards", "ps_colocate", "ps_sync"):
            out.append(
                (
                    f"parallel.{key}",
                    f"parallel.dp_mode = {p.dp_mode} (no parameter servers)",
                    "give parallel.dp_mode = ps, or leave it out",
                )
            )
    if p.zero != 3:
        out.append(
            (
                "parallel.reshard_after_forward",
                f"parallel.zero = {p.zero} (an option of ZeRO-3)",
                "give parallel.zero = 3, or leave it out",
            )
        )
    if not (p.zero == 3 and p.zeropp_qgz):
        out.append(
            (
                "parallel.zeropp_qgz_bits",
                "parallel.zeropp_qgz off (the bits of ZeRO++ qgZ's gradients)",
                "give parallel.zeropp_qgz = true (with parallel.zero = 3), or leave it out",
            )
        )
    if not (p.zero == 3 and (p.zeropp_hpz or p.zeropp_qgz)):
        out.append(
            (
                "parallel.hpz_group",
                "parallel.zeropp_hpz and zeropp_qgz off (the ranks of one node, for ZeRO++ hpZ and qgZ)",
                "give parallel.zeropp_hpz or zeropp_qgz = true (with parallel.zero = 3), or leave it out",
            )
        )
    if "disk" not in (p.offload, p.offload_params):
        out.append(
            (
                "parallel.offload_dir",
                f"parallel.offload = {p.offload} and parallel.offload_params = {p.offload_params} "
                "(it holds disk offload's files)",
                "give parallel.offload or parallel.offload_params = disk, or leave it out",
            )
        )
    out += _idle_at_degree_one(cfg)
    d = cfg.data
    if d.format == "text" and not d.sources:
        for key in ("train_on_prompt", "overlong"):
            out.append(
                (
                    f"data.{key}",
                    "data.format = text (every token is trained; documents are cut into sequences)",
                    "give data.format = chat or prompt_completion, or leave it out",
                )
            )
    if d.sources:
        out.append(
            (
                "data.prepared_dir",
                "[[data.sources]] (each source is prepared into a cache directory of its own)",
                "leave it out",
            )
        )
    return out


def _idle_at_degree_one(cfg: LoomConfig) -> list[tuple[str, str, str]]:
    """Options of a parallel dimension, or of experts, set where that dimension has one rank or the model
    has no experts."""
    p, out = cfg.parallel, []
    for name, degree, dim in (
        ("sp", p.tp, "tp"),
        ("cp_mode", p.cp, "cp"),
        ("schedule", p.pp, "pp"),
        ("virtual_stages", p.pp, "pp"),
    ):
        if degree == 1:
            what = {"tp": "tensor", "cp": "context", "pp": "pipeline"}[dim]
            out.append(
                (
                    f"parallel.{name}",
                    f"parallel.{dim} = 1 (no {what} parallelism)",
                    f"give parallel.{dim} > 1, or leave it out",
                )
            )
    if not cfg.model.moe:
        for f in dataclasses.fields(cfg.moe):
            out.append(
                (
                    f"moe.{f.name}",
                    f"model.n_experts = {cfg.model.n_experts} (a dense MLP: no experts to route)",
                    "give model.n_experts > 1, or leave it out",
                )
            )
    return out


def check_vocab(cfg: LoomConfig, tokenizer_vocab: int) -> None:
    """An explicit model vocabulary must hold every token id of the tokenizer."""
    _require(
        cfg.model.vocab_size == 0 or cfg.model.vocab_size >= tokenizer_vocab,
        f"model.vocab_size: {cfg.model.vocab_size} is smaller than the tokenizer's {tokenizer_vocab}",
    )
