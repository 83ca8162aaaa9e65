"""Loom checkpoints vs ``torch.distributed.checkpoint`` (DCP) on the same state, same run.

State: the 125M preset (configs/gpt-125m.toml) under data parallelism, parameters + AdamW
moments + step counters (~1.5 GB). For each world size: save (sync), async save (stall =
time the training thread is blocked, for the first save and once its host buffers exist;
total = until committed), load (Loom: with its SHA-256
verification, and without), DCP save / async_save / load. Contenders alternate per round;
the median of ``--rounds`` is reported. Throughput = checkpoint bytes / time. Loads read
files the save just wrote, so they come from the page cache for both.

    python benchmarks/bench_checkpoint.py [--ranks 1 2] [--rounds 2] [--config configs/gpt-125m.toml]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from loom import config as C  # noqa: E402
from loom.checkpoint import Checkpointer, CheckpointReader  # noqa: E402
from loom.checkpoint.replicated import ensure_adam_state  # noqa: E402
from loom.checkpoint.save import new_group  # noqa: E402
from loom.model.llama import build_model  # noqa: E402
from loom.optim.groups import build_optimizer  # noqa: E402
from loom.parallel.data.checkpoint import ReplicatedState  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_no_write, results  # noqa: E402


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _timed(world: int, fn) -> float:
    _barrier(world)
    t0 = time.perf_counter()
    fn()
    _barrier(world)
    return time.perf_counter() - t0


def _rank(rank: int, world: int, args, init: str, out: dict) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=600)
        )
    import torch.distributed.checkpoint as dcp

    cfg = C.load_toml(args.config)
    cfg.model.max_seq_len = 256
    model = build_model(cfg.model, 0)
    opt = build_optimizer(model, cfg.train)
    ensure_adam_state(opt)
    for st in opt.state.values():
        st["exp_avg"].normal_()
        st["exp_avg_sq"].uniform_()
    group = new_group(world, 600)
    state = ReplicatedState(model, opt, dist.group.WORLD if world > 1 else None)
    dcp_state = {"model": model.state_dict(), "optim": {str(i): s for i, s in enumerate(opt.state.values())}}
    root = Path(args.dir)
    solo = dict(no_dist=world == 1)
    res: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        res.setdefault(key, []).append(value)

    for r in range(args.rounds):
        ck = Checkpointer(root / f"loom{r}", rank, world, group, keep=1)
        add(
            "loom save", _timed(world, lambda ck=ck: ck.save(1, state.sharded_state(), {}, {}, blocking=True))
        )
        for step, what in ((2, "first"), (3, "steady")):  # the first async save allocates its buffers
            t0 = time.perf_counter()
            ck.save(step, state.sharded_state(), {}, {}, blocking=False)
            add(f"loom async stall {what}", time.perf_counter() - t0)
            ck.wait()
            _barrier(world)
            add(f"loom async total {what}", time.perf_counter() - t0)

        def loom_load(check: bool, ck=ck) -> None:
            with CheckpointReader(ck.root, rank, world, group, check=check) as reader:
                state.load_sharded(reader)

        add("loom load (verified)", _timed(world, lambda: loom_load(True)))
        add("loom load (no verify)", _timed(world, lambda: loom_load(False)))
        d = root / f"dcp{r}"
        add("dcp save", _timed(world, lambda d=d: dcp.save(dcp_state, checkpoint_id=str(d / "a"), **solo)))
        t0 = time.perf_counter()
        fut = dcp.async_save(dcp_state, checkpoint_id=str(d / "b"), **solo)
        add("dcp async stall", time.perf_counter() - t0)
        fut.result()
        _barrier(world)
        add("dcp async total", time.perf_counter() - t0)
        add("dcp load", _timed(world, lambda d=d: dcp.load(dcp_state, checkpoint_id=str(d / "a"), **solo)))
        if rank == 0:
            res.setdefault("_bytes loom", []).append(_dir_bytes(root / f"loom{r}" / "step-00000003"))
            res.setdefault("_bytes dcp", []).append(_dir_bytes(d / "a"))
        _barrier(world)
        if rank == 0:
            shutil.rmtree(root / f"loom{r}", ignore_errors=True)
            shutil.rmtree(d, ignore_errors=True)
    if rank == 0:
        out.update({k: statistics.median(v) for k, v in res.items()})
    if world > 1:
        dist.destroy_process_group()


def _run(world: int, args) -> dict:
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        args.dir = tmp
        if world == 1:
            out: dict = {}
            _rank(0, 1, args, "", out)
            return out
        manager = mp.Manager()
        out = manager.dict()
        mp.spawn(_rank, args=(world, args, f"file://{tmp}/rdzv", out), nprocs=world)
        return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--config", default=str(Path(__file__).resolve().parent.parent / "configs" / "gpt-125m.toml")
    )
    ap.add_argument("--tmp", default=None, help="directory for the checkpoints (default: system temp)")
    add_no_write(ap)
    args = ap.parse_args()
    with results("checkpoint", "Checkpoints against torch.distributed.checkpoint", write=not args.no_write):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        rows = []
        for world in args.ranks:
            r = _run(world, args)
            mb_loom, mb_dcp = r["_bytes loom"] / 1e6, r["_bytes dcp"] / 1e6
            for key in sorted(k for k in r if not k.startswith("_")):
                mb = mb_dcp if key.startswith("dcp") else mb_loom
                rate = "" if "stall" in key else f"{mb / r[key]:8.0f}"
                rows.append(f"| {world} | {key:22s} | {r[key]:7.2f} | {rate:>8s} |")
            rows.append(f"| {world} | checkpoint size MB     | loom {mb_loom:.0f} | dcp {mb_dcp:.0f} |")
            rows.append(
                f"| {world} | ratios                 | async stall / sync save: loom "
                f"{r['loom async stall steady'] / r['loom save']:.1%}, dcp {r['dcp async stall'] / r['dcp save']:.1%} | "
                f"load loom(verified)/dcp {r['loom load (verified)'] / r['dcp load']:.2f}x, "
                f"save loom/dcp {r['loom save'] / r['dcp save']:.2f}x |"
            )
        print("| ranks | what | seconds | MB/s |\n|---|---|---|---|")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
