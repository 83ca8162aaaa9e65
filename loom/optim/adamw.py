"""AdamW on flat parameter shards: the math of ``torch.optim.AdamW``, per element.

Each rank updates only its shards. For a shard p with gradient g at step t (lr γ, decay λ):

    p ← p · (1 - γλ)                 on the elements of matrices only (ndim >= 2, per-element mask
                                      expressed as runs of the shard: ``FlatLayout.local_ranges``)
    m ← m + (1 - β1)(g - m)          (lerp, as torch)
    v ← β2 v + (1 - β2) g²
    p ← p - γ/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + ε)

State per shard element, in the :class:`~loom.optim.store.StateStore` (device, host or disk):
m and v, 8 bytes; plus a 4-byte fp32 master copy when the parameters are not fp32 on the
store's device (mixed precision, or parameters on a GPU with the state offloaded). Without a
master copy the fp32 parameter shard itself is updated in place.

Kernels: torch's fused AdamW (``torch._fused_adamw_``, one kernel over every shard: CPU, CUDA and
the other devices of :func:`fused_supported`) where the store's device has it, else the same
update as ``_foreach`` ops (six passes over the state). The decay runs (a mask no fused kernel
takes) are applied first by one ``_foreach_mul_``, exactly as AdamW's decoupled decay precedes
its Adam step; the fused kernel then runs with λ = 0. Both paths agree to fp32 rounding
(``tests/test_precision_speed.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loom.comm import Group
from loom.optim.master import MasterWeights
from loom.optim.store import StateStore


def fused_supported(device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    """Whether torch has a fused AdamW kernel for tensors of ``dtype`` on ``device``."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    floating = dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    return floating and torch.device(device).type in _get_fused_kernels_supported_devices()


class ShardedAdamW:
    """Decoupled-weight-decay Adam over a list of 1-D parameter shards (views of live parameters)."""

    def __init__(
        self,
        shards: Sequence[torch.Tensor],
        decay_ranges: Sequence[list[tuple[int, int]]],
        store: StateStore,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        fused: bool | None = None,
    ) -> None:
        """``fused``: None = the fused kernel where :func:`fused_supported`, False = ``_foreach`` ops."""
        self.params = list(shards)
        self.store = store
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay
        self.step_count = 0
        self.master = MasterWeights(shards, store)
        self.masters = self.master.masters
        self.exp_avgs = [store.zeros(p.numel(), f"exp_avg{i}") for i, p in enumerate(self.params)]
        self.exp_avg_sqs = [store.zeros(p.numel(), f"exp_avg_sq{i}") for i, p in enumerate(self.params)]
        self._decayed = [m[lo:hi] for m, runs in zip(self.masters, decay_ranges) for lo, hi in runs]
        self.fused = fused_supported(store.device) if fused is None else fused
        self._step_t = torch.zeros((), dtype=torch.float32, device=store.device)  # the fused kernel's t

    @property
    def state_bytes(self) -> int:
        """Adam moments (8 bytes per shard element) plus separate fp32 masters, wherever they live."""
        return self.store.nbytes

    @torch.no_grad()
    def step(self, grads: Sequence[torch.Tensor], lr: float, grad_scale: float = 1.0) -> None:
        """One AdamW update of every shard from ``grad_scale`` · its reduced gradient shard ``grads[i]``."""
        if not self.params:
            return
        g = self.master.grads32(grads, grad_scale)
        self.step_count += 1
        if self.weight_decay != 0 and self._decayed:
            torch._foreach_mul_(self._decayed, 1 - lr * self.weight_decay)
        if self.fused:
            self._step_t.fill_(self.step_count)
            torch._fused_adamw_(
                self.masters,
                g,
                self.exp_avgs,
                self.exp_avg_sqs,
                [],
                [self._step_t] * len(self.masters),
                lr=lr,
                beta1=self.beta1,
                beta2=self.beta2,
                weight_decay=0.0,
                eps=self.eps,
                amsgrad=False,
                maximize=False,
            )
            del g
            self.master.publish()
            return
        torch._foreach_lerp_(self.exp_avgs, g, 1 - self.beta1)
        torch._foreach_mul_(self.exp_avg_sqs, self.beta2)
        torch._foreach_addcmul_(self.exp_avg_sqs, g, g, 1 - self.beta2)
        del g
        bias1 = 1 - self.beta1**self.step_count
        bias2_sqrt = (1 - self.beta2**self.step_count) ** 0.5
        denom = torch._foreach_sqrt(self.exp_avg_sqs)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(self.masters, self.exp_avgs, denom, (lr / bias1) * -1)
        self.master.publish()

    def bind_groups(self, shard_group: Group, tp_group: Group) -> None:
        """AdamW is element-wise: no statistics cross shards."""
