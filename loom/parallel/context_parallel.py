"""Context parallelism: each sequence split over the ``cp`` ranks, attention over all of it.

Tokens. A sequence of T tokens is cut into 2·cp chunks of T/(2cp); cp rank r keeps chunks r and
2cp-1-r, in that order (:func:`local_positions`). Under the causal mask an early chunk attends to
few keys and a late one to many; pairing them gives every rank the same attention work (the
load-balanced layout of Megatron-LM's context parallelism). Embedding, norms, MLP, output head
and loss are token-local and run on the T/cp local tokens unchanged. Rotary embeddings need the
global positions: the model's ``rope_cos``/``rope_sin`` tables are replaced by their rows at
the local positions, so ``apply_rope``'s ``cos[:T/cp]`` reads exactly those.

Attention, all-gather based (as Llama 3 trains long context, Dubey et al. 2024, §3.3.2): each
attention core all-gathers the keys and values (B, k, T/cp, d) of the cp group before it runs
(rank-major order, which softmax does not care about), and masks by global position:
query i sees key j iff pos(j) <= pos(i). Backward reduce-scatters dK and dV. Per layer and
micro-batch, with b bytes per element and k·d = the key/value width (per tp rank):

    forward   all-gather of K and V:   2 · B·(T/cp)·k·d·b · (cp-1)  bytes sent per rank
    backward  reduce-scatter of dK, dV: the same

(and again in a recomputed forward). The gathered keys and values, repeated to the query heads,
are what the attention saves for backward: 2·B·T·h·b per layer and rank where a ring would keep
2·B·(T/cp)·h·b (:func:`loom.memory.activations.activation_bytes_per_layer` with ``cp``); the
additive causal mask (T/cp, T) is one buffer shared by every layer.

Gradients. Every parameter is replicated over cp, and each rank's loss is the mean over its
T/cp tokens. The data-parallel reduction therefore runs over dp·cp ranks (ZeRO shards over
dp_shard·cp), and its average is the mean over all tokens, because every rank holds as many.
The result equals one process on the whole sequence. Dropout is not supported with cp > 1
(config validation): its masks would need a cp-private stream.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from loom.comm import CommMeter, Group
from loom.model.llama import CoreAttention
from loom.parallel.tp_comm import gather_seq

__all__ = ["ContextParallelCore", "apply_context_parallel", "cp_comm_bytes", "local_positions", "shard_sequence"]


def local_positions(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions of cp rank ``rank``'s tokens: chunks r and 2cp-1-r of 2cp, in order."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp}")
    c = seq_len // (2 * cp)
    first, second = (rank * c, (rank + 1) * c), ((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)
    return torch.cat([torch.arange(*first, device=device), torch.arange(*second, device=device)])


def shard_sequence(batches, cp: int, rank: int):
    """This cp rank's tokens of each (tokens, targets) micro-batch: columns at :func:`local_positions`."""
    if cp == 1:
        return batches
    out = []
    for x, y in batches:
        idx = local_positions(x.shape[1], cp, rank).to(x.device)
        out.append((x.index_select(1, idx), y.index_select(1, idx)))
    return out


class ContextParallelCore(nn.Module):
    """:class:`~loom.model.llama.CoreAttention` over the whole sequence of the cp group: local
    queries (B, a, T/cp, d), keys and values all-gathered, causal mask by global position."""

    mask: torch.Tensor  # a registered buffer (non-persistent)

    def __init__(self, mask: torch.Tensor, group: Group, meter: CommMeter | None = None) -> None:
        super().__init__()
        self.group, self.meter = group, meter
        self.register_buffer("mask", mask, persistent=False)  # one tensor shared by every layer

    @staticmethod
    def causal_mask(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Additive mask (T/cp, T), 0 where query i may see key j (pos(j) <= pos(i)), -inf elsewhere;
        keys in the order of the all-gather (rank-major)."""
        q_pos = local_positions(seq_len, cp, rank, device)
        k_pos = torch.cat([local_positions(seq_len, cp, r, device) for r in range(cp)])
        mask = torch.zeros(len(q_pos), seq_len, device=device)
        return mask.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # (B, k, T/cp, d) -> (B, k, T, d): gather along the sequence (dim 2, via the batch-first helper)
        k = gather_seq(k.transpose(1, 2), self.group, self.meter).transpose(1, 2)
        v = gather_seq(v.transpose(1, 2), self.group, self.meter).transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        mask = self.mask if self.mask.dtype == q.dtype else self.mask.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, a, T/cp, d)


def apply_context_parallel(model: nn.Module, mesh, cfg, meter: CommMeter | None = None) -> None:
    """Swap every attention core for :class:`ContextParallelCore` and the rotary tables for the rows
    of this rank's positions (in place; before the pipeline split, so stages share them)."""
    cp, rank, group = mesh.size("cp"), mesh.local_rank("cp"), mesh.group("cp")
    if cp == 1:
        return
    positions = local_positions(cfg.data.seq_len, cp, rank)
    rope_cos, rope_sin = cast(torch.Tensor, model.rope_cos), cast(torch.Tensor, model.rope_sin)  # buffers
    mask = ContextParallelCore.causal_mask(cfg.data.seq_len, cp, rank, rope_cos.device)
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, CoreAttention):
                setattr(module, name, ContextParallelCore(mask, group, meter))
    model.rope_cos = rope_cos[positions.to(rope_cos.device)]
    model.rope_sin = rope_sin[positions.to(rope_sin.device)]


def cp_comm_bytes(batch: int, seq_len: int, kv_width: int, n_layers: int, cp: int, elem: int,
                  micro_batches: int = 1, recompute: bool = False) -> int:  # fmt: skip
    """Bytes one rank sends per step for context parallelism (module formula): per layer and
    micro-batch, all-gathers of K and V forward and reduce-scatters of dK and dV backward, each
    B·(T/cp)·kv_width·b·(cp-1); the forward's again under full recomputation."""
    per = 2 * batch * (seq_len // cp) * kv_width * elem * (cp - 1)
    passes = 3 if recompute else 2
    return per * passes * n_layers * micro_batches
