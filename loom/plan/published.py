"""``loom plan validate --published``: the planner against published large-scale training runs.

Each ``loom/plan/validation/*.toml`` file holds ``[models.NAME]`` shapes (:class:`ModelConfig`
fields) and ``[[runs]]``: ``name``, ``model``, ``stack`` (the training software, see
:data:`loom.plan.cost.STACKS`; a name of one in :data:`~loom.plan.cost.stacks.STACK_ALIASES`, any
other is ``other``), ``cluster`` (``device``, ``devices_per_node``,
optional ``inter_bandwidth_gbps``, GB/s per GPU, default the device's reference node's NIC share
(``DeviceSpec.nic_bandwidth``: 25 per A100, 50 per Hopper or Blackwell GPU), optional
``intra_bandwidth_gbps``), ``layout`` (a
:meth:`Layout.parse` line), ``global_batch``, ``seq_len``, ``precision`` (bf16), ``flash_attention``
(true), ``compile`` (false: true for a step under ``torch.compile``), ``reduce_dtype`` (fp32),
``expert_tensor_parallel`` and ``moe_weighting`` (an MoE run's, see below), ``fused_cross_entropy``
(false) and ``recompute_modules`` (none; see below), one measured throughput — ``tokens_per_s_per_gpu``, the whole job's
``tokens_per_s`` or ``samples_per_s`` (sequences), ``step_time_s``, ``tflops_per_gpu`` or ``mfu`` (a share of the device's dense bf16 peak, as Llama 3
and torchtitan report it), the last two with the ``tflops_formula`` the publication counted FLOPs
with (:data:`TFLOPS_FORMULAS`) — its ``source`` (paper, table, URL) and ``group``, the independent
source it belongs to (default: the file's name; leave-one-source-out holds a group out at once).
Every row cites where its numbers come from.

``expert_tensor_parallel``, the ranks an MoE's experts are cut over (Megatron-Core's
``expert_tensor_parallel_size``): 1 is Megatron-Core's MoE parallel folding, its ``ep`` drawn from
tp x dp x cp and each rank's experts its own (:attr:`Workload.expert_folding`); the layout's tp (> 1)
splits every expert over tp as the dense MLP (``Layout.expert_tp = "split"``, the layout line's
``etp``); any other value is refused. Left out, a Megatron-Core row (stack ``megatron-core`` or an
alias: NeMo, Megatron-Bridge, Megatron-LM) of an MoE under tp > 1 is priced split: Megatron-Core
sets ``expert_tensor_parallel_size`` to the tensor-parallel size when it is not given (and split
experts over tp before it had the option), so its published MoE runs that do not name it ran split
(the DGX Cloud Grok-1 rows: with experts whole on each of the tp4 ranks they were predicted at
about 100 GiB per 80 GiB GPU). Rows of other stacks left out keep the layout line's experts
(whole on every tp rank, Loom's default, unless it says ``etp``).

``moe_weighting``, where an MoE's routing weights multiply the expert rows (:attr:`Workload.moe_weighting`):
``output`` (the default: each row's output as it returns, kept for the weight's gradient, as Loom and
Megatron-Core before 0.13 do) or ``activation`` (Megatron-Core 0.13+, April 2025: inside the fused
weighted GLU, which keeps its input and a 4-byte weight per row; only on a stack whose MoE layer is
Megatron-Core's, :attr:`~loom.plan.cost.stacks.Stack.moe_saves`). A row cites the Megatron-Core version it ran.

``fused_cross_entropy`` (false): the run's loss is a fused in-place cross entropy that keeps only the
logits, their gradient written over them (Transformer Engine's ``parallel_cross_entropy``, Megatron-Core's
``cross_entropy_fusion_impl = "te"``: :attr:`Workload.fused_cross_entropy`); not on Loom's stack.
``recompute_modules`` (none): single modules whose outputs the run discards in forward and recomputes
in backward beside the layout's policy (Megatron-Core's ``recompute_modules`` under selective
granularity: ``moe_act``, ``layernorm``; :attr:`Workload.recompute_modules`), among those its stack
offers (:attr:`~loom.plan.cost.stacks.Stack.recompute_modules`); the layout's ``recompute:none`` then
means no attention core recomputed (Megatron-Bridge replaces the default ``core_attn`` with the list).

The comparison is on tokens/s per GPU (equivalently TFLOP/s per GPU under any one FLOP count: the
ratio is the same); the table prints TFLOP/s per GPU in Loom's count, hardware FLOPs with
recomputation (:class:`Estimate`). ``megatron`` is Narayanan et al. 2021's
``96 B s l h^2 (1 + s/6h + V/16lh)`` per step (full recomputation counted); ``palm`` is Chowdhery
et al. 2022's model FLOPs, 6 N + 12 L H Q T per token (Loom's own MFU count and torchtitan's); ``6n``
is its 6 N alone (Kaplan et al. 2020). N counts the matmul weights a token runs through (the head
included, the input embedding not; top_k of an MoE's routed experts).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from loom.config import (
    MAX_BATCH_OR_SEQ,
    ConfigError,
    ModelConfig,
    _check_finite,
    _check_model,
    from_dict,
    read_text_file,
)
from loom.model.llama import flops_per_token
from loom.plan.cost import CostModel, Estimate, Layout, PlanError, Workload
from loom.plan.cost.layout import MOE_WEIGHTINGS, MoeWeighting
from loom.plan.cost.params import ParamCounts
from loom.plan.cost.stacks import STACK_ALIASES, STACKS, resolve_stack
from loom.plan.hardware import GB, PRECISIONS, ClusterSpec, HardwareError, get_device

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

VALIDATION_DIR = Path(__file__).resolve().parent / "validation"
MEAN_TOLERANCE = 0.05  # the goal on the public set: mean |error| <= 5%, max <= 12%
MAX_TOLERANCE = 0.12
# [[runs]] keys and their TOML types (float: an integer or a float; every number finite and > 0)
_RUN_KEYS: dict[str, type] = {
    "name": str,
    "model": str,
    "stack": str,
    "cluster": dict,
    "layout": str,
    "global_batch": int,
    "seq_len": int,
    "precision": str,
    "flash_attention": bool,
    "compile": bool,
    "reduce_dtype": str,
    "expert_tensor_parallel": int,
    "moe_weighting": str,
    "fused_cross_entropy": bool,
    "recompute_modules": list,
    "tokens_per_s_per_gpu": float,
    "tokens_per_s": float,
    "samples_per_s": float,
    "step_time_s": float,
    "tflops_per_gpu": float,
    "mfu": float,
    "tflops_formula": str,
    "source": str,
    "group": str,
    "note": str,
}
_CLUSTER_KEYS: dict[str, type] = {
    "device": str,
    "devices_per_node": int,
    "inter_bandwidth_gbps": float,
    "intra_bandwidth_gbps": float,
}
# the whole job's tokens/s and sequences/s (Megatron's and DeepSpeed's "samples per second") too
_MEASURES = ("tokens_per_s_per_gpu", "tokens_per_s", "samples_per_s", "step_time_s", "tflops_per_gpu", "mfu")
TFLOPS_FORMULAS = ("megatron", "palm", "6n")  # how a tflops_per_gpu or mfu row counted its FLOPs


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


def counted_flops_per_token(m: ModelConfig, seq_len: int, formula: str, shared_experts: int = 0) -> float:
    """FLOPs per token as ``formula`` (:data:`TFLOPS_FORMULAS`) counts them: ``megatron`` (above),
    ``palm`` = 6 N_a + 12 L a d T (:func:`loom.model.llama.flops_per_token`, N_a the matmul weights a
    token runs through), ``6n`` = 6 N_a."""
    if formula == "megatron":
        return megatron_flops_per_token(m, seq_len)
    n_experts, top_k = (m.n_experts, m.top_k) if m.moe else (1, 1)
    counts = ParamCounts.of(m, n_experts, top_k, shared_experts)
    palm = flops_per_token(m, seq_len, counts.matmul, counts.experts, n_experts, top_k)
    return palm if formula == "palm" else palm - 12.0 * m.n_layers * m.n_heads * m.head_dim * seq_len


def _run(row: dict[str, Any], models: dict[str, ModelConfig], where: str) -> PublishedRun:
    name = row.get("name", "?")
    at = f"{where}: run {name!r}"
    _check_types(row, _RUN_KEYS, at)
    for key in ("name", "model", "stack", "cluster", "layout", "global_batch", "seq_len", "source"):
        if key not in row:
            raise PlanError(f"{at}: missing {key!r}")
    if not row["name"].strip():
        raise PlanError(f"{where}: run name: empty; each run needs a name of its own")
    if row["model"] not in models:
        raise PlanError(f"{at}: model {row['model']!r} not among [models.*] ({', '.join(models)})")
    given = [k for k in _MEASURES if k in row]
    if len(given) != 1:
        raise PlanError(f"{at}: give exactly one of {', '.join(_MEASURES)}")
    model = models[row["model"]]
    cl = dict(row["cluster"])
    _check_types(cl, _CLUSTER_KEYS, f"{at}: cluster")
    for key in ("device",):
        if key not in cl:
            raise PlanError(f"{at}: cluster: missing {key!r}")
    per = int(cl.get("devices_per_node", 8))
    try:
        lay = Layout.parse(row["layout"], "layout")
        dev = get_device(cl["device"])
        kw = {}  # unstated: the device's reference node's NIC share (DeviceSpec.nic_bandwidth)
        if "inter_bandwidth_gbps" in cl:
            kw["inter_bandwidth"] = float(cl["inter_bandwidth_gbps"]) * GB
        if "intra_bandwidth_gbps" in cl:
            kw["intra_bandwidth"] = float(cl["intra_bandwidth_gbps"]) * GB
        if lay.world_size > per and lay.world_size % per:  # ceil would add devices the run did not have
            raise PlanError(
                f"cluster: devices_per_node = {per} does not divide the layout's {lay.world_size} devices "
                "(whole nodes, or part of one)"
            )
        nodes = -(-lay.world_size // per)
        cluster = ClusterSpec.single_node(dev, per, nodes, name=f"{dev.name}:{nodes}x{per}", **kw)
        w = Workload(
            global_batch=row["global_batch"],
            seq_len=row["seq_len"],
            precision=row.get("precision", "bf16"),
            fp8_layers="all",  # Transformer Engine's FP8 runs every block Linear in float8
            reduce_dtype=row.get("reduce_dtype", "fp32"),
            flash_attention=row.get("flash_attention", True),
            compile=row.get("compile", False),
            expert_folding=row.get("expert_tensor_parallel") == 1,
            moe_weighting=_moe_weighting(row, model),
            fused_cross_entropy=_fused_cross_entropy(row),
            recompute_modules=_recompute_modules(row),
        )
        lay = _expert_layout(row, model, lay)
        if w.precision not in (
            *PRECISIONS,
            "auto",
        ):  # the run's key, before the cost model names train.precision
            raise PlanError(
                f"precision: must be one of {', '.join(PRECISIONS)} (the Linears' GEMMs), got {w.precision!r}"
            )
    except (PlanError, HardwareError) as e:
        raise PlanError(f"{at}: {e}") from None
    for key in ("global_batch", "seq_len"):  # as a config's train.global_batch and data.seq_len
        if row[key] > MAX_BATCH_OR_SEQ:
            raise PlanError(f"{at}: {key}: at most {MAX_BATCH_OR_SEQ:,} (2^24), got {row[key]:,}")
    tokens = w.global_batch * w.seq_len
    if "tokens_per_s_per_gpu" in row:
        tps = float(row["tokens_per_s_per_gpu"])
    elif "tokens_per_s" in row:
        tps = float(row["tokens_per_s"]) / lay.world_size
    elif "samples_per_s" in row:
        tps = float(row["samples_per_s"]) * w.seq_len / lay.world_size
    elif "step_time_s" in row:
        tps = tokens / float(row["step_time_s"]) / lay.world_size
    else:
        formula = row.get("tflops_formula")
        if formula not in TFLOPS_FORMULAS:
            raise PlanError(
                f"{at}: {given[0]} needs tflops_formula, one of {', '.join(repr(f) for f in TFLOPS_FORMULAS)}"
                f" (how the publication counted FLOPs), got {formula!r}"
            )
        per_token = counted_flops_per_token(model, w.seq_len, formula, w.moe_shared)
        if "mfu" in row and not row["mfu"] <= 1:
            raise PlanError(f"{at}: mfu is a share of the device's bf16 peak, at most 1, got {row['mfu']!r}")
        flops = (
            float(row["tflops_per_gpu"]) * 1e12 if "tflops_per_gpu" in row else row["mfu"] * dev.bf16_flops
        )
        tps = flops / per_token
    if "tflops_formula" in row and given[0] not in ("tflops_per_gpu", "mfu"):
        raise PlanError(f"{at}: tflops_formula applies to tflops_per_gpu or mfu, not {given[0]}")
    measure = given[0]
    if not (math.isfinite(tps) and tps > 0):  # a finite measure whose tokens/s is not (step_time_s = 1e-320)
        raise PlanError(
            f"{at}: {measure} = {row[measure]!r} gives {tps!r} tokens/s per GPU, not a finite number > 0"
        )
    group = str(row.get("group", Path(where).stem))
    stack = resolve_stack(str(row["stack"]))[0]
    return PublishedRun(str(name), model, stack, cluster, lay, w, tps, str(row["source"]), where, group)


def _expert_layout(row: dict[str, Any], model: ModelConfig, lay: Layout) -> Layout:
    """``lay`` with the experts of the row's ``expert_tensor_parallel`` (module doc): 1 folds them
    (the workload's), tp > 1 splits them, left out a Megatron-Core MoE row under tp > 1 splits them;
    a value that is neither, or one the model or stack cannot take, is one :class:`PlanError` line."""
    etp, stack = row.get("expert_tensor_parallel"), resolve_stack(str(row["stack"]))[0]
    moe = model.n_experts > 1
    if etp is None:
        split = moe and lay.tp > 1 and stack == "megatron-core"  # Megatron-Core's default: tp
        return dataclasses.replace(lay, expert_tp="split") if split else lay
    if etp not in (1, lay.tp):
        raise PlanError(
            f"expert_tensor_parallel: must be 1 (Megatron-Core's MoE parallel folding) or the layout's "
            f"tp = {lay.tp} (experts split over tp), got {etp}"
        )
    if not moe:
        raise PlanError(
            f"expert_tensor_parallel: {etp} lays out an MoE's experts, but the model has no experts"
        )
    if etp == 1:
        if stack == "":
            raise PlanError(
                "expert_tensor_parallel: 1 folds an MoE's experts, but Loom's stack keeps them on every tp "
                "rank, whole or split (give the layout's tp, or leave it out)"
            )
        if lay.expert_tp == "split" and lay.tp > 1:
            raise PlanError(
                "expert_tensor_parallel: 1 folds an MoE's experts, but the layout splits them (etp)"
            )
        return lay
    return dataclasses.replace(lay, expert_tp="split")


def _moe_weighting(row: dict[str, Any], model: ModelConfig) -> MoeWeighting:
    """The row's ``moe_weighting`` (module doc; :attr:`Workload.moe_weighting`), ``output`` when left
    out; one :class:`PlanError` line for a value not in :data:`MOE_WEIGHTINGS`, a dense model, or a
    stack whose MoE layer weights each row's output (all but Megatron-Core's)."""
    value = row.get("moe_weighting", "output")
    if value not in MOE_WEIGHTINGS:
        raise PlanError(f"moe_weighting: must be one of {', '.join(MOE_WEIGHTINGS)}, got {value!r}")
    if value == "output":
        return "output"
    if model.n_experts <= 1:
        raise PlanError(
            f"moe_weighting: {value} places an MoE's routing weights, but the model has no experts"
        )
    stack = resolve_stack(str(row["stack"]))[0]
    if STACKS[stack].moe_saves != "megatron":
        raise PlanError(
            f"moe_weighting: {value} is Megatron-Core's weighted GLU (0.13+); stack {row['stack']!r} weights "
            "each expert row's output (leave it out)"
        )
    return cast(MoeWeighting, value)


def _fused_cross_entropy(row: dict[str, Any]) -> bool:
    """The row's ``fused_cross_entropy`` (module doc; :attr:`Workload.fused_cross_entropy`), false when
    left out; refused on Loom's own stack, whose loss is its own (one :class:`PlanError` line)."""
    value = bool(row.get("fused_cross_entropy", False))
    if value and resolve_stack(str(row["stack"]))[0] == "":
        raise PlanError(
            "fused_cross_entropy: Loom's stack runs its own loss (a chunked head and loss where it can); "
            "leave it out"
        )
    return value


def _recompute_modules(row: dict[str, Any]) -> tuple[str, ...]:
    """The row's ``recompute_modules`` (module doc; :attr:`Workload.recompute_modules`), none when left
    out; one :class:`PlanError` line for a name its stack does not offer (``Stack.recompute_modules``)."""
    names = row.get("recompute_modules", [])
    stack = resolve_stack(str(row["stack"]))[0]
    offered = STACKS[stack].recompute_modules
    for name in names:
        if not isinstance(name, str) or name not in offered:
            raise PlanError(
                f"recompute_modules: {name!r} is not a module stack {row['stack']!r} recomputes alone "
                f"(it offers: {', '.join(offered) or 'none'})"
            )
    return tuple(names)


def _check_types(table: dict[str, Any], types: dict[str, type], at: str) -> None:
    """Every key of ``table`` known, of its TOML type in ``types`` (float: any number), numbers finite
    and > 0 (TOML's ``inf`` and ``nan`` are refused: a ``> 0`` test alone lets ``inf`` through)."""
    for key, value in table.items():
        if key not in types:
            raise PlanError(f"{at}: unknown key {key!r}; allowed: {', '.join(sorted(types))}")
        want = types[key]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = (
            number and (want is float or isinstance(value, int))
            if want in (int, float)
            else isinstance(value, want)
        )
        if not ok:
            kind = {
                int: "a whole number",
                float: "a number",
                bool: "true or false",
                dict: "a table",
                list: "a list",
            }.get(want, "a string")
            raise PlanError(f"{at}: {key} must be {kind}, got {value!r}")
        if number and not (math.isfinite(value) and value > 0):  # inf passes a bare > 0, NaN does not
            raise PlanError(f"{at}: {key} must be > 0 and finite, got {value!r}")


def _model(fields: Any, at: str) -> ModelConfig:
    """A ``[models.NAME]`` table as :class:`ModelConfig`, read and checked as a config's ``[model]``."""
    if not isinstance(fields, dict):
        raise PlanError(f"{at} must be a table, got {type(fields).__name__}")
    for key, value in fields.items():  # [models.gpt-1.7b] nests a table "7b" under the model "gpt-1"
        if isinstance(value, dict):
            raise PlanError(
                f'{at}.{key}: a table where a model field belongs; quote a name with dots: [models."{at.split("models.", 1)[-1]}.{key}"]'
            )
    try:
        cfg = from_dict({"model": fields})
        _check_finite(cfg)  # rope_theta = inf, norm_eps = nan: every float field finite, as loom train checks
        model = cfg.model
        _check_model(model)
    except ConfigError as e:  # "model.dim: ..." -> "FILE: models.NAME.dim: ..."
        raise PlanError(f"{at}.{str(e).removeprefix('model.')}") from None
    return model


def load_file(path: Path) -> list[PublishedRun]:
    """The runs of one validation TOML (the module docstring's format); a bad file, table or value is
    one :class:`PlanError` line naming the file, the run or model, and the key."""
    text = read_text_file(path, str(path), PlanError)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PlanError(f"{path.name}: not valid TOML: {e}") from None
    for key in data:
        if key not in ("models", "runs"):
            raise PlanError(f"{path.name}: unknown table {key!r}; allowed: [models.NAME] and [[runs]]")
    tables, rows = data.get("models", {}), data.get("runs", [])
    if not isinstance(tables, dict):
        raise PlanError(f"{path.name}: models must be tables [models.NAME], got {type(tables).__name__}")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise PlanError(f"{path.name}: runs must be an array of tables [[runs]], got {type(rows).__name__}")
    if not rows:
        raise PlanError(f"{path.name}: no [[runs]]")
    models = {key: _model(fields, f"{path.name}: models.{key}") for key, fields in tables.items()}
    runs = [_run(row, models, path.name) for row in rows]
    unknown = sorted({str(r["stack"]) for r in rows if not resolve_stack(str(r["stack"]))[1]})
    if unknown:  # a run of any software is predicted, on the constants of none in particular
        known = [repr(n) for n in STACKS if n != "other"] + [repr(a) for a in STACK_ALIASES]
        print(
            f"loom: note: {path.name}: stack {', '.join(map(repr, unknown))} is none the planner was fitted "
            f"on; priced as 'other': {STACKS['other'].note} (fitted: {', '.join(known)})",
            file=sys.stderr,
        )
    return runs


def load_runs(directory: Path = VALIDATION_DIR) -> list[PublishedRun]:
    """Every run of every ``*.toml`` in ``directory``, in file then row order."""
    return load_files(sorted(directory.glob("*.toml")))


def load_files(paths: list[Path]) -> list[PublishedRun]:
    """Every run of each file, in order; a run name given twice (in one file or two, or a file given
    twice) is refused: its row would count twice in the means and in ``--fit``."""
    runs: list[PublishedRun] = []
    seen: dict[str, str] = {}
    for path in paths:
        for run in load_file(path):
            if run.name in seen:
                raise PlanError(
                    f"{path.name}: run {run.name!r}: the name of a run in {seen[run.name]} too; give each run "
                    "a name of its own (and each file once)"
                )
            seen[run.name] = path.name
            runs.append(run)
    return runs


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
    """Each run beside the planner's estimate; a layout the planner refuses for its run (it does not
    divide the batch, exceeds the model's heads, ...) is one line naming the file and the run."""
    out = []
    for r in load_runs() if runs is None else runs:
        try:
            c = PublishedComparison(r, predict(r))
        except (PlanError, HardwareError) as e:
            raise PlanError(f"{r.file}: run {r.name!r}: {e}") from None
        if not (math.isfinite(c.published_tflops) and math.isfinite(c.error)):  # 1e308 tokens/s: finite, but
            raise PlanError(  # its TFLOP/s overflow (and --json would print Infinity)
                f"{r.file}: run {r.name!r}: its measured throughput ({r.tokens_per_s_per_gpu:g} tokens/s per GPU) "
                "is beyond any device: the TFLOP/s it implies are not a finite number"
            )
        out.append(c)
    return out


def summary(rows: list[PublishedComparison]) -> tuple[float, float]:
    """(mean |error|, max |error|)."""
    errs = [abs(r.error) for r in rows]
    return sum(errs) / len(errs), max(errs)


def _layout_cell(lay: Layout) -> str:
    """The degrees, sp, tp-/ep-overlap, the pipeline schedule (pp > 1), micro-batch and recomputation."""
    schedule = f" {lay.schedule}" + (f":v{lay.v}" if lay.v > 1 else "") if lay.pp > 1 else ""
    overlap = " tp-overlap" * (lay.tp_overlap and lay.tp > 1) + " ep-overlap" * (
        lay.ep_overlap and lay.ep > 1
    )
    return lay.short() + " sp" * lay.sp + overlap + schedule + f" mb{lay.micro_batch} {lay.recompute}"


def format_published(rows: list[PublishedComparison]) -> str:
    head = ("run", "GPUs", "layout", "pred TFLOP/s", "publ TFLOP/s", "error", "mem GiB")
    cells = [head] + [
        (
            r.run.name,
            str(r.run.gpus),
            _layout_cell(r.run.layout),
            f"{r.estimate.tflops_per_device:.1f}",
            f"{r.published_tflops:.1f}",
            f"{100 * r.error:+.1f}%",
            f"{r.estimate.memory / 2**30:.0f}" + ("" if r.estimate.fits else " *"),
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
    over = [r for r in rows if not r.estimate.fits]
    if over:  # they ran, so the memory model over-counts there
        lines.append(
            f"* {len(over)} of {len(rows)}: predicted above its device's memory, though the run ran there "
            "(the memory model over-counts it)"
        )
    return "\n".join(lines)


def sources(rows: list[PublishedRun]) -> str:
    return "\n".join(f"- {r.name}: {r.source}" for r in rows)
