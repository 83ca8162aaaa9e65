"""The checkpoint adapter of the co-located parameter server (:mod:`loom.parallel.param_server`).

Names are the single-device ones (:mod:`loom.checkpoint.protocol`), so a checkpoint saved here
resumes under all-reduce data parallelism, ZeRO or another ps_shards, and the other way round:

    model.<fqn>            whole on every worker: replicated over the W workers
    optim.<fqn>.exp_avg    server k's flat range of the parameter, [max(o, s_k), min(o + n, e_k)) − o
    optim.<fqn>.exp_avg_sq for a parameter at [o, o + n) of the flat buffer and shard k = [s_k, e_k)
    optim.<fqn>.step       the server's step count (written by the holder of element 0)

Loading fills the parameters on every worker (they are views of the flat buffer the servers
update in place) and each server's moments; the servers' step counts must agree.
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


class ColocatedPSState:
    """:class:`~loom.checkpoint.protocol.Shardable` of a ``ColocatedParamServer``."""

    def __init__(self, strategy) -> None:
        self.s = strategy
        self.index, self.count = _rank_size(strategy.group)
        self._steps: list[torch.Tensor] = []

    def sharded_state(self) -> dict[str, ShardedTensor]:
        s, module = self.s, self.s.module
        readers = read_group(s.group, s.model.flat.device)
        placements = {name: Placement.replicated(t, (self.index, self.count), readers)
                      for name, t in unique_named_tensors(module) if t.requires_grad or not isinstance(t, torch.nn.Parameter)}  # fmt: skip
        out = placement_state(placements)
        self._steps = []
        opt = s.optimizer
        if opt is None:
            return out
        names = {id(t): n for n, t in unique_named_tensors(module)}
        lay = s.model.layout  # its start/end: this rank's server's shard
        for p, slot in zip(lay.params, lay.slots):
            lo, hi = max(slot.offset, lay.start), min(slot.offset + slot.numel, lay.end)
            if lo >= hi:
                continue
            fqn, a, b = names[id(p)], lo - lay.start, hi - lay.start
            for key, buf in (("exp_avg", opt.exp_avgs[0]), ("exp_avg_sq", opt.exp_avg_sqs[0])):
                out[f"optim.{fqn}.{key}"] = ShardedTensor(
                    buf[a:b], tuple(p.shape), Flat(lo - slot.offset, hi - lo)
                )
            step = torch.tensor(float(opt.step_count))
            self._steps.append(step)
            out[f"optim.{fqn}.step"] = ShardedTensor.full(step, (0, 1) if lo == slot.offset else (1, 2))
        return out

    @torch.no_grad()
    def load_sharded(self, reader: ShardReader) -> None:
        reader.fill(self.sharded_state())
        steps = {int(t.item()) for t in self._steps}
        if len(steps) > 1:
            raise CheckpointError(f"optimizer step counts differ between parameters: {sorted(steps)}")
        if self.s.optimizer is not None and steps:
            self.s.optimizer.step_count = steps.pop()
