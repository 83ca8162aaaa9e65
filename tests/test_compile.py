"""``train.compile``: compiled equals eager (fp32) under each layout, graph breaks reported, no
recompilation after the second step, refusals before any process starts.

Compiling is slow on 2 shared CPU cores (tens of seconds per distinct graph), so the model is the
tiny one and every layout runs compiled and eager in the same rank process (same seed, same
batches), comparing the two there; identical blocks share one compiled graph and inductor's
on-disk cache serves the layouts whose graphs repeat.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from loom.config import ConfigError, LoomConfig, validate
from tests.helpers import SEQ, rank_micro_batches, tiny_model, tiny_train

STEPS, BATCH, MICRO = 6, 8, 2
# Adam moves a weight by up to lr whatever its gradient's size, so inductor's fp32 rounding (other fusions,
# other summation orders) flipping a near-zero gradient's sign shows up as a fraction of lr: measured up to
# 1.03e-5 at lr 3e-3 (one element in 3072), so the tests train at lr 1e-3 to compare parameters at 1e-5.
LR = 1e-3
TOL = dict(rtol=1e-5, atol=1e-5)


def _config(layout: dict, compile_mode: str, world: int) -> LoomConfig:
    cfg = LoomConfig(model=tiny_model(), train=tiny_train(steps=STEPS, lr=LR, min_lr=LR / 10))
    cfg.data.seq_len = SEQ
    p = cfg.parallel
    p.tp, p.pp, p.cp = layout.get("tp", 1), layout.get("pp", 1), layout.get("cp", 1)
    p.dp = world // (p.tp * p.pp * p.cp)
    p.dp_shard = layout.get("dp_shard", 1)
    p.zero, p.sp = layout.get("zero", 0), layout.get("sp", False)
    p.schedule = layout.get("schedule", p.schedule)
    p.cp_mode = layout.get("cp_mode", p.cp_mode)
    cfg.train.global_batch, cfg.train.micro_batch = BATCH, MICRO
    cfg.train.precision, cfg.train.recompute = "fp32", layout.get("recompute", "none")
    cfg.train.compile = compile_mode  # type: ignore[assignment]
    cfg.run.dir = "/tmp/loom-test-compile"
    return cfg


def _train(layout: dict, compile_mode: str) -> dict:
    """STEPS steps of ``layout`` through build_run (the trainer's path) with ``train.compile``;
    from the third step on any recompilation raises (dynamo's ``error_on_recompile``)."""
    import torch._dynamo

    from loom.comm import CommMeter
    from loom.model.llama import build_model
    from loom.parallel.context.parallelize import shard_sequence
    from loom.train.build import build_run
    from loom.train.compile import compile_report
    from loom.train.schedule import lr_at
    from loom.train.step import train_step
    from tests.dist import get_mesh

    dims = {k: v for k, v in layout.items() if k in ("cp", "tp", "pp", "dp_shard", "dp_replicate")}
    mesh = get_mesh(**dims) if dims else None
    world = mesh.dims.world_size if mesh is not None else 1
    cfg = _config(layout, compile_mode, world)
    if mesh is None:
        from loom.mesh import ParallelDims, ParallelMesh

        mesh = ParallelMesh(ParallelDims(), "cpu")
    torch._dynamo.reset()  # compile afresh (inductor's disk cache still serves repeated graphs)
    model = build_model(cfg.model, cfg.train.seed, meta=True)
    run = build_run(cfg, mesh, model, CommMeter())
    dp_rank, dp = mesh.local_rank("dp"), mesh.size("dp")
    losses = []
    try:
        for step in range(STEPS):
            torch._dynamo.config.error_on_recompile = step >= 2
            batches = shard_sequence(
                rank_micro_batches(step, BATCH, MICRO, dp_rank, dp), mesh.size("cp"), mesh.local_rank("cp")
            )
            res = train_step(run, batches, cfg.train.grad_clip, lr_at(step, cfg.train), mesh.group("dp_cp"))
            losses.append(res.loss)
    finally:
        torch._dynamo.config.error_on_recompile = False
    report = compile_report(run.model)
    state = run.strategy.full_state_dict()
    return {
        "losses": losses,
        "state": None if state is None else {k: v.clone() for k, v in state.items()},
        "report": None if report is None else (report.graphs, report.breaks(), report.line()),
    }


def _compiled_and_eager(layout: dict, mode: str = "blocks") -> tuple[dict, dict]:
    torch.set_num_threads(1)
    return _train(layout, mode), _train(layout, "none")


def _assert_equal(results: list[tuple[dict, dict]], name: str) -> None:
    for compiled, eager in results:
        assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=0)
        if eager["state"] is not None:
            for k, v in eager["state"].items():
                assert_close(compiled["state"][k], v, **TOL, msg=lambda m, k=k: f"{name} {k}: {m}")


LAYOUTS = {
    "dp2": {"dp_replicate": 2},
    "zero1": {"dp_shard": 2, "zero": 1},
    "zero2": {"dp_shard": 2, "zero": 2},
    "zero3": {"dp_shard": 2, "zero": 3},
    "tp2 sp": {"tp": 2, "sp": True},
    "pp2 1f1b": {"pp": 2, "schedule": "1f1b"},
    "cp2": {"cp": 2},
    "dp2 recompute": {"dp_replicate": 2, "recompute": "full"},
}

# Graph breaks per layout (2 blocks): each is a communicating module run eagerly inside a block.
BREAKS = {"tp2 sp": 4, "cp2": 2}


@pytest.mark.parametrize("mode", ["blocks", "full"])
def test_one_process_compiled_equals_eager(mode):
    compiled, eager = _compiled_and_eager({}, mode)
    _assert_equal([(compiled, eager)], mode)
    graphs, breaks, _ = compiled["report"]
    assert graphs >= 1 and breaks == {}, (graphs, breaks)  # the plain model compiles whole


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_compiled_equals_eager(pools, name):
    results = pools(2).run(_compiled_and_eager, LAYOUTS[name])
    _assert_equal(results, name)
    for compiled, _ in results:
        graphs, breaks, line = compiled["report"]
        assert graphs >= 1, line  # a block at least (pp: rank 0 has no loss; tp: its loss is eager)
        assert sum(breaks.values()) == BREAKS.get(name, 0), line


def test_compress_refused_before_start():
    """Compression picks a format per saved tensor kind; a compiled block's saved tensors have none."""
    cfg = LoomConfig(model=tiny_model(), train=tiny_train(compress="bf16"))
    cfg.train.compile = "blocks"
    cfg.data.seq_len = SEQ
    with pytest.raises(ConfigError, match="train.compile"):
        validate(cfg, 1)
