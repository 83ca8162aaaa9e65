"""The planner against the runtime: calibration pieces, parallel.auto, and state memory of real runs.

Only memory (and, in the tensor-parallel tests, the collective calls per step) is asserted
against real runs: both are deterministic. Step time on this shared 2-core machine swings by up
to 1.6x between identical runs, so its comparison is printed by ``loom plan validate`` and not
asserted here.
"""

from __future__ import annotations

import json
import time

import pytest

from loom import config as C
from loom.plan.auto import apply_auto, choose, describe, local_cluster, predicted_fields, runnable
from loom.plan.calibrate import fit_line, model_shapes
from loom.plan.cli import main as plan_main
from loom.plan.cost import PlanError
from loom.plan.hardware import CollectiveFit, Profile, contended
from loom.plan.validate import DEBUG_CONFIG, LAYOUTS, MEMORY_TOLERANCE, format_comparisons, validate

PROFILE = Profile(
    device="cpu",
    gemm_flops={"fp32": 20e9},
    hbm_bandwidth=50e9,
    collectives=[
        CollectiveFit(op, "intra", n, 0.5e9, 200e-6)
        for op in ("all_reduce", "all_gather", "reduce_scatter")
        for n in (2, 3, 4)
    ],
)


def _cfg(world: int, *extra: str) -> C.LoomConfig:
    return C.load(DEBUG_CONFIG, ["--run.nproc", str(world), *extra])


def test_fit_line_recovers_latency_and_bandwidth():
    pts = [(v, 50e-6 + v / 2e9) for v in (1e3, 1e5, 1e6, 4e6)]
    bw, lat = fit_line(pts)
    assert bw == pytest.approx(2e9, rel=1e-9)
    assert lat == pytest.approx(50e-6, rel=1e-6)
    bw, lat = fit_line([(1e3, 1e-3), (1e6, 0.9e-3)])  # latency-bound noise: no negative bandwidth
    assert bw > 0 and lat > 0


def test_contended_scales_compute_only_when_ranks_outnumber_cores():
    assert contended(PROFILE, 2, n_cores=2).gemm_flops["fp32"] == 20e9
    shared = contended(PROFILE, 4, n_cores=2)
    assert shared.gemm_flops["fp32"] == 10e9 and shared.hbm_bandwidth == 25e9
    assert shared.collectives == PROFILE.collectives


def test_contended_scales_the_collectives_cpu_seconds_as_compute():
    """A collective's CPU seconds (scope cpu) take the shared cores as compute does: / share."""
    import dataclasses

    cpu = [
        CollectiveFit("all_gather", "cpu", 2, 1e9, 400e-6, world=2),
        CollectiveFit("all_gather", "cpu synced", 2, 2e9, 100e-6),
        CollectiveFit("all_gather", "cpu", 2, 1e9, 300e-6, world=4),
    ]
    prof = dataclasses.replace(PROFILE, collectives=[*PROFILE.collectives, *cpu], compute_share={"4": 0.4})
    shared = contended(prof, 4, n_cores=2)
    assert [(c.latency, c.bus_bandwidth) for c in shared.collectives if c.scope.startswith("cpu")] == [
        pytest.approx((1e-3, 0.4e9)),
        pytest.approx((250e-6, 0.8e9)),
        pytest.approx((750e-6, 0.4e9)),
    ]
    assert [c for c in shared.collectives if not c.scope.startswith("cpu")] == PROFILE.collectives
    twin = (
        shared.cpu_twin()
    )  # the call's CPU measured with its group alone (world 2), not side by side (world 4)
    assert twin is not None and twin.comm_overlap == {"1": 0.0}
    assert sorted((c.scope, c.latency) for c in twin.collectives) == [
        ("intra", pytest.approx(1e-3)),
        ("synced", pytest.approx(250e-6)),
    ]
    assert PROFILE.cpu_twin() is None  # no CPU seconds measured: no bound


def test_cpu_bound_is_the_ranks_cpu_demand_beyond_the_critical_path():
    """Collectives whose CPU seconds exceed their wall time by d each: with nothing hidden (tp2, no
    dp, no bubble) the CPU demand is the critical path + d per call, so the bound adds exactly
    calls x d; CPU seconds below the wall time add nothing."""
    import dataclasses

    from loom.plan.auto import _cost_model, layout_of

    ops = ("all_reduce", "all_gather", "reduce_scatter")
    wall = [CollectiveFit(op, scope, 2, 0.5e9, 200e-6) for op in ops for scope in ("intra", "synced")]

    def with_cpu(latency: float) -> Profile:
        cpu = [CollectiveFit(op, scope, 2, 0.5e9, latency) for op in ops for scope in ("cpu", "cpu synced")]
        return dataclasses.replace(PROFILE, collectives=wall + cpu, comm_overlap={"2": 0.0})

    cfg = _cfg(2, "--parallel.tp", "2", "--parallel.dp", "1", "--parallel.sp", "true")
    lay = layout_of(cfg)
    plain = _cost_model(
        cfg, 2, dataclasses.replace(PROFILE, collectives=wall, comm_overlap={"2": 0.0})
    ).estimate(lay)
    for d in (0.5e-3, -0.1e-3):
        cm = _cost_model(cfg, 2, with_cpu(200e-6 + d))
        est = cm.estimate(lay)
        calls = sum(cm.collective_calls(lay).values()) + 1  # + the step-end loss all-reduce (a scalar)
        assert est.time_breakdown["cpu bound"] == pytest.approx(max(0.0, calls * d))
        assert est.step_time == pytest.approx(plain.step_time + max(0.0, calls * d))


def test_a_collectives_job_measures_wall_and_cpu_seconds_per_call():
    """One 2-rank job of :func:`_coll_worker`: per op and size the wall time and the CPU time of a
    call between compute, back to back (synced) both too, all positive; the hidden share in [0, 1]."""
    from loom.plan.calibrate import MESSAGE_BYTES, OPS, _run_world

    rows = _run_world(2, "gloo", 2, (16, 8))
    keys = {(o, g, s) for o, g, s, _ in rows}
    for op in OPS:
        assert {(op, 2, b) for b in MESSAGE_BYTES} <= keys and {
            (f"{op}:cpu", 2, b) for b in MESSAGE_BYTES
        } <= keys
    for op in ("all_gather", "p2p"):
        assert {(f"{op}:synced", 2, b) for b in MESSAGE_BYTES} <= keys and {
            (f"{op}:cpu synced", 2, b) for b in MESSAGE_BYTES
        } <= keys
    assert {
        ("all_reduce:synced", 2, 4),
        ("all_reduce:cpu synced", 2, 4),
        ("work", 2, 0),
    } <= keys  # work: the ranks' mean
    assert {
        ("tp_layer:cpu", 2, 16 * 8 * 4),
        ("ep_layer", 2, 16 * 8 * 4),
        ("ep_layer:cpu", 2, 16 * 8 * 4),
    } <= keys  # through Loom's layers
    assert all(t > 0 for o, *_, t in rows if o != "overlap") and all(
        0 <= t <= 1 for o, *_, t in rows if o == "overlap"
    )


def test_measured_compute_share_and_profile_fields_round_trip(tmp_path):
    import dataclasses

    prof = dataclasses.replace(PROFILE, compute_share={"2": 0.8}, backward_ratio=1.5)
    assert contended(prof, 2, n_cores=2).gemm_flops["fp32"] == pytest.approx(
        16e9
    )  # measured, not cores/world
    assert contended(prof, 4, n_cores=2).gemm_flops["fp32"] == 10e9  # unmeasured: cores / world
    assert contended(prof, 2, n_cores=2).backward_ratio == 1.5
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == prof
    fits = [
        CollectiveFit("all_reduce", "intra", 2, 1e9, 1e-3, world=2),
        CollectiveFit("all_reduce", "intra", 2, 1e9, 5e-3, world=4),
    ]
    by_world = Profile("cpu", collectives=fits)
    assert by_world.collective("all_reduce", "intra", 2, world=4).latency == 5e-3  # tp2 inside a 4-rank job
    assert by_world.collective("all_reduce", "intra", 2, world=2).latency == 1e-3


def test_backward_ratio_and_layer_work_run():
    from loom.plan.calibrate import layer_work, measure_backward_ratio, work_rate

    m = _cfg(1).model
    m.vocab_size = 512
    assert 0.5 <= measure_backward_ratio(m, 2, 64, repeats=9) < 10  # median of 9: a burst of load skews 3
    assert 0 < work_rate(layer_work(64, 32), calls=5, blocks=2) < 1


@pytest.mark.parametrize("tie", ["true", "false"])
def test_zero3_units_per_pipeline_stage_are_the_runtimes(tie):
    """The planner's ZeRO-3 units of a pipeline's first and last stage equal the units the runtime
    wraps (``find_units`` on each rank's stages): tied, the last stage's head copy is a unit alone."""
    from loom.model.llama import build_model
    from loom.parallel.pipeline.stage import PipelineModule
    from loom.parallel.zero.stage3 import find_units
    from loom.plan.auto import _cost_model

    over = [
        "--parallel.pp",
        "2",
        "--parallel.zero",
        "3",
        "--model.n_layers",
        "4",
        "--model.tie_embeddings",
        tie,
        "--model.vocab_size",
        "256",
    ]
    cfg = _cfg(2, *over)
    model, cm = build_model(cfg.model, seed=0), _cost_model(cfg, 2, None)
    for rank in (0, 1):
        units = find_units(PipelineModule(model, rank, 2, [0, 2, 4]))
        assert cm.zero3_units(2, last=rank == 1) == (len(units), 0.0)


def test_hidden_share_is_the_ratio_of_summed_extra_times():
    """1 - (Σ overlapped - Σ alone) / (Σ sequential - Σ alone): 10 ms of work, 20 ms more in
    sequence, 10 ms more overlapped -> half hidden, none more -> all hidden. (Naps of 1-3 ms made a
    sleep's ~0.1 ms of overshoot on a loaded machine a 20% error: 0.61 measured for 0.5 in CI.)"""
    from loom.plan.calibrate import hidden_share

    def nap(ms: float):
        return lambda: time.sleep(ms / 1e3)

    assert hidden_share(nap(10), nap(30), nap(20), calls=2, trials=5) == pytest.approx(0.5, abs=0.1)
    assert hidden_share(nap(10), nap(30), nap(10), calls=2, trials=3) == pytest.approx(1.0, abs=0.1)


def test_busy_calls_count_the_calls_finished_in_the_wall_time():
    """10 ms calls for 0.1 s: about 10 (the first, a warm-up, not counted; the last may overrun)."""
    from loom.plan.calibrate import busy_calls

    assert 7 <= busy_calls(lambda: time.sleep(0.01), 0.1) <= 11


def test_median_rows_take_each_measurement_at_its_median_over_jobs():
    from loom.plan.calibrate import median_rows

    jobs = [[("all_gather", 2, 4096, t), ("work", 2, 0, w)] for t, w in ((1.0, 5.0), (3.0, 4.0), (2.0, 9.0))]
    assert sorted(median_rows(jobs)) == [("all_gather", 2, 4096, 2.0), ("work", 2, 0, 5.0)]


def test_overlap_only_job_measures_the_hidden_share_per_group_size():
    """A 2-rank job of :func:`_coll_worker` with ``overlap_only``: one ("overlap", 2, 0, share) row."""
    from loom.plan.calibrate import _run_world

    rows = _run_world(2, "gloo", 2, (16, 8), overlap_only=True)
    assert [r[:3] for r in rows] == [("overlap", 2, 0)]
    assert 0.0 <= rows[0][3] <= 1.0


def test_op_overhead_and_optimizer_rates_measure():
    """Seconds per operator (a tiny model: nearly no FLOPs) and optimizer elements/s: positive, and
    8-bit Adam's arithmetic (quantize, dequantize per block) slower per element than AdamW's."""
    from loom.plan.calibrate import measure_op_overhead, measure_optimizer_rate

    m = _cfg(1).model
    m.vocab_size = 512
    c_op = measure_op_overhead(m, "fp32", repeats=3)
    assert 1e-8 < c_op < 1e-3
    rates = {k: measure_optimizer_rate(k, c_op, numel=1 << 16, repeats=2) for k in ("adamw", "adam8bit")}
    assert 0 < rates["adam8bit"] < rates["adamw"]


def test_microbatch_overhead_reproduces_the_measured_one_rank_step():
    import dataclasses

    from loom.plan.calibrate import microbatch_overhead
    from loom.plan.cost import Layout, estimate
    from loom.plan.report import model_of, workload_of

    cfg = _cfg(1)
    prof = dataclasses.replace(PROFILE, op_overhead={"fp32": 2e-6})
    per_mb = microbatch_overhead(cfg, prof, 0.05)
    measured = dataclasses.replace(prof, microbatch_overhead=per_mb)
    est = estimate(model_of(cfg), Layout(micro_batch=2), workload_of(cfg), local_cluster(1), profile=measured)
    assert est.step_time == pytest.approx(0.05, rel=1e-9)
    L = cfg.model.n_layers
    assert per_mb * (L + 1) == pytest.approx(
        est.time_breakdown["framework"] / est.microbatches
        - 2e-6 * (L * est_ops(cfg).layer_fb + est_ops(cfg).fixed_fb)
    )


def est_ops(cfg):
    from loom.plan.opcount import op_counts
    from loom.plan.report import model_of

    return op_counts(model_of(cfg), None, cfg.train.optimizer)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_framework_term_is_ops_times_cost_per_op(recompute):
    """framework = m · (c_op · (L · ops_layer + ops_head) + (L + 1) · t_block); full recomputation adds
    m · c_op · L · (ops_layer_full - ops_layer); the optimizer's operators count once per step."""
    import dataclasses

    from loom.plan.cost import Layout, estimate
    from loom.plan.report import model_of, workload_of

    cfg = _cfg(1)
    c_op, t_mb = 3e-6, 1e-4
    prof = dataclasses.replace(PROFILE, op_overhead={"fp32": c_op}, microbatch_overhead=t_mb)
    est = estimate(
        model_of(cfg),
        Layout(micro_batch=2, recompute=recompute),
        workload_of(cfg),
        local_cluster(1),
        profile=prof,
    )
    ops, L, m = est_ops(cfg), cfg.model.n_layers, est.microbatches
    assert est.time_breakdown["framework"] == pytest.approx(
        m * (c_op * (L * ops.layer_fb + ops.fixed_fb) + (L + 1) * t_mb)
    )
    half = estimate(
        model_of(cfg),
        Layout(micro_batch=2, recompute=recompute),
        workload_of(cfg),
        local_cluster(1),
        profile=dataclasses.replace(prof, op_overhead={"fp32": c_op / 2}),
    )
    again = (
        m * c_op / 2 * L * (ops.layer_full - ops.layer_fb) if recompute == "full" else 0.0
    )  # t_mb equal in both
    assert est.time_breakdown["recompute"] - half.time_breakdown["recompute"] == pytest.approx(again)
    assert est.time_breakdown["optimizer"] - half.time_breakdown["optimizer"] == pytest.approx(
        c_op / 2 * ops.optimizer(L)
    )
    hooks = estimate(
        model_of(cfg),
        Layout(micro_batch=2, recompute=recompute),
        workload_of(cfg),
        local_cluster(1),
        profile=dataclasses.replace(prof, microbatch_overhead=2 * t_mb),
    )
    rehooked = m * t_mb * L * (ops.layer_full - ops.layer_fb) / ops.layer_fb if recompute == "full" else 0.0
    assert hooks.time_breakdown["recompute"] - est.time_breakdown["recompute"] == pytest.approx(rehooked)


def test_op_counts_are_linear_in_layers():
    """ops(L) = fixed + L · per_layer: a 3-layer tiny model's count is predicted from the 1- and 2-layer ones."""
    from loom.plan.opcount import _model_counts, op_counts, tiny_config

    for extra in ((), ("--model.n_experts", "4"), ("--train.optimizer", "adafactor")):
        cfg = _cfg(1, *extra)
        cfg.model.vocab_size = 512
        ops = op_counts(cfg.model, None, cfg.train.optimizer)
        fb, sel, full, opt = _model_counts(tiny_config(cfg.model, 3), None, cfg.train.optimizer, 1)
        assert (fb, sel, full) == (
            ops.microbatch(3),
            ops.microbatch(3, "selective"),
            ops.microbatch(3, "full"),
        )
        assert opt == ops.optimizer(3)
        assert ops.layer_full > ops.layer_selective > ops.layer_fb > 0 and ops.fixed_fb > 0


def test_op_counts_are_kept_on_disk_and_a_bad_file_is_counted_again(tmp_path, monkeypatch):
    """A fresh process (an empty in-process cache) reads the counts the first one stored; a file it
    cannot read is counted again and rewritten, equal."""
    import loom.plan.opcount as oc

    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(oc, "_CACHE", {})
    m = _cfg(1).model
    m.vocab_size = 512
    counted = oc.op_counts(m)
    (path,) = (tmp_path / "opcounts").iterdir()
    measure = oc._measure
    monkeypatch.setattr(oc, "_CACHE", {})
    monkeypatch.setattr(oc, "_measure", lambda *a: pytest.fail("counted again with a stored file"))
    assert oc.op_counts(m) == counted
    path.write_text('{"layer_fb": ')  # half-written
    monkeypatch.setattr(oc, "_CACHE", {})
    monkeypatch.setattr(oc, "_measure", measure)
    assert oc.op_counts(m) == counted and json.loads(path.read_text())["layer_fb"] == counted.layer_fb


def test_model_shapes_cover_forward_and_backward():
    m = _cfg(1).model
    m.vocab_size = 512
    shapes = model_shapes(m, 128)
    assert len(shapes) == 3 * 8 and (128, 64, 512) in shapes and (64, 128, 512) in shapes


def test_auto_field_parses_and_defaults_off():
    assert C.ParallelConfig().auto is False
    assert _cfg(2, "--parallel.auto", "true").parallel.auto is True


@pytest.mark.parametrize("world", [1, 2, 4])
def test_apply_auto_writes_a_runnable_layout(world):
    cfg = _cfg(world, "--parallel.auto", "true")
    est = apply_auto(cfg, world, PROFILE)
    p = cfg.parallel
    assert p.auto is False  # chosen once
    assert p.dp * p.tp * p.pp * p.cp == world
    assert cfg.train.micro_batch == est.layout.micro_batch
    C.validate(cfg, world)  # the runtime accepts it as written
    assert "parallel.auto chose" in describe(est)


def test_choose_is_the_fastest_runnable_layout():
    cfg = _cfg(4)
    best = choose(cfg, 4, PROFILE)
    assert runnable(cfg, best.layout)
    from loom.plan.report import model_of, workload_of
    from loom.plan.search import search

    ranked = search(model_of(cfg), workload_of(cfg), local_cluster(4), 4, profile=PROFILE).ranked
    faster = [e for e in ranked if e.step_time < best.step_time]
    assert all(not runnable(cfg, e.layout) for e in faster)


@pytest.mark.parametrize(
    "args, kept",
    [
        (("--train.micro_batch", "1"), {"micro_batch": 1}),
        (("--train.recompute", "full"), {"recompute": "full"}),
        (("--parallel.pp", "2", "--parallel.schedule", "gpipe"), {"pp": 2, "schedule": "gpipe"}),
        (("--parallel.zero", "1", "--parallel.offload", "cpu"), {"zero": 1, "offload": "cpu"}),
    ],
)
def test_apply_auto_keeps_every_explicit_field(args, kept):
    """An explicit micro-batch, recomputation, schedule or offload constrains the search like an
    explicit degree: the chosen layout has it, the config keeps it, and the chosen line names it."""
    cfg = _cfg(2, "--parallel.auto", "true", *args)
    est = apply_auto(cfg, 2, PROFILE)
    line = describe(est)
    for field, value in kept.items():
        section = cfg.train if field in ("micro_batch", "recompute") else cfg.parallel
        assert getattr(section, field) == value, (field, getattr(section, field))
        assert f"{field}={value}" in line or f"{field}{value}" in line, line
    C.validate(cfg, 2)


def test_apply_auto_keeps_offload_disk():
    cfg = _cfg(2, "--parallel.auto", "true", "--parallel.zero", "1", "--parallel.offload", "disk")
    est = apply_auto(cfg, 2, PROFILE)
    assert est.layout.offload and cfg.parallel.offload == "disk"
    assert " offload=disk: " in describe(est, cfg)  # the layout records "offloaded", not where


def test_apply_auto_refuses_an_explicit_value_no_layout_has():
    """An explicit micro-batch no layout of the world size can run is one line naming it and why."""
    cfg = _cfg(2, "--parallel.auto", "true", "--train.micro_batch", "3")
    with pytest.raises(PlanError) as e:
        apply_auto(cfg, 2, PROFILE)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("parallel.auto:")
    assert "train.micro_batch = 3" in msg and "must be divisible by micro_batch" in msg


def test_predicted_fields_of_a_config():
    cfg = _cfg(2, "--parallel.zero", "3")
    C.validate(cfg, 2)
    cfg.model.vocab_size = 512
    f = predicted_fields(cfg, 2, PROFILE)
    assert f["plan_state_bytes"] == pytest.approx(131392 * 16 / 2)  # fp32 W+G+Adam, halved by ZeRO-3
    assert f["plan_step_time_s"] > 0 and f["plan_peak_mem_bytes"] > f["plan_state_bytes"]


def test_trainer_plan_fields_never_raise():
    from loom.train.trainer import _add_plan

    row = {"step_time_s": 0.1}
    cfg = C.LoomConfig()
    cfg.parallel.tp = 3  # does not divide the 8 heads: the planner raises, the trainer must not
    _add_plan(cfg, 3, row)
    assert row == {"step_time_s": 0.1}


def test_plan_subcommands_dispatch():
    assert plan_main(["validate", "--only", "no-such-layout"]) == 2
    assert plan_main(["calibrate", "--nproc", "0"]) == 2


@pytest.mark.slow
def test_state_memory_of_real_runs_matches_prediction(tmp_path):
    """ZeRO-3 over 2 ranks, a 2-stage pipeline (rank 0 = first stage) and Adafactor under ZeRO-1:
    within 5% (one process's state is plan verify's, tests/test_plan_verify.py)."""
    from concurrent.futures import ThreadPoolExecutor

    chosen = [lay for lay in LAYOUTS if lay[0] in ("dp2 zero3", "pp2 1f1b", "dp2 zero1 adafactor")]

    def one(layout) -> list:  # the runs at once: their state bytes do not depend on the cores' load
        return validate([layout], profile=PROFILE, steps=2, corpus_mb=0.5, workdir=str(tmp_path))

    with ThreadPoolExecutor(len(chosen)) as pool:
        rows = [row for rows in pool.map(one, chosen) for row in rows]
    print(format_comparisons(rows))
    assert len(rows) == 3
    for r in rows:
        assert abs(r.memory_error) <= MEMORY_TOLERANCE, r


@pytest.mark.slow
def test_train_with_parallel_auto_runs_and_logs_the_prediction(tmp_path):
    """``loom train --parallel.auto true`` on 2 ranks: the chosen layout trains, and the last
    metrics row carries the planner's prediction beside the measurement."""
    import json
    import subprocess
    import sys

    from loom.plan.validate import REPO, base_overrides

    run_dir = tmp_path / "auto"
    cmd = [
        sys.executable,
        "-m",
        "loom",
        "train",
        DEBUG_CONFIG,
        "--nproc",
        "2",
        "--run.dir",
        str(run_dir),
        "--parallel.auto",
        "true",
        *base_overrides(2, 0.5),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "parallel.auto chose" in proc.stdout
    logged = (proc.stdout + proc.stderr).splitlines()  # rank 0's log lines go to stderr
    line = next(x for x in logged if "planner: step" in x)  # the end-of-run line
    assert "s predicted" in line and ("calibration profile" in line or "datasheet" in line)
    assert "cores were not shared" in line or "other processes were using the cores" in line
    row = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    state = row["param_bytes"] + row["grad_bytes"] + row["optim_bytes"]
    assert row["plan_state_bytes"] == pytest.approx(state, rel=MEMORY_TOLERANCE)
    assert row["plan_step_time_s"] > 0
    saved = C.load_toml(run_dir / "config.toml")
    assert saved.parallel.auto is False and saved.parallel.dp * saved.parallel.tp * saved.parallel.pp == 2


def test_validation_table_and_picture(tmp_path):
    from loom.plan.validate import Comparison
    from loom.plan.viz import draw_validation

    rows = [
        Comparison("dp2", 2, 0.05, 0.04, 1000.0, 1000.0, meas_median_s=0.0625),
        Comparison("tp2 sp", 2, 0.05, 0.15, 990.0, 1000.0),
    ]
    table = format_comparisons(rows)
    assert "+25.0%" in table and "-1.00%" in table and "state memory within 5%: 2/2" in table
    assert "median s" in table and "0.0625" in table  # the typical step beside the fastest
    png = draw_validation(rows, tmp_path / "v.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_validate_json_and_plot_together(tmp_path, monkeypatch, capsys):
    """``--json --plot f.png``: stdout is the JSON rows alone, the picture is drawn too."""
    import json

    from loom.plan import validate as V

    rows = [V.Comparison("dp2", 2, 0.05, 0.04, 1000.0, 1000.0, meas_median_s=0.0625)]
    monkeypatch.setattr(V, "validate", lambda *a, **k: rows)
    assert V.main(["--only", "dp2", "--json", "--plot", str(tmp_path / "v.png")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[0]["name"] == "dp2" and out[0]["time_error"] == pytest.approx(0.25)
    assert (tmp_path / "v.png").read_bytes()[:4] == b"\x89PNG"


def test_validation_compares_the_fastest_run_and_pools_steps_for_the_median():
    """The fastest run's row sets the measured step and state; the median is over every step of every run."""
    from loom.plan.validate import DEBUG_CONFIG, base_overrides, compare

    state = {"param_bytes": 400.0, "grad_bytes": 400.0, "optim_bytes": 800.0}
    runs = [
        state | {"step_time_s": 0.02, "step_times": [0.03, 0.02, 0.05]},
        state | {"step_time_s": 0.01, "step_times": [0.01, 0.04]},
    ]
    c = compare("dp1", 1, base_overrides(4), DEBUG_CONFIG, None, runs)
    assert c.meas_step_s == 0.01 and c.meas_median_s == 0.03 and c.meas_state_bytes == 1600.0
    assert c.pred_step_s > 0


@pytest.mark.parametrize("colocate", [True, False])
def test_parameter_server_terms(colocate):
    """dp_mode = ps: no all-reduce; push + pull = 2 p2p messages of W' Φ 4 / K bytes through the busiest
    server (W' = W - 1 co-located); the moments only on server ranks (worker 0 = server 0 if co-located)."""
    from loom.plan.auto import _cost_model
    from loom.plan.report import layout_of

    extra = ["--parallel.dp_mode", "ps", "--parallel.ps_shards", "2", "--train.precision", "fp32"]
    world = 4 if colocate else 6
    cfg = _cfg(world, *extra, "--parallel.ps_colocate", str(colocate).lower())
    cfg.model.vocab_size = 512
    cm = _cost_model(cfg, world, PROFILE)
    lay = layout_of(cfg)
    assert (lay.dp, lay.world_size) == (4, 4)
    phi = cm._params_on(1, 1, 1, True, True)[0]
    through = 3 if colocate else 4
    assert cm._dp_comm(4, 1, 1, 1, 1, 1, 0, 1, world) == pytest.approx(
        2 * cm.machine.collective("p2p", 2, through * phi * 4 / 2, 4, world)
    )
    states = cm.state_memory(lay)
    assert states["optimizer"] == (8 * phi / 2 if colocate else 0.0)
    assert states["weights"] == states["gradients"] == 4 * phi


def test_layer_call_excess_is_the_layer_measurement_minus_its_bare_calls():
    """Per call: the layer's time minus the mean fit of the calls it issued, each moving S/2 (tp: 3
    all-gathers + 2 reduce-scatters of S; ep: 4 all-to-alls of the top-2 rows, 2 S, and one of the
    4 experts' int64 counts), never below 0, and 0 when the layer was not measured."""
    from loom.plan.probes import EP_EXPERTS, EP_TOP_K, layer_call_excess

    S = 8192
    fits = [
        CollectiveFit("all_gather", "cpu", 2, 1e9, 100e-6, world=2),
        CollectiveFit("reduce_scatter", "cpu", 2, 1e9, 200e-6, world=2),
        CollectiveFit("all_to_all", "intra", 2, 2e9, 50e-6, world=2),
        CollectiveFit("all_gather", "cpu", 2, 1e9, 900e-6, world=4),
    ]  # another job size: not the 2-rank layer's
    rows = [("tp_layer:cpu", 2, S, 1e-3), ("ep_layer", 2, S, 0.5e-3)]
    tp_bare = (3 * (100e-6 + S / 2 / 1e9) + 2 * (200e-6 + S / 2 / 1e9)) / 5
    assert layer_call_excess("tp", rows, fits, "cpu") == pytest.approx(1e-3 - tp_bare)
    ep_bare = (4 * (50e-6 + S * EP_TOP_K / 2 / 2e9) + (50e-6 + 8 * EP_EXPERTS / 2 / 2e9)) / 5
    assert layer_call_excess("ep", rows, fits, "intra") == pytest.approx(0.5e-3 - ep_bare)
    assert (
        layer_call_excess("tp", [("tp_layer:cpu", 2, S, 1e-5)], fits, "cpu") == 0.0
    )  # cheaper than the fits: nothing added
    assert layer_call_excess("ep", rows, fits, "cpu") == 0.0  # not measured


def test_layer_call_overhead_is_added_to_each_tp_and_ep_call_and_its_cpu_in_the_twin(tmp_path):
    """``call_overhead[kind]`` adds d to each call of that kind on the critical path (tp2 sp: every
    tp call but the once-per-step all-reduce of partial gradients; ep2: the 5 all-to-alls per MoE
    layer and micro-batch); ``call_overhead_cpu`` adds it to the CPU twin's calls instead, so with
    CPU seconds equal to the wall ones the bound is exactly calls x d. The fields survive a save and
    load, and contention scales them as compute (/ share)."""
    import dataclasses

    from loom.plan.auto import _cost_model, layout_of

    ops = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    wall = [CollectiveFit(op, scope, 2, 0.5e9, 200e-6) for op in ops for scope in ("intra", "synced")]
    cpu = [CollectiveFit(op, scope, 2, 0.5e9, 200e-6) for op in ops for scope in ("cpu", "cpu synced")]
    base = dataclasses.replace(PROFILE, collectives=wall + cpu, comm_overlap={"2": 0.0})
    d = 1e-3
    for kind, extra in (
        ("tp", ("--parallel.tp", "2", "--parallel.dp", "1", "--parallel.sp", "true")),
        ("ep", ("--model.n_experts", "4", "--parallel.ep", "2")),
    ):
        cfg = _cfg(2, *extra)
        lay = layout_of(cfg)
        plain = _cost_model(cfg, 2, base)
        counted = plain.collective_calls(lay)
        calls = sum(counted.values()) - 1 if kind == "tp" else counted["all_to_all"]
        t0 = plain.estimate(lay).step_time
        on_wall = _cost_model(cfg, 2, dataclasses.replace(base, call_overhead={kind: d})).estimate(lay)
        assert on_wall.step_time - t0 == pytest.approx(calls * d)
        on_cpu = _cost_model(cfg, 2, dataclasses.replace(base, call_overhead_cpu={kind: d})).estimate(lay)
        assert on_cpu.time_breakdown["cpu bound"] == pytest.approx(
            calls * d
        ) and on_cpu.step_time == pytest.approx(t0 + calls * d)
    prof = dataclasses.replace(
        base, call_overhead={"ep": 2e-4}, call_overhead_cpu={"tp": 3e-4}, compute_share={"4": 0.5}
    )
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == prof
    shared = contended(prof, 4, n_cores=2)
    assert shared.call_overhead == {"ep": pytest.approx(4e-4)} and shared.call_overhead_cpu == {
        "tp": pytest.approx(6e-4)
    }
    from loom.plan.hardware import HardwareError

    for bad, says in (
        ('{"xp": 1e-4}', "profile.call_overhead.xp: unknown kind; allowed: tp, ep"),
        ('{"tp": -1e-4}', "profile.call_overhead.tp: must be a finite number >= 0"),
    ):
        with pytest.raises(HardwareError, match=says.replace(".", r"\.")):
            Profile.from_json('{"device": "cpu", "call_overhead": ' + bad + "}")


def test_validate_predicts_a_mixture_of_experts_with_the_runs_expert_load():
    """moe.imbalance unset: the comparison plans with the run's measured moe_imbalance, as if given."""
    from loom.plan.validate import compare

    over = ["--model.n_experts", "4", "--parallel.ep", "2"]
    row = {
        "step_time_s": 0.02,
        "step_times": [0.02],
        "moe_imbalance": 2.0,
        "param_bytes": 1.0,
        "grad_bytes": 1.0,
        "optim_bytes": 1.0,
    }
    got = compare("moe", 2, over, DEBUG_CONFIG, PROFILE, [row])
    given = predicted_fields(_cfg(2, *over, "--moe.imbalance", "2.0"), 2, contended(PROFILE, 2))
    balanced = predicted_fields(_cfg(2, *over, "--moe.imbalance", "1.0"), 2, contended(PROFILE, 2))
    assert (
        got.pred_step_s == pytest.approx(given["plan_step_time_s"])
        and got.pred_step_s > balanced["plan_step_time_s"]
    )


def test_end_of_run_line_says_whether_the_cores_were_shared_and_names_the_profile(tmp_path, monkeypatch):
    """Load beyond the run's own runnable threads, min(cores, ranks x threads), is other processes':
    load 5 on 2 cores with 2 one-thread ranks leaves 3; a named profile file is what the line cites."""
    import os

    from loom.config import LoomConfig
    from loom.plan import auto

    monkeypatch.setattr(os, "getloadavg", lambda: (5.0, 4.0, 3.0))
    monkeypatch.setattr(auto, "cores", lambda: 2)
    assert auto.core_load(2, 1) == (5.0, 3.0, 2)
    assert auto.core_load(1, 8) == (5.0, 3.0, 2)  # a rank's threads beyond the cores are no more load
    cfg = LoomConfig()
    row = {"plan_step_time_s": 0.02, "step_time_s": 0.44, "plan_state_bytes": 2**20}
    line = auto.prediction_line(cfg, 2, row, 2**20)
    assert "other processes were using the cores (load 5.0 on 2 cores, about 3.0 beyond this run's 2)" in line
    monkeypatch.setattr(os, "getloadavg", lambda: (1.2, 1.0, 1.0))
    prof = tmp_path / "p.json"
    prof.write_text("{}")
    cfg.parallel.profile = str(prof)
    line = auto.prediction_line(cfg, 2, row, 2**20)
    assert f"calibration profile {prof}" in line and "cores were not shared" in line
