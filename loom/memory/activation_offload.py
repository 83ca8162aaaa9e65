"""Activation offload: saved tensors to pinned host memory during forward, back in backward (GPU only).

Used by :class:`~loom.memory.compress.SavedActivations` (``train.offload_activations``). Each
saved tensor of at least ``min_bytes`` (after compression, if any) is copied device → pinned
host on a side stream, asynchronously, as soon as it is saved; the device copy is released
once that copy has completed (the side stream holds it until then: ``record_stream``).

Backward unpacks the saved tensors in about the reverse of the order they were saved (a node
reads its own few in its own order). When one is unpacked, the ``depth`` (3) saved before it that
are still to be unpacked are *prefetched*: copied host → device on a second side stream, which
first waits on the GPU (not the host) for their device → host copies. At its own unpack the
current stream waits only for that prefetch's event, so the copy overlaps the compute in
between; a tensor unpacked without a prefetch (the first of a backward) is copied on the current
stream; one unpacked again within the next 2·depth unpacks (the same storage saved by several ops)
reuses that copy.
The host never waits. Device bytes of saved activations drop to what is below ``min_bytes``, plus
copies in flight, ``depth`` prefetched tensors and 2·depth recently unpacked ones (most of them
held by autograd anyway); the host holds the rest:

    device ≈ Σ_{small} bytes + in-flight copies + 3·depth tensors,    host = Σ_{offloaded} bytes

The cost is PCIe traffic, 2·(offloaded bytes) per step, hidden behind compute when the link
keeps up (≈ 25 GB/s per direction on PCIe 4 x16). On a CPU run there is no device memory to
save: :func:`make_offloader` refuses with a message naming the field (the offloader itself runs
on the CPU, copies synchronous and no streams, so its bookkeeping is tested there).
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import torch

from loom import comm
from loom.config import ConfigError

PREFETCH_DEPTH = 3  # saved tensors kept prefetched ahead of backward (an attention node reads q, k, v)


class OffloadHandle:
    """One offloaded tensor: its host copy, the event its device → host copy records, the handle
    saved before it (what to prefetch next) and the prefetched device copy, if any."""

    __slots__ = ("host", "done", "prev", "prefetched", "unpacked", "on_device", "__weakref__")

    def __init__(self, host: torch.Tensor, done: Any, prev: OffloadHandle | None) -> None:
        self.host, self.done = host, done
        self.prev = weakref.ref(prev) if prev is not None else None
        self.prefetched: tuple[torch.Tensor, Any] | None = None  # (device tensor, ready event)
        self.unpacked = 0
        self.on_device: torch.Tensor | None = None  # the unpacked copy, while among the recent ones


class HostOffloader:
    """Host copies of device tensors: device → host on one side stream, prefetch back on another."""

    def __init__(self, device: torch.device, min_bytes: int = 1 << 16, depth: int = PREFETCH_DEPTH) -> None:
        self.device = torch.device(device)
        self.min_bytes = min_bytes
        self.depth = depth
        cuda = self.device.type == "cuda"
        self.pin = cuda and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(self.device) if self.pin else None  # device -> host
        self.fetch_stream = torch.cuda.Stream(self.device) if self.pin else None  # host -> device
        self._last: weakref.ref[OffloadHandle] | None = None  # the handle saved last
        self.prefetch_hits = 0  # unpacks served by a prefetch (for tests and metrics)
        self.demand = 0  # unpacks copied on the current stream
        self.reused = 0  # unpacks served by the copy a recent unpack made
        self._recent: deque[weakref.ref[OffloadHandle]] = deque()  # the last 2·depth unpacked

    def accepts(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device.type and t.numel() * t.element_size() >= self.min_bytes

    def to_host(self, t: torch.Tensor) -> OffloadHandle:
        """Start the device → host copy of ``t``; returns its handle."""
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
        comm.mark_host(host, "activation offload's pinned buffer")
        done = None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # t is fully written
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
                t.record_stream(self.stream)  # t's memory is reused only after this copy
                done = torch.cuda.Event()
                done.record(self.stream)
        else:
            host.copy_(t)
        prev = self._last() if self._last is not None else None
        handle = OffloadHandle(host, done, prev)
        self._last = weakref.ref(handle)
        return handle

    def _copy_in(self, h: OffloadHandle, stream: Any) -> torch.Tensor:
        """``h``'s tensor on the device, copied on ``stream`` (None: the CPU, synchronously)."""
        if stream is None:
            return h.host.to(self.device, copy=True)
        stream.wait_event(h.done)  # the host buffer is filled (a wait on the GPU, not the host)
        with torch.cuda.stream(stream):
            return h.host.to(self.device, non_blocking=True)

    def _prefetch(self, h: OffloadHandle) -> None:
        stream = self.fetch_stream
        t = self._copy_in(h, stream)
        ready = None
        if stream is not None:
            ready = torch.cuda.Event()
            ready.record(stream)
        h.prefetched = (t, ready)

    def to_device(self, h: OffloadHandle) -> torch.Tensor:
        """The tensor on the device again, ordered on the current stream (prefetched, reused, or
        copied now); starts the prefetch of the next ``depth`` to be unpacked."""
        if h.on_device is not None:  # unpacked again soon (the same storage saved by several ops)
            self.reused += 1
            return h.on_device
        current = torch.cuda.current_stream(self.device) if self.pin else None
        if h.prefetched is not None:
            t, ready = h.prefetched
            h.prefetched = None
            if current is not None:
                current.wait_event(ready)
                t.record_stream(current)  # allocated on the fetch stream, used (and freed) on this one
            self.prefetch_hits += 1
        else:
            t = self._copy_in(h, current)
            self.demand += 1
        h.unpacked += 1
        h.on_device = t
        self._recent.append(weakref.ref(h))  # (a handle dies with the graph's last use of it)
        if len(self._recent) > 2 * self.depth and (old := self._recent.popleft()()) is not None:
            old.on_device = None  # the copy is left to autograd's references
        ahead, steps, prev = 0, 0, h.prev() if h.prev is not None else None
        while prev is not None and ahead < self.depth and steps < 4 * self.depth:  # the next ``depth``
            steps += 1  # still to be unpacked, looked for among the few saved before
            if prev.unpacked == 0:
                ahead += 1
                if prev.prefetched is None:
                    self._prefetch(prev)
            prev = prev.prev() if prev.prev is not None else None
        return t


def make_offloader(enabled: bool, device: torch.device) -> HostOffloader | None:
    """The offloader for ``train.offload_activations`` on ``device`` (refused on CPU), or None."""
    if not enabled:
        return None
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError(
            "train.offload_activations: moves saved activations from GPU to pinned host memory; "
            f"this run's device is {device.type}, where they are in host memory already (set it to false)"
        )
    return HostOffloader(device)
