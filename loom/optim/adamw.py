"""AdamW on flat parameter shards: the math of ``torch.optim.AdamW(foreach=True)``, per element.

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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loom.comm import Group
from loom.optim.master import MasterWeights
from loom.optim.store import StateStore


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
    ) -> None:
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
