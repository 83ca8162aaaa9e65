"""Ring attention: K and V blocks circulate over the cp ranks; each rank keeps only its own.

Forward, cp steps: at step s rank r holds the keys and values (and, with packed documents, the
keys' document ids) of rank j = r − s (mod cp); it posts the send of that block to r + 1 and the
receive of the next one from r − 1 (one ``batch_isend_irecv``, the same on every rank), computes
its blocks against it (:func:`~loom.parallel.context.blocks.chunk_blocks`: causal at s = 0, half
a block otherwise, nothing skipped that is needed, nothing computed that the mask hides) while
the transfer runs, and merges them into the running fp32 output and log-sum-exp.

Backward, cp steps again: the K/V blocks circulate as in forward and, one step behind them, the
fp32 accumulators of dK and dV: rank r adds its share for block j and passes the sum on, so
after cp − 1 hops plus one last hop every accumulator is home. dQ stays local.

Saved for backward per layer: q, the local k and v, the output and the log-sum-exp, all of the
T/cp local tokens (nothing of the other ranks). Bytes sent per rank, per layer and micro-batch,
with kv = B·(T/cp)·k·d (the local keys, per tp rank) and e bytes per element:

    forward    (cp − 1) · 2·kv·e        (K and V, one message per step)
    backward   (cp − 1) · 2·kv·e  +  cp · 2·kv·4   (K/V again, the fp32 dK/dV accumulators)

plus, with packed documents, B·(T/cp)·8 bytes of key document ids with every K/V message. A layer
whose sliding window reaches at most one chunk back exchanges only its halo rows instead
(:mod:`loom.parallel.context.halo`).
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from loom import comm
from loom.comm import CommMeter, Group
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


def _exchange(sends: list, recvs: list, group: Group, meter: CommMeter | None, nxt: int, prev: int) -> list:
    """Post sends of ``sends`` to rank ``nxt`` and receives of ``recvs`` from ``prev`` as one batch."""
    return comm.batch_p2p([(t, nxt) for t in sends], [(t, prev) for t in recvs], group, meter)


def _finish(works: list) -> None:
    for w in works:
        comm.wait(w)


class _RingAttention(Function):
    """Attention of the local queries over the whole sequence, K/V circulating (module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, docs, group, meter, rank, cp, drop_p, base, scale, softcap, window):  # type: ignore[override]
        B, a, T, d = q.shape
        c, nxt, prev = T // 2, (rank + 1) % cp, (rank - 1) % cp
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        # (B, T, a, d) in memory, as the flash kernel lays its output out, so the projection's input
        # y.transpose(1, 2).reshape(B, T, a·d) is a view of the saved output, not a copy
        acc = torch.zeros(B, T, a, d, dtype=acc_dtype, device=q.device).transpose(1, 2)
        lse = torch.full((B, a, T), float("-inf"), dtype=acc.dtype, device=q.device)
        kv, kdocs = torch.stack([k, v]), docs  # (2, B, k, T, d): one message per step
        for s in range(cp):
            works, nkv, ndocs = [], kv, kdocs
            if s < cp - 1:
                nkv, ndocs = torch.empty_like(kv), None if docs is None else torch.empty_like(docs)
                works = _exchange(
                    [kv] + ([kdocs] if docs is not None else []),
                    [nkv] + ([ndocs] if docs is not None else []),
                    group,
                    meter,
                    nxt,
                    prev,
                )
            src = (rank - s) % cp
            for n, (qs, ks, causal, gap) in enumerate(window_blocks(rank, src, c, cp, window)):
                mask = block_mask(docs, kdocs, qs, ks, causal, gap, window, q.dtype, q.device)
                drop = None if base is None else (drop_p, block_seed(base, rank, src, n))
                o, m = attend(
                    q[:, :, qs],
                    kv[0][:, :, ks],
                    kv[1][:, :, ks],
                    causal and mask is None,
                    mask,
                    drop,
                    scale,
                    softcap,
                )
                merge(acc[:, :, qs], lse[:, :, qs], o, m)
            _finish(works)
            kv, kdocs = nkv, ndocs
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, docs)
        ctx.ring = (group, meter, rank, cp, drop_p, base, scale, softcap, window)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, docs = ctx.saved_tensors
        group, meter, rank, cp, drop_p, base, scale, softcap, window = ctx.ring
        dout = dout.contiguous()
        c, nxt, prev = q.shape[2] // 2, (rank + 1) % cp, (rank - 1) % cp
        acc_dtype = torch.promote_types(k.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        kv, kdocs, dkv = torch.stack([k, v]), docs, None
        for s in range(cp):
            sends, recvs, nkv, ndocs, ndkv = [], [], kv, kdocs, None
            if s < cp - 1:  # the next K/V block
                nkv, ndocs = torch.empty_like(kv), None if docs is None else torch.empty_like(docs)
                sends += [kv] + ([kdocs] if docs is not None else [])
                recvs += [nkv] + ([ndocs] if docs is not None else [])
            if dkv is not None:  # the accumulator of the block held one step ago, one hop further
                ndkv = torch.empty_like(dkv)
                sends.append(dkv)
                recvs.append(ndkv)
            works = _exchange(sends, recvs, group, meter, nxt, prev)
            local = torch.zeros(kv.shape, dtype=acc_dtype, device=kv.device)
            src = (rank - s) % cp
            for n, (qs, ks, causal, gap) in enumerate(window_blocks(rank, src, c, cp, window)):
                mask = block_mask(docs, kdocs, qs, ks, causal, gap, window, q.dtype, q.device)
                drop = None if base is None else (drop_p, block_seed(base, rank, src, n))
                gq, gk, gv = attend_backward(
                    dout[:, :, qs],
                    q[:, :, qs],
                    kv[0][:, :, ks],
                    kv[1][:, :, ks],
                    out[:, :, qs],
                    lse[:, :, qs],
                    causal and mask is None,
                    mask,
                    drop,
                    scale,
                    softcap,
                )
                dq[:, :, qs] += gq
                local[0][:, :, ks] += gk
                local[1][:, :, ks] += gv
            _finish(works)
            dkv = local if ndkv is None else ndkv.add_(local)
            kv, kdocs = nkv, ndocs
        assert dkv is not None  # cp >= 1 blocks ran
        home = torch.empty_like(dkv)  # the last hop: every accumulator back to its owner
        _finish(_exchange([dkv], [home], group, meter, nxt, prev))
        return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype), *(None,) * 10


class RingCore(CpCore):
    """:class:`~loom.model.llama.CoreAttention` over the cp group's whole sequence by ring attention:
    local queries (B, a, T/cp, d), local keys and values (B, k, T/cp, d), optional local document ids
    (B, T/cp) -> (B, a, T/cp, d)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor | None = None
    ) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        docs = (
            None
            if docs is None
            else global_docs(docs.contiguous(), self.group, self.rank, self.cp, self.meter)
        )
        if self.by_halo(q):  # a window within one chunk: the neighbours' last rows, not the ring
            return halo_attention(self, q, k, v, docs)
        base = draw_seed() if self.training and self.dropout > 0 else None
        return _RingAttention.apply(
            q,
            k,
            v,
            docs,
            self.group,
            self.meter,
            self.rank,
            self.cp,
            self.dropout,
            base,
            self.scale,
            self.softcap,
            self.window,
        )
