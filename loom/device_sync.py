"""Count device-to-host synchronizations: the calls that make the host wait for the device.

On CUDA the host queues kernels and runs ahead; a call that needs a value computed on the device
(a Python number, a data-dependent shape, a copy to host memory) stalls it until the queue
drains. :class:`SyncCounter` counts those calls in a block of code, on any device: on a CPU no
call really waits, so it counts the calls that *would* wait on CUDA. Caught at two levels:

- Python (a ``TorchFunctionMode``): ``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``;
  ``.to(cpu)`` of a tensor on another device (on a CPU-only run every tensor is "on the device"
  already, so only the explicit ``.cpu()`` counts); ``bool()`` / ``int()`` / ``float()`` /
  ``operator.index`` / format / repr of a tensor (``if t.any():`` is ``bool``); ``torch.equal``;
  ``nonzero``, ``argwhere``, ``masked_select``, ``unique*``, one-argument ``where``,
  ``repeat_interleave`` without ``output_size`` (their output shape depends on the values);
  indexing with a boolean mask (read, or a write of a tensor value).
- ATen (a ``TorchDispatchMode``), for what C++ does below Python, autograd's backward included:
  ``_local_scalar_dense`` (every scalar read), ``nonzero``, ``masked_select``, ``unique``. A call
  already counted at the Python level is not counted again for the ATen ops it runs.

Tensors that stay on the host on every device by design are no sync: on a CUDA run a call on a
CPU tensor is not counted; on a CPU run (where every tensor is a CPU tensor) pass them as ``host``
(torch.optim's non-fused optimizers keep each parameter's ``step`` count on the CPU and read it
with ``.item()``: :func:`optimizer_host_tensors`). Each count keeps where it came from (the first
frame outside torch and this module), so a test that asserts a budget can say which line broke it.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_T = torch.Tensor
_ALWAYS = {
    _T.item,
    _T.tolist,
    _T.numpy,
    _T.cpu,
    _T.__bool__,
    _T.__int__,
    _T.__float__,
    _T.__index__,
    _T.__format__,
    _T.__repr__,
    torch.equal,
    _T.equal,
    torch.nonzero,
    _T.nonzero,
    torch.argwhere,
    _T.argwhere,
    torch.masked_select,
    _T.masked_select,
    torch.unique,
    _T.unique,
    torch.unique_consecutive,
    _T.unique_consecutive,
}
_ATEN = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive"}


def _is_cpu(device: Any) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu"


def _bool_index(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool and p.dim() > 0 for p in parts)


def _syncs(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)`` would make the host wait for the device on CUDA."""
    if func in _ALWAYS:
        return True
    if func in (torch.where, _T.where):
        return len(args) + len(kwargs) == 1  # where(cond): the indices, a data-dependent shape
    if func in (torch.repeat_interleave, _T.repeat_interleave):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        tensor_repeats = isinstance(args[0], torch.Tensor) and repeats is None
        return (tensor_repeats or isinstance(repeats, torch.Tensor)) and kwargs.get("output_size") is None
    if func is _T.__getitem__:
        return _bool_index(args[1])
    if func is _T.__setitem__:
        value = args[2]
        return _bool_index(args[1]) and isinstance(value, torch.Tensor) and value.dim() > 0
    if func is _T.to:
        t = args[0]
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        return isinstance(t, torch.Tensor) and t.device.type != "cpu" and _is_cpu(target)
    return False


def _where() -> str:
    """file:line of the innermost frame outside torch and this module."""
    for frame in reversed(traceback.extract_stack()):
        f = frame.filename
        if f != __file__ and "/torch/" not in f:
            return f"{f}:{frame.lineno}"
    return "?"


def _subject(args: tuple) -> torch.Tensor | None:
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


class _FunctionLevel(TorchFunctionMode):
    def __init__(self, owner: SyncCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.owner.depth == 0 and _syncs(func, args, kwargs) and self.owner.on_device(_subject(args)):
            self.owner.record(getattr(func, "__name__", str(func)))
            self.owner.depth += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.owner.depth -= 1
        return func(*args, **kwargs)


class _AtenLevel(TorchDispatchMode):
    def __init__(self, owner: SyncCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.owner.depth == 0 and name in _ATEN and self.owner.on_device(_subject(args)):
            self.owner.record(f"aten.{name}")
        return func(*args, **(kwargs or {}))


class SyncCounter:
    """Context manager counting would-be host syncs (module docstring) in its block.

    ``count`` in total; ``calls``: (what, where) of each; ``by_site()`` a Counter of "what @ where".
    Re-entering (one block per micro-batch, say) keeps adding; ``phase(name)`` files the calls of a
    sub-block under ``name`` in ``phases`` as well. ``device``: the run's device (None: the CPU,
    simulating one); ``host``: tensors that live on the host on every device (never counted).
    """

    def __init__(self, device: torch.device | str | None = None, host: Iterable[torch.Tensor] = ()) -> None:
        self.device = torch.device(device if device is not None else "cpu")
        self.host = {id(t) for t in host}
        self.calls: list[tuple[str, str]] = []
        self.phases: Counter[str] = Counter()
        self.depth = 0
        self._phase: str | None = None
        self._stack: contextlib.ExitStack | None = None

    def on_device(self, t: torch.Tensor | None) -> bool:
        """Whether a call on ``t`` reads the device (None: no tensor argument, counted)."""
        if t is None:
            return True
        if id(t) in self.host:
            return False
        return self.device.type == "cpu" or t.device.type != "cpu"

    @property
    def count(self) -> int:
        return len(self.calls)

    def record(self, what: str) -> None:
        self.calls.append((what, _where()))
        if self._phase is not None:
            self.phases[self._phase] += 1

    def by_site(self) -> Counter[str]:
        return Counter(f"{what} @ {where}" for what, where in self.calls)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the syncs of this block to ``name`` (``phases[name]``, 0 when none)."""
        outer, self._phase = self._phase, name
        self.phases[name] += 0
        try:
            yield
        finally:
            self._phase = outer

    def __enter__(self) -> SyncCounter:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(_AtenLevel(self))
        self._stack.enter_context(_FunctionLevel(self))
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stack is not None
        self._stack.close()
        self._stack = None


def optimizer_host_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The per-parameter ``step`` counts a non-fused, non-capturable torch optimizer keeps on the CPU."""
    return [
        st["step"]
        for st in optimizer.state.values()
        if isinstance(st.get("step"), torch.Tensor) and st["step"].device.type == "cpu"
    ]
