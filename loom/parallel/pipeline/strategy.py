"""Pipeline parallelism as a training Strategy: the data-parallel strategy of this rank's stages,
plus the pipeline-wide norm and the tied embedding/head gradient.

:func:`apply_pipeline` cuts the model (at ``parallel.pp_layout`` or the profiled partitioner's
bounds) and keeps this rank's stages; the data-parallel strategy is applied to those stages, and
:class:`PipelineStrategy` composes it with the runtime. The pipeline replaces only forward and
backward (:mod:`loom.parallel.pipeline.step`); sync, clipping and the update are the shared
:func:`loom.train.step.optimizer_step` over this strategy:

    finish_sync   the dp reduction, then the tied embedding/head gradient summed between the
                  first and the last pipeline rank (synchronous schedules; on the device, through a
                  copy, when the inner strategy keeps its gradient shards in host memory)
    grad_sq       Σ over pp ranks of each stage's Σ g² (the tied matrix once); asynchronous
                  schedules (PipeDream, 2BW): the stage's own, as a pp-wide norm would
                  synchronise the stages the schedule decouples
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from loom import comm
from loom.comm import CommMeter, Group
from loom.parallel.base import Strategy, StrategyBase
from loom.parallel.pipeline.report import timeline_report
from loom.parallel.pipeline.runtime import (
    Batch,
    PipelineRuntime,
    RunStats,
    gather_timeline,
    loss_scale,
    step_schedule,
)
from loom.parallel.pipeline.schedules import Action
from loom.parallel.pipeline.simulate import Timeline, check
from loom.parallel.pipeline.stage import PipelineModule, exchange_tied_grad, gather_full_state, split_model
from loom.parallel.placement import placement_of
from loom.rules import ASYNC_SCHEDULES

__all__ = ["ASYNC", "PipelineStrategy", "apply_pipeline"]

ASYNC = ASYNC_SCHEDULES  # stage-local weight versions: each stage clips and steps on its own
log = logging.getLogger("loom")


def apply_pipeline(model, mesh, *, bounds: list[int], seq_div: int = 1) -> PipelineModule:
    """Cut ``model`` into ``pp * virtual_stages`` stages at ``bounds`` (``parallel.pp_layout`` or the
    profiled partitioner: :func:`~loom.parallel.pipeline.profile.choose_layout`) and keep this pipeline
    rank's ones. ``seq_div``: what the sequence is cut by inside a stage (tp with sequence parallelism)."""
    pipe = split_model(
        model, mesh.local_rank("pp"), mesh.size("pp"), bounds, mesh.group("pp"), mesh.pp_links()
    )
    pipe.seq_div = seq_div  # (batches arrive cut to this cp rank's tokens)
    pipe.tp_group = mesh.group("tp")
    return pipe


class PipelineStrategy(StrategyBase):
    """The data-parallel ``inner`` strategy of this rank's stages, plus the pipeline runtime.

    The timeline of step ``record_step`` is measured, kept in ``timeline`` and drawn to
    ``timeline_path``.
    """

    def __init__(
        self,
        inner: Strategy,
        pipe: PipelineModule,
        schedule: str,
        v: int = 1,
        tp_group: Group = None,
        meter: CommMeter | None = None,
        vertical_sync: bool = False,
        record_step: int = -1,
        timeline_path: str | Path | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.inner, self.pipe, self.schedule, self.v = inner, pipe, schedule, v
        self.comm_device = inner.comm_device  # the inner strategy's device for scalar collectives
        self.tp_group, self.meter, self.vertical_sync = tp_group, meter, vertical_sync
        self.record_step, self.timeline_path, self.steps_done = record_step, timeline_path, 0
        self.runtime = PipelineRuntime(pipe, meter, timeout_s)
        self.timeline: Timeline | None = None
        self.last_stats: RunStats | None = None
        self._lists: dict[int, list[Action]] = {}

    @property
    def asynchronous(self) -> bool:
        return self.schedule in ASYNC

    def actions(self, m: int) -> list[Action]:
        """This rank's list for m micro-batches (the whole schedule is checked by the simulator once)."""
        if m not in self._lists:
            full = step_schedule(self.schedule, self.pipe.p, m, self.v, self.vertical_sync)
            check(full)
            self._lists[m] = full[self.pipe.rank]
        return self._lists[m]

    def run(
        self,
        micro_batches: Sequence[Batch],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        on_step: Callable[[Action], None],
    ) -> RunStats:
        """Execute this rank's list over the micro-batches (recording the timeline on ``record_step``)."""
        m = len(micro_batches)
        record = self.steps_done == self.record_step
        stats = self.runtime.run(
            self.actions(m),
            micro_batches,
            loss_fn,
            loss_scale(self.schedule, m),
            on_step,
            no_sync=None if self.asynchronous else self.inner.no_sync,
            record=record,
        )
        self.steps_done += 1
        self.last_stats = stats
        if record:
            self.timeline = gather_timeline(stats.events, self.pipe.group, self.pipe.rank, self.pipe.p)
            if self.timeline is not None and self.timeline_path is not None:
                log.info("%s", timeline_report(self.timeline, self.schedule, m, self.v, self.timeline_path))
        return stats

    # ------------------------------------------------------------------ Strategy
    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.inner.no_sync()

    def finish_sync(self) -> None:
        self.inner.finish_sync()
        if not self.asynchronous:
            exchange_tied_grad(self.pipe, self.meter, self._tied_grad(), self.comm_device)

    def _tied_grad(self) -> torch.Tensor | None:
        """This rank's reduced gradient of its tied copy: whole, or its ZeRO shard (empty if none)."""
        tied = self.pipe.tied_weight()
        if tied is None or not tied.requires_grad:  # frozen (LoRA): no gradient to exchange
            return None
        return self.inner.param_grad_shard(tied)

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def grads(self) -> list[torch.Tensor]:
        return self.inner.grads()

    def grad_sq(self) -> torch.Tensor:
        """Σ over pp ranks of the stages' Σ g², the tied matrix counted once (by the first rank);
        the stage's own under an asynchronous schedule."""
        sq = self.inner.grad_sq()
        if self.asynchronous:
            return sq
        tied = self.pipe.tied_weight()
        if tied is not None and tied.requires_grad and self.pipe.is_last:
            t = self.inner.param_grad_sq(tied)  # (a ZeRO shard's squares summed over its sharding group)
            if placement_of(tied).tp_sharded:
                comm.all_reduce(t, self.tp_group)
            sq = sq - t.to(sq.device)
        sq = sq.clone()
        comm.all_reduce(sq, self.pipe.group, self.meter)
        return sq.clamp(min=0.0)

    def scale_grads(self, coef: torch.Tensor) -> None:
        self.inner.scale_grads(coef)

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        self.inner.step(lr, grad_scale)

    def state_bytes(self) -> dict[str, int]:
        return self.inner.state_bytes()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict (reference names) on pipeline rank 0, None elsewhere (ZeRO-3
        units gathered for the while)."""
        with self.inner.gathered():
            return gather_full_state(self.pipe)

    def param_grad_shard(self, p: torch.Tensor) -> torch.Tensor | None:
        return self.inner.param_grad_shard(p)

    def param_grad_sq(self, p: torch.Tensor) -> torch.Tensor:
        return self.inner.param_grad_sq(p)

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        return self.inner.gathered()

    def row(self) -> dict[str, float]:
        return self.inner.row()

    def remove(self) -> None:
        self.inner.remove()

    def close(self) -> None:
        self.inner.close()

    # ------------------------------------------------------------------ checkpoints (Shardable)
    def _canonical(self, key: str) -> tuple[str, bool]:
        """Checkpoint name of an inner key ("model.stages.1.layers.5..." -> "model.layers.5...") and
        whether it is the last stage's copy of the tied matrix (saved by the first stage only)."""
        kind, _, rest = key.partition(".")
        if kind not in ("model", "optim") or not rest.startswith("stages."):
            return key, False
        rest = rest.split(".", 2)[2]
        if self.pipe.is_last and self.pipe.tied_weight() is not None and rest.startswith("output.weight"):
            return f"{kind}.tok_embeddings.weight{rest[len('output.weight') :]}", True
        return f"{kind}.{rest}", False

    def sharded_state(self) -> dict:
        out = {}
        for key, piece in self.inner.sharded_state().items():
            name, tied_copy = self._canonical(key)
            if not tied_copy:
                out[name] = piece
        return out

    def load_sharded(self, reader) -> None:
        self.inner.load_sharded(_RenamingReader(reader, lambda k: self._canonical(k)[0]))


class _RenamingReader:
    """A checkpoint reader that fills a stage's pieces under their canonical names."""

    def __init__(self, reader, rename: Callable[[str], str]) -> None:
        self.reader, self.rename = reader, rename

    def fill(self, state: dict) -> None:
        self.reader.fill({self.rename(k): v for k, v in state.items()})

    def __getattr__(self, name: str):
        return getattr(self.reader, name)
