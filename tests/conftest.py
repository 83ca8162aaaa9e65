"""Session-wide fixtures: shared multi-rank worker pools (see tests/dist.py); a guard that the
suite never writes into the run directories a checkout's user trains into by default; one scratch
directory for the whole session, removed at its end."""

from __future__ import annotations

import gc
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.dist import WorkerPool

_SCRATCH: str | None = None


@pytest.hookimpl(optionalhook=True)  # pytest without xdist (a GPU image) still loads this file
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): one worker per core this process may use, at most 4. Each
    worker runs whole test files (``--dist loadfile``) with its own rank pools (a few GiB each), and a
    multi-rank test's ranks already share the cores; ``-n 0`` runs everything in this process."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


def pytest_configure(config: pytest.Config) -> None:
    """Every temporary file of the session (this process, its worker pools, the ``loom`` commands it
    starts: they inherit ``TMPDIR``) goes into one directory that :func:`pytest_unconfigure` removes,
    so a run leaves nothing in ``/tmp`` (runs that each left their ``mkdtemp`` directories filled CI's
    disk). Inductor's compile cache stays where PyTorch puts it by default, shared across runs."""
    import multiprocessing.util

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    global _SCRATCH
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    # this process's multiprocessing directory stays outside: its own exit handler removes it, after ours
    multiprocessing.util.get_temp_dir()
    _SCRATCH = tempfile.mkdtemp(prefix="loom-tests-")
    os.environ["TMPDIR"] = _SCRATCH
    tempfile.tempdir = _SCRATCH


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SCRATCH is not None:
        shutil.rmtree(_SCRATCH, ignore_errors=True)
    gc.freeze()  # the exit collects nothing across the session's heap (seconds: loom.cli.run)


class Pools:
    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def __call__(self, world: int) -> WorkerPool:
        if world not in self._pools:
            self._pools[world] = WorkerPool(world)
        return self._pools[world]

    def release_groups(self, where: str) -> None:
        """Every pool a module used destroys its process groups but the default one (tests/dist.py),
        and each of its ranks is back to the gloo threads it had when it started."""
        from tests.dist import release_groups

        for world, pool in self._pools.items():
            if not pool.used:
                continue
            pool.run(release_groups)
            start = pool.gloo_threads
            held = pool.settled_gloo_threads(expect=start)
            leaked = held != start
            if leaked:  # a leak fails this module only: the next one starts clean
                pool.restart()
            pool.used = False
            assert not leaked, (
                f"{where}: the ranks of the {world}-rank pool run {held} gloo worker threads after their "
                f"groups were destroyed, {start} at start: something holds their groups"
            )

    def close(self) -> None:
        for p in self._pools.values():
            p.close()


@pytest.fixture(scope="session")
def pools():
    """``pools(n)`` -> a WorkerPool of n gloo ranks, started on first use and shared."""
    p = Pools()
    yield p
    p.close()


@pytest.fixture(autouse=True, scope="module")
def _release_process_groups(pools, request):
    """After each test module, the pools it used drop the process groups its tests made (see
    tests/dist.py), and every rank is back to the gloo threads it started with: a reference that
    outlived its group kept the group's threads (waking every 10 ms) for the rest of the session."""
    yield
    pools.release_groups(request.module.__name__)


# run.dir of the defaults and of the debug preset, relative to where loom runs (tests run in the checkout)
USER_RUN_DIRS = ("runs/default", "runs/debug")


def _files(d: Path) -> dict[str, tuple[int, int]] | None:
    if not d.is_dir():
        return None
    return {
        str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in d.rglob("*") if p.is_file()
    }


@pytest.fixture(scope="session", autouse=True)
def user_run_dirs_untouched():
    """A test that keeps the default ``run.dir`` would write over a user's own run in the checkout."""
    root = Path(__file__).resolve().parent.parent
    dirs = sorted({(base / rel).resolve() for base in (root, Path.cwd()) for rel in USER_RUN_DIRS})
    before = {d: _files(d) for d in dirs}
    yield
    changed = [str(d) for d in dirs if _files(d) != before[d]]
    assert not changed, f"the test suite wrote into {', '.join(changed)}: give every test its own run.dir"


@pytest.fixture
def clean_logging():
    """The trainer reconfigures logging to the stream of the moment; put it back after each test.
    A handler an earlier test left on its own captured stream, closed since, is dropped first: a
    warning logged before the trainer's set-up would otherwise print a logging error."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers[:] = [h for h in handlers if not getattr(getattr(h, "stream", None), "closed", False)]
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
