"""``loom plan validate --published``: the planner against published large-scale training runs.

Each ``loom/plan/validation/*.toml`` file holds ``[models.NAME]`` shapes (:class:`ModelConfig`
fields) and ``[[runs]]``: ``name``, ``model``, ``stack`` (the training software, see
:data:`loom.plan.cost.STACKS`), ``cluster`` (``device``, ``devices_per_node``,
``inter_bandwidth_gbps`` per GPU, optional ``intra_bandwidth_gbps``), ``layout`` (a
:meth:`Layout.parse` line), ``global_batch``, ``seq_len``, ``precision`` (bf16), ``flash_attention``
(true), ``reduce_dtype`` (fp32), one measured throughput — ``tokens_per_s_per_gpu``,
``step_time_s``, or ``tflops_per_gpu`` with the ``tflops_formula`` the publication counted it with —
its ``source`` (paper, table, URL) and ``group``, the independent source it belongs to (default:
the file's name; leave-one-source-out holds a group out at once). Every row cites where its
numbers come from.

The comparison is on tokens/s per GPU (equivalently TFLOP/s per GPU under any one FLOP count: the
ratio is the same); the table prints TFLOP/s per GPU in Loom's count, hardware FLOPs with
recomputation (:class:`Estimate`). ``megatron`` is Narayanan et al. 2021's
``96 B s l h^2 (1 + s/6h + V/16lh)`` per step (full recomputation counted).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.config import ModelConfig
from loom.plan.cost import CostModel, Estimate, Layout, PlanError, Workload
from loom.plan.hardware import GB, ClusterSpec, HardwareError, get_device

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

VALIDATION_DIR = Path(__file__).resolve().parent / "validation"
MEAN_TOLERANCE = 0.05  # the goal on the public set: mean |error| <= 5%, max <= 12%
MAX_TOLERANCE = 0.12
_RUN_KEYS = {
    "name",
    "model",
    "stack",
    "cluster",
    "layout",
    "global_batch",
    "seq_len",
    "precision",
    "flash_attention",
    "reduce_dtype",
    "tokens_per_s_per_gpu",
    "step_time_s",
    "tflops_per_gpu",
    "tflops_formula",
    "source",
    "group",
    "note",
}
_MEASURES = ("tokens_per_s_per_gpu", "step_time_s", "tflops_per_gpu")


@dataclass(frozen=True)
class PublishedRun:
    """One published run: what ran, on what, and how fast (tokens/s per GPU)."""

    name: str
    model: ModelConfig
    stack: str
    cluster: ClusterSpec
    layout: Layout
    workload: Workload
    tokens_per_s_per_gpu: float  # the measurement, converted from what was published
    source: str
    file: str = ""
    group: str = ""  # the independent source (publication, team) leave-one-source-out holds out together

    @property
    def gpus(self) -> int:
        return self.layout.world_size


def megatron_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Narayanan et al. 2021's FLOPs per token with full recomputation: 96 l h^2 (1 + s/6h + V/16lh)."""
    h, L = m.dim, m.n_layers
    return 96.0 * L * h * h * (1 + seq_len / (6 * h) + m.vocab_size / (16 * L * h))


def _run(row: dict[str, Any], models: dict[str, ModelConfig], where: str) -> PublishedRun:
    name = row.get("name", "?")
    at = f"{where}: run {name!r}"
    for key in row:
        if key not in _RUN_KEYS:
            raise PlanError(f"{at}: unknown key {key!r}; allowed: {', '.join(sorted(_RUN_KEYS))}")
    for key in ("name", "model", "stack", "cluster", "layout", "global_batch", "seq_len", "source"):
        if key not in row:
            raise PlanError(f"{at}: missing {key!r}")
    if row["model"] not in models:
        raise PlanError(f"{at}: model {row['model']!r} not among [models.*] ({', '.join(models)})")
    given = [k for k in _MEASURES if k in row]
    if len(given) != 1:
        raise PlanError(f"{at}: give exactly one of {', '.join(_MEASURES)}")
    model = models[row["model"]]
    lay = Layout.parse(row["layout"])
    cl = dict(row["cluster"])
    per = int(cl.pop("devices_per_node", 8))
    try:
        dev = get_device(cl.pop("device"))
        kw = {"inter_bandwidth": float(cl.pop("inter_bandwidth_gbps")) * GB}
        if "intra_bandwidth_gbps" in cl:
            kw["intra_bandwidth"] = float(cl.pop("intra_bandwidth_gbps")) * GB
    except (KeyError, HardwareError) as e:
        raise PlanError(f"{at}: cluster: {e}") from None
    if cl:
        raise PlanError(f"{at}: cluster: unknown keys {sorted(cl)}")
    nodes = -(-lay.world_size // per)
    cluster = ClusterSpec.single_node(dev, per, nodes, name=f"{dev.name}:{nodes}x{per}", **kw)
    w = Workload(
        global_batch=int(row["global_batch"]),
        seq_len=int(row["seq_len"]),
        precision=row.get("precision", "bf16"),
        fp8_layers="all",  # Transformer Engine's FP8 runs every block Linear in float8
        reduce_dtype=row.get("reduce_dtype", "fp32"),
        flash_attention=bool(row.get("flash_attention", True)),
    )
    tokens = w.global_batch * w.seq_len
    if "tokens_per_s_per_gpu" in row:
        tps = float(row["tokens_per_s_per_gpu"])
    elif "step_time_s" in row:
        tps = tokens / float(row["step_time_s"]) / lay.world_size
    else:
        if row.get("tflops_formula") != "megatron":
            raise PlanError(f'{at}: tflops_per_gpu needs tflops_formula = "megatron" (the only one known)')
        tps = float(row["tflops_per_gpu"]) * 1e12 / megatron_flops_per_token(model, w.seq_len)
    group = str(row.get("group", Path(where).stem))
    return PublishedRun(
        str(name), model, str(row["stack"]), cluster, lay, w, tps, str(row["source"]), where, group
    )


def load_file(path: Path) -> list[PublishedRun]:
    data = tomllib.loads(path.read_text())
    models = {}
    for key, fields in data.get("models", {}).items():
        try:
            models[key] = ModelConfig(**fields)
        except TypeError as e:
            raise PlanError(f"{path.name}: models.{key}: {e}") from None
    return [_run(row, models, path.name) for row in data.get("runs", [])]


def load_runs(directory: Path = VALIDATION_DIR) -> list[PublishedRun]:
    """Every run of every ``*.toml`` in ``directory``, in file then row order."""
    return [r for p in sorted(directory.glob("*.toml")) for r in load_file(p)]


@dataclass
class PublishedComparison:
    run: PublishedRun
    estimate: Estimate

    @property
    def predicted_tokens(self) -> float:
        return self.estimate.tokens_per_s / self.run.gpus

    @property
    def error(self) -> float:
        """(predicted - published) / published, on tokens/s per GPU (= on TFLOP/s per GPU)."""
        return self.predicted_tokens / self.run.tokens_per_s_per_gpu - 1

    @property
    def published_tflops(self) -> float:
        """The published throughput in Loom's FLOP count (the estimate's hardware FLOPs per token)."""
        return self.estimate.tflops_per_device * self.run.tokens_per_s_per_gpu / self.predicted_tokens


def predict(run: PublishedRun) -> Estimate:
    """The planner's estimate of ``run``'s layout (its validity checked as for any layout)."""
    cm = CostModel(run.model, run.workload, run.cluster, stack=run.stack)
    return cm.estimate(run.layout)


def compare_published(runs: list[PublishedRun] | None = None) -> list[PublishedComparison]:
    return [PublishedComparison(r, predict(r)) for r in (load_runs() if runs is None else runs)]


def summary(rows: list[PublishedComparison]) -> tuple[float, float]:
    """(mean |error|, max |error|)."""
    errs = [abs(r.error) for r in rows]
    return sum(errs) / len(errs), max(errs)


def format_published(rows: list[PublishedComparison]) -> str:
    head = ("run", "GPUs", "layout", "pred TFLOP/s", "publ TFLOP/s", "error", "mem GiB")
    cells = [head] + [
        (
            r.run.name,
            str(r.run.gpus),
            r.run.layout.short() + f" mb{r.run.layout.micro_batch} {r.run.layout.recompute}",
            f"{r.estimate.tflops_per_device:.1f}",
            f"{r.published_tflops:.1f}",
            f"{100 * r.error:+.1f}%",
            f"{r.estimate.memory / 2**30:.0f}",
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) if i in (0, 2) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if rows:
        mean, worst = summary(rows)
        lines.append(
            f"{len(rows)} published runs: mean |error| {100 * mean:.1f}%, max {100 * worst:.1f}% "
            f"(goal {100 * MEAN_TOLERANCE:.0f}% / {100 * MAX_TOLERANCE:.0f}%)"
        )
    return "\n".join(lines)


def sources(rows: list[PublishedRun]) -> str:
    return "\n".join(f"- {r.name}: {r.source}" for r in rows)
