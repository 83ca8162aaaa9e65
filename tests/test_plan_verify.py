"""``loom plan verify``: one rank of a large job, built under the fake process group and stepped here;
the planner's model-state bytes hold within 2% and its peak within 10% (the command's own gates)."""

from __future__ import annotations

import subprocess
import sys

from loom.plan.cost import Layout


def _verify(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "loom", "plan", "verify", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def test_rank_0_of_llama3_8b_on_32_devices_matches_the_planner():
    """tp8 pp4, 1F1B with 4 micro-batches: every model-state kind within 2%, the peak within 10%."""
    out = _verify(
        "--config",
        "llama3-8b",
        "--devices",
        "32",
        "--device",
        "h100-sxm",
        "--rank",
        "0",
        "--seq",
        "16",
        "--layout",
        "dp1 tp8 pp4 cp1 ep1 zero0 1f1b:v1 mb1 recompute:none",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = _rows(out.stdout)
    for kind in ("parameters", "gradients", "optimizer", "peak"):
        assert rows[kind].endswith(("(±2%)", "(±10%)")) and " ok " in rows[kind] + " ", rows[kind]


def test_rank_0_of_a_1b_model_under_zero3_on_64_devices_holds_the_state_formula():
    """ZeRO-3 over 64: parameters, gradients and optimizer state are 1/64 each, as the planner says
    (within 2%), and the peak holds the planner's ZeRO-3 transient (the tied embedding/head unit
    gathered with its gradients in backward) within 10%."""
    out = _verify(
        "--config",
        "llama-1b",
        "--devices",
        "64",
        "--device",
        "h100-sxm",
        "--rank",
        "0",
        "--seq",
        "16",
        "--layout",
        "dp64 tp1 pp1 cp1 ep1 zero3 mb1 recompute:none",
    )
    rows = _rows(out.stdout)
    for kind in ("parameters", "gradients", "optimizer", "peak"):
        assert " ok " in rows[kind] + " ", rows[kind]
    assert out.returncode == 0, out.stdout + out.stderr


def _rows(stdout: str) -> dict[str, str]:
    """Table rows of ``loom plan verify`` by kind (first word; "saved" for saved activations)."""
    return {line.split()[0]: line.rstrip() for line in stdout.splitlines() if line.strip()}


def test_layout_lines_round_trip_and_bad_ones_are_one_line():
    lay = Layout.parse("dp16 tp8 pp8 cp1 ep1 zero1 sp interleaved:v5 mb1 recompute:none")
    assert (lay.dp, lay.tp, lay.pp, lay.zero, lay.dp_shard, lay.sp, lay.schedule, lay.v) == (
        16,
        8,
        8,
        1,
        16,
        True,
        "interleaved",
        5,
    )
    assert Layout.parse(lay.spec()) == lay
    out = _verify("--config", "llama3-8b", "--devices", "32", "--layout", "dp1 tp8 pp4 warp9")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "'warp9'" in out.stderr
    out = _verify("--config", "llama3-8b", "--devices", "64", "--layout", "dp1 tp8 pp4")
    assert out.returncode == 2 and "uses 32 devices" in out.stderr
