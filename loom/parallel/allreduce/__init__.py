"""All-reduce algorithms on point-to-point, chosen by ``parallel.allreduce``.

``native`` is the backend's own ``all_reduce`` (NCCL or gloo pick the algorithm); ``ring``,
``tree`` and ``butterfly`` are written here on ``batch_isend_irecv`` (see their modules for the
schedule, the reduction order and the α-β cost; :mod:`loom.plan.collectives` has the models):

    algorithm   rounds per rank      elements sent per rank       time
    ring        2 (N-1)              2 (N-1)/N · n                2(N-1) α + 2(N-1)/N · S β
    tree        2 ceil(log2 N) (*)   n · (1 + children) (*)       2 ceil(log2 N) (α + S β)
    butterfly   2 log2 N             2 (N-1)/N · n                2 log2 N α + 2(N-1)/N · S β

(*) on the critical path: rank 0 (the root) takes part in every round. S = n·b bytes.

The gradient reduction (:class:`loom.parallel.reducer.GradReducer`) is the one caller in
training: the composition root hands it :func:`by_name` of ``parallel.allreduce``. The point-to-point algorithms run synchronously: an ``async_op`` call returns a
handle already complete (on an accelerator the rounds are only enqueued: each wait orders the
current stream after the transfer, without blocking the host).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from functools import partial

import torch

from loom import comm
from loom.comm import CommMeter, Group
from loom.parallel.allreduce.butterfly import butterfly_all_reduce
from loom.parallel.allreduce.p2p import Trace, split_bounds
from loom.parallel.allreduce.ring import ring_all_reduce
from loom.parallel.allreduce.tree import tree_all_reduce
from loom.parallel.reducer import AllReduce
from loom.rules import AllReduceName

ALGORITHMS: dict[str, Callable[[torch.Tensor, Group, Trace], None]] = {
    "ring": ring_all_reduce,
    "tree": tree_all_reduce,
    "butterfly": butterfly_all_reduce,
}

__all__ = ["ALGORITHMS", "AllReduceName", "Trace", "all_reduce", "by_name", "split_bounds"]


class Completed:
    """The handle of an all-reduce that has already run (the point-to-point algorithms)."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def all_reduce(
    t: torch.Tensor,
    group: Group,
    algorithm: str = "native",
    meter: CommMeter | None = None,
    async_op: bool = False,
    trace: Trace | None = None,
):
    """Sum ``t`` in place over ``group`` with ``algorithm``; a work handle when ``async_op``.

    ``meter`` records one ``all_reduce`` of ``t``: the ring volume for ``native`` (what
    :class:`~loom.comm.CommMeter` assumes of the backend), the bytes this rank sent, counted, for
    the others. ``trace`` (point-to-point algorithms) accumulates rounds and bytes of this rank."""
    if algorithm == "native":
        return comm.all_reduce(t, group, meter, async_op=async_op)
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"all_reduce: unknown algorithm {algorithm!r}; one of native, {', '.join(ALGORITHMS)}"
        )
    if comm.group_size(group) == 1:
        return None
    comm.check_tensors(f"all_reduce[{algorithm}]", group, t)
    trace = trace if trace is not None else Trace()
    before = trace.sent
    flat = t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)
    ALGORITHMS[algorithm](flat, group, trace)
    if not t.is_contiguous():
        t.copy_(flat.view_as(t))
    if meter is not None:
        meter.record_sent("all_reduce", comm.nbytes(t), trace.sent - before)
    return Completed() if async_op else None


def by_name(algorithm: str) -> AllReduce:
    """The all-reduce of ``parallel.allreduce`` = ``algorithm``, as the data-parallel strategies take it."""
    if algorithm == "native":
        return comm.all_reduce
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"all_reduce: unknown algorithm {algorithm!r}; one of native, {', '.join(ALGORITHMS)}"
        )
    return partial(all_reduce, algorithm=algorithm)
