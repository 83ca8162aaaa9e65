"""``loom plan calibrate``'s options, each refused in one line before anything is measured, and a
relative ``--config`` taken from the user's directory (the measuring runs start in the repository).
No measurement runs here: :func:`loom.plan.calibrate.calibrate` is replaced by a stub."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loom.plan import calibrate as cal
from loom.plan import validate as val

BAD_MODEL = "[model]\ndim = 60\n"  # 8 heads (the default) do not divide 60


@pytest.fixture
def measured(monkeypatch) -> list[tuple]:
    """The arguments :func:`calibrate` was called with (it returns at once)."""
    calls: list[tuple] = []

    def stub(*args):
        calls.append(args)
        raise SystemExit(0)  # past every check: nothing measured, nothing written

    monkeypatch.setattr(cal, "calibrate", stub)
    return calls


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--threads", "0"], "--threads: must be >= 1, got 0"),
        (["--nproc", "0"], "--nproc: must be >= 1, got 0"),
        (["--nproc", "2", "--backend", "zz"], "--backend: must be one of gloo, nccl"),
        (["--out", "EXISTING.json"], "--out: 'EXISTING.json' exists and is never replaced"),
        (["--out", "adir"], "--out: 'adir' is a directory"),
        (["--out", "nodir/p.json"], "--out: 'nodir' is not a directory"),
        (["--out", ""], "--out: empty"),
        (["--config", "cfg/none.toml"], "--config cfg/none.toml: config file"),
        (["--config", "cfg/bad.toml"], "--config cfg/bad.toml: model.dim: 60 must be divisible"),
    ],
    ids=[
        "threads 0",
        "nproc 0",
        "backend",
        "out exists",
        "out dir",
        "out no parent",
        "out empty",
        "config missing",
        "config bad",
    ],
)
def test_bad_options_refused_in_one_line_before_measuring(
    tmp_path, monkeypatch, capsys, measured, argv, says
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "EXISTING.json").write_text("{}\n")
    (tmp_path / "adir").mkdir()
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "bad.toml").write_text(BAD_MODEL)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert cal.main(["--nproc", "1", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loom plan calibrate: error: ") and says in lines[0], lines
    assert measured == [] and captured.out == ""
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing replaced


def test_nccl_without_cuda_is_one_line(tmp_path, monkeypatch, capsys, measured):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cal.main(["--backend", "nccl", "--nproc", "1", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("loom plan calibrate: error: --backend nccl: needs CUDA GPUs") and "\n" not in err
    assert measured == []


def test_nccl_needs_a_gpu_per_rank(tmp_path, monkeypatch, capsys, measured):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cal.main(["--backend", "nccl", "--nproc", "2", "--out", str(tmp_path / "p.json")]) == 2
    assert "--nproc 2 needs one GPU per rank, this machine has 1" in capsys.readouterr().err
    assert measured == []


def test_relative_config_is_resolved_against_the_users_directory(tmp_path, monkeypatch, measured):
    """The config reaches :func:`calibrate` (and its ``loom train`` subprocess, which runs in the
    repository) as an absolute path; a preset name stays a name."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "tiny.toml").write_text((Path(val.DEBUG_CONFIG)).read_text())
    with pytest.raises(SystemExit):
        cal.main(["--nproc", "1", "--config", "cfg/tiny.toml", "--out", "p.json"])
    (nproc, config, backend, device, threads) = measured[0]
    assert config == str(tmp_path / "cfg" / "tiny.toml") and (nproc, backend, device, threads) == (
        1,
        "gloo",
        "cpu",
        1,
    )
    with pytest.raises(SystemExit):
        cal.main(["--nproc", "1", "--config", "debug", "--out", "p.json"])
    assert measured[1][1] == "debug"
    assert not (tmp_path / "p.json").exists()


def test_run_layout_names_the_config_absolutely(tmp_path, monkeypatch):
    """:func:`run_layout` starts ``loom train`` with cwd = the repository: a relative config path is
    made absolute against this process's directory first (before: 'config file ... does not exist')."""
    import subprocess

    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "tiny.toml").write_text("")
    seen = {}

    def fake_run(cmd, cwd, **kw):
        seen["cmd"], seen["cwd"] = cmd, cwd
        run_dir = Path(cmd[cmd.index("--run.dir") + 1])
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text('{"step_time_s": 0.5}\n')
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(val.subprocess, "run", fake_run)
    row = val.run_layout("cfg/tiny.toml", 1, [], "runs/x")
    assert seen["cmd"][4] == str(tmp_path / "cfg" / "tiny.toml") and seen["cwd"] == val.REPO
    assert seen["cmd"][seen["cmd"].index("--run.dir") + 1] == str(tmp_path / "runs" / "x")
    assert row["step_time_s"] == 0.5
    assert val.absolute_config("debug") == "debug"
