"""The one-GPU check (``benchmarks/gpu_one.sh``, issue 32) cannot rot: its dry run (every part on the
CPU with tiny sizes, through the same code) gives every part A..G a PASS, or a SKIP that says why,
and writes both summaries; an impossible budget makes it write FAIL and exit non-zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_one.sh"


def _run(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = ["bash", str(SCRIPT), "--out", str(out), "--dry-run", "--jobs", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The default corpus (stdlib, 0.5 MB) prepared once, as the wrapper does without --data."""
    out = tmp_path_factory.mktemp("gpu_one_data")
    p = subprocess.run(
        ["python", str(ROOT / "benchmarks" / "gpu_one.py"), "prepare", "--out", str(out), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return out / "data"


def test_dry_run_passes_every_part(tmp_path, data):
    out = tmp_path / "dry"
    p = _run(out, "--data", str(data))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] and summary["passed"]
    assert set(summary["parts"]) == set("ABCDEFG")
    for part, status in summary["parts"].items():
        assert status in ("PASS", "SKIP"), (part, status)
    for row in summary["rows"]:
        assert row["status"] in ("PASS", "SKIP"), row
        if row["status"] == "SKIP":
            assert row["note"], f"a SKIP must say why: {row}"
    for part in "ABCDEFG":  # every part measured something
        assert any(r["part"] == part and r["status"] == "PASS" for r in summary["rows"]), part
    table = (out / "summary.md").read_text()
    assert "| part | check | measured | expected / budget | result |" in table
    assert table.count("\n| ") >= len(summary["rows"]) + 1
    checks = {r["check"] for r in summary["rows"]}
    # B and C compared what they ran, each step time against the planner's
    assert {
        "loss falls",
        "MFU",
        "tokens/s bf16 / fp32",
        "step time / planner",
        "bf16 + compile step / planner",
    } <= checks


def test_an_impossible_budget_fails_and_exits_non_zero(tmp_path, data):
    out = tmp_path / "fail"
    p = _run(out, "--data", str(data), "--only", "A", "--budget", "A.peak_tflops_min=1e12")
    assert p.returncode == 1, p.stdout + p.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parts"] == {"A": "FAIL"} and not summary["passed"]
    failed = [r for r in summary["rows"] if r["status"] == "FAIL"]
    assert [r["check"] for r in failed] == ["bf16 peak (MFU's divisor)"]
    assert "| FAIL |" in (out / "summary.md").read_text()


def test_a_part_that_times_out_is_a_failure(tmp_path):
    """A part killed by its timeout (or crashing) without rows is a FAIL row in the summary."""
    out = tmp_path / "timeout"
    cmd = ["python", str(ROOT / "benchmarks" / "gpu_one.py"), "summary", "--out", str(out), "--dry-run"]
    p = subprocess.run([*cmd, "--parts", "F", "--exits", "F=124"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 1, p.stdout + p.stderr
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert rows[0]["status"] == "FAIL" and "timed out" in rows[0]["note"]


def test_bad_arguments_are_refused(tmp_path):
    p = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and "--out DIR is required" in p.stderr
    (tmp_path / "runs" / "B").mkdir(parents=True)  # a previous run's trainers: they would resume, no steps
    p = subprocess.run(
        ["bash", str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT
    )
    assert p.returncode == 2 and "holds a previous run" in p.stderr and p.stderr.count("\n") == 1


LEASE = ROOT / "benchmarks" / "gpu_lease.sh"


def test_the_lease_wrapper_runs_gpu_one_and_reports(tmp_path, data):
    """``gpu_lease.sh run`` (what a device lease executes) on the prepared kit: gpu_one.sh's summary and
    the lease log land in $OUT, and gpu_one's exit status is the wrapper's (an impossible budget: 1)."""
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "LEASE_PYTEST": "",
        "LEASE_ARGS": "--dry-run --only A --budget A.peak_tflops_min=1e12",
    }
    p = subprocess.run(
        ["bash", str(LEASE), "run", str(data.parent)], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    assert json.loads((tmp_path / "out" / "gpu-out" / "summary.json").read_text())["parts"] == {"A": "FAIL"}
    assert "== lease used" in (tmp_path / "out" / "lease.log").read_text()


def test_the_lease_wrapper_refuses_a_kit_without_data(tmp_path):
    p = subprocess.run(["bash", str(LEASE), "run", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "no prepared data" in p.stderr
    p = subprocess.run(["bash", str(LEASE)], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and "gpu_lease.sh prepare" in p.stdout


def test_the_gpu_scripts_pytest_runs_without_xdist():
    """gpu_lease.sh / gpu_smoke.sh run pytest with ``-o addopts=`` on images that may lack pytest-xdist:
    the suite's conftest must load without the plugin (its xdist hook is optional)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:xdist", "tests/test_imports.py"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
