"""Asynchronous gradient reduction into shards: the one reducer of every data-parallel strategy.

A flat gradient of Φ' elements of b bytes is divided by dp (the mean over dp = R·N ranks),
reduce-scattered inside its sharding group of N ranks, and the resulting shard all-reduced
across the R replicas (the whole buffer when N = 1: replicated data parallelism, where the
reduce-scatter is skipped and the buffer reduced in place). Bytes per rank:

    reduce-scatter  Φ'·b·(N-1)/N   +   all-reduce across replicas  2·(Φ'/N)·b·(R-1)/R

The all-reduce across replicas is the one place gradients are all-reduced: the backend's own
(:func:`loom.comm.all_reduce`), or the one the composition root picks for ``parallel.allreduce``
(ring, tree or butterfly on point-to-point, :func:`loom.parallel.allreduce.by_name`; the
all-reduce term above is then the algorithm's own: the tree sends (1 + children)·Φ'/N·b).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from loom import comm
from loom.comm import CommMeter, Group

MAX_INFLIGHT = 2  # full-size gradient buffers in flight at once (beyond the one being filled)


class AllReduce(Protocol):
    """An in-place sum of ``t`` over ``group``, metered on ``meter``; a work handle when ``async_op``."""

    def __call__(
        self, t: torch.Tensor, group: Group, *, meter: CommMeter | None = None, async_op: bool = False
    ) -> Any: ...


@dataclass
class _Pending:
    work: object | None  # the reduce-scatter over the sharding group
    full: torch.Tensor  # kept alive until the collective completes
    out: torch.Tensor
    dest: torch.Tensor
    transient: int  # bytes alive only while this reduction is in flight
    replica_work: object | None = None  # the all-reduce of the shard across replicas
    replicated: bool = False  # that all-reduce has been issued


class GradReducer:
    """Asynchronous reduce-scatter of flat gradients into shards, at most ``max_inflight`` at once.

    Overlap: the all-reduce of a shard across replicas is issued asynchronously as soon as the
    next gradient is launched (its reduce-scatter is then issued too; waiting for the earlier one
    only orders the stream on an accelerator), so with R > 1 every reduction but the last is on
    the wire during backward; with N = 1 (replicated masters) the all-reduce is issued at once.
    Reductions of one group are issued in launch order on every rank, as NCCL requires.
    ``replica_log`` records, per all-reduce issued, whether it was issued before :meth:`drain`.
    """

    def __init__(
        self,
        shard_group: Group,
        replicate_group: Group,
        dp: int,
        meter: CommMeter | None,
        reduce_dtype: torch.dtype | None,
        max_inflight: int = MAX_INFLIGHT,
        all_reduce: AllReduce = comm.all_reduce,
    ) -> None:
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.all_reduce = all_reduce  # the all-reduce across replicas (parallel.allreduce)
        self.dp, self.meter = dp, meter
        self.reduce_dtype = reduce_dtype
        self.max_inflight = max_inflight
        self.inflight: deque[_Pending] = deque()
        self.replica_log: list[bool] = []

    def launch(self, full: torch.Tensor, dest: torch.Tensor, owned: bool = True) -> None:
        """Start dest = shard of (Σ over dp of full) / dp. ``full`` may be divided in place; ``owned``:
        the caller drops it now, so it lives (transiently) until this reduction completes."""
        send = full if self.reduce_dtype in (None, full.dtype) else full.to(self.reduce_dtype)
        send.div_(self.dp)
        if comm.group_size(self.shard_group) == 1 and dest.numel() == send.numel():
            out, work = send, None  # the whole buffer is the shard: reduce it in place across replicas
        else:
            aliased = dest.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
            same = (
                dest.dtype == send.dtype and dest.device == send.device and not aliased
            )  # (host dest: offload)
            out = dest if same else torch.empty_like(dest, dtype=send.dtype, device=send.device)
            work = comm.reduce_scatter(out, send, self.shard_group, self.meter, async_op=True)
        transient = _nbytes(send) if (owned or send is not full) else 0
        transient += _nbytes(out) if (out is not dest and out is not send) else 0
        for p in self.inflight:  # the earlier shards go on to their replicas now
            self._replicate(p, during_backward=True)
        self.inflight.append(_Pending(work, send, out, dest, transient))
        if work is None:  # nothing to wait for: across replicas at once
            self._replicate(self.inflight[-1], during_backward=True)
        while len(self.inflight) > self.max_inflight:
            self._complete(self.inflight.popleft())

    def _replicate(self, p: _Pending, during_backward: bool = False) -> None:
        if p.replicated:
            return
        if p.work is not None:
            comm.wait(p.work)
            p.work = None
        p.replica_work = self.all_reduce(p.out, self.replicate_group, meter=self.meter, async_op=True)
        p.replicated = True
        if p.replica_work is not None:
            self.replica_log.append(during_backward)

    def _complete(self, p: _Pending) -> None:
        self._replicate(p)
        if p.replica_work is not None:
            comm.wait(p.replica_work)
        if p.out is not p.dest:
            p.dest.copy_(p.out)

    @property
    def inflight_bytes(self) -> int:
        return sum(p.transient for p in self.inflight)

    def drain(self) -> None:
        """Wait for every reduction launched so far."""
        while self.inflight:
            self._complete(self.inflight.popleft())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
