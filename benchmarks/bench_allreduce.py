"""All-reduce algorithms on point-to-point (ring, tree, butterfly) vs the backend's own, and their α-β fit.

For every rank count and message size, the four contenders run in alternating rounds
(native, ring, tree, butterfly, native, ...) on the same fp32 tensor, refilled before each call;
a call's time is the slowest rank's, from a barrier to its return. Prints the median per cell and
its ratio to native as a markdown table, then α (s/round) and β (s/byte) of each algorithm fitted
over all cells (:func:`loom.plan.collectives.fit`: T = R(N)·α + V(S, N)·β) and the model's
relative errors (median, worst) against the measurements.

    python benchmarks/bench_allreduce.py [--ranks 2,4,8] [--max-mb 64] [--full] [--reps 9]

Sizes: 1 KB, 4 KB, ..., up to ``--max-mb`` (64 MB; ``--full``: 256 MB). Large messages repeat
fewer times (at least 3). GPUs: ``LOOM_BENCH_DEVICE=cuda`` (NCCL, one GPU per rank).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import add_no_write, backend_name, device, init_gloo, results, run_ranks, synchronize  # noqa: E402

from loom.parallel.allreduce import all_reduce  # noqa: E402
from loom.plan import collectives  # noqa: E402

ALGOS = ("native", "ring", "tree", "butterfly")


def sizes(max_mb: float) -> list[int]:
    """1 KB, 4 KB, 16 KB, ... (x4) up to ``max_mb`` MB, in bytes."""
    out, s = [], 1024
    while s <= max_mb * 2**20:
        out.append(s)
        s *= 4
    return out


def reps_for(nbytes: int, reps: int) -> int:
    return reps if nbytes <= 2**20 else max(3, reps // 3) if nbytes <= 16 * 2**20 else 3


def _worker(rank: int, world: int, init: str, args, out) -> None:
    init_gloo(rank, world, init, threads=1, timeout_s=1800)
    group = dist.group.WORLD
    algos = [a for a in ALGOS if a != "butterfly" or world & (world - 1) == 0]
    table: dict[tuple[str, int], list[float]] = {}
    for nbytes in sizes(args.max_mb):
        src = torch.randn(nbytes // 4, device=device())
        x = torch.empty_like(src)
        for _ in range(1 + reps_for(nbytes, args.reps)):  # the first round warms up
            for algo in algos:
                x.copy_(src)
                synchronize()
                dist.barrier()
                t0 = time.perf_counter()
                all_reduce(x, group, algo)
                synchronize()
                table.setdefault((algo, nbytes), []).append(time.perf_counter() - t0)
        del src, x
    every: list = [None] * world
    dist.all_gather_object(every, table)
    if rank == 0:  # a call lasts until its slowest rank returns; warm-up dropped
        out.put({k: [max(t[k][i] for t in every) for i in range(1, len(v))] for k, v in table.items()})
    dist.destroy_process_group()


def human(nbytes: int) -> str:
    return f"{nbytes // 2**20} MB" if nbytes >= 2**20 else f"{nbytes // 1024} KB"


def ms(t: float) -> str:
    return f"{t * 1e3:.3f}" if t < 0.01 else f"{t * 1e3:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4,8", help="comma-separated rank counts")
    ap.add_argument("--max-mb", type=float, default=64.0, help="largest message, MB (default 64)")
    ap.add_argument("--full", action="store_true", help="up to 256 MB")
    ap.add_argument("--reps", type=int, default=9, help="timed rounds per cell up to 1 MB (fewer above)")
    add_no_write(ap)
    args = ap.parse_args()
    with results("allreduce", "All-reduce algorithms", write=not args.no_write):
        if args.full:
            args.max_mb = max(args.max_mb, 256.0)
        medians: dict[tuple[int, str, int], float] = {}
        for world in (int(w) for w in args.ranks.split(",")):
            for (algo, nbytes), times in run_ranks(world, _worker, args).items():
                medians[world, algo, nbytes] = statistics.median(times)

        print(f"\nAll-reduce of fp32 tensors, {backend_name()} ranks; median ms per call (ratio to native)\n")
        print("| ranks | size | " + " | ".join(ALGOS) + " |")
        print("|---:|---:|" + "---:|" * len(ALGOS))
        for world, nbytes in sorted({(w, s) for w, _, s in medians}):
            base = medians[world, "native", nbytes]
            cells = []
            for algo in ALGOS:
                t = medians.get((world, algo, nbytes))
                cells.append(
                    "n/a" if t is None else ms(t) if algo == "native" else f"{ms(t)} ({t / base:.2f})"
                )
            print(f"| {world} | {human(nbytes)} | " + " | ".join(cells) + " |")

        print("\nα-β fit per algorithm over every cell, T = R(N)·α + V(S,N)·β (loom.plan.collectives)\n")
        print("| algorithm | α (µs/round) | 1/β (MB/s) | model error: median | worst |")
        print("|---|---:|---:|---:|---:|")
        for algo in ALGOS:
            points = [(w, float(s), t) for (w, a, s), t in medians.items() if a == algo]
            if len(points) < 2:
                continue
            ab = collectives.fit(algo, points)
            print(
                f"| {algo} | {ab.alpha * 1e6:.1f} | {ab.bandwidth / 2**20:.0f} | {ab.median_rel_error:.0%} "
                f"| {ab.max_rel_error:.0%} |"
            )


if __name__ == "__main__":
    main()
