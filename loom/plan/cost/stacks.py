"""The training software a prediction assumes (:class:`Stack`): how many passes its memory-bound
kernels make, what its "selective" recomputation means, how it reduces and where its loss peaks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stack:
    """Training software whose kernels and overlap a prediction assumes (published runs name theirs).

    ``other`` scales the time of everything but GEMMs and attention kernels (elementwise, norms,
    softmax, loss: the memory-bound work) for a stack that fuses less than one pass over each
    tensor (fitted on the published runs, 1.75-2.8: eager or partly fused norms, bias/GeLU,
    softmax and loss read and write each tensor about twice what Loom's one-pass count says).
    ``selective_gemms`` = g: what "selective" recomputation means there, the share of a block's
    GEMMs whose outputs the policy does not save and recomputes. One rule for time and memory: the
    recomputed forward costs the attention core plus g of the block's GEMM time
    (:func:`~loom.plan.cost.compute.microbatch_times`), and the block saves (1 - g) of its GEMM
    outputs (:func:`~loom.plan.cost.memory.selective_saved`). g = 0: Korthikanti et al.'s policy,
    Loom's and Megatron's (only the attention core recomputed; the block keeps all else); torchtitan's
    op-level policy saves every other matmul output and recomputes the rest (0.5).
    ``bucket_params``: how the stack sizes its data-parallel gradient buckets (:meth:`~loom.plan.cost.
    base.CostBase.bucket_bytes`): each bucket is one reduce call, whose ring latency grows with the group.
    ``microbatch_reduce``: Composer's FSDP reduce-scatters the gradients of every micro-batch (Loom
    and torchtitan keep them whole until the last: ``no_sync``). ``logit_bytes``: bytes per logit at
    the loss's peak, over the whole T x V / t logits (:func:`~loom.plan.cost.memory.logit_bytes`);
    0: B_a + 8 (the logits, an fp32 copy and the fp32 log-softmax: torchtitan's ``cross_entropy`` on
    ``logits.float()``); llm-foundry's fused cross entropy works on the bf16 logits in place (4: 2 + 2
    bytes, the logits and their gradient). Only Loom's own stack moves the head into a chunked loss
    (:func:`~loom.plan.cost.memory.head_in_loss`).
    """

    name: str
    other: float = 1.0
    selective_gemms: float = 0.0  # g: share of a block's GEMMs "selective" recomputes (1 - g of outputs kept)
    # ZeRO-2/3 reduce-scatter every micro-batch (FSDP without no_sync): no full-size grads
    microbatch_reduce: bool = False
    # bytes per logit at the loss's peak, whole logits (0: B_a + 8, logits + fp32 copy + log-softmax;
    # Loom's "" chunks its loss instead where it can: memory.head_in_loss)
    logit_bytes: float = 0.0
    # fp8 / int8 under tp: one MAX all-reduce of amaxes per 8-bit GEMM on shards (Loom's
    # loom.memory.lowp_gemm); False: the stack's own scaling traffic is not counted (Transformer
    # Engine reduces a few amaxes per layer, not per GEMM)
    amax_per_gemm: bool = False
    # fp8 / int8 run an MoE's routed experts in 8 bits (Transformer Engine's grouped GEMMs); False: they
    # stay bf16 (Loom converts nn.Linear layers only, its experts are grouped weights)
    lowp_experts: bool = True
    # fp8 / int8 price the output head's GEMMs 8-bit; False: bf16 (Loom keeps the head out of its swap,
    # as torchtitan does). The fitted stacks keep True, the pricing their constants were fitted with
    # (Megatron's output layer is not a Transformer Engine Linear: a refit would move them)
    lowp_head: bool = True
    # fp8 scales each 8-bit Linear's operands dynamically in kernels of their own (torchao's Float8Linear:
    # an amax pass, then a cast writing both layouts), priced by compute.scale_cast_bytes; False: the
    # stack fuses them (Transformer Engine's casts are in its fitted 8-bit rate)
    scale_casts: bool = False
    # an 8-bit Linear keeps its input for the weight gradient in 8 bits, 1 byte per element (Transformer
    # Engine caches the fp8 cast it made); False: in B_a (torchao's Float8Linear saves the bf16 input
    # and casts again in the backward): loom.plan.cost.memory.layer_saved
    saves_8bit_inputs: bool = False
    # (floor, per data-parallel rank): a gradient bucket of max(floor, per x dp cp) parameters, as
    # Megatron-Core's DDP sizes it (larger groups, larger buckets: a ring's per-rank message stays above
    # its latency); (0, 0): the workload's own bucket_bytes (parallel.bucket_mb: Loom, PyTorch DDP's 25 MB)
    bucket_params: tuple[float, float] = (0.0, 0.0)
    # split experts (expert tensor parallelism = tp) under sp: each rank routes its own sequence shard and
    # dispatches its T/t·k rows over ep, then the tp group all-gathers the rows it received (k·load·S)
    # and reduce-scatters the experts' outputs (Megatron-Core's alltoall dispatcher: A2A(EP) -> AG(TP),
    # RS(TP) -> A2A(EP)); False: Loom's, the sequence all-gathered before the router (S), every tp rank
    # routing the tp group's tokens (loom.plan.cost.comm.tp_calls)
    etp_gathers_rows: bool = False
    # what an MoE layer keeps for backward: "loom", Loom's own MoE (loom.model.moe, measured:
    # memory.moe_activation); "megatron", Megatron-Core's (Transformer Engine's grouped experts, the fused
    # bias-GLU keeping its input alone, permutations and all-to-alls keeping index maps, not rows:
    # memory.megatron_moe_activation)
    moe_saves: str = "loom"
    # output-discarding checkpoints of single modules the stack offers beside its recompute policy
    # (Workload.recompute_modules; memory.module_recompute_saved, compute.module_recompute_bytes):
    # Megatron-Core's recompute_modules "moe_act" (the experts' GLU) and "layernorm" (the pre-MLP norm)
    recompute_modules: tuple[str, ...] = ()
    # the stack whose memory-bound factor this one runs at (the same fused kernels), fitted there;
    # "": its own ``other`` (memory_bound_stack)
    other_of: str = ""
    note: str = ""


STACKS: dict[str, Stack] = {
    s.name: s
    for s in (
        Stack(
            "",
            other=1.8,
            amax_per_gemm=True,
            lowp_experts=False,
            lowp_head=False,
            scale_casts=True,
            note="Loom: eager PyTorch norms/activations and SDPA flash attention, as torchtitan's",
        ),
        Stack(
            "megatron-core",
            other=1.24,
            saves_8bit_inputs=True,
            bucket_params=(40e6, 1e6),
            etp_gathers_rows=True,
            moe_saves="megatron",
            recompute_modules=("moe_act", "layernorm"),
            note="Megatron-Core + Transformer Engine (fused norm-GEMM, bias-GeLU): fitted on two "
            "sources, NeMo 24.07 and Megatron-Bridge (FP8 on H100)",
        ),
        Stack(
            "megatron-lm-2021",
            other_of="megatron-core",
            note="Megatron-LM (2021): Megatron's fused kernels (apex LayerNorm, scale-mask-softmax, bias-GeLU, "
            "bias-dropout-add) without flash attention: Megatron-Core's memory-bound factor",
        ),
        Stack(
            "megatron-deepspeed",
            other=4.26,
            note="Megatron-DeepSpeed (BLOOM, MT-NLG): Megatron kernels, DeepSpeed pipeline and ZeRO-1; fitted on two sources (BigScience, MT-NLG)",
        ),
        Stack(
            "pytorch-fsdp",
            other=1.8,
            selective_gemms=0.5,
            scale_casts=True,
            note="torchtitan: PyTorch FSDP2 eager, SDPA flash attention, Triton fused_rmsnorm (its Llama 2 13B "
            "preset); one source: Loom's factor",
        ),
        Stack(
            "composer-fsdp",
            other=1.8,
            microbatch_reduce=True,
            logit_bytes=4.0,
            note="MosaicML Composer + FSDP1, Triton flash attention; one source: Loom's factor",
        ),
        Stack(
            "other",
            other=1.8,
            note="a stack none of the published sources used: Loom's memory-bound factor, Megatron's "
            "selective recomputation, whole logits in B_a + 8 bytes",
        ),
    )
}


# the memory-bound factor of a compiled step (Workload.compile: train.compile, a published run's
# ``compile``): Inductor fuses each block's pointwise chain (norm, residual add, RoPE, SwiGLU, the loss's
# log-softmax) into one kernel, so each tensor is read and written once, the traffic the elementwise
# count states; a stack already below it (none today) keeps its own
COMPILED_OTHER = 1.0


def memory_bound_stack(name: str) -> str:
    """The :data:`STACKS` key whose ``other`` prices ``name``'s memory-bound work (``Stack.other_of``)."""
    return STACKS[name].other_of or name


# other names of the stacks above, as publications and users write them (lower case)
STACK_ALIASES: dict[str, str] = {
    "loom": "",
    "nemo": "megatron-core",
    "megatron-bridge": "megatron-core",
    "megatron-lm": "megatron-core",
    "megatron": "megatron-core",
    "torchtitan": "pytorch-fsdp",
    "fsdp2": "pytorch-fsdp",
    "llm-foundry": "composer-fsdp",
    "composer": "composer-fsdp",
}


def resolve_stack(name: str) -> tuple[str, bool]:
    """(the :data:`STACKS` key of ``name``: itself, its :data:`STACK_ALIASES` entry, else ``"other"``;
    whether it was known)."""
    key = name.strip().lower()
    if key in STACKS:
        return key, True
    if key in STACK_ALIASES:
        return STACK_ALIASES[key], True
    return "other", False
