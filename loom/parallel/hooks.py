"""Parameter hooks that do not keep their strategy alive.

A tensor keeps its hooks where Python's garbage collector cannot follow them (the tensor's traverse
stops at tensors that C++ also holds, as autograd holds every parameter). A gradient hook bound to
its strategy closed the loop parameter -> hook -> strategy -> model -> parameter, which no collection
frees: a process that built a second strategy kept the first one's model, gradient buffers and process
groups (each gloo group with threads that wake every 10 ms) for good. :func:`weak_hook` holds the
strategy by a weak reference and everything else by value.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def weak_hook(method: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    """A hook calling ``method(*args, *hook_args)`` while ``method``'s object lives, a no-op after.

    ``method`` is a bound method; ``args`` must not lead back to the hooked tensor (pass indices,
    not objects that hold parameters)."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def hook(*hook_args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, *hook_args)

    return hook
