"""What the cost model evaluates: a :class:`Layout` (degrees, sharding, schedule, recomputation)
of a :class:`Workload` (batch, sequence, precision), and what it answers: an :class:`Estimate`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, get_args

from loom.config import OPTIMIZERS
from loom.mesh import ParallelDims
from loom.numbers import is_whole
from loom.optim.adam8bit import BLOCK as ADAM8BIT_BLOCK
from loom.rules import CP_MODES, ScheduleName

SCHEDULES: tuple[ScheduleName, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1")  # those the formulas model


RECOMPUTE = ("none", "selective", "full")  # the policies of config.RecomputePolicy, cheapest first
MoeWeighting = Literal["output", "activation"]  # Workload.moe_weighting: where an MoE's routing weights apply
MOE_WEIGHTINGS: tuple[MoeWeighting, ...] = get_args(MoeWeighting)


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
    # an MoE's experts under tp (parallel.expert_tp, loom.rules.EXPERT_TP_MODES): replicate (whole on every
    # tp rank) | split (w1/w3 columns, w2 rows, as the dense MLP: Megatron-Core's expert tensor parallelism)
    expert_tp: str = "replicate"
    # ZeRO-3 parameter + gradient shards (and the state) on the host: ZeRO-Infinity
    offload_params: bool = False
    qwz: bool = False  # ZeRO++ int8 weight gathers (zero 3; loom.plan.zero_options)
    hpz: int = 0  # ZeRO++ secondary partition over this many ranks (a node; 0 = off)
    qgz: int = 0  # ZeRO++ gradient all-to-all in this many bits (8 or 4; 0 = off)
    # tensor-parallel collectives pipelined with their GEMMs (Megatron-Core --tp-comm-overlap)
    tp_overlap: bool = False
    # an MoE's all-to-alls run beside another micro-batch's layer compute (Megatron-Core
    # --overlap-moe-expert-parallel-comm, Megatron-Bridge's moe_a2a_overlap)
    ep_overlap: bool = False
    # data-parallel / ZeRO traffic overlapped bucket by bucket (False: after backward)
    dp_overlap: bool = True
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
        ``dp16 tp8 pp8 cp1 ep1 zero1/16 sp [etp] interleaved:v5 mb1 recompute:none [offload]``
        (``etp``: ``expert_tp = "split"``)."""
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}", f"cp{self.cp}{self._mode()}", f"ep{self.ep}"]
        parts.append(f"zero{self.zero}/{self.dp_shard}" if self.zero else "zero0")
        parts += ["sp"] * self.sp + ["etp"] * (self.expert_tp == "split")
        parts += [f"{self.schedule}:v{self.v}", f"mb{self.micro_batch}", f"recompute:{self.recompute}"]
        parts += ["tp-overlap"] * self.tp_overlap + ["ep-overlap"] * self.ep_overlap
        parts += ["dp-after-backward"] * (not self.dp_overlap)
        parts += [f"split:{','.join(map(str, self.split))}"] * bool(self.split)
        return " ".join(parts + ["offload"] * self.offload)

    @classmethod
    def parse(cls, text: str, field: str = "--layout") -> Layout:
        """The layout of a :meth:`spec` line (``zeroK`` alone shards over all of dp; degrees not named
        are 1); ``field`` names it in errors."""
        from typing import get_args

        from loom.rules import ScheduleName

        kw: dict = {}
        if not text.split():
            raise PlanError(
                f"{field}: empty; expected e.g. 'dp16 tp8 pp8 cp1 ep1 zero1 sp interleaved:v5 mb1'"
            )
        seen: dict[str, str] = {}  # what a token sets -> the token that set it
        for tok in text.split():
            name, _, arg = tok.partition(":")
            head = name.rstrip("0123456789/")
            digits = name[len(head) :]
            what = "schedule" if name in get_args(ScheduleName) else head or name
            if what in seen:  # a second one would silently replace the first
                raise PlanError(f"{field}: {seen[what]!r} and {tok!r} in {text!r} both set {what}; give one")
            seen[what] = tok
            if head in ("dp", "tp", "pp", "cp", "ep", "mb") and is_whole(digits) and int(digits) < 1:
                raise PlanError(f"{field}: {tok!r} in {text!r}: a degree (and mb) is at least 1")
            try:
                if head == "cp" and is_whole(digits) and arg in ("", *CP_MODES):
                    kw["cp"] = int(digits)
                    kw["cp_mode"] = arg or "allgather"
                elif head in ("dp", "tp", "pp", "ep", "mb") and is_whole(digits) and not arg:
                    kw["micro_batch" if head == "mb" else head] = int(digits)
                elif head == "zero" and digits:
                    stage, _, shard = digits.partition("/")
                    kw["zero"] = int(stage)
                    if shard:
                        kw["dp_shard"] = int(shard)
                elif tok == "sp":
                    kw["sp"] = True
                elif tok == "etp":
                    kw["expert_tp"] = "split"
                elif tok == "offload":
                    kw["offload"] = True
                elif tok == "tp-overlap":
                    kw["tp_overlap"] = True
                elif tok == "ep-overlap":
                    kw["ep_overlap"] = True
                elif tok == "dp-after-backward":
                    kw["dp_overlap"] = False
                elif name == "split" and arg:
                    if not all(is_whole(x.strip()) and int(x) >= 1 for x in arg.split(",")):
                        raise ValueError  # a stage holds at least 1 block
                    kw["split"] = tuple(int(x) for x in arg.split(","))
                elif name == "recompute" and arg in ("none", "selective", "full"):
                    kw["recompute"] = arg
                elif name in get_args(ScheduleName):
                    kw["schedule"] = name
                    if arg:
                        if not arg.startswith("v") or not is_whole(arg[1:]) or int(arg[1:]) < 1:
                            raise ValueError  # v: at least 1 virtual stage per device
                        kw["v"] = int(arg[1:])
                else:
                    raise ValueError
            except ValueError:
                raise PlanError(
                    f"{field}: cannot read {tok!r} in {text!r}; expected e.g. "
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
        if self.zero:  # zS/G as the table and the layout line write it: stage S over G of the dp ranks
            parts.append(f"z{self.zero}" + (f"/{self.dp_shard}" if self.dp_shard != self.dp else ""))
        return " ".join(parts + ["etp"] * (self.expert_tp == "split"))


@dataclass(frozen=True)
class Workload:
    """What is trained: batch, sequence, precision (micro_batch and recompute live on Layout)."""

    global_batch: int  # sequences per optimizer step
    seq_len: int  # tokens per sequence
    precision: str = "bf16"  # fp32 | tf32 | bf16 | fp16 | fp8 | int8 (fp8, int8: 8-bit GEMMs, bf16 states)
    fp8_recipe: str = "tensorwise"  # train.fp8_recipe: tensorwise | rowwise (fp8's amax all-reduces under tp)
    # train.fp8_layers: auto (the GEMMs too small for float8 to pay run bf16) | all (other stacks: every Linear)
    fp8_layers: str = "auto"
    reduce_dtype: str = "fp32"  # dtype gradients are reduced in (fp32 | bf16 | fp16)
    flash_attention: bool = True  # attention scores are not stored (flash / SDPA)
    # train.compile != none: torch.compile (Inductor) emits each block's pointwise chain as one kernel, so
    # memory-bound work runs at one pass per tensor (stacks.COMPILED_OTHER), not the stack's eager factor
    compile: bool = False
    bucket_bytes: float = 25 * 2**20  # data-parallel gradient bucket (parallel.bucket_mb)
    optimizer: str = "adamw"  # adamw | adam8bit | adafactor (train.optimizer)
    moe_imbalance: float = 1.0  # MoE: max/mean tokens per expert (moe.imbalance; a run's moe_imbalance metric; 0 = the profile's)
    # MoE: moe.capacity_factor (0 = dropless): caps an expert's load at cf x mean
    capacity_factor: float = 0.0
    moe_aux_loss: bool = False  # MoE: moe.aux_loss_coef > 0 (the Switch/GShard balancing loss)
    moe_z_loss: bool = False  # MoE: moe.z_loss_coef > 0 (the router z-loss)
    moe_score: str = "softmax"  # MoE: moe.score (sigmoid: the aux loss normalizes each token's scores)
    moe_shared: int = 0  # MoE: moe.n_shared_experts (one SwiGLU of S·f that every token runs)
    moe_compute: str = "grouped"  # MoE: moe.compute, grouped | loop (per expert: no group offsets)
    # MoE parallel folding (Megatron-Core, expert tensor parallelism 1; a published run's
    # expert_tensor_parallel = 1): the expert-parallel group is drawn from tp x dp x cp, so ep need only
    # divide that, and each rank's E/ep experts are its own, not shared by the tp group (Loom's layouts:
    # whole on every tp rank, or split over it, Layout.expert_tp)
    expert_folding: bool = False
    # MoE: where the routing weights multiply an expert row (a published run's moe_weighting; MOE_WEIGHTINGS):
    # "output", the row's output as it returns, kept for the weight's gradient (Loom; Megatron-Core before
    # 0.13); "activation", inside the fused weighted GLU (Megatron-Core 0.13+: its input and the weight only)
    moe_weighting: MoeWeighting = "output"
    # the loss writes the logits' gradient over the logits in its forward and keeps only them (a published
    # run's fused_cross_entropy: Transformer Engine's parallel cross entropy, Megatron-Core's
    # cross_entropy_fusion_impl = "te"): B_a per logit at the loss's peak (memory.logit_bytes)
    fused_cross_entropy: bool = False
    # single modules whose outputs the stack discards in forward and recomputes in backward, beside the
    # layout's recompute policy (a published run's recompute_modules; Stack.recompute_modules names those
    # a stack offers: Megatron-Core's "moe_act", "layernorm"); ignored under full recomputation
    recompute_modules: tuple[str, ...] = ()
    # parallel.allreduce: the gradient all-reduce's algorithm (butterfly needs 2^k ranks)
    allreduce: str = "native"
    # parallel.dp_mode = "ps": K parameter-server shards instead of the all-reduce (0 = none)
    ps_shards: int = 0
    ps_colocate: bool = True  # servers in workers 0..K-1 (else K dedicated ranks besides the dp workers)
    ps_sync: str = "bsp"  # parallel.ps_sync: bsp | asp | ssp:S (co-located servers run bsp only)
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
    def moe_router_losses(self) -> bool:
        """An aux or z loss is on (a synchronous pipeline schedule is needed)."""
        return self.moe_aux_loss or self.moe_z_loss

    @property
    def mixed(self) -> bool:
        return self.precision in ("bf16", "fp16", "fp8", "int8")

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
