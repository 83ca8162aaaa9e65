"""Session-wide fixtures: shared multi-rank worker pools (see tests/dist.py)."""

from __future__ import annotations

import pytest

from tests.dist import WorkerPool


class Pools:
    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def __call__(self, world: int) -> WorkerPool:
        if world not in self._pools:
            self._pools[world] = WorkerPool(world)
        return self._pools[world]

    def close(self) -> None:
        for p in self._pools.values():
            p.close()


@pytest.fixture(scope="session")
def pools():
    """``pools(n)`` -> a WorkerPool of n gloo ranks, started on first use and shared."""
    p = Pools()
    yield p
    p.close()
