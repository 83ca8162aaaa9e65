"""Execute schedules as an event simulation: validity check, timings, bubble, memory.

Execution model (the runtime contract of :mod:`.schedules`): each rank runs
its list in order; SEND is buffered (takes no time, the message arrives
``t_comm`` later); RECV blocks until the FIFO-next message from its peer has
arrived; F/B/BI/BW take ``t_f``, ``t_b``, ``t_b - t_w``, ``t_w``; STEP takes no
time. A schedule is deadlock-free iff this execution completes.

Bubble fraction = idle rank-time / (ranks x makespan), where busy means a
compute action or STEP (waiting in RECV is idle).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from loom.parallel.pipeline.schedules import COMPUTE, RECVS, SENDS, Action, Kind, Schedule

__all__ = ["Event", "ScheduleError", "Timeline", "check", "peak_in_flight", "simulate"]

BUSY = COMPUTE | {Kind.STEP}


class ScheduleError(ValueError):
    """A schedule that is malformed, unpaired, out of order or deadlocks."""


class Event(NamedTuple):
    """One executed action: its rank, the action, and start/end times (simulated units or seconds)."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    """Per-rank start/end of every action; simulated here, or measured by the runtime."""

    n_ranks: int
    events: list[Event]

    @property
    def makespan(self) -> float:
        """Time from the first start to the last end over all ranks."""
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def busy(self, rank: int) -> float:
        """Compute (F/B/BI/BW) and optimizer-step time of one rank."""
        return sum(e.end - e.start for e in self.events if e.rank == rank and e.action.kind in BUSY)

    @property
    def bubble(self) -> float:
        """Idle time / total rank-time = 1 - sum(busy) / (n_ranks * makespan)."""
        total = self.n_ranks * self.makespan
        if total <= 0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in range(self.n_ranks)) / total

    def waiting(self, rank: int) -> float:
        """Time one rank waits on its peers: inside RECVs, before its first action and after its last."""
        mine = [e for e in self.events if e.rank == rank]
        if not mine:
            return self.makespan
        lo, hi = min(e.start for e in self.events), max(e.end for e in self.events)
        recv = sum(e.end - e.start for e in mine if e.action.kind in RECVS)
        return recv + (min(e.start for e in mine) - lo) + (hi - max(e.end for e in mine))

    @property
    def waiting_bubble(self) -> float:
        """Rank-time spent waiting on peers / (ranks x makespan): the schedule's bubble as a run
        sees it. ``1 - busy - waiting`` is the runtime's own time between actions (0 when simulated)."""
        total = self.n_ranks * self.makespan
        return sum(self.waiting(r) for r in range(self.n_ranks)) / total if total > 0 else 0.0

    @property
    def peak_in_flight(self) -> list[int]:
        """Per rank: most (micro-batch, stage) activations alive at once (F started, B/BW not ended)."""
        per_rank: list[list[Action]] = [[] for _ in range(self.n_ranks)]
        for e in sorted(self.events, key=lambda e: e.start):  # stable: list order breaks ties
            per_rank[e.rank].append(e.action)
        return [_peak(actions) for actions in per_rank]


def _peak(actions: Sequence[Action]) -> int:
    alive = peak = 0
    for a in actions:
        if a.kind is Kind.F:
            alive += 1
            peak = max(peak, alive)
        elif a.kind in (Kind.B, Kind.BW):
            alive -= 1
    return peak


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per rank: most (micro-batch, stage) activations alive at once, in list order."""
    return [_peak(actions) for actions in schedule]


def _n_stages(schedule: Schedule) -> int:
    # a compute action without a stage is reported by _check_structure
    stages = [a.stage for actions in schedule for a in actions if a.kind in COMPUTE and a.stage is not None]
    return max(stages) + 1 if stages else 0


def _check_structure(schedule: Schedule) -> None:
    """Placement, peers, one F and one B (or BI+BW) per (micro-batch, stage), same micro-batches everywhere."""
    p = len(schedule)
    if p == 0:
        raise ScheduleError("schedule has no ranks")
    n_stages = _n_stages(schedule)
    if n_stages % p:
        raise ScheduleError(
            f"{n_stages} stages cannot be spread over {p} ranks (stage s lives on rank s % p)"
        )
    counts: dict[tuple[int, int], dict[Kind, int]] = defaultdict(lambda: defaultdict(int))
    versioned = any(a.version is not None for actions in schedule for a in actions)
    for r, actions in enumerate(schedule):
        stepped = False
        for i, a in enumerate(actions):
            where = f"rank {r} action {i} ({a})"
            if not isinstance(a, Action):
                raise ScheduleError(f"{where}: not an Action")
            if a.kind is Kind.STEP:
                stepped = True
                continue
            if a.microbatch is None or a.stage is None or a.microbatch < 0 or not 0 <= a.stage < n_stages:
                raise ScheduleError(f"{where}: needs a micro-batch >= 0 and a stage in [0, {n_stages})")
            if a.stage % p != r:
                raise ScheduleError(f"{where}: stage {a.stage} lives on rank {a.stage % p}")
            if a.kind in COMPUTE:
                if stepped and not versioned:
                    raise ScheduleError(f"{where}: compute after STEP in a synchronous schedule")
                counts[(a.microbatch, a.stage)][a.kind] += 1
                continue
            target = {
                Kind.SEND_F: a.stage + 1,
                Kind.RECV_F: a.stage - 1,
                Kind.SEND_B: a.stage - 1,
                Kind.RECV_B: a.stage + 1,
            }[a.kind]
            if not 0 <= target < n_stages:
                raise ScheduleError(f"{where}: stage {a.stage} has no neighbour stage {target}")
            if a.peer != target % p or a.peer == r:
                raise ScheduleError(f"{where}: peer must be rank {target % p}, which holds stage {target}")
    microbatches = sorted({mb for mb, _ in counts})
    for s in range(n_stages):
        for mb in microbatches:
            c = counts.get((mb, s), {})
            ok = c.get(Kind.F, 0) == 1 and (
                (c.get(Kind.B, 0) == 1 and not c.get(Kind.BI) and not c.get(Kind.BW))
                or (not c.get(Kind.B) and c.get(Kind.BI, 0) == 1 and c.get(Kind.BW, 0) == 1)
            )
            if not ok:
                found = ", ".join(f"{k.value}x{n}" for k, n in c.items()) or "nothing"
                raise ScheduleError(
                    f"micro-batch {mb} on stage {s}: need one F and one B (or one BI and one BW), found {found}"
                )


def _execute(schedule: Schedule, cost: Callable[[Action], float], t_comm: float) -> list[Event]:
    """Run the lists as a Kahn network: local clocks, blocking FIFO recv, buffered send."""
    _check_structure(schedule)
    p, n_stages = len(schedule), _n_stages(schedule)
    channels: dict[tuple[int, int], deque[tuple[Action, float]]] = defaultdict(deque)
    have: list[set[tuple[str, int, int]]] = [
        set() for _ in range(p)
    ]  # inputs ready: ("act"|"grad", mb, stage)
    done: list[dict[tuple[Kind, int, int], Action]] = [{} for _ in range(p)]
    steps = [0] * p
    pc, clock = [0] * p, [0.0] * p
    events: list[Event] = []

    def fail(r: int, a: Action, why: str) -> ScheduleError:
        return ScheduleError(f"rank {r} action {pc[r]} ({a}): {why}")

    def run(r: int, a: Action) -> float | None:
        """Execute a on rank r; return its end time, or None if blocked in RECV."""
        if a.kind is Kind.STEP:
            steps[r] += 1
            if a.version is not None and a.version != steps[r]:
                raise fail(r, a, f"is step {steps[r]} of this rank but creates version {a.version}")
            return clock[r]
        mb, s = a.microbatch, a.stage
        if mb is None or s is None:  # _check_structure has rejected these
            raise fail(r, a, "needs a micro-batch and a stage")
        if a.kind in RECVS:
            if a.peer is None:  # _check_structure has rejected these
                raise fail(r, a, "needs a peer rank")
            queue = channels[(a.peer, r)]
            if not queue:
                return None
            sent, arrival = queue.popleft()
            want = (Kind.SEND_F, s - 1) if a.kind is Kind.RECV_F else (Kind.SEND_B, s + 1)
            if (sent.kind, sent.stage) != want or sent.microbatch != mb:
                raise fail(
                    r,
                    a,
                    f"next message from rank {a.peer} is {sent}: sends and receives "
                    f"between ranks {a.peer}->{r} are not in the same order",
                )
            have[r].add(("act" if a.kind is Kind.RECV_F else "grad", mb, s))
            return max(clock[r], arrival)
        if a.kind in SENDS:
            producers = (Kind.F,) if a.kind is Kind.SEND_F else (Kind.B, Kind.BI)
            if not any((k, mb, s) in done[r] for k in producers):
                raise fail(r, a, "sends a result its stage has not computed yet")
            if a.peer is None:  # _check_structure has rejected these
                raise fail(r, a, "needs a peer rank")
            channels[(r, a.peer)].append((a, clock[r] + t_comm))
            return clock[r]
        # compute
        if a.version is not None and a.version > steps[r]:
            raise fail(r, a, f"uses weight version {a.version} before this rank created it")
        fwd = done[r].get((Kind.F, mb, s))
        if a.kind is Kind.F:
            if s > 0:
                if ("act", mb, s) not in have[r]:
                    raise fail(r, a, f"activation of micro-batch {mb} for stage {s} has not been received")
                have[r].remove(("act", mb, s))
            if s + 1 < n_stages and (s + 1) % p == r:
                have[r].add(("act", mb, s + 1))
        elif fwd is None:
            raise fail(r, a, f"backward before the forward of micro-batch {mb} on stage {s}")
        elif a.version != fwd.version:
            raise fail(
                r,
                a,
                f"uses weight version {a.version} but its forward used {fwd.version} "
                "(weight stashing violated)",
            )
        elif a.kind in (Kind.B, Kind.BI):
            if s + 1 < n_stages:
                if ("grad", mb, s) not in have[r]:
                    raise fail(
                        r, a, f"output gradient of micro-batch {mb} for stage {s} has not been received"
                    )
                have[r].remove(("grad", mb, s))
            if s > 0 and (s - 1) % p == r:
                have[r].add(("grad", mb, s - 1))
        elif (Kind.BI, mb, s) not in done[r]:
            raise fail(r, a, f"weight gradient before the input gradient of micro-batch {mb} on stage {s}")
        done[r][(a.kind, mb, s)] = a
        return clock[r] + cost(a)

    while True:
        moved = False
        for r in range(p):
            while pc[r] < len(schedule[r]):
                a = schedule[r][pc[r]]
                end = run(r, a)
                if end is None:
                    break
                events.append(Event(r, a, clock[r], end))
                clock[r] = end
                pc[r] += 1
                moved = True
        if all(pc[r] == len(schedule[r]) for r in range(p)):
            break
        if not moved:
            waits = "; ".join(
                f"rank {r} waits in {schedule[r][pc[r]]}" for r in range(p) if pc[r] < len(schedule[r])
            )
            raise ScheduleError(f"deadlock: {waits}")
    for (src, dst), queue in channels.items():
        if queue:
            raise ScheduleError(f"rank {src} sent {queue[0][0]} to rank {dst}, which never receives it")
    for r in range(p):
        if have[r]:
            what, mb, s = sorted(have[r])[0]
            raise ScheduleError(f"rank {r}: {what} of micro-batch {mb} for stage {s} is never used")
    return events


def check(schedule: Schedule) -> None:
    """Raise ScheduleError unless the schedule pairs up, respects data order and cannot deadlock."""
    _execute(schedule, lambda a: 1.0, 0.0)


def _per_stage(value: float | Sequence[float], stage: int) -> float:
    return float(value) if isinstance(value, int | float) else float(value[stage])


def simulate(
    schedule: Schedule,
    t_f: float | Sequence[float],
    t_b: float | Sequence[float],
    t_w: float | Sequence[float] | None = None,
    t_comm: float = 0.0,
) -> Timeline:
    """Simulate a schedule; times are per action (per virtual stage), scalars or one value per stage.

    t_b is the full backward; t_w the weight-gradient part (default t_b / 2), so
    BI takes t_b - t_w and BW takes t_w. Raises ScheduleError on an invalid schedule.
    """

    def cost(a: Action) -> float:
        s = a.stage
        if s is None:  # _execute costs only compute actions, which _check_structure gave a stage
            raise ScheduleError(f"{a}: a compute action needs a stage")
        if a.kind is Kind.F:
            return _per_stage(t_f, s)
        full = _per_stage(t_b, s)
        if a.kind is Kind.B:
            return full
        weight = full / 2 if t_w is None else _per_stage(t_w, s)
        if not 0 <= weight <= full:
            raise ValueError(f"t_w={weight} must lie within [0, t_b={full}]")
        return weight if a.kind is Kind.BW else full - weight

    return Timeline(len(schedule), _execute(schedule, cost, t_comm))
