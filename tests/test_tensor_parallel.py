"""Tensor and sequence parallelism: primitives, layers, loss, full-model equality, DTensor parity,
activation accounting and configuration errors."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from loom.config import ConfigError, LoomConfig, ParallelConfig, validate
from loom.plan.cost import CostModel, Layout, Workload
from loom.plan.hardware import ClusterSpec
from tests.dist import get_mesh
from tests.helpers import SEQ, VOCAB, metered_steps, tiny_model, tiny_train, train_dp

BATCH, MICRO = 8, 4
TOL = dict(rtol=1e-4, atol=1e-5)
# Over 20 AdamW steps: m/(sqrt(v)+eps) turns the rounding of a near-zero gradient element (sums in
# another order across tp shards) into up to ~1e-5 of parameter difference; layers are held to TOL.
TRAIN_TOL = dict(rtol=1e-4, atol=5e-5)


def _ctx(tp: int, sp: bool = False, meter=None):
    from loom.parallel.tensor.shard import TPContext

    mesh = get_mesh(tp=tp)
    return TPContext(mesh.group("tp"), mesh.local_rank("tp"), tp, meter, sp)


def _same_everywhere(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _primitives(tp: int) -> None:
    """f, g, the sequence pair, and fused column-parallel matmul against their one-process meaning."""
    from loom.parallel.sequence import gather_seq, scatter_seq
    from loom.parallel.tensor.comm import copy_to_tp, reduce_from_tp
    from loom.parallel.tensor.layers import column_parallel_matmul

    ctx = _ctx(tp)
    r, group = ctx.rank, ctx.group
    B, T, H = 2, 4 * tp, 6
    per_rank = [_same_everywhere(B, T, H, seed=10 + i) for i in range(tp)]  # rank i's own tensor
    total = sum(per_rank)
    rows = slice(r * T // tp, (r + 1) * T // tp)

    # f: identity forward, all-reduce backward
    x = _same_everywhere(B, T, H).requires_grad_()
    y = copy_to_tp(x, group)
    assert_close(y, x)
    y.backward(per_rank[r])
    assert_close(x.grad, total)
    # g: all-reduce forward, identity backward
    x = per_rank[r].clone().requires_grad_()
    y = reduce_from_tp(x, group)
    assert_close(y, total)
    y.backward(per_rank[r] * 2)
    assert_close(x.grad, per_rank[r] * 2)
    # gather_seq: all-gather forward, reduce-scatter backward
    full = _same_everywhere(B, T, H, seed=1)
    x = full[:, rows].clone().requires_grad_()
    y = gather_seq(x, group)
    assert_close(y, full)
    y.backward(per_rank[r])
    assert_close(x.grad, total[:, rows])
    # scatter_seq: reduce-scatter forward, all-gather backward
    x = per_rank[r].clone().requires_grad_()
    y = scatter_seq(x, group)
    assert_close(y, total[:, rows])
    y.backward(full[:, rows])
    assert_close(x.grad, full)
    # fused column-parallel matmul (f or gather entry) against F.linear on the full weights
    w1, w2 = _same_everywhere(8 * tp, H, seed=2), _same_everywhere(4 * tp, H, seed=3)
    g1, g2 = _same_everywhere(B, T, 8 * tp, seed=4), _same_everywhere(B, T, 4 * tp, seed=5)
    xr = full.clone().requires_grad_()
    w1r, w2r = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    torch.autograd.backward((F.linear(xr, w1r), F.linear(xr, w2r)), (g1, g2))
    for sp in (False, True):
        ctx.sp = sp
        lw1 = w1.chunk(tp)[r].clone().requires_grad_()
        lw2 = w2.chunk(tp)[r].clone().requires_grad_()
        x = (full[:, rows] if sp else full).clone().requires_grad_()
        y1, y2 = column_parallel_matmul(x, (lw1, lw2), ctx)
        assert_close(y1, F.linear(full, w1).chunk(tp, -1)[r])
        assert_close(y2, F.linear(full, w2).chunk(tp, -1)[r])
        torch.autograd.backward((y1, y2), (g1.chunk(tp, -1)[r], g2.chunk(tp, -1)[r]))
        assert_close(x.grad, xr.grad[:, rows] if sp else xr.grad)
        assert_close(lw1.grad, w1r.grad.chunk(tp)[r])
        assert_close(lw2.grad, w2r.grad.chunk(tp)[r])


def _layers(tp: int) -> None:
    """Column -> row linear pair, vocab-parallel embedding, against the single-device modules."""
    from loom.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from loom.parallel.tensor.shard import sharded_param

    B, T, H, OUT = 2, 4 * tp, 8, 6 * tp
    full = _same_everywhere(B, T, H)
    w_in, w_out, table = (
        _same_everywhere(OUT, H, seed=1),
        _same_everywhere(H, OUT, seed=2),
        _same_everywhere(64, H, seed=3),
    )
    tokens = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(4))
    up = _same_everywhere(B, T, H, seed=5)
    xr, w_in_r, w_out_r, table_r = (t.clone().requires_grad_() for t in (full, w_in, w_out, table))
    ref = F.linear(F.linear(xr, w_in_r), w_out_r) + F.embedding(tokens, table_r)
    ref.backward(up)
    for sp in (False, True):
        ctx = _ctx(tp, sp)
        rows = slice(ctx.rank * T // tp, (ctx.rank + 1) * T // tp)
        col = ColumnParallelLinear(sharded_param(w_in, 0, ctx), ctx)
        row = RowParallelLinear(sharded_param(w_out, 1, ctx), ctx)
        emb = VocabParallelEmbedding(sharded_param(table, 0, ctx), ctx)
        x = (full[:, rows] if sp else full).clone().requires_grad_()
        y = row(col(x)) + emb(tokens)
        assert_close(y, ref[:, rows] if sp else ref)
        y.backward(up[:, rows] if sp else up)
        assert_close(x.grad, xr.grad[:, rows] if sp else xr.grad)
        assert_close(col.weight.grad, w_in_r.grad.chunk(tp, 0)[ctx.rank])
        assert_close(row.weight.grad, w_out_r.grad.chunk(tp, 1)[ctx.rank])
        assert_close(emb.weight.grad, table_r.grad.chunk(tp, 0)[ctx.rank])


def _cross_entropy(tp: int) -> None:
    from loom.parallel.tensor.parallelize import vocab_parallel_cross_entropy

    ctx = _ctx(tp)
    B, T, V = 3, 5, 16 * tp
    logits = (_same_everywhere(B, T, V) * 4).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    targets[0, :3] = -100  # ignored tokens
    targets[2, 4] = -100
    ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    ref.backward()
    local = logits.detach().chunk(tp, -1)[ctx.rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, ctx.group)
    assert_close(loss, ref.detach())
    loss.backward()
    assert_close(local.grad, logits.grad.chunk(tp, -1)[ctx.rank])


@pytest.mark.parametrize("tp", [2, 4])
def test_primitives_layers_and_loss(pools, tp):
    pools(tp).run(_primitives, tp)
    pools(tp).run(_layers, tp)
    pools(tp).run(_cross_entropy, tp)


def test_vocab_parallel_cross_entropy_single_rank():
    """Size-1 group: the same function is F.cross_entropy, including ignored tokens."""
    from loom.parallel.tensor.parallelize import vocab_parallel_cross_entropy

    logits = torch.randn(2, 7, 11)
    targets = torch.randint(0, 11, (2, 7))
    targets[1, ::2] = -100
    assert_close(
        vocab_parallel_cross_entropy(logits, targets, None),
        F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100),
    )


# ----------------------------------------------------------------------------- full model


def _train_tp(tp: int, dp: int, sp: bool, zero: int = 0, steps: int = 20):
    """Train the tiny model through ``parallelize`` on a tp x dp mesh; gather the final state."""
    from loom.comm import CommMeter
    from loom.model.llama import build_model
    from loom.parallel.state import gather_full_state
    from loom.train.build import parallelize

    mesh = get_mesh(tp=tp, dp_replicate=dp) if zero == 0 else get_mesh(tp=tp, dp_shard=dp)
    cfg = LoomConfig(
        model=tiny_model(), train=tiny_train(steps=steps), parallel=ParallelConfig(tp=tp, sp=sp, zero=zero)
    )
    cfg.data.seq_len = SEQ
    cfg.train.global_batch, cfg.train.micro_batch = BATCH, MICRO // dp
    validate(cfg, tp * dp)
    model = build_model(cfg.model, cfg.train.seed)
    meter = CommMeter()
    strategy = parallelize(model, mesh, cfg, meter).strategy
    losses, moved, calls = metered_steps(
        model, strategy, meter, mesh, cfg, model.loss_fn, steps, BATCH, MICRO // dp
    )
    moved = [sum(m.values()) for m in moved]
    with strategy.gathered() if zero == 3 else contextlib.nullcontext():  # ZeRO-3: whole tp shards
        state = gather_full_state(model, mesh.group("tp"))
    strategy.remove()
    return {"losses": losses, "state": state, "moved": moved, "calls": calls}


@pytest.fixture(scope="module")
def reference():
    return train_dp(None, tiny_model(), tiny_train(), BATCH, MICRO)


def _check_equal(results, reference) -> None:
    for r in results:
        assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), **TOL)
        assert r["state"].keys() == reference["state"].keys()
        for k, v in reference["state"].items():
            assert_close(r["state"][k], v, **TRAIN_TOL, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)])
def test_tp_equals_single_process(pools, reference, tp, sp):
    """20 steps (2 micro-batches each, clipping on): losses and gathered parameters equal the reference;
    bytes moved per step equal the formula (k micro-batches + the once-per-step partial sums)."""
    from loom.parallel.tensor.parallelize import comm_bytes_formula

    results = pools(tp).run(_train_tp, tp, 1, sp)
    _check_equal(results, reference)
    expected = comm_bytes_formula(tiny_model(), MICRO, SEQ, tp, sp, micro_batches=BATCH // MICRO)
    # the planner's count of collective calls (what sets the time of small layers) is Loom's
    planner = CostModel(
        tiny_model(), Workload(BATCH, SEQ, precision="fp32"), ClusterSpec.single_node("cpu", tp)
    )
    calls = planner.collective_calls(Layout(tp=tp, sp=sp, micro_batch=MICRO))
    for r in results:
        assert r["moved"] == [pytest.approx(expected)] * len(r["moved"])
        assert r["calls"] == [calls] * len(r["calls"])


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_tp2_dp2_equals_single_process(pools, reference, zero):
    """2D mesh tp=2 x dp=2 with sp: plain data parallel, or ZeRO-1/2/3 sharding over dp only; the
    collective calls per step are the planner's (tp per micro-batch + dp/ZeRO per bucket or unit)."""
    results = pools(4).run(_train_tp, 2, 2, True, zero)
    _check_equal(results, reference)
    planner = CostModel(
        tiny_model(), Workload(BATCH, SEQ, precision="fp32"), ClusterSpec.single_node("cpu", 4)
    )
    lay = Layout(dp=2, dp_shard=2 if zero else 1, tp=2, sp=True, zero=zero, micro_batch=MICRO // 2)
    for r in results:
        assert r["calls"] == [planner.collective_calls(lay)] * len(r["calls"])


# ----------------------------------------------------------------------------- dropout randomness


def _rng_streams():
    from loom.parallel.rng import private_rng

    rank = get_mesh(tp=2).local_rank("tp")
    torch.manual_seed(5)
    state = torch.get_rng_state()
    with private_rng(rank):
        inside = torch.rand(64)
    after = torch.rand(8)
    torch.set_rng_state(state)  # what recomputation does before replaying a region
    with private_rng(rank):
        again = torch.rand(64)
    return inside, after, again


def _replicas_with_dropout(sp: bool):
    """tp2 forward with dropout 0.3: the block outputs every rank holds (replicated without sp)."""
    from loom.model.llama import build_model
    from loom.train.build import parallelize

    mesh = get_mesh(tp=2)
    cfg = LoomConfig(model=tiny_model(dropout=0.3), parallel=ParallelConfig(tp=2, sp=sp))
    cfg.data.seq_len = SEQ
    model = build_model(cfg.model, 0)
    parallelize(model, mesh, cfg, None)
    outs = []
    model.layers[0].register_forward_hook(lambda m, a, y: outs.append(y.detach().clone()))
    torch.manual_seed(11)  # the same default stream on both ranks, as the trainer seeds it
    model.train()
    model(torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB)
    return outs[0]


def test_tp_dropout_masks_are_private_per_rank_and_replayable(pools):
    """Split activations draw rank-private masks, replayed exactly after restoring the default
    generator (recomputation); the shared stream advances alike, so replicated activations stay
    replicated through dropout."""
    (in0, after0, again0), (in1, after1, again1) = pools(2).run(_rng_streams)
    assert not torch.equal(in0, in1)
    assert torch.equal(after0, after1)
    assert torch.equal(in0, again0) and torch.equal(in1, again1)
    y0, y1 = pools(2).run(_replicas_with_dropout, False)
    assert torch.equal(y0, y1)  # hidden states replicated over tp stay bitwise equal


# ----------------------------------------------------------------------------- DTensor parity


def _dtensor_parity(tp: int, sp: bool) -> None:
    """One block, Loom TP vs torch's DTensor TP (ColwiseParallel/RowwiseParallel, + SequenceParallel)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from loom.model.llama import build_model
    from loom.parallel.partial import sum_partial_grads
    from loom.parallel.tensor.parallelize import parallelize_block

    mesh = get_mesh(tp=tp)
    full = build_model(tiny_model(), 3)
    cos, sin = full.rope_cos, full.rope_sin
    loom_block, torch_block = full.layers[0], build_model(tiny_model(), 3).layers[0]
    parallelize_block(loom_block, _ctx(tp, sp))
    out_layout = Shard(1) if sp else Replicate()
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=out_layout),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=out_layout),
    }
    if sp:
        plan |= {
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
                use_local_output=True,
            ),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
        }
    parallelize_module(torch_block, mesh.device_mesh["tp"], plan)
    x_full, up_full = _same_everywhere(2, SEQ, 32), _same_everywhere(2, SEQ, 32, seed=1)
    rows = slice(mesh.local_rank("tp") * SEQ // tp, (mesh.local_rank("tp") + 1) * SEQ // tp)
    x_in = x_full[:, rows] if sp else x_full
    outs, grads = [], []
    for block in (loom_block, torch_block):
        x = x_in.clone().requires_grad_()
        y = block(x, cos, sin)
        y.backward(up_full[:, rows] if sp else up_full)
        if block is loom_block:  # the norms' gradient parts, summed once per step as train_step does
            sum_partial_grads(block.parameters(), lambda p: p.grad)
        outs.append(y.detach())
        grads.append({"x": x.grad, **{n: p.grad for n, p in block.named_parameters()}})
    assert_close(outs[0], outs[1], **TOL)
    for name, g in grads[1].items():
        if hasattr(g, "to_local"):  # shards compare locally; Partial (norm weights under sp) once summed
            g = g.to_local() if isinstance(g.placements[0], Shard) else g.full_tensor()
        assert_close(grads[0][name], g, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("sp", [False, True])
def test_block_matches_dtensor_tp(pools, sp):
    pools(2).run(_dtensor_parity, 2, sp)


# ----------------------------------------------------------------------------- activation memory


def _activation_bytes(tp: int, sp: bool, batch: int) -> dict[int, int]:
    from loom.memory.activations import measure_layer_bytes
    from loom.model.llama import build_model
    from loom.parallel.tensor.parallelize import apply_tensor_parallel

    cfg = LoomConfig(model=tiny_model(), parallel=ParallelConfig(tp=tp, sp=sp))
    cfg.data.seq_len = SEQ
    model = build_model(cfg.model, 0)
    if tp > 1:
        apply_tensor_parallel(model, get_mesh(tp=tp), sp=sp)
    tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(0))
    return measure_layer_bytes(model, tokens)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_activation_bytes_equal_formula(pools, tp):
    """Saved-for-backward bytes per layer, measured with saved-tensor hooks, equal the derived formula."""
    from loom.memory.activations import activation_bytes_per_layer

    batch, cfg = 3, tiny_model()
    for sp in (False, True):
        expected = activation_bytes_per_layer(cfg, batch, SEQ, tp, sp)
        per_rank = (
            [_activation_bytes(1, sp, batch)] if tp == 1 else pools(tp).run(_activation_bytes, tp, sp, batch)
        )
        for measured in per_rank:
            assert measured == {i: expected for i in range(cfg.n_layers)}, (tp, sp)
    if tp > 1:  # with sp everything is divided by tp (but k, v heads replicated when k < tp: unrepeated,
        # each rank keeps its one kv head, 2·4·sb·d); without sp, only the attention/MLP interior
        replicated = 2 * 4 * batch * SEQ * cfg.head_dim * max(0, tp - cfg.n_kv_heads)
        assert activation_bytes_per_layer(cfg, batch, SEQ, tp, True) * tp == (
            activation_bytes_per_layer(cfg, batch, SEQ) + replicated
        )


# ----------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "model,parallel,seq,field",
    [
        (dict(dim=48, n_heads=6, n_kv_heads=2), dict(tp=4), SEQ, "model.n_heads"),
        (dict(dim=48, n_heads=6, n_kv_heads=3), dict(tp=2), SEQ, "model.n_kv_heads"),
        (dict(ffn_dim=99), dict(tp=2), SEQ, "model.ffn_dim"),
        # a vocabulary tp does not divide is padded (model.pad_vocab_to); an explicit padding must divide
        (dict(vocab_size=129, pad_vocab_to=130), dict(tp=4), SEQ, "model.pad_vocab_to"),
        (dict(vocab_size=129, pad_vocab_to=100), dict(tp=2), SEQ, "model.pad_vocab_to"),
        (dict(max_seq_len=32), dict(tp=4, sp=True), 30, "data.seq_len"),
    ],
)
def test_bad_shapes_rejected_before_start(model, parallel, seq, field):
    cfg = LoomConfig(model=tiny_model(**model), parallel=ParallelConfig(**parallel))
    cfg.data.seq_len = seq
    cfg.data.vocab_size = 4097
    cfg.train.global_batch, cfg.train.micro_batch = 8, 8
    with pytest.raises(ConfigError) as err:
        validate(cfg, parallel["tp"])
    msg = str(err.value)
    assert msg.startswith(field) and "\n" not in msg, msg


def test_kv_heads_replicated_when_they_divide_tp():
    cfg = LoomConfig(model=tiny_model(n_heads=8, n_kv_heads=2), parallel=ParallelConfig(tp=8))
    cfg.data.seq_len = SEQ
    cfg.train.global_batch, cfg.train.micro_batch = 8, 8
    validate(cfg, 8)  # 2 kv heads over 8 ranks: each kv head replicated on 4 ranks
