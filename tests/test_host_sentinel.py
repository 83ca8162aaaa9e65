"""The host-tensor sentinel of strict mode (issue 32, item 2) and the host/device crossings it guards
(findings 1 and 8): a host store's tensor handed to a collective fails in one line naming the call
site; pp2 x ZeRO-3 x offload_params x tied embeddings exchanges its tied gradient and reduces its
norm on the device and equals one process; activation offload prefetches the next saved tensor;
parameter offload's gradient shard and ``grads32`` cross to pinned host memory without blocking."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from tests.helpers import ADAM_STATE_TOL, one_thread, tiny_model, tiny_train, train_dp, train_layout  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS, BATCH, MICRO = 3, 8, 2
PP_OFFLOAD = {"pp": 2, "dp_shard": 2, "zero": 3, "offload_params": "cpu"}  # tiny_model ties its embeddings


# ----------------------------------------------------------------------------- the sentinel


def _direct_misuse() -> dict[str, str]:
    """A host store's tensor (and a view of it) handed to an all-reduce and to a point-to-point; the
    same through ``all_reduce_via``, which copies it (the sum is checked)."""
    import torch.distributed as dist

    from loom import comm
    from loom.optim.store import HostStore

    rank = dist.get_rank()
    shard = HostStore(torch.device("cpu")).zeros(6, "grad0")
    shard.fill_(rank + 1.0)
    out = dict.fromkeys(("all_reduce", "send/recv"), "not caught")
    try:
        comm.all_reduce(shard[2:5], dist.group.WORLD)
    except comm.StrictCommError as e:
        out["all_reduce"] = str(e)
    try:
        comm.batch_p2p([(shard, 1 - rank)], [], dist.group.WORLD)
    except comm.StrictCommError as e:
        out["send/recv"] = str(e)
    comm.all_reduce_via(shard, dist.group.WORLD, torch.device("cpu"))
    out["via"] = shard.tolist()
    return out


def test_sentinel_names_the_collective_and_the_caller(pools):
    for r in pools(2).run(_direct_misuse):
        for what in ("all_reduce", "send/recv"):
            msg = r[what]
            assert msg.startswith(f"{what} called from test_host_sentinel.py:"), msg
            assert "_direct_misuse" in msg and "host memory of the cpu store's 'grad0'" in msg, msg
            assert "\n" not in msg
        assert r["via"] == [3.0] * 6  # 1 + 2: the copy crossed, the store's tensor got the sum


def _old_tied_exchange() -> str:
    """Finding 1's configuration, one step, then the tied gradient handed to the point-to-point as
    ``exchange_tied_grad`` did before the fix (the ZeRO shard of the tied matrix, in the host store)."""
    from loom import comm
    from loom.parallel.pipeline.strategy import PipelineStrategy
    from tests import helpers

    built = []
    real = PipelineStrategy.__init__

    def keep(self, *args, **kwargs):
        real(self, *args, **kwargs)
        built.append(self)

    PipelineStrategy.__init__ = keep  # type: ignore[method-assign]
    try:
        helpers.train_layout(PP_OFFLOAD, 1, BATCH, MICRO)
    finally:
        PipelineStrategy.__init__ = real  # type: ignore[method-assign]
    strategy = built[-1]
    pipe, grad = strategy.pipe, strategy._tied_grad()
    assert grad is not None and grad.numel() > 0
    peer = (pipe.n_stages - 1) % pipe.p if pipe.is_first else 0
    group, peer = pipe.link(pipe.rank, peer)
    try:
        comm.batch_p2p([(grad, peer)], [], group)
    except comm.StrictCommError as e:
        return str(e)
    return "not caught"


def test_sentinel_catches_the_old_tied_exchange_of_finding_1(pools):
    """pp2 x ZeRO-3 (dp_shard 2) x offload_params = cpu x tied embeddings: the tied matrix's gradient
    shard lives in the host store; the point-to-point the old exchange posted fails, naming it."""
    for msg in pools(4).run(_old_tied_exchange):
        assert msg.startswith("send/recv called from test_host_sentinel.py:"), msg
        assert "host memory of the cpu store's 'grad" in msg, msg


# ----------------------------------------------------------------------------- finding 1


def _pp_zero3_offload() -> dict:
    return train_layout(PP_OFFLOAD, STEPS, BATCH, MICRO)


def test_pp2_zero3_offload_params_tied_equals_single_process(pools):
    """Finding 1's layout under strict mode and the sentinel: the tied gradient is exchanged and the
    norm reduced through device copies, and every rank equals one process (losses, weights, and the
    two tied copies bitwise equal)."""
    ref = train_dp(None, tiny_model(), tiny_train(steps=STEPS), BATCH, BATCH)
    results = pools(4).run(_pp_zero3_offload)
    for r in results:
        assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-5)
    states = [r["state"] for r in results if r["state"] is not None]
    assert states
    for state in states:
        for k, v in ref["state"].items():
            assert_close(state[k], v, **ADAM_STATE_TOL, msg=lambda m, k=k: f"{k}: {m}")
        assert torch.equal(state["output.weight"], state["tok_embeddings.weight"])


# ----------------------------------------------------------------------------- finding 8: offload


def _offload_step(offloader, micro_batches: int, counter=None) -> tuple[list[float], dict, int]:
    """Forward and backward of ``micro_batches`` micro-batches of the tiny model (4 blocks) with the
    saved activations offloaded (or not): losses, gradients, unpacks of offloaded tensors."""
    from loom.memory.compress import SavedActivations
    from loom.model.llama import build_model, loss_fn
    from tests.helpers import rank_micro_batches

    model = build_model(tiny_model(n_layers=4), 0)
    saved = SavedActivations(model, "none", offloader)
    losses = []
    for x, y in rank_micro_batches(0, 2 * micro_batches, 2, 0, 1):
        with saved:
            loss = loss_fn(model(x), y)
        if counter is not None:
            with counter:
                loss.backward()
        else:
            loss.backward()
        losses.append(loss.item())
    saved.remove()
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}, saved.offloaded


def test_activation_offload_prefetches_the_next_saved_tensor_and_equals_no_offload():
    """The offloader's CPU path (copies synchronous, no streams): gradients bitwise equal to no
    offload; per backward one unpack is copied on demand (the first): every other offloaded tensor
    was prefetched when one saved after it was unpacked, or reuses the copy of a recent unpack of
    its storage (measured on the tiny model: 59 prefetched, 25 reused); no host sync in backward
    (2 and 4 micro-batches alike) and nothing left in host memory after it."""
    from loom.device_sync import SyncCounter
    from loom.memory.activation_offload import HostOffloader

    ref_losses, ref_grads, _ = _offload_step(None, 2)
    off = HostOffloader(torch.device("cpu"), min_bytes=1024)
    losses, grads, left = _offload_step(off, 2)
    assert losses == ref_losses and left == 0
    for k, g in ref_grads.items():
        assert torch.equal(grads[k], g), k
    assert off.demand == 2 and off.prefetch_hits > 20 * off.demand  # one demand copy per backward
    syncs = []
    for m in (2, 4):
        counter = SyncCounter(host=())
        _offload_step(HostOffloader(torch.device("cpu"), min_bytes=1024), m, counter)
        syncs.append(counter.count)
    assert syncs == [0, 0]


def _offload_syncs() -> dict:
    from tests.test_sync_budget import _both

    return {
        name: _both(layout, None, None)
        for name, layout in (
            ("zero3-offload-params", {"dp_shard": 2, "zero": 3, "offload_params": "cpu"}),
            ("zero2-offload", {"dp_shard": 2, "zero": 2, "offload": "cpu"}),
        )
    }


def test_offload_adds_no_sync_per_micro_batch(pools):
    """ZeRO-3 with offload_params = cpu and ZeRO-2 with the optimizer state on the host: the same
    syncs with 2 and 4 micro-batches (none per micro-batch) and the step's budget (the norm read
    once, the loss logged once), as without offload (tests/test_sync_budget.py)."""
    from tests.test_sync_budget import STEP_BUDGET

    for per_rank in pools(2).run(_offload_syncs):
        for name, (two, four) in per_rank.items():
            assert two == four, f"{name}: syncs inside the micro-batch loop: {two} vs {four}"
            assert sum(four.values()) == STEP_BUDGET, (name, four)
