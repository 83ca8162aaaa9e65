"""Device-agnostic helpers: pick the device and backend, time a GEMM, read and reset peak memory.

Every ``torch.cuda`` call in Loom goes through here, behind an availability check, so the same
code runs on CPU + gloo and on CUDA + NCCL.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import time
from collections.abc import MutableMapping

import torch

# The one map from precision names (train.precision, parallel.reduce_dtype) to the torch dtype of the
# parameters and activations: tf32 stores fp32 (only its matmuls round to TF32); fp8 and int8 keep bf16
# parameters and run the Linear layers' matmuls in 8 bits (loom.memory.precision).
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
    "int8": torch.bfloat16,
}


def resolve_precision(precision: str, device: str, bf16: bool | None = None) -> str:
    """``train.precision = auto``: bf16 where ``device`` (run.device: auto | cpu | cuda) resolves to a
    GPU with bf16 tensor cores (``bf16``: whether it has them; None: this machine's GPU, compute
    capability 8.0+), fp16 on an older GPU (V100, T4: bf16 only emulated), fp32 on the CPU; any other
    value is returned as set (an explicit choice is never overridden)."""
    if precision != "auto":
        return precision
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device != "cuda":
        return "fp32"
    if bf16 is None:  # no CUDA here: run.device = cuda is refused later, naming it
        bf16 = not cuda_available() or torch.cuda.is_bf16_supported(including_emulation=False)
    return "bf16" if bf16 else "fp16"


def set_fp32_matmul(device: torch.device, tf32: bool) -> None:
    """fp32 matmuls and convolutions on TF32 tensor cores (``train.precision = tf32``) or in full fp32,
    on CUDA; nothing changes on the CPU, where tf32 runs as fp32."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = tf32
    if tf32:
        torch.backends.cudnn.allow_tf32 = True


def fp8_supported(device: torch.device) -> bool:
    """Whether float8 matmuls (``torch._scaled_mm``) run on ``device``: CUDA compute capability 8.9+
    (Ada, Hopper, Blackwell); the CPU emulates them (slowly: tests and small runs)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


def cuda_available() -> bool:
    return torch.cuda.is_available()


def cuda_device_count() -> int:
    """GPUs this process sees (after ``CUDA_VISIBLE_DEVICES``); 0 without CUDA."""
    return torch.cuda.device_count() if cuda_available() else 0


def cuda_ordinal(local_rank: int) -> int:
    """The GPU index of the rank with ``LOCAL_RANK`` = ``local_rank``, among the n visible ones:
    ``local_rank`` when local_rank < n (every local rank sees every GPU: torchrun, ``loom train``);
    0 when n = 1 (one GPU bound per task: ``srun --gpus-per-task=1``, where LOCAL_RANK still counts
    the node's tasks); any other n is refused in one line."""
    n = cuda_device_count()
    if local_rank < n:
        return local_rank
    if n == 1:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    raise RuntimeError(
        f"LOCAL_RANK={local_rank} but this process sees {n} GPUs{shown}: start at most {n} ranks per node "
        "(--nproc, srun --ntasks-per-node), or give each rank every GPU of its node or exactly one"
    )


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"  # read by every torch >= 2.10 (PYTORCH_ALLOC_CONF: its newer name)
EXPANDABLE = "expandable_segments:True"


def default_allocator_conf(environ: MutableMapping[str, str] | None = None) -> str | None:
    """CUDA runs get ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (ZeRO-3 frees and refills
    storage every unit; expandable segments grow one mapping instead of leaving fragments), unless
    the user set it or ``PYTORCH_ALLOC_CONF``: an explicit setting is never overridden. Set before
    the allocator starts (it reads the variable once); if CUDA is already initialized it is applied
    to the running allocator. Returns the line to log where it set it, None where it left it."""
    environ = os.environ if environ is None else environ
    if ALLOC_CONF in environ or "PYTORCH_ALLOC_CONF" in environ:
        return None
    environ[ALLOC_CONF] = EXPANDABLE
    if environ is os.environ and torch.cuda.is_initialized():
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        (setter or torch.cuda.memory._set_allocator_settings)(EXPANDABLE)
    return f"{ALLOC_CONF}={EXPANDABLE} (set by Loom: unset; set it yourself to choose otherwise)"


def resolve_device(kind: str, local_rank: int = 0) -> torch.device:
    """``auto`` = CUDA when available, else cpu; on CUDA the GPU :func:`cuda_ordinal` picks, with
    expandable segments unless the allocator was configured (:func:`default_allocator_conf`)."""
    if kind == "auto":
        kind = "cuda" if cuda_available() else "cpu"
    if kind == "cuda":
        if not cuda_available():
            raise RuntimeError("run.device = cuda but CUDA is not available on this machine")
        if (line := default_allocator_conf()) is not None:
            logging.getLogger("loom").info("%s", line)
        index = cuda_ordinal(local_rank)
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def resolve_backend(kind: str, device: torch.device) -> str:
    if kind == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return kind


def device_name(device: torch.device) -> str:
    """The accelerator's reported name (``NVIDIA H100 80GB HBM3``), else the device type (``cpu``)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU, peak resident set size of this process on the CPU, since the
    last :func:`reset_peak_memory` (on Linux; elsewhere since the process started)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _vm_hwm()
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def peak_reserved_bytes(device: torch.device) -> int:
    """Peak bytes the caching allocator held from the GPU (allocated + cached free blocks and
    fragments) since the last :func:`reset_peak_memory`; on the CPU, where nothing is cached,
    the peak resident set (:func:`peak_memory_bytes`)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    return peak_memory_bytes(device)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak window: the allocator's peak on a GPU; on Linux the process's high-water
    mark (``/proc/self/clear_refs`` = 5 resets VmHWM to the current RSS)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:  # not Linux, or not allowed: the peak stays process-wide
        pass


def _vm_hwm() -> int | None:
    """VmHWM (peak RSS, bytes) from /proc/self/status, or None where there is none."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def tf32_enabled() -> bool:
    """Whether fp32 matmuls may run on TF32 tensor cores (otherwise fp32 MFU uses the FP32 peak)."""
    cuda_tf32 = torch.cuda.is_available() and torch.backends.cuda.matmul.allow_tf32
    return bool(cuda_tf32) or torch.get_float32_matmul_precision() != "highest"


def measure_gemm_flops(
    device: torch.device, dtype: torch.dtype = torch.float32, n: int | None = None, seconds: float = 0.0
) -> float:
    """Achieved FLOP/s of an n x n matmul in ``dtype`` on ``device`` (2 n^3 FLOPs each), best of a
    short run (``seconds``: 0.3 on an accelerator, 0.1 on the CPU, where 4 matmuls take about 7 ms);
    n = 8192 on an accelerator (large enough to reach the tensor cores' rate), 512 on the CPU. Timed
    between device synchronisations."""
    cpu = device.type == "cpu"
    n, seconds = n or (512 if cpu else 8192), seconds or (0.1 if cpu else 0.3)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
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


def default_threads(local_world: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world))
