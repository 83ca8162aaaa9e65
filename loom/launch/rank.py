"""One rank started by Loom's launcher: the trainer under ``@record``, its fault dumps in
``run.dir/logs``, and its exit after a failed collective."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

from loom import config as C
from loom.launch.env import _host_rank_store, under_external_launcher
from loom.launch.failures import fault_dump_path
from loom.launch.options import Nodes
from loom.launch.watch import watch_launcher


def _worker(cfg_dict: dict[str, Any]) -> dict[str, float] | None:
    """One rank. Exceptions are recorded (``@record``) so the launcher can quote them; None if the
    rank ended with ``sys.exit(0)`` (``record`` turns that into a return)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from loom.train.trainer import run

    _host_rank_store()
    run_cfg = cfg_dict["run"]
    watch_launcher(Path(run_cfg["dir"]), float(run_cfg["preempt_grace_s"]))
    try:
        return record(_run_rank)(cfg_dict, run)
    finally:  # the rank's exit collects no garbage across its whole heap (loom.cli.run)
        gc.freeze()


def _run_rank(cfg_dict: dict[str, Any], run) -> dict[str, float]:
    """A rank of Loom's launcher: a failure is the launcher's one line, unless it restarts instead
    (then the rank's own line says why it restarted)."""
    from tqdm import tqdm

    # only rank 0 draws bars: a thread lock, not tqdm's default named semaphore, which a killed rank
    # leaks (the launcher's resource tracker then prints a two-line warning after its one line)
    tqdm.set_lock(threading.RLock())
    _fault_dumps_to_file(Path(cfg_dict["run"]["dir"]))
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    from loom.train.health import CollectiveFailure
    from loom.train.trainer import StopRequest

    try:
        try:
            return run(
                C.from_dict(cfg_dict), exit_on_signal=True, report_comm_failure=restarts not in ("", "0")
            )
        finally:
            # the rank's work is done (its result, or its exit for a signal, is decided): it only waits for
            # the agent to read it, or exits, and a signal now (the agent's own SIGTERM as it shuts down,
            # the launcher's forwarded Ctrl-C after the terminal's) ends it at once, not as a
            # KeyboardInterrupt traceback from an exit handler
            for sig in StopRequest.SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
    except CollectiveFailure as e:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        if e.after_peer:  # the launcher names that peer's error or exit, and stops this rank on seeing it:
            # its SIGTERM ends the wait at once (a sleep resumes after a handler that returns, and the
            # launcher then waits its 30 s grace before SIGKILL)
            signal.signal(signal.SIGTERM, lambda *_: leave_now(1))
            time.sleep(float(cfg_dict["run"]["timeout_s"]))
        get_error_handler().record_exception(e)  # what @record would write: the launcher's one line
        leave_now(1)


_FAULT_FILE: list[Any] = []  # the open file the fault handler writes to (kept for the process's life)


def _fault_dumps_to_file(run_dir: Path) -> None:
    """Point the fault handler (``@record`` enables it on stderr, every thread) at this rank's
    :func:`fault_dump_path`: a rank killed by a signal then leaves the launcher's one line on the
    terminal, not ~70 lines of every thread's stack; stderr stays the fallback if the file cannot be made."""
    import faulthandler

    try:
        path = fault_dump_path(run_dir, int(os.environ.get("RANK", "0")))
        path.parent.mkdir(parents=True, exist_ok=True)
        f = path.open("w")
    except OSError:
        return
    _FAULT_FILE[:] = [f]
    faulthandler.enable(file=f, all_threads=True)


def leave_now(code: int) -> NoReturn:
    """End this rank at once after a failed collective (its line already recorded or printed): a gloo
    group whose operation still waits on the lost peer (the rank's wait was bounded by run.timeout_s,
    the operation only by the group's own timeout, a day for the control group) makes a normal exit
    hang in the group's destructor, which joins that operation's thread (measured: 1 run in 6 of the
    stopped-rank test, the launcher waiting for a rank that never ended)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_CPP_LOG = "TORCH_CPP_LOG_LEVEL"
_QUIETED: list[bool] = []  # this launcher set _CPP_LOG (the ranks get it unset again)


def quiet_launcher_store_logs(nodes: Nodes | None) -> None:
    """A multi-node launcher, before torch is imported: c10d logs every failed call of the elastic agent
    to a rendezvous store that went with node 0's launcher as a warning with its C++ frames (~40 lines
    each), before Loom's one line (:func:`rendezvous_lost_line`); the launcher's C++ log level (read once,
    at import) is set to ERROR, unless the user set one. Its ranks keep the user's setting."""
    if nodes is None or under_external_launcher() or "torch" in sys.modules or _CPP_LOG in os.environ:
        return
    os.environ[_CPP_LOG] = "ERROR"
    _QUIETED.append(True)


def _unquiet_ranks() -> None:
    if _QUIETED:
        import torch  # noqa: F401  (the level is read at import: the launcher keeps ERROR)

        os.environ.pop(_CPP_LOG, None)
        _QUIETED.clear()
