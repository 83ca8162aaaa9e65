"""When the runtime issues a list's point-to-point operations, and a model of NCCL running them.

Links: every ordered pair of neighbouring pipeline ranks (src -> dst) has its own two-rank
process group (:meth:`loom.mesh.ParallelMesh.pp_links`), so each group carries messages one
way only. The posting plan (one rule, used by the runtime and checked here): the RECVs of the
run of SEND/RECV actions that follows a compute are posted *before* that compute (they arrive
while it runs), one ``batch_isend_irecv`` per link; the run's SENDs (and any RECV not posted
yet) are posted after it, again one batch per link. Each RECV is waited at its list position.

NCCL model (:func:`nccl_check`). On CUDA + NCCL every batch of a process group runs on that
group's one stream in the order the rank issued it, and finishes only once each of its sends
and receives has met the peer's matching operation *while the peer's batch is running* (no
buffering: large messages rendezvous). A batch starts once the previous batch of its stream
has finished and the computes issued before it have run (PyTorch orders the communication
stream after the compute stream at issue). A compute starts once the previous compute has run
and every batch holding a RECV listed before it has finished. Messages of an ordered pair of
ranks match in FIFO order. A plan completes under this model iff it cannot deadlock on NCCL.

Why links: with one pp group, a rank's send queued behind its own pending receive (or the
reverse) waits for the peer's matching operation, which the peer may have queued behind its
own; the early receive posting of every schedule (and the plain list order of interleaved
schedules) deadlocks that way. On a link group the sender's stream holds only sends and the
receiver's only receives, both in the channel's FIFO order, so the k-th send always meets the
k-th receive: a plan completes under the model iff the list completes under the buffered-send
model of :mod:`.simulate` (tested for every schedule). The strict communication mode
(``LOOM_STRICT_COMM=1``) executes each group's batches one after another in issue order, so a
plan that deadlocks here hangs, and is reported, on CPU too.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from loom.parallel.pipeline.schedules import RECVS, SENDS, Action, Schedule

__all__ = ["Issue", "link_of", "nccl_check", "posting_plan"]

COMM = SENDS | RECVS


@dataclass(frozen=True)
class Issue:
    """One thing the runtime issues, in order: a compute or STEP (``batch`` empty, ``index`` its list
    position), or one ``batch_isend_irecv`` of the list positions in ``batch`` on group ``link``."""

    index: int
    batch: tuple[int, ...] = ()
    link: Hashable = None

    @property
    def is_batch(self) -> bool:
        return bool(self.batch)


def link_of(rank: int, a: Action) -> tuple[int, int]:
    """The (src, dst) pipeline ranks of a SEND or RECV on ``rank``."""
    assert a.peer is not None
    return (rank, a.peer) if a.kind in SENDS else (a.peer, rank)


def _per_link(rank: int, actions: Sequence[Action], positions: Sequence[int]) -> list[Issue]:
    by_link: dict[tuple[int, int], list[int]] = {}
    for i in positions:
        by_link.setdefault(link_of(rank, actions[i]), []).append(i)
    return [Issue(ids[0], tuple(ids), link) for link, ids in by_link.items()]


def posting_plan(rank: int, actions: Sequence[Action]) -> list[Issue]:
    """The issue order of pipeline rank ``rank``'s list (see the module docstring)."""
    order: list[Issue] = []
    posted: set[int] = set()
    i, n = 0, len(actions)
    while i < n:
        if actions[i].kind in COMM:
            j = i
            while j < n and actions[j].kind in COMM:
                j += 1
            rest = [k for k in range(i, j) if k not in posted]
            order += _per_link(rank, actions, rest)
            i = j
            continue
        k = i + 1
        while k < n and actions[k].kind in COMM:
            k += 1
        early = [x for x in range(i + 1, k) if actions[x].kind in RECVS]
        order += _per_link(rank, actions, early)
        posted.update(early)
        order.append(Issue(i))
        i += 1
    return order


def nccl_check(schedule: Schedule, plans: Sequence[list[Issue]] | None = None) -> None:
    """Raise ``ScheduleError`` unless every rank's plan completes under the NCCL model (batches with
    the same ``link`` share one in-order stream)."""
    from loom.parallel.pipeline.simulate import ScheduleError

    p = len(schedule)
    plans = [posting_plan(r, a) for r, a in enumerate(schedule)] if plans is None else plans
    partner: dict[tuple[int, int], tuple[int, int]] = {}  # (rank, position) of a SEND <-> of its RECV
    sends: dict[tuple[int, int], list[int]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for r, actions in enumerate(schedule):
        for i, a in enumerate(actions):
            if a.kind in COMM:
                (sends if a.kind in SENDS else recvs)[link_of(r, a)].append(i)
    for (src, dst), idx in sends.items():
        other = recvs.get((src, dst), [])
        if len(other) != len(idx):
            raise ScheduleError(
                f"rank {src} sends {len(idx)} messages to rank {dst}, which receives {len(other)}"
            )
        for i, j in zip(idx, other):
            partner[(src, i)], partner[(dst, j)] = (dst, j), (src, i)

    streams: list[dict[Hashable, list[Issue]]] = [defaultdict(list) for _ in range(p)]
    after: list[dict[Issue, int]] = [{} for _ in range(p)]  # computes issued before each batch
    computes: list[list[int]] = [[] for _ in range(p)]
    batch_of: list[dict[int, Issue]] = [{} for _ in range(p)]
    for r, plan in enumerate(plans):
        for it in plan:
            if it.is_batch:
                streams[r][it.link].append(it)
                after[r][it] = len(computes[r])
                batch_of[r].update({i: it for i in it.batch})
            else:
                computes[r].append(it.index)
    head: list[dict[Hashable, int]] = [defaultdict(int) for _ in range(p)]
    done_c = [0] * p
    finished: list[set[int]] = [set() for _ in range(p)]  # positions whose transfer completed
    complete: list[set[Issue]] = [set() for _ in range(p)]

    def running(r: int, it: Issue) -> bool:
        queue = streams[r][it.link]
        h = head[r][it.link]
        return h < len(queue) and queue[h] == it and done_c[r] >= after[r][it]

    def ready(r: int) -> bool:
        c = computes[r][done_c[r]]
        return all(batch_of[r][j] in complete[r] for j in range(c) if schedule[r][j].kind in RECVS)

    while True:
        moved = False
        for r in range(p):
            while done_c[r] < len(computes[r]) and ready(r):
                done_c[r] += 1
                moved = True
        for r in range(p):
            for link, queue in streams[r].items():
                h = head[r][link]
                if h >= len(queue) or not running(r, queue[h]):
                    continue
                it = queue[h]
                for i in it.batch:
                    q, j = partner[(r, i)]
                    if i not in finished[r] and running(q, batch_of[q][j]):
                        finished[r].add(i)
                        finished[q].add(j)
                        moved = True
                if all(i in finished[r] for i in it.batch):
                    complete[r].add(it)
                    head[r][link] += 1
                    moved = True
        if all(
            done_c[r] == len(computes[r]) and all(head[r][k] == len(q) for k, q in streams[r].items())
            for r in range(p)
        ):
            return
        if not moved:
            waits = []
            for r in range(p):
                for link, queue in streams[r].items():
                    if head[r][link] < len(queue):
                        it = queue[head[r][link]]
                        ops = ", ".join(str(schedule[r][i]) for i in it.batch if i not in finished[r])
                        waits.append(f"rank {r} stream {link} blocked in [{ops}]")
            raise ScheduleError("deadlock on NCCL's in-order streams: " + "; ".join(waits))
