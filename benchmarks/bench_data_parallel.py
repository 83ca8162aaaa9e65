"""Loom data parallel vs torch DistributedDataParallel, and Loom single-process vs a plain loop.

Same model, data, ranks and run; rounds alternate between the two contenders (ABAB...) so
machine noise hits both alike. Prints median step times and the ratio Loom / peer.

    python benchmarks/bench_data_parallel.py [--world 2] [--steps 12] [--dim 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import add_no_write, backend_name, device, init_gloo, race, results, run_ranks  # noqa: E402

from loom.config import ModelConfig, TrainConfig  # noqa: E402
from loom.model.llama import build_model, loss_fn  # noqa: E402
from loom.optim.groups import build_optimizer  # noqa: E402
from loom.train.schedule import lr_at  # noqa: E402

SEQ, MICRO, ACCUM, VOCAB = 256, 4, 2, 4096


def _cfgs(args) -> tuple[ModelConfig, TrainConfig]:
    m = ModelConfig(
        dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=4, vocab_size=VOCAB, max_seq_len=SEQ
    )
    return m, TrainConfig(steps=10_000, grad_clip=1.0, warmup_steps=0)


def _batches(step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    t = torch.randint(0, VOCAB, (ACCUM, MICRO, SEQ + 1), generator=g)
    t = t.to(device())
    return [(t[i, :, :-1], t[i, :, 1:]) for i in range(ACCUM)]


def loom_stepper(model_cfg, train_cfg, group):
    from loom.parallel.data.strategy import DataParallel
    from loom.train.step import plain_run, train_step

    model = build_model(model_cfg, train_cfg.seed, device())
    strat = DataParallel(model, group).attach_optimizer(build_optimizer(model, train_cfg))

    def step(i: int, rank: int) -> None:
        train_step(
            plain_run(model, strat, loss_fn),
            _batches(i, rank),
            train_cfg.grad_clip,
            lr_at(i, train_cfg),
            group,
        )

    return step


def ddp_stepper(model_cfg, train_cfg, group):
    """The PyTorch peer: DDP (or, with no group, a plain loop) with the same optimizer and clipping."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(model_cfg, train_cfg.seed, device())
    wrapped = DDP(model, process_group=group) if group is not None else model
    opt = build_optimizer(model, train_cfg)

    def step(i: int, rank: int) -> None:
        for g in opt.param_groups:
            g["lr"] = lr_at(i, train_cfg)
        opt.zero_grad(set_to_none=False)
        batches = _batches(i, rank)
        for k, (x, y) in enumerate(batches):
            if group is not None and k < len(batches) - 1:
                with wrapped.no_sync():
                    (loss_fn(wrapped(x), y) / len(batches)).backward()
            else:
                (loss_fn(wrapped(x), y) / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.grad_clip)
        opt.step()

    return step


def _worker(rank: int, world: int, init: str, args, out) -> None:
    init_gloo(rank, world, init, threads=None, timeout_s=300)
    m, t = _cfgs(args)
    group = dist.group.WORLD
    times = race(
        {"loom": loom_stepper(m, t, group), "ddp": ddp_stepper(m, t, group)}, args.steps, rank, dist.barrier
    )
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def report(title: str, times: dict[str, list[float]], peer: str) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{title}")
    print(f"{'contender':<12}{'wall s/step':>14}{'ratio':>8}{'cpu s/step':>14}{'ratio':>8}")
    for k in (k for k in med if not k.endswith(" cpu")):
        w, c = med[k], med[f"{k} cpu"]
        print(f"{k:<12}{w:>14.4f}{w / med[peer]:>8.3f}{c:>14.4f}{c / med[f'{peer} cpu']:>8.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    add_no_write(ap)
    args = ap.parse_args()
    with results("data_parallel", "Data parallelism", write=not args.no_write, preformatted=True):
        m, t = _cfgs(args)
        torch.set_num_threads(os.cpu_count() or 1)
        single = race(
            {"loom": loom_stepper(m, t, None), "plain": ddp_stepper(m, t, None)}, args.steps, 0, lambda: None
        )
        report(
            f"single process ({torch.get_num_threads()} threads): Loom vs plain PyTorch loop", single, "plain"
        )

        times = run_ranks(args.world, _worker, args)
        report(
            f"data parallel, {args.world} {backend_name()} ranks: Loom DataParallel vs torch DDP",
            times,
            "ddp",
        )


if __name__ == "__main__":
    main()
