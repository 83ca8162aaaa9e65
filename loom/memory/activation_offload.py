"""Activation offload: saved tensors to pinned host memory during forward, back in backward (GPU only).

Used by :class:`~loom.memory.compress.SavedActivations` (``train.offload_activations``). Each
saved tensor of at least ``min_bytes`` (after compression, if any) is copied device → pinned
host on a side stream, asynchronously, as soon as it is saved; the device copy is released
once that copy has completed (the side stream holds it until then: ``record_stream``). In
backward the tensor is copied host → device on the current stream, which then waits only for
that copy. Device bytes of saved activations drop to what is below ``min_bytes`` (plus copies
in flight); the host holds the rest:

    device ≈ Σ_{small} bytes + in-flight copies,    host = Σ_{offloaded} bytes

The cost is PCIe traffic, 2·(offloaded bytes) per step, hidden behind compute when the link
keeps up (≈ 25 GB/s per direction on PCIe 4 x16). On a CPU run there is no device memory to
save: :func:`make_offloader` refuses with a message naming the field.
"""

from __future__ import annotations

import torch

from loom.config import ConfigError


class HostOffloader:
    """Pinned-host copies of CUDA tensors on a dedicated stream."""

    def __init__(self, device: torch.device, min_bytes: int = 1 << 16) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ConfigError(
                "train.offload_activations: moves saved activations from GPU to pinned host memory; "
                f"this run's device is {device.type}, where they are in host memory already (set it to false)"
            )
        self.device = device
        self.min_bytes = min_bytes
        self.stream = torch.cuda.Stream(device)

    def accepts(self, t: torch.Tensor) -> bool:
        return t.is_cuda and t.numel() * t.element_size() >= self.min_bytes

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Start the device → host copy; the handle is (host tensor, copy-done event)."""
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # t is fully written
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # t's memory is reused only after this copy
            done = torch.cuda.Event()
            done.record(self.stream)
        return host, done

    def to_device(self, handle: tuple[torch.Tensor, torch.cuda.Event]) -> torch.Tensor:
        """The tensor on the device again (ordered on the current stream)."""
        host, done = handle
        done.synchronize()  # the pinned buffer holds the data
        return host.to(self.device, non_blocking=True)


def make_offloader(enabled: bool, device: torch.device) -> HostOffloader | None:
    """The offloader for ``train.offload_activations`` on ``device`` (refused on CPU), or None."""
    return HostOffloader(device) if enabled else None
