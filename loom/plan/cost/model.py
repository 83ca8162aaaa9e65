"""Cost model: per-device memory and step time of one parallel layout, from formulas alone.

Notation: L layers, h hidden, a query heads, k kv heads, d = h/a, f SwiGLU hidden, V vocabulary,
s sequence, b micro-batch, T = b*s/cp tokens a device holds, t = tp, p = pp, v virtual stages,
m = global_batch / (dp*b) micro-batches per step, Phi parameters. Bytes per element of an
activation B_a (2 for bf16/fp16/fp8, 4 for fp32).

Parameters (:class:`ParamCounts`), per layer: attention 2h^2 + 2hkd, SwiGLU 3hf (MoE: E*3hf
plus a router hE), norms 2h; plus embedding Vh, head Vh unless tied, final norm h. GPT-2's
variants: the GELU MLP 2hf, biases (q/k/v h + 2kd, wo h, w1 f, w2 h; the row-parallel wo and w2
biases whole on every tp rank), LayerNorm biases (norms 4h, final 2h), a position table sh.

Memory, per device, of the largest stage (first holds the embedding, last the head and logits):

- model states, bytes per parameter (W, G, O) = (2, 2, 12) mixed precision (bf16 weights and
  grads, fp32 master/momentum/variance), (4, 4, 8) fp32. Over a ZeRO group of N = dp_shard*cp:
  stage 0: W+G+O; 1: W+G+O/N; 2: W+(G+O)/N; 3: (W+G+O)/N plus the transient of a unit in
  backward: gathered, its gradient filling, the next block prefetched (``_zero3_transient``). Stages 2/3 with gradient accumulation (m > 1) hold full-size gradients
  between micro-batches (reduced once, after the last, as FSDP's ``no_sync``). ``offload`` moves O to host memory. Layer weights divide by t, experts
  by ep only (whole on every tp rank); the vocabulary-parallel embedding and head by t; norms are replicated.
- activations of one layer for one micro-batch, derived like Korthikanti et al. 2022 for this
  block (pre-norm, fused RMSNorm saving its input, RoPE, GQA, SwiGLU, no dropout, no biases)::

      norm inputs 2 B_a T h, norm outputs (matmul inputs) 2 B_a T h     -> / t only with sp
      q B_a T h, k and v 2 B_a T k d                                    -> / t
      attention output (wo input) B_a T h, log-sum-exp 4 T a            -> / t (gone: selective)
      scores: softmax output B_a a T s, only without flash attention    -> / t (gone: selective)
      SwiGLU w1 x, silu(w1 x), w3 x, their product: 4 B_a T f           -> / t

  With B_a = 2 and cp = 1 this is s b h (c1 + c2 a s / h) with c1 = 12 + 4 k/a + 8 f/h
  (+ 4a/h for the log-sum-exp) and c2 = 2 without flash, 0 with flash/SDPA. Tensor parallel
  without sp divides all but the 8 s b h of norm inputs/outputs by t; with sp all of it.
  Selective recomputation drops the attention core's outputs (scores, o, lse); full
  recomputation keeps only the block input B_a T h (/t with sp) per layer plus one layer's
  working set. GQA is counted at kv width (a GQA-aware kernel); the reference model's
  ``repeat_interleave`` before SDPA would store k, v at width h instead.
- times the layers of activations held at peak on stage i (in micro-batches x layers):
  GPipe m*L/p; 1F1B min(m, p-i)*L/p; ZB-H1 min(m, p)*L/p (deferred W keeps inputs alive on
  every stage); interleaved (Megatron's warm-up count)
  min(m v, 2(p-i-1) + (v-1)p + 1) * L/(p v), which for stage 0 is L (1 + (p-1)/(p v)).
- logits on the last stage: T V / t (B_a + 8) bytes (logits, fp32 copy, fp32 log-softmax).
- overhead: the device's runtime constant (context, workspaces, comm buffers) plus
  FRAGMENTATION (10%) of the dynamic memory (activations, logits, gather buffers).

Time of one step:

- compute: each GEMM of a layer by :meth:`Machine.gemm` with M = T tokens: on a GPU from the
  datasheet, tile and wave quantization over its SMs plus a per-tile fixed cost (K0), against its
  HBM traffic (the roofline); on a CPU or with a calibrated rate, 2MKN / flops. Backward is r = 2x
  forward (the FLOP ratio; a calibration profile may measure r nearer 1 for small layers where
  per-op cost sets the time). Attention core per kernel (:meth:`CostModel._attention_core`): a
  causal flash kernel runs half of the 4 T s h / t FLOPs (the PaLM/Megatron convention 12 L h s
  per token that the FLOP counts keep) at the device's flash share of peak, backward 2.5x those
  FLOPs; unfused (no flash) two batched GEMMs per head and 4 B a s^2 bytes of scores. Elementwise
  ops (norms, residuals, RoPE, SwiGLU/GeLU, loss) as bytes over HBM bandwidth, times the stack's
  ``other`` (:class:`Stack`: how many passes its kernels make, fitted on published runs). Full
  recomputation adds the layers' forward (x4/3 of layer FLOPs), selective the attention core's
  (plus ``Stack.selective_gemms`` of the GEMMs). Pipeline stages hold L / p blocks, or with p not
  dividing L the spare blocks on middle stages first (:meth:`CostModel.stage_layers`); the
  slowest of first, middle and last sets t_mb.
- framework (a device with a per-operator cost, ``op_overhead``: CPUs): per micro-batch
  c_op · (L_s · ops_block(recompute) + ops_head) + (L_s + 1) · t_block, the operators counted on a
  tiny model of the same structure (:mod:`loom.plan.opcount`), t_block the trainer's hooks per block
  (recomputation: t_block again in proportion to the operators it repeats);
  the optimizer adds c_op · ops_optimizer and takes max(bytes / HBM, elements / its arithmetic rate).
- tensor parallel: the calls Loom issues (:meth:`CostModel.tp_calls`): per layer 4 all-reduces
  of T h B_a bytes fwd+bwd, 6 with full recomputation; with sp 6 all-gathers + 4 reduce-scatters
  of that size; plus embedding, head and vocab-parallel loss calls, and once per step one
  all-reduce of the gradients held in part (sp norms, replicated kv heads). Each call costs
  latency + volume / bandwidth, on the intra-node link, + the profile's ``call_overhead["tp"]``
  (what a call costs in Loom's layers beyond the collective; on a CPU the twin below charges
  ``call_overhead_cpu["tp"]``); not overlapped, or with
  ``Layout.tp_overlap`` cut in t chunks pipelined with the layer's GEMMs:
  comm / t + max(0, comm (t-1)/t - GEMMs fwd+bwd) per layer.
- context parallel (:mod:`loom.parallel.context.parallelize`, :meth:`CostModel._cp_layer_time`), by
  ``Layout.cp_mode``: allgather all-gathers K and V over cp before the core (again under full
  recomputation) and reduce-scatters dK, dV, not overlapped, and saves the other ranks' keys and
  values (2 B T (cp-1) kd / t more activation bytes per layer); ring sends K/V blocks (and fp32
  dK/dV backward) point to point, each hop overlapped with one block's attention, and saves only
  the local ones; alltoall exchanges q, k, v and the output over cp, not overlapped, and saves its
  repeated kv heads (f = cp / gcd(k, cp)) and its own output (B T h / t) more.
- expert parallel: 4 all-to-alls per MoE layer (dispatch + combine, fwd and bwd; 6 with full
  recomputation) of T top_k h B_a bytes, (ep-1)/ep of it leaving the device, and the small
  all-to-all of per-expert counts before each dispatch (latency only); each of these calls also
  ``call_overhead["ep"]`` (measured through Loom's expert-parallel layer: the counts' host round
  trip, the splits, the waits of synchronous all-to-alls), its CPU ``call_overhead_cpu["ep"]``.
- pipeline: per micro-batch stage time t_mb (slowest stage); bubble (p-1) t_mb for GPipe/1F1B
  (fraction (p-1)/(m+p-1)), (p-1)/v t_mb interleaved, (p-1)(t_mb - 2 t_W) for ZB-H1 (t_W the
  weight-gradient half of backward); P2P of T h B_a / t bytes per chunk boundary, 2 m v
  transfers per step, not overlapped.
- data parallel over dp*cp ranks (grads in ``reduce_dtype``), reduced once per step after the
  last micro-batch: ZeRO 0 all-reduce 2 Phi (n-1)/n; ZeRO 1/2 reduce-scatter + all-gather (same
  volume); ZeRO-3 all-gathers Phi forward and Phi - Phi_last backward every micro-batch, one call
  per unit, and reduce-scatters once (3 Phi - Phi_last for m = 1; :meth:`CostModel._dp_comm`);
  in a pipeline a stage keeps no unit gathered and its gathers run inside each micro-batch's
  stage time: 2 Phi_s of the busier end stage (the last: + final norm and head, a tied head's
  copy a unit of its own) m times in the step and once more per bubble slot
  (:meth:`CostModel.zero3_stage_gathers`, hidden behind t_mb as below);
  every bucket or unit call pays the measured latency; hybrid sharding adds an all-reduce of the
  shard across replicas. Across nodes a ring's bus bandwidth is the NIC share of the group's
  members on a node (:meth:`Machine.inter_bandwidth`). With ``Layout.dp_overlap`` (default) it
  hides bucket by bucket behind the last micro-batch's backward (ZeRO 1/2 also the next
  forward, ZeRO 3 all micro-batches), but the last call; what runs beside compute slows it by
  1 - ``comm_overlap`` (0.8 hidden on GPUs; on a CPU the share ``loom plan calibrate`` measures,
  an async all-gather beside compute: gloo's thread mostly waits, but shares the cores; 0 without
  a profile) (:meth:`CostModel._dp_time`).
- step synchronisation: the scalar collectives of every step (loss averaged over dp, gradient
  norm summed over tp, the ZeRO group and pp, loss broadcast over pp), one call latency each.
- optimizer: Adam reads and writes 28 bytes per local parameter at HBM speed; offloaded, at
  HOST_ADAM_BANDWIDTH per node, plus grads down and weights up over the host link.
- cpu bound (a CPU profile with the collectives' CPU seconds, scope ``cpu``): ranks sharing cores
  cannot finish a step before the cores have run every rank's CPU work. The same model on those
  seconds (nothing hidden, no bubble: a waiting rank spends nothing) sums a rank's CPU demand D,
  each collective's CPU scaled by the compute share as compute is (``contended``):
  step = max(critical path, D), the excess shown as ``cpu bound``. With a core per rank D stays
  below the path; with two ranks per core the collectives' own CPU (gloo's threads, the kernel's
  socket copies: 0.3-0.6 ms a call here) competes with the other ranks' compute. A tp or ep call
  adds its layer's CPU (``call_overhead_cpu``: a tp call through Loom's layers spends 0.47-0.64 ms
  here, the bare collective between compute 0.26-0.51 ms).

Outputs: step time, tokens/s, achieved TFLOP/s per device (hardware FLOPs incl. recomputation,
as Megatron reports), MFU (model FLOPs 6N + 12 L h s per token, no recomputation, over the
peak of the precision, as PaLM defines it), peak memory per device and its breakdown, and the
largest time term.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from functools import lru_cache

from loom.config import OPTIMIZERS, ModelConfig, target_shapes
from loom.finetune.nf4 import nf4_bytes
from loom.mesh import ParallelDims
from loom.model.llama import flops_per_token
from loom.optim.adam8bit import BLOCK as ADAM8BIT_BLOCK
from loom.plan import collectives
from loom.plan.hardware import ClusterSpec, HardwareError, Machine, Profile
from loom.plan.opcount import op_counts
from loom.plan.zero_options import zero3_memory, zeropp_time
from loom.rules import (
    CP_MODES,
    ModelFacts,
    ScheduleName,
    context_parallel_problem,
    layout_problems,
    sequence_parallel_problem,
    tensor_parallel_problem,
)

SCHEDULES: tuple[ScheduleName, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1")  # those the formulas model
RECOMPUTE = ("none", "selective", "full")  # the policies of config.RecomputePolicy, cheapest first
FRAGMENTATION = 0.10  # share of dynamic memory lost to allocator fragmentation (assumption)
HOST_ADAM_BANDWIDTH = 100e9  # host memory bandwidth for CPU Adam, bytes/s per node (assumption)
ADAM_BYTES = 28  # bytes read + written per parameter by one Adam step
FLASH_BWD = 2.5  # flash attention backward / forward time (it recomputes the scores; Dao 2023)


def default_split(n_layers: int, pp: int) -> tuple[int, ...]:
    """Blocks per stage when none are given: ``L = q pp + r``, the r spare blocks on middle stages
    first, then the last, then the first (those two also hold the embedding and the head):
    70 on 12 -> 5, 6 x 10, 5 (BLOOM's split); 30 on 4 -> 7, 8, 8, 7."""
    q, rem = divmod(n_layers, pp)
    counts = [q] * pp
    order = list(range(1, pp - 1)) + [pp - 1, 0]
    for i in order[:rem]:
        counts[i] += 1
    return tuple(counts)


def split_layout(counts: tuple[int, ...]) -> str:
    """``parallel.pp_layout`` of per-stage block counts: (1, 3) -> "0-0,1-3"."""
    bounds, lo = [], 0
    for c in counts:
        bounds.append(f"{lo}-{lo + c - 1}")
        lo += c
    return ",".join(bounds)


@dataclass(frozen=True)
class Stack:
    """Training software whose kernels and overlap a prediction assumes (published runs name theirs).

    ``other`` scales the time of everything but GEMMs and attention kernels (elementwise, norms,
    softmax, loss: the memory-bound work) for a stack that fuses less than one pass over each
    tensor (fitted on the published runs, 1.75-2.8: eager or partly fused norms, bias/GeLU,
    softmax and loss read and write each tensor about twice what Loom's one-pass count says).
    ``selective_gemms``: what "selective" recomputation means there beyond the attention core
    (Korthikanti et al.'s policy, Loom's and Megatron's: 0); torchtitan's op-level policy saves
    every other matmul output and recomputes the rest (0.5). ``microbatch_reduce``: Composer's
    FSDP reduce-scatters the gradients of every micro-batch (Loom and torchtitan keep them whole
    until the last: ``no_sync``); ``logit_bytes``: llm-foundry's fused cross entropy works on the
    bf16 logits in place (2 + 2 bytes, the logits and their gradient).
    """

    name: str
    other: float = 1.0
    selective_gemms: float = 0.0  # share of a layer's GEMMs that "selective" recomputation runs again
    microbatch_reduce: bool = (
        False  # ZeRO-2/3 reduce-scatter every micro-batch (FSDP without no_sync): no full-size grads
    )
    logit_bytes: float = (
        0.0  # bytes per logit at the loss's peak (0: B_a + 8, logits + fp32 copy + log-softmax)
    )
    note: str = ""


STACKS: dict[str, Stack] = {
    s.name: s
    for s in (
        Stack(
            "",
            other=1.8,
            note="Loom: eager PyTorch norms/activations and SDPA flash attention, as torchtitan's",
        ),
        Stack(
            "megatron-core",
            other=1.3,
            note="Megatron-Core + Transformer Engine (fused norm-GEMM, bias-GeLU): an "
            "assumption between one pass and Megatron-LM's fitted 1.85, not fitted (no public bf16 row outside the held-out set)",
        ),
        Stack(
            "megatron-lm-2021",
            other=1.85,
            note="Megatron-LM (2021): fused softmax/bias-GeLU kernels, no flash attention",
        ),
        Stack(
            "megatron-deepspeed",
            other=2.8,
            note="Megatron-DeepSpeed (BLOOM, MT-NLG): Megatron kernels, DeepSpeed pipeline and ZeRO-1",
        ),
        Stack(
            "pytorch-fsdp",
            other=1.8,
            selective_gemms=0.5,
            note="torchtitan: PyTorch FSDP2 eager, SDPA flash attention",
        ),
        Stack(
            "composer-fsdp",
            other=1.75,
            microbatch_reduce=True,
            logit_bytes=4.0,
            note="MosaicML Composer + FSDP1, Triton flash attention",
        ),
    )
}


def tp_reason(model: ModelFacts, tp: int, per_node: int) -> str | None:
    """Why tensor-parallel degree ``tp`` cannot split ``model`` (:mod:`loom.rules`) on nodes of
    ``per_node`` devices, or None."""
    why = tensor_parallel_problem(model, tp)
    if why is None and (tp > per_node or per_node % tp):
        why = "tp must divide devices_per_node (stay inside a node)"
    return why


class PlanError(ValueError):
    """A layout or workload the planner cannot evaluate; the message says why."""


@dataclass(frozen=True)
class Layout:
    """One parallel layout: degrees, sharding, schedule, recomputation."""

    dp: int = 1  # data-parallel degree (replicas x shards)
    dp_shard: int = 1  # ZeRO/FSDP sharding group inside dp (1 = no sharding)
    tp: int = 1  # tensor-parallel degree (inside a node)
    pp: int = 1  # pipeline stages
    cp: int = 1  # context-parallel degree (sequence split)
    ep: int = 1  # expert-parallel degree (borrows from dp*cp)
    zero: int = 0  # ZeRO stage 0-3, sharded over dp_shard*cp
    sp: bool = False  # sequence parallelism alongside tensor parallelism
    schedule: ScheduleName = "1f1b"  # one of SCHEDULES (those modelled)
    v: int = 1  # virtual stages per device (interleaved)
    micro_batch: int = 1  # sequences per forward/backward on one device
    recompute: str = "none"  # none | selective | full
    offload: bool = False  # optimizer state (fp32 master, momentum, variance) on the host
    cp_mode: str = "allgather"  # how attention spans cp: allgather | ring | alltoall (loom.rules.CP_MODES)
    offload_params: bool = (
        False  # ZeRO-3 parameter + gradient shards (and the state) on the host: ZeRO-Infinity
    )
    qwz: bool = False  # ZeRO++ int8 weight gathers (zero 3; loom.plan.zero_options)
    hpz: int = 0  # ZeRO++ secondary partition over this many ranks (a node; 0 = off)
    qgz: int = 0  # ZeRO++ gradient all-to-all in this many bits (8 or 4; 0 = off)
    tp_overlap: bool = (
        False  # tensor-parallel collectives pipelined with their GEMMs (Megatron-Core --tp-comm-overlap)
    )
    dp_overlap: bool = (
        True  # data-parallel / ZeRO traffic overlapped bucket by bucket (False: after backward)
    )
    split: tuple[
        int, ...
    ] = ()  # blocks per pipeline stage (parallel.pp_layout); () = CostModel.stage_layers' rule

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def dims(self) -> ParallelDims:
        """The mesh arithmetic of this layout (validates ep | dp*cp)."""
        return ParallelDims(
            dp_replicate=self.dp // self.dp_shard,
            dp_shard=self.dp_shard,
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            ep=self.ep,
        )

    def spec(self) -> str:
        """The whole layout in one line, as ``loom plan verify --layout`` takes it (:meth:`parse`):
        ``dp16 tp8 pp8 cp1 ep1 zero1/16 sp interleaved:v5 mb1 recompute:none [offload]``."""
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}", f"cp{self.cp}{self._mode()}", f"ep{self.ep}"]
        parts.append(f"zero{self.zero}/{self.dp_shard}" if self.zero else "zero0")
        parts += ["sp"] * self.sp + [
            f"{self.schedule}:v{self.v}",
            f"mb{self.micro_batch}",
            f"recompute:{self.recompute}",
        ]
        parts += ["tp-overlap"] * self.tp_overlap + ["dp-after-backward"] * (not self.dp_overlap)
        parts += [f"split:{','.join(map(str, self.split))}"] * bool(self.split)
        return " ".join(parts + ["offload"] * self.offload)

    @classmethod
    def parse(cls, text: str) -> Layout:
        """The layout of a :meth:`spec` line (``zeroK`` alone shards over all of dp; degrees not named are 1)."""
        from typing import get_args

        from loom.rules import ScheduleName

        kw: dict = {}
        for tok in text.split():
            name, _, arg = tok.partition(":")
            head = name.rstrip("0123456789/")
            digits = name[len(head) :]
            try:
                if head == "cp" and digits.isdigit() and arg in ("", *CP_MODES):
                    kw["cp"] = int(digits)
                    kw["cp_mode"] = arg or "allgather"
                elif head in ("dp", "tp", "pp", "ep", "mb") and digits.isdigit() and not arg:
                    kw["micro_batch" if head == "mb" else head] = int(digits)
                elif head == "zero" and digits:
                    stage, _, shard = digits.partition("/")
                    kw["zero"] = int(stage)
                    if shard:
                        kw["dp_shard"] = int(shard)
                elif tok == "sp":
                    kw["sp"] = True
                elif tok == "offload":
                    kw["offload"] = True
                elif tok == "tp-overlap":
                    kw["tp_overlap"] = True
                elif tok == "dp-after-backward":
                    kw["dp_overlap"] = False
                elif name == "split" and arg:
                    kw["split"] = tuple(int(x) for x in arg.split(","))
                elif name == "recompute" and arg in ("none", "selective", "full"):
                    kw["recompute"] = arg
                elif name in get_args(ScheduleName):
                    kw["schedule"] = name
                    if arg:
                        if not arg.startswith("v"):
                            raise ValueError
                        kw["v"] = int(arg[1:])
                else:
                    raise ValueError
            except ValueError:
                raise PlanError(
                    f"--layout: cannot read {tok!r} in {text!r}; expected e.g. "
                    "'dp16 tp8 pp8 cp1 ep1 zero1 sp interleaved:v5 mb1 recompute:none'"
                ) from None
        if kw.get("zero") and "dp_shard" not in kw:
            kw["dp_shard"] = kw.get("dp", 1)
        return cls(**kw)

    def _mode(self) -> str:
        return f":{self.cp_mode}" if self.cp > 1 and self.cp_mode != "allgather" else ""

    def short(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        parts += [f"cp{self.cp}{self._mode()}"] * (self.cp > 1) + [f"ep{self.ep}"] * (self.ep > 1)
        if self.zero:
            n = self.dp_shard * self.cp
            parts.append(f"z{self.zero}" + (f"/{n}" if self.dp_shard != self.dp else ""))
        return " ".join(parts)


@dataclass(frozen=True)
class Workload:
    """What is trained: batch, sequence, precision (micro_batch and recompute live on Layout)."""

    global_batch: int  # sequences per optimizer step
    seq_len: int  # tokens per sequence
    precision: str = "bf16"  # fp32 | tf32 | bf16 | fp16 | fp8 (fp8: fp8 GEMMs, bf16 states)
    reduce_dtype: str = "fp32"  # dtype gradients are reduced in (fp32 | bf16 | fp16)
    flash_attention: bool = True  # attention scores are not stored (flash / SDPA)
    bucket_bytes: float = 25 * 2**20  # data-parallel gradient bucket (parallel.bucket_mb)
    optimizer: str = "adamw"  # adamw | adam8bit | adafactor (train.optimizer)
    moe_imbalance: float = 1.0  # MoE: max/mean tokens per expert (moe.imbalance; a run's moe_imbalance metric; 0 = the profile's)
    capacity_factor: float = (
        0.0  # MoE: moe.capacity_factor (0 = dropless): caps an expert's load at cf x mean
    )
    moe_router_losses: bool = False  # MoE: aux or z loss on (a synchronous pipeline schedule is needed)
    allreduce: str = (
        "native"  # parallel.allreduce: the gradient all-reduce's algorithm (butterfly needs 2^k ranks)
    )
    ps_shards: int = (
        0  # parallel.dp_mode = "ps": K parameter-server shards instead of the all-reduce (0 = none)
    )
    ps_colocate: bool = True  # servers in workers 0..K-1 (else K dedicated ranks besides the dp workers)
    lora_rank: int = 0  # finetune.lora_rank of a LoRA/QLoRA run (0 = every parameter trains)
    lora_targets: tuple[str, ...] = ()  # its resolved targets (q, k, v, o, w1, w2, w3)
    qlora: bool = False  # the targets' frozen base weights stored in NF4

    @property
    def moe_load(self) -> float:
        """The busiest expert's tokens over the mean: the imbalance, capped by the capacity factor."""
        return (
            min(self.moe_imbalance, self.capacity_factor) if self.capacity_factor > 0 else self.moe_imbalance
        )

    @property
    def mixed(self) -> bool:
        return self.precision in ("bf16", "fp16", "fp8")

    @property
    def act_bytes(self) -> int:
        return 2 if self.mixed else 4

    def state_bytes(self) -> tuple[float, float, float]:
        """(weights, grads, optimizer) bytes per parameter: (2, 2, 12) mixed, (4, 4, 8) fp32 for
        AdamW; 8-bit Adam keeps 2 + 8/256 bytes of moments (+ a 4-byte master when mixed);
        Adafactor only the master here, its factored moments are counted per matrix
        (:meth:`CostModel._state_memory`)."""
        if self.optimizer not in OPTIMIZERS:
            raise PlanError(f"train.optimizer: must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        master = 4 if self.mixed else 0
        moments = {"adamw": 8.0, "adam8bit": 2.0 + 8.0 / ADAM8BIT_BLOCK, "adafactor": 0.0}[self.optimizer]
        return (2, 2, master + moments) if self.mixed else (4, 4, moments)


@dataclass
class Estimate:
    """Prediction for one layout; times in seconds, memory in bytes per device."""

    layout: Layout
    step_time: float
    tokens_per_s: float
    tflops_per_device: float  # achieved hardware TFLOP/s (incl. recomputation), Megatron's measure
    mfu: float  # model FLOPs utilisation (no recomputation) vs the precision's peak
    memory: float  # peak bytes on the busiest device
    capacity: float  # device memory bytes
    memory_breakdown: dict[str, float] = field(default_factory=dict)
    time_breakdown: dict[str, float] = field(default_factory=dict)
    microbatches: int = 1
    bubble_fraction: float = 0.0
    peak_stage: str = "only"  # which stage holds the peak: only | first | last

    @property
    def fits(self) -> bool:
        return self.memory <= self.capacity

    @property
    def dominant(self) -> str:
        """The largest term of the step time."""
        return max(self.time_breakdown, key=self.time_breakdown.__getitem__)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["fits"], out["dominant"] = self.fits, self.dominant
        return out


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1, w_share: float = 1 / 3) -> float:
    """Share of the step a device idles in the pipeline bubble.

    GPipe/1F1B (p-1)/(m+p-1); interleaved ((p-1)/v)/(m + (p-1)/v); ZB-H1 (p-1)(1-2w)/(m + (p-1)(1-2w))
    with w = t_W / t_mb the weight-gradient share of a micro-batch (1/3 when F = B = W).
    """
    if p <= 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        idle = p - 1.0
    elif schedule == "interleaved":
        idle = (p - 1.0) / v
    elif schedule == "zb-h1":
        idle = (p - 1.0) * (1.0 - 2.0 * w_share)
    else:
        raise PlanError(f"schedule: must be one of {SCHEDULES}, got {schedule!r}")
    return idle / (m + idle)


def inflight_layers(schedule: str, p: int, stage: int, m: int, v: int, n_layers: int) -> float:
    """Layer activations (micro-batches x layers) stage ``stage`` holds at its peak (module doc)."""
    per_stage = n_layers / p
    if schedule == "gpipe":
        return m * per_stage
    if schedule == "interleaved" and v > 1:
        chunks = min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
        return chunks * per_stage / v
    if schedule == "zb-h1":  # deferred weight-gradient passes keep p micro-batches alive on every stage
        return min(m, p) * per_stage
    return min(m, p - stage) * per_stage


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of the Llama-style model (see module doc); MoE when n_experts > 1."""

    attn: int  # attention matmul weights per layer
    mlp: int  # MLP weights per layer (all experts)
    mlp_active: int  # MLP weights one token goes through
    router: int  # router weights per layer (MoE)
    norms: int  # norm weights per layer
    embed: int  # input embedding
    head: int  # output head (0 when tied)
    final_norm: int
    n_layers: int
    positions: int = 0  # learned position table (replicated over tp, on the first stage)
    mlp_whole: int = 0  # of ``mlp``: the row-parallel bias, whole on every tp rank
    attn_whole: int = 0  # of ``attn``: the row-parallel wo bias, whole on every tp rank

    @classmethod
    def of(cls, m: ModelConfig, n_experts: int = 1, top_k: int = 1) -> ParamCounts:
        h, f, kd, qd = m.dim, m.resolved_ffn_dim(), m.n_kv_heads * m.head_dim, m.n_heads * m.head_dim
        moe = n_experts > 1
        mats = 3 if m.mlp == "swiglu" else 2  # SwiGLU's w1, w3, w2, or GELU's w1, w2
        mlp_bias = (f + h) if m.bias and not moe else 0  # experts have no biases
        norm = 2 if m.norm == "layernorm" else 1  # LayerNorm: weight and bias
        return cls(
            attn=2 * h * qd
            + 2 * h * kd
            + ((qd + 2 * kd) if m.qkv_bias or m.bias else 0)
            + (h if m.bias else 0),
            mlp=mats * h * f * (n_experts if moe else 1) + mlp_bias,
            mlp_active=mats * h * f * (top_k if moe else 1) + mlp_bias,
            router=h * n_experts if moe else 0,
            norms=2 * h * norm + (2 * m.head_dim if m.qk_norm else 0),
            embed=m.vocab_size * h,
            head=0 if m.tie_embeddings else m.vocab_size * h,
            final_norm=h * norm,
            n_layers=m.n_layers,
            positions=m.max_seq_len * h if m.positions == "learned" else 0,
            mlp_whole=h if mlp_bias else 0,
            attn_whole=h if m.bias else 0,
        )

    def mlp_on(self, tp: int, ep: int = 1) -> float:
        """MLP parameters one rank holds: split over tp (experts over ep too) but the whole w2 bias."""
        return (self.mlp - self.mlp_whole) / (tp * ep) + self.mlp_whole

    @property
    def total(self) -> int:
        per_layer = self.attn + self.mlp + self.router + self.norms
        return self.n_layers * per_layer + self.embed + self.head + self.final_norm + self.positions

    @property
    def matmul_active(self) -> int:
        """Weights a token multiplies through: layers' matmuls + the head (tied or not)."""
        return self.n_layers * (self.attn + self.mlp_active + self.router) + self.embed


def param_count(model: ModelConfig, n_experts: int = 1) -> int:
    """Unique parameters (tied embeddings counted once), as ``llama.count_params`` counts them."""
    return ParamCounts.of(model, n_experts).total


class CostModel:
    """Memory and time of layouts for one model, workload and cluster (see module doc)."""

    def __init__(
        self,
        model: ModelConfig,
        train: Workload,
        cluster: ClusterSpec,
        profile: Profile | None = None,
        n_experts: int | None = None,
        top_k: int | None = None,
        stack: str = "",
    ) -> None:
        """``n_experts`` / ``top_k``: those of ``model`` unless given (1 = dense); ``stack``: the
        training software whose kernels run the step (:data:`STACKS`; "" = Loom's own)."""
        if n_experts is None:
            n_experts, top_k = model.n_experts, (model.top_k if model.moe else 1) if top_k is None else top_k
        top_k = 1 if top_k is None else top_k
        if model.vocab_size <= 0:
            raise PlanError("model.vocab_size: must be set (> 0) to plan")
        if train.global_batch < 1 or train.seq_len < 1:
            raise PlanError("train: global_batch and seq_len must be >= 1")
        if train.reduce_dtype not in ("fp32", "bf16", "fp16"):
            raise PlanError(f"train.reduce_dtype: must be fp32, bf16 or fp16, got {train.reduce_dtype!r}")
        if n_experts < 1 or not 1 <= top_k <= n_experts:
            raise PlanError(f"n_experts/top_k: need 1 <= top_k <= n_experts, got {top_k}/{n_experts}")
        if train.moe_imbalance <= 0:  # moe.imbalance unset: a calibration run's measurement, else balanced
            measured = profile.moe_imbalance if profile is not None else 0.0
            train = dataclasses.replace(train, moe_imbalance=measured if measured >= 1 else 1.0)
        self.model, self.train, self.cluster = model, train, cluster
        self.n_experts, self.top_k = n_experts, top_k
        self.moe = n_experts > 1
        try:
            self.machine = Machine(cluster, train.precision, profile)
        except HardwareError as e:
            raise PlanError(f"train.precision: {e}") from None
        if stack not in STACKS:
            raise PlanError(f"stack: must be one of {', '.join(STACKS)}, got {stack!r}")
        self.stack = STACKS[stack]
        # per-kernel compute model: a GPU from its datasheet (a measured GEMM rate is used flat, as measured)
        self.kernels = cluster.device.sms > 0 and not self.machine.measured_gemm
        # per-operator framework cost (CPUs): ops counted on a tiny model of this structure (loom.plan.opcount)
        self.ops = None
        if self.machine.op_time > 0:
            try:
                self.ops = op_counts(model, None, train.optimizer)
            except Exception as e:  # a structure the tiny model cannot run: plan without the term, and say so
                logging.getLogger("loom").warning(
                    "planner: operators not counted (%s); per-operator cost left out", e
                )
        measured_r = profile.backward_ratio if profile is not None and self.ops is None else 0.0
        self.bwd_ratio = (
            measured_r if measured_r > 0 else 2.0
        )  # FLOP ratio; a measured one folds per-op cost in
        self.params = ParamCounts.of(model, n_experts, top_k)
        self.facts = ModelFacts.of(
            model,
            n_experts=n_experts,
            moe_capacity=train.capacity_factor > 0,
            moe_router_losses=train.moe_router_losses,
        )  # what the layout rules read
        self.ffn = model.resolved_ffn_dim()
        self.kd = model.n_kv_heads * model.head_dim
        self.model_flops = flops_per_token(model, train.seq_len, self.params.matmul_active) * (
            train.global_batch * train.seq_len
        )
        self.act_bytes = train.act_bytes
        self.W, self.G, self.O = train.state_bytes()
        self.R = {"fp32": 4, "bf16": 2, "fp16": 2}[train.reduce_dtype]
        # ranks sharing CPU cores: the same model on the collectives' CPU seconds sums each rank's CPU demand
        twin = profile.cpu_twin() if profile is not None else None
        self.cpu_model = (
            CostModel(model, train, cluster, twin, n_experts, top_k, stack) if twin is not None else None
        )
        # Memoised pieces: the search evaluates many layouts sharing degrees or micro-batch.
        self._per_mb = lru_cache(maxsize=None)(self._microbatch_times)
        self._states = lru_cache(maxsize=None)(self._state_memory)
        self._act = lru_cache(maxsize=None)(self._layer_activation)
        self._dp_volume = lru_cache(maxsize=None)(self._dp_comm)

    def stage_layers(self, pp: int, first: bool, last: bool, split: tuple[int, ...] = ()) -> float:
        """Blocks on one device of the first stage, the last, or the fullest middle stage (neither;
        0 when pp < 3). ``L / pp`` when pp divides L; otherwise ``L = q pp + r`` is split with the
        r extra blocks on middle stages first, then the last, then the first (they also hold the
        embedding and the head, as :func:`~loom.parallel.pipeline.partition.partition` balances).
        An explicit ``split`` (blocks per stage, ``Layout.split``) gives its own counts."""
        L = self.model.n_layers
        if pp == 1:
            return float(L)
        split = split or default_split(L, pp)
        return float(split[0] if first else split[-1] if last else max(split[1:-1], default=0))

    def _attention_core(self, tp: int, cp: int, mb: int) -> tuple[float, float]:
        """(forward, backward) seconds of the attention core of one layer and micro-batch, per kernel:

        - flash (``Workload.flash_attention``): a causal kernel computes half the 4 T s h / t FLOPs
          of the square score matrix (masked blocks skipped): forward ``2 T s h / t`` at the
          device's ``flash_fwd`` share of peak, backward 2.5x those FLOPs (it recomputes the scores)
          at ``flash_bwd``;
        - unfused (Megatron 2021): per (sequence, head) two batched GEMMs, Q K^T (s x d x s) and
          A V (s x s x d), each through :meth:`Machine.gemm` (tiles over the whole batch), the
          full square; the scores are written, read and written by the softmax and read by A V,
          4 B a s^2 bytes; backward twice the GEMMs and the traffic again.
        """
        mc, tr, mach, B = self.model, self.train, self.machine, self.act_bytes
        s, h = tr.seq_len, mc.dim
        T = mb * s / cp
        io = B * T * (2 * h / tp + 2 * self.kv_width(tp)) / mach.hbm  # q, k, v in; o out
        if tr.flash_attention:
            flops = 2.0 * T * s * h / tp
            return max(mach.attention(flops, False), io), mach.attention(2.5 * flops, True) + 2 * io
        heads = mb * mc.n_heads / tp
        d = mc.head_dim
        gemms = mach.gemm(s, d, s, B, batch=heads) + mach.gemm(s, s, d, B, batch=heads)
        scores = (self.stack.other if self.kernels else 1.0) * 4 * B * heads * s * s / mach.hbm
        return gemms + scores + io, 2 * (gemms + scores + io)

    def kv_width(self, tp: int) -> float:
        """Key/value width one tp rank computes: k d / t when t divides the k kv heads, else one
        head d (heads replicated: every t / k ranks share one, Loom's ``ParallelAttention``)."""
        k = self.model.n_kv_heads
        return self.kd / tp if k % tp == 0 else self.model.head_dim

    def _attn_params(self, tp: int) -> float:
        """Attention weights one tp rank holds: wq, wo split; wk, wv split or replicated whole (their
        biases alike). Norm weights (q/k norms included) are in ``ParamCounts.norms``."""
        m = self.model
        h, qd = m.dim, m.n_heads * m.head_dim
        kv_split = tp if m.n_kv_heads % tp == 0 else 1
        bias = m.qkv_bias or m.bias
        split = (2 * h * qd + (qd if bias else 0)) / tp + (
            2 * h * self.kd + (2 * self.kd if bias else 0)
        ) / kv_split
        return split + self.params.attn_whole

    # ------------------------------------------------------------------ validity

    def check(self, lay: Layout) -> str | None:
        """Why ``lay`` cannot run this model/workload on this cluster, or None."""
        m, t = self.model, self.train
        if min(lay.dp, lay.dp_shard, lay.tp, lay.pp, lay.cp, lay.ep, lay.v, lay.micro_batch) < 1:
            return "every degree must be >= 1"
        if lay.world_size > self.cluster.world_size:
            return "more devices than the cluster has"
        if lay.dp % lay.dp_shard:
            return "dp_shard must divide dp"
        if lay.zero not in (0, 1, 2, 3):
            return "zero must be 0, 1, 2 or 3"
        if lay.zero > 0 and lay.dp_shard * lay.cp == 1:
            return "zero > 0 needs a sharding group dp_shard*cp > 1"
        if lay.schedule not in SCHEDULES:
            return f"schedule must be one of {', '.join(SCHEDULES)}"
        if lay.recompute not in RECOMPUTE:
            return f"recompute must be one of {', '.join(RECOMPUTE)}"
        why = tp_reason(self.facts, lay.tp, self.cluster.devices_per_node)
        why = why or (sequence_parallel_problem(lay.tp, lay.cp, t.seq_len) if lay.sp else None)
        why = why or context_parallel_problem(lay.cp, t.seq_len)
        if why:
            return why
        if lay.v > 1 and lay.schedule != "interleaved":
            return "v > 1 only with the interleaved schedule"
        if lay.schedule == "interleaved" and (lay.v < 2 or lay.pp < 2):
            return "interleaved needs pp >= 2 and v >= 2"
        if m.n_layers < lay.pp * lay.v:
            return "pp*v must not exceed n_layers (every pipeline chunk holds a block)"
        if lay.split and (len(lay.split) != lay.pp or sum(lay.split) != m.n_layers or min(lay.split) < lay.v):
            return f"split must give each of the pp={lay.pp} stages at least v={lay.v} blocks, {m.n_layers} in all"
        if t.global_batch % (lay.dp * lay.micro_batch):
            return "dp*micro_batch must divide global_batch"
        if lay.schedule == "interleaved" and (t.global_batch // (lay.dp * lay.micro_batch)) % lay.pp:
            return "interleaved needs micro-batches divisible by pp"
        if lay.ep > 1 and not self.moe:
            return "ep > 1 needs experts (n_experts > 1)"
        if (lay.dp * lay.cp) % lay.ep or self.n_experts % lay.ep:
            return "ep must divide dp*cp and n_experts"
        return None

    def refused(self, lay: Layout) -> str | None:
        """Why ``loom train`` refuses ``lay`` for this model and workload (:func:`loom.rules.layout_problems`),
        or None. :meth:`check` asks only whether the formulas apply; the search ranks neither kind."""
        t = self.train
        problems = layout_problems(
            self.facts,
            seq_len=t.seq_len,
            precision=t.precision,
            optimizer=t.optimizer,
            tp=lay.tp,
            pp=lay.pp,
            cp=lay.cp,
            ep=lay.ep,
            zero=lay.zero,
            sp=lay.sp,
            schedule=lay.schedule,
            virtual_stages=lay.v,
            cp_mode=lay.cp_mode,
            microbatches=t.global_batch // (lay.dp * lay.micro_batch),
            offload="cpu" if lay.offload else "none",
            allreduce=t.allreduce,
            dp=lay.dp,
            dp_shard=lay.dp_shard,
        )
        return problems[0] if problems else None

    # ------------------------------------------------------------------ memory

    def _stage_params(self, lay: Layout, first: bool, last: bool) -> tuple[float, float]:
        """(dense, expert) parameters one device of this stage holds, before ZeRO sharding."""
        return self._params_on(lay.tp, lay.pp, lay.ep, first, last, lay.split)

    def _params_on(
        self, t: int, pp: int, ep: int, first: bool, last: bool, split: tuple[int, ...] = ()
    ) -> tuple[float, float]:
        pc = self.params
        layers = self.stage_layers(pp, first, last, split)
        dense = layers * (self._attn_params(t) + pc.norms + pc.router + (0 if self.moe else pc.mlp_on(t)))
        expert = layers * pc.mlp / ep if self.moe else 0.0  # experts are replicated over tp
        if first:
            dense += pc.embed / t + pc.positions
        if last:
            dense += pc.final_norm
            if pc.head or pp > 1:  # untied head, or a tied copy on the last stage
                dense += self.model.vocab_size * self.model.dim / t
        return dense, expert

    def state_memory(self, lay: Layout, first: bool = True, last: bool = True) -> dict[str, float]:
        """Weights, gradients, optimizer state and ZeRO-3 gather buffer on one device (bytes)."""
        return dict(
            self._states(
                lay.tp, lay.pp, lay.cp, lay.ep, lay.zero, lay.dp_shard, lay.offload, first, last, lay.split
            )
        )

    def _adapters_on(
        self, t: int, pp: int, first: bool, last: bool, split: tuple[int, ...] = ()
    ) -> tuple[float, float]:
        """(LoRA adapter parameters, target base elements) on one device of a stage: per block and
        target of shape (d_out, d_in), r·(d_in + d_out/t) for a column-parallel target (q, k, v, w1, w3:
        B split with W's rows), r·(d_in/t + d_out) for a row-parallel one (o, w2: A split with W's
        columns); the base weight d_out·d_in/t."""
        r, layers = self.train.lora_rank, self.stage_layers(pp, first, last, split)
        shapes = target_shapes(self.model)
        adapters = base = 0.0
        for name in self.train.lora_targets:
            d_out, d_in = shapes[name]
            adapters += r * ((d_in / t + d_out) if name in ("o", "w2") else (d_in + d_out / t))
            base += d_out * d_in / t
        return layers * adapters, layers * base

    def _lora_state(
        self,
        tp: int,
        pp: int,
        first: bool,
        last: bool,
        split: tuple[int, ...],
        dense: float,
        expert: float,
        shard: tuple[int, ...],
        shard_e: tuple[int, ...],
    ) -> dict[str, float]:
        """A LoRA/QLoRA rank's states: the frozen base at W bytes per element (no gradient, no optimizer
        state; QLoRA's targets in NF4: n/2 + n/64 + 4·ceil(n/16384) + 4 bytes), sharded like the weights;
        the adapters' weights, gradients and optimizer state as any trained parameter's."""
        W, G, O = self.W, self.G, self.O  # noqa: E741 (the module doc's names)
        adapters, targets = self._adapters_on(tp, pp, first, last, split)
        frozen = W * (dense / shard[0] + expert / shard_e[0])
        if self.train.qlora:  # each target's weight is quantized on its own (QLoRA refuses tp > 1)
            shapes, layers = target_shapes(self.model), self.stage_layers(pp, first, last, split)
            nf4 = layers * sum(nf4_bytes(shapes[n][0] * shapes[n][1]) for n in self.train.lora_targets)
            frozen += (nf4 - W * targets) / shard[0]
        return {
            "weights": frozen + W * adapters / shard[0],
            "gradients": G * adapters / shard[1],
            "optimizer": O * adapters / shard[2],
        }

    def _state_memory(
        self,
        tp: int,
        pp: int,
        cp: int,
        ep: int,
        zero: int,
        dp_shard: int,
        offload: bool,
        first: bool,
        last: bool,
        split: tuple[int, ...] = (),
    ) -> tuple[tuple[str, float], ...]:
        W, G, O = self.W, self.G, self.O  # noqa: E741 (the module doc's names)
        dense, expert = self._params_on(tp, pp, ep, first, last, split)
        n = dp_shard * cp if zero else 1
        n_e = max(1, n // ep)
        shard = {0: (1, 1, 1), 1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}[zero]
        shard_e = {0: (1, 1, 1), 1: (1, 1, n_e), 2: (1, n_e, n_e), 3: (n_e, n_e, n_e)}[zero]
        weights = W * (dense / shard[0] + expert / shard_e[0])
        buffer = 0.0
        if zero == 3:
            buffer = self._zero3_transient(tp, pp, ep, first, last)
        optim = O * (dense / shard[2] + expert / shard_e[2])
        if (
            self.train.ps_shards
        ):  # the moments live on the servers: worker 0 holds server 0's shard if co-located
            optim = O * dense / self.train.ps_shards if self.train.ps_colocate else 0.0
        if self.train.optimizer == "adafactor":  # 4 (R + C) per matrix, 4 per vector element
            optim += self._factored_bytes(tp, pp, ep, first, last) / shard[2]
        grads = G * (dense / shard[1] + expert / shard_e[1])
        if self.train.lora_rank:
            lora = self._lora_state(tp, pp, first, last, split, dense, expert, shard, shard_e)
            weights, grads, optim = lora["weights"], lora["gradients"], lora["optimizer"]
        return (
            ("weights", weights),
            ("gradients", grads),
            ("optimizer", 0.0 if offload else optim),
            ("zero3 buffer", buffer),
        )

    def _zero3_transient(self, tp: int, pp: int, ep: int, first: bool, last: bool) -> float:
        """ZeRO-3's gathered units and gradients at the step's peak (bytes), as Loom runs them:

            max over units u of  W·u + G·u + G·p(u) [+ 2G·p(u), tied]  +  W·u_layer

        A unit in backward is gathered (W·u), its whole gradient buffer is filling (G·u) from
        autograd's gradient of its largest parameter p(u) (G·p), and the next block is prefetched
        (W·u_layer). Units: a block; the embedding on the first stage; final norm + head on the
        last; without a pipeline a tied embedding and head are one unit, whose head gradient autograd
        holds until the embedding's arrives and then sums into a third tensor (2G·p more)."""
        W, G = self.W, self.G
        units = self.zero3_unit_sizes(tp, pp, ep, first, last)
        return max(W * u + G * (u + p + extra) for u, p, extra in units) + W * units[0][0]

    def zero3_unit_sizes(
        self, tp: int, pp: int, ep: int, first: bool, last: bool
    ) -> list[tuple[float, float, float]]:
        """ZeRO-3's units on a stage, a block's first: (elements, largest parameter, gradients held beyond it)."""
        pc, m, t = self.params, self.model, tp
        layer = self._attn_params(t) + pc.norms + pc.router + (pc.mlp / ep if self.moe else pc.mlp_on(t))
        experts = self.n_experts / ep if self.moe else 1
        widest = max(
            m.n_heads * m.head_dim * m.dim / t, self.ffn * m.dim * (experts if self.moe else 1 / t)
        )  # wq/wo or w1/w2/w3
        table = m.vocab_size * m.dim / t
        units = [(layer, widest, 0.0)]
        if pp == 1 and not pc.head:
            units.append((table + pc.final_norm, table, 2 * table))
        else:
            units += [(table, table, 0.0)] if first else []
            units += [(table + pc.final_norm, table, 0.0)] if last and (pc.head or pp > 1) else []
        return units

    def _factored_bytes(self, tp: int, pp: int, ep: int, first: bool, last: bool) -> float:
        """Adafactor's factored second moments on one device before ZeRO: 4 (R + C) bytes per
        (R x C) weight matrix slice it holds, 4 bytes per vector element (norms, biases)."""
        m, h, f, kd, V, pc = self.model, self.model.dim, self.ffn, self.kd, self.model.vocab_size, self.params
        experts = self.n_experts / ep if self.moe else 1
        kv_rows = kd / tp if m.n_kv_heads % tp == 0 else kd
        qd, mats = m.n_heads * m.head_dim, (3 if m.mlp == "swiglu" else 2)
        biases = (qd / tp + 2 * kv_rows if m.qkv_bias or m.bias else 0) + pc.attn_whole
        biases += (f / tp if pc.mlp_whole else 0) + pc.mlp_whole  # w1's rows, w2's whole bias
        layer = 4 * ((qd / tp + h) * 2 + (kv_rows + h) * 2 + experts * mats * (f / tp + h)) + 4 * (
            pc.norms + biases
        )
        total = self.stage_layers(pp, first, last) * layer
        if first:
            total += 4 * (V / tp + h) + (4 * (m.max_seq_len + h) if pc.positions else 0)
        if last:
            total += 4 * pc.final_norm + (4 * (V / tp + h) if pc.head or pp > 1 else 0)
        return total

    def step_workspace(self, lay: Layout, first: bool = True, last: bool = True) -> float:
        """Temporaries of Loom's AdamW step on one device: the fp32 denominators sqrt(v) of every
        element it updates (``torch._foreach_sqrt``), and under mixed precision the fp32 copy of
        the gradient shard, 4·Φ_opt·(1 + mixed) bytes for the Φ_opt elements whose optimizer state it
        holds (8-bit Adam works in chunks and Adafactor on factored statistics: not counted)."""
        if self.train.optimizer != "adamw" or lay.offload:
            return 0.0
        dense, expert = self._params_on(lay.tp, lay.pp, lay.ep, first, last, lay.split)
        n = lay.dp_shard * lay.cp if lay.zero else 1
        elements = dense / n + expert / max(1, n // lay.ep)
        return 4.0 * elements * (2 if self.train.mixed else 1)

    def layer_activation(self, lay: Layout) -> tuple[float, float, float]:
        """Bytes of one layer, one micro-batch: (no recomputation, selective, block input)."""
        return self._act(lay.tp, lay.sp, lay.cp, lay.micro_batch, lay.cp_mode)

    def _layer_activation(
        self, t: int, sp: bool, cp: int, mb: int, cp_mode: str = "allgather"
    ) -> tuple[float, float, float]:
        m, tr = self.model, self.train
        B, h = self.act_bytes, m.dim
        T = mb * tr.seq_len / cp
        rep_div = t if sp else 1
        rep = 4 * B * T * h / rep_div
        qkv = B * T * (h / t + 2 * self.kv_width(t))
        if self.moe:  # experts whole on every tp rank, on its tokens (T/t with sp), the busiest's load
            mlp = 4 * B * T / rep_div * self.ffn * self.top_k * tr.moe_load
        else:
            mlp = (
                (4 if m.mlp == "swiglu" else 2) * B * T * self.ffn / t
            )  # w1 x, silu, w3 x, product | w1 x, gelu
        core = (B * T * h + 4 * T * m.n_heads) / t
        if cp > 1 and cp_mode == "allgather":  # the other ranks' keys and values, gathered
            core += 2 * B * T * (cp - 1) * self.kv_width(t)
        elif (
            cp > 1 and cp_mode == "alltoall"
        ):  # kv heads repeated to whole groups per rank; the core's own output
            core += 2 * B * T * (self._kv_repeat(t, cp) - 1) * self.kv_width(t) + B * T * h / t
        if not tr.flash_attention:
            core += B * m.n_heads * T * tr.seq_len / t
        selective = rep + qkv + mlp
        return selective + core, selective, B * T * h / rep_div

    def _stages(self, pp: int) -> list[tuple[str, bool, bool, int]]:
        if pp == 1:
            return [("only", True, True, 0)]
        middle = [("middle", False, False, 1)] if pp > 2 else []
        return [("first", True, False, 0), *middle, ("last", False, True, pp - 1)]

    def peak_states(self, lay: Layout) -> float:
        """Model-state bytes (no activations) on the busiest stage, plus the runtime constant."""
        worst = max(
            sum(
                v
                for _, v in self._states(
                    lay.tp, lay.pp, lay.cp, lay.ep, lay.zero, lay.dp_shard, lay.offload, f, la, lay.split
                )
            )
            for _, f, la, _ in self._stages(lay.pp)
        )
        return worst + self.cluster.device.runtime_overhead_bytes

    def memory(self, lay: Layout) -> tuple[float, dict[str, float], str]:
        """(peak bytes, breakdown, stage) over the first and last pipeline stage."""
        best: tuple[float, dict[str, float], str] = (-1.0, {}, "")
        for name, _, _, idx in self._stages(lay.pp):
            bd = self.stage_memory(lay, idx)
            total = sum(bd.values())
            if total > best[0]:
                best = (total, bd, name)
        return best

    def stage_memory(self, lay: Layout, stage: int, microbatches: int | None = None) -> dict[str, float]:
        """Bytes on a device of pipeline stage ``stage`` at its peak, by kind: model states, saved
        activations of the layers in flight (``inflight_layers`` of the schedule), logits, full-size
        gradients kept across micro-batches, overhead; ``microbatches`` default: the workload's."""
        m = microbatches or self.train.global_batch // (lay.dp * lay.micro_batch)
        first, last = stage == 0, stage == lay.pp - 1
        full_act, sel_act, block_in = self._act(lay.tp, lay.sp, lay.cp, lay.micro_batch, lay.cp_mode)
        bd = dict(
            self._states(
                lay.tp, lay.pp, lay.cp, lay.ep, lay.zero, lay.dp_shard, lay.offload, first, last, lay.split
            )
        )
        n = inflight_layers(lay.schedule, lay.pp, stage, m, lay.v, self.model.n_layers)
        if lay.pp > 1 and (
            self.model.n_layers % lay.pp or lay.split
        ):  # uneven: this stage's blocks, not L / pp
            n *= self.stage_layers(lay.pp, first, last, lay.split) * lay.pp / self.model.n_layers
        if lay.recompute == "none":
            act = n * full_act
        elif lay.recompute == "selective":
            act = n * sel_act
        else:
            act = max(n - 1.0, 0.0) * block_in + sel_act
        logits = 0.0
        if last:
            T = lay.micro_batch * self.train.seq_len / lay.cp
            logits = T * self.model.vocab_size / lay.tp * (self.stack.logit_bytes or self.act_bytes + 8)
        bd["activations"] = act
        bd["logits"] = logits
        bd["accumulation"] = 0.0
        if (
            lay.zero >= 2 and m > 1 and not self.stack.microbatch_reduce
        ):  # full-size gradients kept (FSDP no_sync)
            dense, expert = self._params_on(lay.tp, lay.pp, lay.ep, first, last, lay.split)
            bd["accumulation"] = self.G * (dense + expert) - bd["gradients"]
        # The optimizer step runs after the activations are freed; its temporaries count only beyond them.
        bd["optimizer step"] = max(0.0, self.step_workspace(lay, first, last) - act - logits)
        bd["overhead"] = self.cluster.device.runtime_overhead_bytes + FRAGMENTATION * (
            act + logits + bd["zero3 buffer"]
        )
        return zero3_memory(self, lay, bd, first, last) if lay.offload_params or lay.hpz else bd

    # ------------------------------------------------------------------ time

    def tp_calls(
        self, tp: int, sp: bool, recompute: str, mb: int, part: str, cp: int = 1
    ) -> dict[tuple[str, float], float]:
        """Tensor-parallel collectives of one micro-batch, fwd + bwd, as Loom issues them:
        ``{(op, message bytes): calls}`` for one ``layer``, the ``first`` stage's extras (the
        vocabulary-parallel embedding) or the ``last`` stage's (final norm, head, loss).

        With S = T h B_a (the full sequence's hidden states; all-gather output = reduce-scatter
        input = S), per layer: without sp, 4 all-reduces of S (g after attention and MLP forward,
        f before them backward); with sp, 6 all-gathers (2 forward, 2 re-gathered for the weight
        gradients, 2 as the reduce-scatters' backward) and 4 reduce-scatters of S. Full
        recomputation repeats the forward's 2 (no sp: all-reduce; sp: all-gather +
        reduce-scatter). First stage: the embedding's all-reduce (sp: reduce-scatter, all-gather
        backward). Last stage: the head input's backward all-reduce (sp: 2 all-gathers + 1
        reduce-scatter) and the vocab-parallel loss's 2 all-reduces (row max: 4T bytes; sum-exp
        and target logit: 8T). Gradients held in part per rank are summed once per step
        (:meth:`tp_partial_params`), not here.
        """
        if tp <= 1:
            return {}
        T = mb * self.train.seq_len / cp
        S = T * self.model.dim * self.act_bytes
        again = 2 if recompute == "full" else 0
        calls: list[tuple[str, float, int]]
        if part == "layer":
            calls = (
                [("all_reduce", S, 4 + again)]
                if not sp
                else [("all_gather", S, 6 + again), ("reduce_scatter", S, 4 + again)]
            )
        elif part == "first":
            calls = [("all_reduce", S, 1)] if not sp else [("reduce_scatter", S, 1), ("all_gather", S, 1)]
        else:
            calls = [("all_reduce", 4.0 * T, 1), ("all_reduce", 8.0 * T, 1)]  # the loss
            calls += [("all_reduce", S, 1)] if not sp else [("all_gather", S, 2), ("reduce_scatter", S, 1)]
        out: dict[tuple[str, float], float] = {}
        for op, size, k in calls:
            out[(op, size)] = out.get((op, size), 0) + k
        return out

    def tp_partial_params(self, tp: int, sp: bool, pp: int, last: bool = True, ep: int = 1) -> float:
        """Parameters whose gradient each tp rank holds in part, summed over tp in one all-reduce
        per step (``tp_comm.sum_partial_grads``, ``tensor_parallel.partial_numel``): with sp the norms'
        weights and LayerNorm biases (2 per layer + the final norm on the last stage), the
        row-parallel biases and the position table (on the first stage); replicated key/value
        weights and biases (k < t); q/k norm weights; with sp, the router and this rank's E/ep
        experts (replicated over tp, each rank routing its sequence shard)."""
        if tp <= 1:
            return 0.0
        m, pc = self.model, self.params
        layers, h, first = (
            m.n_layers / pp,
            m.dim,
            pp == 1 or not last,
        )  # pp > 1: the largest stage is the first
        qk_norms = 2 * m.head_dim if m.qk_norm else 0  # per layer, of pc.norms
        seq = layers * (pc.norms - qk_norms + pc.attn_whole + pc.mlp_whole) + (pc.final_norm if last else 0)
        seq += pc.positions if first else 0
        kv = 2 * layers * self.kd * (h + (1 if m.qkv_bias or m.bias else 0)) if m.n_kv_heads % tp else 0.0
        moe = layers * (pc.router + pc.mlp / ep) if self.moe else 0.0
        return (seq + moe if sp else 0.0) + kv + layers * qk_norms

    def collective_calls(self, lay: Layout) -> dict[str, int]:
        """Tensor-parallel and data-parallel/ZeRO collective calls per step on one device of the
        first stage, by op (what :class:`loom.comm.CommMeter` counts): :meth:`tp_calls` per
        micro-batch, one call per bucket (ZeRO 0: all-reduce; 1/2: reduce-scatter + all-gather),
        ZeRO-3 2u - 1 all-gathers per micro-batch (2u in a pipeline) and u reduce-scatters per step; hybrid sharding
        adds an all-reduce over the replicas per bucket (unit)."""
        m = self.train.global_batch // (lay.dp * lay.micro_batch)
        out: dict[str, int] = {}

        def add(op: str, k: float) -> None:
            out[op] = out.get(op, 0) + int(k)

        parts = [("layer", self.model.n_layers // lay.pp), ("first", 1)] + [("last", 1)] * (lay.pp == 1)
        for part, times in parts:
            for (op, _), k in self.tp_calls(
                lay.tp, lay.sp, lay.recompute, lay.micro_batch, part, lay.cp
            ).items():
                add(op, m * times * k)
        if (
            lay.ep > 1 and self.moe
        ):  # per MoE layer: counts + dispatch + combine forward (again when recomputed), 2 backward
            add("all_to_all", m * (self.model.n_layers // lay.pp) * (5 + 3 * (lay.recompute == "full")))
        if lay.cp > 1:  # per layer and micro-batch, forward again when recomputed (_cp_layer_time)
            layers, passes = self.model.n_layers // lay.pp, 1 + (lay.recompute == "full")
            if lay.cp_mode == "ring":  # one send per K/V hop (cp - 1 a pass), cp dK/dV hops
                add("send", m * layers * ((lay.cp - 1) * (passes + 1) + lay.cp))
            elif lay.cp_mode == "alltoall":  # q, k, v, output; their gradients
                add("all_to_all", m * layers * 4 * (passes + 1))
            else:  # K and V all-gathered, dK and dV reduce-scattered
                add("all_gather", m * layers * 2 * passes)
                add("reduce_scatter", m * layers * 2)
        if self.tp_partial_params(lay.tp, lay.sp, lay.pp, lay.pp == 1, lay.ep):
            add("all_reduce", 1)
        n = lay.dp_shard * lay.cp if lay.zero else lay.dp * lay.cp
        if n > 1:
            dense, expert = self._params_on(lay.tp, lay.pp, lay.ep, True, lay.pp == 1)
            if lay.ep == 1:  # experts, if any, share the dense buckets
                dense, expert = dense + expert, 0.0
            buckets = max(1, -(-int(dense * self.R) // int(self.train.bucket_bytes)))
            if lay.zero == 0:  # expert shards: buckets of their own, summed over their edp group
                edp = lay.dp * lay.cp // lay.ep
                add(
                    "all_reduce",
                    buckets + (-(-int(expert * self.R) // int(self.train.bucket_bytes)) if edp > 1 else 0),
                )
            elif lay.zero in (1, 2):
                add("reduce_scatter", buckets)
                add("all_gather", buckets)
            else:
                units, kept = self.zero3_units(lay.pp, lay.tp)
                add("all_gather", m * (2 * units - (kept > 0)))
                add("reduce_scatter", units)
            if lay.zero and lay.dp > lay.dp_shard:  # hybrid: each reduced shard all-reduced over replicas
                add("all_reduce", buckets if lay.zero < 3 else self.zero3_units(lay.pp, lay.tp)[0])
        return out

    def _kv_repeat(self, tp: int, cp: int) -> int:
        """All-to-all cp: key/value heads per tp rank repeated by cp / gcd(k, cp) (loom.parallel.context.alltoall)."""
        k = max(1, self.model.n_kv_heads // tp)
        return cp // math.gcd(k, cp)

    def _cp_layer_time(
        self, tp: int, cp: int, T: float, recompute: str, mode: str, core_f: float, world: int
    ) -> float:
        """Exposed context-parallel communication of one layer and micro-batch (forward, backward and,
        under full recomputation, the forward again), T = tokens per device:

        - allgather: all-gathers of K and V before the core, reduce-scatters of dK, dV; not overlapped.
        - ring: cp − 1 K/V messages of 2 T kd B_a forward and again backward, plus cp fp32 dK/dV
          messages of 2 T kd 4 backward, each overlapped with one block's attention (the core's
          time / cp): exposed max(0, message − block) per hop.
        - alltoall: q, k, v and the output exchanged forward (their gradients backward), not
          overlapped; kv heads repeated by cp / gcd(k, cp).
        """
        mach, B, kv, h = self.machine, self.act_bytes, self.kv_width(tp), self.model.dim
        span, w = tp * cp, world or None
        passes = 2 if recompute == "full" else 1  # forwards per step
        if mode == "ring":
            block = core_f / cp
            kv_hop = max(0.0, mach.collective("p2p", 2, 2 * T * kv * B, span, w) - block)
            dkv_hop = max(0.0, mach.collective("p2p", 2, 2 * T * kv * 4, span, w) - self.bwd_ratio * block)
            return (cp - 1) * kv_hop * (passes + 1) + cp * dkv_hop
        if mode == "alltoall":
            f = self._kv_repeat(tp, cp)
            one = 2 * mach.collective("all_to_all", cp, T * h / tp * B, span, w)  # q and the output
            one += 2 * mach.collective("all_to_all", cp, T * kv * f * B, span, w)  # k and v
            return one * (passes + 1)
        kv_full = B * T * cp * kv
        gathers = 2 * passes
        return gathers * mach.collective("all_gather", cp, kv_full, span, w) + 2 * mach.collective(
            "reduce_scatter", cp, kv_full, span, w
        )

    def _microbatch_times(
        self,
        tp: int,
        sp: bool,
        cp: int,
        ep: int,
        mb: int,
        recompute: str,
        pp: int,
        world: int = 0,
        cp_mode: str = "allgather",
        tp_overlap: bool = False,
        split: tuple[int, ...] = (),
    ) -> tuple[float, float, dict[str, float]]:
        """(t_mb of the slowest stage, its weight-grad time t_W, per-term times) for one micro-batch."""
        mc, tr, mach = self.model, self.train, self.machine
        B, h, f, s = self.act_bytes, mc.dim, self.ffn, tr.seq_len
        T = mb * s / cp
        gemm_b = 1 if tr.precision == "fp8" else B
        # tokens per expert GEMM: T_r*top_k routed tokens (T_r = T/tp with sp, else T: experts are whole on
        # every tp rank) spread over this device's experts, the busiest ``moe_load`` times the mean
        T_moe = T / tp if sp else T
        ups = 2 if mc.mlp == "swiglu" else 1  # SwiGLU's w1 and w3, or GELU's w1
        if self.moe:
            experts_here = self.n_experts / ep
            Te = T_moe * self.top_k / experts_here * tr.moe_load
            mlp_f = experts_here * (ups * mach.gemm(Te, h, f, gemm_b) + mach.gemm(Te, f, h, gemm_b))
        else:
            mlp_f = ups * mach.gemm(T, h, f / tp, gemm_b) + mach.gemm(T, f / tp, h, gemm_b)
        gemm_f = (
            mach.gemm(T, h, h / tp, gemm_b)
            + 2 * mach.gemm(T, h, self.kv_width(tp), gemm_b)
            + mach.gemm(T, h / tp, h, gemm_b)
            + mlp_f
        )
        a_t = mc.n_heads / tp
        core_bytes = B * T * (2 * h / tp + 2 * self.kv_width(tp))
        if not tr.flash_attention:
            core_bytes += 4 * B * a_t * T * s  # scores written, softmax read+write, read by AV
        mlp_elt = (
            3 * f * self.top_k * tr.moe_load / (tp if sp else 1)
            if self.moe
            else (3 if mc.mlp == "swiglu" else 2) * f / tp
        )
        elt_bytes = B * T * (10 * h / (tp if sp else 1) + 2 * (h / tp + self.kv_width(tp)) + mlp_elt)
        other = self.stack.other if self.kernels else 1.0  # a calibrated profile measured its own kernels
        elt_f = other * elt_bytes / mach.hbm
        r = self.bwd_ratio  # 2 when GEMM FLOPs set the time; measured (profile) when per-op cost does
        if self.kernels:  # per-kernel model (a GPU from the datasheet): flash kernels, batched GEMMs
            core_f, core_b = self._attention_core(tp, cp, mb)
        else:
            core_f = max(4.0 * T * s * h / tp / mach.flops, core_bytes / mach.hbm)
            core_b = (FLASH_BWD if tr.flash_attention else 2.0) * r / 2 * core_f
        layer_f = gemm_f + core_f + elt_f
        lora_wgrad = (
            0.0  # LoRA: a frozen target computes no weight gradient (its adapters' rank-r GEMMs are left out)
        )
        if tr.lora_rank:
            target_gemm = {
                "q": (h, h / tp),
                "k": (h, self.kv_width(tp)),
                "v": (h, self.kv_width(tp)),
                "o": (h / tp, h),
                "w1": (h, f / tp),
                "w3": (h, f / tp),
                "w2": (f / tp, h),
            }
            lora_wgrad = r / 2 * sum(mach.gemm(T, *target_gemm[n], gemm_b) for n in tr.lora_targets)
        # backward: GEMMs and elementwise 2x forward; a flash kernel recomputes the scores (2.5x)
        layer_b = r * (gemm_f + elt_f) + core_b - lora_wgrad
        recomp = {"none": 0.0, "selective": core_f + self.stack.selective_gemms * gemm_f, "full": layer_f}[
            recompute
        ]
        ops, c_op = self.ops, mach.op_time
        if ops is not None:  # the framework's per-operator cost: tp/cp/pp split FLOPs, not the op count; the
            # trainer's per-block hooks fire again in the recomputed forward (in proportion to its operators)
            again = ops.microbatch(1, recompute) - ops.microbatch(1)
            recomp += c_op * again + mach.microbatch_overhead * again / max(1.0, ops.layer_fb)
        n_tp = {"none": 4, "selective": 4, "full": 6}[recompute]

        def tp_time(
            calls: dict[tuple[str, float], float],
        ) -> float:  # each call: its collective + the layer's own cost
            extra = mach.call_overhead.get("tp", 0.0)
            return sum(
                k * (mach.collective(op, tp, size, tp, world or None) + extra)
                for (op, size), k in calls.items()
            )

        tp_layer = tp_time(self.tp_calls(tp, sp, recompute, mb, "layer", cp))
        if (
            tp_overlap and tp > 1
        ):  # each collective cut in tp chunks, pipelined with its GEMM: the first chunk shows
            gemms = gemm_f * (1 + r) + (gemm_f if recompute == "full" else 0.0)
            tp_layer = tp_layer / tp + max(0.0, tp_layer * (tp - 1) / tp - gemms)
        cp_layer = self._cp_layer_time(tp, cp, T, recompute, cp_mode, core_f, world) if cp > 1 else 0.0
        ep_layer = 0.0
        if self.moe and ep > 1:
            # rows of this rank's tokens (T_moe·k, at most the capacity's), the busiest rank receiving ``moe_load`` x
            ep_layer = n_tp * mach.collective(
                "all_to_all", ep, T_moe * self.top_k * h * B * tr.moe_load, tp * ep, world or None
            )
            ep_layer += (
                (n_tp - 2) // 2 * mach.latency("all_to_all", ep, tp * ep, world or None)
            )  # the per-expert counts
            ep_layer += (n_tp + (n_tp - 2) // 2) * mach.call_overhead.get(
                "ep", 0.0
            )  # each call's cost in the layer
        head = (1 + r) * mach.gemm(T, h, mc.vocab_size / tp, gemm_b)
        head += other * 16 * T * mc.vocab_size / tp / mach.hbm
        per_layer = {
            "compute": layer_f + layer_b,
            "recompute": recomp,
            "tp comm": tp_layer,
            "cp comm": cp_layer,
            "ep comm": ep_layer,
            "framework": c_op * ops.layer_fb if ops else 0.0,
        }
        first_tp = tp_time(self.tp_calls(tp, sp, recompute, mb, "first", cp))
        last_tp = tp_time(self.tp_calls(tp, sp, recompute, mb, "last", cp))

        def stage(layers: float, first: bool, last: bool) -> dict[str, float]:
            terms = {k: layers * v for k, v in per_layer.items()}
            terms["compute"] += head if last else 0.0
            if ops:  # the head's operators; the trainer's per-micro-batch cost per block (saved-tensor and
                # gradient hooks), and once more for the rest (embedding, head, loss, data)
                terms["framework"] += (c_op * ops.fixed_fb if last else 0.0) + (
                    layers + 1
                ) * mach.microbatch_overhead
            terms["tp comm"] += (first_tp if first else 0.0) + (last_tp if last else 0.0)
            return terms

        kinds = [(True, True)] if pp == 1 else [(True, False), (False, True)] + [(False, False)] * (pp > 2)
        Ls, terms = max(
            (
                (self.stage_layers(pp, f, la, split), stage(self.stage_layers(pp, f, la, split), f, la))
                for f, la in kinds
            ),
            key=lambda st: sum(st[1].values()),
        )
        t_w = Ls * (
            gemm_f * r / 2 - lora_wgrad
        )  # weight-gradient GEMMs: half of the backward GEMMs (trained ones)
        return sum(terms.values()), t_w, terms

    def _dp_time(self, lay: Layout, m: int, t_mb: float, t_compute: float) -> float:
        """Exposed data-parallel / ZeRO communication per step, of ``total`` seconds in ``calls`` calls.

        Without overlap (``Layout.dp_overlap`` off, or a device whose ``comm_overlap`` is 0: gloo on
        the CPU cores that compute) all of it. With it, bucket by bucket: ZeRO 0 reduces each bucket
        while the last micro-batch's backward ``t_b`` goes on, ZeRO 1/2 also gather the updated
        parameters under the next forward ``t_f``, ZeRO-3 prefetches every unit under all ``m``
        micro-batches; what does not fit the window shows, and at least the last call (nothing
        left to hide it behind)::

            exposed = last + max(0, rest - window) + (1 - comm_overlap) min(rest, window)
            (last = total / calls, rest = total - last)

        window = t_b | t_b + t_f | m t_mb; the last term: collectives running beside compute slow it
        (NCCL's channels take SMs and HBM bandwidth), the device's ``comm_overlap`` share (0.8) hidden;
        on a CPU the profile's measured share (gloo's thread waits beside the compute, but its copies
        and reductions take the same cores).
        """
        total = self._dp_volume(
            lay.dp, lay.dp_shard, lay.tp, lay.pp, lay.cp, lay.ep, lay.zero, m, lay.world_size, lay.split
        )
        if lay.zero == 3 and (lay.qwz or lay.hpz or lay.qgz):
            total = zeropp_time(self, lay, m)
        share = self.machine.comm_overlap(lay.world_size)
        if total <= 0 or not lay.dp_overlap or share <= 0:
            return total
        r = self.bwd_ratio
        t_b, t_f = t_mb * r / (1 + r), t_mb / (1 + r)
        window = {0: t_b, 1: t_b + t_f, 2: t_b + t_f}.get(lay.zero, t_compute)
        if lay.zero == 3:
            units = max(self.zero3_units(lay.pp, lay.tp, s, lay.split)[0] for s in (False, True))
            calls = units + (
                m * (2 * units - 1) if lay.pp == 1 else 0
            )  # a pipeline's gathers: zero3_stage_gathers
        else:
            dense, expert = self._params_on(lay.tp, lay.pp, lay.ep, True, lay.pp == 1)
            calls = max(1, -(-int((dense + expert) * self.R) // int(self.train.bucket_bytes))) * (
                2 if lay.zero else 1
            )
        return exposed(total, calls, window, share)

    def _sync_time(self, lay: Layout) -> float:
        """Scalar collectives of every step, one call latency each: the logged loss averaged over
        dp, the gradient norm summed over tp, over the ZeRO group and over pp, and the loss
        broadcast over pp."""
        mach, world = self.machine, lay.world_size
        calls = [
            ("all_reduce", lay.dp * lay.cp, lay.tp * lay.cp * lay.dp),
            ("all_reduce", lay.tp, lay.tp),
            ("all_reduce", lay.pp, world),
            ("all_reduce", lay.pp, world),
        ]
        if lay.zero:
            calls.append(("all_reduce", lay.dp_shard * lay.cp, lay.tp * lay.cp * lay.dp_shard))
        return sum(mach.latency(op, n, span, world, synced=True) for op, n, span in calls)

    def zero3_units(
        self, pp: int, tp: int = 1, last: bool = False, split: tuple[int, ...] = ()
    ) -> tuple[int, float]:
        """(units, parameters kept gathered from forward to backward) of ZeRO-3 on the first
        stage (``last``: the last), as Loom wraps it: every block, the modules before the blocks and
        those after them, merged when they share the tied embedding. Without a pipeline the last
        unit (final norm + head) stays gathered, as backward needs it next; a pipeline stage keeps
        none (its next action is often another micro-batch's forward). In a pipeline the first stage
        adds the embedding, the last the final norm + head, a tied head's copy of the embedding
        being a unit of its own (:func:`~loom.parallel.layout.tied_copy`): 2 units."""
        pc = self.params
        if pp > 1:
            blocks = int(self.stage_layers(pp, not last, last, split))
            return blocks + (1 + (pc.head == 0) if last else 1), 0.0
        units = self.model.n_layers + (1 if pc.head == 0 else 2)
        return units, pc.final_norm + self.model.vocab_size * self.model.dim / tp

    def _dp_comm(
        self,
        dp: int,
        ds: int,
        tp: int,
        pp: int,
        cp: int,
        ep_deg: int,
        zero: int,
        m: int,
        world: int = 0,
        split: tuple[int, ...] = (),
    ) -> float:
        """Seconds of data-parallel / ZeRO collectives per step, as Loom issues them (with gradient
        accumulation, reductions happen once, after the last micro-batch):

        - ZeRO 0: an all-reduce of Phi R bytes in ceil(Phi R / bucket) bucket calls;
        - ZeRO 1/2: a reduce-scatter of Phi R and an all-gather of Phi W, per bucket (the gather after
          the optimizer, the ranks in step: the profile's back-to-back fit);
        - ZeRO 3 (u units): per micro-batch, all-gathers of Phi W forward (u calls) and of
          (Phi - Phi_kept) W backward (u - 1 calls; u in a pipeline, which keeps no unit gathered);
          a reduce-scatter of Phi R per step (u calls);
        - hybrid sharding: an all-reduce of the shard Phi R / N across the dp / dp_shard replicas;
        - a parameter server (K shards): a push and a pull phase, the busiest server's link carrying
          W' Phi 4 / K bytes in each (point-to-point; W' = W workers, W - 1 co-located).
        """
        mach, W, R = self.machine, self.W, self.R
        wd = world or None
        dense, expert = self._params_on(tp, pp, ep_deg, True, pp == 1)
        dense_l, expert_l = self._params_on(tp, pp, ep_deg, False, True)
        total = 0.0
        tpcp = tp * cp
        if (
            self.train.ps_shards
        ):  # push then pull, each one message per (worker, server): the server's link carries
            # W' Φ b / K per phase (W' = W, or W - 1 when server k lives in worker k), b = 4 (fp32)
            k, through = self.train.ps_shards, dp - (1 if self.train.ps_colocate else 0)
            return (
                2 * mach.collective("p2p", 2, through * dense * 4 / k, tpcp * dp, wd) if through > 0 else 0.0
            )
        for phi, ep in ((max(dense, dense_l), 1), (max(expert, expert_l), ep_deg)):
            if phi <= 0:
                continue
            buckets = max(1, -(-int(phi * R) // int(self.train.bucket_bytes)))
            if zero == 0:
                n, span = dp * cp // ep, tpcp * dp
                total += self._grad_all_reduce(n, phi * R, span, wd, buckets)
                continue
            ns = max(1, ds * cp // ep)
            span = tpcp * ds
            lat_rs, lat_ag = (
                mach.latency("reduce_scatter", ns, span, wd),
                mach.latency("all_gather", ns, span, wd),
            )
            rs = mach.collective("reduce_scatter", ns, phi * R, span, wd)
            if zero in (1, 2):  # the gather of the updated shards follows the optimizer, every rank in step
                lat_ag = mach.latency("all_gather", ns, span, wd, synced=True)
                ag = mach.collective("all_gather", ns, phi * W, span, wd, synced=True)
                total += rs + ag + (buckets - 1) * (lat_rs + lat_ag)
            else:  # a pipeline's gathers are in its stage time (zero3_stage_gathers), its busiest end stage's reduces here
                units = max(self.zero3_units(pp, tp, s, split)[0] for s in (False, True))
                reduces = m if self.stack.microbatch_reduce else 1
                total += reduces * (rs + (units - 1) * lat_rs)
                if pp == 1:
                    total += m * self._zero3_gathers(phi, ep, ns, span, wd, tp)
            total += self._grad_all_reduce(dp // ds, phi * R / ns, tpcp * dp, wd)
        return total

    def _zero3_gathers(
        self,
        phi: float,
        ep: int,
        ns: int,
        span: int,
        world: int | None,
        tp: int,
        pp: int = 1,
        last_stage: bool = False,
        split: tuple[int, ...] = (),
    ) -> float:
        """ZeRO-3 all-gathers of one micro-batch over ``ns`` ranks: forward, the stage's ``u`` units of
        Φ W bytes in all, ``u`` latencies; backward again, but for the kept unit (none in a pipeline)."""
        mach = self.machine
        units, kept = self.zero3_units(pp, tp, last_stage, split)
        kept = min(kept, phi) if ep == 1 else 0.0
        lat = mach.latency("all_gather", ns, span, world)
        fwd = mach.collective("all_gather", ns, phi * self.W, span, world) + (units - 1) * lat
        calls = units - 1 if kept > 0 else units  # backward gathers all but the kept unit
        bwd = mach.collective("all_gather", ns, (phi - kept) * self.W, span, world) + max(0, calls - 1) * lat
        return fwd + bwd

    def zero3_stage_gathers(self, lay: Layout) -> tuple[float, int]:
        """(seconds, calls) of ZeRO-3's all-gathers per micro-batch on the busier end stage of a
        pipeline (:meth:`_zero3_gathers` of its dense and expert parameters); they run inside each
        micro-batch's stage time, so the bubble stretches with them."""
        wd, out = lay.world_size, (0.0, 0)
        ns_dense = max(1, lay.dp_shard * lay.cp)
        for first, last in ((True, False), (False, True)):
            dense, expert = self._params_on(lay.tp, lay.pp, lay.ep, first, last, lay.split)
            t = 0.0
            for phi, ep in ((dense, 1), (expert, lay.ep)):
                if phi > 0:
                    ns = max(1, ns_dense // ep)
                    t += self._zero3_gathers(
                        phi, ep, ns, lay.tp * lay.cp * lay.dp_shard, wd, lay.tp, lay.pp, last, lay.split
                    )
            calls = 2 * self.zero3_units(lay.pp, lay.tp, last, lay.split)[0]
            out = max(out, (t, calls))
        return out

    def _grad_all_reduce(self, n: int, size: float, span: int, world: int | None, calls: int = 1) -> float:
        """Seconds of the gradient all-reduce of ``size`` bytes over ``n`` ranks in ``calls`` bucket
        calls, by ``Workload.allreduce``: the backend's (``native``: the machine's ring, or the profile's
        fit), else the algorithm's α-β time (:mod:`loom.plan.collectives`: rounds·α + volume·β, the
        link's latency and bandwidth), every further call paying its rounds' α again."""
        mach, algorithm = self.machine, self.train.allreduce
        if n <= 1 or size <= 0:
            return 0.0
        if algorithm == "native":
            return mach.collective("all_reduce", n, size, span, world) + (calls - 1) * mach.latency(
                "all_reduce", n, span, world
            )
        if algorithm == "butterfly" and n & (n - 1):  # refused by the rules; timed as a ring meanwhile
            algorithm = "ring"
        alpha, beta = mach.alpha_beta(n, span)
        return (
            collectives.time(algorithm, size, n, alpha, beta)
            + (calls - 1) * collectives.rounds(algorithm, n) * alpha
        )

    def estimate(self, lay: Layout) -> Estimate:
        """Full prediction for ``lay``; raises :class:`PlanError` if the layout is invalid."""
        why = self.check(lay)
        if why:
            raise PlanError(f"layout {lay.short()}: {why}")
        mem, breakdown, stage = self.memory(lay)
        return self.timed(lay, mem, breakdown, stage)

    def timed(self, lay: Layout, mem: float, breakdown: dict[str, float], stage: str) -> Estimate:
        """Add the time prediction to a checked layout whose memory is known."""
        tr, mach = self.train, self.machine
        m = tr.global_batch // (lay.dp * lay.micro_batch)
        p = lay.pp
        world = lay.world_size
        t_mb, t_w, terms = self._per_mb(
            lay.tp,
            lay.sp,
            lay.cp,
            lay.ep,
            lay.micro_batch,
            lay.recompute,
            p,
            world,
            lay.cp_mode,
            lay.tp_overlap,
            lay.split,
        )
        w_share = t_w / t_mb
        if p == 1:
            idle = 0.0
        elif lay.schedule == "interleaved":
            idle = (p - 1) / lay.v
        elif lay.schedule == "zb-h1":
            idle = (p - 1) * (1 - 2 * w_share)
        else:
            idle = p - 1.0
        time = {k: m * val for k, val in terms.items()}
        gathers = 0.0  # ZeRO-3 in a pipeline: each micro-batch's gathers, prefetched under its stage compute
        if (
            p > 1 and lay.zero == 3 and not (lay.qwz or lay.hpz or lay.qgz)
        ):  # ZeRO++: zeropp_time counts its own
            g, calls = self.zero3_stage_gathers(lay)
            gathers = exposed(g, calls, t_mb, mach.comm_overlap(world) if lay.dp_overlap else 0.0)
        time["pp bubble"] = idle * (t_mb + gathers)
        time["pp p2p"] = 0.0
        if p > 1:
            B = self.act_bytes
            msg = lay.micro_batch * tr.seq_len / lay.cp * self.model.dim * B / lay.tp
            span = lay.tp * lay.cp * lay.dp * p
            time["pp p2p"] = (
                2 * m * lay.v * mach.collective("p2p", 2, msg, span, synced=True)
            )  # the receiver waits
        partial = self.tp_partial_params(lay.tp, lay.sp, p, p == 1, lay.ep) * self.R
        time["tp comm"] += mach.collective("all_reduce", lay.tp, partial, lay.tp, world)
        time["step sync"] = self._sync_time(lay)
        time["dp comm"] = self._dp_time(lay, m, terms["compute"], m * t_mb) + m * gathers
        dense, expert = self._stage_params(lay, True, p == 1)
        n = lay.dp_shard * lay.cp if lay.zero else 1
        local = dense / n + expert / max(1, n // lay.ep)
        if tr.ps_shards:  # each server steps its shard; the workers wait for it (bsp)
            local = dense / tr.ps_shards
        if lay.offload:
            W, G = self.W, self.G
            host_adam = HOST_ADAM_BANDWIDTH / self.cluster.devices_per_node
            time["optimizer"] = local * ((W + G) / self.cluster.host_bandwidth + ADAM_BYTES / host_adam)
        else:  # its bytes over the memory bandwidth, or its arithmetic where that is slower (8-bit Adam on a CPU)
            rate = mach.optimizer_rates.get(tr.optimizer, 0.0)
            time["optimizer"] = max(local * ADAM_BYTES / mach.hbm, local / rate if rate > 0 else 0.0)
        if (
            self.ops is not None
        ):  # the optimizer's operators (foreach calls, or per-parameter ones: adafactor)
            time["optimizer"] += mach.op_time * self.ops.optimizer(
                self.stage_layers(p, True, p == 1, lay.split)
            )
        time["cpu bound"] = 0.0
        if self.cpu_model is not None:  # the cores cannot run more than their share of every rank's CPU work
            time["cpu bound"] = max(
                0.0, self.cpu_model.cpu_demand(lay, mem, breakdown, stage) - sum(time.values())
            )
        step = sum(time.values())
        tokens = tr.global_batch * tr.seq_len
        world = lay.world_size
        rec_tokens = {
            "none": 0.0,
            "selective": 4.0 * self.model.n_layers * self.model.dim * tr.seq_len,
            "full": 2.0 * self.params.n_layers * (self.params.attn + self.params.mlp_active)
            + 4.0 * self.model.n_layers * self.model.dim * tr.seq_len,
        }[lay.recompute]
        hw_flops = self.model_flops + rec_tokens * tokens
        return Estimate(
            layout=lay,
            step_time=step,
            tokens_per_s=tokens / step,
            tflops_per_device=hw_flops / step / world / 1e12,
            mfu=self.model_flops / step / world / mach.peak,
            memory=mem,
            capacity=self.cluster.device.memory_bytes,
            memory_breakdown=breakdown,
            time_breakdown=time,
            microbatches=m,
            bubble_fraction=time["pp bubble"] / (m * t_mb + time["pp bubble"]),
            peak_stage=stage,
        )

    def cpu_demand(self, lay: Layout, mem: float, breakdown: dict[str, float], stage: str) -> float:
        """Seconds of one rank's work in a step, without the pipeline bubble (a waiting rank spends
        nothing): on a CPU twin (:meth:`Profile.cpu_twin`) the rank's CPU demand."""
        return sum(
            v for k, v in self.timed(lay, mem, breakdown, stage).time_breakdown.items() if k != "pp bubble"
        )


def exposed(total: float, calls: int, window: float, share: float) -> float:
    """Seconds of ``total`` communication in ``calls`` calls left showing beside ``window`` seconds of
    compute when a ``share`` of overlapped traffic is truly hidden: the last call always (nothing
    left to hide it behind), what does not fit the window, and the unhidden part of what does::

        last + max(0, rest - window) + (1 - share) min(rest, window),  last = total / calls, rest = total - last
    """
    if total <= 0 or share <= 0 or calls <= 0:
        return max(0.0, total)
    last = total / calls
    rest = total - last
    return last + max(0.0, rest - window) + (1 - share) * min(rest, window)


def estimate(
    model: ModelConfig,
    layout: Layout,
    train: Workload,
    cluster: ClusterSpec,
    *,
    profile: Profile | None = None,
    n_experts: int | None = None,
    top_k: int | None = None,
) -> Estimate:
    """Predict memory and step time of ``layout`` (see the module doc for every formula)."""
    return CostModel(model, train, cluster, profile, n_experts, top_k).estimate(layout)
