"""The launcher's environment: loopback stores and ports, an external launcher's (torchrun's, an
``srun`` step's) variables checked and mapped, ``run.master_addr`` of a one-node run."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from datetime import timedelta
from typing import Any

from loom import config as C
from loom.notes import UNDER_LOOM_LAUNCHER
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
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads is not None and not all(is_whole(t) and int(t) >= 1 for t in threads.split(",")):
        raise C.ConfigError(  # libgomp would warn in every process and ignore it
            f"environment: OMP_NUM_THREADS={_shown(threads)} is not a positive whole number (or a comma "
            "list of them); unset it (run.threads sets the threads a rank uses)"
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
    addr = os.environ["MASTER_ADDR"]
    try:  # c10d would retry an unresolvable name until run.timeout_s, then blame rank 0
        socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise C.ConfigError(
            f"environment: MASTER_ADDR={_shown(addr)} does not resolve ({e}); the launcher sets it to rank "
            "0's host"
        ) from None


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
    os.environ[UNDER_LOOM_LAUNCHER] = "1"  # its ranks leave out the warnings it printed (loom.notes)
    # A shared rendezvous TCP store made restarts fail on this machine (pytorch/pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if is_loopback(master_addr):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ["MASTER_ADDR"] = master_addr
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # NCCL: a timed-out collective raises (Loom names the hung rank) instead of killing the process;
    # the elastic agent would otherwise give every worker 1 (loom.train.health.nccl_watchdog_env)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


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
