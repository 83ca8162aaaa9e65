"""Context parallelism at long sequence: saved activations per rank and step time, per mode and cp.

One sequence of T tokens on cp ranks (gloo, CPU) for cp in {1, 2, 4} and every ``parallel.cp_mode``
(allgather, ring, alltoall); a step is forward + loss + backward (no optimizer, no gradient sync:
only the context-parallel mechanics differ). Measured per rank: the bytes autograd saves for
backward over the whole forward (their peak: nothing is freed before backward; each storage once,
``loom.memory.activations.SavedTensorMeter``), the per-layer formula beside it, bytes sent per
step (``CommMeter``) beside :func:`loom.parallel.context.parallelize.cp_comm_bytes`, and the median
step time. PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` runs as a peer on
the same model and ranks if it can; otherwise its error is printed.

    nice python benchmarks/bench_context_parallel.py [--seq 8192] [--steps 3] [--cps 1,2,4]
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

from loom.config import LoomConfig, ModelConfig  # noqa: E402
from loom.model.llama import build_model, loss_fn  # noqa: E402

VOCAB, DIM, LAYERS, HEADS = 512, 64, 2, 4


def _cfg(seq: int, cp: int, mode: str, kv_heads: int) -> LoomConfig:
    m = ModelConfig(
        dim=DIM,
        n_layers=LAYERS,
        n_heads=HEADS,
        n_kv_heads=kv_heads,
        vocab_size=VOCAB,
        max_seq_len=seq,
        multiple_of=16,
    )
    cfg = LoomConfig(model=m)
    cfg.data.seq_len, cfg.parallel.cp, cfg.parallel.cp_mode = seq, cp, mode
    return cfg


def _batch(seq: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, VOCAB, (1, seq + 1), generator=torch.Generator().manual_seed(step))
    return t[:, :-1], t[:, 1:]


def _saved_bytes(model, x, y) -> int:
    from loom.memory.activations import SavedTensorMeter

    meter = SavedTensorMeter(model, layers=model.layers)
    with meter:
        loss = loss_fn(model(x), y)
    loss.backward()
    return meter.total


def _loom(rank: int, world: int, args, mode: str) -> dict:
    from loom.comm import CommMeter
    from loom.memory.activations import activation_bytes_per_layer
    from loom.mesh import ParallelDims, ParallelMesh
    from loom.parallel.context.parallelize import apply_context_parallel, cp_comm_bytes, shard_sequence

    cfg = _cfg(args.seq, world, mode, args.kv_heads)
    mesh = ParallelMesh(ParallelDims(cp=world), "cpu")
    meter = CommMeter()
    model = build_model(cfg.model, 0)
    apply_context_parallel(
        model,
        mesh,
        mode=cfg.parallel.cp_mode,
        seq_len=cfg.data.seq_len,
        dropout=cfg.model.dropout,
        meter=meter,
    )

    def batch(i):
        ((x, y),) = shard_sequence([_batch(args.seq, i)], world, rank)
        return x, y

    saved = _saved_bytes(model, *batch(0))
    times = []
    for i in range(args.steps):
        x, y = batch(i)
        model.zero_grad(set_to_none=True)
        meter.reset()
        dist.barrier()
        t0 = time.perf_counter()
        loss_fn(model(x), y).backward()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    m = cfg.model
    sent = sum(v for k, v in meter.moved.items())
    formula = cp_comm_bytes(
        1,
        args.seq,
        m.n_kv_heads * m.head_dim,
        m.n_layers,
        world,
        4,
        mode=mode,
        q_width=m.n_heads * m.head_dim,
        head_dim=m.head_dim,
    )
    layer = activation_bytes_per_layer(m, 1, args.seq, cp=world, cp_mode=mode)
    return dict(
        saved=saved,
        layer_formula=layer,
        time=statistics.median(times[1:] or times),
        sent=sent,
        formula=formula,
    )


def _torch_cp(rank: int, world: int, args) -> dict:
    """PyTorch's experimental context parallelism on the plain model (rotary tables sharded with the tokens)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    cfg = _cfg(args.seq, 1, "allgather", args.kv_heads)
    model = build_model(cfg.model, 0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    times = []
    for i in range(args.steps):
        x, y = _batch(args.seq, i)
        cos, sin = model.rope_cos[: args.seq].clone(), model.rope_sin[: args.seq].clone()
        model.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        with context_parallel(mesh, buffers=[x, y, cos, sin], buffer_seq_dims=[1, 1, 0, 0]):
            model.rope_cos, model.rope_sin = cos, sin
            loss_fn(model(x), y).backward()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    # its saved tensors (DTensor-backed inside the context) have no storage the meter can read
    return dict(saved=None, time=statistics.median(times[1:] or times))


def _worker(rank: int, world: int, init: str, args, out) -> None:
    init_gloo(rank, world, init, timeout_s=1800)
    res: dict = {}
    for mode in args.modes if world > 1 else ["allgather"]:
        res[mode] = _loom(rank, world, args, mode)
    if world > 1 and args.torch:
        try:
            res["torch context_parallel"] = _torch_cp(rank, world, args)
        except Exception as e:  # noqa: BLE001 (reported, not hidden)
            res["torch context_parallel"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        out.put(gathered)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--kv-heads", type=int, default=4, help="key/value heads (of 4 query heads)")
    ap.add_argument("--modes", default="allgather,ring,alltoall")
    ap.add_argument("--no-torch", dest="torch", action="store_false")
    add_no_write(ap)
    args = ap.parse_args()
    with results("context_parallel", "Context parallelism", write=not args.no_write, preformatted=True):
        args.modes = args.modes.split(",")
        print(
            f"context parallel, gloo on CPU: dim {DIM}, {LAYERS} layers, {HEADS} heads ({args.kv_heads} kv), vocab {VOCAB}, "
            f"one sequence of T = {args.seq}; step = forward + loss + backward; fp32"
        )
        print(
            f"{'cp':>3} {'mode':<24} {'saved/rank MiB':>15} {'x cp=1':>7} {'layer formula MiB':>18} "
            f"{'sent/rank MiB':>14} {'formula MiB':>12} {'step s':>8}"
        )
        base = None
        for cp in [int(c) for c in args.cps.split(",")]:
            ranks = run_ranks(cp, _worker, args)
            for mode in ranks[0]:
                per = [r[mode] for r in ranks]
                if "error" in per[0]:
                    print(f"{cp:>3} {mode:<24} does not run here: {per[0]['error']}")
                    continue
                if per[0]["saved"] is None:
                    print(
                        f"{cp:>3} {mode:<24} {'n/a':>15} {'':>7} {'':>18} {'':>14} {'':>12} {max(p['time'] for p in per):8.2f}"
                    )
                    continue
                saved = max(p["saved"] for p in per)
                base = base or saved
                sent = max(p.get("sent", 0) for p in per) / 2**20
                formula = f"{per[0]['formula'] / 2**20:12.2f}" if "formula" in per[0] else f"{'':>12}"
                layer = (
                    f"{per[0]['layer_formula'] / 2**20:18.2f}" if "layer_formula" in per[0] else f"{'':>18}"
                )
                print(
                    f"{cp:>3} {mode:<24} {saved / 2**20:15.2f} {saved / base * cp:7.2f} {layer} {sent:14.2f} "
                    f"{formula} {max(p['time'] for p in per):8.2f}"
                )
        print("x cp=1: saved bytes per rank times cp over cp = 1's (1.00 = memory shrinks as 1/cp)")


if __name__ == "__main__":
    main()
