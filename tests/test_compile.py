"""``train.compile``: compiled equals eager (fp32) under each layout, graph breaks reported, no
recompilation after the second step, refusals before any process starts.

Compiling is slow on 2 shared CPU cores (tens of seconds per distinct graph), so the model is the
tiny one and every layout runs compiled and eager in the same rank process (same seed, same
batches), comparing the two there; identical blocks share one compiled graph and inductor's
on-disk cache serves the layouts whose graphs repeat.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from torch.testing import assert_close

from loom.config import ConfigError, LoomConfig, validate
from tests.helpers import GEMMA2_FIELDS, SEQ, rank_micro_batches, tiny_model, tiny_train

STEPS, BATCH, MICRO = 6, 8, 2
# Adam moves a weight by up to lr whatever its gradient's size, so inductor's fp32 rounding (other fusions,
# other summation orders) flipping a near-zero gradient's sign shows up as a fraction of lr: measured up to
# 1.03e-5 at lr 3e-3 (one element in 3072), so the tests train at lr 1e-3 to compare parameters at 1e-5.
LR = 1e-3
TOL = dict(rtol=1e-5, atol=1e-5)


def _config(layout: dict, compile_mode: str, world: int) -> LoomConfig:
    """The tiny model under ``layout``: mesh degrees and parallel fields, ``model`` (ModelConfig fields over
    tiny_model's), ``train`` (TrainConfig fields), ``finetune`` (FinetuneConfig fields)."""
    from loom.config import FinetuneConfig

    cfg = LoomConfig(
        model=tiny_model(**layout.get("model", {})), train=tiny_train(steps=STEPS, lr=LR, min_lr=LR / 10)
    )
    cfg.data.seq_len = SEQ
    p = cfg.parallel
    p.tp, p.pp, p.cp, p.ep = (
        layout.get("tp", 1),
        layout.get("pp", 1),
        layout.get("cp", 1),
        layout.get("ep", 1),
    )
    p.dp = world // (p.tp * p.pp * p.cp)
    p.dp_shard = layout.get("dp_shard", 1)
    p.zero, p.sp = layout.get("zero", 0), layout.get("sp", False)
    p.schedule = layout.get("schedule", p.schedule)
    p.virtual_stages = layout.get("virtual_stages", 1)
    p.cp_mode = layout.get("cp_mode", p.cp_mode)
    if "finetune" in layout:
        cfg.finetune = FinetuneConfig(**layout["finetune"])
    cfg.train.global_batch, cfg.train.micro_batch = BATCH, MICRO
    cfg.train.precision, cfg.train.recompute = "fp32", layout.get("recompute", "none")
    for k, v in layout.get("train", {}).items():
        setattr(cfg.train, k, v)
    cfg.train.compile = compile_mode  # type: ignore[assignment]
    cfg.run.dir = os.path.join(tempfile.gettempdir(), "loom-test-compile")
    validate(cfg, world)
    return cfg


class _CopyOffloader:
    """The CPU stand-in of :class:`loom.memory.activation_offload.HostOffloader` (CUDA only): every
    saved floating-point tensor goes to a "host" copy in forward and comes back in backward."""

    def accepts(self, t: torch.Tensor) -> bool:
        return t.is_floating_point()

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host


def _train(layout: dict, compile_mode: str) -> dict:
    """STEPS steps of ``layout`` through build_run (the trainer's path) with ``train.compile``;
    from the third step on any recompilation raises (dynamo's ``error_on_recompile``). ``offload``:
    every step under activation offload's saved-tensor hooks (:class:`_CopyOffloader`)."""
    import contextlib

    import torch._dynamo

    from loom.comm import CommMeter
    from loom.memory.compress import SavedActivations
    from loom.model.llama import build_model
    from loom.parallel.context.parallelize import shard_sequence
    from loom.train.build import build_run
    from loom.train.compile import compile_report
    from loom.train.schedule import lr_at
    from loom.train.step import train_step
    from tests.dist import get_mesh

    dims = {k: v for k, v in layout.items() if k in ("cp", "tp", "pp", "ep", "dp_shard", "dp_replicate")}
    mesh = get_mesh(**dims) if dims else None
    world = mesh.dims.world_size if mesh is not None else 1
    cfg = _config(layout, compile_mode, world)
    if mesh is None:
        from loom.mesh import ParallelDims, ParallelMesh

        mesh = ParallelMesh(ParallelDims(), "cpu")
    torch._dynamo.reset()  # compile afresh (inductor's disk cache still serves repeated graphs)
    model = build_model(cfg.model, cfg.train.seed, meta=True, moe=cfg.moe)
    run = build_run(cfg, mesh, model, CommMeter())
    dp_rank, dp = mesh.local_rank("dp"), mesh.size("dp")
    losses = []
    compress, offload = cfg.train.compress, _CopyOffloader() if layout.get("offload") else None
    saved = SavedActivations(run.model, compress, offload) if offload or compress != "none" else None
    try:
        for step in range(STEPS):
            torch._dynamo.config.error_on_recompile = step >= 2
            batches = shard_sequence(
                rank_micro_batches(step, BATCH, MICRO, dp_rank, dp), mesh.size("cp"), mesh.local_rank("cp")
            )
            with saved or contextlib.nullcontext():
                res = train_step(
                    run, batches, cfg.train.grad_clip, lr_at(step, cfg.train), mesh.group("dp_cp")
                )
            losses.append(res.loss)
    finally:
        torch._dynamo.config.error_on_recompile = False
    report = compile_report(run.model)
    state = run.strategy.full_state_dict()
    return {
        "losses": losses,
        "state": None if state is None else {k: v.clone() for k, v in state.items()},
        "report": None if report is None else (report.graphs, report.breaks(), report.line()),
        "scaler": None if run.scaler is None else (run.scaler.scale, run.scaler.skipped),
        "saved": None if saved is None else saved.stats(),
        "packed": None if saved is None else (saved.packed, saved.raw),  # compression: bytes stored, replaced
    }


def _compiled_and_eager(layout: dict, mode: str = "blocks") -> tuple[dict, dict]:
    torch.set_num_threads(1)
    return _train(layout, mode), _train(layout, "none")


def _each_compiled_and_eager(layouts: list[dict]) -> list[tuple[dict, dict]]:
    """Several layouts in one call of the rank processes (compiled, then eager, each)."""
    return [_compiled_and_eager(layout) for layout in layouts]


def _assert_equal(results: list[tuple[dict, dict]], name: str, param_tol: dict | None = None) -> None:
    for compiled, eager in results:
        assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=0)
        assert compiled["scaler"] == eager["scaler"], name  # the fp16 scale and skipped steps
        if eager["state"] is not None:
            for k, v in eager["state"].items():
                assert_close(
                    compiled["state"][k], v, **(param_tol or TOL), msg=lambda m, k=k: f"{name} {k}: {m}"
                )


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


GEMMA2 = GEMMA2_FIELDS


@pytest.mark.parametrize(
    "mode,model", [("blocks", {}), ("full", {}), ("blocks", GEMMA2)], ids=["blocks", "full", "gemma2"]
)
def test_one_process_compiled_equals_eager(mode, model):
    compiled, eager = _compiled_and_eager({"model": model}, mode)
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


def test_full_refused_before_start_under_compress_and_zero_bubble():
    """``full`` stays refused under compression and zb-h1 (one node per stage); ``blocks`` compiles regions."""
    cfg = LoomConfig(model=tiny_model(), train=tiny_train(compress="bf16"))
    cfg.train.compile = "full"
    cfg.data.seq_len = SEQ
    with pytest.raises(ConfigError, match="train.compile: 'full' .* train.compress"):
        validate(cfg, 1)
    cfg = _config({"pp": 2, "schedule": "zb-h1"}, "none", 2)
    cfg.train.compile = "full"
    with pytest.raises(ConfigError, match="train.compile: 'full' .* schedule 'zb-h1'"):
        validate(cfg, 2)


def test_zero_bubble_and_compress_compile_regions(pools):
    """pp2 zb-h1 under ``train.compress = attention=bf16`` with ``blocks``: regions (the norms and the MLP
    compiled between eager linears; the attention, a compressed kind, eager), so BW re-enters at each
    linear's own eager mm node and at each norm's compiled node. Equals the eager compressed ZB-H1 run step
    for step, and compression packed the same tensors (bytes in, bytes out): the kind hooks run eagerly
    around each compiled region. One layout for both (each alone costs a pool run of its own)."""
    layout = {"pp": 2, "schedule": "zb-h1", "train": {"compress": "attention=bf16"}}
    results = pools(2).run(_compiled_and_eager, layout)
    _assert_equal(results, "pp2 zb-h1 compress")
    for compiled, eager in results:
        graphs, breaks, line = compiled["report"]
        regions = (
            "compile=blocks as regions (zb-h1, compress=attention=bf16): mlp, norm compiled, linears eager"
        )
        assert line.startswith(regions + ", attention eager:") and graphs >= 2, line
        # the graph breaks are the MLP's eager linears w1, w3, w2 (each recorded once: blocks share code)
        assert sum(breaks.values()) == 3 and line.endswith("(3x eager Linear.forward)"), line
        assert compiled["packed"] == eager["packed"] and compiled["packed"][0] > 0, (compiled, eager)


LORA = {"method": "lora", "lora_rank": 4, "lora_alpha": 8.0, "lora_targets": "all-linear"}
MOE = {"n_experts": 4, "top_k": 2}
MORE = {
    "cp2 ring": {"cp": 2, "cp_mode": "ring"},
    "cp2 alltoall": {"cp": 2, "cp_mode": "alltoall"},
    "ep2": {"dp_replicate": 2, "ep": 2, "model": MOE},
    "qlora zero3": {"dp_shard": 2, "zero": 3, "finetune": LORA | {"method": "qlora"}},
    "pp2 gpipe": {"pp": 2, "schedule": "gpipe"},
    "pp2 interleaved": {"pp": 2, "schedule": "interleaved", "virtual_stages": 2, "model": {"n_layers": 4}},
    "pp2 pipedream": {"pp": 2, "schedule": "pipedream", "model": {"tie_embeddings": False}},
    "pp2 2bw": {"pp": 2, "schedule": "2bw", "model": {"tie_embeddings": False}},
}
# One call of the rank processes per group: the layouts of a group compile one after the other.
GROUPS = [
    ["cp2 ring", "cp2 alltoall"],
    ["ep2", "qlora zero3"],
    ["pp2 gpipe", "pp2 interleaved"],
    ["pp2 pipedream", "pp2 2bw"],
]
# Graph breaks: the context-parallel core of each block's attention, the MoE layer of each block
# (blocks with equal graphs are compiled once, so ep2's second MoE adds no break).
MORE_BREAKS = {"cp2 ring": 2, "cp2 alltoall": 2, "ep2": 1}


@pytest.mark.parametrize("names", GROUPS, ids=[" + ".join(g) for g in GROUPS])
def test_more_layouts_compiled_equal_eager(pools, names):
    results = pools(2).run(_each_compiled_and_eager, [MORE[n] for n in names])
    for i, name in enumerate(names):
        _assert_equal([r[i] for r in results], name)
        for compiled, _ in (r[i] for r in results):
            graphs, breaks, line = compiled["report"]
            assert graphs >= 1 and sum(breaks.values()) == MORE_BREAKS.get(name, 0), f"{name}: {line}"


# fp16: inductor computes fp16 pointwise ops in fp32 and rounds once, eager rounds every op, so some
# fp16 gradients differ in their last bits; Adam turns a flipped sign of a near-zero one into a step of up
# to lr. Measured after 6 steps: losses within 2.7e-6 (the 1e-5 rule holds), weights within 6.4e-4 = 0.64 lr.
FP16_TOL = dict(rtol=0, atol=LR)


def test_one_process_moe_fp16_lora_offload_compiled_equal_eager():
    """One process: MoE (compiled, its balancing statistics an eager helper), the
    fp16 loss scaler (a first-step overflow skipped alike: scale 2^20 halved once, hysteresis 1), LoRA
    (block 0's input needs no gradient: a second graph) and activation offload's hooks (everything a
    compiled block saves goes to the offloader; inductor saves less than eager)."""
    fp16 = {"precision": "fp16", "loss_scale_init": 2.0**20, "loss_scale_hysteresis": 1}
    moe, half, lora, offload = _each_compiled_and_eager(
        [{"model": MOE}, {"train": fp16}, {"finetune": LORA}, {"offload": True}]
    )
    _assert_equal([moe], "moe")
    _assert_equal([half], "fp16", FP16_TOL)
    _assert_equal([lora], "lora")
    _assert_equal([offload], "offload")
    # the MoE layer compiles but its balancing (statistics all-reduce, recomputing()) is an eager helper:
    # that one break, recorded twice (in the block's frame and in the MoE forward's own frame, which
    # dynamo then compiles), each block alike; graphs: the block up to the MoE, the MoE's routing and
    # experts, the MoE after the helper, the block after the MoE, the loss
    graphs, breaks, line = moe[0]["report"]
    assert graphs == 5 and sum(breaks.values()) == 2 and all("_balance" in b for b in breaks), line
    assert half[0]["scaler"] == (2.0**19, 1)
    assert lora[0]["report"][:2] == (3, {}), lora[0]["report"][2]  # 2 block graphs and the loss
    c, e = offload[0]["saved"], offload[1]["saved"]
    assert 0 < c["act_offloaded_peak_bytes"] <= e["act_offloaded_peak_bytes"], (c, e)


def test_zero_bubble_regions_split_like_eager():
    """What BI and BW run under regions, counted by the profiler on one stage of 2 blocks: every
    ``aten::mm`` in the same phase as in eager (each linear's dX in BI, its dW in BW), and BW's only
    compiled backward nodes are the 4 norms' (a norm's weight joins at its compiled node), against
    BI's 8 (4 norms, 2 attention cores, 2 SwiGLU products)."""
    import torch._dynamo
    from torch.profiler import profile

    from loom.model.llama import build_model
    from loom.parallel.pipeline.stage import backward_input, backward_weight
    from loom.train.compile import apply_compile

    torch.set_num_threads(1)
    cfg = tiny_model()

    def phases(compiled: bool) -> list[tuple[int, int]]:
        torch._dynamo.reset()
        model = build_model(cfg, 0)
        if compiled:
            apply_compile(model, "blocks", lambda y, t: y.sum(), zero_bubble=True)
        x = torch.randn(2, SEQ, cfg.dim, requires_grad=True)
        params = [p for b in model.layers for p in b.parameters()]
        y = x
        for block in model.layers:
            y = block(y, model.rope_cos, model.rope_sin)
        with profile() as bi:
            _, pending = backward_input(y, torch.ones_like(y), x, params)
        with profile() as bw:
            backward_weight(pending)
        return [
            tuple(
                sum(e.count for e in p.key_averages() if e.key == k)
                for k in ("aten::mm", "CompiledFunctionBackward")
            )
            for p in (bi, bw)
        ]

    eager, regions = phases(False), phases(True)
    mms = 2 * (4 + 3)  # per block: wq wk wv wo, w1 w3 w2
    assert [c[0] for c in regions] == [c[0] for c in eager] == [mms, mms], (eager, regions)
    assert [c[1] for c in regions] == [8, 4] and [c[1] for c in eager] == [0, 0], regions
