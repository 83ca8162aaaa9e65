"""α-β cost model of the all-reduce algorithms (``parallel.allreduce``, :mod:`loom.parallel.allreduce`).

One all-reduce of S bytes over N ranks; α is the cost of one round (latency, seconds), β the
seconds per byte of one link; a round moves one message per rank and direction, so its time is
α + (bytes of its largest message)·β. With L = ceil(log2 N):

    algorithm   rounds R      bytes on the critical path V     time T = R α + V β
    ring        2 (N-1)       2 (N-1)/N · S                   2 (N-1) α + 2 (N-1)/N · S β
    tree        2 L           2 L · S                         2 L (α + S β)
    butterfly   2 log2 N      2 (N-1)/N · S                   2 log2 N α + 2 (N-1)/N · S β
    native      modelled as the ring (the volumes :class:`loom.comm.CommMeter` and the planner's
                :class:`~loom.plan.hardware.Machine` assume of the backend)

The tree moves whole tensors (binomial reduce, then broadcast; no pipelining), hence its
V = 2 L S. Bytes a rank *sends* (what the runtime counts): ring and butterfly 2 (N-1)/N · S on
every rank; tree S · (1 + children(r)) for r ≠ 0 and S · children(0) for the root, where
children(r) = #{d = 2^k : (r = 0 or d < lowbit(r)) and r + d < N}. The cost of the additions
(γ per byte) is folded into β. :func:`fit` finds α and β of an algorithm from measured times.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

ALGORITHMS = ("native", "ring", "tree", "butterfly")


def _check(algorithm: str, n: int) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"all-reduce algorithm: must be one of {' | '.join(ALGORITHMS)}, got {algorithm!r}")
    if n < 1:
        raise ValueError(f"all-reduce over {n} ranks: need at least one")
    if algorithm == "butterfly" and n & (n - 1):
        raise ValueError(f"butterfly all-reduce needs a power-of-two group, got {n} ranks")


def _levels(n: int) -> int:
    """L = ceil(log2 n)."""
    return (n - 1).bit_length()


def rounds(algorithm: str, n: int) -> int:
    """R: rounds on the critical path (ring 2(N-1), tree and butterfly 2 ceil(log2 N))."""
    _check(algorithm, n)
    if n == 1:
        return 0
    return 2 * (n - 1) if algorithm in ("native", "ring") else 2 * _levels(n)


def volume(algorithm: str, size: float, n: int) -> float:
    """V: bytes on the critical path (ring, butterfly 2(N-1)/N·S; tree 2 ceil(log2 N)·S)."""
    _check(algorithm, n)
    if n == 1:
        return 0.0
    if algorithm == "tree":
        return 2.0 * _levels(n) * size
    return 2.0 * (n - 1) / n * size


def children(rank: int, n: int) -> int:
    """Children of ``rank`` in the binomial tree rooted at rank 0 over ``n`` ranks."""
    low = rank & -rank if rank else n
    return sum(1 for k in range(_levels(n)) if (1 << k) < low and rank + (1 << k) < n)


def bytes_sent(algorithm: str, size: float, n: int, rank: int) -> float:
    """Bytes ``rank`` sends in one all-reduce of ``size`` bytes (N | elements for ring and butterfly)."""
    _check(algorithm, n)
    if n == 1:
        return 0.0
    if algorithm == "tree":
        return size * ((rank != 0) + children(rank, n))
    return 2.0 * (n - 1) / n * size


def time(algorithm: str, size: float, n: int, alpha: float, beta: float) -> float:
    """T = R·α + V·β seconds for one all-reduce of ``size`` bytes over ``n`` ranks (module doc)."""
    return rounds(algorithm, n) * alpha + volume(algorithm, size, n) * beta


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted model: α (s per round), β (s per byte), the fit's worst and median relative errors."""

    alpha: float
    beta: float
    max_rel_error: float
    median_rel_error: float = 0.0

    @property
    def bandwidth(self) -> float:
        """1/β: bytes per second of a link."""
        return 1.0 / self.beta if self.beta > 0 else math.inf


def fit(algorithm: str, points: Sequence[tuple[int, float, float]]) -> AlphaBeta:
    """α, β >= 0 minimising the relative error of T = R(N)·α + V(S, N)·β over measured
    ``points`` (ranks N, bytes S, seconds t): weighted least squares, weights 1/t, so a 1 KB
    latency counts as much as a 64 MB one; a negative coefficient is pinned to 0 and the other refitted."""
    rows = [(rounds(algorithm, n), volume(algorithm, s, n), t) for n, s, t in points if n > 1 and t > 0]
    if len(rows) < 2:
        raise ValueError(f"fit: need measurements at two sizes or more, got {len(rows)}")

    def one(col: int) -> float:  # t = c·x, weighted: c = Σ x/t / Σ (x/t)²
        den = sum((r[col] / r[2]) ** 2 for r in rows)
        return max(0.0, sum(r[col] / r[2] for r in rows) / den) if den > 0 else 0.0

    a11 = sum((r[0] / r[2]) ** 2 for r in rows)
    a12 = sum(r[0] * r[1] / r[2] ** 2 for r in rows)
    a22 = sum((r[1] / r[2]) ** 2 for r in rows)
    b1 = sum(r[0] / r[2] for r in rows)
    b2 = sum(r[1] / r[2] for r in rows)
    det = a11 * a22 - a12 * a12
    alpha, beta = ((b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det) if det > 0 else (-1.0, -1.0)
    if alpha < 0 or beta < 0:
        alpha, beta = (0.0, one(1)) if alpha < 0 else (one(0), 0.0)
    errs = sorted(abs(alpha * r + beta * v - t) / t for r, v, t in rows)
    return AlphaBeta(alpha, beta, errs[-1], errs[len(errs) // 2])
