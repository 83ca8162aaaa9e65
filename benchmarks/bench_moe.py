"""Mixture of experts: step time of an E-expert top-k MoE against the dense model with the same
active parameters, grouped expert compute against the per-expert loop, and ep2 against no ep.

Same ranks (data parallel over ``--world``), data and run: every step, each contender runs one
training step in turn (build_run + train_step, the trainer's path), so machine noise hits all
alike. Contenders (E = 8, top-2 by default):

    dense          a SwiGLU of width k·f: the same active parameters per token as the MoE
    moe grouped    the MoE, experts as one grouped matmul per weight (``moe.compute = grouped``)
    moe loop       the MoE, experts one by one (``moe.compute = loop``, the reference)
    moe ep{world}  the MoE with its experts split over the ranks (all-to-all), grouped

Prints median wall and CPU time per step, the ratios grouped : loop, MoE : dense and ep : no ep,
the bytes each all-to-all call moves per rank, and the expert GEMM path this build takes.

    python benchmarks/bench_moe.py [--world 2] [--steps 12] [--dim 256] [--layers 4] [--experts 8] [--top-k 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import add_no_write, backend_name, device, init_gloo, race, results, run_ranks  # noqa: E402

from loom.comm import CommMeter  # noqa: E402
from loom.config import LoomConfig, ModelConfig, MoEConfig, TrainConfig  # noqa: E402
from loom.model.llama import build_model, count_params  # noqa: E402
from loom.model.moe import grouped_mm_available  # noqa: E402

SEQ, MICRO, ACCUM, VOCAB = 256, 4, 2, 4096


def _cfg(args, world: int, experts: int, ep: int, compute: str) -> LoomConfig:
    f = args.ffn * (args.top_k if experts == 1 else 1)  # dense: the k active experts' width in one MLP
    m = ModelConfig(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=VOCAB,
        max_seq_len=SEQ,
        ffn_dim=f,
        n_experts=experts,
        top_k=args.top_k,
    )
    cfg = LoomConfig(model=m, train=TrainConfig(steps=10_000, warmup_steps=0), moe=MoEConfig(compute=compute))  # type: ignore[arg-type]
    cfg.parallel.dp, cfg.parallel.dp_shard, cfg.parallel.ep = world, 1, ep
    cfg.train.micro_batch, cfg.train.global_batch = MICRO, MICRO * ACCUM * world
    cfg.data.seq_len, cfg.run.dir = SEQ, "/tmp/loom-bench-moe"
    return cfg


def _batches(step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    t = torch.randint(0, VOCAB, (ACCUM, MICRO, SEQ + 1), generator=g).to(device())
    return [(t[i, :, :-1], t[i, :, 1:]) for i in range(ACCUM)]


def _contender(cfg: LoomConfig, meter: CommMeter):
    from loom.mesh import ParallelDims, ParallelMesh
    from loom.train.build import build_run
    from loom.train.schedule import lr_at
    from loom.train.step import train_step

    dims = ParallelDims(dp_replicate=cfg.parallel.dp, dp_shard=1, ep=cfg.parallel.ep)
    mesh = ParallelMesh(dims, device().type)
    model = build_model(cfg.model, cfg.train.seed, device(), meta=True, moe=cfg.moe)
    run = build_run(cfg, mesh, model, meter)

    def step(i: int, rank: int) -> None:
        train_step(run, _batches(i, rank), cfg.train.grad_clip, lr_at(i, cfg.train), mesh.group("dp_cp"))

    return step, model


def _worker(rank: int, world: int, init: str, args, out) -> None:
    init_gloo(rank, world, init, threads=None, timeout_s=300)
    E = args.experts
    names = {
        "dense": (1, 1, "grouped"),
        "moe grouped": (E, 1, "grouped"),
        "moe loop": (E, 1, "loop"),
        f"moe ep{world}": (E, world, "grouped"),
    }
    meters = {name: CommMeter() for name in names}
    contenders, params = {}, {}
    for name, (experts, ep, compute) in names.items():
        cfg = _cfg(args, world, experts, ep, compute)
        step, _ = _contender(cfg, meters[name])
        contenders[name] = step
        whole = build_model(cfg.model, 0, "cpu", meta=True, moe=cfg.moe)
        params[name] = count_params(whole)
    for m in meters.values():
        m.reset()
    times = race(contenders, args.steps, rank, dist.barrier)
    a2a = {
        name: m.moved.get("all_to_all", 0) / max(1, m.calls.get("all_to_all", 1))
        for name, m in meters.items()
    }
    if rank == 0:
        out.put((times, params, a2a))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512, help="one expert's hidden size f")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    add_no_write(ap)
    args = ap.parse_args()
    with results("moe", "Mixture of experts", write=not args.no_write, preformatted=True):
        times, params, a2a = run_ranks(args.world, _worker, args)
        x = torch.zeros(1, 1)
        print(
            f"MoE E={args.experts} top-{args.top_k}, h={args.dim} f={args.ffn}, {args.layers} layers, seq {SEQ}, "
            f"micro {MICRO} x {ACCUM} per rank, {args.world} {backend_name()} ranks; expert GEMMs: "
            f"{'torch._grouped_mm' if grouped_mm_available(x) else 'padded batched matmul'}"
        )
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{'contender':<14} {'params':>10} {'step ms':>9} {'cpu ms':>9} {'a2a B/call':>11}")
        for name in params:
            print(
                f"{name:<14} {params[name]:>10,} {1e3 * med[name]:>9.1f} {1e3 * med[name + ' cpu']:>9.1f} "
                f"{a2a[name]:>11,.0f}"
            )
        ep = f"moe ep{args.world}"
        print(f"grouped : loop  = {med['moe grouped'] / med['moe loop']:.2f}")
        print(f"moe : dense     = {med['moe grouped'] / med['dense']:.2f}")
        print(f"ep : no ep      = {med[ep] / med['moe grouped']:.2f}")


if __name__ == "__main__":
    main()
