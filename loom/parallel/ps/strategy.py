"""Data parallelism through a parameter server: workers push gradients, servers update, workers pull.

The model's parameters are laid end to end in one flat fp32 buffer of Φ elements, padded to
Φ' = ceil(Φ / 4K) · 4K and cut into K equal shards of Φ_k = Φ'/K elements
(:class:`~loom.parallel.layout.FlatLayout` with K "ranks"). Server k owns shard k: its
parameters and its AdamW moments (8·Φ_k bytes; :class:`~loom.optim.adamw.ShardedAdamW`, the
element-wise math of ``torch.optim.AdamW``). Workers keep whole parameters and gradients (Φ' each,
``param.data`` and ``param.grad`` are views of the flat buffers) and exchange only point-to-point:

    push: worker w sends g_w[shard k] to server k          Φ_k · b bytes per (w, k)
    pull: server k sends its updated shard k to worker w    Φ_k · b bytes per (w, k)

Bytes through server k per step (b = 4, fp32): with W workers and dedicated server ranks,
2 · W · Φ_k · b (W pushes in, W pulls out); co-located (server k in worker k's process), its own
worker's share does not cross a link: 2 · (W-1) · Φ_k · b. The links of server k are its
bottleneck: each worker moves 2 · Φ' · b, server k moves 2 · W · Φ_k · b = 2 · W · Φ' · b / K,
growing with W, where ring all-reduce moves 2 · Φ' · b · (W-1)/W per rank, flat in W.

Synchronization (``parallel.ps_sync``):

- ``bsp``: every server waits for all W gradients, averages them (ḡ = Σ_w g_w / W: the gradient of
  the global-batch mean loss, as all-reduce data parallelism), clips by the global norm
  (Σ_k ‖ḡ_k‖², summed over the servers), steps once, and every worker pulls: equal to all-reduce
  data parallelism and to one process.
- ``asp`` / ``ssp:S`` (dedicated servers only: :mod:`loom.parallel.ps.server`): each push is one
  AdamW update with that worker's gradient (clipped by the worker's own norm), applied as it
  arrives; the worker pulls whatever the server holds then.

Co-located servers (:class:`ColocatedParamServer`) are serviced at the step boundary, inside the
protocol calls every rank makes (``finish_sync`` pushes, ``step`` updates and pulls), which makes
BSP deterministic; each push/pull phase is one ``batch_isend_irecv`` per rank over ``group``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from loom import comm
from loom.comm import CommMeter, Group
from loom.optim.adamw import ShardedAdamW
from loom.optim.store import StateStore
from loom.parallel.base import StrategyBase, SyncSwitch, sum_sq
from loom.parallel.layout import FlatLayout, decayed_ids, unique_params
from loom.parallel.ps.links import DONE, PULL_HEADER, PUSH, PUSH_HEADER, PSLinks, recv, send, wait_for
from loom.parallel.state import gather_module_state


class FlatModel:
    """The parameters of ``module`` (and their gradients) as views of two flat fp32 buffers, and the
    K shards the servers own."""

    def __init__(self, module: nn.Module, shards: int, index: int = 0) -> None:
        """``index``: the shard this process's server owns (its decay runs are :attr:`decay_runs`)."""
        self.module = module
        self.params = unique_params(module)
        if any(p.dtype != torch.float32 for p in self.params):
            raise ValueError("the parameter server updates fp32 parameters (train.precision = fp32)")
        self.layout = FlatLayout(self.params, shards, index, decayed_ids(module))
        self.shards, self.shard_numel = shards, self.layout.shard_numel  # K, Φ_k
        self.flat = self.layout.new_flat()
        self.layout.bind(self.flat)
        self.grad = self.layout.new_flat()
        self.zero_grad()

    def seg(self, t: torch.Tensor, k: int) -> torch.Tensor:
        """Shard k of a flat buffer (a contiguous view)."""
        return t[k * self.shard_numel : (k + 1) * self.shard_numel]

    @property
    def decay_runs(self) -> list[tuple[int, int]]:
        return self.layout.local_ranges(lambda s: s.decay)

    def zero_grad(self) -> None:
        self.grad.zero_()
        for p, v in zip(self.params, self.layout.views(self.grad)):
            p.grad = v

    @torch.no_grad()
    def fold_grads(self) -> None:
        """A ``.grad`` replaced by someone (not a view of the flat buffer any more) is copied back."""
        for p, v in zip(self.params, self.layout.views(self.grad)):
            if p.grad is not None and p.grad.data_ptr() != v.data_ptr():
                v.copy_(p.grad)
                p.grad = v

    def new_optimizer(self, shard: torch.Tensor, train_cfg) -> ShardedAdamW:
        """AdamW on ``shard`` (this process's server's parameters), state on its device."""
        return ShardedAdamW(
            [shard],
            [self.decay_runs],
            StateStore(shard.device),
            (train_cfg.beta1, train_cfg.beta2),
            train_cfg.eps,
            train_cfg.weight_decay,
        )


class ColocatedParamServer(SyncSwitch, StrategyBase):
    """BSP parameter server with server k living in rank k of ``group`` (k < K <= W = group size).

    Per step: push (each worker sends shard k of its gradient to server k ≠ itself; server k
    receives W-1 shards), the servers average and clip by the global norm, step, and push their
    shard back to the W-1 other workers (pull). ``server_bytes``: bytes through this rank's
    server's links in the last step, counted (2 · (W-1) · Φ_k · 4 on a server, 0 elsewhere).
    """

    def __init__(
        self,
        module: nn.Module,
        group: Group,
        shards: int,
        train_cfg,
        meter: CommMeter | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        self.group, self.meter, self.timeout_s = group, meter, timeout_s
        self.world = comm.group_size(group)
        self.rank = dist.get_rank(group) if self.world > 1 else 0
        if not 1 <= shards <= self.world:
            raise ValueError(
                f"parallel.ps_shards: {shards} co-located servers need as many workers, got {self.world}"
            )
        self.sync_enabled = True
        self.server = self.rank if self.rank < shards else None
        self.model = FlatModel(module, shards, self.server or 0)
        self.module, self.params = module, self.model.params
        self.shard_grad = torch.zeros(0)
        self.optimizer: ShardedAdamW | None = None
        self.inbox: list[torch.Tensor] = []
        if self.server is not None:
            shard = self.model.seg(self.model.flat, self.server)  # updated in place: the workers' pull source
            self.optimizer = self.model.new_optimizer(shard, train_cfg)
            self.shard_grad = torch.zeros_like(shard)
            self.inbox = [torch.empty_like(shard) for _ in range(self.world - 1)]
        self.server_bytes = 0

    def _others(self) -> Iterator[int]:
        return (u for u in range(self.world) if u != self.rank)

    def _exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
        for work in comm.batch_p2p(sends, recvs, self.group, self.meter):
            wait_for(work, self.timeout_s, "a co-located parameter server or worker")

    # ------------------------------------------------------------------ Strategy
    def finish_sync(self) -> None:
        """Push: every worker's gradient shard k to server k; server k averages the W shards in rank order."""
        if not self.sync_enabled:
            return
        m = self.model
        m.fold_grads()
        sends = [(m.seg(m.grad, k), k) for k in range(m.shards) if k != self.rank]
        recvs = list(zip(self.inbox, self._others())) if self.server is not None else []
        if self.world > 1:
            self._exchange(sends, recvs)
        if self.server is None:
            self.server_bytes = 0
            return
        g, own, inbox = self.shard_grad, m.seg(m.grad, self.server), iter(self.inbox)
        g.copy_(own if self.rank == 0 else next(inbox))
        for u in range(1, self.world):
            g.add_(own if u == self.rank else next(inbox))
        g.div_(self.world)
        self.server_bytes = len(self.inbox) * comm.nbytes(g)

    def zero_grad(self) -> None:
        self.model.zero_grad()
        self.shard_grad.zero_()

    def grads(self) -> list[torch.Tensor]:
        """The averaged gradient shard this rank's server holds (none on a worker without a server)."""
        return [self.shard_grad] if self.server is not None else []

    def grad_sq(self) -> torch.Tensor:
        """Σ over the servers of ‖ḡ_k‖² (padding is zero): one scalar all-reduce over ``group``."""
        sq = sum_sq(self.grads(), self.model.flat.device)
        comm.all_reduce(sq, self.group)
        return sq

    @torch.no_grad()
    def scale_grads(self, coef: torch.Tensor) -> None:
        if self.server is not None:
            self.shard_grad.mul_(coef.to(self.shard_grad.device))

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """Server k: AdamW on shard k; then pull: server k sends shard k to every other worker."""
        m = self.model
        if self.optimizer is not None:
            self.optimizer.step([self.shard_grad], lr, grad_scale)
        if self.world == 1:
            return
        sends = [(m.seg(m.flat, self.rank), u) for u in self._others()] if self.server is not None else []
        recvs = [(m.seg(m.flat, k), k) for k in range(m.shards) if k != self.rank]
        self._exchange(sends, recvs)
        self.server_bytes += len(sends) * comm.nbytes(m.seg(m.flat, 0))

    def state_bytes(self) -> dict[str, int]:
        """Worker: parameters and gradients Φ'·4 each; server k adds its AdamW moments 8·Φ_k and an
        inbox of (W-1)·Φ_k·4 (the pushed shards before they are averaged)."""
        m = self.model
        return {
            "param_bytes": comm.nbytes(m.flat),
            "grad_bytes": comm.nbytes(m.grad),
            "optim_bytes": self.optimizer.state_bytes if self.optimizer is not None else 0,
            "ps_inbox_bytes": sum(comm.nbytes(t) for t in self.inbox) + comm.nbytes(self.shard_grad),
        }

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return gather_module_state(self.module)

    # ------------------------------------------------------------------ checkpoints (Shardable)
    def sharded_state(self):
        from loom.parallel.ps.checkpoint import ColocatedPSState

        return ColocatedPSState(self).sharded_state()

    def load_sharded(self, reader) -> None:
        from loom.parallel.ps.checkpoint import ColocatedPSState

        ColocatedPSState(self).load_sharded(reader)


class PSWorker(SyncSwitch, StrategyBase):
    """A worker of a parameter server with K dedicated server ranks (:mod:`loom.parallel.ps.server`).

    ``bound`` (``parallel.ps_sync``): "bsp", or the staleness bound S of ssp:S (None: asp).

    - bsp: ``finish_sync`` pushes the raw gradient; ``grad_sq`` receives Σ‖ḡ‖² from server 0;
      ``scale_grads`` keeps the clip coefficient; ``step`` sends (lr, grad_scale, coefficient) to
      every server and pulls the updated shards.
    - asp / ssp: the worker clips its own gradient (``grad_sq`` and ``scale_grads`` are local);
      ``step`` pushes it with (lr, grad_scale) and pulls; under ssp:S the server holds the pull of a
      worker more than S clocks ahead of the slowest one.

    :meth:`close` tells every server this worker is done (call it once, after the last step).
    """

    def __init__(
        self,
        module: nn.Module,
        links: PSLinks,
        bound: int | str | None,
        meter: CommMeter | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        self.links, self.bound, self.meter, self.timeout_s = links, bound, meter, timeout_s
        self.sync_enabled = True
        self.model = FlatModel(module, links.shards)
        self.module, self.params = module, self.model.params
        self.clock = 0  # pushes made
        self.pulled = [0] * links.shards  # version of each shard last pulled
        self.versions: list[list[int]] = []  # per step: the version pulled from each server
        self.seen: dict[str, float] = {}  # the servers' figures as of the last pull (:meth:`row`)
        self.coef = 1.0
        dev = self.model.flat.device  # messages live where the model does (NCCL moves device memory only)
        self._header = torch.zeros(PUSH_HEADER, dtype=torch.float64, device=dev)
        self._reply = [torch.zeros(PULL_HEADER, dtype=torch.float64, device=dev) for _ in range(links.shards)]
        self._pending: list = []

    @property
    def bsp(self) -> bool:
        return self.bound == "bsp"

    def _name(self, k: int) -> str:
        return f"parameter server {k} (rank {self.links.server_rank(k)})"

    def _push(self, header: list[float], grads: bool) -> None:
        """Send ``header`` (and this worker's gradient shards) to every server; waits for the sends."""
        lk, m, works = self.links, self.model, []
        self._header.copy_(torch.tensor(header, dtype=torch.float64))
        for k in range(lk.shards):
            g = lk.push[(lk.rank, k)]
            peer = lk.peer(g, lk.server_rank(k))
            works.append((send(self._header, g, peer), k))
            if grads:
                works.append((send(m.seg(m.grad, k), g, peer, self.meter), k))
        for w, k in works:
            wait_for(w, self.timeout_s, self._name(k))

    def _pull(self) -> None:
        """Receive (version, updates) and shard k from every server into the flat parameters."""
        lk, m, works = self.links, self.model, []
        for k in range(lk.shards):
            g = lk.pull[(lk.rank, k)]
            peer = lk.peer(g, lk.server_rank(k))
            works += [(recv(self._reply[k], g, peer), k), (recv(m.seg(m.flat, k), g, peer), k)]
        for w, k in works:
            wait_for(w, self.timeout_s, self._name(k))
        self.pulled = [int(r[0]) for r in self._reply]
        self.versions.append(list(self.pulled))
        self.seen = {
            "ps_staleness_max": max(int(r[2]) for r in self._reply),  # over the servers, so far
            "ps_pulls_held": max(int(r[3]) for r in self._reply),
        }

    # ------------------------------------------------------------------ Strategy
    def finish_sync(self) -> None:
        if not self.sync_enabled:
            return
        self.model.fold_grads()
        self.coef = 1.0
        if self.bsp:
            self._push([PUSH, self.clock, 0.0, math.nan, math.nan], grads=True)

    def zero_grad(self) -> None:
        self.model.zero_grad()

    def grads(self) -> list[torch.Tensor]:
        """bsp: none here (the servers hold the averaged gradient); asp/ssp: this worker's own."""
        return [] if self.bsp else [self.model.grad]

    def grad_sq(self) -> torch.Tensor:
        if not self.bsp:
            return sum_sq([self.model.grad])
        lk = self.links
        sq = torch.zeros(1, dtype=torch.float64, device=self.model.flat.device)
        g = lk.pull[(lk.rank, 0)]
        wait_for(recv(sq, g, lk.peer(g, lk.server_rank(0))), self.timeout_s, self._name(0))
        return sq[0].float()

    @torch.no_grad()
    def scale_grads(self, coef: torch.Tensor) -> None:
        if self.bsp:
            self.coef = float(coef)
        else:
            self.model.grad.mul_(coef)

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        if self.bsp:
            self._push([lr, grad_scale, self.coef, 0.0, 0.0], grads=False)  # the update's control message
        else:
            self._push([PUSH, self.clock, 0.0, lr, grad_scale], grads=True)
        self.clock += 1
        self._pull()

    def close(self) -> None:
        """Tell every server that this worker is done (until its next push: the servers serve again)."""
        self._push([DONE, self.clock, 0.0, 0.0, 0.0], grads=False)

    def row(self) -> dict[str, float]:
        """For the metrics row: the largest staleness any server has recorded (over every worker's
        updates) and the most pulls a server has held back for the ssp bound, as of this worker's last pull."""
        return dict(self.seen)

    def state_bytes(self) -> dict[str, int]:
        m = self.model
        return {"param_bytes": comm.nbytes(m.flat), "grad_bytes": comm.nbytes(m.grad), "optim_bytes": 0}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return gather_module_state(self.module)

    # ------------------------------------------------------------------ checkpoints (Shardable)
    def sharded_state(self):
        """A checkpoint pauses the servers: this worker sends DONE first, so they join the save with their
        shards (:class:`~loom.parallel.ps.checkpoint.WorkerState`)."""
        from loom.parallel.ps.checkpoint import WorkerState

        self.close()
        return WorkerState(self).sharded_state()

    def load_sharded(self, reader) -> None:
        from loom.parallel.ps.checkpoint import WorkerState

        WorkerState(self).load_sharded(reader)
