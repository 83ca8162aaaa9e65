"""Device-agnostic helpers: pick the device and backend, measure peak FLOP/s, read memory.

Every ``torch.cuda`` call in Loom goes through here, behind an availability check, so the same
code runs on CPU + gloo and on CUDA + NCCL.
"""

from __future__ import annotations

import os
import resource
import sys
import time

import torch

# Peak dense bf16 FLOP/s (no sparsity) from vendor datasheets; fp32 uses the TF32 tensor-core rate.
GPU_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},
    "B200": {"bf16": 2250e12, "fp16": 2250e12, "fp32": 1100e12},
    "MI300X": {"bf16": 1307e12, "fp16": 1307e12, "fp32": 654e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 183e12},
}


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(kind: str, local_rank: int = 0) -> torch.device:
    """``auto`` = cuda:<local_rank> when CUDA is available, else cpu."""
    if kind == "auto":
        kind = "cuda" if cuda_available() else "cpu"
    if kind == "cuda":
        if not cuda_available():
            raise RuntimeError("run.device = cuda but CUDA is not available on this machine")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def resolve_backend(kind: str, device: torch.device) -> str:
    if kind == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return kind


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def measure_gemm_flops(device: torch.device, n: int = 512, seconds: float = 0.3) -> float:
    """Achieved FLOP/s of an n x n fp32 matmul on ``device`` (2 n^3 FLOPs each), best of a short run."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    for _ in range(2):
        a @ b
    synchronize(device)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        synchronize(device)
        dt = time.perf_counter() - t0
        best = max(best, 4 * 2 * n**3 / dt)
    return best


def peak_flops(device: torch.device, precision: str = "fp32") -> tuple[float, str]:
    """Peak FLOP/s for MFU and where it came from (datasheet for known GPUs, measured otherwise)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, table in GPU_PEAK_FLOPS.items():
            if key in name:
                return table.get(precision, table["fp32"]), f"datasheet {key} {precision}"
    return measure_gemm_flops(device), f"measured fp32 GEMM on {device.type} ({torch.get_num_threads()} threads)"


def default_threads(local_world: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world))
