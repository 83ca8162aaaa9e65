"""Hardware the planner reasons about: accelerator specs, clusters (TOML), calibration profiles (JSON).

Units are SI throughout: bytes, FLOP/s, bytes/s, seconds. Memory capacities are written in GiB
because that is what vendors' HBM "GB" mean (an "A100 80GB" reports 81920 MiB, an "H100 80GB"
81559 MiB usable; H200 141, B200 180 and MI300X 192 likewise binary); bandwidths and FLOP rates
are decimal (GB/s, TFLOP/s) as datasheets print them. A :class:`DeviceSpec` holds vendor
datasheet numbers (dense, i.e. without 2:4 sparsity); a :class:`ClusterSpec` arranges
``nodes x devices_per_node`` of one device with an intra-node link (NVLink/xGMI/loopback) and an
inter-node link (per-device NIC share); a :class:`Profile` carries what calibration measured on a
real machine and, when given, overrides the datasheet numbers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GEMM_K0: float = 256  # reduction steps a GEMM tile's prologue + epilogue cost (pipeline fill and drain; fitted, see achievable)
GB = 1e9
GiB = 2**30
TFLOPS = 1e12
PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")


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
    runtime_overhead_bytes: float = 1.0 * GiB  # context + library workspaces + comm buffers (assumption)
    sms: int = 0  # streaming multiprocessors (compute units) that GEMM tiles spread over; 0 = no wave model
    tile: tuple[int, int] = (
        128,
        256,
    )  # output tile (rows, cols) of one GEMM thread block (cuBLAS/CUTLASS bf16)
    flash_fwd: float = 0.0  # sustained fraction of peak of a flash-attention forward kernel (0 = achievable)
    flash_bwd: float = 0.0  # same, backward (counted as 2.5x the forward's FLOPs)
    nic_bandwidth: float = 50 * GB  # inter-node bandwidth per device per direction of its reference node
    # (DGX A100: one 200 Gb/s HDR HCA per GPU = 25 GB/s; DGX H100/H200/B200: one 400 Gb/s NDR = 50 GB/s)
    op_overhead: float = (
        0.0  # framework cost per executed operator (Python, dispatch, autograd), s; charged on
    )
    # top of FLOPs and bytes where the host waits for each op (CPUs); 0 = hidden behind queued kernels (GPUs)
    microbatch_overhead: float = (
        0.0  # the trainer's cost per block and micro-batch beyond the model's operators
    )
    # (saved-tensor and gradient hooks, views), once more per micro-batch for the rest, s (loom plan calibrate --config)
    optimizer_rates: tuple[
        tuple[str, float], ...
    ] = ()  # (train.optimizer, shard elements/s of one step) where
    # its arithmetic, not its bytes, sets the time (CPUs; absent: bytes / memory bandwidth)
    comm_overlap: float = (
        0.8  # share of overlapped data-parallel traffic truly hidden: the rest slows compute (assumption;
    )
    # 0 on CPU: gloo runs on the same cores that compute, so nothing is hidden)
    source: str = ""  # the datasheet the numbers come from

    def peak_flops(self, precision: str) -> float:
        """Peak dense FLOP/s in ``precision``; a precision the device lacks raises :class:`HardwareError`.

        ``fp32`` means true FP32 math (PyTorch's default matmul precision); ask for ``tf32``
        to count TF32 tensor cores.
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
_CPU = (
    "this machine: Intel Xeon (Emerald Rapids, KVM), 2 cores, AVX-512 with 2 FMA units/core "
    "(Intel 64 and IA-32 Optimization Reference Manual): 2.3 GHz * 64 FP32 FLOP/cycle per core; "
    "AVX512_BF16 doubles that; one rank pinned to one core"
)

DEVICES: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        # A100: 19.5 TF FP32, 156 TF TF32, 312 TF BF16/FP16 (dense); NVLink 3 600 GB/s total.
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
            source=_NV_A100,
        ),
        # H100 SXM: 67 TF FP32, 494.5 TF32, 989.5 BF16/FP16, 1979 FP8 (dense = half the
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
            source=_NV_H100,
        ),
        # H100 PCIe: 51 TF FP32, 378 TF32, 756 BF16/FP16, 1513 FP8; HBM2e 2.0 TB/s; GPUs of a
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
            source=_NV_H200,
        ),
        # B200 (HGX B200 / 8): 1440 GB -> 180 GB, 64 TB/s -> 8 TB/s, FP32 75 TF, TF32 1.1 PF,
        # BF16/FP16 2.25 PF, FP8 4.5 PF dense; NVLink 5 1.8 TB/s total.
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
            source=_NV_B200,
        ),
        # MI300X: 192 GB HBM3 at 5.3 TB/s; 163.4 TF FP32 (matrix), 653.7 TF32, 1307.4 BF16/FP16,
        # 2614.9 FP8 dense; 7 Infinity Fabric links x 64 GB/s per direction = 448 GB/s.
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
            source=_AMD_MI300X,
        ),
        # This CPU, per rank (one core): 147 GFLOP/s FP32, 294 BF16 (AVX512_BF16), no TF32/FP8;
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
            source=_CPU,
        ),
    )
}


# (substrings of torch.cuda.get_device_name, all required, lower case) -> DEVICES key, first match
# wins; None: a part whose name contains a known one but whose datasheet differs (H100 NVL: 94 GB,
# other clocks; GH200 / GB200: Grace superchips), so it is measured, not given another part's peak.
_NAME_RULES: tuple[tuple[tuple[str, ...], str | None], ...] = (
    (("h100", "nvl"), None),
    (("gh200",), None),
    (("gb200",), None),
    (("h100", "pcie"), "h100-pcie"),
    (("h100",), "h100-sxm"),
    (("h200",), "h200"),
    (("b200",), "b200"),
    (("a100", "40gb"), "a100-40g"),
    (("a100",), "a100-80g"),
    (("mi300x",), "mi300x"),
)


def device_key(name: str) -> str | None:
    """The :data:`DEVICES` key of an accelerator by its reported name (``NVIDIA H100 80GB HBM3``,
    ``NVIDIA H100 PCIe``, ``NVIDIA A100-SXM4-40GB``, ...), or None for one not in the table."""
    low = name.lower()
    return next((key for parts, key in _NAME_RULES if all(p in low for p in parts)), None)


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
assumptions, CPU 0.50; calibration (:class:`Profile`) replaces it with a measurement. ``sms``
(datasheet SM / CU counts) and ``flash_fwd`` / ``flash_bwd`` (FlashAttention-2 paper: ~65% / 50%
of peak on A100, ~37% / 30% on H100) feed the per-kernel model of :meth:`Machine.gemm` and
:meth:`Machine.attention`."""


def get_device(name: str) -> DeviceSpec:
    """Look up a device by name; an unknown name lists the known ones."""
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise HardwareError(f"unknown device {name!r}; known: {', '.join(DEVICES)}") from None


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes x devices_per_node`` identical devices; bandwidths per device, per direction."""

    name: str
    device: DeviceSpec
    nodes: int
    devices_per_node: int
    intra_bandwidth: float  # bytes/s per direction between devices of a node
    intra_latency: float  # seconds per message hop inside a node
    inter_bandwidth: float  # bytes/s per direction per device across nodes (its NIC share)
    inter_latency: float  # seconds per message hop across nodes
    host_bandwidth: float = 25 * GB  # device <-> host memory (PCIe) per direction, for offload
    comm_efficiency: float = 0.8  # achievable fraction of link bandwidth for ring collectives

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def memory_bytes(self) -> float:
        return self.device.memory_bytes

    @classmethod
    def single_node(cls, device: str | DeviceSpec, devices: int, nodes: int = 1, **kw: Any) -> ClusterSpec:
        """A cluster from a device name with datasheet links and the device's reference NIC share
        (``nic_bandwidth``: 25 GB/s per A100 of a DGX A100, 50 GB/s per Hopper/Blackwell GPU)."""
        dev = device if isinstance(device, DeviceSpec) else get_device(device)
        args: dict[str, Any] = dict(
            name=f"{dev.name}:{nodes}x{devices}",
            device=dev,
            nodes=nodes,
            devices_per_node=devices,
            intra_bandwidth=dev.link_bandwidth,
            intra_latency=5e-6,
            inter_bandwidth=dev.nic_bandwidth,
            inter_latency=10e-6,
        )
        args.update(kw)
        spec = cls(**args)
        spec.validate()
        return spec

    def validate(self) -> None:
        for name in ("nodes", "devices_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise HardwareError(f"cluster.{name}: must be a positive integer, got {v!r}")
        for name in ("intra_bandwidth", "inter_bandwidth", "host_bandwidth"):
            if not getattr(self, name) > 0:
                raise HardwareError(f"cluster.{name}: must be > 0, got {getattr(self, name)!r}")
        for name in ("intra_latency", "inter_latency"):
            if not getattr(self, name) >= 0:
                raise HardwareError(f"cluster.{name}: must be >= 0, got {getattr(self, name)!r}")
        if not 0 < self.comm_efficiency <= 1:
            raise HardwareError(f"cluster.comm_efficiency: must be in (0, 1], got {self.comm_efficiency!r}")


# TOML keys of [cluster] -> (unit multiplier, ClusterSpec field). Bandwidths are written in GB/s,
# latencies in microseconds, memory in GiB: the units datasheets and nccl-tests print.
_TOML_KEYS: dict[str, tuple[float, str]] = {
    "intra_bandwidth_gbps": (GB, "intra_bandwidth"),
    "intra_latency_us": (1e-6, "intra_latency"),
    "inter_bandwidth_gbps": (GB, "inter_bandwidth"),
    "inter_latency_us": (1e-6, "inter_latency"),
    "host_bandwidth_gbps": (GB, "host_bandwidth"),
    "comm_efficiency": (1.0, "comm_efficiency"),
}
_DEVICE_OVERRIDES = {"memory_gib": GiB, "achievable": 1.0}


def cluster_from_dict(data: dict[str, Any], name: str = "cluster") -> ClusterSpec:
    """Build a :class:`ClusterSpec` from the parsed TOML ``{"cluster": {...}}``.

    Required: ``device`` (a name in :data:`DEVICES`), ``nodes``, ``devices_per_node``. Optional:
    ``intra_bandwidth_gbps`` (default: the device's link), ``intra_latency_us`` (5),
    ``inter_bandwidth_gbps`` (the device's ``nic_bandwidth``: 25 A100, 50 others), ``inter_latency_us`` (10),
    ``host_bandwidth_gbps`` (25), ``comm_efficiency`` (0.8), ``memory_gib`` and ``achievable``
    (override the device's). Unknown keys are rejected, naming the key.
    """
    if set(data) != {"cluster"} or not isinstance(data["cluster"], dict):
        extra = sorted(set(data) - {"cluster"})
        raise HardwareError(f"{name}: expected one [cluster] table" + (f", found {extra}" if extra else ""))
    table = dict(data["cluster"])
    allowed = {"name", "device", "nodes", "devices_per_node", *_TOML_KEYS, *_DEVICE_OVERRIDES}
    for key in table:
        if key not in allowed:
            raise HardwareError(f"cluster.{key}: unknown key; allowed: {', '.join(sorted(allowed))}")
    for key in ("device", "nodes", "devices_per_node"):
        if key not in table:
            raise HardwareError(f"cluster.{key}: missing (required: device, nodes, devices_per_node)")
    if not isinstance(table["device"], str):
        raise HardwareError(f"cluster.device: expected a device name, got {table['device']!r}")
    dev = get_device(table["device"])
    overrides: dict[str, Any] = {}  # DeviceSpec fields (all float) -> value
    for key, unit in _DEVICE_OVERRIDES.items():
        if key in table:
            v = table[key]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise HardwareError(f"cluster.{key}: must be a positive number, got {v!r}")
            overrides["memory_bytes" if key == "memory_gib" else key] = float(v) * unit
    if overrides.get("achievable", 0.5) > 1:
        raise HardwareError(f"cluster.achievable: must be in (0, 1], got {table['achievable']!r}")
    if overrides:
        dev = dataclasses.replace(dev, **overrides)
    kw: dict[str, Any] = {}
    for key, (unit, fname) in _TOML_KEYS.items():
        if key in table:
            v = table[key]
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise HardwareError(f"cluster.{key}: expected a number, got {v!r}")
            kw[fname] = float(v) * unit
    for key in ("nodes", "devices_per_node"):
        v = table[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise HardwareError(f"cluster.{key}: must be a positive integer, got {v!r}")
    return ClusterSpec.single_node(
        dev, table["devices_per_node"], table["nodes"], name=str(table.get("name", name)), **kw
    )


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read a cluster TOML file (see :func:`cluster_from_dict` for the keys)."""
    p = Path(path)
    if not p.is_file():
        raise HardwareError(f"cluster file {str(p)!r} does not exist")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise HardwareError(f"cluster file {str(p)!r} is not valid TOML: {e}") from None
    return cluster_from_dict(data, name=p.stem)


CLUSTER_DIR = Path(__file__).resolve().parents[1] / "configs" / "clusters"


def known_clusters() -> list[str]:
    return sorted(p.stem for p in CLUSTER_DIR.glob("*.toml"))


def resolve_cluster(spec: str) -> ClusterSpec:
    """A cluster from a TOML path, a name in ``loom/configs/clusters``, or ``DEVICE:NODESxPER`` (``h100-sxm:8x8``)."""
    p = Path(spec)
    if p.suffix == ".toml" or p.is_file():
        return load_cluster(p)
    if (CLUSTER_DIR / f"{spec}.toml").is_file():
        return load_cluster(CLUSTER_DIR / f"{spec}.toml")
    if ":" in spec:
        dev, _, shape = spec.partition(":")
        nodes, sep, per = shape.partition("x")
        if not (sep and nodes.isdigit() and per.isdigit()):
            raise HardwareError(f"cluster {spec!r}: expected DEVICE:NODESxPER, e.g. h100-sxm:8x8")
        return ClusterSpec.single_node(dev, int(per), int(nodes))
    raise HardwareError(
        f"unknown cluster {spec!r}; known: {', '.join(known_clusters())}, a .toml path, "
        f"or DEVICE:NODESxPER with DEVICE in {', '.join(DEVICES)}"
    )


CALL_KINDS = ("tp", "ep")  # the calls Profile.call_overhead prices: tensor- and expert-parallel layers


@dataclass(frozen=True)
class CollectiveFit:
    """A measured collective: time(bytes) = latency + bytes / bus_bandwidth for this group size."""

    op: str  # all_reduce | all_gather | reduce_scatter | all_to_all | p2p
    scope: str  # intra (inside a node, between compute) | inter (across nodes) | synced (intra, back to back:
    # the ranks already in step, as at the step-end scalars or a pipeline receiver waiting for its input) |
    # cpu, cpu synced (intra and synced: the CPU seconds the calling process spends rather than the wall time)
    group_size: int
    bus_bandwidth: float  # bytes/s of the ring-normalised ("bus") bandwidth, as nccl-tests reports
    latency: float  # seconds
    world: int = 0  # ranks running at once when measured (groups side by side); 0 = group_size


@dataclass
class Profile:
    """Calibration of one machine; any field given replaces the datasheet number it measures."""

    device: str  # DeviceSpec name it was measured on
    gemm_flops: dict[str, float] = field(default_factory=dict)  # precision -> sustained FLOP/s
    hbm_bandwidth: float = 0.0  # measured copy bandwidth, bytes/s (0 = use the spec)
    compute_share: dict[str, float] = field(default_factory=dict)  # ranks at once -> speed vs alone
    comm_overlap: dict[str, float] = field(
        default_factory=dict
    )  # ranks at once -> share of an async collective hidden
    backward_ratio: float = 0.0  # measured backward / forward time of the model (0 = 2, the FLOP ratio)
    moe_imbalance: float = 0.0  # a MoE config's calibration run: its moe_imbalance metric (0 = not measured)
    op_overhead: dict[str, float] = field(default_factory=dict)  # precision -> seconds per ATen operator
    microbatch_overhead: float = (
        0.0  # the trainer's cost per block and micro-batch outside the counted operators, s
    )
    optimizer_rate: dict[str, float] = field(
        default_factory=dict
    )  # train.optimizer -> shard elements/s of a step
    collectives: list[CollectiveFit] = field(default_factory=list)
    # seconds a tp or ep call costs through Loom's layers beyond its collective fit (autograd functions, buffers,
    # the counts' round trip, waits), wall and CPU, by kind ("tp", "ep"): loom.plan.calibrate.layer_call_excess
    call_overhead: dict[str, float] = field(default_factory=dict)
    call_overhead_cpu: dict[str, float] = field(default_factory=dict)

    def collective(
        self, op: str, scope: str, group_size: int, world: int | None = None
    ) -> CollectiveFit | None:
        """The fit for ``op`` in ``scope`` with the nearest measured group size, then the nearest
        job size ``world`` (ranks sharing the machine change a collective's cost on CPUs)."""
        fits = [c for c in self.collectives if c.op == op and c.scope == scope]
        if not fits:
            fits = [c for c in self.collectives if c.op == "all_reduce" and c.scope == scope]
        if not fits:
            return None

        def distance(c: CollectiveFit) -> tuple[int, int, int, int]:
            w = c.world or c.group_size
            return abs(c.group_size - group_size), abs(w - world) if world else 0, -c.group_size, -w

        return min(fits, key=distance)

    def cpu_twin(self) -> Profile | None:
        """This profile with each collective's *CPU* time (scope ``cpu``: the seconds its process spends,
        gloo's threads and the kernel's socket copies) in place of its wall time, nothing hidden, so a
        cost model on it sums a rank's CPU demand; None without ``cpu`` fits (GPUs, older profiles).

        A call's CPU is its own work: the fit of the job with the fewest ranks at once counts (the
        group alone). Groups side by side in step on shared cores measured less (0.3-0.4 ms a call
        here with 4 ranks on 2 cores) than the trainer spends there (0.6 ms, as with 2 ranks)."""
        alone: dict[tuple[str, str, int], CollectiveFit] = {}
        for c in sorted(self.collectives, key=lambda c: -(c.world or c.group_size)):
            if c.scope in ("cpu", "cpu synced"):
                alone[(c.op, c.scope, c.group_size)] = c
        if not alone:
            return None
        fits = [
            dataclasses.replace(c, scope="intra" if c.scope == "cpu" else "synced") for c in alone.values()
        ]
        # hidden or not, a call spends its CPU, and in its layer the layer's CPU
        return dataclasses.replace(
            self, collectives=fits, comm_overlap={"1": 0.0}, call_overhead=dict(self.call_overhead_cpu)
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise HardwareError(f"profile: not valid JSON: {e}") from None
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise HardwareError(f"profile.{key}: unknown key; allowed: {', '.join(sorted(known))}")
        if "device" not in data:
            raise HardwareError("profile.device: missing")
        for prec in data.get("gemm_flops", {}):
            if prec not in PRECISIONS:
                raise HardwareError(f"profile.gemm_flops.{prec}: unknown precision; allowed: {PRECISIONS}")
        try:
            fits = [CollectiveFit(**c) for c in data.get("collectives", [])]
        except TypeError as e:
            raise HardwareError(f"profile.collectives: {e}") from None

        def number(key: str) -> float:
            value = data.get(key, 0.0)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
            ):
                raise HardwareError(f"profile.{key}: must be a finite number >= 0, got {value!r}")
            return float(value)

        def numbers(key: str) -> dict[str, float]:
            table = data.get(key, {})
            if not isinstance(table, dict):
                raise HardwareError(f"profile.{key}: must be a table of numbers, got {table!r}")
            out = {}
            for k, v in table.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise HardwareError(f"profile.{key}.{k}: must be a finite number >= 0, got {v!r}")
                out[str(k)] = float(v)
            return out

        for key in ("call_overhead", "call_overhead_cpu"):
            for kind in data.get(key, {}) if isinstance(data.get(key), dict) else ():
                if kind not in CALL_KINDS:
                    raise HardwareError(
                        f"profile.{key}.{kind}: unknown kind; allowed: {', '.join(CALL_KINDS)}"
                    )
        return cls(
            device=data["device"],
            gemm_flops=numbers("gemm_flops"),
            hbm_bandwidth=number("hbm_bandwidth"),
            compute_share=numbers("compute_share"),
            comm_overlap=numbers("comm_overlap"),
            backward_ratio=number("backward_ratio"),
            moe_imbalance=number("moe_imbalance"),
            op_overhead=numbers("op_overhead"),
            microbatch_overhead=number("microbatch_overhead"),
            optimizer_rate=numbers("optimizer_rate"),
            collectives=fits,
            call_overhead=numbers("call_overhead"),
            call_overhead_cpu=numbers("call_overhead_cpu"),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        p = Path(path)
        if not p.is_file():
            raise HardwareError(f"profile file {str(p)!r} does not exist")
        return cls.from_json(p.read_text())


COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


class Machine:
    """Throughputs the cost model uses, from a cluster's specs or, where measured, a :class:`Profile`.

    Compute: ``flops = gemm_flops[precision]`` from the profile, else ``peak * achievable``.
    Collectives on ``n`` devices of a message of ``S`` bytes (the full, unsharded buffer), with
    ``B`` the link bandwidth times ``comm_efficiency`` and ``l`` the per-hop latency (ring
    algorithms, as in the NCCL bus-bandwidth convention)::

        all_reduce      2 (n-1)/n * S / B + 2 (n-1) l
        all_gather      (n-1)/n * S / B + (n-1) l       (S = gathered size)
        reduce_scatter  (n-1)/n * S / B + (n-1) l       (S = input size)
        all_to_all      (n-1)/n * S / B + (n-1) l       (S = bytes one device holds)
        p2p             S / B + l

    A group whose ranks span more than one node (``span > devices_per_node``) uses the
    inter-node link; a measured fit replaces ``B`` by its bus bandwidth and the latency term by
    its latency.
    """

    def __init__(self, cluster: ClusterSpec, precision: str, profile: Profile | None = None) -> None:
        self.cluster = cluster
        self.precision = precision
        self.profile = profile
        dev = cluster.device
        self.peak = dev.peak_flops(precision)
        measured = profile.gemm_flops.get(precision, 0.0) if profile else 0.0
        self.flops = measured if measured > 0 else self.peak * dev.achievable
        self.measured_gemm = measured > 0
        self.hbm = profile.hbm_bandwidth if profile and profile.hbm_bandwidth > 0 else dev.hbm_bandwidth
        self.call_overhead = (
            dict(profile.call_overhead) if profile else {}
        )  # kind (tp, ep) -> s added to each call
        measured_op = profile.op_overhead.get(precision, 0.0) if profile else 0.0
        self.op_time = measured_op if measured_op > 0 else dev.op_overhead  # s per ATen operator
        self.microbatch_overhead = (
            profile.microbatch_overhead
            if profile and profile.microbatch_overhead
            else dev.microbatch_overhead
        )
        self.optimizer_rates = dict(dev.optimizer_rates) | (profile.optimizer_rate if profile else {})
        self._overlap = profile.comm_overlap if profile else {}

        eff = cluster.comm_efficiency
        self._links = {
            "intra": (cluster.intra_bandwidth * eff, cluster.intra_latency),
            "inter": (cluster.inter_bandwidth * eff, cluster.inter_latency),
        }

    def comm_overlap(self, world: int) -> float:
        """Share of a collective's time hidden when it runs beside compute: measured at the nearest job size, else the device's."""
        if not self._overlap:
            return self.cluster.device.comm_overlap
        return self._overlap[min(self._overlap, key=lambda w: (abs(int(w) - world), -int(w)))]

    def inter_bandwidth(self, n: int, span: int) -> float:
        """Bus bandwidth of a ring collective over ``n`` ranks spread evenly over the nodes that
        ``span`` consecutive ranks cover: NCCL runs one ring per NIC, each crossing every node
        boundary once, so the k = n / nodes members of a node share their k NICs and the bus
        bandwidth is k times one device's NIC share (nccl-tests: ~8 x 25 GB/s on 8 x HDR DGX A100
        nodes), never above the intra-node link (times comm_efficiency, as every link here)."""
        per = self.cluster.devices_per_node
        nodes = max(1, -(-span // per))
        k = max(1.0, min(per, n / nodes))
        intra, _ = self._links["intra"]
        return min(intra, k * self._links["inter"][0])

    def alpha_beta(self, n: int, span: int) -> tuple[float, float]:
        """(α seconds per round, β seconds per byte) of one link of a group of ``n`` ranks covering
        ``span`` consecutive ranks: the latency and bandwidth :meth:`collective` uses without a profile."""
        scope = self.scope(span)
        bw, lat = self._links[scope]
        if scope == "inter":
            bw = self.inter_bandwidth(n, span)
        return lat, 1.0 / bw

    def scope(self, span: int) -> str:
        """``intra`` if a group whose ranks cover ``span`` consecutive ranks stays in one node."""
        return "intra" if span <= self.cluster.devices_per_node else "inter"

    def collective(
        self, op: str, n: int, size: float, span: int, world: int | None = None, synced: bool = False
    ) -> float:
        """Seconds for ``op`` over ``n`` devices on a message of ``size`` bytes (see class doc),
        in a job of ``world`` ranks (picks the profile's fit measured nearest that job size);
        ``synced``: a call between ranks already in step (the profile's back-to-back fit, if any)."""
        if n <= 1 or size <= 0:
            return 0.0
        scope = self.scope(span)
        bw, lat = self._links[scope]
        if scope == "inter":
            bw = self.inter_bandwidth(n, span)
        fit = self._fit(op, scope, n, world, synced)
        if op == "all_reduce":
            volume, hops = 2.0 * (n - 1) / n * size, 2 * (n - 1)
        elif op in ("all_gather", "reduce_scatter", "all_to_all"):
            volume, hops = (n - 1) / n * size, n - 1
        elif op == "p2p":
            volume, hops = size, 1
        else:
            raise HardwareError(f"collective op: must be one of {COLLECTIVE_OPS}, got {op!r}")
        if fit is not None:
            return fit.latency + volume / fit.bus_bandwidth
        return hops * lat + volume / bw

    def _fit(self, op: str, scope: str, n: int, world: int | None, synced: bool) -> CollectiveFit | None:
        """The profile's fit; ``synced`` (ranks already in step) prefers a back-to-back measurement."""
        if self.profile is None:
            return None
        if synced and scope == "intra":
            fit = self.profile.collective(op, "synced", n, world)
            if fit is not None and fit.op == op:
                return fit
        return self.profile.collective(op, scope, n, world)

    def latency(self, op: str, n: int, span: int, world: int | None = None, synced: bool = False) -> float:
        """Fixed cost of one call of ``op`` over ``n`` devices (the size-independent part)."""
        if n <= 1:
            return 0.0
        scope = self.scope(span)
        fit = self._fit(op, scope, n, world, synced)
        if fit is not None:
            return fit.latency
        hops = {"all_reduce": 2 * (n - 1), "p2p": 1}.get(op, n - 1)
        return hops * self._links[scope][1]

    def gemm(self, m: float, k: float, n: float, elem_bytes: float, batch: float = 1) -> float:
        """Time of an (m x k) @ (k x n) product: the larger of its compute and its HBM traffic
        ``elem_bytes (mk + kn + mn) / HBM`` (the roofline).

        Compute, on a device with ``sms`` > 0 and no measured GEMM rate: the output is cut into
        ``tiles = ceil(m / tm) ceil(n / tn)`` blocks of the device's tile (tm, tn) — shrunk to the
        power of two (>= 16) covering m or n when that is smaller, as a library picks a smaller
        tile for a skinny product; they run in
        ``waves = ceil(tiles / sms)`` rounds, each round one tile per SM at the sustained rate
        ``peak * achievable / sms``, over ``k + GEMM_K0`` steps (the main loop plus its prologue
        and epilogue)::

            t = waves * 2 tm tn (k + GEMM_K0) / (peak * achievable / sms)

        (``batch`` independent products share the waves), which is ``2mkn / (peak * achievable)`` times the tile quantization (padded edges), the
        wave quantization (a last, partly idle round) and ``(k + K0) / k``: thin tensor-parallel
        slices and small hidden sizes run below large square products. Otherwise (CPU, or a
        calibrated rate) ``2mkn / flops``.
        """
        memory = batch * elem_bytes * (m * k + k * n + m * n) / self.hbm
        sms = self.cluster.device.sms
        if sms <= 0 or self.measured_gemm:
            return max(2.0 * batch * m * k * n / self.flops, memory)
        tm, tn = (
            min(t, max(16, 2 ** math.ceil(math.log2(max(d, 1)))))
            for t, d in zip(self.cluster.device.tile, (m, n))
        )
        tiles = math.ceil(batch - 1e-9) * math.ceil(m / tm - 1e-9) * math.ceil(n / tn - 1e-9)
        waves = math.ceil(tiles / sms - 1e-9)
        return max(waves * 2.0 * tm * tn * (k + GEMM_K0) * sms / self.flops, memory)

    def attention(self, flops: float, backward: bool) -> float:
        """Seconds of a flash-attention kernel of ``flops`` at the device's flash efficiency (its
        ``flash_fwd`` / ``flash_bwd`` share of peak; the GEMM rate when not given or measured)."""
        dev = self.cluster.device
        share = dev.flash_bwd if backward else dev.flash_fwd
        return flops / (self.peak * share if share > 0 and not self.measured_gemm else self.flops)
