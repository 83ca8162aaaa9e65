"""The resharding contract for the ZeRO strategies (:mod:`loom.parallel.zero`), stages 1-3.

Every ZeRO stage keeps, per flat buffer (a stage-1/2 bucket or a stage-3 unit), one
:class:`~loom.parallel.layout.FlatLayout` and this rank's shard ``[start, end)`` of the
buffer's fp32 master weights and Adam moments (``strategy.optim``). A parameter at
``[offset, offset + numel)`` of the buffer therefore contributes, on this rank, the flat range
``[max(offset, start), min(offset + numel, end)) - offset`` of its own flattening:

    model.<fqn>            that range of the fp32 master (the parameter itself when fp32)
    optim.<fqn>.exp_avg    that range of m;   optim.<fqn>.exp_avg_sq   that range of v
    optim.<fqn>.step       the step count, a scalar (written by the holder of element 0)

(optimizers other than AdamW name their own element-shaped buffers, ``checkpoint_buffers``:
8-bit Adam its dequantized m and v, Adafactor its second-moment estimate as ``exp_avg_sq``)

A tensor-parallel shard (``Placement.tp_dim``) is flattened on its own, so its range is a
:class:`~loom.checkpoint.protocol.Flat` *within* the tp box of the global tensor. Replicas:
hybrid sharding repeats each shard over ``replicate_group`` (R copies), and parameters that
tensor parallelism does not shard repeat over tp as well.

Loading fills exactly these ranges (the R hybrid replicas of a range read 1/R of it each and
all-gather over ``replicate_group``: :mod:`~loom.checkpoint.shared_read`); then the masters
go into the parameter shards (when they are distinct tensors), and stages 1-2, whose
parameters are whole on every rank, all-gather each flat bucket over the sharding group, as
after a step, instead of reading every parameter from disk. Read from disk per rank, for Φ
parameters and k fp32 state buffers (master, moments; k = 3 for AdamW) over N sharding ranks:
4kΦ/(N·R) bytes, at every stage.
"""

from __future__ import annotations

import torch

from loom import comm
from loom.checkpoint.format import CheckpointError
from loom.checkpoint.protocol import Box, Flat, ShardedTensor, ShardReader
from loom.checkpoint.replicated import _rank_size, read_group, unique_named_tensors
from loom.parallel.placement import expert_geometry, placement_of, tp_geometry


def _flat_state(opt, i: int) -> list[tuple[str, torch.Tensor]]:
    """(key, buffer laid out like shard i) pairs checkpointed for flat buffer i: the master weights, then
    Adam's moments, or what the optimizer names (``checkpoint_buffers``: Adafactor, 8-bit Adam)."""
    if hasattr(opt, "checkpoint_buffers"):
        return [("model", opt.masters[i]), *opt.checkpoint_buffers(i)]
    return [("model", opt.masters[i]), ("exp_avg", opt.exp_avgs[i]), ("exp_avg_sq", opt.exp_avg_sqs[i])]


class ZeroState:
    """:class:`~loom.checkpoint.protocol.Shardable` for ``ZeroDataParallel`` and ``FullyShardedZero``."""

    def __init__(self, strategy) -> None:
        self.s = strategy
        self.rep_rank, self.rep = _rank_size(strategy.replicate_group)
        self.tp_rank, self.tp = _rank_size(strategy.tp_group)
        self.names = {id(t): n for n, t in unique_named_tensors(strategy.module)}
        self.stage3 = strategy.shards_parameters
        self._steps: list[torch.Tensor] = []

    def sharded_state(self) -> dict[str, ShardedTensor]:
        opt = self.s.optim
        out: dict[str, ShardedTensor] = {}
        self._steps = []
        for i, lay in enumerate(self.s.layouts):
            for p, slot in zip(lay.params, lay.slots):
                lo, hi = max(slot.offset, lay.start), min(slot.offset + slot.numel, lay.end)
                if lo >= hi:
                    continue
                fqn = self.names[id(p)]
                shape, tp_offsets = tp_geometry(p, self.tp_rank, self.tp)
                within = None if tp_offsets is None else Box(tp_offsets, tuple(p.shape))
                readers = read_group(self.s.replicate_group, lay.device)
                expert = placement_of(p).expert
                if expert is not None:  # this rank's experts, repeated over their edp group
                    shape, offsets = expert_geometry(p, self.tp_rank, self.tp)
                    within = Box(offsets, tuple(p.shape))
                    # whole over tp (tp peers hold copies), or split there (parallel.expert_tp: distinct)
                    tp_rank, tp = (self.tp_rank, self.tp) if tp_offsets is None else (0, 1)
                    if lay.world > 1:  # sharded over the edp group: every piece distinct but for tp peers
                        replica, readers = (tp_rank, tp), None
                    else:
                        e_rank, e_size = _rank_size(expert.edp)
                        replica = (tp_rank * e_size + e_rank, tp * e_size)
                        readers = read_group(expert.edp, lay.device)
                elif within is None:
                    replica = (self.tp_rank * self.rep + self.rep_rank, self.tp * self.rep)
                else:
                    replica = (self.rep_rank, self.rep)
                start = lo - slot.offset
                a, b = lo - lay.start, hi - lay.start
                for key, buf in _flat_state(opt, i):
                    name = f"model.{fqn}" if key == "model" else f"optim.{fqn}.{key}"
                    out[name] = ShardedTensor(buf[a:b], shape, Flat(start, hi - lo, within), replica, readers)
                step = torch.tensor(float(opt.step_count))
                self._steps.append(step)
                origin = start == 0 and (within is None or not any(within.offsets)) and replica[0] == 0
                out[f"optim.{fqn}.step"] = ShardedTensor.full(step, (0, 1) if origin else (1, 2))
        return out

    @torch.no_grad()
    def load_sharded(self, reader: ShardReader) -> None:
        opt = self.s.optim
        reader.fill(self.sharded_state())
        steps = {int(t.item()) for t in self._steps}
        if len(steps) > 1:
            raise CheckpointError(f"optimizer step counts differ between parameters: {sorted(steps)}")
        opt.step_count = steps.pop() if steps else 0
        if hasattr(opt, "checkpoint_loaded"):  # optimizers whose state is derived from what was filled
            opt.checkpoint_loaded()
        for p, master in zip(opt.params, opt.masters):
            if master is not p:
                p.copy_(master)
        if not self.stage3:  # stages 1-2: every rank's shard into every bucket, as after a step
            for b in self.s.buckets:
                comm.all_gather(b.params, b.layout.shard_of(b.params), b.group)
