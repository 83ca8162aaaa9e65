"""What each memory technique buys and costs: recomputation, activation compression, Adafactor, bf16.

Same model, data and gloo ranks (data parallel), one run. Every step, each contender runs one
optimizer step in turn, so machine noise hits all alike. Per contender, on rank 0:

- peak memory per rank = model state held between steps (parameters + gradients + optimizer
  state, ``strategy.state_bytes()``) + the peak bytes of saved activations during the step
  (:class:`~loom.memory.compress.SavedActivations`: every tensor autograd keeps, each storage
  once, counted until backward frees it). On CPU these are exact tensor sizes; the allocator's
  working set (temporaries of one op) is not included;
- median wall time per step, and its ratio to the baseline (fp32, AdamW, nothing recomputed).

Then the largest model (layers at fixed width) that fits a memory cap per rank: memory is
affine in the layer count, m(L) = a + b·L, measured at two depths; L_max = floor((cap - a)/b),
checked by a measured step at L_max.

    python benchmarks/bench_memory.py [--world 2] [--steps 6] [--dim 256] [--layers 4] [--cap-mib 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import add_no_write, init_gloo, race, results, run_ranks  # noqa: E402

from loom.config import LoomConfig, ModelConfig, ParallelConfig, TrainConfig, validate  # noqa: E402

SEQ, MICRO, ACCUM, VOCAB = 256, 4, 2, 4096
BASE = "none"
CONTENDERS = {  # name: train-config overrides
    "none": {},
    "selective": {"recompute": "selective"},
    "every:2": {"recompute": "every:2"},
    "full": {"recompute": "full"},
    "none + fp8": {"compress": "fp8"},
    "selective + fp8": {"recompute": "selective", "compress": "fp8"},
    "every:2 + fp8": {"recompute": "every:2", "compress": "fp8"},
    "full + fp8": {"recompute": "full", "compress": "fp8"},
    "none + bf16 act": {"compress": "bf16"},
    "adafactor": {"optimizer": "adafactor", "lr": 1e-2},
    "full + adafactor": {"recompute": "full", "optimizer": "adafactor", "lr": 1e-2},
    "bf16 (mixed precision)": {"precision": "bf16"},
}
CAP = {  # name: overrides, for the largest model under the memory cap
    "baseline (fp32, AdamW)": {},
    "full recompute": {"recompute": "full"},
    "selective + fp8 act": {"recompute": "selective", "compress": "fp8"},
    "bf16 + full + adafactor": {
        "precision": "bf16",
        "recompute": "full",
        "optimizer": "adafactor",
        "lr": 1e-2,
    },
}


def _cfg(args, world: int, layers: int, over: dict) -> LoomConfig:
    m = ModelConfig(dim=args.dim, n_layers=layers, n_heads=8, n_kv_heads=4, vocab_size=VOCAB, max_seq_len=SEQ)
    t = TrainConfig(
        steps=10_000,
        grad_clip=1.0,
        warmup_steps=0,
        global_batch=MICRO * ACCUM * world,
        micro_batch=MICRO,
        **over,
    )
    cfg = LoomConfig(model=m, train=t, parallel=ParallelConfig(dp=world))
    cfg.data.seq_len = SEQ
    return validate(cfg, world)


def _batches(step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    t = torch.randint(0, VOCAB, (ACCUM, MICRO, SEQ + 1), generator=g)
    return [(t[i, :, :-1], t[i, :, 1:]) for i in range(ACCUM)]


def contender(cfg: LoomConfig, mesh):
    """One training setup through ``build_run``: a step function and its memory report."""
    from loom.memory.compress import SavedActivations
    from loom.model.llama import build_model
    from loom.train.build import build_run
    from loom.train.schedule import lr_at
    from loom.train.step import train_step

    model = build_model(cfg.model, cfg.train.seed)
    run = build_run(cfg, mesh, model)
    strategy = run.strategy
    saved = SavedActivations(model, cfg.train.compress)

    def step(i: int, rank: int) -> None:
        with saved:
            train_step(run, _batches(i, rank), cfg.train.grad_clip, lr_at(i, cfg.train), mesh.group("dp"))

    def memory() -> dict[str, int]:
        s = strategy.state_bytes()
        state = s["param_bytes"] + s["grad_bytes"] + s["optim_bytes"]
        return {"state": state, "act": saved.peak, "total": state + saved.peak}

    return step, memory


def one_step_memory(args, world: int, layers: int, over: dict, mesh, rank: int) -> int:
    step, memory = contender(_cfg(args, world, layers, over), mesh)
    step(0, rank)
    return memory()["total"]


def cap_search(args, world: int, mesh, rank: int) -> dict[str, tuple]:
    """Largest L under ``args.cap_mib`` per config: affine fit at 2 and 4 layers, checked at L_max."""
    cap = args.cap_mib * 2**20
    out = {}
    for name, over in CAP.items():
        m2 = one_step_memory(args, world, 2, over, mesh, rank)
        m4 = one_step_memory(args, world, 4, over, mesh, rank)
        b = (m4 - m2) / 2
        a = m2 - 2 * b
        lmax = max(0, int((cap - a) // b))  # 0: even the embedding, head and loss do not fit
        measured = one_step_memory(args, world, lmax, over, mesh, rank) if lmax >= 1 else 0
        out[name] = (a, b, lmax, measured)
    return out


def _worker(rank: int, world: int, init: str, args, out) -> None:
    from loom.mesh import ParallelDims, ParallelMesh

    init_gloo(rank, world, init, threads=None, timeout_s=600)
    mesh = ParallelMesh(ParallelDims(dp_replicate=world), "cpu")
    made = {k: contender(_cfg(args, world, args.layers, over), mesh) for k, over in CONTENDERS.items()}
    times = race({k: v[0] for k, v in made.items()}, args.steps, rank, dist.barrier)
    times = {k: v for k, v in times.items() if not k.endswith(" cpu")}  # this table reports wall time
    mem = {k: v[1]() for k, v in made.items()}
    del made
    caps = cap_search(args, world, mesh, rank) if args.cap_mib > 0 else {}
    if rank == 0:
        out.put((times, mem, caps))
    dist.destroy_process_group()


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def report(args, times: dict[str, list[float]], mem: dict[str, dict], caps: dict) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"\nMemory techniques, {args.world} gloo ranks (data parallel), dim {args.dim}, {args.layers} layers, "
        f"seq {SEQ}, micro-batch {MICRO} x {ACCUM}, rank 0\n"
    )
    print("| setup | state MiB | saved act. MiB | peak MiB | vs none | step s | vs none |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for k, m in mem.items():
        print(
            f"| {k} | {mib(m['state'])} | {mib(m['act'])} | {mib(m['total'])} | "
            f"{m['total'] / mem[BASE]['total']:.2f} | {med[k]:.3f} | {med[k] / med[BASE]:.2f} |"
        )
    if caps:
        print(
            f"\nLargest model under {args.cap_mib} MiB per rank (dim {args.dim}; m(L) = a + b·L fitted at "
            "L = 2, 4; measured at L_max)\n"
        )
        print("| setup | a MiB | b MiB/layer | L_max | measured at L_max MiB |")
        print("|---|---:|---:|---:|---:|")
        for k, (a, b, lmax, measured) in caps.items():
            print(f"| {k} | {mib(a)} | {mib(b)} | {lmax} | {mib(measured) if lmax else '-'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--cap-mib", type=float, default=256.0, help="memory cap per rank; 0 = skip the search")
    add_no_write(ap)
    args = ap.parse_args()
    with results("memory", "Memory techniques", write=not args.no_write):
        times, mem, caps = run_ranks(args.world, _worker, args)
        report(args, times, mem, caps)


if __name__ == "__main__":
    main()
