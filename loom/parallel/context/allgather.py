"""All-gather context parallelism (as Llama 3 trains long context, Dubey et al. 2024, §3.3.2).

Each attention core all-gathers the keys and values (B, k, T/cp, d) of the cp group (rank-major
order: rank j's two chunks at rows 2cj .. 2c(j+1)), then computes the local queries' blocks
against each rank's keys (:func:`~loom.parallel.context.blocks.chunk_blocks`: one causal block,
cp − 1 unmasked half blocks) merged by log-sum-exp. No dense mask: every block is a plain or
causal flash call (packed documents: an additive mask of the block only). Backward computes
each block's dK, dV into the gathered gradient, which the gather's backward reduce-scatters.

Saved for backward per layer: q, out and lse of the T/cp local tokens, and the gathered keys
and values of the whole sequence, unrepeated: 2·B·T·k·d·e (k·d per tp rank). Bytes sent per
rank, per layer and micro-batch, kv = B·(T/cp)·k·d:

    forward    all-gather of K and V        2·kv·e·(cp − 1)
    backward   reduce-scatter of dK and dV  2·kv·e·(cp − 1)

plus, with packed documents, the all-gather of the document ids, B·(T/cp)·8·(cp − 1). A layer whose
sliding window reaches at most one chunk back gathers nothing: it exchanges its halo rows
(:mod:`loom.parallel.context.halo`).
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from loom import comm
from loom.parallel.context.blocks import (
    CpCore,
    attend,
    attend_backward,
    block_mask,
    block_seed,
    draw_seed,
    global_docs,
    merge,
    window_blocks,
)
from loom.parallel.context.halo import halo_attention
from loom.parallel.sequence import gather_seq


def _blocks(rank: int, cp: int, c: int, drop_p: float, base: int | None, window: int = 0):
    """(query rows, gathered key rows, causal, band offset, dropout) of every block, rank's own
    first (:func:`~loom.parallel.context.blocks.window_blocks`); the dropout seeds are the ring's
    (:func:`~loom.parallel.context.blocks.block_seed`)."""
    for src in [rank] + [j for j in range(cp) if j != rank]:
        for n, (qs, ks, causal, gap) in enumerate(window_blocks(rank, src, c, cp, window)):
            drop = None if base is None else (drop_p, block_seed(base, rank, src, n))
            yield qs, slice(2 * c * src + ks.start, 2 * c * src + ks.stop), causal, gap, drop


class _GatheredAttention(Function):
    """Local queries against the gathered keys, block by block (module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, docs, kdocs, rank, cp, drop_p, base, scale, softcap, window):  # type: ignore[override]
        B, a, T, d = q.shape
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        # (B, T, a, d) in memory, as the flash kernel lays its output out, so the projection's input
        # y.transpose(1, 2).reshape(B, T, a·d) is a view of the saved output, not a copy
        acc = torch.zeros(B, T, a, d, dtype=acc_dtype, device=q.device).transpose(1, 2)
        lse = torch.full((B, a, T), float("-inf"), dtype=acc.dtype, device=q.device)
        for qs, ks, causal, gap, drop in _blocks(rank, cp, T // 2, drop_p, base, window):
            mask = block_mask(docs, kdocs, qs, ks, causal, gap, window, q.dtype, q.device)
            o, m = attend(
                q[:, :, qs], k[:, :, ks], v[:, :, ks], causal and mask is None, mask, drop, scale, softcap
            )
            merge(acc[:, :, qs], lse[:, :, qs], o, m)
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, docs, kdocs)
        ctx.where = (rank, cp, drop_p, base, scale, softcap, window)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, docs, kdocs = ctx.saved_tensors
        rank, cp, drop_p, base, scale, softcap, window = ctx.where
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        dk = torch.zeros(k.shape, dtype=dq.dtype, device=k.device)
        dv = torch.zeros(v.shape, dtype=dq.dtype, device=v.device)
        for qs, ks, causal, gap, drop in _blocks(rank, cp, q.shape[2] // 2, drop_p, base, window):
            mask = block_mask(docs, kdocs, qs, ks, causal, gap, window, q.dtype, q.device)
            gq, gk, gv = attend_backward(
                dout[:, :, qs],
                q[:, :, qs],
                k[:, :, ks],
                v[:, :, ks],
                out[:, :, qs],
                lse[:, :, qs],
                causal and mask is None,
                mask,
                drop,
                scale,
                softcap,
            )
            dq[:, :, qs] += gq
            dk[:, :, ks] += gk
            dv[:, :, ks] += gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *(None,) * 9


class AllGatherCore(CpCore):
    """:class:`~loom.model.llama.CoreAttention` over the cp group's whole sequence, K/V all-gathered:
    local queries (B, a, T/cp, d), local keys and values (B, k, T/cp, d), optional local document ids
    (B, T/cp) -> (B, a, T/cp, d)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.by_halo(q):  # a window within one chunk: the neighbours' last rows, not the whole sequence
            docs = (
                None
                if docs is None
                else global_docs(docs.contiguous(), self.group, self.rank, self.cp, self.meter)
            )
            return halo_attention(self, q, k, v, docs)
        # (B, k, T/cp, d) -> (B, k, T, d): gather along the sequence (dim 2, via the batch-first helper)
        k = gather_seq(k.transpose(1, 2), self.group, self.meter).transpose(1, 2).contiguous()
        v = gather_seq(v.transpose(1, 2), self.group, self.meter).transpose(1, 2).contiguous()
        kdocs = None
        if docs is not None:
            docs = global_docs(docs.contiguous(), self.group, self.rank, self.cp, self.meter)
            kdocs = torch.empty((self.cp, *docs.shape), dtype=docs.dtype, device=docs.device)
            comm.all_gather(kdocs.view(-1), docs.view(-1), self.group, self.meter)
            kdocs = kdocs.transpose(0, 1).reshape(docs.shape[0], -1)  # (B, T) rank-major like the keys
        base = draw_seed() if self.training and self.dropout > 0 else None
        return _GatheredAttention.apply(
            q.contiguous(),
            k,
            v,
            docs,
            kdocs,
            self.rank,
            self.cp,
            self.dropout,
            base,
            self.scale,
            self.softcap,
            self.window,
        )
