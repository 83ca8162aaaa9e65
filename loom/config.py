"""Typed configuration: dataclasses, TOML loading, ``--section.key value`` overrides, validation.

Pure Python (no torch import) so a bad config is rejected in milliseconds, before any
process starts. Every error is a :class:`ConfigError` whose one-line message names the
field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import tempfile
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from loom.rules import (
    AllReduceName,
    CpModeName,
    DpModeName,
    ModelFacts,
    ScheduleName,
    layout_problems,
    param_server_problem,
    sequence_parallel_problem,
    tensor_parallel_problem,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration problem, with a one-line message naming the field."""


# Closed sets of values: a field of one of these types is checked against it (``typing.get_args``).
Precision = Literal["fp32", "bf16", "fp16"]
Optimizer = Literal["adamw", "adafactor", "adam8bit"]
ReduceDtype = Literal["fp32", "bf16", "fp16"]
Offload = Literal["none", "cpu", "disk"]
Device = Literal["auto", "cpu", "cuda"]
Backend = Literal["auto", "gloo", "nccl"]
TextErrors = Literal["strict", "replace"]
DataFormat = Literal["text", "chat", "prompt_completion"]
Overlong = Literal["truncate", "drop"]
CpMode = CpModeName  # parallel.cp_mode (loom.rules)
AllReduce = AllReduceName  # parallel.allreduce (loom.rules); butterfly refuses non-power-of-two groups
DpMode = DpModeName  # parallel.dp_mode (loom.rules)
# Parts of the pattern fields train.recompute and train.compress.
RecomputePolicy = Literal["none", "full", "selective"]
CompressFormat = Literal["none", "bf16", "fp8", "int8"]
TensorKind = Literal["attention", "mlp", "norm", "other"]  # what a module's ``activation_kind`` may say
NormKind = Literal["rmsnorm", "layernorm"]  # model.norm
MlpKind = Literal["swiglu", "gelu", "gelu_tanh"]  # model.mlp
PositionKind = Literal["rope", "learned"]  # model.positions
FinetuneMethod = Literal["full", "lora", "qlora"]  # finetune.method
LORA_TARGETS = ("q", "k", "v", "o", "w1", "w2", "w3")  # finetune.lora_targets: the block's linear layers
NF4_BLOCK = 64  # QLoRA: elements per NF4 absmax block (a quantized base weight's numel must be a multiple)


@dataclass
class ModelConfig:
    """Shape of the Llama-style decoder."""

    dim: int = 256  # hidden size h
    n_layers: int = 4  # transformer blocks L
    n_heads: int = 8  # query heads a
    n_kv_heads: int = 4  # key/value heads (grouped-query attention); must divide n_heads
    ffn_dim: int = 0  # MLP hidden size; 0 = Llama rule round_up(8h/3, multiple_of)
    multiple_of: int = 64  # rounding for the automatic ffn_dim
    vocab_size: int = 0  # 0 = take it from the tokenizer of the prepared data
    max_seq_len: int = 256  # longest sequence RoPE is prepared for
    rope_theta: float = 10000.0  # RoPE base frequency
    rope_scaling: float = 0.0  # Llama 3.1 long-context RoPE: divide low frequencies by this factor (0 = off)
    rope_low_freq_factor: float = 1.0  # Llama 3.1 RoPE: wavelengths above original_len / this are scaled
    rope_high_freq_factor: float = 4.0  # Llama 3.1 RoPE: wavelengths below original_len / this are kept
    rope_original_len: int = 8192  # Llama 3.1 RoPE: the context length pretraining used
    norm_eps: float = 1e-5  # epsilon of the norms (RMSNorm or LayerNorm)
    tie_embeddings: bool = True  # share the embedding matrix with the output head
    init_std: float = 0.02  # std of the normal init; output projections use std/sqrt(2L)
    dropout: float = 0.0  # dropout on both residual branches and in the attention core (training only)
    n_experts: int = 1  # > 1: every block's MLP is a mixture of this many SwiGLU experts
    top_k: int = 2  # experts each token is routed to (mixture of experts only)
    qkv_bias: bool = False  # biases on the query/key/value projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head's query and key before RoPE (Qwen3)
    attn_head_dim: int = 0  # size of one attention head; 0 = dim / n_heads
    norm: NormKind = "rmsnorm"  # layernorm: (x - mean) / std * w + b (GPT-2)
    mlp: MlpKind = "swiglu"  # gelu / gelu_tanh: w2(gelu(w1 x)), exact or tanh-approximated (GPT-2's gelu_new)
    positions: PositionKind = (
        "rope"  # learned: a (max_seq_len, dim) table added to the token embeddings (GPT-2)
    )
    bias: bool = False  # biases on every linear layer but the output head and the router (GPT-2)
    from_hf: str = ""  # local Hugging Face model directory to start from: its shape, weights and tokenizer

    @property
    def moe(self) -> bool:
        return self.n_experts > 1

    def resolved_ffn_dim(self) -> int:
        """SwiGLU hidden size: explicit, or ``multiple_of * ceil(8h/3 / multiple_of)``."""
        if self.ffn_dim > 0:
            return self.ffn_dim
        hidden = int(8 * self.dim / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads


@dataclass
class SourceConfig:
    """One source of a training mixture: a ``[[data.sources]]`` table."""

    path: str = (
        ""  # file, directory or glob of .txt/.jsonl/.jsonl.gz/.parquet/.arrow, or a datasets save_to_disk dir
    )
    weight: float = 1.0  # share of training sequences drawn from it (weights are normalized over the sources)
    text_field: str = "text"  # field holding the text in its records
    format: DataFormat = "text"  # chat / prompt_completion records (labels only on answers, as data.format)


@dataclass
class DataConfig:
    """Where tokens come from."""

    source: str = "stdlib"  # "stdlib" (the Python standard library source, ~10 MB, offline) or a file/dir/glob of .txt/.jsonl/.parquet
    prepared_dir: str = (
        ""  # where train.bin/val.bin/tokenizer.json live; "" = a cache dir keyed by source+vocab
    )
    tokenizer: str = ""  # path to a tokenizer.json to use; "" = train a byte-level BPE on the corpus
    vocab_size: int = 4096  # BPE vocabulary size when training a tokenizer
    seq_len: int = 256  # tokens per training sequence T
    val_fraction: float = 0.02  # share of the corpus held out for eval loss
    max_corpus_mb: float = (
        24.0  # cap on corpus text read; 0 = no cap (preparation streams: memory stays flat)
    )
    text_field: str = "text"  # field holding the text in .jsonl/.parquet records
    errors: TextErrors = (
        "strict"  # invalid UTF-8 in the corpus: strict refuses, naming the file; replace counts and reports
    )
    workers: int = (
        0  # tokenizing processes for prepare; 0 = one per CPU core (output identical for any count)
    )
    pack: bool = False  # batches carry positions: RoPE restarts and attention stays inside each document
    format: DataFormat = "text"  # chat: records with messages; prompt_completion: prompt + completion fields
    train_on_prompt: bool = (
        False  # chat/prompt_completion: also train on prompt tokens (else labels -100 there)
    )
    overlong: Overlong = (
        "truncate"  # chat/prompt_completion examples over seq_len + 1 tokens: cut or left out
    )
    sources: list[SourceConfig] = field(
        default_factory=list
    )  # [[data.sources]] mixture (replaces data.source)


@dataclass
class ParallelConfig:
    """Parallel layout. Product of dp * tp * pp * cp must equal the world size.

    Pipeline micro-batches are the gradient-accumulation micro-batches:
    m = train.global_batch / (train.micro_batch * dp) per step.
    """

    dp: int = -1  # data-parallel degree; -1 = world_size / (tp*pp*cp)
    dp_shard: int = -1  # ZeRO/FSDP sharding group inside dp; -1 = all of dp
    tp: int = 1  # tensor-parallel degree
    sp: bool = False  # sequence parallelism: norms/residual sharded along the sequence over tp
    pp: int = 1  # pipeline-parallel degree
    cp: int = 1  # context-parallel degree
    cp_mode: CpMode = "allgather"  # attention under cp: all-gathered K/V, K/V ring (O(T/cp) memory), or all-to-all over heads (Ulysses)
    ep: int = 1  # expert-parallel degree (borrows from dp*cp)
    zero: int = 0  # ZeRO stage 0 (plain data parallel), 1, 2 or 3
    bucket_mb: float = 25.0  # gradient bucket size for the all-reduce, in MB
    reduce_dtype: ReduceDtype = "fp32"  # dtype gradients are reduced in
    allreduce: AllReduce = (
        "native"  # gradient all-reduce: the backend's own, or ring | tree | butterfly on point-to-point
    )
    dp_mode: DpMode = "allreduce"  # data-parallel gradients: all-reduced, or through a parameter server (ps)
    ps_shards: int = 1  # dp_mode = ps: K servers, each holding 1/K of the parameters and their AdamW state
    ps_colocate: bool = True  # dp_mode = ps: server k lives in worker rank k (else K dedicated server ranks: run.nproc = dp + K)
    ps_sync: str = (
        "bsp"  # dp_mode = ps: bsp (synchronous) | asp (asynchronous) | ssp:S (at most S steps stale)
    )
    schedule: ScheduleName = "1f1b"  # pipeline schedule (pipedream and 2bw are asynchronous)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule only)
    pp_layout: str = (
        ""  # manual cut, inclusive block ranges per stage ("0-3,4-7"); "" = profile and partition
    )
    vertical_sync: bool = (
        False  # pipedream: each stage uses the weight version stage 0 used for the micro-batch
    )
    offload: Offload = (
        "none"  # where ZeRO optimizer state lives: cpu = host memory (ZeRO-Offload), disk = mmap files
    )
    offload_dir: str = ""  # directory for parallel.offload = "disk"; "" = <run.dir>/offload
    reshard_after_forward: bool = (
        True  # ZeRO-3: free gathered params after forward, gather again for backward
    )
    offload_params: Offload = "none"  # ZeRO-3 (ZeRO-Infinity): parameter and gradient shards on cpu = host memory, disk = mmap files
    zeropp_qwz: bool = False  # ZeRO++ qwZ (ZeRO-3): weights all-gathered as block-wise int8 + absmax scales
    zeropp_hpz: bool = (
        False  # ZeRO++ hpZ (ZeRO-3): a secondary weight partition per node group; backward gathers inside it
    )
    zeropp_qgz: bool = (
        False  # ZeRO++ qgZ (ZeRO-3): gradients reduce-scattered as block-wise int8 through an all-to-all
    )
    zeropp_qgz_bits: int = 8  # ZeRO++ qgZ: 8 (int8) or 4 (int4, two codes a byte) bits per gradient element
    hpz_group: int = (
        0  # ZeRO++ hpZ: ranks per secondary partition (one node); 0 = the launcher's LOCAL_WORLD_SIZE / tp
    )
    auto: bool = False  # let the planner (loom.plan) choose the layout and micro-batch for the world size


@dataclass
class TrainConfig:
    """Optimisation and loop."""

    steps: int = 200  # total optimizer steps (a resumed run stops where an uninterrupted one would)
    global_batch: int = 16  # sequences per optimizer step, over all data-parallel ranks
    micro_batch: int = 4  # sequences per forward/backward on one rank
    lr: float = 3e-3  # peak learning rate
    min_lr: float = 3e-4  # floor of the cosine decay
    warmup_steps: int = 20  # linear warm-up steps
    weight_decay: float = 0.1  # AdamW decoupled weight decay (not on norms/biases)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # clip global grad norm to this; 0 = off
    seed: int = 1234  # seeds init, data order and dropout; independent of the layout
    eval_every: int = 100  # steps between eval losses; 0 = off
    eval_batches: int = 4  # micro-batches per eval
    log_every: int = 10  # steps between step lines / metrics rows
    precision: Precision = "fp32"  # compute dtype; bf16/fp16: half weights and activations, fp32 master weights + optimizer state
    optimizer: Optimizer = "adamw"  # adafactor: factored second moments; adam8bit: block-wise 8-bit moments
    recompute: str = "none"  # activation recomputation: none | full | selective (attention core) | every:<k>
    compress: str = (
        "none"  # saved activations stored as none | bf16 | fp8 | int8, or per kind "mlp=fp8,attention=bf16"
    )
    offload_activations: bool = False  # saved activations to pinned host memory (GPU runs only)
    loss_scale: float = 0.0  # fp16: static loss scale; 0 = dynamic
    loss_scale_init: float = 65536.0  # fp16 dynamic scaling: first scale
    loss_scale_window: int = 1000  # fp16 dynamic scaling: double the scale after this many clean steps
    loss_scale_hysteresis: int = 2  # fp16 dynamic scaling: overflows tolerated before the scale is halved
    loss_scale_min: float = 1.0  # fp16 dynamic scaling: floor of the scale
    max_skipped_steps: int = 20  # fp16: stop when more steps than this in a row overflow; 0 = never
    checkpoint_every: int = 0  # steps between checkpoints; 0 = only the final one
    checkpoint_async: bool = True  # periodic saves written by a background thread (final: synchronous)
    checkpoint_keep: int = 2  # newest checkpoints kept in <run.dir>/checkpoints; 0 = keep all
    resume: str = ""  # checkpoint to start from (run dir or checkpoint dir); "" = latest in run.dir
    init_from: str = (
        ""  # weights only (Loom checkpoint or local HF directory): fresh optimizer, step 0, any layout
    )
    time_limit_s: float = 0.0  # stop early (and save) after this many seconds; 0 = none


@dataclass
class RunConfig:
    """Where and how the job runs."""

    dir: str = "runs/default"  # output directory: config.toml, metrics.jsonl, tensorboard/, checkpoints/
    nproc: int = 2  # local ranks started by `loom train` (ignored under torchrun/srun)
    device: Device = "auto"  # where ranks compute
    backend: Backend = "auto"  # process-group backend; auto = nccl on cuda, gloo on cpu
    timeout_s: float = 300.0  # process-group timeout: a dead rank surfaces as an error after this
    progress: bool = True  # progress bar on rank 0
    tensorboard: bool = True  # write TensorBoard events
    master_addr: str = "127.0.0.1"  # rendezvous address; loopback unless you mean multi-node
    master_port: int = 0  # rendezvous port; 0 = pick a free one
    threads: int = 0  # torch intra-op threads per rank; 0 = cores / local ranks


MoEScore = Literal["softmax", "sigmoid"]  # moe.score
DropPolicy = Literal["probability", "position"]  # moe.drop_policy
ExpertCompute = Literal["grouped", "loop"]  # moe.compute


@dataclass
class MoEConfig:
    """Mixture-of-experts routing and balancing (used when model.n_experts > 1)."""

    score: MoEScore = (
        "softmax"  # router scores: softmax over experts (Mixtral) or per-expert sigmoid (DeepSeek-V3)
    )
    norm_topk: bool = True  # routing weights of the k chosen experts renormalized to sum to 1
    n_shared_experts: int = 0  # experts every token goes through (one SwiGLU of this many expert widths)
    aux_loss_coef: float = 0.0  # Switch/GShard load-balancing loss α·E·Σ_e f_e·P_e (0 = off)
    z_loss_coef: float = 0.0  # router z-loss β·mean(logsumexp(logits)²) (0 = off)
    bias_update_rate: float = (
        0.0  # aux-loss-free balancing: per-expert selection bias += rate·sign(mean load - load)
    )
    capacity_factor: float = 0.0  # tokens an expert takes per micro-batch: ceil(cf·N·k/E); 0 = dropless
    drop_policy: DropPolicy = "probability"  # over capacity, keep the highest-weight or the earliest tokens
    compute: ExpertCompute = "grouped"  # experts as one grouped matmul, or a Python loop (reference)
    imbalance: float = 0.0  # planner input: max/mean tokens per expert (a run's moe_imbalance metric); 0 = measured by `loom plan calibrate --config`, else 1
    rebalance_every: int = 0  # expert parallelism: every this many steps, replicate the hottest experts on every ep rank (0 = off)
    hot_experts: int = (
        1  # experts per layer replicated at each rebalance (the most loaded since the last one)
    )


@dataclass
class FinetuneConfig:
    """Parameter-efficient fine-tuning: LoRA adapters on a frozen base (QLoRA: the base stored in NF4)."""

    method: FinetuneMethod = (
        "full"  # full: train every weight; lora: frozen base + adapters; qlora: lora on a 4-bit NF4 base
    )
    lora_rank: int = (
        16  # r: each target W (d_out, d_in) gets A (r, d_in) and B (d_out, r), r·(d_in + d_out) trained
    )
    lora_alpha: float = 32.0  # the adapter's output is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0  # dropout on the adapter's input (training only)
    lora_targets: str = (
        "all-linear"  # comma list of q,k,v,o,w1,w2,w3 (attention and MLP linears), or all-linear
    )


@dataclass
class LoomConfig:
    """The whole job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)


SECTIONS: dict[str, type] = dict(typing.get_type_hints(LoomConfig))


def _field_types(cls: type) -> dict[str, Any]:
    return dict(_field_types_of(cls))


@functools.cache
def _field_types_of(cls: type) -> dict[str, Any]:
    """Resolved once per class: ``typing.get_type_hints`` compiles every string annotation."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Convert a TOML or CLI value to ``typ``; raise ConfigError naming ``where``."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None:
            return None
        typ = args[0]
    if typing.get_origin(typ) is Literal:  # checked against its values by validate()
        typ = type(typing.get_args(typ)[0])
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if typ is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if typing.get_origin(typ) is list:  # a list of tables: [[section.key]] in TOML
        (item,) = typing.get_args(typ)
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ConfigError(
                f"{where}: expected a list of tables ([[{where}]] in a TOML file), got {value!r}"
            )
        types_ = _field_types(item)
        out = []
        for i, table in enumerate(value):
            for k in table:
                if k not in types_:
                    raise ConfigError(f"{where}[{i}].{k}: unknown key; allowed: {', '.join(types_)}")
            out.append(item(**{k: _coerce(v, types_[k], f"{where}[{i}].{k}") for k, v in table.items()}))
        return out
    raise ConfigError(f"{where}: unsupported field type {typ!r}")  # pragma: no cover


def _apply(cfg: LoomConfig, section: str, key: str, value: Any) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown section [{section}]; allowed: {', '.join(SECTIONS)}")
    sub = getattr(cfg, section)
    types_ = _field_types(type(sub))
    if key not in types_:
        allowed = ", ".join(types_)
        raise ConfigError(f"{section}.{key}: unknown key; allowed in [{section}]: {allowed}")
    setattr(sub, key, _coerce(value, types_[key], f"{section}.{key}"))


def from_dict(data: dict[str, Any], base: LoomConfig | None = None) -> LoomConfig:
    """Build a config from nested dicts (as TOML gives), starting from ``base`` or defaults."""
    cfg = base if base is not None else LoomConfig()
    for section, table in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section [{section}]; allowed: {', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table, got {table!r}")
        for key, value in table.items():
            _apply(cfg, section, key, value)
    return cfg


PRESET_DIR = Path(__file__).resolve().parent / "configs"


def presets() -> list[str]:
    """Names of the configs shipped with Loom (``loom/configs/*.toml``): ``loom train debug``."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def preset_path(name: str) -> Path:
    """The shipped config called ``name``; an unknown name lists the known ones."""
    p = PRESET_DIR / f"{name}.toml"
    if not p.is_file():
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(presets())}")
    return p


def load_toml(path: str | Path, base: LoomConfig | None = None) -> LoomConfig:
    """Read a TOML config: a file path, or the name of a shipped preset (``debug``, ``llama3-8b``)."""
    p = Path(path)
    if not p.is_file() and p.suffix != ".toml" and (PRESET_DIR / f"{p.name}.toml").is_file():
        p = PRESET_DIR / f"{p.name}.toml"
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist (or a preset: {', '.join(presets())})")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    return from_dict(data, base)


def apply_overrides(cfg: LoomConfig, args: list[str]) -> LoomConfig:
    """Apply ``--section.key value`` (or ``--section.key=value``) pairs."""
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.key value")
        name = arg[2:]
        if "=" in name:
            name, value = name.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"--{name}: missing value")
            value = args[i + 1]
            i += 2
        section, _, key = name.partition(".")
        _apply(cfg, section, key.replace("-", "_"), value)
    return cfg


def to_dict(cfg: LoomConfig) -> dict[str, dict[str, Any]]:
    return {name: dataclasses.asdict(getattr(cfg, name)) for name in SECTIONS}


def dump_toml(cfg: LoomConfig) -> str:
    import tomli_w

    return tomli_w.dumps(to_dict(cfg))


# ----------------------------------------------------------------------------- validation

OPTIMIZERS: tuple[str, ...] = typing.get_args(Optimizer)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _require_none(problem: str | None) -> None:
    if problem:
        raise ConfigError(problem)


def choices(typ: Any) -> tuple[Any, ...]:
    """The allowed values of a ``Literal[...]`` field type; () for other types."""
    return typing.get_args(typ) if typing.get_origin(typ) is Literal else ()


def _check_choices(cfg: LoomConfig) -> None:
    """Every field typed ``Literal[...]`` holds one of its values."""
    for section, cls in SECTIONS.items():
        for name, typ in _field_types(cls).items():
            allowed, value = choices(typ), getattr(getattr(cfg, section), name)
            _require(
                not allowed or value in allowed,
                f"{section}.{name}: must be one of {' | '.join(map(str, allowed))}, got {value!r}",
            )


def resolve_layout(cfg: LoomConfig, world_size: int) -> None:
    """Fill ``parallel.dp``/``dp_shard`` from the world size and check every product.

    world_size = dp * tp * pp * cp;  dp = dp_replicate * dp_shard;  ep | dp * cp.
    """
    p = cfg.parallel
    for name in ("tp", "pp", "cp", "ep"):
        _require(getattr(p, name) >= 1, f"parallel.{name}: must be >= 1, got {getattr(p, name)}")
    inner = p.tp * p.pp * p.cp
    if p.dp == -1:
        _require(
            world_size % inner == 0,
            f"parallel: world size {world_size} is not divisible by tp*pp*cp = {inner}",
        )
        p.dp = world_size // inner
    _require(p.dp >= 1, f"parallel.dp: must be >= 1 or -1 (auto), got {p.dp}")
    _require(
        p.dp * inner == world_size,
        f"parallel: dp*tp*pp*cp = {p.dp}*{p.tp}*{p.pp}*{p.cp} = {p.dp * inner} "
        f"must equal the world size {world_size}",
    )
    if p.dp_shard == -1:
        p.dp_shard = p.dp if p.zero > 0 else 1
    _require(
        p.dp_shard >= 1 and p.dp % p.dp_shard == 0,
        f"parallel.dp_shard: must divide dp={p.dp}, got {p.dp_shard}",
    )
    _require(
        (p.dp * p.cp) % p.ep == 0,
        f"parallel.ep: must divide dp*cp = {p.dp * p.cp}, got {p.ep}",
    )


def _check_finite(cfg: LoomConfig) -> None:
    """Every float field is a finite number (no NaN or infinity slips past a ``>`` bound)."""
    import math

    for section, cls in SECTIONS.items():
        obj = getattr(cfg, section)
        for f in dataclasses.fields(cls):
            v = getattr(obj, f.name)
            if isinstance(v, float):
                _require(math.isfinite(v), f"{section}.{f.name}: must be a finite number, got {v}")


# (section.field, lowest allowed, inclusive) for numeric fields the rules below do not bound
_LOWER_BOUNDS: tuple[tuple[str, float, bool], ...] = (
    ("model.rope_theta", 0.0, False),
    ("model.norm_eps", 0.0, False),
    ("model.rope_scaling", 0.0, True),
    ("model.attn_head_dim", 0.0, True),
    ("model.top_k", 1.0, True),
    ("train.global_batch", 1.0, True),
    ("train.eps", 0.0, False),
    ("train.weight_decay", 0.0, True),
    ("train.seed", 0.0, True),
    ("train.eval_batches", 1.0, True),
    ("train.time_limit_s", 0.0, True),
    ("train.loss_scale", 0.0, True),
    ("train.loss_scale_init", 0.0, False),
    ("train.loss_scale_window", 1.0, True),
    ("train.loss_scale_hysteresis", 1.0, True),
    ("train.loss_scale_min", 0.0, False),
    ("train.max_skipped_steps", 0.0, True),
    ("run.master_port", 0.0, True),
    ("run.nproc", 1.0, True),
)


def _check_bounds(cfg: LoomConfig) -> None:
    for path, low, inclusive in _LOWER_BOUNDS:
        section, name = path.split(".")
        v = getattr(getattr(cfg, section), name)
        ok = v >= low if inclusive else v > low
        _require(ok, f"{path}: must be {'>=' if inclusive else '>'} {low:g}, got {v}")
    _require(
        cfg.run.master_port <= 65535, f"run.master_port: must be in [0, 65535], got {cfg.run.master_port}"
    )
    m = cfg.model
    if m.rope_scaling:
        _require(
            m.rope_high_freq_factor > m.rope_low_freq_factor > 0,
            f"model.rope_high_freq_factor: must exceed model.rope_low_freq_factor > 0, got "
            f"{m.rope_high_freq_factor} and {m.rope_low_freq_factor}",
        )
        _require(
            m.rope_original_len >= 1, f"model.rope_original_len: must be >= 1, got {m.rope_original_len}"
        )


def _check_moe(cfg: LoomConfig) -> None:
    """The [moe] numbers: coefficients and rates >= 0, capacity factor 0 (dropless) or > 0."""
    e = cfg.moe
    for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate", "capacity_factor"):
        v = getattr(e, name)
        _require(v >= 0, f"moe.{name}: must be >= 0, got {v}")
    _require(e.n_shared_experts >= 0, f"moe.n_shared_experts: must be >= 0, got {e.n_shared_experts}")
    _require(
        e.imbalance == 0 or e.imbalance >= 1,
        f"moe.imbalance: must be >= 1 (max over mean tokens per expert), or 0 (the calibration's), got {e.imbalance}",
    )
    _require(e.rebalance_every >= 0, f"moe.rebalance_every: must be >= 0 (0 = off), got {e.rebalance_every}")
    if e.rebalance_every:
        _require(
            cfg.parallel.ep > 1,
            "moe.rebalance_every: replicates hot experts over expert-parallel ranks; it needs "
            f"parallel.ep > 1, got {cfg.parallel.ep}",
        )
        n = cfg.model.n_experts
        _require(
            1 <= e.hot_experts < n,
            f"moe.hot_experts: must be in [1, model.n_experts) = [1, {n}), got {e.hot_experts}",
        )
    # capacity under cp/sp and router losses under asynchronous pipelines: rules.layout_problems


def model_linears(m: ModelConfig) -> tuple[str, ...]:
    """The LoRA targets this model has: q, k, v, o, and the dense MLP's w1, w2 (and SwiGLU's w3);
    a mixture of experts' MLP weights are not linear layers LoRA wraps."""
    mlp = () if m.moe else ("w1", "w2", "w3") if m.mlp == "swiglu" else ("w1", "w2")
    return ("q", "k", "v", "o", *mlp)


def lora_targets(cfg: LoomConfig) -> tuple[str, ...]:
    """``finetune.lora_targets`` resolved for ``cfg.model`` (in :data:`LORA_TARGETS` order); raises
    ConfigError for an unknown name or one this model lacks, and when nothing is left to target."""
    spec, have = cfg.finetune.lora_targets.replace(" ", ""), model_linears(cfg.model)
    names = have if spec == "all-linear" else tuple(t for t in spec.split(",") if t)
    for t in names:
        _require(
            t in LORA_TARGETS,
            f"finetune.lora_targets: unknown target {t!r}; valid: {', '.join(LORA_TARGETS)} or all-linear",
        )
    missing = [t for t in names if t not in have]
    why = "its MLP is a mixture of experts" if cfg.model.moe else f"model.mlp = {cfg.model.mlp}"
    _require(
        bool(names) and len(missing) < len(names),
        f"finetune.lora_targets: nothing to target in this model "
        f"({cfg.finetune.lora_targets!r}; it has {', '.join(have)}: {why})",
    )
    _require(
        not missing,
        f"finetune.lora_targets: this model has no {', '.join(missing)} linear layer ({why}); "
        f"its targets: {', '.join(have)}",
    )
    return tuple(t for t in LORA_TARGETS if t in names)


def target_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """(d_out, d_in) of each LoRA target's weight."""
    qd, kd, f = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim, m.resolved_ffn_dim()
    return {
        "q": (qd, m.dim),
        "k": (kd, m.dim),
        "v": (kd, m.dim),
        "o": (m.dim, qd),
        "w1": (f, m.dim),
        "w3": (f, m.dim),
        "w2": (m.dim, f),
    }


TARGET_NAMES = {
    "q": "attention.wq",
    "k": "attention.wk",
    "v": "attention.wv",
    "o": "attention.wo",
    "w1": "feed_forward.w1",
    "w2": "feed_forward.w2",
    "w3": "feed_forward.w3",
}


def check_finetune(cfg: LoomConfig) -> None:
    """[finetune]: rank >= 1, alpha > 0, dropout in [0, 1), targets this model has; QLoRA's base
    weights split into 64-element NF4 blocks, and no tensor parallelism (each rank would quantize a slice)."""
    f, p = cfg.finetune, cfg.parallel
    if f.method == "full":
        return
    _require(f.lora_rank >= 1, f"finetune.lora_rank: must be >= 1, got {f.lora_rank}")
    _require(f.lora_alpha > 0, f"finetune.lora_alpha: must be > 0, got {f.lora_alpha}")
    _require(0.0 <= f.lora_dropout < 1.0, f"finetune.lora_dropout: must be in [0, 1), got {f.lora_dropout}")
    targets = lora_targets(cfg)
    if f.method != "qlora":
        return
    for t in targets:
        out, inp = target_shapes(cfg.model)[t]
        _require(
            out * inp % NF4_BLOCK == 0,
            f"finetune.method: qlora cannot quantize layers.*.{TARGET_NAMES[t]}.weight "
            f"({out} x {inp} = {out * inp} elements, not a multiple of the {NF4_BLOCK}-element NF4 block); "
            f"use method = lora or drop {t} from finetune.lora_targets",
        )
    _require(
        p.tp == 1,
        f"finetune.method: qlora with parallel.tp = {p.tp} is not supported (each rank would "
        "quantize its own slice); use method = lora, or tp = 1",
    )


def world_size_of(cfg: LoomConfig) -> int:
    """World size a config asks for: explicit dp product (and dedicated server ranks), or run.nproc."""
    p = cfg.parallel
    if p.dp > 0:
        return p.dp * p.tp * p.pp * p.cp + ps_servers(cfg)
    return cfg.run.nproc


def ps_servers(cfg: LoomConfig) -> int:
    """Dedicated parameter-server ranks (``parallel.dp_mode = "ps"``, ``ps_colocate = false``): K =
    ``parallel.ps_shards``, else 0. Rank-count rule: run.nproc = W + K, ranks 0..W-1 the workers
    (``parallel.dp`` = W: data is sharded over them), ranks W..W+K-1 the servers (:mod:`loom.train.ps_run`)."""
    p = cfg.parallel
    return p.ps_shards if p.dp_mode == "ps" and not p.ps_colocate else 0


def validate(cfg: LoomConfig, world_size: int) -> LoomConfig:
    """Check every field and combination; resolve automatic values in place. Raises ConfigError."""
    m, d, p, t, r = cfg.model, cfg.data, cfg.parallel, cfg.train, cfg.run
    _require(world_size >= 1, f"run.nproc: must be >= 1, got {world_size}")
    _check_finite(cfg)
    _check_bounds(cfg)
    _check_choices(cfg)
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len", "multiple_of"):
        _require(getattr(m, name) >= 1, f"model.{name}: must be >= 1, got {getattr(m, name)}")
    _require(
        m.attn_head_dim > 0 or m.dim % m.n_heads == 0,
        f"model.dim: {m.dim} must be divisible by model.n_heads={m.n_heads} (or set model.attn_head_dim)",
    )
    _require(
        m.positions != "rope" or m.head_dim % 2 == 0,
        f"model.dim: head_dim {m.head_dim} must be even for RoPE",
    )
    _require(
        m.n_heads % m.n_kv_heads == 0,
        f"model.n_kv_heads: must divide model.n_heads={m.n_heads}, got {m.n_kv_heads}",
    )
    _require(m.ffn_dim >= 0, f"model.ffn_dim: must be >= 0 (0 = automatic), got {m.ffn_dim}")
    _require(m.vocab_size >= 0, f"model.vocab_size: must be >= 0 (0 = from tokenizer), got {m.vocab_size}")
    _require(m.init_std > 0, f"model.init_std: must be > 0, got {m.init_std}")
    _require(0.0 <= m.dropout < 1.0, f"model.dropout: must be in [0, 1), got {m.dropout}")
    _require(m.n_experts >= 1, f"model.n_experts: must be >= 1 (1 = dense MLP), got {m.n_experts}")
    _require(
        not m.moe or m.mlp == "swiglu", f"model.mlp: experts are SwiGLU; {m.mlp!r} needs model.n_experts = 1"
    )
    if m.moe:
        _require(
            1 <= m.top_k <= m.n_experts,
            f"model.top_k: must be in [1, model.n_experts={m.n_experts}], got {m.top_k}",
        )

    _require(d.seq_len >= 2, f"data.seq_len: must be >= 2, got {d.seq_len}")
    _require(
        d.seq_len <= m.max_seq_len,
        f"data.seq_len: {d.seq_len} exceeds model.max_seq_len={m.max_seq_len}",
    )
    _require(d.vocab_size >= 260, f"data.vocab_size: must be >= 260 (bytes + specials), got {d.vocab_size}")
    _require(0.0 < d.val_fraction < 0.5, f"data.val_fraction: must be in (0, 0.5), got {d.val_fraction}")
    _require(d.max_corpus_mb >= 0, f"data.max_corpus_mb: must be >= 0 (0 = no cap), got {d.max_corpus_mb}")
    _require(d.workers >= 0, f"data.workers: must be >= 0 (0 = one per CPU core), got {d.workers}")
    for i, src in enumerate(d.sources):
        _require(bool(src.path.strip()), f"data.sources[{i}].path: must name a file, directory or glob")
        _require(
            src.weight > 0 and src.weight != float("inf"),
            f"data.sources[{i}].weight: must be a positive number, got {src.weight}",
        )
        _require(
            src.format in typing.get_args(DataFormat),
            f"data.sources[{i}].format: must be one of "
            f"{' | '.join(typing.get_args(DataFormat))}, got {src.format!r}",
        )
    _require(
        not d.sources or d.format == "text",
        f"data.format: {d.format} is for data.source; give each [[data.sources]] table its own format",
    )
    _require(
        d.format == "text" or d.source != "stdlib",
        f"data.format: {d.format} needs a data.source of .jsonl/.parquet records, not the stdlib text",
    )
    _require(t.steps >= 1, f"train.steps: must be >= 1, got {t.steps}")
    _require(t.lr > 0, f"train.lr: must be > 0, got {t.lr}")
    _require(0 <= t.min_lr <= t.lr, f"train.min_lr: must be in [0, train.lr={t.lr}], got {t.min_lr}")
    _require(t.warmup_steps >= 0, f"train.warmup_steps: must be >= 0, got {t.warmup_steps}")
    _require(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "train.beta1/beta2: must be in [0, 1)")
    _require(t.grad_clip >= 0, f"train.grad_clip: must be >= 0 (0 = off), got {t.grad_clip}")
    _require(t.log_every >= 1, f"train.log_every: must be >= 1, got {t.log_every}")
    _require(t.eval_every >= 0, f"train.eval_every: must be >= 0, got {t.eval_every}")
    _require(t.checkpoint_every >= 0, f"train.checkpoint_every: must be >= 0, got {t.checkpoint_every}")
    _require(
        t.checkpoint_keep >= 0, f"train.checkpoint_keep: must be >= 0 (0 = all), got {t.checkpoint_keep}"
    )
    _require(
        not t.resume or Path(t.resume).is_dir(),
        f"train.resume: {t.resume!r} is not a directory (a run dir, its checkpoints/ or one checkpoint)",
    )
    _require(
        not t.init_from or Path(t.init_from).is_dir(),
        f"train.init_from: {t.init_from!r} is not a directory (a Loom run or checkpoint, or a Hugging Face model)",
    )
    _require(
        not (r.device == "cpu" and r.backend == "nccl"),
        "run.backend: nccl needs run.device = cuda; use gloo on cpu",
    )
    _require(r.timeout_s > 0, f"run.timeout_s: must be > 0, got {r.timeout_s}")
    _require(r.dir.strip() != "", "run.dir: must name a directory (it holds checkpoints and metrics), got ''")
    _require(r.threads >= 0, f"run.threads: must be >= 0 (0 = automatic), got {r.threads}")
    _require(p.bucket_mb > 0, f"parallel.bucket_mb: must be > 0, got {p.bucket_mb}")
    _require(p.zero in (0, 1, 2, 3), f"parallel.zero: must be 0, 1, 2 or 3, got {p.zero}")
    resolve_layout(cfg, world_size - _check_ps_ranks(cfg, world_size))
    _check_moe(cfg)
    check_finetune(cfg)
    _check_implemented(cfg)
    check_param_server(cfg)
    check_memory(cfg)
    _require(t.micro_batch >= 1, f"train.micro_batch: must be >= 1, got {t.micro_batch}")
    _require(
        t.global_batch % (t.micro_batch * p.dp) == 0,
        f"train.global_batch: {t.global_batch} must be divisible by micro_batch*dp = "
        f"{t.micro_batch}*{p.dp} = {t.micro_batch * p.dp}",
    )
    problems = layout_problems(
        model_facts(cfg),
        seq_len=d.seq_len,
        precision=t.precision,
        optimizer=t.optimizer,
        tp=p.tp,
        pp=p.pp,
        cp=p.cp,
        ep=p.ep,
        zero=p.zero,
        sp=p.sp,
        schedule=p.schedule,
        cp_mode=p.cp_mode,
        virtual_stages=p.virtual_stages,
        microbatches=grad_accum_steps(cfg),
        offload=p.offload,
        pp_layout=p.pp_layout,
        vertical_sync=p.vertical_sync,
        allreduce=p.allreduce,
        dp=p.dp,
        dp_shard=p.dp_shard,
    )
    _require_none(problems[0] if problems else None)
    if p.offload == "disk":
        problem = _unwritable(offload_dir(cfg))
        _require(problem is None, f"parallel.offload_dir: {problem}")
    return cfg


def model_facts(cfg: LoomConfig) -> ModelFacts:
    """What the layout rules need of ``cfg``'s model; its vocabulary, if known, names the field setting it."""
    m, e = cfg.model, cfg.moe
    moe = dict(moe_capacity=e.capacity_factor > 0, moe_router_losses=e.aux_loss_coef > 0 or e.z_loss_coef > 0)
    if m.vocab_size == 0 and not cfg.data.tokenizer:  # a tokenizer trained to data.vocab_size
        return ModelFacts.of(m, vocab_size=cfg.data.vocab_size, vocab_field="data.vocab_size", **moe)
    return ModelFacts.of(m, **moe)  # vocab_size 0: taken from a given tokenizer later


# Features whose fields exist (so the mesh and the planner can name them) but whose runtime
# has not landed yet: (field, predicate on the config, message). Entries go as features land.
NOT_YET: list[tuple[str, Any, str]] = []


RECOMPUTE_HELP = f"{', '.join(typing.get_args(RecomputePolicy))} or every:<k> (k >= 1)"
COMPRESS_FORMATS: tuple[str, ...] = typing.get_args(CompressFormat)
COMPRESS_KINDS: tuple[str, ...] = typing.get_args(TensorKind)


def parse_recompute(spec: str) -> tuple[str, int]:
    """``train.recompute`` -> (policy, k): none/full/selective with k = 1, or ("every", k)."""
    if spec in typing.get_args(RecomputePolicy):
        return spec, 1
    head, _, k = spec.partition(":")
    _require(
        head == "every" and k.isdigit() and int(k) >= 1,
        f"train.recompute: must be one of {RECOMPUTE_HELP}, got {spec!r}",
    )
    return "every", int(k)


def parse_compress(spec: str) -> dict[str, str]:
    """``train.compress`` -> format per saved-tensor kind: "fp8" (every kind) or "mlp=fp8,attention=bf16"
    (kinds not named: none). Kinds: the module that saved the tensor (attention, mlp, norm, other)."""
    if "=" not in spec:
        _require(
            spec in COMPRESS_FORMATS,
            f"train.compress: must be one of {COMPRESS_FORMATS} or kind=format pairs "
            f"(kinds {COMPRESS_KINDS}), got {spec!r}",
        )
        return dict.fromkeys(COMPRESS_KINDS, spec)
    out = dict.fromkeys(COMPRESS_KINDS, "none")
    for item in spec.split(","):
        kind, _, fmt = item.strip().partition("=")
        _require(
            kind in COMPRESS_KINDS, f"train.compress: unknown tensor kind {kind!r}; kinds: {COMPRESS_KINDS}"
        )
        _require(fmt in COMPRESS_FORMATS, f"train.compress: {kind}={fmt!r}; formats: {COMPRESS_FORMATS}")
        out[kind] = fmt
    return out


def check_memory(cfg: LoomConfig) -> None:
    """Memory-technique fields (loss scaling, recomputation, compression, activation offload)."""
    t = cfg.train
    policy, k = parse_recompute(t.recompute)
    _require(
        policy != "every" or k <= cfg.model.n_layers,
        f"train.recompute: every:{k} checkpoints one block in {k}, but model.n_layers = {cfg.model.n_layers}",
    )
    parse_compress(t.compress)
    _require(t.loss_scale >= 0, f"train.loss_scale: must be >= 0 (0 = dynamic), got {t.loss_scale}")
    _require(t.loss_scale_init >= 1, f"train.loss_scale_init: must be >= 1, got {t.loss_scale_init}")
    _require(t.loss_scale_window >= 1, f"train.loss_scale_window: must be >= 1, got {t.loss_scale_window}")
    _require(
        t.loss_scale_hysteresis >= 1,
        f"train.loss_scale_hysteresis: must be >= 1, got {t.loss_scale_hysteresis}",
    )
    _require(
        0 < t.loss_scale_min <= t.loss_scale_init,
        f"train.loss_scale_min: must be in (0, train.loss_scale_init], got {t.loss_scale_min}",
    )
    _require(
        not t.offload_activations or cfg.run.device != "cpu",
        "train.offload_activations: moves saved activations from GPU to pinned host memory; with "
        "run.device = cpu they are in host memory already (set it to false)",
    )


def check_param_server(cfg: LoomConfig) -> None:
    """``parallel.dp_mode = "ps"``: the parameter server's fields and the layouts it refuses (:mod:`loom.rules`).
    The parameter count is a lower bound: the layers' attention and two MLP matrices, and the embedding."""
    p, m = cfg.parallel, cfg.model
    if p.dp_mode != "ps":
        return
    vocab = m.vocab_size or (cfg.data.vocab_size if not cfg.data.tokenizer else 0)
    hd = m.head_dim
    n_params = (
        m.n_layers * m.dim * (hd * (2 * m.n_heads + 2 * m.n_kv_heads) + 2 * m.resolved_ffn_dim())
        + vocab * m.dim
    )
    _require_none(
        param_server_problem(
            shards=p.ps_shards,
            colocate=p.ps_colocate,
            sync=p.ps_sync,
            n_params=n_params,
            workers=p.dp,
            tp=p.tp,
            pp=p.pp,
            cp=p.cp,
            ep=p.ep,
            zero=p.zero,
            precision=cfg.train.precision,
            optimizer=cfg.train.optimizer,
        )
    )
    if not p.ps_colocate:  # what the dedicated-server run (loom.train.ps_run) does not do
        _require(
            cfg.train.time_limit_s == 0,
            "train.time_limit_s: dedicated parameter servers (parallel.ps_colocate = "
            "false) stop after the workers' last step; use train.steps (or co-located servers)",
        )
        _require(
            cfg.finetune.method == "full",
            f"finetune.method: {cfg.finetune.method} with dedicated parameter "
            "servers (parallel.ps_colocate = false) is not supported; use co-located servers or dp_mode = allreduce",
        )


def _check_ps_ranks(cfg: LoomConfig, world_size: int) -> int:
    """The rank-count rule of dedicated parameter servers (:func:`ps_servers`): world = parallel.dp workers +
    parallel.ps_shards servers; returns the number of server ranks (0 without them)."""
    p, k = cfg.parallel, ps_servers(cfg)
    if not k:
        return 0
    _require(k >= 1, f"parallel.ps_shards: must be >= 1, got {k}")
    _require(
        world_size > k,
        f"run.nproc: {world_size} ranks cannot hold parallel.ps_shards = {k} dedicated servers "
        f"and a worker (run.nproc = workers + ps_shards); give at least --nproc {k + 1}",
    )
    _require(
        p.dp in (-1, world_size - k),
        f"run.nproc: {world_size} ranks, but parallel.dp + parallel.ps_shards = "
        f"{p.dp} workers + {k} dedicated servers = {p.dp + k}; give --nproc {p.dp + k}, or leave parallel.dp "
        "unset (= run.nproc - ps_shards)",
    )
    return k


def check_tensor_parallel(cfg: LoomConfig) -> None:
    """The shapes tensor parallelism splits (and, with sp, the sequence) divide by tp (:mod:`loom.rules`)."""
    p = cfg.parallel
    _require_none(tensor_parallel_problem(model_facts(cfg), p.tp))
    _require_none(sequence_parallel_problem(p.tp, p.cp, cfg.data.seq_len) if p.sp else None)


def offload_dir(cfg: LoomConfig) -> str:
    """Directory of the memory-mapped optimizer state: ``parallel.offload_dir`` or ``<run.dir>/offload``."""
    return cfg.parallel.offload_dir or str(Path(cfg.run.dir) / "offload")


def _unwritable(path: str) -> str | None:
    """Why ``path`` cannot be used as a writable directory (None if it can, creating it if needed).

    Probes by creating a temporary file in ``path`` or, if it does not exist yet, in its nearest
    existing ancestor (permission bits alone lie for root and for read-only mounts).
    """
    probe = Path(path).expanduser()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        return f"{path!r} is not a writable directory ({str(probe)!r} is not a directory)"
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        return f"{path!r} is not a writable directory ({e.strerror or e})"
    return None


def _check_zero3_options(p: ParallelConfig) -> None:
    """ZeRO-Infinity parameter offload and the ZeRO++ options are options of ZeRO-3."""
    zpp = [f for f in ("zeropp_qwz", "zeropp_hpz", "zeropp_qgz") if getattr(p, f)]
    _require(
        p.offload_params == "none" or p.zero == 3,
        f"parallel.offload_params: {p.offload_params!r} offloads ZeRO-3's parameter shards; it needs parallel.zero = 3",
    )
    for f in zpp:
        _require(p.zero == 3, f"parallel.{f}: a ZeRO++ option of ZeRO-3; it needs parallel.zero = 3")
    _require(
        not (zpp and p.offload_params != "none"),
        f"parallel.offload_params: not combined with ZeRO++ ({', '.join(zpp)}) yet",
    )
    _require(p.hpz_group >= 0, f"parallel.hpz_group: must be >= 0, got {p.hpz_group}")
    _require(
        p.zeropp_qgz_bits in (4, 8), f"parallel.zeropp_qgz_bits: must be 4 or 8, got {p.zeropp_qgz_bits}"
    )
    n = p.dp_shard * p.cp
    _require(
        not (p.zeropp_hpz and p.hpz_group > 0 and n > 0 and n % p.hpz_group != 0),
        f"parallel.hpz_group: {p.hpz_group} must divide the sharding group (dp_shard*cp = {n})",
    )


def _check_implemented(cfg: LoomConfig) -> None:
    _check_zero3_options(cfg.parallel)
    for name, pred, msg in NOT_YET:
        if pred(cfg):
            raise ConfigError(f"{name}: {msg}")


def effective_vocab(cfg: LoomConfig, tokenizer_vocab: int) -> int:
    """Model vocabulary: explicit, or the tokenizer's."""
    return cfg.model.vocab_size if cfg.model.vocab_size > 0 else tokenizer_vocab


def check_vocab(cfg: LoomConfig, tokenizer_vocab: int) -> None:
    """An explicit model vocabulary must hold every token id of the tokenizer."""
    _require(
        cfg.model.vocab_size == 0 or cfg.model.vocab_size >= tokenizer_vocab,
        f"model.vocab_size: {cfg.model.vocab_size} is smaller than the tokenizer's {tokenizer_vocab}",
    )


def grad_accum_steps(cfg: LoomConfig) -> int:
    """Micro-steps per optimizer step: global_batch / (micro_batch * dp)."""
    return cfg.train.global_batch // (cfg.train.micro_batch * cfg.parallel.dp)


def load(path: str | None, overrides: list[str]) -> LoomConfig:
    """Defaults, then the TOML file (if any), then CLI overrides."""
    cfg = load_toml(path) if path else LoomConfig()
    return apply_overrides(cfg, overrides)


def reference() -> str:
    """Every field with its type, default, one-line doc (read from this module's source) and, for a
    ``Literal`` field, its allowed values."""
    import inspect
    import re

    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]  {(inspect.getdoc(cls) or '').partition(chr(10))[0]}")
        types_ = _field_types(cls)
        for src in inspect.getsource(cls).splitlines():
            m = re.match(r"\s+(\w+): ([\w| \[\]]+) = (.+?)(?:\s+#\s*(.*))?$", src)
            if m:
                name, typ, default, doc = m.groups()
                allowed = choices(types_[name])
                if allowed:
                    typ, doc = (
                        type(allowed[0]).__name__,
                        f"{doc or ''}; one of: {' | '.join(map(str, allowed))}".lstrip("; "),
                    )
                lines.append(f"  {section}.{name:<22} {typ:<6} {default:<12} {doc or ''}".rstrip())
        lines.append("")
    return "\n".join(lines)
