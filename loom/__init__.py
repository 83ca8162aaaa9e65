"""Loom: training and fine-tuning transformer language models across many devices."""

import multiprocessing.process as _process
import os as _os
import signal as _signal


def _quiet_while_bootstrapping(signum: int, frame: object) -> None:
    """SIGINT in a process multiprocessing's spawn is starting: 128 + SIGINT, quietly, while it still
    unpickles its target (``_inheriting``); Python's KeyboardInterrupt once it runs."""
    if getattr(_process.current_process(), "_inheriting", False):
        _os._exit(128 + signum)
    _signal.default_int_handler(signum, frame)  # type: ignore[arg-type]


if getattr(_process.current_process(), "_inheriting", False):
    # a rank of `loom train --nproc N` imports the launcher's main module (the `loom` script: this
    # package) before unpickling its target, which imports torch: a Ctrl-C there printed a
    # KeyboardInterrupt traceback per rank before the launcher's one line
    _signal.signal(_signal.SIGINT, _quiet_while_bootstrapping)
