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
- collectives: ``all_reduce``, ``all_gather``, ``reduce_scatter`` for every job size 2..nproc
  and group size dividing it, groups side by side (:func:`measure_collectives`), each call timed
  between a few of the model's GEMMs as inside a training step, in spawned processes joined by a
  ``file://`` rendezvous (gloo on CPU, nccl on GPUs), messages 4 KiB to 4 MiB; a least-squares fit
  ``t = latency + volume / bus_bandwidth`` with the ring volume :class:`~loom.plan.hardware.Machine` uses.

Ranks on this machine share cores: :func:`contended` scales the compute numbers of a profile by
``cores / world`` when more ranks than cores run at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from loom.config import LoomConfig, ModelConfig
from loom.plan.hardware import CollectiveFit, Profile

if TYPE_CHECKING:
    import torch

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


def _timed(fn, repeats: int, device: torch.device | None = None) -> float:
    """Median seconds of ``fn()`` after two warm-up calls; on an accelerator (``device``) each call
    is timed between synchronisations, so queued kernels and collectives are counted."""
    from loom.device import synchronize

    fn()
    fn()
    times = []
    for _ in range(repeats):
        if device is not None:
            synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device is not None:
            synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_gemm(
    shapes: list[tuple[int, int, int]], repeats: int = 20, dtype: str = "fp32", device: torch.device | None = None
) -> tuple[float, dict[str, float]]:
    """(total FLOPs / total seconds, FLOP/s per shape) of ``torch.mm`` in ``dtype`` over ``shapes``
    (2 m k n FLOPs each) on ``device`` (default the CPU), each call timed between device syncs."""
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    total_flops = total_s = 0.0
    per: dict[str, float] = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dt, device=device), torch.randn(k, n, dtype=dt, device=device)
        out = torch.empty(m, n, dtype=dt, device=device)
        reps = max(3, min(repeats, int(2e9 / (2 * m * k * n + 1))))
        sec = _timed(lambda a=a, b=b, out=out: torch.mm(a, b, out=out), reps, device)
        total_flops += 2.0 * m * k * n
        total_s += sec
        per[f"{m}x{k}x{n}"] = 2.0 * m * k * n / sec
    return total_flops / total_s, per


def measure_bandwidth(elements: list[int], repeats: int = 20, device: torch.device | None = None) -> float:
    """Bytes/s of ``c = a + b`` (12 bytes per fp32 element), total over ``elements`` sizes, on ``device``."""
    import torch

    moved = total_s = 0.0
    for n in elements:
        a, b, c = torch.randn(n, device=device), torch.randn(n, device=device), torch.empty(n, device=device)
        total_s += _timed(lambda a=a, b=b, c=c: torch.add(a, b, out=c), repeats, device)
        moved += 12.0 * n
    return moved / total_s


def measure_trainer_step(config: str, steps: int = 12, runs: int = 5) -> tuple[float, float]:
    """(step time in s, MoE imbalance) of a one-rank fp32 ``loom train config``. The step time as
    :func:`loom.plan.validate.run_layout` measures it (the fastest step), the least of ``runs`` runs:
    identical runs here differ by up to 1.6x, a process lands in a fast or a slow mode and keeps it
    (~4 vs ~6 ms for the same forward + backward in plain PyTorch), so only the fastest of several is
    the machine's. The imbalance: the last metrics row's ``moe_imbalance`` (max/mean tokens per
    expert of the worst layer), the median over the runs; 0 for a dense model."""
    from loom.plan.validate import base_overrides, run_layout

    best, imbalance = float("inf"), []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            row = run_layout(config, 1, [*base_overrides(steps), "--train.precision", "fp32"], str(Path(tmp) / f"run{i}"))
            best = min(best, float(row["step_time_s"]))
            imbalance.append(float(row.get("moe_imbalance", 0.0)))
    return best, statistics.median(imbalance)


def measure_backward_ratio(model: ModelConfig, micro_batch: int, seq_len: int, repeats: int = 15,
                           device: torch.device | None = None) -> float:  # fmt: skip
    """Backward time / forward time of one micro-batch through the model with its loss (autograd on).

    2 when GEMM FLOPs set the time (backward runs two products per forward one); nearer 1 when
    the framework's per-op cost does (small layers), which is what full recomputation's extra
    forward then costs relative to the step.
    """
    import torch

    from loom.model.llama import build_model, loss_fn

    net = build_model(model, seed=0).to(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.vocab_size, (micro_batch, seq_len), generator=g).to(device)
    y = torch.randint(0, model.vocab_size, (micro_batch, seq_len), generator=g).to(device)

    def fwd():
        return loss_fn(net(x), y)

    def fwd_bwd() -> None:
        fwd().backward()
        net.zero_grad(set_to_none=True)

    t_f = _timed(fwd, repeats, device)
    t_fb = _timed(fwd_bwd, repeats, device)
    return max(0.5, (t_fb - t_f) / t_f)


def sustained_flops(cfg: LoomConfig, hbm: float, seconds: float, backward_ratio: float = 0.0) -> float:
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
        prof = Profile(device="cpu", gemm_flops={"fp32": flops}, hbm_bandwidth=hbm, backward_ratio=backward_ratio)
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


def _coll_worker(
    rank: int, world: int, init: str, backend: str, repeats: int, work_shape: tuple[int, int], queue
) -> None:
    """Every rank of a ``world``-rank job, in groups of ``n`` side by side (each ``n`` dividing
    ``world``): per op and size, the time of ``(work; op)`` minus that of ``work`` alone, each the
    mean over a block of ``repeats`` calls (so time slices lost to other ranks count)."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # *_into_tensor renamed in newer torch
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":  # one GPU per rank, set before NCCL's communicator binds to one
        from loom.device import resolve_device

        device = resolve_device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world)
    work = layer_work(*work_shape, device=device)

    def loop(call) -> float:  # mean over a block of calls (preemption by other ranks included), median of 3
        def block() -> None:
            for _ in range(repeats):
                work()
                call()

        return _timed(block, 3, device) / repeats

    dist.barrier()
    results: list[tuple[str, int, int, float]] = [("work", world, 0, work_rate(work, device=device))]  # all ranks at once
    for n in [g for g in range(2, world + 1) if world % g == 0]:
        groups = [dist.new_group(list(range(i, i + n))) for i in range(0, world, n)]  # all ranks create all
        group = groups[rank // n]
        for size in MESSAGE_BYTES:
            numel = size // 4 // n * n
            full = torch.ones(numel, device=device)
            part = torch.ones(numel // n, device=device)
            calls = {
                "all_reduce": lambda full=full, g=group: dist.all_reduce(full, group=g),
                "all_gather": lambda full=full, part=part, g=group: dist.all_gather_into_tensor(full, part, group=g),
                "reduce_scatter": lambda full=full, part=part, g=group: dist.reduce_scatter_tensor(part, full, group=g),
            }
            dist.barrier()
            alone = loop(lambda: None)
            for op in OPS:
                dist.barrier()
                results.append((op, n, numel * 4, max(loop(calls[op]) - alone, 1e-7)))
    dist.barrier()
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def layer_work(tokens: int, width: int, device=None):
    """A callable running what a rank does between two collectives of a layer: a few of the
    model's GEMMs (``tokens x width @ width x width``) with elementwise ops, forward and backward
    through autograd, so both the FLOPs and the per-op framework cost are in it."""
    import torch

    x = torch.randn(tokens, width, device=device)
    w = (torch.randn(width, width, device=device) / width**0.5).requires_grad_()

    def work() -> None:
        y = x
        for _ in range(2):
            y = torch.nn.functional.silu(y @ w) * 0.5 + y
        y.sum().backward()
        w.grad = None

    return work


def work_rate(work, calls: int = 200, blocks: int = 5, device: torch.device | None = None) -> float:
    """Seconds per ``work()`` call: the median over ``blocks`` blocks of ``calls`` calls, each block
    long enough (tens of ms) to span the scheduler's time slices."""

    def block() -> None:
        for _ in range(calls):
            work()

    return _timed(block, blocks, device) / calls


def _run_world(
    world: int, backend: str, repeats: int, work_shape: tuple[int, int]
) -> list[tuple[str, int, int, float]]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init = str(Path(tmp) / "rdzv")
        args = (world, init, backend, repeats, work_shape, queue)
        procs = [ctx.Process(target=_coll_worker, args=(r, *args)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"calibrate: a collective worker failed (exit codes {[p.exitcode for p in procs]})")
        return queue.get()


def measure_collectives(
    nproc: int, backend: str = "gloo", repeats: int = 20, work_shape: tuple[int, int] = (128, 64)
) -> list[CollectiveFit]:
    """Fits for every op in :data:`OPS`, every job size ``world`` in 2..``nproc`` and every group
    size ``n`` dividing it (``world / n`` groups running at once, as tp groups inside a dp x tp job).

    Each call is timed *in a loop with compute between calls* (``work_shape`` = tokens x width of
    the GEMMs): a collective inside a training step pays the wake-up of a peer that was computing
    and the skew between ranks, which an isolated ping-pong does not see (on this 2-core machine
    2-4x its latency). One spawned job per ``world`` (file:// rendezvous).
    """
    fits, _ = measure_contention(nproc, backend, repeats, work_shape)
    return fits


def measure_contention(
    nproc: int, backend: str = "gloo", repeats: int = 20, work_shape: tuple[int, int] = (128, 64)
) -> tuple[list[CollectiveFit], dict[str, float]]:
    """(:func:`measure_collectives`' fits, compute share per job size): the share is the speed of
    :func:`layer_work` on each of ``world`` ranks running it at once over its speed alone (ranks
    sharing cores, memory bandwidth and caches; 1 on separate GPUs)."""
    import torch

    torch.set_num_threads(1)
    solo = work_rate(layer_work(*work_shape))
    fits, share = [], {}
    for world in range(2, nproc + 1):
        rows = _run_world(world, backend, repeats, work_shape)
        share[str(world)] = min(1.0, solo / next(t for o, _, _, t in rows if o == "work"))
        for op in OPS:
            for n in sorted({g for o, g, _, _ in rows if o == op}):
                pts = [(_volume(op, n, s), t) for o, g, s, t in rows if o == op and g == n]
                bw, lat = fit_line(pts)
                fits.append(CollectiveFit(op, "intra", n, bus_bandwidth=bw, latency=lat, world=world))
    return fits, share


def calibrate(
    nproc: int = 2, config: str | None = None, backend: str = "gloo", device: str = "cpu", threads: int = 1
) -> Profile:
    """Measure compute and memory bandwidth (one rank, ``threads`` threads, on ``device``: cpu, or
    cuda = GPU 0, stored under its hardware-table name when known) and collectives.

    With a ``config``, the stored FLOP rate is that run's sustained one (:func:`sustained_flops`
    of :func:`measure_trainer_step`), not the bare GEMM rate: at small sizes the framework's
    per-op cost (autograd, hooks, the optimizer's loops), not the FLOPs, sets the time.
    """
    import torch

    from loom.device import device_name, resolve_device
    from loom.plan.hardware import device_key

    torch.set_num_threads(threads)
    dev = resolve_device(device)  # cuda: GPU 0 (raises without CUDA); the work is timed between its syncs
    on = dev if dev.type != "cpu" else None
    if on is not None:
        device = device_key(device_name(dev)) or device
    cfg, tokens = None, 128
    if config is not None:
        from loom.config import load
        from loom.plan.report import model_of

        cfg = load(config, [])
        cfg.model = model_of(cfg)
        tokens = cfg.train.micro_batch * cfg.data.seq_len
    model = cfg.model if cfg is not None else None
    shapes = model_shapes(model, tokens) if model is not None else list(GENERIC_SHAPES)
    flops, _ = measure_gemm(shapes, device=on)
    half, _ = measure_gemm(shapes, dtype="bf16", device=on)
    width = max(model.dim, model.resolved_ffn_dim()) if model is not None else 256
    hbm = measure_bandwidth([tokens * width, 4 * tokens * width], device=on)
    bare, ratio, imbalance = flops, 0.0, 0.0
    if cfg is not None and config is not None:
        cfg.train.precision = "fp32"
        ratio = measure_backward_ratio(cfg.model, cfg.train.micro_batch, cfg.data.seq_len, device=on)
        seconds, imbalance = measure_trainer_step(config)
        flops = sustained_flops(cfg, hbm, seconds, ratio)
    rates = {"fp32": flops, "bf16": flops * half / bare}  # half precision: the bare GEMMs' ratio
    work_shape = (tokens, model.dim) if model is not None else (128, 64)
    fits, share = measure_contention(nproc, backend, work_shape=work_shape) if nproc > 1 else ([], {})
    return Profile(device=device, gemm_flops=rates, hbm_bandwidth=hbm, compute_share=share,
                   backward_ratio=ratio, collectives=fits, moe_imbalance=imbalance)  # fmt: skip


def contended(profile: Profile, world: int, n_cores: int | None = None) -> Profile:
    """``profile`` with compute and memory bandwidth scaled by the measured compute share of
    ``world`` ranks (:func:`measure_contention`), else by ``cores / world`` when ranks outnumber cores."""
    share = profile.compute_share.get(str(world)) or min(1.0, (n_cores or cores()) / max(1, world))
    return dataclasses.replace(
        profile,
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
    print(f"{kind} fp32 {prof.gemm_flops['fp32'] / 1e9:.2f} GFLOP/s per rank (bf16 "
          f"{prof.gemm_flops['bf16'] / 1e9:.2f}), elementwise {prof.hbm_bandwidth / 1e9:.2f} GB/s")  # fmt: skip
    if prof.backward_ratio:
        print(f"backward / forward time of the model: {prof.backward_ratio:.2f} (2 when FLOPs set it)")
    if prof.moe_imbalance:
        print(f"expert load of the run: max/mean {prof.moe_imbalance:.2f} (the planner's moe.imbalance when unset)")
    for world, share in prof.compute_share.items():
        print(f"compute share with {world} ranks at once: {share:.2f}")
    for c in prof.collectives:
        print(f"{c.op:<15} world={c.world} n={c.group_size}  bus {c.bus_bandwidth / 1e9:.3f} GB/s  latency {c.latency * 1e6:.0f} us")
    print(f"wrote {args.out} ({time.perf_counter() - t0:.1f} s)")
    return 0
