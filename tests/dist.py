"""Multi-rank test harness: a pool of long-lived gloo ranks shared by every test of a session.

Starting a process that imports torch costs seconds here, so each world size gets one pool of
processes, started once (``file://`` rendezvous in a temp dir: no ports), that runs test
functions on every rank and returns their results. A function raising on one rank fails the
test with that rank's traceback; the pool is then restarted so later tests start clean.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = str(Path(__file__).resolve().parent.parent)
PG_TIMEOUT_S = 60
DEVICE_TYPE = "cpu"  # this rank's device type: "cuda" in an NCCL pool (one GPU per rank)


def rank_device():
    """This process's device: ``cuda:<rank>`` in an NCCL pool, else the CPU."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if DEVICE_TYPE == "cuda" else torch.device("cpu")


def _worker_loop(rank: int, world: int, init_file: str, conn, backend: str = "gloo") -> None:
    global DEVICE_TYPE
    # NCCL's rules on gloo (loom.comm strict mode); the collective order of every group is compared
    # across its ranks after each call (PyTorch's DETAIL checks: LOOM_TEST_DIST_DEBUG=DETAIL)
    os.environ.setdefault("LOOM_STRICT_COMM", "1")
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = os.environ.get("LOOM_TEST_DIST_DEBUG", "OFF")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    faulthandler.enable()  # a crashing rank prints its Python stack
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist

    from loom import comm

    torch.set_num_threads(1)
    device = None
    if backend == "nccl":
        DEVICE_TYPE = "cuda"
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=PG_TIMEOUT_S),
        device_id=device,
    )
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        module, name, args, kwargs = msg
        comm.take_order_log()
        try:
            fn = getattr(importlib.import_module(module), name)
            value = fn(*args, **kwargs)
            conn.send(("ok", (value, comm.take_order_log())))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            conn.send(("err", traceback.format_exc()))
    dist.destroy_process_group()
    gc.freeze()  # the exit collects nothing across the heap of every test the rank ran (loom.cli.run)


class RankFailure(AssertionError):
    pass


class CollectiveOrderError(AssertionError):
    """The members of a group issued different collectives (strict mode's cross-rank comparison)."""


class WorkerPool:
    """``world`` ranks (gloo on the CPU, or NCCL with one GPU each); :meth:`run` calls ``fn(*args)``
    on all of them."""

    def __init__(self, world: int, backend: str = "gloo") -> None:
        self.world, self.backend = world, backend
        self._start()

    def _start(self) -> None:
        self.used = False  # ran a function since the module-end release (tests/conftest.py)
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="loom-pool-")
        init_file = os.path.join(self._tmp.name, "rdzv")
        self.procs, self.conns = [], []
        for r in range(self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker_loop, args=(r, self.world, init_file, child, self.backend), daemon=True
            )
            p.start()
            self.procs.append(p)
            self.conns.append(parent)
        for r, c in enumerate(self.conns):
            if not c.poll(120):
                raise RuntimeError(f"test rank {r} did not start within 120 s")
            c.recv()
        self.gloo_threads = self.settled_gloo_threads()  # the default group's, per rank
        self.used = False

    def gloo_thread_counts(self) -> list[int]:
        """Each rank's gloo worker threads (a gloo group keeps its own until it is freed)."""
        return [t.get("pt_gloo_runloop", 0) for t in self.run(live_threads)]

    def settled_gloo_threads(self, expect: list[int] | None = None, within: float = 2.0) -> list[int]:
        """:meth:`gloo_thread_counts` once threads stop starting or exiting (a freed group's threads
        leave within their 10 ms wake-up; a new group's start asynchronously): the counts equal to
        ``expect``, or else two readings 0.1 s apart that agree, polled for at most ``within`` s."""
        counts, deadline = self.gloo_thread_counts(), time.monotonic() + within
        while time.monotonic() < deadline:
            if expect is not None and counts == expect:
                break
            time.sleep(0.1)
            again = self.gloo_thread_counts()
            if again == counts and expect is None:
                break
            counts = again
        return counts

    def run(self, fn, *args, timeout: float = 300, **kwargs) -> list[Any]:
        """Run ``fn`` (a module-level function) on every rank; return the per-rank results."""
        self.used = True
        results: list[Any] = [None] * self.world
        orders: list[dict] = [{} for _ in range(self.world)]
        errors: list[str] = []
        for r, c in enumerate(self.conns):
            try:
                c.send((fn.__module__, fn.__name__, args, kwargs))
            except OSError:  # the rank died during an earlier call
                errors.append(f"rank {r} is dead (exit code {self.procs[r].exitcode})")
        for r, c in enumerate(self.conns):
            if errors and len(errors) == self.world:
                break
            wait = timeout if not errors else 5
            try:
                if not c.poll(wait):
                    errors.append(f"rank {r}: no answer within {wait:.0f} s")
                    continue
                status, value = c.recv()
            except (EOFError, OSError):
                self.procs[r].join(timeout=5)
                errors.append(f"rank {r} died (exit code {self.procs[r].exitcode})")
                continue
            if status == "ok":
                results[r], orders[r] = value
            else:
                errors.append(f"rank {r} raised:\n{value}")
        if errors:
            self.restart()
            raise RankFailure("\n".join(errors))
        from loom.comm import first_order_mismatch

        if (mismatch := first_order_mismatch(orders)) is not None:
            raise CollectiveOrderError(f"{fn.__name__}: {mismatch}")
        return results

    def restart(self) -> None:
        self.close()
        self._start()

    def close(self) -> None:
        for c in self.conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                c.send(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self._tmp.cleanup()


# ------------------------------------------------------------------ helpers used inside ranks

_MESHES: dict[tuple, Any] = {}  # by degrees, least recently used first
MAX_MESHES = 4  # each mesh holds ~10 gloo groups; see release_groups


def get_mesh(**dims: int):
    """A ``ParallelMesh`` for these degrees, built once per rank process and reused by tests (the
    ``MAX_MESHES`` most recently used are kept; an older one's groups are destroyed)."""
    from loom.mesh import ParallelDims, ParallelMesh

    key = tuple(sorted(dims.items()))
    if key in _MESHES:
        _MESHES[key] = _MESHES.pop(key)  # most recently used last
        return _MESHES[key]
    while len(_MESHES) >= MAX_MESHES:
        _destroy_groups(_mesh_groups(_MESHES.pop(next(iter(_MESHES)))))
    _MESHES[key] = ParallelMesh(ParallelDims(**dims), DEVICE_TYPE)
    return _MESHES[key]


def _mesh_groups(mesh) -> list:
    groups = [
        mesh.group(n)
        for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_cp", "dp_shard_cp", "ep", "edp")
    ]
    return [*groups, *mesh.pp_links().values(), *mesh.twins()]


def _destroy_groups(groups) -> int:
    """Destroy these process groups (each once; never the default group)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    default, done = c10d._get_default_group(), set()
    for g in groups:
        if g is None or g is default or id(g) in done or g not in c10d._world.pg_map:
            continue
        done.add(id(g))
        dist.destroy_process_group(g)
    return len(done)


def release_groups() -> int:
    """Destroy every process group of this rank but the default one (cached meshes too), clear
    torch's DTensor caches and collect, so that nothing holds a destroyed group; returns how many.
    Each gloo group keeps two threads that wake every 10 ms until it is freed: ranks holding
    hundreds of groups kept both cores of this machine busy and slowed the whole suite."""
    import gc

    from torch.distributed import distributed_c10d as c10d

    _MESHES.clear()
    n = _destroy_groups(list(c10d._world.pg_map))
    _clear_torch_distributed_caches()
    while gc.collect():  # a group lives (and its threads run) until its last reference goes
        pass
    return n


def _clear_torch_distributed_caches() -> None:
    """DTensor's sharding propagation and redistribute plans are cached per device mesh (its
    sharding-propagation caches, and module-level ``*_cache`` dicts such as ``_redistribute``'s
    ``_planner_cache``, whose planners hold their mesh); a test comparing with DTensor or FSDP2 left
    its meshes, and so its groups, in them."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    import functools

    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if attr.endswith("_cache") and type(value) is dict:
                value.clear()
            members = vars(value).values() if isinstance(value, type) else (value,)
            for member in members:  # functools caches of functions and of class methods
                member = getattr(member, "__func__", member)  # staticmethod / classmethod
                if isinstance(member, functools._lru_cache_wrapper):
                    member.cache_clear()
    with contextlib.suppress(ImportError, AttributeError):  # the Python and C++ fast-path caches
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()


def live_threads() -> dict[str, int]:
    """This process's threads by name (Linux: /proc/self/task; none where there is no /proc, so
    the module-end leak check of tests/conftest.py compares nothing there)."""
    from collections import Counter

    tasks = f"/proc/{os.getpid()}/task"
    if not os.path.isdir(tasks):
        return {}
    return dict(Counter(Path(f"{tasks}/{t}/comm").read_text().strip() for t in os.listdir(tasks)))
