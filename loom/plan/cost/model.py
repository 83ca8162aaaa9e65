"""The cost model (:class:`CostModel`): its inputs and shapes from :class:`~loom.plan.cost.base.CostBase`,
each term a plain function of the model in the module of its concern, bound here as a method."""

from __future__ import annotations

from loom.config import ModelConfig
from loom.plan.cost import check as validity
from loom.plan.cost import comm, compute, dp, step
from loom.plan.cost import memory as mem
from loom.plan.cost.base import CostBase
from loom.plan.cost.layout import Estimate, Layout, Workload
from loom.plan.hardware import ClusterSpec, Profile


class CostModel(CostBase):
    """Memory and time of layouts for one model, workload and cluster (formulas: :mod:`loom.plan.cost`)."""

    # validity
    check = validity.check
    refused = validity.refused
    # memory
    state_memory = mem.state_memory
    _adapters_on = mem.adapters_on
    _lora_state = mem.lora_state
    _state_memory = mem.state_terms
    _zero3_transient = mem.zero3_transient
    _factored_bytes = mem.factored_bytes
    step_workspace = mem.step_workspace
    layer_activation = mem.layer_activation
    _layer_activation = mem.activation_terms
    peak_states = mem.peak_states
    memory = mem.peak_memory
    stage_memory = mem.stage_memory
    # tensor, context and expert parallel communication; the step's collective calls
    tp_calls = comm.tp_calls
    tp_partial_params = comm.tp_partial_params
    tp_payload = comm.tp_payload
    collective_calls = comm.collective_calls
    _cp_layer_time = comm.cp_layer_time
    # compute of a micro-batch
    _attention_core = compute.attention_core
    _microbatch_times = compute.microbatch_times
    # data parallel, ZeRO and the step's synchronisation
    _dp_time = dp.dp_time
    _sync_time = dp.sync_time
    _dp_comm = dp.dp_comm
    _zero3_gathers = dp.zero3_gathers
    zero3_stage_gathers = dp.zero3_stage_gathers
    _grad_all_reduce = dp.grad_all_reduce
    # the step
    estimate = step.estimate_layout
    timed = step.timed
    cpu_demand = step.cpu_demand

    def _dp_volume(self, *key: object) -> float:
        """:meth:`_dp_comm`, memoised."""
        return self.memo(dp.dp_comm)(*key)


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
