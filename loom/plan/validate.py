"""``loom plan validate``: run small layouts through the real trainer and compare with the planner.

Each layout is a ``python -m loom train`` subprocess on the debug model (a few steps, a small
corpus, no eval/TensorBoard) with its own ``--run.dir``. From its last ``metrics.jsonl`` row
(rank 0, i.e. the first pipeline stage) we take the step time (the fastest step after
the first two, warm-up, ones: see :func:`run_layout`) and the model-state bytes
``param_bytes + grad_bytes + optim_bytes``; the planner predicts the same two numbers for the
same config on :func:`~loom.plan.auto.local_cluster` with the calibration profile (scaled by
:func:`~loom.plan.hardware.profiles.contended` when ranks outnumber cores). Errors are
``(predicted - measured) / measured``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from loom.config import ArgParser, ConfigError, LoomConfig, check_picture_path, load, preset_path
from loom.config import validate as validate_config
from loom.parallel.base import held_state_bytes
from loom.plan.auto import predicted_fields
from loom.plan.comparison import MEMORY_TOLERANCE, TIME_TOLERANCE, Comparison
from loom.plan.cost import PlanError
from loom.plan.hardware import HardwareError, Profile, contended

REPO = Path(__file__).resolve().parents[2]
DEBUG_CONFIG = str(preset_path("debug"))

# (name, ranks, overrides): dp, ZeRO 1/2/3, tensor(+sequence), pipeline, recomputation, mixes,
# the memory-saving optimizers, an uneven pipeline split and expert parallelism.
LAYOUTS: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    ("dp1", 1, ()),
    ("dp1 recompute=full", 1, ("--train.recompute", "full")),
    ("dp2", 2, ()),
    ("dp2 zero1", 2, ("--parallel.zero", "1")),
    ("dp2 zero3", 2, ("--parallel.zero", "3")),
    ("tp2 sp", 2, ("--parallel.tp", "2", "--parallel.sp", "true")),
    ("pp2 1f1b", 2, ("--parallel.pp", "2")),
    ("cp2", 2, ("--parallel.cp", "2")),
    ("dp4 zero2", 4, ("--parallel.zero", "2")),
    ("dp2 tp2 zero1", 4, ("--parallel.tp", "2", "--parallel.sp", "true", "--parallel.zero", "1")),
    ("dp2 pp2", 4, ("--parallel.pp", "2")),
    ("dp2 pp2 zero3", 4, ("--parallel.pp", "2", "--parallel.zero", "3")),
    ("dp2 zero1 adafactor", 2, ("--parallel.zero", "1", "--train.optimizer", "adafactor")),
    ("dp1 adam8bit bf16", 1, ("--train.optimizer", "adam8bit", "--train.precision", "bf16")),
    ("pp2 uneven 2+3", 2, ("--model.n_layers", "5", "--parallel.pp", "2", "--parallel.pp_layout", "0-1,2-4")),
    ("dp2 moe ep2", 2, ("--model.n_experts", "4", "--parallel.ep", "2")),
)


def base_overrides(steps: int, corpus_mb: float | None = None) -> list[str]:
    """Short, quiet runs: ``steps`` steps, a metrics row every 2, no eval, no TensorBoard, one
    thread per rank (as calibrated; more threads than free cores make OpenMP spin)."""
    return [
        "--train.steps",
        str(steps),
        "--train.log_every",
        "1",
        "--train.eval_every",
        "0",
        "--train.warmup_steps",
        "1",
        "--run.tensorboard",
        "false",
        "--run.progress",
        "false",
        "--run.threads",
        "1",
    ] + (["--data.max_corpus_mb", str(corpus_mb)] if corpus_mb else [])


def absolute_config(config: str) -> str:
    """``config`` as the training subprocess must name it: a file path made absolute against this
    process's working directory (the subprocess runs in the repository), a preset name as given."""
    p = Path(config).expanduser()
    return str(p.resolve()) if p.is_file() or p.suffix == ".toml" else config


def run_layout(config: str, ranks: int, overrides: list[str], run_dir: str, timeout_s: float = 600) -> dict:
    """Train one layout in a subprocess; returns its last metrics row with ``step_time_s`` replaced by
    the fastest step after the first two (others' jobs on a shared machine only ever slow a step
    down; the minimum is the least disturbed) and ``step_times``, all of them. Raises with the run's
    stderr on failure."""
    cmd = [
        sys.executable,
        "-m",
        "loom",
        "train",
        absolute_config(config),
        "--nproc",
        str(ranks),
        "--run.dir",
        str(Path(run_dir).resolve()),
        *overrides,
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    metrics = Path(run_dir).resolve() / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"loom train {' '.join(overrides)} failed ({proc.returncode}):\n{tail}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    timed = (
        rows[2:] if len(rows) > 3 else rows[1:] or rows
    )  # the first steps warm up (allocator, autograd caches)
    times = [float(r["step_time_s"]) for r in timed]
    return rows[-1] | {"step_time_s": min(times), "step_times": times}


def config_of(config: str, ranks: int, overrides: list[str]) -> LoomConfig:
    return load(config, [*overrides, "--run.nproc", str(ranks)])


def compare(
    name: str, ranks: int, overrides: list[str], config: str, profile: Profile | None, runs: list[dict]
) -> Comparison:
    """Predict one layout and compare it with the fastest of ``runs`` (the last metrics row of
    each run, :func:`run_layout`), the median of all their steps beside it; the profile is scaled
    for contention at ``ranks``. A mixture of experts with ``moe.imbalance`` unset is predicted with
    that run's measured expert load (its ``moe_imbalance`` metric): how the router spreads tokens is
    the workload's, an input of the plan as the batch is, not a cost the planner could measure."""
    row = min(runs, key=lambda r: float(r["step_time_s"]))
    cfg = config_of(config, ranks, overrides)
    if cfg.model.n_experts > 1 and not cfg.moe.imbalance and float(row.get("moe_imbalance", 0.0)) >= 1:
        cfg.moe.imbalance = float(row["moe_imbalance"])
    prof = contended(profile, ranks) if profile is not None and profile.device == "cpu" else profile
    pred = predicted_fields(cfg, ranks, prof)
    return Comparison(
        name=name,
        ranks=ranks,
        pred_step_s=pred["plan_step_time_s"],
        meas_step_s=float(row["step_time_s"]),
        pred_state_bytes=pred["plan_state_bytes"],
        meas_state_bytes=float(held_state_bytes(row)),
        meas_median_s=statistics.median(t for r in runs for t in r["step_times"]),
    )


def format_comparisons(rows: list[Comparison]) -> str:
    """Aligned table with the two errors and a summary line."""
    head = (
        "layout",
        "ranks",
        "step pred s",
        "step meas s",
        "err",
        "median s",
        "state pred B",
        "state meas B",
        "err",
    )
    cells = [head] + [
        (
            r.name,
            str(r.ranks),
            f"{r.pred_step_s:.4f}",
            f"{r.meas_step_s:.4f}",
            f"{100 * r.time_error:+.1f}%",
            f"{r.meas_median_s:.4f}" if r.meas_median_s else "-",
            f"{r.pred_state_bytes:,.0f}",
            f"{r.meas_state_bytes:,.0f}",
            f"{100 * r.memory_error:+.2f}%",
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if rows:
        t_ok = sum(abs(r.time_error) <= TIME_TOLERANCE for r in rows)
        m_ok = sum(abs(r.memory_error) <= MEMORY_TOLERANCE for r in rows)
        errs = sorted(abs(r.time_error) for r in rows)
        mean_t, median_t = sum(errs) / len(errs), statistics.median(errs)
        lines.append(
            f"state memory within {MEMORY_TOLERANCE:.0%}: {m_ok}/{len(rows)}; step time within "
            f"{TIME_TOLERANCE:.0%}: {t_ok}/{len(rows)} (|error| median {100 * median_t:.1f}%, mean "
            f"{100 * mean_t:.1f}%, worst {100 * errs[-1]:.1f}%)"
        )
    return "\n".join(lines)


def validate(
    layouts=LAYOUTS,
    config: str = DEBUG_CONFIG,
    profile: Profile | None = None,
    steps: int = 12,
    corpus_mb: float = 0.5,
    workdir: str | None = None,
    echo=None,
    repeats: int = 1,
) -> list[Comparison]:
    """Run every layout ``repeats`` times, one round of all layouts after another (a slow spell of
    the machine then hits different layouts, not both runs of one), and compare each with its
    fastest run; ``echo`` gets each row when its last run finishes."""
    out = []
    runs: list[list[dict]] = [[] for _ in layouts]
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for r in range(max(1, repeats)):
            for i, (name, ranks, extra) in enumerate(layouts):
                ov = [*base_overrides(steps, corpus_mb), *extra]
                runs[i].append(run_layout(config, ranks, ov, str(Path(tmp) / f"run{i}-{r}")))
                if r == max(1, repeats) - 1:
                    c = compare(name, ranks, ov, config, profile, runs[i])
                    out.append(c)
                    if echo is not None:
                        echo(c)
    return out


# the options of the local runs, and those of --published: each refused in the other mode (it would do nothing)
LOCAL_OPTIONS = ("--profile", "--config", "--steps", "--repeats", "--corpus-mb", "--only", "--plot")
PUBLISHED_OPTIONS = ("--runs", "--sources", "--fit")


def check_options(args) -> None:
    """Refuse an option the mode given does not read, and bad values, before any run starts; fill in
    the local runs' defaults. Raises :class:`ConfigError` naming the option."""
    given = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in LOCAL_OPTIONS + PUBLISHED_OPTIONS}
    if args.published:
        extra = [f for f in LOCAL_OPTIONS if given[f] is not None]
        if extra:
            raise ConfigError(
                f"{extra[0]}: not with --published (it predicts published runs from the shipped constants; "
                f"no local run, profile or picture); its options: {', '.join(PUBLISHED_OPTIONS)}, --json"
            )
        for flag, why in (("--sources", "each JSON row has its source"), ("--fit", "its report is text")):
            if args.json and given[flag]:
                raise ConfigError(f"{flag}: not with --json ({why})")
        return
    extra = [f for f in PUBLISHED_OPTIONS if given[f]]
    if extra:
        raise ConfigError(f"{extra[0]} needs --published (it has no effect on local runs)")
    args.config = DEBUG_CONFIG if args.config is None else args.config
    args.steps = 12 if args.steps is None else args.steps
    args.repeats = 3 if args.repeats is None else args.repeats
    args.corpus_mb = 0.5 if args.corpus_mb is None else args.corpus_mb
    for flag, value in (("--steps", args.steps), ("--repeats", args.repeats)):
        if value < 1:  # before any training run starts
            raise ConfigError(f"{flag}: must be >= 1, got {value}")
    if not (math.isfinite(args.corpus_mb) and args.corpus_mb > 0):
        raise ConfigError(f"--corpus-mb: must be a number > 0, got {args.corpus_mb}")
    if args.plot:
        check_picture_path("--plot", args.plot)
    unknown = [n for n in args.only or () if n not in {name for name, _, _ in LAYOUTS}]
    if unknown:
        raise ConfigError(
            f"--only: no layout named {unknown[0]!r}; layouts: {', '.join(n for n, _, _ in LAYOUTS)}"
        )
    if args.profile:
        try:  # a missing or bad profile before the runs, not after them
            Profile.load(args.profile)
        except HardwareError as e:
            raise ConfigError(f"--profile: {e}") from None


def check_layouts(args) -> list[tuple[str, int, tuple[str, ...]]]:
    """The layouts ``--only`` names (all without it), each with ``--config`` read and validated as
    its training run will (``args.config`` made absolute: the runs start in the repository)."""
    given, args.config = args.config, absolute_config(args.config)
    try:
        load(args.config, [])  # exists, is UTF-8 TOML, holds known fields
    except ConfigError as e:
        raise ConfigError(f"--config {given}: {e}") from None
    layouts = [lay for lay in LAYOUTS if not args.only or lay[0] in args.only]
    for name, ranks, extra in layouts:
        try:
            cfg = config_of(args.config, ranks, [*base_overrides(args.steps, args.corpus_mb), *extra])
            validate_config(copy.deepcopy(cfg), ranks)
        except ConfigError as e:
            hint = "" if args.only else "; choose layouts with --only"
            raise ConfigError(
                f"--config {given}: layout {name!r} ({ranks} rank{'s' if ranks > 1 else ''}): {e}{hint}"
            ) from None
    return layouts


def main(argv: list[str]) -> int:
    """``loom plan validate [--profile p.json] [--config debug.toml] [--steps N] [--only NAME ...] [--json] [--plot f.png]``,
    or ``loom plan validate --published [--sources] [--json]`` (no runs: the published-run table)."""
    p = ArgParser(prog="loom plan validate", description="predicted vs measured on local runs")
    p.add_argument(
        "--profile",
        help="calibration profile (loom plan calibrate); default: ./profile.json if present, else the datasheet",
    )
    p.add_argument("--config", help="base training config (default: configs/debug.toml)")
    p.add_argument("--steps", type=int, help="optimizer steps per run (each timed; default 12)")
    p.add_argument("--repeats", type=int, help="runs per layout; the fastest counts (default 3)")
    p.add_argument("--corpus-mb", type=float, help="data.max_corpus_mb of the runs (default 0.5)")
    p.add_argument("--only", nargs="+", help=f"layout names: {', '.join(n for n, _, _ in LAYOUTS)}")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--plot", help="also draw predicted vs measured bars into this PNG (local runs only)")
    p.add_argument(
        "--published",
        action="store_true",
        help="instead: predicted vs published TFLOP/s per GPU of the runs in loom/plan/validation/*.toml",
    )
    p.add_argument(
        "--runs",
        nargs="+",
        metavar="FILE",
        help="with --published: your own runs instead, TOML files in the format of loom/plan/validation/*.toml "
        "(docs/planner.md), predicted with the shipped constants",
    )
    p.add_argument("--sources", action="store_true", help="with --published: also list each run's source")
    p.add_argument(
        "--fit",
        action="store_true",
        help="with --published: refit the fitted constants, and predict each file's runs from the others",
    )
    args = p.parse_args(argv)
    try:
        check_options(args)
        layouts = [] if args.published else check_layouts(args)
    except (ConfigError, HardwareError) as e:
        print(f"loom plan validate: error: {e}", file=sys.stderr)
        return 2
    if args.published:
        from loom.plan.published import (
            MAX_TOLERANCE,
            MEAN_TOLERANCE,
            compare_published,
            format_published,
            load_files,
            sources,
            summary,
        )

        try:
            given = load_files([Path(f) for f in args.runs]) if args.runs else None
            published = compare_published(given)
        except PlanError as e:
            print(f"loom plan validate: error: {e}", file=sys.stderr)
            return 2
        if args.json:
            print(
                json.dumps(
                    [
                        {
                            "name": r.run.name,
                            "gpus": r.run.gpus,
                            "layout": r.run.layout.spec(),
                            "stack": r.run.stack,
                            "predicted_tflops": r.estimate.tflops_per_device,
                            "published_tflops": r.published_tflops,
                            "error": r.error,
                            "source": r.run.source,
                        }
                        for r in published
                    ]
                )
            )
        else:
            print(format_published(published))
            if args.sources:
                print(sources([r.run for r in published]))
            if args.fit:
                from loom.plan.fit import current, errors, fit, leave_one_source_out, per_source

                runs = [r.run for r in published] + (
                    [r.run for r in compare_published()] if args.runs else []
                )
                now = current(runs)
                refit = fit(runs, now)
                errs = [abs(e) for e in errors(runs, refit)]
                print("constants now:  " + ", ".join(f"{k}={v:.3g}" for k, v in now.items()))
                print(
                    "refit:          "
                    + ", ".join(f"{k}={v:.3g}" for k, v in refit.items())
                    + f"  (mean {100 * sum(errs) / len(errs):.1f}%, max {100 * max(errs):.1f}%)"
                )
                held_rows = leave_one_source_out(runs)
                held = [abs(e) for _, e in held_rows]
                for g, (n, mean_g, worst_g) in per_source(held_rows).items():
                    print(f"  {g}: {n} runs, held out mean {100 * mean_g:.1f}%, max {100 * worst_g:.1f}%")
                print(
                    f"each source predicted from constants fitted on the others (from neutral starts): "
                    f"mean {100 * sum(held) / len(held):.1f}%, max {100 * max(held):.1f}%"
                )
        mean, worst = summary(published)
        return 0 if mean <= MEAN_TOLERANCE and worst <= MAX_TOLERANCE else 1
    profile = Profile.load(args.profile) if args.profile else None
    t0 = time.perf_counter()

    def echo(c: Comparison) -> None:
        if not args.json:
            print(
                f"  {c.name}: step {c.pred_step_s:.4f} vs {c.meas_step_s:.4f} s ({100 * c.time_error:+.1f}%; "
                f"median step {c.meas_median_s:.4f} s), "
                f"state {100 * c.memory_error:+.2f}%",
                flush=True,
            )

    rows = validate(
        layouts, args.config, profile, args.steps, args.corpus_mb, echo=echo, repeats=args.repeats
    )
    if args.json:
        print(
            json.dumps(
                [asdict(r) | {"time_error": r.time_error, "memory_error": r.memory_error} for r in rows]
            )
        )
    else:
        print(format_comparisons(rows))
    if args.plot:  # with --json the note goes to stderr, stdout stays JSON
        from loom.plan.viz import draw_validation

        print(f"wrote {draw_validation(rows, args.plot)}", file=sys.stderr if args.json else sys.stdout)
    if not args.json:
        print(
            f"profile: {args.profile or 'default (./profile.json or datasheet)'}; "
            f"{time.perf_counter() - t0:.0f} s"
        )
    return 0 if all(abs(r.memory_error) <= MEMORY_TOLERANCE for r in rows) else 1
