"""The gradient-synchronisation switch shared by data-parallel strategies (plain and ZeRO)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class SyncSwitch:
    """``sync_enabled`` and :meth:`no_sync`: gradient hooks check the flag; inside ``no_sync``
    (gradient accumulation) they communicate nothing and gradients accumulate locally."""

    sync_enabled: bool = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; no communication inside this context."""
        prev = self.sync_enabled
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = prev
