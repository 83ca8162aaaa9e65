"""Cluster scheduling in simulation: the headline comparisons of Gavel and Pollux on Loom's planner.

1. Gavel (OSDI 2020), heterogeneity-aware LAS against heterogeneity-agnostic LAS on a mixed cluster of
   36 V100 + 36 P100 + 36 K80 (Gavel's simulated cluster), synthetic traces (Poisson arrivals at
   several rates, Gavel's duration and size distributions, Loom models whose speeds come from the
   planner), averaged over seeds. The paper reports up to 3.5x lower average JCT.
2. Pollux (OSDI 2021), goodput-adaptive allocation and batch size against fixed allocations (LAS /
   Tiresias with the requested devices and batch) on 64 V100s (16 nodes of 4). The paper reports
   37-50% lower average JCT.

Draws docs/cluster/*.png and writes docs/results/cluster.md.

    python benchmarks/bench_cluster.py [--jobs 200] [--seeds 1] [--rates 4,8,16,32] [--pollux-rates 20,40] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import add_no_write, write_results  # noqa: E402

from loom.cluster import DEFAULT_CLUSTER, Cluster, Result, make_policy, simulate, synthetic_trace  # noqa: E402
from loom.cluster.cli import draw_cdf  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"
GAVEL = ("fifo", "las", "gavel-las", "gavel-maxmin", "gavel-makespan", "gavel-ftf")
POLLUX = ("fifo", "las", "pollux")
POLLUX_CLUSTER = Cluster({"v100": 64}, devices_per_node=4)


def run(jobs, cluster: Cluster, names) -> list[Result]:
    return [simulate(jobs, cluster, make_policy(n)) for n in names]


def table(rows: dict[str, list[dict]], base: str) -> str:
    """Mean over seeds of each metric per policy, and avg JCT relative to ``base``."""
    lines = [
        "| policy | avg JCT (h) | p99 JCT (h) | makespan (h) | utilization | fairness (Jain) | max FTF | "
        f"avg JCT vs {base} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ref = statistics.mean(s["avg_jct"] for s in rows[base])
    for name, runs in rows.items():
        m = {k: statistics.mean(float(s[k]) for s in runs) for k in runs[0] if k not in ("policy", "jobs")}
        lines.append(
            f"| {name} | {m['avg_jct'] / 3600:.2f} | {m['p99_jct'] / 3600:.2f} | {m['makespan'] / 3600:.1f} | "
            f"{m['utilization']:.1%} | {m['fairness']:.3f} | {m['max_ftf']:.1f} | {ref / m['avg_jct']:.2f}x |"
        )
    return "\n".join(lines)


def draw_load(points: dict[str, list[tuple[float, float]]], out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name, pts in points.items():
        ax.plot([p[0] for p in pts], [p[1] / 3600 for p in pts], marker="o", label=name)
    ax.set_xlabel("arrival rate (jobs/hour)")
    ax.set_ylabel("average JCT (hours)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("36 V100 + 36 P100 + 36 K80, synthetic traces", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--rates", default="4,8,16,32", help="Gavel part: arrival rates, jobs/hour")
    ap.add_argument("--pollux-jobs", type=int, default=160, help="Pollux part: jobs (the paper's trace: 160)")
    ap.add_argument("--pollux-rates", default="20,40", help="Pollux part: jobs/hour (its trace: 160 in 8 h)")
    add_no_write(ap)
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    (DOCS / "cluster").mkdir(exist_ok=True)
    body = []
    t0 = time.perf_counter()

    body.append("## Gavel: heterogeneity-aware against agnostic LAS\n")
    body.append(
        f"{args.jobs} jobs per trace, {args.seeds} seed(s) per rate, cluster 36 v100 + 36 p100 + 36 k80 "
        "(4 per node), rounds of 360 s, 15 s lost per placement change. Throughputs from the planner "
        "(fastest layout on n devices of each type).\n"
    )
    load: dict[str, list[tuple[float, float]]] = {n: [] for n in GAVEL}
    ratios = []
    last: list[Result] = []
    for rate in rates:
        rows: dict[str, list[dict]] = {n: [] for n in GAVEL}
        for seed in range(args.seeds):
            jobs = synthetic_trace(args.jobs, rate, seed)
            results = run(jobs, DEFAULT_CLUSTER, GAVEL)
            for r in results:
                rows[r.policy].append(r.summary())
            last = results
        for n in GAVEL:
            load[n].append((rate, statistics.mean(float(s["avg_jct"]) for s in rows[n])))
        ratio = statistics.mean(float(s["avg_jct"]) for s in rows["las"]) / statistics.mean(
            float(s["avg_jct"]) for s in rows["gavel-las"]
        )
        ratios.append((rate, ratio))
        body.append(f"### {rate:g} jobs/hour\n\n{table(rows, 'las')}\n")
        print(f"gavel part: rate {rate:g} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    draw_load(load, DOCS / "cluster" / "gavel-load.png")
    draw_cdf(
        last,
        DOCS / "cluster" / "gavel-cdf.png",
        f"{args.jobs} jobs at {rates[-1]:g}/h, seed {args.seeds - 1}",
    )
    body.append(
        "Average JCT of agnostic LAS over heterogeneity-aware LAS (gavel-las): "
        + ", ".join(f"{r:.2f}x at {rate:g} jobs/h" for rate, r in ratios)
        + " (paper: up to 3.5x).\n\n"
        "![average JCT against load](../cluster/gavel-load.png)\n\n"
        "![JCT CDF, highest load](../cluster/gavel-cdf.png)\n"
    )

    body.append("## Pollux: goodput-adaptive against fixed allocations\n")
    body.append(
        f"{args.pollux_jobs} jobs per trace, {args.seeds} seed(s) per rate, 64 v100 (4 per node); run times on "
        "the requested V100s of 10^x minutes, x uniform on [1, 2.5] (10 min to 5 h, no long tail: Pollux's "
        "trace is hours, not days). Fixed: each job its requested devices at its base batch (fifo; las = "
        "Tiresias). Pollux: devices, batch (up to 16x) and learning rate chosen for goodput; B_noise from "
        "the trace.\n"
    )
    cuts = []
    for rate in [float(r) for r in args.pollux_rates.split(",")]:
        rows = {n: [] for n in POLLUX}
        for seed in range(args.seeds):
            jobs = synthetic_trace(args.pollux_jobs, rate, seed, short=(1.0, 2.5), long_share=0.0)
            last = run(jobs, POLLUX_CLUSTER, POLLUX)
            for r in last:
                rows[r.policy].append(r.summary())
        cut = 1 - statistics.mean(float(s["avg_jct"]) for s in rows["pollux"]) / statistics.mean(
            float(s["avg_jct"]) for s in rows["las"]
        )
        cuts.append((rate, cut))
        body.append(f"### {rate:g} jobs/hour\n\n{table(rows, 'las')}\n")
        print(f"pollux part: rate {rate:g} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    draw_cdf(last, DOCS / "cluster" / "pollux-cdf.png", f"{args.pollux_jobs} jobs on 64 v100 at {rate:g}/h")
    body.append(
        "Pollux's average JCT against LAS with fixed allocations: "
        + ", ".join(f"{c:.0%} lower at {rate:g} jobs/h" for rate, c in cuts)
        + " (paper: 37-50% lower).\n\n![JCT CDF, highest load](../cluster/pollux-cdf.png)\n"
    )
    body.append(f"Simulated in {time.perf_counter() - t0:.0f} s.\n")
    text = "\n".join(body)
    print(text)
    if not args.no_write:
        print(write_results("cluster", "Cluster scheduling (simulated)", text), file=sys.stderr)


if __name__ == "__main__":
    main()
