"""Context parallelism in its three modes (allgather, ring, alltoall): the load-balanced token split,
the block kernels, training under cp (alone and with recomputation, dp, ZeRO-3, tp + sp, pp, ep;
packed documents) equal to one process, bytes sent, calls and saved activations equal to the
formulas, the planner's modes, and dropout under cp."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from tests.dist import get_mesh
from tests.helpers import SEQ, one_thread, tiny_model, tiny_train, train_dp, train_layout  # noqa: F401 (fixture)

BATCH, MICRO, STEPS = 8, 4, 8
TOL = dict(rtol=1e-4, atol=5e-5)  # sums over keys split across ranks round differently over AdamW steps
pytestmark = pytest.mark.usefixtures("one_thread")


def test_local_positions_pair_an_early_and_a_late_chunk():
    from loom.parallel.context.parallelize import local_positions

    assert local_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([local_positions(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    # causal work (keys at or before each query) is the same on every rank
    work = [int((local_positions(24, 3, r) + 1).sum()) for r in range(3)]
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="divisible by 2\\*cp"):
        local_positions(10, 3, 0)


MODES = ("allgather", "ring", "alltoall")
LAYOUTS = {
    "cp2": (2, {"cp": 2}),
    "cp2 recompute": (2, {"cp": 2, "recompute": "full"}),
    "cp2 x dp2": (4, {"cp": 2, "dp_replicate": 2}),
    "cp2 x dp2 zero3": (4, {"cp": 2, "dp_shard": 2, "zero": 3}),
    "cp2 x tp2 sp": (4, {"cp": 2, "tp": 2, "sp": True}),
    "pp2 x cp2": (4, {"cp": 2, "pp": 2}),
    "cp4": (4, {"cp": 4}),
}
# Every mode in every layout would cost ~5 min; each layout runs the modes it exercises differently
# (the ring's p2p beside pp's p2p and ZeRO-3's gathers; alltoall's heads split again by tp), every
# mode runs cp2, cp4 and recomputation.
CASES = [(n, m) for n in ("cp2", "cp2 recompute", "cp4") for m in MODES] + [
    ("cp2 x dp2", "ring"),
    ("cp2 x dp2 zero3", "ring"),
    ("cp2 x dp2 zero3", "alltoall"),
    ("cp2 x tp2 sp", "alltoall"),
    ("cp2 x tp2 sp", "ring"),
    ("pp2 x cp2", "ring"),
    ("pp2 x cp2", "allgather"),
    ("cp2 x dp2", "allgather"),
]


@pytest.fixture(scope="module")
def reference():
    return train_dp(None, tiny_model(), tiny_train(steps=STEPS), BATCH, MICRO)


@pytest.mark.parametrize("name,mode", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_context_parallel_equals_single_process(pools, reference, name, mode):
    world, layout = LAYOUTS[name]
    results = pools(world).run(train_layout, layout | {"cp_mode": mode}, STEPS, BATCH, MICRO)
    for r in results:
        assert_close(
            torch.tensor(r["losses"]), torch.tensor(reference["losses"]), **TOL, msg=lambda m: f"{name}: {m}"
        )
    for r in results:
        if r["state"] is not None:
            for k, v in reference["state"].items():
                assert_close(r["state"][k], v, **TOL, msg=lambda m, k=k: f"{name} {k}: {m}")


BYTES_CASES = (
    [("cp2", m) for m in MODES]
    + [("cp2 recompute", m) for m in MODES]
    + [("cp4", "ring"), ("cp4", "alltoall")]
)


@pytest.mark.parametrize("name,mode", BYTES_CASES, ids=[f"{n}-{m}" for n, m in BYTES_CASES])
def test_context_parallel_bytes_equal_formula(pools, name, mode):
    """Per step and rank, the bytes of the mode's collectives or sends equal :func:`cp_comm_bytes`
    (allgather: K/V all-gathers and dK/dV reduce-scatters; ring: K/V and fp32 dK/dV sends;
    alltoall: q, k, v, output exchanges and their gradients), the forward's again when recomputed."""
    from loom.parallel.context.parallelize import cp_comm_bytes, cp_layer_bytes

    world, layout = LAYOUTS[name]
    cp, cfg = layout["cp"], tiny_model()
    kv, q = cfg.n_kv_heads * cfg.head_dim, cfg.n_heads * cfg.head_dim
    full = layout.get("recompute") == "full"
    total = cp_comm_bytes(MICRO, SEQ, kv, cfg.n_layers, cp, 4, BATCH // MICRO, full, mode, q, cfg.head_dim)
    fwd, bwd = cp_layer_bytes(MICRO, SEQ, kv, cp, 4, mode, q, cfg.head_dim)
    assert total == (fwd * (1 + full) + bwd) * cfg.n_layers * BATCH // MICRO > 0
    kinds = {"allgather": ("all_gather", "reduce_scatter"), "ring": ("send",), "alltoall": ("all_to_all",)}[
        mode
    ]
    for r in pools(world).run(train_layout, layout | {"cp_mode": mode}, 2, BATCH, MICRO):
        for moved in r["moved"]:
            assert sum(moved.get(k, 0) for k in kinds) == total
            if mode == "allgather":
                assert moved["reduce_scatter"] == total // (3 if full else 2)


CALL_CASES = [
    ("cp2", "allgather"),
    ("cp2 recompute", "allgather"),
    ("cp2 x dp2", "allgather"),
    ("cp2 x dp2 zero3", "allgather"),
    ("cp2 recompute", "ring"),
    ("cp4", "ring"),
    ("cp2 recompute", "alltoall"),
    ("cp2 x dp2 zero3", "alltoall"),
]


@pytest.mark.parametrize("name,mode", CALL_CASES, ids=[f"{n}-{m}" for n, m in CALL_CASES])
def test_collective_calls_equal_the_planners(pools, name, mode):
    """Per step, per layer and micro-batch: allgather 2 K/V all-gathers (4 with full recomputation)
    and 2 dK/dV reduce-scatters; ring cp-1 K/V sends per forward and backward, cp dK/dV sends;
    alltoall 4 all-to-alls per forward and backward; plus the data-parallel reduction over dp x cp:
    what the cost model charges."""
    from loom.plan.cost import CostModel, Layout, Workload
    from loom.plan.hardware import ClusterSpec

    world, layout = LAYOUTS[name]
    planner = CostModel(
        tiny_model(), Workload(BATCH, SEQ, precision="fp32"), ClusterSpec.single_node("cpu", world)
    )
    dp = layout.get("dp_replicate", 1) * layout.get("dp_shard", 1)
    expected = planner.collective_calls(
        Layout(
            dp=dp,
            dp_shard=layout.get("dp_shard", 1),
            cp=layout["cp"],
            zero=layout.get("zero", 0),
            micro_batch=MICRO,
            cp_mode=mode,
            recompute=layout.get("recompute", "none"),
        )
    )
    for r in pools(world).run(train_layout, layout | {"cp_mode": mode}, 2, BATCH, MICRO):
        assert r["calls"] == [expected] * 2


def test_planner_models_each_mode_and_picks_per_layout():
    """At T = 128k over cp = 8 (a 7B-shaped model, GQA 8 kv heads): the planner's activation bytes of
    a layer are the module formulas' (allgather keeps 2·T·kd·B_a of K/V, ring 2·(T/cp)·kd·B_a,
    alltoall its repeated heads and its own output too), the ring's exposed communication is what
    is left over from the overlapped blocks, and the search ranks every mode, choosing one that fits."""
    import dataclasses

    from loom.config import ModelConfig
    from loom.plan.cost import CostModel, Layout, Workload
    from loom.plan.hardware import ClusterSpec
    from loom.plan.search import search

    mc = ModelConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256, max_seq_len=131072
    )
    s, cp, B = 131072, 8, 2
    cm = CostModel(mc, Workload(8, s, precision="bf16"), ClusterSpec.single_node("h100-sxm", 8, 8))
    acts = {m: cm.layer_activation(Layout(cp=cp, cp_mode=m))[0] for m in ("allgather", "ring", "alltoall")}
    T, kd, h = s // cp, 8 * 128, 4096
    assert acts["allgather"] - acts["ring"] == 2 * B * T * (cp - 1) * kd
    assert acts["alltoall"] - acts["ring"] == 2 * B * T * kd * (cp // 8 - 1) + B * T * h
    assert acts["ring"] < acts["alltoall"] < acts["allgather"]
    ring = Layout(dp=8, cp=cp, cp_mode="ring")
    assert Layout.parse(ring.spec()) == ring and "cp8:ring" in ring.spec()
    result = search(mc, Workload(8, s, precision="bf16"), ClusterSpec.single_node("h100-sxm", 8, 8))
    assert result.rejected["cp_mode: another mode of the layout is faster (micro-batch 1)"] > 0
    best = result.ranked[0].layout
    assert best.cp > 1 and best.cp_mode in ("ring", "alltoall"), best.spec()
    for mode in ("allgather", "ring", "alltoall"):  # the mode ranked beats the others at micro-batch 1
        one = dataclasses.replace(best, micro_batch=1, recompute="none")
        other, chosen = cm.estimate(dataclasses.replace(one, cp_mode=mode)), cm.estimate(one)
        assert not other.fits or not chosen.fits or other.step_time >= chosen.step_time


def _saved_per_layer(cp: int, mode: str) -> tuple[dict, int]:
    from loom.config import LoomConfig
    from loom.memory.activations import activation_bytes_per_layer, measure_layer_bytes
    from loom.model.llama import build_model
    from loom.parallel.context.parallelize import apply_context_parallel, shard_sequence

    mesh = get_mesh(cp=cp)
    cfg = LoomConfig(model=tiny_model())
    cfg.data.seq_len, cfg.parallel.cp, cfg.parallel.cp_mode = SEQ, cp, mode
    model = build_model(cfg.model, 0)
    apply_context_parallel(model, mesh, mode=mode, seq_len=SEQ)
    x = torch.randint(0, cfg.model.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    ((local, _),) = shard_sequence([(x, x)], cp, mesh.local_rank("cp"))
    return measure_layer_bytes(model, local), activation_bytes_per_layer(
        cfg.model, 2, SEQ, cp=cp, cp_mode=mode
    )


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_saved_activations_per_layer_equal_formula(pools, cp, mode):
    """Each layer saves its s/cp tokens' activations plus keys and values: the whole sequence's
    (allgather), the local ones (ring), the whole sequence's for 1/cp of the heads (alltoall)."""
    for per_layer, formula in pools(cp).run(_saved_per_layer, cp, mode):
        assert set(per_layer.values()) == {formula}


def test_bad_context_parallel_configs_fail_in_one_line():
    from loom import config as C

    for overrides, message in [
        (
            ["--parallel.cp", "2", "--data.seq_len", "30", "--model.max_seq_len", "64"],
            "divisible by 2*parallel.cp=4",
        ),
        (
            [
                "--parallel.cp",
                "2",
                "--parallel.cp_mode",
                "alltoall",
                "--model.n_heads",
                "3",
                "--model.n_kv_heads",
                "3",
                "--model.dim",
                "48",
            ],
            "parallel.cp_mode: alltoall splits the 3 query heads",
        ),
    ]:
        cfg = C.apply_overrides(C.LoomConfig(), overrides)
        with pytest.raises(C.ConfigError) as e:
            C.validate(cfg, 2)
        assert message in str(e.value) and "\n" not in str(e.value)


PACKED_CASES = [("cp2", m) for m in MODES] + [
    ("cp2 recompute", "ring"),
    ("cp4", "ring"),
    ("cp4", "allgather"),
]


@pytest.fixture(scope="module")
def packed_reference():
    return train_dp(None, tiny_model(), tiny_train(steps=STEPS), BATCH, MICRO, packed=True)


@pytest.mark.parametrize("name,mode", PACKED_CASES, ids=[f"{n}-{m}" for n, m in PACKED_CASES])
def test_packed_documents_equal_single_process(pools, packed_reference, name, mode):
    """Packed documents (several per sequence, positions restarting at each): attention stays inside
    documents across the cp ranks (the keys' document ids travel with K/V), RoPE by each token's
    position: losses and weights equal one process on the whole packed sequence."""
    world, layout = LAYOUTS[name]
    results = pools(world).run(train_layout, layout | {"cp_mode": mode}, STEPS, BATCH, MICRO, packed=True)
    for r in results:
        assert_close(torch.tensor(r["losses"]), torch.tensor(packed_reference["losses"]), **TOL)
        for k, v in packed_reference["state"].items():
            assert_close(r["state"][k], v, **TOL, msg=lambda m, k=k: f"{name} {k}: {m}")


def test_document_ids_of_the_whole_sequence_from_each_ranks_own(pools):
    """Each rank's ids from cumsum(positions == 0) over its own two chunks, corrected by the other
    chunks' document starts (one all-gather of counts), equal cumsum over the whole sequence."""
    for ok in pools(4).run(_global_docs_match, 4):
        assert ok


def _global_docs_match(cp: int) -> bool:
    from loom.parallel.context.blocks import global_docs
    from loom.parallel.context.parallelize import shard_sequence
    from tests.helpers import packed_global_batch

    mesh = get_mesh(cp=cp)
    _, _, positions = packed_global_batch(0, 3)
    ((mine,),) = shard_sequence([(positions,)], cp, mesh.local_rank("cp"))
    ((want,),) = shard_sequence([((positions == 0).cumsum(1),)], cp, mesh.local_rank("cp"))
    got = global_docs((mine == 0).cumsum(1), mesh.group("cp"), mesh.local_rank("cp"), cp)
    return bool(torch.equal(got, want))


DROP = {"dropout": 0.1}


def test_dropout_under_cp_is_private_per_rank_and_replayable(pools):
    """Dropout with cp: each rank's blocks draw from their own generator (different masks on the
    same draw), and the same draw again replays the same masks."""
    for mine, again, theirs in pools(2).run(_private_draws):
        assert torch.equal(mine, again) and not torch.equal(mine, theirs)


def _private_draws():
    import torch.distributed as dist

    from loom.parallel.context.parallelize import CpPrivateRng

    mesh = get_mesh(cp=2)
    draw = torch.nn.Dropout(0.5)  # a module drawing its mask from the default generator
    CpPrivateRng(mesh.local_rank("cp"), torch.device("cpu")).attach(draw)
    torch.manual_seed(3)  # the default generator alike on every rank, as train.seed makes it
    state = torch.get_rng_state()
    mine = draw(torch.ones(64))
    torch.set_rng_state(state)
    again = draw(torch.ones(64))
    every = [torch.empty(64) for _ in range(2)]
    dist.all_gather(every, mine, group=mesh.group("cp"))
    return mine, again, every[1 - mesh.local_rank("cp")]


def _seeded_train(layout: dict, steps: int) -> dict:
    """:func:`train_layout` with dropout, the default generator seeded first (the pool's processes
    are reused, and dropout draws from it)."""
    torch.manual_seed(11)
    return train_layout(layout, steps, BATCH, MICRO, model_kw=DROP)


@pytest.fixture(scope="module")
def dropout_ring(pools):
    return pools(2).run(_seeded_train, {"cp": 2, "cp_mode": "ring"}, 4)


@pytest.mark.parametrize(
    "layout",
    [{"cp_mode": "allgather"}, {"cp_mode": "ring", "recompute": "full"}],
    ids=["allgather", "ring recompute"],
)
def test_dropout_under_cp_replays_the_same_masks(pools, dropout_ring, reference, layout):
    """With attention and residual dropout (p = 0.1): allgather draws each block's mask from the same
    seed as ring, and recomputation replays every mask, so both equal the ring run; dropout is on
    (the losses differ from the run without it)."""
    results = pools(2).run(_seeded_train, {"cp": 2} | layout, 4)
    for r, ref in zip(results, dropout_ring, strict=True):
        assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL)
        for k, v in ref["state"].items():
            assert_close(r["state"][k], v, **TOL, msg=lambda m, k=k: f"{k}: {m}")
    assert not torch.allclose(torch.tensor(dropout_ring[0]["losses"]), torch.tensor(reference["losses"][:4]))


def test_dropout_alltoall_recompute_replays(pools):
    """alltoall drops on its heads in the flash call; recomputation replays those masks too."""
    runs = [
        pools(2).run(_seeded_train, {"cp": 2, "cp_mode": "alltoall"} | extra, 3)
        for extra in ({}, {"recompute": "full"})
    ]
    for r, ref in zip(*runs, strict=True):
        assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL)
        for k, v in ref["state"].items():
            assert_close(r["state"][k], v, **TOL)


MOE = dict(n_experts=4, top_k=2)


@pytest.fixture(scope="module")
def moe_reference():
    return train_dp(None, tiny_model(**MOE), tiny_train(steps=STEPS), BATCH, MICRO)


@pytest.mark.parametrize("mode", ["ring", "alltoall"])
def test_context_parallel_with_expert_parallel_equals_single_process(pools, moe_reference, mode):
    """A MoE model, cp2 x ep2 (ep borrows the cp ranks): the experts' all-to-alls beside each cp core."""
    for r in pools(2).run(train_layout, {"cp": 2, "ep": 2, "cp_mode": mode}, STEPS, BATCH, MICRO, MOE):
        assert_close(torch.tensor(r["losses"]), torch.tensor(moe_reference["losses"]), **TOL)
        for k, v in moe_reference["state"].items():
            assert_close(r["state"][k], v, **TOL, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("fused", [True, False], ids=["cpu flash kernel", "fp32 matmuls"])
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
def test_blocks_merged_by_log_sum_exp_equal_sdpa(monkeypatch, fused, packed):
    """Attention split into key blocks (the causal diagonal blocks and an unmasked one), merged by
    log-sum-exp, and each block's backward from the merged output and lse: equal to one SDPA call
    (GQA, float64), in the CPU flash kernel and in the portable fp32 path."""
    import torch.nn.functional as F

    from loom.parallel.context import blocks

    monkeypatch.setattr(blocks, "_fused", lambda q: fused)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 8, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 1, 1]])
    mask = blocks.doc_mask(docs, docs, True, q.dtype) if packed else None
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=mask, is_causal=not packed, enable_gqa=True)
    grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref.backward(grad)
    parts = [
        (slice(0, 4), slice(0, 4), True),
        (slice(4, 8), slice(4, 8), True),
        (slice(4, 8), slice(0, 4), False),
    ]
    out, lse = torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"), dtype=q.dtype)
    masks = [blocks.doc_mask(docs[:, qs], docs[:, ks], c, q.dtype) if packed else None for qs, ks, c in parts]
    for (qs, ks, c), m in zip(parts, masks, strict=True):
        blocks.merge(
            out[:, :, qs],
            lse[:, :, qs],
            *blocks.attend(q[:, :, qs], k[:, :, ks], v[:, :, ks], c and m is None, m),
        )
    assert_close(out, ref.detach())
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (qs, ks, c), m in zip(parts, masks, strict=True):
        gq, gk, gv = blocks.attend_backward(
            grad[:, :, qs],
            q[:, :, qs],
            k[:, :, ks],
            v[:, :, ks],
            out[:, :, qs],
            lse[:, :, qs],
            c and m is None,
            m,
        )
        dq[:, :, qs] += gq
        dk[:, :, ks] += gk
        dv[:, :, ks] += gv
    for got, want in zip((dq, dk, dv), ref_in, strict=True):
        assert_close(got, want.grad)
