"""Mixed precision and fp16 loss scaling: bf16/fp16 follow fp32, an overflow on one rank is skipped by
every rank, the memory held per rank is the mixed-precision formula, bad combinations are refused."""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import replace

import pytest
import torch

from loom.config import ConfigError, LoomConfig, validate
from loom.memory.loss_scale import DynamicLossScaler
from loom.memory.precision import state_bytes_formula
from tests.dist import get_mesh
from tests.helpers import SEQ, one_thread, rank_micro_batches, tiny_model, tiny_train  # noqa: F401 (fixture)

BATCH, MICRO = 8, 4
# Stated tolerances over 50 steps on the memorisation task below (loss 4.85 -> 3.29; measured gaps
# 1.2e-3 for bf16, 2.2e-4 for fp16):
BF16_TOL = 0.01  # |loss_bf16 - loss_fp32| at every step: bf16 rounds weights/activations to 2^-8
FP16_TOL = 0.002  # fp16 (10 mantissa bits) with loss scaling tracks fp32 more tightly


def make_cfg(world: int = 1, **train_kw) -> LoomConfig:
    cfg = LoomConfig(model=tiny_model(), train=tiny_train(**train_kw))
    cfg.data.seq_len = SEQ
    cfg.train.global_batch, cfg.train.micro_batch = BATCH, MICRO
    return cfg


def train_loop(cfg: LoomConfig, mesh, steps: int, hook=None, model_hook=None) -> dict:
    """Train through ``build_run`` on a two-batch memorisation task (so the loss falls);
    ``hook(step, strategy)`` runs after each step's gradient reduction (test-only injection)."""
    from loom.model.llama import build_model
    from loom.parallel.context.parallelize import shard_sequence
    from loom.train.build import build_run
    from loom.train.schedule import lr_at
    from loom.train.step import scaler_stats, train_step

    world = mesh.dims.world_size if mesh is not None else 1
    validate(cfg, world)
    model = build_model(cfg.model, cfg.train.seed)
    if model_hook is not None:
        model_hook(model)
    run = build_run(cfg, mesh, model)
    strategy = run.strategy
    dp, dp_rank = mesh.size("dp"), mesh.local_rank("dp")
    state = {"step": -1}
    if hook is not None:
        orig = strategy.finish_sync

        def finish_sync():
            orig()
            hook(state["step"], strategy)

        strategy.finish_sync = finish_sync
    losses, norms, scales, snaps = [], [], [], []
    for step in range(steps):
        state["step"] = step
        micro = shard_sequence(
            rank_micro_batches(step % 2, BATCH, cfg.train.micro_batch, dp_rank, dp),
            mesh.size("cp"),
            mesh.local_rank("cp"),
        )
        sharded = cfg.parallel.zero == 3  # ZeRO-3 frees the full parameters' storage between steps
        before = [] if sharded else [p.detach().clone() for p in model.parameters()]
        res = train_step(run, micro, cfg.train.grad_clip, lr_at(step, cfg.train), mesh.group("dp_cp"))
        losses.append(res.loss)
        norms.append(res.grad_norm)
        scales.append(scaler_stats(run.scaler).get("loss_scale", 1.0))
        snaps.append(None if sharded else all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
    finite = cfg.parallel.zero == 3 or all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return {
        "losses": losses,
        "norms": norms,
        "scales": scales,
        "unchanged": snaps,
        "finite": finite,
        "stats": scaler_stats(run.scaler),
        "bytes": strategy.state_bytes(),
        "strategy": strategy,
        "scaler": run.scaler,
        "dtype": next(model.parameters()).dtype,
    }


def single_mesh():
    from loom.mesh import ParallelDims, ParallelMesh

    return ParallelMesh(ParallelDims(), "cpu")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests.helpers.one_thread: one intra-op thread


# ----------------------------------------------------------------------------- single process


@pytest.fixture(scope="module")
def fp32_run():
    return train_loop(make_cfg(steps=50), single_mesh(), 50)


def test_bf16_follows_fp32(fp32_run):
    out = train_loop(make_cfg(steps=50, precision="bf16"), single_mesh(), 50)
    assert out["dtype"] == torch.bfloat16
    ref = fp32_run["losses"]
    assert ref[-1] < ref[0] - 1.2  # the task is learnt
    gap = max(abs(a - b) for a, b in zip(ref, out["losses"]))
    assert gap < BF16_TOL, gap


def test_fp16_with_loss_scaling_follows_fp32(fp32_run):
    cfg = make_cfg(steps=50, precision="fp16", loss_scale_window=10)
    out = train_loop(cfg, single_mesh(), 50)
    assert out["dtype"] == torch.float16
    gap = max(abs(a - b) for a, b in zip(fp32_run["losses"], out["losses"]))
    assert gap < FP16_TOL, gap
    assert out["stats"]["skipped_steps"] == 0 and out["scales"][9] == 2.0**17  # doubled after 10 clean steps


def test_fp16_overflowing_scale_backs_off():
    """A scale of 2^40 overflows fp16 (max 65504): steps are skipped, weights untouched, the scale halves
    each time (hysteresis 1) until the gradients fit, then training goes on with finite weights."""
    cfg = make_cfg(steps=40, precision="fp16", loss_scale_init=2.0**40, loss_scale_hysteresis=1)
    out = train_loop(cfg, single_mesh(), 40)
    k = out["unchanged"].index(False)  # the first clean step
    assert k >= 10 and out["stats"]["skipped_steps"] == sum(out["unchanged"]) <= k + 3  # then rarely
    assert out["scales"][:k] == [2.0 ** (39 - i) for i in range(k)]  # halved at every skipped step
    assert all(math.isinf(n) for n in out["norms"][:k]) and math.isfinite(out["norms"][k])
    assert out["finite"] and out["losses"][-1] < out["losses"][k] - 0.2


def test_loss_scaler_state_is_checkpointed(tmp_path):
    """fp16: the scale, clean-step count, hysteresis tracker and skip count survive save/load (bitwise
    weights and masters through the ZeRO adapter underneath)."""
    from loom.checkpoint.load import CheckpointReader
    from loom.checkpoint.save import Checkpointer

    cfg = make_cfg(steps=3, precision="fp16", loss_scale_init=2.0**40)
    from loom.checkpoint.protocol import CombinedState

    ra = train_loop(cfg, single_mesh(), 3)
    a, sa = ra["strategy"], ra["scaler"]
    saved = Checkpointer(tmp_path).save(3, CombinedState(a, sa).sharded_state(), {}, {}, blocking=True)
    rb = train_loop(make_cfg(steps=1, precision="fp16"), single_mesh(), 0)
    b, sb = rb["strategy"], rb["scaler"]
    with CheckpointReader(saved) as reader:
        CombinedState(b, sb).load_sharded(reader)
    assert (sb.scale, sb.good_steps, sb.tracker, sb.skipped) == (
        sa.scale,
        sa.good_steps,
        sa.tracker,
        sa.skipped,
    )
    assert sa.skipped == 3 and sa.scale == 2.0**38  # hysteresis 2: the first overflow only spends the tracker
    assert all(torch.equal(x, y) for x, y in zip(a.optim.masters, b.optim.masters))


def test_mixed_precision_state_bytes_formula():
    """16 bytes per parameter without ZeRO: 2 (bf16 weights) + 2 (grads) + 12 (fp32 master, m, v)."""
    for opt in ("adamw", "adam8bit"):
        out = train_loop(make_cfg(steps=1, precision="bf16", optimizer=opt), single_mesh(), 1)
        numels = [lay.padded for lay in out["strategy"].layouts]
        want = state_bytes_formula(numels, "bf16", opt, zero=0, n=1)
        assert {k: out["bytes"][k] for k in want} == want
        if opt == "adamw":
            assert sum(want.values()) == 16 * sum(numels)


def test_loss_scaler_hysteresis_and_growth():
    s = DynamicLossScaler(init=1024.0, window=3, hysteresis=2, min_scale=256.0)
    s.update(True)
    assert s.scale == 1024.0  # first overflow absorbed by the hysteresis
    s.update(True)
    assert s.scale == 512.0
    s.update(True)
    assert s.scale == 256.0  # the tracker stays spent until the next growth
    s.update(True)
    assert s.scale == 256.0  # floor
    for _ in range(3):
        s.update(False)
    assert s.scale == 512.0 and s.tracker == 2 and s.skipped == 4
    static = DynamicLossScaler(static=128.0)
    static.update(True)
    assert static.scale == 128.0 and static.skipped == 1


def test_precision_config_errors():
    cfg = make_cfg(precision="fp16")
    cfg.model.n_layers = 4
    cfg.parallel = replace(cfg.parallel, pp=2, schedule="pipedream")
    cfg.model.tie_embeddings = False
    with pytest.raises(ConfigError, match=r"^train\.precision: fp16 .*pipedream"):
        validate(cfg, 2)
    for field, value, pattern in (
        ("precision", "fp4", r"^train\.precision: must be one of"),
        ("optimizer", "lion", r"^train\.optimizer: must be one of"),
        ("loss_scale_window", 0, r"^train\.loss_scale_window: must be >= 1"),
    ):
        with pytest.raises(ConfigError, match=pattern) as e:
            validate(make_cfg(**{field: value}), 1)
        assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- dp2 x tp2, fp16 overflow

BAD_STEP, BAD_RANK = 3, 3


def _poison(step: int, strategy) -> None:
    """Test-only: after the gradient reduction of BAD_STEP, one rank's gradient shard becomes inf."""
    import torch.distributed as dist

    if step == BAD_STEP and dist.get_rank() == BAD_RANK:
        strategy.grads()[0].mul_(math.inf)


def overflow_run(steps: int) -> dict:
    mesh = get_mesh(tp=2, dp_replicate=2)
    cfg = make_cfg(steps=steps, precision="fp16", loss_scale_hysteresis=1, loss_scale_init=2.0**12)
    cfg.parallel = replace(cfg.parallel, tp=2, dp=2)
    out = train_loop(cfg, mesh, steps, hook=_poison)
    del out["strategy"], out["scaler"]
    return out


def test_overflow_on_one_rank_skips_the_step_on_every_rank(pools):
    results = pools(4).run(overflow_run, 6)
    for r in results:
        skipped = [i for i, same in enumerate(r["unchanged"]) if same]
        assert skipped == [BAD_STEP], (
            skipped
        )  # every rank skipped exactly the poisoned step, weights untouched
        assert r["norms"][BAD_STEP] == math.inf
        assert r["scales"][BAD_STEP] == r["scales"][BAD_STEP - 1] / 2  # halved (hysteresis 1)
        assert r["stats"]["skipped_steps"] == 1 and r["finite"]
        assert all(math.isfinite(x) for x in r["losses"])
    assert len({tuple(r["losses"]) for r in results}) == 1  # replicas and tp peers agree on everything


def test_diverged_fp16_run_stops_naming_the_loss_scale():
    """An fp16 run whose every step overflows must not skip its way to a 'finished' model."""
    from loom.memory.loss_scale import DynamicLossScaler, LossScaleDiverged

    s = DynamicLossScaler(init=2.0**4, hysteresis=1, min_scale=1.0, max_skipped=3)
    for _ in range(3):
        s.update(True)
    s.update(False)  # a clean step resets the count
    for _ in range(3):
        s.update(True)
    with pytest.raises(
        LossScaleDiverged,
        match=r"train.max_skipped_steps: 4 fp16 steps in a row overflowed "
        r"\(loss scale now 1, floor train.loss_scale_min = 1\)",
    ):
        s.update(True)
    unlimited = DynamicLossScaler(max_skipped=0)
    for _ in range(100):
        unlimited.update(True)


def test_a_static_scale_that_overflows_every_step_names_the_scale_not_the_learning_rate():
    from loom.memory.loss_scale import DynamicLossScaler, LossScaleDiverged

    s = DynamicLossScaler(static=1e30, max_skipped=2)
    s.update(True)
    s.update(True)
    with pytest.raises(LossScaleDiverged, match=r"^train.loss_scale: the static scale 1e\+30 made 3") as e:
        s.update(True)
    assert "train.lr" not in str(e.value)


# ----------------------------------------------------------------------------- fp16 under dp: one process's skips

SKIP_STEPS = 16
# 2^24 overflows this model's fp16 gradients (one process's ceiling is 2^20: it skips steps 0-3, then
# every third step as a window of 2 clean steps doubles the scale back to 2^21)
SKIP_TRAIN = {
    "precision": "fp16",
    "loss_scale_init": 2.0**24,
    "loss_scale_hysteresis": 1,
    "loss_scale_window": 2,
}
SKIP_LAYOUTS = {  # name: (mesh dims, micro-batch, zero, experts)
    "dp2": ({"dp_replicate": 2}, 4, 0, 1),
    "dp2 accumulating": ({"dp_replicate": 2}, 2, 0, 1),
    "dp4": ({"dp_replicate": 4}, 2, 0, 1),
    "dp2 zero2": ({"dp_shard": 2}, 2, 2, 1),
    "dp2 zero3": ({"dp_shard": 2}, 4, 3, 1),
    "cp2": ({"cp": 2}, 4, 0, 1),
    "dp2 x cp2": ({"dp_replicate": 2, "cp": 2}, 2, 0, 1),
    "moe dp2 ep2": ({"dp_replicate": 2, "ep": 2}, 4, 0, 4),
    "pp2 x dp2": ({"pp": 2, "dp_replicate": 2}, 2, 0, 1),
}


def skip_run(dims: dict, micro: int, zero: int, experts: int = 1) -> dict:
    dp = dims.get("dp_replicate", 1) * dims.get("dp_shard", 1)
    cfg = make_cfg(steps=SKIP_STEPS, **SKIP_TRAIN)
    cfg.model = replace(cfg.model, n_experts=experts)
    cfg.train.micro_batch = micro
    cfg.run.dir = os.path.join(
        tempfile.gettempdir(), "loom-test-fp16-skips"
    )  # pipelines draw a timeline there
    cfg.parallel = replace(
        cfg.parallel, dp=dp, cp=dims.get("cp", 1), ep=dims.get("ep", 1), pp=dims.get("pp", 1), zero=zero
    )
    out = train_loop(cfg, get_mesh(**dims) if dims else single_mesh(), SKIP_STEPS)
    return {k: out[k] for k in ("losses", "norms", "scales", "unchanged")}


@pytest.fixture(scope="module")
def fp16_skips():
    return {experts: skip_run({}, MICRO, 0, experts) for experts in (1, 4)}


@pytest.mark.parametrize("name", list(SKIP_LAYOUTS))
def test_fp16_under_dp_skips_one_process_steps(pools, fp16_skips, name):
    """The backward at S/(dp·cp) holds one process's fp16 terms on each rank (loom.memory.loss_scale):
    the same steps overflow, the scale follows the same path and the losses stay within fp16's
    rounding of one process's (before: dp2 overflowed at half one process's ceiling)."""
    dims, micro, zero, experts = SKIP_LAYOUTS[name]
    ref = fp16_skips[experts]
    skipped = [i for i, same in enumerate(ref["unchanged"]) if same]
    assert skipped[:4] == [0, 1, 2, 3] and len(skipped) >= 6  # the case overflows, early and again
    assert skipped == [i for i, norm in enumerate(ref["norms"]) if norm == math.inf]
    n = dims.get("dp_replicate", 1) * dims.get("dp_shard", 1) * dims.get("cp", 1) * dims.get("pp", 1)
    for r in pools(n).run(skip_run, dims, micro, zero, experts):
        assert [i for i, norm in enumerate(r["norms"]) if norm == math.inf] == skipped
        assert r["scales"] == ref["scales"]
        # measured: dp2 and dp2 zero3 bit-equal, accumulation / dp4 / zero2 1.7e-5, cp 3.1e-5 (fp16 sums'
        # order); MoE ep2 1.4e-4 by step 14 (the experts' rows summed in another order, then routed on)
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=0, atol=1e-4 if experts == 1 else 5e-4)
