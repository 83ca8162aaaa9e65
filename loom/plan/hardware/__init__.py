"""Hardware the planner reasons about: accelerator specs, clusters (TOML), calibration profiles (JSON).

Units are SI throughout: bytes, FLOP/s, bytes/s, seconds. Memory capacities are written in GiB
because that is what vendors' HBM "GB" mean (an "A100 80GB" reports 81920 MiB, an "H100 80GB"
81559 MiB usable; H200 141, B200 180 and MI300X 192 likewise binary); bandwidths and FLOP rates
are decimal (GB/s, TFLOP/s) as datasheets print them.

datasheets  :class:`DeviceSpec` (vendor datasheet numbers, dense: without 2:4 sparsity), :data:`DEVICES`
clusters    :class:`ClusterSpec`: ``nodes x devices_per_node`` of one device with an intra-node link
            (NVLink/xGMI/loopback) and an inter-node link (per-device NIC share), from TOML
profiles    :class:`Profile`: what calibration measured on a real machine; when given, it overrides
            the datasheet numbers (:func:`contended` shares it among ranks on the same cores)
machine     :class:`Machine`: the throughputs the cost model uses, from the two above

Inside this package modules import each other directly, never this ``__init__``.
"""

from loom.plan.hardware.clusters import (
    CLUSTER_DIR,
    MAX_DEVICES,
    ClusterSpec,
    cluster_from_dict,
    known_clusters,
    load_cluster,
    resolve_cluster,
)
from loom.plan.hardware.datasheets import (
    DEVICES,
    GB,
    GEMM_K0,
    PRECISIONS,
    TFLOPS,
    DeviceSpec,
    GiB,
    HardwareError,
    auto_precision,
    device_key,
    get_device,
    mfu_peak,
)
from loom.plan.hardware.machine import (
    COLLECTIVE_OPS,
    Machine,
)
from loom.plan.hardware.profiles import (
    CALL_KINDS,
    CollectiveFit,
    Profile,
    contended,
    cores,
    datasheet_profile,
)

__all__ = [
    "CALL_KINDS",
    "CLUSTER_DIR",
    "COLLECTIVE_OPS",
    "ClusterSpec",
    "CollectiveFit",
    "DEVICES",
    "DeviceSpec",
    "GB",
    "GEMM_K0",
    "GiB",
    "HardwareError",
    "MAX_DEVICES",
    "Machine",
    "PRECISIONS",
    "Profile",
    "TFLOPS",
    "auto_precision",
    "cluster_from_dict",
    "contended",
    "cores",
    "datasheet_profile",
    "device_key",
    "get_device",
    "known_clusters",
    "load_cluster",
    "mfu_peak",
    "resolve_cluster",
]
