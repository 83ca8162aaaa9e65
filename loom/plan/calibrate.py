"""``loom plan calibrate``: measure this machine and save a :class:`~loom.plan.hardware.Profile`.

What is measured, per rank (``--threads``, default 1: one rank per core):

- GEMM throughput: ``torch.mm`` in fp32 and bf16 on a few shapes (total FLOPs / total time);
  given ``--config``, that model's shapes (q/k/v/o, MLP and head GEMMs at ``micro_batch *
  seq_len`` tokens, forward and both backward products).
- memory bandwidth: ``c = a + b`` on activation-sized fp32 tensors, 12 bytes per element over
  the time.
- on a CPU, per-operator cost (``op_overhead``, fp32 and bf16): forward + backward of the model's structure
  at counting size (:mod:`loom.plan.opcount`: nearly no FLOPs) over its ATen operator count.
  Small models spend most of a step there, and tp, cp and pp split the FLOPs but not the ops.
- on a CPU, optimizer arithmetic rates (elements/s of one step, :func:`measure_optimizer_rate`), and
  the trainer's per-micro-batch cost beyond the operators (``microbatch_overhead``: gradient hooks and
  views, data, bookkeeping): a one-rank ``loom train`` of the config, timed, minus the planner's
  one-rank prediction, over its micro-batches (:func:`microbatch_overhead`).
- collectives: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all`` and (groups of
  2) ``p2p`` send/recv for every job size 2..nproc and group size dividing it, groups side by side
  (:func:`measure_collectives`), each call timed between a few of the model's GEMMs as inside a
  training step, in spawned processes joined by a ``file://`` rendezvous (gloo on CPU, nccl on
  GPUs), messages 4 KiB to 4 MiB; a relative-error least-squares fit ``t = latency + volume /
  bus_bandwidth`` with the volumes :class:`~loom.plan.hardware.Machine` uses (:func:`fit_line`).
  With gloo also each call's CPU seconds (the process's, all its threads; scopes ``cpu`` and
  ``cpu synced``): ranks outnumbering cores pay them out of the cores' time
  (:meth:`~loom.plan.hardware.Profile.cpu_twin`, the cost model's ``cpu bound``).
- calls as Loom's layers issue them (gloo, 2 ranks): a step pays a collective inside its layer,
  with the layer's autograd functions, buffers and waits around it. A sequence-parallel column ->
  row pair of the tensor-parallel layers (:func:`~loom.plan.probes.tp_layer_pair`) and a mixture of experts through
  the expert-parallel layer (:func:`~loom.plan.probes.ep_layer_pair`), each between the same compute, minus the same
  math without the layers, per call; what exceeds the bare fits (:func:`~loom.plan.probes.layer_call_excess`) is the
  profile's ``call_overhead`` (wall: ep) and ``call_overhead_cpu`` (tp, ep).

Ranks on this machine share cores: :func:`~loom.plan.hardware.profiles.contended` scales the compute numbers of a profile (and
the collectives' CPU seconds) by the measured compute share of ``world`` ranks at once, the mean
over the ranks, else by ``cores / world`` when more ranks than cores run at once.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from loom.config import ArgParser, ConfigError, LoomConfig, ModelConfig
from loom.config import validate as validate_config
from loom.plan.hardware import CollectiveFit, Profile
from loom.plan.probes import (
    LAYER_CALLS,
    WALL_KINDS,
    _timed,
    busy_calls,
    ep_layer_pair,
    hidden_share,
    layer_call_excess,
    layer_work,
    tp_layer_pair,
    work_rate,
)

if TYPE_CHECKING:
    import torch

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")  # p2p: groups of 2
MESSAGE_BYTES = (4 << 10, 64 << 10, 512 << 10, 4 << 20)
SHARE_SECONDS = 0.5  # wall time every rank of a job computes at once to measure the compute share
COLLECTIVE_JOBS = 3  # fresh jobs per job size whose collective times are taken at their median
# fresh jobs whose hidden share is averaged: each lands in a scheduling mode and keeps it (0-0.4 here)
OVERLAP_JOBS = 4
GENERIC_SHAPES = ((128, 64, 192), (512, 256, 256), (1024, 1024, 1024))


def model_shapes(model: ModelConfig, tokens: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of every GEMM one layer + the head runs for ``tokens`` tokens, forward and backward."""
    h, f, kd, v = model.dim, model.resolved_ffn_dim(), model.n_kv_heads * model.head_dim, model.vocab_size
    fwd = [(tokens, h, h), (tokens, h, kd), (tokens, h, kd), (tokens, h, h), (tokens, h, f), (tokens, h, f)]
    fwd += [(tokens, f, h)] + ([(tokens, h, v)] if v > 0 else [])
    out = []
    for m, k, n in fwd:  # forward, input gradient (m x n @ n x k), weight gradient (k x m @ m x n)
        out += [(m, k, n), (m, n, k), (k, m, n)]
    return out


def measure_gemm(
    shapes: list[tuple[int, int, int]],
    repeats: int = 20,
    dtype: str = "fp32",
    device: torch.device | None = None,
) -> tuple[float, dict[str, float]]:
    """(total FLOPs / total seconds, FLOP/s per shape) of ``torch.mm`` in ``dtype`` over ``shapes``
    (2 m k n FLOPs each) on ``device`` (default the CPU), each call timed between device syncs."""
    import torch

    from loom.device import DTYPES

    dt = DTYPES[dtype]
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
            row = run_layout(
                config, 1, [*base_overrides(steps), "--train.precision", "fp32"], str(Path(tmp) / f"run{i}")
            )
            best = min(best, float(row["step_time_s"]))
            imbalance.append(float(row.get("moe_imbalance", 0.0)))
    return best, statistics.median(imbalance)


def measure_backward_ratio(
    model: ModelConfig, micro_batch: int, seq_len: int, repeats: int = 15, device: torch.device | None = None
) -> float:
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


def microbatch_overhead(cfg: LoomConfig, profile: Profile, seconds: float) -> float:
    """The trainer's cost per block and micro-batch that the planner's terms leave out (saved-tensor
    and gradient hooks, views; once more for embedding, head and data): ``seconds`` (a one-rank step
    of ``cfg``) minus its one-rank prediction with ``profile``, over micro-batches x (L + 1), at least 0."""
    from loom.plan.auto import local_cluster
    from loom.plan.cost import RECOMPUTE, Layout, estimate
    from loom.plan.report import model_of, workload_of

    rec = cfg.train.recompute if cfg.train.recompute in RECOMPUTE else "none"
    lay = Layout(micro_batch=cfg.train.micro_batch, recompute=rec)
    cluster = local_cluster(1)
    est = estimate(
        model_of(cfg), lay, workload_of(cfg), cluster, profile=profile
    )  # with the device's default
    units = est.microbatches * (cfg.model.n_layers + 1)
    return max(0.0, (seconds - est.step_time) / units + cluster.device.microbatch_overhead)


def measure_op_overhead(
    model: ModelConfig, precision: str = "fp32", repeats: int = 30, device: torch.device | None = None
) -> float:
    """Seconds per ATen operator: forward + backward of ``model``'s structure at counting size
    (:func:`loom.plan.opcount.tiny_config`, 16 tokens: nearly no FLOPs) over its operator count."""
    import torch

    from loom.device import DTYPES
    from loom.model.llama import build_model, loss_fn
    from loom.plan.opcount import TOKENS, _count, tiny_config

    tiny = tiny_config(model, model.n_layers)
    dt = DTYPES[precision]
    net = build_model(tiny, seed=0).to(device=device, dtype=dt)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, tiny.vocab_size, (1, TOKENS), generator=g).to(device)

    def fwd_bwd() -> None:
        loss_fn(net(x), x).backward()
        net.zero_grad(set_to_none=True)

    n = _count(fwd_bwd)
    return _timed(fwd_bwd, repeats, device) / n


def measure_optimizer_rate(
    kind: str, op_seconds: float, numel: int = 1 << 20, repeats: int = 5, device: torch.device | None = None
) -> float:
    """Shard elements per second of one ``kind`` step (:func:`~loom.optim.flat.build_flat_optimizer`)
    on a ``numel``-element matrix, its operators' cost (``op_seconds`` each) taken out."""
    import torch
    from torch import nn

    from loom.config import TrainConfig
    from loom.optim.flat import build_flat_optimizer
    from loom.optim.store import StateStore
    from loom.parallel.layout import FlatLayout
    from loom.plan.opcount import _count

    p = nn.Parameter(torch.randn(1024, numel // 1024, device=device) * 0.02)
    lay = FlatLayout([p], 1, 0, {id(p)})
    flat = lay.new_flat()
    lay.bind(flat)
    opt = build_flat_optimizer(
        [lay],
        [lay.shard_of(flat)],
        StateStore(flat.device),
        TrainConfig(optimizer=kind),  # type: ignore[arg-type]
    )
    grads = [torch.randn(lay.shard_numel, device=device) * 1e-3]
    opt.step(grads, 1e-3)
    ops = _count(lambda: opt.step(grads, 1e-3))
    seconds = _timed(lambda: opt.step(grads, 1e-3), repeats, device)
    return numel / max(seconds - ops * op_seconds, 1e-9)


def _volume(op: str, n: int, size: float) -> float:
    """Bytes per rank of ``op`` (ring volumes; a point-to-point message whole), as :class:`Machine` counts them."""
    return size if op == "p2p" else (2.0 if op == "all_reduce" else 1.0) * (n - 1) / n * size


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of the *relative* error of ``t = latency + volume / bandwidth`` -> (bandwidth,
    latency), both kept positive. Relative: a 4 KiB call (latency-bound) weighs as much as a 4 MiB
    one, so the intercept is the small calls' cost a step's scalar and per-layer collectives pay,
    not an extrapolation from the large ones (weights 1/t^2 on the absolute residuals)."""
    ws = [1.0 / max(t, 1e-12) ** 2 for _, t in points]
    sw = sum(ws)
    mx = sum(w * x for w, (x, _) in zip(ws, points)) / sw
    my = sum(w * y for w, (_, y) in zip(ws, points)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, (x, _) in zip(ws, points))
    slope = sum(w * (x - mx) * (y - my) for w, (x, y) in zip(ws, points)) / sxx if sxx > 0 else 0.0
    if slope <= 0:  # flat (latency-bound) measurements: the largest message sets the bandwidth
        x, y = max(points)
        return x / max(y, 1e-9), min(t for _, t in points)
    lat = max(0.0, my - slope * mx)
    return 1.0 / slope, lat


def _coll_worker(
    rank: int,
    world: int,
    init: str,
    backend: str,
    repeats: int,
    work_shape: tuple[int, int],
    queue,
    overlap_only: bool = False,
) -> None:
    """Every rank of a ``world``-rank job, in groups of ``n`` side by side (each ``n`` dividing
    ``world``): per op and size, the time of ``(work; op)`` minus that of ``work`` alone, each the
    mean over a block of ``repeats`` calls (so time slices lost to other ranks count); the share of
    an asynchronous all-gather hidden behind the work (``overlap_only``: that alone)."""
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

    def timed(body) -> tuple[float, float]:
        """(wall, CPU) seconds of ``body()``, each the least of 5 runs (the least disturbed, as validate
        counts the fastest run of a layout); the CPU time is this process's (all its threads: gloo's,
        the kernel's socket copies)."""
        cpu: list[float] = []

        def run() -> None:
            c0 = time.process_time()
            body()
            cpu.append(time.process_time() - c0)

        return _timed(run, 5, device, best=True), min(cpu[2:])  # after _timed's two warm-up runs

    def loop(
        call,
    ) -> tuple[
        float, float
    ]:  # per (work; call), the mean over a block of calls (preemption by other ranks included)
        wall, cpu = timed(lambda: [(work(), call()) for _ in range(repeats)])
        return wall / repeats, cpu / repeats

    dist.barrier()
    results: list[tuple[str, int, int, float]] = []
    if not overlap_only:  # all ranks at once, each for the same wall time: the cores' throughput shared
        done = torch.tensor([busy_calls(work, SHARE_SECONDS, device)], dtype=torch.float64, device=device)
        dist.all_reduce(done)
        results.append(
            ("work", world, 0, SHARE_SECONDS * world / done.item())
        )  # seconds per call, ranks' mean rate
    for n in [g for g in range(2, world + 1) if world % g == 0]:
        groups = [dist.new_group(list(range(i, i + n))) for i in range(0, world, n)]  # all ranks create all
        group = groups[rank // n]
        for size in () if overlap_only else MESSAGE_BYTES:
            numel = size // 4 // n * n
            full = torch.ones(numel, device=device)
            part = torch.ones(numel // n, device=device)
            calls = {
                "all_reduce": lambda full=full, g=group: dist.all_reduce(full, group=g),
                "all_gather": lambda full=full, part=part, g=group: dist.all_gather_into_tensor(
                    full, part, group=g
                ),
                "reduce_scatter": lambda full=full, part=part, g=group: dist.reduce_scatter_tensor(
                    part, full, group=g
                ),
            }
            out = torch.empty_like(full)
            calls["all_to_all"] = lambda full=full, out=out, g=group: dist.all_to_all_single(
                out, full, group=g
            )
            if n == 2:  # a pipeline hand-off: the group's first rank sends, the second receives
                first = rank - rank % 2
                calls["p2p"] = (
                    (lambda full=full, peer=first + 1: dist.send(full, peer))
                    if rank == first
                    else (lambda full=full, peer=first: dist.recv(full, peer))
                )
            dist.barrier()
            alone, alone_cpu = loop(lambda: None)
            for op in [o for o in OPS if o in calls]:
                dist.barrier()
                wall, cpu = loop(calls[op])
                results.append((op, n, numel * 4, max(wall - alone, 1e-7)))
                results.append((f"{op}:cpu", n, numel * 4, max(cpu - alone_cpu, 1e-7)))
            # synced: back to back, the ranks already in step (step-end scalars; a pipeline receiver waiting)
            synced = {"all_gather": calls["all_gather"]}  # ZeRO-1/2's gather of the updated shards
            if n == 2:
                first = rank - rank % 2
                peer = first + 1 if rank == first else first
                synced["p2p"] = (
                    (lambda full=full, peer=peer: (dist.send(full, peer), dist.recv(full, peer)))
                    if rank == first
                    else (lambda full=full, peer=peer: (dist.recv(full, peer), dist.send(full, peer)))
                )
            for op, call in synced.items():
                dist.barrier()
                wall, cpu = timed(lambda call=call: [call() for _ in range(repeats)])
                half = 2 * repeats if op == "p2p" else repeats  # p2p: half a round trip
                results += [
                    (f"{op}:synced", n, numel * 4, wall / half),
                    (f"{op}:cpu synced", n, numel * 4, cpu / half),
                ]
        if (
            n == world == 2 and backend == "gloo" and not overlap_only
        ):  # the group alone, as cpu_twin counts a call's CPU
            # a call as Loom's layers issue it, between the same compute (per call, the layers minus the same math alone)
            for kind, (layers, alone) in (
                ("tp", tp_layer_pair(*work_shape, group, rank % n, n, device)),
                ("ep", ep_layer_pair(*work_shape, group, rank % n, n, device)),
            ):
                dist.barrier()
                wall, cpu = loop(layers)
                dist.barrier()
                wall_alone, cpu_alone = loop(alone)
                # per call, the mean of the group's ranks (one rank's CPU moves by a third from its peer's)
                per_call = torch.tensor(
                    [wall - wall_alone, cpu - cpu_alone], dtype=torch.float64, device=device
                )
                dist.all_reduce(per_call, group=group)
                wall_call, cpu_call = (per_call / (n * LAYER_CALLS[kind])).tolist()
                size = work_shape[0] * work_shape[1] * 4  # the full activation, bytes
                if kind in WALL_KINDS:
                    results.append((f"{kind}_layer", n, size, max(wall_call, 1e-7)))
                results.append((f"{kind}_layer:cpu", n, size, max(cpu_call, 1e-7)))
        # overlap: an all-gather issued before the work and waited after it (ZeRO-3's prefetch, a bucket
        # reduced during backward), against the same in sequence; share hidden = 1 - extra / sequential extra
        full = torch.ones((64 << 10) // 4 // n * n, device=device)
        part = torch.ones(full.numel() // n, device=device)

        def overlapped(full=full, part=part, g=group) -> None:
            handle = dist.all_gather_into_tensor(full, part, group=g, async_op=True)
            work()
            handle.wait()

        def sequential(full=full, part=part, g=group) -> None:
            work()
            dist.all_gather_into_tensor(full, part, group=g)

        dist.barrier()
        results.append(("overlap", n, 0, hidden_share(work, sequential, overlapped, repeats, device)))
        if overlap_only:
            continue
        scalar = torch.ones(1, device=device)  # the step-end scalars (loss, gradient norm), back to back
        dist.barrier()
        t = _timed(lambda s=scalar, g=group: [dist.all_reduce(s, group=g) for _ in range(repeats)], 3, device)
        _, cpu = timed(lambda s=scalar, g=group: [dist.all_reduce(s, group=g) for _ in range(repeats)])
        results += [("all_reduce:synced", n, 4, t / repeats), ("all_reduce:cpu synced", n, 4, cpu / repeats)]
    dist.barrier()
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def _run_world(
    world: int, backend: str, repeats: int, work_shape: tuple[int, int], overlap_only: bool = False
) -> list[tuple[str, int, int, float]]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init = str(Path(tmp) / "rdzv")
        args = (world, init, backend, repeats, work_shape, queue, overlap_only)
        procs = [ctx.Process(target=_coll_worker, args=(r, *args)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(
                f"calibrate: a collective worker failed (exit codes {[p.exitcode for p in procs]})"
            )
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
    fits, _, _, _ = measure_contention(nproc, backend, repeats, work_shape)
    return fits


def median_rows(jobs: list[list[tuple[str, int, int, float]]]) -> list[tuple[str, int, int, float]]:
    """One row per (what, group size, bytes): the median of its value over the fresh ``jobs`` (a job
    keeps the scheduling mode it lands in: one job's latencies move 20-30% from the next's)."""
    values: dict[tuple[str, int, int], list[float]] = {}
    for rows in jobs:
        for o, g, s, t in rows:
            values.setdefault((o, g, s), []).append(t)
    return [(o, g, s, statistics.median(ts)) for (o, g, s), ts in values.items()]


def measure_contention(
    nproc: int, backend: str = "gloo", repeats: int = 20, work_shape: tuple[int, int] = (128, 64)
) -> tuple[list[CollectiveFit], dict[str, float], dict[str, float], dict[str, dict[str, float]]]:
    """(:func:`measure_collectives`' fits, compute share per job size, overlap per job size, what a
    call costs through Loom's layers by scope and kind): the share is the speed of :func:`~loom.plan.probes.layer_work` on each of
    ``world`` ranks running it at once over its speed alone (ranks sharing cores, memory bandwidth
    and caches; 1 on separate GPUs); the overlap, the share of an asynchronous all-gather's time
    hidden behind that work (:func:`~loom.plan.probes.hidden_share`; the mean over group sizes and over
    :data:`OVERLAP_JOBS` fresh jobs); what a tp or ep call costs through Loom's layers beyond its
    collective fits, wall (``intra``) and CPU (``cpu``), per kind (gloo, the 2-rank job:
    :func:`~loom.plan.probes.layer_call_excess`); every time the median of :data:`COLLECTIVE_JOBS` fresh jobs
    (:func:`median_rows`)."""
    import torch

    torch.set_num_threads(1)
    solo = work_rate(layer_work(*work_shape))
    fits, share, overlap, calls = [], {}, {}, {}
    for world in range(2, nproc + 1):
        jobs = [_run_world(world, backend, repeats, work_shape) for _ in range(COLLECTIVE_JOBS)]
        rows = median_rows(jobs)
        share[str(world)] = min(1.0, solo / next(t for o, _, _, t in rows if o == "work"))
        cpu = ("cpu",) if backend == "gloo" else ()  # CPU seconds matter where ranks share the CPU's cores
        for op, scope in [(o, s) for s in ("intra", *cpu) for o in OPS] + [
            (o, s) for s in ("synced", *(f"{c} synced" for c in cpu)) for o in ("all_gather", "p2p")
        ]:
            key = op if scope == "intra" else f"{op}:{scope}"
            for n in sorted({g for o, g, _, _ in rows if o == key}):
                pts = [(_volume(op, n, s), t) for o, g, s, t in rows if o == key and g == n]
                bw, lat = fit_line(pts)
                fits.append(CollectiveFit(op, scope, n, bus_bandwidth=bw, latency=lat, world=world))
        if world == 2 and any(o.endswith("_layer") for o, _, _, _ in rows):
            calls = {
                "intra": {kind: layer_call_excess(kind, rows, fits, "intra") for kind in WALL_KINDS},
                "cpu": {kind: layer_call_excess(kind, rows, fits, "cpu") for kind in LAYER_CALLS},
            }
        hidden = [
            statistics.fmean(t for o, _, _, t in r if o == "overlap")
            for r in jobs
            + [_run_world(world, backend, repeats, work_shape, True) for _ in range(OVERLAP_JOBS - len(jobs))]
        ]
        overlap[str(world)] = statistics.fmean(hidden)
        for key, synced, scope in [("all_reduce:synced", "synced", "intra")] + [
            (f"all_reduce:{c} synced", f"{c} synced", c) for c in cpu
        ]:
            for _, n, _, t in [r for r in rows if r[0] == key]:  # a scalar: its time is the latency
                bw = next(
                    f.bus_bandwidth
                    for f in fits
                    if (f.op, f.scope, f.group_size, f.world) == ("all_reduce", scope, n, world)
                )
                fits.append(CollectiveFit("all_reduce", synced, n, bus_bandwidth=bw, latency=t, world=world))
    return fits, share, overlap, calls


def calibrate(
    nproc: int = 2, config: str | None = None, backend: str = "gloo", device: str = "cpu", threads: int = 1
) -> Profile:
    """Measure compute and memory bandwidth (one rank, ``threads`` threads, on ``device``: cpu, or
    cuda = GPU 0, stored under its hardware-table name when known) and collectives.

    With a ``config``: that model's GEMM shapes and per-operator cost, and the trainer's
    per-micro-batch cost (:func:`microbatch_overhead` of :func:`measure_trainer_step`).
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
    rates, ops, optimizers = {"fp32": flops, "bf16": half}, {}, {}
    overhead, imbalance, ratio = 0.0, 0.0, 0.0
    if model is not None and on is None:  # a CPU waits for each operator; a GPU's queued kernels hide it
        ops = {p: measure_op_overhead(model, p) for p in ("fp32", "bf16")}
        optimizers = {k: measure_optimizer_rate(k, ops["fp32"]) for k in ("adamw", "adam8bit", "adafactor")}
    if cfg is not None and config is not None:
        cfg.train.precision = "fp32"
        seconds, imbalance = measure_trainer_step(config)
        if on is None:
            measured = Profile(
                device=device, gemm_flops=rates, hbm_bandwidth=hbm, op_overhead=ops, optimizer_rate=optimizers
            )
            overhead = microbatch_overhead(cfg, measured, seconds)
        else:  # no per-operator term on a GPU: the measured backward / forward ratio of the model instead
            ratio = measure_backward_ratio(cfg.model, cfg.train.micro_batch, cfg.data.seq_len, device=on)
    work_shape = (tokens, model.dim) if model is not None else (128, 64)
    fits, share, overlap, calls = (
        measure_contention(nproc, backend, work_shape=work_shape) if nproc > 1 else ([], {}, {}, {})
    )
    return Profile(
        device=device,
        gemm_flops=rates,
        hbm_bandwidth=hbm,
        compute_share=share,
        comm_overlap=overlap,
        op_overhead=ops,
        optimizer_rate=optimizers,
        microbatch_overhead=overhead,
        backward_ratio=ratio,
        collectives=fits,
        moe_imbalance=imbalance,
        call_overhead=calls.get("intra", {}),
        call_overhead_cpu=calls.get("cpu", {}),
    )


BACKENDS = ("gloo", "nccl")  # gloo: CPU ranks; nccl: one CUDA GPU per rank


def check_out(option: str, path: str) -> Path:
    """``--out``: a new file in an existing, writable directory, checked before anything is
    measured (the profile is written last, minutes later). Raises :class:`ConfigError`."""
    out = Path(path).expanduser()
    if not path.strip():
        raise ConfigError(f"{option}: empty; name the profile file to write (JSON)")
    if out.is_dir():
        raise ConfigError(f"{option}: {path!r} is a directory; name the profile file to write (JSON)")
    if out.exists() or out.is_symlink():
        raise ConfigError(
            f"{option}: {path!r} exists and is never replaced; remove it or choose another --out "
            "(nothing was measured)"
        )
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(
            f"{option}: {str(parent)!r} is not a directory; create it first (nothing was measured)"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{option}: {str(parent)!r} is not writable (nothing was measured)")
    return out


def check_backend(backend: str, nproc: int) -> None:
    """``--backend``: one of :data:`BACKENDS`; nccl only where CUDA has a GPU for every rank."""
    if backend not in BACKENDS:
        raise ConfigError(
            f"--backend: must be one of {', '.join(BACKENDS)} (gloo: CPU, nccl: GPUs), got {backend!r}"
        )
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "--backend nccl: needs CUDA GPUs and this machine has none (torch.cuda.is_available() is "
                "False); use --backend gloo"
            )
        if nproc > torch.cuda.device_count():
            raise ConfigError(
                f"--backend nccl: --nproc {nproc} needs one GPU per rank, this machine has "
                f"{torch.cuda.device_count()}"
            )


def check_config(config: str) -> str:
    """``--config``: the absolute path of a config file (a preset name stays a name), read and
    validated as the one-rank run :func:`measure_trainer_step` starts from it, before any
    measurement; the measuring subprocesses run elsewhere, so a relative path is resolved here
    against the user's working directory. Raises :class:`ConfigError` naming ``--config``."""
    from loom.plan.validate import absolute_config, base_overrides, config_of

    path = absolute_config(config)
    try:
        cfg = config_of(path, 1, [*base_overrides(12), "--train.precision", "fp32"])
        validate_config(copy.deepcopy(cfg), 1)
    except ConfigError as e:
        raise ConfigError(f"--config {config}: {e}") from None
    return path


def main(argv: list[str]) -> int:
    """``loom plan calibrate [--out profile.json] [--nproc N] [--config run.toml] [--backend B] [--threads T]``:
    every option checked in one line before anything is measured."""
    p = ArgParser(prog="loom plan calibrate", description="measure this machine into a profile")
    p.add_argument(
        "--out", default="profile.json", help="where to write the profile (JSON; a new file, never replaced)"
    )
    p.add_argument(
        "--nproc", type=int, default=2, help="ranks: collective group sizes 2..N, threads per rank"
    )
    p.add_argument("--config", help="a Loom TOML config: measure its model's GEMM shapes")
    p.add_argument("--backend", default="gloo", help=f"{' or '.join(BACKENDS)} (gloo: CPU, nccl: GPUs)")
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads of the compute measurements (per rank, >= 1)"
    )
    args = p.parse_args(argv)
    try:
        for flag, value in (("--nproc", args.nproc), ("--threads", args.threads)):
            if value < 1:
                raise ConfigError(f"{flag}: must be >= 1, got {value}")
        check_backend(args.backend, args.nproc)
        check_out("--out", args.out)
        if args.config is not None:
            args.config = check_config(args.config)
    except ConfigError as e:
        print(f"loom plan calibrate: error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    device = "cuda" if args.backend == "nccl" else "cpu"
    prof = calibrate(args.nproc, args.config, args.backend, device, args.threads)
    prof.save(args.out)
    print(
        f"GEMM fp32 {prof.gemm_flops['fp32'] / 1e9:.2f} GFLOP/s per rank (bf16 "
        f"{prof.gemm_flops['bf16'] / 1e9:.2f}), elementwise {prof.hbm_bandwidth / 1e9:.2f} GB/s"
    )
    if prof.op_overhead:
        print(
            "per ATen operator: "
            + ", ".join(f"{p} {v * 1e6:.2f} us" for p, v in prof.op_overhead.items())
            + (
                f"; the trainer's further cost per block and micro-batch: {prof.microbatch_overhead * 1e3:.2f} ms"
                if args.config
                else ""
            )
        )
    if prof.backward_ratio:
        print(f"backward / forward time of the model: {prof.backward_ratio:.2f} (2 when FLOPs set it)")
    if prof.optimizer_rate:
        print(
            "optimizer step: "
            + ", ".join(f"{k} {v / 1e6:.1f} M elements/s" for k, v in prof.optimizer_rate.items())
        )
    if prof.moe_imbalance:
        print(
            f"expert load of the run: max/mean {prof.moe_imbalance:.2f} (the planner's moe.imbalance when unset)"
        )
    for world, share in prof.compute_share.items():
        print(
            f"compute share with {world} ranks at once: {share:.2f}; asynchronous collective hidden behind "
            f"compute: {prof.comm_overlap.get(world, 0.0):.2f}"
        )
    for kind in sorted(set(prof.call_overhead) | set(prof.call_overhead_cpu)):
        print(
            f"a {kind} call through Loom's layers, beyond its collective: {prof.call_overhead.get(kind, 0.0) * 1e6:.0f} us "
            f"wall, {prof.call_overhead_cpu.get(kind, 0.0) * 1e6:.0f} us CPU (2 ranks)"
        )
    for c in prof.collectives:
        print(
            f"{c.op:<15} {c.scope:<10} world={c.world} n={c.group_size}  bus {c.bus_bandwidth / 1e9:.3f} GB/s  latency {c.latency * 1e6:.0f} us"
        )
    print(f"wrote {args.out} ({time.perf_counter() - t0:.1f} s)")
    return 0
