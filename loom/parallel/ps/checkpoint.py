"""The checkpoint adapter of the co-located parameter server (:mod:`loom.parallel.ps.strategy`).

Names are the single-device ones (:mod:`loom.checkpoint.protocol`), so a checkpoint saved here
resumes under all-reduce data parallelism, ZeRO or another ps_shards, and the other way round:

    model.<fqn>            whole on every worker: replicated over the W workers
    optim.<fqn>.exp_avg    server k's flat range of the parameter, [max(o, s_k), min(o + n, e_k)) − o
    optim.<fqn>.exp_avg_sq for a parameter at [o, o + n) of the flat buffer and shard k = [s_k, e_k)
    optim.<fqn>.step       the server's step count (written by the holder of element 0)

Loading fills the parameters on every worker (they are views of the flat buffer the servers
update in place) and each server's moments; the servers' step counts must agree.

Dedicated server ranks (:mod:`loom.parallel.ps.server`, :mod:`loom.train.ps_run`) write the same
names, the parameters too from the servers: server k writes ``model.<fqn>`` and ``optim.<fqn>.*``
of its range (its shard is the truth: under asp/ssp the workers' copies differ), the workers
only what no server holds (persistent buffers, frozen parameters), replicated over the W workers.
``optim.<fqn>.step`` is the server's AdamW step count: the steps under bsp (the checkpoint equals
all-reduce data parallelism's), W per step under asp/ssp (one update per push; its moments are
those of that sequence of updates).
"""

from __future__ import annotations

import torch

from loom.checkpoint.format import CheckpointError
from loom.checkpoint.protocol import Flat, ShardedTensor, ShardReader
from loom.checkpoint.replicated import (
    Placement,
    _rank_size,
    placement_state,
    read_group,
    unique_named_tensors,
)

Piece = tuple[
    str, tuple[int, ...], int, int, int
]  # fqn, global shape, slot offset, [lo, hi) in the flat buffer


def shard_pieces(module: torch.nn.Module, layout) -> list[Piece]:
    """The parameters of ``layout`` (a :class:`~loom.parallel.layout.FlatLayout`) that reach its
    shard [start, end), each with the flat range [lo, hi) of it there."""
    names = {id(t): n for n, t in unique_named_tensors(module)}
    out = []
    for p, slot in zip(layout.params, layout.slots):
        lo, hi = max(slot.offset, layout.start), min(slot.offset + slot.numel, layout.end)
        if lo < hi:
            out.append((names[id(p)], tuple(p.shape), slot.offset, lo, hi))
    return out


def shard_state(
    pieces: list[Piece], start: int, opt, params: torch.Tensor | None = None
) -> tuple[dict[str, ShardedTensor], list[torch.Tensor]]:
    """``optim.<fqn>.{exp_avg, exp_avg_sq, step}`` of the shard starting at flat element ``start`` (and
    ``model.<fqn>`` from ``params``, the shard's parameters, if given); the step tensors, to check on load."""
    out: dict[str, ShardedTensor] = {}
    steps = []
    for fqn, shape, offset, lo, hi in pieces:
        a, b, region = lo - start, hi - start, Flat(lo - offset, hi - lo)
        held = [("exp_avg", opt.exp_avgs[0]), ("exp_avg_sq", opt.exp_avg_sqs[0])]
        if params is not None:
            out[f"model.{fqn}"] = ShardedTensor(params[a:b], shape, region)
        for key, buf in held:
            out[f"optim.{fqn}.{key}"] = ShardedTensor(buf[a:b], shape, region)
        step = torch.tensor(float(opt.step_count))
        steps.append(step)
        out[f"optim.{fqn}.step"] = ShardedTensor.full(step, (0, 1) if lo == offset else (1, 2))
    return out, steps


def load_steps(opt, steps: list[torch.Tensor]) -> None:
    """The step count read into ``steps`` (one per parameter piece) becomes ``opt``'s; they must agree."""
    counts = {int(t.item()) for t in steps}
    if len(counts) > 1:
        raise CheckpointError(f"optimizer step counts differ between parameters: {sorted(counts)}")
    if opt is not None and counts:
        opt.step_count = counts.pop()


class ColocatedPSState:
    """:class:`~loom.checkpoint.protocol.Shardable` of a ``ColocatedParamServer``."""

    def __init__(self, strategy) -> None:
        self.s = strategy
        self.index, self.count = _rank_size(strategy.group)
        self._steps: list[torch.Tensor] = []

    def sharded_state(self) -> dict[str, ShardedTensor]:
        s, module = self.s, self.s.module
        readers = read_group(s.group, s.model.flat.device)
        placements = {
            name: Placement.replicated(t, (self.index, self.count), readers)
            for name, t in unique_named_tensors(module)
            if t.requires_grad or not isinstance(t, torch.nn.Parameter)
        }
        out = placement_state(placements)
        self._steps = []
        if s.optimizer is None:
            return out
        optim, self._steps = shard_state(
            shard_pieces(module, s.model.layout), s.model.layout.start, s.optimizer
        )
        return {**out, **optim}

    @torch.no_grad()
    def load_sharded(self, reader: ShardReader) -> None:
        reader.fill(self.sharded_state())
        load_steps(self.s.optimizer, self._steps)


class WorkerState:
    """:class:`~loom.checkpoint.protocol.Shardable` of a ``PSWorker`` (dedicated servers): it saves what no
    server holds (persistent buffers, frozen parameters), replicated over the W workers, and loads all
    of the model (its first gradient needs the parameters before any pull)."""

    def __init__(self, worker) -> None:
        self.w = worker
        links = worker.links
        self.replica = (links.rank, links.workers)
        self.readers = read_group(links.worker_group, worker.model.flat.device)

    def _state(self, everything: bool) -> dict[str, ShardedTensor]:
        held = {id(p) for p in self.w.params}  # the servers' (trainable, in the flat buffer)
        return placement_state(
            {
                name: Placement.replicated(t, self.replica, self.readers)
                for name, t in unique_named_tensors(self.w.module)
                if everything or id(t) not in held
            }
        )

    def sharded_state(self) -> dict[str, ShardedTensor]:
        return self._state(everything=False)

    @torch.no_grad()
    def load_sharded(self, reader: ShardReader) -> None:
        reader.fill(self._state(everything=True))


class ServerState:
    """:class:`~loom.checkpoint.protocol.Shardable` of a dedicated ``ParameterServer``: its shard of the
    parameters and their AdamW moments (``server.pieces``: :func:`shard_pieces` of its layout)."""

    def __init__(self, server) -> None:
        self.server = server
        self._steps: list[torch.Tensor] = []

    def sharded_state(self) -> dict[str, ShardedTensor]:
        s = self.server
        out, self._steps = shard_state(s.pieces, s.start, s.optimizer, s.shard)
        return out

    @torch.no_grad()
    def load_sharded(self, reader: ShardReader) -> None:
        reader.fill(self.sharded_state())
        load_steps(self.server.optimizer, self._steps)
