"""``train.compile``: ``torch.compile`` applied to a parallelized model, after every other dimension.

Modes:

    none     eager PyTorch
    blocks   regional compilation (torchtitan's recipe): each transformer block's ``forward`` and
             the loss are compiled; identical blocks share one compiled graph (with
             ``inline_inbuilt_nn_modules`` dynamo treats parameters as inputs, so it guards on the
             code, not on the module), so compile time is about one block's, not L blocks'
    full     the whole model's ``forward`` (embedding, blocks, norm, head) and the loss

Only ``forward`` is compiled, never a module's ``__call__``: the hooks other dimensions install on
the modules they own (ZeRO-3 gathers before a unit's forward and backward, data-parallel bucket
hooks on gradients, which run in autograd's engine) stay eager around the compiled code, exactly
as without compile. Recomputation: the block's checkpoint wrapper is compiled with it (dynamo
traces ``torch.utils.checkpoint`` as a higher-order op; the recomputed forward is the compiled one).

Communication is never traced: the forward of every module of :mod:`loom.parallel` inside a
compiled region (tensor-parallel linears and loss, context-parallel cores, expert-parallel MoE)
is wrapped in ``torch.compiler.disable``, so it runs eagerly
between compiled pieces: a graph break at a known place, never a collective whose metering or
ordering dynamo would replay once at trace time. :class:`CompileReport` logs the graphs and the
graph breaks (count and reasons) once the first forward has compiled, and counts recompilations
(the micro-batch shapes are fixed by the config: none after the first step).

The one-process MoE layer (ep = 1) compiles: experts are counted by a fixed-size scatter-add (not
``bincount``), fp32 takes the padded batched matmul (the fake kernel of ``torch._grouped_mm`` takes
bf16 only), and only its balancing helper (the statistics' all-reduce, ``recomputing()``) runs
eagerly: one graph break per MoE block, 4 graphs per block shape. Expert-parallel MoE (a module of
:mod:`loom.parallel`: its all-to-all) stays an island.

Regions (``blocks`` under the zb-h1 schedule or ``train.compress``): a compiled block is one
autograd node computing input and weight gradients together, so zb-h1's deferred weight pass
(:func:`loom.parallel.pipeline.stage.backward_weight`, which re-enters the graph at each weight's
join node) would run the whole block's backward twice; and compression names a saved tensor's kind
by module hooks, which dynamo traces as side effects replayed after the graph (every tensor a
compiled block saves would count as the kind on the stack before it). So there the grain is finer:
the ``forward`` of each module that names an ``activation_kind`` and holds no other such module
(each norm, the attention, the dense MLP) is compiled, with every ``nn.Linear`` inside it an eager
island; the residual adds stay eager. Each linear's weight then joins the backward at its own eager
``mm`` node (BW runs only dW = dYᵀX, as without compile) and each region's kind hooks run eagerly
around its compiled forward. A norm's weight joins at the norm's compiled node, so BW runs that
norm's backward a second time (one memory-bound pass over (B, T, h) per norm per micro-batch); and
the process compiles without donated buffers (BI retains the graph, which a backward freeing its
saved inputs refuses; the flag is read at compile, lazy backward compile and run time). Under
compression, the regions of a kind that is compressed stay eager: inductor chooses other saved
tensors than eager code (fewer bytes: docs/speed.md), and a lossy format applied to
other tensors gives other gradients. A module with parameters outside its linears other than a
norm (the MoE layer, whose experts are stacked weights) stays eager in this mode.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from loom.model.llama import keep_eager_under_compile

log = logging.getLogger("loom")

REPORT_ATTR = "_loom_compile_report"

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _counters() -> Any:
    from torch._dynamo.utils import counters

    return counters


def _eager_module(m: nn.Module) -> bool:
    """A module whose forward communicates (every module of :mod:`loom.parallel`: expert-parallel
    MoE included): run eagerly."""
    return type(m).__module__.startswith("loom.parallel.")


def _eager_islands(region: nn.Module, linears: bool = False) -> list[str]:
    """Wrap the forward of each communicating module inside ``region`` (not ``region`` itself), and
    with ``linears`` of each ``nn.Linear``, in ``torch.compiler.disable``; returns their class names."""
    names = []
    for name, m in region.named_modules():
        island = _eager_module(m) or (linears and isinstance(m, nn.Linear))
        if name and island and not getattr(m.forward, "_loom_eager", False):
            eager = torch.compiler.disable(m.forward, recursive=True)
            eager._loom_eager = True  # type: ignore[attr-defined]  # a function takes attributes
            m.forward = eager
            names.append(type(m).__name__)
    return names


def _blocks(model: nn.Module) -> list[nn.Module]:
    from loom.model.llama import Block

    return [m for m in model.modules() if isinstance(m, Block)]


class CompileReport:
    """Dynamo's counters since :func:`apply_compile`: graphs compiled, graph breaks by reason."""

    def __init__(self, mode: str, islands: list[str]) -> None:
        self.mode, self.islands = mode, islands
        c = _counters()
        self._graphs0 = c["stats"]["unique_graphs"]
        self._breaks0 = dict(c["graph_break"])
        self.logged = False

    @property
    def graphs(self) -> int:
        """Graphs compiled since apply_compile (each block shape once; more after a recompilation)."""
        return _counters()["stats"]["unique_graphs"] - self._graphs0

    def breaks(self) -> dict[str, int]:
        """Graph breaks since apply_compile, by reason."""
        now = dict(_counters()["graph_break"])
        diff = {k: v - self._breaks0.get(k, 0) for k, v in now.items()}
        return {k: v for k, v in diff.items() if v}

    def line(self) -> str:
        breaks: Counter[str] = Counter()
        for reason, n in self.breaks().items():
            island = re.search(r"function `?<function (\S+) at", reason)  # a compiler.disable'd forward
            breaks[f"eager {island.group(1)}" if island else reason.splitlines()[0][:120]] += n
        where = "; ".join(f"{n}x {k}" for k, n in breaks.items())
        return f"compile={self.mode}: {self.graphs} graphs, {sum(breaks.values())} graph breaks" + (
            f" ({where})" if where else ""
        )

    def log_once(self) -> None:
        if not self.logged:
            self.logged = True
            log.info(self.line())


def apply_compile(
    model: nn.Module, mode: str, loss_fn: LossFn, *, compress: str = "none", zero_bubble: bool = False
) -> tuple[LossFn, CompileReport | None]:
    """Compile ``model`` (``train.compile``: none | blocks | full) in place, after the parallel
    dimensions and recomputation; returns the loss to use (compiled too) and the report (None for
    ``none``). ``blocks`` compiles regions (module docstring) when ``zero_bubble`` (the zb-h1
    schedule) or ``compress`` (``train.compress``) is not none. The report is logged after the first
    compiled loss has run."""
    if mode == "none":
        return loss_fn, None
    if mode not in ("blocks", "full"):
        raise ValueError(f"train.compile: unknown mode {mode!r} (none, blocks, full)")
    from loom.config import parse_compress

    formats = parse_compress(compress)
    why = [w for w, on in (("zb-h1", zero_bubble), (f"compress={compress}", compress != "none")) if on]
    if why and mode == "full":
        raise ValueError(f"train.compile: 'full' cannot run under {' and '.join(why)}; use blocks or none")
    islands: list[str] = []
    label = mode
    if why:
        regions, eager = _fine_regions(model, formats)
        kinds = sorted({getattr(m, "activation_kind", "") for m, _ in regions})
        label = f"blocks as regions ({', '.join(why)}): {', '.join(kinds) or 'none'} compiled, linears eager"
        label += f", {', '.join(eager)} eager" if eager else ""
    else:
        regions = _regions(model, mode)
    keep_eager_under_compile()
    for region, attr in regions:
        islands += _eager_islands(region, linears=bool(why))
        setattr(region, attr, torch.compile(getattr(region, attr)))
    if zero_bubble:  # read when a graph compiles, when its backward compiles (lazily) and when it runs
        torch._functorch.config.donated_buffer = False  # BI retains the graph for BW (module docstring)
    report = CompileReport(label, islands)
    model.__dict__[REPORT_ATTR] = report  # not a submodule or parameter: outside the state dict
    compiled_loss = torch.compile(loss_fn) if not _eager_loss(loss_fn) else loss_fn

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = compiled_loss(logits, targets)
        report.log_once()
        return out

    return loss, report


def compile_report(model: nn.Module) -> CompileReport | None:
    """The report of :func:`apply_compile` on ``model`` (None when it was not compiled)."""
    return model.__dict__.get(REPORT_ATTR)


def _regions(model: nn.Module, mode: str) -> list[tuple[nn.Module, str]]:
    """(module, method) pairs to compile: every block's forward, or the whole forward (a pipeline
    rank's stages: each stage's ``body``, blocks and head, which its schedule calls)."""
    if mode == "blocks":
        return [(b, "forward") for b in _blocks(model)]
    from loom.parallel.pipeline.stage import StageModule

    stages = [m for m in model.modules() if isinstance(m, StageModule)]
    return [(s, "body") for s in stages] if stages else [(model, "forward")]


def _fine_regions(model: nn.Module, formats: dict[str, str]) -> tuple[list[tuple[nn.Module, str]], list[str]]:
    """The regions of ``blocks`` under zb-h1 or compression (module docstring): the forward of each
    module in a block that names an ``activation_kind``, holds no other such module, is not of
    :mod:`loom.parallel`, keeps its parameters in ``nn.Linear`` children (a norm: its own weight) and
    whose kind ``formats`` does not compress. Returns them and the kinds left eager for compression."""
    regions: list[tuple[nn.Module, str]] = []
    eager: set[str] = set()
    for block in _blocks(model):
        for m in block.modules():
            kind = getattr(m, "activation_kind", None)
            if kind is None or _eager_module(m):
                continue
            inner = any(getattr(c, "activation_kind", None) for c in list(m.modules())[1:])
            linear = {id(p) for c in m.modules() if isinstance(c, nn.Linear) for p in c.parameters()}
            loose = [p for p in m.parameters() if id(p) not in linear]
            if inner or (loose and kind != "norm"):
                continue
            if formats.get(kind, "none") != "none":
                eager.add(kind)
                continue
            regions.append((m, "forward"))
    return regions, sorted(eager)


def _eager_loss(loss_fn: LossFn) -> bool:
    """The vocabulary-parallel loss (tensor parallelism) communicates: it stays eager."""
    fn = getattr(loss_fn, "func", loss_fn)  # a functools.partial
    return getattr(fn, "__module__", "").startswith("loom.parallel.")
