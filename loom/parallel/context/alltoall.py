"""All-to-all context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023).

Around the attention core, q, k and v are exchanged from sequence-sharded (B, heads, T/cp, d) to
head-sharded (B, heads/cp, T, d) by one all-to-all each; every rank then runs ordinary causal
attention over the whole sequence for its heads (:func:`loom.model.llama.attention`, the one
process's own, with its scale, soft-cap and sliding window: one flash call, no mask, when uncapped and
unwindowed), and one all-to-all
takes the output back to sequence-sharded. The gathered sequence arrives rank-major (rank j's two
chunks at rows 2cj .. 2c(j+1)); it is permuted into position order before the core and back after.

Query heads (per tp rank) must divide by cp. Key/value heads k that do not are repeated first by
f = cp / gcd(k, cp), so that cp divides k·f = lcm(k, cp) and each rank's a/cp query heads find
their (k·f)/cp key/value heads on the same rank (a divides by lcm(k, cp) since k | a and cp | a).

Saved for backward per layer: the core's q, k (·f), v (·f), output and log-sum-exp for the whole
sequence but 1/cp of the heads, as many elements as T/cp tokens of all heads; the core's output
is a tensor of its own beside the projection's input (the all-to-all's result). Bytes sent per rank,
per layer and micro-batch (an all-to-all keeps 1/cp of its input), with e bytes per element,
n = B·(T/cp)·d and k' = k·f key/value heads (per tp rank):

    forward    (2·a + 2·k') · n · e · (cp − 1)/cp       (q, k, v in; the output back)
    backward   the same                                 (their gradients, the other way)

plus, with packed documents, the all-gather of the document ids, B·(T/cp)·8·(cp − 1), and a
dense (B, 1, T, T) additive document mask per core (not O(T/cp): use ring for long packed sequences).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.autograd import Function

from loom import comm
from loom.comm import CommMeter, Group
from loom.model.llama import attention
from loom.parallel.context.blocks import CpCore, doc_mask, global_docs, local_positions


def kv_repeat(kv_heads: int, cp: int) -> int:
    """The factor f key/value heads are repeated by before the exchange (module doc)."""
    return cp // math.gcd(kv_heads, cp)


def _all_to_all(x: torch.Tensor, group: Group, meter: CommMeter | None) -> torch.Tensor:
    """(cp, ...) -> (cp, ...): slice i to rank i, slice j of the result from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if meter is not None:
        meter.record("all_to_all", x.numel() * x.element_size() * (x.shape[0] - 1) // x.shape[0], 2)
    comm.check_tensors("all_to_all", group, out, x)
    dist.all_to_all_single(out, x, group=group)
    return out


def rank_major_positions(seq_len: int, cp: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Position of each row of the rank-major gathered sequence (rank j's local positions, j = 0..cp-1)."""
    return torch.cat([local_positions(seq_len, cp, j, device) for j in range(cp)])


def seq_to_heads(
    x: torch.Tensor, cp: int, order: torch.Tensor, group: Group, meter: CommMeter | None
) -> torch.Tensor:
    """(B, H, T/cp, d) of this rank's tokens -> (B, H/cp, T, d) of this rank's heads, rows in position
    order (``order``: the rank-major row of each position)."""
    B, H, t, d = x.shape
    parts = _all_to_all(
        x.view(B, cp, H // cp, t, d).transpose(0, 1), group, meter
    )  # (cp sources, B, H/cp, t, d)
    return parts.permute(1, 2, 0, 3, 4).reshape(B, H // cp, cp * t, d).index_select(2, order)


def heads_to_seq(
    x: torch.Tensor, cp: int, rows: torch.Tensor, group: Group, meter: CommMeter | None
) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: (B, H/cp, T, d) in position order -> (B, H, T/cp, d)
    (``rows``: the position of each rank-major row)."""
    B, h, T, d = x.shape
    parts = (
        x.index_select(2, rows).view(B, h, cp, T // cp, d).permute(2, 0, 1, 3, 4)
    )  # (cp destinations, ...)
    return _all_to_all(parts, group, meter).transpose(0, 1).reshape(B, cp * h, T // cp, d)


class _SeqToHeads(Function):
    """Forward :func:`seq_to_heads` (all-to-all); backward :func:`heads_to_seq` (all-to-all)."""

    @staticmethod
    def forward(ctx, x, cp, order, rows, group, meter):  # type: ignore[override]
        ctx.args = (cp, order, rows, group, meter)
        return seq_to_heads(x, cp, order, group, meter)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        cp, order, rows, group, meter = ctx.args
        return heads_to_seq(grad.contiguous(), cp, rows, group, meter), None, None, None, None, None


class _HeadsToSeq(Function):
    """Forward :func:`heads_to_seq` (all-to-all); backward :func:`seq_to_heads` (all-to-all)."""

    @staticmethod
    def forward(ctx, x, cp, order, rows, group, meter):  # type: ignore[override]
        ctx.args = (cp, order, rows, group, meter)
        return heads_to_seq(x, cp, rows, group, meter)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        cp, order, rows, group, meter = ctx.args
        return seq_to_heads(grad.contiguous(), cp, order, group, meter), None, None, None, None, None


class AllToAllCore(CpCore):
    """:class:`~loom.model.llama.CoreAttention` over the cp group's whole sequence by head exchange:
    local queries (B, a, T/cp, d), local keys and values (B, k, T/cp, d), optional local document ids
    (B, T/cp) -> (B, a, T/cp, d). Needs a % cp == 0 (config validation)."""

    def __init__(
        self,
        group: Group,
        rank: int,
        cp: int,
        meter: CommMeter | None = None,
        dropout: float = 0.0,
        scale: float = 0.0,
        softcap: float = 0.0,
        window: int = 0,
    ) -> None:
        super().__init__(group, rank, cp, meter, dropout, scale, softcap, window)
        self._orders: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def _order(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, str(device))
        if key not in self._orders:
            rows = rank_major_positions(seq_len, self.cp, device)
            self._orders[key] = (torch.argsort(rows), rows)
        return self._orders[key]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor | None = None
    ) -> torch.Tensor:
        cp, group, meter = self.cp, self.group, self.meter
        order, rows = self._order(q.shape[2] * cp, q.device)
        f = kv_repeat(k.shape[1], cp)
        if f > 1:  # (B, k, T/cp, d) -> (B, k·f, T/cp, d): whole groups of heads per rank
            k, v = k.repeat_interleave(f, dim=1), v.repeat_interleave(f, dim=1)
        q, k, v = (_SeqToHeads.apply(t.contiguous(), cp, order, rows, group, meter) for t in (q, k, v))
        mask = None
        if docs is not None:
            docs = global_docs(docs.contiguous(), group, self.rank, cp, meter)
            every = torch.empty((cp, *docs.shape), dtype=docs.dtype, device=docs.device)
            comm.all_gather(every.view(-1), docs.view(-1), group, meter)
            every = (
                every.transpose(0, 1).reshape(docs.shape[0], -1).index_select(1, order)
            )  # (B, T) by position
            mask = doc_mask(every, every, True, q.dtype)
        p = self.dropout if self.training else 0.0  # this rank's heads: masks from the cp-private stream
        y = attention(q, k, v, mask, p, scale=self.scale, softcap=self.softcap, window=self.window)
        return _HeadsToSeq.apply(y, cp, order, rows, group, meter)  # (B, a, T/cp, d)
