"""Activation recomputation: keep less for backward, run parts of the forward again inside it.

Policies (``train.recompute``), applied from outside to the plain model (or to a pipeline
rank's stages) by replacing the ``forward`` of chosen module *instances* with a
``torch.utils.checkpoint`` (non-reentrant) call of the original; parameter names, hooks of
other strategies and the state dict are unchanged:

    none        nothing recomputed
    full        every transformer block checkpointed: only its input is kept
    selective   the attention core of every block (softmax(q kᵀ) v, dropout:
                :class:`~loom.model.llama.CoreAttention`) checkpointed (Korthikanti et al. 2022)
    every:k     the blocks of global index i ≡ 0 (mod k) checkpointed; the others keep everything

Bytes saved for backward per layer, with A the layer's full activation bytes (the formula of
:mod:`loom.memory.activations`), s sequence, b micro-batch, h = dim, e bytes per activation
element, t = tp with sequence parallelism else 1:

    none       A
    full       e·s·b·h / t                    (the block input, the only tensor kept)
    selective  A - Δ                          (:func:`selective_savings`: the core keeps its inputs
                                               q, k, v; it drops its log-sum-exp and, with
                                               dropout on the math kernel, the
                                               (a/n, s, s) score/mask/probability matrices)
    every:k    full for i ≡ 0 (mod k), A otherwise

so with L layers, full recomputation keeps L·e·s·b·h/t plus, during backward, one layer's
working set A (recomputed, then freed) — the "layer inputs plus one layer" of the textbook.
Cost: one extra forward of every recomputed region (≈ +33% of step FLOPs for ``full``, a few
percent for ``selective``); with tensor/sequence parallelism the recomputed forward also re-runs
its collectives (counted by the comm meter).

Correctness: RNG state (CPU and every CUDA device the inputs live on) is stashed at the
forward and restored for the recomputation (``preserve_rng_state``), so dropout masks are
identical and the gradients equal those of ``none`` exactly. Tensor-parallel collectives inside
a recomputed region run again in the same order on every tp rank. ZeRO-3 re-gathers a unit's
parameters before its backward (its pre-backward hook), i.e. before the recomputation needs them.

Accounting: a checkpoint keeps its inputs alive by reference, outside autograd's saved tensors;
an identity node (``_Hold``) saves them too, so saved-tensor hooks (the meter of
:mod:`loom.memory.activations`, the tracker of :mod:`loom.memory.compress`) see what is kept.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from loom.config import ConfigError, ModelConfig, parse_recompute
from loom.memory.activations import activation_bytes_per_layer

HELD_ATTR = "_loom_checkpoint_input"  # marks the alias _Hold saves: compression leaves it alone


class _Hold(torch.autograd.Function):
    """Identity; saves an alias of its input so saved-tensor hooks account for it (backward: identity)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        alias = x.detach()
        setattr(alias, HELD_ATTR, True)
        ctx.save_for_backward(alias)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _hold(a):
    if isinstance(a, torch.Tensor) and a.requires_grad and a.is_floating_point():
        return _Hold.apply(a)
    return a


def checkpointed(forward: Callable) -> Callable:
    """``forward`` run under a non-reentrant checkpoint when gradients are recorded."""

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        args = tuple(_hold(a) for a in args)
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    run.__wrapped__ = forward  # type: ignore[attr-defined]  # a function takes attributes; mypy's type has none
    return run


def _blocks(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(global layer index, block) for every transformer block, from names like ``layers.5`` or
    ``stages.0.layers.5`` (a pipeline rank's stages keep the reference names)."""
    from loom.model.llama import Block

    out: list[tuple[int, nn.Module]] = []
    for name, m in model.named_modules():
        if isinstance(m, Block):
            nums = re.findall(r"(?:^|\.)(\d+)(?=\.|$)", name)
            out.append((int(nums[-1]) if nums else len(out), m))
    return out


def _cores(model: nn.Module) -> list[nn.Module]:
    from loom.model.llama import CoreAttention

    return [m for m in model.modules() if isinstance(m, CoreAttention)]


def _wrap(module: nn.Module) -> None:
    if "forward" in module.__dict__:  # already wrapped: re-wrap the original
        module.forward = module.__dict__["forward"].__wrapped__
    module.forward = checkpointed(module.forward)


def remove_recompute(model: nn.Module) -> None:
    """Restore every wrapped module's own forward."""
    for m in model.modules():
        fwd = m.__dict__.get("forward")
        if fwd is not None and hasattr(fwd, "__wrapped__"):
            del m.forward


def apply_recompute(model: nn.Module, spec: str) -> list[nn.Module]:
    """Apply the policy ``spec`` (``train.recompute``) to ``model`` in place; return the wrapped
    modules. Raises ConfigError when the model has nothing the policy can wrap."""
    policy, k = parse_recompute(spec)
    remove_recompute(model)
    if policy == "none":
        return []
    if policy == "selective":
        targets = _cores(model)
        if not targets:
            raise ConfigError(
                f"train.recompute: 'selective' recomputes the attention core (CoreAttention modules), but "
                f"{type(model).__name__} has no attention; use full or every:<k>"
            )
    else:
        blocks = _blocks(model)
        if not blocks:
            raise ConfigError(
                f"train.recompute: {spec!r} checkpoints transformer blocks, but {type(model).__name__} has none"
            )
        targets = [b for i, b in blocks if policy == "full" or i % k == 0]
    for m in targets:
        _wrap(m)
    return targets


# ----------------------------------------------------------------------------- formulas


def selective_savings(cfg: ModelConfig, batch: int, seq: int, tp: int = 1, elem: int = 4) -> int:
    """Bytes per layer that ``selective`` frees on one tp rank (flash kernel, no dropout).

    The core's output is also the input of ``wo`` (same storage), so it stays, and its inputs
    q, k, v (k and v unrepeated: SDPA's ``enable_gqa``) are kept by the checkpoint. Freed: the
    fp32 log-sum-exp,

        Δ = 4·s·b·a/n

    With dropout on CPU, torch runs the math kernel, which also keeps the (a/n, s, s) softmax and
    dropout matrices, so selective frees the 2·e·b·(a/n)·s² of Korthikanti et al. as well (the
    flash and memory-efficient CUDA kernels keep only an RNG offset).
    """
    return 4 * seq * batch * (cfg.n_heads // tp)


def saved_bytes_per_layer(
    cfg: ModelConfig,
    spec: str,
    index: int,
    batch: int,
    seq: int,
    tp: int = 1,
    sp: bool = False,
    elem: int = 4,
) -> int:
    """Bytes layer ``index`` keeps for backward under policy ``spec`` (no dropout): the module
    docstring's table, with A from :func:`loom.memory.activations.activation_bytes_per_layer`."""
    policy, k = parse_recompute(spec)
    full_layer = activation_bytes_per_layer(cfg, batch, seq, tp, sp, elem)
    if policy == "full" or (policy == "every" and index % k == 0):
        return elem * seq * batch * cfg.dim // (tp if sp else 1)
    if policy == "selective":
        return full_layer - selective_savings(cfg, batch, seq, tp, elem)
    return full_layer
