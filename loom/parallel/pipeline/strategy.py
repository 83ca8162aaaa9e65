"""Pipeline parallelism as a training Strategy: the split step, the step function, eval, saving.

:func:`apply_pipeline` is step 3 of ``parallelize``: it cuts the model (``parallel.pp_layout``
or the profiled partitioner) and keeps this rank's stages. The data-parallel strategy (step 5)
then wraps those stages, and :class:`PipelineStrategy` wraps it in turn.

Micro-batches: the pipeline's micro-batches are the gradient-accumulation micro-batches,
m = global_batch / (micro_batch * dp); every pipeline rank of a data-parallel replica reads
the same ones (the first stage uses the tokens, the last the targets).

One synchronous step (GPipe, 1F1B, interleaved, ZB-H1) on every rank:

    run the action list (loss / m per micro-batch) -> at STEP: finish the dp reduction,
    sum the tied embedding/head gradient between the first and last rank, clip by
    ||g|| = sqrt(sum over pp ranks of ||g_rank||^2) (tied matrix once), optimizer step.

It equals the single-process step on the same global batch. Asynchronous lists (PipeDream,
2BW) step inside the list; each rank clips its own stage's gradient (a pp-wide norm would
synchronise the stages the schedule decouples), and tied embeddings are rejected.
The loss is computed on the last stage, averaged over dp, and broadcast over pp.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from loom import comm
from loom.comm import CommMeter, Group
from loom.parallel.data_parallel import DataParallel
from loom.parallel.pipeline.runtime import (
    Batch,
    PipelineRuntime,
    RunStats,
    bubble_formula,
    gather_timeline,
    loss_scale,
    step_schedule,
)
from loom.parallel.pipeline.schedules import Action, Kind
from loom.parallel.pipeline.simulate import Timeline, check
from loom.parallel.pipeline.stage import PipelineModule, exchange_tied_grad, gather_full_state, split_model
from loom.parallel.tp_comm import sum_partial_grads
from loom.train.step import StepResult, Strategy, grad_norm_sq, mean_over

__all__ = [
    "ASYNC",
    "PipelineStrategy",
    "apply_pipeline",
    "pipeline_evaluate",
    "pipeline_full_model",
    "pipeline_train_step",
    "timeline_report",
]

ASYNC = ("pipedream", "2bw")
log = logging.getLogger("loom")


def apply_pipeline(model, mesh, cfg, loss_fn, log_fn: Callable[[str], None] | None = None) -> PipelineModule:
    """Cut ``model`` into ``pp * virtual_stages`` stages and keep this pipeline rank's ones."""
    from loom.config import grad_accum_steps
    from loom.parallel.pipeline.profile import choose_layout

    bounds = choose_layout(model, cfg, grad_accum_steps(cfg), loss_fn, log_fn)
    pipe = split_model(model, mesh.local_rank("pp"), mesh.size("pp"), bounds, mesh.group("pp"), mesh.pp_links())
    pipe.seq_div = cfg.parallel.tp if cfg.parallel.sp else 1  # (batches arrive cut to this cp rank's tokens)
    pipe.tp_group = mesh.group("tp")
    return pipe


class PipelineStrategy:
    """The data-parallel ``inner`` strategy of this rank's stages, plus the pipeline runtime.

    Delegates the Strategy protocol (and any other attribute) to ``inner``, except
    :meth:`finish_sync` (adds the tied-gradient exchange) and :meth:`clip_grad_norm` (sums the
    squared norm over the pp group: each rank holds different parameters). The measured
    timeline of step ``record_step`` is kept in ``timeline`` and drawn to ``timeline_path``.
    """

    def __init__(self, inner: Strategy, pipe: PipelineModule, schedule: str, v: int = 1, tp_group: Group = None,
                 meter: CommMeter | None = None, vertical_sync: bool = False, record_step: int = -1,
                 timeline_path: str | Path | None = None, timeout_s: float | None = None) -> None:  # fmt: skip
        self.inner, self.pipe, self.schedule, self.v = inner, pipe, schedule, v
        self.tp_group, self.meter, self.vertical_sync = tp_group, meter, vertical_sync
        self.record_step, self.timeline_path, self.steps_done = record_step, timeline_path, 0
        self.runtime = PipelineRuntime(pipe, meter, timeout_s)
        self.timeline: Timeline | None = None
        self.last_stats: RunStats | None = None
        self._lists: dict[int, list[Action]] = {}

    def __getattr__(self, name: str):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

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

    def run(self, micro_batches: Sequence[Batch], loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
            on_step: Callable[[Action], None]) -> RunStats:  # fmt: skip
        """Execute this rank's list over the micro-batches (recording the timeline on ``record_step``)."""
        m = len(micro_batches)
        record = self.steps_done == self.record_step
        stats = self.runtime.run(self.actions(m), micro_batches, loss_fn, loss_scale(self.schedule, m), on_step,
                                 no_sync=None if self.asynchronous else self.inner.no_sync, record=record)  # fmt: skip
        self.steps_done += 1
        self.last_stats = stats
        if record:
            self.timeline = gather_timeline(stats.events, self.pipe.group, self.pipe.rank, self.pipe.p)
            if self.timeline is not None and self.timeline_path is not None:
                log.info("%s", timeline_report(self.timeline, self.schedule, m, self.v, self.timeline_path))
        return stats

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.inner.no_sync()

    def finish_sync(self) -> None:
        self.inner.finish_sync()
        if not self.asynchronous:
            exchange_tied_grad(self.pipe, self.meter, self._tied_grad())

    def _tied_grad(self) -> torch.Tensor | None:
        """This rank's reduced gradient of its tied copy: whole, or its ZeRO shard (empty if none)."""
        tied = self.pipe.tied_weight()
        if tied is None:
            return None
        shard_of = getattr(self.inner, "param_grad_shard", None)
        return shard_of(tied) if shard_of is not None else tied.grad

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def step(self, lr: float) -> None:
        self.inner.step(lr)

    def state_bytes(self) -> dict[str, int]:
        return self.inner.state_bytes()

    def clip_grad_norm(self, max_norm: float) -> float:
        """||g||^2 = sum over pp ranks of the stage norms^2, the tied matrix counted once; then clip.

        Scaling by coef = min(1, max_norm / (||g|| + 1e-6)): DataParallel's gradients are
        ``p.grad``, scaled here by one float32 factor, bitwise the same on every pipeline rank (so
        the two tied copies stay equal). Other inner strategies (sharded gradients) are asked to
        clip to max_norm' with min(1, max_norm' / (local + 1e-6)) = coef in their float32 formula
        (exact up to one float32 ulp of coef). Asynchronous schedules: the stage's own norm.
        """
        if self.asynchronous:
            return self.inner.clip_grad_norm(max_norm)
        local = self.inner.clip_grad_norm(0.0)
        device = next(self.pipe.parameters()).device  # collectives take device tensors (NCCL)
        sq = torch.tensor(local * local, dtype=torch.float64, device=device)
        tied = self.pipe.tied_weight()
        if tied is not None and self.pipe.is_last:  # the tied matrix once: the first rank counts it
            if hasattr(self.inner, "param_grad_shard"):  # a ZeRO shard: squares summed over the sharding group
                t = self.inner.param_grad_shard(tied).float().pow(2).sum()
                comm.all_reduce(t, self.inner.shard_group)
            else:
                t = grad_norm_sq([tied])
            if getattr(tied, "tp_shard_dim", None) is not None:
                comm.all_reduce(t, self.tp_group)
            sq -= t.double().to(device)
        comm.all_reduce(sq, self.pipe.group, self.meter)
        norm = math.sqrt(max(float(sq), 0.0))
        coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
        if coef < 1.0 and isinstance(self.inner, DataParallel):
            grads = [p.grad for p in self.inner.params if p.grad is not None]
            torch._foreach_mul_(grads, torch.tensor(coef, dtype=torch.float32, device=grads[0].device))
        elif coef < 1.0:
            self.inner.clip_grad_norm(_max_norm_for(local, coef))
        return norm


    # ------------------------------------------------------------------ checkpoints (Shardable)
    def _canonical(self, key: str) -> tuple[str, bool]:
        """Checkpoint name of an inner key ("model.stages.1.layers.5..." -> "model.layers.5...") and
        whether it is the last stage's copy of the tied matrix (saved by the first stage only)."""
        kind, _, rest = key.partition(".")
        if kind not in ("model", "optim") or not rest.startswith("stages."):
            return key, False
        rest = rest.split(".", 2)[2]
        if self.pipe.is_last and self.pipe.tied_weight() is not None and rest.startswith("output.weight"):
            return f"{kind}.tok_embeddings.weight{rest[len('output.weight'):]}", True
        return f"{kind}.{rest}", False

    def sharded_state(self) -> dict:
        from loom.checkpoint.replicated import as_shardable

        out = {}
        for key, piece in as_shardable(self.inner).sharded_state().items():
            name, tied_copy = self._canonical(key)
            if not tied_copy:
                out[name] = piece
        return out

    def load_sharded(self, reader) -> None:
        from loom.checkpoint.replicated import as_shardable

        as_shardable(self.inner).load_sharded(_RenamingReader(reader, lambda k: self._canonical(k)[0]))


def _max_norm_for(local: float, coef: float) -> float:
    """A max_norm M with clamp(M / (local + 1e-6), max=1) == float32(coef) exactly in float32 arithmetic."""
    d = torch.tensor(local, dtype=torch.float32) + 1e-6
    want = torch.tensor(coef, dtype=torch.float32)
    guess = (want.double() * d.double()).float()
    up, down = guess.clone(), guess.clone()
    for _ in range(8):  # the product is off by at most a few float32 ulps
        for cand in (up, down):
            if torch.clamp(float(cand) / d, max=1.0) == want:
                return float(cand)
        up = torch.nextafter(up, torch.tensor(float("inf")))
        down = torch.nextafter(down, torch.tensor(float("-inf")))
    return float(guess)


class _RenamingReader:
    """A checkpoint reader that fills a stage's pieces under their canonical names."""

    def __init__(self, reader, rename: Callable[[str], str]) -> None:
        self.reader, self.rename = reader, rename

    def fill(self, state: dict) -> None:
        self.reader.fill({self.rename(k): v for k, v in state.items()})

    def __getattr__(self, name: str):
        return getattr(self.reader, name)


def pipeline_train_step(model: PipelineModule, strategy: PipelineStrategy, micro_batches: Sequence[Batch],
                        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], grad_clip: float, lr: float,
                        dp_group: Group) -> StepResult:  # fmt: skip
    """One step through the pipeline; the signature and result of :func:`loom.train.step.train_step`.

    ``strategy`` is a :class:`PipelineStrategy`, possibly wrapped (attributes pass through);
    the optimizer side goes through the Strategy protocol so wrappers see every step.
    """
    norms: list[float] = []

    def on_step(_: Action) -> None:
        strategy.finish_sync()
        sum_partial_grads(model.parameters(), strategy)
        norms.append(strategy.clip_grad_norm(grad_clip))
        strategy.step(lr)
        if strategy.asynchronous:
            strategy.zero_grad()

    strategy.zero_grad()
    stats = strategy.run(micro_batches, loss_fn, on_step)
    loss = _last_stage_mean(model, dp_group, list(stats.losses.values()))
    if strategy.asynchronous:  # root-mean-square of this step's per-update stage norms, summed over stages
        sq = torch.tensor(sum(n * n for n in norms) / max(1, len(norms)), dtype=torch.float64,
                          device=next(model.parameters()).device)  # fmt: skip
        comm.all_reduce(sq, model.group)
        return StepResult(loss=loss, grad_norm=math.sqrt(float(sq)))
    return StepResult(loss=loss, grad_norm=norms[-1])


def _last_stage_mean(pipe: PipelineModule, dp_group: Group, losses: list[torch.Tensor]) -> float:
    """Mean of the last stage's losses, averaged over dp, known on every pipeline rank."""
    device = next(pipe.parameters()).device
    value = torch.zeros((), dtype=torch.float32, device=device)
    if pipe.is_last:
        value = mean_over(torch.stack(losses).float().mean(), dp_group)
    comm.broadcast(value, (pipe.n_stages - 1) % pipe.p, pipe.group)
    return float(value)


@torch.no_grad()
def pipeline_evaluate(model: PipelineModule, batches: Sequence[Batch],
                      loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dp_group: Group) -> float:  # fmt: skip
    """Mean loss over ``batches`` (signature of :func:`loom.train.step.evaluate`): a forward-only
    pipeline, each micro-batch through the stages in order (sends never block, so no deadlock)."""
    pipe, was_training = model, model.training
    p, dim, dtype = pipe.p, pipe.cfg.dim, next(pipe.parameters()).dtype
    losses, works, keep = [], [], []
    pipe.eval()
    for x, y in batches:
        for s in pipe.stage_ids:
            stage = pipe.stage(s)
            if stage.is_first:
                h = stage(x)
            else:
                h = torch.empty(x.shape[0], x.shape[1] // pipe.seq_div, dim, dtype=dtype, device=x.device)
                group, peer = pipe.link((s - 1) % p, pipe.rank)
                for w in comm.batch_p2p([], [(h, peer)], group):
                    w.wait()
                h = stage(h)
            if stage.is_last:
                losses.append(loss_fn(h, y).float())
            else:
                group, peer = pipe.link(pipe.rank, (s + 1) % p)
                works += comm.batch_p2p([(h, peer)], [], group)
                keep.append(h)
    for w in works:
        w.wait()
    pipe.train(was_training)
    return _last_stage_mean(pipe, dp_group, losses)


def pipeline_full_model(pipe: PipelineModule):
    """The whole model (a ``Transformer`` holding every stage's weights) on pipeline rank 0, else None."""
    from loom.model.llama import Transformer

    state = gather_full_state(pipe)
    if state is None:
        return None
    model = Transformer(pipe.cfg)
    model.load_state_dict(state)
    return model


def timeline_report(timeline: Timeline, schedule: str, m: int, v: int = 1, path: str | Path | None = None) -> str:
    """Measured bubble (rank-time waiting on peers, :attr:`Timeline.waiting_bubble`) beside the formula
    and beside the simulation of the same lists with the measured mean time of every (stage, kind),
    which accounts for unequal stages and t_b != 2 t_f; then the runtime's own time between
    actions (posting sends and receives, bookkeeping), which the formula does not count; draws
    the picture at ``path`` if given.

    Synchronous schedules: the bubble of the F/B/BI/BW phase (the final STEP left out, as in the
    formula); asynchronous ones: of the whole list, STEPs counted as busy.
    """
    p = timeline.n_ranks
    compute = Timeline(p, [e for e in timeline.events if e.action.kind is not Kind.STEP])
    judged = timeline if schedule in ASYNC else compute
    measured = judged.waiting_bubble
    text = (f"pipeline {schedule} p={p} m={m} v={v}: measured bubble {measured:.1%} vs formula "
            f"{bubble_formula(schedule, p, m, v):.1%} (simulated with measured stage times "
            f"{_simulated_bubble(compute, schedule, m, v):.1%}), runtime overhead between actions "
            f"{judged.bubble - measured:.1%}, makespan {1e3 * compute.makespan:.1f} ms")  # fmt: skip
    if path is not None:
        from loom.viz.timeline import draw_timeline

        draw_timeline(timeline, path, title=f"{schedule} p={p} m={m} v={v} (measured)")
        text += f"; timeline {path}"
    return text


def _simulated_bubble(timeline: Timeline, schedule: str, m: int, v: int) -> float:
    """Bubble of the simulator run on the same lists with each stage's mean measured F, B (= BI + BW), BW times."""
    from loom.parallel.pipeline.simulate import simulate

    spans: dict[tuple[Kind, int], list[float]] = {}
    for e in timeline.events:
        if e.action.kind in (Kind.F, Kind.B, Kind.BI, Kind.BW):
            spans.setdefault((e.action.kind, e.action.stage), []).append(e.end - e.start)
    n = timeline.n_ranks * v

    def mean(kind: Kind, s: int) -> float:
        xs = spans.get((kind, s), [])
        return sum(xs) / len(xs) if xs else 0.0

    t_f = [mean(Kind.F, s) for s in range(n)]
    t_w = [mean(Kind.BW, s) for s in range(n)]
    t_b = [mean(Kind.B, s) or mean(Kind.BI, s) + t_w[s] for s in range(n)]
    sim = simulate(step_schedule(schedule, timeline.n_ranks, m, v), t_f, t_b, t_w)
    if schedule in ASYNC:
        return sim.bubble
    return Timeline(sim.n_ranks, [e for e in sim.events if e.action.kind is not Kind.STEP]).bubble
