"""Clusters: ``nodes x devices_per_node`` of one :class:`~loom.plan.hardware.datasheets.DeviceSpec`
with an intra-node and an inter-node link, from TOML files (``loom/configs/clusters``) or
``DEVICE:NODESxPER``."""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.config import read_text_file
from loom.numbers import is_whole
from loom.plan.hardware.datasheets import DEVICES, GB, DeviceSpec, GiB, HardwareError, get_device

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


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
        if self.world_size > MAX_DEVICES:
            raise HardwareError(
                f"cluster: {self.nodes} nodes x {self.devices_per_node} devices = {self.world_size:,} devices; "
                f"the planner takes at most {MAX_DEVICES:,}"
            )
        for name in ("intra_bandwidth", "inter_bandwidth", "host_bandwidth"):
            if not getattr(self, name) > 0:
                raise HardwareError(f"cluster.{name}: must be > 0, got {getattr(self, name)!r}")
        for name in ("intra_latency", "inter_latency"):
            if not getattr(self, name) >= 0:
                raise HardwareError(f"cluster.{name}: must be >= 0, got {getattr(self, name)!r}")
        if not 0 < self.comm_efficiency <= 1:
            raise HardwareError(f"cluster.comm_efficiency: must be in (0, 1], got {self.comm_efficiency!r}")


MAX_DEVICES = 2**21  # devices one plan may span: ten times the largest clusters built (2026)

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
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < math.inf:
                raise HardwareError(f"cluster.{key}: must be a positive finite number, got {v!r}")
            overrides["memory_bytes" if key == "memory_gib" else key] = float(v) * unit
    if overrides.get("achievable", 0.5) > 1:
        raise HardwareError(f"cluster.achievable: must be in (0, 1], got {table['achievable']!r}")
    if overrides:
        dev = dataclasses.replace(dev, **overrides)
    kw: dict[str, Any] = {}
    for key, (unit, fname) in _TOML_KEYS.items():
        if key in table:
            v = table[key]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise HardwareError(f"cluster.{key}: expected a finite number, got {v!r}")
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
    text = read_text_file(p, f"cluster file {str(p)!r}", HardwareError)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise HardwareError(f"cluster file {str(p)!r} is not valid TOML: {e}") from None
    return cluster_from_dict(data, name=p.stem)


CLUSTER_DIR = Path(__file__).resolve().parents[2] / "configs" / "clusters"


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
        if not (sep and is_whole(nodes) and is_whole(per)):
            raise HardwareError(f"cluster {spec!r}: expected DEVICE:NODESxPER, e.g. h100-sxm:8x8")
        return ClusterSpec.single_node(dev, int(per), int(nodes))
    raise HardwareError(
        f"unknown cluster {spec!r}; known: {', '.join(known_clusters())}, a .toml path, "
        f"or DEVICE:NODESxPER with DEVICE in {', '.join(DEVICES)}"
    )
