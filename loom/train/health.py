"""Failure diagnosis: heartbeats that name a hung rank, and a guard against non-finite updates.

Heartbeat: every rank runs a thread that rewrites ``<run.dir>/heartbeat/rank-NNNNN.json``
(host, pid and its start time, wall time, current step and phase) every ``interval`` = clamp(timeout / 8, 1 s, 60 s)
seconds (:func:`heartbeat_interval`), and at once on a phase change: at 1,024 ranks and the
default 600 s timeout that is 14 small writes per second for the whole job, not 1,024. A
stopped process (SIGSTOP, a debugger, a swapped-out node) or a dead one stops refreshing its
file, while a healthy rank blocked in a collective keeps refreshing it. When a collective fails
on the process-group timeout, :func:`diagnose` reads the files and names the ranks whose
heartbeat is older than ``3 · interval``, with their last step and phase, and the collective
this rank was in. A rank that is gone is named as such, not as fresh: its file says it exited
(written when a rank leaves :func:`loom.train.trainer.run`), or, on this host, its pid no longer
runs (a SIGKILL leaves a recent heartbeat behind). A peer that closed the connection while every
heartbeat is recent is reported as that, never as "every other rank's heartbeat is fresh".

The files live in ``run.dir``, which a multi-node job must put on a shared file system (as it
must for checkpoints anyway); without one a rank only sees the heartbeats of its own node.

Bound: a stopped rank is reported ``run.timeout_s`` (the collective timeout) after the
others enter the collective it never joins, plus the time to read the files (milliseconds).
Staleness needs ``run.timeout_s`` > 3 · interval, which the clamp gives for any timeout above 24 s
(below that the 1 s floor: timeout > 3 s).

NCCL (:func:`nccl_watchdog_env`): the process group's watchdog would otherwise kill the process
on a timed-out collective before this diagnosis runs. Loom sets (unless the user has) the
watchdog to abort the communicators and raise in Python instead (``TORCH_NCCL_ASYNC_ERROR_HANDLING
= 2``), its heartbeat monitor above Loom's timeout, and the flight recorder to dump each rank's
last collectives into ``<run.dir>/flight_recorder/`` on a timeout; the diagnosis names the dump.
The elastic agent (``loom train``'s launcher, ``torchrun``) gives its workers
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (SIGABRT) unless its own environment sets the variable, so
each rank decides before its process group exists (:func:`nccl_error_handling`): the agent's
default (1 in the rank, absent from the agent's own environment, read from
``/proc/<parent>/environ``) is replaced by 2; a value the user set is kept, and when it kills
(0 or 1) rank 0 logs once that the hung-rank diagnosis cannot run.

Non-finite values (:func:`loom.train.step.optimizer_step`): the gradient norm is global (every
rank computes the same value after the gradient reduction), so all ranks agree without another
collective. If it is not finite, :class:`NonFiniteError` is raised before the optimizer runs,
parameters untouched (fp32/bf16: stop with a message; fp16 loss scaling skips the step instead
and lowers the scale: :mod:`loom.memory.loss_scale`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

INTERVAL_S = 1.0  # the floor of the refresh interval
MAX_INTERVAL_S = 60.0
STALE_INTERVALS = 3  # a heartbeat older than this many intervals is stale
FLIGHT_RECORDER_DIR = "flight_recorder"


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between heartbeat writes: clamp(timeout / 8, 1, 60)."""
    return min(MAX_INTERVAL_S, max(INTERVAL_S, timeout_s / 8))


def nccl_watchdog_env(timeout_s: float, run_dir: Path) -> dict[str, str]:
    """Environment for NCCL process groups (set before they are created; values the user set win):
    raise on a timed-out collective instead of killing the process, watchdog monitor above the
    collective timeout, flight recorder dumped per rank under ``<run_dir>/flight_recorder/``."""
    prefix = Path(run_dir) / FLIGHT_RECORDER_DIR / "rank_"
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # abort the communicators, raise in the waiting call
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(int(timeout_s) + 120),
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_FR_BUFFER_SIZE": "2000",  # the newer name of the flight recorder's size
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(prefix),
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(prefix),  # the older name of the same setting
    }


NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
RAISING = ("2", "3")  # abort the communicators and raise / raise only: the diagnosis runs


def parent_environ(pid: int | None = None) -> dict[str, str] | None:
    """The environment the parent process (the elastic agent under a launcher) started with, or None
    where it cannot be read (no ``/proc``, another user)."""
    try:
        raw = Path(f"/proc/{os.getppid() if pid is None else pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def nccl_error_handling(environ: dict[str, str], parent: dict[str, str] | None) -> tuple[str | None, str]:
    """(the value to set for ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, or None to keep this rank's; a line
    to log, or ""): unset → 2; 1 from the elastic agent's default (``TORCHELASTIC_RUN_ID`` set, the
    variable absent from the agent's own environment ``parent``) → 2; anything else is the user's
    and is kept, with a line when it kills the rank (0, 1) or when whose it is cannot be told."""
    value = environ.get(NCCL_ERROR_HANDLING)
    if value is None:
        return "2", ""
    if value in RAISING:
        return None, ""
    under_agent = "TORCHELASTIC_RUN_ID" in environ
    if under_agent and value == "1" and parent is not None and NCCL_ERROR_HANDLING not in parent:
        return "2", ""
    whose = (
        "set by you or by torchrun's default (its environment cannot be read)"
        if under_agent and parent is None
        else "set by you"
    )
    return None, (
        f"{NCCL_ERROR_HANDLING}={value} ({whose}) is kept: a timed-out NCCL collective then ends the "
        f"rank before Loom can name the hung rank; set it to 2 (or unset it) for that diagnosis"
    )


def apply_nccl_watchdog_env(
    timeout_s: float, run_dir: Path, rank: int = 0, read_parent: Callable[[], dict | None] = parent_environ
) -> None:
    """Set :func:`nccl_watchdog_env` where the user has not (``os.environ``, before the process group
    exists); ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` by :func:`nccl_error_handling` (``read_parent``: the
    agent's environment); rank 0 logs its line once."""
    (Path(run_dir) / FLIGHT_RECORDER_DIR).mkdir(parents=True, exist_ok=True)
    for key, value in nccl_watchdog_env(timeout_s, run_dir).items():
        if key != NCCL_ERROR_HANDLING:
            os.environ.setdefault(key, value)
    environ = dict(os.environ)
    chosen, line = nccl_error_handling(environ, read_parent() if NCCL_ERROR_HANDLING in environ else None)
    if chosen is not None:
        os.environ[NCCL_ERROR_HANDLING] = chosen
    if line and rank == 0:
        logging.getLogger("loom").warning("%s", line)


class Heartbeat:
    """Background thread refreshing this rank's heartbeat file."""

    current: Heartbeat | None = None  # this process's newest: closed by the rank's way out (trainer.run)

    def __init__(self, run_dir: Path, rank: int, interval: float = INTERVAL_S) -> None:
        self.dir = Path(run_dir) / "heartbeat"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.interval = rank, interval
        self.node = _node_rank()
        self.step, self.phase = 0, "setup"
        self.failed: str | None = None  # this rank's own error, once it ended with one
        self._stop = threading.Event()
        self._write_lock = threading.Lock()  # set() and the thread share one temp file
        self._thread = threading.Thread(target=self._run, name="loom-heartbeat", daemon=True)
        self._thread.start()
        Heartbeat.current = self

    def set(self, step: int, phase: str) -> None:
        """Record progress; written at once on a phase change, else by the thread (≤ interval late)."""
        changed = phase != self.phase
        self.step, self.phase = step, phase
        if changed:
            with contextlib.suppress(OSError):
                self._write()

    def _write(self) -> None:
        self._put(exited=False)

    def _put(self, exited: bool) -> None:
        path = self.dir / f"rank-{self.rank:05d}.json"
        tmp = path.with_name(path.name + ".tmp")
        body = {
            "rank": self.rank,
            "node": self.node,
            "host": _HOST,
            "pid": os.getpid(),
            "start": _start_ticks(os.getpid()),
            "time": time.time(),
            "step": self.step,
            "phase": self.phase,
        }
        if exited:
            body["exited"] = True
        if self.failed is not None:
            body["failed"] = self.failed
        with self._write_lock:
            tmp.write_text(json.dumps(body))
            os.replace(tmp, path)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                self._write()
            self._stop.wait(self.interval)

    def close(self, failed: str | None = None) -> None:
        """Stop refreshing and mark the file as exited (peers then do not take this rank for alive);
        ``failed``: the error this rank ends with, which its launcher reports (:func:`failed_peers`)."""
        self.failed = failed if failed is not None else self.failed
        self._stop.set()
        self._thread.join(timeout=2 * self.interval)
        with contextlib.suppress(OSError):
            self._put(exited=True)


_HOST = socket.gethostname()
_PF_EXITING = 0x4  # the kernel's per-task flag, set as a process starts to exit
SETTLE_S = 1.0  # after a closed connection, how long to look for the peer's process to be gone


def _node_rank() -> int | None:
    """This process's node in its job: the elastic agent's ``GROUP_RANK`` (Loom's launcher, torchrun)
    or ``SLURM_NODEID`` (srun); None when neither says."""
    for key in ("GROUP_RANK", "SLURM_NODEID"):
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return None


def _start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (Linux ``/proc``), to tell a reused pid apart."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_gone(beat: dict) -> bool:
    """True if the heartbeat's process has certainly ended: it said so, or it ran on this host and
    its pid is gone, a zombie, or now another process. Unknown (another host, no /proc): False."""
    if beat.get("exited"):
        return True
    if beat.get("host") != _HOST or not isinstance(beat.get("pid"), int):
        return False
    pid = beat["pid"]
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        state, flags = fields[0], int(fields[6])
    except FileNotFoundError:
        return True
    except (OSError, IndexError, ValueError):
        return False
    if state in ("Z", "X") or flags & _PF_EXITING:  # dead, or being torn down (a SIGKILL in progress)
        return True
    start = beat.get("start")
    return start is not None and _start_ticks(pid) not in (None, start)


def read_heartbeats(run_dir: Path, world: int) -> dict[int, dict | None]:
    out: dict[int, dict | None] = {}
    for r in range(world):
        try:
            out[r] = json.loads((Path(run_dir) / "heartbeat" / f"rank-{r:05d}.json").read_text())
        except (OSError, ValueError):
            out[r] = None
    return out


def failed_peers(run_dir: Path, world: int, rank: int) -> list[int]:
    """The other ranks that ended with an error of their own (their heartbeat says so): a collective
    that lost them failed because of it, and their launcher names that error in its one line."""
    beats = read_heartbeats(run_dir, world)
    return [r for r, b in beats.items() if r != rank and b is not None and b.get("failed")]


def reported_peers(run_dir: Path, world: int, rank: int) -> list[int]:
    """The other ranks whose end the launcher reports itself: those that ended with an error of their
    own (:func:`failed_peers`), and those of this node that ended (their exit status, a signal such as
    SIGKILL, is the launcher's to name). A rank of another node that ended is not: only this rank's
    line can name it."""
    beats = read_heartbeats(run_dir, world)
    node = _node_rank()
    return [
        r
        for r, b in beats.items()
        if r != rank
        and b is not None
        and (b.get("failed") or (b.get("node") == node and b.get("host") == _HOST and process_gone(b)))
    ]


def is_comm_failure(exc: BaseException) -> bool:
    """A collective that timed out or lost its peer (gloo and NCCL wording)."""
    text = str(exc)
    markers = (
        "Timed out",
        "timed out",
        "Timeout",
        "Application timeout",  # gloo, when an earlier operation's timeout closed the pair
        "pair closure",
        "Connection closed by peer",
        "Connection reset by peer",
        "Connection refused",
        "Broken pipe",
        "NCCL",
    )
    return type(exc).__name__ in ("DistBackendError", "DistNetworkError") or any(m in text for m in markers)


def where(exc: BaseException) -> str:
    """The innermost Loom frames of the traceback: the collective and who called it."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}loom{os.sep}" in f.filename]
    if not frames:
        return "an unknown collective"
    return " <- ".join(f"{f.name} ({Path(f.filename).name}:{f.lineno})" for f in reversed(frames[-2:]))


def peer_closed(exc: BaseException) -> bool:
    """The collective failed because a peer closed its connection (it exited or was killed)."""
    text = str(exc)
    return any(m in text for m in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))


def diagnose(
    exc: BaseException, run_dir: Path, rank: int, world: int, timeout_s: float, now: float | None = None
) -> str:
    """One line naming the ranks that are gone or unresponsive, their last step/phase, and this
    rank's collective (and where NCCL's flight recorder dumped the last collectives, if it did).
    "every other rank's heartbeat is fresh" only when it is, and no peer closed the connection."""
    now = time.time() if now is None else now
    stale_after = STALE_INTERVALS * heartbeat_interval(timeout_s)
    beats = read_heartbeats(run_dir, world)
    mine = beats.get(rank) or {}

    places = {(b.get("node"), b.get("host")) for b in beats.values() if b is not None}
    several = len(places) > 1  # a job over several nodes or hosts: say where each rank ran

    def where_ran(b: dict) -> str:
        if not several:
            return ""
        node = f"node {b['node']}, " if b.get("node") is not None else ""
        return f"{node}host {b.get('host', '?')}; "

    def classify() -> tuple[list[str], list[str]]:
        gone, stale = [], []
        for r, b in beats.items():
            if r == rank:
                continue
            if b is None:
                stale.append(f"rank {r} (no heartbeat file)")
            elif process_gone(b):
                how = (
                    f"failed: {b['failed']}"
                    if b.get("failed")
                    else "exited"
                    if b.get("exited")
                    else "no longer running"
                )
                gone.append(
                    f"rank {r} ({where_ran(b)}pid {b['pid']} {how}, last at step {b['step']} in {b['phase']})"
                )
            elif now - b["time"] > stale_after:
                stale.append(
                    f"rank {r} ({where_ran(b)}pid {b['pid']}, silent for {now - b['time']:.1f} s, "
                    f"last at step {b['step']} in {b['phase']})"
                )
        return gone, stale

    gone, stale = classify()
    # a killed peer's sockets can close a moment before its process shows as ending: look again briefly
    local = any(b is not None and b.get("host") == _HOST for r, b in beats.items() if r != rank)
    settle = time.monotonic() + SETTLE_S
    while not gone and local and peer_closed(exc) and time.monotonic() < settle:
        time.sleep(0.05)
        gone, stale = classify()
    head = (
        f"rank {rank}: collective failed after up to {timeout_s:.0f} s in {where(exc)} "
        f"at step {mine.get('step', '?')} ({mine.get('phase', '?')})"
    )
    dumps = sorted((Path(run_dir) / FLIGHT_RECORDER_DIR).glob("rank_*"))
    tail = f"; NCCL flight recorder: {dumps[0].parent}/rank_* ({len(dumps)} dumps)" if dumps else ""
    found = []
    if gone:
        found.append(f"gone: {', '.join(gone)}")
    if stale:
        found.append(f"unresponsive: {', '.join(stale)} (stopped, hung or dead)")
    if found:
        return f"{head}; {'; '.join(found)}{tail}"
    if peer_closed(exc):
        return (
            f"{head}; a peer closed its connection, but no rank's heartbeat shows it gone yet (a rank on "
            f"another host that exited, or one killed less than {stale_after:.0f} s ago){tail}"
        )
    return (
        f"{head}; every other rank's heartbeat is fresh (slow collective or a rank in a different one?){tail}"
    )


class CollectiveFailure(RuntimeError):
    """A collective timed out or lost a peer; the message is :func:`diagnose`'s one line.
    ``after_peer``: the cause is a peer the launcher reports itself (:func:`reported_peers`)."""

    def __init__(self, message: str, after_peer: bool = False) -> None:
        super().__init__(message)
        self.after_peer = after_peer


class NonFiniteError(FloatingPointError):
    """Loss or gradients became inf/NaN; the update was not applied."""
