"""Attention by blocks: one block's output with its log-sum-exp, its backward, and the merge.

For queries q (B, a, Tq, d) and one block of keys and values (B, k, Tk, d) (GQA: a % k == 0),
with scores s = q kᵀ/√d (−∞ where masked):

    lse_i = log Σ_j exp(s_ij)           o_i = Σ_j exp(s_ij − lse_i) v_j

Two blocks of the same queries merge exactly (the online softmax of flash attention):

    lse = log(exp(lse₁) + exp(lse₂))    o = exp(lse₁ − lse) o₁ + exp(lse₂ − lse) o₂

in fp32. The backward of one block takes the *final* o and lse of the whole row: with
P_ij = exp(s_ij − lse_i) and D_i = Σ_c dO_ic O_ic,

    dV = Pᵀ dO    dS = P ∘ (dO Vᵀ − D)    dQ = dS K/√d    dK = dSᵀ Q/√d

so each block's gradients are its exact share and are summed over blocks. On the CPU the
blocks run in PyTorch's flash kernel for the CPU (which returns the log-sum-exp); elsewhere in
fp32 matrix products (the same formulas). A block is either causal (square, query i sees key
j <= i), full, or masked by document: an additive mask of the block only, in the compute dtype.

Which blocks the load-balanced layout computes: cp rank r holds chunks r and 2cp−1−r of c
tokens each; against the keys of rank j (:func:`chunk_blocks`):

    j = r    all 2c queries, all 2c keys, causal (local positions increase)
    j < r    all 2c queries against j's first chunk (j < r < 2cp−1−j), no mask
    j > r    r's second chunk against all 2c keys (both earlier than 2cp−1−r), no mask

so every rank does the same work: one causal 2c x 2c block and cp − 1 full blocks of 2c x c.

Attention dropout (``drop`` = (p, seed)): the probabilities P_ij (normalised by the final lse)
are multiplied by M_ij/(1 − p), M a keep-mask drawn from a generator seeded with the block's seed,
drawn again in backward; the merge and D_i = Σ_c dO_ic O_ic stay exact, and dS = P ∘ (M∘dO Vᵀ/(1−p) − D).
Blocks with dropout run in the fp32 matrix products (a fused kernel draws its own mask).
On an accelerator the blocks run in those products too: correct, but with (Tq, Tk) fp32
temporaries per block, not a flash kernel (a fused CUDA path is not written yet).
"""

from __future__ import annotations

import math

import torch
from torch import nn

Block = tuple[slice, slice, bool]  # query rows, key rows, causal
Dropout = tuple[float, int]  # attention dropout p, the block's seed
BLOCK_SEED = 0x9E3779B97F4A7C15  # odd 64-bit constant: block seeds far apart


class CpCore(nn.Module):
    """What every context-parallel attention core holds: the cp group, this rank's place in it, the
    meter of its traffic and the attention dropout p. Subclasses take local queries (B, a, T/cp, d),
    keys and values (B, k, T/cp, d) and optional local document ids (B, T/cp) -> (B, a, T/cp, d)."""

    def __init__(self, group, rank: int, cp: int, meter=None, dropout: float = 0.0) -> None:
        super().__init__()
        self.group, self.rank, self.cp, self.meter, self.dropout = group, rank, cp, meter, dropout


def draw_seed() -> int:
    """One 62-bit draw from the default generator: the base of a core call's block seeds (replayed
    by recomputation, which restores the generator first)."""
    return int(torch.randint(0, 2**62, (1,), device="cpu").item())


def block_seed(base: int, rank: int, src: int) -> int:
    """The dropout seed of the block of ``rank``'s queries against ``src``'s keys (base drawn per call)."""
    return (base + (1 + rank * 4099 + src) * BLOCK_SEED) % 2**63


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
    return q.device.type == "cpu"


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None = None,
    drop: Dropout | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: output (B, a, Tq, d) in q's dtype and log-sum-exp (B, a, Tq) in fp32, −∞ on rows
    the mask hides entirely (their output is 0). ``drop`` = (p, seed): attention dropout (module doc)."""
    if _fused(q) and drop is None:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask
        )
        if mask is not None:  # the kernel reports lse 0 for a fully masked row
            hidden = torch.isinf(mask).all(-1).expand_as(lse)
            lse = lse.masked_fill(hidden, float("-inf"))
        return out, _acc(lse)
    s = _scores(q, k, causal, mask)
    lse = s.logsumexp(-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1)) * _kept(s.shape, s.device, drop)
    return (p @ _acc(_repeat(v, q))).to(q.dtype), lse


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
):
    """dQ, dK, dV of one block given the rows' final ``out`` and ``lse`` (module formulas; ``drop``:
    the forward's dropout, its mask drawn again from the same seed)."""
    if _fused(q) and drop is None:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask
        )
    scale = 1.0 / math.sqrt(q.shape[-1])
    kr, vr = _acc(_repeat(k, q)), _acc(_repeat(v, q))
    p = torch.exp(_scores(q, k, causal, mask) - _finite(lse).unsqueeze(-1))
    kept = _kept(p.shape, p.device, drop)
    do = _acc(dout)
    dv = (p * kept).transpose(-1, -2) @ do
    ds = p * ((do @ vr.transpose(-1, -2)) * kept - (do * _acc(out)).sum(-1, keepdim=True))
    dq, dk = (ds @ kr) * scale, (ds.transpose(-1, -2) @ _acc(q)) * scale
    return dq.to(q.dtype), _unrepeat(dk, k).to(k.dtype), _unrepeat(dv, v).to(v.dtype)


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


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> torch.Tensor:
    s = (_acc(q) @ _acc(_repeat(k, q)).transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, a, Tq, Tk)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if mask is not None:
        s = s + _acc(mask)
    return s
