"""Stage partitioner: optimal against brute force, memory limits, manual layouts."""

from __future__ import annotations

import random

import pytest

from loom.parallel.pipeline.partition import brute_force, parse_layout, partition, stage_sums


def _valid(bounds: list[int], n_layers: int, n_stages: int) -> bool:
    return (
        len(bounds) == n_stages + 1
        and bounds[0] == 0
        and bounds[-1] == n_layers
        and all(a < b for a, b in zip(bounds, bounds[1:]))  # contiguous, every stage non-empty
    )


def test_known_cut() -> None:
    assert partition([1, 1, 1, 1, 4], 2) == [0, 4, 5]
    assert partition([5, 1, 1, 1, 1, 1, 5], 3) == [0, 1, 6, 7]
    assert partition([3, 3, 3], 1) == [0, 3]
    assert partition([2, 7, 1], 3) == [0, 1, 2, 3]
    assert stage_sums([5, 1, 1, 1, 1, 1, 5], [0, 1, 6, 7]) == [5.0, 5.0, 5.0]


def test_matches_brute_force_on_random_unequal_costs() -> None:
    rng = random.Random(1234)
    for _ in range(300):
        n = rng.randint(1, 11)
        k = rng.randint(1, min(n, 6))
        costs = [rng.randint(1, 30) for _ in range(n)]
        bounds = partition(costs, k)
        assert _valid(bounds, n, k)
        assert max(stage_sums(costs, bounds)) == max(stage_sums(costs, brute_force(costs, k)))


def test_matches_brute_force_on_random_float_costs() -> None:
    rng = random.Random(7)
    for _ in range(100):
        n = rng.randint(2, 10)
        k = rng.randint(1, min(n, 5))
        costs = [rng.uniform(0.1, 3.0) for _ in range(n)]
        best = max(stage_sums(costs, brute_force(costs, k)))
        assert max(stage_sums(costs, partition(costs, k))) == pytest.approx(best, rel=1e-12)


def test_memory_limit_respected_and_optimal_among_feasible() -> None:
    rng = random.Random(99)
    feasible = infeasible = 0
    for _ in range(300):
        n = rng.randint(2, 10)
        k = rng.randint(1, min(n, 5))
        costs = [rng.randint(1, 20) for _ in range(n)]
        mem = [rng.randint(1, 10) for _ in range(n)]
        limit = rng.randint(max(mem), sum(mem))
        expected = brute_force(costs, k, mem, limit)
        if expected is None:
            infeasible += 1
            with pytest.raises(ValueError, match=r"do not fit in .* stages under mem_limit"):
                partition(costs, k, mem, limit)
            continue
        feasible += 1
        bounds = partition(costs, k, mem, limit)
        assert _valid(bounds, n, k)
        assert max(stage_sums(mem, bounds)) <= limit
        assert max(stage_sums(costs, bounds)) == max(stage_sums(costs, expected))
    assert feasible > 50 and infeasible > 10  # both branches exercised


def test_memory_limit_changes_the_cut() -> None:
    costs, mem = [1, 1, 1, 1, 4], [4, 4, 4, 4, 1]
    assert partition(costs, 2) == [0, 4, 5]
    bounds = partition(costs, 2, mem, mem_limit=13)  # 4 layers of 4 bytes do not fit in 13
    assert bounds == [0, 3, 5]
    assert max(stage_sums(mem, bounds)) <= 13


def test_infeasible_errors_are_one_line() -> None:
    with pytest.raises(ValueError, match=r"layer 2 alone needs 9 bytes > mem_limit 8") as info:
        partition([1, 1, 1], 2, mem=[1, 1, 9], mem_limit=8)
    assert "\n" not in str(info.value)
    with pytest.raises(
        ValueError, match=r"4 layers do not fit in 2 stages under mem_limit 5: the best cut needs 6"
    ):
        partition([1, 1, 1, 1], 2, mem=[3, 3, 3, 3], mem_limit=5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"costs": [1, 2], "n_stages": 3}, r"3 pipeline stages but only 2 layers"),
        ({"costs": [1, 2], "n_stages": 0}, r"at least one pipeline stage"),
        ({"costs": [1, -2], "n_stages": 1}, r"non-negative"),
        ({"costs": [1, 2], "n_stages": 1, "mem": [1, 1]}, r"give both mem .* and mem_limit"),
        ({"costs": [1, 2], "n_stages": 1, "mem": [1], "mem_limit": 4}, r"mem has 1 entries but costs has 2"),
    ],
)
def test_bad_partition_inputs(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        partition(**kwargs)


def test_parse_layout() -> None:
    assert parse_layout("0-3,4-7", 8, 2) == [0, 4, 8]
    assert parse_layout("0, 1-5, 6", 7, 3) == [0, 1, 6, 7]


@pytest.mark.parametrize(
    ("text", "n_layers", "n_stages", "message"),
    [
        ("0-3,5-7", 8, 2, r"stage 1 starts at layer 5, expected 4"),
        ("0-4,4-7", 8, 2, r"stage 1 starts at layer 4, expected 5"),
        ("1-3,4-7", 8, 2, r"stage 0 starts at layer 1, expected 0"),
        ("0-3,4-6", 8, 2, r"covers layers 0-6 but the model has 8 \(0-7\)"),
        ("0-3,4-9", 8, 2, r"covers layers 0-9 but the model has 8"),
        ("0-3,4-7", 8, 4, r"2 stages given, expected 4"),
        ("0-3,x-7", 8, 2, r"stage 1 'x-7' is not 'a-b' or 'a'"),
        ("0-3,7-4", 8, 2, r"stage 1 starts at layer 7, expected 4"),
        ("0-3,4-3", 8, 2, r"stage 1 range '4-3' is empty"),
    ],
)
def test_parse_layout_errors(text: str, n_layers: int, n_stages: int, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_layout(text, n_layers, n_stages)
    assert "\n" not in str(info.value)
