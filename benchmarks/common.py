"""Shared benchmark harness: spawn ranks, race contenders step by step, take medians.

Rounds alternate between contenders (ABAB...) so machine noise hits them alike. CPU time is
recorded beside wall time: this machine is often shared, and CPU time is immune to other
processes' load (though it misses time spent waiting on communication).

Ranks are gloo processes on the CPU, or, with ``LOOM_BENCH_DEVICE=cuda`` (what
``benchmarks/gpu_smoke.sh`` sets), NCCL ranks with one GPU each; every step is then timed
between device synchronisations.
"""

from __future__ import annotations

import os
import queue
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def on_gpu() -> bool:
    return os.environ.get("LOOM_BENCH_DEVICE", "cpu") == "cuda"


def device() -> torch.device:
    """This rank's device: its GPU under ``LOOM_BENCH_DEVICE=cuda``, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu() else torch.device("cpu")


def backend_name() -> str:
    return "NCCL" if on_gpu() else "gloo"


def synchronize() -> None:
    if on_gpu():
        torch.cuda.synchronize()


def init_gloo(rank: int, world: int, init: str, threads: int | None = None, timeout_s: int = 600) -> None:
    """Join a ``file://`` rendezvous (gloo; NCCL on ``cuda:<rank>`` under ``LOOM_BENCH_DEVICE=cuda``);
    threads default to cores / ranks."""
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) // world))
    backend, dev = "gloo", None
    if on_gpu():
        torch.cuda.set_device(rank)
        backend, dev = "nccl", torch.device("cuda", rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
        device_id=dev,
    )


def race(
    steppers: dict[str, Callable[[int, int], Any]], steps: int, rank: int, barrier, warmup: int = 2
) -> dict[str, list[float]]:
    """Per-step wall time of each contender, and its CPU time under ``"<name> cpu"``; warm-up dropped."""
    times: dict[str, list[float]] = {}
    for i in range(steps):
        for name, step in steppers.items():
            synchronize()
            barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step(i, rank)
            synchronize()
            barrier()
            times.setdefault(name, []).append(time.perf_counter() - t0)
            times.setdefault(f"{name} cpu", []).append(time.process_time() - c0)
    return {k: v[warmup:] for k, v in times.items()}


def run_ranks(world: int, worker: Callable, *args: Any) -> Any:
    """Spawn ``worker(rank, world, init_file, *args, out_queue)`` on ``world`` ranks; return what
    the first rank puts on the queue. A rank that dies ends the benchmark instead of hanging it."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, "rdzv")
        procs = [ctx.Process(target=worker, args=(r, world, init, *args, out)) for r in range(world)]
        for p in procs:
            p.start()
        result = None
        while result is None:
            try:
                result = out.get(timeout=5)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    for p in procs:
                        p.kill()
                    sys.exit("a benchmark rank failed (traceback above)")
        for p in procs:
            p.join()
    return result
