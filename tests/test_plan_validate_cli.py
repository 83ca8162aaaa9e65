"""``loom plan validate``'s options: each refused in one line, before any training run, where the
mode given does not read it (``--published`` runs nothing locally); ``--config`` resolved against
the user's directory and checked for every chosen layout first. No run starts here:
:func:`loom.plan.validate.validate` is replaced by a stub."""

from __future__ import annotations

from pathlib import Path

import pytest

from loom.plan import validate as val


@pytest.fixture
def runs(monkeypatch) -> list[tuple]:
    """The arguments :func:`validate` (the training runs) was called with; it returns no rows."""
    calls: list[tuple] = []

    def stub(*args, **kw):
        calls.append(args)
        return []

    monkeypatch.setattr(val, "validate", stub)
    return calls


def _one_line(capsys, says: str) -> None:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loom plan validate: error: ") and says in lines[0], lines
    assert captured.out == ""


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--published", "--plot", "x.png"], "--plot: not with --published"),
        (["--published", "--only", "dp1"], "--only: not with --published"),
        (["--published", "--config", "debug"], "--config: not with --published"),
        (["--published", "--steps", "3"], "--steps: not with --published"),
        (["--published", "--repeats", "1"], "--repeats: not with --published"),
        (["--published", "--corpus-mb", "1"], "--corpus-mb: not with --published"),
        (["--published", "--profile", "p.json"], "--profile: not with --published"),
        (["--published", "--sources", "--json"], "--sources: not with --json"),
        (["--published", "--fit", "--json"], "--fit: not with --json"),
        (["--fit"], "--fit needs --published"),
        (["--sources"], "--sources needs --published"),
        (["--runs", "r.toml"], "--runs needs --published"),
        (["--only", "dp1", "nope"], "--only: no layout named 'nope'"),
        (["--profile", "none.json"], "--profile: profile file 'none.json' does not exist"),
        (["--config", "cfg/none.toml"], "--config cfg/none.toml: config file"),
        (
            ["--config", "cfg/bad.toml", "--only", "dp1"],
            "--config cfg/bad.toml: layout 'dp1' (1 rank): model.dim",
        ),
        (["--config", "cfg/tiny.toml", "--only", "tp2 sp"], "layout 'tp2 sp' (2 ranks): "),
    ],
)
def test_options_the_mode_does_not_read_are_refused(tmp_path, monkeypatch, capsys, runs, argv, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "bad.toml").write_text("[model]\ndim = 60\n")
    (tmp_path / "cfg" / "tiny.toml").write_text(  # 3 heads: tp 2 does not divide them
        Path(val.DEBUG_CONFIG)
        .read_text()
        .replace("n_heads = 4", "n_heads = 3")
        .replace("n_kv_heads = 2", "n_kv_heads = 3")
        .replace("dim = 64", "dim = 48")
    )
    assert val.main(argv) == 2
    _one_line(capsys, says)
    assert runs == [] and not (tmp_path / "x.png").exists()


def test_relative_config_reaches_the_runs_absolute(tmp_path, monkeypatch, capsys, runs):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "tiny.toml").write_text(Path(val.DEBUG_CONFIG).read_text())
    assert val.main(["--config", "cfg/tiny.toml", "--only", "dp1", "dp2", "--json"]) == 0
    ((layouts, config, *_),) = runs
    assert config == str(tmp_path / "cfg" / "tiny.toml")
    assert [name for name, _, _ in layouts] == ["dp1", "dp2"]
    assert capsys.readouterr().out.strip() == "[]"


def test_published_keeps_its_own_options(capsys):
    assert val.main(["--published", "--json"]) in (0, 1)
    assert capsys.readouterr().out.startswith("[{")
    assert val.main(["--published", "--sources"]) in (0, 1)
    assert "- BLOOM-176B" in capsys.readouterr().out
