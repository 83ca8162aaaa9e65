"""Draw a pipeline timeline (simulated or measured) as PNG or SVG, like the GPipe/PipeDream figures.

One row per rank, time on the x-axis; F/B/BI/BW/STEP boxes coloured by kind
with the micro-batch number inside, later virtual stages (interleaving) in a
lighter shade, idle time grey, and the measured bubble fraction in the title.
Uses matplotlib's object API with the Agg canvas, so no global backend is set.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from loom.parallel.pipeline.schedules import Kind
from loom.parallel.pipeline.simulate import Timeline

__all__ = ["COLORS", "draw_timeline"]

COLORS: dict[Kind, str] = {
    Kind.F: "#3b75af",  # forward: blue
    Kind.B: "#519e3e",  # full backward: green
    Kind.BI: "#2aa198",  # input-gradient backward: teal
    Kind.BW: "#8e6bb8",  # weight-gradient backward: purple
    Kind.STEP: "#303030",  # optimizer step: near black
}
IDLE = "#e6e6e6"
LABELS = {
    Kind.F: "forward",
    Kind.B: "backward",
    Kind.BI: "backward (input grad)",
    Kind.BW: "backward (weight grad)",
    Kind.STEP: "optimizer step",
}


def _shade(color: str, chunk: int) -> tuple[float, float, float]:
    """Lighter colour for later model chunks: chunk 0 full colour, chunk 1 mixed 45% with white, ..."""
    mix = min(0.45 * chunk, 0.7)
    r, g, b = to_rgb(color)
    return r + (1.0 - r) * mix, g + (1.0 - g) * mix, b + (1.0 - b) * mix


def draw_timeline(timeline: Timeline, path: str | Path, title: str = "pipeline schedule") -> Path:
    """Write the timeline picture to path (.png or .svg); returns the path."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise ValueError(f"timeline picture must be .png or .svg, got {path.name!r}")
    events = [e for e in timeline.events if e.action.kind in COLORS]
    if not events:
        raise ValueError("timeline has no compute events to draw")
    t0 = min(e.start for e in timeline.events)
    span = timeline.makespan or 1.0
    n_ranks = timeline.n_ranks
    longest = max(sum(1 for e in events if e.rank == r) for r in range(n_ranks))
    width = min(max(8.0, 0.28 * longest), 40.0)

    fig = Figure(figsize=(width, 1.0 + 0.55 * n_ranks), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for r in range(n_ranks):  # idle background, covered by the action boxes
        ax.broken_barh([(0.0, span)], (r - 0.4, 0.8), facecolors=IDLE, edgecolor="none")
    min_text = span / (width * 9.0)  # a box narrower than ~1/9 inch gets no label
    for e in events:
        a = e.action
        start, dur = e.start - t0, e.end - e.start
        if a.kind is Kind.STEP:  # drawn on top: a zero-time step is a bar between two boxes
            if dur > span / 300:
                ax.broken_barh([(start, dur)], (e.rank - 0.4, 0.8), facecolors=COLORS[Kind.STEP], zorder=3)
            else:
                ax.plot(
                    [start, start],
                    [e.rank - 0.45, e.rank + 0.45],
                    color=COLORS[Kind.STEP],
                    linewidth=2.5,
                    solid_capstyle="butt",
                    zorder=3,
                )
            continue
        if a.stage is None:
            raise ValueError(f"rank {e.rank}: {a} is a compute action without a stage")
        chunk = a.stage // n_ranks
        color = _shade(COLORS[a.kind], chunk)
        ax.broken_barh(
            [(start, dur)], (e.rank - 0.4, 0.8), facecolors=color, edgecolor="white", linewidth=0.6
        )
        if dur >= min_text:
            dark = sum(color) < 1.8
            ax.text(
                start + dur / 2,
                e.rank,
                str(a.microbatch),
                ha="center",
                va="center",
                fontsize=7,
                color="white" if dark else "black",
            )

    ax.set_xlim(0, span * 1.005)
    ax.set_ylim(n_ranks - 0.5, -0.5)  # rank 0 on top, as in the papers
    ax.set_yticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)])
    ax.set_xlabel("time")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    kinds = [k for k in COLORS if any(e.action.kind is k for e in events)]
    handles = [Patch(facecolor=COLORS[k], label=LABELS[k]) for k in kinds]
    chunks = {e.action.stage // n_ranks for e in events if e.action.stage is not None}
    if len(chunks) > 1:
        handles.append(Patch(facecolor=_shade(COLORS[Kind.F], 1), label="later model chunk (lighter)"))
    handles.append(Patch(facecolor=IDLE, label="idle"))
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.25 - 0.05 * (n_ranks < 3)),
        ncol=len(handles),
        frameon=False,
        fontsize=8,
    )
    ax.set_title(f"{title} — bubble {timeline.bubble:.1%}, makespan {timeline.makespan:.4g}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    return path
