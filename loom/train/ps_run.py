"""``loom train`` with dedicated parameter-server ranks (``parallel.dp_mode = "ps"``, ``ps_colocate = false``).

Ranks (:func:`loom.config.ps_servers`): run.nproc = W + K; ranks 0..W-1 are the workers
(``parallel.dp`` = W), ranks W..W+K-1 the K = ``parallel.ps_shards`` servers
(:mod:`loom.parallel.ps.links`). Workers run the normal trainer on :func:`worker_mesh`, a mesh of
the W workers only (data sharded over them), with :class:`~loom.parallel.ps.strategy.PSWorker`
as their data-parallel strategy (:func:`ps_worker`). A server rank runs :func:`serve`: it takes
part in the trainer's world-wide collectives, in the trainer's order, and serves in between:

    process group -> links (the workers make them as their mesh) -> control group -> data
    verdict (rank 0 prepares) -> checkpoint group and restore -> per segment: serve until every
    worker has sent DONE, then the checkpoint save (periodic, or the final one) -> final barrier

A checkpoint pauses the servers: a worker sends DONE as it hands its state to the save
(``PSWorker.sharded_state``); the servers save their shards with it, then serve again. The
checkpoint is the layout-independent one (:mod:`loom.parallel.ps.checkpoint`): under bsp equal to
all-reduce data parallelism's, moments included, so it resumes under any layout; under asp/ssp the
servers' parameters and moments of their per-push updates (step count W per step).

The loss is averaged over the workers under bsp; under asp/ssp each worker logs its own (an
all-reduce per step would hold the workers in lockstep). Rank 0's metrics rows carry the servers'
largest staleness and pulls held (``ps_staleness_max``, ``ps_pulls_held``, as of its last pull);
each server writes its whole report to ``run.dir/ps_server<k>.json`` at the end.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from loom import config as C
from loom.checkpoint.training import TrainCheckpoints
from loom.comm import CommMeter, Group
from loom.mesh import ParallelDims, ParallelMesh
from loom.parallel.materialize import init_source, materialize, tag_origins
from loom.parallel.ps.links import PSLinks, make_links
from loom.parallel.ps.server import ParameterServer
from loom.parallel.ps.strategy import PSWorker
from loom.rules import parse_ps_sync
from loom.train.export import write_json_atomic
from loom.train.health import Heartbeat, heartbeat_interval
from loom.train.setup import control_group, data_identity, ensure_data, init_process_group, initial_model

log = logging.getLogger("loom")


def sync_bound(spec: str) -> int | str | None:
    """``parallel.ps_sync`` as the servers and workers take it: "bsp", or the bound S of ssp:S (None: asp)."""
    return "bsp" if spec == "bsp" else parse_ps_sync(spec)


class WorkerMesh(ParallelMesh):
    """The mesh of the W workers: dp = W, every other degree 1 (:mod:`loom.rules` refuses the rest). Its
    dp groups are the links' worker group; ``dp_cp`` (where the trainer averages losses) is that group
    under bsp and none under asp/ssp. ``links``: this worker's links to the servers."""

    def __init__(self, dims: ParallelDims, links: PSLinks, loss_group: Group, device_type: str) -> None:
        if dims.world_size != dims.dp or dims.dp != links.workers:
            raise ValueError(
                f"dedicated parameter servers: the workers' mesh is dp = {links.workers} only, got {dims}"
            )
        self.dims, self.device_type, self.links = dims, device_type, links
        self.distributed, self.rank = True, links.rank
        self.coords = dims.coords(links.rank)
        self.coords["ep"], self.coords["edp"] = 0, self.coords["dp"]
        self._device_mesh = None
        dp = links.worker_group
        self._groups = {
            "dp_replicate": dp,
            "dp": dp,
            "dp_cp": loss_group,
            "edp": loss_group,
        }  # one-rank dims: None


def worker_mesh(cfg: C.LoomConfig, device_type: str) -> WorkerMesh:
    """Make the links (every rank, servers too: :func:`serve`) and return this worker's mesh."""
    p = cfg.parallel
    links = make_links(p.dp, p.ps_shards)
    loss_group = links.worker_group if p.ps_sync == "bsp" else None
    return WorkerMesh(ParallelDims.from_config(p), links, loss_group, device_type)


def ps_worker(
    model: nn.Module, mesh: ParallelMesh, cfg: C.LoomConfig, meter: CommMeter | None = None
) -> PSWorker:
    """This worker's strategy: pushes to and pulls from the servers over ``mesh.links``."""
    if not isinstance(mesh, WorkerMesh):
        raise TypeError("a worker of dedicated parameter servers trains on worker_mesh()")
    return PSWorker(model, mesh.links, sync_bound(cfg.parallel.ps_sync), meter, cfg.run.timeout_s)


def server_model(cfg: C.LoomConfig, device: torch.device) -> nn.Module:
    """The whole model with the values the workers start from (a server takes its shard from it)."""
    model, source = initial_model(cfg, device)
    tag_origins(model, cfg.model.vocab_size)
    materialize(model, device, source or init_source(cfg.model, cfg.train.seed))
    return model


def serve(cfg: C.LoomConfig, env) -> dict[str, float]:
    """A server rank of ``loom train`` (see the module docstring); returns its report's figures."""
    device = init_process_group(cfg, env)
    C.validate(cfg, env.world)
    p = cfg.parallel
    workers = p.dp
    links = make_links(workers, p.ps_shards)  # where the workers build their mesh
    run_dir = Path(cfg.run.dir)
    heartbeat = Heartbeat(run_dir, env.rank, heartbeat_interval(cfg.run.timeout_s))
    try:
        control = control_group(env)
        data = ensure_data(cfg, env, control)
        C.check_vocab(cfg, data.vocab_size)
        cfg.model.vocab_size = C.effective_vocab(cfg, data.vocab_size)
        server = ParameterServer(
            server_model(cfg, device), links, sync_bound(p.ps_sync), cfg.train, timeout_s=cfg.run.timeout_s
        )
        heartbeat.set(0, "checkpoint load")
        tokenizer = data_identity(data)["tokenizer"]  # recorded in each checkpoint, checked on restore
        ckpts = TrainCheckpoints(cfg, run_dir, env.rank, env.world, server, tokenizer_sha256=tokenizer)
        done = ckpts.restore()
        while done < cfg.train.steps:
            heartbeat.set(done + 1, "serve")
            before = len(server.report.pushers)
            server.serve()
            steps = (len(server.report.pushers) - before) // workers  # every worker pushes once per step
            if steps == 0:
                raise RuntimeError(
                    f"parameter server {server.k}: the workers paused at step {done} without a step"
                )
            done += steps
            if done < cfg.train.steps:  # a periodic checkpoint paused the workers
                heartbeat.set(done, "checkpoint save")
                ckpts.save(done, blocking=not cfg.train.checkpoint_async)
        heartbeat.set(done, "final save")
        ckpts.finish(done)
        report = summary(server)
        write_json_atomic(run_dir / f"ps_server{server.k}.json", report)
        dist.barrier(group=control)  # the trainer's, after rank 0's export (Trainer.save_final)
        return {k: float(v) for k, v in report.items() if isinstance(v, (int, float))}
    finally:
        heartbeat.close()


def summary(server: ParameterServer) -> dict:
    """What a server saw over the run: rounds, pushes applied, staleness (largest, mean), pulls held, bytes through it."""
    r = server.report
    return {
        "server": r.index,
        "sync": server.bound
        if isinstance(server.bound, str)
        else ("asp" if server.bound is None else f"ssp:{server.bound}"),
        "rounds": r.rounds,
        "pushes": len(r.pushers),
        "max_staleness": r.max_staleness,
        "mean_staleness": sum(r.staleness) / max(1, len(r.staleness)),
        "max_missed": max(r.missed, default=0),
        "pulls_held": r.waits,
        "bytes_in": r.bytes_in,
        "bytes_out": r.bytes_out,
    }
