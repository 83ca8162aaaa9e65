"""The Strategy protocol every parallel strategy implements, and the one gradient clipping.

A strategy owns the gradients and the update of the parameters it is applied to: data
parallelism (:mod:`loom.parallel.data.strategy`), ZeRO 1-3 (:mod:`loom.parallel.zero`), and
the pipeline around either (:mod:`loom.parallel.pipeline.strategy`). The training step
(:func:`loom.train.step.optimizer_step`) drives one update through this protocol only:

    finish_sync()  ->  any non-finite in grads()?  ->  clip_grad_norm()  ->  step(lr, grad_scale)

Clipping (one rule for every layout): norm = sqrt(grad_sq()), the global L2 norm with every
element counted once; coef = min(1, M / (norm + 1e-6)) for M = max_norm (in the units of the
held gradients: M / u when they hold the loss-scaled 1/u · g), and scale_grads(coef).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from loom import comm
from loom.checkpoint.protocol import ShardedTensor, ShardReader
from loom.comm import Group


class Strategy(Protocol):
    """What the training step needs from a strategy."""

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Inside: backward accumulates locally, no communication."""
        ...

    def finish_sync(self) -> None:
        """After the last backward: finish the gradient reduction, tensor-parallel partial sums included."""
        ...

    def zero_grad(self) -> None: ...

    def grads(self) -> list[torch.Tensor]:
        """The reduced gradient tensors this rank holds (whole, or its shards)."""
        ...

    def grad_sq(self) -> torch.Tensor:
        """Σ g² over the whole model's gradient, every element once: an fp32 scalar, equal on every rank."""
        ...

    def scale_grads(self, coef: torch.Tensor) -> None:
        """Multiply the held gradients by ``coef`` (an fp32 scalar tensor)."""
        ...

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """Update at learning rate ``lr`` with gradients read as ``grad_scale`` · held gradient."""
        ...

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds: ``param_bytes``, ``grad_bytes``, ``optim_bytes`` (and extras)."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The single-device ``state_dict`` of the module this strategy trains (a collective; None on
        the ranks that do not receive it: pipeline ranks other than the first)."""
        ...

    # the checkpoint pair (:class:`loom.checkpoint.protocol.Shardable`)
    def sharded_state(self) -> dict[str, ShardedTensor]:
        """Every tensor this rank holds (model and optimizer), by canonical global name."""
        ...

    def load_sharded(self, reader: ShardReader) -> None:
        """Overwrite this rank's state from ``reader`` (a checkpoint of any layout)."""
        ...

    # capabilities with defaults in :class:`StrategyBase`
    @property
    def comm_device(self) -> torch.device | None:
        """Where scalar collectives over the held gradients run (the norm, the overflow flag): None for
        the gradients' own device; set when they live elsewhere (host shards under offload)."""
        ...

    def param_grad_shard(self, p: torch.Tensor) -> torch.Tensor | None:
        """The part of ``p``'s reduced gradient this rank holds, flattened in shard order for a sharding
        strategy (possibly empty); the whole ``p.grad`` for a replicating one."""
        ...

    def param_grad_sq(self, p: torch.Tensor) -> torch.Tensor:
        """Σ g² over ``p``'s reduced gradient, every element once over the data-parallel ranks (a
        sharding strategy sums its shards' squares over the sharding group): an fp32 scalar."""
        ...

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        """Inside: every parameter whole on this rank (ZeRO-3 gathers its units; a collective)."""
        ...

    def row(self) -> dict[str, float]:
        """The strategy's own figures for the metrics row (parameter servers: staleness); may be empty."""
        ...

    def remove(self) -> None:
        """Remove the hooks this strategy installed on the module's parameters."""
        ...

    def close(self) -> None:
        """After the last step: release what lives outside this process (a parameter-server worker
        tells its servers it is done)."""
        ...


class StrategyBase:
    """The defaults of :class:`Strategy`'s optional capabilities, inherited by every strategy class: no
    separate device for collectives, whole gradients, parameters whole already, no figures of its own,
    no hooks, nothing to close."""

    comm_device: torch.device | None = None

    def param_grad_shard(self, p: torch.Tensor) -> torch.Tensor | None:
        return p.grad

    def param_grad_sq(self, p: torch.Tensor) -> torch.Tensor:
        return grad_norm_sq([p])

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def row(self) -> dict[str, float]:
        return {}

    def remove(self) -> None:
        pass

    def close(self) -> None:
        pass


def held_state_bytes(state: Mapping[str, float]) -> float:
    """Model-state bytes a rank keeps on its device between steps, from :meth:`Strategy.state_bytes`:
    parameters + gradients + optimizer state + a frozen base (LoRA), less what an offload store holds
    (``optim_offload_bytes``; parameter offload reports its shards apart already). What the planner's
    model-state prediction counts."""
    held = sum(state.get(k, 0) for k in ("param_bytes", "grad_bytes", "optim_bytes", "frozen_bytes"))
    return held - state.get("optim_offload_bytes", 0)


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


# elements per fp32 partial norm, and the most pieces of one call (a Python view each: the host cost of a
# step stays ~10 ms on an 8B model): the CPU's fp32 norm of one 8M-element tensor is 4e-4 off, so how a
# layout cut the gradients (whole parameters, flat ZeRO shards, tp slices) moved the norm and the clip;
# 16k-element pieces summed in fp64 hold it within 1e-7 (GPU reductions are exact to fp32 at any size)
NORM_PIECE, NORM_PIECES = 16384, 16384


def sum_sq(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """Σ x² as fp32 over ``tensors`` (half ones too), on their device (``device`` when there are none: a
    rank without any still joins the collective that sums it): fp32 norms of pieces of at most
    max(NORM_PIECE, N / NORM_PIECES) elements (N: all of them), their squares summed in fp64."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    piece = max(NORM_PIECE, -(-sum(t.numel() for t in tensors) // NORM_PIECES))
    pieces = [p for t in tensors for p in t.reshape(-1).split(piece)]
    norms = torch.stack(torch._foreach_norm(pieces, 2.0, dtype=torch.float32))
    return norms.double().pow(2).sum().float()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, a host tensor through pinned memory: a copy from pageable host memory to a
    GPU makes the host wait for the device's queue; a pinned one runs in order on its stream."""
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def grad_norm_sq(params: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """Σ g² in fp32 over the parameters' ``.grad`` (see :func:`sum_sq`)."""
    if device is None and len(params):
        device = params[0].device
    return sum_sq([p.grad for p in params if p.grad is not None], device)


def clip_grad_norm(strategy: Strategy, max_norm: float, unscale: float = 1.0) -> float:
    """The global gradient norm of ``unscale`` · held gradients; clip them to ``max_norm`` if > 0.

    The held gradients may carry a loss scale S = 1 / ``unscale`` (a power of two): their norm is
    S·‖g‖ and clipping them to S·M applies the coefficient min(1, M / ‖g‖) to the true gradient.
    """
    norm = strategy.grad_sq().sqrt()
    held = strategy.grads()
    if held and held[0].device != norm.device:  # shards in host memory: read the norm once, clip there
        norm = norm.cpu()  # (the coefficient on the device would cross back for every bucket)
    if max_norm > 0:
        coef = torch.clamp(max_norm / unscale / (norm + 1e-6), max=1.0)
        strategy.scale_grads(coef)
    return float(norm) * unscale


def scale_all(grads: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
    """``grads`` *= coef in place (one fused call)."""
    grads = [g for g in grads if g.numel()]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))


def any_nonfinite(
    grads: Sequence[torch.Tensor], device: torch.device | None = None, bound: float = math.inf
) -> bool:
    """True on every rank if any rank's ``grads`` hold an inf or NaN, or an element above ``bound`` in
    magnitude: one MAX all-reduce over WORLD, as every dimension (dp, tp, pp, ep) holds different
    gradient shards and all must agree. ``device``: where the flag crosses ranks (default: the
    gradients'; host shards under offload)."""
    device = device or (grads[0].device if grads else torch.device("cpu"))
    grads = [g for g in grads if g.numel()]
    flag = torch.zeros(1, device=device)
    if grads:
        amax = torch.stack(
            torch._foreach_norm(grads, float("inf"))
        )  # exact in the gradient's dtype; NaN propagates
        flag += to_device((~(amax <= bound)).any().float(), device)  # inf, NaN (never <=) or past the bound
    if dist.is_available() and dist.is_initialized():
        comm.all_reduce_max(flag, dist.group.WORLD)
    return bool(flag.item())


@dataclass
class StepResult:
    loss: float  # mean loss over the global batch
    grad_norm: float  # global gradient norm before clipping


Update = Callable[[], float]  # finish the sync, clip, step: returns the gradient norm
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def token_mean(losses: list[torch.Tensor], targets: list[torch.Tensor], group: Group) -> torch.Tensor:
    """The mean over every trained target (not -100) of ``losses`` (each a batch's mean over its
    ``targets``) on all ranks of ``group``: Σ loss_b c_b / Σ c_b (one unmetered all-reduce), so a
    held-out set of chat data weighs each answer token alike on any layout (0 when none is trained)."""
    device = losses[0].device if losses else torch.device("cpu")
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for loss, y in zip(losses, targets):
        c = (y != -100).sum().to(device=device, dtype=torch.float64)
        # a batch with no trained target (an eval pad, eval_batches) weighs 0 even if its mean is NaN
        sums += torch.stack([torch.where(c > 0, loss.double() * c, 0.0), c])
    if comm.group_size(group) > 1:
        comm.all_reduce(sums, group)
    return (sums[0] / sums[1].clamp(min=1)).float()


def mean_over(value: torch.Tensor, group: Group) -> torch.Tensor:
    """Average a scalar over ``group`` (unmetered: bookkeeping, not training traffic)."""
    n = comm.group_size(group)
    if n > 1:
        value = value.clone()
        comm.all_reduce(value, group)
        value /= n
    return value
