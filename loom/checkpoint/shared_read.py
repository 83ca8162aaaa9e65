"""Replicated state read once per replica group: each of n holders reads 1/n from disk, then they all-gather.

The ``n`` ranks of a :class:`~loom.checkpoint.protocol.ReadGroup` hold the same pieces (data-parallel
replicas). Rank ``j`` reads from disk only share ``j`` of ``n`` of each piece (the save's split:
rows of a box, or a slice of a flat range; see :func:`~loom.checkpoint.regions.share`), so a
resume under the layout that saved reads back exactly the file each rank wrote. The shares are
packed into one byte buffer per bucket (each padded to the largest share of its tensor, 8-byte
aligned) and one ``all_gather`` over the group, on the group's device, hands every rank all of them.

Per rank, for S bytes of state replicated over the group (pieces of R rows, R ≥ n):

    read from disk        ≈ S / n          (exactly Σ_t |share(t, j, n)|)
    all-gather (ring)     ≈ S · (n-1)/n    moved, in buckets of at most BUCKET_BYTES gathered

instead of S read by every rank. Every member must pass the same pieces (same names, regions,
dtypes): replicas do by definition.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from loom import comm
from loom.checkpoint.protocol import Box, ReadGroup, Region, ShardedTensor
from loom.checkpoint.regions import share, take

BUCKET_BYTES = 256 << 20  # most bytes gathered by one all_gather (a larger single tensor goes alone)
ALIGN = 8

Reader = Callable[[str, Region, torch.Tensor], None]  # fill tensor with region of name, from disk


def _shape(region: Region) -> tuple[int, ...]:
    return region.lengths if isinstance(region, Box) else (region.length,)


def _padded(st: ShardedTensor, n: int) -> int:
    """Bytes one rank contributes for ``st``: its largest share, rounded up to ALIGN."""
    most = max((p.numel for j in range(n) if (p := share(st.region, st.global_shape, j, n))), default=0)
    nbytes = most * st.local.element_size()
    return nbytes + (-nbytes % ALIGN)


def group_order(rg: ReadGroup) -> tuple[int, ...]:
    """A global order of groups (their global ranks): every rank runs its groups in this order,
    so ranks in several groups never wait on each other in a cycle."""
    return tuple(dist.get_process_group_ranks(rg.group)) if rg.group is not None else ()


def fill_shared(entries: list[tuple[str, ShardedTensor]], rg: ReadGroup, read: Reader) -> int:
    """Fill every entry's ``local`` (see module doc); return the bytes this rank read from disk."""
    entries = sorted(entries, key=lambda e: e[0])
    sizes = [_padded(st, rg.size) for _, st in entries]
    done, start, total = 0, 0, 0
    for k in range(len(entries) + 1):
        if k == len(entries) or (k > start and (total + sizes[k]) * rg.size > BUCKET_BYTES):
            if k > start:
                done += _bucket(entries[start:k], sizes[start:k], rg, read)
            start, total = k, 0
        if k < len(entries):
            total += sizes[k]
    return done


def _bucket(entries: list[tuple[str, ShardedTensor]], sizes: list[int], rg: ReadGroup, read: Reader) -> int:
    n, j = rg.size, rg.rank
    width = sum(sizes)
    mine = torch.zeros(width, dtype=torch.uint8)
    nread, off = 0, 0
    for (name, st), size in zip(entries, sizes):
        part = share(st.region, st.global_shape, j, n)
        if part is not None and part.numel:
            nbytes = part.numel * st.local.element_size()
            read(name, part, mine[off : off + nbytes].view(st.local.dtype).view(_shape(part)))
            nread += nbytes
        off += size
    if width == 0:
        return 0
    everyone = torch.empty(n * width, dtype=torch.uint8, device=rg.device)
    comm.all_gather(everyone, mine.to(rg.device), rg.group)
    off = 0
    for (_, st), size in zip(entries, sizes):
        for i in range(n):
            part = share(st.region, st.global_shape, i, n)
            if part is None or not part.numel:
                continue
            at = i * width + off
            src = everyone[at : at + part.numel * st.local.element_size()].view(st.local.dtype)
            dst = take(st.local, st.region, part)
            dst.copy_(src.view(dst.shape))
        off += size
    return nread
