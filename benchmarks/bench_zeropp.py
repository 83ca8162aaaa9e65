"""ZeRO++ (qwZ, hpZ, qgZ) vs ZeRO-3: bytes per step by collective, loss after S steps, step time.

One run per contender over the same 4 gloo ranks (hpZ groups of 2 ranks stand for nodes), same
model, seed and data: sequences of a fixed random bigram chain (each token has 4 successors, so the
loss can fall from ln V to about ln 4). Prints per contender the bytes one rank sends per step by
collective (the meter), the bytes that cross the hpZ group ("inter-node"; qgZ runs in two hops over
those groups, its first inside them), the loss averaged over
the last 10 steps and its largest gap to ZeRO-3's along the run, and the median step time.

    python benchmarks/bench_zeropp.py [--steps 200] [--world 4] [--hpz-group 2]
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

from loom.config import LoomConfig, ModelConfig, TrainConfig  # noqa: E402

VOCAB, SEQ, MICRO, BATCH = 512, 64, 4, 16
CONTENDERS = {
    "zero-3": {},
    "qwZ": {"zeropp_qwz": True},
    "hpZ": {"zeropp_hpz": True},
    "qgZ": {"zeropp_qgz": True},
    "qgZ int4": {"zeropp_qgz": True, "zeropp_qgz_bits": 4},
    "qwZ+hpZ+qgZ": {"zeropp_qwz": True, "zeropp_hpz": True, "zeropp_qgz": True},
}


def bigram_batch(step: int, rows: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp rank's rows of global batch ``step``: walks of a fixed random chain of 4 successors per token."""
    succ = torch.randint(0, VOCAB, (VOCAB, 4), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1000 + step)
    tok = torch.empty(rows, SEQ + 1, dtype=torch.long)
    tok[:, 0] = torch.randint(0, VOCAB, (rows,), generator=g)
    pick = torch.randint(0, 4, (rows, SEQ), generator=g)
    for t in range(SEQ):
        tok[:, t + 1] = succ[tok[:, t], pick[:, t]]
    per = rows // dp
    mine = tok[dp_rank * per : (dp_rank + 1) * per]
    return mine[:, :-1], mine[:, 1:]


def _rank(rank: int, world: int, init: str, steps: int, hpz: int, out) -> None:
    from loom.comm import CommMeter
    from loom.mesh import ParallelDims, ParallelMesh
    from loom.model.llama import build_model, loss_fn
    from loom.train.build import parallelize
    from loom.train.schedule import lr_at
    from loom.train.step import plain_run, train_step

    init_gloo(rank, world, init, threads=1)
    mesh = ParallelMesh(ParallelDims(dp_shard=world), "cpu")
    results = {}
    for name, opts in CONTENDERS.items():
        cfg = LoomConfig(
            model=ModelConfig(
                dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=SEQ
            ),
            train=TrainConfig(steps=steps, lr=3e-3, warmup_steps=10, global_batch=BATCH, micro_batch=MICRO),
        )
        cfg.parallel.dp, cfg.parallel.dp_shard, cfg.parallel.zero, cfg.parallel.hpz_group = (
            world,
            world,
            3,
            hpz,
        )
        for k, v in opts.items():
            setattr(cfg.parallel, k, v)
        model = build_model(cfg.model, cfg.train.seed)
        meter = CommMeter()
        strategy = parallelize(model, mesh, cfg, meter).strategy
        losses, times, moved = [], [], {}
        for step in range(steps):
            meter.reset()
            x, y = bigram_batch(step, BATCH, rank, world)
            micro = [(x[i : i + MICRO], y[i : i + MICRO]) for i in range(0, len(x), MICRO)]
            dist.barrier()
            t0 = time.perf_counter()
            res = train_step(
                plain_run(model, strategy, loss_fn), micro, 1.0, lr_at(step, cfg.train), mesh.group("dp")
            )
            times.append(time.perf_counter() - t0)
            losses.append(res.loss)
            moved = dict(meter.moved)
        strategy.remove()
        results[name] = {"losses": losses, "time": statistics.median(times[2:]), "moved": moved}
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--hpz-group", type=int, default=2)
    add_no_write(ap)
    args = ap.parse_args()
    with results("zeropp", "ZeRO++: quantized and hierarchical collectives", write=not args.no_write):
        res = run_ranks(args.world, _rank, args.steps, args.hpz_group)
        ref = res["zero-3"]
        base_bytes = sum(ref["moved"].values())
        print(
            f"ZeRO-3 over {args.world} ranks, hpZ groups of {args.hpz_group}; {args.steps} steps; bytes one rank sends per step\n"
        )
        print(
            "| | all-gather | all-gather in group (hpZ) | reduce-scatter | all-to-all | all-to-all in group (qgZ) "
            "| crossing groups | vs ZeRO-3 | loss (last 10) | max abs loss gap | step (ms) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for name, r in res.items():
            m = r["moved"]
            cross = sum(v for k, v in m.items() if not k.endswith("_hpz"))  # _hpz: inside a group (node)
            last = statistics.mean(r["losses"][-10:])
            gap = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
            cells = [
                f"{m.get(k, 0):,.0f}"
                for k in ("all_gather", "all_gather_hpz", "reduce_scatter", "all_to_all", "all_to_all_hpz")
            ]
            print(
                f"| {name} | "
                + " | ".join(cells)
                + f" | {cross:,.0f} | {cross / base_bytes:.1%} | {last:.4f} | "
                f"{gap:.4f} | {1000 * r['time']:.1f} |"
            )
        print(
            f"\nloss at step 0: {ref['losses'][0]:.4f} (ln V = {torch.log(torch.tensor(float(VOCAB))):.4f}), "
            f"ln 4 = {torch.log(torch.tensor(4.0)):.4f}"
        )


if __name__ == "__main__":
    main()
