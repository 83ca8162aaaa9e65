"""Reading a checkpoint's weights into Loom's layout, box by box: a rank reads with ``safetensors``'
``get_slice`` only the rows and columns (and experts) its parameters hold, never a whole tensor."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from typing import cast

import torch

from loom.model.hf.directory import HFModel, _refuse_integer, open_shard
from loom.model.hf.families import CONFIG, HFError
from loom.model.hf.names import VOCAB_TENSORS, Mapping, _mappings, expected_shapes, to_loom_rows
from loom.model.hf.quantized import dequantize


class Reader:
    """Boxes of Loom tensors read from a checkpoint's shards (each file opened once, closed with the
    reader); ``bytes_read`` counts the bytes ``get_slice`` returned."""

    def __init__(self, model: HFModel) -> None:
        self.model = model
        self.maps = dict(_mappings(model.config, model.prefix))
        self.shapes = expected_shapes(model.config)
        self.opened: dict[str, object] = {}
        self.files = ExitStack()
        self.bytes_read = 0

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.files.close()

    def check(self, names: Iterable[str]) -> None:
        """Every HF tensor of the Loom tensors ``names`` is in the checkpoint, else an error naming it."""
        for lm in names:
            for name in self.maps[lm].names():
                if name not in self.model.files:
                    raise HFError(f"{self.model.dir}: tensor {name} is missing from the checkpoint")

    def _open(self, name: str):
        """The safetensors slice of HF tensor ``name`` (its shard opened once)."""
        file = self.model.files[name]
        if file not in self.opened:
            self.opened[file] = self.files.enter_context(open_shard(self.model.dir / file))
        return self.opened[file].get_slice(name)  # type: ignore[attr-defined]

    def _slice(self, name: str, shape: tuple[int, ...]):
        file = self.model.files[name]
        sl = self._open(name)
        if self.model.scale_of(name, sl.get_dtype()) is None:
            _refuse_integer(self.model.dir / file, name, sl.get_dtype())
        if tuple(sl.get_shape()) != shape:
            raise HFError(
                f"{self.model.dir / file}: {name} has shape {tuple(sl.get_shape())}, {CONFIG} implies {shape}"
            )
        return sl

    def read(self, lm: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The box ``index`` (slices with steps of 1; None: all) of Loom's tensor ``lm``."""
        if lm not in self.maps:
            raise HFError(f"{self.model.dir}: the checkpoint has no tensor for Loom's {lm}")
        shape = self.shapes[lm]
        box = tuple(s.indices(n)[:2] for s, n in zip(index or (), shape)) + tuple(
            (0, n) for n in shape[len(index or ()) :]
        )
        t = self._box(self.maps[lm], shape, box)
        if t.is_floating_point() and not bool(
            torch.isfinite(t).all()
        ):  # else: "non-finite gradient" at step 1
            names = ", ".join(self.maps[lm].names())
            raise HFError(
                f"{self.model.dir}: tensor {names} holds NaN or inf values; the checkpoint is damaged"
            )
        return t

    def _box(self, m: Mapping, shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        if isinstance(m.hf, tuple):  # an expert stack: only the experts in the box, each its own box
            (e0, e1), rest = box[0], box[1:]
            parts = [self._box(dataclasses.replace(m, hf=m.hf[e]), shape[1:], rest) for e in range(e0, e1)]
            return torch.stack(parts) if parts else torch.empty(0, *(b - a for a, b in rest))
        if m.heads is None:
            return self._plain(m, shape, box)
        (r0, r1), d = box[0], shape[0] // m.heads  # whole heads are reordered: widen to them, then cut
        lo, hi = r0 // d * d, -(-r1 // d) * d
        t = to_loom_rows(self._plain(m, shape, ((lo, hi), *box[1:])), (hi - lo) // d, m.rotary)
        return t[r0 - lo : r1 - lo]

    def _plain(self, m: Mapping, shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        off = 0 if m.part is None else m.part[0]  # a fused tensor's rows of this part
        rows = slice(off + box[0][0], off + box[0][1])
        sl = self._slice(cast(str, m.hf), m.hf_shape(shape))
        if m.conv1d:  # stored (in, out): read the transposed box
            t = sl[slice(*box[1]), rows].t()
        else:
            t = sl[(rows, *(slice(a, b) for a, b in box[1:]))]
        self.bytes_read += t.numel() * t.element_size()
        scale = self.model.scale_of(cast(str, m.hf), sl.get_dtype())
        if scale is not None:  # 8-bit codes: times the scales of the blocks over the box
            t = dequantize(
                t, self._open(scale), tuple(sl.get_shape()), rows, slice(*box[1]), self.model.block
            )
        return t


def read_state(model: HFModel, names: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(Loom name, whole tensor) for ``names`` (default: all), one tensor at a time (an expert stack
    is read expert by expert); each shard file is opened once."""
    with Reader(model) as reader:
        wanted = [lm for lm in reader.maps if names is None or lm in names]
        reader.check(wanted)
        for lm in wanted:
            yield lm, reader.read(lm)


class HFSource:
    """The :data:`~loom.parallel.materialize.Source` of a checkpoint: ``(name, shape, index)`` -> that
    box of Loom's parameter ``name``, read with ``get_slice`` (for materializing a model built on the
    meta device: a rank reads only what it holds). ``bytes_read`` sums over calls."""

    def __init__(self, model: HFModel) -> None:
        self.model = model
        self.bytes_read = 0

    def __call__(self, name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> torch.Tensor:
        with Reader(self.model) as reader:
            reader.check([name] if name in reader.maps else [])
            V = reader.shapes[name][0] if name in VOCAB_TENSORS and name in reader.shapes else shape[0]
            if shape[0] <= V:
                t = reader.read(name, index)
            else:  # a padded vocabulary (model.pad_vocab_to): rows >= V are zeros
                r0, r1 = index[0].indices(shape[0])[:2] if index else (0, shape[0])
                t = reader.read(name, (slice(min(r0, V), min(r1, V)), *index[1:]))
                t = torch.cat((t, t.new_zeros(r1 - r0 - t.shape[0], *t.shape[1:])))
            self.bytes_read += reader.bytes_read
            return t


def source(model: HFModel) -> HFSource:
    """The box reader of ``model``'s weights (:class:`HFSource`)."""
    return HFSource(model)


@torch.no_grad()
def load_into(module: torch.nn.Module, model: HFModel) -> None:
    """Copy the checkpoint's weights into a Loom ``Transformer`` built from ``model.config``
    (converted to each parameter's dtype and device, one tensor at a time)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    for name, t in read_state(model, set(params)):
        p: torch.Tensor = params[name]
        if name in VOCAB_TENSORS and p.shape[0] > t.shape[0]:  # a padded vocabulary: zero rows after V
            p[t.shape[0] :].zero_()
            p = p[: t.shape[0]]
        p.copy_(t)
