"""``loom train``'s launch options (restarts, the nodes of a multi-node job) and the elastic
launcher's settings made from them."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from loom import config as C
from loom.launch.env import is_loopback
from loom.numbers import is_whole


@dataclass(frozen=True)
class Nodes:
    """A multi-node job: ``nnodes`` launchers (one per node) meet at ``endpoint`` (``HOST:PORT``,
    hosted by node 0)."""

    nnodes: int
    node_rank: int
    endpoint: str

    @property
    def host(self) -> str:
        return self.endpoint.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])


@dataclass(frozen=True)
class LaunchOptions:
    """``loom train``'s options beside the config: restarts and the nodes of a multi-node job."""

    max_restarts: int = 0
    nodes: Nodes | None = None

    def world(self, cfg: C.LoomConfig) -> int:
        """Ranks of the whole job: the explicit parallel degrees, else ``run.nproc`` per node (always with
        dedicated parameter servers: ``config.validate`` checks run.nproc = parallel.dp + ps_shards)."""
        p = cfg.parallel
        explicit = p.dp > 0 and not C.ps_servers(cfg)
        return (
            p.dp * p.tp * p.pp * p.cp
            if explicit
            else cfg.run.nproc * (self.nodes.nnodes if self.nodes else 1)
        )


TRAIN_OPTIONS = ("nproc", "max_restarts", "nnodes", "node_rank", "rdzv_endpoint")


def launch_options(plain: dict[str, str]) -> LaunchOptions:
    """``--max-restarts K --nnodes N --node-rank R --rdzv-endpoint HOST:PORT`` (keys as the CLI
    parser gives them: dashes to underscores), each checked with a one-line ConfigError."""

    def count(key: str, default: int, low: int) -> int:
        flag = "--" + key.replace("_", "-")
        value = C._coerce(plain.get(key, str(default)), int, flag)
        if value < low:
            raise C.ConfigError(f"{flag}: must be >= {low}, got {value}")
        return value

    max_restarts = count("max_restarts", 0, 0)
    nnodes = count("nnodes", 1, 1)
    node_rank = count("node_rank", 0, 0)
    endpoint = plain.get("rdzv_endpoint", "").strip()
    if node_rank >= nnodes:
        raise C.ConfigError(f"--node-rank: must be in [0, --nnodes={nnodes}), got {node_rank}")
    if not endpoint:
        if nnodes > 1:
            raise C.ConfigError(
                f"--rdzv-endpoint: --nnodes {nnodes} needs the rendezvous HOST:PORT that "
                "every node reaches (node 0 hosts it)"
            )
        return LaunchOptions(max_restarts)
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host.strip("[]") or not is_whole(port) or not 1 <= int(port) <= 65535:
        raise C.ConfigError(
            f"--rdzv-endpoint: expected HOST:PORT with a port in [1, 65535], got {endpoint!r}"
        )
    return LaunchOptions(max_restarts, Nodes(nnodes, node_rank, endpoint))


def launch_config(
    cfg: C.LoomConfig, nproc: int, max_restarts: int, nodes: Nodes | None, port: int, agent_dir: str
):
    """The elastic launcher's settings: one local node on ``run.master_addr:port``, or this node of a
    multi-node job (rendezvous at ``nodes.endpoint``, hosted by node 0). The agent's own files (each
    rank's error file) go under ``agent_dir``, which the caller removes (left to itself, the agent
    leaves a ``torchelastic_*`` directory in the temp dir on every launch)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    local_addr: str | None
    if nodes is None:  # one local node; a fresh run id, so a leftover store never joins
        addr = cfg.run.master_addr
        nnodes, run_id, endpoint, is_host = 1, f"loom-{uuid.uuid4().hex[:8]}", f"{addr}:{port}", True
        local_addr = addr
    else:  # one job per endpoint: every node names the same run
        nnodes, run_id, endpoint, is_host = nodes.nnodes, "loom", nodes.endpoint, nodes.node_rank == 0
        local_addr = nodes.host if is_loopback(nodes.host) else None  # else this node's name, as torchrun
    return LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"timeout": int(cfg.run.timeout_s), "is_host": is_host},
        max_restarts=max_restarts,
        monitor_interval=0.1,
        shutdown_timeout=math.ceil(cfg.run.preempt_grace_s),  # SIGTERM/SIGINT to SIGKILL: time to save
        start_method="spawn",
        local_addr=local_addr,
        logs_specs=DefaultLogsSpecs(log_dir=agent_dir),
    )
