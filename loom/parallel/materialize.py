"""Sharded materialization: the model is built on the meta device, cut by every parallel dimension,
and only then does each rank allocate and initialize what it holds.

Every parameter of the reference model is tagged with its :class:`~loom.parallel.placement.Origin`
(name and global shape) before any dimension is applied; tensor, expert and pipeline parallelism
keep the tag and narrow its box as they slice. :func:`materialize` then gives each meta parameter
its box of the whole parameter's value, ``source(name, shape, index)`` (the layout-independent init,
which generates the whole value and slices it, or pretrained weights, of which only the box is
read), one parameter at a time, so the values equal today's layout in every layout and the peak
memory of construction on a rank is

    its final model state + the largest whole parameter it holds a piece of.

ZeRO-3 materializes unit by unit into each unit's flat buffer and keeps only its shard
(:meth:`loom.parallel.layout.FlatLayout.bind`), so a rank never holds more than one whole unit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from loom.config import ModelConfig
from loom.model.hf.names import VOCAB_TENSORS
from loom.model.llama import init_value
from loom.parallel.placement import Origin, place, placement_of

Source = Callable[
    [str, tuple[int, ...], tuple[slice, ...]], torch.Tensor
]  # (name, global shape, box) -> the box's values

Fill = Callable[
    [torch.Tensor, tuple[int, int]], torch.Tensor
]  # (meta parameter, its rows [r0, r1)) -> their values


def tag_origins(model: nn.Module, vocab: int | None = None) -> None:
    """Record each parameter's reference name and global shape (tied parameters under their first name);
    of the embedding and head of more rows than the ``vocab`` real ones (``model.pad_vocab_to``), also
    that count (:attr:`Origin.rows`)."""
    for name, p in model.named_parameters():
        if placement_of(p).origin is None:
            rows = vocab if vocab is not None and name in VOCAB_TENSORS and p.shape[0] > vocab else None
            place(p, origin=Origin(name, tuple(p.shape), rows=rows))


def init_source(cfg: ModelConfig, seed: int) -> Source:
    """The layout-independent init (:func:`~loom.model.llama.init_value`) as a source: the whole value
    is generated (its RNG stream does not depend on the layout) and the box cut from it."""
    return lambda name, shape, index: init_value(cfg, seed, name, shape)[index]


def local_values(p: torch.Tensor, source: Source, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """``p``'s box of its whole value, ``source(name, shape, box)``; with ``rows``, only its rows
    [r0, r1) along dim 0 (what a ZeRO-3 shard holds of it)."""
    origin = placement_of(p).origin
    if origin is None:
        raise ValueError(f"a meta parameter of shape {tuple(p.shape)} has no origin: cannot initialize it")
    shape = tuple(p.shape)
    if rows is not None:
        origin = origin.narrowed(0, *rows)
        shape = (rows[1] - rows[0], *shape[1:])
    values = source(origin.name, origin.shape, origin.index())
    if tuple(values.shape) != shape:
        raise ValueError(
            f"{origin.name}: box {origin.box} of {origin.shape} is {tuple(values.shape)}, "
            f"the parameter is {shape}"
        )
    return values


def filler(source: Source) -> Fill:
    """The fill function of :meth:`~loom.parallel.layout.FlatLayout.bind` for ``source``."""
    return lambda p, rows: local_values(p, source, rows)


@torch.no_grad()
def swap_in(p: torch.Tensor, values: torch.Tensor) -> None:
    """Make the meta parameter ``p`` (the same object, its placement kept) hold ``values``."""
    q = nn.Parameter(values, requires_grad=p.requires_grad)
    q.__dict__.update(p.__dict__)
    torch.utils.swap_tensors(p, q)


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device, source: Source) -> None:
    """Allocate every meta parameter of ``module`` on ``device`` with its values (dtype kept), one at a time."""
    for p in module.parameters():  # each tied parameter once; it is real after its first swap
        if p.is_meta:
            values = torch.empty(p.shape, dtype=p.dtype, device=device)
            values.copy_(local_values(p, source))  # a copy: the whole value is freed at once
            swap_in(p, values)


def check_materialized(module: nn.Module) -> None:
    """A parameter or buffer left on the meta device is an error naming it."""
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in named:
            if t.is_meta:
                raise RuntimeError(f"{kind} {name} is still on the meta device after materialization")
