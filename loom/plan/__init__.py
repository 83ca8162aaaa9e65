"""The planner: predict memory and speed of parallel layouts, search the best, check fit before launch.

hardware  DeviceSpec, ClusterSpec (TOML), Profile (JSON calibration), Machine (throughputs)
cost      Layout, Workload, Estimate, estimate(), CostModel: the formulas
search    search(): every valid layout of a world size that fits, fastest first
report    tables and breakdowns as text, check_fit() before launch
published ``loom plan validate --published``: the model against published runs (validation/*.toml)
cli       ``loom plan``
"""

from loom.plan.cost import (
    CostModel,
    Estimate,
    Layout,
    PlanError,
    Workload,
    bubble_fraction,
    estimate,
    param_count,
)
from loom.plan.hardware import (
    DEVICES,
    ClusterSpec,
    DeviceSpec,
    HardwareError,
    Profile,
    get_device,
    load_cluster,
    resolve_cluster,
)
from loom.plan.report import check_fit, format_breakdown, format_search, format_table
from loom.plan.search import SearchResult, search

__all__ = [
    "DEVICES",
    "ClusterSpec",
    "CostModel",
    "DeviceSpec",
    "Estimate",
    "HardwareError",
    "Layout",
    "PlanError",
    "Profile",
    "SearchResult",
    "Workload",
    "bubble_fraction",
    "check_fit",
    "estimate",
    "format_breakdown",
    "format_search",
    "format_table",
    "get_device",
    "load_cluster",
    "param_count",
    "resolve_cluster",
    "search",
]
