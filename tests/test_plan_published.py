"""The planner against published large-scale runs (loom/plan/validation/*.toml), and the cost terms
that the comparison rests on, each against a hand computation."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from loom.config import ModelConfig
from loom.plan.cost import STACKS, CostModel, Layout, PlanError, Workload
from loom.plan.hardware import GEMM_K0, ClusterSpec, Machine, get_device
from loom.plan.published import (
    MAX_TOLERANCE,
    compare_published,
    format_published,
    load_file,
    load_runs,
    megatron_flops_per_token,
    summary,
)

# What the public set reaches today in sample (loom plan validate --published; goal 5% / 12%), and the
# gate on generalization: each independent source predicted from constants fitted on the others.
REACHED_MEAN, REACHED_MAX = 0.06, 0.17
LOSO_MEAN, LOSO_MAX = 0.08, 0.20


@pytest.fixture(scope="module")
def table():
    return compare_published()


def test_public_set_has_40_cited_runs_from_6_sources_and_no_held_out_row():
    runs = load_runs()
    assert len(runs) >= 40 and len({r.group for r in runs}) >= 6
    assert len({r.name for r in runs}) == len(runs)
    for r in runs:
        assert r.stack in STACKS and r.tokens_per_s_per_gpu > 0
        assert len(r.source) > 40 and any(k in r.source for k in ("arXiv", "http", "commit", "README")), (
            r.name
        )
        # held out: Narayanan et al. 2021 Table 1 beyond its 145.6B row, the Megatron-LM README's
        # H100 weak-scaling table, the Llama 3 paper's 405B table, Korthikanti et al. 2022 Table 5
        assert (
            "Korthikanti" not in r.source
            and "weak-scaling" not in r.source
            and "Llama 3 paper" not in r.source
        )
        if "Narayanan" in r.source and "Table 1" in r.source:
            assert "145.6B" in r.source
    assert {r.cluster.device.name for r in runs} >= {"a100-80g", "h100-sxm"}


def test_published_table_within_the_reached_tolerance(table):
    mean, worst = summary(table)
    text = format_published(table)
    assert mean <= REACHED_MEAN and worst <= REACHED_MAX, text
    assert f"{len(table)} published runs" in text
    # the comparison is on tokens/s, so the printed TFLOP/s share one FLOP count
    for r in table:
        assert r.published_tflops == pytest.approx(r.estimate.tflops_per_device / (1 + r.error))


def test_published_runs_that_ran_fit_in_memory(table):
    """Every run fits the 80 GB it ran on (distributed optimizer, recomputation and stage splits as
    published). MPT-30b on 8 A100 fits since Loom's AdamW step runs torch's fused kernel: its only
    temporary is the fp32 gradient copy (4 bytes per local element; the _foreach step added 4 more)."""
    misses = [r.run.name for r in table if not r.estimate.fits]
    # The known memory miss (the memory model's, loom/plan/cost/memory.py): ZeRO-3 "accumulation" of
    # full-size gradients under Megatron FSDP. Remove the name once it fits. Four other Megatron-Core
    # FP8 rows fit since Transformer Engine's 8-bit Linear inputs are kept in 1 byte (Stack.saves_8bit_inputs).
    known = {"Megatron-Bridge 25.11 LLAMA3_8B, 8 H100, FSDP"}
    assert set(misses) <= known, sorted(set(misses) - known)
    for name in ("Megatron-Bridge 25.11 LLAMA3_70B, 64 H100", "NeMo 24.07 Nemotron-340B, 128 H100"):
        assert name not in misses
    text = format_published(table)  # a miss is marked in the table, and counted under it
    marked = [line for line in text.splitlines() if line.endswith(" *")]
    assert len(marked) == len(misses) and all(any(n in line for line in marked) for n in misses), text
    assert (f"* {len(misses)} of {len(table)}: predicted above" in text) == bool(misses), text


def test_megatron_flop_count_and_tflops_rows():
    m = ModelConfig(dim=12288, n_layers=80, n_heads=96, vocab_size=51200)
    s = 2048
    assert megatron_flops_per_token(m, s) == pytest.approx(
        96 * 80 * 12288**2 * (1 + s / (6 * 12288) + 51200 / (16 * 80 * 12288))
    )
    row = next(r for r in load_runs() if "145.6B" in r.name)
    assert row.tokens_per_s_per_gpu == pytest.approx(148e12 / megatron_flops_per_token(row.model, 2048))
    mt = next(r for r in load_runs() if r.name == "MT-NLG 530B, 280 nodes")
    assert mt.tokens_per_s_per_gpu == pytest.approx(1920 * 2048 / 60.1 / 2240)


def test_palm_and_6n_counts_are_the_trainers_mfu_rule_and_mfu_rows_use_the_bf16_peak(tmp_path):
    """``palm`` = 6 N_a + 12 L a d T with N_a counted on a built model as the trainer counts it (the
    head, not the input table; top_k of the routed experts; the norms' weights are no matmuls and the
    planner leaves them out), ``6n`` without the attention term; an
    ``mfu`` row is that share of the device's dense bf16 peak over the formula's FLOPs per token."""
    from loom.model.llama import build_model, count_params, expert_params, flops_per_token
    from loom.plan.published import counted_flops_per_token

    for m in (
        ModelConfig(dim=256, n_layers=3, n_heads=8, n_kv_heads=2, ffn_dim=640, vocab_size=1000),
        ModelConfig(dim=128, n_layers=2, n_heads=4, vocab_size=500, tie_embeddings=True),
        ModelConfig(dim=128, n_layers=2, n_heads=4, vocab_size=500, n_experts=8, top_k=2, ffn_dim=256),
    ):
        whole = build_model(m, 0, meta=True)
        norms = sum(p.numel() for name, p in whole.named_parameters() if "norm" in name)  # not matmuls
        n_a = count_params(whole, exclude_embedding=not m.tie_embeddings) - norms
        trainer = flops_per_token(m, 512, n_a, expert_params(whole))
        assert counted_flops_per_token(m, 512, "palm") == pytest.approx(trainer, rel=1e-12)
        attention = 12 * m.n_layers * m.n_heads * m.head_dim * 512
        assert counted_flops_per_token(m, 512, "6n") == pytest.approx(trainer - attention, rel=1e-12)
    (tmp_path / "own.toml").write_text(
        _OWN.replace("tokens_per_s_per_gpu = 2973", "mfu = 0.4\ntflops_formula = 'palm'")
    )
    (row,) = load_file(tmp_path / "own.toml")
    per_token = counted_flops_per_token(row.model, 8192, "palm")
    assert row.tokens_per_s_per_gpu == pytest.approx(0.4 * get_device("a100-80g").bf16_flops / per_token)


def test_gemm_tile_and_wave_quantization_by_hand():
    """t = ceil(ceil(m/tm) ceil(n/tn) / SMs) * 2 tm tn (k + K0) / (peak * achievable / SMs)."""
    cl = ClusterSpec.single_node("a100-80g", 8)
    mach = Machine(cl, "bf16")
    dev = get_device("a100-80g")
    per_sm = 312e12 * dev.achievable / 108
    one_wave = 2 * 128 * 256 * (4096 + GEMM_K0) / per_sm
    assert mach.gemm(8192, 4096, 4096, 2) == pytest.approx(10 * one_wave)  # 1024 tiles: 10 waves of 108
    assert mach.gemm(8192, 4096, 4096, 2) > 2 * 8192 * 4096 * 4096 / mach.flops  # quantized, not flat
    assert mach.gemm(100, 4096, 200, 2) == pytest.approx(one_wave)  # one padded tile: one wave
    # 12 batched 2048 x 128 x 2048 products: 12 * 16 * 8 = 1536 tiles, 15 waves, k + K0 = 256 steps
    assert mach.gemm(2048, 128, 2048, 2, batch=12) == pytest.approx(
        15 * 2 * 128 * 256 * (128 + GEMM_K0) / per_sm
    )
    # memory bound: a skinny product moves more bytes than its FLOPs take
    assert mach.gemm(1, 8192, 8192, 2) == pytest.approx(2 * (8192 + 8192 * 8192 + 8192) / dev.hbm_bandwidth)
    # the CPU (no SMs) keeps the flat rate
    cpu = Machine(ClusterSpec.single_node("cpu", 2), "fp32")
    assert cpu.gemm(64, 64, 64, 4) == pytest.approx(max(2 * 64**3 / cpu.flops, 4 * 3 * 64 * 64 / cpu.hbm))


def test_flash_and_unfused_attention_per_kernel():
    """Flash: causal half of 4 T s h / t forward at flash_fwd, 2.5x backward at flash_bwd (+ q, k, v, o
    traffic); unfused: two batched GEMMs and 4 B a s^2 score bytes, backward twice."""
    m = ModelConfig(dim=4096, n_layers=2, n_heads=32, n_kv_heads=32, vocab_size=1000)
    cl = ClusterSpec.single_node("a100-80g", 8)
    cm = CostModel(m, Workload(8, 4096), cl)
    dev = cl.device
    T, s, h = 4096, 4096, 4096
    io = 2 * T * (2 * h / 2 + 2 * h / 2) / dev.hbm_bandwidth
    flops = 2 * T * s * h / 2
    fwd, bwd = cm._attention_core(2, 1, 1)
    assert fwd == pytest.approx(max(flops / (312e12 * dev.flash_fwd), io))
    assert bwd == pytest.approx(2.5 * flops / (312e12 * dev.flash_bwd) + 2 * io)
    un = CostModel(m, Workload(8, 4096, flash_attention=False), cl)
    mach, heads = un.machine, 16
    gemms = mach.gemm(s, 128, s, 2, batch=heads) + mach.gemm(s, s, 128, 2, batch=heads)
    scores = (
        STACKS[""].other * 4 * 2 * heads * s * s / dev.hbm_bandwidth
    )  # memory-bound: x the stack's passes
    f2, b2 = un._attention_core(2, 1, 1)
    assert f2 == pytest.approx(gemms + scores + io) and b2 == pytest.approx(2 * f2)


def test_uneven_pipeline_stages_lighter_first_and_last():
    """L = q p + r: the r extra blocks go to middle stages, then the last, then the first."""
    m = ModelConfig(dim=1024, n_layers=70, n_heads=8, n_kv_heads=8, vocab_size=1000)
    cm = CostModel(m, Workload(96, 1024), ClusterSpec.single_node("a100-80g", 8, 2))
    assert [
        cm.stage_layers(12, True, False),
        cm.stage_layers(12, False, False),
        cm.stage_layers(12, False, True),
    ] == [5, 6, 5]
    m32 = ModelConfig(dim=1024, n_layers=32, n_heads=8, n_kv_heads=8, vocab_size=1000)
    c32 = CostModel(m32, Workload(96, 1024), ClusterSpec.single_node("a100-80g", 8, 2))
    assert [
        c32.stage_layers(3, True, False),
        c32.stage_layers(3, False, False),
        c32.stage_layers(3, False, True),
    ] == [10, 11, 11]
    assert c32.stage_layers(4, True, False) == c32.stage_layers(4, False, True) == 8
    assert [c32.stage_layers(5, f, la) for f, la in ((True, False), (False, False), (False, True))] == [
        6,
        7,
        6,
    ]
    e = c32.estimate(Layout(dp=1, pp=3, micro_batch=1))  # pp 3 on 32 layers: expressible now
    layer = c32.estimate(Layout(dp=1, pp=4, micro_batch=1))
    assert e.step_time > layer.step_time  # 11 blocks on the slowest stage vs 8
    assert math.isfinite(e.memory)


def test_stack_scales_only_memory_bound_work():
    m = ModelConfig(dim=2048, n_layers=4, n_heads=16, n_kv_heads=16, vocab_size=32000)
    cl = ClusterSpec.single_node("h100-sxm", 8)
    w = Workload(8, 2048)
    base = CostModel(m, w, cl, stack="composer-fsdp")._microbatch_times(1, False, 1, 1, 1, "none", 1)[0]
    mds = CostModel(m, w, cl, stack="megatron-deepspeed")._microbatch_times(1, False, 1, 1, 1, "none", 1)[0]
    T, h, f, V, B = 2048, 2048, m.resolved_ffn_dim(), 32000, 2
    elt = B * T * (10 * h + 2 * (h + h) + 3 * f) / cl.device.hbm_bandwidth  # per layer forward
    d_other = STACKS["megatron-deepspeed"].other - STACKS["composer-fsdp"].other
    # 4 layers, each its elementwise bytes forward and twice backward, plus the loss's 16 bytes per logit
    assert mds - base == pytest.approx(d_other * (4 * 3 * elt + 16 * T * V / cl.device.hbm_bandwidth))
    with pytest.raises(PlanError, match="stack: must be one of"):
        CostModel(m, w, cl, stack="jax")


def test_a_compiled_step_runs_memory_bound_work_in_one_pass(tmp_path):
    """train.compile (a published run's ``compile``): Inductor fuses each block's pointwise chain, so the
    elementwise and loss bytes run at COMPILED_OTHER (one pass) instead of the stack's eager factor; the
    GEMMs and attention kernels are unchanged. A config's train.compile reaches the planner."""
    import dataclasses

    from loom.config import LoomConfig
    from loom.plan.cost.stacks import COMPILED_OTHER
    from loom.plan.report import workload_of

    m = ModelConfig(dim=2048, n_layers=4, n_heads=16, n_kv_heads=16, vocab_size=32000)
    cl = ClusterSpec.single_node("h100-sxm", 8)
    w = Workload(8, 2048)
    T, h, f, V, B = 2048, 2048, m.resolved_ffn_dim(), 32000, 2
    elt = B * T * (10 * h + 2 * (h + h) + 3 * f) / cl.device.hbm_bandwidth
    memory_bound = 4 * 3 * elt + 16 * T * V / cl.device.hbm_bandwidth  # 4 layers fwd + 2x bwd, the loss
    for stack in ("", "pytorch-fsdp", "megatron-core"):
        eager = CostModel(m, w, cl, stack=stack)
        fused = CostModel(m, dataclasses.replace(w, compile=True), cl, stack=stack)
        assert fused.other == COMPILED_OTHER == 1.0 < eager.other
        t = [c._microbatch_times(1, False, 1, 1, 1, "none", 1)[0] for c in (eager, fused)]
        assert t[0] - t[1] == pytest.approx((eager.other - COMPILED_OTHER) * memory_bound)
    lay = Layout.parse("dp8 zero3 mb1")
    assert CostModel(m, dataclasses.replace(w, compile=True), cl).estimate(lay).step_time < (
        CostModel(m, w, cl).estimate(lay).step_time
    )
    cfg = LoomConfig()
    assert not workload_of(cfg).compile
    cfg.train.compile = "blocks"
    assert workload_of(cfg).compile
    # a published run says so with ``compile = true``, checked as a bool
    src = (Path(__file__).resolve().parents[1] / "loom/plan/validation/torchtitan.toml").read_text()
    own = tmp_path / "own.toml"
    own.write_text(src.replace("seq_len = 8192", "seq_len = 8192\ncompile = true", 1))
    row = load_file(own)[0]
    assert row.workload.compile and not load_runs()[0].workload.compile
    own.write_text(src.replace("seq_len = 8192", "seq_len = 8192\ncompile = 'yes'", 1))
    with pytest.raises(PlanError, match="compile must be true or false"):
        load_file(own)


def test_a_run_of_any_stack_is_predicted_and_aliases_name_the_fitted_ones(tmp_path, capsys):
    """A published run of software none of the sources used (MaxText, DeepSpeed alone, ...) was refused:
    it is priced as the stack 'other' with one note naming it; the names publications use for the
    fitted stacks (torchtitan, NeMo, llm-foundry, ...) are those stacks."""
    from loom.plan.published import load_file, predict

    def run_of(stack: str):
        (tmp_path / "own.toml").write_text(_OWN.replace('"pytorch-fsdp"', f'"{stack}"', 1))
        return load_file(tmp_path / "own.toml")[0]

    fitted = run_of("pytorch-fsdp")
    assert capsys.readouterr().err == ""
    for alias in ("torchtitan", "TorchTitan", "fsdp2"):
        assert run_of(alias).stack == "pytorch-fsdp" and capsys.readouterr().err == ""
    assert run_of("nemo").stack == run_of("megatron-bridge").stack == "megatron-core"
    other = run_of("maxtext")
    err = capsys.readouterr().err.strip().splitlines()
    assert other.stack == "other" and len(err) == 1, err
    assert err[0].startswith(
        "loom: note: own.toml: stack 'maxtext' is none the planner was fitted on; priced as 'other'"
    )
    assert predict(other).tokens_per_s != predict(fitted).tokens_per_s  # torchtitan's own recomputation


def test_an_unstated_network_is_the_devices_reference_node(tmp_path):
    """Publications often leave the inter-node network out (it was refused): a run without
    ``inter_bandwidth_gbps`` gets its device's reference NIC share (25 GB/s per A100 of a DGX A100),
    so _OWN's stated 25 predicts the same; ``devices_per_node`` defaults to 8."""
    from loom.plan.published import load_file, predict

    (tmp_path / "own.toml").write_text(_OWN.replace(", inter_bandwidth_gbps = 25", "", 1))
    (tmp_path / "stated.toml").write_text(_OWN)
    unstated, stated = load_file(tmp_path / "own.toml")[0], load_file(tmp_path / "stated.toml")[0]
    assert unstated.cluster.inter_bandwidth == stated.cluster.inter_bandwidth == 25e9
    assert predict(unstated).tokens_per_s == predict(stated).tokens_per_s


def test_a_jobs_tokens_or_samples_per_second_are_the_same_measure(tmp_path):
    """Publications give the whole job's tokens/s or sequences/s (Megatron's "samples per second"):
    each is tokens/s per GPU times the GPUs (64 here), or that over the sequence (8192)."""
    from loom.plan.published import load_file

    def measure(text: str) -> float:
        (tmp_path / "own.toml").write_text(_OWN.replace("tokens_per_s_per_gpu = 2973", text, 1))
        return load_file(tmp_path / "own.toml")[0].tokens_per_s_per_gpu

    assert (
        measure("tokens_per_s = 190272") == measure(f"samples_per_s = {190272 / 8192}") == pytest.approx(2973)
    )
    (tmp_path / "own.toml").write_text(
        _OWN.replace("tokens_per_s_per_gpu = 2973", "tokens_per_s = 1\nmfu = 0.5")
    )
    with pytest.raises(
        PlanError, match="give exactly one of tokens_per_s_per_gpu, tokens_per_s, samples_per_s"
    ):
        load_file(tmp_path / "own.toml")


def test_cli_published_table(capsys):
    from loom.plan.validate import main

    code = main(["--published"])
    out = capsys.readouterr().out
    assert "published runs: mean |error|" in out and "BLOOM-176B" in out
    _, worst = summary(compare_published())
    assert code == (0 if worst <= MAX_TOLERANCE else 1)


_OWN = """
[models.m]
dim = 4096
n_layers = 32
n_heads = 32
n_kv_heads = 8
ffn_dim = 14336
vocab_size = 128256
tie_embeddings = false

[[runs]]
name = "mine"
model = "m"
stack = "pytorch-fsdp"
cluster = { device = "a100-80g", devices_per_node = 8, inter_bandwidth_gbps = 25 }
layout = "dp64 zero3 mb1 recompute:selective"
global_batch = 64
seq_len = 8192
tokens_per_s_per_gpu = 2973
source = "a run of my own"
"""


def test_cli_predicts_your_own_runs_as_the_shipped_ones(tmp_path, capsys):
    """``--published --runs FILE``: a user's file in the shipped format (here torchtitan's Llama 3 8B row
    copied) is predicted exactly as the shipped row is; exit status 1 beyond the 12% goal."""
    from loom.plan.validate import main

    (tmp_path / "own.toml").write_text(_OWN)
    shipped = next(r for r in compare_published() if r.run.name == "torchtitan Llama 3 8B, selective op AC")
    code = main(["--published", "--runs", str(tmp_path / "own.toml")])
    out = capsys.readouterr().out
    assert f"{100 * shipped.error:+.1f}%" in out and "mine" in out and "BLOOM" not in out
    assert code == (0 if abs(shipped.error) <= MAX_TOLERANCE else 1)


@pytest.mark.parametrize(
    "old, new, says",
    [
        ("dim = 4096", "dim = ", "own.toml: not valid TOML"),
        ("dim = 4096", 'dim = "big"', "own.toml: models.m.dim: expected an integer, got the string 'big'"),
        ("dim = 4096", "dim = -4", "own.toml: models.m.dim: must be >= 1"),
        (
            "n_heads = 32",
            "n_heads = 33",
            "own.toml: models.m.dim: 4096 must be divisible by model.n_heads=33",
        ),
        ("vocab_size = 128256", "vocab_size = 1.5", "models.m.vocab_size: expected an integer"),
        ("global_batch = 64", 'global_batch = "x"', "run 'mine': global_batch must be a whole number"),
        ("global_batch = 64", "global_batch = 0", "run 'mine': global_batch must be > 0"),
        ("global_batch = 64", "global_batch = 65", "run 'mine': layout dp64"),
        (
            "seq_len = 8192",
            "seq_len = 8192\nflash_attention = 'yes'",
            "flash_attention must be true or false",
        ),
        ("tokens_per_s_per_gpu = 2973", "tokens_per_s_per_gpu = nan", "tokens_per_s_per_gpu must be > 0"),
        (
            "tokens_per_s_per_gpu = 2973",
            "tokens_per_s_per_gpu = 'fast'",
            "tokens_per_s_per_gpu must be a number",
        ),
        ("devices_per_node = 8", "devices_per_node = 0", "cluster: devices_per_node must be > 0"),
        # 64 devices as 10 nodes of 7 were predicted for 70
        (
            "devices_per_node = 8",
            "devices_per_node = 7",
            "cluster: devices_per_node = 7 does not divide the layout's 64",
        ),
        (
            "inter_bandwidth_gbps = 25",
            "inter_bandwidth_gbps = '25'",
            "cluster: inter_bandwidth_gbps must be a number",
        ),
        ('"a100-80g"', '"tpu-v5"', "run 'mine': unknown device 'tpu-v5'"),
        (
            "seq_len = 8192",
            "seq_len = 8192\nprecision = 'fp4'",
            "run 'mine': precision: must be one of",
        ),
        ("zero3", "zero9", "run 'mine': layout"),
        # not finite: inf passed the > 0 test and --json printed Infinity (not JSON)
        (
            "tokens_per_s_per_gpu = 2973",
            "tokens_per_s_per_gpu = inf",
            "tokens_per_s_per_gpu must be > 0 and finite, got inf",
        ),
        (
            "tokens_per_s_per_gpu = 2973",
            "step_time_s = inf",
            "run 'mine': step_time_s must be > 0 and finite, got inf",
        ),
        (
            "inter_bandwidth_gbps = 25",
            "inter_bandwidth_gbps = inf",
            "run 'mine': cluster: inter_bandwidth_gbps must be > 0 and finite",
        ),
        (
            "inter_bandwidth_gbps = 25",
            "inter_bandwidth_gbps = 25, intra_bandwidth_gbps = -inf",
            "cluster: intra_bandwidth_gbps must be > 0 and finite",
        ),
        (
            "tie_embeddings = false",
            "tie_embeddings = false\nrope_theta = inf",
            "own.toml: models.m.rope_theta: must be a finite number, got inf",
        ),
        (
            "tie_embeddings = false",
            "tie_embeddings = false\nnorm_eps = nan",
            "own.toml: models.m.norm_eps: must be a finite number, got nan",
        ),
        # finite, but the tokens/s or TFLOP/s derived from it are not
        (
            "tokens_per_s_per_gpu = 2973",
            "step_time_s = 1e-320",
            "run 'mine': step_time_s = 1e-320 gives inf tokens/s per GPU",
        ),
        (
            "tokens_per_s_per_gpu = 2973",
            "tokens_per_s_per_gpu = 1e308",
            "run 'mine': its measured throughput (1e+308 tokens/s per GPU) is beyond",
        ),
        # FLOP counts: one of the known formulas, with a measure that counts FLOPs, an MFU a share of 1
        (
            "tokens_per_s_per_gpu = 2973",
            "tflops_per_gpu = 150\ntflops_formula = 'hardware'",
            "run 'mine': tflops_per_gpu needs tflops_formula, one of 'megatron', 'palm', '6n'",
        ),
        ("tokens_per_s_per_gpu = 2973", "mfu = 0.4", "run 'mine': mfu needs tflops_formula"),
        (
            "tokens_per_s_per_gpu = 2973",
            "mfu = 43\ntflops_formula = 'palm'",
            "run 'mine': mfu is a share of the device's bf16 peak, at most 1, got 43",
        ),
        (
            "tokens_per_s_per_gpu = 2973",
            "tokens_per_s_per_gpu = 2973\ntflops_formula = 'palm'",
            "run 'mine': tflops_formula applies to tflops_per_gpu or mfu, not tokens_per_s_per_gpu",
        ),
        # a second value of one layout field silently replaced the first; none at all was dp1 on 1 GPU
        (
            "zero3",
            "zero3 dp2",
            "run 'mine': layout: 'dp64' and 'dp2' in 'dp64 zero3 dp2 mb1 recompute:selective' both set dp",
        ),
        ('layout = "dp64 zero3 mb1 recompute:selective"', 'layout = " "', "run 'mine': layout: empty"),
        ("dp64", "dp0", "run 'mine': layout: 'dp0' in 'dp0 zero3"),
        ('name = "mine"', 'name = " "', "own.toml: run name: empty"),
        # the search enumerated a global batch's divisors: 4.6e18 ran for hours
        (
            "global_batch = 64",
            "global_batch = 4611686018427387904",
            "global_batch: at most 16,777,216 (2^24)",
        ),
        ("seq_len = 8192", "seq_len = 9223372036854775807", "run 'mine': seq_len: at most 16,777,216"),
        # widths of 4e12 printed tables of 1e20 TFLOP/s and -100% errors: each width has its bound
        ("dim = 4096", "dim = 4096000000000", "own.toml: models.m.dim: at most 131,072"),
        ("ffn_dim = 14336", "ffn_dim = 1000000000000", "own.toml: models.m.ffn_dim: at most 1,048,576"),
        ("vocab_size = 128256", "vocab_size = 1000000000000", "models.m.vocab_size: at most"),
        ("n_kv_heads = 8", "n_kv_heads = 8\nn_experts = 1000000000", "models.m.n_experts: at most 65,536"),
        ("n_kv_heads = 8", "n_kv_heads = 8\nattn_head_dim = 100000000000", "models.m.attn_head_dim: at most"),
        ("n_kv_heads = 8", "n_kv_heads = 8\nmax_seq_len = 100000000000", "models.m.max_seq_len: at most"),
        ("[models.m]", "[modelz.m]", "own.toml: unknown table 'modelz'"),
        ("[[runs]]", "[runs]", "own.toml: runs must be an array of tables"),
        ("tie_embeddings = false", "tie_embeddings = false\nfoo = 1", "own.toml: models.m.foo: unknown key"),
    ],
)
def test_a_bad_runs_file_is_one_line_naming_the_file_and_key(tmp_path, capsys, old, new, says):
    assert old in _OWN
    (tmp_path / "own.toml").write_text(_OWN.replace(old, new, 1))
    _refused_in_one_line(tmp_path / "own.toml", says, capsys)


def _refused_in_one_line(path, says: str, capsys) -> None:
    """``loom plan validate --published --runs PATH`` (and with ``--json``) exits 2 with one stderr
    line containing ``says`` and prints nothing on stdout."""
    from loom.plan.validate import main

    for extra in ([], ["--json"]):
        assert main(["--published", "--runs", str(path), *extra]) == 2
        captured = capsys.readouterr()
        assert captured.err.count("\n") == 1 and says in captured.err, captured.err
        assert captured.out == ""


def test_a_run_name_given_twice_is_refused(tmp_path, capsys):
    """Two runs of one name (in one file, two files, or one file given twice) would count twice in
    the means and in --fit: refused naming the run and where it was first."""
    from loom.plan.validate import main

    (tmp_path / "own.toml").write_text(_OWN)
    (tmp_path / "two.toml").write_text(_OWN + _OWN[_OWN.index("[[runs]]") :])
    for files, says in (
        (["own.toml", "own.toml"], "own.toml: run 'mine': the name of a run in own.toml too"),
        (["two.toml"], "two.toml: run 'mine': the name of a run in two.toml too"),
    ):
        assert main(["--published", "--runs", *(str(tmp_path / f) for f in files)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err


def test_runs_files_that_cannot_be_read_are_one_line(tmp_path, capsys):
    (tmp_path / "latin1.toml").write_bytes(b"# caf\xe9\n")
    for path, says in (
        (tmp_path / "none.toml", "does not exist"),
        (tmp_path, "is a directory"),
        (tmp_path / "latin1.toml", "not UTF-8"),
    ):
        _refused_in_one_line(path, says, capsys)


def _small_llama() -> ModelConfig:
    return ModelConfig(dim=4096, n_layers=8, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000)


def test_tp_overlap_hides_collectives_behind_their_gemms():
    """Overlapped: per layer tp_comm / t (the first chunk) + max(0, rest - G) + (1 - comm_overlap)
    min(rest, G), rest = tp_comm (t-1)/t, G the GEMMs fwd+bwd: what hides behind compute still costs
    1 - comm_overlap, the data-parallel overlap's rule (dp.contended; before: hidden for free)."""
    import dataclasses

    from loom.plan.cost.dp import contended, exposed

    m = _small_llama()
    cl = ClusterSpec.single_node("h100-sxm", 8)
    cm = CostModel(m, Workload(8, 4096), cl)
    mach, t, T, h, f = cm.machine, 8, 4096, 4096, 14336
    share = cl.device.comm_overlap
    assert share == 0.8 and mach.comm_overlap(8) == share
    layer_comm = sum(
        k * mach.collective(op, t, size, t)
        for (op, size), k in cm.tp_calls(t, True, "none", 1, "layer").items()
    )
    gemm_f = (
        mach.gemm(T, h, h / t, 2)
        + 2 * mach.gemm(T, h, cm.kv_width(t), 2)
        + mach.gemm(T, h / t, h, 2)
        + 2 * mach.gemm(T, h, f / t, 2)
        + mach.gemm(T, f / t, h, 2)
    )
    rest, G = layer_comm * (t - 1) / t, 3 * gemm_f
    hidden = layer_comm / t + max(0.0, rest - G) + (1 - share) * min(rest, G)
    assert exposed(layer_comm, t, G, share) == pytest.approx(hidden)
    assert contended(2.0, 3.0, share) == pytest.approx(2.0 + (1 - share) * 3.0)
    off = cm._microbatch_times(t, True, 1, 1, 1, "none", 1, 8, "allgather", False)[2]["tp comm"]
    on = cm._microbatch_times(t, True, 1, 1, 1, "none", 1, 8, "allgather", True)[2]["tp comm"]
    assert off - on == pytest.approx(8 * (layer_comm - hidden))
    assert on < off
    # a device hiding all of it (comm_overlap 1) keeps the free overlap; one hiding none (0) shows all
    for s, want in ((1.0, layer_comm / t + max(0.0, rest - G)), (0.0, layer_comm)):
        dev = dataclasses.replace(cl.device, comm_overlap=s)
        c = CostModel(m, Workload(8, 4096), dataclasses.replace(cl, device=dev))
        got = c._microbatch_times(t, True, 1, 1, 1, "none", 1, 8, "allgather", True)[2]["tp comm"]
        assert got - (off - 8 * layer_comm) == pytest.approx(8 * want)
    lay = Layout.parse("dp1 tp8 pp1 sp mb1 recompute:none tp-overlap")
    assert lay.tp_overlap and Layout.parse(lay.spec()) == lay


def test_fp8_scaling_casts_are_priced_where_the_stack_casts_apart():
    """torchao's dynamic scaling (Loom's and torchtitan's fp8) moves, per 8-bit Linear (M x K) @ (K x N) and
    micro-batch, 6 M K + 5 K N bytes forward and 3 K N + 6 M N backward (tensorwise; rowwise 8, 3, 7, 8):
    its amax and cast kernels (torchao's roofline counts). Linears too small for float8 to pay stay bf16
    and cast nothing; Transformer Engine's fused casts (megatron-core) are in its fitted 8-bit rate."""
    import dataclasses

    from loom.memory.precision import runs_8bit
    from loom.plan.cost.compute import SCALE_CAST_BYTES

    m = _small_llama()
    cl = ClusterSpec.single_node("h100-sxm", 8)
    T, h, f, kv = 4096, 4096, 14336, 1024
    shapes = [(1, h, h), (2, h, kv), (1, h, h), (2, h, f), (1, f, h)]  # q, k and v, o, w1 and w3, w2
    for recipe in ("tensorwise", "rowwise"):
        w = Workload(8, T, precision="fp8", fp8_recipe=recipe)
        b_x, b_w, b_wb, b_g = SCALE_CAST_BYTES[recipe]
        eight = [(c, k, n) for c, k, n in shapes if runs_8bit("fp8", k, n, recipe, "auto")]
        assert (2, h, kv) not in eight  # k and v: too small for tensorwise float8 to pay
        fwd = sum(c * (b_x * T * k + b_w * k * n) for c, k, n in eight)
        bwd = sum(c * (b_wb * k * n + b_g * T * n) for c, k, n in eight)
        with_casts = CostModel(m, w, cl)
        assert with_casts.stack.scale_casts
        without = CostModel(m, w, cl)
        without.stack = dataclasses.replace(without.stack, scale_casts=False)
        got = [
            c._microbatch_times(1, False, 1, 1, 1, "none", 1, 8)[2]["compute"] for c in (with_casts, without)
        ]
        hbm = with_casts.machine.hbm
        assert got[0] - got[1] == pytest.approx(m.n_layers * (fwd + bwd) / hbm, rel=1e-9)
        full = [
            c._microbatch_times(1, False, 1, 1, 1, "full", 1, 8)[2]["recompute"]
            for c in (with_casts, without)
        ]
        assert full[0] - full[1] == pytest.approx(m.n_layers * fwd / hbm, rel=1e-9)  # forward casts again
    te = CostModel(m, Workload(8, T, precision="fp8"), cl, stack="megatron-core")
    assert not te.stack.scale_casts


def test_hybrid_sharding_all_reduces_each_buckets_shard_across_replicas():
    """ZeRO 1 over N of dp: per bucket a reduce-scatter and an all-gather over N, and the bucket's shard
    all-reduced across the dp / N replicas, K bucket calls each paying their latency (Loom's reducer
    issues one per bucket; the replica all-reduce was priced as one call, which favoured hybrid layouts)."""
    from loom.plan.cost.dp import dp_comm, grad_all_reduce

    m = _small_llama()
    cl = ClusterSpec.single_node("h100-sxm", 8, 8)
    cm = CostModel(m, Workload(64, 4096), cl)
    mach, wd = cm.machine, 64
    dense = cm._params_on(1, 1, 1, True, True)[0]
    K = -(-int(dense * cm.R) // int(cm.train.bucket_bytes))
    assert K > 10
    n, reps = 8, 8  # dp 64 = 8 replicas of shards over 8
    rs = mach.collective("reduce_scatter", n, dense * cm.R, 8, wd)
    ag = mach.collective("all_gather", n, dense * cm.W, 8, wd, synced=True)
    lat = mach.latency("reduce_scatter", n, 8, wd) + mach.latency("all_gather", n, 8, wd, synced=True)
    ar = grad_all_reduce(cm, reps, dense * cm.R / n, 64, wd, K)
    assert ar == pytest.approx(
        mach.collective("all_reduce", reps, dense * cm.R / n, 64, wd)
        + (K - 1) * mach.latency("all_reduce", reps, 64, wd)
    )
    assert dp_comm(cm, 64, 8, 1, 1, 1, 1, 1, 1, wd) == pytest.approx(rs + ag + (K - 1) * lat + ar)


def test_dp_overlap_bucket_by_bucket():
    """ZeRO-0: the K bucket all-reduces (c = total / K each) queue on one stream as their gradients
    complete in the last backward t_b (bucket i at t_b i / K): exposed = finish - t_b, plus
    (1 - comm_overlap) of the hidden part; off: total. Interleaved chunks finish earlier."""
    from loom.plan.cost.dp import queue_finish, reduce_ready_times, serial_finish

    m = _small_llama()
    cl = ClusterSpec.single_node("a100-80g", 8, 2)
    w = Workload(64, 4096, bucket_bytes=100 * 2**20)
    cm = CostModel(m, w, cl)
    lay = Layout(dp=16, micro_batch=1)
    total = cm._dp_comm(16, 1, 1, 1, 1, 1, 0, 4, 16)
    K = -(-int(cm._params_on(1, 1, 1, True, True)[0] * 4) // (100 * 2**20))
    share = cl.device.comm_overlap
    c = total / K
    for t_mb in (0.01, 1.0):
        t_b = t_mb * 2 / 3
        end = 0.0
        for i in range(K):  # by hand: bucket i starts when ready and the stream is free
            end = max(end, t_b * (i + 1) / K) + c
        shown = max(0.0, end - t_b)
        want = shown + (1 - share) * (total - min(total, shown))
        assert cm._dp_time(lay, 4, t_mb, 4 * t_mb) == pytest.approx(want)
    assert serial_finish([0.0, 0.0], [1.0, 2.0]) == 3.0 and serial_finish([5.0], [1.0]) == 6.0
    # v = 2 chunks on p = 4 stages: chunk 1 ends p = 4 chunk-backwards (t_b / 2 each) before chunk 0
    assert reduce_ready_times(1.0, 4, 4, 2) == pytest.approx([-1.25, -1.0, 0.75, 1.0])
    for n, p, v, cc in ((40, 1, 1, 0.01), (40, 4, 2, 0.05), (37, 8, 5, 0.002), (120, 4, 4, 0.03)):
        ready = reduce_ready_times(1.0, n, p, v)
        assert queue_finish(1.0, n, p, v, cc) == pytest.approx(serial_finish(ready, [cc] * len(ready)))
    assert cm._dp_time(Layout(dp=16, micro_batch=1, dp_overlap=False), 4, 1.0, 4.0) == pytest.approx(total)
    z3 = Layout(dp=16, dp_shard=16, zero=3, micro_batch=1)  # prefetch under all 4 micro-batches
    total3 = cm._dp_comm(16, 16, 1, 1, 1, 1, 3, 4, 16)
    units = cm.zero3_units(1)[0]
    last3 = total3 / (4 * (2 * units - 1) + units)
    assert cm._dp_time(z3, 4, 1.0, 4.0) == pytest.approx(
        last3 + max(0.0, total3 - last3 - 4.0) + (1 - share) * min(total3 - last3, 4.0)
    )
    # ZeRO-1: the gathers under the next forward t_f, bucket j needed at (j - 1) t_f / K
    z1 = Layout(dp=16, dp_shard=16, zero=1, micro_batch=1)
    tot1 = cm._dp_comm(16, 16, 1, 1, 1, 1, 1, 4, 16)
    gather, reduce = tot1 * 2 / 6, tot1 * 4 / 6  # Phi W of Phi (R + W): W = 2 (bf16), R = 4 (fp32)
    t_b, t_f = 2 / 3, 1 / 3
    r_shown = max(0.0, serial_finish([t_b * (i + 1) / K for i in range(K)], [reduce / K] * K) - t_b)
    g = gather / K
    g_shown = g + (K - 1) * max(0.0, g - t_f / K)
    want1 = r_shown + g_shown + (1 - share) * (reduce - min(reduce, r_shown) + gather - min(gather, g_shown))
    assert cm._dp_time(z1, 4, 1.0, 4.0) == pytest.approx(want1)
    # the CPU (gloo on the compute cores) hides nothing
    cpu = CostModel(m, w, ClusterSpec.single_node("cpu", 2))
    assert cpu._dp_time(Layout(dp=2), 4, 1.0, 4.0) == pytest.approx(cpu._dp_comm(2, 1, 1, 1, 1, 1, 0, 4, 2))


def test_search_ranks_uneven_pipelines_and_counts_the_fullest_stage():
    """30 blocks on 4 stages: 7, 8, 8, 7 (spare blocks in the middle); memory checks the middle stage too."""
    from loom.plan.search import search

    m = ModelConfig(dim=2048, n_layers=30, n_heads=16, n_kv_heads=16, vocab_size=32000)
    cl = ClusterSpec.single_node("a100-80g", 8)
    result = search(m, Workload(64, 2048), cl)
    assert any(e.layout.pp == 4 for e in result.ranked)
    assert "pp must divide n_layers" not in result.rejected
    cm = CostModel(m, Workload(64, 2048), cl)
    lay = Layout(dp=2, pp=4, micro_batch=1)
    assert [stage for stage, *_ in cm._stages(4)] == ["first", "middle", "last"]
    middle, first = cm.stage_memory(lay, 1), cm.stage_memory(lay, 0)
    # the middle stage holds 8 blocks against the first's 7 (and no embedding)
    per_block = cm._params_on(1, 4, 1, False, False)[0] / 8
    assert cm._params_on(1, 4, 1, True, False)[0] == pytest.approx(7 * per_block + 32000 * 2048)
    assert first["activations"] / (4 * 7) == pytest.approx(
        middle["activations"] / (3 * 8)
    )  # 1F1B: p - i in flight


def test_lighter_end_splits_are_expressed_searched_and_read_from_pp_layout():
    """An explicit split (Layout.split, from parallel.pp_layout) sets each stage's blocks; the search
    also tries even splits with one block moved off the first and last stage."""
    from loom.config import load, preset_path
    from loom.plan.report import layout_of
    from loom.plan.search import lighter_ends, search

    assert (
        lighter_ends(32, 4) == (7, 9, 9, 7)
        and lighter_ends(30, 3) == (9, 12, 9)
        and lighter_ends(30, 4) == ()
    )
    m = ModelConfig(dim=2048, n_layers=32, n_heads=16, n_kv_heads=16, vocab_size=128000)
    cl = ClusterSpec.single_node("a100-80g", 8)
    cm = CostModel(m, Workload(64, 2048), cl)
    even, light = Layout(dp=2, pp=4, micro_batch=1), Layout(dp=2, pp=4, micro_batch=1, split=(7, 9, 9, 7))
    assert (
        cm.stage_layers(4, True, False, light.split) == 7
        and cm.stage_layers(4, False, False, light.split) == 9
    )
    # the first stage's parameters: 7 blocks and the 128k embedding instead of 8 blocks
    per_block = cm._params_on(1, 4, 1, False, False)[0] / 8
    assert cm.state_memory(light, True, False)["weights"] == pytest.approx(
        2 * (7 * per_block + 128000 * 2048)
    )
    assert cm.estimate(light).step_time != cm.estimate(even).step_time
    assert Layout.parse(light.spec()) == light
    assert "split must give" in (cm.check(Layout(dp=2, pp=4, split=(8, 8, 8))) or "")
    result = search(m, Workload(64, 2048), cl)
    assert any(e.layout.split == (7, 9, 9, 7) for e in result.ranked)
    cfg = load(
        str(preset_path("debug")),
        [
            "--model.n_layers",
            "4",
            "--parallel.pp",
            "2",
            "--parallel.pp_layout",
            "0-0,1-3",
            "--run.nproc",
            "2",
        ],
    )
    assert layout_of(cfg).split == (1, 3)


def test_verify_builds_the_planners_stage_split():
    """``loom plan verify`` runs the blocks per stage the planner priced: its split, or its default rule."""
    from loom.config import load, preset_path
    from loom.plan.cost import default_split, split_layout
    from loom.train.verify import job_config

    assert default_split(70, 12) == (5,) + (6,) * 10 + (5,) and split_layout((1, 3)) == "0-0,1-3"
    assert split_layout((3, 4), 2) == "0-0,1-2,3-4,5-6"  # device 0: 1 + 2 blocks, device 1: 2 + 2
    cfg = load(str(preset_path("debug")), ["--model.n_layers", "6"])
    assert job_config(cfg, Layout(pp=4), 16, 4).parallel.pp_layout == "0-0,1-2,3-4,5-5"  # 1, 2, 2, 1
    assert job_config(cfg, Layout(pp=2, split=(2, 4)), 16, 2).parallel.pp_layout == "0-1,2-5"


def test_leave_one_source_out_gate():
    """Each source (PublishedRun.group) predicted from constants fitted on the other sources only,
    from neutral starts: mean |error| <= 8%, max <= 20% (the table: docs/results/planner_sources.md)."""
    from loom.plan.fit import leave_one_source_out, per_source

    rows = leave_one_source_out(load_runs())
    errs = [abs(e) for _, e in rows]
    table = per_source(rows)
    assert len(table) >= 6
    assert sum(errs) / len(errs) <= LOSO_MEAN and max(errs) <= LOSO_MAX, table


def test_megatron_core_buckets_grow_with_the_data_parallel_group():
    """Megatron-Core's DDP buckets max(40M, 1M x dp cp) parameters (of the reduce dtype); Loom's and
    PyTorch DDP's stay at parallel.bucket_mb. Fewer calls, so less ring latency in a large group."""
    m = ModelConfig(dim=4096, n_layers=8, n_heads=32, vocab_size=32000)
    cl = ClusterSpec.single_node("h100-sxm", 8, 16)
    w = Workload(512, 2048, reduce_dtype="bf16")
    core, loom = CostModel(m, w, cl, stack="megatron-core"), CostModel(m, w, cl)
    assert core.bucket_bytes(8) == 40e6 * 2 and core.bucket_bytes(128) == 128e6 * 2
    assert loom.bucket_bytes(128) == w.bucket_bytes == 25 * 2**20
    assert core.buckets(1e9, 128) == math.ceil(1e9 / 256e6) and loom.buckets(1e9, 128) == math.ceil(
        1e9 / 2**20 / 25
    )
    from loom.plan.cost.comm import collective_calls

    lay = Layout(dp=128, dp_shard=128, zero=1, micro_batch=4)
    grads = core._params_on(1, 1, 1, True, True)[0] * 2  # bf16 gradients of the whole model (tp = pp = 1)
    for cm, bucket in ((core, 128e6 * 2), (loom, 25 * 2**20)):  # one reduce-scatter and one gather per bucket
        calls = collective_calls(cm, lay)
        assert calls["reduce_scatter"] == calls["all_gather"] == math.ceil(grads / bucket)
    assert core.estimate(lay).time_breakdown["dp comm"] < loom.estimate(lay).time_breakdown["dp comm"]


# (mean, max) |error| per file of benchmarks/heldout/: Narayanan et al. 2021's Table 1 within the goal
# (today 5.8% / 10.3%); NVIDIA's DGX Cloud recipes (NeMo 24.09-25.02, H100) at today's figures, a
# regression bound, not the goal (11.9% / 25.4%: their bf16 rows run about 18% faster than the H100
# bf16 share fitted on llm-foundry's rows predicts; docs/planner.md, "Rows never fitted on");
# Megatron-Bridge's fine-grained MoE rows (Qwen3-30B-A3B, 235B-A22B, GPT-OSS-120B on H100) at today's
# 38.1% / 201.4%, a regression bound: the Qwen3-30B rows at ep 8 inside a node run 3x slower than
# predicted (test_fine_grained_moe_rows_by_group)
HELD_OUT_BOUNDS = {
    "narayanan2021_table1.toml": (0.08, 0.12),
    "dgxc_h100.toml": (0.125, 0.26),
    "megatron_bridge_moe_h100.toml": (0.35, 1.65),
}


def test_rows_never_fitted_on_are_predicted_within_their_bounds():
    """benchmarks/heldout/: published rows outside loom/plan/validation (so outside every fit),
    configured as their publication's scripts ran them, predicted with the shipped constants within
    each file's bound (:data:`HELD_OUT_BOUNDS`; a new file must name its own)."""
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "heldout").glob("*.toml"))
    assert {f.name for f in files} == set(HELD_OUT_BOUNDS)
    shipped = {r.name for r in load_runs()}
    for path in files:
        table = compare_published(load_file(path))
        assert len(table) >= 9 and not {c.run.name for c in table} & shipped
        mean, worst = summary(table)
        bound = HELD_OUT_BOUNDS[path.name]
        assert mean <= bound[0] and worst <= bound[1], format_published(table)


# |error| bound per row group of benchmarks/heldout/megatron_bridge_moe_h100.toml (today's figures; before
# the MoE routing bytes, the experts' backward at their shapes and ep-overlap: +178/+198%, -8/-9%,
# -18/-24%, +25/+28%; before the attention core counted a·d, not h, and GPT-OSS's sliding window:
# +199/+201%, -16/-18%, -5.4/+1.7%, +15.6/+19.2%)
MOE_GROUP_BOUNDS = {
    "Qwen3-30B-A3B FP8, 16 H100, ep8 pp2": 1.65,  # +161%, +164%: not priced (docs/planner.md)
    "Qwen3-30B-A3B FP8, 16 H100, ep16": 0.23,  # -21.8% to -22.9%
    "Qwen3-235B-A22B": 0.07,  # -6.5% to +0.5%
    "GPT-OSS-120B": 0.22,  # +17.4% to +21.1%
}


def test_fine_grained_moe_rows_by_group():
    """Each row group of the fine-grained MoE file within its bound (:data:`MOE_GROUP_BOUNDS`), every
    row in one group; the 235B's all-to-alls beside another micro-batch's compute (ep-overlap, as its
    recipe runs them) took it from -18..-24% to -5..+2%."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "heldout" / "megatron_bridge_moe_h100.toml"
    table = compare_published(load_file(path))
    for c in table:
        groups = [g for g in MOE_GROUP_BOUNDS if g in c.run.name]
        assert len(groups) == 1, c.run.name
        assert abs(c.error) <= MOE_GROUP_BOUNDS[groups[0]], format_published(table)
    assert {g for c in table for g in MOE_GROUP_BOUNDS if g in c.run.name} == set(MOE_GROUP_BOUNDS)


def _tiny_moe(n_layers: int = 1, n_experts: int = 4) -> ModelConfig:
    return ModelConfig(
        dim=8,
        n_layers=n_layers,
        n_heads=2,
        n_kv_heads=1,
        ffn_dim=16,
        n_experts=n_experts,
        top_k=2,
        vocab_size=32,
    )


def test_moe_routing_bytes_by_hand():
    """E = 4, k = 2, h = 8, B_a = 2, T_r = T_p = 3 tokens, n_s = 6 copies, n_e = 6 rows: router fwd
    (12·4 + 12·2)·3 = 216, bwd 16·4·3 = 192; permute + combine fwd (3·6 + 3)·16 = 336, bwd
    (3·6 + 2·3)·16 = 384; the regroup 4·6·16 = 384 each way only under ep > 1 with several experts here."""
    from loom.plan.cost.compute import moe_routing_bytes

    cm = CostModel(_tiny_moe(), Workload(1, 16), ClusterSpec.single_node("h100-sxm", 8))
    assert moe_routing_bytes(cm, 3, 3, 6, 2, 2) == (216 + 336 + 384, 192 + 384 + 384)
    assert moe_routing_bytes(cm, 3, 3, 6, 1, 4) == (216 + 336, 192 + 384)
    assert moe_routing_bytes(cm, 3, 3, 6, 4, 1) == (216 + 336, 192 + 384)  # one expert here: no regroup
    # fp32 activations: 4 bytes per element of the rows, the router's bytes as they were
    cm32 = CostModel(_tiny_moe(), Workload(1, 16, precision="fp32"), ClusterSpec.single_node("h100-sxm", 8))
    assert moe_routing_bytes(cm32, 3, 3, 6, 1, 4) == (216 + 2 * 336, 192 + 2 * 384)


def test_moe_routing_is_priced_in_moe_layers_only():
    """A micro-batch's compute holds L x other x (fwd + bwd) / HBM of :func:`moe_routing_bytes` for an
    MoE layer (T_r = T, n_s = k T, n_e = k T at ep 2, 2 experts here), and nothing for a dense one."""
    import loom.plan.cost.compute as compute

    cl = ClusterSpec.single_node("h100-sxm", 8)
    L, T = 3, 1024
    moe = CostModel(_tiny_moe(L), Workload(8, T), cl, stack="megatron-core")
    dense = CostModel(_tiny_moe(L, n_experts=1), Workload(8, T), cl, stack="megatron-core")
    args = (1, False, 1, 2, 1, "none", 1)

    def priced(cm: CostModel) -> float:
        return compute.microbatch_times(cm, *args)[2]["compute"]

    with_bytes = priced(moe), priced(dense)
    real = compute.moe_routing_bytes
    try:
        compute.moe_routing_bytes = lambda *a: (0.0, 0.0)
        without = priced(moe), priced(dense)
    finally:
        compute.moe_routing_bytes = real
    fwd, bwd = real(moe, T, T, 2 * T, 2, 2)
    assert with_bytes[0] - without[0] == pytest.approx(L * moe.other * (fwd + bwd) / moe.machine.hbm)
    assert with_bytes[1] == without[1]


def test_expert_backward_gemms_at_their_own_shapes():
    """A routed expert's GEMM (64 x 128) @ (128 x 256) on an H100 in bf16: its input gradient
    (64 x 256) @ (256 x 128) is one 64 x 128 tile (tiles shrink to cover m and n), its weight gradient
    (128 x 64) @ (64 x 256) one 128 x 256 tile, each one wave of (k + K0) steps at the per-SM rate
    (above its bytes); on a CPU (no wave model) r and r/2 times the forward, as a dense Linear's."""
    from loom.plan.cost.compute import expert_backward, linear_gemm

    cm = CostModel(_tiny_moe(), Workload(8, 1024), ClusterSpec.single_node("h100-sxm", 8))
    dev = get_device("h100-sxm")
    per_sm = dev.bf16_flops * dev.achievable / dev.sms
    dgrad = 2 * 64 * 128 * (256 + GEMM_K0) / per_sm
    wgrad = 2 * 128 * 256 * (64 + GEMM_K0) / per_sm
    assert dgrad > 2 * (64 * 256 + 256 * 128 + 64 * 128) / dev.hbm_bandwidth  # compute-bound
    assert expert_backward(cm, 64, 128, 256) == pytest.approx((dgrad + wgrad, wgrad))
    # Transformer Engine's experts in fp8: the same shapes at the 8-bit rate, 1-byte operands
    fp8 = CostModel(
        _tiny_moe(), Workload(8, 1024, precision="fp8", fp8_layers="all"), cm.cluster, stack="megatron-core"
    )
    per_sm8 = dev.fp8_flops * dev.achievable_8bit / dev.sms
    w8 = 2 * 128 * 256 * (64 + GEMM_K0) / per_sm8
    assert expert_backward(fp8, 64, 128, 256) == pytest.approx(
        (2 * 64 * 128 * (256 + GEMM_K0) / per_sm8 + w8, w8)
    )
    cpu = CostModel(_tiny_moe(), Workload(8, 1024, precision="fp32"), ClusterSpec.single_node("cpu", 2))
    fwd = linear_gemm(cpu, 64, 128, 256, expert=True)
    assert expert_backward(cpu, 64, 128, 256) == pytest.approx((cpu.bwd_ratio * fwd, cpu.bwd_ratio / 2 * fwd))


def test_ep_overlap_hides_all_to_alls_behind_the_layers_compute():
    """ep-overlap (Megatron-Core's --overlap-moe-expert-parallel-comm): a layer's all-to-alls A beside
    another micro-batch's compute of the layer C cost max(0, A - C) + (1 - comm_overlap) min(A, C)
    (dp.contended); C from two models one layer apart (the head cancels). Read and written as a
    layout token, shown in the table."""
    from loom.plan.cost.compute import microbatch_times
    from loom.plan.cost.dp import contended
    from loom.plan.published import _layout_cell

    cl = ClusterSpec.single_node("h100-sxm", 8, 2)
    work = Workload(64, 4096, precision="fp8", fp8_layers="all", expert_folding=True)
    big = dict(dim=2048, n_heads=16, n_kv_heads=4, ffn_dim=768, n_experts=128, top_k=8, vocab_size=32000)
    one, two = (CostModel(ModelConfig(n_layers=n, **big), work, cl, stack="megatron-core") for n in (1, 2))

    def terms(cm: CostModel, overlap: bool) -> dict[str, float]:
        return microbatch_times(
            cm, 1, False, 1, 16, 1, "none", 1, 16, "allgather", False, (), "replicate", overlap
        )[2]

    A, C = terms(one, False)["ep comm"], terms(two, False)["compute"] - terms(one, False)["compute"]
    share = one.machine.comm_overlap(16)
    assert A > C > 0 and share == 0.8  # across 2 nodes the all-to-alls outlast the layer's compute
    assert terms(one, True)["ep comm"] == pytest.approx(contended(A - C, C, share))
    assert terms(one, True)["compute"] == terms(one, False)["compute"]
    lay = Layout.parse("dp16 ep16 zero1 ep-overlap mb1")
    assert lay.ep_overlap and Layout.parse(lay.spec()) == lay and "ep-overlap" in _layout_cell(lay)
    assert "ep-overlap" not in _layout_cell(Layout.parse("dp16 ep16 zero1 mb1"))


def test_stack_factor_needs_two_sources_and_8bit_share_is_its_own():
    """A stack used by one source runs at Loom's factor, or borrows the factor of the stack whose
    kernels it runs (its rows predicted with it, never fitted to); fp8 GEMMs read the 8-bit share of
    the fp8 peak, their attention the bf16 peak."""
    from loom.plan.fit import current, errors, informing, stacks_with_sources

    runs = load_runs()
    assert stacks_with_sources(runs) == {"megatron-core", "megatron-deepspeed"}
    for name in ("composer-fsdp", "pytorch-fsdp"):
        assert STACKS[name].other == STACKS[""].other and not STACKS[name].other_of
    row = next(r for r in runs if r.stack == "megatron-lm-2021")
    assert STACKS["megatron-lm-2021"].other_of == "megatron-core" and row not in informing(runs)
    core = CostModel(row.model, row.workload, row.cluster, stack="megatron-core")
    assert CostModel(row.model, row.workload, row.cluster, stack=row.stack).other == core.other
    assert core.other == STACKS["megatron-core"].other != STACKS[""].other
    # the borrowed factor moves with the fitted one: a refit of Megatron-Core's moves this row
    now = current(runs)
    slower = dict(now, **{"other:megatron-core": 2 * now["other:megatron-core"]})
    assert errors([row], slower)[0] < errors([row], now)[0]
    assert set(current(runs)) == {
        "achievable:a100-80g",
        "achievable:h100-sxm",
        "achievable8:h100-sxm",
        "other:megatron-core",
        "other:megatron-deepspeed",
    }
    dev = get_device("h100-sxm")
    fp8 = Machine(ClusterSpec.single_node("h100-sxm", 8), "fp8")
    assert fp8.flops == pytest.approx(1979e12 * dev.achievable_8bit)
    assert fp8.attention(1e12, False) == pytest.approx(1e12 / (989.5e12 * dev.flash_fwd))


def test_refit_restores_the_tables_and_never_worsens_the_objective():
    import loom.plan.hardware.datasheets as hw
    from loom.plan.fit import constants, current, errors, fit, objective

    runs = [r for r in load_runs() if r.name.startswith(("BLOOM", "MT-NLG", "torchtitan Llama 3 8B"))]
    now = current(runs)
    assert set(now) == {"achievable:a100-80g", "other:megatron-deepspeed"}
    with constants(dict(now, **{"achievable:a100-80g": 0.5, "k0": 64.0})):
        assert hw.DEVICES["a100-80g"].achievable == 0.5 and hw.GEMM_K0 == 64.0
    assert hw.DEVICES["a100-80g"].achievable == now["achievable:a100-80g"] and hw.GEMM_K0 == GEMM_K0
    assert objective(errors(runs, now)) == pytest.approx(
        objective([r.error for r in compare_published(runs)])
    )
    start = dict(now, **{"other:megatron-deepspeed": 1.0})
    assert objective(errors(runs, fit(runs, start, sweeps=1))) <= objective(errors(runs, start))


def test_transformer_engine_keeps_8bit_linear_inputs_in_one_byte():
    """Under fp8 (every block Linear 8-bit) a stack with ``saves_8bit_inputs`` keeps the inputs of the
    weight gradients in 1 byte instead of B_a = 2: one block saves (B_a - 1)·T·(2h/t_sp + q/t + f/t)
    bytes less (both norms' outputs, sequence-sharded under sp; the core's output; the MLP product)."""
    from loom.plan.cost.memory import layer_saved

    m = ModelConfig(dim=1024, n_layers=4, n_heads=16, n_kv_heads=4, ffn_dim=2816, vocab_size=32000)
    cl = ClusterSpec.single_node("h100-sxm", 8)
    w = Workload(8, 2048, precision="fp8", fp8_layers="all")
    assert STACKS["megatron-core"].saves_8bit_inputs and not STACKS["pytorch-fsdp"].saves_8bit_inputs
    for t, sp in ((1, False), (4, True)):
        te = layer_saved(CostModel(m, w, cl, stack="megatron-core"), t, sp, 1, 2)
        torchao = layer_saved(CostModel(m, w, cl, stack="pytorch-fsdp"), t, sp, 1, 2)
        T = 2 * 2048
        want = T * (2 * 1024 / (t if sp else 1) + 1024 / t + 2816 / t)
        assert torchao[0] - te[0] == pytest.approx(want) and te[1:] == torchao[1:]
    bf16 = Workload(8, 2048, precision="bf16")  # no 8-bit Linear: the same bytes on every stack
    assert layer_saved(CostModel(m, bf16, cl, stack="megatron-core"), 1, False, 1, 2) == layer_saved(
        CostModel(m, bf16, cl, stack="pytorch-fsdp"), 1, False, 1, 2
    )


def test_an_moe_layer_times_its_routers_gemm():
    """The router's logits (T x h) @ (h x E) run in bf16 outside the 8-bit swap and are in the model
    FLOPs, so they are timed: per layer forward, Machine.gemm(T, h, E) once (65,536 experts gave an MFU
    of 169% when they were counted but not timed)."""
    import dataclasses

    from loom.plan.hardware import Machine

    m = dataclasses.replace(_small_llama(), n_experts=64, top_k=2)
    cl = ClusterSpec.single_node("h100-sxm", 8)
    cm = CostModel(m, Workload(8, 4096), cl)
    calls = []
    real = Machine.gemm

    def gemm(self, mm, k, n, *a, **kw):
        calls.append((mm, k, n))
        return real(self, mm, k, n, *a, **kw)

    Machine.gemm = gemm
    try:
        cm._microbatch_times(1, False, 1, 1, 1, "none", 1)
    finally:
        Machine.gemm = real
    assert calls.count((4096, 4096, 64)) == 1
    big = CostModel(dataclasses.replace(m, n_experts=65536), Workload(8, 4096), cl)
    assert big.estimate(Layout.parse("dp8 mb1")).mfu < 1


def test_the_table_tells_rows_apart_by_tp_overlap():
    """Two rows that differ only in tp-overlap read differently in the table's layout column."""
    from loom.plan.published import _layout_cell

    plain, overlapped = (Layout.parse(f"dp1 tp8 pp1 sp mb1{extra}") for extra in ("", " tp-overlap"))
    assert "tp-overlap" in _layout_cell(overlapped) and "tp-overlap" not in _layout_cell(plain)


def test_expert_folding_takes_ep_from_tp_and_shards_the_experts_over_it():
    """Megatron-Core's MoE parallel folding (a run's expert_tensor_parallel = 1): ep need only divide
    tp x dp x cp (Qwen3-235B ran at tp2 dp16 ep32), each rank's experts are its own (no tp sum of
    their gradients), and their ZeRO group is tp x dp x cp / ep; Loom's own layout refuses it."""
    from loom.plan.cost.check import check, refused
    from loom.plan.cost.comm import tp_partial_params
    from loom.plan.cost.memory import state_terms

    m = ModelConfig(dim=1024, n_layers=4, n_heads=16, n_kv_heads=4, ffn_dim=512, vocab_size=32000)
    cl = ClusterSpec.single_node("h100-sxm", 8)
    plain, folded = (
        CostModel(m, Workload(64, 1024, expert_folding=f), cl, n_experts=16, top_k=2, stack="megatron-core")
        for f in (False, True)
    )
    wide = Layout(dp=2, dp_shard=2, tp=4, ep=8, zero=1, sp=True)  # ep8 > dp*cp = 2
    assert check(plain, wide) == "parallel.ep: must divide dp*cp = 2, got 8"
    assert check(folded, wide) is None and "Megatron-Core's" in (refused(folded, wide) or "")
    lay = Layout(dp=2, dp_shard=2, tp=4, ep=2, zero=1, sp=True)  # valid both ways: the groups differ
    expert = folded._params_on(4, 1, 2, True, True)[1]
    optim = {
        cm: dict(state_terms(cm, 4, 1, 1, 2, 1, 2, False, True, True))["optimizer"] for cm in (plain, folded)
    }
    assert optim[plain] - optim[folded] == pytest.approx(plain.O * expert * (1 - 1 / 4))  # shards 1 -> 4
    assert tp_partial_params(plain, 4, True, 1, ep=2) - tp_partial_params(folded, 4, True, 1, ep=2) == (
        pytest.approx(expert)
    )
    assert plain.estimate(lay).step_time != folded.estimate(lay).step_time


def test_a_published_row_folds_experts_only_where_it_can(tmp_path):
    """expert_tensor_parallel = 1 is accepted on an MoE row of a stack that folds; a value neither 1
    nor the layout's tp, a dense model or Loom's own stack (which does not fold) is one line naming the key."""
    base = (
        "[models.m]\ndim = 1024\nn_layers = 4\nn_heads = 16\nn_kv_heads = 4\nffn_dim = 512\n"
        "vocab_size = 32000\nn_experts = 16\ntop_k = 2\n[models.d]\ndim = 1024\nn_layers = 4\nn_heads = 16\n"
        "vocab_size = 32000\n[[runs]]\nname = 'r'\nmodel = '{model}'\nstack = '{stack}'\n"
        "cluster = {{ device = 'h100-sxm' }}\nlayout = 'dp2 tp4 ep8 zero1 sp'\nglobal_batch = 64\nseq_len = 1024\n"
        "expert_tensor_parallel = {etp}\ntokens_per_s_per_gpu = 1000\nsource = 'test'\n"
    )
    path = tmp_path / "runs.toml"
    path.write_text(base.format(model="m", stack="nemo", etp=1))
    (row,) = compare_published(load_file(path))
    assert row.run.workload.expert_folding and row.estimate.step_time > 0
    for model, stack, etp, want in (
        ("m", "nemo", 2, "must be 1 (Megatron-Core's MoE parallel folding) or the layout's tp = 4"),
        ("d", "nemo", 1, "the model has no experts"),
        ("m", "loom", 1, "Loom's stack keeps them on every tp rank, whole or split"),
    ):
        path.write_text(base.format(model=model, stack=stack, etp=etp))
        with pytest.raises(PlanError, match=r"run 'r': expert_tensor_parallel: .*" + re.escape(want)):
            load_file(path)
