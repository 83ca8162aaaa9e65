"""What Megatron-Core keeps per GPU for an MoE run, each term against a hand computation: its MoE
layer's saved set (``Stack.moe_saves``, ``Workload.moe_weighting``), the fused cross entropy's logits,
single-module recomputation (``Workload.recompute_modules``) and ep-overlap's extra chunk in flight;
and the fine-grained MoE rows that ran in 80 GiB predicted to fit there."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from loom.config import ModelConfig
from loom.plan.cost import CostModel, Layout, PlanError, Workload, inflight_layers
from loom.plan.cost.compute import microbatch_times
from loom.plan.cost.memory import (
    activation_terms,
    layer_saved,
    logit_bytes,
    megatron_moe_activation,
    moe_activation,
    stage_memory,
)
from loom.plan.hardware import ClusterSpec
from loom.plan.published import compare_published, format_published, load_file

H100 = ClusterSpec.single_node("h100-sxm", 8)
# h 64, f 32, E 8, k 2, SwiGLU (u = 2)
MOE = ModelConfig(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=32, n_experts=8, top_k=2, vocab_size=256
)
T = 16  # one micro-batch of one sequence


def _cm(stack: str = "megatron-core", **work: object) -> CostModel:
    return CostModel(MOE, Workload(8, T, **work), H100, stack=stack)  # type: ignore[arg-type]


def test_megatron_moe_layer_keeps_rows_inputs_glu_input_and_a_weight_by_hand():
    """T = 16 tokens, E = 8, k = 2, h = 64, f = 32, B_a = 2: per token the router's fp32 scores 4·8 and
    the permutation's row map 4·(2·8 + 1), 100; per row the first GEMM's input s1·64, the GLU's input
    2·2·32 = 128, the weight 4, the second GEMM's input s2·32. bf16 (s = 2): 16·(100 + 2·324) = 11,968;
    weighted at the output (Megatron-Core < 0.13) each row's output too, 16·2·2·64 = 4,096 more; fp8
    under Transformer Engine (s = 1): 16·(100 + 2·228) = 8,896."""
    assert megatron_moe_activation(_cm(moe_weighting="activation"), T) == 16 * (100 + 2 * 324) == 11968
    assert megatron_moe_activation(_cm(), T) == 11968 + 4096  # moe_weighting "output", the default
    fp8 = _cm(moe_weighting="activation", precision="fp8", fp8_layers="all")
    assert megatron_moe_activation(fp8, T) == 16 * (100 + 2 * 228) == 8896
    # Megatron-Core's stack takes this count; Loom's keeps its own (measured) one, larger here: its
    # SwiGLU's 4 tensors, each row's input and output and the weighted rows where they return
    assert moe_activation(_cm(moe_weighting="activation"), T, 2) == 11968  # ep: no term of its own
    loom = moe_activation(_cm(""), T, 1)
    assert loom > 11968 + 4096
    # the layer's other tensors are the same on both stacks in bf16: only the MoE set differs
    assert layer_saved(_cm(), 1, False, 1, 1)[0] - layer_saved(_cm(""), 1, False, 1, 1)[0] == (
        pytest.approx(11968 + 4096 - loom)
    )


def test_moe_weighting_and_recompute_modules_are_checked():
    """A value not among the choices, Megatron-Core's weighting on a stack whose MoE layer weights each
    row's output, a module its stack does not recompute alone, or the fused loss on Loom's stack: one
    line naming the field."""
    for work, stack, want in (
        (
            {"moe_weighting": "input"},
            "megatron-core",
            "train.moe_weighting: must be one of output, activation",
        ),
        ({"moe_weighting": "activation"}, "", "is Megatron-Core's weighted GLU; stack ''"),
        ({"moe_weighting": "activation"}, "pytorch-fsdp", "stack 'pytorch-fsdp' weights each"),
        ({"recompute_modules": ("core_attn",)}, "megatron-core", "'core_attn' not among stack"),
        ({"recompute_modules": ("moe_act",)}, "", "(it offers: none)"),
        ({"fused_cross_entropy": True}, "", "train.fused_cross_entropy: Loom's loss is its own"),
    ):
        with pytest.raises(PlanError, match=re.escape(want)):
            _cm(stack, **work)


def test_fused_cross_entropy_keeps_the_logits_alone():
    """Transformer Engine's parallel cross entropy (Megatron-Core's cross_entropy_fusion_impl "te")
    writes the gradient over the logits: T·V/t·B_a = 16·256/2·2 bytes at tp 2, against the whole
    logits, an fp32 copy and the log-softmax, 16·256/2·10, without it."""
    lay = Layout(tp=2, dp=4)
    assert logit_bytes(_cm(fused_cross_entropy=True), lay) == 16 * 256 / 2 * 2
    assert logit_bytes(_cm(), lay) == 16 * 256 / 2 * 10


def test_recompute_modules_drop_their_outputs_and_recompute_them():
    """moe_act: the second grouped GEMM's input, k·R·s2·f = 2·16·2·32 = 2,048 bytes less per layer;
    layernorm: the pre-MLP norm's output B_a·T·h = 2·16·64 = 2,048 less; both under no recomputation
    and selective. In backward their forward runs again, memory-bound at the stack's factor: the GLU
    reads its input and the weight and writes its output, 32 rows·(3·2·32 + 4) = 6,272 bytes, the norm
    reads its input and writes its output and 1/rms, 16·(2·2·64 + 4) = 4,160, per layer."""
    plain, both = _cm(), _cm(recompute_modules=("moe_act", "layernorm"))
    act = _cm(recompute_modules=("moe_act",))
    full, sel, block_in = activation_terms(plain, 1, False, 1, 1)
    assert activation_terms(act, 1, False, 1, 1) == (full - 2048, sel - 2048, block_in)
    assert activation_terms(both, 1, False, 1, 1) == (full - 4096, sel - 4096, block_in)
    recompute = {
        cm: microbatch_times(cm, 1, False, 1, 1, 1, "none", 1)[2]["recompute"] for cm in (plain, both)
    }
    assert recompute[plain] == 0.0
    assert recompute[both] == pytest.approx(2 * both.other * (6272 + 4160) / both.machine.hbm)
    dense = dataclasses.replace(MOE, n_experts=1, top_k=1)  # no MoE layer: nothing to discard
    with_mods = CostModel(dense, Workload(8, T, recompute_modules=("moe_act",)), H100, stack="megatron-core")
    without = CostModel(dense, Workload(8, T), H100, stack="megatron-core")
    assert activation_terms(with_mods, 1, False, 1, 1) == activation_terms(without, 1, False, 1, 1)


def test_ep_overlap_holds_one_more_interleaved_chunk():
    """Megatron-Core's combined 1F1B (ep-overlap) runs one more warm-up forward: stage i of p = 2, v = 4
    holds 2(p - i - 1) + (v - 1)p + 2 chunks of L/(p v) layers (8 layers: stage 0 10 chunks, 10 layers);
    without a pipeline the layer-by-layer co-schedule keeps L; in stage memory only for an MoE under ep."""
    assert inflight_layers("interleaved", 2, 0, 64, 4, 8, ep_overlap=True) == 10.0
    assert inflight_layers("interleaved", 2, 0, 64, 4, 8) == 9.0
    assert inflight_layers("1f1b", 1, 0, 64, 1, 8, ep_overlap=True) == 8.0
    cm = CostModel(dataclasses.replace(MOE, n_layers=8), Workload(64, T), H100, stack="megatron-core")
    lay = Layout(dp=2, pp=2, ep=2, schedule="interleaved", v=4)
    per_layer = activation_terms(cm, 1, False, 1, 1)[0]
    ov = Layout(dp=2, pp=2, ep=2, schedule="interleaved", v=4, ep_overlap=True)
    assert stage_memory(cm, ov, 0)["activations"] - stage_memory(cm, lay, 0)["activations"] == (
        pytest.approx(per_layer)
    )


_ROW = """
[models.m]
dim = 1024
n_layers = 4
n_heads = 16
n_kv_heads = 4
ffn_dim = 512
vocab_size = 32000
n_experts = 16
top_k = 2
[models.d]
dim = 1024
n_layers = 4
n_heads = 16
vocab_size = 32000
[[runs]]
name = 'r'
model = '{model}'
stack = '{stack}'
cluster = {{ device = 'h100-sxm' }}
layout = 'dp8 ep8 zero1'
global_batch = 64
seq_len = 1024
{extra}
tokens_per_s_per_gpu = 1000
source = 'test'
"""


def test_a_published_row_names_its_megatron_moe_settings(tmp_path):
    """moe_weighting, fused_cross_entropy and recompute_modules reach the row's workload; a bad value,
    a dense model, a stack without the feature or a list of the wrong kind is one line naming the key."""
    path = tmp_path / "runs.toml"
    extra = "moe_weighting = 'activation'\nfused_cross_entropy = true\nrecompute_modules = ['moe_act']"
    path.write_text(_ROW.format(model="m", stack="megatron-bridge", extra=extra))
    (row,) = compare_published(load_file(path))
    w = row.run.workload
    assert (w.moe_weighting, w.fused_cross_entropy, w.recompute_modules) == ("activation", True, ("moe_act",))
    for model, stack, extra, want in (
        ("m", "nemo", "moe_weighting = 'input'", "moe_weighting: must be one of output, activation"),
        ("d", "nemo", "moe_weighting = 'activation'", "moe_weighting: activation places an MoE's routing"),
        (
            "m",
            "torchtitan",
            "moe_weighting = 'activation'",
            "moe_weighting: activation is Megatron-Core's weighted",
        ),
        ("m", "loom", "fused_cross_entropy = true", "fused_cross_entropy: Loom's stack runs its own loss"),
        ("m", "nemo", "recompute_modules = ['mlp']", "recompute_modules: 'mlp' is not a module stack 'nemo'"),
        ("m", "nemo", "recompute_modules = 'moe_act'", "recompute_modules must be a list"),
    ):
        path.write_text(_ROW.format(model=model, stack=stack, extra=extra))
        with pytest.raises(PlanError, match=r"runs.toml: run 'r': " + re.escape(want)):
            load_file(path)


def test_fine_grained_moe_rows_fit_the_80_gib_they_ran_in():
    """Every row of benchmarks/heldout/megatron_bridge_moe_h100.toml ran on 80 GiB H100s, and is
    predicted to fit there (before Megatron-Core's MoE layer, fused loss and recompute modules were
    priced: the 235B at 118 GiB, the 30B at ep 16 at 85, the 25.11 30B row at micro-batch 2 at 132)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "heldout" / "megatron_bridge_moe_h100.toml"
    table = compare_published(load_file(path))
    assert len(table) == 14
    for c in table:
        assert c.estimate.fits, format_published(table)
