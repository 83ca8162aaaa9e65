"""``loom plan``: check a training config against a cluster and rank the layouts that fit.

    loom plan --config run.toml [--cluster cpu-local] [--world N] [--top K] [--json] [--section.key value ...]
    loom plan --model llama3-70b --cluster h100-sxm:128x8 --seq 8192 --global-batch 1024 [--explain 1]
    loom plan calibrate [--out profile.json] [--nproc N] [--config run.toml]   measure this machine
    loom plan validate [--profile profile.json]   predicted vs measured on local debug-model runs
    loom plan verify --config C --devices N --device D [--layout best|LINE] [--rank R] [--seq S]
                                                  one rank of an N-device job, built and stepped here

``--cluster`` takes a TOML path, a name in ``loom/configs/clusters`` or ``DEVICE:NODESxPER``;
``--device NAME`` with ``--world N`` builds nodes of up to 8 such devices. Exit status: 0 when the
config's layout fits or some layout fits (the config's own explained in one line when it does
not), 1 when nothing fits, 2 on bad input. ``--json``: the whole answer as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import cast

from loom.config import (
    MAX_BATCH_OR_SEQ,
    MODEL_SIZE_BOUNDS,
    ArgParser,
    ConfigError,
    ModelConfig,
    Precision,
    check_picture_path,
    load,
    load_toml,
    preset_path,
    presets,
    validate_shape,
)
from loom.plan.cost import Estimate, PlanError, Workload
from loom.plan.hardware import (
    DEVICES,
    MAX_DEVICES,
    ClusterSpec,
    HardwareError,
    Profile,
    auto_precision,
    known_clusters,
    resolve_cluster,
)
from loom.plan.report import (
    config_verdict,
    dropped_rows,
    format_breakdown,
    format_search,
    model_of,
    workload_of,
)
from loom.plan.search import search


def _preset_models() -> dict[str, ModelConfig]:
    """Model shapes of the shipped presets (``loom/configs/*.toml``), vocabulary resolved."""
    return {name: model_of(load_toml(preset_path(name))) for name in presets()}


MODELS: dict[str, ModelConfig] = _preset_models()


def _parser() -> argparse.ArgumentParser:
    p = ArgParser(
        prog="loom plan",
        description=__doc__.split("\n")[0],
        epilog="subcommands (each with its own --help): loom plan calibrate (measure this machine into a "
        "profile), loom plan validate (predictions against real runs here, or --published runs), loom plan "
        "verify (build and step one rank of a large job; its real peak against the planner's)",
        allow_abbrev=False,
    )
    p.add_argument("--config", help="a Loom TOML config: check its layout, search its model/batch")
    p.add_argument("--model", help=f"a model preset: {', '.join(MODELS)} (without --config)")
    p.add_argument("--cluster", help=f"TOML file, one of {', '.join(known_clusters())}, or DEVICE:NODESxPER")
    p.add_argument("--device", help=f"build a cluster of this device ({', '.join(DEVICES)}), 8 per node")
    p.add_argument("--world", "--devices", type=int, dest="world", help="devices to plan for (default: all)")
    p.add_argument("--seq", type=int, help="sequence length (with --model; default 8192)")
    p.add_argument("--global-batch", type=int, help="sequences per step (with --model; default 1024)")
    p.add_argument(
        "--precision",
        help="fp32 | tf32 | bf16 | fp16 | fp8 | int8 (with --model; default: as train.precision = auto on the "
        "device: bf16, fp16 without bf16 tensor cores, fp32 on the CPU)",
    )
    p.add_argument(
        "--experts", type=int, default=None, help="MoE experts per layer (1 = dense; default: the model's)"
    )
    p.add_argument("--top-k", type=int, default=None, help="experts per token (MoE; default: the model's)")
    p.add_argument("--profile", help="a calibration profile (JSON) that overrides the datasheet numbers")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--explain", type=int, default=0, metavar="RANK", help="print the breakdown of this row")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", metavar="FILE", help="write memory bars + throughput vs memory (PNG or SVG)")
    return p


def cluster_of(args: argparse.Namespace, default: str) -> ClusterSpec:
    """The cluster of ``--cluster`` or ``--device``/``--world`` (``default`` without either)."""
    for flag, value in (("--device", args.device), ("--cluster", args.cluster)):
        if value is not None and not value.strip():  # an empty value would plan the default cluster
            raise HardwareError(f"{flag}: empty; give a device or cluster name (see loom plan --help)")
    if args.cluster and args.device:  # the cluster names its own device: --device would be ignored
        raise HardwareError(
            f"--device {args.device} and --cluster {args.cluster}: both given; give one (a cluster names its "
            "device: DEVICE:NODESxPER)"
        )
    if args.cluster:
        return resolve_cluster(args.cluster)
    if args.device:
        n = args.world or 8
        if n > MAX_DEVICES:
            raise HardwareError(f"--devices {n}: the planner takes at most {MAX_DEVICES:,} devices")
        per = min(8, n)
        if n % per:
            raise HardwareError(
                f"--devices {n}: not a whole number of {per}-device nodes (--device builds nodes of 8; "
                "--cluster DEVICE:NODESxPER gives others)"
            )
        return ClusterSpec.single_node(args.device, per, n // per)
    return resolve_cluster(default)


def _json_estimate(e: Estimate | None) -> dict | None:
    return None if e is None else e.to_dict()


SUBCOMMANDS = ("calibrate", "validate")


def _named_model_flags(args: argparse.Namespace) -> list[tuple[str, object]]:
    """The flags that describe a ``--model NAME`` run, and their values (None: not given)."""
    return [
        ("--model", args.model),
        ("--seq", args.seq),
        ("--global-batch", args.global_batch),
        ("--precision", args.precision),
    ]


def main(argv: list[str]) -> int:
    if argv and argv[0] in SUBCOMMANDS:  # loom plan calibrate | validate: their own options
        if argv[0] == "calibrate":
            from loom.plan.calibrate import main as sub
        else:
            from loom.plan.validate import main as sub
        return sub(argv[1:])
    parser = _parser()
    args, overrides = parser.parse_known_args(argv)
    for flag, value, low in (
        ("--devices", args.world, 1),  # --devices 0 would plan for the whole cluster instead
        ("--top", args.top, 1),
        ("--seq", args.seq, 1),
        ("--global-batch", args.global_batch, 1),
        ("--experts", args.experts, 1),
        ("--top-k", args.top_k, 1),
        ("--explain", args.explain, 0),
    ):
        if value is not None and value < low:
            parser.error(f"{flag}: must be >= {low}, got {value}")
    for flag, value in (("--seq", args.seq), ("--global-batch", args.global_batch)):
        if value is not None and value > MAX_BATCH_OR_SEQ:  # the search enumerates their divisors
            parser.error(f"{flag}: at most {MAX_BATCH_OR_SEQ:,} (2^24), got {value:,}")
    most, published = MODEL_SIZE_BOUNDS["n_experts"]  # as model.n_experts
    for flag, value in (("--experts", args.experts), ("--top-k", args.top_k)):
        if value is not None and value > most:
            parser.error(f"{flag}: at most {most:,} (published models: {published}), got {value:,}")
    try:
        if args.plot:  # before the search: the picture is drawn last
            check_picture_path("--plot", args.plot)
        profile = Profile.load(args.profile) if args.profile else None
        check = None
        if args.config or overrides:
            named = [f for f, v in _named_model_flags(args) if v is not None]
            if named:  # they describe a named model's run; a config describes its own
                given = f"--config {args.config}" if args.config else f"{overrides[0]} (a config option)"
                raise PlanError(
                    f"{', '.join(named)}: these describe a --model NAME's run, and {given} plans a config's "
                    "run; give the config's fields as --section.key options (--model.dim, --data.seq_len, "
                    "--train.global_batch, --train.precision) or plan --model NAME without them"
                )
            cfg = load(args.config, overrides)
            if cfg.model.from_hf:  # the directory's model, as loom train would run it
                from loom.model.hf import resolve_from_hf

                resolve_from_hf(cfg, need_data=False)
            cluster = cluster_of(args, "cpu-local")
            automatic = cfg.train.precision == "auto"
            validate_shape(
                cfg
            )  # bad values are refused, not priced (the layout is judged against the cluster)
            if automatic:  # as the trainer resolves it on the planned device, not on this machine
                cfg.train.precision = cast(Precision, auto_precision(cluster.device))
            check = config_verdict(cfg, cluster, profile)
            model, train = model_of(cfg), workload_of(cfg)
        else:
            if not args.model:
                parser.error("give --config FILE or --model NAME")
            if args.model not in MODELS:
                raise PlanError(f"unknown model {args.model!r}; known: {', '.join(MODELS)}")
            cluster = cluster_of(args, "h100-8x8")
            model = MODELS[args.model]
            precision = args.precision or auto_precision(cluster.device)
            train = Workload(args.global_batch or 1024, args.seq or 8192, precision=precision)
        result = search(
            model, train, cluster, args.world, profile=profile, n_experts=args.experts, top_k=args.top_k
        )
    except (ConfigError, PlanError, HardwareError) as e:
        print(f"loom plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = {
            "cluster": cluster.name,
            "world": result.world,
            "check": None if check is None else {"fits": check[0], "message": check[1]},
            "ranked": [e.to_dict() for e in result.ranked[: args.top]],
            "fitting": len(result.ranked),
            "rejected": dict(result.rejected),
            "dropped": dropped_rows(result),
            "closest": _json_estimate(result.closest) if not result.ranked else None,
            "elapsed_s": result.elapsed_s,
        }
        print(json.dumps(out, indent=2, default=str))
    else:
        print(
            f"cluster {cluster.name}: {cluster.nodes} x {cluster.devices_per_node} {cluster.device.name}, "
            f"{train.precision}"
        )
        if check is not None:
            print(check[1])
        if check is not None and not check[0] and not result.ranked:
            print("\n".join(format_search(result, args.top).split("\n")[1:]))  # the check already explained
        else:
            print(format_search(result, args.top))
        if args.explain:
            if not 1 <= args.explain <= len(result.ranked):
                print(
                    f"loom plan: error: --explain {args.explain}: only {len(result.ranked)} rows",
                    file=sys.stderr,
                )
                return 2
            print(format_breakdown(result.ranked[args.explain - 1]))
    if args.plot and result.ranked:
        from loom.plan.viz import draw_search

        print(
            f"wrote {draw_search(result.ranked, args.plot, args.top)}",
            file=sys.stderr if args.json else sys.stdout,
        )
    if check is not None and check[0]:
        return 0
    return 0 if result.ranked else 1
