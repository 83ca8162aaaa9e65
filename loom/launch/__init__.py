"""Local multi-rank launch through torch's elastic launcher (the machinery behind ``torchrun``).

``loom train --run.nproc N`` validates the config, prepares the data once, then starts N ranks
with a c10d rendezvous bound to loopback. If a rank fails, the agent stops every other rank
and we print one line naming the failed rank(s). Under ``torchrun`` (``WORLD_SIZE`` set) or a
multi-task ``srun`` step (SLURM's variables mapped by :func:`slurm_rank_env`) the launcher is
skipped and this process is one rank, on GPU ``LOCAL_RANK`` of its node.

Network: torch's stores listen on every interface. For a local run Loom hosts them itself on a
socket bound to the loopback address (:func:`host_store`; torch then reuses that server): the
launcher's rendezvous store, and rank 0's store for the process group. gloo binds to ``lo``.
Only a multi-node job (``--nnodes``) listens beyond loopback; c10d has no authentication, so
such a job belongs on a private network.

Multi-node (:class:`Nodes`): ``loom train --nnodes N --node-rank R --rdzv-endpoint HOST:PORT``
on every node starts ``run.nproc`` ranks per node through the same launcher, node 0 hosting the
rendezvous store, with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it restarts after a
failure hang or fail: pytorch/pytorch#135712). Under bare ``torchrun --max-restarts`` without
that variable, rank 0 warns once (:func:`torchrun_restart_warning`).

A stopped rank (SIGSTOP, a frozen node) does not delay the end of the job: the elastic agent asks
its workers to stop with SIGTERM and waits 30 s before SIGKILL, and a stopped process cannot act
on SIGTERM; Loom's launcher kills a worker that is stopped with a termination signal pending at
once (:class:`StoppedWorkerReaper`).

A lost node launcher (SIGKILL, the OOM killer): the kernel tells each of its ranks
(:func:`watch_launcher`, a parent-death signal), which records ``run.dir/heartbeat/node-NNNNN.json``
and stops as on SIGTERM, so every rank saves the same step; the surviving launchers then end with one
line naming the lost node and its host (:func:`lost_node_line`), node 0's as soon as its ranks have
stopped (:class:`LostNodeWatch` where the agent would restart them), the others' when node 0's
rendezvous store goes with node 0's launcher. An orphaned rank that
has not ended ``run.preempt_grace_s`` later kills itself, as its launcher would have.

Preemption and Ctrl-C: SIGTERM or SIGINT reaches the launcher (which forwards it to every rank and
waits ``run.preempt_grace_s`` before SIGKILL) or the ranks themselves; the ranks agree on a step,
save it and exit (:class:`loom.train.trainer.StopRequest`), and the launcher prints one line
(:func:`stop_line`) naming the step saved and exits with 128 + the signal's number.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loom import config as C
from loom.launch.env import (
    _HOSTED,
    _host_rank_store,
    _set_launch_env,
    _shown,
    apply_slurm_env,
    check_launcher_env,
    check_local_address,
    check_slurm_env,
    expand_counts,
    first_host,
    free_port,
    host_store,
    is_loopback,
    slurm_rank_env,
    torchrun_restart_warning,
    under_external_launcher,
)
from loom.launch.failures import (
    INPUT_ERRORS,
    OWN_ERRORS,
    Stopped,
    _clear_stopped,
    _failure_message,
    _fault_note,
    _finish,
    _save_traceback,
    _stop_code,
    failure_code,
    failure_line,
    fault_dump_path,
    stop_line,
    stopped_record,
)
from loom.launch.options import TRAIN_OPTIONS, LaunchOptions, Nodes, launch_config, launch_options
from loom.launch.rank import (
    _fault_dumps_to_file,
    _run_rank,
    _unquiet_ranks,
    _worker,
    leave_now,
    quiet_launcher_store_logs,
)
from loom.launch.watch import (
    LAUNCHER_LOST,
    LostNodeWatch,
    StoppedWorkerReaper,
    _clear_lost,
    lost_marker,
    lost_node_line,
    lost_nodes,
    rendezvous_lost_line,
    stopped_with_kill_pending,
    watch_launcher,
)

__all__ = [
    "apply_slurm_env",
    "check_launcher_env",
    "check_local_address",
    "check_local_gpus",
    "check_slurm_env",
    "_clear_lost",
    "_clear_stopped",
    "expand_counts",
    "failure_code",
    "failure_line",
    "_failure_message",
    "fault_dump_path",
    "_fault_dumps_to_file",
    "_fault_note",
    "_finish",
    "first_host",
    "free_port",
    "_host_rank_store",
    "host_store",
    "_HOSTED",
    "INPUT_ERRORS",
    "is_loopback",
    "launch",
    "launch_config",
    "launch_options",
    "LAUNCHER_LOST",
    "LaunchOptions",
    "leave_now",
    "_lost_line",
    "lost_marker",
    "lost_node_line",
    "lost_nodes",
    "LostNodeWatch",
    "main_train",
    "Nodes",
    "OWN_ERRORS",
    "quiet_launcher_store_logs",
    "relaunch_on_taken_port",
    "rendezvous_lost_line",
    "_run_rank",
    "_save_traceback",
    "_set_launch_env",
    "_shown",
    "slurm_rank_env",
    "_stop_code",
    "stop_line",
    "Stopped",
    "stopped_record",
    "stopped_with_kill_pending",
    "StoppedWorkerReaper",
    "STORE_ATTEMPTS",
    "torchrun_restart_warning",
    "_train_locally",
    "TRAIN_OPTIONS",
    "under_external_launcher",
    "_unquiet_ranks",
    "wait_for_rendezvous",
    "watch_launcher",
    "_worker",
]


def launch(
    cfg: C.LoomConfig, nproc: int, max_restarts: int = 0, nodes: Nodes | None = None
) -> dict[int, Any]:
    """Start ``nproc`` local ranks running the trainer (of ``nodes``' job, if given); returns each
    rank's result.

    Raises ``SystemExit`` with a one-line message naming the failed rank(s).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    started = time.time()
    addr = cfg.run.master_addr if nodes is None else nodes.host
    _set_launch_env(addr)
    _unquiet_ranks()
    port = cfg.run.master_port if nodes is None else nodes.port
    if is_loopback(addr) and (nodes is None or nodes.node_rank == 0):  # the rendezvous store on loopback only
        try:
            port = host_store(addr, port, cfg.run.timeout_s)
        except OSError as e:
            field = "run.master_port" if nodes is None else "--rdzv-endpoint"
            raise C.ConfigError(f"{field}: cannot listen on {addr}:{port}: {e.strerror or e}") from None
    elif nodes is None:
        port = port or free_port("0.0.0.0")
    # the agent logs each failed rank's traceback; Loom reports them in one line (tracebacks to files)
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # "Received N death signal, shutting down workers": the one line of stop_line says it
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    # keep-alive and shutdown warnings of a rendezvous whose store went with node 0: lost_node_line says it
    logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous").setLevel(logging.ERROR)
    reaper = StoppedWorkerReaper()
    watch = LostNodeWatch(Path(cfg.run.dir), nodes.node_rank) if nodes is not None else None
    run_dir = Path(cfg.run.dir)
    agent_dir = tempfile.mkdtemp(prefix="loom-launch-")
    # the launcher's own temp files go there too: torch's spawn gives each rank an error file in the
    # temp dir and leaves it there when the rank fails (the ranks keep the user's temp dir)
    tempfile.tempdir, user_tmp = agent_dir, tempfile.tempdir
    try:
        try:
            lc = launch_config(cfg, nproc, max_restarts, nodes, port, agent_dir)

            def start() -> dict[int, Any]:
                try:
                    return elastic_launch(lc, _worker)(C.to_dict(cfg))
                finally:
                    ignore_late_signals()

            return relaunch_on_taken_port(start, STORE_ATTEMPTS if nodes is None else 1)  # one node: its own
        except ChildFailedError as e:
            if (line := _lost_line(nodes, run_dir)) is not None:  # another node's launcher died
                raise Stopped(line, 1) from None
            if (record := stopped_record(run_dir)) is not None:  # the ranks' exit after a signal
                raise Stopped(stop_line(run_dir), _stop_code(record)) from None
            raise Stopped(failure_line(e.failures, run_dir), failure_code(e.failures)) from None
        except RendezvousError as e:  # node 0's store went with its launcher
            if nodes is None:
                raise
            raise Stopped(rendezvous_lost_line(nodes, e, run_dir), 1) from None
        except (KeyboardInterrupt, SignalException) as e:
            if watch is not None and watch.fired and (line := _lost_line(nodes, run_dir)) is not None:
                raise Stopped(line, 1) from None
            sig = signal.Signals(e.sigval) if isinstance(e, SignalException) else signal.SIGINT
            raise Stopped(stop_line(run_dir, sig, started), 128 + sig) from None
        finally:
            reaper.close()
            if watch is not None:
                watch.close()
    except SignalException:  # the watch's SIGTERM, handled as the launch was ending anyway
        if watch is None or not watch.fired or (line := _lost_line(nodes, run_dir)) is None:
            raise
        raise Stopped(line, 1) from None
    finally:  # the failures' tracebacks are in run_dir/logs by now (failure_line)
        tempfile.tempdir = user_tmp
        shutil.rmtree(agent_dir, ignore_errors=True)


def _lost_line(nodes: Nodes | None, run_dir: Path) -> str | None:
    """:func:`lost_node_line` for the other nodes whose launcher died, or None."""
    if nodes is None:
        return None
    lost = {n: r for n, r in lost_nodes(run_dir).items() if n != nodes.node_rank}
    return lost_node_line(lost, run_dir, nodes.endpoint) if lost else None


STORE_ATTEMPTS = 3  # launches when rank 0's store port (chosen by the agent) was taken meanwhile


LATE_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # those torch's agent handles


def ignore_late_signals() -> None:
    """The agent is done (the ranks ended, its line is decided): a signal from here to the launcher's
    exit is ignored. The agent's handler stays installed and raised its ``SignalException`` from
    wherever the launcher was (its clean-up, a finalizer at exit: a traceback, or exit code 1 after
    the run's own line), and once Python restores the default action during finalization a Ctrl-C
    killed it silently (-2) after a run that had ended well. A launch again (a taken port) installs
    the agent's handler anew."""
    for sig in LATE_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def relaunch_on_taken_port(start, attempts: int = STORE_ATTEMPTS):
    """``start()`` (one elastic launch), again up to ``attempts`` times in all while it fails only
    because rank 0 could not listen on the port the agent chose for its store (``StorePortTaken``:
    the agent's free port was taken before the rank bound it); the agent picks a new port each
    launch. Nothing has run before that point, so a launch again is a clean start."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    for attempt in range(1, attempts + 1):
        try:
            return start()
        except ChildFailedError as e:
            taken = [r for r, f in e.failures.items() if _failure_message(f).startswith("StorePortTaken")]
            if not taken or attempt == attempts:
                raise
            line = _failure_message(e.failures[taken[0]]).partition(": ")[2]
            print(f"loom: {line.split(';')[0]}; starting the ranks again on a new port", file=sys.stderr)
    raise AssertionError("unreachable")


def main_train(cfg: C.LoomConfig, max_restarts: int = 0, nodes: Nodes | None = None) -> int:
    """``loom train``: one rank under an external launcher, else a local elastic launch (this node's
    ranks of a multi-node job with ``nodes``).

    With ``max_restarts`` > 0 the launcher restarts every rank after a failure (up to that many
    times); each restart resumes from the run's latest complete checkpoint.
    """
    from loom.train.run_lock import RunLock

    if under_external_launcher():
        from loom.train.trainer import run

        if (warning := torchrun_restart_warning(dict(os.environ))) is not None:
            print(warning, file=sys.stderr, flush=True)
        from loom.train.health import CollectiveFailure

        _host_rank_store()  # a loopback job under torchrun: rank 0's store on loopback too
        try:
            if int(os.environ["RANK"]) != 0:
                run(cfg, exit_on_signal=True)
                return 0
            with RunLock(cfg.run.dir):  # one owner of run.dir for the whole job
                _clear_stopped(cfg.run.dir)
                try:
                    run(cfg, exit_on_signal=True)
                finally:  # rank 0 says where a signal stopped the job
                    if stopped_record(Path(cfg.run.dir)) is not None:
                        print(stop_line(Path(cfg.run.dir)), file=sys.stderr, flush=True)
            return 0
        except CollectiveFailure as e:  # its one line, then out (the run lock goes with the process)
            print(f"loom: error: {e}", file=sys.stderr)
            leave_now(2)
    world = cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp + C.ps_servers(
        cfg
    )  # validated by the CLI
    check_local_gpus(cfg, cfg.run.nproc if nodes is not None else world)  # before run.dir is touched
    if nodes is None and world > 1:  # a one-node job hosts its store at run.master_addr
        check_local_address(cfg.run.master_addr)
    try:
        if nodes is not None and nodes.node_rank != 0:  # node 0 owns run.dir for the job
            return _train_locally(cfg, max_restarts, nodes)
        with RunLock(cfg.run.dir):  # held by this process while the ranks it starts run
            _clear_stopped(cfg.run.dir)
            _clear_lost(cfg.run.dir)
            return _train_locally(cfg, max_restarts, nodes)
    except Stopped as e:
        print(e.line, file=sys.stderr, flush=True)
        return int(e.code or 1)


def check_local_gpus(cfg: C.LoomConfig, local_ranks: int) -> None:
    """On a CUDA run each local rank takes its own GPU: more local ranks than ``device_count()`` GPUs
    is refused before any rank starts (one line naming run.nproc)."""
    import torch

    from loom.device import cuda_available, cuda_device_count

    if cfg.run.device == "cpu" or (cfg.run.device == "auto" and not cuda_available()):
        return
    if not cuda_available():
        raise C.ConfigError(
            f"run.device: cuda, but this machine has no CUDA device torch {torch.__version__} can use; "
            "give run.device = auto (CUDA where there is one) or cpu"
        )
    n = cuda_device_count()
    if local_ranks > n:
        raise C.ConfigError(
            f"run.nproc: {local_ranks} ranks on this node but torch.cuda.device_count() = {n} "
            f"(one GPU per rank); give --nproc {n} or fewer, or run.device = cpu"
        )


def wait_for_rendezvous(nodes: Nodes, timeout_s: float) -> None:
    """A node other than 0 waits (at most ``run.timeout_s``, torch's store client waits 60 s
    whatever the setting) for node 0's rendezvous store to accept a connection; none is one line."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((nodes.host, nodes.port), timeout=min(5.0, timeout_s)).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise C.ConfigError(
                    f"--rdzv-endpoint: nothing answered at {nodes.endpoint} within run.timeout_s = {timeout_s:g} s "
                    f"({e.strerror or e}); node {nodes.node_rank} of {nodes.nnodes} needs node 0 "
                    "(--node-rank 0) running with the same --rdzv-endpoint"
                ) from None
            time.sleep(0.25)


def _train_locally(cfg: C.LoomConfig, max_restarts: int, nodes: Nodes | None = None) -> int:
    if nodes is not None and nodes.node_rank != 0:
        wait_for_rendezvous(nodes, cfg.run.timeout_s)
    world = cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp + C.ps_servers(cfg)
    from loom.data import prepare_data

    prepared = prepare_data(cfg.data, progress=cfg.run.progress)
    cfg.data.prepared_dir = str(prepared.dir)
    C.check_vocab(cfg, prepared.vocab_size)  # before any rank starts
    if nodes is not None:
        if world != nodes.nnodes * cfg.run.nproc:
            raise C.ConfigError(
                f"run.nproc: {cfg.run.nproc} ranks per node on {nodes.nnodes} nodes, but "
                f"parallel.dp*tp*pp*cp = {world}; --nnodes x --nproc must equal it, or leave "
                "parallel.dp unset"
            )
        launch(cfg, cfg.run.nproc, max_restarts, nodes)
        sys.stdout.flush()
        return _finish(cfg.run.dir) if nodes.node_rank == 0 else 0
    if world == 1 and max_restarts == 0:
        from loom.train.trainer import run

        try:
            run(cfg)
        except KeyboardInterrupt:  # before the trainer's handler was installed
            raise Stopped(stop_line(Path(cfg.run.dir), signal.SIGINT), 128 + signal.SIGINT) from None
        except SystemExit as e:  # the trainer's exit for a signal before training: 128 + its number
            if not isinstance(e.code, int) or e.code - 128 not in (signal.SIGINT, signal.SIGTERM):
                raise
            raise Stopped(stop_line(Path(cfg.run.dir), signal.Signals(e.code - 128)), e.code) from None
        return _finish(cfg.run.dir)
    launch(cfg, world, max_restarts)
    sys.stdout.flush()
    return _finish(cfg.run.dir)
