"""Cut a sequence of layers into contiguous pipeline stages.

A layout is a list of ``n_stages + 1`` boundaries ``[0, b1, ..., n_layers]``:
stage k holds layers ``bounds[k] : bounds[k+1]``. Costs are per layer, with the
embedding and the output head/loss as the first and last entries.

:func:`partition` is PipeDream's planner reduced to one dimension: dynamic
programming over ``best[k][i]`` = the smallest possible slowest-stage cost when
the first i layers form k stages,
``best[k][i] = min_j max(best[k-1][j], sum(costs[j:i]))`` over cuts j whose last
stage fits ``mem_limit``; O(n_stages * n_layers^2).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from loom.rules import parse_layout  # the manual-layout parser is a config rule (ground layer)

__all__ = ["brute_force", "parse_layout", "partition", "stage_sums"]


def stage_sums(values: Sequence[float], bounds: Sequence[int]) -> list[float]:
    """Per-stage sums of a per-layer quantity (time, bytes) for a layout."""
    return [float(sum(values[a:b])) for a, b in itertools.pairwise(bounds)]


def _validate(
    costs: Sequence[float], n_stages: int, mem: Sequence[float] | None, mem_limit: float | None
) -> None:
    if n_stages < 1:
        raise ValueError(f"need at least one pipeline stage, got {n_stages}")
    if n_stages > len(costs):
        raise ValueError(
            f"{n_stages} pipeline stages but only {len(costs)} layers (embedding and head included)"
        )
    if any(c < 0 for c in costs):
        raise ValueError("layer costs must be non-negative")
    if (mem is None) != (mem_limit is None):
        raise ValueError("give both mem (per-layer bytes) and mem_limit (per-stage bytes), or neither")
    if mem is not None and len(mem) != len(costs):
        raise ValueError(f"mem has {len(mem)} entries but costs has {len(costs)}")


def _infeasible(n_layers: int, n_stages: int, mem: Sequence[float], mem_limit: float) -> ValueError:
    big = max(range(n_layers), key=lambda i: mem[i])
    if mem[big] > mem_limit:
        return ValueError(f"layer {big} alone needs {mem[big]:g} bytes > mem_limit {mem_limit:g}")
    need = max(stage_sums(mem, partition(mem, n_stages)))
    return ValueError(
        f"{n_layers} layers do not fit in {n_stages} stages under mem_limit {mem_limit:g}: "
        f"the best cut needs {need:g} bytes per stage"
    )


def partition(
    costs: Sequence[float],
    n_stages: int,
    mem: Sequence[float] | None = None,
    mem_limit: float | None = None,
) -> list[int]:
    """Boundaries of the contiguous, non-empty cut minimizing the slowest stage (memory-feasible)."""
    _validate(costs, n_stages, mem, mem_limit)
    n = len(costs)
    cost_prefix = [0.0, *itertools.accumulate(float(c) for c in costs)]
    mem_prefix = [0.0, *itertools.accumulate(float(x) for x in mem)] if mem is not None else None

    def fits(j: int, i: int) -> bool:
        return mem_prefix is None or mem_limit is None or mem_prefix[i] - mem_prefix[j] <= mem_limit

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):  # leave at least one layer per remaining stage
            for j in range(k - 1, i):
                if best[k - 1][j] == inf or not fits(j, i):
                    continue
                value = max(best[k - 1][j], cost_prefix[i] - cost_prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    if best[n_stages][n] == inf:
        if mem is None or mem_limit is None:  # without a memory limit every cut fits
            raise RuntimeError(f"partition: no cut of {n} layers into {n_stages} stages found")
        raise _infeasible(n, n_stages, mem, mem_limit)
    bounds = [n]
    for k in range(n_stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def brute_force(
    costs: Sequence[float],
    n_stages: int,
    mem: Sequence[float] | None = None,
    mem_limit: float | None = None,
) -> list[int] | None:
    """Try every contiguous cut (for tests); the best feasible boundaries, or None."""
    _validate(costs, n_stages, mem, mem_limit)
    n, best, best_bounds = len(costs), float("inf"), None
    for inner in itertools.combinations(range(1, n), n_stages - 1):
        bounds = [0, *inner, n]
        if mem is not None and mem_limit is not None and max(stage_sums(mem, bounds)) > mem_limit:
            continue
        slowest = max(stage_sums(costs, bounds))
        if slowest < best:
            best, best_bounds = slowest, bounds
    return best_bounds
