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
    origin      the reference model's parameter this tensor is (a box of): its name, global shape
                and this tensor's [start, stop) per dim, from which a rank materializes only what
                it holds (:mod:`loom.parallel.materialize`); of a padded vocabulary's embedding and
                head also the real rows V of the V' (the rest zeros that no gradient reaches, which
                a statistic over the matrix, as Adafactor's RMS, must not count)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from loom.comm import CommMeter, Group

_ATTR = "_loom_placement"
T = TypeVar("T", bound=torch.Tensor)


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
class Origin:
    """``name`` of the reference model, of global ``shape``; this tensor holds ``box`` of it
    ([start, stop) per dim; None: the whole); ``rows``: the global rows that are real (a padded
    vocabulary's V of shape[0] = V'; None: all)."""

    name: str
    shape: tuple[int, ...]
    box: tuple[tuple[int, int], ...] | None = None
    rows: int | None = None

    def narrowed(self, dim: int, start: int, stop: int) -> Origin:
        """The origin of the [start, stop) slice along ``dim`` of a tensor with this origin."""
        box = list(self.box or ((0, n) for n in self.shape))
        lo = box[dim][0]
        box[dim] = (lo + start, lo + stop)
        return replace(self, box=tuple(box))

    def index(self) -> tuple[slice, ...]:
        """Index of this tensor's values in the global one."""
        return tuple(slice(a, b) for a, b in (self.box or ((0, n) for n in self.shape)))


@dataclass(frozen=True)
class Placement:
    tp_dim: int | None = None
    partial: PartialSum | None = None
    expert: ExpertShard | None = None
    origin: Origin | None = None

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


def slice_of(full: torch.Tensor, dim: int, rank: int, parts: int) -> tuple[torch.Tensor, Placement]:
    """Part ``rank`` of ``parts`` of ``full`` along ``dim`` (``torch.chunk``'s split), and the placement
    its parameter inherits from ``full`` with the origin narrowed to it (set ``tp_dim``/``expert`` on top)."""
    size = -(-full.shape[dim] // parts)
    start, stop = min(rank * size, full.shape[dim]), min((rank + 1) * size, full.shape[dim])
    pl = placement_of(full)
    origin = pl.origin.narrowed(dim, start, stop) if pl.origin is not None else None
    return full.detach().narrow(dim, start, stop - start), replace(pl, origin=origin)


def setattr_placement(p: T, placement: Placement) -> T:
    """Record ``placement`` on ``p`` (replacing what it had); returns ``p``."""
    setattr(p, _ATTR, placement)
    return p


def copy_placement(src: torch.Tensor, dst: T) -> T:
    """``dst`` takes ``src``'s placement (a replicated copy of the same parameter); returns ``dst``."""
    setattr(dst, _ATTR, placement_of(src))
    return dst


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


def expert_geometry(
    p: torch.Tensor, tp_rank: int = 0, tp: int = 1
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global shape, offsets) of an expert shard: rows [rank·E/ep, (rank+1)·E/ep) of all E experts,
    and of a split expert (``tp_dim``, parallel.expert_tp = split) this tp rank's slice of each."""
    e = expert_shard(p)
    shape, tp_offsets = tp_geometry(p, tp_rank, tp)
    offsets = list(tp_offsets or (0,) * p.dim())
    offsets[0] = e.rank * p.shape[0]
    return (p.shape[0] * e.ep, *shape[1:]), tuple(offsets)
