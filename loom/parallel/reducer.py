"""Asynchronous gradient reduction into shards: the one reducer of every data-parallel strategy.

A flat gradient of Φ' elements of b bytes is divided by dp (the mean over dp = R·N ranks),
reduce-scattered inside its sharding group of N ranks, and the resulting shard all-reduced
across the R replicas (the whole buffer when N = 1: replicated data parallelism, where the
reduce-scatter is skipped and the buffer reduced in place). Bytes per rank:

    reduce-scatter  Φ'·b·(N-1)/N   +   all-reduce across replicas  2·(Φ'/N)·b·(R-1)/R

Streams (CUDA): a reduction's reduce-scatter is issued from the compute stream (its NCCL stream
waits for the gradient); the all-reduce across replicas is chained to it on a stream of its own
(:class:`CommStream`: that stream waits for the reduce-scatter's work, then issues the
all-reduce), so the compute stream never waits for a reduce-scatter it does not read. The compute
stream waits for a reduction only in :meth:`GradReducer._complete`, where it reads the result (the
copy into the shard; the buffers are freed there too): for bucket i − ``max_inflight`` when
bucket i is launched (the bound on gradient buffers in flight), and for every bucket at
:meth:`GradReducer.drain`. On the CPU (gloo) every wait blocks the host wherever it is issued;
``wait_log`` records each wait's collective, bucket and stream (the event-order model).

The all-reduce across replicas is the one place gradients are all-reduced: the backend's own
(:func:`loom.comm.all_reduce`), or the one the composition root picks for ``parallel.allreduce``
(ring, tree or butterfly on point-to-point, :func:`loom.parallel.allreduce.by_name`; the
all-reduce term above is then the algorithm's own: the tree sends (1 + children)·Φ'/N·b).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
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


class CommStream:
    """The stream a reducer's chained communication runs on: on CUDA one side stream per device
    (created on first use), elsewhere none (the host runs everything in order). ``log`` gets
    (collective, bucket, stream) for every wait: ``"comm"`` inside :meth:`side`, else ``"compute"``."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self.where = "compute"
        self.log: list[tuple[str, int, str]] = []

    @contextlib.contextmanager
    def side(self, device: torch.device) -> Iterator[None]:
        """Inside: work is enqueued on the side stream (CUDA), waits are logged as ``comm``."""
        previous, self.where = self.where, "comm"
        try:
            if device.type == "cuda":
                if device not in self._streams:
                    self._streams[device] = torch.cuda.Stream(device)
                with torch.cuda.stream(self._streams[device]):
                    yield
            else:
                yield
        finally:
            self.where = previous

    def wait(self, work: Any, what: str, bucket: int) -> None:
        """The current stream (the host on the CPU) waits for ``work``."""
        comm.wait(work)
        self.log.append((what, bucket, self.where))


@dataclass
class _Pending:
    work: object | None  # the reduce-scatter over the sharding group
    full: torch.Tensor  # kept alive until the collective completes
    out: torch.Tensor
    dest: torch.Tensor
    transient: int  # bytes alive only while this reduction is in flight
    replica_work: object | None = None  # the all-reduce of the shard across replicas
    replicated: bool = False  # that all-reduce has been issued
    bucket: int = 0  # launch number since the reducer was made (wait_log)


class GradReducer:
    """Asynchronous reduce-scatter of flat gradients into shards, at most ``max_inflight`` at once.

    Overlap: the all-reduce of a shard across replicas is issued asynchronously as soon as the
    next gradient is launched (its reduce-scatter is then issued too; the wait for the earlier one
    orders only the side stream on an accelerator), so with R > 1 every reduction but the last is on
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
        self.stream = CommStream()  # the replica all-reduces' stream; its log is the event-order model
        self.launched = 0

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
        self.inflight.append(_Pending(work, send, out, dest, transient, bucket=self.launched))
        self.launched += 1
        if work is None:  # nothing to wait for: across replicas at once
            self._replicate(self.inflight[-1], during_backward=True)
        while len(self.inflight) > self.max_inflight:
            self._complete(self.inflight.popleft())

    def _replicate(self, p: _Pending, during_backward: bool = False) -> None:
        """Issue the all-reduce of ``p``'s shard across replicas: after its reduce-scatter, chained on
        the side stream (the compute stream does not wait); at once without one (in place)."""
        if p.replicated:
            return
        if comm.group_size(self.replicate_group) == 1:  # no replicas: _complete waits for the reduce-scatter
            p.replicated = True
            return
        if p.work is None:
            p.replica_work = self.all_reduce(p.out, self.replicate_group, meter=self.meter, async_op=True)
        else:
            with self.stream.side(p.out.device):
                self.stream.wait(p.work, "reduce_scatter", p.bucket)
                p.work = None
                p.replica_work = self.all_reduce(p.out, self.replicate_group, meter=self.meter, async_op=True)
        p.replicated = True
        if p.replica_work is not None:
            self.replica_log.append(during_backward)

    def _complete(self, p: _Pending) -> None:
        """The compute stream reads ``p``'s result: it waits for the last collective of ``p``."""
        self._replicate(p)
        if p.replica_work is not None:
            self.stream.wait(p.replica_work, "all_reduce", p.bucket)
        elif p.work is not None:  # one replica: the reduce-scatter is the last
            self.stream.wait(p.work, "reduce_scatter", p.bucket)
            p.work = None
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
