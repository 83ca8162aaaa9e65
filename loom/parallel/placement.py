"""Per-parameter sharding facts, typed and in one place.

Tensor, sequence and expert parallelism change what a local parameter is a piece of; data
parallelism, ZeRO, clipping and checkpoints must know it. Each fact is recorded once, on the
parameter, as a frozen :class:`Placement`, and read only through :func:`placement_of`:

    tp_dim      this rank's contiguous 1/tp slice of the global tensor along that dim
                (None: replicated over tp)
    partial     replicated over tp, but each rank computes only part of its gradient (a
                sequence-parallel norm, a replicated key/value head): summed over tp once a step
    expert      rows [rank·E/ep, (rank+1)·E/ep) of all E experts; its gradient is summed over the
                ``edp`` group (the ranks holding the same experts), its norm over ``ep``
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from loom.comm import CommMeter, Group

_ATTR = "_loom_placement"


@dataclass(frozen=True)
class PartialSum:
    """The tensor-parallel group a partial gradient is summed over, and its meter."""

    group: Group
    meter: CommMeter | None = None


@dataclass(frozen=True)
class ExpertShard:
    """This rank's experts: ``rank`` of ``ep`` expert shards; ``group`` = ep, ``edp`` = same-expert ranks."""

    rank: int
    ep: int
    group: Group
    edp: Group


@dataclass(frozen=True)
class Placement:
    tp_dim: int | None = None
    partial: PartialSum | None = None
    expert: ExpertShard | None = None

    @property
    def tp_sharded(self) -> bool:
        return self.tp_dim is not None


REPLICATED = Placement()


def placement_of(p: torch.Tensor) -> Placement:
    """The placement recorded on ``p`` (replicated everywhere if none)."""
    return getattr(p, _ATTR, REPLICATED)


def place(p: torch.Tensor, **facts) -> torch.Tensor:
    """Record ``facts`` (fields of :class:`Placement`) on ``p``, keeping the others; returns ``p``."""
    setattr(p, _ATTR, replace(placement_of(p), **facts))
    return p


def is_expert(p: torch.Tensor) -> bool:
    return placement_of(p).expert is not None


def expert_shard(p: torch.Tensor) -> ExpertShard:
    """The expert shard ``p`` is (an error if it is none)."""
    e = placement_of(p).expert
    if e is None:
        raise ValueError("not an expert-parallel shard")
    return e


def expert_group(p: torch.Tensor) -> Group:
    """The edp group of an expert shard (the ranks holding the same experts), else None."""
    e = placement_of(p).expert
    return None if e is None else e.edp


def tp_geometry(p: torch.Tensor, tp_rank: int, tp: int) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(global shape, offsets of this rank's slice, or None when whole) of a possibly tp-sharded ``p``."""
    dim = placement_of(p).tp_dim
    if dim is None or tp == 1:
        return tuple(p.shape), None
    shape, offsets = list(p.shape), [0] * p.dim()
    offsets[dim] = tp_rank * shape[dim]
    shape[dim] *= tp
    return tuple(shape), tuple(offsets)


def expert_geometry(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global shape, offsets) of an expert shard: rows [rank·E/ep, (rank+1)·E/ep) of all E experts."""
    e = expert_shard(p)
    return (p.shape[0] * e.ep, *p.shape[1:]), (e.rank * p.shape[0],) + (0,) * (p.dim() - 1)
