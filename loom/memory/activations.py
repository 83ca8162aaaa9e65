"""Activation accounting: bytes saved for backward, measured with saved-tensor hooks.

:class:`SavedTensorMeter` records every tensor autograd saves during a forward, counts each
storage once (a tensor saved by several ops, or views of one buffer, are one allocation),
leaves out parameters and buffers (they are not activations), and attributes each storage to
the transformer layer whose forward first saved it.

Formula for this architecture (``loom.model.llama`` Block: RMSNorm, GQA attention through the
flash kernel of ``scaled_dot_product_attention``, SwiGLU), per layer, derived op by op. With s
sequence, b micro-batch, h = dim, a heads, f = ffn, e bytes per activation element (4 in fp32),
n = tp and t = n with sequence parallelism else 1:

    RMSNorm (x2)       input x, output x̂·w (e·sbh each), 1/rms (4·sb)              4·e·sbh/t + 8·sb/t
    q, k, v            post-RoPE q (a/n heads), k and v unrepeated (k_n heads each)  e·sbh/n + 2·e·sb·d·k_n
    attention          output (b, a/n, s, d) and log-sum-exp (b, a/n, s) fp32         e·sbh/n + 4·sb·a/n
    SwiGLU             w1 x (silu input), silu(w1 x), w3 x, their product (w2 input)  4·e·sbf/n

    bytes/layer = s·b·h·(e·(4/t + 2/n + 2·d·k_n/h + 4f/(h·n)) + 4·(2/t + a/n)/h)

with k_n = k/n key/value heads per tp rank (1 when tp replicates them, k < n): SDPA's
``enable_gqa`` reads them in place, none is repeated to a heads.

In the form of Korthikanti et al. 2022, s·b·h·(c₁ + c₂·a·s/h): the flash kernel keeps no
(a, s, s) score or dropout matrix, so c₂ = 0 and the log-sum-exp adds 4·a/(h·n). Without
sequence parallelism the norms and their inputs (4·e·sbh + 8·sb) stay replicated on every tp
rank; with it everything is divided by n. Not counted per layer: the pre-RoPE q/k are not
saved (RoPE multiplies by constant tables; :mod:`loom.model.norms` saves no x̂), and residual adds save nothing.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import cast

import torch
from torch import nn

from loom.config import ModelConfig


def activation_bytes_per_layer(
    cfg: ModelConfig,
    batch: int,
    seq: int,
    tp: int = 1,
    sp: bool = False,
    elem: int = 4,
    cp: int = 1,
    cp_mode: str = "allgather",
) -> int:
    """The formula of the module docstring, in bytes, for one layer on one tensor-parallel rank.

    With context parallelism (``seq`` the whole sequence) every term counts the rank's s/cp tokens;
    the keys and values, unrepeated (k·d = n_kv_heads·head_dim wide, /n), are those of
    ``cp_mode``'s core: allgather keeps the whole sequence's, 2·e·sb·kd/n; ring the local ones,
    2·e·(sb/cp)·kd/n; alltoall the whole sequence's for 1/cp of the heads repeated by
    f = cp/gcd(k, cp), 2·e·(sb/cp)·kd·f/n, and its head-sharded output is a tensor of its own
    beside the output projection's input (returned by an all-to-all): e·(sb/cp)·h/n more."""
    n, t = tp, (tp if sp else 1)
    sb, h, f, a = seq * batch, cfg.dim, cfg.resolved_ffn_dim(), cfg.n_heads
    local = sb // cp
    kd = cfg.n_kv_heads * cfg.head_dim
    if cp == 1:
        kv = 2 * sb * max(1, cfg.n_kv_heads // n) * cfg.head_dim  # k, v unrepeated (k_n heads)
    else:
        rep = cp // math.gcd(cfg.n_kv_heads, cp) if cp_mode == "alltoall" else 1
        kv = 2 * (sb if cp_mode == "allgather" else local) * kd * rep // n
        kv += (
            local * h // n if cp_mode == "alltoall" else 0
        )  # the core's head-sharded output beside wo's input
    elems = 4 * local * h // t + 2 * local * h // n + kv + 4 * local * f // n
    fp32 = 2 * local // t + local * a // n
    return elem * elems + 4 * fp32


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr())


class SavedTensorMeter:
    """Measure unique bytes saved for backward, in total and per layer.

    Usage::

        meter = SavedTensorMeter(model, layers=model.layers)
        with meter:
            loss = loss_fn(model(x), y)
        meter.per_layer   # {layer index: bytes}
    """

    def __init__(self, model: nn.Module, layers: Iterable[nn.Module] = ()) -> None:
        self.exclude = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}
        self.layers = list(layers)
        self.per_layer: dict[int | None, int] = defaultdict(int)  # None: outside every layer
        self.seen: set[tuple[str, int]] = set()
        self._current: int | None = None
        self._stack: contextlib.ExitStack | None = None

    @property
    def total(self) -> int:
        return sum(self.per_layer.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self.exclude and key not in self.seen:
            self.seen.add(key)
            self.per_layer[self._current] += t.untyped_storage().nbytes()
        return t

    def _hooks(self) -> Iterator:
        for i, layer in enumerate(self.layers):

            def pre(_m, _args, i=i):
                self._current = i

            def post(_m, _args, _out):
                self._current = None

            yield layer.register_forward_pre_hook(pre)
            yield layer.register_forward_hook(post)

    def __enter__(self) -> SavedTensorMeter:
        self._stack = contextlib.ExitStack()
        for h in self._hooks():
            self._stack.callback(h.remove)
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        return self

    def __exit__(self, *exc) -> None:
        assert self._stack is not None
        self._stack.close()
        self._stack = None


def measure_layer_bytes(model: nn.Module, tokens: torch.Tensor) -> dict[int, int]:
    """Bytes saved for backward by each transformer layer in one forward of ``tokens``."""
    layers = cast(nn.ModuleList, model.layers)  # a Transformer's blocks
    meter = SavedTensorMeter(model, layers=layers)
    with meter:
        out = model(tokens)
    del out
    return {i: meter.per_layer.get(i, 0) for i in range(len(layers))}
