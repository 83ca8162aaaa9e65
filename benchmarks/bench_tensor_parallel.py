"""Loom tensor parallel vs PyTorch DTensor tensor parallel: step time, bytes moved, activations.

Same model (untied embeddings, so DTensor can shard the embedding and the head separately),
same data, same gloo ranks, same run; rounds alternate (ABAB...) so machine noise hits both
alike. A step is forward + vocab-parallel loss + backward + AdamW (no clipping, no data
parallelism: only the tensor-parallel mechanics differ). DTensor uses the torchtitan plan:
ColwiseParallel / RowwiseParallel, SequenceParallel norms with ``--sp``, ``loss_parallel``.

    python benchmarks/bench_tensor_parallel.py [--tp 2] [--steps 12] [--dim 256] [--layers 4] [--sp]
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

from loom.config import LoomConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from loom.model.llama import build_model, loss_fn  # noqa: E402
from loom.optim.groups import build_optimizer  # noqa: E402

SEQ, MICRO, VOCAB = 256, 4, 4096


def _cfg(args) -> LoomConfig:
    m = ModelConfig(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=VOCAB,
        max_seq_len=SEQ,
        tie_embeddings=False,
    )
    cfg = LoomConfig(
        model=m, train=TrainConfig(warmup_steps=0), parallel=ParallelConfig(tp=args.tp, sp=args.sp)
    )
    cfg.data.seq_len = SEQ
    return cfg


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return t[:, :-1], t[:, 1:]


def loom_stepper(cfg: LoomConfig, mesh, meter):
    from loom.parallel.partial import sum_partial_grads
    from loom.parallel.tensor.parallelize import apply_tensor_parallel

    model = build_model(cfg.model, cfg.train.seed)
    loss = apply_tensor_parallel(model, mesh, sp=cfg.parallel.sp, meter=meter)
    opt = build_optimizer(model, cfg.train)

    def step(i: int) -> float:
        opt.zero_grad(set_to_none=True)
        x, y = _batch(i)
        out = loss(model(x), y)
        out.backward()
        sum_partial_grads(model.parameters(), lambda p: p.grad)  # sp norms' gradient parts, once per step
        opt.step()
        return float(out.detach())

    return step, model


def dtensor_stepper(cfg: LoomConfig, device_mesh):
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

    sp = cfg.parallel.sp
    model = build_model(cfg.model, cfg.train.seed)
    seq = Shard(1) if sp else Replicate()
    parallelize_module(
        model,
        device_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
            **({"norm": SequenceParallel()} if sp else {}),
        },
    )
    for block in model.layers:
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan |= {
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            }
        parallelize_module(block, device_mesh, plan)
    opts = _split_optimizers(model, cfg)

    def step(i: int) -> float:
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        x, y = _batch(i)
        with loss_parallel():
            out = loss_fn(model(x), y)
            out.backward()
        for p in (
            model.parameters()
        ):  # sp: norm-weight grads are Partial sums; all-reduce them (Loom: sum_partial_grads)
            if isinstance(p.grad, DTensor) and p.grad.placements[0].is_partial():
                p.grad = p.grad.redistribute(p.grad.device_mesh, [Replicate()])
        for opt in opts:
            opt.step()
        out = out.detach()
        out = out.detach()
        return float(out.full_tensor() if isinstance(out, DTensor) else out)

    return step, model


def _split_optimizers(model, cfg: LoomConfig) -> list[torch.optim.Optimizer]:
    """AdamW as ``build_optimizer``, one per kind of parameter: foreach kernels cannot mix DTensor
    and plain tensors (without sp the norm weights stay plain)."""
    from torch.distributed.tensor import DTensor

    t = cfg.train
    opts = []
    for want in (True, False):
        ps = [p for p in model.parameters() if isinstance(p, DTensor) == want]
        groups = [
            {"params": [p for p in ps if p.ndim >= 2], "weight_decay": t.weight_decay},
            {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        if groups:
            opts.append(torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=True))
    return opts


def _worker(rank: int, world: int, init: str, args, out) -> None:
    init_gloo(rank, world, init, timeout_s=300)
    from torch.distributed.tensor.debug import CommDebugMode

    from loom.comm import CommMeter
    from loom.memory.activations import activation_bytes_per_layer, measure_layer_bytes
    from loom.mesh import ParallelDims, ParallelMesh
    from loom.parallel.tensor.parallelize import comm_bytes_formula

    cfg = _cfg(args)
    mesh = ParallelMesh(ParallelDims(tp=world), "cpu")
    meter = CommMeter()
    steppers = dict(
        zip(
            ("loom", "dtensor"),
            (loom_stepper(cfg, mesh, meter), dtensor_stepper(cfg, mesh.device_mesh["tp"])),
        )
    )
    losses = {name: step(0) for name, (step, _) in steppers.items()}  # same init, same batch: same loss
    times: dict[str, list[float]] = {}
    for i in range(1, args.steps + 1):
        for name, (step, _) in steppers.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step(i)
            dist.barrier()
            times.setdefault(name, []).append(time.perf_counter() - t0)
            times.setdefault(f"{name} cpu", []).append(time.process_time() - c0)
    meter.reset()
    steppers["loom"][0](0)
    moved, calls = meter.total_moved, dict(meter.calls)
    debug = CommDebugMode()
    with debug:
        steppers["dtensor"][0](0)
    x, _ = _batch(0)
    measured = measure_layer_bytes(steppers["loom"][1], x)[0]
    if rank == 0:
        out.put(
            {
                "times": {k: v[2:] for k, v in times.items()},
                "losses": losses,
                "moved": moved,
                "calls": calls,
                "formula": comm_bytes_formula(cfg.model, MICRO, SEQ, world, cfg.parallel.sp),
                "dtensor_calls": {str(k): v for k, v in debug.get_comm_counts().items()},
                "act": measured,
                "act_formula": activation_bytes_per_layer(cfg.model, MICRO, SEQ, world, cfg.parallel.sp),
                "act_tp1": activation_bytes_per_layer(cfg.model, MICRO, SEQ),
            }
        )
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--sp", action="store_true")
    add_no_write(ap)
    args = ap.parse_args()
    with results(
        "tensor_parallel", "Tensor parallelism against DTensor", write=not args.no_write, preformatted=True
    ):
        res = run_ranks(args.tp, _worker, args)
        med = {k: statistics.median(v) for k, v in res["times"].items()}
        print(
            f"\ntensor parallel, {args.tp} gloo ranks, sp={args.sp}: dim {args.dim}, {args.layers} layers, "
            f"batch {MICRO} x {SEQ}, vocab {VOCAB}; step = fwd + loss + bwd + AdamW"
        )
        print(f"first-step loss: loom {res['losses']['loom']:.6f}  dtensor {res['losses']['dtensor']:.6f}")
        print(f"{'contender':<10}{'wall s/step':>13}{'ratio':>8}{'cpu s/step':>13}{'ratio':>8}")
        for k in ("loom", "dtensor"):
            w, c = med[k], med[f"{k} cpu"]
            print(f"{k:<10}{w:>13.4f}{w / med['dtensor']:>8.3f}{c:>13.4f}{c / med['dtensor cpu']:>8.3f}")
        print(
            f"loom bytes moved/step per rank: {res['moved']:,.0f} (formula {res['formula']:,.0f}); calls {res['calls']}"
        )
        print(f"dtensor collectives/step: {res['dtensor_calls']}")
        print(
            f"activations saved per layer per rank: {res['act']:,} B (formula {res['act_formula']:,}; tp=1: "
            f"{res['act_tp1']:,})"
        )


if __name__ == "__main__":
    main()
