"""Accelerator datasheets: :class:`DeviceSpec`, the table :data:`DEVICES`, names to keys, MFU peaks.

Units are SI throughout: bytes, FLOP/s, bytes/s, seconds. Memory capacities are written in GiB
because that is what vendors' HBM "GB" mean (an "A100 80GB" reports 81920 MiB, an "H100 80GB"
81559 MiB usable; H200 141, B200 180 and MI300X 192 likewise binary); bandwidths and FLOP rates
are decimal (GB/s, TFLOP/s) as datasheets print them. A :class:`DeviceSpec` holds vendor
datasheet numbers (dense, i.e. without 2:4 sparsity). ``loom plan validate --published --fit``
patches :data:`GEMM_K0` here (:meth:`~loom.plan.hardware.machine.Machine.gemm` reads it at call time).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from loom.device import resolve_precision

GEMM_K0: float = 256  # reduction steps a GEMM tile's prologue + epilogue cost (pipeline fill and drain; fitted, see achievable)
GB = 1e9
GiB = 2**30
TFLOPS = 1e12
PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")


class HardwareError(ValueError):
    """A bad device, cluster or profile description; the message names the field."""


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator, from its vendor datasheet (dense peak numbers, no sparsity)."""

    name: str
    memory_bytes: float  # device memory (HBM) capacity
    fp32_flops: float  # peak dense FP32 FLOP/s (non-tensor-core unless the vendor only quotes matrix)
    tf32_flops: float  # peak dense TF32 tensor FLOP/s (0 = unsupported)
    bf16_flops: float  # peak dense BF16 tensor FLOP/s
    fp16_flops: float  # peak dense FP16 tensor FLOP/s
    fp8_flops: float  # peak dense FP8 tensor FLOP/s (0 = unsupported)
    hbm_bandwidth: float  # device memory bandwidth, bytes/s
    link_bandwidth: float  # intra-node device-to-device bandwidth per direction, bytes/s
    achievable: (
        float  # sustained fraction of peak of a large GEMM in training (fitted on published runs; module doc)
    )
    # sustained share of the fp8/int8 peak of a large 8-bit GEMM (0: ``achievable``; fitted on FP8 runs)
    achievable_8bit: float = 0.0
    runtime_overhead_bytes: float = 1.0 * GiB  # context + library workspaces + comm buffers (assumption)
    int8_flops: float = 0.0  # peak dense INT8 tensor OP/s (0 = unsupported); train.precision = int8
    sms: int = 0  # streaming multiprocessors (compute units) that GEMM tiles spread over; 0 = no wave model
    tile: tuple[int, int] = (
        128,
        256,
    )  # output tile (rows, cols) of one GEMM thread block (cuBLAS/CUTLASS bf16)
    flash_fwd: float = 0.0  # sustained fraction of peak of a flash-attention forward kernel (0 = achievable)
    flash_bwd: float = 0.0  # same, backward (counted as 2.5x the forward's FLOPs)
    nic_bandwidth: float = 50 * GB  # inter-node bandwidth per device per direction of its reference node
    # (DGX A100: one 200 Gb/s HDR HCA per GPU = 25 GB/s; DGX H100/H200/B200: one 400 Gb/s NDR = 50 GB/s)
    # framework cost per executed operator (Python, dispatch, autograd), s; charged on
    op_overhead: float = 0.0
    # top of FLOPs and bytes where the host waits for each op (CPUs); 0 = hidden behind queued kernels (GPUs)
    # the trainer's cost per block and micro-batch beyond the model's operators
    microbatch_overhead: float = 0.0
    # (saved-tensor and gradient hooks, views), once more per micro-batch for the rest, s (loom plan calibrate --config)
    optimizer_rates: tuple[
        tuple[str, float], ...
    ] = ()  # (train.optimizer, shard elements/s of one step) where
    # its arithmetic, not its bytes, sets the time (CPUs; absent: bytes / memory bandwidth)
    # share of overlapped data-parallel traffic truly hidden: the rest slows compute (assumption;
    comm_overlap: float = 0.8
    # 0 on CPU: gloo runs on the same cores that compute, so nothing is hidden)
    source: str = ""  # the datasheet the numbers come from
    # activation dtypes (fp32, bf16) whose MoE experts run torch._grouped_mm here, as
    # loom.model.moe.grouped_mm_available decides: bf16 at CUDA capability >= 9.0 (ROCm's gfx942
    # reports 9.4), fp32 and bf16 on the CPU; otherwise the zero-padded batched matmul
    grouped_mm: tuple[str, ...] = ()

    def gemm_share(self, precision: str) -> float:
        """Sustained share of ``precision``'s peak of a large GEMM: ``achievable_8bit`` for fp8/int8
        where given (8-bit tensor cores reach a smaller share of their doubled peak), else ``achievable``."""
        return (
            self.achievable_8bit
            if precision in ("fp8", "int8") and self.achievable_8bit > 0
            else self.achievable
        )

    def peak_flops(self, precision: str) -> float:
        """Peak dense FLOP/s in ``precision``; a precision the device lacks raises :class:`HardwareError`.

        ``fp32`` means true FP32 math (PyTorch's default matmul precision); ask for ``tf32``
        to count TF32 tensor cores (``train.precision = tf32``). ``fp8`` and ``int8`` are the
        rates of those runs' Linear GEMMs (torchao), whose other matmuls (attention) run in bf16.
        """
        if precision not in PRECISIONS:
            raise HardwareError(f"precision: must be one of {PRECISIONS}, got {precision!r}")
        value = getattr(self, f"{precision}_flops")
        if value <= 0:
            raise HardwareError(f"device {self.name!r} has no {precision} support")
        return value


_NV_A100 = "NVIDIA A100 Tensor Core GPU datasheet (2021), SXM4 column"
_NV_H100 = "NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM / H100 PCIe columns"
_NV_H200 = "NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM column"
_NV_B200 = "NVIDIA DGX/HGX B200 datasheet (2024): 8-GPU totals divided by 8"
_AMD_MI300X = "AMD Instinct MI300X accelerator datasheet (2023)"
_AMD_MI250X = "AMD Instinct MI250X accelerator datasheet (2021), OAM module figures divided by its 2 GCDs"
_NV_H800 = "NVIDIA H800 Tensor Core GPU datasheet (2023), H800 SXM5 column"
_NV_V100 = "NVIDIA Tesla V100 GPU datasheet (2020), V100 SXM2 column"
_NV_P100 = "NVIDIA Tesla P100 GPU datasheet (2016), P100 for NVLink-optimized servers column"
_NV_K80 = "NVIDIA Tesla K80 GPU accelerator datasheet (2014): board totals divided by its 2 GPUs"
_NV_L4 = "NVIDIA L4 Tensor Core GPU datasheet (2023)"
_NV_L40S = "NVIDIA L40S GPU datasheet (2023)"
_NV_A10 = "NVIDIA A10 Tensor Core GPU datasheet (2021)"
_NV_T4 = "NVIDIA T4 Tensor Core GPU datasheet (2019)"
_NV_4090 = "NVIDIA Ada GPU architecture whitepaper (v2.1, 2023), GeForce RTX 4090 column, FP32 accumulate"
_CPU = (
    "this machine: Intel Xeon (Emerald Rapids, KVM), 2 cores, AVX-512 with 2 FMA units/core "
    "(Intel 64 and IA-32 Optimization Reference Manual): 2.3 GHz * 64 FP32 FLOP/cycle per core; "
    "AVX512_BF16 doubles that; one rank pinned to one core"
)

DEVICES: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        # A100: 19.5 TF FP32, 156 TF TF32, 312 TF BF16/FP16, 624 TOPS INT8 (dense); NVLink 3 600 GB/s total.
        DeviceSpec(
            "a100-40g",
            40 * GiB,
            19.5e12,
            156e12,
            312e12,
            312e12,
            0.0,
            1555 * GB,
            300 * GB,
            0.73,
            sms=108,
            flash_fwd=0.65,
            flash_bwd=0.50,
            nic_bandwidth=25 * GB,
            int8_flops=624e12,
            source=_NV_A100,
        ),
        DeviceSpec(
            "a100-80g",
            80 * GiB,
            19.5e12,
            156e12,
            312e12,
            312e12,
            0.0,
            2039 * GB,
            300 * GB,
            0.73,
            sms=108,
            flash_fwd=0.65,
            flash_bwd=0.50,
            nic_bandwidth=25 * GB,
            int8_flops=624e12,
            source=_NV_A100,
        ),
        # H100 SXM: 67 TF FP32, 494.5 TF32, 989.5 BF16/FP16, 1979 FP8 and INT8 (dense = half the
        # sparse figures); HBM3 3.35 TB/s; NVLink 4 900 GB/s total.
        DeviceSpec(
            "h100-sxm",
            80 * GiB,
            67e12,
            494.5e12,
            989.5e12,
            989.5e12,
            1979e12,
            3350 * GB,
            450 * GB,
            0.58,
            sms=132,
            flash_fwd=0.37,
            flash_bwd=0.30,
            int8_flops=1979e12,
            achievable_8bit=0.575,  # fitted on NeMo 24.07 + Megatron-Bridge FP8 rows (loom plan validate --published --fit)
            grouped_mm=("bf16",),
            source=_NV_H100,
        ),
        # H100 PCIe: 51 TF FP32, 378 TF32, 756 BF16/FP16, 1513 FP8/INT8; HBM2e 2.0 TB/s; GPUs of a
        # node talk over PCIe Gen5 x16 (64 GB/s per direction; NVLink bridges only join pairs).
        DeviceSpec(
            "h100-pcie",
            80 * GiB,
            51e12,
            378e12,
            756e12,
            756e12,
            1513e12,
            2000 * GB,
            64 * GB,
            0.58,
            sms=114,
            flash_fwd=0.37,
            flash_bwd=0.30,
            int8_flops=1513e12,
            grouped_mm=("bf16",),
            source=_NV_H100,
        ),
        # H200 SXM: H100 compute, 141 GB HBM3e at 4.8 TB/s, NVLink 4 900 GB/s total.
        DeviceSpec(
            "h200",
            141 * GiB,
            67e12,
            494.5e12,
            989.5e12,
            989.5e12,
            1979e12,
            4800 * GB,
            450 * GB,
            0.58,
            sms=132,
            flash_fwd=0.37,
            flash_bwd=0.30,
            int8_flops=1979e12,
            grouped_mm=("bf16",),
            source=_NV_H200,
        ),
        # B200 (HGX B200 / 8): 1440 GB -> 180 GB, 64 TB/s -> 8 TB/s, FP32 75 TF, TF32 1.1 PF,
        # BF16/FP16 2.25 PF, FP8 and INT8 4.5 PF dense; NVLink 5 1.8 TB/s total.
        DeviceSpec(
            "b200",
            180 * GiB,
            75e12,
            1100e12,
            2250e12,
            2250e12,
            4500e12,
            8000 * GB,
            900 * GB,
            0.70,
            sms=148,
            int8_flops=4500e12,
            grouped_mm=("bf16",),
            source=_NV_B200,
        ),
        # MI300X: 192 GB HBM3 at 5.3 TB/s; 163.4 TF FP32 (matrix), 653.7 TF32, 1307.4 BF16/FP16,
        # 2614.9 FP8 and INT8 dense; 7 Infinity Fabric links x 64 GB/s per direction = 448 GB/s.
        DeviceSpec(
            "mi300x",
            192 * GiB,
            163.4e12,
            653.7e12,
            1307.4e12,
            1307.4e12,
            2614.9e12,
            5300 * GB,
            448 * GB,
            0.55,
            sms=304,
            int8_flops=2614.9e12,
            grouped_mm=("bf16",),
            source=_AMD_MI300X,
        ),
        # MI250X, one GCD (what torch sees as a device; the OAM module holds two): module figures / 2:
        # 64 GB HBM2e at 1.6 TB/s, 47.9 TF FP32 (matrix), 191.5 TF BF16/FP16 and INT8, no TF32 or FP8;
        # 110 CUs; Infinity Fabric to the other GCDs about 100 GB/s per direction; a Frontier node's
        # four 25 GB/s Slingshot NICs over its 8 GCDs: 12.5 GB/s each.
        DeviceSpec(
            "mi250x",
            64 * GiB,
            47.9e12,
            0.0,
            191.5e12,
            191.5e12,
            0.0,
            1600 * GB,
            100 * GB,
            0.55,
            sms=110,
            nic_bandwidth=12.5 * GB,
            int8_flops=191.5e12,
            source=_AMD_MI250X,
        ),
        # PCIe cards people fine-tune on (cloud instances, workstations): no NVLink, so GPUs of a node talk
        # over PCIe (Gen4 x16: 32 GB/s per direction, Gen3: 16); the NIC share is an assumption (a cloud
        # VM's 100 Gb/s over its 8 GPUs, 1.5625 GB/s each): these are rarely run across nodes.
        # L4: 30.3 TF FP32, 60 TF32, 121 BF16/FP16, 242.5 FP8/INT8 (dense = half the sparse figures);
        # 24 GB GDDR6 at 300 GB/s; 58 SMs.
        DeviceSpec(
            "l4",
            24 * GiB,
            30.3e12,
            60e12,
            121e12,
            121e12,
            242.5e12,
            300 * GB,
            32 * GB,
            0.58,
            sms=58,
            nic_bandwidth=1.5625 * GB,
            int8_flops=242.5e12,
            source=_NV_L4,
        ),
        # L40S: 91.6 TF FP32, 183 TF32, 362 BF16/FP16, 733 FP8/INT8 (dense); 48 GB GDDR6 at 864 GB/s; 142 SMs.
        DeviceSpec(
            "l40s",
            48 * GiB,
            91.6e12,
            183e12,
            362e12,
            362e12,
            733e12,
            864 * GB,
            32 * GB,
            0.58,
            sms=142,
            nic_bandwidth=1.5625 * GB,
            int8_flops=733e12,
            source=_NV_L40S,
        ),
        # A10: 31.2 TF FP32, 62.5 TF32, 125 BF16/FP16, 250 INT8 (dense), no FP8; 24 GB GDDR6 at 600 GB/s;
        # 72 SMs. (AWS's A10G is another part: measured, not given this one's peak.)
        DeviceSpec(
            "a10",
            24 * GiB,
            31.2e12,
            62.5e12,
            125e12,
            125e12,
            0.0,
            600 * GB,
            32 * GB,
            0.58,
            sms=72,
            nic_bandwidth=1.5625 * GB,
            int8_flops=250e12,
            source=_NV_A10,
        ),
        # T4: 8.1 TF FP32, 65 TF FP16 (mixed precision), 130 INT8; no BF16 or TF32 (auto precision: fp16);
        # 16 GB GDDR6 at 320 GB/s; 40 SMs; PCIe Gen3 x16.
        DeviceSpec(
            "t4",
            16 * GiB,
            8.1e12,
            0.0,
            0.0,
            65e12,
            0.0,
            320 * GB,
            16 * GB,
            0.55,
            sms=40,
            nic_bandwidth=1.5625 * GB,
            int8_flops=130e12,
            source=_NV_T4,
        ),
        # GeForce RTX 4090: 82.6 TF FP32 and TF32, 165.2 BF16/FP16 and 330.3 FP8 with FP32 accumulate (the
        # GeForce rate, half the FP16-accumulate one; training accumulates in FP32), 660.6 INT8 (dense);
        # 24 GB GDDR6X at 1008 GB/s; 128 SMs; no peer-to-peer between GeForce cards (PCIe through the host).
        DeviceSpec(
            "rtx4090",
            24 * GiB,
            82.6e12,
            82.6e12,
            165.2e12,
            165.2e12,
            330.3e12,
            1008 * GB,
            25 * GB,
            0.58,
            sms=128,
            nic_bandwidth=1.25 * GB,
            int8_flops=660.6e12,
            source=_NV_4090,
        ),
        # Older parts, for the cluster scheduler's mixed clusters (loom.cluster; Gavel's V100/P100/K80).
        # V100 SXM2 16GB: 15.7 TF FP32, 125 TF FP16 tensor, no BF16/TF32; HBM2 900 GB/s; NVLink 2 300 GB/s total.
        DeviceSpec(
            "v100",
            16 * GiB,
            15.7e12,
            0.0,
            0.0,
            125e12,
            0.0,
            900 * GB,
            150 * GB,
            0.55,
            sms=80,
            nic_bandwidth=3.125 * GB,
            source=_NV_V100,
        ),
        # P100 SXM2 16GB: 10.6 TF FP32, 21.2 TF FP16 (no tensor cores); HBM2 732 GB/s; NVLink 1 160 GB/s total.
        DeviceSpec(
            "p100",
            16 * GiB,
            10.6e12,
            0.0,
            0.0,
            21.2e12,
            0.0,
            732 * GB,
            80 * GB,
            0.55,
            sms=56,
            nic_bandwidth=3.125 * GB,
            source=_NV_P100,
        ),
        # K80, one of the board's two GK210 GPUs: 4.37 TF FP32 (boost; 8.73 per board), no fast FP16
        # (fp16 counted at the FP32 rate: mixed precision only halves bytes), GDDR5 240 GB/s, 12 GiB;
        # GPUs talk over PCIe 3.0 x16 (15.75 GB/s per direction).
        DeviceSpec(
            "k80",
            12 * GiB,
            4.37e12,
            0.0,
            0.0,
            4.37e12,
            0.0,
            240 * GB,
            15.75 * GB,
            0.55,
            sms=13,
            nic_bandwidth=1.25 * GB,
            source=_NV_K80,
        ),
        # This CPU, per rank (one core): 147 GFLOP/s FP32, 294 BF16 (AVX512_BF16), no TF32/FP8/INT8 units
        # (fp8 and int8 runs are emulated here: tests, not speed);
        # memory and "link" (loopback gloo) are set by the cluster file, these are placeholders.
        DeviceSpec(
            "cpu",
            8 * GiB,
            147e9,
            0.0,
            294e9,
            147e9,
            0.0,
            20 * GB,
            5 * GB,
            0.50,
            runtime_overhead_bytes=0.4 * GiB,
            op_overhead=2.2e-6,  # a tiny Llama block's forward + backward on this machine: 2.2 us per ATen op (fp32)
            # one step over a 2^20-element shard here: AdamW 1.2 ms, 8-bit Adam 73 ms, Adafactor 6.3 ms
            optimizer_rates=(("adamw", 0.86e9), ("adam8bit", 14.4e6), ("adafactor", 166e6)),
            microbatch_overhead=0.5e-3,  # calibrate --config debug.toml here: 1.4-1.7 ms per micro-batch over 2 + 1
            comm_overlap=0.0,
            grouped_mm=("fp32", "bf16"),
            source=_CPU,
        ),
    )
}
# H800 SXM (H100's export variant, the DeepSeek-V3 clusters): the H100 SXM chip, its 8-bit share
# included, with NVLink cut to 400 GB/s total (200 per direction).
DEVICES["h800"] = replace(DEVICES["h100-sxm"], name="h800", link_bandwidth=200 * GB, source=_NV_H800)


# (substrings of torch.cuda.get_device_name, all required, lower case) -> DEVICES key, first match
# wins; None: a part whose name contains a known one but whose datasheet differs (H100 NVL: 94 GB,
# other clocks; H200 NVL: 600 W, 1671 TF bf16 with sparsity against the SXM's 1979; GH200 / GB200: Grace
# superchips), so it is measured, not given another part's peak.
_NAME_RULES: tuple[tuple[tuple[str, ...], str | None], ...] = (
    (("a1000",), None),  # RTX A1000 (a laptop and workstation part), not an A100
    (("h100", "nvl"), None),
    (("h200", "nvl"), None),
    (("gh200",), None),
    (("gb200",), None),
    (("h100", "pcie"), "h100-pcie"),
    (("h100",), "h100-sxm"),
    (("h200",), "h200"),
    (("h800", "pcie"), None),
    (("h800",), "h800"),
    (("b200",), "b200"),
    (("a100", "40gb"), "a100-40g"),
    (("a100",), "a100-80g"),
    (("mi300x",), "mi300x"),
    (("mi250x",), "mi250x"),
    (("l40s",), "l40s"),
    (("l40",), None),
    (("l4",), "l4"),
    (("a10g",), None),
    (("a10",), "a10"),
    (("tesla", "t4"), "t4"),
    (("4090", "laptop"), None),
    (("4090 d",), None),
    (("4090",), "rtx4090"),
    (("v100",), "v100"),
    (("p100",), "p100"),
    (("k80",), "k80"),
)


def device_key(name: str, whole_words: bool = False) -> str | None:
    """The :data:`DEVICES` key of an accelerator by its reported name (``NVIDIA H100 80GB HBM3``,
    ``NVIDIA H100 PCIe``, ``NVIDIA A100-SXM4-40GB``, ...), or None for one not in the table;
    ``whole_words``: each part a whole word of the name (a name typed by a user: ``h100x`` is none)."""
    low = name.lower()
    words = set(re.split(r"[^a-z0-9]+", low))
    return next(
        (
            key
            for parts, key in _NAME_RULES
            if all((p in words) if whole_words else (p in low) for p in parts)
        ),
        None,
    )


def mfu_peak(name: str, precision: str, tf32: bool) -> tuple[float, str] | None:
    """Datasheet peak FLOP/s for MFU of a run in ``precision`` (fp32 | bf16 | fp16) on the device
    called ``name``, and its source; fp32 counts TF32 tensor cores only when ``tf32`` is on. None
    for a device not in the table."""
    key = device_key(name)
    if key is None:
        return None
    kind = "tf32" if precision == "fp32" and tf32 else precision
    return DEVICES[key].peak_flops(kind), f"datasheet {key} {kind} ({DEVICES[key].source})"


"""Known accelerators by name. ``achievable`` (sustained fraction of peak of a large GEMM inside a
training step, before tile/wave quantization) is not a datasheet number: A100 0.73 and H100 0.58
are fitted on the published runs (``loom plan validate --published --fit``; the H100 value on
llm-foundry's rows only), H200 follows H100, B200 0.70 and MI300X 0.55 are unvalidated
assumptions, V100/P100/K80 0.55 unvalidated assumptions (the cluster scheduler's mixed clusters), CPU 0.50; calibration (:class:`Profile`) replaces it with a measurement. ``sms``
(datasheet SM / CU counts) and ``flash_fwd`` / ``flash_bwd`` (FlashAttention-2 paper: ~65% / 50%
of peak on A100, ~37% / 30% on H100) feed the per-kernel model of :meth:`Machine.gemm` and
:meth:`Machine.attention`."""


def auto_precision(dev: DeviceSpec) -> str:
    """``train.precision = auto`` on ``dev`` as the trainer resolves it there
    (:func:`loom.device.resolve_precision`): bf16 with bf16 tensor cores, fp16 without, fp32 on the CPU."""
    return resolve_precision("auto", "cpu" if dev.name == "cpu" else "cuda", bf16=dev.bf16_flops > 0)


def get_device(name: str) -> DeviceSpec:
    """Look up a device by its key, or by a name as vendors and torch write it (``H100``, ``NVIDIA
    A100-SXM4-40GB``: :func:`device_key`); an unknown name lists the known ones."""
    low = name.strip().lower()
    key = low if low in DEVICES else device_key(low, whole_words=True)
    if key is None:
        words = set(re.split(r"[^a-z0-9]+", low))
        apart = any(k is None and all(p in words for p in parts) for parts, k in _NAME_RULES)
        why = " (a part whose datasheet differs from the table's: a calibration profile measures it)" * apart
        raise HardwareError(f"unknown device {name!r}{why}; known: {', '.join(DEVICES)}")
    return DEVICES[key]
