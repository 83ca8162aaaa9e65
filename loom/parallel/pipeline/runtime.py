"""One runtime that executes any pipeline action list (see the contract in :mod:`.schedules`).

Per action on this rank:

* ``F``: stage forward of one micro-batch (tokens on the first stage, the received activation
  otherwise; the last stage adds the loss, scaled by the schedule's loss scale).
* ``B``: full backward; ``BI``/``BW``: the split of :mod:`.stage` (input gradient now, weight
  gradient later).
* ``SEND``/``RECV``: issued as :func:`~.posting.posting_plan` says, one ``batch_isend_irecv``
  per one-way link group (``pipe.links``); the RECVs of the run that follows a compute action
  are posted *before* that compute, so messages arrive while it runs. Sends are never waited
  before the end of the list. The plan is proven deadlock-free on NCCL's in-order streams for
  every list the simulator accepts (:func:`~.posting.nccl_check`).
  Activations and gradients have the shape (micro_batch, T, h) (T / tp with sequence
  parallelism), known from the micro-batch, so no shapes are exchanged.
* ``STEP``: the caller's optimizer step.

Weight stashing (asynchronous lists, whose compute actions carry a weight ``version``): after
STEP k the rank snapshots its parameters as version k if a later action uses it, and drops a
version after its last use. F and B of a micro-batch run through
``torch.func.functional_call`` on the *same* snapshot (the version its forward used, while
newer versions exist); the backward's gradient is then added to the live parameters' ``.grad``,
so the optimizer applies W_{k+1} = W_k - lr * grad(W_version). Versions kept at once:
PipeDream p - rank, 2BW 2 (:func:`~.schedules.stashed_versions`); PipeDream with vertical sync
p on every rank, since the versions between stage 0's and this rank's newest are needed by
forwards that have not started yet (``stashed_versions`` counts only in-flight ones: p - r + 1).

Timing: every action's start/end (``time.perf_counter``, relative to a barrier at the start
of a recorded run; on an accelerator read after synchronising the device, so an event spans its
kernels and not their launch) goes into a :class:`~.simulate.Timeline`, gathered on pipeline rank 0.
Failure: a RECV that does not complete within ``timeout_s`` (training: ``run.timeout_s``;
default the pp group's own timeout) raises :class:`PipelineError` naming the peer rank, so a
rank that hangs or dies mid-pipeline ends the job after at most that bound (a dead process
usually sooner: its sockets close and the receive fails at once).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist
from torch.func import functional_call

from loom import comm
from loom.comm import CommMeter, Group
from loom.device import synchronize
from loom.parallel.pipeline.posting import Issue, posting_plan
from loom.parallel.pipeline.schedules import (
    COMPUTE,
    RECVS,
    SENDS,
    Action,
    Kind,
    build_schedule,
    pipedream_2bw,
    pipedream_async,
)
from loom.parallel.pipeline.simulate import Event, Timeline
from loom.parallel.pipeline.stage import PipelineModule, WeightGrad, backward_input, backward_weight

__all__ = [
    "PipelineError",
    "PipelineRuntime",
    "RunStats",
    "bubble_formula",
    "gather_timeline",
    "step_schedule",
]

Batch = tuple[torch.Tensor, ...]  # (tokens, targets), or with data.pack (tokens, targets, positions)


class PipelineError(RuntimeError):
    """A pipeline peer failed or hung (the message names the rank)."""


def _placed(a: Action) -> tuple[int, int]:
    """(micro-batch, stage) of an action that runs on a stage: every kind but STEP has both."""
    if a.microbatch is None or a.stage is None:
        raise ValueError(f"{a}: a {a.kind.value} action needs a micro-batch and a stage")
    return a.microbatch, a.stage


def _peer(a: Action) -> int:
    """The other pipeline rank of a SEND or RECV."""
    if a.peer is None:
        raise ValueError(f"{a}: a {a.kind.value} action needs a peer rank")
    return a.peer


def bubble_formula(name: str, p: int, m: int, v: int = 1) -> float:
    """Theoretical bubble with equal stages, t_b = 2 t_f (t_w = t_b / 2), no communication.

    GPipe, 1F1B, PipeDream: (p-1)/(m+p-1); interleaved: (p-1)/(v m + p-1);
    ZB-H1: (p-1)/(3m + p-1); 2BW over the step's 2 batches of m/2: (p-1)/(m + p-1).
    """
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)


def step_schedule(name: str, p: int, m: int, v: int = 1, vertical_sync: bool = False) -> list[list[Action]]:
    """The action lists one training step runs over its m micro-batches.

    Synchronous schedules and PipeDream take the m micro-batches as they are (PipeDream: one
    weight update per micro-batch); 2BW splits them into 2 batches of m/2 (one update each).
    """
    if name == "pipedream":
        return pipedream_async(p, m, vertical_sync)
    if name == "2bw":
        if m % 2 or m // 2 < p:
            raise ValueError(
                f"2bw splits a step's {m} micro-batches into 2 batches of at least pp={p}: need m even, m >= {2 * p}"
            )
        return pipedream_2bw(p, m // 2, batches=2)
    return build_schedule(name, p, m, v)


def loss_scale(name: str, m: int) -> float:
    """Each micro-batch's loss multiplier: 1/(micro-batches per update)."""
    return {"pipedream": 1.0, "2bw": 2.0 / m}.get(name, 1.0 / m)


@dataclass
class RunStats:
    """What one run of an action list leaves: per-micro-batch losses (last stage), events, stash peak."""

    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # unscaled, last stage only
    events: list[Event] = field(default_factory=list)
    peak_versions: int = 1
    version_log: list[dict] = field(default_factory=list)  # per B: versions and weight fingerprints


class _Versions:
    """Weight versions of one stage for an asynchronous list (see the module docstring)."""

    def __init__(self, stage: torch.nn.Module, actions: Sequence[Action]) -> None:
        self.live = dict(stage.named_parameters())
        self.last_use: dict[int, int] = {}
        for i, a in enumerate(actions):
            if a.kind in COMPUTE:
                self.last_use[a.version or 0] = i
        self.stash: dict[int, dict[str, torch.Tensor]] = {}
        self.newest = 0
        self._snapshot(0)

    def _snapshot(self, version: int) -> None:
        if version in self.last_use:
            self.stash[version] = {
                n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in self.live.items()
            }

    @property
    def kept(self) -> int:
        return len(set(self.stash) | {self.newest})

    def stepped(self, version: int) -> None:
        self.newest = version
        self._snapshot(version)

    def used(self, index: int, version: int) -> None:
        if self.last_use.get(version) == index:
            self.stash.pop(version, None)

    def move_grads(self, version: int) -> None:
        for name, t in self.stash[version].items():
            if t.grad is not None:
                p = self.live[name]
                if p.grad is None:
                    p.grad = t.grad.clone()
                else:
                    p.grad.add_(t.grad)
                t.grad = None

    def fingerprint(self, version: int | None) -> float:
        params = self.live if version is None else self.stash[version]
        return float(sum(t.detach().double().sum() for t in params.values()))


class PipelineRuntime:
    """Executes this pipeline rank's action list over ``pipe.group`` (peers are group-local ranks)."""

    def __init__(
        self, pipe: PipelineModule, meter: CommMeter | None = None, timeout_s: float | None = None
    ) -> None:
        self.pipe, self.group, self.meter = pipe, pipe.group, meter
        self.timeout = timedelta(seconds=timeout_s) if timeout_s else None  # None: the pp group's own
        self.dim = pipe.cfg.dim
        self.dtype = next(pipe.parameters()).dtype
        self.device = next(pipe.parameters()).device
        self.trace_versions = False

    # ------------------------------------------------------------------ communication
    def _peer_name(self, peer: int) -> str:
        try:
            group = cast(dist.ProcessGroup, self.group)  # typed ProcessGroup; takes None (default group) too
            return f"rank {dist.get_global_rank(group, peer)} (pipeline rank {peer})"
        except (RuntimeError, ValueError):
            return f"pipeline rank {peer}"

    def _wait(self, work, a: Action) -> None:
        t0 = time.perf_counter()
        try:
            comm.wait(work, self.timeout)
        except RuntimeError as e:
            raise PipelineError(
                f"pipeline rank {self.pipe.rank}: {a} got no message from {self._peer_name(_peer(a))} after "
                f"{time.perf_counter() - t0:.1f} s; that rank has died or hung ({str(e).splitlines()[0]})"
            ) from e

    def _post(self, issue: Issue) -> None:
        """One batch of one link: sends of results computed already, or receives into new buffers."""
        sends, recvs = [], []
        for i in issue.batch:
            a = self.actions[i]
            mb, s = _placed(a)
            if a.kind in SENDS:
                store = self.out_act if a.kind is Kind.SEND_F else self.out_grad
                t = store.pop((mb, s))
                sends.append((t, a.peer))
                self.sent.append(t)
            else:
                rows, seq = self.batches[mb][0].shape[:2]
                buf = torch.empty(
                    rows, seq // self.pipe.seq_div, self.dim, dtype=self.dtype, device=self.device
                )
                recvs.append((i, buf))
        src, dst = cast(tuple[int, int], issue.link)  # posting.link_of: (src, dst) pipeline ranks
        group, peer = self.pipe.link(src, dst)
        works = comm.batch_p2p(
            [(t, peer) for t, _ in sends], [(b, peer) for _, b in recvs], group, self.meter
        )
        self.send_works += works[: len(sends)]
        for (i, buf), w in zip(recvs, works[len(sends) :]):
            self.posted[i] = (w, buf)

    def _receive(self, upto: int) -> None:
        """Wait, in list order, for every RECV listed before position ``upto``."""
        while self.pending and self.pending[0] < upto:
            i = self.pending.popleft()
            a = self.actions[i]
            work, buf = self.posted.pop(i)
            t0 = self._clock()
            self._wait(work, a)
            self._event(a, t0)
            key = _placed(a)
            if a.kind is Kind.RECV_F:
                self.in_act[key] = buf.requires_grad_()
            else:
                self.in_grad[key] = buf

    # ------------------------------------------------------------------ compute
    def _forward(self, a: Action, index: int) -> None:
        mb, s = key = _placed(a)
        stage = self.pipe.stage(s)
        x, y, *packed = self.batches[mb]  # packed data: (x, y, positions), given to every stage
        inp = None if stage.is_first else self.in_act.pop(key)
        if self.versions is not None:
            weights = self.versions.stash[a.version or 0]
            out = functional_call(stage, weights, (x if stage.is_first else inp, *packed))
            self.versions.used(index, a.version or 0)
        else:
            inp = stage.embed(x, *packed) if stage.is_first else inp
            out = stage.body(
                cast(torch.Tensor, inp), *packed
            )  # received above, or embedded on the first stage
        if stage.is_last:
            loss = self.loss_fn(out, y)
            self.stats.losses[mb] = loss.detach()
            out = loss * self.scale
        else:
            self.out_act[key] = out.detach()
        self.saved[key] = (inp, out)

    def _backward(self, a: Action, index: int) -> None:
        mb, s = key = _placed(a)
        stage = self.pipe.stage(s)
        if a.kind is Kind.BW:
            with self._sync(index):
                backward_weight(self.pending_w.pop(key))
            return
        inp, out = self.saved.pop(key)
        grad = None if stage.is_last else self.in_grad.pop(key)
        dx: torch.Tensor | None
        if a.kind is Kind.BI:
            dx, self.pending_w[key] = backward_input(out, grad, inp, list(stage.parameters()))
        else:
            with self._sync(index):
                torch.autograd.backward(out, grad)
            dx = None if stage.is_first else inp.grad
        if not stage.is_first:
            if dx is None:
                raise RuntimeError(
                    f"pipeline rank {self.pipe.rank}: {a} left no gradient for the input of stage {s}"
                )
            self.out_grad[key] = dx
        if self.versions is not None:
            v = a.version or 0
            if self.trace_versions:
                self.stats.version_log.append(
                    {
                        "mb": mb,
                        "version": v,
                        "newest": self.versions.newest,
                        "used": self.versions.fingerprint(v),
                        "live": self.versions.fingerprint(None),
                    }
                )
            self.versions.move_grads(v)
            self.versions.used(index, v)

    def _sync(self, index: int) -> contextlib.AbstractContextManager:
        """Data-parallel hooks reduce only on a parameter's last accumulation of the step."""
        if self.no_sync is None or index in self.final:
            return contextlib.nullcontext()
        return self.no_sync()

    def _clock(self) -> float:
        """Now; on a recorded run after the device's queued work has finished."""
        if self.record:
            synchronize(self.device)
        return time.perf_counter()

    def _event(self, a: Action, t0: float) -> None:
        if self.record:
            self.stats.events.append(Event(self.pipe.rank, a, t0 - self.t0, self._clock() - self.t0))

    # ------------------------------------------------------------------ run
    def run(
        self,
        actions: Sequence[Action],
        batches: Sequence[Batch],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        scale: float,
        on_step: Callable[[Action], None],
        no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
        record: bool = False,
    ) -> RunStats:
        """Execute ``actions``; ``batches[i]`` = (tokens, targets) of micro-batch i (all stages get them)."""
        self.batches, self.loss_fn, self.scale, self.no_sync, self.record = (
            batches,
            loss_fn,
            scale,
            no_sync,
            record,
        )
        self.stats = RunStats()
        self.saved: dict[tuple[int, int], tuple] = {}  # (mb, stage) -> (input, output) of its forward
        self.in_act: dict[tuple[int, int], torch.Tensor] = {}
        self.in_grad: dict[tuple[int, int], torch.Tensor] = {}
        self.out_act: dict[tuple[int, int], torch.Tensor] = {}
        self.out_grad: dict[tuple[int, int], torch.Tensor] = {}
        self.pending_w: dict[tuple[int, int], WeightGrad] = {}
        self.posted: dict[int, tuple] = {}
        self.sent: list[torch.Tensor] = []
        self.send_works: list = []
        versioned = any(a.version is not None for a in actions)
        if versioned and self.pipe.n_stages != self.pipe.p:
            raise ValueError("weight-versioned (asynchronous) schedules need one stage per rank")
        self.versions = _Versions(self.pipe.stages[0], actions) if versioned else None
        last: dict[int, int] = {}
        for i, a in enumerate(actions):
            if a.kind in (Kind.B, Kind.BW):
                last[_placed(a)[1]] = i
        self.final = set(last.values())
        self.actions = actions
        self.pending = deque(i for i, a in enumerate(actions) if a.kind in RECVS)
        if record:
            synchronize(self.device)
            dist.barrier(group=self.group)
        self.t0 = time.perf_counter()
        for issue in posting_plan(self.pipe.rank, actions):
            if issue.is_batch:
                self._post(issue)
                continue
            i = issue.index
            a = actions[i]
            self._receive(i)
            t0 = self._clock()
            if a.kind is Kind.F:
                self._forward(a, i)
            elif a.kind in (Kind.B, Kind.BI, Kind.BW):
                self._backward(a, i)
            else:
                on_step(a)
                if self.versions is not None:
                    self.versions.stepped(a.version or 0)
            self._event(a, t0)
            if self.versions is not None:
                self.stats.peak_versions = max(self.stats.peak_versions, self.versions.kept)
        self._receive(len(actions))
        for w in self.send_works:
            try:
                w.wait()
            except RuntimeError as e:
                raise PipelineError(
                    f"pipeline rank {self.pipe.rank}: a send did not complete; a peer has died "
                    f"or hung ({str(e).splitlines()[0]})"
                ) from e
        self.sent.clear()
        return self.stats


def gather_timeline(events: list[Event], group: Group, rank: int, p: int) -> Timeline | None:
    """All pipeline ranks' events as one Timeline on pipeline rank 0 (None elsewhere)."""
    if comm.group_size(group) == 1:
        return Timeline(p, list(events))
    out: list | None = [None] * p if rank == 0 else None
    dist.gather_object(events, out, group=group, group_dst=0)
    if out is None:
        return None
    return Timeline(p, [e for part in out for e in part])
