"""fp32 master weights for flat parameter shards, and the loss-scale unscale folded into the fp32 gradient.

Where a shard is not fp32 on the state store's device (half precision, or state offloaded), the
optimizer keeps an fp32 master copy (4 bytes per element), updates it and copies the result back
into the parameter shard; an fp32 shard on the store's device is its own master. Gradients are
read as g = float32(grad) · ``grad_scale``: an fp16 gradient holding S·∇ is unscaled in fp32, so no
small gradient is flushed to zero by a division in half precision.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loom import comm
from loom.optim.store import StateStore


class MasterWeights:
    """fp32 masters for shards that need one (half precision, or state on another device)."""

    def __init__(self, shards: Sequence[torch.Tensor], store: StateStore) -> None:
        self.params = list(shards)
        self.store = store
        self.masters: list[torch.Tensor] = []
        for i, p in enumerate(self.params):
            if p.dtype == torch.float32 and p.device == store.device:
                self.masters.append(p)  # the fp32 shard is its own master
            else:
                m = store.zeros(p.numel(), f"master{i}")
                m.copy_(p.detach())
                self.masters.append(m)

    def grads32(self, grads: Sequence[torch.Tensor], scale: float) -> list[torch.Tensor]:
        """fp32 gradients on the store's device, multiplied by ``scale`` (a copy when scaled or cast).

        A device gradient bound for host state (offload) is cast and scaled on its device, then
        copied without blocking into pinned host memory (pageable where there is no CUDA); the host
        waits once, on the event after the last copy, before the update reads them."""
        dev = self.store.device
        out = []
        crossed = None
        for g in grads:
            if g.device == dev and g.dtype == torch.float32 and scale == 1.0:
                out.append(g)
            elif g.device == dev:
                g32 = g.to(dev, torch.float32, copy=True)
                out.append(g32.mul_(scale) if scale != 1.0 else g32)
            else:
                g32 = g.to(torch.float32, copy=True)
                g32 = g32.mul_(scale) if scale != 1.0 else g32
                pin = g.device.type == "cuda" and torch.cuda.is_available()
                host = torch.empty(g.shape, dtype=torch.float32, device=dev, pin_memory=pin)
                host.copy_(g32, non_blocking=pin)
                out.append(comm.mark_host(host, "optimizer's fp32 gradient copy"))
                crossed = g.device if pin else crossed
        if crossed is not None:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(crossed))
            done.synchronize()
        return out

    @torch.no_grad()
    def publish(self) -> None:
        """Copy updated masters into the parameter shards."""
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m, non_blocking=True)
