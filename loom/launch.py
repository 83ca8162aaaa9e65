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

import contextlib
import gc
import ipaddress
import json
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

from loom import config as C
from loom.numbers import is_whole


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


_HOSTED: list[Any] = []  # store servers this process hosts, alive as long as the process


def host_store(addr: str, port: int = 0, timeout_s: float = 300.0) -> int:
    """Host a c10d TCPStore server listening on ``addr:port`` only (``port`` 0: a free one) for the
    life of this process; returns the port. torch keeps one server per port and process for
    multi-tenant stores, so the stores torch itself opens later on that port (the elastic
    rendezvous, ``init_process_group``'s rank-0 store) reuse this one instead of listening on every
    interface."""
    import torch.distributed as dist

    family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(512)
        port = sock.getsockname()[1]
        store = dist.TCPStore(
            addr,
            port,
            None,
            True,
            timedelta(seconds=timeout_s),
            wait_for_workers=False,
            multi_tenant=True,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    _HOSTED.append((store, sock))  # the socket object must outlive the server that listens on its fd
    return port


def _host_rank_store() -> None:
    """In global rank 0 of a loopback job whose ranks host their own store (not the agent's):
    open that store on loopback before ``init_process_group`` does it on every interface."""
    env = os.environ
    if env.get("RANK") != "0" or env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    if not is_loopback(env.get("MASTER_ADDR", "")) or not is_whole(env.get("MASTER_PORT", "")):
        return
    with contextlib.suppress(OSError, RuntimeError):  # taken: init_process_group reports it as usual
        host_store(env["MASTER_ADDR"], int(env["MASTER_PORT"]))


def under_external_launcher() -> bool:
    """True under torchrun, or srun once :func:`apply_slurm_env` ran: this process is already one rank."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _shown(value: str) -> str:
    """An environment value for a one-line message: as it is, or quoted and escaped when it is empty
    or holds spaces, newlines or other unprintable characters."""
    return value if value and value.isprintable() and not any(c.isspace() for c in value) else repr(value)


def check_launcher_env() -> None:
    """Refuse ``RANK``/``WORLD_SIZE`` without the rendezvous a launcher sets with them (left over in
    a shell, they would make this process wait forever for peers that never come), and any of the
    rank variables set to something not a whole number (a one-rank run reads them too)."""
    paired = under_external_launcher()  # RANK and WORLD_SIZE together: checked as a pair below
    from loom.comm import check_strict_env

    try:
        check_strict_env()
    except ValueError as e:
        raise C.ConfigError(str(e)) from None
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", *(() if paired else ("RANK", "WORLD_SIZE"))):
        value = os.environ.get(name)
        if value is not None and not is_whole(value):
            raise C.ConfigError(
                f"environment: {name}={_shown(value)} is not a whole number >= 0 (a launcher sets it; "
                f"unset {name} for a local run)"
            )
    if is_whole(lws := os.environ.get("LOCAL_WORLD_SIZE", "")) and int(lws) == 0:
        raise C.ConfigError(
            "environment: LOCAL_WORLD_SIZE=0 counts no rank on this node (a launcher sets it >= 1; unset it "
            "for a local run)"
        )
    if not paired:
        return
    rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
    if not (is_whole(rank) and is_whole(world) and int(rank) < int(world)):
        raise C.ConfigError(
            f"environment: RANK={_shown(rank)} WORLD_SIZE={_shown(world)} describe no rank of a job (need 0 <= RANK < "
            "WORLD_SIZE); left over from another job? unset RANK and WORLD_SIZE for a local run"
        )
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise C.ConfigError(
            f"environment: RANK={_shown(os.environ['RANK'])} and WORLD_SIZE={_shown(os.environ['WORLD_SIZE'])} are set but "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not, so no launcher started this "
            "process; unset RANK and WORLD_SIZE for a local run, or start it under torchrun or srun"
        )
    port = os.environ["MASTER_PORT"]
    if not (is_whole(port) and 1 <= int(port) <= 65535):
        raise C.ConfigError(f"environment: MASTER_PORT={port!r} is not a port in [1, 65535]")


def expand_counts(spec: str) -> list[int]:
    """SLURM's tasks-per-node string -> one count per node: ``"4(x2),3"`` -> ``[4, 4, 3]``."""
    out: list[int] = []
    for part in filter(None, spec.split(",")):
        count, _, times = part.partition("(x")
        out += [int(count)] * (int(times.rstrip(")")) if times else 1)
    return out


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[07-09,12],login1"`` -> ``"gpu07"``."""
    head, depth = "", 0
    for ch in nodelist:  # the first top-level comma ends the first entry
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            break
        head += ch
    if "[" not in head:
        return head
    prefix, rest = head.split("[", 1)
    ranges, suffix = rest.split("]", 1)
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def slurm_rank_env(environ: dict[str, str]) -> dict[str, str]:
    """torchrun's variables for one task of a multi-task ``srun`` step (one task per GPU, no
    torchrun): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE from SLURM_PROCID, SLURM_NTASKS,
    SLURM_LOCALID and this node's entry of SLURM_STEP_TASKS_PER_NODE; MASTER_ADDR the step's first
    node, MASTER_PORT 29500 + job id mod 1000 (unless set). Empty when torchrun's variables are set
    or there is no multi-task step."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return {}
    if "SLURM_PROCID" not in environ or _slurm_int(environ, "SLURM_NTASKS", "1") <= 1:
        return {}
    check_slurm_env(environ)
    spec_name = (
        "SLURM_STEP_TASKS_PER_NODE" if environ.get("SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
    )
    try:
        per_node = expand_counts(environ.get(spec_name, ""))
    except ValueError:
        raise C.ConfigError(
            f"environment: {spec_name}={environ.get(spec_name)!r} is not SLURM's tasks-per-node list "
            "(e.g. '4(x2),3'); unset the SLURM_* variables for a local run"
        ) from None
    node = _slurm_int(environ, "SLURM_NODEID", "0")
    _slurm_int(environ, "SLURM_LOCALID", "0")
    _slurm_int(environ, "SLURM_JOB_ID", "0")
    nodes = (
        environ.get("SLURM_STEP_NODELIST")
        or environ.get("SLURM_JOB_NODELIST")
        or environ.get("SLURM_NODELIST", "")
    )
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_NTASKS"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(per_node[node] if node < len(per_node) else environ["SLURM_NTASKS"]),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(nodes) or "127.0.0.1",
        "MASTER_PORT": environ.get("MASTER_PORT")
        or str(29500 + int(environ.get("SLURM_JOB_ID", "0")) % 1000),
    }


def _slurm_int(environ: dict[str, str], name: str, default: str) -> int:
    """A SLURM count or id (a whole number >= 0), else one line naming the variable."""
    value = environ.get(name, default)
    if not is_whole(value):
        raise C.ConfigError(
            f"environment: {name}={value!r} is not a task count or id (a whole number >= 0); unset the "
            "SLURM_* variables for a local run"
        )
    return int(value)


def apply_slurm_env() -> None:
    """Under a multi-task ``srun`` step, export :func:`slurm_rank_env` so this process runs as one rank
    (:func:`check_slurm_env` first: variables of no live step are refused)."""
    os.environ.update(slurm_rank_env(dict(os.environ)))


def check_slurm_env(environ: dict[str, str]) -> None:
    """Refuse SLURM task variables that describe no live job step (left in a shell, or copied from a
    batch script): a step sets its job id and node list with them, and a task id below the task count."""
    procid, ntasks = environ.get("SLURM_PROCID", ""), environ.get("SLURM_NTASKS", "")
    where = f"SLURM_PROCID={_shown(procid)} SLURM_NTASKS={_shown(ntasks)}"
    if not (is_whole(procid) and is_whole(ntasks) and int(procid) < int(ntasks)):
        raise C.ConfigError(
            f"environment: {where} describe no task of a job step (need 0 <= SLURM_PROCID < SLURM_NTASKS)"
        )
    nodes = (
        environ.get("SLURM_STEP_NODELIST")
        or environ.get("SLURM_JOB_NODELIST")
        or environ.get("SLURM_NODELIST")
    )
    missing = [
        k for k, v in (("SLURM_JOB_ID", environ.get("SLURM_JOB_ID")), ("SLURM_*NODELIST", nodes)) if not v
    ]
    if missing:
        raise C.ConfigError(
            f"environment: {where} are set but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
            "not, so no srun step started this process; unset the SLURM_* variables for a local run"
        )


def _worker(cfg_dict: dict[str, Any]) -> dict[str, float] | None:
    """One rank. Exceptions are recorded (``@record``) so the launcher can quote them; None if the
    rank ended with ``sys.exit(0)`` (``record`` turns that into a return)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from loom.train.trainer import run

    _host_rank_store()
    run_cfg = cfg_dict["run"]
    watch_launcher(Path(run_cfg["dir"]), float(run_cfg["preempt_grace_s"]))
    try:
        return record(_run_rank)(cfg_dict, run)
    finally:  # the rank's exit collects no garbage across its whole heap (loom.cli.run)
        gc.freeze()


def _run_rank(cfg_dict: dict[str, Any], run) -> dict[str, float]:
    """A rank of Loom's launcher: a failure is the launcher's one line, unless it restarts instead
    (then the rank's own line says why it restarted)."""
    from tqdm import tqdm

    # only rank 0 draws bars: a thread lock, not tqdm's default named semaphore, which a killed rank
    # leaks (the launcher's resource tracker then prints a two-line warning after its one line)
    tqdm.set_lock(threading.RLock())
    _fault_dumps_to_file(Path(cfg_dict["run"]["dir"]))
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    from loom.train.health import CollectiveFailure
    from loom.train.trainer import StopRequest

    try:
        result = run(
            C.from_dict(cfg_dict), exit_on_signal=True, report_comm_failure=restarts not in ("", "0")
        )
        # the rank's work is done: it only waits for the agent to read its result, and a signal (the
        # agent's own SIGTERM as it shuts down) ends it at once, not as a KeyboardInterrupt there
        for sig in StopRequest.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        return result
    except CollectiveFailure as e:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        if e.after_peer:  # the launcher names that peer's error or exit, and stops this rank on seeing it:
            # its SIGTERM ends the wait at once (a sleep resumes after a handler that returns, and the
            # launcher then waits its 30 s grace before SIGKILL)
            signal.signal(signal.SIGTERM, lambda *_: leave_now(1))
            time.sleep(float(cfg_dict["run"]["timeout_s"]))
        get_error_handler().record_exception(e)  # what @record would write: the launcher's one line
        leave_now(1)


_FAULT_FILE: list[Any] = []  # the open file the fault handler writes to (kept for the process's life)


def fault_dump_path(run_dir: Path, rank: int) -> Path:
    """Where a rank's Python stacks go when it dies of a signal (SIGSEGV, SIGBUS, SIGFPE, SIGABRT)."""
    return run_dir / "logs" / f"rank-{rank}-fault.txt"


def _fault_dumps_to_file(run_dir: Path) -> None:
    """Point the fault handler (``@record`` enables it on stderr, every thread) at this rank's
    :func:`fault_dump_path`: a rank killed by a signal then leaves the launcher's one line on the
    terminal, not ~70 lines of every thread's stack; stderr stays the fallback if the file cannot be made."""
    import faulthandler

    try:
        path = fault_dump_path(run_dir, int(os.environ.get("RANK", "0")))
        path.parent.mkdir(parents=True, exist_ok=True)
        f = path.open("w")
    except OSError:
        return
    _FAULT_FILE[:] = [f]
    faulthandler.enable(file=f, all_threads=True)


def leave_now(code: int) -> NoReturn:
    """End this rank at once after a failed collective (its line already recorded or printed): a gloo
    group whose operation still waits on the lost peer (the rank's wait was bounded by run.timeout_s,
    the operation only by the group's own timeout, a day for the control group) makes a normal exit
    hang in the group's destructor, which joins that operation's thread (measured: 1 run in 6 of the
    stopped-rank test, the launcher waiting for a rank that never ended)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_CPP_LOG = "TORCH_CPP_LOG_LEVEL"
_QUIETED: list[bool] = []  # this launcher set _CPP_LOG (the ranks get it unset again)


def quiet_launcher_store_logs(nodes: Nodes | None) -> None:
    """A multi-node launcher, before torch is imported: c10d logs every failed call of the elastic agent
    to a rendezvous store that went with node 0's launcher as a warning with its C++ frames (~40 lines
    each), before Loom's one line (:func:`rendezvous_lost_line`); the launcher's C++ log level (read once,
    at import) is set to ERROR, unless the user set one. Its ranks keep the user's setting."""
    if nodes is None or under_external_launcher() or "torch" in sys.modules or _CPP_LOG in os.environ:
        return
    os.environ[_CPP_LOG] = "ERROR"
    _QUIETED.append(True)


def _unquiet_ranks() -> None:
    if _QUIETED:
        import torch  # noqa: F401  (the level is read at import: the launcher keeps ERROR)

        os.environ.pop(_CPP_LOG, None)
        _QUIETED.clear()


def check_local_address(addr: str) -> None:
    """``run.master_addr`` of a one-node run: an address of this machine, where the ranks' store is
    hosted; a name that does not resolve, or another machine's address (the ranks would wait out
    ``run.timeout_s`` for a store nobody hosts), is refused in one line."""
    import socket

    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise C.ConfigError(f"run.master_addr: {addr!r} does not resolve ({e}); use 127.0.0.1") from None
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((sockaddr[0], 0))
                return
            except OSError:
                continue
    raise C.ConfigError(
        f"run.master_addr: {addr!r} is not an address of this machine; a one-node run hosts its ranks' store "
        "here (127.0.0.1, or this host's name); for several machines give --nnodes and --rdzv-endpoint"
    )


def _set_launch_env(master_addr: str) -> None:
    # A shared rendezvous TCP store made restarts fail on this machine (pytorch/pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if is_loopback(master_addr):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ["MASTER_ADDR"] = master_addr
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # NCCL: a timed-out collective raises (Loom names the hung rank) instead of killing the process;
    # the elastic agent would otherwise give every worker 1 (loom.train.health.nccl_watchdog_env)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


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


def torchrun_restart_warning(environ: dict[str, str]) -> str | None:
    """The one line rank 0 prints when bare ``torchrun --max-restarts K`` (K > 0) started it without
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: such restarts hang or fail (pytorch/pytorch#135712)."""
    restarts = environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if (
        not is_whole(restarts)
        or int(restarts) == 0
        or environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1"
    ):
        return None
    if environ.get("RANK") != "0" or environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    return (
        f"loom: warning: torchrun --max-restarts {restarts} without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
        "in its environment: restarts after a failure usually hang; export it before torchrun, or run "
        "loom train --nnodes N --node-rank R --rdzv-endpoint HOST:PORT on each node"
    )


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


_KILL_PENDING = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}


def stopped_with_kill_pending(pid: int) -> bool:
    """``pid`` is stopped (SIGSTOP, SIGTSTP) while a signal that would end it waits for a SIGCONT."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    except (OSError, ValueError):
        return False
    if not fields.get("State", "").strip().startswith("T"):
        return False
    pending = int(fields.get("ShdPnd", "0"), 16) | int(fields.get("SigPnd", "0"), 16)
    return any(pending >> (int(sig) - 1) & 1 for sig in _KILL_PENDING)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


class StoppedWorkerReaper:
    """A thread of the launcher: a worker the agent asked to stop but that is stopped (its SIGTERM
    waits for a SIGCONT) is killed at once, instead of after the agent's 30 s grace."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.killed: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loom-reaper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.wait(self.interval):
            for pid in _children(me):
                if stopped_with_kill_pending(pid):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                        self.killed.append(pid)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2 * self.interval + 1)


LAUNCHER_LOST = signal.SIGUSR2
"""The parent-death signal of a rank under Loom's launcher (torch's own, SIGINT, reads as a Ctrl-C)."""
_PR_SET_PDEATHSIG = 1  # prctl(2)


def lost_marker(run_dir: Path, node: int) -> Path:
    """``run.dir/heartbeat/node-NNNNN.json``: written by the ranks of a node whose launcher died."""
    return Path(run_dir) / "heartbeat" / f"node-{node:05d}.json"


def watch_launcher(run_dir: Path, grace_s: float) -> bool:
    """In a rank started by Loom's launcher, on Linux: when the launcher dies, the kernel sends this
    rank :data:`LAUNCHER_LOST` (``prctl(PR_SET_PDEATHSIG)``); the rank writes :func:`lost_marker` (its
    node, host and the launcher's pid), raises SIGTERM on itself (the trainer's agreed stop: every rank
    saves the same step and ends) and kills itself if it still runs ``grace_s`` later, as the launcher
    would have. True if the watch is installed."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return False
    import ctypes

    launcher = os.getppid()
    node = int(os.environ.get("GROUP_RANK", "0") or 0)  # the elastic agent's node rank
    fired: list[int] = []

    def lost(signum: int, frame: Any) -> None:
        if fired or os.getppid() == launcher:  # once; a stray signal while the launcher lives is ignored
            return
        fired.append(signum)
        record = {
            "node": node,
            "host": socket.gethostname(),
            "launcher_pid": launcher,
            "rank": int(os.environ.get("RANK", "-1")),
            "time": time.time(),
        }
        with contextlib.suppress(OSError):
            _write_json(lost_marker(run_dir, node), record)
        end = threading.Timer(grace_s, os.kill, (os.getpid(), signal.SIGKILL))
        end.daemon = True
        end.start()
        signal.raise_signal(signal.SIGTERM)

    signal.signal(LAUNCHER_LOST, lost)
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(LAUNCHER_LOST), 0, 0, 0) != 0:
        signal.signal(LAUNCHER_LOST, signal.SIG_DFL)
        return False
    lost(LAUNCHER_LOST, None)  # the launcher died before the watch was set: act now
    return True


class LostNodeWatch:
    """A thread of a multi-node launcher: once one of its ranks has ended while another node's ranks
    left a :func:`lost_marker`, the launcher stops itself with SIGTERM ``settle_s`` later, unless the
    launch ended meanwhile. Without it the elastic agent would restart its ranks under
    ``--max-restarts`` and wait at the rendezvous for the lost node (measured: > 20 s with
    ``run.timeout_s = 5``), or wait at its exit barrier (300 s); :func:`launch` then names the node."""

    def __init__(self, run_dir: Path, node: int, interval: float = 0.2, settle_s: float = 0.5) -> None:
        self.run_dir, self.node = Path(run_dir), node
        self.interval, self.settle_s = interval, settle_s
        self.fired = False
        self._closed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loom-lost-node", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me, seen = os.getpid(), set(_children(os.getpid()))
        since: float | None = None
        while not self._stop.wait(self.interval):
            now = set(_children(me))
            if since is None and seen - now and any(n != self.node for n in lost_nodes(self.run_dir)):
                since = time.monotonic()  # a rank ended and a node is lost (one look per ended rank)
            seen = now
            if since is not None and time.monotonic() - since >= self.settle_s:
                with self._lock:
                    if not self._closed:
                        self.fired = True
                        os.kill(me, signal.SIGTERM)
                return

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._stop.set()
        self._thread.join(2 * self.interval + 1)


def _write_json(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # several ranks of a node write the same file
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def lost_nodes(run_dir: Path) -> dict[int, dict]:
    """The nodes whose launcher died during this job (their ranks' :func:`lost_marker` files)."""
    out: dict[int, dict] = {}
    for path in sorted((Path(run_dir) / "heartbeat").glob("node-*.json")):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text())
            if isinstance(record, dict) and isinstance(record.get("node"), int):
                out[record["node"]] = record
    return out


def _clear_lost(run_dir: str) -> None:
    for path in (Path(run_dir) / "heartbeat").glob("node-*.json"):
        with contextlib.suppress(OSError):
            path.unlink()


def lost_node_line(lost: dict[int, dict], run_dir: Path, rendezvous: str | None = None) -> str:
    """The one line of a surviving node: each lost node with its host and launcher pid (and the
    rendezvous store that went with node 0's launcher), then the step every rank saved, or none."""
    heads = [
        f"node {node} (host {r.get('host', '?')}) stopped answering: its launcher (pid "
        f"{r.get('launcher_pid', '?')}) is gone"
        + (f", and with it the rendezvous store at {rendezvous}" if node == 0 and rendezvous else "")
        for node, r in sorted(lost.items())
    ]
    return f"loom: {'; '.join(heads)}; {_saved(run_dir)}"


def _saved(run_dir: Path) -> str:
    record = stopped_record(run_dir)
    if record is None:
        return "the ranks stopped before a step could be saved"
    return (
        f"every rank stopped after step {record['step']}: checkpoint {record.get('checkpoint')} saved; start "
        "the lost launcher again and run the same command on every node to resume"
    )


def rendezvous_lost_line(nodes: Nodes, exc: BaseException, run_dir: Path) -> str:
    """One line for a rendezvous that failed under a running job: the lost node when its ranks left
    a :func:`lost_marker`, else node 0 (whose launcher hosts the store) for the other nodes."""
    lost = {n: r for n, r in lost_nodes(run_dir).items() if n != nodes.node_rank}
    if lost:
        return lost_node_line(lost, run_dir, nodes.endpoint)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    head = (
        f"node 0 (rendezvous {nodes.endpoint}) stopped answering: {type(exc).__name__}, its launcher "
        "or its host is gone"
        if nodes.node_rank != 0
        else f"the rendezvous at {nodes.endpoint} failed: {type(exc).__name__}: {text}"
    )
    return f"loom: {head}; {_saved(run_dir)}"


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
            start = lambda: elastic_launch(lc, _worker)(C.to_dict(cfg))  # noqa: E731
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


class Stopped(SystemExit):
    """The end of a run stopped by SIGTERM/SIGINT: :attr:`line` for stderr, exit code 128 + signal."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(code)
        self.line = line


def stopped_record(run_dir: Path) -> dict | None:
    """What the ranks saved when a signal stopped them (``run.dir/stopped.json``), or None."""
    from loom.train.trainer import STOPPED

    try:
        record = json.loads((Path(run_dir) / STOPPED).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def stop_line(run_dir: Path, sig: signal.Signals | None = None, since: float | None = None) -> str:
    """The one line of a run stopped by a signal: the step its ranks saved, that the run had ended
    (the ranks recorded the signal as ``final``, or a final model was written after ``since``, the
    launch's start: the signal came as the ranks were leaving), or that none was saved."""
    record = stopped_record(run_dir)
    name = sig.name if sig is not None else str((record or {}).get("signal", "a signal"))
    final = run_dir / "checkpoints" / "final" / "meta.json"
    written = since is not None and final.is_file() and final.stat().st_mtime >= since
    if (record is None and written) or (record is not None and record.get("final") is True):
        return (
            f"loom: interrupted by {name} as the run ended: its final model was saved "
            f"({final.parent}); nothing to resume"
        )
    if record is None:
        return f"loom: interrupted by {name} before a step could be saved; all ranks stopped"
    return (
        f"loom: stopped by {record.get('signal', 'a signal')} after step {record['step']}: checkpoint "
        f"{record.get('checkpoint')} saved; run the same command to resume"
    )


def _clear_stopped(run_dir: str) -> None:
    from loom.train.trainer import STOPPED

    with contextlib.suppress(OSError):
        (Path(run_dir) / STOPPED).unlink()


def _finish(run_dir: str) -> int:
    """After the ranks returned: 0, or the line and 128 + signal when a signal stopped them."""
    record = stopped_record(Path(run_dir))
    if record is None:
        return 0
    sys.stdout.flush()
    print(stop_line(Path(run_dir)), file=sys.stderr, flush=True)
    return _stop_code(record)


def _stop_code(record: dict) -> int:
    return 128 + int(getattr(signal, str(record.get("signal")), signal.SIGTERM))


# Loom's own errors: their message already names the field or file, so no class name or traceback
OWN_ERRORS = (
    "ConfigError",
    "CheckpointError",
    "HFError",
    "NonFiniteError",
    "CollectiveFailure",
    "LossScaleDiverged",
    "PipelineError",
    "StrictCommError",
    "HardwareError",
    "PlanError",
    "StorePortTaken",
)


# Loom's errors that mean bad input (a field, a file): exit status 2, as the one-process run gives
INPUT_ERRORS = ("ConfigError", "CheckpointError", "HFError", "HardwareError", "PlanError")


def failure_code(failures: dict) -> int:
    """The launcher's exit status for the failed ranks: 2 when each failed on bad input (every rank's
    error one of :data:`INPUT_ERRORS`, as a damaged checkpoint found by the ranks), else 1."""
    names = [_failure_message(f).partition(": ")[0].rsplit(".", 1)[-1] for f in failures.values()]
    return 2 if names and all(name in INPUT_ERRORS for name in names) else 1


def failure_line(failures: dict, run_dir: Path) -> str:
    """One line for the failed ranks: Loom's errors as ``loom: <message> (rank r; traceback in F)``
    (ranks with the same message together), anything else with its rank, exit code and class. Each
    rank's traceback goes to ``<run_dir>/logs/rank-<r>-failure.txt``."""
    groups: dict[str, list[str]] = {}
    for rank, failure in sorted(failures.items()):
        text = _failure_message(failure)
        path = _save_traceback(failure, run_dir, rank)
        where = f"rank {rank}" if path is None else f"rank {rank}; traceback in {path}"
        name, _, rest = text.partition(": ")
        if name.rsplit(".", 1)[-1] in OWN_ERRORS and rest:
            groups.setdefault(rest, []).append(where)
        else:
            groups.setdefault(
                f"rank {rank} (local {failure.local_rank}, pid {failure.pid}) failed with exit code "
                f"{failure.exitcode}: {text}{_fault_note(run_dir, rank) if failure.exitcode < 0 else ''}",
                [],
            ).append("" if path is None else f"traceback in {path}")
    parts = [
        f"{msg} ({'; '.join(w for w in wheres if w)})" if any(wheres) else msg
        for msg, wheres in groups.items()
    ]
    return "loom: " + " | ".join(parts)


def _save_traceback(failure, run_dir: Path, rank: int) -> Path | None:
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    msg = data.get("message", {})
    stack = msg.get("extraInfo", {}).get("py_callstack", "") if isinstance(msg, dict) else ""
    if not stack:
        return None
    try:
        path = Path(run_dir) / "logs" / f"rank-{rank}-failure.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(stack)
        return path
    except OSError:
        return None


def _failure_message(failure) -> str:
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    msg = data.get("message", {})
    if isinstance(msg, dict):
        text = msg.get("message", "")
    else:
        text = str(msg)
    text = (
        text.strip().splitlines()[-1] if text.strip() else (failure.message or "see the rank's output above")
    )
    if failure.signal_name() not in ("", "<N/A>", None) and failure.exitcode < 0:
        text = f"killed by {failure.signal_name()}"
    return text


def _fault_note(run_dir: Path, rank: int) -> str:
    """``; stacks in PATH`` when the rank's fault handler wrote its threads' stacks there."""
    path = fault_dump_path(run_dir, rank)
    try:
        return f"; its stacks: {path}" if path.stat().st_size > 0 else ""
    except OSError:
        return ""


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
