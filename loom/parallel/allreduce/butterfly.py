"""Butterfly all-reduce: recursive halving (reduce-scatter) then recursive doubling (all-gather).

N must be a power of two (``parallel.allreduce = butterfly`` is refused at config time otherwise;
no silent fallback). Reduce-scatter, for m = N/2, N/4, ..., 1: rank r and its partner r XOR m
hold the same segment; each sends one half of it to the other and adds the half it keeps (the
lower half if r AND m = 0), so rank r ends with chunk r of N, fully summed. All-gather replays
the steps backwards (m = 1, 2, ..., N/2), sending the segment kept and receiving the one given.
Per rank, with L = log2 N:

    rounds      2 L
    elements    2 (N-1)/N · n sent (halves of halves: n/2 + n/4 + ... + n/N per phase)
    time        2 L α + 2 (N-1)/N · n·b · β

Reduction order (the same for every element): y_r ← y_r + y_{r XOR m} for m = N/2, N/4, ..., 1;
the result is y_0, e.g. (x_0 + x_2) + (x_1 + x_3) for N = 4.
"""

from __future__ import annotations

import torch

from loom import comm
from loom.comm import Group
from loom.parallel.allreduce.p2p import Trace, exchange, local_rank


def butterfly_all_reduce(x: torch.Tensor, group: Group, trace: Trace) -> None:
    """Sum the flat contiguous ``x`` in place over ``group`` of 2^L ranks (see the module doc)."""
    n, r = comm.group_size(group), local_rank(group)
    if n & (n - 1):
        raise ValueError(f"butterfly all-reduce needs a power-of-two group, got {n} ranks; use ring or tree")
    lo, hi = 0, x.numel()
    buf = torch.empty((hi + 1) // 2, dtype=x.dtype, device=x.device)
    steps: list[tuple[int, tuple[int, int], tuple[int, int]]] = []
    m = n // 2
    while m >= 1:
        peer, mid = r ^ m, (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if r & m == 0 else ((mid, hi), (lo, mid))
        incoming = buf[: keep[1] - keep[0]]
        exchange(group, [(x[give[0] : give[1]], peer)], [(incoming, peer)], trace)
        x[keep[0] : keep[1]].add_(incoming)
        steps.append((peer, keep, give))
        lo, hi = keep
        m //= 2
    for peer, keep, give in reversed(steps):
        exchange(group, [(x[keep[0] : keep[1]], peer)], [(x[give[0] : give[1]], peer)], trace)
