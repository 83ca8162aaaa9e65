"""Warnings about inputs that Loom's launcher checks before it starts the ranks.

The launcher reads the prepared data and the checkpoint to resume before any rank starts, and each
rank reads them again: a warning about them (:data:`LAUNCHER_SAYS` on the record) is the launcher's
to print once; in a rank it started (:data:`UNDER_LOOM_LAUNCHER` in the environment) the record is
dropped (:func:`drop_launcher_notes`). Under torchrun or srun no launcher spoke: rank 0 prints it.
"""

from __future__ import annotations

import logging
import os

UNDER_LOOM_LAUNCHER = "LOOM_LAUNCHER"  # set by loom.launch in the environment its ranks inherit
LAUNCHER_SAYS = {"launcher_says": True}  # ``extra`` of a warning the launcher has printed already


class _DropLauncherNotes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "launcher_says", False)


def drop_launcher_notes(handler: logging.Handler) -> None:
    """In a rank of Loom's launcher, ``handler`` leaves out the warnings the launcher printed."""
    if os.environ.get(UNDER_LOOM_LAUNCHER) == "1":
        handler.addFilter(_DropLauncherNotes())
