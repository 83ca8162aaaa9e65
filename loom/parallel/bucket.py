"""Gradient buckets: which parameters share a flat buffer, and in which order buffers launch.

Buckets are runs of parameters in *reverse* registration order (roughly the order backward
produces their gradients), each up to ``bucket_mb`` and of one dtype, device and reduction group
(as DDP's). A bucket is *ready* when its last gradient of the step has been accumulated; each
reduction group launches its buckets in index order, a ready bucket waiting for its
predecessors, so every rank issues a group's collectives in the same order (as NCCL requires)
even when ranks complete buckets in different orders (an expert that received no tokens here).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

from torch import nn

from loom.parallel.placement import expert_group

B = TypeVar("B")


def split_buckets(
    params: Sequence[nn.Parameter], cap_bytes: int, alone: frozenset[int] = frozenset()
) -> list[list[nn.Parameter]]:
    """Runs of parameters in *reverse* registration order (roughly the order backward produces
    their gradients), each up to ``cap_bytes`` and of one dtype and device (as the DDP buckets);
    parameters whose id is in ``alone`` get a bucket of their own."""
    groups: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in reversed(params):
        nb = p.numel() * p.element_size()
        if current and (
            size + nb > cap_bytes
            or p.dtype != current[0].dtype
            or p.device != current[0].device
            or id(p) in alone
            or id(current[0]) in alone
            or expert_group(p) is not expert_group(current[0])
        ):
            groups.append(current)
            current, size = [], 0
        current.append(p)
        size += nb
    if current:
        groups.append(current)
    return groups


class BucketQueue(Generic[B]):
    """Launch order of ``buckets``: per reduction group (``group_of``), in index order once ready."""

    def __init__(
        self,
        buckets: Sequence[B],
        sizes: Sequence[int],
        group_of: Callable[[B], Hashable],
        launch: Callable[[B], None],
    ) -> None:
        self.buckets, self.sizes, self.launch = list(buckets), list(sizes), launch
        self.groups = [group_of(b) for b in self.buckets]
        self.reset()

    def reset(self) -> None:
        """A new step: every gradient pending, nothing launched."""
        self.pending = list(self.sizes)
        self.ready = [False] * len(self.buckets)
        self.launched = [False] * len(self.buckets)

    def grad_ready(self, i: int) -> None:
        """One more gradient of bucket ``i`` accumulated; launch what the order allows."""
        self.pending[i] -= 1
        if self.pending[i]:
            return
        self.ready[i] = True
        for j, g in enumerate(self.groups):  # this group's buckets in index order, up to the first not ready
            if g == self.groups[i] and not self.launched[j]:
                if not self.ready[j]:
                    break
                self._launch(j)

    def launch_rest(self) -> None:
        """Launch every bucket not launched yet (unused parameters; everything when hooks were off)."""
        for j in range(len(self.buckets)):
            if not self.launched[j]:
                self._launch(j)

    def _launch(self, j: int) -> None:
        self.launched[j] = True
        self.launch(self.buckets[j])
