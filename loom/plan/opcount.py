"""Operators a training step executes, counted by running a tiny model of the same structure.

Small models on a CPU (or tiny layers on a GPU) spend their time in the framework's per-operator
cost (Python, dispatcher, autograd), which does not shrink when tensor, context or pipeline
parallelism splits the FLOPs. The cost model charges ``ops · c_op`` beside the FLOP and byte
terms, where ``c_op`` is the device's per-operator cost (:class:`~loom.plan.hardware.DeviceSpec`
``op_overhead``, measured by ``loom plan calibrate``).

The counts do not depend on widths, so they are taken on a model with the same structure (norms,
MLP kind, positions, biases, heads, experts) but 8-wide heads, 32-wide MLPs, a 64-token vocabulary
and 16-token sequences, on the CPU, under a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
that counts every ATen call, under each recomputation policy (:func:`~loom.memory.recompute.apply_recompute`:
the checkpointed forward runs again in backward, with the checkpoint's own calls). One and two
layers give the per-layer and the fixed counts (``ops(L) = fixed + L · per_layer``); the optimizer
step is counted on the same two models' flat parameter shards
(:func:`~loom.optim.flat.build_flat_optimizer`, one shard).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from loom.config import ModelConfig, MoEConfig

TOKENS = 16  # sequence length of the counting runs
HEAD_DIM = 8


@dataclass(frozen=True)
class OpCounts:
    """ATen operators per micro-batch (forward + backward) and per optimizer step."""

    layer_fb: float  # one block, forward + backward
    layer_selective: float  # the same with the attention core recomputed (train.recompute = selective)
    layer_full: float  # the same with the block recomputed (full: checkpointing adds the forward again)
    fixed_fb: float  # embedding, final norm, head and loss, forward + backward
    optimizer_layer: float  # optimizer step: per block's parameters
    optimizer_fixed: float  # optimizer step: the rest (embedding, final norm, the fused calls)

    def microbatch(self, layers: float, recompute: str = "none", head: bool = True) -> float:
        """Operators of one micro-batch through ``layers`` blocks (and the head and loss if ``head``)."""
        per = {"selective": self.layer_selective, "full": self.layer_full}.get(recompute, self.layer_fb)
        return layers * per + (self.fixed_fb if head else 0.0)

    def optimizer(self, layers: float) -> float:
        return self.optimizer_fixed + layers * self.optimizer_layer


COUNT_EXPERTS = 256  # the most experts a counting model holds (DeepSeek-V3's routed count): ops per
# layer of the grouped path do not grow with E, and a million-expert config must be judged, not built


def tiny_config(model: ModelConfig, n_layers: int) -> ModelConfig:
    """``model``'s structure at counting size: same heads, norms, MLP, positions and biases; its
    experts up to :data:`COUNT_EXPERTS`."""
    experts = min(model.n_experts, COUNT_EXPERTS)
    local = sorted(i for i in model.local_layers() if i < n_layers)  # its windowed layers among the first
    return dataclasses.replace(
        model,
        window_layers=",".join(map(str, local)),
        sliding_window=model.sliding_window if local else 0,
        rope_local_theta=model.rope_local_theta if local else 0.0,
        n_experts=experts,
        top_k=min(model.top_k, experts),
        n_layers=n_layers,
        attn_head_dim=HEAD_DIM,
        dim=HEAD_DIM * model.n_heads,
        ffn_dim=32,
        multiple_of=8,
        vocab_size=64,
        pad_vocab_to=0,  # the counting model's own vocabulary, whatever padding the real one asks for
        max_seq_len=TOKENS,
        from_hf="",
        rope_scaling=0.0,
    )


def _count(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.n += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        fn()
    return Counter.n


def _model_counts(
    model: ModelConfig, moe: MoEConfig | None, optimizer: str, batch: int
) -> tuple[int, int, int, int]:
    """(forward + backward under recompute none, selective, full; optimizer step) operators of the tiny model ``model``."""
    import torch

    from loom.config import TrainConfig
    from loom.memory.recompute import apply_recompute
    from loom.model.llama import build_model, loss_fn
    from loom.optim.flat import build_flat_optimizer
    from loom.optim.store import StateStore
    from loom.parallel.layout import FlatLayout, decayed_ids

    net = build_model(model, seed=0, moe=moe)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.vocab_size, (batch, TOKENS), generator=g)
    y = torch.randint(0, model.vocab_size, (batch, TOKENS), generator=g)
    fb = []
    for mode in ("none", "selective", "full"):
        apply_recompute(net, mode)
        loss_fn(net(x), y).backward()  # warm-up: lazy buffers and caches are not per-step work
        fb.append(_count(lambda: loss_fn(net(x), y).backward()))
    apply_recompute(net, "none")
    net.zero_grad(set_to_none=True)
    params = [p for p in net.parameters() if p.requires_grad]
    lay = FlatLayout(params, 1, 0, decayed_ids(net))
    flat = lay.new_flat()
    lay.bind(flat)
    opt = build_flat_optimizer(
        [lay],
        [lay.shard_of(flat)],
        StateStore(flat.device),
        TrainConfig(optimizer=optimizer),  # type: ignore[arg-type]
    )
    grads = [torch.randn_like(lay.shard_of(flat))]
    opt.step(grads, 1e-3)  # the first step builds the state
    return fb[0], fb[1], fb[2], _count(lambda: opt.step(grads, 1e-3))


def op_counts(model: ModelConfig, moe: MoEConfig | None = None, optimizer: str = "adamw") -> OpCounts:
    """Per-layer and fixed operator counts of ``model``, cached per structure in this process and on
    disk (:func:`_stored`): counting takes ~1.5 s in a fresh process (the model's first forward under a
    dispatch mode imports torch._dynamo), on the path of every ``loom train`` launch's check."""
    key = repr((tiny_config(model, 1), moe, optimizer))
    if key not in _CACHE:
        path = _stored(key)
        try:
            _CACHE[key] = OpCounts(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):  # absent, half-written by another process, or stale
            _CACHE[key] = _measure(model, moe, optimizer)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(dataclasses.asdict(_CACHE[key])))
                os.replace(tmp, path)  # atomic: a reader sees the whole file or none
            except OSError:  # a read-only cache: counting again next time is only slower
                pass
    return _CACHE[key]


_CACHE: dict[str, OpCounts] = {}


def _stored(key: str) -> Path:
    """``<LOOM_CACHE_DIR or ~/.cache/loom>/opcounts/<hash>.json``; the hash covers the structure
    ``key``, torch's version and the source of every ``loom`` module (any change in how a step is
    built or run counts again)."""
    import torch

    global _SOURCE
    if _SOURCE is None:
        h = hashlib.sha256()
        root = Path(__file__).resolve().parent.parent
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
        _SOURCE = h.hexdigest()
    digest = hashlib.sha256(f"{key}|{torch.__version__}|{_SOURCE}".encode()).hexdigest()[:24]
    return (
        Path(os.environ.get("LOOM_CACHE_DIR") or "~/.cache/loom").expanduser() / "opcounts" / f"{digest}.json"
    )


_SOURCE: str | None = None


def _measure(model: ModelConfig, moe: MoEConfig | None, optimizer: str) -> OpCounts:
    import torch

    threads = torch.get_num_threads()
    batch = max(
        1, -(-4 * max(1, min(model.n_experts, COUNT_EXPERTS)) // TOKENS)
    )  # MoE: ~4 tokens per expert, every expert busy
    try:
        torch.set_num_threads(1)
        with torch.random.fork_rng(devices=[]):
            one = _model_counts(tiny_config(model, 1), moe, optimizer, batch)
            two = _model_counts(tiny_config(model, 2), moe, optimizer, batch)
    finally:
        torch.set_num_threads(threads)
    (fb1, sel1, full1, op1), (fb2, sel2, full2, op2) = one, two
    return OpCounts(
        layer_fb=fb2 - fb1,
        layer_selective=sel2 - sel1,
        layer_full=full2 - full1,
        fixed_fb=2 * fb1 - fb2,
        optimizer_layer=op2 - op1,
        optimizer_fixed=2 * op1 - op2,
    )
