"""Ranks that stop or lose their launcher: stopped workers killed at once, a lost node's launcher
noticed by its ranks (a parent-death signal) and named in one line by the surviving launchers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from loom.launch.failures import stopped_record
from loom.launch.options import Nodes

_KILL_PENDING = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}


def stopped_with_kill_pending(pid: int) -> bool:
    """``pid`` is stopped (SIGSTOP, SIGTSTP) while a signal that would end it waits for a SIGCONT."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    except (OSError, ValueError):
        return False
    if not fields.get("State", "").strip().startswith("T"):
        return False
    pending = int(fields.get("ShdPnd", "0"), 16) | int(fields.get("SigPnd", "0"), 16)
    return any(pending >> (int(sig) - 1) & 1 for sig in _KILL_PENDING)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


class StoppedWorkerReaper:
    """A thread of the launcher: a worker the agent asked to stop but that is stopped (its SIGTERM
    waits for a SIGCONT) is killed at once, instead of after the agent's 30 s grace."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.killed: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loom-reaper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.wait(self.interval):
            for pid in _children(me):
                if stopped_with_kill_pending(pid):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                        self.killed.append(pid)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2 * self.interval + 1)


LAUNCHER_LOST = signal.SIGUSR2
"""The parent-death signal of a rank under Loom's launcher (torch's own, SIGINT, reads as a Ctrl-C)."""
_PR_SET_PDEATHSIG = 1  # prctl(2)


def lost_marker(run_dir: Path, node: int) -> Path:
    """``run.dir/heartbeat/node-NNNNN.json``: written by the ranks of a node whose launcher died."""
    return Path(run_dir) / "heartbeat" / f"node-{node:05d}.json"


def watch_launcher(run_dir: Path, grace_s: float) -> bool:
    """In a rank started by Loom's launcher, on Linux: when the launcher dies, the kernel sends this
    rank :data:`LAUNCHER_LOST` (``prctl(PR_SET_PDEATHSIG)``); the rank writes :func:`lost_marker` (its
    node, host and the launcher's pid), raises SIGTERM on itself (the trainer's agreed stop: every rank
    saves the same step and ends) and kills itself if it still runs ``grace_s`` later, as the launcher
    would have. True if the watch is installed."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return False
    import ctypes

    launcher = os.getppid()
    node = int(os.environ.get("GROUP_RANK", "0") or 0)  # the elastic agent's node rank
    fired: list[int] = []

    def lost(signum: int, frame: Any) -> None:
        if fired or os.getppid() == launcher:  # once; a stray signal while the launcher lives is ignored
            return
        fired.append(signum)
        record = {
            "node": node,
            "host": socket.gethostname(),
            "launcher_pid": launcher,
            "rank": int(os.environ.get("RANK", "-1")),
            "time": time.time(),
        }
        with contextlib.suppress(OSError):
            _write_json(lost_marker(run_dir, node), record)
        end = threading.Timer(grace_s, os.kill, (os.getpid(), signal.SIGKILL))
        end.daemon = True
        end.start()
        signal.raise_signal(signal.SIGTERM)

    signal.signal(LAUNCHER_LOST, lost)
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(LAUNCHER_LOST), 0, 0, 0) != 0:
        signal.signal(LAUNCHER_LOST, signal.SIG_DFL)
        return False
    lost(LAUNCHER_LOST, None)  # the launcher died before the watch was set: act now
    return True


class LostNodeWatch:
    """A thread of a multi-node launcher: once one of its ranks has ended while another node's ranks
    left a :func:`lost_marker`, the launcher stops itself with SIGTERM ``settle_s`` later, unless the
    launch ended meanwhile. Without it the elastic agent would restart its ranks under
    ``--max-restarts`` and wait at the rendezvous for the lost node (measured: > 20 s with
    ``run.timeout_s = 5``), or wait at its exit barrier (300 s); :func:`launch` then names the node."""

    def __init__(self, run_dir: Path, node: int, interval: float = 0.2, settle_s: float = 0.5) -> None:
        self.run_dir, self.node = Path(run_dir), node
        self.interval, self.settle_s = interval, settle_s
        self.fired = False
        self._closed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loom-lost-node", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me, seen = os.getpid(), set(_children(os.getpid()))
        since: float | None = None
        while not self._stop.wait(self.interval):
            now = set(_children(me))
            if since is None and seen - now and any(n != self.node for n in lost_nodes(self.run_dir)):
                since = time.monotonic()  # a rank ended and a node is lost (one look per ended rank)
            seen = now
            if since is not None and time.monotonic() - since >= self.settle_s:
                with self._lock:
                    if not self._closed:
                        self.fired = True
                        os.kill(me, signal.SIGTERM)
                return

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._stop.set()
        self._thread.join(2 * self.interval + 1)


def _write_json(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # several ranks of a node write the same file
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def lost_nodes(run_dir: Path) -> dict[int, dict]:
    """The nodes whose launcher died during this job (their ranks' :func:`lost_marker` files)."""
    out: dict[int, dict] = {}
    for path in sorted((Path(run_dir) / "heartbeat").glob("node-*.json")):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text())
            if isinstance(record, dict) and isinstance(record.get("node"), int):
                out[record["node"]] = record
    return out


def _clear_lost(run_dir: str) -> None:
    for path in (Path(run_dir) / "heartbeat").glob("node-*.json"):
        with contextlib.suppress(OSError):
            path.unlink()


def lost_node_line(lost: dict[int, dict], run_dir: Path, rendezvous: str | None = None) -> str:
    """The one line of a surviving node: each lost node with its host and launcher pid (and the
    rendezvous store that went with node 0's launcher), then the step every rank saved, or none."""
    heads = [
        f"node {node} (host {r.get('host', '?')}) stopped answering: its launcher (pid "
        f"{r.get('launcher_pid', '?')}) is gone"
        + (f", and with it the rendezvous store at {rendezvous}" if node == 0 and rendezvous else "")
        for node, r in sorted(lost.items())
    ]
    return f"loom: {'; '.join(heads)}; {_saved(run_dir)}"


def _saved(run_dir: Path) -> str:
    record = stopped_record(run_dir)
    if record is None:
        return "the ranks stopped before a step could be saved"
    return (
        f"every rank stopped after step {record['step']}: checkpoint {record.get('checkpoint')} saved; start "
        "the lost launcher again and run the same command on every node to resume"
    )


def rendezvous_lost_line(nodes: Nodes, exc: BaseException, run_dir: Path) -> str:
    """One line for a rendezvous that failed under a running job: the lost node when its ranks left
    a :func:`lost_marker`, else node 0 (whose launcher hosts the store) for the other nodes."""
    lost = {n: r for n, r in lost_nodes(run_dir).items() if n != nodes.node_rank}
    if lost:
        return lost_node_line(lost, run_dir, nodes.endpoint)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    head = (
        f"node 0 (rendezvous {nodes.endpoint}) stopped answering: {type(exc).__name__}, its launcher "
        "or its host is gone"
        if nodes.node_rank != 0
        else f"the rendezvous at {nodes.endpoint} failed: {type(exc).__name__}: {text}"
    )
    return f"loom: {head}; {_saved(run_dir)}"
