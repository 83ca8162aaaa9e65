"""Per-layer profile on the real device, and the stage cut it implies (PipeDream's planner).

Profile. Every block of the model is timed on the run's device with one micro-batch
(forward, then backward; median of ``repeats`` after a warm-up), and so are the token
embedding and the final norm + output head + loss. Activation bytes are what autograd saves
for backward (counted with ``saved_tensors_hooks``, parameters excluded).

Cut. The embedding's cost is added to block 0 and the head's to block L-1, so each stage
keeps at least one block and :func:`~.partition.partition` cuts L units into n = p*v stages
minimizing the slowest stage, max_k sum_{i in k} (t_fwd_i + t_bwd_i), under a per-stage
memory limit (CUDA: 90% of the device memory; CPU: none).

Predicted memory of stage k (fp32 AdamW):

    state_k = 16 * Phi_k                 (weight 4 + gradient 4 + two Adam moments 8 bytes)
    acts_k  = A_k * f_r / v              (A_k saved bytes of one micro-batch, f_r the peak
                                          in-flight (micro-batch, chunk) pairs of rank r = k % p)

All ranks profile at once (tensor-parallel layers then pair their collectives) and use rank
0's result, so every rank cuts the same way.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from loom.device import synchronize
from loom.model.llama import Transformer
from loom.parallel.pipeline.partition import parse_layout, partition, stage_sums
from loom.parallel.pipeline.schedules import build_schedule
from loom.parallel.pipeline.simulate import peak_in_flight

__all__ = ["LayerProfile", "choose_layout", "describe_layout", "layer_costs", "profile_model"]


@dataclass
class LayerProfile:
    """Per unit (embedding, block 0..L-1, head): forward and backward seconds, saved and parameter bytes."""

    names: list[str]
    fwd_s: list[float]
    bwd_s: list[float]
    act_bytes: list[int]
    param_bytes: list[int]


def _time(
    fn: Callable[[], tuple[torch.Tensor, torch.Tensor | None]],
    device: torch.device,
    repeats: int,
    params: set[int],
) -> tuple[float, float, int]:
    """fn() -> (output, grad or None); returns median forward s, median backward s, saved bytes."""
    fwd, bwd, saved = [], [], 0
    for i in range(repeats + 1):
        sizes: list[int] = []

        def pack(t: torch.Tensor, sizes: list[int] = sizes) -> torch.Tensor:
            if t.data_ptr() not in params:
                sizes.append(t.numel() * t.element_size())
            return t

        synchronize(device)
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, grad = fn()
        synchronize(device)
        t1 = time.perf_counter()
        if out.requires_grad:  # a frozen part (LoRA's embedding) has no backward
            out.backward(grad)
        synchronize(device)
        t2 = time.perf_counter()
        if i > 0:  # the first run warms up allocators and kernels
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            saved = sum(sizes)
    return statistics.median(fwd), statistics.median(bwd), saved


@contextlib.contextmanager
def _real(params: list[nn.Parameter], device: torch.device) -> Iterator[None]:
    """Parameters on the meta device hold small random values on ``device`` inside (timing needs shapes,
    not values), and are back on meta after: one unit's memory at a time."""
    from loom.parallel.materialize import swap_in

    g = torch.Generator(device="cpu").manual_seed(0)
    meta = [p for p in dict.fromkeys(params) if p.is_meta]
    for p in meta:
        swap_in(p, torch.randn(p.shape, generator=g).mul_(0.02).to(device, p.dtype))
    try:
        yield
    finally:
        for p in meta:
            p.grad = None
            swap_in(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))


def profile_model(
    model: nn.Module,
    micro_batch: int,
    seq_len: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    repeats: int = 3,
    seq_div: int = 1,
    cp: int = 1,
) -> LayerProfile:
    """Time every unit of a Llama ``Transformer`` on its device with a (micro_batch, seq_len / cp)
    batch (a context-parallel rank's tokens; blocks see seq_len / seq_div positions: that, cut
    again by tp under sequence parallelism)."""
    tf = cast(Transformer, model)  # its modules may be tensor/context-parallel swaps of the originals
    p0 = next(model.parameters())
    device, cfg = next(model.buffers()).device, tf.cfg  # buffers are real also when parameters are on meta
    g = torch.Generator(device="cpu").manual_seed(0)
    host = torch.device("cpu")  # drawn on the host from a seeded generator: the same inputs on any device
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len // cp), generator=g, device=host).to(
        device
    )
    h = torch.randn(micro_batch, seq_len // seq_div, cfg.dim, generator=g, device=host).to(device, p0.dtype)
    dh = torch.randn(micro_batch, seq_len // seq_div, cfg.dim, generator=g, device=host).to(device, p0.dtype)
    prof = LayerProfile([], [], [], [], [])

    def add(name: str, module_params: list[nn.Parameter], fn) -> None:
        with _real(
            module_params, device
        ):  # a model built on meta: this unit's parameters, for its timing only
            params = {p.data_ptr() for p in model.parameters()}
            f, b, a = _time(fn, device, repeats, params)
        prof.names.append(name)
        prof.fwd_s.append(f)
        prof.bwd_s.append(b)
        prof.act_bytes.append(a)
        prof.param_bytes.append(sum(p.numel() * p.element_size() for p in module_params))

    add("embedding", list(tf.tok_embeddings.parameters()), lambda: (tf.tok_embeddings(tokens), dh))
    for i, layer in enumerate(tf.layers):
        x = h.detach().requires_grad_()
        add(
            f"block {i}",
            list(layer.parameters()),
            lambda layer=layer, x=x: (layer(x, tf.rope_cos, tf.rope_sin), dh),
        )
    head = list(tf.norm.parameters()) + list(tf.output.parameters())
    x = h.detach().requires_grad_()
    add("head+loss", head, lambda: (loss_fn(tf.logits(x), tokens), None))
    model.zero_grad(set_to_none=True)
    return prof


def layer_costs(prof: LayerProfile) -> tuple[list[float], list[float], list[float]]:
    """Per block: time (fwd+bwd), state bytes 16*Phi, activation bytes; embedding/head folded into the ends."""
    t = [f + b for f, b in zip(prof.fwd_s, prof.bwd_s)]
    state = [4.0 * b for b in prof.param_bytes]  # 16 bytes per fp32 parameter = 4x its 4 bytes
    acts = [float(a) for a in prof.act_bytes]
    out = []
    for values in (t, state, acts):
        inner = values[1:-1]
        inner[0] += values[0]
        inner[-1] += values[-1]
        out.append(inner)
    return out[0], out[1], out[2]


def _in_flight(cfg, p: int, v: int, m: int) -> list[int]:
    name = cfg.parallel.schedule
    if name == "2bw":
        return [p - r for r in range(p)]
    return peak_in_flight(build_schedule(name, p, m, v))


def describe_layout(bounds: list[int], prof: LayerProfile, p: int, in_flight: list[int]) -> str:
    """The cut, predicted per-stage time and memory, as printable lines."""
    t, state, acts = layer_costs(prof)
    n = len(bounds) - 1
    v = n // p
    times, states, act = stage_sums(t, bounds), stage_sums(state, bounds), stage_sums(acts, bounds)
    lines = [
        f"pipeline cut into {n} stages over {p} ranks (layers per stage: "
        f"{', '.join(f'{a}-{b - 1}' for a, b in zip(bounds, bounds[1:]))})"
    ]
    for k in range(n):
        mem = states[k] + act[k] * in_flight[k % p] / v
        lines.append(
            f"  stage {k} (rank {k % p}): layers {bounds[k]}-{bounds[k + 1] - 1}, "
            f"predicted {1e3 * times[k]:.2f} ms fwd+bwd per micro-batch, "
            f"{mem / 2**20:.1f} MiB (state {states[k] / 2**20:.1f} + activations {act[k] * in_flight[k % p] / v / 2**20:.1f})"
        )
    lines.append(f"  slowest stage {1e3 * max(times):.2f} ms, fastest {1e3 * min(times):.2f} ms")
    return "\n".join(lines)


def _mem_limit(device: torch.device) -> float | None:
    if device.type == "cuda":
        return 0.9 * torch.cuda.get_device_properties(device).total_memory
    return None


def choose_layout(
    model: nn.Module, cfg, m: int, loss_fn, log: Callable[[str], None] | None = None
) -> list[int]:
    """Stage boundaries: ``parallel.pp_layout`` if given, else profiled and cut; identical on every rank."""
    p, v, n_layers = cfg.parallel.pp, cfg.parallel.virtual_stages, cfg.model.n_layers
    if cfg.parallel.pp_layout:
        return parse_layout(cfg.parallel.pp_layout, n_layers, p * v)
    seq_div = (cfg.parallel.tp if cfg.parallel.sp else 1) * cfg.parallel.cp  # a block's tokens on one rank
    prof = profile_model(
        model, cfg.train.micro_batch, cfg.data.seq_len, loss_fn, seq_div=seq_div, cp=cfg.parallel.cp
    )
    in_flight = _in_flight(cfg, p, v, m)
    t, state, acts = layer_costs(prof)
    limit = _mem_limit(next(model.parameters()).device)
    mem = [s + a * max(in_flight) / v for s, a in zip(state, acts)]
    bounds = partition(t, p * v, mem if limit else None, limit)
    if dist.is_available() and dist.is_initialized():
        box = [bounds]
        dist.broadcast_object_list(box, src=0)
        bounds = box[0]
    if log is not None:
        log(describe_layout(bounds, prof, p, in_flight))
    return bounds
