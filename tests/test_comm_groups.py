"""Communicators of a run (issue 32): ZeRO-3's all-gathers on a group of their own (finding 7)."""

from __future__ import annotations

import pytest

from tests.helpers import tiny_model, tiny_train

# --- finding 7: ZeRO-3's all-gathers and reduce-scatters on two communicators ----------------------


def _zero3_step_groups(offload_params: str) -> dict:
    """One ZeRO-3 step on 2 ranks (dp_shard 2) through build_run; per collective, the groups
    ``(name, global ranks)`` it ran on (loom.comm's per-group log, strict mode)."""
    from loom.comm import CommMeter, take_order_log
    from loom.config import LoomConfig
    from loom.model.llama import build_model
    from loom.train.build import build_run
    from loom.train.step import train_step
    from tests.dist import get_mesh
    from tests.helpers import SEQ, rank_micro_batches

    mesh = get_mesh(dp_shard=2)
    cfg = LoomConfig(model=tiny_model(), train=tiny_train(steps=1))
    cfg.data.seq_len, cfg.parallel.dp, cfg.parallel.dp_shard, cfg.parallel.zero = SEQ, 2, 2, 3
    cfg.parallel.offload_params = offload_params
    cfg.train.global_batch, cfg.train.micro_batch = 4, 2
    run = build_run(cfg, mesh, build_model(cfg.model, cfg.train.seed), CommMeter())
    take_order_log()  # what building did
    batches = rank_micro_batches(0, 4, 2, mesh.local_rank("dp"), 2)
    train_step(run, batches, cfg.train.grad_clip, cfg.train.lr, mesh.group("dp_cp"))
    log = take_order_log()
    run.strategy.remove()
    ops: dict[str, set] = {}
    for key, calls in log.items():
        for call in calls:
            ops.setdefault(call.split("(")[0], set()).add(key)
    shard = mesh.group("dp_shard_cp")
    return {"ops": ops, "shard": shard.group_name, "twin": mesh.twin("dp_shard_cp").group_name}


@pytest.mark.parametrize("offload_params", ["none", "cpu"])
def test_zero3_gathers_and_reduce_scatters_use_two_groups(pools, offload_params):
    """Every all-gather of a ZeRO-3 step runs on the sharding group's twin, every reduce-scatter on
    the sharding group: same members (global ranks 0 and 1), two communicators (on NCCL two streams,
    so a prefetch all-gather does not queue behind a reduce-scatter)."""
    for r in pools(2).run(_zero3_step_groups, offload_params):
        assert r["shard"] != r["twin"]
        assert r["ops"]["all_gather"] == {(r["twin"], (0, 1))}, r
        assert r["ops"]["reduce_scatter"] == {(r["shard"], (0, 1))}, r
