"""The rounds every point-to-point all-reduce is made of, and what they move.

A round is one ``batch_isend_irecv`` of this rank (through :func:`loom.comm.batch_p2p`: strict
mode checks the tensors and runs a group's batches in issue order, as NCCL's stream does), waited
for before the next one starts. Peers are group-local ranks (``group_peer``: torch maps them to
global ranks with ``dist.get_global_rank``). Both sides of a message compute its size from the
same split, so a receive always matches its send; zero-element messages are not posted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from loom import comm
from loom.comm import Group


@dataclass
class Trace:
    """What this rank's all-reduces did: rounds it took part in, bytes it sent and received."""

    rounds: int = 0
    sent: int = 0
    received: int = 0


def exchange(
    group: Group, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], trace: Trace
) -> None:
    """One round: post ``sends`` and ``recvs`` (tensor, group-local peer) as one batch and wait for it."""
    sends = [(t, p) for t, p in sends if t.numel()]
    recvs = [(t, p) for t, p in recvs if t.numel()]
    if not sends and not recvs:
        return
    for work in comm.batch_p2p(sends, recvs, group):
        comm.wait(work)
    trace.rounds += 1
    trace.sent += sum(comm.nbytes(t) for t, _ in sends)
    trace.received += sum(comm.nbytes(t) for t, _ in recvs)


def split_bounds(numel: int, parts: int) -> list[int]:
    """Offsets of ``parts`` contiguous chunks of ``numel`` elements, sizes differing by at most one
    (the first ``numel % parts`` one larger): chunk c is [bounds[c], bounds[c+1])."""
    base, extra = divmod(numel, parts)
    bounds = [0]
    for c in range(parts):
        bounds.append(bounds[-1] + base + (c < extra))
    return bounds


def local_rank(group: Group) -> int:
    """This rank's index in ``group``."""
    return dist.get_rank(group)
