"""Metrics: one standard step line, ``metrics.jsonl`` and TensorBoard, written by rank 0 only."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from loom.notes import drop_launcher_notes

if TYPE_CHECKING:
    from loom.train.trackers import Tracker

log = logging.getLogger("loom")


def setup_logging(rank: int) -> None:
    """Rank-aware log format; only rank 0 logs INFO, others only warnings and errors."""
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank {rank}] %(message)s", force=True)
    for handler in logging.getLogger().handlers:  # what Loom's launcher said already (loom.notes)
        drop_launcher_notes(handler)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}TiB"  # pragma: no cover


def step_line(row: dict[str, Any]) -> str:
    """``step | loss | lr | grad_norm | tok/s | MFU | mem`` (the one standard line); mem is this rank's
    peak allocated bytes with the allocator's peak reserved bytes, the state and the peak saved
    activations, then the largest peaks over the ranks and whose; fp16 runs end with the loss scale
    and the count of skipped steps."""
    from loom.parallel.base import held_state_bytes

    return (
        f"step {row['step']:>6} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
        f"grad_norm {row['grad_norm']:.3f} | tok/s {row['tokens_per_s']:,.0f} | "
        f"MFU {100 * row['mfu']:.1f}% | mem {human_bytes(row['peak_mem_bytes'])}"
        + (
            f" (reserved {human_bytes(row['peak_reserved_bytes'])}, "
            if "peak_reserved_bytes" in row
            else " ("
        )
        + f"state {human_bytes(held_state_bytes(row))}"
        + (f", act {human_bytes(row['act_saved_peak_bytes'])}" if "act_saved_peak_bytes" in row else "")
        + ")"
        + (
            f" | max mem {human_bytes(row['peak_mem_max_bytes'])} rank {row['peak_mem_max_rank']}, "
            f"reserved {human_bytes(row['peak_reserved_max_bytes'])} rank {row['peak_reserved_max_rank']}"
            if "peak_mem_max_bytes" in row
            else ""
        )
        + (f" | scale {row['loss_scale']:g} skipped {row['skipped_steps']}" if "loss_scale" in row else "")
    )


def max_over_ranks(
    values: dict[str, int], rank: int, world: int, group=None, timeout_s: float | None = None
) -> dict[str, int]:
    """For each ``<name>_bytes`` of this rank: ``<name>_max_bytes``, the largest over the ``world``
    ranks of ``group``, and ``<name>_max_rank``, the (lowest) rank that has it. One all-reduce (MAX)
    of one int64 per value on the CPU (the gloo control group: no device sync), each sent as
    v · world + (world − 1 − rank), whose maximum gives the largest v and then the lowest rank."""
    keys = list(values)
    code = torch.tensor([int(values[k]) * world + (world - 1 - rank) for k in keys], dtype=torch.int64)
    if world > 1:
        work = dist.all_reduce(code, op=dist.ReduceOp.MAX, group=group, async_op=True)
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timedelta(seconds=timeout_s))
    out: dict[str, int] = {}
    for k, c in zip(keys, code.tolist()):
        name = k.removesuffix("_bytes")
        out[f"{name}_max_bytes"], out[f"{name}_max_rank"] = c // world, world - 1 - c % world
    return out


def _quiet_tensorboard_threads() -> None:
    """TensorBoard's event-writer thread re-raises a write error, which ``threading`` prints as a
    traceback; the same error reaches :meth:`MetricsWriter.write` through ``flush``, so that thread's
    copy is dropped (every other thread's exceptions are printed as before)."""
    previous = threading.excepthook
    if getattr(previous, "_loom_quiet_tb", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook._loom_quiet_tb = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def strict_json_row(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` as strict JSON holds it: a non-finite number (an fp16 step's infinite gradient norm, a
    diverged loss) becomes null, its value named beside it as ``KEY_nonfinite`` ("inf", "-inf",
    "nan"); Python writes them as ``Infinity``/``NaN``, which JSON.parse, polars and strict parsers
    refuse and jq reads as 1.8e308. TensorBoard and the trackers get the numbers themselves."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[k], out[f"{k}_nonfinite"] = None, repr(v)
        else:
            out[k] = v
    return out


def _metrics_error(e: OSError, where: Path) -> OSError:
    """A failed metrics write as one ``OSError`` naming the file (``where`` when the error names none)."""
    return OSError(e.errno, f"{e.strerror or e} (while writing the run's metrics)", str(e.filename or where))


class MetricsWriter:
    """Appends JSON rows to ``metrics.jsonl`` (flushed and fsynced per row) and TensorBoard scalars."""

    def __init__(
        self,
        run_dir: str | Path,
        enabled: bool,
        tensorboard: bool,
        trackers: Sequence[Tracker] = (),
        start_step: int = 0,
    ) -> None:
        """``start_step``: the step this attempt resumes after (0: from the start); TensorBoard drops
        the events an earlier attempt wrote past it (``purge_step``), as ``metrics.jsonl`` is cut there."""
        self.enabled = enabled
        self.trackers = list(trackers)  # wandb, mlflow (loom.train.trackers): the same rows
        self.path = Path(run_dir) / "metrics.jsonl"
        # 0o666 less the umask, as every other file of the run (a group's shared run.dir stays appendable)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666) if enabled else -1
        self._tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_tensorboard_threads()  # first: the writer thread writes (and may fail) as it starts
            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=start_step + 1)

    def write(self, row: dict[str, Any]) -> None:
        """A failed write (disk full, quota) raises one ``OSError`` naming the file, TensorBoard's too:
        its writer thread's error is taken to this thread by ``flush`` (and not printed there)."""
        if not self.enabled:
            return
        where = self.path
        try:
            # One write() per row, so a reader never sees half a row unless the writer is killed mid-call.
            os.write(
                self._fd, (json.dumps(strict_json_row(row), sort_keys=True, allow_nan=False) + "\n").encode()
            )
            os.fsync(self._fd)
            if self._tb is not None:
                where = Path(self._tb.log_dir)
                step = int(row["step"])
                for k, v in row.items():
                    if k != "step" and isinstance(v, (int, float)):
                        self._tb.add_scalar(k, v, step)
                self._tb.flush()
            for t in self.trackers:
                t.log(row)
        except OSError as e:
            raise _metrics_error(e, where) from None

    def close(self) -> None:
        for t in self.trackers:
            t.close()
        self.trackers = []
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._tb is not None:
            tb, self._tb = self._tb, None
            try:  # its last flush raises what its writer thread could not write (disk full)
                tb.close()
            except OSError as e:
                raise _metrics_error(e, Path(tb.log_dir)) from None
