"""The measured pipeline timeline beside the formula and the simulation, and its picture."""

from __future__ import annotations

from pathlib import Path

from loom.parallel.pipeline.runtime import bubble_formula, step_schedule
from loom.parallel.pipeline.schedules import Kind
from loom.parallel.pipeline.simulate import Timeline
from loom.rules import ASYNC_SCHEDULES


def timeline_report(
    timeline: Timeline, schedule: str, m: int, v: int = 1, path: str | Path | None = None
) -> str:
    """Measured bubble (rank-time waiting on peers, :attr:`Timeline.waiting_bubble`) beside the formula
    and beside the simulation of the same lists with the measured mean time of every (stage, kind),
    which accounts for unequal stages and t_b != 2 t_f; then the runtime's own time between
    actions (posting sends and receives, bookkeeping), which the formula does not count; draws
    the picture at ``path`` if given.

    Synchronous schedules: the bubble of the F/B/BI/BW phase (the final STEP left out, as in the
    formula); asynchronous ones: of the whole list, STEPs counted as busy.
    """
    p = timeline.n_ranks
    compute = Timeline(p, [e for e in timeline.events if e.action.kind is not Kind.STEP])
    judged = timeline if schedule in ASYNC_SCHEDULES else compute
    measured = judged.waiting_bubble
    text = (
        f"pipeline {schedule} p={p} m={m} v={v}: measured bubble {measured:.1%} vs formula "
        f"{bubble_formula(schedule, p, m, v):.1%} (simulated with measured stage times "
        f"{_simulated_bubble(compute, schedule, m, v):.1%}), runtime overhead between actions "
        f"{judged.bubble - measured:.1%}, makespan {1e3 * compute.makespan:.1f} ms"
    )
    if path is not None:
        from loom.parallel.pipeline.picture import draw_timeline

        draw_timeline(timeline, path, title=f"{schedule} p={p} m={m} v={v} (measured)")
        text += f"; timeline {path}"
    return text


def _simulated_bubble(timeline: Timeline, schedule: str, m: int, v: int) -> float:
    """Bubble of the simulator run on the same lists with each stage's mean measured F, B (= BI + BW), BW times."""
    from loom.parallel.pipeline.simulate import simulate

    spans: dict[tuple[Kind, int], list[float]] = {}
    for e in timeline.events:
        if e.action.kind in (Kind.F, Kind.B, Kind.BI, Kind.BW) and e.action.stage is not None:
            spans.setdefault((e.action.kind, e.action.stage), []).append(e.end - e.start)
    n = timeline.n_ranks * v

    def mean(kind: Kind, s: int) -> float:
        xs = spans.get((kind, s), [])
        return sum(xs) / len(xs) if xs else 0.0

    t_f = [mean(Kind.F, s) for s in range(n)]
    t_w = [mean(Kind.BW, s) for s in range(n)]
    t_b = [mean(Kind.B, s) or mean(Kind.BI, s) + t_w[s] for s in range(n)]
    sim = simulate(step_schedule(schedule, timeline.n_ranks, m, v), t_f, t_b, t_w)
    if schedule in ASYNC_SCHEDULES:
        return sim.bubble
    return Timeline(sim.n_ranks, [e for e in sim.events if e.action.kind is not Kind.STEP]).bubble
