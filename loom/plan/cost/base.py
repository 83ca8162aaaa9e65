"""What every term of the cost model reads (:class:`CostBase`): model, workload, cluster, the
machine's throughputs, and the model's shapes on a layout: blocks per stage, parameters per device,
ZeRO-3's units. The terms themselves are plain functions of a ``CostBase`` in the sibling modules."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from functools import lru_cache, partial
from typing import Any

from loom.config import ModelConfig
from loom.model.llama import flops_per_token
from loom.plan.cost.layout import MOE_WEIGHTINGS, Layout, PlanError, Workload
from loom.plan.cost.params import ParamCounts, qk_norm_held, qk_norm_params
from loom.plan.cost.pipeline import default_split
from loom.plan.cost.stacks import COMPILED_OTHER, STACKS, memory_bound_stack
from loom.plan.hardware import ClusterSpec, HardwareError, Machine, Profile, auto_precision
from loom.plan.opcount import op_counts
from loom.rules import ModelFacts


class CostBase:
    """Inputs and shapes of one model, workload and cluster; :class:`~loom.plan.cost.model.CostModel`
    adds the terms."""

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
        if model.positions == "learned" and train.seq_len > model.max_seq_len:  # loom train refuses it too
            raise PlanError(
                f"seq_len: {train.seq_len} exceeds model.max_seq_len={model.max_seq_len} (learned "
                "positions hold one embedding per position; RoPE models have no such bound)"
            )
        if train.fp8_layers not in ("auto", "all"):
            raise PlanError(f"train.fp8_layers: must be auto or all, got {train.fp8_layers!r}")
        if train.reduce_dtype not in ("fp32", "bf16", "fp16"):
            raise PlanError(f"train.reduce_dtype: must be fp32, bf16 or fp16, got {train.reduce_dtype!r}")
        if n_experts < 1 or not 1 <= top_k <= n_experts:
            raise PlanError(f"n_experts/top_k: need 1 <= top_k <= n_experts, got {top_k}/{n_experts}")
        if train.moe_weighting not in MOE_WEIGHTINGS:
            raise PlanError(
                f"train.moe_weighting: must be one of {', '.join(MOE_WEIGHTINGS)}, got {train.moe_weighting!r}"
            )
        if train.moe_imbalance <= 0:  # moe.imbalance unset: a calibration run's measurement, else balanced
            measured = profile.moe_imbalance if profile is not None else 0.0
            train = dataclasses.replace(train, moe_imbalance=measured if measured >= 1 else 1.0)
        if train.precision == "auto":  # train.precision = auto, as the trainer resolves it on the device
            train = dataclasses.replace(train, precision=auto_precision(cluster.device))
        self.model, self.train, self.cluster = model, train, cluster
        self.n_experts, self.top_k = n_experts, top_k
        self.moe = n_experts > 1
        try:
            self.machine = Machine(cluster, train.precision, profile)
        except HardwareError as e:
            raise PlanError(f"train.precision: {str(e).removeprefix('precision: ')}") from None
        if stack not in STACKS:
            names = ", ".join(repr(n) for n in STACKS)
            raise PlanError(f"stack: must be one of {names} ('' is Loom), got {stack!r}")
        self.stack = STACKS[stack]
        if train.moe_weighting != "output" and self.stack.moe_saves != "megatron":
            raise PlanError(  # Loom's MoE (and the stacks counted as it) weights each row's output
                f"train.moe_weighting: {train.moe_weighting} is Megatron-Core's weighted GLU; stack {stack!r} "
                "weights each expert row's output (output)"
            )
        unknown = [m for m in train.recompute_modules if m not in self.stack.recompute_modules]
        if unknown:
            offered = ", ".join(self.stack.recompute_modules) or "none"
            raise PlanError(
                f"train.recompute_modules: {', '.join(map(repr, unknown))} not among stack {stack!r}'s "
                f"(it offers: {offered})"
            )
        if train.fused_cross_entropy and stack == "":
            raise PlanError(
                "train.fused_cross_entropy: Loom's loss is its own (a chunked head and loss where it can: "
                "memory.logit_bytes); the in-place fused cross entropy is another stack's"
            )
        factor = STACKS[memory_bound_stack(stack)].other  # its memory-bound factor (Stack.other_of)
        self.other = min(factor, COMPILED_OTHER) if train.compile else factor
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
        self.params = ParamCounts.of(model, n_experts, top_k, train.moe_shared)
        self.facts = ModelFacts.of(
            model,
            n_experts=n_experts,
            moe_capacity=train.capacity_factor > 0,
            moe_router_losses=train.moe_router_losses,
        )  # what the layout rules read
        self.ffn = model.resolved_ffn_dim()
        self.kd = model.n_kv_heads * model.head_dim
        self.model_flops = flops_per_token(  # the trainer's MFU rule: top_k of the E experts run
            model, train.seq_len, self.params.matmul, self.params.experts, n_experts, top_k
        ) * (train.global_batch * train.seq_len)
        self.act_bytes = train.act_bytes
        self.W, self.G, self.O = train.state_bytes()
        self.R = {"fp32": 4, "bf16": 2, "fp16": 2}[train.reduce_dtype]
        # ranks sharing CPU cores: the same model on the collectives' CPU seconds sums each rank's CPU demand
        twin = profile.cpu_twin() if profile is not None else None
        self.cpu_model: CostBase | None = (
            type(self)(model, train, cluster, twin, n_experts, top_k, stack) if twin is not None else None
        )
        self._memo: dict[Callable[..., Any], Callable[..., Any]] = {}  # memo()'s caches

    def memo(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn(self, *args)`` memoised for this model: the search evaluates many layouts sharing
        degrees or micro-batch (states, activations, micro-batch times, data-parallel volume)."""
        cached = self._memo.get(fn)
        if cached is None:
            cached = self._memo[fn] = lru_cache(maxsize=None)(partial(fn, self))
        return cached

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

    def norms_on(self, tp: int) -> float:
        """Norm weights one tp rank holds per layer (q/k norms over whole projections cut with the heads)."""
        m = self.model
        return self.params.norms - qk_norm_params(m) + qk_norm_held(m, tp)

    def _stage_params(self, lay: Layout, first: bool, last: bool) -> tuple[float, float]:
        """(dense, expert) parameters one device of this stage holds, before ZeRO sharding."""
        return self._params_on(lay.tp, lay.pp, lay.ep, first, last, lay.split, lay.expert_tp)

    def expert_cut(self, tp: int, expert_tp: str = "replicate") -> int:
        """The tp ranks one expert's weights are cut over: tp under ``expert_tp = "split"`` (an MoE's
        w1/w3 by columns, w2 by rows, shared experts alike; the router whole), else 1 (whole on every
        tp rank)."""
        return tp if expert_tp == "split" and self.moe else 1

    def expert_rows_gathered(self, tp: int, sp: bool, expert_tp: str) -> bool:
        """Split experts under sp on a stack that gathers the routed rows over tp after the ep
        all-to-all (``Stack.etp_gathers_rows``: Megatron-Core's alltoall dispatcher, each rank routing
        its own sequence shard), not the sequence before the router (Loom's)."""
        return self.expert_cut(tp, expert_tp) > 1 and sp and self.stack.etp_gathers_rows

    def rows_pooled(self, tp: int, expert_tp: str, ep: int) -> bool:
        """Loom's split experts under ep > 1 (:mod:`loom.parallel.expert.tp_rows`): each tp rank sends
        1/tp of the group's tokens through the all-to-all and the received rows are pooled over tp."""
        return self.expert_cut(tp, expert_tp) > 1 and ep > 1 and not self.stack.etp_gathers_rows

    def moe_tokens(self, T: float, tp: int, sp: bool, expert_tp: str) -> tuple[float, float]:
        """(tokens a rank routes and dispatches, tokens whose expert rows it computes) of a micro-batch
        of T = b·s/cp tokens per tp group: experts whole on every tp rank, both T/t with sp (its
        sequence shard), else T; split experts compute the tp group's T tokens' rows (at f/t), routed
        after the sequence is gathered (T), or, gathering the routed rows
        (:meth:`expert_rows_gathered`), from each rank's own shard (T/t)."""
        shard = T / tp if sp else T
        if self.expert_cut(tp, expert_tp) == 1:
            return shard, shard
        return (shard if self.expert_rows_gathered(tp, sp, expert_tp) else T), T

    def bucket_bytes(self, ranks: int) -> float:
        """Bytes of one data-parallel gradient bucket in a reduction over ``ranks`` (dp x cp): the
        stack's rule, max(floor, per-rank x ranks) parameters of R bytes (Megatron-Core: 40M, 1M),
        else the workload's ``bucket_bytes`` (``parallel.bucket_mb``)."""
        floor, per_rank = self.stack.bucket_params
        if floor <= 0 and per_rank <= 0:
            return self.train.bucket_bytes
        return max(floor, per_rank * ranks) * self.R

    def expert_group(self, ranks: int, ep: int, tp: int) -> int:
        """Ranks sharing each expert among ``ranks`` data-parallel ones (the experts' gradient and ZeRO
        group): ranks / ep, or ranks x tp / ep under :attr:`Workload.expert_folding` (a tp group's ranks
        hold different experts there; in Loom's layouts the same ones, whole, or split over tp, each
        slice reduced over the same ranks / ep)."""
        return max(1, ranks * (tp if self.train.expert_folding else 1) // ep)

    def buckets(self, nbytes: float, ranks: int) -> int:
        """Reduce calls for ``nbytes`` of gradients over ``ranks``: ceil(nbytes / :meth:`bucket_bytes`), at least 1."""
        return max(1, -(-int(nbytes) // int(self.bucket_bytes(ranks))))

    def _params_on(
        self,
        t: int,
        pp: int,
        ep: int,
        first: bool,
        last: bool,
        split: tuple[int, ...] = (),
        expert_tp: str = "replicate",
    ) -> tuple[float, float]:
        """(dense, expert) parameters one device of a stage holds: routed experts E/ep per rank, whole
        on every tp rank or split over it (:meth:`expert_cut`), shared experts alike; the router whole."""
        pc = self.params
        layers = self.stage_layers(pp, first, last, split)
        cut = self.expert_cut(t, expert_tp)
        dense = layers * (
            self._attn_params(t)
            + self.norms_on(t)
            + pc.router
            + pc.shared / cut
            + (0 if self.moe else pc.mlp_on(t))
        )
        expert = layers * pc.mlp / (ep * cut) if self.moe else 0.0
        if first:
            dense += pc.embed / t + pc.positions
        if last:
            dense += pc.final_norm
            if pc.head or pp > 1:  # untied head, or a tied copy on the last stage
                dense += self.model.vocab_size * self.model.dim / t
        return dense, expert

    def _kv_repeat(self, tp: int, cp: int) -> int:
        """All-to-all cp: key/value heads per tp rank repeated by cp / gcd(k, cp) (loom.parallel.context.alltoall)."""
        k = max(1, self.model.n_kv_heads // tp)
        return cp // math.gcd(k, cp)

    def _stages(self, pp: int) -> list[tuple[str, bool, bool, int]]:
        if pp == 1:
            return [("only", True, True, 0)]
        middle = [("middle", False, False, 1)] if pp > 2 else []
        return [("first", True, False, 0), *middle, ("last", False, True, pp - 1)]

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

    def zero3_unit_sizes(
        self, tp: int, pp: int, ep: int, first: bool, last: bool, expert_tp: str = "replicate"
    ) -> list[tuple[float, float, float]]:
        """ZeRO-3's units on a stage, a block's first: (elements, gradients autograd forms at once,
        gradients held beyond them). A block forms its widest matrix's gradient alone (wq/wo, w1/w2/w3,
        a stacked expert weight of E/ep experts), except that under tp > 1 one column-parallel
        function forms q, k, v's together, and SwiGLU's w1 and w3's ((a d + 2 k d)·h/t, 2 f h/t).
        A tied embedding and head without a pipeline hold beyond the embedding's gradient the head's
        and, at tp 1, their sum (the linear's weight gradient is a transposed view, which autograd
        cannot add into: a third table); under tp > 1 the head's column-parallel function forms its
        gradient contiguous and autograd adds the embedding's into it (measured: two tables). Split
        experts (:meth:`expert_cut`): each stacked weight, shared ones too, 1/t of its size."""
        pc, m, t = self.params, self.model, tp
        cut = self.expert_cut(tp, expert_tp)
        layer = (
            self._attn_params(t)
            + self.norms_on(t)
            + pc.router
            + pc.shared / cut
            + (pc.mlp / (ep * cut) if self.moe else pc.mlp_on(t))
        )
        experts = self.n_experts / ep if self.moe else 1
        qd = m.n_heads * m.head_dim
        attn = (qd / t + 2 * self.kv_width(t)) * m.dim if t > 1 else qd * m.dim  # q, k, v | wq, wo
        fused = 2 if t > 1 and m.gated_mlp and not self.moe else 1  # w1, w3 together
        widest = max(attn, self.ffn * m.dim * (experts / cut if self.moe else fused / t), pc.shared / 3 / cut)
        table = m.vocab_size * m.dim / t
        units = [(layer, widest, 0.0)]
        if pp == 1 and not pc.head:
            units.append((table + pc.final_norm, table, (2 if t == 1 else 1) * table))
        else:
            units += [(table, table, 0.0)] if first else []
            units += [(table + pc.final_norm, table, 0.0)] if last and (pc.head or pp > 1) else []
        return units
