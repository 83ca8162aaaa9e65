"""Calibration profiles: what ``loom plan calibrate`` measured on a real machine (JSON); any field
given replaces the datasheet number it measures."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from loom.config import read_text_file
from loom.plan.hardware.datasheets import PRECISIONS, DeviceSpec, HardwareError

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
    # the trainer's cost per block and micro-batch outside the counted operators, s
    microbatch_overhead: float = 0.0
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
        if not isinstance(data, dict):
            raise HardwareError(
                f"profile: must be a JSON object of measured fields, got {type(data).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise HardwareError(f"profile.{key}: unknown key; allowed: {', '.join(sorted(known))}")
        if "device" not in data:
            raise HardwareError("profile.device: missing")
        if not isinstance(data["device"], str):
            raise HardwareError(f"profile.device: must be a device name, got {data['device']!r}")
        for prec in data.get("gemm_flops", {}) if isinstance(data.get("gemm_flops"), dict) else ():
            if prec not in PRECISIONS:
                raise HardwareError(f"profile.gemm_flops.{prec}: unknown precision; allowed: {PRECISIONS}")
        entries = data.get("collectives", [])
        if not isinstance(entries, list):
            raise HardwareError(
                f"profile.collectives: must be a list of measured collectives, got {entries!r}"
            )
        fits = [_collective(c, i) for i, c in enumerate(entries)]

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
        return cls.from_json(read_text_file(p, f"profile file {str(p)!r}", HardwareError))


# CollectiveFit fields -> (type, smallest value allowed, 0 excluded)
_FIT_FIELDS: dict[str, tuple[type, float, bool]] = {
    "op": (str, 0, False),
    "scope": (str, 0, False),
    "group_size": (int, 1, False),
    "bus_bandwidth": (float, 0, True),
    "latency": (float, 0, False),
    "world": (int, 0, False),
}


def _collective(entry: object, i: int) -> CollectiveFit:
    """``profile.collectives[i]`` as a :class:`CollectiveFit`, each field of its type (numbers finite,
    not below their least value); a bad one is one :class:`HardwareError` line naming it."""
    at = f"profile.collectives[{i}]"
    if not isinstance(entry, dict):
        raise HardwareError(f"{at}: must be an object with {', '.join(_FIT_FIELDS)}, got {entry!r}")
    for key, value in entry.items():
        if key not in _FIT_FIELDS:
            raise HardwareError(f"{at}.{key}: unknown key; allowed: {', '.join(_FIT_FIELDS)}")
        kind, least, strict = _FIT_FIELDS[key]
        if kind is str:
            if not isinstance(value, str):
                raise HardwareError(f"{at}.{key}: must be a string, got {value!r}")
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        whole = isinstance(value, int) or kind is float
        if not (number and whole and math.isfinite(value) and (value > least if strict else value >= least)):
            what = "a whole number" if kind is int else "a finite number"
            raise HardwareError(
                f"{at}.{key}: must be {what} {'>' if strict else '>='} {least:g}, got {value!r}"
            )
    missing = [k for k in ("op", "scope", "group_size", "bus_bandwidth", "latency") if k not in entry]
    if missing:
        raise HardwareError(f"{at}: missing {', '.join(missing)}")
    return CollectiveFit(**entry)


def cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def contended(profile: Profile, world: int, n_cores: int | None = None) -> Profile:
    """``profile`` with compute and memory bandwidth scaled by the measured compute share of
    ``world`` ranks (:func:`~loom.plan.calibrate.measure_contention`), else by ``cores / world`` when ranks outnumber cores."""
    share = profile.compute_share.get(str(world)) or min(1.0, (n_cores or cores()) / max(1, world))
    return dataclasses.replace(
        profile,
        gemm_flops={k: v * share for k, v in profile.gemm_flops.items()},
        hbm_bandwidth=profile.hbm_bandwidth * share,
        op_overhead={k: v / share for k, v in profile.op_overhead.items()},
        optimizer_rate={k: v * share for k, v in profile.optimizer_rate.items()},
        microbatch_overhead=profile.microbatch_overhead / share,
        call_overhead={
            k: v / share for k, v in profile.call_overhead.items()
        },  # the layers' own work, on shared cores
        call_overhead_cpu={k: v / share for k, v in profile.call_overhead_cpu.items()},
        # a collective's CPU work takes the same shared cores as compute
        collectives=[
            dataclasses.replace(c, latency=c.latency / share, bus_bandwidth=c.bus_bandwidth * share)
            if c.scope.startswith("cpu")
            else c
            for c in profile.collectives
        ],
    )


def datasheet_profile(spec: DeviceSpec) -> Profile:
    """``spec``'s own numbers (peak x achievable, memory bandwidth, per-op cost) as a profile, so
    :func:`contended` can scale them for ranks sharing cores when nothing was measured."""
    rates = {
        p: getattr(spec, f"{p}_flops") * spec.gemm_share(p)
        for p in PRECISIONS
        if getattr(spec, f"{p}_flops", 0) > 0
    }
    return Profile(
        device=spec.name,
        gemm_flops=rates,
        hbm_bandwidth=spec.hbm_bandwidth,
        op_overhead=dict.fromkeys(rates, spec.op_overhead) if spec.op_overhead > 0 else {},
        optimizer_rate=dict(spec.optimizer_rates),
    )
