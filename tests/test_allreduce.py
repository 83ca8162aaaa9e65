"""All-reduce on point-to-point (ring, tree, butterfly): equal to the backend's all-reduce, bit for
bit where the reduction order allows and to a single-process sum in the algorithm's stated order
always; rounds and bytes counted against the α-β formulas; training with each equal to native."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from loom.plan import collectives as model
from tests.dist import get_mesh
from tests.helpers import train_layout

SIZES = (4096, 1001)  # divisible by 2, 4 and 8 (the formulas), and not (uneven chunks)
CASES = [
    ("ring", 2),
    ("ring", 3),
    ("ring", 4),
    ("tree", 2),
    ("tree", 3),
    ("tree", 4),
    ("butterfly", 2),
    ("butterfly", 4),
]


def _inputs(world: int, numel: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Every rank's input (each rank can rebuild all of them: seeds by rank)."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(1000 * r + numel)
        x = torch.randn(numel, generator=g) * 10 ** (r % 3)  # magnitudes apart: the order shows in the bits
        out.append(x.to(dtype) if dtype.is_floating_point else (x * 1000).to(dtype))
    return out


def ordered_sum(algorithm: str, xs: list[torch.Tensor]) -> torch.Tensor:
    """The sum in the order each algorithm's module documents, in one process."""
    n = len(xs)
    if algorithm == "ring":  # chunk c: ((x_c + x_{c+1}) + ...) + x_{c-1}
        from loom.parallel.allreduce import split_bounds

        b, out = split_bounds(xs[0].numel(), n), torch.empty_like(xs[0])
        for c in range(n):
            acc = xs[c][b[c] : b[c + 1]].clone()
            for k in range(1, n):
                acc = acc + xs[(c + k) % n][b[c] : b[c + 1]]
            out[b[c] : b[c + 1]] = acc
        return out
    y = [x.clone() for x in xs]
    if algorithm == "tree":  # y_r += y_{r+d}, d = 1, 2, 4, ...
        d = 1
        while d < n:
            for r in range(0, n, 2 * d):
                if r + d < n:
                    y[r] = y[r] + y[r + d]
            d *= 2
        return y[0]
    m = n // 2  # butterfly: y_r = y_r + y_{r xor m}, m = N/2, ..., 1
    while m >= 1:
        y = [y[r] + y[r ^ m] for r in range(n)]
        m //= 2
    return y[0]


def _run(algorithm: str, world: int):
    import torch.distributed as dist

    from loom.comm import CommMeter
    from loom.parallel.allreduce import Trace, all_reduce

    group = get_mesh(dp_replicate=world).group("dp")
    rank = dist.get_rank(group)
    out = []
    for numel in SIZES:
        xs = _inputs(world, numel)
        ours, native = xs[rank].clone(), xs[rank].clone()
        trace, meter = Trace(), CommMeter()
        all_reduce(ours, group, algorithm, meter, trace=trace)
        dist.all_reduce(native, group=group)
        ints = _inputs(world, numel, torch.int64)
        ours_int, native_int = ints[rank].clone(), ints[rank].clone()
        all_reduce(ours_int, group, algorithm)
        dist.all_reduce(native_int, group=group)
        out.append(
            dict(
                numel=numel,
                ours=ours,
                native=native,
                ordered=ordered_sum(algorithm, xs),
                rounds=trace.rounds,
                sent=trace.sent,
                received=trace.received,
                metered=meter.moved["all_reduce"],
                ints_equal=torch.equal(ours_int, native_int),
            )
        )
    return out


def _expected_sent(algorithm: str, numel: int, world: int, rank: int) -> int:
    """Bytes (fp32) rank sends, counted exactly for uneven chunks too."""
    from loom.parallel.allreduce import split_bounds

    if algorithm == "ring":  # every chunk but (r+1) in the reduce-scatter, but (r+2) in the all-gather
        b = split_bounds(numel, world)
        size = [b[c + 1] - b[c] for c in range(world)]
        return 4 * (2 * numel - size[(rank + 1) % world] - size[(rank + 2) % world])
    if algorithm == "tree":
        return int(model.bytes_sent("tree", 4 * numel, world, rank))
    sent, lo, hi, m = 0, 0, numel, world // 2  # butterfly: the half given away, then the half kept
    while m >= 1:
        sent += 4 * (hi - lo)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if rank & m == 0 else (mid, hi)
        m //= 2
    return sent


@pytest.mark.parametrize("algorithm,world", CASES)
def test_equals_backend_and_formulas(pools, algorithm, world):
    results = pools(world).run(_run, algorithm, world)
    for i, numel in enumerate(SIZES):
        cells = [r[i] for r in results]
        for rank, c in enumerate(cells):
            # the stated reduction order, bit for bit; every rank the same bits
            assert torch.equal(c["ours"], c["ordered"]), f"{algorithm} rank {rank} n={numel}"
            assert torch.equal(c["ours"], cells[0]["ours"])
            if world == 2:  # a + b == b + a: any order gives the backend's bits
                assert torch.equal(c["ours"], c["native"])
            else:  # gloo's own order differs: ring from rank c (ring), pairs (tree, butterfly)
                assert_close(c["ours"], c["native"], rtol=1e-5, atol=1e-4)
            assert c["ints_equal"], "int64 sums are exact in any order"
            # bytes sent per rank, counted, equal the formula; the meter records the count
            assert c["sent"] == _expected_sent(algorithm, numel, world, rank)
            assert c["metered"] == c["sent"]
            if numel % world == 0 and algorithm != "tree":
                assert (
                    c["sent"]
                    == 2 * (world - 1) / world * numel * 4
                    == model.bytes_sent(algorithm, 4 * numel, world, rank)
                )
            # rounds: ring 2(N-1) and butterfly 2 log2 N on every rank; tree 2 (1 + children) (root: 2 ceil(log2 N))
            if algorithm == "tree":
                assert c["rounds"] == 2 * ((rank != 0) + model.children(rank, world))
            else:
                assert c["rounds"] == model.rounds(algorithm, world)
        assert max(c["rounds"] for c in cells) == model.rounds(algorithm, world)
        assert sum(c["sent"] for c in cells) == sum(c["received"] for c in cells)
        if algorithm == "tree":  # 2 (N-1) whole tensors in all
            assert sum(c["sent"] for c in cells) == 2 * (world - 1) * numel * 4


def test_butterfly_refuses_other_group_sizes():
    from loom.config import ConfigError, LoomConfig, validate

    cfg = LoomConfig()
    cfg.parallel.allreduce = "butterfly"
    cfg.train.global_batch, cfg.train.micro_batch = 24, 1
    with pytest.raises(ConfigError) as e:
        validate(cfg, 3)
    assert str(e.value).startswith(
        "parallel.allreduce: butterfly (recursive halving-doubling) needs a power-of-two "
        "group, but gradients are all-reduced over dp*cp = 3 ranks"
    )
    assert "\n" not in str(e.value)
    for world, zero, dp_shard in ((4, 0, 1), (6, 1, 3), (3, 1, 3)):  # groups of 4, 2 and 1 ranks
        cfg = LoomConfig()
        cfg.parallel.allreduce, cfg.parallel.zero, cfg.parallel.dp_shard = "butterfly", zero, dp_shard
        cfg.train.global_batch, cfg.train.micro_batch = 24, 1
        validate(cfg, world)
    for algorithm in ("ring", "tree", "native"):
        cfg = LoomConfig()
        cfg.parallel.allreduce = algorithm
        cfg.train.global_batch, cfg.train.micro_batch = 24, 1
        validate(cfg, 3)


def test_alpha_beta_model_by_hand():
    """Hand computation: α = 10 µs, β = 1 ns/byte (1 GB/s), S = 1 MB = 2^20 bytes."""
    a, b, s = 1e-5, 1e-9, float(2**20)
    # ring, N = 4: 6 rounds, 2·3/4·S = 1.5 S bytes
    assert model.time("ring", s, 4, a, b) == pytest.approx(6e-5 + 1.5 * 2**20 * 1e-9)
    assert model.time("native", s, 4, a, b) == model.time("ring", s, 4, a, b)
    # tree, N = 4: L = 2, 4 rounds of a whole message: 4 (α + S β); N = 3: L = 2 as well, N = 5: L = 3
    assert model.time("tree", s, 4, a, b) == pytest.approx(4 * (1e-5 + 2**20 * 1e-9))
    assert model.time("tree", s, 3, a, b) == model.time("tree", s, 4, a, b)
    assert model.time("tree", s, 5, a, b) == pytest.approx(6 * (1e-5 + 2**20 * 1e-9))
    # butterfly, N = 8: 2·3 = 6 rounds, 2·7/8 S = 1.75 S bytes
    assert model.time("butterfly", s, 8, a, b) == pytest.approx(6e-5 + 1.75 * 2**20 * 1e-9)
    assert model.time("ring", s, 1, a, b) == 0.0
    # the binomial tree of 8: rank 0 has children 1, 2, 4; rank 4 has 5, 6; rank 6 has 7; odd ranks none
    assert [model.children(r, 8) for r in range(8)] == [3, 0, 1, 0, 2, 0, 1, 0]
    assert [model.children(r, 3) for r in range(3)] == [2, 0, 0]
    with pytest.raises(ValueError, match="power-of-two"):
        model.time("butterfly", s, 6, a, b)
    # crossover ring vs tree at N = 8: ring 14 α + 1.75 S β, tree 6 α + 6 S β: equal at S = 8α / (4.25 β)
    cross = 8 * a / (4.25 * b)
    assert model.time("ring", cross, 8, a, b) == pytest.approx(model.time("tree", cross, 8, a, b))


def test_fit_recovers_alpha_beta():
    a, b = 3e-5, 2e-10
    points = [(n, s, model.time("butterfly", s, n, a, b)) for n in (2, 4, 8) for s in (1e3, 1e5, 1e7, 6.4e7)]
    ab = model.fit("butterfly", points)
    assert ab.alpha == pytest.approx(a) and ab.beta == pytest.approx(b) and ab.max_rel_error < 1e-9
    noisy = [(n, s, t * (1.1 if i % 2 else 0.9)) for i, (n, s, t) in enumerate(points)]
    assert model.fit("butterfly", noisy).max_rel_error == pytest.approx(0.1, abs=0.02)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "butterfly"])
def test_dp2_training_equals_native(pools, algorithm):
    """dp = 2: the two-rank sum is order-free, so losses and weights are bit for bit native's."""
    layout = dict(dp_replicate=2)
    native, ours = pools(2).run(_train_pair, layout, algorithm)[0]
    assert f"all_reduce[{algorithm}]" in ours["issued"] and f"all_reduce[{algorithm}]" not in native["issued"]
    assert ours["losses"] == native["losses"]
    for k, v in native["state"].items():
        assert torch.equal(ours["state"][k], v), k
    # the meter counts what was sent: 2 (N-1)/N of the gradients (ring, butterfly), N = 2: the whole once
    moved = [m["all_reduce"] for m in ours["moved"]]
    assert moved == [m["all_reduce"] for m in native["moved"]]


@pytest.mark.parametrize("zero,algorithm", [(1, "butterfly"), (3, "tree")])
def test_zero_hybrid_replicas_use_the_algorithm(pools, zero, algorithm):
    """ZeRO sharded over 2 ranks, gradient shards all-reduced across 2 replicas with ``algorithm``:
    equal to native, bit for bit (two replicas: order-free)."""
    layout = dict(dp_replicate=2, dp_shard=2, zero=zero)
    for native, ours in pools(4).run(_train_pair, layout, algorithm):
        assert (
            f"all_reduce[{algorithm}]" in ours["issued"]
            and f"all_reduce[{algorithm}]" not in native["issued"]
        )
        assert_close(torch.tensor(ours["losses"]), torch.tensor(native["losses"]), rtol=0, atol=0)
        for k, v in native["state"].items():
            assert torch.equal(ours["state"][k], v), k


def _train_pair(layout: dict, algorithm: str):
    """Native and ``algorithm`` runs; each says which gradient all-reduces it issued (strict mode's log)."""
    from loom import comm

    out = []
    for name in ("native", algorithm):
        comm.take_order_log()
        run = train_layout(layout | dict(allreduce=name), steps=3, batch=8, micro=2)
        run["issued"] = sorted(
            {
                op.split("(")[0]
                for ops in comm.take_order_log().values()
                for op in ops
                if op.startswith("all_reduce")
            }
        )
        out.append(run)
    return tuple(out)


def test_planner_times_the_gradient_all_reduce_by_its_algorithm():
    """The planner's data-parallel all-reduce follows parallel.allreduce: ring costs what the backend's
    (modelled as a ring) does; tree and butterfly their α-β times with the link's latency and bandwidth,
    every bucket call paying its rounds' latency."""
    from dataclasses import replace

    from loom.plan import collectives
    from loom.plan.cost import CostModel, Workload
    from loom.plan.hardware import ClusterSpec
    from tests.helpers import tiny_model

    model = tiny_model(vocab_size=512)
    cluster = ClusterSpec.single_node("a100-80g", 8)
    work = Workload(64, 64, precision="fp32", bucket_bytes=2**16)

    def dp_time(algorithm: str) -> float:
        cm = CostModel(model, replace(work, allreduce=algorithm), cluster)
        return cm._dp_volume(8, 1, 1, 1, 1, 1, 0, 1, 8)

    cm = CostModel(model, work, cluster)
    size = cm._params_on(1, 1, 1, True, True)[0] * cm.R
    calls = -(-int(size) // int(work.bucket_bytes))
    alpha, beta = cm.machine.alpha_beta(8, 8)
    assert dp_time("ring") == pytest.approx(dp_time("native"), rel=1e-12)
    for algorithm in ("tree", "butterfly"):
        want = (
            collectives.time(algorithm, size, 8, alpha, beta)
            + (calls - 1) * collectives.rounds(algorithm, 8) * alpha
        )
        assert dp_time(algorithm) == pytest.approx(want, rel=1e-12)
