"""ParallelMesh: every parallel dimension, its process groups, and this rank's coordinates.

Mesh dimensions, outermost first: ``pp, dp_replicate, dp_shard, cp, tp``.

    world = pp * dp * cp * tp,   dp = dp_replicate * dp_shard,   ep | dp * cp.

``tp`` is innermost so tensor-parallel peers are neighbouring ranks (same node); ``pp`` is
outermost so pipeline stages span nodes. Expert parallelism borrows ranks from ``dp * cp``.
:class:`ParallelDims` is the pure arithmetic (testable for any world size without processes);
:class:`ParallelMesh` adds the process groups, built once from a ``DeviceMesh``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property

import torch.distributed as dist

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLATTENED = {  # flattened groups: name -> size
    "dp": lambda d: d.dp,
    "dp_cp": lambda d: d.dp * d.cp,
    "dp_shard_cp": lambda d: d.dp_shard * d.cp,
    "ep": lambda d: d.ep,  # expert parallel: ranks whose experts together make all of them
    "edp": lambda d: d.dp * d.cp // d.ep,  # expert data parallel: the ranks holding the same experts
}

TWIN_DIMS = {  # flattened groups that have a twin (ParallelMesh.twin): name -> the dimensions it spans
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"),
}


def can_split() -> bool:
    """Whether the default group can split communicators (NCCL bound to a device, torch >= 2.6): then
    :func:`split_groups` makes a whole colouring in one collective instead of one per group."""
    if not hasattr(dist, "split_group") or not dist.is_initialized():
        return False
    world = dist.group.WORLD
    device = getattr(world, "bound_device_id", None)
    if world is None or device is None:
        return False
    try:
        backend = world._get_backend(device)
    except RuntimeError:  # no backend for that device
        return False
    return bool(getattr(backend, "supports_splitting", False))


def split_groups(colouring: Sequence[Sequence[int]], rank: int, **kwargs) -> dist.ProcessGroup | None:
    """One process group per list of ``colouring`` (disjoint lists of global ranks); returns the one
    holding ``rank`` (None if none does). Every rank calls it with the same colouring.

    Where the backend splits (:func:`can_split`), one ``dist.split_group`` (one world-wide
    collective) creates them all; elsewhere (gloo, the fake group) one ``dist.new_group`` per list,
    in order, each a world-wide step. ``kwargs`` (``timeout``) go to either."""
    lists = [sorted(int(r) for r in ranks) for ranks in colouring]
    seen: set[int] = set()
    for ranks in lists:
        if seen.intersection(ranks) or len(set(ranks)) != len(ranks):
            raise ValueError(f"split_groups: the lists of a colouring must be disjoint, got {lists}")
        seen.update(ranks)
    if can_split():
        return dist.split_group(split_ranks=lists, **kwargs)
    mine = None
    for ranks in lists:
        group = dist.new_group(ranks, **kwargs)
        if rank in ranks:
            mine = group
    return mine


def world_gloo_group(timeout: timedelta) -> dist.ProcessGroup:
    """A gloo group over every rank (host-side control: long waits, JSON, checkpoint agreement) whose
    pairs connect on first use (``TORCH_GLOO_LAZY_INIT``): a gloo group connects every pair when
    made, a full mesh of world - 1 sockets per rank (16,384 ranks: 1.3e8 connections for each such
    group); lazily a rank connects only to the peers its collectives reach (a ring's two
    neighbours, a tree's parent and children). The variable is set around the creation only."""
    before = os.environ.get(LAZY_GLOO)
    os.environ[LAZY_GLOO] = "1"
    try:
        return dist.new_group(backend="gloo", timeout=timeout)
    finally:
        if before is None:
            del os.environ[LAZY_GLOO]
        else:
            os.environ[LAZY_GLOO] = before


LAZY_GLOO = "TORCH_GLOO_LAZY_INIT"


def link_colour(src: int, dst: int, pp: int) -> tuple[int, int]:
    """The colouring of pipeline link ``src -> dst`` (neighbours on the ring of ``pp`` stages):
    (direction, colour), the links of one colouring being disjoint pairs. Forward links
    ``s -> s+1`` and backward ones ``s+1 -> s`` are coloured apart, each by the parity of ``s``
    (an odd ring's closing edge ``pp-1 -> 0`` gets a third colour): 2·2 colourings for even ``pp``,
    2·3 for odd ``pp >= 3``, 2 for ``pp = 2`` (its two links are both forward: s = 0 and s = 1)."""
    forward = dst == (src + 1) % pp
    s = src if forward else dst
    colour = 2 if pp % 2 and pp > 1 and s == pp - 1 else s % 2
    return (0 if forward else 1), colour


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of every dimension; validated on construction."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ParallelDims.{name}: must be a positive integer, got {v!r}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"ParallelDims.ep: {self.ep} must divide dp*cp = {self.dp * self.cp}")

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in MESH_DIMS)

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` along every mesh dimension (row-major, tp fastest)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        out: dict[str, int] = {}
        rem = rank
        for name, size in zip(reversed(MESH_DIMS), reversed(self.shape)):
            out[name] = rem % size
            rem //= size
        out = {d: out[d] for d in MESH_DIMS}
        out["dp"] = out["dp_replicate"] * self.dp_shard + out["dp_shard"]
        return out

    def group_ranks(self, rank: int, dims: tuple[str, ...]) -> list[int]:
        """Global ranks sharing every coordinate of ``rank`` except those in ``dims``."""
        c = self.coords(rank)
        sizes = dict(zip(MESH_DIMS, self.shape))
        strides: dict[str, int] = {}
        s = 1
        for name in reversed(MESH_DIMS):
            strides[name] = s
            s *= sizes[name]
        base = rank - sum(c[d] * strides[d] for d in dims)
        ranks = [base]
        for d in dims:
            ranks = [r + i * strides[d] for r in ranks for i in range(sizes[d])]
        return sorted(ranks)

    @classmethod
    def from_config(cls, p) -> ParallelDims:  # p: loom.config.ParallelConfig (resolved)
        return cls(dp_replicate=p.dp // p.dp_shard, dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep)


class ParallelMesh:
    """Process groups for every dimension, created once and passed explicitly.

    ``group(name)`` accepts a mesh dimension or ``"dp"`` (replicate and shard flattened).
    With a world of one process (no ``torch.distributed``), every group is ``None`` and
    every size is 1, so single-process code runs through the same paths.
    """

    def __init__(self, dims: ParallelDims, device_type: str = "cpu") -> None:
        self.dims = dims
        self.device_type = device_type
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        world = dist.get_world_size() if self.distributed else 1
        if world != dims.world_size:
            raise ValueError(
                f"mesh {dict(zip(MESH_DIMS, dims.shape))} has {dims.world_size} ranks but the world has {world}"
            )
        self.coords = dims.coords(self.rank)
        self.coords["ep"], self.coords["edp"] = 0, self.coords["dp"] * dims.cp + self.coords["cp"]  # ep = 1
        self._device_mesh = None
        self._groups: dict[str, dist.ProcessGroup | None] = {}
        if self.distributed and world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self._device_mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=MESH_DIMS)
            for name in MESH_DIMS:
                self._groups[name] = self._device_mesh.get_group(name)
            self._groups["dp"] = self._device_mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()
            if dims.cp > 1:  # gradients of parameters replicated over cp are reduced with dp's
                self._groups["dp_cp"] = (
                    self._device_mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp").get_group()
                )
                self._groups["dp_shard_cp"] = (
                    self._device_mesh["dp_shard", "cp"]._flatten("dp_shard_cp").get_group()
                )
            else:
                self._groups["dp_cp"], self._groups["dp_shard_cp"] = (
                    self._groups["dp"],
                    self._groups["dp_shard"],
                )
            if dims.ep > 1:
                self._expert_groups(world)
            else:
                self._groups["edp"] = self._groups["dp_cp"]
            if dims.pp > 1:
                self._pp_link_groups(world)

    def _expert_groups(self, world: int) -> None:
        """ep borrows from dp x cp: the dp*cp ranks of each (pp, tp) coordinate, in mesh order, form
        groups of ep consecutive ranks ("ep": their experts together make all of them) and ep
        strided groups ("edp": the ranks holding the same experts). Every rank creates every group."""
        ep = self.dims.ep
        boxes = sorted(
            {tuple(self.dims.group_ranks(r, ("dp_replicate", "dp_shard", "cp"))) for r in range(world)}
        )
        ep_lists = [box[i : i + ep] for box in boxes for i in range(0, len(box), ep)]
        edp_lists = [box[j::ep] for box in boxes for j in range(ep)]
        for name, lists in (("ep", ep_lists), ("edp", edp_lists)):  # each a colouring: one split each
            self._groups[name] = split_groups(lists, self.rank)
            self.coords[name] = next(ranks.index(self.rank) for ranks in lists if self.rank in ranks)

    def _pp_link_groups(self, world: int) -> None:
        """A two-rank group per ordered pair of neighbouring pipeline ranks (i -> i±1 mod pp), so each
        group carries point-to-point messages one way only (why: :mod:`loom.parallel.pipeline.posting`).
        Links are created by colouring (:func:`link_colour`: at most 6 whatever the world), every
        rank creating every group in the same order."""
        pp = self.dims.pp
        lines = sorted({tuple(self.dims.group_ranks(r, ("pp",))) for r in range(world)})
        pairs = dict.fromkeys((i, j) for i in range(pp) for j in ((i + 1) % pp, (i - 1) % pp) if j != i)
        colourings: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for src, dst in pairs:
            colourings.setdefault(link_colour(src, dst, pp), []).append((src, dst))
        mine = self.coords["pp"]
        self._links: dict[tuple[int, int], dist.ProcessGroup] = {}
        for links in colourings.values():
            group = split_groups([[line[s], line[d]] for line in lines for s, d in links], self.rank)
            for src, dst in links:
                if mine in (src, dst) and group is not None:  # a member of exactly one pair of links
                    self._links[(src, dst)] = group

    def pp_links(self) -> dict[tuple[int, int], dist.ProcessGroup]:
        """This rank's pipeline link groups, keyed by (sending, receiving) pipeline rank."""
        return dict(getattr(self, "_links", {}))

    @cached_property
    def device_mesh(self):
        return self._device_mesh

    def group(self, name: str) -> dist.ProcessGroup | None:
        """A mesh dimension's group, or a flattened one: ``dp`` (replicate x shard), ``dp_cp`` (dp x cp:
        where gradients of parameters replicated over cp are reduced), ``dp_shard_cp`` (ZeRO's shards)."""
        if name not in (*MESH_DIMS, *FLATTENED):
            raise KeyError(f"unknown mesh dimension {name!r}; known: {', '.join((*MESH_DIMS, *FLATTENED))}")
        return self._groups.get(name)

    def twin(self, name: str) -> dist.ProcessGroup | None:
        """A second communicator with the members of ``group(name)`` (a mesh dimension, ``dp``,
        ``dp_cp`` or ``dp_shard_cp``), made on the first call and kept: on NCCL each communicator has
        its own stream, so collectives on the twin do not queue behind the group's. Every rank makes
        every group of the colouring (one :func:`split_groups`), so every rank calls this, in the same
        order. None where the group is (one rank, or one process)."""
        twins: dict[str, dist.ProcessGroup | None] = self.__dict__.setdefault("_twins", {})
        if name not in twins:
            dims = TWIN_DIMS.get(name, (name,))
            if name not in TWIN_DIMS and name not in MESH_DIMS:
                raise KeyError(f"no twin of {name!r}; known: {', '.join((*MESH_DIMS, *TWIN_DIMS))}")
            if self.group(name) is None or self.size(name) == 1:
                twins[name] = None
            else:
                world = self.dims.world_size
                lists = sorted({tuple(self.dims.group_ranks(r, dims)) for r in range(world)})
                twins[name] = split_groups(lists, self.rank)
        return twins[name]

    def twins(self) -> list[dist.ProcessGroup]:
        """The twins made so far (see :meth:`twin`)."""
        return [g for g in self.__dict__.get("_twins", {}).values() if g is not None]

    def size(self, name: str) -> int:
        if name in FLATTENED:
            return FLATTENED[name](self.dims)
        return getattr(self.dims, name)

    def local_rank(self, name: str) -> int:
        return self.coords[name]

    def __repr__(self) -> str:
        shape = ", ".join(f"{d}={s}" for d, s in zip(MESH_DIMS, self.dims.shape))
        return f"ParallelMesh({shape}; rank {self.rank} at {self.coords})"
