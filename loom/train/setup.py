"""What every rank does before it trains: its device and process group, the control group, the
prepared and verified data (the same verdict on every rank), the model before parallelization.

Shared by the trainer (:mod:`loom.train.trainer`) and the dedicated parameter-server ranks
(:mod:`loom.train.ps_run`), which join the trainer's world-wide collectives in its order.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from loom import config as C
from loom.checkpoint.format import DATA_IDENTITY
from loom.data import PreparedData, prepare_data
from loom.device import default_threads, resolve_backend, resolve_device
from loom.mesh import world_gloo_group
from loom.model.llama import build_model
from loom.parallel.materialize import Source
from loom.train.health import apply_nccl_watchdog_env

log = logging.getLogger("loom")


@dataclass
class RankEnv:
    rank: int
    world: int
    local_rank: int
    local_world: int

    @classmethod
    def from_environ(cls) -> RankEnv:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            world=world,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            local_world=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
        )


def init_process_group(cfg: C.LoomConfig, env: RankEnv) -> torch.device:
    """Device, threads, and (for world > 1) the default process group with a timeout."""
    device = resolve_device(cfg.run.device, env.local_rank)
    torch.set_num_threads(cfg.run.threads or default_threads(env.local_world))
    if env.world > 1 and not dist.is_initialized():
        backend = resolve_backend(cfg.run.backend, device)
        if "nccl" in backend:  # before the process group exists: its watchdog reads these
            apply_nccl_watchdog_env(cfg.run.timeout_s, Path(cfg.run.dir), env.rank)
        try:
            dist.init_process_group(
                backend=backend,
                timeout=timedelta(seconds=cfg.run.timeout_s),
                device_id=device if device.type == "cuda" else None,
            )
        except Exception as e:
            if env.rank == 0 and address_in_use(e):
                raise StorePortTaken(store_port_line(os.environ)) from None
            raise
    return device


class StorePortTaken(C.ConfigError):
    """Rank 0 could not listen on ``MASTER_ADDR:MASTER_PORT`` for the process group's store."""


def address_in_use(exc: BaseException) -> bool:
    """The store's server socket could not bind: the port is taken (EADDRINUSE, errno 98)."""
    text = str(exc)
    return "EADDRINUSE" in text or "ddress already in use" in text or getattr(exc, "errno", None) == 98


def store_port_line(environ) -> str:
    """The one line of :class:`StorePortTaken`: the port, and why (not "rank 1 unresponsive")."""
    where = f"{environ.get('MASTER_ADDR', '?')}:{environ.get('MASTER_PORT', '?')}"
    return (
        f"MASTER_PORT: rank 0 cannot listen on {where} for the process group's store: address already in "
        "use (another process took the port after the launcher chose it); start again, or give a free "
        "port (torchrun --master-port, MASTER_PORT under srun)"
    )


CONTROL_TIMEOUT_S = 24 * 3600  # single-rank phases (data preparation, export) may take hours


def control_group(env: RankEnv):
    """A gloo group over every rank with a long timeout, for waiting while one rank works: NCCL's
    watchdog polices only NCCL groups, so a long wait here does not kill anyone (None alone)."""
    if env.world == 1 or not dist.is_initialized():
        return None
    return world_gloo_group(timedelta(seconds=CONTROL_TIMEOUT_S))


def ensure_data(cfg: C.LoomConfig, env: RankEnv, control=None) -> PreparedData:
    """Prepared tokens, verified (:meth:`PreparedData.load`): rank 0 prepares or checks them while the
    others wait on ``control``; its verdict reaches every rank, so a refusal is the same one line on
    all of them (none waits for a rank that has given up).

    A node-local cache (``torchrun``/``srun`` over nodes without a shared ``data.prepared_dir``): on
    a node whose copy of rank 0's ``meta.json`` is missing or is another file (inode, mtime, size:
    :func:`data_stamp`), local rank 0 prepares or verifies that node's copy in the same directory,
    and one all-reduce over ``control`` waits for every node (a failure there is one line naming
    its rank on every rank). On a shared file system nothing more is read than before."""
    from loom.checkpoint.save import broadcast_json

    check_data_record(Path(cfg.run.dir))
    error = ""
    failure: Exception | None = None
    prepared: PreparedData | None = None
    if env.rank == 0:
        try:
            prepared = prepare_data(cfg.data, progress=cfg.run.progress)
        except Exception as e:
            if env.world == 1:
                raise
            failure = e
            error = (
                str(e)
                if isinstance(e, C.ConfigError)
                else f"data.source: rank 0 failed to prepare it ({e!r})"
            )
    if env.world > 1:
        verdict = broadcast_json(
            {
                "error": error,
                "dir": str(prepared.dir) if prepared else "",
                "stamp": data_stamp(Path(prepared.dir)) if prepared else None,
            },
            env.rank,
            env.world,
            control,
        )
        assert isinstance(verdict, dict)
        if failure is not None:
            raise failure
        if verdict["error"]:
            raise C.ConfigError(verdict["error"])
        prepare_node_copy(cfg, env, verdict, control)
        if env.rank != 0:  # rank 0 (or this node's local rank 0) checked the files; read them
            prepared = PreparedData.load(verdict["dir"], verify=False)
    assert prepared is not None
    return prepared


def data_stamp(prepared_dir: Path) -> list[int] | None:
    """(inode, mtime in s, size) of ``meta.json``: the same file on every node of a shared file system,
    another one in a node-local cache prepared on that node (None: absent)."""
    try:
        st = (Path(prepared_dir) / "meta.json").stat()
    except OSError:
        return None
    return [st.st_ino, int(st.st_mtime), st.st_size]


def prepare_node_copy(cfg: C.LoomConfig, env: RankEnv, verdict: dict, control) -> None:
    """Local rank 0 of a node without rank 0's copy prepares or verifies its own in ``verdict["dir"]``;
    then every rank learns (one all-reduce of MAX over ``control``) whether some node failed."""
    import dataclasses

    failed: Exception | None = None
    if env.rank != 0 and env.local_rank == 0 and data_stamp(Path(verdict["dir"])) != verdict["stamp"]:
        try:
            prepare_data(dataclasses.replace(cfg.data, prepared_dir=verdict["dir"]), progress=False)
        except Exception as e:
            failed = e
    flag = torch.tensor([env.rank + 1 if failed is not None else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control)
    if failed is not None:
        raise failed
    if int(flag):
        raise C.ConfigError(
            f"data.prepared_dir: rank {int(flag) - 1} failed to prepare or verify its node's copy of "
            f"{verdict['dir']} (its own line says why)"
        )


def check_data_record(run_dir: Path) -> None:
    """``run_dir/data.json`` (the data a run is bound to), if present, is a JSON object of hashes."""
    import json

    path = run_dir / DATA_IDENTITY
    if not path.is_file():
        return
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        record = None
    if not isinstance(record, dict) or not all(isinstance(v, str) for v in record.values()):
        raise C.ConfigError(
            f"run.dir: {path} is not the JSON object of data hashes Loom writes; restore it, or start "
            "a new run.dir with --train.init_from"
        )


def initial_model(cfg: C.LoomConfig, device: torch.device) -> tuple[torch.nn.Module, Source | None]:
    """The model before parallelization, built on the meta device, and the source of its values (None:
    the layout-independent init): each rank materializes only what it holds, reading per parameter only
    its boxes of the pretrained weights of model.from_hf or of the weights of train.init_from."""
    model: torch.nn.Module = build_model(cfg.model, cfg.train.seed, device, meta=True, moe=cfg.moe)
    source: Source | None = None
    if cfg.model.from_hf:  # pretrained weights (the shape was taken from the directory by the CLI)
        from loom.model.hf import open_dir
        from loom.model.hf import source as hf_source

        source = hf_source(open_dir(cfg.model.from_hf, cfg.data.seq_len))
    if cfg.train.init_from:  # weights only; a checkpoint in run.dir (a restart) still wins below
        from loom.train.init_from import initial_source

        source, what = initial_source(model, cfg.train.init_from)
        log.info("initial weights from %s", what)
    return model, source


def data_identity(data: PreparedData) -> dict[str, str]:
    """SHA-256 of the tokenizer and of the prepared token files (recorded when they were written)."""
    import hashlib
    import json

    meta = json.loads((Path(data.train_path).parent / "meta.json").read_text())
    digests = meta.get("sha256", {})
    return {
        "tokenizer": hashlib.sha256(Path(data.tokenizer_path).read_bytes()).hexdigest(),
        "train.bin": str(digests.get("train.bin", "")),
        "val.bin": str(digests.get("val.bin", "")),
    }


def _check_same_tokenizer(run_dir: Path, now: str) -> None:
    """A run without ``data.json`` still has the ``tokenizer.json`` it trained with: resuming with
    another would replace it, and its checkpoints would no longer match their token ids."""
    import hashlib

    tok = run_dir / "tokenizer.json"
    if not tok.is_file() or not now:
        return
    was = hashlib.sha256(tok.read_bytes()).hexdigest()
    if was != now:
        raise C.ConfigError(
            f"data: {tok} (sha256 {was[:12]}) is not this run's tokenizer (sha256 {now[:12]}); resume with the "
            f"data and tokenizer it was trained with, or start a new run.dir with --train.init_from {run_dir}"
        )


def check_same_data(run_dir: Path, identity: dict[str, str]) -> None:
    """A resumed run continues on the data and tokenizer it started with (``run_dir/data.json``);
    anything else is refused naming both hashes (``train.init_from`` starts a new run from it)."""
    import json

    path = run_dir / DATA_IDENTITY
    if not path.is_file():  # a run from before runs recorded their data: its tokenizer.json says
        _check_same_tokenizer(run_dir, identity.get("tokenizer", ""))
        return
    recorded = json.loads(path.read_text())
    for key, now in identity.items():
        was = recorded.get(key, "")
        if was and now and was != now:
            raise C.ConfigError(
                f"data: {run_dir} was trained with {key} {was[:12]}, this run's is {now[:12]}; resume with the same "
                f"data and tokenizer, or start a new run.dir with --train.init_from {run_dir}"
            )
