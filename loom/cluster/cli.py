"""``loom cluster simulate``: policies over a trace on a cluster, a table (or JSON) and a JCT CDF picture."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from loom.cluster.formats import (
    DEFAULT_CLUSTER,
    Cluster,
    check_runnable,
    load_cluster,
    load_trace,
    synthetic_trace,
)
from loom.cluster.jobs import ClusterError
from loom.cluster.policies import POLICIES, make_policy
from loom.cluster.run import add_parser as add_run_parser
from loom.cluster.run import main_run
from loom.cluster.simulate import Result, simulate
from loom.cluster.slurm import add_parser as add_slurm_parser
from loom.cluster.slurm import main_slurm
from loom.config import ArgParser, ConfigError, check_picture_path
from loom.plan import HardwareError

SYNTHETIC_MAX_JOBS = 100_000  # jobs of a synthetic trace (0.5 GB, about 20 minutes per policy)


def parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="loom cluster", description="Multi-job scheduling on a shared cluster")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("simulate", help="simulate scheduling policies over a job trace")
    s.add_argument("--cluster", help="cluster file (TOML/JSON; default: 36 v100 + 36 p100 + 36 k80)")
    s.add_argument("--trace", required=True, help="trace file (TOML/JSON) or 'synthetic'")
    s.add_argument(
        "--policy", action="append", help=f"repeatable; one of {', '.join(POLICIES)} (default: all)"
    )
    s.add_argument("--jobs", type=int, default=60, help="synthetic: number of jobs (default 60)")
    s.add_argument("--rate", type=float, default=6.0, help="synthetic: arrivals per hour (default 6)")
    s.add_argument("--seed", type=int, default=0, help="synthetic: seed of the trace (default 0)")
    s.add_argument("--json", action="store_true", help="print a JSON list, one object per policy")
    s.add_argument("--plot", help="write the JCT CDF picture (PNG) here")
    add_run_parser(sub)  # loom cluster run: real jobs on this machine (loom/cluster/run.py)
    add_slurm_parser(sub)  # loom cluster slurm: sbatch scripts / Kubernetes Jobs (loom/cluster/slurm.py)
    return p


def draw_cdf(results: list[Result], out: str | Path, title: str = "") -> Path:
    """Empirical CDF of JCT (hours, log x) per policy."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for r in results:
        x = sorted(v / 3600 for v in r.jct.values())
        ax.step(
            x,
            [(i + 1) / len(x) for i in range(len(x))],
            where="post",
            label=f"{r.policy} (avg {r.avg_jct / 3600:.1f} h)",
        )
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (hours)")
    ax.set_ylabel("fraction of jobs")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def run(args: argparse.Namespace) -> int:
    if args.plot:  # before the simulation: the picture is drawn last
        check_picture_path("--plot", args.plot)
    cluster: Cluster = load_cluster(args.cluster) if args.cluster else DEFAULT_CLUSTER
    names = args.policy or list(POLICIES)
    policies = [make_policy(n) for n in names]  # unknown names refused before anything runs
    if args.trace == "synthetic":
        if not 1 <= args.jobs <= SYNTHETIC_MAX_JOBS:
            raise ClusterError(
                f"--jobs: must be in [1, {SYNTHETIC_MAX_JOBS:,}] (about 5 KB and 13 ms of simulation per job "
                f"and policy), got {args.jobs}"
            )
        if not (math.isfinite(args.rate) and args.rate > 0):
            raise ClusterError(f"--rate: must be a finite number of arrivals per hour > 0, got {args.rate}")
        jobs, where = synthetic_trace(args.jobs, args.rate, args.seed), "synthetic trace"
    else:
        jobs, where = load_trace(args.trace), args.trace
    check_runnable(jobs, cluster, where)
    try:
        results = [simulate(jobs, cluster, p) for p in policies]
    except ClusterError as e:  # the events cap: which file's job keeps it going
        raise ClusterError(f"{where}: {e}") from None
    if args.json:
        print(json.dumps([r.summary() for r in results], indent=1))
    else:
        print(f"{len(jobs)} jobs on {', '.join(f'{n} {t}' for t, n in cluster.devices.items())}")
        print(
            f"{'policy':<16}{'avg JCT h':>10}{'p99 JCT h':>10}{'makespan h':>11}{'util':>7}{'fairness':>9}{'max FTF':>8}"
        )
        for r in results:
            s = r.summary()
            print(
                f"{r.policy:<16}{r.avg_jct / 3600:>10.2f}{r.p99_jct / 3600:>10.2f}{r.makespan / 3600:>11.2f}"
                f"{r.utilization:>7.1%}{s['fairness']:>9.3f}{s['max_ftf']:>8.2f}"
            )
    if args.plot:
        path = draw_cdf(results, args.plot, f"{len(jobs)} jobs")
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        return {"run": main_run, "slurm": main_slurm}.get(args.cmd, run)(args)
    except (ClusterError, HardwareError, ConfigError) as e:
        print(f"loom: error: {e}", file=sys.stderr)
        return 2
