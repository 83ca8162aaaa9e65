"""8-bit AdamW on flat shards: block-wise quantized moments (after Dettmers et al. 2022).

The update is AdamW's (:mod:`loom.optim.adamw`), run in fp32 on dequantized moments,
chunk by chunk. Between steps each moment is stored as one byte per element plus one fp32
absmax per block of B = 256 consecutive shard elements:

    x̂ = absmax(block) · Q[code],   code = the nearest entry of the 8-bit map Q to x / absmax(block)

Maps: log-spaced magnitudes covering 7 decades below the block maximum (the idea of the
"dynamic" map: roughly constant *relative* error, ≤ 6.4% for the signed map, ≤ 3.3% for the
unsigned one) and an exact zero. m uses the signed map (0, ±10^(-7+7k/126), 255 codes).
The second moment is stored as its square root u = √v with the unsigned map (0, 10^(-7+7k/254),
256 codes): √ halves v's dynamic range in log terms, so an element's u flushes to zero only
when its gradient is 10⁷ times smaller than the block's largest, where m flushes as well
(a zero u beside a non-zero m would make the update m/ε).

    state bytes per shard of n elements = 2n + 8·ceil(n/B)     (+ 4n fp32 masters for half params)

i.e. ≈ 2.03 bytes per element instead of 8 for fp32 moments. Blocks are cut per shard, so a
sharded run quantizes at other boundaries than an unsharded one: results agree to quantization
noise, not bitwise.

Under tensor parallelism a block can hold elements of a parameter every tp rank keeps whole (a norm
weight) beside a tp-split one's, whose values differ per rank: its absmax would differ per rank, and
so would the replicated elements' codes, and the replicas drift apart. Those few elements (at most
2(B - 1) per replicated run of the shard) keep fp32 moments instead and enter no absmax, so every tp
rank updates its replicas identically (and a resume, which restores them from one rank, continues
bit for bit).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loom.comm import Group
from loom.optim.master import MasterWeights
from loom.optim.store import StateStore

BLOCK = 256
CHUNK_BLOCKS = 4096  # blocks dequantized at once: bounds the fp32 working set to 4 MiB per moment


def _signed_map(device: torch.device) -> torch.Tensor:
    mags = torch.logspace(-7, 0, 127, dtype=torch.float64, device=device)
    return torch.cat([-mags.flip(0), mags.new_zeros(1), mags]).float()  # 255 sorted


def _unsigned_map(device: torch.device) -> torch.Tensor:
    mags = torch.logspace(-7, 0, 255, dtype=torch.float64, device=device)
    return torch.cat([mags.new_zeros(1), mags]).float()


class BlockQuantizer:
    """Codes (uint8) and per-block absmax for a 1-D fp32 tensor, with a sorted map of ≤ 256 values."""

    def __init__(self, qmap: torch.Tensor) -> None:
        self.map = qmap
        self.mid = ((self.map[1:] + self.map[:-1]) / 2).contiguous()  # decision boundaries

    def quantize(self, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor) -> None:
        """Encode ``x`` (n) into ``codes`` (n, uint8) and ``absmax`` (ceil(n/B)) in place."""
        n = x.numel()
        nb = absmax.numel()
        padded = torch.zeros(nb * BLOCK, dtype=torch.float32, device=x.device)
        padded[:n] = x
        blocks = padded.view(nb, BLOCK)
        amax = blocks.abs().amax(dim=1)
        absmax.copy_(amax)
        blocks.div_(amax.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(1))
        codes.copy_(torch.bucketize(padded[:n], self.mid).to(torch.uint8))

    def dequantize(self, codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        n = codes.numel()
        vals = self.map[codes.long()]
        return vals.view(-1).mul_(absmax.repeat_interleave(BLOCK)[:n])


def mixed_elements(
    replicated: list[tuple[int, int]], split: list[tuple[int, int]], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Sorted shard-local indices of the elements of ``replicated`` runs whose block of B also holds
    an element of a ``split`` run (only a run's first and last blocks can)."""
    split_blocks = {b for lo, hi in split for b in range(lo // BLOCK, (hi - 1) // BLOCK + 1)}
    out: list[torch.Tensor] = []
    for lo, hi in replicated:
        ends = {lo // BLOCK, (hi - 1) // BLOCK}
        for b in sorted(ends & split_blocks):
            a, z = max(lo, b * BLOCK), min(hi, (b + 1) * BLOCK)
            out.append(torch.arange(a, z, dtype=torch.long, device=device))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=device)


def _chunk_spans(exact: list[int], n: int) -> list[tuple[int, int]]:
    """For each chunk of ``CHUNK_BLOCKS`` blocks of a shard of n elements, the [k0, k1) slice of the
    sorted ``exact`` indices inside it (found once, on the host: no device sync in the step)."""
    import bisect

    span = CHUNK_BLOCKS * BLOCK
    return [(bisect.bisect_left(exact, lo), bisect.bisect_left(exact, lo + span)) for lo in range(0, n, span)]


class FlatAdam8bit:
    """AdamW with 8-bit block-quantized moments over flat shards (masters fp32 where needed)."""

    def __init__(
        self,
        shards: Sequence[torch.Tensor],
        decay_ranges: Sequence[list[tuple[int, int]]],
        store: StateStore,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        tp_runs: Sequence[tuple[list[tuple[int, int]], list[tuple[int, int]]]] = (),
    ) -> None:
        """``tp_runs``: per shard, the shard-local runs of tp-replicated and of tp-split parameters
        (:func:`mixed_elements`); empty without tensor parallelism."""
        self.master = MasterWeights(shards, store)
        self.params, self.masters, self.store = self.master.params, self.master.masters, store
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay
        self.step_count = 0
        self.qm = BlockQuantizer(_signed_map(store.device))
        self.qu = BlockQuantizer(_unsigned_map(store.device))
        self.m_codes, self.m_absmax, self.u_codes, self.u_absmax = [], [], [], []
        for i, p in enumerate(self.params):
            nb = -(-p.numel() // BLOCK)
            self.m_codes.append(store.zeros(p.numel(), f"m_codes{i}", torch.uint8))
            self.u_codes.append(store.zeros(p.numel(), f"u_codes{i}", torch.uint8))
            self.m_absmax.append(store.zeros(nb, f"m_absmax{i}"))
            self.u_absmax.append(store.zeros(nb, f"u_absmax{i}"))
            self.m_codes[-1].fill_(
                int(torch.bucketize(self.qm.mid.new_zeros(()), self.qm.mid))
            )  # code of 0.0
        self._decayed = [m[lo:hi] for m, runs in zip(self.masters, decay_ranges) for lo, hi in runs]
        # replicated elements of blocks shared with tp-split ones: fp32 moments, outside every absmax
        self.exact: list[torch.Tensor] = []
        self._spans: list[list[tuple[int, int]]] = []  # per chunk of the step: its slice of exact
        self.m_exact: list[torch.Tensor] = []
        self.v_exact: list[torch.Tensor] = []
        for i in range(len(self.params)):
            replicated, split = tp_runs[i] if i < len(tp_runs) else ([], [])
            idx = mixed_elements(replicated, split, store.device)
            self.exact.append(idx)
            self._spans.append(_chunk_spans(idx.tolist(), self.params[i].numel()))
            self.m_exact.append(store.zeros(idx.numel(), f"m_exact{i}"))
            self.v_exact.append(store.zeros(idx.numel(), f"v_exact{i}"))
        self._ckpt: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def bind_groups(self, shard_group: Group, tp_group: Group) -> None:
        """Element-wise (per block of this shard): no statistics cross shards."""

    @property
    def state_bytes(self) -> int:
        """2n + 8·ceil(n/B) per shard of n elements, plus separate fp32 masters."""
        return self.store.nbytes

    @torch.no_grad()
    def checkpoint_buffers(self, i: int) -> list[tuple[str, torch.Tensor]]:
        """Shard i's moments dequantized to fp32, saved as AdamW's ``exp_avg`` / ``exp_avg_sq`` (so an
        8-bit run resumes from an AdamW checkpoint and back, at any layout). Transient: 8 bytes per
        element until the next step or :meth:`checkpoint_loaded`."""
        if i in self._ckpt:  # asked once per parameter of the shard: one pair of buffers
            m, v = self._ckpt[i]
            return [("exp_avg", m), ("exp_avg_sq", v)]
        m = self.qm.dequantize(self.m_codes[i], self.m_absmax[i])
        v = self.qu.dequantize(self.u_codes[i], self.u_absmax[i]).square_()
        m[self.exact[i]], v[self.exact[i]] = self.m_exact[i], self.v_exact[i]
        self._ckpt[i] = (m, v)
        return [("exp_avg", m), ("exp_avg_sq", v)]

    @torch.no_grad()
    def checkpoint_loaded(self) -> None:
        """Quantize the filled fp32 moments into the 8-bit state."""
        for i, (m, v) in self._ckpt.items():
            idx = self.exact[i]
            self.m_exact[i].copy_(m[idx])
            self.v_exact[i].copy_(v[idx])
            m[idx], v[idx] = 0.0, 0.0
            self.qm.quantize(m, self.m_codes[i], self.m_absmax[i])
            self.qu.quantize(v.clamp_(min=0).sqrt_(), self.u_codes[i], self.u_absmax[i])
        self._ckpt.clear()

    @torch.no_grad()
    def step(self, grads: Sequence[torch.Tensor], lr: float, grad_scale: float = 1.0) -> None:
        g32 = self.master.grads32(grads, grad_scale)
        self._ckpt.clear()
        self.step_count += 1
        if self.weight_decay != 0 and self._decayed:
            torch._foreach_mul_(self._decayed, 1 - lr * self.weight_decay)
        bias1 = 1 - self.beta1**self.step_count
        bias2_sqrt = (1 - self.beta2**self.step_count) ** 0.5
        span = CHUNK_BLOCKS * BLOCK
        for i, g in enumerate(g32):
            idx = self.exact[i]
            for c, lo in enumerate(range(0, g.numel(), span)):
                hi = min(g.numel(), lo + span)
                blo, bhi = lo // BLOCK, -(-hi // BLOCK)
                mc, uc = self.m_codes[i][lo:hi], self.u_codes[i][lo:hi]
                ma, ua = self.m_absmax[i][blo:bhi], self.u_absmax[i][blo:bhi]
                m = self.qm.dequantize(mc, ma)
                v = self.qu.dequantize(uc, ua).square_()
                k0, k1 = self._spans[i][c]
                here = idx[k0:k1] - lo  # this chunk's fp32-kept elements
                if k1 > k0:
                    m[here], v[here] = self.m_exact[i][k0:k1], self.v_exact[i][k0:k1]
                gc = g[lo:hi]
                m.lerp_(gc, 1 - self.beta1)
                v.mul_(self.beta2).addcmul_(gc, gc, value=1 - self.beta2)
                if k1 > k0:
                    self.m_exact[i][k0:k1], self.v_exact[i][k0:k1] = m[here], v[here]
                u = v.sqrt_()
                denom = (u / bias2_sqrt).add_(self.eps)
                self.masters[i][lo:hi].addcdiv_(m, denom, value=-lr / bias1)
                if k1 > k0:
                    m[here], u[here] = 0.0, 0.0  # outside the blocks' absmax
                self.qm.quantize(m, mc, ma)
                self.qu.quantize(u, uc, ua)
        self.master.publish()
