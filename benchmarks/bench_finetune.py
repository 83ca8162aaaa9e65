"""The course material's two fine-tuning examples at this machine's scale: the largest micro-batch
each memory setup fits under a per-rank budget, predicted and measured, with its step time.

Course: (1) a ~400M chat model, ZeRO-2 + fp16 against DDP: ZeRO-2 fitted about twice DDP's
batch; (2) GPT-2 1.5B on one 24 GB GPU: DDP ran out of memory, ZeRO-3 + CPU offload fitted.
Here: a Llama-family model and a larger GPT-2-family model (random init), 2 gloo ranks, one
micro-batch per step (global batch = 2b), every setup in fresh rank processes:

    DDP (fp32)              W + G + O = 4 + 4 + 8 bytes per parameter Φ on every rank
    ZeRO-2 + bf16           2Φ + (2 + 12)Φ/N   (fp16 in the course: same bytes; fp16 GEMMs run
                            at ~0.1 GFLOP/s on this CPU against ~400 for bf16, so bf16 stands in)
    ZeRO-3                  (4 + 4 + 8)Φ/N + the units gathered in flight
    ZeRO-3 + CPU offload    (4 + 4)Φ/N on the device; the 8Φ/N of Adam on the host
    LoRA / QLoRA (DDP)      frozen base 4Φ (QLoRA: ~0.516 bytes per target weight, NF4) + 16 bytes
                            per adapter parameter (r = 16 on every linear layer)

Per setup: one step at micro-batch b = 1, then at 4; the affine m(b) = m0 + c·b through them
guesses b_max, then steps bisect between the largest b that fitted and the smallest that did not;
step time is a second step at b_max. Memory of the first step = peak resident set size (Linux
VmHWM) minus the process's after a warm-up (the same setup on a one-layer model: libraries and
kernels loaded) and before the model was built; "held between steps" = resident after that step;
a later step's = held + its own rise above the resident set just before it (so caches a step of
another b left behind, e.g. oneDNN's bf16 primitives, are not charged to it). With offload =
"cpu" the optimizer state in host memory is left out (on a CPU machine host is the device; on a
GPU that state is not in device memory). The planner's b_max: the largest b whose predicted peak
(:meth:`loom.plan.cost.CostModel.stage_memory`, less the device runtime constant) fits; LoRA rows
use the planner's activations with the LoRA states' formula above (the planner has no LoRA).

    python benchmarks/bench_finetune.py [--budget-mib 1024] [--seq 128] [--models llama,gpt2]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import add_no_write, init_gloo, results, run_ranks  # noqa: E402

from loom import config as C  # noqa: E402

WORLD, VOCAB, PROBE = 2, 8192, 4
MiB = 2**20
MODELS = {  # name: (course counterpart, model fields)
    "llama": ("~400M chat model", dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4)),
    "gpt2": (
        "GPT-2 1.5B",
        dict(
            dim=1024,
            n_layers=10,
            n_heads=16,
            n_kv_heads=16,
            norm="layernorm",
            mlp="gelu_tanh",
            positions="learned",
            bias=True,
            tie_embeddings=True,
        ),
    ),
}
SETUPS = {  # name: (parallel fields, train fields, finetune method)
    "DDP (fp32)": ({"zero": 0}, {}, "full"),
    "ZeRO-2 + bf16": ({"zero": 2}, {"precision": "bf16"}, "full"),
    "ZeRO-3": ({"zero": 3}, {}, "full"),
    "ZeRO-3 + CPU offload": ({"zero": 3, "offload": "cpu"}, {}, "full"),
    "LoRA r16 (DDP)": ({"zero": 0}, {}, "lora"),
    "QLoRA r16 (DDP)": ({"zero": 0}, {}, "qlora"),
}


def make_config(model: str | dict, setup: str, b: int, seq: int) -> C.LoomConfig:
    """The config of ``setup`` on ``model`` (a name of MODELS, or its fields) at micro-batch ``b``."""
    par, train, method = SETUPS[setup]
    cfg = C.LoomConfig()
    fields = MODELS[model][1] if isinstance(model, str) else model
    cfg.model = C.ModelConfig(vocab_size=VOCAB, max_seq_len=seq, **fields)  # type: ignore[arg-type]
    cfg.data.seq_len = seq
    cfg.train = C.TrainConfig(
        steps=10_000, warmup_steps=0, grad_clip=1.0, micro_batch=b, global_batch=b * WORLD, **train
    )
    sharded = par["zero"] > 0
    cfg.parallel = C.ParallelConfig(dp=WORLD, dp_shard=WORLD if sharded else 1, **par)
    if method != "full":
        cfg.finetune.method = method  # type: ignore[assignment]
        cfg.finetune.lora_rank = 16
    return C.validate(cfg, WORLD)


# ----------------------------------------------------------------------------- predictions


def lora_state_bytes(cfg: C.LoomConfig) -> float:
    """Frozen base (fp32, or NF4 for the targets under QLoRA) + 16 bytes per adapter parameter."""
    from loom.finetune.lora import LoRALinear, apply_lora, is_adapter
    from loom.finetune.nf4 import nf4_bytes
    from loom.model.llama import build_model

    model = build_model(cfg.model, 0, meta=True)
    apply_lora(model, targets=C.lora_targets(cfg), finetune=cfg.finetune)
    quantized = (
        {id(m.weight) for m in model.modules() if isinstance(m, LoRALinear)}
        if cfg.finetune.method == "qlora"
        else set()
    )
    total = 0.0
    for name, p in model.named_parameters():
        total += (
            16 * p.numel()
            if is_adapter(name)
            else nf4_bytes(p.numel())
            if id(p) in quantized
            else 4 * p.numel()
        )
    return total


def predicted_bytes(cfg: C.LoomConfig) -> float:
    """The planner's peak per rank (less the runtime constant); LoRA: its states by formula."""
    from loom.plan.auto import local_cluster
    from loom.plan.cost import CostModel
    from loom.plan.report import layout_of, model_of, workload_of

    cluster = local_cluster(WORLD)
    bd = CostModel(model_of(cfg), workload_of(cfg), cluster).stage_memory(layout_of(cfg), 0, 1)
    total = sum(bd.values()) - cluster.device.runtime_overhead_bytes
    if cfg.finetune.method != "full":  # states and the update's workspace of the adapters alone
        from loom.finetune.lora import adapter_numel
        from loom.model.llama import build_model, count_params

        share = adapter_numel(cfg) / count_params(build_model(cfg.model, 0, meta=True))
        full = bd["weights"] + bd["gradients"] + bd["optimizer"] + bd["optimizer step"]
        total += lora_state_bytes(cfg) + share * bd["optimizer step"] - full
    return total


def planner_bmax(model: str, setup: str, seq: int, budget: float, cap: int) -> int:
    b = 0
    while b < cap and predicted_bytes(make_config(model, setup, b + 1, seq)) <= budget:
        b += 1
    return b


# ----------------------------------------------------------------------------- measurement


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker(rank: int, world: int, init: str, model: dict, setup: str, args, out) -> None:
    from loom.device import peak_memory_bytes, reset_peak_memory
    from loom.mesh import ParallelDims, ParallelMesh
    from loom.model.llama import build_model
    from loom.train.build import build_run
    from loom.train.step import train_step

    init_gloo(rank, world, init, threads=1)
    cpu = torch.device("cpu")
    cfg = make_config(model, setup, 1, args.seq)
    mesh = ParallelMesh(ParallelDims.from_config(cfg.parallel), "cpu")
    g = torch.Generator().manual_seed(rank)
    # Warm-up: the same setup on a tiny model loads every library and kernel a step touches, so the
    # baseline below holds the runtime (the planner's runtime constant) and the peaks only the run.
    tiny = make_config(model | {"dim": 64, "n_layers": 1, "n_heads": 4, "n_kv_heads": 4}, setup, 1, args.seq)
    warm = build_run(tiny, mesh, build_model(tiny.model, 0, cpu, meta=True))
    t = torch.randint(0, VOCAB, (2, args.seq + 1), generator=g)
    train_step(warm, [(t[:, :-1], t[:, 1:])], 1.0, 1e-4, mesh.group("dp"))
    del warm
    gc.collect()
    base = _rss()
    run = build_run(cfg, mesh, build_model(cfg.model, cfg.train.seed, cpu, meta=True))

    held = 0

    def step(b: int) -> tuple[float, float]:
        """(peak bytes, seconds) of one step at micro-batch b, the largest over the ranks: held state +
        the step's own rise above the resident set before it (caches other shapes left are not counted)."""
        t = torch.randint(0, VOCAB, (b, args.seq + 1), generator=g)
        gc.collect()
        before = _rss()
        reset_peak_memory(cpu)
        t0 = time.perf_counter()
        train_step(run, [(t[:, :-1], t[:, 1:])], cfg.train.grad_clip, 1e-4, mesh.group("dp"))
        dt = time.perf_counter() - t0
        host = run.strategy.state_bytes().get("optim_offload_bytes", 0)
        rise = peak_memory_bytes(cpu) - (before if held else base + host)
        res = torch.tensor([held + rise, dt], dtype=torch.float64)
        dist.all_reduce(res, op=dist.ReduceOp.MAX)
        return float(res[0]), float(res[1])

    budget = args.budget_mib * MiB
    m1, t1 = step(1)
    gc.collect()  # held between steps: resident after a step (optimizer state allocated), host state apart
    held = _rss() - base - run.strategy.state_bytes().get("optim_offload_bytes", 0)
    held = int(max(held, 1))
    result = {"states": held, "m1": m1, "t1": t1, "bmax": 0, "peak": m1, "time": t1}
    if m1 <= budget:
        fits, over = {1: m1}, {}
        mp, _ = step(PROBE)
        (fits if mp <= budget else over)[PROBE] = mp
        slope = max((mp - m1) / (PROBE - 1), 1.0)
        guess = max(1, min(args.cap, 1 + int((budget - m1) // slope)))
        while True:  # bisect between the largest b that fit and the smallest that did not
            lo, hi = max(fits), min(over, default=args.cap + 1)
            if hi - lo <= 1:
                break
            b = guess if lo < guess < hi else (lo + hi) // 2
            peak, _ = step(b)
            (fits if peak <= budget else over)[b] = peak
        b = max(fits)
        _, dt = step(b)
        result |= {"bmax": b, "peak": fits[b], "time": dt, "slope": slope}
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-mib", type=float, default=1024.0, help="memory budget per rank")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--models", default="llama,gpt2")
    ap.add_argument("--setups", default=",".join(SETUPS), help="comma list of setup names")
    ap.add_argument("--cap", type=int, default=48, help="largest micro-batch tried")
    ap.add_argument("--smoke", action="store_true", help="tiny models and budget: check that the script runs")
    add_no_write(ap)
    args = ap.parse_args()
    with results("finetune", "Fine-tuning memory", write=not args.no_write):
        if args.smoke:
            for _, fields in MODELS.values():
                fields |= {
                    "dim": 64,
                    "n_layers": 2,
                    "n_heads": 4,
                    "n_kv_heads": 4 if fields.get("bias") else 2,
                }
            args.seq, args.budget_mib, args.cap = 32, 48.0, 8
        os.environ.setdefault(
            "MALLOC_MMAP_THRESHOLD_", "65536"
        )  # freed tensors go back to the OS: peaks per step
        budget = args.budget_mib * MiB
        rows = []
        t_start = time.perf_counter()
        for model in args.models.split(","):
            from loom.model.llama import build_model, count_params

            phi = count_params(build_model(make_config(model, "DDP (fp32)", 1, args.seq).model, 0, meta=True))
            for setup in args.setups.split(","):
                try:
                    planned = planner_bmax(model, setup, args.seq, budget, args.cap)
                    pred1 = predicted_bytes(make_config(model, setup, max(planned, 1), args.seq))
                except Exception as e:  # noqa: BLE001 - a setup this tree cannot build yet is reported, not fatal
                    print(f"{model} / {setup}: not available ({type(e).__name__}: {e})", file=sys.stderr)
                    continue
                t0 = time.perf_counter()
                r = run_ranks(WORLD, _worker, MODELS[model][1], setup, args)
                rows.append((model, phi, setup, planned, pred1, r, time.perf_counter() - t0))
                print(
                    f"{model} / {setup}: done in {time.perf_counter() - t0:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
        report(args, rows, time.perf_counter() - t_start)


def report(args, rows, total_s: float) -> None:
    print(
        f"\nFine-tuning memory, {WORLD} gloo ranks (1 core each), budget {args.budget_mib:.0f} MiB per rank, "
        f"seq {args.seq}, vocabulary {VOCAB}, one micro-batch of b sequences per rank per step "
        f"(total {total_s / 60:.1f} min)\n"
    )
    print(
        "| model | setup | held between steps MiB/rank | b_max planner | b_max measured | peak at b_max MiB (planner / measured) "
        "| step s | tokens/s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for model, phi, setup, planned, pred, r, _ in rows:
        name = f"{model} {phi / 1e6:.0f}M ({MODELS[model][0]})"
        if r["bmax"] == 0:
            print(
                f"| {name} | {setup} | {r['states'] / MiB:.0f} | {planned} | 0 (b=1: {r['m1'] / MiB:.0f} MiB) | - | "
                f"{r['t1']:.2f} (b=1) | - |"
            )
            continue
        tps = r["bmax"] * args.seq * WORLD / r["time"]
        print(
            f"| {name} | {setup} | {r['states'] / MiB:.0f} | {planned} | {r['bmax']} | "
            f"{pred / MiB:.0f} (b={max(planned, 1)}) / {r['peak'] / MiB:.0f} | {r['time']:.2f} | {tps:,.0f} |"
        )


if __name__ == "__main__":
    main()
