"""Discrete-event simulator: a trace, a cluster, a policy -> job completion times and cluster metrics.

Events are arrivals, completions and round boundaries (every ``cluster.round_s``). At each the policy
allocates the jobs present; between events each placed job makes progress at its goodput
throughput(type, n, batch) x E(batch) (:mod:`loom.cluster.jobs`), constant over the interval. A job
whose placement changes (moved, resized, resumed after preemption) makes no progress for
``cluster.restart_s`` (checkpoint, restart, reshard). Deterministic: same inputs, same result.

Metrics: JCT = finish - arrival; ``avg_jct``, ``p99_jct`` (linear interpolation of the sorted JCTs);
``makespan`` = last finish - first arrival; ``utilization`` = allocated device-seconds / (devices x
makespan); ``ftf`` per job rho = JCT / (its work alone on its requested devices of its fastest type),
``max_ftf`` and ``fairness`` = Jain's index (sum rho)^2 / (n sum rho^2) (1: every job slowed alike).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from loom.cluster.formats import Cluster
from loom.cluster.jobs import ClusterError, Job, throughput
from loom.cluster.policies import JobState, Placement, Policy

MAX_EVENTS = 1_000_000


@dataclass
class Result:
    """One policy's run over a trace."""

    policy: str
    jct: dict[str, float]  # job -> completion time
    ftf: dict[str, float]  # job -> JCT / isolated time
    makespan: float
    utilization: float
    events: int
    timeline: list[tuple[float, dict[str, int]]] = field(
        default_factory=list
    )  # (time, devices in use per type)

    @property
    def avg_jct(self) -> float:
        return float(np.mean(list(self.jct.values())))

    @property
    def p99_jct(self) -> float:
        return float(np.percentile(list(self.jct.values()), 99))

    @property
    def fairness(self) -> float:
        r = np.array(list(self.ftf.values()))
        return float(r.sum() ** 2 / (len(r) * (r**2).sum()))

    def summary(self) -> dict[str, float | str]:
        return {
            "policy": self.policy,
            "avg_jct": self.avg_jct,
            "p99_jct": self.p99_jct,
            "makespan": self.makespan,
            "utilization": self.utilization,
            "fairness": self.fairness,
            "max_ftf": max(self.ftf.values()),
            "jobs": len(self.jct),
        }


def isolated_time(job: Job, cluster: Cluster) -> float:
    """The job's work alone on its requested devices of its fastest type (base batch)."""
    best = max(
        throughput(job, t, job.devices, per_node=cluster.devices_per_node, profile=cluster.profile(t))
        for t in cluster.types
    )
    return job.samples / best if best > 0 else math.inf


def simulate(jobs: list[Job], cluster: Cluster, policy: Policy) -> Result:
    """Run ``policy`` over ``jobs`` on ``cluster`` (module doc)."""
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise ClusterError("trace: job names must be unique")
    pending = sorted(jobs, key=lambda j: (j.arrival, j.name))
    states: dict[str, JobState] = {}
    active: list[JobState] = []
    now = pending[0].arrival if pending else 0.0
    busy = 0.0
    events = 0
    timeline: list[tuple[float, dict[str, int]]] = []
    i = 0
    while i < len(pending) or active:
        while i < len(pending) and pending[i].arrival <= now:
            js = JobState(pending[i])
            states[js.job.name] = js
            active.append(js)
            i += 1
        alloc = policy.allocate(active, cluster, now) if active else {}
        used = dict.fromkeys(cluster.types, 0)
        for placed in alloc.values():
            used[placed.device] += placed.n
        for t, n in used.items():
            if n > cluster.devices[t]:
                raise ClusterError(f"policy {policy.name}: allocated {n} {t} of {cluster.devices[t]}")
        timeline.append((now, used))
        rates: dict[str, float] = {}
        for js in active:
            p: Placement | None = alloc.get(js.job.name)
            if p != js.placement and p is not None and js.started:
                js.restart_until = now + cluster.restart_s
            js.placement = p
            if p is not None:
                js.started = True
                tp = throughput(
                    js.job, p.device, p.n, p.batch, cluster.devices_per_node, cluster.profile(p.device)
                )
                rates[js.job.name] = tp * js.job.efficiency(p.batch, js.fraction)
        nxt = (math.floor(now / cluster.round_s + 1e-9) + 1) * cluster.round_s
        if i < len(pending):
            nxt = min(nxt, pending[i].arrival)
        for js in active:
            r = rates.get(js.job.name, 0.0)
            if r > 0:
                nxt = min(nxt, max(now, js.restart_until) + js.remaining / r)
        dt = nxt - now
        done_now = []
        for js in active:
            q = js.placement
            if q is None:
                continue
            productive = max(0.0, nxt - max(now, js.restart_until))
            js.done += rates.get(js.job.name, 0.0) * productive
            js.attained += q.n * dt
            js.received[q.device] = js.received.get(q.device, 0.0) + dt
            busy += q.n * dt
            if js.remaining <= js.job.samples * 1e-9:
                js.finish = nxt
                done_now.append(js)
        for js in done_now:
            active.remove(js)
        now = nxt
        events += 1
        if events > MAX_EVENTS:
            if i < len(pending):  # what keeps the simulation going: a job that has not arrived yet
                j = pending[i]
                held = f"job {j.name!r} arrives only at arrival_s = {j.arrival:g}"
            else:  # or the one furthest from done
                js = min(active, key=lambda s: s.fraction)
                held = (
                    f"job {js.job.name!r} has done {100 * js.fraction:.2g}% of samples = {js.job.samples:g}"
                )
            raise ClusterError(
                f"policy {policy.name}: more than {MAX_EVENTS:,} events by t = {now:.4g} s "
                f"({now / cluster.round_s:.3g} rounds of cluster.round_s = {cluster.round_s:g} s): {held}"
            )
    first = min(j.arrival for j in jobs)
    makespan = max(js.finish for js in states.values()) - first
    jct = {n: js.finish - js.job.arrival for n, js in states.items()}
    ftf = {n: jct[n] / isolated_time(js.job, cluster) for n, js in states.items()}
    total = sum(cluster.devices.values())
    return Result(policy.name, jct, ftf, makespan, busy / (total * makespan), events, timeline)
