"""What autograd keeps for backward: accounting, compression (the Gist idea), offload.

:class:`SavedActivations` is one pair of saved-tensor hooks, entered around a training step
(the trainer does; tests and benchmarks may). Every tensor autograd saves goes through it:

- parameters and buffers are passed through untouched and not counted (they are model state);
- accounting: the bytes alive in saved tensors are counted when saved and released when
  autograd frees them (a node's saved tensors are freed right after its backward runs), each
  storage once however many ops save it. ``peak`` is the maximum over the step: with gradient
  accumulation one micro-batch's, with a pipeline schedule those of the micro-batches in flight.
  On a GPU the CUDA allocator's peak (``peak_mem_bytes``) also sees the working set;
- compression (``train.compress``): floating-point activations are stored in a smaller format
  and expanded in backward, chosen per tensor kind = the ``activation_kind`` class attribute of the
  innermost module whose forward saved it (``attention``, ``mlp``, ``norm``; ``other`` outside them):

      format  stored                                        bytes for n elements
      bf16    x.to(bfloat16)                                2n      (x already 2-byte: as is)
      fp8     x/σ as float8_e4m3fn, σ = max|x|/448          n + 4
      int8    round(x/σ) as int8,   σ = max|x|/127          n + 4

  so from fp32: 2× (bf16) and 4n/(n + 4) ≈ 4× (fp8, int8); from bf16: 1×, 2×, 2×. Lossy:
  backward sees x̂ = x(1 + δ) with |δ| ≤ 2⁻⁸ (bf16), 2⁻⁴ (fp8, relative) or σ/2 absolute (int8).
  Inputs kept by a recomputation checkpoint are not compressed (the checkpoint holds them anyway);
- offload (``train.offload_activations``, GPU only): the (possibly compressed) payload moves to
  pinned host memory, see :mod:`loom.memory.activation_offload`; its bytes count as ``offloaded``.

Hooks only where a feature needs them: the module hooks that name a tensor's kind exist only under
compression, and without compression or offload the trainer enters the saved-tensor hooks on logged
steps only (:meth:`SavedActivations.around`): the figure they log is the same, the other steps run
bare.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from loom.config import parse_compress
from loom.memory.recompute import HELD_ATTR

FP8_MAX, INT8_MAX = 448.0, 127.0


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def encode(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(payload, scale or None) of ``x`` in ``fmt`` (module docstring table)."""
    if fmt == "bf16":
        return x.to(torch.bfloat16), None
    amax = x.detach().abs().amax().float()
    scale = torch.where(amax > 0, amax / (FP8_MAX if fmt == "fp8" else INT8_MAX), torch.ones_like(amax))
    y = x.detach().float() / scale
    if fmt == "fp8":
        return y.to(torch.float8_e4m3fn), scale
    return y.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def decode(payload: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return payload.to(dtype)
    return (payload.float() * scale).to(dtype)


class _Kept:
    """A saved tensor kept as is; releases its storage's count when autograd frees it."""

    __slots__ = ("owner", "tensor", "key", "__weakref__")

    def __init__(self, owner: SavedActivations, tensor: torch.Tensor, key) -> None:
        self.owner, self.tensor, self.key = owner, tensor, key

    def __del__(self) -> None:
        self.owner._release(self.key)


class _Packed:
    """A compressed (and/or offloaded) saved tensor."""

    __slots__ = ("owner", "payload", "scale", "dtype", "nbytes", "host", "__weakref__")

    def __init__(self, owner, payload, scale, dtype, nbytes: int, host: bool) -> None:
        self.owner, self.payload, self.scale, self.dtype, self.nbytes, self.host = (
            owner,
            payload,
            scale,
            dtype,
            nbytes,
            host,
        )

    def __del__(self) -> None:
        self.owner._free(self.nbytes, self.host)


class _View:
    """One saved tensor: a view (shape, stride, offset) of a packed storage shared by its views."""

    __slots__ = ("packed", "view")

    def __init__(self, packed: _Packed, view: tuple) -> None:
        self.packed, self.view = packed, view


def _whole_storage(t: torch.Tensor) -> torch.Tensor:
    """The tensor's whole storage as a flat tensor of its dtype (what compression encodes once)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, (n,), (1,))


class SavedActivations:
    """Saved-tensor hooks for ``model`` (module docstring); a reusable context manager."""

    def __init__(self, model: nn.Module, compress: str = "none", offloader=None) -> None:
        self.formats = parse_compress(compress)
        self.offloader = offloader
        self.exclude = {_storage_key(b) for b in model.buffers()}
        self.live = 0  # bytes on the device held in saved tensors now
        self.peak = 0
        self.offloaded = 0  # bytes held in host memory now (offload)
        self.offloaded_peak = 0
        self.packed = 0  # bytes stored by compression since the last reset (accounting tests)
        self.raw = 0  # ... and the bytes of the tensors they replace
        self._counts: dict[tuple[str, int], list[int]] = {}
        self._cache: dict[int, tuple[weakref.ref, weakref.ref[_Packed]]] = {}
        self._kinds: list[str] = []
        # the module hooks only tell compression which kind saved a tensor: none without compression
        self.compressing = any(f != "none" for f in self.formats.values())
        self._handles = list(self._kind_hooks(model)) if self.compressing else []
        self._ctx: torch.autograd.graph.saved_tensors_hooks | None = None

    # ------------------------------------------------------------------ kinds
    def _kind_hooks(self, model: nn.Module) -> Iterator:
        for m in model.modules():
            kind = getattr(m, "activation_kind", None)  # a class attribute: "attention", "mlp", "norm"
            if kind is None:
                continue
            if kind not in self.formats:
                raise ValueError(
                    f"{type(m).__name__}.activation_kind: {kind!r} is not one of {tuple(self.formats)}"
                )

            def pre(_m, _a, kind=kind):
                self._kinds.append(kind)

            def post(_m, _a, _o):
                if self._kinds:
                    self._kinds.pop()

            yield m.register_forward_pre_hook(pre)
            yield m.register_forward_hook(post)

    @property
    def kind(self) -> str:
        return self._kinds[-1] if self._kinds else "other"

    # ------------------------------------------------------------------ accounting
    def _grow(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def _release(self, key) -> None:
        c = self._counts.get(key)
        if c is None:
            return
        c[0] -= 1
        if c[0] == 0:
            del self._counts[key]
            self.live -= c[1]

    def _free(self, n: int, host: bool) -> None:
        if host:
            self.offloaded -= n
        else:
            self.live -= n

    def reset_peak(self) -> None:
        """Start a new peak (and compression totals) from what is alive now."""
        self.peak, self.offloaded_peak = self.live, self.offloaded
        self.packed = self.raw = 0

    # ------------------------------------------------------------------ hooks
    def _pack(self, t: torch.Tensor):
        root = t._base if t._base is not None else t
        key = _storage_key(t)
        if isinstance(root, nn.Parameter) or key in self.exclude:
            return t  # model state, not an activation
        view = (tuple(t.shape), t.stride(), t.storage_offset())
        hit = self._cache.get(id(root))
        packed = hit[1]() if hit is not None and hit[0]() is root else None
        if packed is not None:
            return _View(packed, view)  # a packed storage saved again (another op or view): one copy
        c = self._counts.get(key)
        if c is not None:  # kept as is already: the first saver decided
            c[0] += 1
            return _Kept(self, t, key)
        fmt = self.formats[self.kind]
        if (
            not t.is_floating_point()
            or getattr(t, HELD_ATTR, False)
            or (fmt == "bf16" and t.element_size() <= 2)
        ):
            fmt = "none"
        flat = _whole_storage(t) if t.is_floating_point() else t
        if fmt == "none" and (self.offloader is None or not self.offloader.accepts(flat)):
            self._counts[key] = [1, _nbytes(t)]
            self._grow(_nbytes(t))
            return _Kept(self, t, key)
        payload, scale = (flat, None) if fmt == "none" else encode(flat, fmt)
        nbytes = payload.numel() * payload.element_size() + (4 if scale is not None else 0)
        self.packed += nbytes
        self.raw += _nbytes(t)
        host = self.offloader is not None and self.offloader.accepts(payload)
        if host:
            payload = self.offloader.to_host(payload)
            self.offloaded += nbytes
            self.offloaded_peak = max(self.offloaded_peak, self.offloaded)
        else:
            self._grow(nbytes)
        packed = _Packed(self, payload, scale, t.dtype, nbytes, host)
        self._cache[id(root)] = (weakref.ref(root), weakref.ref(packed))
        return _View(packed, view)

    def _unpack(self, obj):
        if isinstance(obj, _Kept):
            return obj.tensor
        if isinstance(obj, _View):
            p = obj.packed
            payload = self.offloader.to_device(p.payload) if p.host else p.payload
            return decode(payload, p.scale, p.dtype).as_strided(*obj.view)
        return obj

    def __enter__(self) -> SavedActivations:
        self._kinds.clear()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
        self._ctx = None
        self._cache.clear()  # the packed objects live on in the graph; only the dedup index goes

    @property
    def every_step(self) -> bool:
        """Whether every step needs the hooks: compression or offload change what is saved. Accounting
        alone does not; :meth:`around` then measures logged steps only."""
        return self.compressing or self.offloader is not None

    def around(self, logged: bool) -> contextlib.AbstractContextManager:
        """The context of one training step: these hooks when the step needs them (:attr:`every_step`)
        or is logged (its ``act_saved_peak_bytes``: the steps of a window save the same shapes), else
        nothing at all, so a default step runs without saved-tensor hooks."""
        return self if logged or self.every_step else contextlib.nullcontext()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def stats(self) -> dict[str, int]:
        """For metrics: peak bytes of saved activations on the device (and in host memory)."""
        out = {"act_saved_peak_bytes": self.peak}
        if self.offloader is not None:
            out["act_offloaded_peak_bytes"] = self.offloaded_peak
        return out


def compressed_bytes(numel: int, elem: int, fmt: str) -> int:
    """Bytes :func:`encode` stores for ``numel`` elements of ``elem`` bytes (module docstring table)."""
    if fmt == "none" or (fmt == "bf16" and elem <= 2):
        return numel * elem
    return 2 * numel if fmt == "bf16" else numel + 4
