"""``train.compile``: Loom eager vs Loom compiled (blocks) vs a plain PyTorch loop with compiled blocks.

The default model (``LoomConfig()``'s: h 256, 4 layers, 8 heads / 4 kv heads, T 256, micro-batch 4,
global batch 16; vocabulary 4096), one process and data parallel over ``--world`` gloo ranks. Rounds
alternate (Loom eager, Loom compiled, plain + compile) so machine noise hits them alike. The plain
peer is torchtitan's recipe: ``torch.compile`` on each transformer block module, the loss compiled,
``torch.optim.AdamW`` (foreach), DDP across ranks. Each contender's first step (where it compiles)
is reported apart: the steps a run needs before compiling pays = compile time / time saved per step.

    python benchmarks/bench_compile.py [--world 2] [--steps 10] [--no-write]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import add_no_write, backend_name, device, init_gloo, race, results, run_ranks  # noqa: E402

from loom.config import LoomConfig  # noqa: E402
from loom.model.llama import build_model, loss_fn  # noqa: E402
from loom.train.schedule import lr_at  # noqa: E402

VOCAB = 4096
CONTENDERS = ("loom eager", "loom compiled", "plain+compile")


def _cfg(world: int, mode: str) -> LoomConfig:
    cfg = LoomConfig()
    cfg.model.vocab_size, cfg.model.max_seq_len = VOCAB, cfg.data.seq_len
    cfg.parallel.dp = world
    cfg.train.precision = "fp32"  # type: ignore[assignment]  # the CPU's precision, as the CPU default resolves
    cfg.train.compile = mode  # type: ignore[assignment]
    cfg.train.warmup_steps, cfg.train.steps = 0, 10_000
    return cfg


def _batches(cfg: LoomConfig, step: int, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    t = cfg.train
    accum, seq = t.global_batch // (t.micro_batch * world), cfg.data.seq_len
    g = torch.Generator().manual_seed(step * 1000 + rank)
    tok = torch.randint(0, VOCAB, (accum, t.micro_batch, seq + 1), generator=g).to(device())
    return [(tok[i, :, :-1], tok[i, :, 1:]) for i in range(accum)]


def loom_stepper(world: int, mode: str, group):
    from loom.mesh import ParallelDims, ParallelMesh
    from loom.train.build import build_run
    from loom.train.step import train_step

    cfg = _cfg(world, mode)
    mesh = ParallelMesh(ParallelDims(dp_replicate=world), device().type)
    run = build_run(cfg, mesh, build_model(cfg.model, cfg.train.seed, device(), meta=True))

    def step(i: int, rank: int) -> None:
        batches = _batches(cfg, i, rank, world)
        train_step(run, batches, cfg.train.grad_clip, lr_at(i, cfg.train), group)

    return step


def plain_stepper(world: int, group):
    """torchtitan's recipe on a plain loop: compiled block modules and loss, AdamW, DDP across ranks."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg = _cfg(world, "none")
    model = build_model(cfg.model, cfg.train.seed, device())
    for i, block in enumerate(model.layers):
        model.layers.register_module(str(i), torch.compile(block, fullgraph=True))
    compiled_loss = torch.compile(loss_fn)
    wrapped = DDP(model, process_group=group) if group is not None else model
    t = cfg.train
    opt = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay
    )

    def step(i: int, rank: int) -> None:
        for g in opt.param_groups:
            g["lr"] = lr_at(i, t)
        opt.zero_grad(set_to_none=False)
        batches = _batches(cfg, i, rank, world)
        for k, (x, y) in enumerate(batches):
            sync = group is None or k == len(batches) - 1
            with contextlib.nullcontext() if sync else wrapped.no_sync():  # type: ignore[operator]
                (compiled_loss(wrapped(x), y) / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()

    return step


def _steppers(world: int, group) -> dict:
    return {
        "loom eager": loom_stepper(world, "none", group),
        "loom compiled": loom_stepper(world, "blocks", group),
        "plain+compile": plain_stepper(world, group),
    }


def _race(world: int, steps: int, rank: int, barrier, group) -> dict[str, list[float]]:
    return race(_steppers(world, group), steps, rank, barrier, warmup=0)


def _worker(rank: int, world: int, init: str, args, out) -> None:
    init_gloo(rank, world, init, threads=None, timeout_s=900)
    times = _race(world, args.steps, rank, dist.barrier, dist.group.WORLD)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def report(title: str, times: dict[str, list[float]]) -> None:
    """Median steady-state step (from the third step), ratios, the first steps (compile) and break-even."""
    med = {k: statistics.median(v[2:]) for k, v in times.items()}
    first = {k: sum(v[:2]) for k, v in times.items()}
    base = med["loom eager"]
    print(f"\n{title}\n")
    print(
        "| contender | wall s/step | / loom eager | / plain+compile | cpu s/step | steps 1-2 (s) | pays after |"
    )
    print("|---|---|---|---|---|---|---|")
    for k in CONTENDERS:
        extra = first[k] - 2 * base
        saved = base - med[k]
        pays = f"{extra / saved:.0f} steps" if saved > 0 else "never"
        if k == "loom eager" or extra <= 0:  # no compile cost: eager, or graphs cached by a contender before
            pays = "-" if k == "loom eager" else "at once (cached)"
        print(
            f"| {k} | {med[k]:.4f} | {med[k] / base:.3f} | {med[k] / med['plain+compile']:.3f} "
            f"| {med[f'{k} cpu']:.4f} | {first[k]:.1f} | {pays} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="steps per contender, the first 2 (compile) apart")
    add_no_write(ap)
    args = ap.parse_args()
    started = time.perf_counter()
    with results("compile", "torch.compile (train.compile)", write=not args.no_write):
        torch.set_num_threads(os.cpu_count() or 1)
        print(f"Default model, fp32, {args.steps} steps per contender (the first two compile).")
        single = _race(1, args.steps, 0, lambda: None, None)
        report(f"One process ({torch.get_num_threads()} threads)", single)
        times = run_ranks(args.world, _worker, args)
        report(
            f"Data parallel, {args.world} {backend_name()} ranks (Loom DataParallel; DDP for plain)", times
        )
        print(f"\nWhole benchmark: {time.perf_counter() - started:.0f} s.")


if __name__ == "__main__":
    main()
