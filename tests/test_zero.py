"""ZeRO stages 1-3, hybrid sharding, offload: equality with one process and with FSDP2, exact
state bytes and bytes moved, overlap of communication, one-line errors for bad input.

Every multi-rank configuration runs once (module-scoped fixtures); the tests assert on its results.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from torch.testing import assert_close

from loom import config as C
from tests.dist import get_mesh
from tests.helpers import (
    ADAM_FP32_TOL,
    SEQ,
    metered_steps,
    rank_micro_batches,
    tiny_model,
    tiny_train,
    train_dp,
)

BATCH = 8
TOL = dict(rtol=1e-4, atol=1e-5)
TOL_BF16 = dict(rtol=1e-2, atol=3e-3)  # bf16-rounded gradients (8-bit mantissa), Adam-normalised, 20 steps
ELEM = 4  # fp32 bytes per element
ALIGN_ELEMS = 16 // ELEM  # shards start on 16-byte boundaries (loom.parallel.layout)

# name -> (stage, dp_replicate, dp_shard, micro, extra parallel fields, extra model fields)
WORLD2 = {
    "z1": (1, 1, 2, 2, {}, {}),  # 2 micro-batches per rank: accumulation
    "z2": (2, 1, 2, 2, {"bucket_mb": 0.01}, {}),  # several buckets, overlapped reduce-scatter
    "z3": (3, 1, 2, 2, {}, {}),
    "z3_keep_untied": (3, 1, 2, 4, {"reshard_after_forward": False}, {"tie_embeddings": False}),
    "z1_disk": (1, 1, 2, 4, {"offload": "disk"}, {}),
    "z3_disk": (3, 1, 2, 2, {"offload": "disk"}, {}),
    "z2_host": (2, 1, 2, 4, {"offload": "cpu"}, {}),
    "z3_bf16": (3, 1, 2, 4, {"reduce_dtype": "bf16"}, {}),  # gradients reduced in bf16: half the bytes
}
WORLD4 = {
    "z1": (1, 1, 4, 2, {}, {}),
    "z2": (2, 1, 4, 2, {}, {}),
    "z3": (3, 1, 4, 2, {}, {}),
    "h1": (1, 2, 2, 1, {}, {}),  # hybrid 2x2, 2 micro-batches per rank
    "h2": (2, 2, 2, 1, {}, {}),
    "h3": (3, 2, 2, 1, {}, {}),
}


def train_zero(mesh, stage: int, micro: int, par: dict, model_kw: dict, steps: int = 20, tmp: str = ""):
    """Train the tiny model with ZeRO through ``parallelize``; per-step bytes moved, final full state."""
    from loom.comm import CommMeter
    from loom.model.llama import build_model, loss_fn
    from loom.train.build import parallelize

    dp = mesh.size("dp")
    cfg = C.LoomConfig(model=tiny_model(**model_kw), train=tiny_train(steps=steps))
    cfg.parallel = replace(cfg.parallel, dp=dp, dp_shard=mesh.size("dp_shard"), zero=stage, **par)
    cfg.run.dir = tmp
    model = build_model(cfg.model, cfg.train.seed)
    meter = CommMeter()
    strategy = parallelize(model, mesh, cfg, meter).strategy
    losses, moved, calls = metered_steps(model, strategy, meter, mesh, cfg, loss_fn, steps, BATCH, micro)
    events = list(getattr(strategy, "events", []))  # the last step's, before gathering the state
    pieces = torch.stack([strategy.param_grad_shard(p).pow(2).sum() for p in model.parameters()]).sum()
    torch.distributed.all_reduce(pieces, group=mesh.group("dp_shard"))
    norms = (float(strategy.grad_sq()), float(pieces))
    state_bytes = strategy.state_bytes()
    state = (
        strategy.full_state_dict()
        if stage == 3
        else {k: v.detach().clone() for k, v in model.state_dict().items()}
    )
    out = {
        "losses": losses,
        "state": state,
        "moved": moved,
        "calls": calls,
        "bytes": state_bytes,
        "k": BATCH // dp // micro,
        "groups": [lay.numel for lay in strategy.layouts],
        "norms": norms,
    }
    if stage == 2:
        out["launches"] = [(r.params_not_ready, r.during_backward) for r in strategy.launch_log]
    if stage == 3:
        out["events"] = events
        out["units"] = [u.name for u in strategy.units]
    strategy.remove()
    return out


def _run_all(world: int, specs: dict, tmp: str) -> dict:
    results = {}
    for name, (stage, rep, shard, micro, par, model_kw) in specs.items():
        mesh = get_mesh(dp_replicate=rep, dp_shard=shard)
        results[name] = train_zero(mesh, stage, micro, par, model_kw, tmp=os.path.join(tmp, name))
    return results


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zero"))
    return {2: pools(2).run(_run_all, 2, WORLD2, tmp), 4: pools(4).run(_run_all, 4, WORLD4, tmp)}


@pytest.fixture(scope="module")
def references():
    torch.set_num_threads(1)
    return {
        tied: train_dp(None, tiny_model(tie_embeddings=tied), tiny_train(), BATCH, micro=BATCH)
        for tied in (True, False)
    }


ALL = [(2, n) for n in WORLD2] + [(4, n) for n in WORLD4]
WORLDS = {2: WORLD2, 4: WORLD4}


@pytest.mark.parametrize("world,name", [(w, n) for w, n in ALL if not WORLDS[w][n][4]])
def test_collective_calls_equal_the_planners(runs, world, name):
    """Calls per step (gathers per unit and micro-batch, one reduction per bucket or unit, hybrid
    all-reduces) are what the planner's cost model charges latency for."""
    from loom.plan.cost import CostModel, Layout, Workload
    from loom.plan.hardware import ClusterSpec

    stage, rep, shard, micro, _, model_kw = WORLDS[world][name]
    planner = CostModel(
        tiny_model(**model_kw), Workload(BATCH, SEQ, precision="fp32"), ClusterSpec.single_node("cpu", world)
    )
    expected = planner.collective_calls(Layout(dp=rep * shard, dp_shard=shard, zero=stage, micro_batch=micro))
    for r in runs[world]:
        assert r[name]["calls"] == [expected] * len(r[name]["calls"])


@pytest.mark.parametrize("world,name", ALL)
def test_equals_single_process(runs, references, world, name):
    ref = references[WORLDS[world][name][5].get("tie_embeddings", True)]
    per_rank = [r[name] for r in runs[world]]
    tol = TOL_BF16 if "bf16" in name else ADAM_FP32_TOL
    for r in per_rank:
        assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **tol)
        for k, v in ref["state"].items():
            assert_close(r["state"][k], v, **tol, msg=lambda m, k=k: f"{name} {k}: {m}")
    for r in per_rank[1:]:  # every rank (and every replica) holds the same model, bit for bit
        for k, v in per_rank[0]["state"].items():
            assert torch.equal(r["state"][k], v), f"{name} {k} differs between ranks"


def _phi_groups(world: int, name: str) -> list[int]:
    """Unpadded sizes of the flat buffers, from the model alone: one bucket holding every
    parameter (stages 1-2 with the default 25 MB buckets), or the stage-3 units (each block; the
    embedding, norm and head, merged when tied, split when not)."""
    from loom.model.llama import build_model, count_params

    stage, *_, model_kw = WORLDS[world][name]
    model = build_model(tiny_model(**model_kw), 0)
    phi = count_params(model)
    if stage < 3:
        return [phi]
    blocks = [count_params(b) for b in model.layers]
    if model.cfg.tie_embeddings:
        return blocks + [phi - sum(blocks)]
    emb = count_params(model.tok_embeddings)
    return [emb] + blocks + [phi - sum(blocks) - emb]


def _pad(n: int, shards: int) -> int:
    unit = shards * ALIGN_ELEMS
    return -(-n // unit) * unit


@pytest.mark.parametrize("world,name", ALL)
def test_state_bytes_equal_formula(runs, world, name):
    """fp32: stage 1 4Φ'+4Φ'+8Φ'/N; stage 2 4Φ'+(4Φ'+8Φ')/N; stage 3 16Φ'/N; Φ' padded per buffer."""
    stage, rep, n, _, par, _ = WORLDS[world][name]
    r = runs[world][0][name]
    groups = r["groups"] if name == "z2" and world == 2 else _phi_groups(world, name)
    assert sum(r["groups"]) == sum(groups) and len(r["groups"]) == len(groups)
    padded = sum(_pad(g, n) for g in groups)
    params = ELEM * padded if stage < 3 else ELEM * padded // n
    grads = ELEM * padded if stage == 1 else ELEM * padded // n
    expected = {"param_bytes": params, "grad_bytes": grads, "optim_bytes": 2 * ELEM * padded // n}
    expected["optim_offload_bytes"] = expected["optim_bytes"] if par.get("offload", "none") != "none" else 0
    for rr in runs[world]:
        assert {k: v for k, v in rr[name]["bytes"].items() if k != "transient_peak_bytes"} == expected
    if stage == 3 and n > 1:
        assert r["bytes"]["param_bytes"] * n == padded * ELEM  # a quarter of the model state at N = 4


def test_transient_peak_bytes(runs):
    """Beyond the persistent state, during a step: stage 1 holds one reduce-scatter output (4Φ'/N,
    one bucket); stage 2 under accumulation every full bucket gradient (4Φ', as FSDP's no_sync);
    stage 3 at least one gathered unit, at most full parameters plus full gradients (reached only
    when accumulating: the tiny model's two blocks are all gathered at once by the prefetch)."""
    z1 = runs[2][0]["z1"]
    assert z1["bytes"]["transient_peak_bytes"] == ELEM * _pad(z1["groups"][0], 2) // 2
    z2 = runs[2][0]["z2"]
    assert z2["bytes"]["transient_peak_bytes"] == ELEM * sum(_pad(g, 2) for g in z2["groups"])
    for world, name in ALL:
        if WORLDS[world][name][0] == 3:
            n, peak = WORLDS[world][name][2], runs[world][0][name]["bytes"]["transient_peak_bytes"]
            units = [_pad(g, n) for g in _phi_groups(world, name)]
            assert ELEM * max(units) <= peak <= 2 * ELEM * sum(units)
            if runs[world][0][name]["k"] == 1:  # no accumulation: never every full gradient at once
                assert peak < 2 * ELEM * sum(units)


@pytest.mark.parametrize("world,name", ALL)
def test_bytes_moved_equal_formula(runs, world, name):
    """Per rank per step (ring): stages 1-2 reduce-scatter + all-gather, Φ'b(N-1)/N each; stage 3
    k(Φ' + Φ_re')b(N-1)/N gathered + Φ'b(N-1)/N reduce-scattered; hybrid + 2(Φ'/N)b(R-1)/R."""
    stage, rep, n, _, par, _ = WORLDS[world][name]
    r = runs[world][0][name]
    groups = [_pad(g, n) for g in (r["groups"] if name == "z2" and world == 2 else _phi_groups(world, name))]
    padded, frac = sum(groups), (n - 1) / n
    if stage < 3:
        gathered = padded
    else:
        resharded = sum(groups[:-1]) if par.get("reshard_after_forward", True) else 0
        gathered = r["k"] * (padded + resharded)
    b = 2 if par.get("reduce_dtype") == "bf16" else ELEM  # bytes per reduced gradient element
    expected = {"reduce_scatter": b * padded * frac, "all_gather": ELEM * gathered * frac}
    if rep > 1:
        expected["all_reduce"] = 2 * b * (padded // n) * (rep - 1) / rep
    for rr in runs[world]:
        for step in rr[name]["moved"]:
            assert step == pytest.approx(expected)


@pytest.mark.parametrize("world,name", ALL)
def test_param_grad_shards_partition_the_norm(runs, world, name):
    """Each parameter's owned gradient pieces, squared and summed over the group, give the norm²."""
    for rr in runs[world]:
        norm_sq, pieces_sq = rr[name]["norms"]
        assert pieces_sq == pytest.approx(norm_sq, rel=1e-5)


def test_stage2_reduce_scatter_overlaps_backward(runs):
    """Every bucket's reduce-scatter starts from a gradient hook, the first while gradients are pending."""
    for rr in runs[2]:
        launches = rr["z2"]["launches"]
        assert len(launches) == len(rr["z2"]["groups"]) >= 3
        assert all(during for _, during in launches)
        assert launches[0][0] > 0


def _replica_overlap(rep: int, shard: int, stage: int, precision: str) -> list[list[bool]]:
    """Two steps with small buckets; per reducer, whether each all-reduce across replicas was issued
    before the end-of-step drain (during backward for stages 2 and 3)."""
    from loom.comm import CommMeter
    from loom.model.llama import build_model, loss_fn
    from loom.train.build import parallelize

    mesh = get_mesh(dp_replicate=rep, dp_shard=shard)
    cfg = C.LoomConfig(model=tiny_model(), train=replace(tiny_train(steps=2), precision=precision))
    cfg.parallel = replace(cfg.parallel, dp=rep * shard, dp_shard=shard, zero=stage, bucket_mb=0.01)
    model = build_model(cfg.model, cfg.train.seed)
    strategy = parallelize(model, mesh, cfg, CommMeter()).strategy
    metered_steps(model, strategy, CommMeter(), mesh, cfg, loss_fn, 2, BATCH, BATCH // (rep * shard))
    logs = [r.replica_log for r in getattr(strategy, "_reducers", [strategy.reducer])]
    strategy.remove()
    return logs


@pytest.mark.parametrize(
    "world,rep,shard,stage,precision",
    [
        (2, 2, 1, 0, "bf16"),  # half precision without ZeRO: fp32 masters replicated, gradients all-reduced
        (4, 2, 2, 2, "fp32"),  # hybrid stage 2
        (4, 2, 2, 3, "fp32"),  # hybrid stage 3
    ],
)
def test_replica_all_reduce_overlaps_backward(pools, world, rep, shard, stage, precision):
    """The all-reduce across replicas is issued during backward (as the fp32 data-parallel path's
    buckets are), never all at the end: every one but the last of each step before the drain."""
    for logs in pools(world).run(_replica_overlap, rep, shard, stage, precision):
        log = [flag for reducer in logs for flag in reducer]
        assert len(log) >= 2 * 3, log  # 2 steps, several buckets or units each
        assert sum(not flag for flag in log) <= 2, log  # at most the last of each step waits for the drain


def test_stage3_prefetches_next_unit(runs):
    """After the first step only the first unit of each forward is gathered on demand; every other
    gather (forward and backward) is a prefetch issued while the previous unit computes, and each
    unit's gradients are reduce-scattered once per step."""
    for world, name in ALL:
        if WORLDS[world][name][0] != 3:
            continue
        r = runs[world][0][name]
        gathers = [how for what, _, how in r["events"] if what == "gather"]
        assert gathers.count("demand") == r["k"], (name, r["events"])
        assert gathers.count("prefetch") == len(gathers) - r["k"] > 0
        reduces = [u for what, u, _ in r["events"] if what == "reduce"]
        assert sorted(reduces) == list(range(len(r["units"])))


def _fsdp2_vs_loom(world: int, steps: int, micro: int):
    """Same model and batches under torch's FSDP2 ``fully_shard`` (each block, then the root) and Loom ZeRO-3."""
    from torch.distributed.fsdp import fully_shard

    from loom.model.llama import build_model, loss_fn
    from loom.optim.groups import build_optimizer, set_lr
    from loom.train.schedule import lr_at

    mesh = get_mesh(dp_replicate=1, dp_shard=world)
    tcfg = tiny_train(steps=steps)
    model = build_model(tiny_model(), tcfg.seed)
    for block in model.layers:
        fully_shard(block, mesh=mesh.device_mesh["dp_shard"])
    fully_shard(model, mesh=mesh.device_mesh["dp_shard"])
    opt = build_optimizer(model, tcfg)
    for step in range(steps):
        set_lr(opt, lr_at(step, tcfg))
        opt.zero_grad()
        batches = rank_micro_batches(step, BATCH, micro, mesh.local_rank("dp"), world)
        for x, y in batches:
            (loss_fn(model(x), y) / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        opt.step()
    fsdp_state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    loom = train_zero(mesh, 3, micro, {}, {}, steps=steps)
    return fsdp_state, loom["state"]


def test_matches_torch_fsdp2(pools):
    for fsdp_state, loom_state in pools(2).run(_fsdp2_vs_loom, 2, 10, 2):
        assert fsdp_state.keys() == loom_state.keys()
        for k, v in fsdp_state.items():
            assert_close(loom_state[k], v, **TOL, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize(
    "args,world,field",
    [
        (["--parallel.zero", "4"], 2, "parallel.zero"),
        (["--parallel.dp", "4", "--parallel.dp_shard", "3", "--parallel.zero", "3"], 4, "parallel.dp_shard"),
        (["--parallel.zero", "2", "--parallel.offload", "nvme"], 2, "parallel.offload"),
        (["--parallel.offload", "disk"], 2, "parallel.offload"),  # offload needs zero >= 1
    ],
)
def test_bad_input_one_line_error(args, world, field):
    cfg = C.apply_overrides(C.LoomConfig(), args)
    with pytest.raises(C.ConfigError, match=field.replace(".", r"\.")) as e:
        C.validate(cfg, world)
    assert "\n" not in str(e.value)


def test_unwritable_offload_dir_rejected(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cfg = C.apply_overrides(
        C.LoomConfig(),
        [
            "--parallel.zero",
            "1",
            "--parallel.offload",
            "disk",
            "--parallel.offload_dir",
            str(blocker / "state"),
        ],
    )
    with pytest.raises(C.ConfigError, match=r"parallel\.offload_dir: .* is not a writable directory") as e:
        C.validate(cfg, 2)
    assert "\n" not in str(e.value)
    ok = C.apply_overrides(
        C.LoomConfig(),
        [
            "--parallel.zero",
            "1",
            "--parallel.offload",
            "disk",
            "--parallel.offload_dir",
            str(tmp_path / "new" / "dir"),
        ],
    )
    C.validate(ok, 2)


def test_full_disk_stops_before_training(tmp_path):
    """State files are reserved in full up front: no space is an error at start, never a later SIGBUS."""
    from loom.optim.store import OffloadError, make_store

    store = make_store("disk", torch.device("cpu"), tmp_path, "rank0")
    small = store.zeros(1024, "exp_avg")
    small += 1.0
    assert small.sum().item() == 1024 and store.offloaded_bytes == 1024 * ELEM
    with pytest.raises(
        OffloadError, match=r"parallel\.offload_dir: .* bytes free, optimizer state 'huge' needs"
    ):
        store.zeros(1 << 60, "huge")
    assert os.listdir(tmp_path) == []  # mapped files are unlinked: nothing is left behind
