"""Dynamic loss scaling for fp16, with the overflow decision agreed by every rank.

fp16 has 5 exponent bits: gradients of activations below 6·10⁻⁸ flush to zero in backward.
Multiplying the loss by S (a power of two) shifts every gradient up by log₂ S; the optimizer
multiplies the fp32 copy of each gradient by 1/S again (:mod:`loom.optim.flat`: the unscale is
folded into the fp32 conversion, never done in fp16).

One step (the scaler is an argument of :func:`loom.train.step.optimizer_step`, not a wrapper):

1. backward of S·loss (:func:`training_loss_fn`: an identity on the loss value whose backward
   multiplies by S, S/n under n averaging ranks: below), gradient reduction as usual;
2. overflow check: is any element of this rank's reduced gradients inf/NaN (or past the bound
   below)? The flag is all-reduced (MAX) over the WORLD group
   (:func:`loom.parallel.base.any_nonfinite`) — every rank of every mesh dimension: dp, tp, pp
   each hold different gradient shards, and a step skipped on some ranks only would
   desynchronise the replicas or hang the next collective;
3. no overflow: clip with the norm of the *unscaled* gradients (the strategy computes the
   norm of the scaled ones, S·‖g‖, in fp32, and clips to S·max_norm: the same coefficient), then
   the update reads g/S in fp32 (g·n/S: below);
   overflow: skip the update on every rank (weights and optimizer state untouched), count it;
4. scale update, with hysteresis h (Megatron's rule): an overflow decrements a tracker and
   halves S once it reaches 0 (S ≥ ``min_scale``); ``window`` consecutive clean steps double S
   and reset the tracker to h. A static scale (``train.loss_scale`` > 0) never changes.

Under n = dp·cp ranks whose gradients are averaged, the backward runs at S/n (``backward_scale``):
each rank's fp16 activation and weight gradients then hold exactly the terms one process's hold for
the same samples (S·∇l_i / N over the global batch's N micro-batches), not n times them. The
average over ranks leaves G/n of one process's fp16 gradient G, so the update reads g·n/S
(``unscale``) and an overflow is an inf/NaN or |g| > 65504/n (``overflow_bound``: the sum one
process would have held in fp16 is past fp16's largest value). The steps skipped are then one
process's wherever its overflow is a micro-batch's or the step's sum (not an intermediate partial
sum of its accumulation that later cancels).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd import Function

from loom.checkpoint.protocol import ShardedTensor

SCALER_KEY = "train.loss_scaler"  # checkpoint name of the scaler state


class LossScaleDiverged(FloatingPointError):
    """More than ``train.max_skipped_steps`` fp16 steps in a row overflowed: the run diverged."""


class DynamicLossScaler:
    """The scale S and its update rule (module docstring, step 4). More than ``max_skipped``
    overflowing steps in a row (0 = no limit) raise :class:`LossScaleDiverged`: a diverged run
    would otherwise skip every step and still end as if it had trained."""

    def __init__(
        self,
        init: float = 2.0**16,
        window: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        static: float = 0.0,
        max_skipped: int = 0,
        ranks: int = 1,
    ) -> None:
        self.ranks = ranks  # n: the ranks whose gradients are averaged (dp·cp)
        self.static = static > 0
        self.scale = static if self.static else init
        self.window, self.hysteresis, self.min_scale = window, hysteresis, min_scale
        self.good_steps = 0
        self.tracker = hysteresis
        self.skipped = 0
        self.max_skipped, self.in_a_row = max_skipped, 0

    @classmethod
    def from_config(cls, t, ranks: int = 1) -> DynamicLossScaler:
        return cls(
            t.loss_scale_init,
            t.loss_scale_window,
            t.loss_scale_hysteresis,
            t.loss_scale_min,
            t.loss_scale,
            t.max_skipped_steps,
            ranks,
        )

    @property
    def backward_scale(self) -> float:
        """S/n: the factor of each rank's backward (module docstring)."""
        return self.scale / self.ranks

    @property
    def unscale(self) -> float:
        """n/S: the factor turning the averaged fp16 gradients into the true gradient."""
        return self.ranks / self.scale

    @property
    def overflow_bound(self) -> float:
        """65504/n: an averaged gradient above it is one process's fp16 sum overflowing."""
        return float(torch.finfo(torch.float16).max) / self.ranks

    # ------------------------------------------------------------------ checkpoints (Shardable)
    def sharded_state(self) -> dict[str, ShardedTensor]:
        """``train.loss_scaler`` = (scale, clean steps, hysteresis tracker, skipped steps), the same on
        every rank (each writes a share)."""
        self._saved = torch.tensor(
            [self.scale, self.good_steps, self.tracker, self.skipped], dtype=torch.float64
        )
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        return {SCALER_KEY: ShardedTensor.full(self._saved, (rank, world))}

    def load_sharded(self, reader) -> None:
        """Restore the scaler when the checkpoint has one (an fp32/bf16 run's has not)."""
        if SCALER_KEY not in reader.names():
            return
        buf = torch.zeros(4, dtype=torch.float64)
        reader.fill({SCALER_KEY: ShardedTensor.full(buf)})
        self.scale, self.good_steps, self.tracker, self.skipped = (
            float(buf[0]),
            int(buf[1]),
            int(buf[2]),
            int(buf[3]),
        )

    def update(self, overflow: bool) -> None:
        self.in_a_row = self.in_a_row + 1 if overflow else 0
        if self.max_skipped and self.in_a_row > self.max_skipped:
            if self.static:  # the scale itself overflows fp16: the learning rate is not the cause
                raise LossScaleDiverged(
                    f"train.loss_scale: the static scale {self.scale:g} made {self.in_a_row} fp16 steps in a row "
                    f"overflow (fp16's largest value is 65504); lower train.loss_scale, or set it to 0 for "
                    "dynamic scaling"
                )
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


def training_loss_fn(scaler: DynamicLossScaler | None, loss_fn: Callable) -> Callable:
    """``loss_fn`` whose backward is scaled by the current loss scale (unchanged without a scaler)."""
    if scaler is None:
        return loss_fn

    def scaled(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(logits, targets)
        return _ScaleGrad.apply(loss, scaler.backward_scale) if loss.requires_grad else loss

    return scaled


def scaler_for(train_cfg, ranks: int = 1) -> DynamicLossScaler | None:
    """The loss scaler of an fp16 run (None for fp32 and bf16); ``ranks``: dp·cp."""
    return DynamicLossScaler.from_config(train_cfg, ranks) if train_cfg.precision == "fp16" else None
