"""Thin collectives layer that counts what it moves.

Every collective goes through here with an explicit group and a :class:`CommMeter`. Groups of
size 1 (or ``None``) return at once. Bytes moved per rank are the ring-algorithm volumes,
for a full tensor of S bytes over n ranks:

    all_reduce      2 S (n-1)/n
    reduce_scatter    S (n-1)/n      (S = the full, unscattered input)
    all_gather        S (n-1)/n      (S = the full, gathered output)
    broadcast         S
    send / recv       S
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None


def group_size(group: Group) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def ring_bytes(op: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends for ``op`` on a tensor of ``nbytes`` over ``n`` ranks (ring algorithm)."""
    if n <= 1:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n}
    return nbytes * factor.get(op, 1.0)


@dataclass
class CommMeter:
    """Counts calls, payload bytes and ring bytes-moved per collective kind, reset per step."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    payload: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    moved: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def record(self, op: str, tensor_bytes: int, n: int) -> None:
        self.calls[op] += 1
        self.payload[op] += tensor_bytes
        self.moved[op] += ring_bytes(op, tensor_bytes, n)

    @property
    def total_moved(self) -> float:
        return float(sum(self.moved.values()))

    def snapshot(self) -> dict[str, float]:
        out: dict[str, float] = {f"comm_{k}_bytes": v for k, v in self.moved.items()}
        out |= {f"comm_{k}_calls": c for k, c in self.calls.items()}
        out["comm_bytes"] = self.total_moved
        return out

    def reset(self) -> None:
        self.calls.clear()
        self.payload.clear()
        self.moved.clear()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(t: torch.Tensor, group: Group, meter: CommMeter | None = None, async_op: bool = False):
    """Sum ``t`` in place over ``group``. Returns a work handle when ``async_op`` (else None)."""
    n = group_size(group)
    if n == 1:
        return None
    if meter is not None:
        meter.record("all_reduce", nbytes(t), n)
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_max(t: torch.Tensor, group: Group, meter: CommMeter | None = None) -> None:
    n = group_size(group)
    if n == 1:
        return
    if meter is not None:
        meter.record("all_reduce", nbytes(t), n)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)


def reduce_scatter(
    out: torch.Tensor, full: torch.Tensor, group: Group, meter: CommMeter | None = None, async_op: bool = False
):
    """``out`` = this rank's 1/n slice of the sum of ``full`` over ``group`` (flat, equal slices)."""
    n = group_size(group)
    if n == 1:
        out.copy_(full)
        return None
    if meter is not None:
        meter.record("reduce_scatter", nbytes(full), n)
    return dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather(
    full: torch.Tensor, shard: torch.Tensor, group: Group, meter: CommMeter | None = None, async_op: bool = False
):
    """``full`` = concatenation over ``group`` of every rank's ``shard`` (flat, equal slices)."""
    n = group_size(group)
    if n == 1:
        full.copy_(shard)
        return None
    if meter is not None:
        meter.record("all_gather", nbytes(full), n)
    return dist.all_gather_into_tensor(full, shard, group=group, async_op=async_op)


def batch_p2p(
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
    group: Group,
    meter: CommMeter | None = None,
) -> list:
    """Post isend/irecv to/from group-local peers as one ``batch_isend_irecv``; returns the works
    (sends first, then recvs, in the given order). Messages between two ranks match in post order."""
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=peer) for t, peer in recvs]
    if not ops:
        return []
    if meter is not None:
        for t, _ in sends:
            meter.record("send", nbytes(t), 2)
    return dist.batch_isend_irecv(ops)


def broadcast(t: torch.Tensor, src_local: int, group: Group, meter: CommMeter | None = None) -> None:
    """Broadcast from the ``src_local``-th rank of ``group``."""
    n = group_size(group)
    if n == 1:
        return
    if meter is not None:
        meter.record("broadcast", nbytes(t), n)
    dist.broadcast(t, group_src=src_local, group=group)
