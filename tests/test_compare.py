"""``loom compare`` (issue 36, item 5) on hand-written metrics.jsonl files: a planted difference is
found at its step, identical runs pass, bad inputs are refused in one line. (Determinism of a real
layout against itself: ``tests/test_preempt.py`` compares a resumed 2-rank run with the
uninterrupted one through ``loom compare``.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loom.cli import main


def _write(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(n: int = 10) -> list[dict]:
    return [
        {"step": s, "loss": 6.0 - 0.1 * s + 1e-9 * s * s, "grad_norm": 1.0 / s, "lr": 1e-3}
        for s in range(1, n + 1)
    ]


def test_identical_runs_pass(tmp_path, capsys):
    a, b = _write(tmp_path / "a", _rows()), _write(tmp_path / "b", _rows())
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "same within --tol 0 over 10 common steps" in out and " *" not in out


@pytest.mark.parametrize("field", ["loss", "grad_norm"])
def test_a_planted_difference_is_found_at_its_step(tmp_path, capsys, field):
    rows = _rows()
    rows[6][field] = math.nextafter(rows[6][field], math.inf)  # step 7, one ulp
    a, b = _write(tmp_path / "a", _rows()), _write(tmp_path / "b", rows)
    assert main(["compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert f"first difference beyond --tol 0: step 7 ({field})" in out
    assert [line.split()[0] for line in out.splitlines() if line.endswith(" *")] == ["7"]
    assert main(["compare", str(a), str(b), "--tol", "1e-6"]) == 0  # within a tolerance


def test_later_steps_and_the_plot(tmp_path, capsys):
    rows = _rows(20)
    for r in rows[11:]:
        r["loss"] += 0.5
    a, b = _write(tmp_path / "a", _rows(20)), _write(tmp_path / "b", rows)
    png = tmp_path / "out" / "cmp.png"
    assert main(["compare", str(a / "metrics.jsonl"), str(b), "--tol=0.01", f"--plot={png}"]) == 1
    out = capsys.readouterr().out
    assert "step 12 (loss)" in out and "9 of 20 common steps differ" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_steps_in_one_run_only_are_named_not_compared(tmp_path, capsys):
    a, b = _write(tmp_path / "a", _rows(10)), _write(tmp_path / "b", _rows(6))
    assert main(["compare", str(a), str(b)]) == 0
    assert "4 steps only in A (7-10)" in capsys.readouterr().out


@pytest.mark.parametrize("value", [float("nan"), None], ids=["NaN", "missing"])
def test_a_step_flagged_for_a_nan_or_missing_value_is_not_max_diff_0(tmp_path, capsys, value):
    """A loss NaN (or absent) on one side only differs; the summary said "max |diff|: loss 0"."""
    rows = _rows()
    if value is None:
        del rows[4]["loss"]
    else:
        rows[4]["loss"] = value
    a, b = _write(tmp_path / "a", _rows()), _write(tmp_path / "b", rows)
    assert main(["compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert (
        "first difference beyond --tol 0: step 5 (loss)" in out
        and "(max |diff|: loss inf, grad_norm 0)" in out
    )


def test_bad_inputs_are_refused_in_one_line(tmp_path, capsys):
    good = _write(tmp_path / "good", _rows())
    late = _write(tmp_path / "late", [dict(r, step=r["step"] + 100) for r in _rows()])
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 1.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n'
    )
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 1.0}\n\xff\xfe\n')
    texty = _write(tmp_path / "texty", [dict(r, loss="5.7") if r["step"] == 3 else r for r in _rows()])
    cases = {
        "a loss as text": (
            [str(good), str(texty)],
            "texty/metrics.jsonl:3: loss must be a number or null, got '5.7'",
        ),
        "missing": ([str(good), str(tmp_path / "nowhere")], "nowhere/metrics.jsonl does not exist"),
        "not UTF-8": ([str(good), str(binary)], "binary/metrics.jsonl is not UTF-8 text"),
        "plot not a picture": ([str(good), str(good), "--plot", str(tmp_path / "a.toml")], "--plot"),
        "plot a directory": ([str(good), str(good), "--plot", str(tmp_path)], "is a directory"),
        "no common step": ([str(good), str(late)], "have no step in common"),
        "a row in the middle not JSON": ([str(good), str(torn)], "torn/metrics.jsonl:2: not a JSON row"),
        "one run": ([str(good)], "give two runs"),
        "bad tol": ([str(good), str(good), "--tol", "-1"], "--tol: must be a number >= 0"),
        "unknown option": ([str(good), str(good), "--rtol", "1"], "--rtol: unknown option"),
    }
    for name, (args, expected) in cases.items():
        assert main(["compare", *args]) == 2, name
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("loom: error: ") and expected in lines[0], (
            name,
            lines,
        )
        assert not captured.out, name


def test_a_last_row_cut_short_by_a_kill_is_left_out_with_a_note(tmp_path, capsys):
    """A run killed mid-write leaves its last row without its end (no newline): compared without it,
    saying so in one line on stderr (a row cut anywhere else is refused, above)."""
    good = _write(tmp_path / "good", _rows())
    cut = _write(tmp_path / "cut", _rows(5))
    with open(cut / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')
    assert main(["compare", str(good), str(cut)]) == 0
    captured = capsys.readouterr()
    assert "same within --tol 0 over 5 common steps" in captured.out
    note = captured.err.strip().splitlines()
    assert len(note) == 1 and "cut/metrics.jsonl:6: the last row is cut short" in note[0], note


def test_help_lists_compare(capsys):
    assert main(["--help"]) == 0
    assert "  compare    RUN_A RUN_B" in capsys.readouterr().out
