"""``loom plan validate --published --fit``: refit the planner's few fitted constants on the
published runs, and check them on runs left out.

The constants (everything else is a datasheet or a paper's number): the sustained GEMM share of
peak per device (:attr:`DeviceSpec.achievable`), the per-tile fixed cost ``GEMM_K0`` and one
memory-bound factor per software stack (:attr:`Stack.other`). The objective is
``mean |error| + max |error| / 2`` over the runs; the search is coordinate descent, each
constant in turn over a shrinking multiplicative grid (no external optimizer). Leave-one-out by
file: refit without one source's rows, predict them, so the error printed for a row comes from
constants that never saw it (its stack's factor falls back to Loom's when no other row has it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from loom.plan import cost
from loom.plan.hardware import datasheets as hw  # GEMM_K0 patched where Machine.gemm reads it
from loom.plan.published import PublishedRun

Params = dict[str, float]  # "achievable:<device>", "k0", "other:<stack>"


@contextmanager
def constants(params: Params) -> Iterator[None]:
    """Set the constants for the duration of the block (module tables patched, then restored)."""
    devices, stacks, k0 = dict(hw.DEVICES), dict(cost.STACKS), hw.GEMM_K0
    try:
        for key, value in params.items():
            kind, _, name = key.partition(":")
            if kind == "achievable":
                hw.DEVICES[name] = dataclasses.replace(hw.DEVICES[name], achievable=value)
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


def errors(runs: list[PublishedRun], params: Params) -> list[float]:
    """(predicted - published) / published tokens/s per GPU of each run under ``params``."""
    out = []
    with constants(params):
        for r in runs:
            cl = dataclasses.replace(r.cluster, device=hw.DEVICES[r.cluster.device.name])
            e = cost.CostModel(r.model, r.workload, cl, stack=r.stack).estimate(r.layout)
            out.append(e.tokens_per_s / r.gpus / r.tokens_per_s_per_gpu - 1)
    return out


def objective(errs: list[float]) -> float:
    a = [abs(e) for e in errs]
    return sum(a) / len(a) + max(a) / 2


def current(runs: list[PublishedRun]) -> Params:
    """The constants as they stand, for the devices and stacks ``runs`` use."""
    p: Params = {
        f"achievable:{d}": hw.DEVICES[d].achievable for d in sorted({r.cluster.device.name for r in runs})
    }
    p["k0"] = float(hw.GEMM_K0)
    p.update({f"other:{s}": cost.STACKS[s].other for s in sorted({r.stack for r in runs})})
    return p


def fit(
    runs: list[PublishedRun],
    start: Params,
    sweeps: int = 3,
    fixed: tuple[str, ...] = (),
    score: Callable[[list[float]], float] = objective,
) -> Params:
    """Coordinate descent from ``start``: each free constant tried at x (1 + d) and x / (1 + d)
    for d = 0.2, 0.1, 0.05 (and again while it improves), the best kept."""
    best, best_score = dict(start), score(errors(runs, start))
    for _ in range(sweeps):
        for key in [k for k in best if k not in fixed]:
            for d in (0.2, 0.1, 0.05):
                improved = True
                while improved:
                    improved = False
                    for value in (best[key] * (1 + d), best[key] / (1 + d)):
                        if key.startswith("achievable") and value > 1:
                            continue
                        trial = dict(best, **{key: value})
                        s = score(errors(runs, trial))
                        if s < best_score - 1e-6:
                            best, best_score, improved = trial, s, True
    return best


def leave_one_file_out(
    runs: list[PublishedRun], start: Params, sweeps: int = 1
) -> list[tuple[PublishedRun, float]]:
    """Each file's runs predicted with constants fitted on the other files only."""
    out = []
    for name in sorted({r.file for r in runs}):
        held, rest = [r for r in runs if r.file == name], [r for r in runs if r.file != name]
        seen = {k for k in start if not k.startswith("other:")} | {f"other:{r.stack}" for r in rest}
        params = fit(rest, {k: v for k, v in start.items() if k in seen}, sweeps)
        for s in {r.stack for r in held} - {r.stack for r in rest}:  # an unseen stack: Loom's factor
            params[f"other:{s}"] = cost.STACKS[""].other
        out += list(zip(held, errors(held, params)))
    return out
