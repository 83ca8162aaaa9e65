"""Picture of ``loom plan validate``: predicted vs measured step time and state bytes per layout.

matplotlib's object API with the Agg canvas (no global backend), like ``loom.parallel.pipeline.picture``.
"""

from __future__ import annotations

from pathlib import Path

from loom.plan.comparison import MEMORY_TOLERANCE, TIME_TOLERANCE, Comparison


def draw_validation(rows: list[Comparison], out: str | Path) -> Path:
    """Two panels of paired bars (predicted, measured): step time (ms) and rank-0 state (KiB)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.0, 0.9 * len(rows) + 2), 6.5))
    FigureCanvasAgg(fig)
    x = list(range(len(rows)))
    names = [r.name for r in rows]
    panels = (
        (
            "step time (ms)",
            [1e3 * r.pred_step_s for r in rows],
            [1e3 * r.meas_step_s for r in rows],
            [r.time_error for r in rows],
            TIME_TOLERANCE,
        ),
        (
            "rank-0 model state (KiB)",
            [r.pred_state_bytes / 1024 for r in rows],
            [r.meas_state_bytes / 1024 for r in rows],
            [r.memory_error for r in rows],
            MEMORY_TOLERANCE,
        ),
    )
    for i, (label, pred, meas, errs, tol) in enumerate(panels):
        ax = fig.add_subplot(2, 1, i + 1)
        ax.bar([v - 0.2 for v in x], pred, width=0.4, label="predicted", color="#4878d0")
        ax.bar(
            [v + 0.2 for v in x],
            meas,
            width=0.4,
            label="measured (fastest step)" if i == 0 else "measured",
            color="#ee854a",
        )
        if i == 0 and any(r.meas_median_s for r in rows):  # the typical step: how noisy the machine is
            ax.scatter(
                [v + 0.2 for v in x],
                [1e3 * r.meas_median_s for r in rows],
                marker="_",
                s=120,
                color="black",
                label="measured median step",
                zorder=3,
            )
        for xi, top, err in zip(x, [max(a, b) for a, b in zip(pred, meas)], errs):
            ax.text(
                xi,
                top,
                f"{100 * err:+.0f}%",
                ha="center",
                va="bottom",
                fontsize=7,
                color="black" if abs(err) <= tol else "#c03d3e",
            )
        ax.set_ylabel(label)
        ax.set_xticks(x)
        ax.set_xticklabels(names if i else [""] * len(x), rotation=30, ha="right", fontsize=8)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("loom plan validate: predicted vs measured (error above each pair; red = out of tolerance)")
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)  # check_picture_path allowed a new one
    fig.savefig(path, dpi=110)
    return path


def draw_search(ranked: list, out: str | Path, top: int = 10) -> Path:
    """Left: memory breakdown bars of the ``top`` fastest layouts against the device capacity.
    Right: predicted tokens/s against peak memory for every fitting layout (the top ones marked)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not ranked:
        raise ValueError("no fitting layout to draw")
    best = ranked[:top]
    fig = Figure(figsize=(13, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1)
    kinds = list(dict.fromkeys(k for e in best for k in e.memory_breakdown))
    x = list(range(len(best)))
    bottom = [0.0] * len(best)
    for kind in kinds:
        vals = [e.memory_breakdown.get(kind, 0.0) / 2**30 for e in best]
        ax.bar(x, vals, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(best[0].capacity / 2**30, color="black", linestyle="--", linewidth=1, label="device memory")
    ax.set_xticks(x)
    ax.set_xticklabels([e.layout.short() for e in best], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("GiB per device (busiest stage)")
    ax.set_title(f"memory of the {len(best)} fastest layouts")
    ax.legend(fontsize=7)
    ax2 = fig.add_subplot(1, 2, 2)
    ax2.scatter(
        [e.memory / 2**30 for e in ranked],
        [e.tokens_per_s for e in ranked],
        s=8,
        alpha=0.4,
        color="#4878d0",
        label=f"all {len(ranked)} fitting layouts",
    )
    ax2.scatter(
        [e.memory / 2**30 for e in best],
        [e.tokens_per_s for e in best],
        s=30,
        color="#ee854a",
        label=f"top {len(best)}",
    )
    ax2.set_xlabel("peak GiB per device")
    ax2.set_ylabel("predicted tokens/s")
    ax2.set_title("throughput vs memory")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)  # check_picture_path allowed a new one
    fig.savefig(path, dpi=110)
    return path
