"""Shared benchmark harness: spawn gloo ranks, race contenders step by step, take medians.

Rounds alternate between contenders (ABAB...) so machine noise hits them alike. CPU time is
recorded beside wall time: this machine is often shared, and CPU time is immune to other
processes' load (though it misses time spent waiting on communication).
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


def init_gloo(rank: int, world: int, init: str, threads: int | None = None, timeout_s: int = 600) -> None:
    """Join a ``file://`` rendezvous; threads default to cores / ranks."""
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))  # fmt: skip


def race(steppers: dict[str, Callable[[int, int], Any]], steps: int, rank: int, barrier,
         warmup: int = 2) -> dict[str, list[float]]:  # fmt: skip
    """Per-step wall time of each contender, and its CPU time under ``"<name> cpu"``; warm-up dropped."""
    times: dict[str, list[float]] = {}
    for i in range(steps):
        for name, step in steppers.items():
            barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step(i, rank)
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
