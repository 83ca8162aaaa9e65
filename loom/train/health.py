"""Failure diagnosis: heartbeats that name a hung rank, and a guard against non-finite updates.

Heartbeat: every rank runs a thread that rewrites ``<run.dir>/heartbeat/rank-NNNNN.json``
(pid, wall time, current step and phase) every ``interval`` seconds. A stopped process
(SIGSTOP, a debugger, a swapped-out node) or a dead one stops refreshing its file, while a
healthy rank blocked in a collective keeps refreshing it. When a collective fails on the
process-group timeout, :func:`diagnose` reads the files and names the ranks whose heartbeat
went stale, with their last step and phase, and the collective this rank was in.

The files live in ``run.dir``, which a multi-node job must put on a shared file system (as it
must for checkpoints anyway); without one a rank only sees the heartbeats of its own node.

Bound: a stopped rank is reported ``run.timeout_s`` (the collective timeout) after the
others enter the collective it never joins, plus the time to read the files (milliseconds).
Staleness needs ``run.timeout_s`` > ``STALE_AFTER_S``.

Non-finite values (:class:`FiniteGuard`): the gradient norm is global (every rank computes
the same value after the gradient reduction), so all ranks agree without another collective.
If it is not finite, :meth:`FiniteGuard.step` raises before the optimizer runs, parameters
untouched (fp32/bf16: stop with a message; fp16 loss scaling skips the step instead and lowers
the scale: :mod:`loom.memory.loss_scale`, whose strategy sets ``skipping``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
import traceback
from pathlib import Path

INTERVAL_S = 1.0
STALE_AFTER_S = 3.0


class Heartbeat:
    """Background thread refreshing this rank's heartbeat file."""

    def __init__(self, run_dir: Path, rank: int, interval: float = INTERVAL_S) -> None:
        self.dir = Path(run_dir) / "heartbeat"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.interval = rank, interval
        self.step, self.phase = 0, "setup"
        self._stop = threading.Event()
        self._write_lock = threading.Lock()  # set() and the thread share one temp file
        self._thread = threading.Thread(target=self._run, name="loom-heartbeat", daemon=True)
        self._thread.start()

    def set(self, step: int, phase: str) -> None:
        """Record progress; written at once on a phase change, else by the thread (≤ interval late)."""
        changed = phase != self.phase
        self.step, self.phase = step, phase
        if changed:
            with contextlib.suppress(OSError):
                self._write()

    def _write(self) -> None:
        path = self.dir / f"rank-{self.rank:05d}.json"
        tmp = path.with_name(path.name + ".tmp")
        body = {
            "rank": self.rank,
            "pid": os.getpid(),
            "time": time.time(),
            "step": self.step,
            "phase": self.phase,
        }
        with self._write_lock:
            tmp.write_text(json.dumps(body))
            os.replace(tmp, path)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                self._write()
            self._stop.wait(self.interval)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval)


def read_heartbeats(run_dir: Path, world: int) -> dict[int, dict | None]:
    out: dict[int, dict | None] = {}
    for r in range(world):
        try:
            out[r] = json.loads((Path(run_dir) / "heartbeat" / f"rank-{r:05d}.json").read_text())
        except (OSError, ValueError):
            out[r] = None
    return out


def is_comm_failure(exc: BaseException) -> bool:
    """A collective that timed out or lost its peer (gloo and NCCL wording)."""
    text = str(exc)
    markers = (
        "Timed out",
        "timed out",
        "Timeout",
        "Connection closed by peer",
        "Connection reset by peer",
        "NCCL",
    )
    return type(exc).__name__ in ("DistBackendError", "DistNetworkError") or any(m in text for m in markers)


def where(exc: BaseException) -> str:
    """The innermost Loom frames of the traceback: the collective and who called it."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}loom{os.sep}" in f.filename]
    if not frames:
        return "an unknown collective"
    return " <- ".join(f"{f.name} ({Path(f.filename).name}:{f.lineno})" for f in reversed(frames[-2:]))


def diagnose(
    exc: BaseException, run_dir: Path, rank: int, world: int, timeout_s: float, now: float | None = None
) -> str:
    """One line naming the unresponsive ranks, their last step/phase, and this rank's collective."""
    now = time.time() if now is None else now
    beats = read_heartbeats(run_dir, world)
    mine = beats.get(rank) or {}
    stale = []
    for r, b in beats.items():
        if r == rank:
            continue
        if b is None:
            stale.append(f"rank {r} (no heartbeat file)")
        elif now - b["time"] > STALE_AFTER_S:
            stale.append(f"rank {r} (pid {b['pid']}, silent for {now - b['time']:.1f} s, "
                         f"last at step {b['step']} in {b['phase']})")  # fmt: skip
    head = (f"rank {rank}: collective failed after up to {timeout_s:.0f} s in {where(exc)} "
            f"at step {mine.get('step', '?')} ({mine.get('phase', '?')})")  # fmt: skip
    if stale:
        return f"{head}; unresponsive: {', '.join(stale)} (stopped, hung or dead)"
    return f"{head}; every other rank's heartbeat is fresh (slow collective or a rank in a different one?)"


class NonFiniteError(FloatingPointError):
    """Loss or gradients became inf/NaN; the update was not applied."""


class FiniteGuard:
    """Wraps a training Strategy; refuses the optimizer step when the global grad norm is not finite."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.last_norm = 0.0
        self.step_index = 0

    def clip_grad_norm(self, max_norm: float) -> float:
        self.last_norm = self.inner.clip_grad_norm(max_norm)
        return self.last_norm

    def step(self, lr: float) -> None:
        if not math.isfinite(self.last_norm) and not getattr(self.inner, "skipping", False):  # fp16: skipped
            raise NonFiniteError(
                f"non-finite gradient norm ({self.last_norm}) at step {self.step_index + 1}: update skipped, "
                "parameters untouched; stopping (lower train.lr, check the data, or resume from a checkpoint)"
            )
        self.inner.step(lr)
        self.step_index += 1

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
