"""The peak FLOP/s that MFU divides by: MFU = (tokens/s per rank × FLOPs per token) / peak.

A known accelerator's peak comes from the one hardware table the planner uses
(:func:`loom.plan.hardware.mfu_peak`), in the run's precision: bf16 and fp16 at their tensor-core
rates, fp32 at the FP32 rate unless TF32 is enabled (then the TF32 rate). Anything else (the CPU,
an accelerator not in the table) is measured: a GEMM in the run's dtype, large enough on an
accelerator to reach its matrix units.
"""

from __future__ import annotations

import torch

from loom.device import DTYPES, device_name, measure_gemm_flops, tf32_enabled


def mfu_peak(device: torch.device, precision: str) -> tuple[float, str]:
    """(peak FLOP/s per rank, where it came from) for a run in ``precision`` on ``device``."""
    name = device_name(device)
    if device.type == "cuda":
        from loom.plan.hardware import mfu_peak as from_table

        found = from_table(name, precision, tf32_enabled())
        if found is not None:
            return found
    dtype = DTYPES[precision]
    if device.type == "cpu" and dtype == torch.float16:
        dtype = torch.float32  # fp16 runs compute in fp32 on the CPU
    flops = measure_gemm_flops(device, dtype)
    what = f"{torch.get_num_threads()} threads" if device.type == "cpu" else "not in the hardware table"
    return flops, f"measured {str(dtype).removeprefix('torch.')} GEMM on {name} ({what})"
