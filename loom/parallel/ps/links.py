"""The point-to-point links of a parameter server with dedicated server ranks.

World = W workers (ranks 0..W-1) + K servers (ranks W..W+K-1). Every (worker w, server k) pair
gets two two-rank groups, each carrying messages one way only:

    push[w][k]: w -> server k   header (5 × fp64), then its gradient shard (Φ_k elements);
                                under bsp also a control message (lr, grad_scale, clip coefficient)
    pull[w][k]: server k -> w   header (4 × fp64), then the server's parameter shard (Φ_k);
                                under bsp, server 0 first sends the global Σ‖ḡ‖²

Why one group per direction and pair: NCCL runs each communicator's operations in issue order on
one stream, so a server that has posted the receive of a worker's *next* push must still be able
to send that worker its parameters (another group), and a server waiting on a slow worker must
still hear the others (their own groups). Both sides issue every link's operations in the same
order. Plus ``workers`` (the W workers: loss averaging) and ``servers`` (the K servers: the
global gradient norm under BSP). Every rank creates every group, in the same order.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from loom import comm
from loom.comm import CommMeter, Group

PUSH, DONE = 1.0, 0.0  # header kinds
PUSH_HEADER = 5  # kind, worker clock, 0, lr, grad_scale (bsp: lr and grad_scale follow in a control message)
PULL_HEADER = 4  # server version (complete clocks), updates applied, max staleness so far, pulls held so far


class ServerLost(RuntimeError):
    """A parameter server (or, seen from a server, a worker) stopped answering."""


@dataclass
class PSLinks:
    """This rank's view of the links: ``push[w][k]`` and ``pull[w][k]`` exist where this rank is w or server k."""

    workers: int
    shards: int
    rank: int
    push: dict[tuple[int, int], Group] = field(default_factory=dict)
    pull: dict[tuple[int, int], Group] = field(default_factory=dict)
    worker_group: Group = None
    server_group: Group = None

    @property
    def is_server(self) -> bool:
        return self.rank >= self.workers

    @property
    def server_index(self) -> int:
        return self.rank - self.workers

    def server_rank(self, k: int) -> int:
        return self.workers + k

    def peer(self, group: Group, global_rank: int) -> int:
        """The group-local rank of ``global_rank`` in a link."""
        return dist.get_group_rank(group, global_rank) if group is not None else 0


def make_links(workers: int, shards: int) -> PSLinks:
    """Create every link group (a collective over the world: every rank calls it, in the same order)."""
    rank = dist.get_rank()
    if dist.get_world_size() != workers + shards:
        raise ValueError(
            f"parameter server: the world has {dist.get_world_size()} ranks, not {workers} workers + "
            f"{shards} servers"
        )
    links = PSLinks(workers, shards, rank)
    for w in range(workers):
        for k in range(shards):
            for table in (links.push, links.pull):
                g = dist.new_group([w, workers + k])
                if rank in (w, workers + k):
                    table[(w, k)] = g
    wg = dist.new_group(list(range(workers)))
    sg = dist.new_group(list(range(workers, workers + shards)))
    links.worker_group = wg if rank < workers else None
    links.server_group = sg if rank >= workers else None
    return links


_ISSUE = (
    threading.Lock()
)  # a server's listener threads and its main loop post operations (loom.parallel.ps.server)


def send(t: torch.Tensor, group: Group, peer: int, meter: CommMeter | None = None):
    """Post the send of ``t`` to link-local ``peer``; returns the work (issuing is serialized across threads:
    torch's batch_isend_irecv must not be entered from two at once)."""
    with _ISSUE:
        return comm.batch_p2p([(t, peer)], [], group, meter)[0]


def recv(t: torch.Tensor, group: Group, peer: int):
    """Post the receive of ``t`` from link-local ``peer``; returns the work."""
    with _ISSUE:
        return comm.batch_p2p([], [(t, peer)], group)[0]


def wait_for(work, timeout_s: float, who: str) -> None:
    """Wait for ``work``; a peer that does not answer within ``timeout_s`` (or whose link broke) is named."""
    try:
        comm.wait(work, timedelta(seconds=timeout_s))
    except Exception as e:  # a timeout, or the peer's process is gone (connection closed)
        raise ServerLost(
            f"{who} did not answer within {timeout_s:.0f} s ({str(e).splitlines()[0][:160]})"
        ) from e
