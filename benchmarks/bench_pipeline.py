"""Loom pipeline schedules vs torch.distributed.pipelining on the same stages, ranks and run.

For each synchronous schedule: GPipe vs ``ScheduleGPipe``, 1F1B vs ``Schedule1F1B``, interleaved
(v=2) vs ``ScheduleInterleaved1F1B``, ZB-H1 vs ``ScheduleInterleavedZeroBubble`` (torch's
zero-bubble schedule, one stage per rank here). Rounds alternate the contenders (ABAB...) so
machine noise hits both alike; prints median wall and CPU seconds per step, the ratio Loom /
torch, and Loom's measured bubble (one recorded step) beside the formula. Untied embeddings and
no clipping, which torch's schedules do not do across stages.

    python benchmarks/bench_pipeline.py [--pp 2] [--steps 10] [--dim 256] [--layers 8] [--micro 8]
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

from loom.config import ModelConfig, TrainConfig  # noqa: E402
from loom.model.llama import build_model, loss_fn  # noqa: E402
from loom.optim.groups import build_optimizer, set_lr  # noqa: E402
from loom.train.schedule import lr_at  # noqa: E402

SEQ, ROWS, VOCAB = 128, 2, 2048
PAIRS = [
    ("gpipe", 1, "ScheduleGPipe"),
    ("1f1b", 1, "Schedule1F1B"),
    ("interleaved", 2, "ScheduleInterleaved1F1B"),
    ("zb-h1", 1, "ScheduleInterleavedZeroBubble"),
]


def _cfgs(args) -> tuple[ModelConfig, TrainConfig]:
    m = ModelConfig(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=VOCAB,
        max_seq_len=SEQ,
        tie_embeddings=False,
    )
    return m, TrainConfig(steps=10_000, grad_clip=0.0, warmup_steps=0)


def _batch(step: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, VOCAB, (m * ROWS, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return t[:, :-1], t[:, 1:]


def _bounds(n_layers: int, n: int) -> list[int]:
    return [round(i * n_layers / n) for i in range(n + 1)]


def loom_stepper(mcfg, tcfg, name: str, v: int, m: int, record: int):
    from loom.parallel.data.strategy import DataParallel
    from loom.parallel.pipeline.stage import split_model
    from loom.parallel.pipeline.strategy import PipelineStrategy
    from loom.train.build import pipeline_run
    from loom.train.step import train_step

    p, rank = dist.get_world_size(), dist.get_rank()
    from loom.mesh import ParallelDims, ParallelMesh

    mesh = ParallelMesh(ParallelDims(pp=p), "cpu")
    pipe = split_model(
        build_model(mcfg, tcfg.seed),
        rank,
        p,
        _bounds(mcfg.n_layers, p * v),
        mesh.group("pp"),
        mesh.pp_links(),
    )
    inner = DataParallel(pipe, None).attach_optimizer(build_optimizer(pipe, tcfg))
    strategy = PipelineStrategy(inner, pipe, name, v, record_step=record)

    def step(i: int) -> None:
        x, y = _batch(i, m)
        micro = [(x[k * ROWS : (k + 1) * ROWS], y[k * ROWS : (k + 1) * ROWS]) for k in range(m)]
        train_step(pipeline_run(pipe, strategy, loss_fn), micro, 0.0, lr_at(i, tcfg), None)

    return step, strategy


def torch_stepper(mcfg, tcfg, cls_name: str, v: int, m: int):
    import torch.distributed.pipelining as tp

    from loom.parallel.pipeline.stage import split_model

    p, rank = dist.get_world_size(), dist.get_rank()
    pipe = split_model(build_model(mcfg, tcfg.seed), rank, p, _bounds(mcfg.n_layers, p * v))
    stages = [
        tp.PipelineStage(s, s.index, p * v, torch.device("cpu"), group=dist.group.WORLD) for s in pipe.stages
    ]
    cls = getattr(tp, cls_name)
    schedule = cls(
        stages if v > 1 or cls_name.startswith("ScheduleInterleaved") else stages[0],
        n_microbatches=m,
        loss_fn=loss_fn,
    )
    opt = build_optimizer(pipe, tcfg)
    first, last = pipe.stages[0].is_first, any(s.is_last for s in pipe.stages)

    def step(i: int) -> None:
        x, y = _batch(i, m)
        set_lr(opt, lr_at(i, tcfg))
        opt.zero_grad()
        kwargs = {"target": y, "losses": []} if last else {}
        schedule.step(*((x,) if first else ()), **kwargs)
        opt.step()

    return step


def _worker(rank: int, world: int, init: str, args, out) -> None:
    init_gloo(rank, world, init, threads=1, timeout_s=600)
    mcfg, tcfg = _cfgs(args)
    results = {}
    for name, v, peer in PAIRS:
        try:
            theirs = torch_stepper(mcfg, tcfg, peer, v, args.micro)
        except Exception as e:  # noqa: BLE001 - a peer this torch cannot build is reported, not fatal
            theirs, peer = None, f"{peer} (unavailable: {type(e).__name__})"
        ours, strategy = loom_stepper(mcfg, tcfg, name, v, args.micro, record=args.steps - 1)
        times: dict[str, list[float]] = {}
        for i in range(args.steps):
            for who, step in (("loom", ours), ("torch", theirs)):
                if step is None:
                    continue
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                step(i)
                dist.barrier()
                times.setdefault(who, []).append(time.perf_counter() - t0)
                times.setdefault(f"{who} cpu", []).append(time.process_time() - c0)
        results[name] = {
            "v": v,
            "peer": peer,
            "times": {k: t[2:] for k, t in times.items()},
            "timeline": strategy.timeline,
        }
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main() -> None:
    from loom.parallel.pipeline.report import timeline_report

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--micro", type=int, default=8, help="micro-batches per step (m)")
    ap.add_argument("--out", default="", help="directory for the measured timeline pictures")
    add_no_write(ap)
    args = ap.parse_args()
    with results(
        "pipeline",
        "Pipeline schedules against torch.distributed.pipelining",
        write=not args.no_write,
        preformatted=True,
    ):
        measured = run_ranks(args.pp, _worker, args)
        print(
            f"\npp={args.pp} gloo ranks, dim {args.dim}, {args.layers} layers, m={args.micro} micro-batches of "
            f"{ROWS}x{SEQ} tokens, medians over {args.steps - 2} steps"
        )
        print(
            f"{'schedule':<13}{'peer':<32}{'loom s':>9}{'torch s':>9}{'ratio':>7}{'cpu ratio':>10}  bubble (measured vs formula)"
        )
        for name, r in measured.items():
            med = {k: statistics.median(t) for k, t in r["times"].items()}
            ours, theirs = med["loom"], med.get("torch")
            ratio = (
                f"{ours / theirs:>7.3f}{med['loom cpu'] / med['torch cpu']:>10.3f}"
                if theirs
                else f"{'-':>7}{'-':>10}"
            )
            path = Path(args.out) / f"{name}.png" if args.out else None
            bubble = timeline_report(r["timeline"], name, args.micro, r["v"], path).split(": ", 1)[1]
            print(f"{name:<13}{r['peer']:<32}{ours:>9.4f}{theirs or float('nan'):>9.4f}{ratio}  {bubble}")


if __name__ == "__main__":
    main()
