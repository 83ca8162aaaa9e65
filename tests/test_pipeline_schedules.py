"""Pipeline schedules as data: pairing, order, memory, bubble and weight versions, without processes."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest

from loom.parallel.pipeline.picture import draw_timeline
from loom.parallel.pipeline.schedules import (
    COMPUTE,
    SCHEDULES,
    Action,
    Kind,
    build_schedule,
    pipedream_2bw,
    pipedream_async,
    stashed_versions,
    weight_versions,
)
from loom.parallel.pipeline.simulate import Event, ScheduleError, Timeline, check, peak_in_flight, simulate

CASES = [
    (name, p, m, v)
    for name in SCHEDULES
    for p in (2, 4)
    for m in sorted({p, 2 * p, 8})
    for v in ((1, 2) if name == "interleaved" else (1,))
]
IDS = [f"{name}-p{p}-m{m}-v{v}" for name, p, m, v in CASES]


def _micro(name: str, m: int) -> int:
    """Micro-batches in the list: 2BW spans two batches of m by default."""
    return 2 * m if name == "2bw" else m


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES, ids=IDS)
def test_check_passes_and_lists_are_pure(name: str, p: int, m: int, v: int) -> None:
    schedule = build_schedule(name, p, m, v)
    check(schedule)
    assert schedule == build_schedule(name, p, m, v)
    assert len(schedule) == p


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES, ids=IDS)
def test_forward_precedes_backward_on_every_stage(name: str, p: int, m: int, v: int) -> None:
    schedule = build_schedule(name, p, m, v)
    for r, actions in enumerate(schedule):
        position = {(a.kind, a.microbatch, a.stage): i for i, a in enumerate(actions) if a.kind in COMPUTE}
        for s in range(r, p * v, p):
            for mb in range(_micro(name, m)):
                f = position[(Kind.F, mb, s)]
                if (Kind.B, mb, s) in position:
                    assert f < position[(Kind.B, mb, s)]
                else:
                    assert f < position[(Kind.BI, mb, s)] < position[(Kind.BW, mb, s)]


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES, ids=IDS)
def test_sends_and_recvs_pair_in_fifo_order(name: str, p: int, m: int, v: int) -> None:
    schedule = build_schedule(name, p, m, v)
    sends: dict[tuple[int, int], list[tuple[str, int, int]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[str, int, int]]] = defaultdict(list)
    for r, actions in enumerate(schedule):
        for a in actions:
            if a.kind is Kind.SEND_F:
                sends[(r, a.peer)].append(("F", a.microbatch, a.stage + 1))
            elif a.kind is Kind.SEND_B:
                sends[(r, a.peer)].append(("B", a.microbatch, a.stage - 1))
            elif a.kind is Kind.RECV_F:
                recvs[(a.peer, r)].append(("F", a.microbatch, a.stage))
            elif a.kind is Kind.RECV_B:
                recvs[(a.peer, r)].append(("B", a.microbatch, a.stage))
    assert sends == recvs  # same messages, same order, on every directed pair of ranks
    n_messages = sum(len(q) for q in sends.values())
    assert n_messages == 2 * _micro(name, m) * (p * v - 1)  # one activation + one gradient per boundary


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES, ids=IDS)
def test_stage_order_holds_across_ranks(name: str, p: int, m: int, v: int) -> None:
    timeline = simulate(build_schedule(name, p, m, v), t_f=1, t_b=2, t_comm=0.25)
    when = {(e.action.kind, e.action.microbatch, e.action.stage): e for e in timeline.events}
    for (kind, mb, s), e in when.items():
        if kind is Kind.F and s > 0:
            assert e.start >= when[(Kind.F, mb, s - 1)].end + 0.25
        if kind in (Kind.B, Kind.BI) and s < p * v - 1:
            upstream = when.get((Kind.B, mb, s + 1)) or when[(Kind.BI, mb, s + 1)]
            assert e.start >= upstream.end + 0.25


def _expected_peak(name: str, p: int, m: int, v: int) -> list[int]:
    if name == "gpipe":
        return [m] * p
    if name == "zb-h1":
        return [min(p, m)] * p
    if name == "interleaved" and v > 1:
        return [min(m * v, (v - 1) * p + 2 * (p - 1 - r) + 1) for r in range(p)]
    return [min(p - r, m) for r in range(p)]  # 1F1B, PipeDream, 2BW


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES, ids=IDS)
def test_peak_in_flight_equals_stated_value(name: str, p: int, m: int, v: int) -> None:
    schedule = build_schedule(name, p, m, v)
    expected = _expected_peak(name, p, m, v)
    assert peak_in_flight(schedule) == expected
    assert simulate(schedule, 1, 2).peak_in_flight == expected


def _expected_bubble(name: str, p: int, m: int, v: int) -> float:
    """Bubble fraction with t_f=1, t_b=2 per action (per chunk when interleaved), t_w = t_b/2."""
    return {
        "gpipe": (p - 1) / (m + p - 1),
        "1f1b": (p - 1) / (m + p - 1),
        "pipedream": (p - 1) / (m + p - 1),
        "2bw": (p - 1) / (2 * m + p - 1),
        "interleaved": (p - 1) / (v * m + p - 1),
        "zb-h1": (p - 1) / (3 * m + p - 1),
    }[name]


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES, ids=IDS)
def test_simulated_bubble_equals_formula(name: str, p: int, m: int, v: int) -> None:
    timeline = simulate(build_schedule(name, p, m, v), t_f=1, t_b=2)
    assert timeline.bubble == pytest.approx(_expected_bubble(name, p, m, v), rel=1e-12)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8)])
def test_interleaving_divides_bubble_time_by_v(p: int, m: int) -> None:
    """Idle time per rank is (p-1)(t_f+t_b) in chunk units, i.e. GPipe's bubble time / v per stage.

    As a fraction this is (p-1)/(v*m+p-1), which is within (v-1)(p-1)/(v*m+p-1)
    (relative) of the textbook GPipe fraction / v: here at most 30%.
    """
    v = 2
    flat = simulate(build_schedule("1f1b", p, m), t_f=1, t_b=2)
    chunked = simulate(build_schedule("interleaved", p, m, v), t_f=1 / v, t_b=2 / v)
    idle_flat = flat.makespan - flat.busy(0)
    idle_chunked = chunked.makespan - chunked.busy(0)
    assert idle_chunked == pytest.approx(idle_flat / v)
    textbook = (p - 1) / (m + p - 1) / v
    assert textbook <= chunked.bubble <= textbook * 1.3


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_zero_bubble_h1_beats_1f1b_at_same_memory(p: int, m: int) -> None:
    zb = simulate(build_schedule("zb-h1", p, m), t_f=1, t_b=2)
    base = simulate(build_schedule("1f1b", p, m), t_f=1, t_b=2)
    assert zb.bubble < base.bubble
    assert (zb.makespan - 3 * m) * 3 == pytest.approx(base.makespan - 3 * m)  # a third of 1F1B's bubble time
    assert max(zb.peak_in_flight) == max(base.peak_in_flight)


def test_gpipe_makespan_with_communication_latency() -> None:
    p, m, c = 4, 6, 0.5
    timeline = simulate(build_schedule("gpipe", p, m), t_f=1, t_b=2, t_comm=c)
    assert timeline.makespan == pytest.approx((m + p - 1) * 3 + 2 * (p - 1) * c)


def test_per_stage_costs_slow_stage_sets_the_pace() -> None:
    timeline = simulate(build_schedule("1f1b", 2, 8), t_f=[1, 2], t_b=[2, 4])
    assert timeline.makespan >= 8 * 6  # stage 1 alone needs 8 x (2 + 4)


# ---- weight versions of the asynchronous schedules ----


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 12)])
def test_pipedream_weight_stashing(p: int, m: int) -> None:
    schedule = pipedream_async(p, m)
    versions = weight_versions(schedule)
    for r in range(p):
        for mb in range(m):
            forward = versions[r][(Kind.F, mb, r)]
            assert forward == max(0, mb - (p - 1 - r))  # newest version when the forward runs
            assert versions[r][(Kind.B, mb, r)] == forward  # backward uses the stashed version
    stashed = stashed_versions(schedule)
    for r in range(p):
        if m >= 2 * (p - 1 - r) + 1:  # steady state reached on this rank
            assert stashed[r] == p - r
        else:
            assert stashed[r] <= p - r


def test_pipedream_backward_runs_while_newer_versions_exist() -> None:
    p, m = 4, 8
    stale = []
    for r, actions in enumerate(pipedream_async(p, m)):
        newest = 0
        for a in actions:
            if a.kind is Kind.STEP:
                newest = a.version
            elif a.kind is Kind.B and a.version < newest:
                stale.append((r, a.microbatch, a.version, newest))
    assert stale and all(r < p - 1 for r, *_ in stale)  # the last stage never lags


def test_pipedream_vertical_sync() -> None:
    p, m = 4, 12
    schedule = pipedream_async(p, m, vertical_sync=True)
    check(schedule)
    versions = weight_versions(schedule)
    for mb in range(m):
        for r in range(p):
            assert versions[r][(Kind.F, mb, r)] == versions[r][(Kind.B, mb, r)] == max(0, mb - (p - 1))
    assert stashed_versions(schedule) == [p] + [p - r + 1 for r in range(1, p)]


@pytest.mark.parametrize(("p", "m", "batches"), [(2, 2, 3), (4, 4, 3), (4, 8, 2)])
def test_2bw_two_versions_and_one_step_per_batch(p: int, m: int, batches: int) -> None:
    schedule = pipedream_2bw(p, m, batches)
    check(schedule)
    versions = weight_versions(schedule)
    for r in range(p):
        for mb in range(batches * m):
            assert versions[r][(Kind.F, mb, r)] == versions[r][(Kind.B, mb, r)] == max(0, mb // m - 1)
        steps = [a for a in schedule[r] if a.kind is Kind.STEP]
        assert [s.microbatch for s in steps] == [b * m + m - 1 for b in range(batches)]
    assert stashed_versions(schedule) == [2] * p


def test_synchronous_schedules_step_once_at_the_end() -> None:
    for name in ("gpipe", "1f1b", "zb-h1"):
        for actions in build_schedule(name, 4, 8):
            assert [a.kind for a in actions].count(Kind.STEP) == 1 and actions[-1].kind is Kind.STEP
    assert stashed_versions(build_schedule("1f1b", 4, 8)) == [1] * 4


# ---- bad inputs and broken schedules ----


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("bogus", 4, 8), r"unknown pipeline schedule 'bogus'; choose one of gpipe, 1f1b, interleaved"),
        (("interleaved", 4, 6, 2), r"divisible by pp: m=6, p=4"),
        (("1f1b", 4, 8, 2), r"v=2 > 1 need the 'interleaved' schedule"),
        (("2bw", 4, 3), r"m=3 < p=4"),
        (("gpipe", 0, 8), r"p must be >= 1"),
        (("zb-h1", 4, 0), r"m must be >= 1"),
        (("interleaved", 4, 8, 0), r"v must be >= 1"),
    ],
)
def test_bad_inputs_raise_one_line_errors(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        build_schedule(*args)
    assert "\n" not in str(info.value)


def _edit(schedule: list[list[Action]], rank: int, fn) -> list[list[Action]]:
    return [fn(list(actions)) if r == rank else list(actions) for r, actions in enumerate(schedule)]


def _move_first(kind: Kind):
    def fn(actions: list[Action]) -> list[Action]:
        i = next(i for i, a in enumerate(actions) if a.kind is kind)
        return [actions[i], *actions[:i], *actions[i + 1 :]]

    return fn


def _swap_first_two(kind: Kind):
    def fn(actions: list[Action]) -> list[Action]:
        i, j = [i for i, a in enumerate(actions) if a.kind is kind][:2]
        actions[i], actions[j] = actions[j], actions[i]
        return actions

    return fn


def _drop_first(kind: Kind):
    def fn(actions: list[Action]) -> list[Action]:
        i = next(i for i, a in enumerate(actions) if a.kind is kind)
        return actions[:i] + actions[i + 1 :]

    return fn


@pytest.mark.parametrize(
    ("name", "rank", "edit", "message"),
    [
        (
            "1f1b",
            0,
            _move_first(Kind.RECV_B),
            r"deadlock: rank 0 waits in RECV_B0@s0<->r1; rank 1 waits in RECV_F0",
        ),
        ("gpipe", 1, _swap_first_two(Kind.RECV_F), r"not in the same order"),
        (
            "gpipe",
            1,
            _drop_first(Kind.RECV_F),
            r"activation of micro-batch 0 for stage 1 has not been received",
        ),
        ("gpipe", 0, _drop_first(Kind.SEND_F), r"next message from rank 0 is SEND_F1@s0<->r1"),
        ("gpipe", 1, _move_first(Kind.B), r"backward before the forward of micro-batch 0 on stage 1"),
        (
            "zb-h1",
            1,
            _drop_first(Kind.BW),
            r"micro-batch 0 on stage 1: need one F and one B \(or one BI and one BW\)",
        ),
        ("zb-h1", 0, _move_first(Kind.BW), r"backward before the forward"),
        ("gpipe", 0, _move_first(Kind.STEP), r"compute after STEP in a synchronous schedule"),
    ],
)
def test_check_reports_broken_schedules(name: str, rank: int, edit, message: str) -> None:
    schedule = _edit(build_schedule(name, 2, 2), rank, edit)
    with pytest.raises(ScheduleError, match=message) as info:
        check(schedule)
    assert "\n" not in str(info.value)


def test_check_rejects_wrong_rank_and_wrong_peer() -> None:
    schedule = build_schedule("1f1b", 2, 2)
    moved = [list(schedule[0]) + [Action(Kind.F, 5, 1)], list(schedule[1])]
    with pytest.raises(ScheduleError, match=r"stage 1 lives on rank 1"):
        check(moved)
    bad_peer = [list(schedule[0]), [dataclasses.replace(schedule[1][0], peer=1), *schedule[1][1:]]]
    with pytest.raises(ScheduleError, match=r"peer must be rank 0"):
        check(bad_peer)


def test_check_rejects_broken_weight_stash() -> None:
    schedule = pipedream_async(4, 8)
    i, b = next((i, a) for i, a in enumerate(schedule[0]) if a.kind is Kind.B and a.version == 0)
    schedule[0][i] = dataclasses.replace(b, version=None)
    with pytest.raises(ScheduleError, match=r"weight stashing violated"):
        check(schedule)


def test_action_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Action(Kind.F, 0, 0).microbatch = 1  # type: ignore[misc]


def test_single_rank_needs_no_communication() -> None:
    schedule = build_schedule("1f1b", 1, 4)
    check(schedule)
    assert all(a.kind in COMPUTE | {Kind.STEP} for a in schedule[0])
    assert simulate(schedule, 1, 2).bubble == 0.0


# ---- timeline pictures ----


def test_draw_timeline_png_and_svg(tmp_path) -> None:
    timeline = simulate(build_schedule("interleaved", 4, 8, 2), t_f=1, t_b=2)
    png = draw_timeline(timeline, tmp_path / "interleaved.png", "interleaved")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    svg = draw_timeline(simulate(build_schedule("zb-h1", 2, 4), 1, 2), tmp_path / "zb.svg", "zb-h1")
    text = svg.read_text()
    assert text.startswith("<?xml") and "<svg" in text and "bubble" in text


def test_draw_measured_timeline_in_seconds(tmp_path) -> None:
    """The runtime hands over the same Timeline type with wall-clock seconds."""
    events = [
        Event(0, Action(Kind.F, 0, 0), 100.00, 100.02),
        Event(0, Action(Kind.SEND_F, 0, 0, peer=1), 100.02, 100.021),
        Event(1, Action(Kind.RECV_F, 0, 1, peer=0), 100.00, 100.025),
        Event(1, Action(Kind.F, 0, 1), 100.025, 100.045),
        Event(1, Action(Kind.B, 0, 1), 100.045, 100.085),
        Event(0, Action(Kind.B, 0, 0), 100.09, 100.13),
        Event(0, Action(Kind.STEP, None, None), 100.13, 100.14),
        Event(1, Action(Kind.STEP, None, None), 100.085, 100.09),
    ]
    timeline = Timeline(2, events)
    assert timeline.makespan == pytest.approx(0.14)
    busy = 0.02 + 0.04 + 0.01 + 0.02 + 0.04 + 0.005
    assert timeline.bubble == pytest.approx(1 - busy / (2 * 0.14))
    out = draw_timeline(timeline, tmp_path / "measured.png", "measured")
    assert out.stat().st_size > 5_000
    with pytest.raises(ValueError, match=r"must be \.png or \.svg"):
        draw_timeline(timeline, tmp_path / "measured.jpg")
