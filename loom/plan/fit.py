"""``loom plan validate --published --fit``: refit the planner's few fitted constants on the
published runs, and score them on sources left out.

The constants (everything else is a datasheet or a paper's number): the sustained share of peak
of a large GEMM per device and dtype (:attr:`DeviceSpec.achievable`, ``achievable_8bit`` for
fp8/int8), and one memory-bound factor (:attr:`Stack.other`) per software stack that two or more
independent sources use; a stack with one source runs at Loom's factor, or at the factor of the stack
whose kernels it runs (:attr:`Stack.other_of`: its rows are predicted with it, not fitted to). ``GEMM_K0`` (the tile's
prologue and epilogue) stays fixed. The objective is ``mean |error| + max |error| / 2``; the search
is coordinate descent, each constant in turn over a shrinking multiplicative grid (no external
optimizer). Leave-one-source-out (:func:`leave_one_source_out`): refit without one source's rows
(``PublishedRun.group``) from neutral starts, predict them; a constant no remaining row informs
falls back: a device's bf16 GEMM share to its own 8-bit share (the same silicon), else to the
mean of the other devices', its 8-bit share to its bf16 share,
a stack's factor to Loom's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from loom.plan import cost
from loom.plan.cost.stacks import memory_bound_stack
from loom.plan.hardware import datasheets as hw  # GEMM_K0 patched where Machine.gemm reads it
from loom.plan.published import PublishedRun

Params = dict[str, float]  # "achievable:<device>", "achievable8:<device>", "k0", "other:<stack>"
NEUTRAL = {"achievable": 0.7, "achievable8": 0.7, "other": 1.5}  # LOSO starting points
EIGHT_BIT = ("fp8", "int8")


@contextmanager
def constants(params: Params) -> Iterator[None]:
    """Set the constants for the duration of the block (module tables patched, then restored)."""
    devices, stacks, k0 = dict(hw.DEVICES), dict(cost.STACKS), hw.GEMM_K0
    try:
        for key, value in params.items():
            kind, _, name = key.partition(":")
            if kind == "achievable":
                hw.DEVICES[name] = dataclasses.replace(hw.DEVICES[name], achievable=value)
            elif kind == "achievable8":
                hw.DEVICES[name] = dataclasses.replace(hw.DEVICES[name], achievable_8bit=value)
            elif kind == "other":
                cost.STACKS[name] = dataclasses.replace(cost.STACKS[name], other=value)
            else:
                hw.GEMM_K0 = value
        yield
    finally:
        hw.DEVICES.clear()
        hw.DEVICES.update(devices)
        cost.STACKS.clear()
        cost.STACKS.update(stacks)
        hw.GEMM_K0 = k0


def _keys(r: PublishedRun) -> tuple[str, ...]:
    """The constants a run's prediction reads."""
    dev = r.cluster.device.name
    share = f"achievable8:{dev}" if r.workload.precision in EIGHT_BIT else f"achievable:{dev}"
    return (share, "k0", f"other:{memory_bound_stack(r.stack)}")


def errors(runs: list[PublishedRun], params: Params, memo: dict | None = None) -> list[float]:
    """(predicted - published) / published tokens/s per GPU of each run under ``params``; ``memo``
    keeps each run's error by the constants it reads (a coordinate step recomputes only its rows)."""
    memo = {} if memo is None else memo
    keys = [(id(r), tuple(params.get(k) for k in _keys(r))) for r in runs]
    todo = [r for r, k in zip(runs, keys) if k not in memo]
    if todo:
        with constants(params):
            for r in todo:
                cl = dataclasses.replace(r.cluster, device=hw.DEVICES[r.cluster.device.name])
                e = cost.CostModel(r.model, r.workload, cl, stack=r.stack).estimate(r.layout)
                memo[(id(r), tuple(params.get(k) for k in _keys(r)))] = (
                    e.tokens_per_s / r.gpus / r.tokens_per_s_per_gpu - 1
                )
    return [memo[k] for k in keys]


def objective(errs: list[float]) -> float:
    a = [abs(e) for e in errs]
    return sum(a) / len(a) + max(a) / 2


def informing(runs: list[PublishedRun]) -> list[PublishedRun]:
    """The rows the constants are fitted on: a row whose stack borrows another's memory-bound factor
    (:attr:`Stack.other_of`) is predicted with the fitted constants, never fitted to."""
    return [r for r in runs if not cost.STACKS[r.stack].other_of]


def stacks_with_sources(runs: list[PublishedRun], least: int = 2) -> set[str]:
    """Stacks that ``least`` or more independent sources (groups) use: those get a factor of their own."""
    groups: dict[str, set[str]] = {}
    for r in informing(runs):
        groups.setdefault(r.stack, set()).add(r.group)
    return {s for s, g in groups.items() if len(g) >= least and s}


def current(runs: list[PublishedRun]) -> Params:
    """The free constants as they stand, for the devices, dtypes and stacks ``runs`` inform."""
    runs = informing(runs)
    wide = {r.cluster.device.name for r in runs if r.workload.precision not in EIGHT_BIT}
    p: Params = {f"achievable:{d}": hw.DEVICES[d].achievable for d in sorted(wide)}
    for d in sorted({r.cluster.device.name for r in runs if r.workload.precision in EIGHT_BIT}):
        p[f"achievable8:{d}"] = hw.DEVICES[d].gemm_share("fp8")
    p.update({f"other:{s}": cost.STACKS[s].other for s in sorted(stacks_with_sources(runs))})
    return p


def fit(
    runs: list[PublishedRun],
    start: Params,
    sweeps: int = 2,
    fixed: tuple[str, ...] = (),
    score: Callable[[list[float]], float] = objective,
) -> Params:
    """Coordinate descent from ``start``: each free constant tried at x (1 + d) and x / (1 + d)
    for d = 0.2, 0.1, 0.05, 0.02 (and again while it improves), the best kept."""
    memo: dict = {}
    runs = informing(runs)
    best, best_score = dict(start), score(errors(runs, start, memo))
    for _ in range(sweeps):
        for key in [k for k in best if k not in fixed]:
            for d in (0.2, 0.1, 0.05, 0.02):
                improved = True
                while improved:
                    improved = False
                    for value in (best[key] * (1 + d), best[key] / (1 + d)):
                        if key.startswith("achievable") and value > 1:
                            continue
                        trial = dict(best, **{key: value})
                        s = score(errors(runs, trial, memo))
                        if s < best_score - 1e-6:
                            best, best_score, improved = trial, s, True
    return best


def neutral(params: Params) -> Params:
    return {k: NEUTRAL.get(k.partition(":")[0], v) for k, v in params.items()}


def fallback(params: Params, needed: Params) -> Params:
    """``params`` completed for constants none of the fitted rows informed (module doc)."""
    out = dict(params)
    shares = [v for k, v in params.items() if k.startswith("achievable:")]
    for key in needed:
        if key in out:
            continue
        kind, _, name = key.partition(":")
        if kind == "achievable":  # the same chip's 8-bit share, else the other devices' mean
            eight = params.get(f"achievable8:{name}")
            out[key] = (
                eight if eight else sum(shares) / len(shares) if shares else hw.DEVICES[name].achievable
            )
        elif kind == "achievable8":
            out[key] = out.get(f"achievable:{name}", hw.DEVICES[name].achievable)
        elif kind == "other":
            out[key] = cost.STACKS[""].other
    return out


def leave_one_source_out(runs: list[PublishedRun], sweeps: int = 2) -> list[tuple[PublishedRun, float]]:
    """Each source's runs predicted with constants fitted on the other sources only, from neutral starts."""
    out = []
    for group in sorted({r.group for r in runs}):
        held, rest = [r for r in runs if r.group == group], [r for r in runs if r.group != group]
        params = fit(rest, neutral(current(rest)), sweeps)
        needed = {k: 0.0 for r in held for k in _keys(r) if k != "k0"}
        params = fallback(params, needed)
        for s in {memory_bound_stack(r.stack) for r in held} - stacks_with_sources(rest):  # Loom's factor
            params[f"other:{s}"] = cost.STACKS[""].other
        out += list(zip(held, errors(held, params)))
    return out


def per_source(rows: list[tuple[PublishedRun, float]]) -> dict[str, tuple[int, float, float]]:
    """{group: (runs, mean |error|, max |error|)}."""
    out: dict[str, list[float]] = {}
    for r, e in rows:
        out.setdefault(r.group, []).append(abs(e))
    return {g: (len(v), sum(v) / len(v), max(v)) for g, v in sorted(out.items())}
