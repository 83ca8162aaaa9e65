"""Where optimizer state lives: on the device, in host memory, or in memory-mapped files on disk.

A :class:`StateStore` hands out zero-filled fp32 tensors and counts their bytes. ZeRO keeps its
sharded optimizer state (Adam moments, and fp32 master weights when the parameters are not
already fp32 on the store's device) in one store per rank and runs the update where the store is.

- ``none``: tensors on the training device.
- ``cpu`` (ZeRO-Offload): tensors in host memory, pinned when the device is a GPU so the
  gradient shard and the updated parameter shard cross PCIe asynchronously; the update runs on
  the host. On a CPU-only machine host *is* the device: the store is ordinary CPU memory and no
  copy is made, so ``cpu`` behaves exactly like ``none`` there.
- ``disk`` (ZeRO-Infinity style): each tensor is a shared memory map of its own file in
  ``directory``. The file's blocks are reserved with ``posix_fallocate`` when it is created, so
  a full disk is reported then, as :class:`OffloadError`, before training starts; afterwards
  writes through the map can never hit ENOSPC (which would arrive as SIGBUS, or as silently
  lost pages). The file is unlinked as soon as it is mapped: its space stays reserved while the
  process lives and is returned by the kernel when the process ends, so a crash leaves no
  stale state behind. The kernel pages the state in and out of the page cache as the update
  touches it; resident memory for it is reclaimable cache, not anonymous memory.
"""

from __future__ import annotations

import mmap
import os
import shutil
from pathlib import Path
from typing import get_args

import torch

from loom import comm
from loom.config import Offload

OFFLOAD_KINDS: tuple[str, ...] = get_args(Offload)


class OffloadError(RuntimeError):
    """Optimizer state could not be placed (unwritable directory, no space)."""


class StateStore:
    """Zero-filled tensors for optimizer state on the training device (``offload = "none"``)."""

    kind = "none"

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.nbytes = 0  # bytes handed out so far

    def zeros(self, numel: int, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zero-filled 1-D tensor of ``numel`` elements named ``name`` (names are unique per store)."""
        t = self._alloc(numel, name, dtype)
        self.nbytes += t.numel() * t.element_size()
        if self.kind != "none":  # host memory: no collective may take it (strict mode's sentinel)
            comm.mark_host(t, f"{self.kind} store's {name!r}")
        return t

    def _alloc(self, numel: int, name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of state kept off the training device (0 for the device store)."""
        return 0

    def close(self) -> None:
        """Release what the store holds beyond its tensors (nothing for memory stores)."""


class HostStore(StateStore):
    """Host memory (ZeRO-Offload); pinned when the training device is a GPU."""

    kind = "cpu"

    def __init__(self, device: torch.device) -> None:
        super().__init__(torch.device("cpu"))
        self.pin = torch.device(device).type == "cuda"

    def _alloc(self, numel: int, name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=self.pin)

    @property
    def offloaded_bytes(self) -> int:
        return self.nbytes


class DiskStore(StateStore):
    """Each tensor a shared memory map of a preallocated, unlinked file in ``directory``."""

    kind = "disk"

    def __init__(self, directory: str | Path, tag: str) -> None:
        super().__init__(torch.device("cpu"))
        self.directory = Path(directory)
        self.tag = tag
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OffloadError(
                f"parallel.offload_dir: cannot create {str(self.directory)!r}: {e.strerror}"
            ) from None
        self._maps: list[mmap.mmap] = []

    def _alloc(self, numel: int, name: str, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.zeros(0, dtype=dtype)
        path = self.directory / f"{self.tag}-{name}.bin"
        free = shutil.disk_usage(self.directory).free
        if nbytes > free:
            raise OffloadError(
                f"parallel.offload_dir: {str(self.directory)!r} has {free} bytes free, "
                f"optimizer state {name!r} needs {nbytes}"
            )
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as e:
            raise OffloadError(f"parallel.offload_dir: cannot create {str(path)!r}: {e.strerror}") from None
        try:
            os.posix_fallocate(fd, 0, nbytes)  # reserve every block now: no ENOSPC through the map later
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise OffloadError(
                f"parallel.offload_dir: cannot reserve {nbytes} bytes in {str(path)!r}: {e.strerror}"
            ) from None
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)  # the mapping keeps the blocks; nothing is left after exit
        self._maps.append(mm)
        return torch.frombuffer(mm, dtype=dtype, count=numel)  # fresh blocks read as zeros

    @property
    def offloaded_bytes(self) -> int:
        return self.nbytes

    def close(self) -> None:
        self._maps.clear()  # the maps close when their last tensor is garbage-collected


def make_store(kind: str, device: torch.device, directory: str | Path = "", tag: str = "rank0") -> StateStore:
    """The store for ``parallel.offload`` = ``kind``; ``directory`` and ``tag`` name the disk files."""
    if kind == "none":
        return StateStore(device)
    if kind == "cpu":
        return HostStore(device)
    if kind == "disk":
        if not directory:
            raise OffloadError('parallel.offload_dir: a directory is needed for parallel.offload = "disk"')
        return DiskStore(directory, tag)
    raise OffloadError(f"parallel.offload: must be one of {OFFLOAD_KINDS}, got {kind!r}")
