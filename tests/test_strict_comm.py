"""NCCL's rules on CPU: the pipeline's posting plan under an NCCL stream model, and each check of
the strict communication mode (``LOOM_STRICT_COMM``) firing on a deliberately wrong example."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loom.parallel.pipeline.posting import nccl_check, posting_plan
from loom.parallel.pipeline.runtime import step_schedule
from loom.parallel.pipeline.simulate import ScheduleError, check
from tests.dist import CollectiveOrderError, WorkerPool
from tests.helpers import GEMMA2_FIELDS


def _cases() -> list[tuple[str, int, int, int]]:
    out = []
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "pipedream", "2bw"):
        for p in (2, 3, 4, 8):
            for m in sorted({p, 2 * p, 3 * p, 8, 16}):
                for v in (1, 2, 3, 4) if name == "interleaved" else (1,):
                    try:
                        step_schedule(name, p, m, v)
                    except ValueError:  # a combination the schedule refuses (m not a multiple of p, ...)
                        continue
                    out.append((name, p, m, v))
    return out


ALL = _cases()


def _one_group(schedule):
    """The same batches, all on the pp group's one stream (how Loom posted before links)."""
    return [[replace(it, link="pp") for it in posting_plan(r, actions)] for r, actions in enumerate(schedule)]


def test_every_schedule_is_deadlock_free_on_nccl_streams() -> None:
    """The runtime's plan completes under the NCCL model for every schedule, p, m and v."""
    assert len(ALL) > 100
    for name, p, m, v in ALL:
        schedule = step_schedule(name, p, m, v)
        check(schedule)
        nccl_check(schedule)


def test_one_pp_group_deadlocks_every_schedule() -> None:
    """With every batch on one group, as Loom posted before, none of them completes: the model
    sees what the in-order streams of NCCL would do."""
    for name, p, m, v in ALL:
        with pytest.raises(ScheduleError, match="deadlock on NCCL"):
            nccl_check(step_schedule(name, p, m, v), _one_group(step_schedule(name, p, m, v)))


def test_plan_posts_receives_before_the_compute_and_one_link_per_batch() -> None:
    schedule = step_schedule("1f1b", 2, 4)
    for r, actions in enumerate(schedule):
        plan = posting_plan(r, actions)
        issued = sorted(i for it in plan for i in (it.batch or (it.index,)))
        assert issued == list(range(len(actions)))  # every action issued exactly once
        for _k, it in enumerate(plan):
            if it.is_batch:
                assert (
                    len(
                        {
                            (r, actions[i].peer)
                            if actions[i].kind.name.startswith("SEND")
                            else (actions[i].peer, r)
                            for i in it.batch
                        }
                    )
                    == 1
                )
                assert {it.link} == {
                    (r, actions[i].peer) if actions[i].kind.name.startswith("SEND") else (actions[i].peer, r)
                    for i in it.batch
                }
        # a RECV that follows a compute in the list is issued before that compute
        pos = {i: k for k, it in enumerate(plan) for i in (it.batch or (it.index,))}
        for i, a in enumerate(actions):
            if (
                a.kind.name.startswith("RECV")
                and i > 0
                and not actions[i - 1].kind.name.startswith(("SEND", "RECV"))
            ):
                assert pos[i] < pos[i - 1]


# ----------------------------------------------------------------------------- checks inside ranks


def _tensor_checks() -> list[str]:
    import torch
    import torch.distributed as dist

    from loom import comm

    world = dist.group.WORLD
    seen = []
    for bad in (torch.ones(4, 4).t(), torch.ones(3, dtype=torch.int16), torch.ones(3, device="meta")):
        try:
            comm.all_reduce(bad, world)
        except comm.StrictCommError as e:
            seen.append(str(e))
    ok = torch.ones(3)
    comm.all_reduce(ok, world)  # a good tensor still goes through
    seen.append(str(float(ok.sum())))
    return seen


def _in_order_deadlock() -> str:
    """Both ranks post a receive, then a send, on one group: gloo completes it, NCCL's in-order
    stream cannot (each rank's send waits behind its own receive)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from loom import comm

    group = dist.new_group([0, 1])
    peer = 1 - dist.get_rank()
    inbox, outbox = torch.empty(8), torch.ones(8)
    recv = comm.batch_p2p([], [(inbox, peer)], group)
    comm.batch_p2p([(outbox, peer)], [], group)
    try:
        recv[0].wait(timedelta(seconds=2))
    except RuntimeError as e:
        return str(e)
    return "completed"


def _mismatched_collectives() -> float:
    """Rank 0 sums, rank 1 takes the max: gloo completes both (each rank reduces locally with its
    own op) and the ranks silently hold different values; the order log names the divergence."""
    import torch
    import torch.distributed as dist

    from loom import comm

    t = torch.ones(4)
    if dist.get_rank() == 0:
        comm.all_reduce(t, dist.group.WORLD)
    else:
        comm.all_reduce_max(t, dist.group.WORLD)
    return float(t.sum())


def test_strict_tensor_checks_fire(pools) -> None:
    a, b = pools(2).run(_tensor_checks)
    assert a == b
    assert "not contiguous" in a[0]
    assert "NCCL does not move torch.int16" in a[1]
    assert "not on the group's device" in a[2] and "meta" in a[2]
    assert a[3] == "6.0"


def test_strict_point_to_point_runs_in_issue_order() -> None:
    pool = WorkerPool(2)  # its own ranks: the deadlocked messages must not reach other tests
    try:
        out = pool.run(_in_order_deadlock, timeout=60)
    finally:
        pool.close()
    assert all("timed out" in o for o in out), out


def test_collective_order_is_compared_across_ranks(pools) -> None:
    with pytest.raises(
        CollectiveOrderError,
        match=r"collective #0 is all_reduce\(float32\[4\]\) on rank 0 "
        r"but all_reduce_max\(float32\[4\]\) on rank 1",
    ):
        pools(2).run(_mismatched_collectives)


def _verify_at_step_end() -> str:
    """What the strict trainer does at each step end: compare the logs in the ranks themselves."""
    import torch
    import torch.distributed as dist

    from loom import comm

    comm.all_reduce(torch.ones(4), dist.group.WORLD)
    comm.verify_order()  # the same collectives so far: passes
    t = torch.ones(4)
    (comm.all_reduce if dist.get_rank() == 0 else comm.all_reduce_max)(t, dist.group.WORLD)
    try:
        comm.verify_order()
    except comm.StrictCommError as e:
        return str(e)
    return "not caught"


def test_ranks_compare_their_collective_order_at_a_step_end(pools) -> None:
    for msg in pools(2).run(_verify_at_step_end):
        assert msg.startswith("collective order differs on group") and "all_reduce_max" in msg


def test_order_mismatch_names_the_first_difference() -> None:
    from loom.comm import first_order_mismatch

    key = ("7", (0, 1))
    same = {key: ["all_reduce(float32[8])", "all_gather(bfloat16[4], bfloat16[2])"]}
    assert first_order_mismatch([same, same]) is None
    short = {key: same[key][:1]}
    msg = first_order_mismatch([same, short])
    assert msg is not None and "collective #1 is all_gather" in msg and "but nothing on rank 1" in msg
    # groups a rank is not a member of are not compared against it
    assert first_order_mismatch([same, same, {("9", (2,)): ["all_reduce(float32[1])"]}]) is None


# ----------------------------------------------------------------------------- device placement

SENTINEL_LAYOUTS = {
    2: {
        "dp2": ({"dp_replicate": 2}, {}),
        "dp2-fp16": ({"dp_replicate": 2, "precision": "fp16"}, {}),
        "zero2-offload": ({"dp_shard": 2, "zero": 2, "offload": "cpu"}, {}),
        "zero3-bf16-adafactor": (
            {"dp_shard": 2, "zero": 3, "precision": "bf16", "optimizer": "adafactor"},
            {},
        ),
        "zero1-adam8bit": ({"dp_shard": 2, "zero": 1, "optimizer": "adam8bit"}, {}),
        "tp2-sp": ({"tp": 2, "sp": True}, {}),
        "tp2-sp-gemma2-bf16": (  # the embedding scale, offset norms, soft-caps and scale of Gemma 2
            {"tp": 2, "sp": True, "precision": "bf16"},
            GEMMA2_FIELDS,
        ),
        "pp2-zb": ({"pp": 2, "schedule": "zb-h1"}, {}),
        "pp2-interleaved": ({"pp": 2, "schedule": "interleaved", "virtual_stages": 2}, {"n_layers": 4}),
        "pp2-2bw-bf16": ({"pp": 2, "schedule": "2bw", "precision": "bf16"}, {}),
        "cp2": ({"cp": 2}, {}),
        "cp2-ring-dropout": ({"cp": 2, "cp_mode": "ring"}, {"dropout": 0.1}),
        "cp2-alltoall": ({"cp": 2, "cp_mode": "alltoall"}, {}),
        "ep2": ({"dp_replicate": 2, "ep": 2}, {"n_experts": 4, "top_k": 2}),
        "ep2-zero3-hot": (
            {"dp_shard": 2, "ep": 2, "zero": 3},
            {"n_experts": 4, "top_k": 1},
            {"rebalance_every": 1},
        ),
        "dp2-ring": ({"dp_replicate": 2, "allreduce": "ring"}, {}),
        "dp2-butterfly-hybrid-zero1": ({"dp_replicate": 2, "zero": 1, "allreduce": "butterfly"}, {}),
        "zero3-offload-params": ({"dp_shard": 2, "zero": 3, "offload_params": "cpu"}, {}),
        "ps-colocated": ({"dp_replicate": 2, "dp_mode": "ps", "ps_shards": 2}, {}),
    },
    4: {
        "hybrid-zero3": ({"dp_replicate": 2, "dp_shard": 2, "zero": 3}, {}),
        "tp2-pp2": ({"tp": 2, "pp": 2, "sp": True}, {}),
        "cp2-tp2": ({"cp": 2, "tp": 2}, {}),
        "ep2-dp4-bf16": ({"dp_replicate": 4, "ep": 2, "precision": "bf16"}, {"n_experts": 4, "top_k": 2}),
        "zero3-zeropp": (
            {
                "dp_shard": 4,
                "zero": 3,
                "zeropp_qwz": True,
                "zeropp_hpz": True,
                "zeropp_qgz": True,
                "hpz_group": 2,
            },
            {},
        ),
        "hybrid-zero3-tree": ({"dp_replicate": 2, "dp_shard": 2, "zero": 3, "allreduce": "tree"}, {}),
    },
}


def _sentinel_layouts(world: int) -> dict[str, str]:
    from tests.helpers import train_layout

    out = {}
    for name, (layout, model_kw, *moe_kw) in SENTINEL_LAYOUTS[world].items():
        try:
            train_layout(layout, 2, 8, 2, model_kw, sentinel=True, moe_kw=moe_kw[0] if moe_kw else None)
            out[name] = "ok"
        except Exception as e:  # noqa: BLE001 - reported per layout
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_layouts_create_tensors_on_the_mesh_device_only(pools, world) -> None:
    """Construction and two steps of each layout with the meta device as torch's default device:
    a tensor made without the mesh's device (on the CPU, by default, in a GPU run) fails there,
    in a collective (strict mode) or in an op mixing devices."""
    for per_rank in pools(world).run(_sentinel_layouts, world):
        assert per_rank == dict.fromkeys(SENTINEL_LAYOUTS[world], "ok")


def _default_device_bug() -> str:
    """A gradient-norm fallback made on the default device, as the pipeline's was."""
    import torch
    import torch.distributed as dist

    from loom import comm

    with torch.device("meta"):
        try:
            comm.all_reduce(torch.zeros(()), dist.group.WORLD)
        except comm.StrictCommError as e:
            return str(e)
    return "not caught"


def test_sentinel_catches_a_default_device_tensor(pools) -> None:
    for msg in pools(2).run(_default_device_bug):
        assert "not on the group's device" in msg and "meta" in msg


# ----------------------------------------------------------------------------- findings, each with its test


def _buckets_completed_in_rank_dependent_order(stage: int) -> list[int]:
    """Every bucket's gradients arrive, in opposite orders on the two ranks (as when an expert gets
    no tokens on one rank): the reductions must still be issued in one order everywhere, which the
    pool's order comparison checks after this call."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from loom.parallel.data.strategy import DataParallel

    model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(4)))
    for i, m in enumerate(model):  # distinct sizes: a misordered pair of all-reduces is visible
        m.weight = nn.Parameter(torch.ones(64 + i, 64))
    if stage == 0:
        sync = DataParallel(model, dist.group.WORLD, bucket_mb=0.01)
    else:
        from functools import partial

        from loom.config import TrainConfig
        from loom.optim.flat import build_flat_optimizer
        from loom.optim.store import StateStore
        from loom.parallel.zero.stage12 import ZeroDataParallel

        make_optimizer = partial(
            build_flat_optimizer, store=StateStore(torch.device("cpu")), train_cfg=TrainConfig()
        )
        sync = ZeroDataParallel(model, 2, None, dist.group.WORLD, make_optimizer, bucket_mb=0.01)
    params = list(model.parameters())
    order = params if dist.get_rank() == 0 else params[::-1]
    for p in order:
        p.grad = torch.full_like(p, 1.0 + dist.get_rank())
        sync._on_grad_ready(p)
    sync.finish_sync()
    launched = [r.bucket for r in sync.launch_log]
    sync.remove()
    return launched


@pytest.mark.parametrize("stage", [0, 2])
def test_reductions_issue_in_one_order_when_gradients_arrive_in_another(pools, stage):
    a, b = pools(2).run(_buckets_completed_in_rank_dependent_order, stage)  # order compared by the pool
    assert a == b == sorted(a)


def test_waits_on_an_accelerator_have_no_cpu_timeout(monkeypatch):
    """On a GPU ``wait`` only orders the stream; a timeout there would block the CPU instead."""
    from datetime import timedelta

    import torch

    from loom import comm

    seen = []

    class Work:
        def wait(self, *args):
            seen.append(args)

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    comm.wait(Work(), timedelta(seconds=5))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    comm.wait(Work(), timedelta(seconds=5))
    assert seen == [(), (timedelta(seconds=5),)]
