"""Windowed attention over cp ranks by halo exchange: a layer whose sliding window w reaches at most
one chunk back (w − 1 <= c, the chunk of c = T/(2·cp) tokens of the zigzag layout) needs from the
other ranks only the H = w − 1 keys and values just before each of its two chunks, not the whole
sequence the ring circulates or the all-gather gathers.

Rank r holds chunks r and 2cp−1−r. The H rows before chunk r end rank r−1's first chunk; those
before chunk 2cp−1−r end rank r+1's second chunk (rank cp−1's own first chunk: chunks cp−1 and cp
are both its own). So each rank sends its first chunk's last H rows of K and V to r+1 and its
second chunk's to r−1, and receives the same from them: one ``batch_isend_irecv``. Each query
chunk then attends, in one block, to the H halo rows followed by its own c rows under the band
0 <= H + i − j < w (:func:`~loom.parallel.context.blocks.window_mask`: causal and windowed at once;
packed documents add their mask over the halo's global document ids). Backward returns the halo
rows' dK and dV (fp32) to their owners over the same pairs, reversed.

Bytes sent per rank, per layer and micro-batch, with n the rank's neighbours (1 at either end of
the group, else 2), kh·d the key width (per tp rank) and e bytes per element:

    forward    n · 2·B·H·kh·d·e         (+ n · B·H·8 of document ids with packed data)
    backward   n · 2·B·H·kh·d·4

against (cp − 1)·2·B·(T/cp)·kh·d·e each way in the ring: a factor (T/cp)/H·(cp − 1)/n less.
Saved for backward beyond the ring's: the received halo rows, n·2·B·H·kh·d·e. Attention dropout
keeps the ring's blocks (their seeds), so it runs there.
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from loom import comm
from loom.parallel.context.blocks import attend, attend_backward, doc_mask, window_mask


def _neighbours(rank: int, cp: int) -> tuple[int | None, int | None]:
    """(the rank before, the rank after) this one in the group, None past either end."""
    return (rank - 1 if rank > 0 else None), (rank + 1 if rank < cp - 1 else None)


def _swap(
    to_prev: torch.Tensor | None, to_next: torch.Tensor | None, rank: int, cp: int, group, meter
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Send ``to_prev`` to rank − 1 and ``to_next`` to rank + 1, and receive tensors of the same shapes
    from them (what they sent this way): (from rank − 1, from rank + 1), None where no neighbour is."""
    prev, nxt = _neighbours(rank, cp)
    sends, recvs = [], []
    got_prev = got_next = None
    if prev is not None and to_prev is not None:
        sends.append((to_prev.contiguous(), prev))
        got_prev = torch.empty_like(to_prev)
        recvs.append((got_prev, prev))
    if nxt is not None and to_next is not None:
        sends.append((to_next.contiguous(), nxt))
        got_next = torch.empty_like(to_next)
        recvs.append((got_next, nxt))
    for w in comm.batch_p2p(sends, recvs, group, meter):
        comm.wait(w)
    return got_prev, got_next


def _chunk_keys(kv: torch.Tensor, halos: tuple[torch.Tensor | None, torch.Tensor | None], c: int, h: int):
    """The keys and values (2, B, kh, H' + c, d) each query chunk attends to: its halo (received, or for
    rank cp−1's second chunk the end of its own first) followed by the chunk itself; H' = 0 for chunk 0."""
    first, second = kv[:, :, :, :c], kv[:, :, :, c:]
    before_second = halos[1] if halos[1] is not None else kv[:, :, :, c - h : c]
    firsts = first if halos[0] is None else torch.cat([halos[0], first], 3)
    return firsts, torch.cat([before_second, second], 3)


def _masks(docs, halo_docs, c: int, h: int, window: int, first_halo: bool, dtype, device):
    """Each query chunk's additive mask over its keys: the band with offset H' (0 for chunk 0), plus
    the documents' over the halo's and the chunk's global ids."""
    out = []
    for i, halo in enumerate((h if first_halo else 0, h)):
        mask = window_mask(c, halo + c, halo, window, dtype, device)
        if docs is not None:
            own = docs[:, i * c : (i + 1) * c]
            keys = own if halo == 0 else torch.cat([halo_docs[i], own], 1)
            mask = mask + doc_mask(own, keys, False, dtype)
        out.append(mask)
    return out


class _HaloAttention(Function):
    """Local queries against their chunks and the neighbours' halo rows (module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, docs, group, meter, rank, cp, scale, softcap, window):  # type: ignore[override]
        B, a, T, d = q.shape
        c, h = T // 2, window - 1
        kv = torch.stack([k, v])  # (2, B, kh, 2c, d)
        halos: tuple = (None, None)  # w = 1: each query sees itself alone, nothing to exchange
        if h:
            halos = _swap(kv[:, :, :, 2 * c - h :], kv[:, :, :, c - h : c], rank, cp, group, meter)
        halo_docs: tuple = (None, None)
        if docs is not None and h:
            got = _swap(docs[:, 2 * c - h :], docs[:, c - h : c], rank, cp, group, meter)
            halo_docs = (got[0], got[1] if got[1] is not None else docs[:, c - h : c])
        keys = _chunk_keys(kv, halos, c, h)
        masks = _masks(docs, halo_docs, c, h, window, halos[0] is not None, q.dtype, q.device)
        # (B, T, a, d) in memory, as the flash kernel lays its output out (the projection's input a view)
        out = torch.empty(B, T, a, d, dtype=q.dtype, device=q.device).transpose(1, 2)
        lse = torch.empty(B, a, T, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        for i in range(2):
            rows = slice(i * c, (i + 1) * c)
            o, m = attend(q[:, :, rows], keys[i][0], keys[i][1], False, masks[i], None, scale, softcap)
            out[:, :, rows] = o
            lse[:, :, rows] = m
        ctx.save_for_backward(
            q, kv, out, lse, *masks, *(x if x is not None else kv.new_empty(0) for x in halos)
        )
        ctx.halo = (group, meter, rank, cp, scale, softcap, h, tuple(x is not None for x in halos))
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, kv, out, lse, mask1, mask2, prev, nxt = ctx.saved_tensors
        group, meter, rank, cp, scale, softcap, h, present = ctx.halo
        halos = (prev if present[0] else None, nxt if present[1] else None)
        dout = dout.contiguous()
        c = q.shape[2] // 2
        acc = torch.promote_types(kv.dtype, torch.float32)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        sent: list[torch.Tensor | None] = [None, None]  # the halo rows' gradients, to rank − 1 and + 1
        for i, (keys, mask) in enumerate(zip(_chunk_keys(kv, halos, c, h), (mask1, mask2), strict=True)):
            rows = slice(i * c, (i + 1) * c)
            gq, gk, gv = attend_backward(
                dout[:, :, rows], q[:, :, rows], keys[0], keys[1], out[:, :, rows], lse[:, :, rows], False, mask,
                None, scale, softcap,
            )  # fmt: skip
            dq[:, :, rows] = gq
            g = torch.stack([gk, gv]).to(acc)
            halo = g.shape[3] - c  # H' rows of halo before the chunk's own
            dkv[:, :, :, rows] += g[:, :, :, halo:]
            if i == 0 and halo:
                sent[0] = g[:, :, :, :halo]
            elif i == 1 and halos[1] is not None:
                sent[1] = g[:, :, :, :halo]
            elif i == 1:  # rank cp − 1: the halo of its second chunk is the end of its first
                dkv[:, :, :, c - h : c] += g[:, :, :, :halo]
        from_prev, from_next = _swap(sent[0], sent[1], rank, cp, group, meter)
        if from_next is not None:  # my first chunk's last rows, as rank + 1's halo
            dkv[:, :, :, c - h : c] += from_next
        if from_prev is not None:  # my second chunk's last rows, as rank − 1's halo
            dkv[:, :, :, 2 * c - h :] += from_prev
        return dq, dkv[0].to(kv.dtype), dkv[1].to(kv.dtype), *(None,) * 8


def halo_attention(
    core, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor | None
) -> torch.Tensor:
    """``core``'s (a :class:`~loom.parallel.context.blocks.CpCore`) attention of local queries
    (B, a, T/cp, d) over its window by halo exchange; ``docs``: the local tokens' global document ids
    (B, T/cp), or None."""
    return _HaloAttention.apply(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        docs,
        core.group,
        core.meter,
        core.rank,
        core.cp,
        core.scale,
        core.softcap,
        core.window,
    )
