"""What preparing data tells the user from the launcher process (``loom prepare``, ``loom train``).

Ranks configure their own logging (:func:`loom.train.metrics.setup_logging`, ``[rank r]`` lines);
the process that prepares the data before any rank starts configures none, so Python shows only
its warnings (``logging.lastResort``: the bare message on stderr) and drops the INFO lines of
:mod:`loom.data` (a chat corpus's truncated and dropped examples, each source's token count).
:func:`launcher_lines` shows those too while a command runs, as the same bare lines, and leaves
everything else as it was: warnings of every module still reach stderr once, and nothing is
shown by it once the root logger has handlers (a rank's own logging, or an application's).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

# ``extra=`` of a line that rank 0 logs again when it loads the prepared data (``loom train``'s
# launcher leaves it to the rank: shown once)
REPEATED_BY_RANKS = {"repeated_by_ranks": True}
_DATA_DIR = Path(__file__).resolve().parent


class _LauncherLines(logging.Handler):
    """The bare message on stderr (as ``logging.lastResort``) of Loom's warnings, and of the INFO lines
    of :mod:`loom.data` (but those marked :data:`REPEATED_BY_RANKS` when ``ranks_repeat``), while the
    root logger has no handlers."""

    def __init__(self, own_level: int, ranks_repeat: bool) -> None:
        super().__init__(logging.INFO)
        self.own_level, self.ranks_repeat = own_level, ranks_repeat
        self.setFormatter(logging.Formatter("%(message)s"))

    def before(self) -> int:
        """The level the "loom" logger had without this handler."""
        return self.own_level or logging.root.level

    def shows(self, record: logging.LogRecord) -> bool:
        if logging.root.handlers:
            return False
        if record.levelno >= logging.WARNING:
            return True
        return (
            record.levelno >= logging.INFO
            and Path(record.pathname).resolve().parent == _DATA_DIR
            and not (self.ranks_repeat and getattr(record, "repeated_by_ranks", False))
        )

    def keeps(self, record: logging.LogRecord) -> bool:
        """Logger filter: a record the logger would have dropped at its own level goes no further
        (to the root's handlers) unless this handler shows it."""
        return record.levelno >= self.before() or self.shows(record)

    def filter(self, record: logging.LogRecord) -> bool:  # type: ignore[override]
        return self.shows(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def launcher_lines(active: bool = True, ranks_repeat: bool = False) -> Iterator[None]:
    """While the block runs, :mod:`loom.data`'s INFO lines reach stderr (see the module doc);
    ``ranks_repeat``: ranks started in the block log the lines marked :data:`REPEATED_BY_RANKS`
    themselves. Everything is as before once it ends (nothing is left in this process to a rank
    started by fork, or to the next command of a test)."""
    if not active:
        yield
        return
    logger = logging.getLogger("loom")
    handler = _LauncherLines(logger.level, ranks_repeat)
    logger.addHandler(handler)
    logger.addFilter(handler.keeps)
    logger.setLevel(min(handler.before(), logging.INFO))
    try:
        yield
    finally:
        logger.setLevel(handler.own_level)
        logger.removeFilter(handler.keeps)
        logger.removeHandler(handler)
