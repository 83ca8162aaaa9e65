"""The configuration's sections: typed dataclasses, one per ``[section]`` of a TOML file, each field with
its one-line doc (read by :func:`loom.config.parse.reference`), and the values derived from them.

Pure Python (no torch import). ``Literal`` field types are closed sets checked by ``validate``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from loom.rules import AllReduceName, CpModeName, DpModeName, ExpertTpName, ScheduleName


class ConfigError(ValueError):
    """A configuration problem, with a one-line message naming the field."""


# Closed sets of values: a field of one of these types is checked against it (``typing.get_args``).
# train.precision: auto = bf16 on CUDA (fp16 below capability 8.0), fp32 on the CPU (resolved by validate); tf32 = fp32 with TF32 matmuls
# on CUDA; fp8 / int8 = bf16 with the Linear layers' matmuls in float8 / int8 (torchao)
Precision = Literal["auto", "fp32", "tf32", "bf16", "fp16", "fp8", "int8"]


Fp8Recipe = Literal["tensorwise", "rowwise"]  # train.fp8_recipe: torchao float8 scaling granularity


# train.fp8_layers: auto = the Linears where float8 pays on an H100 (loom.memory.precision.fp8_pays); all = every one
Fp8Layers = Literal["auto", "all"]


Optimizer = Literal["adamw", "adafactor", "adam8bit"]


ReduceDtype = Literal["fp32", "bf16", "fp16"]


Offload = Literal["none", "cpu", "disk"]


Device = Literal["auto", "cpu", "cuda"]


Backend = Literal["auto", "gloo", "nccl"]


TextErrors = Literal["strict", "replace"]


DataFormat = Literal["text", "chat", "prompt_completion"]


Overlong = Literal["truncate", "drop"]


# data.bos: auto = the tokenizer's own start tokens before each document (what its post-processor puts
# before one sequence: Llama 3's <|begin_of_text|>, Gemma's <bos>); none = a document starts with its text
DocStart = Literal["auto", "none"]


CpMode = CpModeName  # parallel.cp_mode (loom.rules)


ExpertTp = ExpertTpName  # parallel.expert_tp (loom.rules)


AllReduce = AllReduceName  # parallel.allreduce (loom.rules); butterfly refuses non-power-of-two groups


DpMode = DpModeName  # parallel.dp_mode (loom.rules)


# Parts of the pattern fields train.recompute and train.compress.
RecomputePolicy = Literal["none", "full", "selective"]


CompressFormat = Literal["none", "bf16", "fp8", "int8"]


TensorKind = Literal["attention", "mlp", "norm", "other"]  # what a module's ``activation_kind`` may say


NormKind = Literal["rmsnorm", "layernorm"]  # model.norm


MlpKind = Literal["swiglu", "gelu", "gelu_tanh", "geglu_tanh"]  # model.mlp


GATED_MLPS: tuple[MlpKind, ...] = ("swiglu", "geglu_tanh")  # the MLPs with a gate's partner w3


PositionKind = Literal["rope", "learned"]  # model.positions


RopeKind = Literal["llama3", "linear", "yarn", "longrope"]  # model.rope_kind: the rule rope_scaling applies


QKNormScope = Literal["head", "all"]  # model.qk_norm_scope


NormPlacement = Literal["pre", "post", "sandwich"]  # model.norm_placement


# model.hf_architecture: the Hugging Face family whose tensor names import and export use; auto = the one
# holding the model's tensors (Llama, Qwen2/3, Mixtral, Qwen3-MoE, OLMo-2, Gemma 1/2, GPT-2). Phi-3 fuses q/k/v
# and gate/up.
HFArchitecture = Literal[
    "auto",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MinistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "GPT2LMHeadModel",
    "Phi3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Olmo2ForCausalLM",
    "Olmo3ForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "SmolLM3ForCausalLM",
    "Starcoder2ForCausalLM",
    "Glm4ForCausalLM",
    "SeedOssForCausalLM",
    "HeliumForCausalLM",
    "Ernie4_5ForCausalLM",
    "GraniteForCausalLM",
    "OlmoeForCausalLM",
    "Exaone4ForCausalLM",
]


FinetuneMethod = Literal["full", "lora", "qlora"]  # finetune.method


Compile = Literal["none", "blocks", "full"]  # train.compile


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
    # rows of the embedding and head (>= vocab_size; the padded rows are zeros, masked from loss, softmax
    # and sampling); 0 = automatic: vocab_size, or a multiple of 128*tp when parallel.tp does not divide it
    pad_vocab_to: int = 0
    max_seq_len: int = 256  # longest sequence RoPE is prepared for
    rope_theta: float = 10000.0  # RoPE base frequency
    rope_scaling: float = 0.0  # long-context RoPE: the factor s the rule rope_kind applies (0 = off)
    # with rope_scaling: llama3 (Llama 3.1: the low frequencies / s, the high kept, a ramp between), linear
    # (every frequency / s), yarn (NTK-by-parts: dims ramped from kept to / s by rope_beta_fast and
    # rope_beta_slow, cos and sin times rope_attn_factor), longrope (frequency i / rope_short_factor[i], or
    # rope_long_factor[i] when max_seq_len > rope_original_len; cos and sin times rope_attn_factor)
    rope_kind: RopeKind = "llama3"
    rope_low_freq_factor: float = 1.0  # Llama 3.1 RoPE: wavelengths above original_len / this are scaled
    rope_high_freq_factor: float = 4.0  # Llama 3.1 RoPE: wavelengths below original_len / this are kept
    rope_original_len: int = 8192  # llama3, yarn, longrope: the context length pretraining used
    rope_beta_fast: float = 32.0  # YaRN: dims turning more than this many times over original_len are kept
    rope_beta_slow: float = 1.0  # YaRN: dims turning fewer than this many times are divided by s
    rope_truncate: bool = True  # YaRN: round the ramp's ends outward to whole dims
    # YaRN, LongRoPE: cos and sin times this; 0 = the rule's (yarn: 0.1 ln s + 1; longrope:
    # sqrt(1 + ln s / ln original_len); 1 when s <= 1)
    rope_attn_factor: float = 0.0
    rope_short_factor: list[float] = field(default_factory=list)  # LongRoPE: r/2 divisors, one per frequency
    rope_long_factor: list[float] = field(default_factory=list)  # LongRoPE: used beyond rope_original_len
    # the share of each head's dims RoPE rotates: the first r = d·f (even); the rest pass unrotated (Phi-4-mini: 0.75)
    rope_fraction: float = 1.0
    norm_eps: float = 1e-5  # epsilon of the norms (RMSNorm or LayerNorm)
    tie_embeddings: bool = True  # share the embedding matrix with the output head
    init_std: float = 0.02  # std of the normal init; output projections use std/sqrt(2L)
    dropout: float = 0.0  # dropout on both residual branches and in the attention core (training only)
    n_experts: int = 1  # > 1: every block's MLP is a mixture of this many SwiGLU experts
    top_k: int = 2  # experts each token is routed to (mixture of experts only)
    qkv_bias: bool = False  # biases on the query/key/value projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head's query and key before RoPE (Qwen3)
    # with qk_norm: head = over each head's d (Qwen3); all = over the whole projection, a·d and k·d wide (OLMo-2)
    qk_norm_scope: QKNormScope = "head"
    # pre: x + attn(norm(x)), then the same with the MLP (Llama); post: x + norm(attn(x)), ... (OLMo-2)
    # sandwich: both, x + norm(attn(norm(x))), then the same with the MLP (Gemma 2 and 3)
    norm_placement: NormPlacement = "pre"
    attn_head_dim: int = 0  # size of one attention head; 0 = dim / n_heads
    norm: NormKind = "rmsnorm"  # layernorm: (x - mean) / std * w + b (GPT-2)
    mlp: MlpKind = "swiglu"  # gelu / gelu_tanh: w2(gelu(w1 x)), exact or tanh-approximated (GPT-2's gelu_new)
    # (geglu_tanh: w2(gelu_tanh(w1 x) * w3 x), Gemma's gated GELU)
    norm_offset: bool = False  # RMSNorm scales by 1 + w, w starting at 0 (Gemma)
    embed_scale: bool = False  # token embeddings times sqrt(dim), rounded to the activation dtype (Gemma)
    # scale of q·k before the softmax; 0 = 1/sqrt(head_dim) (Gemma 2: query_pre_attn_scalar^-1/2)
    attn_scale: float = 0.0
    attn_softcap: float = 0.0  # > 0: scores s -> c·tanh(s/c) before the softmax (Gemma 2: 50); 0 = off
    logit_softcap: float = 0.0  # > 0: logits z -> c·tanh(z/c) (Gemma 2: 30); 0 = off
    embed_multiplier: float = 1.0  # token embeddings times this (Granite's embedding_multiplier)
    residual_multiplier: float = (
        1.0  # each attention and MLP output times this before its residual add (Granite)
    )
    logit_divisor: float = 1.0  # logits divided by this (Granite's logits_scaling), before any cap
    # > 0: on the windowed layers query i sees keys j with i - w < j <= i (Mistral, Gemma 2/3, Phi-3); 0 = all
    sliding_window: int = 0
    # the windowed layers: all, or their indices "0,2,4" (Gemma 2: every other one)
    window_layers: str = "all"
    # the layers that rotate no position into q and k (NoPE: SmolLM3's every fourth): indices "3,7"; "" = none
    nope_layers: str = ""
    # > 0: the RoPE base of the layers window_layers lists (Gemma 3's rope_local_base_freq), the others'
    # rope_theta; 0 = one base for all
    rope_local_theta: float = 0.0
    # learned: a (max_seq_len, dim) table added to the token embeddings (GPT-2)
    positions: PositionKind = "rope"
    bias: bool = False  # biases on every linear layer but the output head and the router (GPT-2)
    from_hf: str = ""  # local Hugging Face model directory to start from: its shape, weights and tokenizer
    # the Hugging Face family import and export name the tensors after (from_hf: the directory's); auto = by shape
    hf_architecture: HFArchitecture = "auto"

    @property
    def moe(self) -> bool:
        return self.n_experts > 1

    def resolved_ffn_dim(self) -> int:
        """SwiGLU hidden size: explicit, or ``multiple_of * ceil(8h/3 / multiple_of)``."""
        if self.ffn_dim > 0:
            return self.ffn_dim
        hidden = int(8 * self.dim / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def windowed_layers(self) -> frozenset[int]:
        """The layers whose attention is windowed (``sliding_window`` > 0): :meth:`local_layers`."""
        return self.local_layers() if self.sliding_window > 0 else frozenset()

    def local_layers(self) -> frozenset[int]:
        """The layers ``window_layers`` lists (windowed with ``sliding_window``, and at
        ``rope_local_theta`` when set): every one for ``all``, else the comma-separated indices; a bad
        list raises naming the field."""
        return self._layer_list("window_layers")

    def nope_layer_set(self) -> frozenset[int]:
        """The layers ``nope_layers`` lists (no RoPE on their q and k)."""
        return self._layer_list("nope_layers") if self.positions == "rope" else frozenset()

    def _layer_list(self, field: str) -> frozenset[int]:
        """``field``'s layers: every one for ``all``, else its comma-separated ASCII indices in
        [0, n_layers); a bad list raises naming the field."""
        text = getattr(self, field)
        if text.strip() == "all":
            return frozenset(range(self.n_layers))
        parts = [p.strip() for p in text.split(",") if p.strip()]
        _require(
            all(p.isascii() and p.isdigit() and int(p) < self.n_layers for p in parts),
            f"model.{field}: 'all' or comma-separated layer indices in [0, {self.n_layers}), got {text!r}",
        )
        return frozenset(int(p) for p in parts)

    def attention_share(self, seq_len: int) -> float:
        """The share of causal attention's T(T+1)/2 (query, key) pairs the layers compute, on average over
        them: a layer windowed by w < T sees w·T − w(w−1)/2; every other layer all (1 without a window)."""
        T, w = seq_len, self.sliding_window
        windowed = len(self.windowed_layers())
        if not windowed or w >= T:
            return 1.0
        seen = (w * T - w * (w - 1) / 2) / (T * (T + 1) / 2)
        return 1.0 - windowed / self.n_layers * (1.0 - seen)

    @property
    def rope_dims(self) -> int:
        """r: the dims of each head RoPE rotates, int(head_dim · rope_fraction)."""
        return int(self.head_dim * self.rope_fraction)

    @property
    def rope_long(self) -> bool:
        """LongRoPE divides by ``rope_long_factor`` (the tables reach beyond ``rope_original_len``), else
        by ``rope_short_factor``."""
        return self.max_seq_len > self.rope_original_len

    def rope_idle_fields(self) -> frozenset[str]:
        """The RoPE fields with no effect on this model (one rule for every place that asks): all of
        them with learned positions; those of the long-context rules ``rope_scaling`` and ``rope_kind``
        do not select."""
        rules = {
            "llama3": ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_len"),
            "linear": (),
            "yarn": (
                "rope_original_len",
                "rope_beta_fast",
                "rope_beta_slow",
                "rope_truncate",
                "rope_attn_factor",
            ),
            "longrope": ("rope_original_len", "rope_short_factor", "rope_long_factor", "rope_attn_factor"),
        }
        scaling = {f for used in rules.values() for f in used} | {"rope_kind"}
        if self.positions != "rope":
            return frozenset(
                scaling | {"rope_theta", "rope_scaling", "rope_fraction", "rope_local_theta", "nope_layers"}
            )
        if not self.rope_scaling:
            return frozenset(scaling)
        return frozenset(scaling - set(rules[self.rope_kind]) - {"rope_kind"})

    @property
    def gated_mlp(self) -> bool:
        """The MLP has a gate's partner w3 (SwiGLU, GeGLU): three matrices, else two (GELU)."""
        return self.mlp in GATED_MLPS

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding table and the output head: ``pad_vocab_to``, or ``vocab_size``."""
        return max(self.pad_vocab_to, self.vocab_size)


@dataclass
class SourceConfig:
    """One source of a training mixture: a ``[[data.sources]]`` table."""

    # file, directory or glob of .txt/.jsonl/.jsonl.gz/.parquet/.arrow, or a datasets save_to_disk dir
    path: str = ""
    weight: float = 1.0  # share of training sequences drawn from it (weights are normalized over the sources)
    text_field: str = "text"  # field holding the text in its records
    format: DataFormat = "text"  # chat / prompt_completion records (labels only on answers, as data.format)


@dataclass
class DataConfig:
    """Where tokens come from."""

    source: str = "stdlib"  # "stdlib" (the Python standard library source, ~10 MB, offline) or a file/dir/glob of .txt/.jsonl/.parquet
    # where train.bin/val.bin/tokenizer.json live; "" = a cache dir keyed by source+vocab
    prepared_dir: str = ""
    tokenizer: str = ""  # path to a tokenizer.json to use; "" = train a byte-level BPE on the corpus
    vocab_size: int = 4096  # BPE vocabulary size when training a tokenizer
    seq_len: int = 256  # tokens per training sequence T
    val_fraction: float = 0.02  # share of the corpus held out for eval loss
    # cap on corpus text read; 0 = no cap (preparation streams: memory stays flat)
    max_corpus_mb: float = 24.0
    text_field: str = "text"  # field holding the text in .jsonl/.parquet records
    # splits each .txt file into documents at this string (e.g. "\n\n"); "" = a file is one document
    doc_separator: str = ""
    # invalid UTF-8 in the corpus: strict refuses, naming the file; replace counts and reports
    errors: TextErrors = "strict"
    # tokenizing processes for prepare; 0 = one per CPU core (output identical for any count)
    workers: int = 0
    pack: bool = False  # batches carry positions: RoPE restarts and attention stays inside each document
    format: DataFormat = "text"  # chat: records with messages; prompt_completion: prompt + completion fields
    # chat/prompt_completion: also train on prompt tokens (else labels -100 there)
    train_on_prompt: bool = False
    # chat/prompt_completion examples over seq_len + 1 tokens: cut or left out
    overlong: Overlong = "truncate"
    sources: list[SourceConfig] = field(
        default_factory=list
    )  # [[data.sources]] mixture (replaces data.source)
    # the tokenizer's start token before each document and example (auto: where its post-processor puts one,
    # as transformers' tokenizer(text) does: Llama 3, Gemma, Mistral; none for GPT-2, Qwen, Loom's own)
    bos: DocStart = "auto"
    # debug: rank 0 writes each step's [source, window] sample ids to run.dir/sample_ids.jsonl
    record_ids: bool = False


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
    # an MoE's experts under tp: whole on every tp rank, or split like the dense MLP (w1/w3 columns, w2
    # rows: 1/tp of their memory; Megatron-Core's expert tensor parallelism = tp)
    expert_tp: ExpertTp = "replicate"
    zero: int = 0  # ZeRO stage 0 (plain data parallel), 1, 2 or 3
    bucket_mb: float = 25.0  # gradient bucket size for the all-reduce, in MB
    reduce_dtype: ReduceDtype = "fp32"  # dtype gradients are reduced in
    # gradient all-reduce: the backend's own, or ring | tree | butterfly on point-to-point
    allreduce: AllReduce = "native"
    dp_mode: DpMode = "allreduce"  # data-parallel gradients: all-reduced, or through a parameter server (ps)
    ps_shards: int = 1  # dp_mode = ps: K servers, each holding 1/K of the parameters and their AdamW state
    ps_colocate: bool = True  # dp_mode = ps: server k lives in worker rank k (else K dedicated server ranks: run.nproc = dp + K)
    # dp_mode = ps: bsp (synchronous) | asp (asynchronous) | ssp:S (at most S steps stale)
    ps_sync: str = "bsp"
    schedule: ScheduleName = "1f1b"  # pipeline schedule (pipedream and 2bw are asynchronous)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule only)
    # manual cut, inclusive block ranges per stage ("0-3,4-7"); "" = profile and partition
    pp_layout: str = ""
    # pipedream: each stage uses the weight version stage 0 used for the micro-batch
    vertical_sync: bool = False
    # where ZeRO optimizer state lives: cpu = host memory (ZeRO-Offload), disk = mmap files
    offload: Offload = "none"
    offload_dir: str = ""  # directory for parallel.offload = "disk"; "" = <run.dir>/offload
    # ZeRO-3: free gathered params after forward, gather again for backward
    reshard_after_forward: bool = True
    offload_params: Offload = "none"  # ZeRO-3 (ZeRO-Infinity): parameter and gradient shards on cpu = host memory, disk = mmap files
    zeropp_qwz: bool = False  # ZeRO++ qwZ (ZeRO-3): weights all-gathered as block-wise int8 + absmax scales
    # ZeRO++ hpZ (ZeRO-3): a secondary weight partition per node group; backward gathers inside it
    zeropp_hpz: bool = False
    # ZeRO++ qgZ (ZeRO-3): gradients reduce-scattered as block-wise int8 through an all-to-all, in two hops
    # (inside each node, then across nodes) when the sharding group spans nodes (of hpz_group ranks)
    zeropp_qgz: bool = False
    zeropp_qgz_bits: int = 8  # ZeRO++ qgZ: 8 (int8) or 4 (int4, two codes a byte) bits per gradient element
    # ZeRO++ hpZ and qgZ: the sharding group's ranks on one node (hpZ's secondary partition, qgZ's first
    # hop); 0 = the launcher's LOCAL_WORLD_SIZE / tp
    hpz_group: int = 0
    auto: bool = False  # let the planner (loom.plan) choose the layout and micro-batch for the world size
    # the planner's calibration profile (loom plan calibrate) for parallel.auto and the plan_* metrics;
    # "" = ./profile.json if present, else the device's datasheet
    profile: str = ""


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
    beta1: float = 0.9  # AdamW: decay of the first moment (the gradient's running mean)
    beta2: float = 0.95  # AdamW: decay of the second moment (the squared gradient's running mean)
    eps: float = 1e-8  # AdamW: added to the second moment's square root in the update's denominator
    grad_clip: float = 1.0  # clip global grad norm to this; 0 = off
    seed: int = 1234  # seeds init and data order (the same under every layout) and dropout (masks per rank)
    eval_every: int = 100  # steps between eval losses (an eval step is logged too); 0 = off
    eval_batches: int = 4  # micro-batches per eval
    log_every: int = 10  # steps between step lines / metrics rows
    # compute dtype; auto = bf16 on CUDA (fp16 below capability 8.0), fp32 on the CPU; bf16/fp16: half weights and activations, fp32
    # master weights + optimizer state; tf32: fp32 with TF32 matmuls on CUDA (identical to fp32 on the CPU);
    # fp8/int8: bf16 with the blocks' Linear matmuls in float8 / int8 (torchao; emulated on the CPU)
    precision: Precision = "auto"
    fp8_recipe: Fp8Recipe = "tensorwise"  # fp8 scaling: one scale per tensor, or per row (torchao recipes)
    # fp8: which block Linears run float8; auto = those whose GEMM per tp rank is large enough for float8 to
    # pay on an H100 (the rest stay bf16), all = every one whose dims are multiples of 16·tp
    fp8_layers: Fp8Layers = "auto"
    optimizer: Optimizer = "adamw"  # adafactor: factored second moments; adam8bit: block-wise 8-bit moments
    recompute: str = "none"  # activation recomputation: none | full | selective (attention core) | every:<k>
    # saved activations stored as none | bf16 | fp8 | int8, or per kind "mlp=fp8,attention=bf16"
    compress: str = "none"
    offload_activations: bool = False  # saved activations to pinned host memory (GPU runs only)
    compile: Compile = "none"  # torch.compile of each block and the loss (blocks), or the whole model (full)
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
    # weights only (Loom checkpoint or local HF directory): fresh optimizer, step 0, any layout
    init_from: str = ""
    time_limit_s: float = 0.0  # stop early (and save) after this many seconds; 0 = none
    # log the gradient noise scale (gns, gns_g2, gns_trace) on logged steps: one more micro-batch each (loom.train.gns)
    log_gns: bool = False


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
    trackers: str = ""  # experiment trackers, comma-separated: wandb, mlflow (tensorboard: run.tensorboard)
    straggler_pct: float = 20.0  # name a rank busy this % above the median for 3 logged steps; 0 = off
    profile_steps: str = ""  # torch.profiler traces of these steps ("10-12" or "10") in run.dir/profile/
    memory_snapshot_step: int = 0  # record this step's allocations in run.dir/profile/; 0 = none
    master_addr: str = "127.0.0.1"  # rendezvous address; loopback unless you mean multi-node
    master_port: int = 0  # rendezvous port; 0 = pick a free one
    threads: int = 0  # torch intra-op threads per rank; 0 = cores / local ranks
    preempt_grace_s: float = 60.0  # SIGTERM/SIGINT: seconds to save the current step and exit (then killed)


MoEScore = Literal["softmax", "sigmoid"]  # moe.score


DropPolicy = Literal["probability", "position"]  # moe.drop_policy


ExpertCompute = Literal["grouped", "loop"]  # moe.compute


@dataclass
class MoEConfig:
    """Mixture-of-experts routing and balancing (used when model.n_experts > 1)."""

    # router scores: softmax over experts (Mixtral) or per-expert sigmoid (DeepSeek-V3)
    score: MoEScore = "softmax"
    norm_topk: bool = True  # routing weights of the k chosen experts renormalized to sum to 1
    n_shared_experts: int = 0  # experts every token goes through (one SwiGLU of this many expert widths)
    aux_loss_coef: float = 0.0  # Switch/GShard load-balancing loss α·E·Σ_e f_e·P_e (0 = off)
    z_loss_coef: float = 0.0  # router z-loss β·mean(logsumexp(logits)²) (0 = off)
    # aux-loss-free balancing: per-expert selection bias += rate·sign(mean load - load)
    bias_update_rate: float = 0.0
    capacity_factor: float = 0.0  # tokens an expert takes per micro-batch: ceil(cf·N·k/E); 0 = dropless
    drop_policy: DropPolicy = "probability"  # over capacity, keep the highest-weight or the earliest tokens
    compute: ExpertCompute = "grouped"  # experts as one grouped matmul, or a Python loop (reference)
    imbalance: float = 0.0  # planner input: max/mean tokens per expert (a run's moe_imbalance metric); 0 = measured by `loom plan calibrate --config`, else 1
    rebalance_every: int = 0  # expert parallelism: every this many steps, replicate the hottest experts on every ep rank (0 = off)
    # experts per layer replicated at each rebalance (the most loaded since the last one)
    hot_experts: int = 1


@dataclass
class FinetuneConfig:
    """Parameter-efficient fine-tuning: LoRA adapters on a frozen base (QLoRA: the base stored in NF4)."""

    # full: train every weight; lora: frozen base + adapters; qlora: lora on a 4-bit NF4 base
    method: FinetuneMethod = "full"
    # r: each target W (d_out, d_in) gets A (r, d_in) and B (d_out, r), r·(d_in + d_out) trained
    lora_rank: int = 16
    lora_alpha: float = 32.0  # the adapter's output is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0  # dropout on the adapter's input (training only)
    # comma list of q,k,v,o,w1,w2,w3 (attention and MLP linears), or all-linear
    lora_targets: str = "all-linear"


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


OPTIMIZERS: tuple[str, ...] = typing.get_args(Optimizer)


def _field_types(cls: type) -> dict[str, Any]:
    return dict(_field_types_of(cls))


@functools.cache
def _field_types_of(cls: type) -> dict[str, Any]:
    """Resolved once per class: ``typing.get_type_hints`` compiles every string annotation."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def choices(typ: Any) -> tuple[Any, ...]:
    """The allowed values of a ``Literal[...]`` field type; () for other types."""
    return typing.get_args(typ) if typing.get_origin(typ) is Literal else ()


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _require_none(problem: str | None) -> None:
    if problem:
        raise ConfigError(problem)


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


def grad_accum_steps(cfg: LoomConfig) -> int:
    """Micro-steps per optimizer step: global_batch / (micro_batch * dp)."""
    return cfg.train.global_batch // (cfg.train.micro_batch * cfg.parallel.dp)


def vocab_padding(vocab: int, tp: int, pad_vocab_to: int = 0) -> int:
    """Rows of the embedding and head for ``vocab`` real tokens: ``pad_vocab_to`` when given, else
    ``vocab`` when tp divides it, else the next multiple of 128·tp (Megatron's rule)."""
    if pad_vocab_to > 0:
        return pad_vocab_to
    if vocab % tp == 0:
        return vocab
    unit = 128 * tp
    return -(-vocab // unit) * unit


def effective_vocab(cfg: LoomConfig, tokenizer_vocab: int) -> int:
    """Model vocabulary: explicit, or the tokenizer's. Resolves ``model.pad_vocab_to`` for it on the
    way (:func:`vocab_padding` of ``parallel.tp``), and logs a padding once."""
    vocab = cfg.model.vocab_size if cfg.model.vocab_size > 0 else tokenizer_vocab
    padded = vocab_padding(vocab, cfg.parallel.tp, cfg.model.pad_vocab_to)
    if padded > vocab:
        logging.getLogger("loom").info("vocab %d padded to %d for tp=%d", vocab, padded, cfg.parallel.tp)
    cfg.model.pad_vocab_to = padded if padded > vocab else cfg.model.pad_vocab_to
    return vocab


def offload_dir(cfg: LoomConfig) -> str:
    """Directory of the memory-mapped optimizer state: ``parallel.offload_dir`` or ``<run.dir>/offload``."""
    return cfg.parallel.offload_dir or str(Path(cfg.run.dir) / "offload")
