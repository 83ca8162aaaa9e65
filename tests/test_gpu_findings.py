"""Issue 32's GPU findings 3, 4, 6, 7 and 10, each shown on the CPU (docs/gpus.md says what is
verified where): streamed export, device choice under srun, MoE FLOPs, communication streams and
memory visibility."""

from __future__ import annotations

import pytest

from tests.helpers import SEQ, tiny_model

# --- finding 6: MoE FLOPs count the top_k experts that run ------------------------------------------


@pytest.mark.parametrize("shared", [0, 1])
def test_moe_flops_count_top_k_experts(shared):
    """6 N_a + 12 L h T with N_a = every matmul weight but the (E − k) experts a token skips; equal to
    the dense model of the same active width (ffn = k·f) plus the router's 6 L h E; the planner the same."""
    from loom.config import MoEConfig
    from loom.model.llama import build_model, count_params, expert_params, flops_per_token
    from loom.plan.cost.params import ParamCounts

    E, k = 8, 2
    moe_cfg = tiny_model(n_experts=E, top_k=k)
    moe = build_model(moe_cfg, 0, meta=True, moe=MoEConfig(n_shared_experts=shared))
    L, h, f = moe_cfg.n_layers, moe_cfg.dim, moe_cfg.resolved_ffn_dim()
    n_all = count_params(moe, exclude_embedding=not moe_cfg.tie_embeddings)  # as the trainer counts
    assert expert_params(moe) == L * E * 3 * h * f
    got = flops_per_token(moe_cfg, SEQ, n_all, expert_params(moe))
    active = n_all - L * (E - k) * 3 * h * f
    assert got == pytest.approx(6 * active + 12 * L * h * SEQ)
    # the dense model whose MLP is the k experts side by side (+ the shared ones): same FLOPs but the router
    dense_cfg = tiny_model(ffn_dim=(k + shared) * f)
    dense = build_model(dense_cfg, 0, meta=True)
    dense_flops = flops_per_token(
        dense_cfg, SEQ, count_params(dense, exclude_embedding=not dense_cfg.tie_embeddings)
    )
    assert got == pytest.approx(dense_flops + 6 * L * h * E)
    # counting every expert (the old rule) is (E/k)-ish too high: the fix is not a no-op
    assert 6 * n_all + 12 * L * h * SEQ > 1.5 * got
    if not shared:  # the planner (no shared experts in its counts) applies the same rule
        pc = ParamCounts.of(moe_cfg, E, k)
        norms = L * pc.norms + pc.final_norm  # counted by the trainer, not by the planner (not matmuls)
        assert pc.experts == expert_params(moe)
        assert flops_per_token(moe_cfg, SEQ, pc.matmul, pc.experts) == pytest.approx(got - 6 * norms)
