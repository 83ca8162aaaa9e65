"""Experiment trackers (issue 36, item 1): W&B in offline mode and MLflow in a local file store get the
rows of ``metrics.jsonl``; a resumed run continues the same tracker run (its id kept in run.dir)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from loom import config as C
from tests.helpers import TINY_JOB, prepared_config, read_metrics, with_sections

OVERRIDES = with_sections(
    TINY_JOB,
    train={"warmup_steps": 1, "checkpoint_every": 2, "checkpoint_async": False},
    run={"nproc": 1, "trackers": "wandb,mlflow"},
)


def _train(cfg: dict, steps: int) -> None:
    from loom.cli import main

    args = [
        f"--{s}.{k}={v}"
        for s, table in with_sections(cfg, train={"steps": steps}).items()
        for k, v in table.items()
    ]
    assert main(["train", *args]) == 0


def _offline_run(tmp_path: Path, monkeypatch) -> dict:
    """The tiny run of :data:`OVERRIDES` in ``tmp_path/run``, W&B offline and MLflow's file store there."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return with_sections(prepared_config(OVERRIDES, tmp_path / "cache"), run={"dir": str(tmp_path / "run")})


def _wandb_logs(run_dir: Path, run_id: str) -> list[bytes]:
    """The record log (``.wandb``) of each offline W&B run directory of ``run_id``, oldest first."""
    return [p.read_bytes() for p in sorted(run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))]


def test_wandb_offline_and_mlflow_file_store_continue_the_same_run_after_a_resume(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    cfg = _offline_run(tmp_path, monkeypatch)
    run_dir = tmp_path / "run"
    _train(cfg, 2)
    ids = json.loads((run_dir / "trackers.json").read_text())
    assert ids["wandb_step"] == ids["mlflow_step"] == 2  # the last step each was sent
    # W&B names an offline run's directory by the second it started in (offline-run-YYYYMMDD_HHMMSS-id):
    # two processes of one run starting within a second (only here: a real resume follows training)
    # would share it, so the resume starts in the next second
    time.sleep(1.1)
    _train(cfg, 4)  # resumes from the step-2 checkpoint
    again = json.loads((run_dir / "trackers.json").read_text())
    assert again == ids | {"wandb_step": 4, "mlflow_step": 4}, "a resume keeps the tracker runs"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]

    def logged() -> list[list[bool]]:  # per offline directory: which steps' losses its log holds
        return [
            [json.dumps(r["loss"]).encode() in log for r in rows]
            for log in _wandb_logs(run_dir, ids["wandb"])
        ]

    expected = [[r in mine for r in rows] for mine in (rows[:2], rows[2:])]  # each process its own steps
    # the log is written by W&B's service process: give a loaded machine time
    deadline = time.monotonic() + 30
    while (found := logged()) != expected and time.monotonic() < deadline:
        time.sleep(0.5)
    assert found == expected, "one offline directory per process, both of the same run id"

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    history = sorted((m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "loss"))
    assert history == [(r["step"], r["loss"]) for r in rows]
    params = client.get_run(ids["mlflow"]).data.params
    assert params["model.dim"] == "32" and params["run.trackers"] == "wandb,mlflow"


def _mlflow_history(run_dir: Path, run_id: str, key: str = "loss") -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_a_resume_below_the_steps_sent_gives_their_new_values_to_new_tracker_runs(
    tmp_path, monkeypatch, capsys
):
    """The audit's run: steps 1-4 sent to MLflow and W&B (offline), then resumed from the step-2
    checkpoint with another ``train.lr``. Steps 3-4 read back from each tracker with the values
    ``metrics.jsonl`` now holds, in a new run beside the old one, and one line says so."""
    from mlflow.tracking import MlflowClient

    cfg = _offline_run(tmp_path, monkeypatch)
    run_dir = tmp_path / "run"
    _train(cfg, 4)
    old, old_rows = json.loads((run_dir / "trackers.json").read_text()), read_metrics(run_dir)
    capsys.readouterr()
    _train(with_sections(cfg, train={"resume": str(run_dir / "checkpoints/step-00000002"), "lr": 0.01}), 4)
    err = capsys.readouterr().err
    ids, rows = json.loads((run_dir / "trackers.json").read_text()), read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[:2] == old_rows[:2]
    assert all(r["lr"] != o["lr"] for r, o in zip(rows[2:], old_rows[2:])), "lr 0.01: each step's lr"
    assert rows[3]["loss"] != old_rows[3]["loss"], "and step 4's loss (step 3's is of the same weights)"
    assert ids["mlflow"] != old["mlflow"] and ids["wandb"] != old["wandb"], "a rewind: new tracker runs"
    assert ids["mlflow_step"] == ids["wandb_step"] == 4 and ids["wandb_group"] == old["wandb"]

    for key in ("loss", "lr"):
        assert _mlflow_history(run_dir, ids["mlflow"], key) == [(r["step"], r[key]) for r in rows[2:]]
        assert _mlflow_history(run_dir, old["mlflow"], key) == [(r["step"], r[key]) for r in old_rows]
    run = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri()).get_run(ids["mlflow"])
    assert run.info.run_name == "run resumed after step 2" and run.data.params["train.lr"] == "0.01"
    assert run.data.tags["loom.resumed_from"] == old["mlflow"]

    def logged() -> list[list[bool]]:  # the new run's offline log: which lrs of each attempt it holds
        return [
            [json.dumps(r["lr"]).encode() in log for r in rows[2:] + old_rows[2:]]
            for log in _wandb_logs(run_dir, ids["wandb"])
        ]

    deadline = time.monotonic() + 30  # written by W&B's service process: give a loaded machine time
    while (found := logged()) != [[True, True, False, False]] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert found == [[True, True, False, False]], "the new W&B run holds the re-run steps' new values"

    lines = [line for line in err.splitlines() if "re-runs steps a tracker was sent" in line]
    assert len(lines) == 1, err
    assert "after step 2" in lines[0] and "'run resumed after step 2'" in lines[0]
    for n in ("mlflow", "wandb"):
        assert f"{n} {ids[n]} (continues {old[n]}, which holds steps to 4)" in lines[0]


def test_an_attempt_that_died_past_its_checkpoint_leaves_each_step_once_per_tracker_run(
    tmp_path, monkeypatch, caplog
):
    """Attempt 1 logs steps 1-7 and dies; attempt 2 resumes from the step-4 checkpoint and logs 5-10
    (metrics.jsonl cut at 4 first, as the trainer does). TensorBoard's events read back 1-10 once
    each (the dead attempt's 5-7 purged); MLflow, whose history cannot be cut, holds 1-7 in the first
    run and 5-10, the values metrics.jsonl holds, in a new one."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from loom.checkpoint.training import truncate_metrics
    from loom.train.metrics import MetricsWriter
    from loom.train.trackers import open_trackers

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runs = []
    for start, steps in ((0, range(1, 8)), (4, range(5, 11))):
        truncate_metrics(tmp_path, start)
        trackers = open_trackers("mlflow", tmp_path, {"run": {"trackers": "mlflow"}})
        runs.append(json.loads((tmp_path / "trackers.json").read_text())["mlflow"])
        writer = MetricsWriter(tmp_path, True, True, trackers, start)
        for step in steps:
            writer.write({"step": step, "loss": 10.0 - step + (0.5 if start == 0 and step > 4 else 0.0)})
        writer.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert events == [(s, 10.0 - s) for s in range(1, 11)]
    assert runs[0] != runs[1]
    assert _mlflow_history(tmp_path, runs[0]) == [(s, 10.0 - s + 0.5 * (s > 4)) for s in range(1, 8)]
    assert _mlflow_history(tmp_path, runs[1]) == [(s, 10.0 - s) for s in range(5, 11)]
    lines = [r.getMessage() for r in caplog.records if "re-runs steps" in r.getMessage()]
    assert lines == [
        "trackers: this attempt resumes after step 4 and re-runs steps a tracker was sent (its history "
        f"cannot be cut): they go to new runs named '{tmp_path.name} resumed after step 4': "
        f"mlflow {runs[1]} (continues {runs[0]}, which holds steps to 7)"
    ]


def test_a_resume_past_the_steps_sent_continues_the_run_and_names_the_params_it_keeps(
    tmp_path, monkeypatch, caplog
):
    """No rewind (resumed from the last step sent) with ``train.lr`` changed: the same MLflow run goes
    on, its params as first logged (write-once), and one line names the one that now differs."""
    from mlflow.tracking import MlflowClient

    from loom.train.metrics import MetricsWriter
    from loom.train.trackers import open_trackers

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runs = []
    for lr, steps in ((0.003, (1, 2)), (0.01, (3, 4))):
        trackers = open_trackers("mlflow", tmp_path, {"train": {"lr": lr, "steps": 4}})
        runs.append(json.loads((tmp_path / "trackers.json").read_text())["mlflow"])
        writer = MetricsWriter(tmp_path, True, False, trackers, steps[0] - 1)
        for step in steps:
            writer.write({"step": step, "loss": 10.0 - step})
        writer.close()
    assert runs[0] == runs[1]
    assert _mlflow_history(tmp_path, runs[0]) == [(s, 10.0 - s) for s in range(1, 5)]
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    assert client.get_run(runs[0]).data.params == {"train.lr": "0.003", "train.steps": "4"}
    assert [r.getMessage() for r in caplog.records if r.name == "loom"] == [
        f"trackers: MLflow run {runs[0]} keeps the params it was first logged with (they are "
        "write-once): train.lr 0.003 (now 0.01)"
    ]


def test_an_unknown_or_missing_tracker_is_one_line(monkeypatch):
    import importlib.util

    from loom.train.trackers import tracker_names

    cfg = C.LoomConfig()
    cfg.run.trackers = "wandb,comet"
    with pytest.raises(C.ConfigError, match=r"^run.trackers: unknown tracker 'comet'"):
        C.validate(cfg, 2)
    assert tracker_names(" tensorboard , mlflow ") == ["mlflow"]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(C.ConfigError, match=r"^run.trackers: wandb is not installed; pip install wandb"):
        tracker_names("wandb")


def test_wandb_without_an_api_key_is_one_line_from_every_rank(tmp_path):
    """No key (no ``wandb login``, no WANDB_API_KEY, not offline): W&B's own reason in one line, the
    same on both ranks, not a traceback from rank 0 and a collective failure from rank 1."""
    import os
    import subprocess
    import sys

    cfg = with_sections(
        prepared_config(OVERRIDES, tmp_path / "cache"),
        run={"dir": str(tmp_path / "run"), "nproc": 2, "trackers": "wandb"},
        parallel={"dp": 2},
        train={"steps": 2, "micro_batch": 1},
    )
    args = [f"--{s}.{k}={v}" for s, table in cfg.items() for k, v in table.items()]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), NETRC=str(tmp_path / "no-netrc"), PYTHONPATH=str(Path.cwd()))
    p = subprocess.run(
        [sys.executable, "-m", "loom", "train", *args], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    assert p.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("loom: run.trackers: wandb: "), lines
    assert "WANDB_MODE=offline" in lines[0]


def test_a_tracker_server_that_refuses_is_one_line(tmp_path, monkeypatch, capsys):
    """MLflow pointed at a closed port: the library's exception, named, in one line (not a traceback)."""
    from loom.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    cfg = with_sections(
        prepared_config(OVERRIDES, tmp_path / "cache"),
        run={"dir": str(tmp_path / "run"), "trackers": "mlflow"},
        train={"steps": 2},
    )
    assert main(["train", *[f"--{s}.{k}={v}" for s, table in cfg.items() for k, v in table.items()]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "loom: error: run.trackers: mlflow could not start: MlflowException: "
    ), err


def test_metrics_rows_are_strict_json_and_files_follow_the_umask(tmp_path):
    """An fp16 step's infinite gradient norm or a diverged loss was written as ``Infinity``/``NaN``
    (JSON.parse and polars refuse them, jq reads 1.8e308): each becomes null with its value named in
    ``KEY_nonfinite``, TensorBoard still getting the number; metrics.jsonl and the run lock take the
    umask's mode as every other file does (a group's shared run.dir stays appendable)."""
    import math
    import os
    import stat

    from loom.train.metrics import MetricsWriter
    from loom.train.run_lock import RunLock

    old = os.umask(0o002)
    try:
        w = MetricsWriter(tmp_path, enabled=True, tensorboard=True)
        w.write({"step": 1, "loss": 2.5, "grad_norm": math.inf, "eval_loss": math.nan, "x": -math.inf})
        w.close()
        with RunLock(str(tmp_path / "run")):
            lock_mode = stat.S_IMODE((tmp_path / "run" / ".loom.lock").stat().st_mode)
    finally:
        os.umask(old)

    def refuse(token):
        raise ValueError(token)

    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    row = json.loads(line, parse_constant=refuse)  # strict: no NaN / Infinity tokens
    assert row == {
        "step": 1,
        "loss": 2.5,
        "grad_norm": None,
        "grad_norm_nonfinite": "inf",
        "eval_loss": None,
        "eval_loss_nonfinite": "nan",
        "x": None,
        "x_nonfinite": "-inf",
    }
    assert stat.S_IMODE((tmp_path / "metrics.jsonl").stat().st_mode) == lock_mode == 0o664
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp_path / "tensorboard"))
    tb.Reload()
    assert math.isinf(tb.Scalars("grad_norm")[0].value) and tb.Scalars("loss")[0].value == 2.5
