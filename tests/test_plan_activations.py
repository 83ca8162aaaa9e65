"""The planner's per-layer activation bytes (:func:`loom.plan.cost.memory.activation_terms`) equal
what one block saves for backward, measured with saved-tensor hooks (each storage once, parameters
and buffers left out: :class:`~loom.memory.activations.SavedTensorMeter`), for tp1, tp2 with
sequence parallelism and cp2 ring, in fp32 and bf16, GQA and the GPT-2 / Qwen3 block variants."""

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
    ],
)
def test_one_block_saves_the_planners_bytes(precision, recompute, model_kw):
    args = (precision, 1, False, 1, recompute, model_kw)
    assert _measured(*args) == _predicted(*args)


@pytest.mark.parametrize(
    "tp,sp,cp,precision", [(2, True, 1, "bf16"), (2, False, 1, "fp32"), (1, False, 2, "bf16")]
)
def test_one_block_saves_the_planners_bytes_across_ranks(pools, tp, sp, cp, precision):
    """tp2 with sp (norms on T/t tokens), tp2 without (norms replicated), cp2 ring (local k, v)."""
    args = (precision, tp, sp, cp, "none", {})
    predicted = _predicted(*args)
    assert pools(max(tp, cp)).run(_measured, *args) == [predicted] * max(tp, cp)
