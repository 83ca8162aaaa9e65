"""A training mixture from ``[[data.sources]]``: each source's prepared tokens and the weighted sampler.

Global sequence g comes from source k with C_k <= u_g < C_{k+1} (C: cumulative normalized weights),
where u_g = frac(o + φ·g) (o from the seed, φ the golden ratio's fraction): a low-discrepancy
sequence, so over any n consecutive sequences each source's count is within O(log n) of weight·n.
If g is the i-th sequence of source k (i = c_k(g), the count of k among [0, g)), its window is
``perm_{k,e}[i mod n_k]`` of that source's epoch e = i // n_k (n_k windows, a permutation seeded by
(seed, k)): every window of a source once per epoch of that source, independently of the others.

The data position is g and the counts c_k(g) (kept in checkpoints, so a resume does not rescan
[0, g)); both depend only on g, so any dp size, micro-batch split or changed global batch that
continues at the same g draws the same sources, and the weights hold across a resume.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from loom.config import LoomConfig
from loom.data.dataset import SHARE_ABOVE, Batch, BatchSampler, TokenDataset, window_order
from loom.data.prepare import prepare_sources

log = logging.getLogger("loom")

PHI = (5**0.5 - 1) / 2  # fractional part of the golden ratio
SCAN_BLOCK = 1 << 20  # sequences classified per block when counting sources over a range


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on uint64 values: a seeded hash, vectorized (wraps modulo 2^64)."""
    with np.errstate(over="ignore"):
        x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class MixtureSampler(BatchSampler):
    """Batches mixing several sources by weight (see module doc), with :class:`BatchSampler`'s rank
    slicing and resume point, so any layout sees the same global batch."""

    def __init__(
        self,
        datasets: list[TokenDataset],
        weights: list[float],
        global_batch: int,
        micro_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        share_above: int = SHARE_ABOVE,
    ) -> None:
        super().__init__(datasets[0], global_batch, micro_batch, dp_rank, dp_size, seed, share_above)
        if len(weights) != len(datasets) or not all(w > 0 for w in weights):
            raise ValueError(f"data.sources: need one positive weight per source, got {weights}")
        self.datasets = datasets
        self.weights = [float(w) / sum(weights) for w in weights]
        self.cum = np.cumsum(np.asarray(weights, dtype=np.float64) / sum(weights))
        self.offset = float(mix64(np.array([seed], dtype=np.uint64))[0] >> np.uint64(11)) / 2**53
        self.source_seeds = [
            int(np.random.SeedSequence([seed, k]).generate_state(1, dtype=np.uint32)[0])
            for k in range(len(datasets))
        ]
        zero = np.zeros(len(datasets), dtype=np.int64)
        self._base: tuple[int, np.ndarray] = (0, zero)  # counts known at the resume point
        self._last: tuple[int, np.ndarray] = (0, zero)  # the latest counts computed
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    def sources_of(self, g: np.ndarray) -> np.ndarray:
        """Source index of global sequences ``g``."""
        u = np.mod(self.offset + PHI * g.astype(np.float64), 1.0)
        return np.minimum(np.searchsorted(self.cum, u, side="right"), len(self.datasets) - 1)

    def _counts(self, lo: int, hi: int) -> np.ndarray:
        """Sequences of each source among global sequences ``[lo, hi)``."""
        out = np.zeros(len(self.datasets), dtype=np.int64)
        for a in range(lo, hi, SCAN_BLOCK):
            g = np.arange(a, min(hi, a + SCAN_BLOCK), dtype=np.int64)
            out += np.bincount(self.sources_of(g), minlength=len(self.datasets))
        return out

    def consumed(self, g: int) -> list[int]:
        """c_k(g) for every source: counted forward from the latest known counts (one step's rows
        when called step after step), or from the resume point's."""
        start, counts = self._last if self._last[0] <= g else self._base
        if g < start:
            raise ValueError(f"global sequence {g} is before this sampler's resume point, {start}")
        self._last = (g, counts + self._counts(start, g))
        return [int(c) for c in self._last[1]]

    def _order(self, k: int, epoch: int) -> np.ndarray:
        if (k, epoch) not in self._orders:
            if len(self._orders) >= 2 * len(self.datasets):
                self._orders.clear()
            self._orders[k, epoch] = window_order(
                self.datasets[k], self.source_seeds[k], epoch, self.share_above
            )
        return self._orders[k, epoch]

    def picks(self, step: int) -> list[tuple[int, int]]:
        """(source, window) of this rank's rows of ``step``."""
        first = self._first_row(step)
        src = self.sources_of(np.arange(first, first + self.rows_per_rank, dtype=np.int64))
        before = self.consumed(first)
        windows = np.empty(len(src), dtype=np.int64)
        for k in np.unique(src):
            rows = np.flatnonzero(src == k)
            i = before[k] + np.arange(len(rows))  # the i-th sequence of source k
            n = self.datasets[k].n_windows
            windows[rows] = [self._order(int(k), int(j // n))[j % n] for j in i]
        return [(int(k), int(w)) for k, w in zip(src, windows)]

    def sample_ids(self, step: int) -> np.ndarray:
        return np.asarray(self.picks(step), dtype=np.int64).reshape(-1, 2)

    def realized(self, steps: int) -> np.ndarray:
        """Share of each source among the global sequences of steps [0, steps)."""
        counts = self._counts(0, steps * self.global_batch)
        return counts / max(1, counts.sum())

    def micro_batches(self, step: int) -> list[Batch]:
        picks, mb = self.picks(step), self.micro_batch
        rows = [self.datasets[k].batch([w]) for k, w in picks]
        return [tuple(torch.cat(parts) for parts in zip(*rows[i : i + mb])) for i in range(0, len(rows), mb)]

    def sources(self) -> list[dict]:
        return [
            {"name": str(d.path.parent), "sha256": d.digest, "windows": d.n_windows, "weight": w}
            for d, w in zip(self.datasets, self.weights)
        ]

    def _restored(self, saved: dict, g: int) -> None:
        """The resume point's counts: the saved ones, or (an older record) counted over [0, g)."""
        sources = saved.get("sources")
        if isinstance(sources, list) and all(isinstance(s.get("consumed"), int) for s in sources):
            counts = np.array([s["consumed"] for s in sources], dtype=np.int64)
        else:
            counts = self._counts(0, g)
        self._base = self._last = (g, counts)


def mixture_sampler(cfg: LoomConfig, dp_rank: int, dp: int, pack_eot: int | None = None) -> MixtureSampler:
    """The :class:`MixtureSampler` over every source's ``train.bin``; logs each source's token count,
    its weight and the share of sequences it gets over the run's ``train.steps`` (the realized mixture)."""
    prepared = prepare_sources(cfg.data, progress=False)
    sets = [TokenDataset(p.train_path, cfg.data.seq_len, pack_eot=pack_eot) for p in prepared]
    weights = [s.weight for s in cfg.data.sources]
    sampler = MixtureSampler(
        sets, weights, cfg.train.global_batch, cfg.train.micro_batch, dp_rank, dp, cfg.train.seed
    )
    realized = sampler.realized(cfg.train.steps)
    for i, (src, p, share) in enumerate(zip(cfg.data.sources, prepared, realized)):
        log.info(
            "mixture source %d %s: %s train tokens, weight %.3f, realized %.4f of %d sequences",
            i,
            src.path,
            f"{p.n_train_tokens:,}",
            src.weight / sum(weights),
            share,
            cfg.train.steps * cfg.train.global_batch,
        )
    return sampler
