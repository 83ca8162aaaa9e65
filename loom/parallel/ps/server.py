"""A dedicated parameter-server rank: the loop that owns shard k (see :mod:`loom.parallel.ps.strategy`).

Per link, in this order (both sides issue the same operations in the same order, NCCL-safe):

    bsp, per round     push: header, gradient shard; (server 0 only) pull: Σ_k‖ḡ_k‖²;
                       push: control (lr, grad_scale, clip coefficient); pull: header, shard
    asp/ssp, per push  push: header (with lr, grad_scale), gradient shard; pull: header, shard
    the end            push: a DONE header

A pull's header carries (version, updates applied, the largest staleness recorded so far, pulls
held so far): the workers see the bound hold (``PSWorker.row``, rank 0's metrics). :meth:`serve`
returns once every worker has sent DONE and may be called again (the workers' next pushes): a
checkpoint is such a pause (:mod:`loom.train.ps_run`); versions and counts run on across calls.

BSP: the server receives all W gradients, averages them in worker order, all-reduces the squared
norm over the servers and sends it to the workers (server 0), applies the workers' clip
coefficient and learning rate, steps once, and sends its shard to every worker.

ASP and SSP (bound S; asp: none): a push is applied as it arrives, as one AdamW step with that
gradient. Clocks: c_w = pushes applied from worker w; the server's version v = min_w c_w (the
clocks every worker has completed: the parameters hold every worker's first v gradients). A
worker pulling at clock c_w gets parameters v behind its own clock: its next gradient is
``staleness`` = c_w − v steps stale. SSP holds the pull of a worker with c_w − v > S until the
slowest catches up, so staleness ≤ S for every update (the test asserts it on what is recorded);
ASP never holds a pull. Also recorded: ``missed``, the updates applied between a worker's pull and
its push (other workers' gradients it did not see): at most (W−1)(2S+1) under ssp:S (each other
worker is at most S below and S+1 above c_w), W−1 under bsp-like ssp:0 rounds.

Streams (asp/ssp on an accelerator): ``wait`` on a communication only orders the *current stream*
after it, and every thread's current stream is the device's default stream unless set. A listener
waiting for worker w's next push on the default stream would stall everything queued there after
it, the main loop's pull to w included, which w needs before it pushes again: a deadlock. So each
listener issues its receives and header reads on a stream of its own, a server's waits poll the
work's completion on the host before ordering any stream after it (:class:`Lanes`), and each
gradient reaches the main loop with an event recorded on its listener's stream, which the main
loop's stream waits on right before the update. On the CPU every lane is the thread itself.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from loom import comm
from loom.comm import CommMeter
from loom.parallel.base import sum_sq
from loom.parallel.ps.checkpoint import ServerState, shard_pieces
from loom.parallel.ps.links import DONE, PULL_HEADER, PUSH_HEADER, PSLinks, ServerLost, recv, send, wait_for
from loom.parallel.ps.strategy import FlatModel


@dataclass
class ServerReport:
    """What one server saw: per applied update, the pushing worker and its staleness; bytes in and out."""

    index: int
    staleness: list[int] = field(default_factory=list)
    missed: list[int] = field(default_factory=list)  # updates applied between the pusher's pull and its push
    pushers: list[int] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    rounds: int = 0  # bsp rounds, or the final version (complete clocks) under asp/ssp
    waits: int = 0  # pulls held back by the ssp bound
    max_staleness: int = 0  # max(staleness), kept as updates arrive (sent with every pull)
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # the final parameter shard ("shard")


class Lanes:
    """Where each thread of a server issues its device work, and how it waits.

    On an accelerator each listener gets a stream of its own (:meth:`listener`), and a wait first
    polls the work's completion on the host, then orders the current stream after it (an event that
    has already passed): no stream ever stalls on a peer, so nothing queued behind it can, even when
    two listeners draw the same stream from torch's pool. The host poll backs off from 10 µs to 1 ms
    and names the peer after ``timeout_s``. On the CPU a wait blocks the thread (gloo completes a
    receive only in ``wait``) and every lane is the thread itself.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.streams = self.device.type != "cpu"

    def new_stream(self):
        return torch.Stream(device=self.device)

    def new_event(self):
        return torch.Event(device=self.device)

    def current_stream(self):
        return torch.accelerator.current_stream(self.device)

    @contextlib.contextmanager
    def listener(self, w: int) -> Iterator[None]:
        """The context of worker w's listener thread: a fresh stream made current (accelerator)."""
        if not self.streams:
            yield
            return
        with self.new_stream():
            yield

    def settle(self, work, timeout_s: float, who: str) -> None:
        """Wait for ``work`` (see the class docstring); :class:`ServerLost` names ``who`` after ``timeout_s``."""
        if self.streams:
            deadline, pause = time.monotonic() + timeout_s, 1e-5
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise ServerLost(f"{who} did not answer within {timeout_s:.0f} s")
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)
        wait_for(work, timeout_s, who)

    def ready(self):
        """An event after the work issued so far on this thread's stream (None on the CPU)."""
        if not self.streams:
            return None
        event = self.new_event()
        event.record(self.current_stream())
        return event

    def consume(self, event) -> None:
        """Order the current stream after ``event`` (a listener's gradient has arrived)."""
        if event is not None:
            self.current_stream().wait_event(event)


class ParameterServer:
    """Shard k of ``module``'s parameters (values taken from it: every rank builds the same init) and its
    AdamW state; :meth:`serve` runs until every worker has sent DONE."""

    def __init__(
        self,
        module: nn.Module,
        links: PSLinks,
        bound: int | str | None,
        train_cfg,
        meter: CommMeter | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        if not links.is_server:
            raise ValueError(f"rank {links.rank} is a worker, not a parameter server")
        self.links, self.bound, self.meter, self.timeout_s = links, bound, meter, timeout_s
        self.k, self.W = links.server_index, links.workers
        model = FlatModel(module, links.shards, self.k)
        self.shard = model.seg(model.flat, self.k).clone()
        self.optimizer = model.new_optimizer(self.shard, train_cfg)
        self.inbox = [torch.zeros_like(self.shard) for _ in range(self.W)]
        self.grad = torch.zeros_like(self.shard)
        dev = self.shard.device  # messages live where the shard does (NCCL moves device memory only)
        self.headers = [torch.zeros(PUSH_HEADER, dtype=torch.float64, device=dev) for _ in range(self.W)]
        self.reply = torch.zeros(PULL_HEADER, dtype=torch.float64, device=dev)
        self.report = ServerReport(self.k)
        self.lanes = Lanes(dev)
        self.pieces, self.start = (
            shard_pieces(module, model.layout),
            model.layout.start,
        )  # what it checkpoints
        del model  # the workers' copy of the whole model is not a server's business

    def sharded_state(self):
        """Its shard of the parameters and their moments, by global name (:class:`ServerState`)."""
        return ServerState(self).sharded_state()

    def load_sharded(self, reader) -> None:
        ServerState(self).load_sharded(reader)

    def _link(self, table: dict, w: int):
        g = table[(w, self.k)]
        return g, self.links.peer(g, w)

    def _wait(self, work, w: int) -> None:
        self.lanes.settle(work, self.timeout_s, f"worker {w}")

    def _recv_push(self, w: int) -> None:
        g, peer = self._link(self.links.push, w)
        self._wait(recv(self.inbox[w], g, peer), w)
        self.report.bytes_in += comm.nbytes(self.inbox[w])

    def _send_pull(self, w: int, version: int, updates: int) -> None:
        g, peer = self._link(self.links.pull, w)
        r = self.report
        self.reply.copy_(torch.tensor([version, updates, r.max_staleness, r.waits], dtype=torch.float64))
        self._wait(send(self.reply, g, peer), w)
        self._wait(send(self.shard, g, peer, self.meter), w)
        self.report.bytes_out += comm.nbytes(self.shard)

    def serve(self) -> ServerReport:
        """Serve until every worker is done; returns the report (with the final shard)."""
        if self.bound == "bsp":
            self._serve_bsp()
        else:
            self._serve_async()
        self.report.state = {"shard": self.shard.clone()}
        return self.report

    # ------------------------------------------------------------------ bsp
    def _serve_bsp(self) -> None:
        while True:
            kinds = []
            for w in range(self.W):
                g, peer = self._link(self.links.push, w)
                self._wait(recv(self.headers[w], g, peer), w)
                kinds.append(float(self.headers[w][0]))
            if all(kind == DONE for kind in kinds):
                return
            if any(kind == DONE for kind in kinds):
                raise RuntimeError(
                    f"parameter server {self.k}: under bsp every worker pushes every round; workers "
                    f"{[w for w, kd in enumerate(kinds) if kd == DONE]} stopped early"
                )
            for w in range(self.W):
                self._recv_push(w)
            self.grad.copy_(self.inbox[0])
            for w in range(1, self.W):
                self.grad.add_(self.inbox[w])
            self.grad.div_(self.W)
            sq = sum_sq([self.grad]).double().reshape(1)
            comm.all_reduce(sq, self.links.server_group)
            if self.k == 0:
                for w in range(self.W):
                    g, peer = self._link(self.links.pull, w)
                    self._wait(send(sq, g, peer), w)
            for w in range(self.W):  # the control message: lr, grad_scale, clip coefficient
                g, peer = self._link(self.links.push, w)
                self._wait(recv(self.headers[w], g, peer), w)
            lr, grad_scale, coef = (float(x) for x in self.headers[0][:3])
            if coef != 1.0:
                self.grad.mul_(coef)
            self.optimizer.step([self.grad], lr, grad_scale)
            self.report.rounds += 1
            self.report.staleness += [0] * self.W
            self.report.missed += [0] * self.W
            self.report.pushers += list(range(self.W))
            for w in range(self.W):
                self._send_pull(w, self.report.rounds, self.report.rounds)

    # ------------------------------------------------------------------ asp / ssp
    def _serve_async(self) -> None:
        """One listener thread per worker blocks on that worker's push link (a receive cannot be polled on
        every backend: gloo completes it only in ``wait``) and queues each arrival; this loop applies
        them in arrival order and answers the pulls the bound allows."""
        W, bound = self.W, self.bound
        assert bound is None or isinstance(bound, int)
        v0, applied = self.report.rounds, len(self.report.pushers)  # where an earlier serve() left off
        clock, lag, seen = (
            [v0] * W,
            [0] * W,
            [applied] * W,
        )  # pushes applied; c_w - v and updates at w's last pull
        arrivals: queue.SimpleQueue = queue.SimpleQueue()
        listeners = [
            threading.Thread(target=self._listen, args=(w, arrivals), daemon=True, name=f"loom-ps-listen-{w}")
            for w in range(W)
        ]
        for th in listeners:
            th.start()
        done: set[int] = set()
        held: list[int] = []  # workers whose push is applied and whose pull waits
        updates = applied
        while len(done) < W or held:
            try:
                w, kind, lr, grad_scale, ready = arrivals.get(timeout=self.timeout_s)
            except queue.Empty:
                silent = sorted(set(range(W)) - done)
                raise ServerLost(
                    f"parameter server {self.k}: workers {silent} sent nothing for {self.timeout_s:.0f} s"
                ) from None
            if isinstance(kind, BaseException):
                raise kind
            if kind == DONE:
                done.add(w)
            else:
                self.report.staleness.append(lag[w])
                self.report.max_staleness = max(self.report.max_staleness, lag[w])
                self.report.missed.append(updates - seen[w])
                self.report.pushers.append(w)
                self.lanes.consume(ready)  # inbox[w] has arrived (on the listener's stream)
                self.optimizer.step([self.inbox[w]], lr, grad_scale)
                updates += 1
                clock[w] += 1
                held.append(w)
            version = min(clock)
            for u in list(held):
                if bound is None or clock[u] - version <= bound:
                    held.remove(u)
                    self._send_pull(u, version, updates)
                    lag[u], seen[u] = clock[u] - version, updates
            self.report.waits += int(kind != DONE and w in held)
        for th in listeners:
            th.join()
        self.report.rounds = min(clock)

    def _listen(self, w: int, arrivals: queue.SimpleQueue) -> None:
        """Worker w's pushes, in order: (w, kind, lr, grad_scale, ready) per header, on this listener's own
        stream; the gradient is in ``inbox[w]`` once ``ready`` (an event, None on the CPU) has passed (w
        sends its next push only after this server answered its pull, which follows the update that
        read the buffer, so the buffer is free again)."""
        g, peer = self._link(self.links.push, w)
        try:
            with self.lanes.listener(w):
                while True:
                    self._wait(recv(self.headers[w], g, peer), w)
                    kind, lr, grad_scale = (float(self.headers[w][i]) for i in (0, 3, 4))
                    if kind != DONE:
                        self._recv_push(w)
                    arrivals.put((w, kind, lr, grad_scale, self.lanes.ready()))
                    if kind == DONE:
                        return
        except BaseException as e:  # noqa: BLE001 - handed to the serving loop
            arrivals.put((w, e, 0.0, 0.0, None))
