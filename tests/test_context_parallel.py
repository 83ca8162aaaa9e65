"""Context parallelism: the load-balanced token split, attention over the gathered sequence, and
training under cp (alone and with dp, ZeRO-3, tp + sp, pp) equal to one process."""

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
    from loom.parallel.context_parallel import local_positions

    assert local_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([local_positions(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    # causal work (keys at or before each query) is the same on every rank
    work = [int((local_positions(24, 3, r) + 1).sum()) for r in range(3)]
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="divisible by 2\\*cp"):
        local_positions(10, 3, 0)


LAYOUTS = {
    "cp2": (2, {"cp": 2}),
    "cp2 recompute": (2, {"cp": 2, "recompute": "full"}),
    "cp2 x dp2": (4, {"cp": 2, "dp_replicate": 2}),
    "cp2 x dp2 zero3": (4, {"cp": 2, "dp_shard": 2, "zero": 3}),
    "cp2 x tp2 sp": (4, {"cp": 2, "tp": 2, "sp": True}),
    "pp2 x cp2": (4, {"cp": 2, "pp": 2}),
}


@pytest.fixture(scope="module")
def reference():
    return train_dp(None, tiny_model(), tiny_train(steps=STEPS), BATCH, MICRO)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_equals_single_process(pools, reference, name):
    world, layout = LAYOUTS[name]
    results = pools(world).run(train_layout, layout, STEPS, BATCH, MICRO)
    for r in results:
        assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), **TOL, msg=lambda m: f"{name}: {m}")
    for r in results:
        if r["state"] is not None:
            for k, v in reference["state"].items():
                assert_close(r["state"][k], v, **TOL, msg=lambda m, k=k: f"{name} {k}: {m}")


@pytest.mark.parametrize("name", ["cp2", "cp2 recompute"])
def test_context_parallel_bytes_equal_formula(pools, name):
    """Per step: all-gathers of K and V forward (and in the recomputed forward), reduce-scatters of
    dK and dV backward, each B·(T/cp)·kv_width·4·(cp-1) bytes sent per rank, per layer and micro-batch."""
    from loom.parallel.context_parallel import cp_comm_bytes

    world, layout = LAYOUTS[name]
    cfg = tiny_model()
    kv = cfg.n_kv_heads * cfg.head_dim
    full = layout.get("recompute") == "full"
    fwd = cp_comm_bytes(MICRO, SEQ, kv, cfg.n_layers, 2, 4, BATCH // MICRO, recompute=full)
    for r in pools(world).run(train_layout, layout, 2, BATCH, MICRO):
        for moved in r["moved"]:
            assert moved["all_gather"] + moved["reduce_scatter"] == fwd
            assert moved["reduce_scatter"] == fwd // (3 if full else 2)


@pytest.mark.parametrize("name", ["cp2", "cp2 recompute", "cp2 x dp2", "cp2 x dp2 zero3"])
def test_collective_calls_equal_the_planners(pools, name):
    """Per step: 2 K/V all-gathers (4 with full recomputation) and 2 dK/dV reduce-scatters per layer
    and micro-batch, plus the data-parallel reduction over dp x cp: what the cost model charges."""
    from loom.plan.cost import CostModel, Layout, Workload
    from loom.plan.hardware import ClusterSpec

    world, layout = LAYOUTS[name]
    planner = CostModel(tiny_model(), Workload(BATCH, SEQ, precision="fp32"), ClusterSpec.single_node("cpu", world))
    dp = layout.get("dp_replicate", 1) * layout.get("dp_shard", 1)
    expected = planner.collective_calls(Layout(dp=dp, dp_shard=layout.get("dp_shard", 1), cp=2, zero=layout.get("zero", 0),
                                               micro_batch=MICRO, recompute=layout.get("recompute", "none")))  # fmt: skip
    for r in pools(world).run(train_layout, layout, 2, BATCH, MICRO):
        assert r["calls"] == [expected] * 2


def _saved_per_layer(cp: int) -> tuple[dict, int]:
    from loom.config import LoomConfig
    from loom.memory.activations import activation_bytes_per_layer, measure_layer_bytes
    from loom.model.llama import build_model
    from loom.parallel.context_parallel import apply_context_parallel, shard_sequence

    mesh = get_mesh(cp=cp)
    cfg = LoomConfig(model=tiny_model())
    cfg.data.seq_len, cfg.parallel.cp = SEQ, cp
    model = build_model(cfg.model, 0)
    apply_context_parallel(model, mesh, cfg)
    x = torch.randint(0, cfg.model.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    ((local, _),) = shard_sequence([(x, x)], cp, mesh.local_rank("cp"))
    return measure_layer_bytes(model, local), activation_bytes_per_layer(cfg.model, 2, SEQ, cp=cp)


@pytest.mark.parametrize("cp", [2, 4])
def test_saved_activations_per_layer_equal_formula(pools, cp):
    """Each layer saves its s/cp tokens' activations plus the whole sequence's repeated K and V."""
    for per_layer, formula in pools(cp).run(_saved_per_layer, cp):
        assert set(per_layer.values()) == {formula}


def test_bad_context_parallel_configs_fail_in_one_line():
    from loom import config as C

    for overrides, message in [
        (["--parallel.cp", "2", "--data.seq_len", "30", "--model.max_seq_len", "64"], "divisible by 2*parallel.cp=4"),
        (["--parallel.cp", "2", "--model.dropout", "0.1"], "model.dropout: context parallelism"),
    ]:
        cfg = C.apply_overrides(C.LoomConfig(), overrides)
        with pytest.raises(C.ConfigError) as e:
            C.validate(cfg, 2)
        assert message in str(e.value) and "\n" not in str(e.value)
