"""How a launch ends in one line: a signal's stop (the step saved, exit 128 + its number), or the
failed ranks named with their errors (tracebacks to ``run.dir/logs``)."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from pathlib import Path


def fault_dump_path(run_dir: Path, rank: int) -> Path:
    """Where a rank's Python stacks go when it dies of a signal (SIGSEGV, SIGBUS, SIGFPE, SIGABRT)."""
    return run_dir / "logs" / f"rank-{rank}-fault.txt"


class Stopped(SystemExit):
    """The end of a run stopped by SIGTERM/SIGINT: :attr:`line` for stderr, exit code 128 + signal."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(code)
        self.line = line


def stopped_record(run_dir: Path) -> dict | None:
    """What the ranks saved when a signal stopped them (``run.dir/stopped.json``), or None."""
    from loom.train.trainer import STOPPED

    try:
        record = json.loads((Path(run_dir) / STOPPED).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def stop_line(run_dir: Path, sig: signal.Signals | None = None, since: float | None = None) -> str:
    """The one line of a run stopped by a signal: the step its ranks saved, that the run had ended
    (the ranks recorded the signal as ``final``, or a final model was written after ``since``, the
    launch's start: the signal came as the ranks were leaving), or that none was saved."""
    record = stopped_record(run_dir)
    name = sig.name if sig is not None else str((record or {}).get("signal", "a signal"))
    final = run_dir / "checkpoints" / "final" / "meta.json"
    written = since is not None and final.is_file() and final.stat().st_mtime >= since
    if (record is None and written) or (record is not None and record.get("final") is True):
        return (
            f"loom: interrupted by {name} as the run ended: its final model was saved "
            f"({final.parent}); nothing to resume"
        )
    if record is None:
        return f"loom: interrupted by {name} before a step could be saved; all ranks stopped"
    return (
        f"loom: stopped by {record.get('signal', 'a signal')} after step {record['step']}: checkpoint "
        f"{record.get('checkpoint')} saved; run the same command to resume"
    )


def _clear_stopped(run_dir: str) -> None:
    from loom.train.trainer import STOPPED

    with contextlib.suppress(OSError):
        (Path(run_dir) / STOPPED).unlink()


def _finish(run_dir: str) -> int:
    """After the ranks returned: 0, or the line and 128 + signal when a signal stopped them."""
    record = stopped_record(Path(run_dir))
    if record is None:
        return 0
    sys.stdout.flush()
    print(stop_line(Path(run_dir)), file=sys.stderr, flush=True)
    return _stop_code(record)


def _stop_code(record: dict) -> int:
    return 128 + int(getattr(signal, str(record.get("signal")), signal.SIGTERM))


# Loom's own errors: their message already names the field or file, so no class name or traceback
OWN_ERRORS = (
    "ConfigError",
    "CheckpointError",
    "HFError",
    "NonFiniteError",
    "CollectiveFailure",
    "LossScaleDiverged",
    "PipelineError",
    "StrictCommError",
    "HardwareError",
    "PlanError",
    "StorePortTaken",
)


# Loom's errors that mean bad input (a field, a file): exit status 2, as the one-process run gives
INPUT_ERRORS = ("ConfigError", "CheckpointError", "HFError", "HardwareError", "PlanError")


def failure_code(failures: dict) -> int:
    """The launcher's exit status for the failed ranks: 2 when each failed on bad input (every rank's
    error one of :data:`INPUT_ERRORS`, as a damaged checkpoint found by the ranks), else 1."""
    names = [_failure_message(f).partition(": ")[0].rsplit(".", 1)[-1] for f in failures.values()]
    return 2 if names and all(name in INPUT_ERRORS for name in names) else 1


def failure_line(failures: dict, run_dir: Path) -> str:
    """One line for the failed ranks: Loom's errors as ``loom: <message> (rank r; traceback in F)``
    (ranks with the same message together), anything else with its rank, exit code and class. Each
    rank's traceback goes to ``<run_dir>/logs/rank-<r>-failure.txt``."""
    groups: dict[str, list[str]] = {}
    for rank, failure in sorted(failures.items()):
        text = _failure_message(failure)
        path = _save_traceback(failure, run_dir, rank)
        where = f"rank {rank}" if path is None else f"rank {rank}; traceback in {path}"
        name, _, rest = text.partition(": ")
        if name.rsplit(".", 1)[-1] in OWN_ERRORS and rest:
            groups.setdefault(rest, []).append(where)
        else:
            groups.setdefault(
                f"rank {rank} (local {failure.local_rank}, pid {failure.pid}) failed with exit code "
                f"{failure.exitcode}: {text}{_fault_note(run_dir, rank) if failure.exitcode < 0 else ''}",
                [],
            ).append("" if path is None else f"traceback in {path}")
    parts = [
        f"{msg} ({'; '.join(w for w in wheres if w)})" if any(wheres) else msg
        for msg, wheres in groups.items()
    ]
    return "loom: " + " | ".join(parts)


def _save_traceback(failure, run_dir: Path, rank: int) -> Path | None:
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    msg = data.get("message", {})
    stack = msg.get("extraInfo", {}).get("py_callstack", "") if isinstance(msg, dict) else ""
    if not stack:
        return None
    try:
        path = Path(run_dir) / "logs" / f"rank-{rank}-failure.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(stack)
        return path
    except OSError:
        return None


def _failure_message(failure) -> str:
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    msg = data.get("message", {})
    if isinstance(msg, dict):
        text = msg.get("message", "")
    else:
        text = str(msg)
    text = (
        text.strip().splitlines()[-1] if text.strip() else (failure.message or "see the rank's output above")
    )
    if failure.signal_name() not in ("", "<N/A>", None) and failure.exitcode < 0:
        text = f"killed by {failure.signal_name()}"
    return text


def _fault_note(run_dir: Path, rank: int) -> str:
    """``; stacks in PATH`` when the rank's fault handler wrote its threads' stacks there."""
    path = fault_dump_path(run_dir, rank)
    try:
        return f"; its stacks: {path}" if path.stat().st_size > 0 else ""
    except OSError:
        return ""
