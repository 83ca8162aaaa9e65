"""Shared benchmark harness: spawn ranks, race contenders step by step, take medians.

Rounds alternate between contenders (ABAB...) so machine noise hits them alike. CPU time is
recorded beside wall time: this machine is often shared, and CPU time is immune to other
processes' load (though it misses time spent waiting on communication).

Ranks are gloo processes on the CPU, or, with ``LOOM_BENCH_DEVICE=cuda`` (what
``benchmarks/gpu_smoke.sh`` sets), NCCL ranks with one GPU each; every step is then timed
between device synchronisations.

Each script writes what it prints to ``docs/results/<name>.md`` (:func:`write_results`, through
:func:`results`), headed by the date, the machine and the command; ``--no-write`` skips that.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import queue
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
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


# ----------------------------------------------------------------------------- result pages

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"


def add_no_write(ap: argparse.ArgumentParser) -> None:
    """The ``--no-write`` flag: print the tables without rewriting the result page."""
    ap.add_argument("--no-write", action="store_true", help="do not write docs/results/<name>.md")


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo``, else what :mod:`platform` says."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def machine() -> str:
    """One line: CPU model, core count, torch version, and the device the ranks ran on."""
    if on_gpu() and torch.cuda.is_available():
        dev = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)} (NCCL)"
    else:
        dev = "CPU (gloo)"
    return f"{cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}; device: {dev}"


def command() -> str:
    """The command line that ran this script, with the script's path relative to the repository."""
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(REPO)
    return shlex.join(["python", str(script), *sys.argv[1:]])


def _blank_around_tables(text: str) -> str:
    """A blank line before and after each run of ``|`` lines, so Markdown reads them as tables."""
    out: list[str] = []
    for line in text.strip("\n").splitlines():
        line = line.rstrip()
        is_row = line.lstrip().startswith("|")
        prev_row = bool(out) and out[-1].lstrip().startswith("|")
        if out and out[-1] and line and is_row != prev_row:
            out.append("")
        out.append(line.strip() if is_row else line)
    return "\n".join(out)


def write_results(name: str, title: str, body_markdown: str, cmd: str | None = None) -> Path:
    """Write ``docs/results/<name>.md`` (``docs/results/gpu/<name>.md`` under ``LOOM_BENCH_DEVICE=cuda``):
    a title, a header with the date (UTC), the machine and the command, then ``body_markdown``.
    Written to a temporary file in the same directory and renamed over the page, so a reader never
    sees half a page. Returns the page's path."""
    out_dir = RESULTS / "gpu" if on_gpu() else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.md"
    script = Path(sys.argv[0]).name
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = (
        f"# {title}\n\n"
        f"Written by `benchmarks/{script}` on {when}; running it again rewrites this page.\n\n"
        f"- Machine: {machine()}\n"
        f"- Command: `{cmd or command()}`\n\n"
        f"{body_markdown.strip()}\n"
    )
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


class _Tee(io.TextIOBase):
    """Writes to the real stdout and keeps a copy."""

    def __init__(self, real: Any) -> None:
        self.real, self.copy = real, io.StringIO()

    def write(self, s: str) -> int:
        self.copy.write(s)
        return self.real.write(s)

    def flush(self) -> None:
        self.real.flush()


@contextlib.contextmanager
def results(name: str, title: str, *, write: bool = True, preformatted: bool = False) -> Iterator[None]:
    """Print as usual inside the block; if it ends without an error, write what was printed to
    ``docs/results/<name>.md`` (:func:`write_results`). ``preformatted``: the text is a fixed-width
    table, kept in a code block; otherwise it is Markdown (blank lines are added around tables)."""
    if not write:
        yield
        return
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    try:
        yield
    finally:
        sys.stdout = tee.real
    text = tee.copy.getvalue()
    body = f"```text\n{text.strip(chr(10))}\n```" if preformatted else _blank_around_tables(text)
    path = write_results(name, title, body)
    with contextlib.suppress(ValueError):
        path = path.relative_to(REPO)
    print(f"results written to {path}")
