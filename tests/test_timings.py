"""Per-rank phase times and the straggler line (issue 36, item 3). A real 2-rank run's rows are
checked in tests/test_e2e.py; here the rules, on times given."""

from __future__ import annotations

import time

import pytest
import torch

from loom.train.timings import PHASES, WINDOWS, PhaseClock, Stragglers, active, phase, timing_fields


def _times(busy: list[float], step: float = 1.0) -> list[list[float]]:
    """Ranks whose busy time is ``busy``: the rest of the step waits in communication."""
    wait = PHASES.index("comm_wait")
    out = []
    for b in busy:
        t = [0.0] * len(PHASES) + [step]
        t[PHASES.index("forward")], t[wait] = b, step - b
        out.append(t)
    return out


def test_a_rank_slow_for_three_logged_steps_in_a_row_is_named_once():
    s = Stragglers(pct=20)
    fast, slow = 0.5, 0.7  # +40% over the median of 4 ranks (0.5)
    lines = [s.check(step, _times([fast, fast, slow, fast])) for step in (10, 20, 30, 40)]
    assert lines[: WINDOWS - 1] == [None] * (WINDOWS - 1) and lines[WINDOWS] is None, lines
    line = lines[WINDOWS - 1]
    assert line is not None and line.startswith(
        "straggler: rank 2 busy 0.7 s per step against the median 0.5 s (+40%"
    )
    assert "up to step 30" in line and "\n" not in line
    assert s.check(50, _times([fast] * 4)) is None  # recovered: the streak ends
    assert Stragglers(pct=50).check(10, _times([fast, slow])) is None  # within the allowance
    assert Stragglers(pct=0).check(10, _times([fast, 10.0])) is None  # off


def test_timing_fields_give_median_max_and_the_slowest_rank():
    f = timing_fields(_times([0.2, 0.9, 0.4]))
    assert f["time_forward_s_median"] == pytest.approx(0.4)
    assert f["time_forward_s_max"] == pytest.approx(0.9) and f["time_forward_s_max_rank"] == 1
    assert f["time_forward_s_ranks"] == pytest.approx([0.2, 0.9, 0.4])
    many = timing_fields(_times([0.1] * 100))
    assert "time_forward_s_ranks" not in many and many["time_step_s_max_rank"] == 0


def test_phases_sum_per_step_and_nothing_is_timed_without_a_clock():
    clock = PhaseClock(torch.device("cpu"))
    with phase("forward"):  # no active clock: untimed
        time.sleep(0.01)
    with active(clock):
        for _ in range(2):
            with phase("forward"):
                time.sleep(0.02)
            with phase("optimizer"):
                pass
    per_step = clock.read(2)
    assert 0.02 <= per_step["forward"] < 0.05 and per_step["data"] == 0
    assert clock.read(1)["forward"] == 0, "read resets the window"


@pytest.mark.parametrize(
    "value,why",
    [
        (-1.0, "must be >= 0 (0 = off)"),
        (float("nan"), "must be a finite number"),
        (float("inf"), "must be a finite number"),
    ],
)
def test_a_straggler_threshold_below_zero_or_not_finite_is_refused_in_one_line(value, why):
    from loom import config as C

    cfg = C.LoomConfig()
    cfg.run.straggler_pct = value
    with pytest.raises(C.ConfigError) as e:
        C.validate(cfg, 1)
    assert str(e.value) == f"run.straggler_pct: {why}, got {value}"
