"""The planner's pricing of ``parallel.expert_tp = "split"`` (an MoE's experts cut over tp as the dense
MLP, Megatron-Core's expert tensor parallelism = tp) beside ``replicate`` (whole on every tp rank):
states, activations, compute, tensor- and expert-parallel communication, the search and published rows."""

from __future__ import annotations

import dataclasses
import re

import pytest

from loom.config import LoomConfig, ModelConfig
from loom.plan.cost import CostModel, Layout, PlanError, Workload
from loom.plan.hardware import ClusterSpec, Machine
from loom.plan.published import compare_published, load_file
from tests.helpers import tiny_model

MOE = dict(n_experts=4, top_k=2)
H100 = ClusterSpec.single_node("h100-sxm", 8)
SEQ = 32


def _cm(stack: str = "", **work) -> CostModel:
    w = dict(precision="bf16", moe_shared=1) | work
    return CostModel(tiny_model(**MOE), Workload(8, SEQ, **w), H100, stack=stack)


def _split(lay: Layout) -> Layout:
    return dataclasses.replace(lay, expert_tp="split")


def test_a_layout_line_names_split_experts_and_reads_them_back():
    lay = Layout.parse("dp2 tp4 ep2 zero1 sp etp mb1")
    assert lay.expert_tp == "split" and Layout.parse(lay.spec()) == lay
    assert lay.short().endswith(" etp") and "etp" not in Layout(tp=4, ep=2).short()


@pytest.mark.parametrize("zero,dp_shard", [(0, 1), (1, 2)])
def test_split_experts_hold_a_tp_th_of_the_expert_states(zero, dp_shard):
    """Routed experts E/ep per rank and the shared ones, cut over t = 2: weights and gradients
    W·(L·3hf·E/ep + L·3hSf)·(1 - 1/t) less (G alike), the optimizer state as much over its ZeRO
    groups (experts: dp·cp/ep ranks, shared experts with the dense ones); the peak drops with them."""
    cm, t, ep = _cm(), 2, 2
    rep = Layout(dp=2, dp_shard=dp_shard, tp=t, ep=ep, zero=zero, sp=True)
    a, b = cm.state_memory(rep), cm.state_memory(_split(rep))
    L, pc = cm.model.n_layers, cm.params
    routed, shared = L * pc.mlp / ep, L * pc.shared
    n = dp_shard if zero else 1
    n_e = cm.expert_group(n, ep, t) if zero else 1
    assert a["weights"] - b["weights"] == pytest.approx(cm.W * (routed + shared) * (1 - 1 / t))
    assert a["gradients"] - b["gradients"] == pytest.approx(cm.G * (routed + shared) * (1 - 1 / t))
    assert a["optimizer"] - b["optimizer"] == pytest.approx(cm.O * (routed / n_e + shared / n) * (1 - 1 / t))
    assert cm.memory(_split(rep))[0] < cm.memory(rep)[0]
    dense = Layout(dp=2, tp=t, sp=True)  # no experts: nothing to split
    plain = CostModel(tiny_model(), Workload(8, SEQ), H100)
    assert plain.state_memory(dense) == plain.state_memory(_split(dense))


def test_split_experts_save_the_groups_rows_at_a_tp_th_of_the_width():
    """Per MoE layer: without sp those of experts whole on every rank with f -> f/t (every rank routes
    all T tokens), the rows returned and weighted (2 B_a k h each) for its 1/t of them under ep; with
    sp the same plus the gathered input B_a T h in place of the norm's output shard B_a T h / t
    (experts whole: the rank's T/t tokens at f)."""
    from loom.plan.cost.memory import layer_saved, moe_activation, moe_saved

    cm, t, ep = _cm(), 2, 2
    T, B, h, f, k = SEQ, cm.act_bytes, cm.model.dim, cm.ffn, cm.top_k
    whole = moe_activation(cm, T, ep)
    narrow = T * k * 4 * B * (f - f / t) + T * 4 * B * cm.train.moe_shared * (f - f / t)  # SwiGLU, shared
    narrow += 2 * B * k * h * T * (1 - 1 / t)  # the other tp ranks' tokens' rows return there
    assert moe_saved(cm, t, False, T, ep, "split") == pytest.approx(whole - narrow)
    assert moe_saved(cm, t, True, T, ep, "split") == pytest.approx(whole - narrow + B * T * h * (1 - 1 / t))
    assert moe_saved(cm, t, True, T, ep) == moe_activation(cm, T / t, ep)  # replicate: unchanged
    for sp in (False, True):
        rep, split = (
            layer_saved(cm, t, sp, 1, 1, ep=ep),
            layer_saved(cm, t, sp, 1, 1, ep=ep, expert_tp="split"),
        )
        assert split[0] - rep[0] == pytest.approx(
            moe_saved(cm, t, sp, T, ep, "split") - moe_saved(cm, t, sp, T, ep)
        )


def test_split_experts_run_the_groups_rows_at_a_tp_th_of_the_width(monkeypatch):
    """Expert GEMMs on a tp rank: whole, the rank's T_r·k/(E/ep) rows per expert at f (T_r = T/t with
    sp, else T); split, the tp group's T·k/(E/ep) at f/t, shared experts at S·f/t on T; the router on
    the tokens the rank routes (split: all T). Without sp, split computes 1/t of replicate's FLOPs."""
    calls: list[tuple[float, float, float]] = []
    real = Machine.gemm

    def gemm(self, m, k, n, *a, **kw):
        calls.append((m, k, n))
        return real(self, m, k, n, *a, **kw)

    monkeypatch.setattr(Machine, "gemm", gemm)
    cm, t, ep = _cm(), 2, 2
    h, f, E, k = cm.model.dim, cm.ffn, cm.n_experts, cm.top_k
    per_expert = SEQ * k / (E / ep)
    for sp, etp, rows, width, routed in (
        (False, "replicate", per_expert, f, SEQ),
        (True, "replicate", per_expert / t, f, SEQ / t),
        (False, "split", per_expert, f / t, SEQ),
        (True, "split", per_expert, f / t, SEQ),
    ):
        calls.clear()
        cm._microbatch_times(t, sp, 1, ep, 1, "none", 1, 0, "allgather", False, (), etp)
        assert (rows, h, width) in calls and (rows, width, h) in calls, (sp, etp)
        assert (routed, h, E) in calls and (
            SEQ if etp == "split" else routed,
            h,
            f / (t if etp == "split" else 1),
        ) in calls
    monkeypatch.setattr(Machine, "gemm", real)
    times = {
        etp: cm.estimate(Layout(dp=2, tp=t, ep=ep, expert_tp=etp)).time_breakdown
        for etp in ("replicate", "split")
    }
    assert times["split"]["compute"] < times["replicate"]["compute"]


def test_split_experts_tensor_parallel_calls_are_the_formulas():
    """Per MoE layer and micro-batch, S = T h B_a: without sp the dense layer's 4 all-reduces of S (5
    recomputed: the MoE's forward sum is not); with sp the attention's 3 all-gathers + 2 reduce-scatters
    and the experts' 2 + 2 (the sequence gathered before the router, the partial outputs
    reduce-scattered; backward the reverse), each sublayer's forward again under full recomputation
    but the MoE's exit; and once, in backward, an all-reduce of the routing weights' gradient (4 T k
    bytes, fp32: each rank's from its partial rows); no MoE gradient summed over tp. Whole experts
    (replicate) issue only the attention's calls. Per step (tp_payload): split moves 2 all-gathers and
    2 reduce-scatters of S per layer and micro-batch more than replicate+sp, one all-reduce of the
    weights more (tests/test_moe.py measures both)."""
    cm, t = _cm(), 2
    T = SEQ
    S = T * cm.model.dim * cm.act_bytes
    w = T * cm.top_k * 4.0  # the routing weights (fp32)
    layer = {  # (sp, recompute) -> calls of the layer
        (False, "none"): {("all_reduce", S): 4, ("all_reduce", w): 1},
        (False, "full"): {("all_reduce", S): 5, ("all_reduce", w): 1},
        (True, "none"): {("all_gather", S): 5, ("reduce_scatter", S): 4, ("all_reduce", w): 1},
        (True, "full"): {("all_gather", S): 7, ("reduce_scatter", S): 5, ("all_reduce", w): 1},
    }
    for (sp, rec), want in layer.items():
        assert cm.tp_calls(t, sp, rec, 1, "layer", 1, "split") == want
    assert cm.tp_calls(t, True, "none", 1, "layer") == {("all_gather", S): 3, ("reduce_scatter", S): 2}
    L, pc = cm.model.n_layers, cm.params
    moe = L * (pc.router + pc.shared + pc.mlp / 2)  # replicate+sp: this rank's shard of every MoE gradient
    assert (
        cm.tp_partial_params(t, True, 1, True, 2) - cm.tp_partial_params(t, True, 1, True, 2, "split") == moe
    )
    assert cm.tp_partial_params(t, False, 1, True, 2, "split") == 0
    lay = Layout(dp=2, tp=t, ep=2, sp=True, micro_batch=2)
    m = cm.train.global_batch // (lay.dp * lay.micro_batch)
    S2 = 2 * S  # micro-batch 2
    payload = cm.tp_payload(_split(lay))
    # under ep the received rows are pooled over tp: R = k·S each way, and the peers' counts (8 E t)
    R2, counts = cm.top_k * S2, 8.0 * cm.n_experts * t
    pooled = m * L * (2 * R2 + counts)
    assert payload["all_gather"] == m * (5 * L + 1 + 2) * S2 + pooled  # layers, embedding, head input
    assert payload["reduce_scatter"] == m * (4 * L + 1 + 1) * S2 + m * L * 2 * R2
    assert payload["all_gather"] - cm.tp_payload(lay)["all_gather"] == m * L * 2 * S2 + pooled
    assert payload["all_reduce"] - cm.tp_payload(lay)["all_reduce"] == m * L * 2 * w
    calls = cm.collective_calls(_split(lay))
    assert calls["all_gather"] == m * (5 * L + 3 + 3 * L) and calls["reduce_scatter"] == m * (
        4 * L + 2 + 2 * L
    )
    assert calls["all_reduce"] - cm.collective_calls(lay)["all_reduce"] == m * L
    assert calls["all_to_all"] == cm.collective_calls(lay)["all_to_all"] == m * L * 5


def test_a_stack_gathering_the_routed_rows_moves_them_over_tp_and_only_its_shard_over_ep(monkeypatch):
    """Megatron-Core (``Stack.etp_gathers_rows``): each rank routes its own sequence shard (its router
    gradient summed over tp) and dispatches its T/t·k rows over ep, as with experts whole; the tp group
    then all-gathers the rows it received and reduce-scatters the outputs, 2 + 2 of R = k·S per layer
    (shared experts: the dense MLP's 3 + 2 of S). Loom's split sends its 1/t of the tp group's rows too."""
    cm, t, ep = _cm("megatron-core", moe_shared=0), 2, 2
    S = SEQ * cm.model.dim * cm.act_bytes
    R = cm.top_k * S
    assert cm.tp_calls(t, True, "none", 1, "layer", 1, "split") == {
        ("all_gather", S): 3,
        ("reduce_scatter", S): 2,
        ("all_gather", R): 2,
        ("reduce_scatter", R): 2,
    }
    shared = _cm("megatron-core", moe_shared=1)
    assert shared.tp_calls(t, True, "full", 1, "layer", 1, "split") == {
        ("all_gather", S): 4 + 4,
        ("reduce_scatter", S): 3 + 3,
        ("all_gather", R): 3,
        ("reduce_scatter", R): 3,
    }
    seq = cm.tp_partial_params(t, True, 1, True, ep, "split") - cm.model.n_layers * cm.params.router
    assert seq == _cm(moe_shared=0).tp_partial_params(t, True, 1, True, ep, "split")
    sizes: list[float] = []
    real = Machine.collective

    def collective(self, op, n, size, *a, **kw):
        if op == "all_to_all":
            sizes.append(size)
        return real(self, op, n, size, *a, **kw)

    monkeypatch.setattr(Machine, "collective", collective)
    row = cm.top_k * cm.model.dim * cm.act_bytes
    for model, etp, tokens in (
        (cm, "replicate", SEQ / t),
        (cm, "split", SEQ / t),
        (_cm(moe_shared=0), "split", SEQ / t),
    ):
        sizes.clear()
        model._microbatch_times(t, True, 1, ep, 1, "none", 1, 0, "allgather", False, (), etp)
        assert set(sizes) == {tokens * row}, (model.stack.name, etp)


def test_the_search_ranks_split_experts_only_for_moe_under_tp():
    """MoE under tp: both expert layouts ranked (tp 1: replicate only); with a capacity factor sp
    stays out but for split experts (they route the tp group's whole sequences); a model whose experts
    whole do not fit at tp 8 is planned with them split."""
    from loom.plan.search import search

    cfg = tiny_model(**MOE, max_seq_len=64)
    free = search(cfg, Workload(16, 64), H100, 8)
    assert {e.layout.expert_tp for e in free.ranked if e.layout.tp > 1} == {"replicate", "split"}
    assert {e.layout.expert_tp for e in free.ranked if e.layout.tp == 1} == {"replicate"}
    capped = search(cfg, Workload(16, 64, capacity_factor=1.25), H100, 8)
    sp = [e.layout for e in capped.ranked if e.layout.tp > 1 and e.layout.sp]
    assert sp and all(lay.expert_tp == "split" and lay.cp == 1 for lay in sp)
    mixtral = ModelConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000, n_experts=8, top_k=2
    )
    two_nodes = ClusterSpec.single_node("h100-sxm", 8, 2)
    best = search(mixtral, Workload(64, 4096), two_nodes, 16, fixed={"tp": 8, "pp": 1})
    assert best.ranked and all(e.layout.expert_tp == "split" for e in best.ranked)
    assert best.rejected["model states alone exceed device memory"] > 0


def test_the_search_plans_whole_experts_under_a_tp_that_does_not_divide_their_width():
    """Experts whole on every tp rank need no width tp divides (loom.rules): an MoE of hidden size 99
    is planned at tp 2 with its experts whole, never split; a dense model of that width is not."""
    from loom.plan.search import search

    odd = search(tiny_model(**MOE, ffn_dim=99, multiple_of=1, max_seq_len=64), Workload(16, 64), H100, 4)
    tp2 = {e.layout.expert_tp for e in odd.ranked if e.layout.tp == 2}
    assert tp2 == {"replicate"}
    dense = search(tiny_model(ffn_dim=99, multiple_of=1, max_seq_len=64), Workload(16, 64), H100, 4)
    assert dense.ranked and all(e.layout.tp == 1 for e in dense.ranked)


def test_megatron_overlaps_are_refused_for_loom_s_own_layouts():
    """tp-overlap / ep-overlap are priced for published Megatron-Core runs; loom train runs neither."""
    from loom.plan.cost.check import OVERLAP_REFUSED

    cm = _cm()
    assert cm.refused(Layout(dp=2, tp=2, ep=2, sp=True)) is None
    assert cm.refused(Layout(dp=2, tp=2, ep=2, sp=True, tp_overlap=True)) == OVERLAP_REFUSED
    assert cm.refused(Layout(dp=2, tp=2, ep=2, sp=True, ep_overlap=True)) == OVERLAP_REFUSED


def test_the_layout_rules_see_the_expert_layout():
    """refused() passes expert_tp to loom.rules: split needs experts; a capacity factor under sp is
    refused for experts whole (each rank routes a shard), not split; folding and split exclude each other."""
    dense = CostModel(tiny_model(), Workload(8, SEQ), H100)
    assert "parallel.expert_tp: 'split'" in (dense.refused(Layout(dp=4, tp=2, expert_tp="split")) or "")
    capped = _cm(capacity_factor=1.25)
    lay = Layout(dp=4, tp=2, sp=True)
    assert "moe.capacity_factor" in (capped.refused(lay) or "") and capped.refused(_split(lay)) is None
    folded = CostModel(tiny_model(**MOE), Workload(8, SEQ, expert_folding=True), H100, stack="megatron-core")
    assert "exclude each other" in (folded.check(Layout(dp=4, tp=2, sp=True, expert_tp="split")) or "")


def test_parallel_auto_writes_the_expert_layout():
    from loom.plan.auto import AUTO_FIELDS, _to_config

    cfg = LoomConfig()
    _to_config(cfg, Layout(tp=2, expert_tp="split"))
    assert AUTO_FIELDS["expert_tp"] == "parallel.expert_tp" and cfg.parallel.expert_tp == "split"


ROW = (
    "[models.m]\ndim = 1024\nn_layers = 4\nn_heads = 16\nn_kv_heads = 4\nffn_dim = 512\n"
    "vocab_size = 32000\nn_experts = 16\ntop_k = 2\n[[runs]]\nname = 'r'\nmodel = 'm'\nstack = '{stack}'\n"
    "cluster = {{ device = 'h100-sxm' }}\nlayout = '{layout}'\nglobal_batch = 64\nseq_len = 1024\n"
    "{etp}tokens_per_s_per_gpu = 1000\nsource = 'test'\n"
)


@pytest.mark.parametrize(
    "stack,etp,layout,split",
    [
        ("nemo", 4, "dp2 tp4 ep2 zero1 sp", True),  # expert_tensor_parallel = tp
        ("loom", 4, "dp2 tp4 ep2 zero1 sp", True),  # Loom's own split experts
        ("nemo", None, "dp2 tp4 ep2 zero1 sp", True),  # Megatron-Core's default: tp
        ("torchtitan", None, "dp2 tp4 ep2 zero1 sp", False),  # other stacks: the layout line's
        ("torchtitan", None, "dp2 tp4 ep2 zero1 sp etp", True),
        ("nemo", None, "dp8 ep2 zero1", False),  # tp 1: nothing to split
    ],
)
def test_a_published_row_splits_experts_at_expert_tensor_parallel_tp(tmp_path, stack, etp, layout, split):
    path = tmp_path / "runs.toml"
    path.write_text(
        ROW.format(stack=stack, layout=layout, etp="" if etp is None else f"expert_tensor_parallel = {etp}\n")
    )
    (row,) = compare_published(load_file(path))
    assert (row.run.layout.expert_tp == "split") == split and not row.run.workload.expert_folding
    cm = CostModel(row.run.model, row.run.workload, row.run.cluster, stack=row.run.stack)
    assert row.estimate.step_time == cm.estimate(row.run.layout).step_time


@pytest.mark.parametrize(
    "etp,layout,says",
    [
        (
            2,
            "dp2 tp4 ep2 zero1 sp",
            "must be 1 (Megatron-Core's MoE parallel folding) or the layout's tp = 4 (experts split over tp), got 2",
        ),
        (8, "dp2 tp4 ep2 zero1 sp", "or the layout's tp = 4"),
        (1, "dp2 tp4 ep2 zero1 sp etp", "1 folds an MoE's experts, but the layout splits them (etp)"),
    ],
)
def test_a_published_rows_other_expert_tensor_parallel_is_one_line(tmp_path, etp, layout, says):
    path = tmp_path / "runs.toml"
    path.write_text(ROW.format(stack="nemo", layout=layout, etp=f"expert_tensor_parallel = {etp}\n"))
    with pytest.raises(PlanError, match=r"run 'r': expert_tensor_parallel: .*" + re.escape(says)) as e:
        load_file(path)
    assert "\n" not in str(e.value)


def test_the_dgx_cloud_grok_rows_are_priced_split_and_fit_where_they_ran():
    """Grok-1 on NeMo (expert_tensor_parallel unset: Megatron-Core's tp4): experts split, so every row
    fits its 80 GiB (whole on each tp rank they were priced at about 100 GiB on 512 GPUs)."""
    from pathlib import Path

    rows = [
        c
        for c in compare_published(
            load_file(Path(__file__).resolve().parents[1] / "benchmarks" / "heldout" / "dgxc_h100.toml")
        )
        if "Grok" in c.run.name
    ]
    assert len(rows) == 3
    for c in rows:
        assert c.run.layout.expert_tp == "split" and c.estimate.fits, c.run.name
        whole = CostModel(c.run.model, c.run.workload, c.run.cluster, stack=c.run.stack)
        assert whole.memory(dataclasses.replace(c.run.layout, expert_tp="replicate"))[0] > c.estimate.memory


def test_experts_whose_rows_are_not_16_byte_multiples_are_priced_as_the_padded_batch():
    """An expert slice whose width is not a 16-byte multiple (ffn 96 in bf16 cut over tp 4: 24 x 2 = 48
    bytes is one; ffn 100 over 4: 25 x 2 = 50 bytes is not) runs the padded batched
    matmul (loom.model.moe.grouped_mm_aligned), so its activations are the padded batch's, as on a
    device without torch._grouped_mm."""
    from loom.plan.cost.memory import moe_activation

    def saved(ffn: int, grouped_mm: tuple[str, ...]) -> float:
        cluster = dataclasses.replace(H100, device=dataclasses.replace(H100.device, grouped_mm=grouped_mm))
        cm = CostModel(tiny_model(**MOE, ffn_dim=ffn), Workload(8, SEQ, precision="bf16"), cluster)
        return moe_activation(cm, SEQ, 1, cut=4)

    assert saved(96, ("bf16",)) != saved(96, ())  # aligned: the grouped matmul
    assert saved(100, ("bf16",)) == saved(100, ())  # 25 bf16 = 50 bytes: padded as without it
