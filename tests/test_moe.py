"""Mixture of experts: top-k routing against a per-token loop, the planner's parameter count, and
MoE training under data parallelism, ZeRO-3, pipeline and context parallelism equal to one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from tests.helpers import SEQ, one_thread, tiny_model, tiny_train, train_dp, train_layout  # noqa: F401 (fixture)

BATCH, MICRO, STEPS = 8, 4, 6
MOE = dict(n_experts=4, top_k=2)
TOL = dict(rtol=1e-4, atol=5e-5)
pytestmark = pytest.mark.usefixtures("one_thread")


def test_routing_equals_a_per_token_loop():
    from loom.model.llama import build_model

    cfg = tiny_model(**MOE)
    ff = build_model(cfg, 0).layers[0].feed_forward
    h = torch.randn(7, cfg.dim, generator=torch.Generator().manual_seed(1))
    got = ff(h[None])[0]
    probs = torch.softmax(h @ ff.router.weight.T, -1)
    want = torch.zeros_like(h)
    for i in range(len(h)):
        w, e = probs[i].topk(cfg.top_k)
        for wj, ej in zip(w / w.sum(), e):
            w1, w3, w2 = ff.w1.weight[ej], ff.w3.weight[ej], ff.w2.weight[ej]
            want[i] += wj * (w2 @ (F.silu(w1 @ h[i]) * (w3 @ h[i])))
    assert_close(got, want)


def test_equal_experts_reduce_to_the_dense_mlp():
    """n_experts = 2, top_k = 2 with equal experts: the weights sum to 1, so the output is one SwiGLU."""
    from loom.model.llama import FeedForward, build_model

    cfg = tiny_model(n_experts=2, top_k=2)
    ff = build_model(cfg, 0).layers[0].feed_forward
    dense = FeedForward(cfg.dim, cfg.resolved_ffn_dim())
    with torch.no_grad():
        for name in ("w1", "w3", "w2"):
            getattr(ff, name).weight.copy_(getattr(dense, name).weight.expand_as(getattr(ff, name).weight))
    x = torch.randn(2, 5, cfg.dim)
    assert_close(ff(x), dense(x))


def test_planner_counts_the_moe_parameters():
    from loom.model.llama import build_model, count_params
    from loom.plan.cost import ParamCounts

    for kw in (MOE, dict(n_experts=8, top_k=1), {}):
        cfg = tiny_model(**kw)
        assert ParamCounts.of(cfg, cfg.n_experts, cfg.top_k).total == count_params(build_model(cfg, 0))


LAYOUTS = {
    "dp2": (2, {"dp_replicate": 2}),
    "dp2 zero3": (2, {"dp_shard": 2, "zero": 3}),
    "pp2": (2, {"pp": 2}),
    "cp2": (2, {"cp": 2}),
    "ep2": (2, {"dp_replicate": 2, "ep": 2}),
    "ep2 recompute": (2, {"dp_replicate": 2, "ep": 2, "recompute": "full"}),
    "dp4 ep2": (4, {"dp_replicate": 4, "ep": 2}),
    "dp4 ep4": (4, {"dp_replicate": 4, "ep": 4}),
    "cp2 ep2": (2, {"cp": 2, "ep": 2}),
    "pp2 dp2 ep2": (4, {"pp": 2, "dp_replicate": 2, "ep": 2}),
}


@pytest.fixture(scope="module")
def reference():
    return train_dp(None, tiny_model(**MOE), tiny_train(steps=STEPS), BATCH, MICRO)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_training_equals_single_process(pools, reference, name):
    world, layout = LAYOUTS[name]
    results = pools(world).run(train_layout, layout, STEPS, BATCH, MICRO, MOE)
    for r in results:
        assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), **TOL, msg=lambda m: f"{name}: {m}")
        if r["state"] is not None:
            for k, v in reference["state"].items():
                assert_close(r["state"][k], v, **TOL, msg=lambda m, k=k: f"{name} {k}: {m}")


def test_expert_parallel_bf16_equals_single_process_bf16(pools):
    """bf16 weights with fp32 masters (Loom's flat-shard optimizer path): expert shards reduced over
    their edp group, clipped over ep; equal to one bf16 process up to bf16 rounding."""
    layout = {"dp_replicate": 2, "ep": 2, "precision": "bf16"}
    ref = train_layout({"precision": "bf16"}, STEPS, BATCH, MICRO, MOE)
    tol = dict(rtol=1e-2, atol=3e-3)  # bf16-rounded gradients summed in another order
    # Weights: an expert sees few tokens, and Adam turns a bf16 rounding that flips the sign of a
    # near-zero gradient element into a step of ~lr (3e-3) on it: a handful of elements differ by ~2 lr.
    weight_tol = dict(rtol=1e-2, atol=2 * tiny_train().lr)
    for r in pools(2).run(train_layout, layout, STEPS, BATCH, MICRO, MOE):
        assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **tol)
        for k, v in ref["state"].items():
            assert_close(r["state"][k].float(), v.float(), **weight_tol, msg=lambda m, k=k: f"{k}: {m}")


def test_bad_moe_configs_fail_in_one_line():
    from loom import config as C

    for overrides, world, message in [
        (["--model.n_experts", "4", "--model.top_k", "5"], 1, "model.top_k: must be in [1, model.n_experts=4]"),
        (["--model.n_experts", "0"], 1, "model.n_experts: must be >= 1"),
        (["--model.n_experts", "4", "--parallel.tp", "2"], 2, "parallel.tp: tensor parallelism of the experts"),
        (["--model.n_experts", "4", "--train.optimizer", "adafactor"], 1, "train.optimizer: adafactor factors 2-D"),
        (["--parallel.ep", "2"], 2, "parallel.ep: expert parallelism needs experts"),
        (["--model.n_experts", "4", "--parallel.ep", "2", "--parallel.zero", "1"], 2, "parallel.zero: ZeRO with expert"),
    ]:
        cfg = C.apply_overrides(C.LoomConfig(), overrides)
        with pytest.raises(C.ConfigError) as e:
            C.validate(cfg, world)
        assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["ep2", "ep2 recompute", "dp4 ep2", "dp4 ep4"])
def test_expert_parallel_calls_equal_the_planners(pools, name):
    """Per MoE layer and micro-batch: 5 all-to-alls (counts, dispatch, combine; dispatch and combine
    again backward), 8 with full recomputation; dense and expert buckets all-reduced over their groups."""
    from loom.plan.cost import CostModel, Layout, Workload
    from loom.plan.hardware import ClusterSpec

    world, layout = LAYOUTS[name]
    cfg, micro = tiny_model(**MOE), min(MICRO, BATCH // world)
    planner = CostModel(cfg, Workload(BATCH, SEQ, precision="fp32"), ClusterSpec.single_node("cpu", world))
    expected = planner.collective_calls(Layout(dp=world, ep=layout["ep"], micro_batch=micro,
                                               recompute=layout.get("recompute", "none")))  # fmt: skip
    assert expected["all_to_all"] > 0
    for r in pools(world).run(train_layout, layout, 2, BATCH, micro, MOE):
        assert r["calls"] == [expected] * 2
        for moved in r["moved"]:  # rows leave for other ranks: at most every routed row, each way
            rows = BATCH // world * SEQ * cfg.top_k
            assert 0 < moved["all_to_all"] <= cfg.n_layers * (5 + 3 * ("recompute" in name)) * rows * cfg.dim * 4
