"""loom.cluster: LP policies on hand-solved instances, the simulator, the CLI, the noise-scale estimate."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from loom.cluster import Cluster, Job, JobState, make_policy, simulate
from loom.cluster.cli import main as cluster_main
from loom.cluster.formats import load_trace
from loom.cluster.jobs import ClusterError, gns_from_metrics, goodput, scaled_lr, throughput
from loom.cluster.policies import Gavel, maxmin_lp
from tests.helpers import global_batch, tiny_model


def table_job(
    name: str, arrival: float, samples: float, tput: dict[str, float], devices: int = 1, **kw
) -> Job:
    return Job(name, arrival, samples, devices, throughput={t: {devices: v} for t, v in tput.items()}, **kw)


# ---- LP policies against hand-solved instances


def test_maxmin_lp_two_jobs_two_types_hand_solved():
    """Job A runs 4/s on fast, 1/s on slow; job B 2/s on both; one device of each, normalised by 1.
    Hand solution: A on fast (x_af = 1), B on slow (x_bs = 1): min(4, 2) = 2. Any share of A on slow
    or B on fast lowers the min: z* = 2 exactly."""
    coef = np.array([[4.0, 1.0], [2.0, 2.0]])
    x, z = maxmin_lp(coef, np.ones(2), np.ones(2))
    assert z == pytest.approx(2.0, abs=1e-7)
    torch.testing.assert_close(torch.tensor(x), torch.eye(2, dtype=torch.float64), atol=1e-6, rtol=0)


def test_maxmin_lp_capacity_and_fairness():
    """Three identical jobs, one device: each gets 1/3 of it (z* = 1/3, capacity tight, all equal)."""
    x, z = maxmin_lp(np.ones((3, 1)), np.ones(3), np.ones(1))
    assert z == pytest.approx(1 / 3, abs=1e-7)
    torch.testing.assert_close(
        torch.tensor(x[:, 0]), torch.full((3,), 1 / 3, dtype=torch.float64), atol=1e-6, rtol=0
    )


def test_gavel_maxmin_normalised_and_secondary_fills_capacity():
    """Two jobs of scale 1 on 1 fast + 1 slow device. Job A speeds 4x on fast, B not at all.
    Equal share gives each half of each: T_eq(A) = 2.5, T_eq(B) = 1. The optimum puts A on fast and
    B on slow: normalised 4/2.5 = 1.6 and 1/1 = 1, and no device is left idle."""
    jobs = [
        JobState(table_job("a", 0, 1e3, {"fast": 4.0, "slow": 1.0})),
        JobState(table_job("b", 0, 1e3, {"fast": 1.0, "slow": 1.0})),
    ]
    cluster = Cluster({"fast": 1, "slow": 1})
    x = Gavel("maxmin").solve(jobs, cluster, 0.0)
    tput, scale, cap = Gavel("maxmin").matrices(jobs, cluster)
    eq = Gavel("maxmin").equal_share(tput, scale, cap)
    torch.testing.assert_close(torch.tensor(eq), torch.tensor([2.5, 1.0], dtype=torch.float64))
    assert x[0, 0] == pytest.approx(1.0, abs=1e-6) and x[1, 1] == pytest.approx(1.0, abs=1e-6)
    # capacity: sum_m s_m X[m, t] <= N_t, and every job's share <= 1
    assert (x.sum(axis=1) <= 1 + 1e-9).all() and ((scale @ x) <= cap + 1e-9).all()


def test_gavel_makespan_hand_solved():
    """Two jobs, speed 1/s, remaining 100 and 300. Two devices: each job all the time it can use
    (X <= 1), z* = min(1/100, 1/300) = 1/300 (makespan 300 s). One device: T_s + T_l <= 1 and
    T_s/100 = T_l/300 at the optimum: X = (1/4, 3/4), z* = 1/400 (makespan 400 s = all the work)."""
    jobs = [JobState(table_job("s", 0, 100, {"g": 1.0})), JobState(table_job("l", 0, 300, {"g": 1.0}))]
    cluster = Cluster({"g": 2})
    tput, scale, cap = Gavel("makespan").matrices(jobs, cluster)
    x, z = maxmin_lp(tput / np.array([100.0, 300.0])[:, None], scale, cap)
    assert z == pytest.approx(1 / 300, abs=1e-9) and x[1, 0] == pytest.approx(1.0, abs=1e-6)
    # with one device the makespan optimum is the total work: the job with more remaining gets 3/4
    x1, z1 = maxmin_lp(tput / np.array([100.0, 300.0])[:, None], scale, np.ones(1))
    assert z1 == pytest.approx(1 / 400, abs=1e-9)
    torch.testing.assert_close(
        torch.tensor(x1[:, 0]), torch.tensor([0.25, 0.75], dtype=torch.float64), atol=1e-6, rtol=0
    )


def test_gavel_ftf_equalises_finish_time_fairness():
    """Two fresh jobs (age 0) on one device, speed 1, remaining 100 and 300. Equal share: T_eq = 1/2,
    isolated finish 200 and 600. rho_m = (R_m / T_m) / (2 R_m) = 1 / (2 T_m): min max rho gives T = 1/2
    each, rho = 1 for both (the equal share is FTF-optimal for identical speeds)."""
    jobs = [JobState(table_job("s", 0, 100, {"g": 1.0})), JobState(table_job("l", 0, 300, {"g": 1.0}))]
    x = Gavel("ftf").solve(jobs, Cluster({"g": 1}), 0.0)
    torch.testing.assert_close(
        torch.tensor(x[:, 0]), torch.tensor([0.5, 0.5], dtype=torch.float64), atol=1e-4, rtol=0
    )


# ---- the simulator


def planted_trace() -> tuple[list[Job], Cluster]:
    """Four jobs at t = 0 on 2 v100 + 2 k80, 3600 samples each: A jobs run 10/s on v100 and 1/s on
    k80 (tensor-core bound), B jobs 1/s on both. Listed B, A, B, A, so the agnostic placement (the
    type with most free devices, v100 on ties) puts the B jobs on the v100s."""
    a, b = {"v100": 10.0, "k80": 1.0}, {"v100": 1.0, "k80": 1.0}
    jobs = [table_job(f"j{i}", 0.0, 3600.0, b if i % 2 == 0 else a) for i in range(4)]
    return jobs, Cluster({"v100": 2, "k80": 2}, round_s=360, restart_s=0)


def test_heterogeneity_aware_beats_agnostic_on_planted_trace():
    """By hand: agnostic LAS keeps B on v100 and A on k80, every job 3600 s (avg 3600). Gavel puts A on
    v100 (360 s) and B on k80 (3600 s): avg (2 * 360 + 2 * 3600) / 4 = 1980 s, 0.55x."""
    jobs, cluster = planted_trace()
    las = simulate(jobs, cluster, make_policy("las"))
    assert las.avg_jct == pytest.approx(3600.0)
    for name in ("gavel-las", "gavel-maxmin"):
        aware = simulate(jobs, cluster, make_policy(name))
        assert aware.avg_jct == pytest.approx(1980.0), name
        assert aware.jct["j1"] == pytest.approx(360.0) and aware.jct["j0"] == pytest.approx(3600.0)
    assert las.utilization == pytest.approx(1.0)  # all four devices busy until the common end


def test_simulator_deterministic_and_single_job_exact():
    jobs, cluster = planted_trace()
    a = simulate(jobs, cluster, make_policy("gavel-ftf")).summary()
    b = simulate(jobs, cluster, make_policy("gavel-ftf")).summary()
    assert a == b
    # one job alone: JCT = restart-free work / speed on its fastest type (every policy places it there or
    # on the type with most free devices: equal here)
    solo = [table_job("x", 5.0, 1000.0, {"v100": 4.0})]
    for name in ("fifo", "las", "gavel-maxmin", "gavel-makespan", "pollux"):
        r = simulate(solo, Cluster({"v100": 2}, restart_s=0), make_policy(name))
        assert r.jct["x"] == pytest.approx(250.0), name
        assert r.utilization == pytest.approx(0.5)  # one of two devices for the whole makespan


def test_fifo_queues_and_restart_cost():
    """One device, two jobs of 100 s arriving together: FIFO finishes them at 100 and 200 s."""
    jobs = [table_job("a", 0, 100, {"g": 1.0}), table_job("b", 0, 100, {"g": 1.0})]
    r = simulate(jobs, Cluster({"g": 1}, restart_s=0), make_policy("fifo"))
    assert r.jct == {"a": 100.0, "b": 200.0} and r.makespan == 200.0
    # LAS with a 50 s round time-slices: both make progress; each move back costs restart_s
    r2 = simulate(jobs, Cluster({"g": 1}, round_s=50, restart_s=10), make_policy("las"))
    assert r2.makespan > 200.0 and max(r2.jct.values()) == r2.makespan


# ---- the job model: planner throughput, goodput, learning rate


def test_planner_throughput_cached_and_goodput_picks_batch():
    m = tiny_model(vocab_size=128, max_seq_len=64)
    job = Job("p", 0, 1e4, 1, batch=8, seq_len=64, precision="fp16", model=m, gns=64.0)
    t1 = throughput(job, "v100", 1)
    assert t1 > 0 and throughput(job, "v100", 1) == t1  # cached: identical
    assert throughput(job, "v100", 1) > throughput(job, "k80", 1)
    g, b = goodput(job, "v100", 2)
    # goodput(M) = throughput(M) * (phi + M0) / (phi + M) at the chosen batch, and no other is better
    assert g == pytest.approx(throughput(job, "v100", 2, b) * (64 + 8) / (64 + b))
    for other in (8, 16, 32):
        assert throughput(job, "v100", 2, other) * (72 / (64 + other)) <= g * (1 + 1e-9)
    # AdaScale's gain r = S (phi + M0) / (phi + M): S = 4 at phi = 64, M0 = 8 -> 4 * 72 / 96 = 3
    assert scaled_lr(job, 32, "adascale") == pytest.approx(job.lr * 3.0)
    assert scaled_lr(job, 32, "sqrt") == pytest.approx(job.lr * 2.0)


# ---- files and the command line


def _write(tmp_path, name: str, text: str):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_cli_json_shape_and_bad_inputs(tmp_path, capsys):
    trace = _write(
        tmp_path,
        "t.toml",
        "[[jobs]]\narrival_s = 0\nsamples = 1000\nthroughput = { v100 = { 1 = 4.0 }, k80 = { 1 = 1.0 } }\n"
        "[[jobs]]\narrival_s = 10\nsamples = 500\ndevices = 1\nthroughput = { v100 = { 1 = 2.0 } }\n",
    )
    cluster = _write(
        tmp_path, "c.json", json.dumps({"cluster": {"devices": {"v100": 1, "k80": 1}, "restart_s": 0}})
    )
    assert (
        cluster_main(
            [
                "simulate",
                "--cluster",
                cluster,
                "--trace",
                trace,
                "--policy",
                "las",
                "--policy",
                "gavel-las",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert [o["policy"] for o in out] == ["las", "gavel-las"]
    for o in out:
        assert {"policy", "avg_jct", "p99_jct", "makespan", "utilization"} <= set(o) and o["jobs"] == 2
    bad = {
        "c1.toml": ("[cluster]\ndevices = { tpu-v5 = 4 }\n", "cluster.devices.tpu-v5: unknown device type"),
        "c2.toml": ("[cluster]\ndevices = { v100 = 0 }\n", "cluster.devices.v100: expected an integer > 0"),
        "c3.toml": ("[cluster]\ndevices = { v100 = 2 }\nspeed = 3\n", "cluster.speed: unknown key"),
    }
    for name, (text, msg) in bad.items():
        assert cluster_main(["simulate", "--cluster", _write(tmp_path, name, text), "--trace", trace]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and name in err and msg in err, err
    bad_traces = {
        "t1.toml": (
            "[[jobs]]\nsamples = 5\nthroughput = { v100 = { 1 = 1.0 } }\n",
            "jobs[0].arrival_s: missing",
        ),
        "t2.toml": (
            "[[jobs]]\narrival_s = 0\nsamples = -5\nmodel = 'debug'\n",
            "jobs[0].samples: expected a number > 0",
        ),
        "t3.json": (
            '{"jobs": [{"arrival_s": 0, "samples": 5, "model": "nope"}]}',
            "jobs[0].model: unknown preset",
        ),
        "t6.json": (
            '{"jobs": [{"arrival_s": 0, "samples": 5, "model": {"dim": 100, "n_heads": 7}}]}',
            "jobs[0].model: model.dim: 100 must be divisible by model.n_heads=7",
        ),
        "t4.toml": (
            "[[jobs]]\narrival_s = 0\nsamples = 5\nthroughput = { p100 = { 1 = 1.0 } }\n",
            "no throughput on 1 devices",
        ),
        "t5.toml": (
            "[[jobs]]\narrival_s = 0\nsamples = 5\nthroughput = { v100 = { 1 = 1.0 } }\ncolor = 1\n",
            "jobs[0].color: unknown key",
        ),
    }
    for name, (text, msg) in bad_traces.items():
        assert cluster_main(["simulate", "--cluster", cluster, "--trace", _write(tmp_path, name, text)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and name in err and msg in err, err
    assert cluster_main(["simulate", "--trace", trace, "--policy", "sjf"]) == 2
    assert "--policy: unknown policy 'sjf'" in capsys.readouterr().err


# ---- the gradient noise scale


@pytest.mark.parametrize(
    "argv,named",
    [
        (["simulate"], "required: --trace"),
        (["simulate", "--trace", "synthetic", "--jobs", "x"], "--jobs: invalid int value"),
        (["simulate", "--trace", "synthetic", "--jobs", "100000000"], "--jobs: must be in [1, 100,000]"),
        (["simulate", "--trace", "synthetic", "--rate", "inf"], "--rate: must be a finite number"),
        (
            ["simulate", "--trace", "synthetic", "--plot", "TMP/cdf.toml"],
            "--plot: 'TMP/cdf.toml' must end in .png",
        ),
        (["simulate", "--trace", "TMP/trace.toml"], "TMP/trace.toml is not UTF-8 text"),
        (["simulate", "--trace", "TMP"], "TMP is a directory, not a file"),
    ],
    ids=[
        "required",
        "type",
        "jobs beyond the bound",
        "rate inf",
        "plot format",
        "trace not UTF-8",
        "trace dir",
    ],
)
def test_cli_bad_options_are_one_line_before_simulating(tmp_path, capsys, monkeypatch, argv, named):
    """argparse's usage block, a synthetic trace of 10^8 jobs (470 GB, allocated before any refusal),
    an infinite arrival rate, a picture format matplotlib refuses after the simulation, a trace
    file of other bytes (a UnicodeDecodeError traceback) and a directory: one line, exit code 2,
    before any trace is drawn or simulated."""

    def too_late(*args, **kwargs):
        raise AssertionError("a trace was drawn or simulated before the refusal")

    monkeypatch.setattr("loom.cluster.cli.synthetic_trace", too_late)
    monkeypatch.setattr("loom.cluster.cli.simulate", too_late)
    argv = [a.replace("TMP", str(tmp_path)) for a in argv]
    (tmp_path / "trace.toml").write_bytes(b"[[jobs]]\nname = 'caf\xe9'\n")
    try:
        rc = cluster_main(argv)
    except SystemExit as e:  # argparse's exit
        rc = e.code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, captured.err
    assert named.replace("TMP", str(tmp_path)) in lines[0] and not captured.out, lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.toml"]


def test_gns_estimate_equals_hand_computation():
    """small_batch is one micro-batch's squared gradient norm and its size; with the step's big-batch norm
    the estimator returns |G|^2 = (B |G_B|^2 - b |G_b|^2)/(B - b), S = (|G_b|^2 - |G_B|^2)/(1/b - 1/B).
    On masked targets b counts trained targets in sequences: b = c / (N / B)."""
    from loom.model.llama import build_model, loss_fn
    from loom.optim.groups import build_optimizer
    from loom.parallel.data.strategy import DataParallel
    from loom.train.gns import gns_estimate, small_batch
    from loom.train.step import plain_run, train_step
    from tests.helpers import masked, tiny_train

    cfg = tiny_model()
    model = build_model(cfg, 3)
    ref = build_model(cfg, 3)
    x, y = global_batch(0, 8)
    micro = [(x[i : i + 2], y[i : i + 2]) for i in range(0, 8, 2)]

    def sq(xs, ys):
        ref.zero_grad()
        loss_fn(ref(xs), ys).backward()
        return sum(float((p.grad.double() ** 2).sum()) for p in ref.parameters() if p.grad is not None)

    sync = DataParallel(model, None)
    g_small, b_small = small_batch(model, sync, loss_fn, micro, 8, None)
    assert g_small == pytest.approx(sq(*micro[0]), rel=1e-5) and b_small == 2.0
    sync.attach_optimizer(build_optimizer(model, tiny_train()))
    res = train_step(plain_run(model, sync, loss_fn), micro, 0.0, 0.0, None)
    g_big = sq(x, y)
    assert res.grad_norm**2 == pytest.approx(g_big, rel=1e-5)
    est = gns_estimate(g_small, res.grad_norm**2, b_small, 8)
    g2 = (8 * g_big - 2 * sq(*micro[0])) / 6
    trace = (sq(*micro[0]) - g_big) / (1 / 2 - 1 / 8)
    assert est["gns_g2"] == pytest.approx(g2, rel=1e-4) and est["gns_trace"] == pytest.approx(trace, rel=1e-4)
    assert est["gns"] == pytest.approx(trace / g2, rel=1e-4)
    ym = masked(y, 3)
    trained = (ym != -100).sum(dim=1).double()
    micro = [(x[i : i + 2], ym[i : i + 2]) for i in range(0, 8, 2)]
    g_small, b_small = small_batch(model, sync, loss_fn, micro, 8, None)
    assert g_small == pytest.approx(sq(*micro[0]), rel=1e-5)
    assert b_small == pytest.approx(float(trained[:2].sum() / (trained.sum() / 8))) and b_small != 2.0
    sync.remove()


def test_gns_from_metrics_and_log_gns_refusals(tmp_path):
    rows = [
        {"step": 1, "gns_g2": 2.0, "gns_trace": 10.0},
        {"step": 2, "gns_g2": 4.0, "gns_trace": 20.0},
        {"step": 3},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert gns_from_metrics(tmp_path) == pytest.approx(15.0 / 3.0)
    with pytest.raises(ClusterError, match="no metrics.jsonl"):
        gns_from_metrics(tmp_path / "nothing")
    # a torn last line is dropped (the run killed mid-write); other damage is one line naming file:line
    path = tmp_path / "metrics.jsonl"
    good = path.read_text()
    path.write_text(good + '{"step": 4, "gns_g2": 1')
    assert gns_from_metrics(tmp_path) == pytest.approx(15.0 / 3.0)
    for damaged, says in (
        ("garbage\n" + good, ":1: not a JSON row of metrics"),
        (good + '{"step": 4, "gns_g2": "x", "gns_trace": 1}\n', ":4: gns_trace and gns_g2 must be finite"),
        (good + '{"step": 4, "gns_g2": NaN, "gns_trace": 1}\n', ":4: gns_trace and gns_g2 must be finite"),
    ):
        path.write_text(damaged)
        with pytest.raises(ClusterError, match=says):
            gns_from_metrics(tmp_path)
    path.write_bytes(b"\xff\n")
    with pytest.raises(ClusterError, match="UTF-8"):
        gns_from_metrics(tmp_path)
    path.write_text(good)
    from loom import config as C

    cfg = C.load("debug", ["--train.log_gns", "true", "--parallel.tp", "2"])
    with pytest.raises(C.ConfigError, match="train.log_gns: needs data parallelism"):
        C.validate(cfg, 2)
    trace = _write(
        tmp_path,
        "t.toml",
        f"[[jobs]]\narrival_s = 0\nsamples = 5\ngns = '{tmp_path}'\nthroughput = {{ v100 = {{ 1 = 1.0 }} }}\n",
    )
    assert load_trace(trace)[0].gns == pytest.approx(5.0)
    assert math.isinf(Job("n", 0, 1).phi(0.5)) and Job("n", 0, 1, gns=10, gns_final=40).phi(
        0.5
    ) == pytest.approx(20.0)


def test_trainer_logs_gns_without_changing_the_run(tmp_path, monkeypatch):
    """One rank, global batch 4 of micro-batches 2: each row's estimates satisfy
    gns_g2 + gns_trace / B_big = grad_norm^2 (the estimator's algebra: E|G_B|^2 = |G|^2 + S / B at
    B_big), and the probe leaves training untouched (losses equal to a run without it)."""
    from loom import config as C
    from loom.data import prepare_data
    from loom.train.trainer import RankEnv, Trainer

    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    runs = []
    for gns in (False, True):
        cfg = C.from_dict(
            {
                "model": {"dim": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 32},
                "data": {"seq_len": 32, "vocab_size": 300, "max_corpus_mb": 0.1},
                "train": {
                    "steps": 3,
                    "global_batch": 4,
                    "micro_batch": 2,
                    "log_every": 1,
                    "eval_every": 0,
                    "log_gns": gns,
                },
                "run": {
                    "progress": False,
                    "tensorboard": False,
                    "threads": 1,
                    "dir": str(tmp_path / f"run{gns}"),
                },
            }
        )
        cfg.data.prepared_dir = str(prepare_data(cfg.data, progress=False).dir)
        trainer = Trainer(cfg, RankEnv(0, 1, 0, 1))
        try:
            trainer.fit()
        finally:
            trainer.heartbeat.close()
        runs.append([json.loads(r) for r in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()])
    plain, probed = runs
    assert [r["loss"] for r in probed] == [r["loss"] for r in plain]
    assert "gns" not in plain[0] and len(probed) == 3
    for r in probed:
        assert r["gns_g2"] + r["gns_trace"] / 4 == pytest.approx(r["grad_norm"] ** 2, rel=1e-6)
        assert r["gns"] == pytest.approx(r["gns_trace"] / r["gns_g2"])


def test_cluster_profiles_feed_the_planner(tmp_path, capsys):
    """A cluster file's ``profiles`` (a loom plan calibrate profile per device type) replace the
    datasheet: the job model's throughput is M / step time of the planner's best layout under that
    profile, shared among the ranks (contended), as parallel.auto sees it; a missing file is refused."""
    from loom.cluster.formats import load_cluster
    from loom.plan import ClusterSpec, Workload, search
    from loom.plan.hardware import DEVICES, contended, datasheet_profile

    prof = datasheet_profile(DEVICES["cpu"])
    path = tmp_path / "profile.json"
    prof.save(path)
    cfile = _write(
        tmp_path, "c.toml", f'[cluster]\ndevices = {{ cpu = 2 }}\nprofiles = {{ cpu = "{path}" }}\n'
    )
    cluster = load_cluster(cfile)
    job = Job("c", 0, 100, 2, batch=4, seq_len=16, precision="fp32", model=tiny_model())
    got = throughput(job, "cpu", 2, per_node=cluster.devices_per_node, profile=cluster.profile("cpu"))
    best = search(
        tiny_model(),
        Workload(4, 16, "fp32"),
        ClusterSpec.single_node("cpu", 2),
        2,
        profile=contended(prof, 2),
    ).best
    assert best is not None and got == pytest.approx(4 / best.step_time)
    bad = _write(tmp_path, "b.toml", '[cluster]\ndevices = { cpu = 2 }\nprofiles = { cpu = "none.json" }\n')
    assert cluster_main(["simulate", "--cluster", bad, "--trace", "synthetic"]) == 2
    err = capsys.readouterr().err
    assert "b.toml: cluster.profiles.cpu: profile file 'none.json' does not exist" in err


def test_gavel_objectives_are_optimal_against_each_other():
    """Three jobs with different speed ratios, remaining work and ages on 2 fast + 1 slow devices:
    each LP's solution is at least as good on its own objective as the other policies' solutions and
    the equal share (FTF: max rho <= 1, the equal share's value; makespan: max R_m / T_m lowest)."""
    jobs = [
        JobState(table_job("a", 0, 900, {"fast": 6.0, "slow": 1.0})),
        JobState(table_job("b", 100, 300, {"fast": 2.0, "slow": 1.5})),
        JobState(table_job("c", 200, 2000, {"fast": 3.0, "slow": 2.0}, devices=2)),
    ]
    cluster, now = Cluster({"fast": 2, "slow": 1}), 400.0
    tput, scale, cap = Gavel("ftf").matrices(jobs, cluster)
    eq = Gavel("ftf").equal_share(tput, scale, cap)
    rem = np.array([js.remaining for js in jobs])
    age = np.array([now - js.job.arrival for js in jobs])
    f = min(1.0, cap.sum() / scale.sum())
    x_eq = np.tile(f * cap / cap.sum(), (3, 1))
    xs = {name: Gavel(name).solve(jobs, cluster, now) for name in ("maxmin", "makespan", "ftf")}
    for x in [*xs.values(), x_eq]:  # every solution is feasible
        assert (x.sum(axis=1) <= 1 + 1e-7).all() and ((scale @ x) <= cap + 1e-7).all() and (x >= -1e-9).all()

    def rho(x):
        return ((age + rem / (tput * x).sum(axis=1)) / (age + rem / eq)).max()

    def span(x):
        return (rem / (tput * x).sum(axis=1)).max()

    def fair(x):
        return ((tput * x).sum(axis=1) / eq).min()

    assert rho(x_eq) == pytest.approx(1.0)
    assert rho(xs["ftf"]) <= min(rho(x) for x in [xs["maxmin"], xs["makespan"], x_eq]) * (1 + 1e-4)
    assert span(xs["makespan"]) <= min(span(x) for x in [xs["maxmin"], xs["ftf"], x_eq]) * (1 + 1e-6)
    assert fair(xs["maxmin"]) >= max(fair(x) for x in [xs["makespan"], xs["ftf"], x_eq]) * (1 - 1e-6)


@pytest.mark.parametrize(
    "second, named",
    [
        ({"name": "a"}, "jobs[1].name: 'a' is already the name of another job"),
        ({"name": "b", "batch": 64, "max_batch": 32}, "jobs[1].max_batch: 32 is below its batch 64"),
        # a table of a type no cluster can have was ignored (h100 for h100-sxm: never used)
        ({"name": "b", "throughput": {"h100": {"1": 1.0}}}, "jobs[1].throughput.h100: unknown device type"),
        ({"name": 7}, "jobs[1].name: expected a non-empty string, got 7"),  # was taken as "7"
    ],
    ids=["duplicate name", "max_batch below batch", "unknown device type", "a number as name"],
)
def test_a_trace_names_the_job_and_the_field_it_refuses(tmp_path, second, named):
    """A duplicate name said only "job names must be unique" (no file, no job); a max_batch below the
    job's batch was accepted."""
    import tomli_w

    from loom.cluster.jobs import ClusterError

    first = {"name": "a", "arrival_s": 0, "samples": 100, "throughput": {"h100-sxm": {"1": 1.0}}}
    path = tmp_path / "trace.toml"
    path.write_text(tomli_w.dumps({"jobs": [first, first | second]}))
    with pytest.raises(ClusterError, match=f"^{path}: " + named.replace("[", r"\[").replace("]", r"\]")):
        load_trace(path)


def test_a_trace_that_would_not_end_names_its_file_job_and_field(tmp_path, capsys, monkeypatch):
    """arrival_s = 1e300 spun the simulator (a round no longer moved the clock) and samples = 1e300
    or a round of 1e-9 s ended in "more than 1000000 events" naming nothing: the arrival is bounded,
    and the events cap names the file, the clock, the rounds and the job that keeps it going."""
    import importlib

    sim = importlib.import_module("loom.cluster.simulate")  # the package's simulate is the function

    job = "[[jobs]]\nname = 'a'\narrival_s = {arrival}\nsamples = {samples}\nthroughput = {{ v100 = {{ 1 = 4.0 }} }}\n"
    far = _write(tmp_path, "far.toml", job.format(arrival="1e300", samples=100))
    assert cluster_main(["simulate", "--trace", far, "--policy", "fifo"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"loom: error: {far}: jobs[0].arrival_s: at most 1e+09 s (about 30 years), got 1e+300"
    )
    monkeypatch.setattr(sim, "MAX_EVENTS", 50)
    big = _write(tmp_path, "big.toml", job.format(arrival=0, samples="1e300"))
    assert cluster_main(["simulate", "--trace", big, "--policy", "fifo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"loom: error: {big}: policy fifo: more than 50 events by t = "
    )
    assert (
        "rounds of cluster.round_s = 360 s): job 'a' has done " in err[0] and "of samples = 1e+300" in err[0]
    )


def test_a_trace_gns_run_without_metrics_names_the_job_field(tmp_path):
    """A job's gns naming a run directory without metrics.jsonl named only the directory."""
    path = _write(
        tmp_path,
        "t.toml",
        "[[jobs]]\narrival_s = 0\nsamples = 10\ngns = 'nowhere'\nthroughput = { v100 = { 1 = 1.0 } }\n",
    )
    with pytest.raises(ClusterError, match=rf"^{path}: jobs\[0\]\.gns: nowhere: no metrics.jsonl"):
        load_trace(path)
