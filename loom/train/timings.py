"""Where each rank's step time goes, and which rank is slow (issue 36, item 3).

Phases of a step: ``data`` (the batch reaches the device), ``forward`` and ``backward`` (summed over
micro-batches; a pipeline schedule's compute is in neither), ``comm_wait`` (the exposed
communication: ``finish_sync`` waiting for the gradient reductions) and ``optimizer`` (clip and
update). Timed without host syncs: CUDA events on a GPU, read after the log step's synchronize; the
host clock elsewhere. Under ``torch.profiler`` each phase is also a named range in the trace.

A rank's *busy* time is its step time less its exposed communication wait: collectives make every
rank's wall time equal, so a slow rank shows as the one the others wait for. :class:`Stragglers`
names a rank whose busy time exceeds the median over ranks by more than ``run.straggler_pct`` for
:data:`WINDOWS` logged steps in a row.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("loom")

PHASES = ("data", "forward", "backward", "comm_wait", "optimizer")
WINDOWS = 3  # logged steps in a row before a slow rank is named
FULL_LISTS = 64  # up to this many ranks a row holds every rank's times; beyond, median/max/slowest only


class PhaseClock:
    """Sums the time of each phase over a log window (see module doc)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host = dict.fromkeys(PHASES, 0.0)
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with torch.profiler.record_function(f"loom.{name}"):
            if self.cuda and name != "data":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
                self.events.append((name, start, end))
            else:
                t0 = time.perf_counter()
                yield
                self.host[name] += time.perf_counter() - t0

    def read(self, steps: int) -> dict[str, float]:
        """Seconds per step of each phase over the window (device work done: after a synchronize); resets."""
        totals = dict(self.host)
        for name, start, end in self.events:
            totals[name] += start.elapsed_time(end) / 1e3
        self.host, self.events = dict.fromkeys(PHASES, 0.0), []
        return {k: v / max(steps, 1) for k, v in totals.items()}


_active: PhaseClock | None = None


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time ``name`` on the active clock (the trainer's); nothing when none is active."""
    if _active is None:
        yield
        return
    with _active.phase(name):
        yield


@contextlib.contextmanager
def active(clock: PhaseClock) -> Iterator[None]:
    global _active
    previous, _active = _active, clock
    try:
        yield
    finally:
        _active = previous


def rank_times(
    mine: dict[str, float], step_s: float, world: int, group, timeout_s: float
) -> list[list[float]]:
    """Every rank's [phases..., step] seconds per step: one all-gather of a few float64 on the CPU
    (the gloo control group: no device sync)."""
    row = torch.tensor([mine[p] for p in PHASES] + [step_s], dtype=torch.float64)
    if world == 1:
        return [row.tolist()]
    out = [torch.zeros_like(row) for _ in range(world)]
    work = dist.all_gather(out, row, group=group, async_op=True)
    work.wait(timedelta(seconds=timeout_s))
    return [t.tolist() for t in out]


def timing_fields(times: list[list[float]]) -> dict[str, object]:
    """Metrics-row fields of every rank's times: per phase the median, the largest and whose; every
    rank's list too up to :data:`FULL_LISTS` ranks; and each rank's busy time (step less comm wait)."""
    names = [*PHASES, "step"]
    row: dict[str, object] = {}
    for j, name in enumerate(names):
        col = [t[j] for t in times]
        slowest = max(range(len(col)), key=col.__getitem__)
        row[f"time_{name}_s_median"] = statistics.median(col)
        row[f"time_{name}_s_max"], row[f"time_{name}_s_max_rank"] = col[slowest], slowest
        if len(times) <= FULL_LISTS:
            row[f"time_{name}_s_ranks"] = col
    return row


def busy(times: list[list[float]]) -> list[float]:
    """Each rank's step time less its exposed communication wait."""
    step, wait = len(PHASES), PHASES.index("comm_wait")
    return [t[step] - t[wait] for t in times]


class Stragglers:
    """Names a rank whose busy time is more than ``pct`` % above the median for :data:`WINDOWS` logged
    steps in a row (once per episode); ``pct`` 0 turns it off."""

    def __init__(self, pct: float) -> None:
        self.pct = pct
        self.streak: dict[int, int] = {}

    def check(self, step: int, times: list[list[float]]) -> str | None:
        if self.pct <= 0 or len(times) < 2:
            return None
        b = busy(times)
        median = statistics.median(b)
        limit = median * (1 + self.pct / 100)
        line = None
        for rank, v in enumerate(b):
            if v > limit and median > 0:
                self.streak[rank] = self.streak.get(rank, 0) + 1
                if self.streak[rank] == WINDOWS and line is None:
                    phases = ", ".join(f"{p} {times[rank][i]:.3g} s" for i, p in enumerate(PHASES))
                    line = (
                        f"straggler: rank {rank} busy {v:.3g} s per step against the median {median:.3g} s "
                        f"(+{100 * (v / median - 1):.0f}%, run.straggler_pct = {self.pct:g}) for {WINDOWS} "
                        f"logged steps in a row up to step {step} ({phases})"
                    )
            else:
                self.streak.pop(rank, None)
        return line
