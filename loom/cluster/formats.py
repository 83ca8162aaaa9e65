"""Cluster and trace files (TOML or JSON, docs/cluster.md), the default mixed cluster, synthetic traces.

Cluster file::

    [cluster]
    devices = { v100 = 36, p100 = 36, k80 = 36 }   # device type -> count
    devices_per_node = 4                           # planner nodes (default 4)
    round_s = 360                                  # Gavel's scheduling round (default 360 s)
    restart_s = 15                                 # lost per placement change: checkpoint + resume (default 15 s)
    profiles = { cpu = "profile.json" }            # optional: a type's loom plan calibrate profile

Trace file: ``[[jobs]]`` tables (TOML) or ``{"jobs": [...]}`` (JSON), each with ``arrival_s`` and
``samples``, and either ``model`` (a preset name of loom/configs, or a table of ModelConfig fields) or
``throughput`` (device type -> {devices: sequences/s}); optional ``name``, ``devices``, ``batch``,
``max_batch``, ``seq_len``, ``precision``, ``gns`` (sequences, or the path of a run trained with
``train.log_gns``: its measured B_noise), ``gns_final``, ``lr``. Every error is one line
naming the file and the field, raised before anything is simulated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom.cluster.jobs import ClusterError, Job, gns_from_metrics, throughput
from loom.config import ModelConfig, read_text_file
from loom.numbers import is_whole
from loom.plan import DEVICES, HardwareError, Profile

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class Cluster:
    """Device types and counts, and the simulator's round and restart costs."""

    devices: dict[str, int]
    devices_per_node: int = 4
    round_s: float = 360.0
    restart_s: float = 15.0
    profiles: dict[str, str] = field(
        default_factory=dict
    )  # device type -> loom plan calibrate profile (JSON)

    def profile(self, device: str) -> str:
        return self.profiles.get(device, "")

    @property
    def types(self) -> list[str]:
        return list(self.devices)

    @property
    def total(self) -> int:
        return sum(self.devices.values())


DEFAULT_CLUSTER = Cluster({"v100": 36, "p100": 36, "k80": 36})  # Gavel's simulated mixed cluster


def _read(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    text = read_text_file(p, str(p), ClusterError)
    try:
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ClusterError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {e}") from None
    if not isinstance(data, dict):
        raise ClusterError(f"{p}: expected a table at the top level")
    return data


def _num(where: str, v: Any, *, lo: float = 0.0, strict: bool = True, integer: bool = False) -> Any:
    ok = isinstance(v, int if integer else (int, float)) and not isinstance(v, bool)
    if not ok or not math.isfinite(v) or (v <= lo if strict else v < lo):
        kind = "an integer" if integer else "a number"
        raise ClusterError(f"{where}: expected {kind} {'>' if strict else '>='} {lo:g}, got {v!r}")
    return v


def cluster_from_dict(data: dict[str, Any], where: str = "cluster") -> Cluster:
    """A :class:`Cluster` from ``{"cluster": {...}}`` (module doc); unknown keys and device types refused."""
    table = data.get("cluster")
    if set(data) != {"cluster"} or not isinstance(table, dict):
        raise ClusterError(f"{where}: expected one [cluster] table, found {sorted(data)}")
    allowed = {"devices", "devices_per_node", "round_s", "restart_s", "profiles"}
    for key in table:
        if key not in allowed:
            raise ClusterError(f"{where}: cluster.{key}: unknown key; allowed: {', '.join(sorted(allowed))}")
    devs = table.get("devices")
    if not isinstance(devs, dict) or not devs:
        raise ClusterError(
            f"{where}: cluster.devices: expected a table of device type -> count, got {devs!r}"
        )
    for name, n in devs.items():
        if name not in DEVICES:
            raise ClusterError(
                f"{where}: cluster.devices.{name}: unknown device type; known: {', '.join(DEVICES)}"
            )
        _num(f"{where}: cluster.devices.{name}", n, integer=True)
    kw: dict[str, Any] = {}
    if "devices_per_node" in table:
        kw["devices_per_node"] = _num(
            f"{where}: cluster.devices_per_node", table["devices_per_node"], integer=True
        )
    for key in ("round_s", "restart_s"):
        if key in table:
            kw[key] = float(_num(f"{where}: cluster.{key}", table[key], strict=key == "round_s"))
    profiles = table.get("profiles", {})
    if not isinstance(profiles, dict):
        raise ClusterError(f"{where}: cluster.profiles: expected a table of device type -> profile path")
    for name, path in profiles.items():
        if name not in devs:
            raise ClusterError(f"{where}: cluster.profiles.{name}: not a device type of cluster.devices")
        try:
            Profile.load(path)
        except (HardwareError, ValueError) as e:
            raise ClusterError(f"{where}: cluster.profiles.{name}: {e}") from None
    return Cluster(dict(devs), profiles=dict(profiles), **kw)


def load_cluster(path: str | Path) -> Cluster:
    return cluster_from_dict(_read(path), str(path))


_JOB_KEYS = {
    "name",
    "arrival_s",
    "samples",
    "devices",
    "batch",
    "max_batch",
    "seq_len",
    "precision",
    "model",
    "throughput",
    "gns",
    "gns_final",
    "lr",
}


def _model(where: str, v: Any, seq_len: int) -> ModelConfig:
    """A preset's model, or a table of ModelConfig fields (vocab_size 32000 and max_seq_len the job's
    seq_len unless given) checked by ``config.validate`` as ``loom train`` would."""
    from loom import config as C

    if isinstance(v, str):
        if v not in C.presets():
            raise ClusterError(f"{where}: unknown preset {v!r}; presets: {', '.join(C.presets())}")
        return C.load(v, []).model
    if isinstance(v, dict):
        names = {f.name for f in dataclasses.fields(ModelConfig)}
        for k in v:
            if k not in names:
                raise ClusterError(f"{where}.{k}: not a ModelConfig field")
        fields = {"vocab_size": 32000, "max_seq_len": seq_len, **v}
        try:
            cfg = C.from_dict({"model": fields, "data": {"seq_len": seq_len}})
            C.validate(cfg, 1)
        except C.ConfigError as e:
            raise ClusterError(f"{where}: {e}") from None
        return cfg.model
    raise ClusterError(f"{where}: expected a preset name or a table of model fields, got {v!r}")


MAX_ARRIVAL_S = 1e9


def job_from_dict(d: Any, i: int, where: str) -> Job:
    """One ``jobs[i]`` entry (module doc)."""
    at = f"{where}: jobs[{i}]"
    if not isinstance(d, dict):
        raise ClusterError(f"{at}: expected a table, got {d!r}")
    for key in d:
        if key not in _JOB_KEYS:
            jobs = " (a --jobs file of cluster run? a trace's jobs give samples and a model)" * (
                key in ("config", "steps", "overrides")
            )
            raise ClusterError(f"{at}.{key}: unknown key; allowed: {', '.join(sorted(_JOB_KEYS))}{jobs}")
    for key in ("arrival_s", "samples"):
        if key not in d:
            raise ClusterError(f"{at}.{key}: missing (required: arrival_s, samples, and model or throughput)")
    if "model" not in d and "throughput" not in d:
        raise ClusterError(f"{at}: give model (planner throughput) or throughput (a table)")
    arrival = float(_num(f"{at}.arrival_s", d["arrival_s"], strict=False))
    if arrival > MAX_ARRIVAL_S:  # beyond it a round's step no longer moves the clock (float spacing)
        raise ClusterError(f"{at}.arrival_s: at most {MAX_ARRIVAL_S:.0e} s (about 30 years), got {arrival:g}")
    if "name" in d and (not isinstance(d["name"], str) or not d["name"].strip()):
        raise ClusterError(f"{at}.name: expected a non-empty string, got {d['name']!r}")
    kw: dict[str, Any] = {
        "name": str(d.get("name", f"job{i}")),
        "arrival": arrival,
        "samples": float(_num(f"{at}.samples", d["samples"])),
    }
    for key in ("devices", "batch", "max_batch", "seq_len"):
        if key in d:
            kw[key] = _num(f"{at}.{key}", d[key], integer=True, strict=key != "max_batch")
    if isinstance(d.get("gns"), str):  # a run logged with train.log_gns: its measured noise scale
        try:
            d = {**d, "gns": gns_from_metrics(d["gns"])}
        except ClusterError as e:
            raise ClusterError(f"{at}.gns: {e}") from None
    for key in ("gns", "gns_final"):
        if key in d:
            kw[key] = float(_num(f"{at}.{key}", d[key], strict=False))
    if "lr" in d:
        kw["lr"] = float(_num(f"{at}.lr", d["lr"]))
    if "precision" in d:
        if d["precision"] not in ("fp32", "tf32", "bf16", "fp16"):
            raise ClusterError(f"{at}.precision: one of fp32, tf32, bf16, fp16, got {d['precision']!r}")
        kw["precision"] = d["precision"]
    if "model" in d:
        kw["model"] = _model(f"{at}.model", d["model"], kw.get("seq_len", 1024))
    if "throughput" in d:
        table = d["throughput"]
        if not isinstance(table, dict) or not table:
            raise ClusterError(f"{at}.throughput: expected device type -> {{devices: sequences/s}}")
        for dev in table:  # a trace may list types a cluster lacks, but not types that do not exist
            if dev not in DEVICES:
                raise ClusterError(f"{at}.throughput.{dev}: unknown device type; known: {', '.join(DEVICES)}")
        out: dict[str, dict[int, float]] = {}
        for dev, row in table.items():
            if not isinstance(row, dict):
                raise ClusterError(f"{at}.throughput.{dev}: expected {{devices: sequences/s}}, got {row!r}")
            out[dev] = {}
            for n, v in row.items():
                if not is_whole(str(n)) or int(n) < 1:
                    raise ClusterError(f"{at}.throughput.{dev}: device count {n!r} is not a positive integer")
                out[dev][int(n)] = float(_num(f"{at}.throughput.{dev}.{n}", v, strict=False))
        kw["throughput"] = out
    return Job(**kw)


def load_trace(path: str | Path) -> list[Job]:
    data = _read(path)
    if set(data) != {"jobs"} or not isinstance(data["jobs"], list) or not data["jobs"]:
        raise ClusterError(f"{path}: expected a non-empty jobs list ([[jobs]] tables), found {sorted(data)}")
    jobs: list[Job] = []
    for i, d in enumerate(data["jobs"]):
        job = job_from_dict(d, i, str(path))
        if any(j.name == job.name for j in jobs):
            raise ClusterError(f"{path}: jobs[{i}].name: {job.name!r} is already the name of another job")
        if job.max_batch and job.max_batch < job.batch:
            raise ClusterError(
                f"{path}: jobs[{i}].max_batch: {job.max_batch} is below its batch {job.batch} (the largest "
                "batch the scheduler may give it; 0 = 16 x batch)"
            )
        jobs.append(job)
    return jobs


def check_runnable(jobs: list[Job], cluster: Cluster, where: str) -> None:
    """Every job can run on some device type of the cluster at its requested size (else one line)."""
    for i, job in enumerate(jobs):
        if job.devices > max(cluster.devices.values()):
            raise ClusterError(
                f"{where}: jobs[{i}].devices: {job.devices} exceeds the largest device pool "
                f"({max(cluster.devices.values())}) of the cluster"
            )
        if not any(
            throughput(job, t, job.devices, per_node=cluster.devices_per_node, profile=cluster.profile(t)) > 0
            for t in cluster.types
        ):
            raise ClusterError(
                f"{where}: jobs[{i}] ({job.name}): no throughput on {job.devices} devices of any of "
                f"{', '.join(cluster.types)} (a throughput table for these types, or a model that fits)"
            )


# The synthetic job mix: Loom models whose speed ratios across V100/P100/K80 differ (fp16 GEMMs gain
# most from V100 tensor cores; fp32 and small, bandwidth-bound jobs gain less), like Gavel's mix of
# ResNets, Transformers, recommendation and RL jobs. (name, ModelConfig fields, seq_len, precision, batch)
JOB_MIX: tuple[tuple[str, dict[str, Any], int, str, int], ...] = (
    ("gpt-125m-fp16", dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=12), 1024, "fp16", 32),
    ("gpt-125m-fp32", dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=12), 1024, "fp32", 32),
    ("llama-350m-fp16", dict(dim=1024, n_layers=24, n_heads=16, n_kv_heads=8), 1024, "fp16", 32),
    ("small-fp32", dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4), 256, "fp32", 64),
    ("long-ctx-fp16", dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=8), 4096, "fp16", 8),
    ("wide-fp32", dict(dim=1536, n_layers=8, n_heads=12, n_kv_heads=12), 512, "fp32", 32),
)
SCALES = ((1, 0.70), (2, 0.10), (4, 0.15), (8, 0.05))  # devices requested, probability


def synthetic_trace(
    n_jobs: int = 60,
    jobs_per_hour: float = 6.0,
    seed: int = 0,
    reference: str = "v100",
    vocab: int = 32000,
    short: tuple[float, float] = (1.5, 3.0),
    long: tuple[float, float] = (3.0, 4.0),
    long_share: float = 0.2,
) -> list[Job]:
    """Poisson arrivals (``jobs_per_hour``), a model drawn from :data:`JOB_MIX`, devices from
    :data:`SCALES`, and a run time on ``devices`` of ``reference`` of 10^x minutes, x uniform on
    ``short`` [1.5, 3] (80%) or ``long`` [3, 4] (``long_share`` 20%) (Gavel's synthetic
    distribution); work = run time x throughput.
    B_noise is drawn log-uniform in [M0, 16 M0] and grows 8x over the run (Pollux's observation)."""
    rng = random.Random(seed)
    jobs: list[Job] = []
    t = 0.0
    for i in range(n_jobs):
        if i:
            t += rng.expovariate(jobs_per_hour / 3600.0)
        name, fields, seq, prec, batch = JOB_MIX[rng.randrange(len(JOB_MIX))]
        r, acc, devices = rng.random(), 0.0, 1
        for n, p in SCALES:
            acc += p
            if r < acc:
                devices = n
                break
        lo, hi = long if rng.random() < long_share else short
        minutes = 10 ** rng.uniform(lo, hi)
        model = ModelConfig(vocab_size=vocab, max_seq_len=seq, **fields)
        job = Job(f"{name}#{i}", t, 1.0, devices, batch, 0, seq, prec, model)
        rate = throughput(job, reference, devices)
        gns = batch * 2 ** rng.uniform(0, 4)
        jobs.append(
            dataclasses.replace(job, samples=max(1.0, rate * minutes * 60), gns=gns, gns_final=8 * gns)
        )
    return jobs
