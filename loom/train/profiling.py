"""Profiler traces and memory snapshots of chosen steps (issue 36, item 2).

``run.profile_steps = "10-12"`` records steps 10 to 12 with ``torch.profiler`` on every rank and
writes ``run.dir/profile/rank-<r>.json`` (r in five digits, ``rank-00000.json``; Chrome / Perfetto
trace JSON; Loom's phases, see :mod:`loom.train.timings`, are its ``loom.*`` ranges); rank 0 then draws every rank's phases on one
time axis, ``profile/timeline.png``. ``run.memory_snapshot_step = N`` records step N's allocations:
a CUDA memory snapshot (``profile/memory-rank-<r>.pickle``, for pytorch.org/memory_viz) on a GPU,
the profiler's memory timeline (``profile/memory-rank-<r>.json``) on the CPU.
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("loom")

PROFILE_DIR = "profile"


def parse_steps(spec: str) -> tuple[int, int] | None:
    """``"10-12"`` -> (10, 12), ``"7"`` -> (7, 7), ``""`` -> None; anything else raises ValueError."""
    spec = spec.strip()
    if not spec:
        return None
    first, _, last = spec.partition("-")
    a, b = int(first), int(last or first)
    if not 1 <= a <= b:
        raise ValueError(spec)
    return a, b


class StepProfiler:
    """Starts and stops the profiler (and the memory recorder) around the chosen steps of one rank."""

    def __init__(self, run, run_dir: Path, rank: int, world: int, device: torch.device, group=None) -> None:
        self.window = parse_steps(run.profile_steps)
        self.memory_step = run.memory_snapshot_step
        self.dir = run_dir / PROFILE_DIR
        self.rank, self.world, self.device, self.group = rank, world, device, group
        self.timeout = timedelta(seconds=run.timeout_s)
        self._prof: torch.profiler.profile | None = None
        self._mem: torch.profiler.profile | None = None
        # one profiler session at a time: a CPU memory step inside the window is recorded by the
        # window's session (its memory timeline then spans the window)
        w = self.window
        self.shared = device.type != "cuda" and w is not None and w[0] <= self.memory_step <= w[1]

    def before(self, step: int) -> None:
        """Called before step ``step`` (1-based) runs."""
        cuda = self.device.type == "cuda"
        if self.window is not None and step == self.window[0]:
            acts = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if cuda else []
            )
            m = self.shared  # the memory step's allocations too
            self._prof = torch.profiler.profile(
                activities=acts, profile_memory=m, record_shapes=m, with_stack=m
            )
            self._prof.start()
        if step == self.memory_step and not self.shared:
            if cuda:
                torch.cuda.memory._record_memory_history(max_entries=200_000)
            else:
                self._mem = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU],
                    profile_memory=True,
                    record_shapes=True,
                    with_stack=True,
                )
                self._mem.start()

    def after(self, step: int) -> None:
        """Called after step ``step`` ran: writes what ends there."""
        if self._prof is not None and self.window is not None and step == self.window[1]:
            self._prof.stop()
            self.dir.mkdir(parents=True, exist_ok=True)
            self._prof.export_chrome_trace(str(self.dir / f"rank-{self.rank:05d}.json"))
            if self.shared:
                self._prof.export_memory_timeline(
                    str(self.dir / f"memory-rank-{self.rank:05d}.json"), device="cpu"
                )
            self._prof = None
            self._all_written()
            if self.rank == 0:
                picture = draw_timeline(self.dir, self.world)
                log.info("profile of steps %d-%d: %s/rank-*.json, %s", *self.window, self.dir, picture)
        if step == self.memory_step and not self.shared:
            self.dir.mkdir(parents=True, exist_ok=True)
            if self.device.type == "cuda":
                path = self.dir / f"memory-rank-{self.rank:05d}.pickle"
                torch.cuda.memory._dump_snapshot(str(path))
                torch.cuda.memory._record_memory_history(enabled=None)
            elif self._mem is not None:
                self._mem.stop()
                path = self.dir / f"memory-rank-{self.rank:05d}.json"
                self._mem.export_memory_timeline(str(path), device="cpu")
                self._mem = None
            if self.rank == 0:
                log.info("memory of step %d: %s/memory-rank-*", step, self.dir)

    def _all_written(self) -> None:
        """Every rank's trace is on disk before rank 0 reads them (the gloo control group, bounded)."""
        if self.world > 1 and dist.is_initialized():
            dist.barrier(group=self.group, async_op=True).wait(self.timeout)


def phase_events(trace: Path) -> list[tuple[str, float, float]]:
    """(phase, start µs, duration µs) of the ``loom.*`` ranges of one Chrome trace."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    return [
        (e["name"][5:], float(e["ts"]), float(e.get("dur", 0.0)))
        for e in events
        if str(e.get("name", "")).startswith("loom.") and e.get("ph") == "X"
    ]


def draw_timeline(profile_dir: Path, world: int) -> Path:
    """One picture: each rank's phases (one row per rank) on a common time axis, in milliseconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from loom.train.timings import PHASES

    per_rank = {r: phase_events(profile_dir / f"rank-{r:05d}.json") for r in range(world)}
    t0 = min((ts for ev in per_rank.values() for _, ts, _ in ev), default=0.0)
    cmap = plt.get_cmap("tab10")
    colors = {name: cmap(i) for i, name in enumerate(PHASES)}
    fig, ax = plt.subplots(figsize=(12, 0.5 + 0.45 * world))
    for r, ev in per_rank.items():
        for name in PHASES:
            bars = [((ts - t0) / 1e3, dur / 1e3) for n, ts, dur in ev if n == name]
            if bars:
                ax.broken_barh(bars, (r - 0.4, 0.8), color=colors[name], label=name if r == 0 else None)
    ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
    ax.set_xlabel("ms (traces aligned on their first phase; clocks of different hosts may differ)")
    ax.invert_yaxis()
    ax.legend(loc="upper right", ncols=len(PHASES), fontsize="small")
    out = profile_dir / "timeline.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
