"""The job model: what a job is, how fast it runs on n devices of a type, and how useful a batch is.

A :class:`Job` is a model config plus a workload (sequences per step at its base batch ``M0``,
sequence length, precision) and an amount of work: ``samples`` sequences at batch ``M0``. Its
throughput (sequences/s) on ``n`` devices of type ``t`` at batch ``M`` comes either from the job's
own table (``throughput[t][n]``, measured or calibrated; independent of ``M``) or from Loom's planner:
``M / step_time`` of the fastest layout :func:`loom.plan.search` finds for ``n`` devices of ``t``
(nodes of ``devices_per_node``; the type's calibration profile when the cluster names one, else
its datasheet), cached per (model, workload, device, n, M, profile).

Statistical efficiency (Pollux, McCandlish et al. 2018): with gradient noise scale ``phi`` (B_noise,
in sequences), a step at batch ``M`` makes the progress of ``(phi + M) / (phi + M0)`` steps at
``M0`` while consuming ``M / M0`` times the samples, so each sample is worth

    E(M) = (phi + M0) / (phi + M)        (E(M0) = 1, decreasing in M)

of a base-batch sample, and goodput(n, M) = throughput(n, M) * E(M) base-batch samples/s. ``phi``
grows during training (Pollux, Fig. 2); here geometrically from ``gns`` to ``gns_final`` with the
fraction of work done. The learning rate for batch ``M`` follows :func:`scaled_lr`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from loom.config import ModelConfig, read_text_file
from loom.plan import ClusterSpec, PlanError, Profile, Workload, get_device, search
from loom.plan.hardware import contended

LrRule = Literal["sqrt", "adascale", "linear"]


class ClusterError(ValueError):
    """A bad cluster, trace or policy description; the message names the file and field."""


@dataclass(frozen=True)
class Job:
    """One training job of a trace (see docs/cluster.md for the file format)."""

    name: str
    arrival: float  # seconds from the trace's start
    samples: float  # work: sequences to train at the base batch (progress is counted in these)
    devices: int = 1  # devices the user asked for (fixed-allocation policies give exactly this)
    batch: int = 32  # base global batch M0, sequences per step
    max_batch: int = 0  # largest batch Pollux may use; 0 = 16 * batch
    seq_len: int = 1024
    precision: str = "fp16"
    model: ModelConfig | None = None  # planner-based throughput (None: ``throughput`` must be given)
    # device type -> devices -> sequences/s (a calibration or measurement; wins over the planner)
    throughput: dict[str, dict[int, float]] = field(default_factory=dict)
    gns: float = 0.0  # gradient noise scale B_noise at the start, sequences (0 = no efficiency loss modelled)
    gns_final: float = 0.0  # B_noise at the end (0 = gns)
    lr: float = 3e-4  # learning rate at the base batch

    @property
    def batch_cap(self) -> int:
        return self.max_batch or 16 * self.batch

    def phi(self, done: float) -> float:
        """B_noise when the fraction ``done`` of the work is done (geometric from gns to gns_final)."""
        if self.gns <= 0:
            return math.inf
        end = self.gns_final or self.gns
        return self.gns * (end / self.gns) ** min(max(done, 0.0), 1.0)

    def efficiency(self, batch: float, done: float = 0.0) -> float:
        """E(M) = (phi + M0) / (phi + M): base-batch samples one sample at batch M is worth."""
        phi = self.phi(done)
        return 1.0 if math.isinf(phi) else (phi + self.batch) / (phi + batch)


def gns_from_metrics(path: str | Path) -> float:
    """B_noise of a run logged with ``train.log_gns``: mean(gns_trace) / mean(gns_g2) over the rows of
    its metrics.jsonl (``path``: the file or the run directory); the ratio of means, as single rows
    are noisy (McCandlish et al. average numerator and denominator separately)."""
    p = Path(path)
    p = p / "metrics.jsonl" if p.is_dir() else p
    if not p.is_file():
        raise ClusterError(f"{p}: no metrics.jsonl (a run trained with --train.log_gns true)")
    pairs = []
    lines = read_text_file(p, str(p), ClusterError).splitlines()
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line) if line.strip() else {}
        except ValueError:
            if i == len(lines):  # a torn last line (the run killed mid-write): dropped, as the trainer does
                continue
            raise ClusterError(f"{p}:{i}: not a JSON row of metrics") from None
        if not isinstance(row, dict) or "gns_g2" not in row or "gns_trace" not in row:
            continue
        pair = (row["gns_trace"], row["gns_g2"])
        if not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in pair
        ):
            raise ClusterError(f"{p}:{i}: gns_trace and gns_g2 must be finite numbers, got {pair!r}")
        pairs.append(pair)
    if not pairs:
        raise ClusterError(f"{p}: no gns_g2/gns_trace rows (train with --train.log_gns true)")
    g2 = sum(g for _, g in pairs) / len(pairs)
    if g2 <= 0:
        raise ClusterError(f"{p}: mean gns_g2 {g2:g} <= 0: too few or too noisy rows for a noise scale")
    return max(0.0, sum(t for t, _ in pairs) / len(pairs) / g2)


def scaled_lr(job: Job, batch: int, rule: LrRule = "adascale", done: float = 0.0) -> float:
    """Learning rate at batch M from the base (lr0, M0); S = M / M0.

    linear: lr0 S; sqrt: lr0 sqrt(S); adascale: lr0 r with AdaScale's gain
    r = (phi/M0 + 1) / (phi/M + 1) = S (phi + M0) / (phi + M) (r -> S for phi >> M, -> 1 for phi << M0).
    """
    s = batch / job.batch
    if rule == "linear":
        return job.lr * s
    if rule == "sqrt":
        return job.lr * math.sqrt(s)
    phi = job.phi(done)
    return job.lr * (s if math.isinf(phi) else s * (phi + job.batch) / (phi + batch))


_STEP_TIMES: dict[
    tuple, float
] = {}  # (repr(model), batch, seq_len, precision, device, n, per_node, profile) -> s


def planner_step_time(
    model: ModelConfig,
    batch: int,
    seq_len: int,
    precision: str,
    device: str,
    n: int,
    per_node: int,
    profile: str = "",
) -> float:
    """Step time (s) of the fastest layout the planner finds for ``n`` devices of ``device``
    (``inf`` where nothing fits or the batch does not divide); cached, the search is not free.
    ``profile``: a ``loom plan calibrate`` profile (JSON path) replacing the datasheet, shared among
    ranks on the same cores as ``parallel.auto`` does (:func:`loom.plan.hardware.contended`)."""
    key = (repr(model), batch, seq_len, precision, device, n, per_node, profile)
    if key not in _STEP_TIMES:
        per = min(n, per_node)
        t = math.inf
        if n % per == 0:
            cluster = ClusterSpec.single_node(get_device(device), per, nodes=n // per)
            work = Workload(global_batch=batch, seq_len=seq_len, precision=precision)
            try:
                prof = Profile.load(profile) if profile else None
                if prof is not None and prof.device == "cpu":
                    prof = contended(prof, n)
                best = search(model, work, cluster, n, profile=prof).best
                t = best.step_time if best is not None else math.inf
            except (PlanError, ValueError):  # HardwareError: a precision the device lacks
                t = math.inf
        _STEP_TIMES[key] = t
    return _STEP_TIMES[key]


def throughput(
    job: Job, device: str, n: int, batch: int | None = None, per_node: int = 8, profile: str = ""
) -> float:
    """Sequences per second of ``job`` on ``n`` devices of type ``device`` at batch ``batch`` (0 where
    it cannot run): the job's table if it has one for ``device``, else the planner."""
    if n <= 0:
        return 0.0
    if job.throughput:
        row = job.throughput.get(device, {})
        return row.get(n, 0.0)
    if job.model is None:
        return 0.0
    b = batch or job.batch
    t = planner_step_time(job.model, b, job.seq_len, job.precision, device, n, per_node, profile)
    return 0.0 if math.isinf(t) else b / t


def batch_choices(job: Job, n: int) -> list[int]:
    """Batches Pollux considers on ``n`` devices: M0 * 2^k up to the cap (a table-driven job: M0 only,
    its throughput does not depend on the batch)."""
    if job.throughput or job.model is None:
        return [job.batch]
    out, b = [], job.batch
    while b <= job.batch_cap:
        out.append(b)
        b *= 2
    return out


def goodput(
    job: Job, device: str, n: int, done: float = 0.0, per_node: int = 8, profile: str = ""
) -> tuple[float, int]:
    """max over M of throughput(n, M) * E(M), and the batch M that reaches it (Pollux)."""
    best, best_b = 0.0, job.batch
    for b in batch_choices(job, n):
        g = throughput(job, device, n, b, per_node, profile) * job.efficiency(b, done)
        if g > best * (1 + 1e-9):
            best, best_b = g, b
    return best, best_b
