"""The resharding contract: how a strategy describes what it holds, and how it reads it back.

A checkpoint stores every tensor of the model and the optimizer under one *global* name and
shape: the tensor the single-device reference model would have. Each rank contributes
*pieces*: which part of the global tensor it holds, as a :class:`Box` (offsets and lengths
per dimension, e.g. a tensor-parallel shard) or as a :class:`Flat` range of the row-major
flattened tensor (e.g. a ZeRO flat shard that cuts a parameter anywhere). Loading under any
other layout only needs each rank to say which parts it wants; the reader finds them in
whatever files hold them.

A strategy implements :class:`Shardable`::

    def sharded_state(self) -> dict[str, ShardedTensor]   # what this rank holds, by global name
    def load_sharded(self, reader: ShardReader) -> None   # fill it from any checkpoint

Names (canonical, layout independent):

- ``model.<fqn>``                 parameters and persistent buffers of the single-device model
                                  (``fqn`` as in ``Transformer.named_parameters()``; a tied
                                  weight once, under its first name; a pipeline stage maps its
                                  local layer index back to the global one).
- ``optim.<fqn>.<key>``           optimizer state of that parameter, same global shape
                                  (``exp_avg``, ``exp_avg_sq``), or a scalar (``step``).
- anything else (e.g. ``scaler.scale`` for a loss scale) as a 0-dim tensor.

Replication: a piece held identically by ``n`` ranks (data-parallel replicas) carries
``replica=(i, n)``; the saver then writes only share ``i`` of ``n`` of it (cut along its
first dimension, or its flat range), so replicas write in parallel and nothing is stored
twice. On load, replicas that name their group (``read_group``, a :class:`ReadGroup`) read
share ``i`` of ``n`` each and all-gather the rest (:mod:`~loom.checkpoint.shared_read`);
without one, every replica reads the whole piece.

Example: ZeRO-3 over ``dp`` ranks, one flat fp32 shard per rank, parameter ``p`` (global
shape ``S``) has elements ``[a, b)`` of its flattening on this rank, stored in
``flat_shard[o : o + b - a]``::

    def sharded_state(self):
        out = {}
        for name, (a, b, o) in self.my_ranges.items():        # name = "layers.0.attention.wq.weight"
            shape = self.global_shapes[name]
            out[f"model.{name}"] = ShardedTensor.flat(self.flat_param[o:o + b - a], shape, a)
            st = self.opt_state[name]
            out[f"optim.{name}.exp_avg"] = ShardedTensor.flat(st["exp_avg"], shape, a)
            out[f"optim.{name}.exp_avg_sq"] = ShardedTensor.flat(st["exp_avg_sq"], shape, a)
            out[f"optim.{name}.step"] = ShardedTensor.full(st["step"], replica=(self.dp_rank, self.dp))
        return out

    def load_sharded(self, reader):
        self.ensure_optimizer_state()                 # the tensors must exist to be filled
        reader.fill(self.sharded_state())             # reads exactly these slices, in place

Tensor parallel (column-parallel ``wq`` split over ``tp`` on dim 0, replicated over ``dp``)::

    rows = shape[0] // tp
    ShardedTensor.box(local_wq, shape, (tp_rank * rows, 0), replica=(dp_rank, dp))

:func:`loom.checkpoint.replicated.placement_state` builds the model+Adam entries from per
parameter placements, so most strategies only describe where each parameter lives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Box:
    """A rectangular part of a global tensor: ``t[o0:o0+l0, o1:o1+l1, ...]``."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for length in self.lengths:
            n *= length
        return n

    def to_json(self) -> dict:
        return {"box": [list(self.offsets), list(self.lengths)]}


@dataclass(frozen=True)
class Flat:
    """Elements ``[start, start + length)`` of the row-major flattened global tensor.

    With ``within``: of the flattened sub-tensor ``within`` instead (a ZeRO flat shard of a
    tensor-parallel shard: the range is in the tp shard's own flattening).
    """

    start: int
    length: int
    within: Box | None = None

    @property
    def numel(self) -> int:
        return self.length

    def to_json(self) -> dict:
        out: dict = {"flat": [self.start, self.length]}
        if self.within is not None:
            out["within"] = [list(self.within.offsets), list(self.within.lengths)]
        return out


Region = Box | Flat


def full_box(shape: tuple[int, ...]) -> Box:
    return Box(tuple(0 for _ in shape), tuple(shape))


def region_from_json(d: dict) -> Region:
    if "box" in d:
        offsets, lengths = d["box"]
        return Box(tuple(int(x) for x in offsets), tuple(int(x) for x in lengths))
    if "flat" in d:
        start, length = d["flat"]
        within = None
        if "within" in d:
            offsets, lengths = d["within"]
            within = Box(tuple(int(x) for x in offsets), tuple(int(x) for x in lengths))
        return Flat(int(start), int(length), within)
    raise ValueError(f"region must have 'box' or 'flat', got {sorted(d)}")


def check_region(region: Region, shape: tuple[int, ...], where: str) -> None:
    """Raise ValueError unless ``region`` lies inside a tensor of ``shape``."""
    if isinstance(region, Box):
        ok = len(region.offsets) == len(shape) == len(region.lengths) and all(
            o >= 0 and n >= 0 and o + n <= s for o, n, s in zip(region.offsets, region.lengths, shape)
        )
    else:
        if region.within is not None:
            check_region(region.within, shape, where)
        total = 1
        for s in region.within.lengths if region.within is not None else shape:
            total *= s
        ok = region.start >= 0 and region.length >= 0 and region.start + region.length <= total
    if not ok:
        raise ValueError(f"{where}: region {region} does not fit global shape {tuple(shape)}")


@dataclass(frozen=True)
class ReadGroup:
    """The ``size`` ranks of ``group`` (this one is ``rank``) hold the same piece and load it together.

    ``device``: where the group's collectives run (the local tensors' device: ``cuda`` on NCCL).
    """

    group: Any
    rank: int
    size: int
    device: torch.device


@dataclass
class ShardedTensor:
    """This rank's piece of a global tensor: ``local`` holds the elements of ``region``.

    ``local.shape`` is ``region.lengths`` for a :class:`Box` and ``(length,)`` for a
    :class:`Flat`. ``replica = (i, n)``: the same piece lives on ``n`` ranks, this is copy ``i``
    (how the save splits the writing). ``read_group``: ranks holding this same piece that split
    the reading on load (may differ from the writers' split; None: this rank reads it all).
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    region: Region
    replica: tuple[int, int] = (0, 1)
    read_group: ReadGroup | None = None

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        check_region(self.region, self.global_shape, "ShardedTensor")
        want = self.region.lengths if isinstance(self.region, Box) else (self.region.length,)
        if tuple(self.local.shape) != tuple(want):
            raise ValueError(
                f"ShardedTensor: local shape {tuple(self.local.shape)} != region shape {tuple(want)}"
            )
        i, n = self.replica
        if not 0 <= i < n:
            raise ValueError(f"ShardedTensor: replica index {i} not in [0, {n})")

    @classmethod
    def full(cls, t: torch.Tensor, replica: tuple[int, int] = (0, 1)) -> ShardedTensor:
        """The whole tensor (replicated over ``replica[1]`` ranks)."""
        return cls(t, tuple(t.shape), full_box(tuple(t.shape)), replica)

    @classmethod
    def box(
        cls,
        t: torch.Tensor,
        global_shape: tuple[int, ...],
        offsets: tuple[int, ...],
        replica: tuple[int, int] = (0, 1),
    ) -> ShardedTensor:
        """``t`` is ``global[offsets[0]:offsets[0]+t.shape[0], ...]``."""
        return cls(t, tuple(global_shape), Box(tuple(offsets), tuple(t.shape)), replica)

    @classmethod
    def flat(
        cls,
        t: torch.Tensor,
        global_shape: tuple[int, ...],
        start: int,
        replica: tuple[int, int] = (0, 1),
        within: Box | None = None,
    ) -> ShardedTensor:
        """``t`` (1-D) is ``global.flatten()[start:start+t.numel()]`` (or of ``global[within]``)."""
        return cls(t, tuple(global_shape), Flat(int(start), t.numel(), within), replica)


@runtime_checkable
class ShardReader(Protocol):
    """Reads any region of any tensor of a checkpoint, whatever layout wrote it."""

    def names(self) -> list[str]:
        """Global names of every tensor in the checkpoint."""

    def global_shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, region: Region | None = None) -> torch.Tensor:
        """A new CPU tensor with the elements of ``region`` (default: the whole tensor)."""

    def fill(self, state: dict[str, ShardedTensor]) -> None:
        """Copy each entry's region into its ``local`` tensor, in place.

        Raises CheckpointError if a name is missing or a global shape differs.
        """


@runtime_checkable
class Shardable(Protocol):
    """What a strategy implements to be checkpointed and resharded (see module docstring)."""

    def sharded_state(self) -> dict[str, ShardedTensor]:
        """Every tensor this rank holds (model and optimizer), by global name."""

    def load_sharded(self, reader: ShardReader) -> None:
        """Overwrite this rank's state from ``reader``; create lazily built state first."""


class CombinedState:
    """Several :class:`Shardable` parts as one (a strategy and the loss scaler, say): their names
    are disjoint; each part loads what it holds."""

    def __init__(self, *parts: Shardable) -> None:
        self.parts = parts

    def sharded_state(self) -> dict[str, ShardedTensor]:
        out: dict[str, ShardedTensor] = {}
        for part in self.parts:
            out.update(part.sharded_state())
        return out

    def load_sharded(self, reader: ShardReader) -> None:
        for part in self.parts:
            part.load_sharded(reader)
