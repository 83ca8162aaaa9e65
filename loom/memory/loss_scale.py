"""Dynamic loss scaling for fp16, with the overflow decision agreed by every rank.

fp16 has 5 exponent bits: gradients of activations below 6·10⁻⁸ flush to zero in backward.
Multiplying the loss by S (a power of two) shifts every gradient up by log₂ S; the optimizer
multiplies the fp32 copy of each gradient by 1/S again (:mod:`loom.optim.flat`: the unscale is
folded into the fp32 conversion, never done in fp16).

One step (:class:`LossScaledStrategy` around the training Strategy):

1. backward of S·loss (:func:`training_loss_fn`: an identity on the loss value whose backward
   multiplies by S, so the logged loss stays unscaled), gradient reduction as usual;
2. overflow check: is any element of this rank's reduced gradients inf/NaN? The flag is
   all-reduced (MAX) over the WORLD group — every rank of every mesh dimension: dp, tp, pp each
   hold different gradient shards, and a step skipped on some ranks only would desynchronise the
   replicas or hang the next collective;
3. no overflow: clip with the norm of the *unscaled* gradients (the inner strategy computes the
   norm of the scaled ones, S·‖g‖, in fp32, and clips to S·max_norm: the same coefficient), then
   the update reads g/S in fp32;
   overflow: skip the update on every rank (weights and optimizer state untouched), count it;
4. scale update, with hysteresis h (Megatron's rule): an overflow decrements a tracker and
   halves S once it reaches 0 (S ≥ ``min_scale``); ``window`` consecutive clean steps double S
   and reset the tracker to h. A static scale (``train.loss_scale`` > 0) never changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd import Function

from loom import comm

SCALER_KEY = "train.loss_scaler"  # checkpoint name of the scaler state


class LossScaleDiverged(FloatingPointError):
    """More than ``train.max_skipped_steps`` fp16 steps in a row overflowed: the run diverged."""


class DynamicLossScaler:
    """The scale S and its update rule (module docstring, step 4). More than ``max_skipped``
    overflowing steps in a row (0 = no limit) raise :class:`LossScaleDiverged`: a diverged run
    would otherwise skip every step and still end as if it had trained."""

    def __init__(self, init: float = 2.0**16, window: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0, static: float = 0.0, max_skipped: int = 0) -> None:  # fmt: skip
        self.static = static > 0
        self.scale = static if self.static else init
        self.window, self.hysteresis, self.min_scale = window, hysteresis, min_scale
        self.good_steps = 0
        self.tracker = hysteresis
        self.skipped = 0
        self.max_skipped, self.in_a_row = max_skipped, 0

    @classmethod
    def from_config(cls, t) -> DynamicLossScaler:
        return cls(t.loss_scale_init, t.loss_scale_window, t.loss_scale_hysteresis, t.loss_scale_min, t.loss_scale,
                   t.max_skipped_steps)  # fmt: skip

    def update(self, overflow: bool) -> None:
        self.in_a_row = self.in_a_row + 1 if overflow else 0
        if self.max_skipped and self.in_a_row > self.max_skipped:
            raise LossScaleDiverged(
                f"train.max_skipped_steps: {self.in_a_row} fp16 steps in a row overflowed (loss scale now "
                f"{self.scale:g}, floor train.loss_scale_min = {self.min_scale:g}); the run diverged: lower train.lr, "
                "or train in bf16"
            )
        if overflow:
            self.skipped += 1
            self.good_steps = 0
            if self.static:
                return
            self.tracker -= 1
            if self.tracker <= 0:
                self.scale = max(self.scale / 2, self.min_scale)
            return
        self.good_steps += 1
        if not self.static and self.good_steps >= self.window:
            self.good_steps = 0
            self.tracker = self.hysteresis
            self.scale *= 2


class _ScaleGrad(Function):
    """Forward: identity. Backward: the incoming gradient times ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def local_grads(strategy) -> list[torch.Tensor]:
    """The gradient tensors this rank holds after the reduction, for any Loom strategy."""
    from loom.parallel.data_parallel import DataParallel
    from loom.parallel.zero.common import ShardedStrategy

    if isinstance(strategy, ShardedStrategy):
        return list(strategy.grad_shards)
    if isinstance(strategy, DataParallel):
        return [b.buffer for b in strategy.buckets]
    inner = getattr(strategy, "inner", None)
    if inner is None:
        raise TypeError(f"loss scaling: cannot find the gradients of {type(strategy).__name__}")
    return local_grads(inner)


def optimizer_of(strategy):
    """The flat-shard optimizer under ``strategy`` (it reads gradients times ``grad_scale``)."""
    optim = getattr(strategy, "optim", None)
    if optim is not None:
        return optim
    inner = getattr(strategy, "inner", None)
    if inner is None:
        raise TypeError(f"fp16 loss scaling needs Loom's master-weight optimizers, not {type(strategy).__name__}")
    return optimizer_of(inner)


def world_overflow(grads: list[torch.Tensor]) -> bool:
    """True on every rank if any rank's ``grads`` hold an inf or NaN (one MAX all-reduce over WORLD)."""
    device = grads[0].device if grads else torch.device("cpu")
    grads = [g for g in grads if g.numel()]
    flag = torch.zeros(1, device=device)
    if grads:
        amax = torch._foreach_norm(grads, float("inf"))  # exact in the gradient's dtype; NaN propagates
        flag += (~torch.isfinite(torch.stack(amax))).any().float()
    if dist.is_available() and dist.is_initialized():
        comm.all_reduce_max(flag, dist.group.WORLD)
    return bool(flag.item())


class LossScaledStrategy:
    """Wraps a training Strategy with fp16 loss scaling (module docstring). Everything else,
    attributes included, passes through to ``inner``."""

    def __init__(self, inner, scaler: DynamicLossScaler) -> None:
        self.inner = inner
        self.loss_scaler = scaler
        self.skipping = False  # this step is being skipped (read by FiniteGuard)
        optimizer_of(inner)  # fail now, not at the first step

    def __getattr__(self, name: str):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def no_sync(self):
        return self.inner.no_sync()

    def finish_sync(self) -> None:
        self.inner.finish_sync()

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Agree on overflow over WORLD; if none, clip the unscaled norm to ``max_norm`` and return it."""
        self.skipping = world_overflow(local_grads(self.inner))
        if self.skipping:
            return math.inf
        s = self.loss_scaler.scale
        return self.inner.clip_grad_norm(max_norm * s if max_norm > 0 else 0.0) / s

    def step(self, lr: float) -> None:
        """The update on unscaled gradients, or nothing on overflow; then the scale update."""
        if not self.skipping:
            optim = optimizer_of(self.inner)
            optim.grad_scale = 1.0 / self.loss_scaler.scale
            try:
                self.inner.step(lr)
            finally:
                optim.grad_scale = 1.0
        self.loss_scaler.update(self.skipping)

    def state_bytes(self) -> dict[str, int]:
        return self.inner.state_bytes()

    # ------------------------------------------------------------------ checkpoints (Shardable)
    def sharded_state(self):
        """The inner strategy's state plus ``train.loss_scaler`` = (scale, clean steps, hysteresis
        tracker, skipped steps), the same on every rank (each writes a share)."""
        from loom.checkpoint.protocol import ShardedTensor
        from loom.checkpoint.replicated import _rank_size, as_shardable

        out = as_shardable(self.inner).sharded_state()
        s = self.loss_scaler
        self._saved = torch.tensor([s.scale, s.good_steps, s.tracker, s.skipped], dtype=torch.float64)
        out[SCALER_KEY] = ShardedTensor.full(self._saved, _rank_size(dist.group.WORLD if dist.is_initialized() else None))
        return out

    def load_sharded(self, reader) -> None:
        """Restore the inner state, and the scaler when the checkpoint has one (an fp32/bf16 run's has not)."""
        from loom.checkpoint.protocol import ShardedTensor
        from loom.checkpoint.replicated import as_shardable

        as_shardable(self.inner).load_sharded(reader)
        if SCALER_KEY in reader.names():
            buf = torch.zeros(4, dtype=torch.float64)
            reader.fill({SCALER_KEY: ShardedTensor.full(buf)})
            s = self.loss_scaler
            s.scale, s.good_steps, s.tracker, s.skipped = float(buf[0]), int(buf[1]), int(buf[2]), int(buf[3])


def find_scaler(strategy) -> DynamicLossScaler | None:
    """The loss scaler in a chain of wrapping strategies, if any."""
    while strategy is not None:
        scaler = strategy.__dict__.get("loss_scaler") if hasattr(strategy, "__dict__") else None
        if scaler is not None:
            return scaler
        strategy = strategy.__dict__.get("inner") if hasattr(strategy, "__dict__") else None
    return None


def training_loss_fn(strategy, loss_fn: Callable) -> Callable:
    """``loss_fn`` whose backward is scaled by the current loss scale (unchanged without one)."""
    scaler = find_scaler(strategy)
    if scaler is None:
        return loss_fn

    def scaled(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(logits, targets)
        return _ScaleGrad.apply(loss, scaler.scale) if loss.requires_grad else loss

    return scaled


def apply_loss_scaling(strategy, cfg):
    """Step 6 of ``parallelize`` for fp16: wrap the final Strategy (see module docstring)."""
    if cfg.train.precision != "fp16":
        return strategy
    return LossScaledStrategy(strategy, DynamicLossScaler.from_config(cfg.train))


def scaler_stats(strategy) -> dict[str, float]:
    """``loss_scale`` and ``skipped_steps`` for the metrics row (empty without loss scaling)."""
    scaler = find_scaler(strategy)
    return {} if scaler is None else {"loss_scale": scaler.scale, "skipped_steps": scaler.skipped}
