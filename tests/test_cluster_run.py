"""Real jobs under a policy (issue 38, part 3): ``loom cluster run`` on this machine's ranks, and
``loom cluster slurm`` writing sbatch scripts and Kubernetes Jobs for an allocation.

The real run: 3 ranks, Pollux. Job ``a`` arrives alone and runs on 2 ranks (its throughput table
makes the doubling worth it); ``b`` and ``c`` arrive at once, so Pollux admits them on 1 rank each
and shrinks ``a`` to 1: ``a`` is stopped with a checkpoint and resumed by ``loom train`` at
``--run.nproc 1``. Its losses, step by step, are those of an uninterrupted 1-rank run within 1e-4.
``b`` and ``c`` train more steps than ``a`` has left, so ``a`` usually ends first (a rank freed earlier
lets Pollux grow ``a`` back to 2: another start of 2 ranks, ~10 s here; its losses still continue).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import tomli_w

from loom import config as C
from loom.cluster.cli import main
from tests.helpers import TINY_JOB, prepared_config, read_metrics, with_sections

A_STEPS = 12


@pytest.fixture(scope="module")
def tiny_toml(tmp_path_factory) -> Path:
    """The tiny job (global batch 4: 2 micro-batches per rank on 2 ranks, 4 on 1), corpus prepared once."""
    d = tmp_path_factory.mktemp("tiny")
    cfg = prepared_config(
        with_sections(TINY_JOB, train={"global_batch": 4, "micro_batch": 1, "checkpoint_every": 0}),
        d / "cache",
    )
    path = d / "tiny.toml"
    path.write_text(tomli_w.dumps(cfg))
    return path


def _jobs_file(path: Path, jobs: list[dict]) -> Path:
    path.write_text(tomli_w.dumps({"jobs": jobs}))
    return path


def test_pollux_shrinks_a_job_from_2_ranks_to_1_and_its_losses_continue(tiny_toml, tmp_path, capsys):
    jobs = _jobs_file(
        tmp_path / "jobs.toml",
        [
            {"name": "a", "config": str(tiny_toml), "steps": A_STEPS, "devices": 2, "throughput": {"1": 10.0, "2": 19.0}},
            {"name": "b", "config": str(tiny_toml), "steps": 100, "devices": 1, "arrival_s": 0.1, "throughput": {"1": 10.0}},
            {"name": "c", "config": str(tiny_toml), "steps": 100, "devices": 1, "arrival_s": 0.1, "throughput": {"1": 10.0}},
        ],
    )  # fmt: skip
    out = tmp_path / "out"
    argv = ["run", "--jobs", str(jobs), "--devices", "3", "--policy", "pollux", "--round-s", "600"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = [json.loads(x) for x in (out / "decisions.jsonl").read_text().splitlines()]
    a = [(r["event"], r["ranks"]) for r in rows if r["job"] == "a"]
    assert a[:3] == [("start", 2), ("preempt", 2), ("resume", 1)], rows
    # if b and c end first (a loaded machine's timing), Pollux may grow a back to 2 before it ends:
    # its losses still continue (the data is exactly-once across a dp resize)
    assert a[-1][0] == "finish" and {e for e, _ in a[3:-1]} <= {"preempt", "resume"}, rows
    stopped = next(r["step"] for r in rows if r["job"] == "a" and r["event"] == "preempt")
    assert 1 <= stopped < A_STEPS  # a real step saved on 2 ranks, the rest on 1
    resumed = next(r["step"] for r in rows if r["job"] == "a" and r["event"] == "resume")
    assert resumed == stopped
    for name in "bc":
        assert [(r["event"], r["ranks"]) for r in rows if r["job"] == name] == [("start", 1), ("finish", 1)]
    assert [ln.split()[0] for ln in printed.splitlines() if ln.split()[:1] in (["a"], ["b"], ["c"])] == list(
        "abc"
    )
    assert "average JCT" in printed

    # the uninterrupted run at the new layout (1 rank), in this process
    from loom.cli import main as loom_main

    ref = tmp_path / "ref"
    assert loom_main(["train", str(out / "a.toml"), "--run.dir", str(ref), "--run.nproc", "1"]) == 0
    got, want = read_metrics(out / "a"), read_metrics(ref)
    assert [r["step"] for r in got] == list(range(1, A_STEPS + 1))
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= 1e-4, (g["step"], g["loss"], w["loss"])


def _bad(tmp_path: Path, jobs: list[dict], *extra: str) -> str:
    path = _jobs_file(tmp_path / "bad.toml", jobs)
    rc = main(
        [
            "run",
            "--jobs",
            str(path),
            "--devices",
            "2",
            "--policy",
            "pollux",
            "--out",
            str(tmp_path / "o"),
            *extra,
        ]
    )
    assert rc == 2
    return str(path)


@pytest.mark.parametrize(
    "jobs, field",
    [
        ([{"name": "a"}], "jobs[0].steps: missing"),
        ([{"steps": 0}], "jobs[0].steps: expected an integer > 0, got 0"),
        ([{"steps": 2, "devices": 3}], "jobs[0].devices: 3 ranks requested, the cluster has 2"),
        ([{"steps": 2, "colour": 1}], "jobs[0].colour: unknown key"),
        (
            [{"steps": 2, "name": "a", "throughput": {"1": 1.0}}, {"steps": 2, "name": "a"}],
            "jobs[1].name: 'a' is",
        ),
        ([{"steps": 2, "config": "nope"}], "jobs[0].config: expected a preset"),
        ([{"steps": 2, "overrides": {"train": {"lr": "fast"}}}], "jobs[0]: train.lr"),
        (  # the job started and exited with code 2
            [{"steps": 2, "overrides": {"data": {"source": "/no/such/corpus.jsonl"}}}],
            "jobs[0]: data.source: '/no/such/corpus.jsonl' does not exist",
        ),
        (
            [{"steps": 2, "overrides": {"train": {"init_from": "/no/such/run"}}}],
            "jobs[0]: train.init_from: '/no/such/run' does not exist",
        ),
        (
            [{"steps": 2, "throughput": {"5": 1.0}}],
            "jobs[0].throughput.cpu.5: expected a device count in 1..2",
        ),
    ],
)
def test_bad_jobs_are_refused_in_one_line_before_anything_starts(tmp_path, capsys, jobs, field):
    path = _bad(tmp_path, jobs)
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"loom: error: {path}: {field}") and "\n" not in err, err
    assert not (tmp_path / "o").exists()  # nothing started, no directory made


def test_bad_options_are_refused(tmp_path, capsys):
    jobs = _jobs_file(tmp_path / "j.toml", [{"steps": 2}])
    for argv, line in [
        (["--devices", "0", "--policy", "las"], "--devices: expected a rank count >= 1, got 0"),
        (["--devices", "2", "--policy", "srtf"], "--policy: unknown policy 'srtf'"),
        (["--devices", "2", "--policy", "las", "--round-s", "0"], "--round-s: expected seconds > 0"),
    ]:
        assert main(["run", "--jobs", str(jobs), *argv]) == 2
        assert capsys.readouterr().err.startswith(f"loom: error: {line}")


def _allocation(tmp_path: Path, tiny_toml: Path) -> Path:
    path = tmp_path / "alloc.toml"
    path.write_text(
        tomli_w.dumps(
            {
                "cluster": {"gpus_per_node": 2},
                "jobs": [
                    {"name": "big", "config": str(tiny_toml), "device": "h100", "gpus": 4, "steps": 50},
                    {"name": "one", "config": str(tiny_toml), "device": "a100", "gpus": 2, "steps": 2},
                ],
            }
        )
    )
    return path


def test_sbatch_scripts_parse_and_request_the_allocation(tiny_toml, tmp_path):
    out = tmp_path / "out"
    assert main(["slurm", "--allocation", str(_allocation(tmp_path, tiny_toml)), "--out", str(out)]) == 0
    for name, nodes, per, device, steps in [("big", 2, 2, "h100", 50), ("one", 1, 2, "a100", 2)]:
        script = (out / f"{name}.sbatch").read_text()
        subprocess.run(["bash", "-n", str(out / f"{name}.sbatch")], check=True)
        directives = [x.split(None, 1)[1] for x in script.splitlines() if x.startswith("#SBATCH")]
        assert f"--nodes={nodes}" in directives and f"--ntasks-per-node={per}" in directives
        assert f"--gpus-per-node={device}:{per}" in directives and "--requeue" in directives
        assert "--signal=TERM@90" in directives  # run.preempt_grace_s 60 + 30
        srun = [x for x in script.splitlines() if x.startswith("srun ")]
        assert srun == [
            f"srun --kill-on-bad-exit=1 --ntasks={nodes * per} --ntasks-per-node={per} "
            f"python -m loom train {out / f'{name}.toml'} --run.dir runs/{name} --train.steps {steps}"
        ]
    # the job's own settings (its steps on the command line, as loom train PRESET --train.steps N)
    own = C.load(str(out / "one.toml"), ["--train.steps", "2"])
    assert C.to_dict(own) == C.to_dict(C.load(str(tiny_toml), []))


def test_kubernetes_manifests_load_and_request_the_allocation(tiny_toml, tmp_path):
    yaml = pytest.importorskip("yaml")
    out = tmp_path / "out"
    argv = ["slurm", "--allocation", str(_allocation(tmp_path, tiny_toml)), "--out", str(out), "--kubernetes"]
    assert main([*argv, "--image", "reg/loom:1"]) == 0
    cm, svc, job = yaml.safe_load_all((out / "big.yaml").read_text())
    assert (cm["kind"], svc["kind"], job["kind"]) == ("ConfigMap", "Service", "Job")
    assert cm["data"]["config.toml"] == (out / "big.toml").read_text()  # the job's resolved config
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == {"job-name": "loom-big"}
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 2, 2)
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "loom-big" and pod["nodeSelector"] == {"loom/device-type": "h100"}
    (c,) = pod["containers"]
    assert c["image"] == "reg/loom:1" and c["resources"]["limits"] == {"nvidia.com/gpu": 2}
    assert c["command"] == [
        "python", "-m", "loom", "train", "/etc/loom/config.toml", "--run.dir", "/runs/big", "--train.steps", "50",
        "--run.nproc", "2",
        "--nnodes", "2", "--node-rank", "$(NODE_RANK)", "--rdzv-endpoint", "loom-big-0.loom-big:29400",
    ]  # fmt: skip
    one = list(yaml.safe_load_all((out / "one.yaml").read_text()))[2]
    assert "--nnodes" not in one["spec"]["template"]["spec"]["containers"][0]["command"]
    assert one["spec"]["completions"] == 1


def test_slurm_from_a_policy_and_refusals(tiny_toml, tmp_path, capsys):
    """gavel-maxmin at time 0 on 4 H100s in nodes of 2: two of three 2-device jobs placed, one script each."""
    cluster = tmp_path / "cluster.toml"
    cluster.write_text("[cluster]\ndevices = { h100-sxm = 4 }\ndevices_per_node = 2\n")
    t = {"h100-sxm": {"2": 5.0}}
    jobs = _jobs_file(
        tmp_path / "jobs.toml",
        [
            {"name": n, "config": str(tiny_toml), "steps": 5, "devices": 2, "throughput": t}
            for n in ("x", "y", "z")
        ],
    )
    out = tmp_path / "out"
    argv = [
        "slurm",
        "--jobs",
        str(jobs),
        "--cluster",
        str(cluster),
        "--policy",
        "gavel-maxmin",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    placed = sorted(p.stem for p in out.glob("*.sbatch"))
    (waiting,) = {"x", "y", "z"} - set(placed)  # the LP's shares are equal: two of the three run first
    assert len(placed) == 2 and f"{waiting}: not placed by gavel-maxmin" in printed
    for name in placed:
        assert "#SBATCH --gpus-per-node=h100-sxm:2" in (out / f"{name}.sbatch").read_text()
    alloc = tmp_path / "bad.toml"
    alloc.write_text(
        tomli_w.dumps({"jobs": [{"name": "q", "device": "h100", "gpus": 12, "nodes": 5, "steps": 2}]})
    )
    assert main(["slurm", "--allocation", str(alloc), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"loom: error: {alloc}: jobs[0].gpus: 12 devices do not split into 5 nodes")
        and err.count("\n") == 1
    )
    assert main(["slurm", "--jobs", str(jobs), "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("loom: error: --policy: --jobs needs a policy")
    # run again into the same --out: the configs and scripts already there are never replaced
    (out / f"{placed[0]}.toml").write_text("# my edits\n")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{out}/" in err and ".toml: exists" in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    shutil.rmtree(out)


def test_jobs_of_one_config_get_their_own_run_directories(tmp_path, capsys):
    """Two jobs of the ``debug`` preset (its ``run.dir`` is ``runs/debug``) ran in the same directory;
    each now trains in ``runs/<name>``."""
    alloc = tmp_path / "alloc.toml"
    job = {"config": "debug", "device": "h100", "gpus": 2, "steps": 10}
    alloc.write_text(tomli_w.dumps({"jobs": [{"name": "a", **job}, {"name": "b", **job}]}))
    out = tmp_path / "out"
    assert main(["slurm", "--allocation", str(alloc), "--out", str(out)]) == 0
    for name in ("a", "b"):
        (srun,) = [x for x in (out / f"{name}.sbatch").read_text().splitlines() if x.startswith("srun ")]
        assert srun.endswith(f"--run.dir runs/{name} --train.steps 10"), srun


@pytest.mark.parametrize(
    "job, field",
    [
        ({"name": "a", "device": "h100", "gpus": 2}, "jobs[0].steps: missing, the job's train.steps"),
        (
            {"name": "a", "device": "h100", "gpus": 2, "steps": 2, "overrides": {"run": {"dir": "x"}}},
            "jobs[0].overrides.run.dir: not allowed",
        ),
        (  # the job's steps = 10 won, silently
            {"name": "a", "device": "h100", "gpus": 2, "steps": 10, "overrides": {"train": {"steps": 99}}},
            "jobs[0].overrides.train.steps: not allowed; the job's steps key gives train.steps",
        ),
        (  # written as nproc = 3 while srun started 4 tasks
            {"name": "a", "device": "h100", "gpus": 4, "steps": 10, "overrides": {"run": {"nproc": 3}}},
            "jobs[0].overrides.run.nproc: not allowed; the scheduler gives each launch its ranks",
        ),
    ],
    ids=["no steps", "run.dir override", "train.steps override", "run.nproc override"],
)
def test_allocation_without_steps_or_with_a_run_dir_is_one_line(tmp_path, capsys, job, field):
    alloc = tmp_path / "alloc.toml"
    alloc.write_text(tomli_w.dumps({"jobs": [job]}))
    assert main(["slurm", "--allocation", str(alloc), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"loom: error: {alloc}: {field}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_run_refuses_a_run_dir_override(tmp_path, capsys):
    """``loom cluster run`` launches each job with ``--run.dir OUT/<name>``: a job's own run.dir would be
    silently replaced, so it is refused before any job starts."""
    _bad(tmp_path, [{"steps": 2, "overrides": {"run": {"dir": str(tmp_path / "mine")}}}])
    err = capsys.readouterr().err
    assert "jobs[0].overrides.run.dir: not allowed" in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists() and not (tmp_path / "mine").exists()


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--kubernetes", "--image", ""], "--image: expected a container image name (not empty"),
        (["--kubernetes", "--image", "a b"], "--image: expected a container image name"),
        (["--kubernetes", "--pvc", ""], "--pvc: expected a PersistentVolumeClaim name"),
        (["--kubernetes", "--pvc", "My_Claim"], "--pvc: expected a PersistentVolumeClaim name"),
        (["--image", "reg/loom:1"], "--image: only with --kubernetes"),
        (["--pvc", "runs"], "--pvc: only with --kubernetes"),
    ],
)
def test_kubernetes_options_refused_in_one_line(tiny_toml, tmp_path, capsys, extra, says):
    out = tmp_path / "out"
    assert (
        main(["slurm", "--allocation", str(_allocation(tmp_path, tiny_toml)), "--out", str(out), *extra]) == 2
    )
    err = capsys.readouterr().err
    assert err.startswith(f"loom: error: {says}") and err.count("\n") == 1, err
    assert not out.exists()


def test_kubernetes_names_that_coincide_are_refused(tmp_path, capsys):
    alloc = tmp_path / "alloc.toml"
    job = {"device": "h100", "gpus": 2, "steps": 2}
    alloc.write_text(tomli_w.dumps({"jobs": [{"name": "a_b", **job}, {"name": "a.b", **job}]}))
    out = tmp_path / "out"
    assert main(["slurm", "--allocation", str(alloc), "--out", str(out), "--kubernetes"]) == 2
    err = capsys.readouterr().err
    assert "jobs 'a_b' and 'a.b': both are Kubernetes resources 'loom-a-b'" in err and err.count("\n") == 1
    assert not out.exists()
    assert main(["slurm", "--allocation", str(alloc), "--out", str(out)]) == 0  # sbatch: distinct files


def test_the_docs_job_on_the_debug_preset_gets_the_planners_throughput(tmp_path):
    """docs/cluster.md's job (config = "debug", no throughput table): the preset leaves its model's
    vocabulary to the tokenizer, which the planner now takes as loom train does (data.vocab_size);
    the job was refused as running "on no rank count of the cluster"."""
    from loom.cluster.formats import Cluster
    from loom.cluster.run import load_jobs

    jobs = _jobs_file(tmp_path / "jobs.toml", [{"name": "a", "config": "debug", "steps": 2}])
    (job,) = load_jobs(jobs, Cluster({"cpu": 2}))
    assert job.cfg.model.vocab_size == 0 and set(job.throughput["cpu"]) == {1, 2}
    assert all(v > 0 for v in job.throughput["cpu"].values())


def test_a_trace_given_as_jobs_and_jobs_given_as_a_trace_say_which_file_they_are(tmp_path):
    """The docs named both files jobs.toml: each loader's unknown-key line now says what the file looks
    like (a simulate trace has samples and a model; a --jobs file a config and steps)."""
    from loom.cluster import Cluster, ClusterError
    from loom.cluster.formats import load_trace
    from loom.cluster.run import load_jobs

    trace = tmp_path / "trace.toml"
    trace.write_text('[[jobs]]\narrival_s = 0\nsamples = 100\nmodel = "debug"\n')
    jobs = tmp_path / "jobs.toml"
    jobs.write_text('[[jobs]]\nconfig = "debug"\nsteps = 10\n')
    with pytest.raises(
        ClusterError, match=r"jobs\[0\]\.samples: unknown key; .* \(a cluster simulate trace\?"
    ):
        load_jobs(trace, Cluster({"cpu": 2}))
    with pytest.raises(
        ClusterError, match=r"jobs\[0\]\.config: unknown key; .* \(a --jobs file of cluster run\?"
    ):
        load_trace(jobs)


def test_a_failed_jobs_reason_is_its_logs_last_error_line(tmp_path):
    """``loom cluster run`` prints a failed job's one-line reason (its log's last ``loom: error:``
    line) beside its exit code, not only the log's path."""
    from loom.cluster.run import _last_error

    log = tmp_path / "a.log"
    assert _last_error(log) == ""  # no log yet
    log.write_text(
        "[rank 0] step 1\nloom: error: data.source: gone\nnoise\nloom: error: train.init_from: bad\n"
    )
    assert _last_error(log) == "train.init_from: bad"
    log.write_bytes(b"loom: error: early\n" + b"x" * 100 + b"\nloom: error: late \xff\n")
    assert _last_error(log, tail=40) == "late \ufffd"
