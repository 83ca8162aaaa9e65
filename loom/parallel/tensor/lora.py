"""LoRA adapters under tensor (and sequence) parallelism, split as the layer they wrap.

Column-parallel W (rows sharded; q, k, v, w1, w3): B_r = B's rows with W_r's rows, A whole.

    h = A x (r values per token, computed alike on every rank), y_r += (α/r)·B_r h
    no sp: h passes f (identity; backward all-reduce of dh = Σ_r B_rᵀ dy_r over tp), so A's
           gradient is whole on every rank;
    sp:    h = all-gather over the sequence of A x_shard (backward reduce-scatter), A's gradient
           is this rank's sequence shard's part: summed over tp once a step (partial).
    key/value weights replicated when n_kv_heads < tp: B whole too, its rows used, partial.

Row-parallel W (columns sharded; o, w2): A_r = A's columns with W_r's columns, B whole.

    y = Σ_r [x_r W_rᵀ + (α/r)·B (A_r x_r)]: the adapter's term joins the layer's partial sum before
    its one collective (all-reduce, or reduce-scatter with sp); B's gradient dyᵀ(A_r x_r) is a
    partial sum over tp.

Bytes moved per rank per micro-batch, on top of the layer's (ρ = (n-1)/n, e bytes per element,
fused q/k/v and w1/w3 entries share one collective of their concatenated h):
    per column-parallel entry with targets of total rank R: 2ρ·b·s·R·e (no sp: backward all-reduce;
    sp: forward all-gather + backward reduce-scatter); row-parallel: none.
Once per step, the partial adapter gradients summed over tp: 2ρ·e·P, P = the row-parallel B's
(d_out·r each), with sp also the column-parallel A's (r·d_in), with replicated key/value heads
their B's. The frozen base's partial parameters (sp norms, ...) have no gradient: nothing to sum,
and its backward collectives run only where a gradient reaches them (not the embedding's, nor any
before the first adapter). :func:`~loom.parallel.tensor.parallelize.lora_comm_bytes` is the whole count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from loom.finetune.lora import adapter_weights, has_adapters, lora_input, lora_output, set_adapters
from loom.parallel.partial import mark_partial
from loom.parallel.placement import copy_placement
from loom.parallel.sequence import gather_seq
from loom.parallel.tensor.comm import copy_to_tp
from loom.parallel.tensor.shard import sharded_param


def shard_column_adapters(src: nn.Module, dst: nn.Module, ctx, replicated_rows: slice | None) -> None:
    """Give the column-parallel ``dst`` the adapters of the full linear ``src``: B's rows sharded
    (or B whole and partial with ``replicated_rows``), A whole (partial with sp)."""
    if not has_adapters(src):
        return
    a, b, scale, dropout = adapter_weights(src)
    if ctx.sp:
        mark_partial(a, ctx.group, ctx.meter)
    b_local: torch.Tensor
    if replicated_rows is None:
        b_local = sharded_param(b, 0, ctx)
    else:
        b_local = mark_partial(
            copy_placement(b, nn.Parameter(b.detach(), requires_grad=b.requires_grad)), ctx.group, ctx.meter
        )
    b_local.requires_grad_(b.requires_grad)
    set_adapters(dst, a, b_local, scale, dropout)


def shard_row_adapters(src: nn.Module, dst: nn.Module, ctx) -> None:
    """Give the row-parallel ``dst`` the adapters of ``src``: A's columns sharded, B whole (partial)."""
    if not has_adapters(src):
        return
    a, b, scale, dropout = adapter_weights(src)
    a_local = sharded_param(a, 1, ctx)
    a_local.requires_grad_(a.requires_grad)
    set_adapters(dst, a_local, mark_partial(b, ctx.group, ctx.meter), scale, dropout)


def column_deltas(x: torch.Tensor, modules: Sequence[nn.Module], ctx) -> list[torch.Tensor | None]:
    """(α/r)·B_r(A x) of each column-parallel module sharing the input ``x`` (None: no adapters);
    one collective over the concatenated h of all of them (module docstring)."""
    with_lora = [m for m in modules if has_adapters(m)]
    if not with_lora:
        return [None] * len(modules)
    hs = [lora_input(m, x) for m in with_lora]  # (B, T or T/n, r) each
    h = torch.cat(hs, dim=-1) if len(hs) > 1 else hs[0]
    h = gather_seq(h, ctx.group, ctx.meter) if ctx.sp else copy_to_tp(h, ctx.group, ctx.meter)  # (B, T, Σr)
    parts = iter(h.split([t.shape[-1] for t in hs], dim=-1))
    out: list[torch.Tensor | None] = []
    for m in modules:
        if not has_adapters(m):
            out.append(None)
            continue
        part = next(parts)
        rows = getattr(m, "replicated_rows", None)
        _, b, scale, _ = adapter_weights(m)
        out.append(torch.nn.functional.linear(part, b if rows is None else b[rows]) * scale)
    return out


def row_delta(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """This rank's part (α/r)·B(A_r x_r) of a row-parallel adapter's output (summed with the layer's)."""
    return lora_output(module, lora_input(module, x)) if has_adapters(module) else None
