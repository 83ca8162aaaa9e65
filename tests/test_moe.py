"""Mixture of experts: top-k routing against a per-token loop, the planner's parameter count, and
MoE training under data parallelism, ZeRO-3, pipeline and context parallelism equal to one process."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from tests.helpers import SEQ, one_thread, tiny_model, tiny_train, train_dp, train_layout  # noqa: F401 (fixture)

BATCH, MICRO, STEPS = 8, 4, 6
MOE = dict(n_experts=4, top_k=2)
TOL = dict(rtol=1e-4, atol=5e-5)
# Aux/z losses: their statistics are per micro-step over dp x cp, as one process running the dp ranks'
# micro-batches as one sees them (reference micro-batch = micro x dp); the shared expert rides along.
BALANCED = dict(aux_loss_coef=0.05, z_loss_coef=0.01, n_shared_experts=1)
# Bias balancing, sigmoid scores and capacity: per rank's micro-batch (reference micro-batch = micro).
BIASED = dict(score="sigmoid", bias_update_rate=0.01, capacity_factor=1.0, drop_policy="probability")
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
    """Every parameter of the built model, shared experts (moe.n_shared_experts: 3·h·S·f a layer) too."""
    from loom.config import MoEConfig
    from loom.model.llama import build_model, count_params
    from loom.plan.cost import ParamCounts

    for kw, shared in ((MOE, 0), (dict(n_experts=8, top_k=1), 0), ({}, 0), (MOE, 2)):
        cfg = tiny_model(**kw)
        built = build_model(cfg, 0, moe=MoEConfig(n_shared_experts=shared))
        assert ParamCounts.of(cfg, cfg.n_experts, cfg.top_k, shared).total == count_params(built), (
            kw,
            shared,
        )


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
    "tp2": (2, {"tp": 2}),
    "tp2 sp": (2, {"tp": 2, "sp": True}),
    "tp2 ep2": (4, {"tp": 2, "dp_replicate": 2, "ep": 2}),
    "tp2 sp ep2": (4, {"tp": 2, "sp": True, "dp_replicate": 2, "ep": 2}),
    "ep2 zero1": (2, {"dp_shard": 2, "ep": 2, "zero": 1}),
    "ep2 zero2": (2, {"dp_shard": 2, "ep": 2, "zero": 2}),
    "dp4 ep2 zero2": (4, {"dp_shard": 4, "ep": 2, "zero": 2}),
    "hybrid dp2x2 ep2 zero1": (4, {"dp_replicate": 2, "dp_shard": 2, "ep": 2, "zero": 1}),
    "ep2 zero3": (2, {"dp_shard": 2, "ep": 2, "zero": 3}),
    "dp4 ep2 zero3": (4, {"dp_shard": 4, "ep": 2, "zero": 3}),
    "hybrid dp2x2 ep2 zero3": (4, {"dp_replicate": 2, "dp_shard": 2, "ep": 2, "zero": 3}),
}


@pytest.fixture(scope="module")
def reference():
    return train_dp(None, tiny_model(**MOE), tiny_train(steps=STEPS), BATCH, MICRO)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_training_equals_single_process(pools, reference, name):
    world, layout = LAYOUTS[name]
    results = pools(world).run(train_layout, layout, STEPS, BATCH, MICRO, MOE)
    for r in results:
        assert_close(
            torch.tensor(r["losses"]), torch.tensor(reference["losses"]), **TOL, msg=lambda m: f"{name}: {m}"
        )
        if r["state"] is not None:
            for k, v in reference["state"].items():
                assert_close(r["state"][k], v, **TOL, msg=lambda m, k=k: f"{name} {k}: {m}")


SPLIT = {"expert_tp": "split"}  # parallel.expert_tp: experts cut over tp like the dense MLP
SPLIT_LAYOUTS = {  # name: (world, layout, [moe] options)
    "tp2": (2, {"tp": 2}, {}),
    "tp2 shared": (2, {"tp": 2}, {"n_shared_experts": 1}),
    "tp2 sp": (2, {"tp": 2, "sp": True}, {}),
    "tp2 sp capacity": (2, {"tp": 2, "sp": True}, BIASED),
    "tp2 sp balanced": (2, {"tp": 2, "sp": True}, BALANCED),
    "tp2 ep2": (4, {"tp": 2, "dp_replicate": 2, "ep": 2}, {}),
    "tp2 sp ep2 shared": (4, {"tp": 2, "sp": True, "dp_replicate": 2, "ep": 2}, {"n_shared_experts": 1}),
    "tp2 ep2 zero1": (4, {"tp": 2, "dp_shard": 2, "ep": 2, "zero": 1}, {}),
    "tp2 sp ep2 zero3": (4, {"tp": 2, "sp": True, "dp_shard": 2, "ep": 2, "zero": 3}, {}),
    "tp2 pp2 recompute": (4, {"tp": 2, "pp": 2, "recompute": "full"}, {}),
}


@pytest.fixture(scope="module")
def split_references():
    options = {json.dumps(kw, sort_keys=True): kw for *_, kw in SPLIT_LAYOUTS.values()}
    return {key: train_layout({}, STEPS, BATCH, MICRO, MOE, moe_kw=kw) for key, kw in options.items()}


@pytest.mark.parametrize("name", list(SPLIT_LAYOUTS))
def test_split_experts_equal_single_process(pools, split_references, name):
    """parallel.expert_tp = split (each tp rank a 1/tp slice of every expert, the router whole): losses,
    gradient norms (the experts' squares summed over tp and ep) and weights equal one process's; under
    sp every rank routes the whole sequence, so a capacity factor drops what one process drops."""
    world, layout, moe_kw = SPLIT_LAYOUTS[name]
    ref = split_references[json.dumps(moe_kw, sort_keys=True)]
    for r in pools(world).run(train_layout, layout | SPLIT, STEPS, BATCH, MICRO, MOE, moe_kw=moe_kw):
        for key in ("losses", "grad_norms"):
            assert_close(
                torch.tensor(r[key]),
                torch.tensor(ref[key]),
                **TOL,
                msg=lambda m, key=key: f"{name} {key}: {m}",
            )
        if r["state"] is not None:
            for k, v in ref["state"].items():
                assert_close(r["state"][k], v, **TOL, msg=lambda m, k=k: f"{name} {k}: {m}")


ODD_FFN = MOE | {"ffn_dim": 33}  # an expert width tp = 2 cannot cut


@pytest.fixture(scope="module")
def odd_ffn_reference():
    return train_layout({}, STEPS, BATCH, MICRO, ODD_FFN)


@pytest.mark.parametrize("layout", [{"tp": 2}, {"tp": 2, "sp": True}], ids=["tp2", "tp2 sp"])
def test_replicated_experts_need_no_width_tp_divides(pools, odd_ffn_reference, layout):
    """Replicated experts (parallel.expert_tp = replicate) are whole on every tp rank, so their width
    f = 33 need not divide by tp = 2 (it was refused as if tp cut them: ``--model.ffn_dim 99 --parallel.tp
    2``); split ones are refused in one line naming the option. Losses and weights equal one process's."""
    from loom.rules import ModelFacts, tensor_parallel_problem

    facts = ModelFacts.of(tiny_model(**ODD_FFN))
    assert tensor_parallel_problem(facts, 2, "replicate") is None
    assert tensor_parallel_problem(facts, 2, "split") == (
        "model.ffn_dim: the SwiGLU hidden size 33 must be divisible by parallel.tp=2 (experts split: "
        "parallel.expert_tp = split; replicate keeps them whole)"
    )
    ref = odd_ffn_reference
    for r in pools(2).run(train_layout, layout, STEPS, BATCH, MICRO, ODD_FFN):
        assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL)
        for k, v in ref["state"].items():
            assert_close(r["state"][k], v, **TOL, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("sp", [False, True])
def test_split_experts_move_the_stated_bytes(pools, sp):
    """Per MoE layer and micro-batch, split experts move over tp (ρ = (n-1)/n, S = b·s·h·4 fp32 bytes):
    4ρS (without sp two all-reduces, with sp an all-gather and a reduce-scatter each way) plus 2ρ·4·b·s·k
    for the routing weights' gradient; under sp the replicated layout's once-a-step sum of the MoE
    layer's partial gradients (router, experts) is gone. Measured as split minus replicate."""
    cfg = tiny_model(**MOE)
    layout = {"tp": 2, "sp": sp}
    runs = [pools(2).run(train_layout, layout | kw, 1, BATCH, MICRO, MOE)[0] for kw in ({}, SPLIT)]
    replicate, split = (sum(r["moved"][0].values()) for r in runs)
    rho, b, s, h, k = 0.5, MICRO, SEQ, cfg.dim, cfg.top_k
    f = cfg.resolved_ffn_dim()
    per_layer = 4 * rho * b * s * h * 4 + 2 * rho * 4 * b * s * k
    partial = 2 * rho * 4 * (cfg.n_experts * h + 3 * cfg.n_experts * f * h) if sp else 0
    assert split - replicate == cfg.n_layers * (BATCH // MICRO) * per_layer - cfg.n_layers * partial


def test_expert_parallel_bf16_equals_single_process_bf16(pools):
    """bf16 weights with fp32 masters (Loom's flat-shard optimizer path): expert shards reduced over
    their edp group, clipped over ep; equal to one bf16 process up to bf16 rounding."""
    layout = {"dp_replicate": 2, "ep": 2, "precision": "bf16"}
    ref = train_layout({"precision": "bf16"}, STEPS, BATCH, MICRO, MOE)
    tol = dict(rtol=1e-2, atol=3e-3)  # bf16-rounded gradients summed in another order
    # Weights: an expert sees few tokens, and Adam turns a bf16 rounding that flips the sign of a
    # near-zero gradient element into a step of ~lr (3e-3) on it, once per flip: a handful of elements
    # differ by 1-3 lr (worst measured 1.67 lr with repeated k/v, 2.72 lr with SDPA's grouped heads).
    weight_tol = dict(rtol=1e-2, atol=3.5 * tiny_train().lr)
    for r in pools(2).run(train_layout, layout, STEPS, BATCH, MICRO, MOE):
        assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **tol)
        for k, v in ref["state"].items():
            assert_close(r["state"][k].float(), v.float(), **weight_tol, msg=lambda m, k=k: f"{k}: {m}")


def test_bad_moe_configs_fail_in_one_line():
    from loom import config as C

    for overrides, world, message in [
        (
            ["--model.n_experts", "4", "--model.top_k", "5"],
            1,
            "model.top_k: must be in [1, model.n_experts=4]",
        ),
        (["--model.n_experts", "0"], 1, "model.n_experts: must be >= 1"),
        (
            [
                "--model.n_experts",
                "4",
                "--moe.capacity_factor",
                "1",
                "--parallel.tp",
                "2",
                "--parallel.sp",
                "true",
            ],
            2,
            "moe.capacity_factor: capacity is counted over a rank's tokens, and sequence parallelism over",
        ),
        (
            ["--model.n_experts", "4", "--train.optimizer", "adafactor"],
            1,
            "train.optimizer: adafactor factors 2-D",
        ),
        (["--parallel.ep", "2"], 2, "parallel.ep: expert parallelism needs experts"),
        (["--model.n_experts", "6", "--parallel.ep", "4"], 4, "parallel.ep: 4 must divide model.n_experts=6"),
        (["--model.n_experts", "4", "--moe.capacity_factor", "-0.5"], 1, "moe.capacity_factor: must be >= 0"),
        (
            [
                "--model.n_experts",
                "4",
                "--moe.aux_loss_coef",
                "0.01",
                "--parallel.pp",
                "2",
                "--parallel.schedule",
                "pipedream",
                "--model.tie_embeddings",
                "false",
            ],
            2,
            "moe.aux_loss_coef: the router losses need a synchronous",
        ),
        (
            ["--model.n_experts", "4", "--moe.capacity_factor", "1.0", "--parallel.cp", "2"],
            2,
            "moe.capacity_factor: capacity is counted over a rank's tokens, and parallel.cp = 2",
        ),
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
    expected = planner.collective_calls(
        Layout(dp=world, ep=layout["ep"], micro_batch=micro, recompute=layout.get("recompute", "none"))
    )
    assert expected["all_to_all"] > 0
    for r in pools(world).run(train_layout, layout, 2, BATCH, micro, MOE):
        assert r["calls"] == [expected] * 2
        for moved in r["moved"]:  # rows leave for other ranks: at most every routed row, each way
            rows = BATCH // world * SEQ * cfg.top_k
            assert (
                0 < moved["all_to_all"] <= cfg.n_layers * (5 + 3 * ("recompute" in name)) * rows * cfg.dim * 4
            )


TP_CALL_LAYOUTS = {
    "tp2 ep2 split": {"tp": 2, "dp_replicate": 2, "ep": 2} | SPLIT,
    "tp2 sp ep2 split recompute": {"tp": 2, "sp": True, "dp_replicate": 2, "ep": 2, "recompute": "full"}
    | SPLIT,
    "tp2": {"tp": 2},
    "tp2 sp": {"tp": 2, "sp": True},
    "tp2 split": {"tp": 2} | SPLIT,
    "tp2 sp split": {"tp": 2, "sp": True} | SPLIT,
    "tp2 sp split recompute": {"tp": 2, "sp": True, "recompute": "full"} | SPLIT,
    "tp2 split recompute": {"tp": 2, "recompute": "full"} | SPLIT,
    "tp2 sp recompute": {"tp": 2, "sp": True, "recompute": "full"},
}


@pytest.mark.parametrize("name", list(TP_CALL_LAYOUTS))
def test_tensor_parallel_moe_calls_and_bytes_equal_the_planners(pools, name):
    """Under tp an MoE layer with whole experts issues only its attention's collectives; split experts
    add the MLP's (2 all-reduces, or under sp an all-gather and a reduce-scatter each way, the
    forward's again under full recomputation) and the routing weights' gradient all-reduce, and under
    ep the rows pooled over tp (an all-gather and a reduce-scatter each way, the counts' all-gather):
    calls per step equal the planner's, and bytes where no routing decides them (ep 1)."""
    from loom.plan.cost import CostModel, Layout, Workload
    from loom.plan.cost.comm import tp_partial_params, tp_payload
    from loom.plan.hardware import ClusterSpec

    layout = TP_CALL_LAYOUTS[name]
    dp, ep = layout.get("dp_replicate", 1), layout.get("ep", 1)
    cfg, micro = tiny_model(**MOE), min(MICRO, BATCH // dp)
    planner = CostModel(cfg, Workload(BATCH, SEQ, precision="fp32"), ClusterSpec.single_node("cpu", 2 * dp))
    lay = Layout(
        dp=dp,
        ep=ep,
        tp=2,
        sp=layout.get("sp", False),
        micro_batch=micro,
        recompute=layout.get("recompute", "none"),
        expert_tp=layout.get("expert_tp", "replicate"),
    )
    calls, payload = planner.collective_calls(lay), tp_payload(planner, lay)
    # + the once-a-step sum of the gradients held in part (fp32), which tp_payload leaves out
    payload["all_reduce"] += 4 * tp_partial_params(planner, 2, lay.sp, 1, ep=1, expert_tp=lay.expert_tp)
    for r in pools(2 * dp).run(train_layout, layout, 1, BATCH, micro, MOE):
        assert r["calls"][0] == calls
        if ep == 1:
            assert r["payload"][0] == pytest.approx(payload)


def test_split_experts_send_their_share_of_the_rows_through_the_all_to_all(pools):
    """tp2 x ep2: each tp rank of split experts sends its half of the tokens' rows, so the rows leaving
    all ranks are half those of whole experts (without sp every tp rank of those sends every row);
    the per-expert counts (8·E/ep·(ep-1) bytes per layer and micro-batch) are exchanged by every rank
    in both."""
    layout, cfg = {"tp": 2, "dp_replicate": 2, "ep": 2}, tiny_model(**MOE)
    counts = 4 * cfg.n_layers * (BATCH // (2 * MICRO)) * 8 * cfg.n_experts // 2  # 4 ranks, 1 other ep rank
    whole, split = (
        sum(
            r["moved"][0]["all_to_all"] for r in pools(4).run(train_layout, layout | kw, 1, BATCH, MICRO, MOE)
        )
        - counts
        for kw in ({}, SPLIT)
    )
    assert split == whole / 2


# ---- issue 14: grouped compute, balancing, capacity ------------------------------------------------------


def _moe_layer(seed: int = 0, **options):
    from loom.config import MoEConfig
    from loom.model.llama import build_model

    cfg = tiny_model(**MOE)
    return build_model(cfg, seed, moe=MoEConfig(**options)).layers[0].feed_forward


@pytest.mark.parametrize("compute", ["grouped_mm", "padded", "loop"])
def test_grouped_expert_compute_equals_the_loop(compute, monkeypatch):
    """One grouped (or padded batched) matmul per weight, or the per-expert loop: outputs and every
    gradient equal to the reference loop over nonzero + index_add (an expert without tokens included)."""
    from loom.model import moe
    from loom.model.moe import experts_forward, route

    ff = _moe_layer(compute="loop" if compute == "loop" else "grouped")
    if compute == "padded":
        monkeypatch.setattr(moe, "grouped_mm_available", lambda x: False)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(3)).abs()
    with torch.no_grad():  # starve expert 3: no token routes there
        ff.router.weight[3] = -1.0
    flat = x.reshape(-1, 32)
    assert (route(flat, ff.router.weight, 2).experts == 3).sum() == 0
    got = ff(x).reshape(-1, 32)
    ws = [ff.w1.weight, ff.w3.weight, ff.w2.weight, ff.router.weight]
    g_got = torch.autograd.grad(got.square().sum(), ws)
    r = route(flat, ff.router.weight, 2)
    want = experts_forward(flat, r.weights, r.experts, *ws[:3])
    g_want = torch.autograd.grad(want.square().sum(), ws)
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_got, g_want):
        assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_experts_whose_rows_are_not_16_byte_multiples_run_the_padded_matmul():
    """torch._grouped_mm refuses row strides that are not multiples of 16 bytes (an expert of width
    25 in fp32: f = 100 split over tp 4 raised "strides should be multiple of 16 bytes" in every rank):
    such experts take the padded batched matmul, equal to the per-expert loop (the planner prices that
    batch: tests/test_plan_expert_tp.py)."""
    from loom.model.moe import grouped_mm_aligned, grouped_swiglu

    assert grouped_mm_aligned(32, 100, 4) and not grouped_mm_aligned(32, 25, 4)
    assert grouped_mm_aligned(32, 24, 2) and not grouped_mm_aligned(32, 25, 2)
    g = torch.Generator().manual_seed(0)
    x, counts = torch.randn(10, 32, generator=g), torch.tensor([4, 0, 6])
    w1, w3, w2 = (
        torch.randn(3, 25, 32, generator=g),
        torch.randn(3, 25, 32, generator=g),
        torch.randn(3, 32, 25, generator=g),
    )
    assert_close(grouped_swiglu(x, counts, w1, w3, w2), grouped_swiglu(x, counts, w1, w3, w2, "loop"))


def test_aux_and_z_losses_equal_their_formulas_on_a_hand_built_routing():
    """Router = 3·identity on 4 experts plus offsets (0.3, 0.2, 0.1, 0) from a constant feature and
    one-hot tokens: token i's logits are 3 on its hot expert plus the offsets, so its top-2 is known:
    aux = α·E·Σ f_e P_e, z = β·mean(logsumexp²), and their gradients reach the router."""
    import math

    ff = _moe_layer(aux_loss_coef=0.1, z_loss_coef=0.01)
    E, k = 4, 2
    offset = [0.3, 0.2, 0.1, 0.0]
    with torch.no_grad():
        ff.router.weight.zero_()
        ff.router.weight[:, :E] = torch.eye(E) * 3.0
        ff.router.weight[:, E] = torch.tensor(offset)
    hot = [0, 0, 0, 1, 2, 0]  # the second choice is expert 0, or 1 for the tokens hot on 0
    x = torch.zeros(len(hot), 32)
    x[:, E] = 1.0
    for i, e in enumerate(hot):
        x[i, e] = 1.0
    counts, P, z = [0.0] * E, [0.0] * E, 0.0
    for e in hot:
        logits = [offset[j] + 3.0 * (j == e) for j in range(E)]
        total = sum(math.exp(v) for v in logits)
        for j in range(E):
            P[j] += math.exp(logits[j]) / total / len(hot)
        counts[e] += 1
        counts[1 if e == 0 else 0] += 1
        z += math.log(total) ** 2 / len(hot)
    aux = E * sum(c / (len(hot) * k) * p for c, p in zip(counts, P))
    f = torch.tensor(counts) / (len(hot) * k)
    ff.train()
    out = ff(x[None])
    stats = ff.stats
    assert_close(stats[:E], torch.tensor(counts))
    assert_close(stats[E + 1], torch.tensor(aux))
    assert_close(stats[E + 2], torch.tensor(z))
    # the injected gradient: that of 0.1·aux + 0.01·z through the router, added to the output's own
    (g_router,) = torch.autograd.grad(out.sum(), ff.router.weight)
    ff.options.aux_loss_coef = ff.options.z_loss_coef = 0.0
    out2 = ff(x[None])
    logits = x @ ff.router.weight.T
    probs = logits.softmax(-1)
    direct = 0.1 * E * (f * probs.mean(0)).sum() + 0.01 * torch.logsumexp(logits, -1).square().mean()
    (g_plain,) = torch.autograd.grad(out2.sum() + direct, ff.router.weight)
    assert_close(g_router, g_plain)


@pytest.mark.parametrize("policy", ["probability", "position"])
def test_capacity_drops_like_a_reference_loop(policy):
    """Expert e keeps its C = ceil(c·N·k/E) best (or earliest) assignments; the output is the loop's
    with the dropped assignments' weights zeroed, and the dropped count is recorded."""
    import math

    from loom.model.moe import experts_forward, route

    ff = _moe_layer(capacity_factor=0.75, drop_policy=policy, n_shared_experts=0)
    ff.train()
    x = torch.randn(1, 13, 32, generator=torch.Generator().manual_seed(5))
    flat = x[0]
    N, k, E = 13, 2, 4
    cap = math.ceil(0.75 * N * k / E)
    r = route(flat, ff.router.weight, k)
    score = r.scores.gather(-1, r.experts).detach()
    keep = torch.zeros(N, k, dtype=torch.bool)
    for e in range(E):
        mine = [(t, s) for t in range(N) for s in range(k) if r.experts[t, s] == e]
        if policy == "probability":
            mine.sort(key=lambda ts: -float(score[ts]))  # stable: ties by position
        for t, s in mine[:cap]:
            keep[t, s] = True
    assert (~keep).sum() > 0
    want = experts_forward(flat, r.weights * keep, r.experts, ff.w1.weight, ff.w3.weight, ff.w2.weight)
    assert_close(ff(x)[0], want, rtol=1e-5, atol=1e-6)
    assert ff.stats[E] == (~keep).sum()
    ff.eval()  # evaluation is dropless
    assert_close(
        ff(x)[0],
        experts_forward(flat, r.weights, r.experts, ff.w1.weight, ff.w3.weight, ff.w2.weight),
        rtol=1e-5,
        atol=1e-6,
    )


BALANCE_LAYOUTS = {  # name: (world, layout, micro-batch per rank: BATCH / (dp x micro) accumulated)
    "dp2": (2, {"dp_replicate": 2}, 4),
    "dp2 accumulated": (2, {"dp_replicate": 2}, 2),
    "cp2": (2, {"cp": 2}, 4),
    "ep2": (2, {"dp_replicate": 2, "ep": 2}, 4),
    "ep2 accumulated": (2, {"dp_replicate": 2, "ep": 2}, 2),
    "ep2 recompute": (2, {"dp_replicate": 2, "ep": 2, "recompute": "full"}, 4),
    "pp2": (2, {"pp": 2}, 4),
    "dp2 zero3": (2, {"dp_shard": 2, "zero": 3}, 4),
    "tp2": (2, {"tp": 2}, 4),
    "tp2 sp": (2, {"tp": 2, "sp": True}, 4),
}


@pytest.fixture(scope="module")
def balance_references():
    refs = {}
    for options in ("BALANCED", "BIASED"):
        for micro in (2, 4):
            refs[options, micro] = train_layout({}, STEPS, BATCH, micro, MOE, moe_kw=globals()[options])
    return refs


@pytest.mark.parametrize("options", ["BALANCED", "BIASED"])
@pytest.mark.parametrize("name", list(BALANCE_LAYOUTS))
def test_balancing_equals_single_process(pools, balance_references, name, options):
    """The same micro-batch size in one process is the reference: each data-parallel rank balances its
    own micro-batch (the aux loss's f_e summed over cp and sp's tp only), with accumulation too; the
    selection bias's step loads are summed over every rank."""
    world, layout, micro = BALANCE_LAYOUTS[name]
    if options == "BIASED" and ("cp" in layout or "sp" in layout):
        pytest.skip("capacity is per rank's tokens: under cp or sp a rank holds part of each sequence")
    ref = balance_references[options, micro]
    for r in pools(world).run(train_layout, layout, STEPS, BATCH, micro, MOE, moe_kw=globals()[options]):
        assert_close(
            torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL, msg=lambda m: f"{name}: {m}"
        )
        if r["state"] is not None:
            for k, v in ref["state"].items():
                assert_close(r["state"][k], v, **TOL, msg=lambda m, k=k: f"{name} {k}: {m}")


def test_trainer_reports_expert_load_and_draws_the_heatmap(tmp_path):
    """metrics.jsonl gets per-layer load shares (summing to 1), imbalance = max/mean of them, dropped
    fraction, aux and z; TensorBoard the scalars; the run ends with moe_load.png. A resumed run
    continues the selection bias from the checkpoint: equal to the uninterrupted run."""
    import json
    import os

    from loom import config as C
    from loom.data import prepare_data
    from loom.train.trainer import RankEnv, Trainer

    cfg = {
        "model": {
            "dim": 32,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "max_seq_len": 32,
            "n_experts": 4,
            "top_k": 2,
        },
        "data": {"seq_len": 32, "vocab_size": 300, "max_corpus_mb": 0.1},
        "train": {
            "steps": 4,
            "global_batch": 4,
            "micro_batch": 2,
            "log_every": 2,
            "eval_every": 0,
            "checkpoint_every": 2,
            "checkpoint_async": False,
        },
        "moe": {
            "aux_loss_coef": 0.01,
            "z_loss_coef": 0.001,
            "bias_update_rate": 0.01,
            "capacity_factor": 1.0,
        },
        "run": {"progress": False, "tensorboard": True, "threads": 1, "dir": str(tmp_path / "run")},
    }
    os.environ.setdefault("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    cfg["data"]["prepared_dir"] = str(prepare_data(C.from_dict(cfg).data, progress=False).dir)

    def train(run_dir, steps):
        c = json.loads(json.dumps(cfg))
        c["run"]["dir"], c["train"]["steps"] = str(run_dir), steps
        trainer = Trainer(C.from_dict(c), RankEnv(0, 1, 0, 1))
        try:
            trainer.fit()
        finally:
            trainer.heartbeat.close()
        return trainer

    whole = train(tmp_path / "run", 4)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        for layer in (0, 1):
            load = torch.tensor(r[f"moe/l{layer}/load"])
            assert len(load) == 4 and abs(float(load.sum()) - 1) < 1e-9
            assert abs(r[f"moe/l{layer}/imbalance"] - float(load.max() / load.mean())) < 1e-9
            assert (
                0 <= r[f"moe/l{layer}/dropped"] < 1
                and r[f"moe/l{layer}/aux"] > 0
                and r[f"moe/l{layer}/z"] > 0
            )
        assert r["moe_imbalance"] == max(r["moe/l0/imbalance"], r["moe/l1/imbalance"])
    assert (tmp_path / "run" / "moe_load.png").stat().st_size > 0
    assert list((tmp_path / "run" / "tensorboard").iterdir())
    bias = [m.expert_bias.clone() for m in whole.moe_report.model.modules() if hasattr(m, "step_load")]
    assert all(b.abs().sum() > 0 for b in bias)
    # stop after 2 steps, resume to 4: the biases (checkpointed buffers) continue
    import shutil

    half = tmp_path / "half"
    train(half, 2)
    shutil.rmtree(half / "checkpoints" / "final", ignore_errors=True)
    resumed = train(half, 4)
    again = [m.expert_bias for m in resumed.moe_report.model.modules() if hasattr(m, "step_load")]
    for a, b in zip(again, bias):
        assert_close(a, b)


@pytest.mark.parametrize(
    "name,shared",
    [
        ("tp2", 0),
        ("tp2 sp ep2", 0),
        ("ep2 zero1", 0),
        ("dp4 ep2 zero2", 0),
        ("dp4 ep2 zero3", 0),
        ("tp2 sp ep2", 1),
        ("tp2 split", 1),
        ("tp2 sp ep2 split", 1),
        ("tp2 ep2 zero1 split", 0),
        ("tp2 sp ep2 zero3 split", 1),
    ],
)
def test_planner_state_bytes_of_moe_equal_the_measured(pools, name, shared):
    """Experts whole on every tp rank (E/ep of them; split: 1/tp of each), attention and embeddings
    split over tp; under ZeRO 1-2 the experts' optimizer state (and stage 2 gradients) sharded over their edp group
    (dp·cp/ep ranks), the dense ones over dp·cp; shared experts (moe.n_shared_experts) whole on
    every tp and ep rank: the planner's weights + gradients + Adam states (4 + 4 + 8 bytes each,
    fp32) equal a rank's."""
    from loom.plan.cost import CostModel, Layout, Workload
    from loom.plan.hardware import ClusterSpec

    world, layout = LAYOUTS.get(name) or (SPLIT_LAYOUTS | LAYOUTS)[name.removesuffix(" split")][:2]
    layout = layout | (SPLIT if name.endswith(" split") else {})
    cfg = tiny_model(**MOE)
    work = Workload(BATCH, SEQ, precision="fp32", moe_shared=shared)
    planner = CostModel(cfg, work, ClusterSpec.single_node("cpu", world))
    tp, zero = layout.get("tp", 1), layout.get("zero", 0)
    lay = Layout(
        dp=world // tp,
        tp=tp,
        ep=layout.get("ep", 1),
        sp=layout.get("sp", False),
        micro_batch=MICRO // 2,
        zero=zero,
        dp_shard=world // tp if zero else 1,
        expert_tp=layout.get("expert_tp", "replicate"),
    )
    predicted = sum(planner.state_memory(lay)[k] for k in ("weights", "gradients", "optimizer"))
    moe_kw = {"n_shared_experts": shared}
    for r in pools(world).run(train_layout, layout, 1, BATCH, MICRO // 2, MOE, moe_kw=moe_kw):
        measured = sum(r["state_bytes"][k] for k in ("param_bytes", "grad_bytes", "optim_bytes"))
        assert measured == pytest.approx(predicted, rel=1e-9)


def test_planner_ranks_moe_under_tp_and_only_layouts_training_runs():
    """tp x MoE (experts whole on every tp rank, or split there) is ranked; with a capacity factor no
    layout splits sequences (cp, sp with whole experts), as training refuses those; a hotter expert load (moe.imbalance) and the
    capacity that caps it change the expert time and the all-to-all volume as stated."""
    from loom.plan.cost import CostModel, Layout, Workload
    from loom.plan.hardware import ClusterSpec
    from loom.plan.search import search

    cfg = tiny_model(**MOE, max_seq_len=64)
    cluster = ClusterSpec.single_node("cpu", 8)
    free = search(cfg, Workload(16, 64, precision="fp32"), cluster, 8)
    assert any(e.layout.tp > 1 for e in free.ranked) and any(e.layout.cp > 1 for e in free.ranked)
    capped = search(cfg, Workload(16, 64, precision="fp32", capacity_factor=1.25), cluster, 8)
    assert any(e.layout.expert_tp == "split" and e.layout.sp for e in capped.ranked)  # whole sequences routed
    assert capped.ranked and all(
        e.layout.cp == 1 and not (e.layout.tp > 1 and e.layout.sp and e.layout.expert_tp != "split")
        for e in capped.ranked
    )
    lay = Layout(dp=8, ep=4, micro_batch=2)

    def ep_comm(**w):
        return (
            CostModel(cfg, Workload(16, 64, precision="fp32", **w), cluster)
            .estimate(lay)
            .time_breakdown["ep comm"]
        )

    assert ep_comm(moe_imbalance=2.0) > ep_comm() and ep_comm(
        moe_imbalance=2.0, capacity_factor=1.25
    ) < ep_comm(moe_imbalance=2.0)
    assert Workload(1, 1, moe_imbalance=3.0, capacity_factor=1.5).moe_load == 1.5


def test_unset_imbalance_takes_the_calibration_runs_measurement(tmp_path, monkeypatch):
    """moe.imbalance = 0 (the default): the planner takes the profile's imbalance, measured by `loom plan
    calibrate --config` from its one-rank run's moe_imbalance metric, else 1 (balanced)."""
    from loom import config as C
    from loom.plan.calibrate import measure_trainer_step
    from loom.plan.cost import CostModel, Workload
    from loom.plan.hardware import ClusterSpec, Profile
    from loom.plan.report import workload_of

    cfg = tiny_model(**MOE, max_seq_len=64)
    cluster = ClusterSpec.single_node("cpu", 8)
    work = workload_of(C.LoomConfig())
    assert work.moe_imbalance == 0
    assert CostModel(cfg, work, cluster).train.moe_imbalance == 1.0
    measured = Profile(device="cpu", moe_imbalance=2.5)
    assert CostModel(cfg, work, cluster, measured).train.moe_imbalance == 2.5
    assert (
        CostModel(cfg, Workload(16, 64, moe_imbalance=1.5), cluster, measured).train.moe_imbalance == 1.5
    )  # given wins
    config = tmp_path / "moe.toml"
    config.write_text(
        "[model]\ndim = 64\nn_layers = 2\nn_heads = 4\nn_kv_heads = 2\nn_experts = 4\ntop_k = 1\n"
        "[data]\nmax_corpus_mb = 0.3\nvocab_size = 300\nseq_len = 32\n"
        "[train]\nglobal_batch = 4\nmicro_batch = 4\n"
    )
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))  # the run's prepared data
    seconds, imbalance = measure_trainer_step(str(config), steps=4, runs=1)
    assert seconds > 0 and 1.0 < imbalance <= 4.0  # top-1 of 4 experts: between balanced and all on one


SKEWED = dict(MOE, n_experts=4, top_k=1)  # top-1 of 4: routing of a fresh router is uneven enough to show


@pytest.mark.parametrize(
    "world, layout",
    [
        (2, {"dp_replicate": 2, "ep": 2}),
        (4, {"dp_shard": 4, "ep": 2, "zero": 3}),
        (4, {"tp": 2, "sp": True, "dp_replicate": 2, "ep": 2} | SPLIT),
    ],
)
def test_hot_expert_replication_equals_single_process_and_cuts_the_busiest_rank(pools, world, layout):
    """moe.rebalance_every = 1: after each step the most loaded expert of each layer is replicated on
    every ep rank. Losses and weights equal one process; the busiest rank computes fewer rows than
    without replication (rows of the same batches, steps 2 on, where a hot set exists)."""
    steps = 4
    ref = train_layout({}, steps, BATCH, MICRO, SKEWED)
    plain = pools(world).run(train_layout, layout, steps, BATCH, MICRO, SKEWED)
    hot = pools(world).run(train_layout, layout, steps, BATCH, MICRO, SKEWED, moe_kw=dict(rebalance_every=1))
    for r in hot:
        assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL)
        if r["state"] is not None:
            for k, v in ref["state"].items():
                assert_close(r["state"][k], v, **TOL, msg=lambda m, k=k: f"{k}: {m}")
    busiest_plain = [max(r["expert_rows"][s] for r in plain) for s in range(1, steps)]
    busiest_hot = [max(r["expert_rows"][s] for r in hot) for s in range(1, steps)]
    print(
        f"busiest rank's expert rows per step, steps 2-{steps}: {busiest_plain} without, {busiest_hot} with replication"
    )
    assert sum(busiest_hot) < sum(busiest_plain)
    assert sum(sum(r["expert_rows"]) for r in hot) == sum(
        sum(r["expert_rows"]) for r in plain
    )  # every row computed once


def test_hot_experts_are_chosen_to_unload_the_busiest_rank():
    from loom.parallel.expert.parallelize import choose_hot, rank_loads

    load = [100.0, 10.0, 60.0, 50.0]  # ep2: rank 0 holds experts 0-1 (110 rows), rank 1 experts 2-3 (110)
    assert rank_loads(load, 2, [0]) == [60.0, 160.0]  # the hottest alone would overload rank 1
    assert choose_hot(load, 2, 1) == [] and choose_hot([100.0, 10.0, 20.0, 30.0], 2, 1) == [0]
    assert rank_loads([100.0, 10.0, 20.0, 30.0], 2, [0]) == [60.0, 100.0]
    assert choose_hot([100.0, 10.0, 20.0, 30.0], 2, 2) == [
        0,
        3,
    ]  # then [75, 85]: the busiest rank lower again


def test_bad_rebalance_configs_fail_in_one_line():
    from loom import config as C

    for overrides, message in [
        (
            ["--model.n_experts", "4", "--moe.rebalance_every", "1"],
            "moe.rebalance_every: replicates hot experts",
        ),
        (
            [
                "--model.n_experts",
                "4",
                "--parallel.ep",
                "2",
                "--moe.rebalance_every",
                "1",
                "--moe.hot_experts",
                "4",
            ],
            "moe.hot_experts: must be in [1, model.n_experts) = [1, 4), got 4",
        ),
        (["--model.n_experts", "4", "--moe.rebalance_every", "-1"], "moe.rebalance_every: must be >= 0"),
    ]:
        with pytest.raises(C.ConfigError) as e:
            C.validate(C.apply_overrides(C.LoomConfig(), overrides), 2)
        assert message in str(e.value) and "\n" not in str(e.value)


CHECKPOINT_LAYOUTS = {  # name: (world, layout, [moe] options)
    name: (*LAYOUTS[name], {})
    for name in ("tp2", "tp2 ep2", "ep2 zero2", "hybrid dp2x2 ep2 zero1", "dp4 ep2 zero3")
} | {
    f"{name} split": (world, layout | SPLIT, moe_kw)
    for name, (world, layout, moe_kw) in SPLIT_LAYOUTS.items()
    if name in ("tp2 shared", "tp2 ep2", "tp2 ep2 zero1", "tp2 sp ep2 zero3")
}


@pytest.mark.parametrize("name", list(CHECKPOINT_LAYOUTS))
def test_moe_checkpoint_reads_back_whole(pools, tmp_path, name):
    """Saved under tp (experts whole on each tp rank, or split there; under ep, E/ep per rank) or ZeRO x
    ep (expert shards spread over their edp group): every tensor of the checkpoint reads back as the
    single-device state the ranks gather."""
    from loom.checkpoint import CheckpointReader

    world, layout, moe_kw = CHECKPOINT_LAYOUTS[name]
    results = pools(world).run(
        train_layout, layout, 1, BATCH, MICRO, MOE, moe_kw=moe_kw, checkpoint_dir=str(tmp_path)
    )
    state = next(r["state"] for r in results if r["state"] is not None)
    with CheckpointReader(tmp_path) as reader:
        for k, v in state.items():
            if k != "output.weight":  # tied to the embedding
                assert torch.equal(reader.read(f"model.{k}"), v), k
