"""Pipeline schedules as data: one ordered action list per pipeline rank.

Each schedule is a pure function of ``p`` ranks, ``m`` micro-batches (and ``v``
virtual stages per rank for the interleaved schedule) returning
``list[list[Action]]``. Virtual stage ``s`` (``0 .. p*v - 1``) lives on rank
``s % p`` (Megatron's looping placement); with ``v == 1`` stage == rank.

Runtime contract (what :mod:`loom.parallel.pipeline.simulate` checks):

* A rank executes its list in order.
* ``F``/``B``/``BI``/``BW`` compute one micro-batch on one stage. ``B`` is the
  full backward; ``BI`` computes only the input gradient (what the previous
  stage waits for) and ``BW`` the weight gradient of the same micro-batch later.
* ``SEND_F``/``SEND_B`` are non-blocking (``isend``): the rank never waits for
  the receiver. Their handles are waited only at the end of the step (a send
  may complete only once the peer posts its recv, as on NCCL).
* ``RECV_F``/``RECV_B`` block until the message has arrived. A runtime may post
  the ``irecv`` earlier and may batch a run of consecutive SEND/RECV actions
  into one ``batch_isend_irecv``, waiting on its RECV handles only: both move
  work earlier, never later, so they keep a valid list deadlock-free.
* Because sends never block, a deadlock is a cycle of ranks blocked in RECVs
  whose matching SENDs come later in the waiting ranks' lists; the simulator
  executes this model and rejects such lists.
* Messages between an ordered pair of ranks are matched in list order (FIFO),
  with no tags, so the k-th SEND from rank a to rank b is the k-th RECV on b
  from a. The same holds for NCCL and gloo.
* ``SEND_F`` on stage s carries the output of ``F`` to stage s+1 and is placed
  right after that ``F``; ``SEND_B`` on stage s carries the input gradient to
  stage s-1, right after ``B``/``BI``. A RECV is placed before the compute that
  needs it (earlier when FIFO order requires). A RECV's ``stage`` is the
  receiving stage; a SEND's ``stage`` is the sending stage.
* ``STEP`` applies the optimizer to all of the rank's stages. Synchronous
  schedules have one STEP at the end of each list. Asynchronous schedules
  (PipeDream, 2BW) interleave STEPs and tag every compute action with the
  weight ``version`` it must use; STEP's ``version`` is the version it creates.

Bubble formulas below assume equal stages and per-action times ``t_f``, ``t_b``
(``t_w`` for the weight-gradient part), no communication time.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import cast

from loom.rules import SCHEDULES as SCHEDULE_NAMES
from loom.rules import ScheduleName

__all__ = [
    "Action",
    "Kind",
    "SCHEDULES",
    "Schedule",
    "build_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "pipedream_2bw",
    "pipedream_async",
    "stashed_versions",
    "weight_versions",
    "zero_bubble_h1",
]


class Kind(str, Enum):
    """What an action does."""

    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients)
    BI = "BI"  # backward, input gradient only
    BW = "BW"  # backward, weight gradient only
    SEND_F = "SEND_F"  # send activation to the next stage
    RECV_F = "RECV_F"  # receive activation from the previous stage
    SEND_B = "SEND_B"  # send input gradient to the previous stage
    RECV_B = "RECV_B"  # receive output gradient from the next stage
    STEP = "STEP"  # optimizer step over the rank's stages


COMPUTE = frozenset({Kind.F, Kind.B, Kind.BI, Kind.BW})
SENDS = frozenset({Kind.SEND_F, Kind.SEND_B})
RECVS = frozenset({Kind.RECV_F, Kind.RECV_B})


@dataclass(frozen=True)
class Action:
    """One step of one rank.

    ``stage`` is the virtual stage the action runs on (the sending stage for
    SEND, the receiving one for RECV); ``peer`` the other rank of a SEND/RECV.
    ``version`` (async schedules only) is the weight version a compute action
    uses, or the one a STEP creates. STEP has ``stage`` None (all of the rank's
    stages) and ``microbatch`` None, or in async schedules the micro-batch
    whose backward completed the gradient it applies.
    """

    kind: Kind
    microbatch: int | None
    stage: int | None
    peer: int | None = None
    version: int | None = None

    def __str__(self) -> str:
        if self.kind is Kind.STEP:
            return "STEP" if self.version is None else f"STEP->v{self.version}"
        text = f"{self.kind.value}{self.microbatch}@s{self.stage}"
        if self.peer is not None:
            text += f"<->r{self.peer}"
        if self.version is not None:
            text += f"[v{self.version}]"
        return text


Schedule = list[list[Action]]
Order = list[tuple[Kind, int, int]]  # compute-only order of one rank: (kind, microbatch, stage)


def _check_args(name: str, p: int, m: int, v: int = 1) -> None:
    if p < 1:
        raise ValueError(f"{name}: pipeline size p must be >= 1, got {p}")
    if m < 1:
        raise ValueError(f"{name}: micro-batch count m must be >= 1, got {m}")
    if v < 1:
        raise ValueError(f"{name}: virtual stages per rank v must be >= 1, got {v}")


def _with_comms(orders: list[Order], p: int, n_stages: int) -> Schedule:
    """Turn compute orders into full action lists with paired, FIFO-ordered sends/recvs."""
    rank_of = [s % p for s in range(n_stages)]
    # 1) sends right after the producing compute; remember each channel's message order
    channel: dict[tuple[int, int], list[Action]] = defaultdict(list)  # (src, dst) -> SENDs in order
    sent: list[list[Action | tuple[Kind, int, int]]] = []
    for r, order in enumerate(orders):
        out: list[Action | tuple[Kind, int, int]] = []
        for kind, mb, s in order:
            out.append((kind, mb, s))
            send = None
            if kind is Kind.F and s + 1 < n_stages and rank_of[s + 1] != r:
                send = Action(Kind.SEND_F, mb, s, peer=rank_of[s + 1])
            elif kind in (Kind.B, Kind.BI) and s > 0 and rank_of[s - 1] != r:
                send = Action(Kind.SEND_B, mb, s, peer=rank_of[s - 1])
            if send is not None:
                out.append(send)
                channel[(r, cast(int, send.peer))].append(send)  # built with a peer just above
        sent.append(out)

    # 2) recvs before the consuming compute, pulling earlier messages of the channel first
    def recv_for(send: Action, src: int) -> Action:
        if send.kind is Kind.SEND_F:
            return Action(Kind.RECV_F, send.microbatch, cast(int, send.stage) + 1, peer=src)
        return Action(Kind.RECV_B, send.microbatch, cast(int, send.stage) - 1, peer=src)

    schedule: Schedule = []
    for r, items in enumerate(sent):
        taken: dict[int, int] = defaultdict(int)  # src -> messages already received
        actions: list[Action] = []
        for item in items:
            if isinstance(item, Action):
                actions.append(item)
                continue
            kind, mb, s = item
            need = None
            if kind is Kind.F and s > 0 and rank_of[s - 1] != r:
                need = (rank_of[s - 1], Kind.SEND_F, mb, s - 1)
            elif kind in (Kind.B, Kind.BI) and s + 1 < n_stages and rank_of[s + 1] != r:
                need = (rank_of[s + 1], Kind.SEND_B, mb, s + 1)
            if need is not None:
                src = need[0]
                queue = channel[(src, r)]
                while True:
                    msg = queue[taken[src]]
                    taken[src] += 1
                    actions.append(recv_for(msg, src))
                    if (msg.kind, msg.microbatch, msg.stage) == need[1:]:
                        break
            actions.append(Action(kind, mb, s))
        schedule.append(actions)
    return schedule


def _finish_sync(orders: list[Order], p: int, n_stages: int) -> Schedule:
    schedule = _with_comms(orders, p, n_stages)
    for actions in schedule:
        actions.append(Action(Kind.STEP, None, None))
    return schedule


def _one_f_one_b_order(p: int, m: int, r: int, backward: Kind = Kind.B) -> Order:
    warmup = min(p - 1 - r, m)
    order: Order = [(Kind.F, j, r) for j in range(warmup)]
    for k in range(m - warmup):
        order += [(Kind.F, k + warmup, r), (backward, k, r)]
    order += [(backward, k, r) for k in range(m - warmup, m)]
    return order


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: all m forwards, then all m backwards, then a synchronous flush (STEP).

    Bubble fraction (p-1)/(m+p-1); peak in-flight micro-batches m on every rank.
    """
    _check_args("gpipe", p, m)
    orders = [[(Kind.F, j, r) for j in range(m)] + [(Kind.B, j, r) for j in range(m)] for r in range(p)]
    return _finish_sync(orders, p, p)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): p-1-rank warm-up forwards, steady one-forward-one-backward, cool-down.

    Bubble fraction (p-1)/(m+p-1), as GPipe; peak in-flight micro-batches min(p - rank, m).
    """
    _check_args("1f1b", p, m)
    return _finish_sync([_one_f_one_b_order(p, m, r) for r in range(p)], p, p)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B: v model chunks per rank, stage c*p + rank for chunk c.

    Micro-batches advance in groups of p through the chunks; rank r runs
    min(m*v, (v-1)*p + 2*(p-1-r)) warm-up forwards, then 1F1B, then cool-down.
    With per-chunk times t_f/v, t_b/v the idle time per rank is the GPipe bubble
    time divided by v, (p-1)*(t_f+t_b)/v, so the bubble fraction is
    (p-1)/(v*m + p-1) (exact in simulation). Peak in-flight (micro-batch, chunk)
    pairs on rank r: min(m*v, (v-1)*p + 2*(p-1-r) + 1); each is 1/v of a
    micro-batch's activations. Needs m % p == 0. With v == 1 it is exactly
    :func:`one_f_one_b` (Megatron's non-interleaved path).
    """
    _check_args("interleaved", p, m, v)
    if m % p:
        raise ValueError(f"interleaved 1F1B needs micro-batches divisible by pp: m={m}, p={p}")
    if v == 1:
        return one_f_one_b(p, m)
    total = m * v

    def stage(r: int, k: int, forward: bool) -> int:
        chunk = (k // p) % v
        return (chunk if forward else v - 1 - chunk) * p + r

    def micro(k: int) -> int:
        return (k // (p * v)) * p + k % p

    orders = []
    for r in range(p):
        warmup = min(total, (v - 1) * p + 2 * (p - 1 - r))
        order: Order = [(Kind.F, micro(k), stage(r, k, True)) for k in range(warmup)]
        for k in range(total - warmup):
            order.append((Kind.F, micro(k + warmup), stage(r, k + warmup, True)))
            order.append((Kind.B, micro(k), stage(r, k, False)))
        order += [(Kind.B, micro(k), stage(r, k, False)) for k in range(total - warmup, total)]
        orders.append(order)
    return _finish_sync(orders, p, p * v)


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023): 1F1B order of F and BI, each rank defers its BW passes.

    Rank r runs its first BW only after r BIs, then one BW after every BI, and
    flushes the rest at the end, so BWs fill the cool-down bubbles. With
    t_f = t_bi = t_w (our default splits t_b evenly: t_bi = t_w = t_b/2) the
    bubble time per rank is (p-1)*(t_f + t_bi - t_w) = (p-1)*t_f, a third of
    1F1B's (p-1)*(t_f + t_b): fraction (p-1)/(3m + p-1) for t_f=1, t_b=2.
    Peak in-flight micro-batches (forward done, BW not done) min(p, m) on every
    rank, i.e. 1F1B's peak (rank 0).
    """
    _check_args("zb-h1", p, m)
    orders = []
    for r in range(p):
        order: Order = []
        weights_done = 0
        for kind, mb, s in _one_f_one_b_order(p, m, r, backward=Kind.BI):
            order.append((kind, mb, s))
            if kind is Kind.BI and mb >= r:
                order.append((Kind.BW, weights_done, s))
                weights_done += 1
        order += [(Kind.BW, j, r) for j in range(weights_done, m)]
        orders.append(order)
    return _finish_sync(orders, p, p)


def _versioned(
    orders: list[Order], p: int, version_of: Callable[[int, int], int], step_after: Callable[[int], bool]
) -> Schedule:
    """Add weight versions and STEPs to 1F1B orders: version_of(rank, mb); STEP after B of mb if step_after(mb)."""
    schedule = _with_comms(orders, p, p)
    out: Schedule = []
    for r, actions in enumerate(schedule):
        tagged: list[Action] = []
        steps = 0
        for a in actions:
            if a.kind in COMPUTE:
                a = Action(a.kind, a.microbatch, a.stage, version=version_of(r, cast(int, a.microbatch)))
            tagged.append(a)
            if a.kind is Kind.B and step_after(cast(int, a.microbatch)):  # compute: has a micro-batch
                steps += 1
                tagged.append(Action(Kind.STEP, a.microbatch, None, version=steps))
        out.append(tagged)
    return out


def _steps_before_forward(p: int, m: int, r: int) -> list[int]:
    """In 1F1B order on rank r: how many backwards precede the forward of each micro-batch."""
    count, before = 0, [0] * m
    for kind, mb, _ in _one_f_one_b_order(p, m, r):
        if kind is Kind.F:
            before[mb] = count
        else:
            count += 1
    return before


def pipedream_async(p: int, m: int, vertical_sync: bool = False) -> Schedule:
    """PipeDream: 1F1B with no flush over m micro-batches; each rank steps after every backward.

    The list covers a whole run (pipeline filled once, drained once); step k
    of rank r creates weight version k. Weight stashing: micro-batch j's
    forward on rank r uses the newest version, max(0, j - (p-1-r)), and its
    backward uses that same stashed version; rank r keeps p - rank versions
    (the in-flight micro-batches' ones, newest included). With vertical_sync,
    micro-batch j uses on every stage the version of its forward on stage 0,
    max(0, j - (p-1)); rank r > 0 then keeps p - r + 1 versions.
    Bubble: (p-1)/(m+p-1) over the whole run, i.e. only the fill and the drain.
    Peak in-flight micro-batches min(p - rank, m).
    """
    _check_args("pipedream", p, m)
    before = [_steps_before_forward(p, m, r) for r in range(p)]

    def version_of(r: int, mb: int) -> int:
        return before[0 if vertical_sync else r][mb]

    orders = [_one_f_one_b_order(p, m, r) for r in range(p)]
    return _versioned(orders, p, version_of, lambda mb: True)


def pipedream_2bw(p: int, m: int, batches: int = 2) -> Schedule:
    """PipeDream-2BW: 1F1B with no flush over batches*m micro-batches, double-buffered weights.

    Gradients accumulate over each batch of m micro-batches; a rank steps after
    the backward of a batch's last micro-batch. Micro-batches of batch b use
    version max(0, b-1) for forward and backward (update W(b+1) = W(b) -
    lr*grad(W(b-1))), so at most 2 versions are alive per rank. Needs m >= p,
    so that in-flight micro-batches span at most two batches.
    Bubble (p-1)/(batches*m + p-1); peak in-flight micro-batches p - rank.
    """
    _check_args("2bw", p, m)
    if m < p:
        raise ValueError(f"PipeDream-2BW needs at least as many micro-batches as stages: m={m} < p={p}")
    if batches < 1:
        raise ValueError(f"PipeDream-2BW: batches must be >= 1, got {batches}")
    total = batches * m
    orders = [_one_f_one_b_order(p, total, r) for r in range(p)]
    return _versioned(orders, p, lambda r, mb: max(0, mb // m - 1), lambda mb: mb % m == m - 1)


def weight_versions(schedule: Schedule) -> list[dict[tuple[Kind, int, int], int]]:
    """Per rank: {(kind, microbatch, stage): weight version} of every compute action (0 if unversioned)."""
    return [
        {
            (a.kind, cast(int, a.microbatch), cast(int, a.stage)): a.version or 0
            for a in actions
            if a.kind in COMPUTE
        }
        for actions in schedule
    ]


def stashed_versions(schedule: Schedule) -> list[int]:
    """Per rank: peak number of weight versions kept at once (newest + those of in-flight micro-batches)."""
    peaks = []
    for actions in schedule:
        newest, peak = 0, 1
        live: dict[tuple[int | None, int | None], int] = {}  # (mb, stage) -> version stashed at its forward
        for a in actions:
            if a.kind is Kind.STEP:
                newest = a.version if a.version is not None else newest
            elif a.kind is Kind.F:
                live[(a.microbatch, a.stage)] = a.version or 0
            elif a.kind in (Kind.B, Kind.BW):
                live.pop((a.microbatch, a.stage), None)
            peak = max(peak, len(set(live.values()) | {newest}))
        peaks.append(peak)
    return peaks


SCHEDULES: dict[ScheduleName, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb-h1": zero_bubble_h1,
    "pipedream": pipedream_async,
    "2bw": pipedream_2bw,
}
if tuple(SCHEDULES) != SCHEDULE_NAMES:  # the names config validates (loom.rules.ScheduleName)
    raise ImportError(
        f"pipeline schedules {tuple(SCHEDULES)} differ from loom.rules.ScheduleName {SCHEDULE_NAMES}"
    )


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Build a registered schedule; raises ValueError with a one-line message for bad inputs."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if name == "interleaved":
        return interleaved_1f1b(p, m, v)
    if v != 1:
        raise ValueError(f"virtual stages v={v} > 1 need the 'interleaved' schedule, not {name!r}")
    return SCHEDULES[name](p, m)
