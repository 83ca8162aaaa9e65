"""Context parallelism: each sequence split over the ``cp`` ranks, attention over all of it.

Tokens. A sequence of T tokens is cut into 2·cp chunks of T/(2cp); cp rank r keeps chunks r and
2cp-1-r, in that order (:func:`local_positions`). Under the causal mask an early chunk attends to
few keys and a late one to many; pairing them gives every rank the same attention work (the
load-balanced layout of Megatron-LM's context parallelism). Embedding, norms, MLP, output head
and loss are token-local and run on the T/cp local tokens unchanged. Rotary embeddings need the
global positions: a pre-hook hands every block the tables' rows at the local positions instead of
the whole tables, so ``apply_rope``'s ``cos[:T/cp]`` reads exactly those (packed documents pass
each token's rows, by its position in its document, and are left alone).

Attention (``parallel.cp_mode``), each core in :mod:`loom.parallel.context`:

- ``allgather``: K and V all-gathered before the core, dK and dV reduce-scattered after
  (:mod:`~loom.parallel.context.allgather`); saves the whole sequence's K and V.
- ``ring``: K/V blocks circulate by point-to-point sends overlapped with the blocks' attention,
  dK/dV accumulators circulate in backward (:mod:`~loom.parallel.context.ring`); saves O(T/cp).
- ``alltoall``: q, k, v exchanged from sequence- to head-sharded and the output back
  (:mod:`~loom.parallel.context.alltoall`, Ulysses); saves O(T/cp); needs heads divisible by cp.

No mode builds a dense mask: causal attention of the load-balanced chunks is one causal block and
cp − 1 unmasked half blocks (:mod:`~loom.parallel.context.blocks`), merged by log-sum-exp.
A sliding window (``model.sliding_window`` on ``model.window_layers``) holds in every mode: ring and
allgather cut the blocks by chunk and skip those beyond the window, banding the rest by global
positions (:func:`~loom.parallel.context.blocks.window_blocks`); alltoall runs the one process's
windowed attention on its heads.
Bytes sent per rank per step: :func:`cp_comm_bytes`; saved activations per layer:
:func:`loom.memory.activations.activation_bytes_per_layer` with ``cp`` and ``cp_mode``.

Gradients. Every parameter is replicated over cp, and each rank's loss is the mean over its
T/cp tokens. The data-parallel reduction therefore runs over dp·cp ranks (ZeRO shards over
dp_shard·cp), and its average is the mean over all tokens, because every rank holds as many.
The result equals one process on the whole sequence.

Dropout. Each block runs on a generator private to its cp rank (seeded from one draw of the
default generator plus the rank, as tensor parallelism's, :func:`~loom.parallel.rng.private_rng`;
tp's own regions nest inside it): the residual-branch masks of the rank's tokens differ from every
other rank's, and recomputation, which restores the default generator before replaying a block,
draws them again identically. Attention dropout: ring and allgather drop each block's
probabilities with a mask drawn from the block's seed (one draw per core call, plus query and key
ranks; :func:`~loom.parallel.context.blocks.block_seed`), drawn again in backward, so the two modes
drop the same elements; alltoall drops inside the flash call on its heads. One process draws its
masks from one stream over the whole sequence, which no split can reproduce: with dropout the
tests assert what holds instead (recomputed = stored, ring = allgather, masks private per rank).
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch
from torch import nn

from loom.comm import CommMeter, Group
from loom.model.llama import CoreAttention
from loom.parallel.context.allgather import AllGatherCore
from loom.parallel.context.alltoall import AllToAllCore, kv_repeat
from loom.parallel.context.blocks import local_positions
from loom.parallel.context.ring import RingCore
from loom.parallel.rng import private_rng

__all__ = ["apply_context_parallel", "context_core", "cp_comm_bytes", "local_positions", "shard_sequence"]


def shard_sequence(batches, cp: int, rank: int):
    """This cp rank's columns (:func:`local_positions`) of each micro-batch: (tokens, targets), or with
    packed documents (tokens, targets, positions), every tensor (B, T) cut alike."""
    if cp == 1:
        return batches
    out = []
    for batch in batches:
        idx = local_positions(batch[0].shape[1], cp, rank).to(batch[0].device)
        out.append(tuple(t.index_select(1, idx) for t in batch))
    return out


CORES: dict[str, type[nn.Module]] = {"allgather": AllGatherCore, "ring": RingCore, "alltoall": AllToAllCore}


def context_core(
    mode: str,
    group: Group,
    rank: int,
    cp: int,
    meter: CommMeter | None = None,
    dropout: float = 0.0,
    scale: float = 0.0,
    softcap: float = 0.0,
    window: int = 0,
) -> nn.Module:
    """The attention core of ``mode`` for cp rank ``rank`` of ``group`` (attention dropout ``dropout``,
    scores scaled by ``scale``, soft-capped by ``softcap`` and windowed by ``window`` as
    :class:`CoreAttention`'s)."""
    return CORES[mode](group, rank, cp, meter, dropout, scale, softcap, window)


class CpPrivateRng:
    """Forward hooks running a module on a generator private to cp rank ``rank``
    (:func:`loom.parallel.rng.private_rng`): entered before its forward, left after (also when it
    raises). A checkpoint inside the forward stashes the private generator's state and replays it."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device
        self.open: list[contextlib.AbstractContextManager] = []

    def attach(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self.enter)
        module.register_forward_hook(self.leave, always_call=True)

    def enter(self, _module: nn.Module, _args: Any) -> None:
        ctx = private_rng(self.rank, self.device)
        ctx.__enter__()
        self.open.append(ctx)

    def leave(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        if self.open:  # (empty when entering itself failed)
            self.open.pop().__exit__(None, None, None)


def apply_context_parallel(
    model: nn.Module,
    mesh,
    *,
    mode: str,
    seq_len: int,
    dropout: float = 0.0,
    meter: CommMeter | None = None,
) -> None:
    """Swap every attention core for the core of ``mode`` (``parallel.cp_mode``), give every block the
    rotary rows of this rank's positions of a ``seq_len`` sequence (a forward pre-hook) and, with
    ``dropout`` > 0 (``model.dropout``), a cp-private generator (in place; before the pipeline split,
    so stages share the blocks)."""
    cp, rank, group = mesh.size("cp"), mesh.local_rank("cp"), mesh.group("cp")
    if cp == 1:
        return
    positions = local_positions(seq_len, cp, rank)
    rope_cos, rope_sin = cast(torch.Tensor, model.rope_cos), cast(torch.Tensor, model.rope_sin)  # buffers
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, CoreAttention):
                core = context_core(
                    mode, group, rank, cp, meter, child.dropout, child.scale, child.softcap, child.window
                )
                setattr(module, name, core)
    if dropout > 0:  # each cp rank's tokens (and heads) draw their own masks, replayable
        private = CpPrivateRng(rank, rope_cos.device)
        for block in cast(nn.ModuleList, model.layers):
            private.attach(block)
    local = (rope_cos[positions.to(rope_cos.device)], rope_sin[positions.to(rope_sin.device)])
    model.register_buffer("cp_rope_cos", local[0], persistent=False)  # buffers: constants, not activations
    model.register_buffer("cp_rope_sin", local[1], persistent=False)

    whole = rope_cos.dim()  # (T_max, d/2), or (T_max, 2, d/2) with two RoPE bases (Gemma 3)

    def local_rows(_block: nn.Module, args: tuple) -> tuple | None:
        """A block gets the whole rotary tables (T_max, [2,] d/2) and reads their first T/cp rows: give
        it this rank's positions' rows instead. Packed documents pass each token's rows (B, T/cp, [2,]
        d/2), gathered by its position in its document: left as they are."""
        if len(args) >= 3 and args[1].dim() == whole:  # read from the model: buffers follow .to(device)
            return (args[0], model.cp_rope_cos, model.cp_rope_sin, *args[3:])
        return None

    for block in cast(nn.ModuleList, model.layers):  # the blocks, shared by pipeline stages made later
        block.register_forward_pre_hook(local_rows)
    pos_ids = getattr(model, "pos_ids", None)
    if pos_ids is not None:  # learned positions: the table's rows at this rank's global positions
        model.pos_ids = positions.to(pos_ids.device)


def cp_layer_bytes(
    batch: int,
    seq_len: int,
    kv_width: int,
    cp: int,
    elem: int,
    mode: str = "allgather",
    q_width: int = 0,
    head_dim: int = 1,
) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends per layer and micro-batch under ``mode``, with
    kv = B·(T/cp)·kv_width elements of local keys (kv_width = k·d per tp rank), e = ``elem``:

        allgather  forward 2·kv·e·(cp-1)            backward the same (reduce-scatter of dK, dV)
        ring       forward 2·kv·e·(cp-1)            backward 2·kv·e·(cp-1) + 2·kv·4·cp (fp32 dK, dV)
        alltoall   forward (2·q + 2·kv')·e·(cp-1)/cp  backward the same; q = B·(T/cp)·q_width,
                   kv' = kv·f with f = cp/gcd(k, cp) (key/value heads repeated, k = kv_width/head_dim)

    Packed documents add per core call an all-gather of B·2 int64 document-start counts and the
    keys' document ids (int64, B·(T/cp) per K/V message or gathered); not counted here.
    """
    if cp == 1:
        return 0, 0
    kv = batch * (seq_len // cp) * kv_width
    if mode == "alltoall":
        q = batch * (seq_len // cp) * q_width
        moved = (2 * q + 2 * kv * kv_repeat(kv_width // head_dim, cp)) * elem * (cp - 1) // cp
        return moved, moved
    fwd = 2 * kv * elem * (cp - 1)
    return fwd, fwd + (2 * kv * 4 * cp if mode == "ring" else 0)


def cp_comm_bytes(
    batch: int,
    seq_len: int,
    kv_width: int,
    n_layers: int,
    cp: int,
    elem: int,
    micro_batches: int = 1,
    recompute: bool = False,
    mode: str = "allgather",
    q_width: int = 0,
    head_dim: int = 1,
) -> int:
    """Bytes one rank sends per step for context parallelism: :func:`cp_layer_bytes` per layer and
    micro-batch, the forward's again under full recomputation."""
    fwd, bwd = cp_layer_bytes(batch, seq_len, kv_width, cp, elem, mode, q_width, head_dim)
    return (fwd * (2 if recompute else 1) + bwd) * n_layers * micro_batches
