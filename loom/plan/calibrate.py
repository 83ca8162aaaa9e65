"""``loom plan calibrate``: measure this machine and save a :class:`~loom.plan.hardware.Profile`.

What is measured, per rank (``--threads``, default 1: one rank per core):

- GEMM throughput: fp32 ``torch.mm`` on a few shapes (total FLOPs / total time). Given
  ``--config``, the shapes are that model's (q/k/v/o, SwiGLU and head GEMMs at ``micro_batch *
  seq_len`` tokens, forward and both backward products), and the rate stored is the run's
  sustained one: a one-rank ``loom train`` of the config is timed and converted to the FLOP/s at
  which the planner's one-rank step time matches it (:func:`sustained_flops`). Small models spend
  their time in per-op framework cost, which a bare GEMM rate does not see; this folds it into
  the compute rate, so layouts that split the FLOPs (tp, pp) but not the op count are predicted
  too fast.
- memory bandwidth: ``c = a + b`` on activation-sized fp32 tensors, 12 bytes per element over
  the time (again including the per-call overhead an elementwise op of that size pays).
- collectives: ``all_reduce``, ``all_gather``, ``reduce_scatter`` for each group size 2..nproc,
  run in ``nproc`` spawned processes joined by a ``file://`` rendezvous (gloo on CPU, nccl on
  GPUs), messages 4 KiB to 4 MiB; a least-squares fit ``t = latency + volume / bus_bandwidth``
  with the ring volume :class:`~loom.plan.hardware.Machine` uses.

Ranks on this machine share cores: :func:`contended` scales the compute numbers of a profile by
``cores / world`` when more ranks than cores run at once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from loom.config import LoomConfig, ModelConfig
from loom.plan.hardware import CollectiveFit, Profile

OPS = ("all_reduce", "all_gather", "reduce_scatter")
MESSAGE_BYTES = (4 << 10, 64 << 10, 512 << 10, 4 << 20)
GENERIC_SHAPES = ((128, 64, 192), (512, 256, 256), (1024, 1024, 1024))


def cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def model_shapes(model: ModelConfig, tokens: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of every GEMM one layer + the head runs for ``tokens`` tokens, forward and backward."""
    h, f, kd, v = model.dim, model.resolved_ffn_dim(), model.n_kv_heads * model.head_dim, model.vocab_size
    fwd = [(tokens, h, h), (tokens, h, kd), (tokens, h, kd), (tokens, h, h), (tokens, h, f), (tokens, h, f)]
    fwd += [(tokens, f, h)] + ([(tokens, h, v)] if v > 0 else [])
    out = []
    for m, k, n in fwd:  # forward, input gradient (m x n @ n x k), weight gradient (k x m @ m x n)
        out += [(m, k, n), (m, n, k), (k, m, n)]
    return out


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_gemm(shapes: list[tuple[int, int, int]], repeats: int = 20) -> tuple[float, dict[str, float]]:
    """(total FLOPs / total seconds, FLOP/s per shape) of fp32 ``torch.mm`` over ``shapes``."""
    import torch

    total_flops = total_s = 0.0
    per: dict[str, float] = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        out = torch.empty(m, n)
        reps = max(3, min(repeats, int(2e9 / (2 * m * k * n + 1))))
        sec = _timed(lambda a=a, b=b, out=out: torch.mm(a, b, out=out), reps)
        total_flops += 2.0 * m * k * n
        total_s += sec
        per[f"{m}x{k}x{n}"] = 2.0 * m * k * n / sec
    return total_flops / total_s, per


def measure_bandwidth(elements: list[int], repeats: int = 20) -> float:
    """Bytes/s of ``c = a + b`` (12 bytes per fp32 element), total over ``elements`` sizes."""
    import torch

    moved = total_s = 0.0
    for n in elements:
        a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
        total_s += _timed(lambda a=a, b=b, c=c: torch.add(a, b, out=c), repeats)
        moved += 12.0 * n
    return moved / total_s


def measure_trainer_step(config: str, steps: int = 12, runs: int = 2) -> float:
    """Step time (s) of a one-rank ``loom train config`` as :func:`loom.plan.validate.run_layout`
    measures it (the fastest window), the least of ``runs`` runs."""
    from loom.plan.validate import base_overrides, run_layout

    best = float("inf")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            row = run_layout(config, 1, base_overrides(steps), str(Path(tmp) / f"run{i}"))
            best = min(best, float(row["step_time_s"]))
    return best


def sustained_flops(cfg: LoomConfig, hbm: float, seconds: float) -> float:
    """The FLOP/s at which the planner's one-rank step time of ``cfg`` equals ``seconds``.

    One rank's predicted step is ``A / flops + B`` (GEMMs and attention over the FLOP rate;
    elementwise ops and the optimizer over ``hbm``); two evaluations give A and B. Falls back to
    the A-only rate when B >= ``seconds``.
    """
    from loom.plan.auto import local_cluster
    from loom.plan.cost import RECOMPUTE, Layout, estimate
    from loom.plan.report import model_of, workload_of

    rec = cfg.train.recompute if cfg.train.recompute in RECOMPUTE else "none"
    lay = Layout(micro_batch=cfg.train.micro_batch, recompute=rec)
    model, work, cluster = model_of(cfg), workload_of(cfg), local_cluster(1)

    def step(flops: float) -> float:
        prof = Profile(device="cpu", gemm_flops={"fp32": flops}, hbm_bandwidth=hbm)
        return estimate(model, lay, work, cluster, profile=prof).step_time

    f1, f2 = 1e9, 2e9
    t1, t2 = step(f1), step(f2)
    a = (t1 - t2) / (1 / f1 - 1 / f2)
    b = t1 - a / f1
    return a / (seconds - b) if seconds > b else a / seconds


def _volume(op: str, n: int, size: float) -> float:
    return (2.0 if op == "all_reduce" else 1.0) * (n - 1) / n * size


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``t = latency + volume / bandwidth`` -> (bandwidth, latency), both kept positive."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.0
    if slope <= 0:  # flat (latency-bound) measurements: the largest message sets the bandwidth
        x, y = max(points)
        return x / max(y, 1e-9), min(ys)
    lat = max(0.0, my - slope * mx)
    return 1.0 / slope, lat


def _coll_worker(rank: int, world: int, init: str, backend: str, repeats: int, queue) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # *_into_tensor renamed in newer torch
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    results: list[tuple[str, int, int, float]] = []
    for n in range(2, world + 1):
        group = dist.new_group(list(range(n)))  # every rank takes part in creating every group
        if rank >= n:
            continue
        for size in MESSAGE_BYTES:
            numel = size // 4 // n * n
            full = torch.ones(numel, device=device)
            part = torch.ones(numel // n, device=device)
            calls = {
                "all_reduce": lambda full=full, g=group: dist.all_reduce(full, group=g),
                "all_gather": lambda full=full, part=part, g=group: dist.all_gather_into_tensor(full, part, group=g),
                "reduce_scatter": lambda full=full, part=part, g=group: dist.reduce_scatter_tensor(part, full, group=g),
            }
            for op in OPS:
                dist.barrier(group=group)
                sec = _timed(calls[op], repeats)
                results.append((op, n, numel * 4, sec))
    dist.barrier()
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def measure_collectives(nproc: int, backend: str = "gloo", repeats: int = 10) -> list[CollectiveFit]:
    """Fits for every op in :data:`OPS` and group size 2..``nproc`` (spawned processes, file:// init)."""
    if nproc < 2:
        return []
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init = str(Path(tmp) / "rdzv")
        ctx_procs = [
            ctx.Process(target=_coll_worker, args=(r, nproc, init, backend, repeats, queue)) for r in range(nproc)
        ]
        for p in ctx_procs:
            p.start()
        for p in ctx_procs:
            p.join()
        if any(p.exitcode != 0 for p in ctx_procs):
            raise RuntimeError(f"calibrate: a collective worker failed (exit codes {[p.exitcode for p in ctx_procs]})")
        rows = queue.get()
    fits = []
    for op in OPS:
        for n in range(2, nproc + 1):
            pts = [(_volume(op, n, s), t) for o, g, s, t in rows if o == op and g == n]
            bw, lat = fit_line(pts)
            fits.append(CollectiveFit(op=op, scope="intra", group_size=n, bus_bandwidth=bw, latency=lat))
    return fits


def calibrate(
    nproc: int = 2, config: str | None = None, backend: str = "gloo", device: str = "cpu", threads: int = 1
) -> Profile:
    """Measure compute and memory bandwidth (one rank, ``threads`` threads) and collectives.

    With a ``config``, the stored FLOP rate is that run's sustained one (:func:`sustained_flops`
    of :func:`measure_trainer_step`), not the bare GEMM rate: at small sizes the framework's
    per-op cost (autograd, hooks, the optimizer's loops), not the FLOPs, sets the time.
    """
    import torch

    torch.set_num_threads(threads)
    cfg, tokens = None, 128
    if config is not None:
        from loom.config import load
        from loom.plan.report import model_of

        cfg = load(config, [])
        cfg.model = model_of(cfg)
        tokens = cfg.train.micro_batch * cfg.data.seq_len
    model = cfg.model if cfg is not None else None
    flops, _ = measure_gemm(model_shapes(model, tokens) if model is not None else list(GENERIC_SHAPES))
    width = max(model.dim, model.resolved_ffn_dim()) if model is not None else 256
    hbm = measure_bandwidth([tokens * width, 4 * tokens * width])
    if cfg is not None and config is not None:
        flops = sustained_flops(cfg, hbm, measure_trainer_step(config))
    return Profile(device=device, gemm_flops={"fp32": flops}, hbm_bandwidth=hbm,
                   collectives=measure_collectives(nproc, backend))  # fmt: skip


def contended(profile: Profile, world: int, n_cores: int | None = None) -> Profile:
    """``profile`` with compute and memory bandwidth scaled by ``cores / world`` when ranks outnumber cores."""
    share = min(1.0, (n_cores or cores()) / max(1, world))
    return Profile(
        device=profile.device,
        gemm_flops={k: v * share for k, v in profile.gemm_flops.items()},
        hbm_bandwidth=profile.hbm_bandwidth * share,
        collectives=list(profile.collectives),
    )


def main(argv: list[str]) -> int:
    """``loom plan calibrate [--out profile.json] [--nproc N] [--config run.toml]``."""
    p = argparse.ArgumentParser(prog="loom plan calibrate", description="measure this machine into a profile")
    p.add_argument("--out", default="profile.json", help="where to write the profile (JSON)")
    p.add_argument("--nproc", type=int, default=2, help="ranks: collective group sizes 2..N, threads per rank")
    p.add_argument("--config", help="a Loom TOML config: measure its model's GEMM shapes")
    p.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl (GPUs)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the compute measurements (per rank)")
    args = p.parse_args(argv)
    if args.nproc < 1:
        print("loom plan calibrate: --nproc must be >= 1", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    device = "cuda" if args.backend == "nccl" else "cpu"
    prof = calibrate(args.nproc, args.config, args.backend, device, args.threads)
    prof.save(args.out)
    kind = "run-sustained" if args.config else "GEMM"
    print(f"{kind} fp32 {prof.gemm_flops['fp32'] / 1e9:.2f} GFLOP/s per rank, elementwise "
          f"{prof.hbm_bandwidth / 1e9:.2f} GB/s")  # fmt: skip
    for c in prof.collectives:
        print(f"{c.op:<15} n={c.group_size}  bus {c.bus_bandwidth / 1e9:.3f} GB/s  latency {c.latency * 1e6:.0f} us")
    print(f"wrote {args.out} ({time.perf_counter() - t0:.1f} s)")
    return 0
