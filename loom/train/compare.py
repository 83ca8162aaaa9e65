"""``loom compare RUN_A RUN_B [--tol T] [--plot OUT.png]``: two runs' ``metrics.jsonl`` step by step.

For each step both runs logged: the loss and the gradient norm of each run and their absolute
difference; then the first step where either differs by more than ``--tol`` (default 0: any
difference, so a determinism check is bitwise). Exit status 0 when the common steps agree, 1 when
they differ, 2 with one line for a bad input (a missing or malformed file, no common step).
``--plot`` draws both runs' curves and marks the first differing step. A run is given as its
``run.dir`` or as the ``metrics.jsonl`` file itself.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from loom.config import ConfigError, _coerce, check_picture_path, read_text_file

FIELDS = ("loss", "grad_norm")

Rows = dict[int, dict]


def metrics_path(run: str) -> Path:
    p = Path(run).expanduser()
    return p if p.is_file() or p.suffix == ".jsonl" else p / "metrics.jsonl"


def read_rows(run: str) -> Rows:
    """``step -> row`` of a run's metrics (a later row of the same step wins, as after a resume)."""
    path = metrics_path(run)
    try:
        text = read_text_file(path, f"compare: {path}")
    except OSError as e:
        raise ConfigError(f"compare: {path}: {e.strerror or e}") from None
    rows: Rows = {}
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if i == len(lines) and not text.endswith("\n"):  # a row cut short: the run killed mid-write
                print(
                    f"compare: {path}:{i}: the last row is cut short (the run was killed while writing it); left out",
                    file=sys.stderr,
                )
                continue
            raise ConfigError(f"compare: {path}:{i}: not a JSON row of metrics") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ConfigError(f"compare: {path}:{i}: a metrics row needs an integer 'step'")
        for f in FIELDS:  # a number, or null / absent (a step that logged none); "5.7" is neither
            v = row.get(f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ConfigError(f"compare: {path}:{i}: {f} must be a number or null, got {v!r}")
        rows[row["step"]] = row
    return rows


def differs(a: float | None, b: float | None, tol: float) -> bool:
    """Beyond ``tol`` (absolute); both NaN (or both absent) count as the same."""
    if a is None or b is None:
        return (a is None) != (b is None)
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) != math.isnan(b)
    return abs(a - b) > tol


@dataclass
class Comparison:
    steps: list[int]  # common steps, ascending
    a: Rows
    b: Rows
    tol: float
    only_a: list[int]
    only_b: list[int]

    def value(self, rows: Rows, step: int, field: str) -> float | None:
        v = rows[step].get(field)
        return float(v) if isinstance(v, (int, float)) else None

    def differs_at(self, step: int) -> list[str]:
        """The fields that differ beyond the tolerance at ``step``."""
        return [
            f for f in FIELDS if differs(self.value(self.a, step, f), self.value(self.b, step, f), self.tol)
        ]

    @property
    def first_difference(self) -> int | None:
        return next((s for s in self.steps if self.differs_at(s)), None)

    def max_diff(self, field: str) -> float:
        """The largest |A - B| over the common steps: inf where one side lacks the value or has NaN
        and the other does not (:func:`differs`), never 0 beside a flagged step."""
        diffs = [
            math.inf if differs(x, y, math.inf) else abs(x - y) if x is not None and y is not None else 0.0
            for s in self.steps
            for x, y in [(self.value(self.a, s, field), self.value(self.b, s, field))]
        ]
        return max((d for d in diffs if not math.isnan(d)), default=0.0)


def compare(a: Rows, b: Rows, tol: float = 0.0) -> Comparison:
    common = sorted(a.keys() & b.keys())
    return Comparison(common, a, b, tol, sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys()))


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.8g}"


def table(c: Comparison) -> list[str]:
    """One line per common step; ``*`` marks a step that differs beyond the tolerance."""
    head = f"{'step':>7}"
    for f in FIELDS:
        head += f"  {f + ' A':>14} {f + ' B':>14} {'|diff|':>9}"
    lines = [head]
    for s in c.steps:
        line = f"{s:>7}"
        for f in FIELDS:
            x, y = c.value(c.a, s, f), c.value(c.b, s, f)
            d = "-" if x is None or y is None else f"{abs(x - y):.2e}" if x != y else "0"
            line += f"  {_num(x):>14} {_num(y):>14} {d:>9}"
        lines.append(line + (" *" if c.differs_at(s) else ""))
    return lines


def summary(c: Comparison, name_a: str, name_b: str) -> str:
    extra = "".join(
        f"; {len(only)} steps only in {name} ({only[0]}-{only[-1]})"
        for only, name in ((c.only_a, "A"), (c.only_b, "B"))
        if only
    )
    first = c.first_difference
    maxes = ", ".join(f"{f} {c.max_diff(f):.3g}" for f in FIELDS)
    if first is None:
        return f"same within --tol {c.tol:g} over {len(c.steps)} common steps (max |diff|: {maxes}){extra}"
    fields = " and ".join(c.differs_at(first))
    return (
        f"first difference beyond --tol {c.tol:g}: step {first} ({fields}); "
        f"{sum(1 for s in c.steps if c.differs_at(s))} of {len(c.steps)} common steps differ "
        f"(max |diff|: {maxes}){extra}"
    )


def plot(c: Comparison, out: str | Path, name_a: str, name_b: str) -> Path:
    """Both runs' loss and gradient norm over the common steps; a dashed line at the first difference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(FIELDS), 1, figsize=(8, 3 * len(FIELDS)), sharex=True)
    first = c.first_difference
    for ax, f in zip(axes, FIELDS, strict=True):
        for rows, name, style in ((c.a, name_a, "-"), (c.b, name_b, "--")):
            pts = [(s, v) for s in c.steps if (v := c.value(rows, s, f)) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name)
        if first is not None:
            ax.axvline(first, color="red", linestyle=":", label=f"first difference (step {first})")
        ax.set_ylabel(f)
        ax.legend(fontsize="small")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


USAGE = "loom compare RUN_A RUN_B [--tol T] [--plot OUT.png]"


def main(argv: list[str]) -> int:
    runs: list[str] = []
    opts: dict[str, str] = {}
    it = iter(argv)
    for a in it:
        if a.startswith("--"):
            key, eq, value = a[2:].partition("=")
            if key not in ("tol", "plot"):
                raise ConfigError(f"--{key}: unknown option; usage: {USAGE}")
            v = value if eq else next(it, None)
            if v is None:
                raise ConfigError(f"--{key}: missing value; usage: {USAGE}")
            opts[key] = v
        else:
            runs.append(a)
    if len(runs) != 2:
        raise ConfigError(f"compare: give two runs (run directories or metrics.jsonl files); usage: {USAGE}")
    tol = _coerce(opts.get("tol", "0"), float, "--tol")
    if "plot" in opts:  # before reading the runs: the picture is drawn last
        check_picture_path("--plot", opts["plot"])
    if not tol >= 0:
        raise ConfigError(f"--tol: must be a number >= 0, got {opts['tol']}")
    rows_a, rows_b = read_rows(runs[0]), read_rows(runs[1])
    c = compare(rows_a, rows_b, tol)
    if not c.steps:
        raise ConfigError(
            f"compare: {metrics_path(runs[0])} ({len(rows_a)} rows) and {metrics_path(runs[1])} "
            f"({len(rows_b)} rows) "
            "have no step in common"
        )
    print(f"A: {metrics_path(runs[0])}\nB: {metrics_path(runs[1])}")
    print("\n".join(table(c)))
    print(summary(c, "A", "B"))
    if "plot" in opts:
        print(f"wrote {plot(c, opts['plot'], runs[0], runs[1])}")
    return 0 if c.first_difference is None else 1
