"""Parameter server vs ring all-reduce data parallelism, and ASP/SSP convergence vs BSP.

Part 1, scaling: W = 2, 4, 8 worker ranks (gloo), 2 sequences each (weak scaling), train the same
model on the same data with
  - ring all-reduce data parallelism (``DataParallel``, ``parallel.allreduce = ring``; and gloo's
    own all-reduce, ``native``, for reference),
  - a parameter server with one shard (K = 1, co-located in rank 0: the central server),
  - a parameter server sharded over every worker (K = W, co-located),
rounds alternating (ABC...). Per step: median wall time, and bytes through the busiest node's
links, counted (ps: ``ColocatedParamServer.server_bytes``; ring: sent + received per rank).
Part 2, convergence: W = 4 workers + 1 dedicated server rank, bsp / ssp:1 / ssp:4 / asp, worker 0
sleeping 20 ms per step (a straggler), 16 sequences per step over the workers; loss per worker step
on a learnable stream (arithmetic progressions), and the largest staleness the server recorded.

    python benchmarks/bench_param_server.py [--workers 2,4,8] [--steps 10] [--conv-steps 40]

Writes docs/ps/scaling.png and docs/ps/convergence.png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import add_no_write, init_gloo, race, results, run_ranks  # noqa: E402

from loom.comm import CommMeter  # noqa: E402
from loom.config import ModelConfig, TrainConfig  # noqa: E402
from loom.model.llama import build_model, count_params, loss_fn  # noqa: E402
from loom.optim.groups import build_optimizer  # noqa: E402
from loom.train.schedule import lr_at  # noqa: E402
from loom.train.step import plain_run, train_step  # noqa: E402

SEQ, MICRO, VOCAB, ROWS = 32, 2, 4096, 2  # scaling: ROWS sequences per worker (weak scaling)
CONV_GLOBAL = 16  # convergence: sequences per step over all workers
OUT = Path(__file__).resolve().parent.parent / "docs" / "ps"


def _cfgs() -> tuple[ModelConfig, TrainConfig]:
    m = ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=SEQ)
    return m, TrainConfig(steps=10_000, lr=3e-3, warmup_steps=5, grad_clip=1.0)


def _rows(step: int, rank: int, world: int, total: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of the ``total`` sequences of ``step``: arithmetic progressions mod 128 with a
    random start and stride 1-3 (learnable: the next token follows from the context)."""
    g = torch.Generator().manual_seed(step)
    start, stride = (
        torch.randint(0, 128, (total, 1), generator=g),
        torch.randint(1, 4, (total, 1), generator=g),
    )
    t = ((start + stride * torch.arange(SEQ + 1)) % 128)[rank * total // world : (rank + 1) * total // world]
    return [(t[i : i + MICRO, :-1], t[i : i + MICRO, 1:]) for i in range(0, len(t), MICRO)]


# ------------------------------------------------------------------ part 1: scaling
CONTENDERS = ("ring", "gloo", "ps K=1", "ps K=W")


def _scaling_worker(rank: int, world: int, init: str, steps: int, out) -> None:
    from loom.parallel.allreduce import by_name
    from loom.parallel.data.strategy import DataParallel
    from loom.parallel.ps.strategy import ColocatedParamServer

    init_gloo(rank, world, init, threads=1, timeout_s=300)
    m, t = _cfgs()
    group = dist.group.WORLD
    meters = {name: CommMeter() for name in CONTENDERS}
    strategies = {
        "ring": DataParallel(build_model(m, t.seed), group, meters["ring"], allreduce=by_name("ring")),
        "gloo": DataParallel(build_model(m, t.seed), group, meters["gloo"]),
        "ps K=1": ColocatedParamServer(build_model(m, t.seed), group, 1, t, meters["ps K=1"]),
        "ps K=W": ColocatedParamServer(build_model(m, t.seed), group, world, t, meters["ps K=W"]),
    }
    for name in ("ring", "gloo"):
        dp = strategies[name]
        dp.attach_optimizer(build_optimizer(dp.module, t))  # type: ignore[attr-defined]
    busiest: dict[str, list[float]] = {k: [] for k in strategies}

    def stepper(name: str):
        s = strategies[name]

        def step(i: int, r: int) -> None:
            meters[name].reset()
            train_step(
                plain_run(s.module, s, loss_fn),
                _rows(i, r, world, ROWS * world),
                t.grad_clip,
                lr_at(i, t),
                group,
            )  # type: ignore[attr-defined]
            if name in (
                "ring",
                "gloo",
            ):  # sent + received by a rank (every rank alike; gloo: the ring volume)
                busiest[name].append(2 * meters[name].total_moved)
            else:
                busiest[name].append(float(s.server_bytes))  # type: ignore[attr-defined]

        return step

    times = race({k: stepper(k) for k in strategies}, steps, rank, dist.barrier)
    phi = count_params(strategies["ring"].module)  # type: ignore[attr-defined]
    if rank == 0:
        out.put({"times": times, "busiest": {k: max(v) for k, v in busiest.items()}, "phi": phi})
    dist.destroy_process_group()


# ------------------------------------------------------------------ part 2: convergence
MODES = ("bsp", "ssp:1", "ssp:4", "asp")


def _convergence_worker(rank: int, world: int, init: str, steps: int, out) -> None:
    from loom.parallel.ps.links import make_links
    from loom.parallel.ps.server import ParameterServer
    from loom.parallel.ps.strategy import PSWorker
    from loom.rules import parse_ps_sync

    init_gloo(rank, world, init, threads=1, timeout_s=300)
    workers = world - 1
    links = make_links(workers, 1)
    m, t = _cfgs()
    result: dict[str, dict] = {}
    for mode in MODES:
        bound = "bsp" if mode == "bsp" else parse_ps_sync(mode)
        model = build_model(m, t.seed)
        dist.barrier()
        t0 = time.perf_counter()
        if links.is_server:
            rep = ParameterServer(model, links, bound, t).serve()
            result[mode] = {"staleness": max(rep.staleness), "missed": max(rep.missed), "waits": rep.waits}
        else:
            w = links.rank
            ps = PSWorker(model, links, bound)
            losses = []
            for i in range(steps):
                if w == 0:
                    time.sleep(0.02)  # the straggler
                group = links.worker_group if mode == "bsp" else None
                losses.append(
                    train_step(
                        plain_run(model, ps, loss_fn),
                        _rows(i, w, workers, CONV_GLOBAL),
                        t.grad_clip,
                        lr_at(i, t),
                        group,
                    ).loss
                )
            ps.close()
            result[mode] = {"losses": losses}
        result[mode]["seconds"] = time.perf_counter() - t0
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        out.put(gathered)
    dist.destroy_process_group()


# ------------------------------------------------------------------ report
def _scaling(worlds: list[int], steps: int) -> dict[int, dict]:
    rows = {}
    for w in worlds:
        res = run_ranks(w, _scaling_worker, steps)
        med = {k: statistics.median(v) for k, v in res["times"].items() if not k.endswith(" cpu")}
        rows[w] = {"med": med, "busiest": res["busiest"], "phi": res["phi"]}
        print(
            f"W={w}: "
            + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items())
            + " | busiest node MB/step: "
            + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in res["busiest"].items()),
            file=sys.stderr,
            flush=True,
        )
    return rows


def _plot_scaling(rows: dict[int, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = sorted(rows)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, style in (("ring", "o-"), ("gloo", "o--"), ("ps K=1", "s-"), ("ps K=W", "^-")):
        a.plot(ws, [rows[w]["med"][name] * 1e3 for w in ws], style, label=name)
        b.plot(ws, [rows[w]["busiest"][name] / 2**20 for w in ws], style, label=name)
    phi_mb = rows[ws[0]]["phi"] * 4 / 2**20
    b.plot(ws, [2 * (w - 1) * phi_mb for w in ws], "k:", label="2(W-1)Φb (K=1 formula)")
    a.set(
        xlabel="workers W",
        ylabel="step time, ms (median)",
        title="step time (gloo, 2 shared cores)",
        xticks=ws,
    )
    b.set(
        xlabel="workers W",
        ylabel="MB per step through the busiest node",
        title="bytes per server link",
        xticks=ws,
    )
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(OUT / "scaling.png", dpi=110)


def _plot_convergence(gathered: list, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = len(gathered) - 1
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode in MODES:
        mean = [
            statistics.fmean(gathered[w][mode]["losses"][i] for w in range(workers)) for i in range(steps)
        ]
        srv = gathered[-1][mode]
        ax.plot(range(1, steps + 1), mean, label=f"{mode} (max staleness {srv['staleness']})")
    ax.set(
        xlabel="worker step",
        ylabel="training loss (mean over workers)",
        title=f"{workers} workers + 1 server, worker 0 a straggler (+20 ms/step)",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "convergence.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="2,4,8")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--conv-workers", type=int, default=4)
    ap.add_argument("--conv-steps", type=int, default=40)
    add_no_write(ap)
    args = ap.parse_args()
    with results("param_server", "Parameter server", write=not args.no_write):
        OUT.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        t0 = time.perf_counter()
        rows = _scaling([int(w) for w in args.workers.split(",")], args.steps)
        _plot_scaling(rows)
        phi = rows[min(rows)]["phi"]
        print(f"\nΦ = {phi} parameters ({phi * 4 / 2**20:.2f} MB fp32)")
        print(
            "| W | "
            + " | ".join(f"{k} ms/step" for k in CONTENDERS)
            + " | "
            + " | ".join(f"{k} MB" for k in CONTENDERS)
            + " |"
        )
        print("|---:|" + "---:|" * (2 * len(CONTENDERS)))
        for w, r in sorted(rows.items()):
            med, busy = r["med"], r["busiest"]
            cells = [f"{med[k] * 1e3:.1f}" for k in CONTENDERS] + [
                f"{busy[k] / 2**20:.2f}" for k in CONTENDERS
            ]
            print(f"| {w} | " + " | ".join(cells) + " |")
        gathered = run_ranks(args.conv_workers + 1, _convergence_worker, args.conv_steps)
        _plot_convergence(gathered, args.conv_steps)
        print(f"\nconvergence, {args.conv_workers} workers + 1 server, {args.conv_steps} steps:\n")
        print("| ps_sync | final loss | max staleness (steps) | max updates missed | pulls held | wall s |")
        print("|---|---:|---:|---:|---:|---:|")
        for mode in MODES:
            last = statistics.fmean(gathered[w][mode]["losses"][-1] for w in range(args.conv_workers))
            srv = gathered[-1][mode]
            print(
                f"| {mode} | {last:.3f} | {srv['staleness']} | {srv['missed']} | {srv['waits']} "
                f"| {srv['seconds']:.1f} |"
            )
        print(f"\ntotal {time.perf_counter() - t0:.0f} s; figures in `{OUT.relative_to(OUT.parents[1])}`")
        print("\n![parameter server vs ring all-reduce](../ps/scaling.png)\n")
        print("![ASP and SSP vs BSP](../ps/convergence.png)")


if __name__ == "__main__":
    main()
