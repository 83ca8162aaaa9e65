"""Loom: training and fine-tuning transformer language models across many devices."""

import multiprocessing.process as _process
import os as _os
import signal as _signal

if getattr(_process.current_process(), "_inheriting", False):
    # a rank that `loom train --nproc N` starts through multiprocessing's spawn imports the launcher's
    # main module (the `loom` script: this package) before torch and any of Loom's code: a Ctrl-C there
    # ends it quietly with 128 + SIGINT, not a KeyboardInterrupt traceback per rank (the launcher prints
    # the one line); the rank restores Python's handler as its code starts (loom.launch.rank)
    _signal.signal(_signal.SIGINT, lambda *_: _os._exit(128 + _signal.SIGINT))
