"""How reproducible is a multi-rank step time on this machine? Plain PyTorch, no Loom trainer.

The debug model (configs/debug.toml) trains on 2 gloo ranks, each run a fresh pair of processes.
Per run, ``--steps`` steps of two kinds, one after the other:

- ``compute``: each rank's forward + backward of 2 micro-batches and an AdamW step, no collective;
- ``dp``: the same plus what data parallelism adds: one all-reduce of the flat gradients and one
  of a scalar (the step-end loss).

Prints, per run and kind, the fastest and the median step, then over the runs the spread
(largest / smallest) of each statistic. Without collectives the median step is within a few percent
of the fastest; with them, how far the median sits above the fastest (and how much that varies
from run to run) is the machine's scheduling noise around the collectives, the reason
``loom plan validate`` compares the planner with the fastest step (docs/planner.md).

    python benchmarks/bench_step_noise.py [--runs 5] [--steps 30]
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
from common import add_no_write, init_gloo, results, run_ranks  # noqa: E402

from loom.config import load, preset_path  # noqa: E402
from loom.model.llama import build_model, loss_fn  # noqa: E402
from loom.plan.report import model_of  # noqa: E402

KINDS = ("compute", "dp")


def worker(rank: int, world: int, init: str, steps: int, out) -> None:
    init_gloo(rank, world, init, threads=1)
    cfg = load(str(preset_path("debug")), [])
    model = model_of(cfg)
    net = build_model(model, seed=0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, model.vocab_size, (cfg.train.micro_batch, cfg.data.seq_len), generator=g)
    y = torch.randint(0, model.vocab_size, (cfg.train.micro_batch, cfg.data.seq_len), generator=g)
    micro = cfg.train.global_batch // cfg.train.micro_batch // world

    def step(kind: str) -> None:
        total = torch.zeros(1)
        for _ in range(micro):
            loss = loss_fn(net(x), y)
            loss.backward()
            total += loss.detach()
        if kind == "dp":
            flat = torch.cat([p.grad.reshape(-1) for p in net.parameters() if p.grad is not None])
            dist.all_reduce(flat)
            dist.all_reduce(total)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {}
    for kind in KINDS:
        dist.barrier()
        for i in range(steps + 2):
            t0 = time.perf_counter()
            step(kind)
            if i >= 2:  # warm-up dropped
                times.setdefault(kind, []).append(time.perf_counter() - t0)
    if rank == 0:
        out.put(times)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    add_no_write(ap)
    args = ap.parse_args()
    with results("step_noise", "Step-time noise", write=not args.no_write):
        stats: dict[str, dict[str, list[float]]] = {k: {"fastest": [], "median": []} for k in KINDS}
        print("| run | kind | fastest ms | median ms | median / fastest |\n|---|---|---|---|---|")
        for r in range(args.runs):
            times = run_ranks(2, worker, args.steps)
            for kind in KINDS:
                fast, med = min(times[kind]), statistics.median(times[kind])
                stats[kind]["fastest"].append(fast)
                stats[kind]["median"].append(med)
                print(f"| {r} | {kind} | {1e3 * fast:.2f} | {1e3 * med:.2f} | {med / fast:.2f} |", flush=True)
        print("\nover the runs, largest / smallest of each statistic (1.00 = perfectly reproducible):")
        print("| kind | fastest step | median step |\n|---|---|---|")
        for kind in KINDS:
            f, m = stats[kind]["fastest"], stats[kind]["median"]
            print(f"| {kind} | {max(f) / min(f):.2f} | {max(m) / min(m):.2f} |")


if __name__ == "__main__":
    main()
