"""Profiler traces and memory snapshots (issue 36, item 2): a 2-rank run's traces load as JSON with
Loom's phases from every rank, rank 0 draws them on one axis, and the CPU memory timeline is written."""

from __future__ import annotations

import json

import pytest

from loom import config as C
from tests.helpers import TINY_JOB, prepared_config, with_sections

OVERRIDES = with_sections(
    TINY_JOB,
    train={"steps": 4, "global_batch": 4, "micro_batch": 1, "warmup_steps": 1, "log_every": 2},
    run={"nproc": 2, "profile_steps": "2-3", "memory_snapshot_step": 4},
)


def test_two_ranks_write_traces_a_timeline_and_a_memory_timeline(tmp_path):
    from loom.cli import main
    from loom.train.profiling import phase_events

    cfg = with_sections(prepared_config(OVERRIDES, tmp_path / "cache"), run={"dir": str(tmp_path / "run")})
    args = [f"--{s}.{k}={v}" for s, table in cfg.items() for k, v in table.items()]
    assert main(["train", *args]) == 0
    profile = tmp_path / "run" / "profile"
    for rank in (0, 1):
        events = phase_events(profile / f"rank-{rank:05d}.json")
        names = [n for n, _, _ in events]
        # 2 steps of 2 micro-batches per rank: every phase of both steps, and nothing of steps 1 or 4
        assert names.count("forward") == 4 and names.count("backward") == 4, names
        assert names.count("data") == 2 and names.count("comm_wait") == 2 and names.count("optimizer") == 2
        assert json.loads((profile / f"memory-rank-{rank:05d}.json").read_text()), "a memory timeline"
    png = (profile / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("profile_steps", "12-10", "run.profile_steps: '12-10' must be a step or a range"),
        ("profile_steps", "5-99", r"\[1, train.steps = 20\]"),
        ("profile_steps", "ten", "run.profile_steps: 'ten'"),
        ("memory_snapshot_step", 21, "run.memory_snapshot_step: must be a step in"),
    ],
)
def test_steps_outside_the_run_are_refused(field, value, match):
    cfg = C.LoomConfig()
    cfg.train.steps = 20
    setattr(cfg.run, field, value)
    with pytest.raises(C.ConfigError, match=match):
        C.validate(cfg, 2)
