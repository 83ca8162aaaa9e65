"""Ring all-reduce: reduce-scatter then all-gather around the ring r -> r+1 (mod N).

The flat tensor of n elements is cut into N chunks (:func:`~.p2p.split_bounds`). Reduce-scatter,
step s = 0..N-2: rank r sends chunk (r-s) mod N to r+1 and adds chunk (r-s-1) mod N from r-1;
rank r then holds the sum of chunk (r+1) mod N. All-gather, step s: rank r sends chunk
(r+1-s) mod N and receives chunk (r-s) mod N in place. Per rank:

    rounds      2 (N-1)
    elements    2 (N-1)/N · n   sent (exactly 2n - |chunk (r+1)| - |chunk (r+2)| when N ∤ n)
    time        2 (N-1) α + 2 (N-1)/N · n·b · β

Reduction order: chunk c = ((x_c + x_{c+1}) + x_{c+2}) + ... + x_{c-1} (ranks mod N, starting
at rank c); floating-point addition commutes, so every rank ends with the same bits.
"""

from __future__ import annotations

import torch

from loom import comm
from loom.comm import Group
from loom.parallel.allreduce.p2p import Trace, exchange, local_rank, split_bounds


def ring_all_reduce(x: torch.Tensor, group: Group, trace: Trace) -> None:
    """Sum the flat contiguous ``x`` in place over ``group`` (see the module doc)."""
    n, r = comm.group_size(group), local_rank(group)
    bounds = split_bounds(x.numel(), n)

    def chunk(c: int) -> torch.Tensor:
        return x[bounds[c] : bounds[c + 1]]

    nxt, prv = (r + 1) % n, (r - 1) % n
    buf = torch.empty(bounds[1] - bounds[0], dtype=x.dtype, device=x.device)
    for s in range(n - 1):
        send, recv = (r - s) % n, (r - s - 1) % n
        incoming = buf[: chunk(recv).numel()]
        exchange(group, [(chunk(send), nxt)], [(incoming, prv)], trace)
        chunk(recv).add_(incoming)
    for s in range(n - 1):
        exchange(group, [(chunk((r + 1 - s) % n), nxt)], [(chunk((r - s) % n), prv)], trace)
