"""Attention by blocks: one block's output with its log-sum-exp, its backward, and the merge.

For queries q (B, a, Tq, d) and one block of keys and values (B, k, Tk, d) (GQA: a % k == 0),
with scores s = σ q kᵀ (σ = ``model.attn_scale``, 0: 1/√d), soft-capped to s = c·tanh(σ q kᵀ / c)
when c = ``model.attn_softcap`` > 0 (−∞ where masked):

    lse_i = log Σ_j exp(s_ij)           o_i = Σ_j exp(s_ij − lse_i) v_j

Two blocks of the same queries merge exactly (the online softmax of flash attention):

    lse = log(exp(lse₁) + exp(lse₂))    o = exp(lse₁ − lse) o₁ + exp(lse₂ − lse) o₂

in fp32. The backward of one block takes the *final* o and lse of the whole row: with
P_ij = exp(s_ij − lse_i) and D_i = Σ_c dO_ic O_ic,

    dV = Pᵀ dO    dS = P ∘ (dO Vᵀ − D)    dQ = σ dS' K    dK = σ dS'ᵀ Q

with dS' = dS, or under the cap dS' = dS ∘ (1 − tanh²(σ q kᵀ / c)) = dS ∘ (1 − (s/c)²), so each
block's gradients are its exact share and are summed over blocks.

Every device runs a block through a kernel that returns the log-sum-exp (:func:`attend`):

    CPU                         aten._scaled_dot_product_flash_attention_for_cpu (mask allowed)
    CUDA, bf16/fp16, no mask    aten._scaled_dot_product_flash_attention (GQA native)
    CUDA otherwise              aten._scaled_dot_product_efficient_attention (fp32; the document
                                mask as its additive bias; GQA keys/values repeated, O(T·d))

and its backward through the matching backward op, given the rows' final out and lse. Memory per
block beyond the kernel's own workspace, for Tq queries, Tk keys, a query and k key heads of d, e
bytes per element (what tests/test_flash_blocks.py measures):

    forward     B·a·Tq·(d·e + 4)                       out and lse (fp32)
    backward    B·(a·Tq + 2·k·Tk)·d·e                  dQ, dK, dV
    + CUDA efficient path with GQA: 2·B·a·Tk·d·e (repeated K, V) and, backward, 2·B·a·Tk·d·e (their grads)

against (B, a, Tq, Tk) fp32 scores, probabilities and their gradient in the matrix products.
Packed documents take the path with a mask: the block's additive mask (B, 1, Tq, Tk) in the compute
dtype is then the one O(Tq·Tk) tensor (made by :func:`doc_mask`, beside the kernel). The fp32 matrix
products (``_fused`` false) stay as the reference of the tests and as the path of attention dropout
and of the soft-cap (no kernel applies it; O(Tq·Tk) fp32 scores per block). σ goes to every kernel
as its ``scale``.
A block is either causal (square, query i sees key j <= i), full, or masked by document.

A sliding window w (``model.sliding_window``: query at position p sees keys at p - w < p' <= p)
cuts the blocks chunk by chunk instead (:func:`window_blocks`): query chunk g against key chunk g'
(c tokens each, positions g·c .. g·c + c - 1) lies (g - g')·c ± (c - 1) apart, so it is skipped when
g' > g or its nearest pair is w or more apart, (g - g')·c - (c - 1) >= w; plain causal (g = g') or
full when its farthest pair is within the window, (g - g')·c + c - 1 < w; else masked by the band
0 <= (g - g')·c + i - j < w (:func:`window_mask`, beside any document mask). Attention work per rank
is then O((T/cp)·w), not O(T²/cp). A window reaching at most one chunk back (w − 1 <= c) needs no
block of the other ranks but their last H = w − 1 rows: ring and all-gather then exchange those
halos instead (:mod:`loom.parallel.context.halo`, :meth:`CpCore.by_halo`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

aten = torch.ops.aten

Block = tuple[slice, slice, bool]  # query rows, key rows, causal
Dropout = tuple[float, int]  # attention dropout p, the block's seed
BLOCK_SEED = 0x9E3779B97F4A7C15  # odd 64-bit constant: block seeds far apart


class CpCore(nn.Module):
    """What every context-parallel attention core holds: the cp group, this rank's place in it, the
    meter of its traffic, the attention dropout p, the scale σ, the soft-cap c and the sliding window
    w (:class:`~loom.model.llama.CoreAttention`'s). Subclasses take
    local queries (B, a, T/cp, d), keys and values (B, k, T/cp, d) and optional local document ids
    (B, T/cp) -> (B, a, T/cp, d)."""

    def __init__(
        self,
        group,
        rank: int,
        cp: int,
        meter=None,
        dropout: float = 0.0,
        scale: float = 0.0,
        softcap: float = 0.0,
        window: int = 0,
    ) -> None:
        super().__init__()
        self.group, self.rank, self.cp, self.meter, self.dropout = group, rank, cp, meter, dropout
        self.scale, self.softcap = scale, softcap  # σ (0: 1/√d) and the soft-cap c (0: none), module doc
        self.window = window  # w: the query at p sees keys p - w < p' <= p by global positions; 0: all

    def by_halo(self, q: torch.Tensor) -> bool:
        """Whether this call's window reaches at most one chunk back, w − 1 <= c = T/(2·cp) for the
        local queries q (B, a, 2c, d), so that ring and all-gather exchange only the halo rows
        (:mod:`loom.parallel.context.halo`); not under attention dropout (its blocks' seeds are the
        ring's)."""
        return (
            self.window > 0
            and self.window - 1 <= q.shape[2] // 2
            and not (self.training and self.dropout > 0)
        )


def draw_seed() -> int:
    """One 62-bit draw from the default generator: the base of a core call's block seeds (replayed
    by recomputation, which restores the generator first)."""
    return int(torch.randint(0, 2**62, (1,), device="cpu").item())


def block_seed(base: int, rank: int, src: int, part: int = 0) -> int:
    """The dropout seed of the block of ``rank``'s queries against ``src``'s keys (base drawn per call;
    ``part``: the block's index among those of the pair, :func:`window_blocks`)."""
    return (base + (1 + rank * 4099 + src) * BLOCK_SEED + part) % 2**63


def local_positions(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions of cp rank ``rank``'s tokens: chunks r and 2cp-1-r of 2cp, in order."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp}")
    c = seq_len // (2 * cp)
    first, second = (rank * c, (rank + 1) * c), ((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)
    return torch.cat([torch.arange(*first, device=device), torch.arange(*second, device=device)])


def chunk_blocks(rank: int, src: int, c: int) -> list[Block]:
    """The blocks rank ``rank``'s 2c local queries compute against rank ``src``'s 2c keys (module doc)."""
    if src == rank:
        return [(slice(0, 2 * c), slice(0, 2 * c), True)]
    if src < rank:
        return [(slice(0, 2 * c), slice(0, c), False)]
    return [(slice(c, 2 * c), slice(0, 2 * c), False)]


WindowBlock = tuple[slice, slice, bool, int | None]  # query rows, key rows, causal, band offset (or None)


def window_blocks(rank: int, src: int, c: int, cp: int, window: int = 0) -> list[WindowBlock]:
    """The blocks rank ``rank``'s 2c local queries compute against rank ``src``'s 2c keys under a
    sliding ``window`` (module doc), each with the offset g·c - g'·c of its band mask, or None where
    it needs none; without a window (0) :func:`chunk_blocks`'s, none banded. Positions are known on
    the host: a skipped block costs nothing, and no block waits on the device."""
    if window <= 0:
        return [(qs, ks, causal, None) for qs, ks, causal in chunk_blocks(rank, src, c)]
    out: list[WindowBlock] = []
    for qi, g in enumerate((rank, 2 * cp - 1 - rank)):  # the local query chunks, in order
        for ki, h in enumerate((src, 2 * cp - 1 - src)):  # the source's key chunks
            gap = (g - h) * c  # query position minus key position at the chunks' first rows
            if gap < 0 or gap - (c - 1) >= window:
                continue  # every key later, or every pair w or more apart
            qs, ks = slice(qi * c, qi * c + c), slice(ki * c, ki * c + c)
            if gap + c - 1 < window:  # the farthest pair inside the window: causal (g = h) or full
                out.append((qs, ks, gap == 0, None))
            else:
                out.append((qs, ks, False, gap))
    return out


def window_mask(tq: int, tk: int, gap: int, window: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive band mask (1, 1, tq, tk): 0 where 0 <= gap + i - j < ``window`` (query row i and key
    row j at positions gap + i - j apart), −∞ elsewhere."""
    d = torch.arange(tq, device=device)[:, None] - torch.arange(tk, device=device)[None, :] + gap
    seen = (d >= 0) & (d < window)
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill(~seen, float("-inf"))[None, None]


def block_mask(
    docs_q: torch.Tensor | None,
    docs_k: torch.Tensor | None,
    qs: slice,
    ks: slice,
    causal: bool,
    gap: int | None,
    window: int,
    dtype: torch.dtype,
    device,
) -> torch.Tensor | None:
    """The additive mask of one block (query rows ``qs`` of ``docs_q``, key rows ``ks`` of ``docs_k``):
    the documents' (:func:`doc_mask`, causal when ``causal``) plus, where ``gap`` is set, the window's
    band (:func:`window_mask`); None when neither applies."""
    mask = None if docs_q is None or docs_k is None else doc_mask(docs_q[:, qs], docs_k[:, ks], causal, dtype)
    if gap is None:
        return mask
    band = window_mask(qs.stop - qs.start, ks.stop - ks.start, gap, window, dtype, device)
    return band if mask is None else mask + band


def global_docs(docs: torch.Tensor, group, rank: int, cp: int, meter=None) -> torch.Tensor:
    """The whole sequence's document ids of this rank's tokens, from ``docs`` = cumsum(positions == 0)
    over its own 2c tokens (what the model computes): each rank's document starts per chunk, S
    (one all-gather of B·2 counts), give chunk g's offset P_g = Σ_{g' < g} S_g'; the first chunk's
    ids are docs + P_r, the second's docs − S_r + P_{2cp−1−r}. Equal to cumsum over the whole sequence."""
    from loom import comm

    c = docs.shape[1] // 2
    first = docs[:, c - 1]  # starts in chunk r
    mine = torch.stack([first, docs[:, -1] - first], dim=1).contiguous()  # (B, 2)
    every = torch.empty((cp, *mine.shape), dtype=mine.dtype, device=mine.device)
    comm.all_gather(every.view(-1), mine.view(-1), group, meter)
    starts = torch.cat([every[:, :, 0], every[:, :, 1].flip(0)]).T  # (B, 2cp): chunk g's starts, g = 0..2cp-1
    offset = starts.cumsum(1) - starts  # (B, 2cp) exclusive prefix
    return torch.cat(
        [
            docs[:, :c] + offset[:, rank : rank + 1],
            docs[:, c:] - first[:, None] + offset[:, 2 * cp - 1 - rank : 2 * cp - rank],
        ],
        dim=1,
    )


def doc_mask(docs_q: torch.Tensor, docs_k: torch.Tensor, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask (B, 1, Tq, Tk): 0 where the query's document equals the key's (and j <= i when
    ``causal``), −∞ elsewhere."""
    visible = docs_q[:, None, :, None] == docs_k[:, None, None, :]
    if causal:
        visible = visible & torch.ones(visible.shape[-2:], dtype=torch.bool, device=visible.device).tril()
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))


def _fused(q: torch.Tensor) -> bool:
    """Whether blocks run in a kernel returning the log-sum-exp: on every device (tests turn it off
    to compare with the fp32 matrix products)."""
    return True


def _kernel(q: torch.Tensor, mask: torch.Tensor | None) -> str:
    """The kernel of a block (module table): "cpu", "flash" or "efficient"."""
    if q.device.type == "cpu":
        return "cpu"
    if (
        mask is None
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
    ):
        return "flash"
    return "efficient"


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None = None,
    drop: Dropout | None = None,
    scale: float = 0.0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: output (B, a, Tq, d) in q's dtype and log-sum-exp (B, a, Tq) in fp32, −∞ on rows
    the mask hides entirely (their output is 0). ``drop`` = (p, seed): attention dropout; ``scale``
    σ, ``softcap`` c (module doc)."""
    if not _fused(q) or drop is not None or softcap > 0:
        s, _ = _scores(q, k, causal, mask, scale, softcap)
        lse = s.logsumexp(-1)
        p = torch.exp(s - _finite(lse).unsqueeze(-1)) * _kept(s.shape, s.device, drop)
        return (p @ _acc(_repeat(v, q))).to(q.dtype), lse
    kernel = _kernel(q, mask)
    if kernel == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale or None
        )
    elif kernel == "flash":
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale or None)[:2]
    else:
        out, lse = aten._scaled_dot_product_efficient_attention(
            q, _repeat(k, q), _repeat(v, q), _bias(mask, q), True, 0.0, causal, scale=scale or None
        )[:2]
        lse = lse[..., : q.shape[2]]  # the kernel pads the rows to a multiple of 32
    if mask is not None:  # a fully masked row: lse −∞ (the CPU kernel reports 0), output 0
        hidden = mask.amax(-1).isneginf().expand_as(lse)  # (B, a, Tq)
        lse = lse.masked_fill(hidden, float("-inf"))
        if kernel == "efficient":
            out = out.masked_fill(hidden.unsqueeze(-1), 0.0)
    return out, _acc(lse)


def attend_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None = None,
    drop: Dropout | None = None,
    scale: float = 0.0,
    softcap: float = 0.0,
):
    """dQ, dK, dV of one block given the rows' final ``out`` and ``lse`` (module formulas; ``drop``:
    the forward's dropout, its mask drawn again from the same seed; ``scale``, ``softcap``: the
    forward's σ and c)."""
    if not _fused(q) or drop is not None or softcap > 0:
        return _math_backward(dout, q, k, v, out, lse, causal, mask, drop, scale, softcap)
    kernel = _kernel(q, mask)
    if kernel == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale or None
        )
    lse = lse.float().contiguous()
    if kernel == "flash":
        Tq, Tk = q.shape[2], k.shape[2]
        seed, offset = _no_rng(q)
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, Tq, Tk, 0.0, causal, seed, offset, scale=scale or None
        )[:3]
    pad = 0 if torch.version.hip else -q.shape[2] % 32  # the padded rows the forward returns
    seed = offset = torch.empty((), dtype=torch.long, device=q.device)
    gq, gk, gv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout,
        q,
        _repeat(k, q),
        _repeat(v, q),
        _bias(mask, q),
        out,
        F.pad(lse, (0, pad)) if pad else lse,
        seed,
        offset,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale or None,
    )
    return gq, _unrepeat(gk, k), _unrepeat(gv, v)


def _math_backward(dout, q, k, v, out, lse, causal, mask, drop, scale=0.0, softcap=0.0):
    """:func:`attend_backward` in fp32 matrix products (the reference; the path of dropout and of
    the soft-cap)."""
    kr, vr = _acc(_repeat(k, q)), _acc(_repeat(v, q))
    s, t = _scores(q, k, causal, mask, scale, softcap)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    kept = _kept(p.shape, p.device, drop)
    do = _acc(dout)
    dv = (p * kept).transpose(-1, -2) @ do
    ds = p * ((do @ vr.transpose(-1, -2)) * kept - (do * _acc(out)).sum(-1, keepdim=True))
    if t is not None:  # through the cap: d(c·tanh(x/c))/dx = 1 − tanh²(x/c)
        ds = ds * (1 - t * t)
    sigma = _sigma(q, scale)
    dq, dk = (ds @ kr) * sigma, (ds.transpose(-1, -2) @ _acc(q)) * sigma
    return dq.to(q.dtype), _unrepeat(dk, k).to(k.dtype), _unrepeat(dv, v).to(v.dtype)


def _bias(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """The mask as the efficient kernel's bias: rows aligned to 16 elements, expanded to the heads."""
    if mask is None:
        return None
    Tk = mask.shape[-1]
    if Tk % 16:
        mask = F.pad(mask, (0, -Tk % 16))[..., :Tk]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], Tk)


def _no_rng(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (unread) random state the flash backward takes without dropout, shaped as its forward's."""
    if torch.version.hip:
        return torch.empty((), dtype=torch.long, device=q.device), torch.empty(
            (), dtype=torch.long, device=q.device
        )
    return torch.zeros(2, dtype=torch.uint64, device=q.device), torch.zeros(
        (), dtype=torch.uint64, device=q.device
    )


def merge(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold one block (out, lse) into the fp32 running (acc, acc_lse), in place (module formula)."""
    new = torch.logaddexp(acc_lse, lse)
    ref = _finite(new)
    acc.mul_(torch.exp(acc_lse - ref).unsqueeze(-1)).add_(
        out.to(acc.dtype) * torch.exp(lse - ref).unsqueeze(-1)
    )
    acc_lse.copy_(new)


def _kept(shape: torch.Size, device: torch.device, drop: Dropout | None) -> torch.Tensor | float:
    """The dropout keep-mask scaled by 1/(1 − p), drawn from a generator seeded with the block's seed
    (the same in forward and backward); 1 without dropout."""
    if drop is None:
        return 1.0
    p, seed = drop
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.rand(shape, generator=g, device=device) >= p).float() / (1.0 - p)


def _acc(x: torch.Tensor) -> torch.Tensor:
    """x in the accumulation dtype: fp32, or wider if x is."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with −∞ (rows that see nothing) replaced by 0, so exp(s − lse) is 0 there, not NaN."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def _repeat(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    rep = q.shape[1] // x.shape[1]
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


def _unrepeat(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Sum the gradient of the repeated heads back onto x's heads."""
    rep = g.shape[1] // x.shape[1]
    return g.unflatten(1, (x.shape[1], rep)).sum(2) if rep > 1 else g


def _sigma(q: torch.Tensor, scale: float) -> float:
    """The scale σ of the scores: ``scale``, or 1/√d when it is 0."""
    return scale or 1.0 / math.sqrt(q.shape[-1])


def _scores(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None,
    scale: float = 0.0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The block's masked scores s (B, a, Tq, Tk) in fp32 (module doc) and, with a soft-cap c > 0,
    tanh(σ q kᵀ / c) unmasked (for the backward), else None."""
    s = (_acc(q) @ _acc(_repeat(k, q)).transpose(-1, -2)) * _sigma(q, scale)  # (B, a, Tq, Tk)
    t = None
    if softcap > 0:
        t = torch.tanh(s / softcap)
        s = softcap * t
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if mask is not None:
        s = s + _acc(mask)
    return s, t
