"""Process groups at scale (issue 32, finding 9a): counted in one process standing in for one rank of a
large world (PyTorch's fake process group, backend "fake").

Before, every group was its own world-wide step: 2·pp·(world/pp) = 2·world pipeline link groups for
pp >= 3 and world/ep + (world/(dp·cp))·ep expert groups. Now each colouring (disjoint lists) is one
``dist.split_group`` where the backend splits (NCCL with a bound device): 2 colourings of links for
pp = 2, 4 for even pp, 6 for odd pp, whatever the world; 2 for the expert groups (ep, edp). Elsewhere
(gloo, the fake group) one ``new_group`` per list, exactly as many as before.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from loom import mesh as mesh_mod
from loom.mesh import ParallelDims, ParallelMesh, split_groups

CASES = [  # (dims, world): pp 2, 4 (even) and 3 (odd), expert parallel in each
    ParallelDims(pp=4, dp_shard=64, tp=4, ep=8),  # 1,024 ranks
    ParallelDims(pp=3, dp_shard=64, tp=4, ep=4),  # 768
    ParallelDims(pp=2, dp_replicate=2, dp_shard=64, tp=4, ep=16),  # 1,024
]


def link_colourings(pp: int) -> int:
    return 2 if pp == 2 else (4 if pp % 2 == 0 else 6)


def reference_links(dims: ParallelDims, rank: int) -> dict[tuple[int, int], list[int]]:
    """Before: this rank's link groups, one per ordered pair of neighbouring pipeline ranks."""
    line, pp, me = dims.group_ranks(rank, ("pp",)), dims.pp, dims.coords(rank)["pp"]
    pairs = {(i, j) for i in range(pp) for j in ((i + 1) % pp, (i - 1) % pp) if j != i}
    return {(s, d): sorted([line[s], line[d]]) for s, d in pairs if me in (s, d)}


def reference_expert(dims: ParallelDims, rank: int) -> tuple[list[int], list[int]]:
    """Before: the ep (consecutive) and edp (strided) groups of ``rank`` within its dp x cp box."""
    box = dims.group_ranks(rank, ("dp_replicate", "dp_shard", "cp"))
    i = box.index(rank)
    return box[i - i % dims.ep : i - i % dims.ep + dims.ep], box[i % dims.ep :: dims.ep]


@pytest.fixture
def fake_world():
    """``start(rank, world)``: this process as ``rank`` of a fake world (destroyed afterwards)."""

    def start(rank: int, world: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def counting(monkeypatch, split: bool) -> Counter:
    """Count ``new_group`` and ``split_group`` calls; with ``split``, stand in for NCCL's split: check
    the colouring (disjoint lists, every call the same on every rank) and return this rank's group."""
    calls: Counter = Counter()
    new_group = dist.new_group
    calls_lists: list[list[list[int]]] = []

    def counted_new_group(*args, **kwargs):
        calls["new_group"] += 1
        return new_group(*args, **kwargs)

    def fake_split(split_ranks, **kwargs):
        calls["split_group"] += 1
        flat = [r for ranks in split_ranks for r in ranks]
        assert len(flat) == len(set(flat)), "a colouring's lists must be disjoint"
        calls_lists.append([list(r) for r in split_ranks])
        mine = [ranks for ranks in split_ranks if dist.get_rank() in ranks]
        return new_group(mine[0]) if mine else None

    monkeypatch.setattr(dist, "new_group", counted_new_group)
    monkeypatch.setattr(dist, "split_group", fake_split)
    monkeypatch.setattr(mesh_mod, "can_split", lambda: split)
    calls.lists = calls_lists  # type: ignore[attr-defined]
    return calls


def members(group) -> list[int]:
    return dist.get_process_group_ranks(group)


@pytest.mark.parametrize("dims", CASES, ids=lambda d: f"pp{d.pp}-world{d.world_size}")
def test_split_colourings_count_and_members(dims, fake_world, monkeypatch):
    """Splitting: link + expert groups take link_colourings(pp) + 2 world-wide calls, not 2·world +
    world/ep·2; each rank's groups have the members the per-group construction gave, every link its
    own group; the colourings together hold every link of the world twice-directed, as before."""
    world = dims.world_size
    calls = counting(monkeypatch, split=True)
    for rank in (0, world // 2 + 5, world - 1):
        fake_world(rank, world)
        calls.clear()
        calls.lists.clear()  # type: ignore[attr-defined]
        m = ParallelMesh(dims)
        assert calls["split_group"] == link_colourings(dims.pp) + 2
        assert calls["new_group"] == 0
        links = m.pp_links()
        assert {k: members(g) for k, g in links.items()} == reference_links(dims, rank)
        assert len({id(g) for g in links.values()}) == len(links)  # one group per direction
        ep, edp = reference_expert(dims, rank)
        assert members(m.group("ep")) == ep and members(m.group("edp")) == edp
        assert m.local_rank("ep") == ep.index(rank) and m.local_rank("edp") == edp.index(rank)
    link_lists = calls.lists[2:]  # type: ignore[attr-defined]  # the last rank's, after ep and edp
    every = Counter(tuple(sorted(r)) for lists in link_lists for r in lists)
    lines = {tuple(dims.group_ranks(r, ("pp",))) for r in range(world)}
    expected = Counter(
        tuple(sorted([line[s], line[d]]))
        for line in lines
        for s, d in {(i, j) for i in range(dims.pp) for j in ((i + 1) % dims.pp, (i - 1) % dims.pp) if j != i}
    )
    assert every == expected


@pytest.mark.parametrize("dims", CASES[:2], ids=lambda d: f"pp{d.pp}-world{d.world_size}")
def test_without_split_one_new_group_per_group(dims, fake_world, monkeypatch):
    """gloo and the fake group cannot split: one new_group per group, as before (2·world links for
    pp >= 3, world/ep + (world/(dp·cp))·ep expert groups), the same members."""
    world = dims.world_size
    calls = counting(monkeypatch, split=False)
    fake_world(world - 3, world)
    m = ParallelMesh(dims)
    boxes = world // (dims.dp * dims.cp)
    assert calls["split_group"] == 0
    assert calls["new_group"] == 2 * world + world // dims.ep + boxes * dims.ep
    assert {k: members(g) for k, g in m.pp_links().items()} == reference_links(dims, world - 3)
    ep, edp = reference_expert(dims, world - 3)
    assert members(m.group("ep")) == ep and members(m.group("edp")) == edp


def test_fake_and_cpu_groups_do_not_split(fake_world):
    """The fake backend (like gloo) has no communicator splitting: split_groups falls back."""
    fake_world(1, 8)
    assert not mesh_mod.can_split()
    group = split_groups([[0, 1], [2, 3]], 1)
    assert members(group) == [0, 1]
    with pytest.raises(ValueError, match="disjoint"):
        split_groups([[0, 1], [1, 2]], 1)


def _sockets() -> int:
    """Sockets this process holds (its /proc/self/fd links to ``socket:``)."""
    import contextlib
    import os

    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return n


def _world_groups() -> tuple[int, int, int, bool, str | None]:
    """Sockets a plain world-spanning gloo group opens, then :func:`world_gloo_group` when made and
    after one broadcast; whether the broadcast arrived; the variable afterwards."""
    import os
    from datetime import timedelta

    import torch

    from loom.mesh import LAZY_GLOO, world_gloo_group

    s0 = _sockets()
    eager = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    s1 = _sockets()
    lazy = world_gloo_group(timedelta(seconds=60))
    s2 = _sockets()
    t = torch.tensor([float(dist.get_rank() + 7)])
    dist.broadcast(t, src=0, group=lazy)
    s3 = _sockets()
    dist.destroy_process_group(lazy)
    dist.destroy_process_group(eager)
    return s1 - s0, s2 - s1, s3 - s2, t.item() == 7.0, os.environ.get(LAZY_GLOO)


def test_world_gloo_groups_connect_only_the_pairs_they_use(pools):
    """Finding 9(b): the control and checkpoint groups span the world. Made eagerly, each rank opens
    a socket to every other (world - 1, besides its listener); made by ``world_gloo_group``, its
    listener, then the peers a broadcast reaches (a tree: log2(world) at most per rank; measured
    1 + 2, 1 + 2, 1 + 1, 1 + 1 on 4 ranks against 1 + 3 each; a peer may connect to a rank before it
    counts, so the two counts are judged together). The variable is not left set."""
    world = 4
    rows = pools(world).run(_world_groups)
    assert all(eager >= world - 1 for eager, *_ in rows), rows
    assert all(made + used <= 1 + (world - 1).bit_length() for _, made, used, *_ in rows), rows
    assert all(ok and left is None for *_, ok, left in rows), rows
    assert sum(made + used for _, made, used, *_ in rows) < sum(eager for eager, *_ in rows), rows
