"""The largest model ZeRO-Infinity (``parallel.offload_params``) trains in a per-rank device budget,
beside ZeRO-3 alone: from the planner's memory model, and one point checked by a run here.

1. Formula (:meth:`loom.plan.cost.CostModel.stage_memory`): Llama-shaped models (head dim 128,
   n_layers = dim / 128, SwiGLU 8/3·dim, vocabulary 32k) of growing width on N ranks of a device
   of M bytes, bf16, micro-batch 1 of 4,096 tokens, full recomputation; the largest whose peak fits
   M under ZeRO-3 (16Φ/N + transients) and under ZeRO-Infinity (transients only; 16Φ/N on the host).
2. Run (CPU, gloo, 2 ranks, fp32): a model whose ZeRO-3 state does not fit a budget of M_cpu bytes
   per rank trains under ``offload_params = cpu`` and ``disk`` inside it: measured device bytes per
   rank = state outside the store (``state_bytes()['device_bytes']``) + the step's transient peak.

    python benchmarks/bench_zero_infinity.py [--nodes 1] [--device h100-sxm] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import add_no_write, init_gloo, results, run_ranks  # noqa: E402

from loom.config import LoomConfig, ModelConfig, TrainConfig  # noqa: E402

GB = 1e9


def llama(dim: int) -> ModelConfig:
    return ModelConfig(
        dim=dim,
        n_layers=dim // 128,
        n_heads=dim // 128,
        n_kv_heads=max(1, dim // 1024),
        vocab_size=32000,
        max_seq_len=4096,
        multiple_of=256,
    )


def largest(device: str, nodes: int, offload: bool) -> tuple[int, float, float]:
    """(dim, parameters, peak bytes) of the widest model of the family that fits one device."""
    from loom.model.llama import build_model, count_params
    from loom.plan.cost import CostModel, Layout, Workload
    from loom.plan.hardware import ClusterSpec

    cluster = ClusterSpec.single_node(device, 8, nodes=nodes)
    n = 8 * nodes
    lay = Layout(dp=n, dp_shard=n, zero=3, micro_batch=1, recompute="full", offload_params=offload)
    best = (0, 0.0, 0.0)
    for dim in range(1024, 65536 + 1, 512):
        cm = CostModel(llama(dim), Workload(n, 4096, precision="bf16"), cluster)
        peak = cm.memory(lay)[0]
        if peak > cluster.device.memory_bytes:
            break
        with torch.device("meta"):
            phi = count_params(build_model(llama(dim), 0, torch.device("meta"), meta=True))
        best = (dim, float(phi), peak)
    return best


def _rank(rank: int, world: int, init: str, steps: int, kind: str, tmp: str, out) -> None:
    from loom.comm import CommMeter
    from loom.mesh import ParallelDims, ParallelMesh
    from loom.model.llama import build_model, loss_fn
    from loom.train.build import parallelize
    from loom.train.schedule import lr_at
    from loom.train.step import plain_run, train_step

    init_gloo(rank, world, init, threads=1)
    mesh = ParallelMesh(ParallelDims(dp_shard=world), "cpu")
    cfg = LoomConfig(
        model=ModelConfig(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=4096, max_seq_len=64),
        train=TrainConfig(steps=steps, warmup_steps=0),
    )
    cfg.parallel.dp, cfg.parallel.dp_shard, cfg.parallel.zero = world, world, 3
    cfg.parallel.offload_params, cfg.run.dir = kind, tmp
    model = build_model(cfg.model, cfg.train.seed)
    strategy = parallelize(model, mesh, cfg, CommMeter()).strategy
    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(steps):
        tokens = torch.randint(0, 4096, (2, 65), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        res = train_step(
            plain_run(model, strategy, loss_fn),
            [(tokens[:, :-1], tokens[:, 1:])],
            1.0,
            lr_at(step, cfg.train),
            mesh.group("dp"),
        )
        times.append(time.perf_counter() - t0)
    sb = strategy.state_bytes()
    persistent = sb.get("device_bytes", sb["param_bytes"] + sb["grad_bytes"] + sb["optim_bytes"])
    if rank == 0:
        out.put(
            {
                "persistent": persistent,
                "transient": sb["transient_peak_bytes"],
                "loss": res.loss,
                "ms": 1000 * statistics.median(times[1:] or times),
                "store": sb.get("param_offload_bytes", 0)
                + sb.get("grad_offload_bytes", 0)
                + sb["optim_offload_bytes"],
            }
        )
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="h100-sxm")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    add_no_write(ap)
    args = ap.parse_args()
    with results("zero_infinity", "ZeRO-Infinity: parameter offload", write=not args.no_write):
        from loom.plan.hardware import get_device

        mem = get_device(args.device).memory_bytes
        print(
            f"## Largest model in {mem / GB:.0f} GB per {args.device}, {8 * args.nodes} ranks, bf16, 4k tokens/rank, full recompute\n"
        )
        print("| | width | layers | parameters | device peak (GB) | host or disk per rank (GB) |")
        print("|---|---|---|---|---|---|")
        for name, off in (("ZeRO-3", False), ("ZeRO-Infinity (offload_params)", True)):
            dim, phi, peak = largest(args.device, args.nodes, off)
            host = 16 * phi / (8 * args.nodes) / GB if off else 0.0
            print(f"| {name} | {dim} | {dim // 128} | {phi / 1e9:.1f} B | {peak / GB:.1f} | {host:.0f} |")
        print("\n## One point run here (CPU, 2 ranks, fp32, dim 256 x 8 layers)\n")
        print(
            "| | device bytes between steps | transient peak | device total | in the store | loss | ms/step |"
        )
        print("|---|---|---|---|---|---|---|")
        with tempfile.TemporaryDirectory() as tmp:
            for kind in ("none", "cpu", "disk"):
                r = run_ranks(2, _rank, args.steps, kind, tmp)
                total = r["persistent"] + r["transient"]
                print(
                    f"| offload_params={kind} | {r['persistent']:,} | {r['transient']:,} | {total:,} | {r['store']:,} "
                    f"| {r['loss']:.6f} | {r['ms']:.0f} |"
                )


if __name__ == "__main__":
    main()
