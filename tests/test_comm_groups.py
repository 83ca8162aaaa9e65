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


# --- finding 9(b): one world-spanning gloo group (the control group) --------------------------------

RUN = {
    "model": {"dim": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 32},
    "data": {"seq_len": 32, "vocab_size": 384, "max_corpus_mb": 0.3},
    "train": {"steps": 5, "global_batch": 4, "micro_batch": 2, "warmup_steps": 1, "log_every": 1},
    "run": {"progress": False, "tensorboard": False, "threads": 1},
}
RUN["train"].update(eval_every=0, checkpoint_every=2, checkpoint_async=True, checkpoint_keep=0)


def _counted_trainer_run(cfg: dict) -> dict:
    """A 2-rank Trainer run (dp 2, asynchronous saves at steps 2 and 4) with ``dist.new_group``
    counted: the world-spanning gloo groups it makes, and which checkpoint each save committed when."""
    import torch.distributed as dist

    from loom import config as C
    from loom.train.trainer import RankEnv, Trainer

    rank, world = dist.get_rank(), dist.get_world_size()
    made: list[tuple] = []
    new_group = dist.new_group

    def counted(ranks=None, *args, **kwargs):
        made.append((None if ranks is None else tuple(sorted(ranks)), kwargs.get("backend")))
        return new_group(ranks, *args, **kwargs)

    dist.new_group = counted
    try:
        trainer = Trainer(C.from_dict(cfg), RankEnv(rank, world, rank, world))
        committed: list[int] = []
        poll = trainer.ckpts.poll

        def watched() -> None:
            poll()
            if trainer.ckpts.last_saved is not None and trainer.ckpts.last_saved[0] not in committed:
                committed.append(trainer.ckpts.last_saved[0])

        trainer.ckpts.poll = watched  # type: ignore[method-assign]
        try:
            trainer.fit()
        finally:
            trainer.heartbeat.close()
    finally:
        dist.new_group = new_group
    spanning = [backend for ranks, backend in made if ranks in (None, tuple(range(world)))]
    return {"gloo": spanning.count("gloo"), "committed": committed, "final": trainer.ckpts.last_saved[0]}


def test_one_world_spanning_gloo_group(pools, tmp_path_factory):
    """World-spanning gloo groups a 2-rank run makes = 1 (the control group; the checkpoint group is
    gone): asynchronous saves agree on it from the step loop, committed by a step-boundary poll
    (step 2's before step 4's save) and step 4's before the final save of step 5."""
    from tests.helpers import prepared_config, with_sections

    cfg = prepared_config(RUN, tmp_path_factory.mktemp("cache"))
    cfg = with_sections(cfg, run={"dir": str(tmp_path_factory.mktemp("run"))}, parallel={"dp": 2})
    for r in pools(2).run(_counted_trainer_run, cfg):
        assert r["gloo"] == 1, r
        assert r["committed"][:1] == [2] and r["final"] == 5, r
