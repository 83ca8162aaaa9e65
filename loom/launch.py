"""Local multi-rank launch through torch's elastic launcher (the machinery behind ``torchrun``).

``loom train --run.nproc N`` validates the config, prepares the data once, then starts N ranks
with a c10d rendezvous bound to loopback. If a rank fails, the agent stops every other rank
and we print one line naming the failed rank(s). Under ``torchrun`` (``WORLD_SIZE`` set) or a
multi-task ``srun`` step (SLURM's variables mapped by :func:`slurm_rank_env`) the launcher is
skipped and this process is one rank, on GPU ``LOCAL_RANK`` of its node.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

from loom import config as C

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def under_external_launcher() -> bool:
    """True under torchrun, or srun once :func:`apply_slurm_env` ran: this process is already one rank."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def check_launcher_env() -> None:
    """Refuse ``RANK``/``WORLD_SIZE`` without the rendezvous a launcher sets with them (left over in
    a shell, they would make this process wait forever for peers that never come)."""
    if not under_external_launcher():
        return
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise C.ConfigError(
            f"environment: RANK={os.environ['RANK']} and WORLD_SIZE={os.environ['WORLD_SIZE']} are set but "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not, so no launcher started this "
            "process; unset RANK and WORLD_SIZE for a local run, or start it under torchrun or srun"
        )


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
    if "SLURM_PROCID" not in environ or int(environ.get("SLURM_NTASKS", "1")) <= 1:
        return {}
    per_node = expand_counts(environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", ""))
    node = int(environ.get("SLURM_NODEID", "0"))
    nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", "")
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_NTASKS"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(per_node[node] if node < len(per_node) else environ["SLURM_NTASKS"]),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(nodes) or "127.0.0.1",
        "MASTER_PORT": environ.get("MASTER_PORT") or str(29500 + int(environ.get("SLURM_JOB_ID", "0")) % 1000),
    }


def apply_slurm_env() -> None:
    """Under a multi-task ``srun`` step, export :func:`slurm_rank_env` so this process runs as one rank."""
    os.environ.update(slurm_rank_env(dict(os.environ)))


def _worker(cfg_dict: dict[str, Any]) -> dict[str, float] | None:
    """One rank. Exceptions are recorded (``@record``) so the launcher can quote them; None if the
    rank ended with ``sys.exit(0)`` (``record`` turns that into a return)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from loom.train.trainer import run

    return record(_run_rank)(cfg_dict, run)


def _run_rank(cfg_dict: dict[str, Any], run) -> dict[str, float]:
    return run(C.from_dict(cfg_dict))


def _set_launch_env(master_addr: str) -> None:
    # A shared rendezvous TCP store made restarts fail on this machine (pytorch/pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if master_addr in LOOPBACK:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ["MASTER_ADDR"] = master_addr
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # NCCL: a timed-out collective raises (Loom names the hung rank) instead of killing the process;
    # the elastic agent would otherwise give every worker 1 (loom.train.health.nccl_watchdog_env)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


def launch(cfg: C.LoomConfig, nproc: int, max_restarts: int = 0) -> dict[int, Any]:
    """Start ``nproc`` local ranks running the trainer; returns each rank's result.

    Raises ``SystemExit`` with a one-line message naming the failed rank(s).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    addr = cfg.run.master_addr
    _set_launch_env(addr)
    port = cfg.run.master_port or free_port(addr if addr in LOOPBACK else "0.0.0.0")
    lc = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"loom-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"{addr}:{port}",
        rdzv_configs={"timeout": int(cfg.run.timeout_s)},
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr=addr,
    )
    # the agent logs each failed rank's traceback; Loom reports them in one line (tracebacks to files)
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        return elastic_launch(lc, _worker)(C.to_dict(cfg))
    except ChildFailedError as e:
        raise SystemExit(failure_line(e.failures, Path(cfg.run.dir))) from None
    except (KeyboardInterrupt, SignalException) as e:
        sig = signal.Signals(e.sigval).name if isinstance(e, SignalException) else "SIGINT"
        raise SystemExit(f"loom: interrupted by {sig}; all ranks stopped") from None


# Loom's own errors: their message already names the field or file, so no class name or traceback
OWN_ERRORS = ("ConfigError", "CheckpointError", "HFError", "NonFiniteError", "LossScaleDiverged", "PipelineError",
              "StrictCommError", "HardwareError", "PlanError")  # fmt: skip


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
            groups.setdefault(f"rank {rank} (local {failure.local_rank}, pid {failure.pid}) failed with exit code "
                              f"{failure.exitcode}: {text}", []).append("" if path is None else f"traceback in {path}")  # fmt: skip
    parts = [f"{msg} ({'; '.join(w for w in wheres if w)})" if any(wheres) else msg for msg, wheres in groups.items()]
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
    text = text.strip().splitlines()[-1] if text.strip() else (failure.message or "see the rank's output above")
    if failure.signal_name() not in ("", "<N/A>", None) and failure.exitcode < 0:
        text = f"killed by {failure.signal_name()}"
    return text


def main_train(cfg: C.LoomConfig, max_restarts: int = 0) -> int:
    """``loom train``: one rank under an external launcher, else a local elastic launch.

    With ``max_restarts`` > 0 the launcher restarts every rank after a failure (up to that many
    times); each restart resumes from the run's latest complete checkpoint.
    """
    from loom.train.run_lock import RunLock

    if under_external_launcher():
        from loom.train.trainer import run

        if int(os.environ["RANK"]) == 0:  # one owner of run.dir for the whole job
            with RunLock(cfg.run.dir):
                run(cfg)
        else:
            run(cfg)
        return 0
    with RunLock(cfg.run.dir):  # held by this process while the ranks it starts run
        return _train_locally(cfg, max_restarts)


def _train_locally(cfg: C.LoomConfig, max_restarts: int) -> int:
    world = cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp  # validated by the CLI
    from loom.data import prepare_data

    prepared = prepare_data(cfg.data, progress=cfg.run.progress)
    cfg.data.prepared_dir = str(prepared.dir)
    C.check_vocab(cfg, prepared.vocab_size)  # before any rank starts
    if world == 1 and max_restarts == 0:
        from loom.train.trainer import run

        run(cfg)
        return 0
    launch(cfg, world, max_restarts)
    sys.stdout.flush()
    return 0
