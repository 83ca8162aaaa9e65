"""One owner per run directory: an exclusive OS file lock on ``<run.dir>/.loom.lock`` for the life
of the job, so a second ``loom train`` on the same directory is refused instead of resuming from
the first one's checkpoints and interleaving its metrics.

The lock is ``flock`` on an open file: the kernel releases it when the holding process exits for
any reason (a crash, SIGKILL), so a lock is never stale on a local file system. The file also
records the holder (pid, host, start time, command) for the refusal message. Who holds it: the
process ``loom train`` starts in (it outlives the ranks it launches); under torchrun or srun,
global rank 0.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from loom.config import ConfigError

LOCK_NAME = ".loom.lock"


class RunLock:
    """Hold ``run_dir``'s lock or raise :class:`ConfigError` naming the holder."""

    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / LOCK_NAME
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)  # the umask decides, as for every file
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder()
            os.close(self.fd)
            raise ConfigError(
                f"run.dir: {self.dir} is in use by {holder}; wait for that run to end or choose "
                "another run.dir"
            ) from None
        os.ftruncate(self.fd, 0)
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),  # with its UTC offset: hosts differ
            "command": " ".join(sys.argv[:3]),
        }
        os.write(self.fd, json.dumps(info).encode())

    def _holder(self) -> str:
        try:
            info = json.loads(self.path.read_text())
            return f"pid {info['pid']} on {info['host']} (started {info['started']}: {info['command']})"
        except (OSError, ValueError, KeyError):
            return "another process"

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
