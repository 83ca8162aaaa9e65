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
  backward: gathered, its gradient filling, the next unit prefetched, two earlier units' gradients
  being reduce-scattered, and without a pipeline a tied embedding/head unit gathered all through
  backward beside the head's gradient (``_zero3_transient``). ZeRO 1/2: autograd's gradients
  formed at once before they join their bucket (a tied table's: head's, embedding's, and at tp 1
  their sum); without ZeRO, mixed precision or a non-AdamW optimizer runs the same flat path over
  one rank (``flat_stage``).
  Gradients reduced in a wider dtype than they are kept (bf16 reduced in fp32, the default): a
  reduction in flight holds its cast copy and the shard it receives, R (1 + 1/N) bytes per element
  (``reduction_bytes``): ZeRO-3's units, ZeRO-1/2's table buckets (``reduction_moment``). Stages 2/3 with gradient accumulation (m > 1) hold full-size gradients
  between micro-batches beside their 1/N shard (reduced once, after the last, as FSDP's ``no_sync``; the
  pipeline's synchronous schedules too, not PipeDream/2BW, which reduce every micro-batch). ``offload`` moves O to host memory. Layer weights divide by t, experts
  by ep only (whole on every tp rank), or by ep·t and shared experts by t under ``Layout.expert_tp =
  "split"`` (the router whole); the vocabulary-parallel embedding and head by t; norms are replicated.
- activations of one layer for one micro-batch, the tensors its block saves for backward
  (pre-norm, RoPE, GQA, SwiGLU, no dropout; measured with saved-tensor hooks, storages counted
  once: tests/test_plan_activations.py)::

      each of the 2 norms: its input B_a T h (:mod:`loom.model.norms`, as fused norm kernels;
        Korthikanti's count) and its output x̂·w (the matmul input) B_a T h,
        1/rms 4 T (LayerNorm mean, 1/σ 8 T)                               -> / t only with sp
      q B_a T a d, k and v 2 B_a T k d                                   -> / t
      q/k norms (qk_norm): inputs B_a T (a + k) d (scope all under tp: in fp32 and x̂,
        (4 + B_a)), 1/rms 4 T per head (scope all: per rank)            -> / t
      attention output (wo input) B_a T a d                              -> / t (kept: selective)
      log-sum-exp 4 T a                                                  -> / t (gone: selective)
      scores: softmax output B_a a T s, only without flash attention     -> / t (gone: selective)
      SwiGLU w1 x, silu(w1 x), w3 x, their product: 4 B_a T f (GELU 2)    -> / t
      MoE instead (:func:`~loom.plan.cost.memory.moe_activation`, balanced routing): per token
        router 4 E + 12 k + 4, sort 16 k + B_a k, weighted rows B_a k h; per expert row
        (T k moe_load) its input and output 2 B_a h and SwiGLU 4 B_a f; 4 E offsets per layer;
        ep > 1: 8 k ids, the returned rows B_a k h, 8 per row received, 4 E / ep offsets
                                                                         -> / t only with sp
        split experts (:func:`~loom.plan.cost.memory.moe_saved`): f/t, the rows of the tp group's
        T tokens on every rank (under sp the gathered input B_a T h too)
      Megatron-Core's MoE layer instead (``Stack.moe_saves``,
        :func:`~loom.plan.cost.memory.megatron_moe_activation`): per token the router's scores 4 E and
        the permutation's row map 4 (2 E + 1); per row the first grouped GEMM's input s1 h, the fused
        GLU's input B_a u f, its weight 4 and the second GEMM's input s2 f (s1, s2: 1 byte under
        Transformer Engine's fp8, else B_a); no row's output, unless weighted at the combine
        (``Workload.moe_weighting = "output"``, Megatron-Core before 0.13: B_a k h per token)
      modules recomputed alone (``Workload.recompute_modules``): moe_act drops the second GEMM's
        input, layernorm the pre-MLP norm's output (:func:`~loom.plan.cost.memory.module_recompute_saved`)

  With B_a = 2, d = h/a, cp = 1 and RMSNorm this is s b h (c1 + c2 a s / h) with
  c1 = 12 + 4 k/a + 8 f/h + (4a + 8)/h and c2 = 2 without flash, 0 with flash/SDPA (the form of
  Korthikanti et al. 2022). Tensor parallel without sp divides all but the norms' 8 s b h + 8 s b
  by t; with sp all of it. Selective recomputation drops what the attention core alone saves
  (scores, lse; the output stays, as wo's input), where the stack's policy recomputes no GEMM
  (``Stack.selective_gemms`` g = 0: Loom, Megatron); an op-level policy recomputing g of the GEMMs
  (torchtitan, g = 0.5) keeps the block input B_a T h, the core's output B_a T a d and lse 4 T a,
  and (1 - g) of the GEMM outputs B_a T (a d + 2 k d + 2 h + 2 f) (/ t as above;
  :func:`~loom.plan.cost.memory.selective_saved`); full
  recomputation keeps only the block input B_a T h (/t with sp) per layer plus one layer's
  working set. GQA is counted at kv width (SDPA's ``enable_gqa``: k, v never repeated).
- times the layers of activations held at peak on stage i (in micro-batches x layers):
  GPipe m*L/p; 1F1B min(m, p-i)*L/p; ZB-H1 min(m, p)*L/p (deferred W keeps inputs alive on
  every stage); interleaved (Megatron's warm-up count)
  min(m v, 2(p-i-1) + (v-1)p + 1) * L/(p v), which for stage 0 is L (1 + (p-1)/(p v)), one
  chunk more under ``ep-overlap`` (Megatron-Core's combined 1F1B); the
  last stage adds its final norm, as a block's norm 2 B_a T h + 4 T, per micro-batch it holds.
- logits on the last stage: T V / t (B_a + 8) bytes (logits, fp32 copy, fp32 log-softmax), or the
  stack's ``logit_bytes`` per logit, or B_a under a fused in-place cross entropy
  (``Workload.fused_cross_entropy``); Loom's own stack without tp or a pipeline runs the head inside
  a chunked loss: one chunk of logits and the head's fp32 gradient sum
  (:func:`~loom.plan.cost.memory.logit_bytes`).
- optimizer step: its temporaries (the fp32 gradient copy under mixed precision) beyond what
  backward's transients (activations, logits, gathered units, gradients in flight) freed.
- overhead: the device's runtime constant (context, workspaces, comm buffers) plus
  FRAGMENTATION (10%) of the dynamic memory (activations, logits, gather buffers).

Time of one step:

- compute: each GEMM of a layer by :meth:`Machine.gemm` with M = T tokens: on a GPU from the
  datasheet, tile and wave quantization over its SMs plus a per-tile fixed cost (K0), against its
  HBM traffic (the roofline); on a CPU or with a calibrated rate, 2MKN / flops. Under fp8 / int8 a
  block Linear's GEMM has 1-byte operands at the 8-bit rate where it runs in 8 bits
  (``loom.memory.precision.runs_8bit``: with ``fp8_layers = auto`` only where float8 pays), else the
  activations' bytes at the bf16 rate (:func:`~loom.plan.cost.compute.linear_gemm`); an MoE's routed
  experts and the output head run 8-bit only on a stack that runs them so (``Stack.lowp_experts``,
  ``Stack.lowp_head``: Loom keeps both in bf16). Backward is r = 2x
  forward (the FLOP ratio; a calibration profile may measure r nearer 1 for small layers where
  per-op cost sets the time); a routed expert's input- and weight-gradient GEMMs on a datasheet GPU
  at their own shapes (:func:`~loom.plan.cost.compute.expert_backward`). An MoE layer's routing adds
  its memory-bound bytes at the stack's ``other``: the router's softmax and top-k, each routed copy's
  row permuted, the received rows regrouped by expert under ep, the probability-weighted combine,
  forward and backward (:func:`~loom.plan.cost.compute.moe_routing_bytes`). Attention core per kernel (:meth:`CostModel._attention_core`): a
  causal flash kernel runs half of the 4 T s h / t FLOPs (the PaLM/Megatron convention 12 L h s
  per token that the FLOP counts keep) at the device's flash share of peak, backward 2.5x those
  FLOPs; unfused (no flash) two batched GEMMs per head and 4 B a s^2 bytes of scores. Elementwise
  ops (norms, residuals, RoPE, SwiGLU/GeLU, loss) as bytes over HBM bandwidth, times the stack's
  ``other`` (:class:`Stack`: how many passes its kernels make, fitted on published runs). Full
  recomputation adds the layers' forward (x4/3 of layer FLOPs), selective the attention core's
  (plus ``Stack.selective_gemms`` = g of the GEMMs, the share whose outputs memory does not keep).
  Pipeline stages hold L / p blocks, or with p not
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
  (split experts, ``Layout.expert_tp``: no sp 4 all-reduces as above, no MoE gradient summed; sp the
  attention's 3 all-gathers + 2 reduce-scatters and the experts' 2 + 2 of S, plus the routing weights'
  gradient all-reduced, T k B_a; or, where the stack gathers the routed rows,
  ``Stack.etp_gathers_rows``, the experts' 2 + 2 of k·S: :func:`~loom.plan.cost.comm.tp_calls`)
  (what a call costs in Loom's layers beyond the collective; on a CPU the twin below charges
  ``call_overhead_cpu["tp"]``); not overlapped, or with
  ``Layout.tp_overlap`` cut in t chunks pipelined with the layer's GEMMs, what hides still costing
  1 - ``comm_overlap`` as data parallel's below (:func:`~loom.plan.cost.dp.contended`):
  comm / t + max(0, rest - G) + (1 - comm_overlap) min(rest, G) per layer, rest = comm (t-1)/t,
  G the layer's GEMMs fwd+bwd (and recomputed).
- context parallel (:mod:`loom.parallel.context.parallelize`, :meth:`CostModel._cp_layer_time`), by
  ``Layout.cp_mode``: allgather all-gathers K and V over cp before the core (again under full
  recomputation) and reduce-scatters dK, dV, not overlapped, and saves the other ranks' keys and
  values (2 B T (cp-1) kd / t more activation bytes per layer); ring sends K/V blocks (and fp32
  dK/dV backward) point to point, each hop overlapped with one block's attention, and saves only
  the local ones; alltoall exchanges q, k, v and the output over cp, not overlapped, and saves its
  repeated kv heads (f = cp / gcd(k, cp)) and its own output (B T h / t) more. Under ring and
  allgather a windowed layer within one chunk (w - 1 <= s / 2cp, :func:`~loom.plan.cost.comm.halo_share`)
  exchanges only its halo rows with its neighbours instead, 2 H kd B_a and 2 H kd 4 per sequence,
  not overlapped, and keeps them.
- expert parallel: 4 all-to-alls per MoE layer (dispatch + combine, fwd and bwd; 6 with full
  recomputation) of T_r top_k h B_a bytes (T_r the tokens a rank routes: T/t with sp, T without;
  split experts T, the tp group's, unless the stack gathers the routed rows), (ep-1)/ep of it leaving the device, and the small
  all-to-all of per-expert counts before each dispatch (latency only); each of these calls also
  ``call_overhead["ep"]`` (measured through Loom's expert-parallel layer: the counts' host round
  trip, the splits, the waits of synchronous all-to-alls), its CPU ``call_overhead_cpu["ep"]``.
  ``Layout.ep_overlap`` (Megatron-Core's --overlap-moe-expert-parallel-comm): the layer's all-to-alls
  A beside another micro-batch's compute of the layer C, max(0, A - C) + (1 - comm_overlap) min(A, C).
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


Modules (each term a plain function of the model, :class:`CostModel` binding them as methods):

layout    Layout, Workload, Estimate, PlanError        params   ParamCounts
stacks    Stack, STACKS (software a prediction assumes)  pipeline blocks per stage, bubble, layers in flight
base      CostBase: inputs, machine, shapes per layout   check    check(), refused() (rules: loom.rules)
memory    states, activations, logits, overhead        comm     tp / cp / ep collectives, calls per step
compute   one micro-batch: GEMMs, attention, recompute  dp       data parallel, ZeRO, step sync, overlap
step      the step: bubble, p2p, optimizer, cpu bound   model    CostModel, estimate()

Inside this package modules import each other directly, never this ``__init__``.
"""

from loom.plan.cost.check import tp_reason
from loom.plan.cost.dp import exposed
from loom.plan.cost.layout import RECOMPUTE, SCHEDULES, Estimate, Layout, PlanError, Workload
from loom.plan.cost.memory import head_in_loss
from loom.plan.cost.model import CostModel, estimate
from loom.plan.cost.params import ParamCounts, param_count
from loom.plan.cost.pipeline import bubble_fraction, default_split, inflight_layers, split_layout
from loom.plan.cost.stacks import STACKS, Stack

__all__ = [
    "RECOMPUTE",
    "SCHEDULES",
    "STACKS",
    "CostModel",
    "Estimate",
    "Layout",
    "ParamCounts",
    "PlanError",
    "Stack",
    "Workload",
    "bubble_fraction",
    "default_split",
    "estimate",
    "exposed",
    "head_in_loss",
    "inflight_layers",
    "param_count",
    "split_layout",
    "tp_reason",
]
