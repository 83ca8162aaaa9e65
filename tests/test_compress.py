"""Activation compression by module kind: every module that saves attention or MLP activations declares
its ``activation_kind``, so ``train.compress = "mlp=fp8"`` reaches the experts of a mixture-of-experts model."""

from __future__ import annotations

import torch

from loom.config import COMPRESS_KINDS
from loom.memory.compress import SavedActivations, compressed_bytes
from tests.helpers import rank_micro_batches, tiny_model


def test_mlp_compression_reaches_the_experts():
    """``mlp=fp8`` on an MoE model compresses exactly the floating-point tensors the MoE layers save first
    (router probabilities, expert inputs and SwiGLU activations): n fp32 bytes stored as n/4 + 4."""
    from loom.model.llama import MoEFeedForward, build_model, loss_fn

    cfg = tiny_model(n_experts=4, top_k=2)
    model = build_model(cfg, 0)
    x, y = rank_micro_batches(0, 2, 2, 0, 1)[0]
    state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    inside = [False]
    first: dict[int, tuple[bool, int]] = {}  # storage -> (first saved inside an MoE layer, bytes)

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if t.is_floating_point() and ptr not in state:
            first.setdefault(ptr, (inside[0], t.untyped_storage().nbytes()))
        return t

    moes = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    hooks = [
        h
        for m in moes
        for h in (
            m.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)),
            m.register_forward_hook(lambda *_: inside.__setitem__(0, False)),
        )
    ]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(model(x), y)
    for h in hooks:
        h.remove()
    expert_bytes = [n for moe, n in first.values() if moe]
    tokens_routed = x.numel() * cfg.top_k
    # not vacuous: w1 x, silu(w1 x), w3 x and their product, for every routed token of every layer
    assert (
        len(moes) == cfg.n_layers
        and sum(expert_bytes) > cfg.n_layers * tokens_routed * 4 * cfg.resolved_ffn_dim() * 4
    )

    saved = SavedActivations(model, "mlp=fp8")
    with saved:
        loss = loss_fn(model(x), y)
    loss.backward()
    saved.remove()
    assert saved.raw == sum(expert_bytes)  # every tensor the experts saved, nothing else
    assert saved.packed == sum(compressed_bytes(n // 4, 4, "fp8") for n in expert_bytes)


def test_replacement_modules_keep_the_kind_of_what_they_replace():
    """Tensor and expert parallelism swap modules; the swapped-in classes save the same kind of tensors."""
    from loom.model.llama import Attention, FeedForward, MoEFeedForward, RMSNorm
    from loom.parallel.expert.parallelize import ExpertParallelMoE
    from loom.parallel.tensor.layers import ParallelAttention, ParallelFeedForward, SequenceParallelRMSNorm

    pairs = [
        (Attention, ParallelAttention),
        (FeedForward, ParallelFeedForward),
        (FeedForward, MoEFeedForward),
        (MoEFeedForward, ExpertParallelMoE),
        (RMSNorm, SequenceParallelRMSNorm),
    ]
    for plain, swapped in pairs:
        assert swapped.activation_kind == plain.activation_kind, swapped.__name__
    assert {Attention.activation_kind, FeedForward.activation_kind, RMSNorm.activation_kind} < set(
        COMPRESS_KINDS
    )
