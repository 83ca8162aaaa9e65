"""Issue 32, findings 2, 5 and 9: the GPU and scale findings the CPU can show.

- 2: an asp/ssp parameter server on a model of CUDA stream semantics (a wait on unfinished work
  stalls its stream; a send posted on a stalled stream queues behind it): the listener threads'
  waits never stall a stream, each listener runs on its own stream, and the main loop's pulls never
  queue behind them. The same model reproduces the deadlock of the old shape (one shared stream,
  plain waits).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import Counter
from datetime import timedelta

import pytest
import torch

from tests.helpers import tiny_model, tiny_train


# ------------------------------------------------------------------ finding 2: listener streams
class StreamModel:
    """CUDA stream semantics on the host: a thread's current stream (``default`` unless set); a wait on
    unfinished work stalls that stream until the work completes; a send posted on a stalled stream
    waits for it (``deadlock_s`` at most: then it raises, the deadlock a GPU would hang in)."""

    def __init__(self, deadlock_s: float = 0.5) -> None:
        self.tls = threading.local()
        self.cond = threading.Condition()
        self.stalled: Counter = Counter()
        self.deadlock_s = deadlock_s
        self.waits: list[tuple[str, str, bool]] = []  # (thread, stream, complete when waited)
        self.sends: list[tuple[str, str]] = []  # (thread, stream)
        self.consumed: list[tuple[str, str]] = []  # (stream waiting, stream the event was recorded on)
        self.streams = 0

    def lane(self) -> str:
        return getattr(self.tls, "lane", "default")


class ModelStream:
    def __init__(self, model: StreamModel) -> None:
        model.streams += 1
        self.model, self.name, self.saved = model, f"stream-{model.streams}", []

    def __enter__(self):
        self.saved.append(self.model.lane())
        self.model.tls.lane = self.name
        return self

    def __exit__(self, *exc) -> None:
        self.model.tls.lane = self.saved.pop()


class ModelCurrent:
    def __init__(self, model: StreamModel) -> None:
        self.model, self.name = model, model.lane()

    def wait_event(self, event) -> None:
        self.model.consumed.append((self.name, event.lane))


class ModelEvent:
    lane = ""

    def record(self, stream) -> None:
        self.lane = stream.name


class RecvWork:
    """A receive: complete once the peer's message is in the channel (copied into ``t``)."""

    def __init__(self, model: StreamModel, channel: queue.Queue, t: torch.Tensor) -> None:
        self.model, self.channel, self.t, self.done = model, channel, t, False

    def _take(self, block: bool, timeout: float | None = None) -> None:
        self.t.copy_(self.channel.get(block, timeout))
        self.done = True

    def is_completed(self) -> bool:
        if not self.done:
            with contextlib.suppress(queue.Empty):
                self._take(False)
        return self.done

    def wait(self, timeout: timedelta | None = None) -> bool:
        m, lane = self.model, self.model.lane()
        m.waits.append((threading.current_thread().name, lane, self.done))
        if self.done:
            return True
        with m.cond:
            m.stalled[lane] += 1  # the stream waits for the peer from now on
        try:
            self._take(True, None if timeout is None else timeout.total_seconds())
        except queue.Empty:
            raise RuntimeError("timed out") from None
        finally:
            with m.cond:
                m.stalled[lane] -= 1
                m.cond.notify_all()
        return True


class SendWork:
    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


class FakeNet:
    """The links of one server k=0 with W workers: a channel per (table, worker)."""

    def __init__(self, model: StreamModel, workers: int) -> None:
        self.model = model
        self.chan = {(t, w): queue.Queue() for t in ("push", "pull") for w in range(workers)}

    def send(self, t, group, peer, meter=None):
        m, lane = self.model, self.model.lane()
        m.sends.append((threading.current_thread().name, lane))
        with m.cond:  # NCCL's stream first waits for the poster's current stream
            if not m.cond.wait_for(lambda: m.stalled[lane] == 0, m.deadlock_s):
                raise RuntimeError(f"deadlock: a send on {lane} queued behind a wait on unfinished work")
        self.chan[group].put(t.detach().clone())
        return SendWork()

    def recv(self, t, group, peer):
        return RecvWork(self.model, self.chan[group], t)


def _fake_worker(net: FakeNet, w: int, steps: int, numel: int) -> None:
    from loom.parallel.ps.links import DONE, PUSH

    g = torch.Generator().manual_seed(w)
    for clock in range(steps):
        net.chan[("push", w)].put(torch.tensor([PUSH, clock, 0.0, 1e-3, 1.0], dtype=torch.float64))
        net.chan[("push", w)].put(torch.randn(numel, generator=g))
        try:
            net.chan[("pull", w)].get(timeout=5)  # header
            net.chan[("pull", w)].get(timeout=5)  # shard
        except queue.Empty:  # the server stopped (the deadlock the old shape shows): nothing to pull
            return
    net.chan[("push", w)].put(torch.tensor([DONE, steps, 0.0, 0.0, 0.0], dtype=torch.float64))


def _serve_on_model(monkeypatch, bound, old_shape: bool = False, workers: int = 2, steps: int = 6):
    from loom.model.llama import build_model
    from loom.parallel.ps import server as S
    from loom.parallel.ps.links import PSLinks

    model = StreamModel()
    net = FakeNet(model, workers)
    monkeypatch.setattr(S, "send", net.send)
    monkeypatch.setattr(S, "recv", net.recv)

    class ModelLanes(S.Lanes):
        def __init__(self) -> None:
            super().__init__(torch.device("cpu"))
            self.streams = True  # the accelerator path, on the model

        def new_stream(self):
            return ModelStream(model)

        def new_event(self):
            return ModelEvent()

        def current_stream(self):
            return ModelCurrent(model)

    class OldLanes(ModelLanes):  # before the fix: every thread on the default stream, plain waits
        def listener(self, w):
            return contextlib.nullcontext()

        def settle(self, work, timeout_s, who):
            S.wait_for(work, timeout_s, who)

    class Links(PSLinks):
        def peer(self, group, global_rank):
            return 0

    links = Links(workers, 1, workers)
    links.push = {(w, 0): ("push", w) for w in range(workers)}
    links.pull = {(w, 0): ("pull", w) for w in range(workers)}
    ps = S.ParameterServer(build_model(tiny_model(), 0), links, bound, tiny_train(), None, 3.0)
    ps.lanes = OldLanes() if old_shape else ModelLanes()
    threads = [
        threading.Thread(target=_fake_worker, args=(net, w, steps, ps.shard.numel()), daemon=True)
        for w in range(workers)
    ]
    for th in threads:
        th.start()
    report = ps.serve()
    for th in threads:
        th.join(5)
    return model, report


@pytest.mark.parametrize("bound", [None, 1])
def test_ps_listener_waits_never_block_the_main_loop(monkeypatch, bound):
    """asp and ssp:1, 2 workers × 6 pushes on the stream model: every wait of a server thread is on
    finished work (0 stalls), each listener on its own stream, never the main loop's; the main loop
    waits once per applied push, on the pushing listener's stream, and its 2 sends per pull are
    all on its own (default) stream."""
    workers, steps = 2, 6
    model, report = _serve_on_model(monkeypatch, bound, workers=workers, steps=steps)
    assert len(report.pushers) == workers * steps
    assert [done for _, _, done in model.waits] == [True] * len(model.waits)
    lanes = {th: lane for th, lane, _ in model.waits if th.startswith("loom-ps-listen")}
    assert len(lanes) == workers and len(set(lanes.values())) == workers and "default" not in lanes.values()
    assert Counter(model.consumed) == Counter(
        ("default", lanes[f"loom-ps-listen-{w}"]) for w in report.pushers
    )
    assert model.sends == [(threading.current_thread().name, "default")] * (2 * workers * steps)


def test_ps_stream_model_reproduces_the_old_deadlock(monkeypatch):
    """The same model, listeners on the shared default stream with plain waits (before the fix): the
    main loop's first pull queues behind a listener's wait for that worker's next push."""
    with pytest.raises(RuntimeError, match="deadlock: a send on default queued behind"):
        _serve_on_model(monkeypatch, None, old_shape=True)


# ------------------------------------------------------------------ finding 5: diagnostics
KEY = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
AGENT = {"TORCHELASTIC_RUN_ID": "job", "RANK": "0"}


@pytest.mark.parametrize(
    "rank_env,parent,want,logged",
    [
        ({}, None, "2", False),  # srun, nothing set: Loom's raising mode
        (AGENT | {KEY: "1"}, {"PATH": "/bin"}, "2", False),  # torchrun's default: replaced
        (AGENT | {KEY: "1"}, {KEY: "1"}, "1", True),  # the user exported 1 to torchrun: kept, said
        (AGENT | {KEY: "1"}, None, "1", True),  # whose it is cannot be read: kept, said
        (AGENT | {KEY: "3"}, {KEY: "3"}, "3", False),  # the user's raising mode: kept silently
        ({KEY: "0"}, None, "0", True),  # srun, the user's 0: kept, said
    ],
)
def test_nccl_error_handling_replaces_only_the_agents_default(
    monkeypatch, tmp_path, caplog, rank_env, parent, want, logged
):
    """Under bare torchrun the agent's TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (SIGABRT before Loom's
    diagnosis) becomes 2 in the rank before its process group exists; a user's value is kept, and a
    killing one is logged once on rank 0 (none on rank 1)."""
    import logging
    import os

    from loom.train.health import apply_nccl_watchdog_env

    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("TORCH_NCCL", "TORCH_FR", "TORCHELASTIC"))
    }
    for rank in (0, 1):
        monkeypatch.setattr(os, "environ", base | rank_env)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="loom"):
            apply_nccl_watchdog_env(600, tmp_path, rank, lambda: parent)
        assert os.environ[KEY] == want
        lines = [r.getMessage() for r in caplog.records if KEY in r.getMessage()]
        assert len(lines) == int(logged and rank == 0), lines
        if lines:
            assert lines[0].startswith(f"{KEY}={want} (") and "is kept" in lines[0]


def test_parent_environ_is_read_from_proc():
    import os

    parent = __import__("loom.train.health", fromlist=["parent_environ"]).parent_environ(os.getpid())
    if parent is None:
        pytest.skip("no /proc here")
    assert parent.get("PATH") == os.environ.get("PATH") or "PATH" in parent


def test_store_port_taken_at_rank0_is_one_line_naming_the_port(monkeypatch, tmp_path):
    """A real bind race: the port rank 0's store must listen on is held by another socket. Rank 0's
    process group start fails with a one-line StorePortTaken naming addr:port and the cause (it
    used to be diagnosed as "rank 1 unresponsive")."""
    import os
    import socket

    from loom import config as C
    from loom.train.setup import RankEnv, StorePortTaken, init_process_group

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        for k, v in {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": "0",
            "WORLD_SIZE": "2",
        }.items():
            monkeypatch.setenv(k, v)
        cfg = C.LoomConfig()
        cfg.run.device, cfg.run.threads, cfg.run.timeout_s = "cpu", torch.get_num_threads(), 5
        cfg.run.dir = str(tmp_path)
        with pytest.raises(StorePortTaken) as info:
            init_process_group(cfg, RankEnv(rank=0, world=2, local_rank=0, local_world=2))
    line = str(info.value)
    assert "\n" not in line and line.startswith(
        f"MASTER_PORT: rank 0 cannot listen on 127.0.0.1:{port} for the process group's store: address "
        "already in use"
    )
    assert not __import__("torch.distributed").distributed.is_initialized()
    assert os.environ["MASTER_PORT"] == str(port)


def _failed(tmp_path, rank: int, message: str):
    import json

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    path = tmp_path / f"error-{rank}-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(
        json.dumps(
            {"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": "0"}}}
        )
    )
    return ChildFailedError("loom", {rank: ProcessFailure(rank, 100 + rank, 1, str(path))})


def test_taken_store_port_relaunches_then_reports(tmp_path, capsys):
    """The launcher starts the ranks again (the agent picks a new port) while rank 0's only failure
    is the taken store port, at most STORE_ATTEMPTS launches; any other failure is raised at once."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from loom.launch import STORE_ATTEMPTS, failure_line, relaunch_on_taken_port

    taken = "StorePortTaken: MASTER_PORT: rank 0 cannot listen on 127.0.0.1:4242 for the process group's store: address already in use (x); start again"
    calls = []

    def flaky(fail_times: int, message: str = taken):
        def start():
            calls.append(1)
            if len(calls) <= fail_times:
                raise _failed(tmp_path, 0, message)
            return {0: "ok"}

        return start

    assert relaunch_on_taken_port(flaky(1)) == {0: "ok"} and len(calls) == 2
    assert capsys.readouterr().err.count("starting the ranks again on a new port") == 1
    calls.clear()
    with pytest.raises(ChildFailedError) as info:
        relaunch_on_taken_port(flaky(STORE_ATTEMPTS))
    assert len(calls) == STORE_ATTEMPTS
    assert failure_line(info.value.failures, tmp_path).startswith(
        "loom: MASTER_PORT: rank 0 cannot listen on 127.0.0.1:4242 for the process group's store"
    )
    calls.clear()
    with pytest.raises(ChildFailedError):
        relaunch_on_taken_port(flaky(1, "RuntimeError: something else"))
    assert len(calls) == 1


# ------------------------------------------------------------------ finding 9 (c): RNG per rank
class _Slice:
    """A Shardable of one tensor, 4 elements per rank (what a strategy would hold)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.local = torch.arange(4.0) + 4 * rank

    def sharded_state(self):
        from loom.checkpoint.protocol import Box, ShardedTensor

        return {"model.w": ShardedTensor(self.local, (4 * self.world,), Box((4 * self.rank,), (4,)))}

    def load_sharded(self, reader) -> None:
        reader.fill(self.sharded_state())


def _rng_resume(run_dir: str) -> dict:
    from pathlib import Path

    import torch.distributed as dist

    from loom.checkpoint.load import CheckpointReader
    from loom.checkpoint.rng import RNG_PREFIX, capture_rng, rng_name, rng_tensor
    from loom.checkpoint.training import TrainCheckpoints
    from loom.config import LoomConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = LoomConfig()
    cfg.run.dir = run_dir
    torch.manual_seed(100 + rank)
    TrainCheckpoints(cfg, Path(run_dir), rank, world, _Slice(rank, world)).save(1, blocking=True)
    own_bytes = rng_tensor(capture_rng()).numel()  # R: this rank's states (the generators are unchanged)
    expected = torch.rand(3)
    torch.manual_seed(999)
    read: list[tuple[str, int]] = []
    plain = CheckpointReader.read

    def counted(self, name, region=None):
        out = plain(self, name, region)
        if name.startswith(RNG_PREFIX):
            read.append((name, out.numel()))
        return out

    CheckpointReader.read = counted  # type: ignore[method-assign]
    try:
        step = TrainCheckpoints(cfg, Path(run_dir), rank, world, _Slice(rank, world)).restore()
    finally:
        CheckpointReader.read = plain  # type: ignore[method-assign]
    state = Path(run_dir) / "checkpoints" / "step-00000001" / "train_state.json"
    return {
        "step": step,
        "same": torch.equal(torch.rand(3), expected),
        "read": read,
        "own": rng_name(rank),
        "own_bytes": own_bytes,
        "state_bytes": state.stat().st_size,
        "state_has_rng": '"rng"' in state.read_text() or '"torch_cpu"' in state.read_text(),
    }


def test_resume_reads_only_this_ranks_rng(pools, tmp_path):
    """2 ranks save and resume: each restores its own generators exactly, reading one RNG tensor, its
    own (R ≈ 20 KB bytes, not world · R); train_state.json holds no RNG state (it is smaller than one
    rank's R), so what every rank reads whole no longer grows by R per rank."""
    results = pools(2).run(_rng_resume, str(tmp_path))
    for r in results:
        assert r["step"] == 1 and r["same"]
        assert r["read"] == [(r["own"], r["own_bytes"])]
        assert not r["state_has_rng"] and r["state_bytes"] < r["own_bytes"]


# ------------------------------------------------------------------ finding 9 (d): one draw per node
def test_epoch_order_is_drawn_once_per_node_and_equals_the_old_order(monkeypatch, tmp_path):
    """4 data-parallel ranks (4 samplers, as 4 processes of a node would) over 37 windows, 12 steps
    (5 epochs; global batch 16): the order is torch.randperm's per epoch, equal to today's per-rank
    draws, drawn once per epoch for the node (5 draws, not 4 × 5), and each rank maps the file
    (nothing of the permutation in its own memory); a file of the wrong size is drawn again."""
    import numpy as np

    from loom.data import dataset as D

    n, T, gb, dp, steps = 37, 8, 16, 4, 12
    path = tmp_path / "t.bin"
    np.arange(n * T + 1, dtype=np.uint16).tofile(path)
    ds = D.TokenDataset(path, seq_len=T)
    old = [D.BatchSampler(ds, gb, 2, r, dp, seed=7, share_above=n) for r in range(dp)]  # per rank
    want = [[s.indices(k) for k in range(steps)] for s in old]
    draws = []
    plain = D.epoch_permutation

    def counted(*args, **kw):
        draws.append(args[:3])
        return plain(*args, **kw)

    monkeypatch.setattr(D, "epoch_permutation", counted)
    shared = [D.BatchSampler(ds, gb, 2, r, dp, seed=7, share_above=0) for r in range(dp)]
    got = [[s.indices(k) for k in range(steps)] for s in shared]
    assert got == want
    epochs = (steps * gb - 1) // n + 1
    assert sorted(draws) == [(n, 7, e) for e in range(epochs)]
    assert all(isinstance(p, np.memmap) for s in shared for p in s._perms.values())
    (tmp_path / "perm" / "perm-n37-s7-e0.int32").write_bytes(b"\0" * 8)  # torn by hand
    assert D.BatchSampler(ds, gb, 2, 0, dp, seed=7, share_above=0).indices(0) == want[0][0]
    assert len(draws) == epochs + 1


# ------------------------------------------------------------------ finding 9 (e): node-local data
def _ensure_on_two_nodes(run_dir: str, data_dir: str, node_local: bool, fail_on_1: bool) -> dict:
    """Ranks 0 and 1 as local rank 0 of two nodes. ``node_local``: rank 1's node has a copy of its own
    (its meta.json is another file); ``fail_on_1``: preparing there fails."""
    import json
    from pathlib import Path

    import numpy as np
    import torch.distributed as dist

    from loom import config as C
    from loom.data.prepare import PreparedData
    from loom.train import setup

    rank = dist.get_rank()
    calls: list[str] = []

    def fake_prepare(data_cfg, progress=True):
        calls.append(str(data_cfg.prepared_dir))
        if fail_on_1 and rank == 1:
            raise C.ConfigError("data.source: disk full on node 1")
        d = Path(data_dir)
        if not (d / "meta.json").is_file() and rank == 0:
            d.mkdir(parents=True, exist_ok=True)
            np.zeros(9, dtype=np.uint16).tofile(d / "train.bin")
            np.zeros(5, dtype=np.uint16).tofile(d / "val.bin")
            (d / "tokenizer.json").write_text("{}")
            meta = {"vocab_size": 8, "n_train_tokens": 9, "n_val_tokens": 5, "dtype": "uint16", "eot_id": 0}
            (d / "meta.json").write_text(json.dumps(meta))
        return PreparedData.load(d, verify=False)

    plain_prepare, plain_stamp = setup.prepare_data, setup.data_stamp
    setup.prepare_data = fake_prepare
    if node_local and rank == 1:
        setup.data_stamp = lambda d: [0, 0, 0]  # another file than rank 0's: this node's own cache
    cfg = C.LoomConfig()
    cfg.run.dir = run_dir
    try:
        env = setup.RankEnv(rank=rank, world=2, local_rank=0, local_world=1)
        got = str(setup.ensure_data(cfg, env, None).dir)
        return {"calls": calls, "dir": got}
    except C.ConfigError as e:
        return {"calls": calls, "error": str(e)}
    finally:
        setup.prepare_data, setup.data_stamp = plain_prepare, plain_stamp


@pytest.mark.parametrize("node_local", [False, True])
def test_each_node_prepares_its_node_local_cache(pools, tmp_path, node_local):
    """Preparations (or verifications) = 1 (rank 0) + the nodes whose copy is not rank 0's file: on a
    shared file system rank 1 reads nothing more; with a node-local cache its node's local rank 0
    prepares into the same directory, and every rank waits for it."""
    data = tmp_path / "data"
    results = pools(2).run(_ensure_on_two_nodes, str(tmp_path / "run"), str(data), node_local, False)
    assert [len(r["calls"]) for r in results] == [1, 1 if node_local else 0]
    assert results[1]["calls"] == ([str(data)] if node_local else [])
    assert [r["dir"] for r in results] == [str(data)] * 2


def test_a_node_that_cannot_prepare_is_named_on_every_rank(pools, tmp_path):
    results = pools(2).run(_ensure_on_two_nodes, str(tmp_path / "run"), str(tmp_path / "d"), True, True)
    assert results[1]["error"] == "data.source: disk full on node 1"
    assert results[0]["error"].startswith(
        "data.prepared_dir: rank 1 failed to prepare or verify its node's copy"
    )


def test_ranks_failing_on_bad_input_exit_2_as_one_process_does(tmp_path):
    """A damaged checkpoint found by every rank is bad input: exit status 2, as the one-process run
    gives for the same file; any other failure among them keeps 1."""
    from loom.launch import failure_code

    damaged = "loom.checkpoint.format.CheckpointError: runs/x/checkpoints/step-2: model-00000.safetensors is truncated"
    config = "ConfigError: data.source: 'x' does not exist"
    both = {**_failed(tmp_path, 0, damaged).failures, **_failed(tmp_path, 1, config).failures}
    assert failure_code(both) == 2
    mixed = {**_failed(tmp_path, 0, damaged).failures, **_failed(tmp_path, 1, "RuntimeError: boom").failures}
    assert failure_code(mixed) == 1
