"""Tree all-reduce: binomial-tree reduce to rank 0, then binomial-tree broadcast from it.

Reduce, for d = 1, 2, 4, ... < N: rank r with r mod 2d = d sends its partial sum to r-d (and is
done); rank r with r mod 2d = 0 and r+d < N adds the one from r+d. Broadcast mirrors it, d from
the largest power of two below N down to 1: r mod 2d = 0 sends the sum to r+d (if < N), which
receives it. Whole tensors travel (no pipelining), so with L = ceil(log2 N):

    rounds      2 L   on the critical path (rank 0 takes part in all of them; a leaf in 2)
    elements    n · (1 + children(r)) sent by rank r ≠ 0, n · children(0) by rank 0, where
                children(r) = #{d = 2^k < lowbit(r) (any d for r = 0) : r + d < N};
                2 (N-1) · n over all ranks
    time        2 L (α + n·b · β)

It wins on latency at small messages and many ranks, and loses on bandwidth to the ring and the
butterfly (L·n against (N-1)/N·n per phase) at large ones.

Reduction order: y_r ← y_r + y_{r+d} for d = 1, 2, 4, ... (ranks with r mod 2d = 0); the result
is y_0, e.g. ((x_0 + x_1) + (x_2 + x_3)) for N = 4 and (x_0 + x_1) + x_2 for N = 3.
"""

from __future__ import annotations

import torch

from loom import comm
from loom.comm import Group
from loom.parallel.allreduce.p2p import Trace, exchange, local_rank


def tree_all_reduce(x: torch.Tensor, group: Group, trace: Trace) -> None:
    """Sum the flat contiguous ``x`` in place over ``group`` (see the module doc)."""
    n, r = comm.group_size(group), local_rank(group)
    buf = torch.empty_like(x) if r % 2 == 0 and r + 1 < n else None  # only ranks with a child receive
    d = 1
    while d < n:
        if r % (2 * d) == d:
            exchange(group, [(x, r - d)], [], trace)
            break
        if r + d < n:
            assert buf is not None
            exchange(group, [], [(buf, r + d)], trace)
            x.add_(buf)
        d *= 2
    del buf
    d = 1 << ((n - 1).bit_length() - 1)  # the largest power of two below n
    while d >= 1:
        if r % (2 * d) == 0 and r + d < n:
            exchange(group, [(x, r + d)], [], trace)
        elif r % (2 * d) == d:
            exchange(group, [], [(x, r - d)], trace)
        d //= 2
