"""The planner's per-layer activation bytes (:func:`loom.plan.cost.memory.activation_terms`) equal
what one block saves for backward, measured with saved-tensor hooks (each storage once, parameters
and buffers left out: :class:`~loom.memory.activations.SavedTensorMeter`), for tp1, tp2 with
sequence parallelism and cp2 ring, in fp32 and bf16, GQA and the GPT-2 / Qwen3 block variants.

Mixture-of-experts blocks (:mod:`loom.model.moe`, ep2: :mod:`loom.parallel.expert.parallelize`)
route as ``loom plan verify`` does (:func:`loom.train.verify.balanced_routing`: N·k/E rows per
expert); that routing runs the real router first and drops its choice, so their bytes are those the
block still holds when its forward returns (:class:`~loom.memory.compress.SavedActivations`' live
count: each storage once, parameters and buffers left out). The final norm's bytes on the last
stage: those first saved inside it, and its output where the head saves it."""

from __future__ import annotations

import pytest
import torch

from loom.plan.cost import CostModel, Layout, Workload
from loom.plan.hardware import ClusterSpec
from tests.dist import get_mesh
from tests.helpers import tiny_model

SEQ, BATCH = 32, 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _measured(precision: str, tp: int, sp: bool, cp: int, recompute: str, model_kw: dict) -> int:
    """Bytes layer 0 saves for one micro-batch of BATCH x SEQ / cp tokens on this rank."""
    from loom.memory.activations import measure_layer_bytes
    from loom.memory.recompute import apply_recompute
    from loom.model.llama import build_model

    cfg = tiny_model(max_seq_len=SEQ, **model_kw)
    model = build_model(cfg, 0).to(DTYPES[precision])
    if tp > 1:
        from loom.parallel.tensor.parallelize import apply_tensor_parallel

        apply_tensor_parallel(model, get_mesh(tp=tp), sp=sp)
    if cp > 1:
        from loom.parallel.context.parallelize import apply_context_parallel

        apply_context_parallel(model, get_mesh(cp=cp), mode="ring", seq_len=SEQ)
    if recompute != "none":
        apply_recompute(model, recompute)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ // cp), generator=torch.Generator().manual_seed(0))
    return measure_layer_bytes(model, tokens)[0]


def _predicted(precision: str, tp: int, sp: bool, cp: int, recompute: str, model_kw: dict) -> float:
    cm = CostModel(
        tiny_model(max_seq_len=SEQ, **model_kw),
        Workload(8, SEQ, precision),
        ClusterSpec.single_node("h100-sxm", 8, 1),
    )
    full, selective, _ = cm.layer_activation(Layout(tp=tp, sp=sp, cp=cp, cp_mode="ring", micro_batch=BATCH))
    return selective if recompute == "selective" else full


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "recompute,model_kw",
    [
        ("none", {}),  # GQA: 4 query heads on 2 kv heads
        ("selective", {}),
        ("none", dict(norm="layernorm", mlp="gelu", bias=True, n_kv_heads=4)),  # GPT-2's block
        ("none", dict(qk_norm=True)),  # Qwen3's per-head q/k norms
        ("none", dict(qk_norm=True, qk_norm_scope="all", attn_head_dim=16)),  # OLMo-2's; a·d != h
        # Gemma 2's: four norms scaling by 1 + w, the gated GELU, a·d != h (its soft-capped attention
        # core runs flex on a GPU, a matrix path here: the planner prices the GPU's)
        (
            "none",
            dict(
                norm_offset=True,
                embed_scale=True,
                mlp="geglu_tanh",
                norm_placement="sandwich",
                attn_head_dim=16,
            ),
        ),
    ],
)
def test_one_block_saves_the_planners_bytes(precision, recompute, model_kw):
    args = (precision, 1, False, 1, recompute, model_kw)
    assert _measured(*args) == _predicted(*args)


GEMMA2_BLOCK = dict(norm_offset=True, mlp="geglu_tanh", norm_placement="sandwich")


@pytest.mark.parametrize(
    "tp,sp,cp,precision,model_kw",
    [
        (2, True, 1, "bf16", {}),
        (2, False, 1, "fp32", {}),
        (1, False, 2, "bf16", {}),
        (2, True, 1, "bf16", GEMMA2_BLOCK),
    ],
    ids=["tp2 sp", "tp2", "cp2", "tp2 sp gemma2"],
)
def test_one_block_saves_the_planners_bytes_across_ranks(pools, tp, sp, cp, precision, model_kw):
    """tp2 with sp (norms on T/t tokens; Gemma 2's four), tp2 without (norms replicated), cp2 ring
    (local k, v)."""
    args = (precision, tp, sp, cp, "none", model_kw)
    predicted = _predicted(*args)
    assert pools(max(tp, cp)).run(_measured, *args) == [predicted] * max(tp, cp)


def _moe_held(
    precision: str,
    model_kw: dict,
    moe_kw: dict,
    tp: int = 1,
    sp: bool = False,
    ep: int = 1,
    padded: bool = False,
    expert_tp: str = "replicate",
) -> int:
    """Bytes MoE block 0 holds for backward after its forward of BATCH x SEQ tokens, routed as
    ``plan verify`` routes (balanced); ``padded``: the experts' padded batched matmul, as where
    ``torch._grouped_mm`` is missing; ``expert_tp``: experts whole on every tp rank, or split."""
    import loom.model.moe

    real = loom.model.moe.grouped_mm_available
    if padded:
        loom.model.moe.grouped_mm_available = lambda x: False
    try:
        return _moe_held_here(precision, model_kw, moe_kw, tp, sp, ep, expert_tp)
    finally:
        loom.model.moe.grouped_mm_available = real


def _moe_held_here(
    precision: str, model_kw: dict, moe_kw: dict, tp: int, sp: bool, ep: int, expert_tp: str
) -> int:
    from loom.config import MoEConfig
    from loom.memory.compress import SavedActivations
    from loom.model.llama import build_model
    from loom.train.verify import balanced_routing

    cfg = tiny_model(max_seq_len=SEQ, **model_kw)
    model = build_model(cfg, 0, moe=MoEConfig(**moe_kw)).to(DTYPES[precision])
    mesh = get_mesh(tp=tp, dp_replicate=ep, ep=ep)
    if tp > 1:
        from loom.parallel.tensor.parallelize import apply_tensor_parallel

        apply_tensor_parallel(model, mesh, sp=sp, expert_tp=expert_tp)
    if ep > 1:
        from loom.parallel.expert.parallelize import apply_expert_parallel

        apply_expert_parallel(model, mesh)
    saved, live = SavedActivations(model), []
    block = model.layers[0]
    block.register_forward_pre_hook(lambda *_: live.append(saved.live))
    block.register_forward_hook(lambda *_: live.append(saved.live))
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with saved, balanced_routing():
        out = model(tokens)
    out.float().sum().backward()  # frees the graph (dropped unrun, it stayed alive with its all-to-all group)
    return live[1] - live[0]


def _moe_predicted(
    precision: str,
    model_kw: dict,
    moe_kw: dict,
    tp: int = 1,
    sp: bool = False,
    ep: int = 1,
    device: str = "cpu",
    expert_tp: str = "replicate",
) -> float:
    """The planner's bytes for the block on ``device`` (the CPU: torch._grouped_mm in fp32 and bf16)."""
    import dataclasses

    from loom.config import LoomConfig, MoEConfig
    from loom.plan.report import workload_of

    cfg = LoomConfig(model=tiny_model(max_seq_len=SEQ, **model_kw), moe=MoEConfig(**moe_kw))
    work = dataclasses.replace(workload_of(cfg), global_batch=8, seq_len=SEQ, precision=precision)
    cm = CostModel(cfg.model, work, ClusterSpec.single_node(device, 8, 1))
    return cm.layer_activation(Layout(tp=tp, sp=sp, ep=ep, micro_batch=BATCH, expert_tp=expert_tp))[0]


MIXTRAL = dict(n_experts=8, top_k=2)  # Mixtral's routing: softmax over 8, top-2, renormalized


@pytest.mark.parametrize(
    "precision,model_kw,moe_kw",
    [
        ("fp32", dict(n_experts=4, top_k=2), {}),
        ("bf16", MIXTRAL, {}),
        ("bf16", dict(n_experts=8, top_k=1), {}),  # Switch's top-1
        ("bf16", dict(n_experts=4, top_k=2), dict(score="sigmoid")),  # DeepSeek-V3's scores: same bytes
        ("bf16", MIXTRAL, dict(capacity_factor=1.0)),  # the keep mask, k bytes per token
        ("bf16", MIXTRAL, dict(compute="loop")),  # per expert: no group offsets (-4E)
        ("bf16", MIXTRAL, dict(n_shared_experts=2)),  # their SwiGLU, 4·B_a·S·f per token
        ("bf16", MIXTRAL, dict(z_loss_coef=1e-3)),  # fp32 logits and log-sum-exp, 4E + 4 per token
        ("bf16", MIXTRAL, dict(aux_loss_coef=1e-2)),  # f_e, 4E
        ("fp32", dict(n_experts=4, top_k=2), dict(aux_loss_coef=1e-2, score="sigmoid")),  # + scores' sums
    ],
)
def test_a_moe_block_saves_the_planners_bytes(precision, model_kw, moe_kw):
    """Router (fp32 scores, ids, renormalized weights), sorted assignments, grouped SwiGLU rows,
    weighted rows, and the [moe] options' own (shared experts, z-loss, aux loss, the loop's missing
    offsets; the planner reads them through workload_of): :func:`~loom.plan.cost.memory.activation_terms`,
    term by term, at ep1."""
    assert _moe_held(precision, model_kw, moe_kw) == _moe_predicted(precision, model_kw, moe_kw)


@pytest.mark.parametrize(
    "precision,model_kw,device",
    [("bf16", MIXTRAL, "a100-80g"), ("fp32", dict(n_experts=4, top_k=2), "h100-sxm")],
)
def test_a_moe_block_on_a_device_without_grouped_mm_saves_the_padded_batch(precision, model_kw, device):
    """No torch._grouped_mm for the dtype there (A100; fp32 on an H100): the (E, T, h) zero-padded
    batch and its SwiGLU, each row's output and (expert, slot) index; no sorted input, no offsets."""
    predicted = _moe_predicted(precision, model_kw, {}, device=device)
    assert predicted > _moe_predicted(precision, model_kw, {}) + 4 * BATCH * SEQ * model_kw["n_experts"]
    assert _moe_held(precision, model_kw, {}, padded=True) == predicted


@pytest.mark.parametrize(
    "tp,ep,precision,model_kw,device",
    [
        (1, 2, "fp32", dict(n_experts=4, top_k=2), "cpu"),
        (1, 2, "bf16", MIXTRAL, "cpu"),
        (2, 1, "bf16", MIXTRAL, "cpu"),
        (1, 2, "bf16", MIXTRAL, "a100-80g"),  # padded: each local expert's batch as wide as its rows
        (2, 1, "bf16", MIXTRAL | {"expert_tp": "split"}, "cpu"),
        (2, 1, "fp32", dict(n_experts=4, top_k=2, expert_tp="split", sp=False), "cpu"),
        (2, 2, "bf16", MIXTRAL | {"expert_tp": "split"}, "cpu"),
        (2, 2, "fp32", dict(n_experts=4, top_k=2, expert_tp="split", sp=False), "cpu"),
    ],
)
def test_a_moe_block_saves_the_planners_bytes_across_ranks(pools, tp, ep, precision, model_kw, device):
    """ep2 (the partition's order and ids, the returned rows, each received row's place and its
    expert output; E/ep group offsets), tp2 with sp (experts whole, on T/t tokens; split: the gathered
    sequence's T tokens at f/t, with and without sp; with ep2 the rows returned for 1/t of them), and
    ep2 on a device without torch._grouped_mm (the padded batch of E/ep experts x the widest one's rows)."""
    model_kw = dict(model_kw)
    expert_tp, sp = model_kw.pop("expert_tp", "replicate"), model_kw.pop("sp", tp > 1)
    args = (precision, model_kw, {}, tp, sp, ep)
    predicted = _moe_predicted(*args, device=device, expert_tp=expert_tp)
    assert pools(tp * ep).run(_moe_held, *args, device != "cpu", expert_tp) == [predicted] * (tp * ep)


def _final_norm_held(precision: str, model_kw: dict) -> int:
    """Bytes the final norm saves for backward in one forward of BATCH x SEQ tokens: those first
    saved inside it, and its output (the head's input)."""
    from loom.memory.activations import SavedTensorMeter, _storage_key
    from loom.model.llama import build_model

    cfg = tiny_model(max_seq_len=SEQ, **model_kw)
    model = build_model(cfg, 0).to(DTYPES[precision])
    meter, outputs = SavedTensorMeter(model, layers=[model.norm]), []
    model.norm.register_forward_hook(lambda _m, _a, out: outputs.append(out))
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with meter:
        logits = model(tokens)
    del logits
    (out,) = outputs
    assert _storage_key(out) in meter.seen, "the head saves the final norm's output"
    return meter.per_layer[0] + out.untyped_storage().nbytes()


@pytest.mark.parametrize(
    "precision,model_kw",
    [("fp32", {}), ("bf16", {}), ("bf16", dict(norm="layernorm", mlp="gelu", bias=True, n_kv_heads=4))],
)
def test_the_final_norm_is_in_the_last_stages_activations(precision, model_kw):
    """2·B_a·h + 4 bytes per token (input, output, 1/rms; LayerNorm 8: mean, 1/σ),
    beside the L layers' bytes in :func:`~loom.plan.cost.memory.stage_memory`."""
    cfg = tiny_model(max_seq_len=SEQ, **model_kw)
    cm = CostModel(cfg, Workload(8, SEQ, precision), ClusterSpec.single_node("h100-sxm", 8, 1))
    lay = Layout(micro_batch=BATCH)
    final = cm.stage_memory(lay, 0)["activations"] - cfg.n_layers * cm.layer_activation(lay)[0]
    assert _final_norm_held(precision, model_kw) == final
