"""Scheduling policies: (jobs, cluster, time) -> allocation {job: Placement(device type, count, batch, lr)}.

A policy is any object with ``name`` and ``allocate(jobs, cluster, now) -> dict[str, Placement]``
(:class:`Policy`); a job runs on one device type at a time. The simulator (and a real driver) calls it
at every arrival, completion and round boundary and applies the returned placements.

- ``fifo``: arrival order, non-preemptive, no backfilling; each job gets its requested devices on the
  type with most free devices (heterogeneity-agnostic).
- ``las``: Tiresias-like least attained service (device-seconds), preemptive, with backfilling;
  same agnostic placement.
- ``gavel-*`` (Narayanan et al., OSDI 2020): a linear program over the allocation matrix X[m, t], the
  share of time job m runs on type t with its requested s_m devices, under sum_t X[m,t] <= 1 and
  sum_m s_m X[m,t] <= N_t. Effective throughput T_m(X) = sum_t tput[m,t] X[m,t].

  - ``gavel-maxmin``: max_X min_m T_m(X) / T_m(X_eq), X_eq the equal time share on every type;
  - ``gavel-las``: the same, weighted by attained service: min_m T_m(X) / (w_m T_m(X_eq)) with
    w_m = 1 + attained_m / mean(attained) (least attained service gets most; weights refreshed with X);
  - ``gavel-makespan``: max_X min_m T_m(X) / R_m (R_m remaining work): every job done by 1/z;
  - ``gavel-ftf``: min_X max_m rho_m, rho_m = (age_m + R_m / T_m(X)) / (age_m + R_m / T_m(X_eq)),
    by bisection on rho over the feasibility LP T_m(X) >= R_m / (rho (age_m + R_m / T_m(X_eq)) - age_m).

  Each solves with HiGHS (``scipy.optimize.linprog``), then a second LP keeps the optimum and
  maximises total normalised throughput (no capacity left idle). X is recomputed when the set of
  jobs changes; Gavel's rounds realise it: each call ranks (m, t) by X[m,t] / (share of m's time
  received on t so far) and places jobs greedily in that order.
- ``pollux`` (Qiao et al., OSDI 2021): jobs admitted in least-attained-service order on the fewest
  devices they run on (of the type with most goodput per device), then devices doubled for the job whose goodput (throughput x statistical efficiency, at its
  best batch) gains most per added device, while devices are free and the gain exceeds 5%. The
  batch maximises goodput on the allocation; the learning rate follows AdaScale's gain.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from scipy.optimize import linprog

from loom.cluster.formats import Cluster
from loom.cluster.jobs import ClusterError, Job, goodput, scaled_lr, throughput


@dataclass(frozen=True)
class Placement:
    """Where a job runs: ``n`` devices of ``device`` at global batch ``batch`` and learning rate ``lr``."""

    device: str
    n: int
    batch: int
    lr: float

    def counts(self) -> dict[str, int]:
        return {self.device: self.n}


@dataclass
class JobState:
    """A job as the scheduler sees it during a run."""

    job: Job
    done: float = 0.0  # base-batch samples done
    attained: float = 0.0  # device-seconds received
    received: dict[str, float] = field(default_factory=dict)  # device type -> seconds run on it
    placement: Placement | None = None
    restart_until: float = 0.0  # no progress before this time (checkpoint + resume after a move)
    started: bool = False
    finish: float = math.nan

    @property
    def fraction(self) -> float:
        return min(1.0, self.done / self.job.samples)

    @property
    def remaining(self) -> float:
        return max(0.0, self.job.samples - self.done)


Allocation = dict[str, Placement]


class Policy(Protocol):
    name: str

    def allocate(self, jobs: Sequence[JobState], cluster: Cluster, now: float) -> Allocation: ...


def _tput(js: JobState, device: str, cluster: Cluster, n: int | None = None) -> float:
    n = n or js.job.devices
    return throughput(js.job, device, n, per_node=cluster.devices_per_node, profile=cluster.profile(device))


def _fixed(js: JobState, device: str) -> Placement:
    return Placement(device, js.job.devices, js.job.batch, js.job.lr)


def _agnostic_place(order: Sequence[JobState], cluster: Cluster, backfill: bool, keep: bool) -> Allocation:
    """Requested devices on the type with most free devices where the job can run, in ``order``."""
    free = dict(cluster.devices)
    out: Allocation = {}
    if keep:  # non-preemptive: running jobs stay
        for js in order:
            if js.placement is not None:
                out[js.job.name] = js.placement
                free[js.placement.device] -= js.placement.n
    for js in order:
        if js.job.name in out:
            continue
        fits = [t for t in cluster.types if free[t] >= js.job.devices and _tput(js, t, cluster) > 0]
        if not fits:
            if backfill:
                continue
            break
        t = max(fits, key=lambda d: (free[d], -cluster.types.index(d)))
        out[js.job.name] = _fixed(js, t)
        free[t] -= js.job.devices
    return out


class Fifo:
    name = "fifo"

    def allocate(self, jobs: Sequence[JobState], cluster: Cluster, now: float) -> Allocation:
        order = sorted(jobs, key=lambda j: (j.job.arrival, j.job.name))
        return _agnostic_place(order, cluster, backfill=False, keep=True)


class Las:
    name = "las"

    def allocate(self, jobs: Sequence[JobState], cluster: Cluster, now: float) -> Allocation:
        order = sorted(jobs, key=lambda j: (j.attained, j.job.arrival, j.job.name))
        return _agnostic_place(order, cluster, backfill=True, keep=False)


def maxmin_lp(
    coef: np.ndarray, scale: np.ndarray, capacity: np.ndarray, secondary: bool = True
) -> tuple[np.ndarray, float]:
    """max_X min_m sum_t coef[m,t] X[m,t]  s.t.  sum_t X[m,t] <= 1, sum_m scale[m] X[m,t] <= capacity[t],
    X >= 0 (X[m,t] = 0 where coef is 0). Returns (X, z*). With ``secondary``, a second LP keeps
    every job's objective >= z* and maximises sum_m,t coef[m,t] X[m,t] (HiGHS, both)."""
    M, T = coef.shape
    nx = M * T
    bounds = [(0.0, 1.0 if coef[m, t] > 0 else 0.0) for m in range(M) for t in range(T)] + [(0.0, None)]
    rows, rhs = [], []
    for m in range(M):  # z - sum_t coef X <= 0
        r = np.zeros(nx + 1)
        r[m * T : (m + 1) * T] = -coef[m]
        r[nx] = 1.0
        rows.append(r)
        rhs.append(0.0)
    for m in range(M):  # sum_t X[m,t] <= 1
        r = np.zeros(nx + 1)
        r[m * T : (m + 1) * T] = 1.0
        rows.append(r)
        rhs.append(1.0)
    for t in range(T):  # sum_m scale X[m,t] <= N_t
        r = np.zeros(nx + 1)
        r[t:nx:T] = scale
        rows.append(r)
        rhs.append(float(capacity[t]))
    A, b = np.array(rows), np.array(rhs)
    c = np.zeros(nx + 1)
    c[nx] = -1.0
    res = linprog(c, A_ub=A, b_ub=b, bounds=bounds, method="highs")
    if res.status != 0:
        raise ClusterError(f"allocation LP: {res.message}")
    z = float(res.x[nx])
    if not secondary:
        return res.x[:nx].reshape(M, T), z
    bounds2 = bounds[:nx] + [(z * (1 - 1e-7), z * (1 - 1e-7))]
    c2 = np.concatenate([-coef.reshape(-1), [0.0]])
    res2 = linprog(c2, A_ub=A, b_ub=b, bounds=bounds2, method="highs")
    x = res2.x if res2.status == 0 else res.x
    return x[:nx].reshape(M, T), z


class Gavel:
    """Heterogeneity-aware LP policies (module doc); ``objective`` in maxmin | las | makespan | ftf."""

    def __init__(self, objective: str) -> None:
        self.objective = objective
        self.name = f"gavel-{objective}"
        self._key: tuple = ()
        self._x: dict[str, dict[str, float]] = {}

    def matrices(
        self, jobs: Sequence[JobState], cluster: Cluster
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tput[m, t] sequences/s on the requested devices, scale[m], capacity[t])."""
        tput = np.array([[_tput(js, t, cluster) for t in cluster.types] for js in jobs])
        scale = np.array([float(js.job.devices) for js in jobs])
        cap = np.array([float(cluster.devices[t]) for t in cluster.types])
        return tput, scale, cap

    def equal_share(self, tput: np.ndarray, scale: np.ndarray, cap: np.ndarray) -> np.ndarray:
        """T_m(X_eq): every job the same time share f of each type, f = min(1, N / sum_m s_m) N_t / N."""
        f = min(1.0, cap.sum() / scale.sum())
        return tput @ (f * cap / cap.sum())

    def solve(self, jobs: Sequence[JobState], cluster: Cluster, now: float) -> np.ndarray:
        tput, scale, cap = self.matrices(jobs, cluster)
        eq = self.equal_share(tput, scale, cap)
        if self.objective in ("maxmin", "las"):
            w = np.ones(len(jobs))
            if self.objective == "las":
                att = np.array([js.attained for js in jobs])
                w = 1.0 + (att / att.mean() if att.mean() > 0 else np.zeros(len(jobs)))
            return maxmin_lp(tput / (w * eq)[:, None], scale, cap)[0]
        rem = np.array([max(js.remaining, 1e-9) for js in jobs])
        if self.objective == "makespan":
            return maxmin_lp(tput / rem[:, None], scale, cap)[0]
        if self.objective == "ftf":
            age = np.array([max(0.0, now - js.job.arrival) for js in jobs])
            iso = age + rem / eq
            lo, hi = 1.0, 2.0
            while maxmin_lp(tput / (rem / (hi * iso - age))[:, None], scale, cap, False)[1] < 1:
                lo, hi = hi, hi * 2
                if hi > 1e6:
                    break
            for _ in range(20):
                mid = (lo + hi) / 2
                ok = maxmin_lp(tput / (rem / (mid * iso - age))[:, None], scale, cap, False)[1] >= 1
                lo, hi = (lo, mid) if ok else (mid, hi)
            return maxmin_lp(tput / (rem / (hi * iso - age))[:, None], scale, cap)[0]
        raise ClusterError(f"gavel objective {self.objective!r}: one of maxmin, las, makespan, ftf")

    def allocate(self, jobs: Sequence[JobState], cluster: Cluster, now: float) -> Allocation:
        if not jobs:
            return {}
        key = tuple(sorted(js.job.name for js in jobs))
        if key != self._key:
            x = self.solve(jobs, cluster, now)
            self._x = {js.job.name: dict(zip(cluster.types, x[i])) for i, js in enumerate(jobs)}
            self._key = key
        ranked = []
        for js in jobs:
            age = max(now - js.job.arrival, cluster.round_s)
            for t, share in self._x[js.job.name].items():
                if share > 1e-6:
                    got = js.received.get(t, 0.0) / age
                    ranked.append(
                        (-(share / got) if got > 0 else -math.inf, -share, js.job.arrival, js.job.name, t)
                    )
        ranked.sort()
        free = dict(cluster.devices)
        by_name = {js.job.name: js for js in jobs}
        out: Allocation = {}
        for *_, name, t in ranked:
            js = by_name[name]
            if name not in out and free[t] >= js.job.devices:
                out[name] = _fixed(js, t)
                free[t] -= js.job.devices
        return out


class Pollux:
    """Goodput-adaptive allocation, batch size and learning rate (module doc)."""

    name = "pollux"
    min_gain = 1.05  # a doubling must raise goodput by 5% at least

    def __init__(self, lr_rule: str = "adascale") -> None:
        self.lr_rule = lr_rule

    def _sizes(self, js: JobState, t: str, cluster: Cluster) -> list[int]:
        if js.job.throughput:
            return sorted(n for n in js.job.throughput.get(t, {}) if n <= cluster.devices[t])
        out, n = [], 1
        while n <= cluster.devices[t]:
            out.append(n)
            n *= 2
        return out

    def allocate(self, jobs: Sequence[JobState], cluster: Cluster, now: float) -> Allocation:
        free = dict(cluster.devices)
        per_node = cluster.devices_per_node
        size: dict[str, tuple[str, int]] = {}
        order = sorted(jobs, key=lambda j: (j.attained, j.job.arrival, j.job.name))
        for js in order:  # admission: the smallest size of the type with the best goodput per device
            best: tuple[float, str, int] | None = None
            for t in cluster.types:
                for n in (n for n in self._sizes(js, t, cluster) if n <= free[t]):
                    g = goodput(js.job, t, n, js.fraction, per_node, cluster.profile(t))[0] / n
                    if g > 0:  # the smallest size that runs (fits in memory)
                        if best is None or g > best[0]:
                            best = (g, t, n)
                        break
            if best is not None:
                size[js.job.name] = (best[1], best[2])
                free[best[1]] -= best[2]
        by_name = {js.job.name: js for js in jobs}
        heap: list[tuple[float, str]] = []

        def push(name: str) -> None:
            t, n = size[name]
            js = by_name[name]
            bigger = [m for m in self._sizes(js, t, cluster) if m > n]
            if not bigger:
                return
            g0 = goodput(js.job, t, n, js.fraction, per_node, cluster.profile(t))[0]
            g1 = goodput(js.job, t, bigger[0], js.fraction, per_node, cluster.profile(t))[0]
            if g0 > 0 and g1 / g0 >= self.min_gain:
                heapq.heappush(heap, (-math.log(g1 / g0) / (bigger[0] - n), name))

        for name in size:
            push(name)
        while heap:
            _, name = heapq.heappop(heap)
            t, n = size[name]
            bigger = [m for m in self._sizes(by_name[name], t, cluster) if m > n][0]
            if free[t] >= bigger - n:
                free[t] -= bigger - n
                size[name] = (t, bigger)
                push(name)
        out: Allocation = {}
        for name, (t, n) in size.items():
            js = by_name[name]
            _, batch = goodput(js.job, t, n, js.fraction, per_node, cluster.profile(t))
            lr = scaled_lr(js.job, batch, "adascale" if self.lr_rule == "adascale" else "sqrt", js.fraction)
            out[name] = Placement(t, n, batch, lr)
        return out


POLICIES = ("fifo", "las", "gavel-las", "gavel-maxmin", "gavel-makespan", "gavel-ftf", "pollux")


def make_policy(name: str) -> Policy:
    """A policy by its name (one of :data:`POLICIES`)."""
    if name == "fifo":
        return Fifo()
    if name == "las":
        return Las()
    if name == "pollux":
        return Pollux()
    if name in POLICIES and name.startswith("gavel-"):
        return Gavel(name.removeprefix("gavel-"))
    raise ClusterError(f"--policy: unknown policy {name!r}; one of {', '.join(POLICIES)}")
