"""Nothing outlives a training layout in its process: after the run's last reference is dropped,
no model, strategy or process group of it is alive (a long-lived process, a notebook or a sweep,
builds layout after layout). Every parameter holds its gradient hook where the garbage collector
cannot follow it; a hook holding its strategy kept the whole run, and each gloo group's threads
(waking every 10 ms), for the life of the process (loom.parallel.hooks)."""

from __future__ import annotations

import pytest

LAYOUTS = {
    "dp2": {"dp_replicate": 2},
    "dp2 zero1": {"dp_shard": 2, "zero": 1},
    "dp2 zero2": {"dp_shard": 2, "zero": 2},
    "dp2 zero3": {"dp_shard": 2, "zero": 3},
    "tp2 sp": {"tp": 2, "sp": True},
    "pp2": {"pp": 2},
    "ep2 zero3": {"dp_shard": 2, "ep": 2, "zero": 3},
}


def _live() -> dict[str, int]:
    import gc

    from loom.model.llama import Transformer
    from loom.parallel.base import StrategyBase
    from tests.dist import live_threads

    gc.collect()
    objects = gc.get_objects()
    return {
        "models": sum(isinstance(o, Transformer) for o in objects),
        "strategies": sum(isinstance(o, StrategyBase) for o in objects),
        "threads": sum(live_threads().values()),
    }


def _train_and_release(layout: dict) -> tuple[dict, dict]:
    from tests.dist import release_groups
    from tests.helpers import train_layout

    release_groups()
    before = _live()
    kw = {"n_experts": 4, "top_k": 2} if layout.get("ep", 1) > 1 else {}
    train_layout(layout, steps=2, batch=4, micro=2, model_kw=kw)
    release_groups()
    return before, _live()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_trained_layout_leaves_no_model_strategy_or_group_behind(pools, name):
    for before, after in pools(2).run(_train_and_release, LAYOUTS[name]):
        assert after == before, (before, after)  # models, strategies, threads: as many as before
