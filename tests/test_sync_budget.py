"""The host-sync budget per layout (issue 31, item 5): one training step per layout on 2 ranks with
:class:`loom.device_sync.SyncCounter` on, through ``build_run`` and ``train_step`` (the trainer's
path), with 2 and with 4 micro-batches. The syncs of the two steps are the same calls at the same
lines, so a micro-batch costs none, for dense DP, ZeRO-1/2/3, TP + SP, PP (1F1B), CP (each mode)
and Adafactor; the step's own budget is stated per layout. MoE under expert parallelism: one sync
per layer and micro-batch, its all-to-all size exchange (``.tolist()`` of the exchanged counts)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from loom.device_sync import SyncCounter
from tests.helpers import one_thread, train_layout  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
MICRO = 2
MOE = dict(n_experts=4, top_k=2)

# name: (layout, model options, [moe] options)
LAYOUTS = {
    "dp2": ({"dp_replicate": 2}, None, None),
    "zero1": ({"dp_shard": 2, "zero": 1}, None, None),
    "zero2": ({"dp_shard": 2, "zero": 2}, None, None),
    "zero3": ({"dp_shard": 2, "zero": 3}, None, None),
    "tp2+sp": ({"tp": 2, "sp": True}, None, None),
    "pp2-1f1b": ({"pp": 2, "schedule": "1f1b"}, None, None),
    "cp2-ring": ({"cp": 2, "cp_mode": "ring"}, None, None),
    "cp2-allgather": ({"cp": 2, "cp_mode": "allgather"}, None, None),
    "cp2-alltoall": ({"cp": 2, "cp_mode": "alltoall"}, None, None),
    "dp2-adafactor": ({"dp_replicate": 2, "optimizer": "adafactor"}, None, None),
    "zero2-adafactor": ({"dp_shard": 2, "zero": 2, "optimizer": "adafactor"}, None, None),
    "ep2": ({"dp_replicate": 2, "ep": 2}, MOE, None),
    "ep2-capacity-hot": ({"dp_replicate": 2, "ep": 2}, MOE, {"capacity_factor": 1.0, "hot_experts": 1}),
    "dp2-moe": ({"dp_replicate": 2}, MOE, {"capacity_factor": 1.0}),
}


def _step_syncs(layout: dict, model_kw: dict | None, moe_kw: dict | None, micro_batches: int) -> Counter:
    """The would-be host syncs, by call and line, of the second step of ``train_layout`` (the first
    builds the optimizer state) with ``micro_batches`` micro-batches per rank. Tensors that stay on
    the host on every device (torch optimizers' step counts) are not counted."""
    import loom.train.step as step_mod
    from loom.device_sync import optimizer_host_tensors

    plain, seen = step_mod.train_step, []

    def counted(run, batches, *args, **kwargs):
        if not seen:
            seen.append(None)
            return plain(run, batches, *args, **kwargs)
        opts = [o for o in vars(run.strategy).values() if isinstance(o, torch.optim.Optimizer)]
        host = [t for o in opts for t in optimizer_host_tensors(o)]
        with SyncCounter(host=host) as c:
            out = plain(run, batches, *args, **kwargs)
        seen.append(c.by_site())
        return out

    step_mod.train_step = counted
    try:
        dp = 1 if layout.get("dp_replicate", 1) * layout.get("dp_shard", 1) == 1 else 2
        kw = dict(model_kw=model_kw, moe_kw=moe_kw)
        train_layout(layout, 2, dp * MICRO * micro_batches, MICRO, **{k: v for k, v in kw.items() if v})
    finally:
        step_mod.train_step = plain
    return seen[-1]


def _both(layout, model_kw, moe_kw) -> tuple[Counter, Counter]:
    return _step_syncs(layout, model_kw, moe_kw, 2), _step_syncs(layout, model_kw, moe_kw, 4)


# the step's budget beyond the micro-batches: float(grad norm) in the clip, 1 to log the loss
STEP_BUDGET = 2


@pytest.mark.parametrize("name", [n for n in LAYOUTS if not n.startswith("ep")])
def test_no_sync_per_micro_batch(pools, name):
    """Dense DP, ZeRO-1/2/3, TP + SP, PP 1F1B, CP (ring, all-gather, all-to-all), Adafactor, MoE
    without expert parallelism (capacity drop included): the same syncs with 2 and 4 micro-batches
    (0 per micro-batch), and the step's budget: the gradient norm read once, the loss logged once; the
    pipeline also gathers its step's timeline of events once (``dist.gather_object``: 8 reads on its destination, 2 elsewhere)."""
    for two, four in pools(2).run(_both, *LAYOUTS[name]):
        assert two == four, f"syncs inside the micro-batch loop: {two} vs {four}"
        timeline = {site: n for site, n in four.items() if "pipeline/runtime.py" in site}
        if name.startswith("pp"):  # + one gather_object of the timeline (8 reads at rank 0, 2 else)
            assert len({site.split(" @ ")[1] for site in timeline}) == 1 and 0 < sum(timeline.values()) <= 8
        assert sum(four.values()) - sum(timeline.values()) == STEP_BUDGET, four


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n.startswith("ep")])
def test_expert_parallel_syncs_only_its_size_exchange(pools, name):
    """Expert parallelism (hot experts and capacity drop too): per micro-batch, one sync per MoE layer
    (the all-to-all size exchange, nowhere else), beside the step's budget."""
    layers = 2
    for two, four in pools(2).run(_both, *LAYOUTS[name]):
        extra = four - two
        assert sum(extra.values()) == 2 * layers, extra  # 2 more micro-batches x one per layer
        assert all("expert/parallelize.py" in site and site.startswith("tolist") for site in extra), extra
        assert sum(two.values()) == STEP_BUDGET + 2 * layers, two
