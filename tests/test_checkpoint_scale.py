"""Resume at scale: which files a rank touches and how many bytes it reads, against the formulas.

- verification (``integrity.assign``): rank r checks a contiguous 1/world of the manifest's
  bytes, so at 1,024 ranks no rank stats or hashes more than 3 files;
- replicated state over dp = n (``shared_read``): rank j reads Σ_t |share(t, j, n)| bytes, ≈ 1/n
  of the parameter + optimizer bytes, and all-gathers the rest; resumed under the layout that
  saved, that is exactly the file it wrote;
- rank-sharded state: a rank opens exactly the shard files whose pieces overlap its regions;
- a corrupted shard that a rank neither reads nor verifies still stops that rank, with the
  one-line message naming the file, before the model is touched.

File accesses are observed from outside the reader: ``os.stat``, ``open`` and safetensors'
``safe_open`` are wrapped while a rank loads, and every tensor read through ``safe_open`` is
counted in bytes.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
from pathlib import Path

import pytest
import torch

from loom.checkpoint import CheckpointError, CheckpointReader
from loom.checkpoint.integrity import CHUNK_BYTES, OPEN_COST, assign, chunk_tasks
from loom.checkpoint.regions import overlaps, share
from tests.dist import get_mesh
from tests.test_checkpoint import LAYOUTS, full_state, layout, save_virtual

# ----------------------------------------------------------------------------- instrumentation


class FileLog:
    """Files of ``root`` touched (stat, open, safe_open) and tensor bytes read through safe_open."""

    def __init__(self, root: Path) -> None:
        self.root, self.given = os.path.realpath(root), str(root)
        self.touched: set[str] = set()
        self.safetensors: set[str] = set()
        self.bytes_read = 0

    def _note(self, path) -> None:
        if isinstance(path, int):  # a file descriptor
            return
        p = os.path.abspath(os.fspath(path))  # no stat: this runs inside the wrapped os.stat
        if p.startswith(self.root) or p.startswith(os.path.abspath(self.given)):
            self.touched.add(os.path.basename(p))

    @contextlib.contextmanager
    def watching(self):
        import loom.checkpoint.load as load

        real_stat, real_open, real_safe_open = os.stat, builtins.open, load.safe_open
        log = self

        def stat(path, *a, **k):
            log._note(path)
            return real_stat(path, *a, **k)

        def open_(path, *a, **k):
            log._note(path)
            return real_open(path, *a, **k)

        class Counted:
            def __init__(self, handle) -> None:
                self.handle = handle

            def get_tensor(self, key):
                t = self.handle.get_tensor(key)
                log.bytes_read += t.numel() * t.element_size()
                return t

            def get_slice(self, key):
                part = self.handle.get_slice(key)

                class Slice:
                    def __getitem__(self, idx):
                        t = part[idx]
                        log.bytes_read += t.numel() * t.element_size()
                        return t

                return Slice()

        def safe_open(path, *a, **k):
            log._note(path)
            log.safetensors.add(Path(path).name)
            return Counted(real_safe_open(path, *a, **k))

        os.stat, builtins.open, io.open, load.safe_open = stat, open_, open_, safe_open
        try:
            yield self
        finally:
            os.stat, builtins.open, io.open, load.safe_open = real_stat, real_open, real_open, real_safe_open


def _shards(names) -> set[str]:
    return {n for n in names if n.startswith("shard-")}


# ----------------------------------------------------------------------------- verification split


def test_verification_of_1024_ranks_touches_at_most_three_files_per_rank():
    world, shard = 1024, 3 * CHUNK_BYTES + 12345  # 4 chunks per shard
    files = {
        f"shard-{r:05d}-of-{world:05d}.safetensors": {"bytes": shard, "sha256": ["x"] * 4}
        for r in range(world)
    }
    files["index.json"] = {"bytes": 40 << 20, "sha256": ["x"]}
    files["train_state.json"] = {"bytes": 20 << 20, "sha256": ["x"]}
    tasks = chunk_tasks(files)
    per_rank = [assign(tasks, r, world) for r in range(world)]
    assert sorted(t for mine in per_rank for t in mine) == sorted(tasks), "every chunk checked exactly once"
    weight = [sum(length + OPEN_COST for _, _, length, _ in mine) for mine in per_rank]
    mean = sum(weight) / world
    assert max(len({t[0] for t in mine}) for mine in per_rank) <= 3
    assert max(weight) <= mean + CHUNK_BYTES + OPEN_COST, "about 1/world of the bytes each"
    few = {
        "index.json": {"bytes": 10, "sha256": ["x"]},
        "shard-0": {"bytes": 5 * CHUNK_BYTES, "sha256": ["x"] * 5},
    }
    two = [assign(chunk_tasks(few), r, 8) for r in range(8)]  # fewer files than ranks: chunks spread
    assert sum(1 for mine in two if mine) >= 5


# ----------------------------------------------------------------------------- rank-sharded checkpoint


def _overlapping_files(ckpt: Path, state) -> set[str]:
    """The formula: files holding a piece that overlaps a wanted region (from the index)."""
    from loom.checkpoint import format as F

    index = F.read_json(ckpt / F.INDEX)
    files = F.check_index_header(index, ckpt)
    out = set()
    for name, st in state.items():
        shape, _, pieces = F.parse_entry(name, index["tensors"][name], files, ckpt)
        out |= {file for file, _, region in pieces if overlaps(region, st.region, shape)}
    return out


@pytest.mark.parametrize("saved", ["dp4xzero3", "pp2xtp2xdp2"])
def test_a_rank_opens_only_the_shards_overlapping_its_regions(tmp_path, saved):
    full = full_state(3)
    ckpt = save_virtual(tmp_path, layout(full, **LAYOUTS[saved]))
    zeros = {k: torch.zeros_like(v) for k, v in full.items()}
    for target in ("dp4xzero3", "pp2xtp2xdp2"):
        want = layout(full, **LAYOUTS[target])
        for r, st in enumerate(layout(zeros, **LAYOUTS[target])):
            expected = _overlapping_files(ckpt, st)
            log = FileLog(ckpt)
            with log.watching(), CheckpointReader(tmp_path) as reader:
                reader.fill(st)
            assert log.safetensors == reader.opened == expected, f"{saved} -> {target} rank {r}"
            n_files = len(list(ckpt.glob("shard-*")))
            assert saved != target or len(expected) <= n_files // 2, (
                "same layout: its stage's files, or fewer"
            )
            wanted = sum(p.local.numel() * p.local.element_size() for p in st.values())
            assert log.bytes_read == reader.bytes_read
            # the wanted elements; from a flat piece, also the rest of the rows holding them
            assert log.bytes_read == wanted if saved == target else wanted <= log.bytes_read <= 2 * wanted
            assert all(torch.equal(st[n].local, want[r][n].local) for n in st)


# ----------------------------------------------------------------------------- replicated: dp = 2 ranks


def _dp_strategy(seed: int, steps: int):
    from tests.test_checkpoint import _dp_model_and_strategy

    return _dp_model_and_strategy(seed=seed, group=get_mesh(dp_replicate=2).group("dp"), steps=steps)


def _dp_resume_measured(root: str):
    """dp=2 trains 2 steps and saves; a fresh dp=2 strategy resumes under a FileLog."""
    from loom.checkpoint import Checkpointer
    from loom.checkpoint.save import new_group
    from tests.test_checkpoint import _full_from

    rank = torch.distributed.get_rank()
    model, strategy = _dp_strategy(7, 2)
    group = new_group(2, 60)
    ck = Checkpointer(root, rank, 2, group)
    ck.save(2, strategy.sharded_state(), {"rank": rank}, {}, blocking=True)
    expected = _full_from(model, strategy.optimizer)
    fresh, s2 = _dp_strategy(99, 0)
    state = s2
    formula = sum(  # Σ_t |share(t, j, n)| bytes, over the parameters and their Adam state
        (p.numel if (p := share(st.region, st.global_shape, rank, 2)) else 0) * st.local.element_size()
        for st in state.sharded_state().values()
    )
    total = sum(st.local.numel() * st.local.element_size() for st in state.sharded_state().values())
    log = FileLog(Path(root))
    with log.watching(), CheckpointReader(root, rank, 2, group) as reader:
        state.load_sharded(reader)
    got = _full_from(fresh, s2.optimizer)
    same = sorted(got) == sorted(expected) and all(
        torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in expected.items()
    )
    return {
        "same": same,
        "bytes": log.bytes_read,
        "formula": formula,
        "total": total,
        "touched": sorted(log.touched),
        "safetensors": sorted(log.safetensors),
        "verified": reader.verified,
    }


def test_dp2_resume_reads_half_the_state_per_rank(pools, tmp_path):
    results = pools(2).run(_dp_resume_measured, str(tmp_path))
    for rank, res in enumerate(results):
        own = f"shard-{rank:05d}-of-00002.safetensors"
        assert res["same"], f"rank {rank}: the resumed state differs from the saved one"
        assert res["bytes"] == res["formula"], res
        assert abs(res["bytes"] - res["total"] / 2) <= 0.05 * res["total"], "about 1/2 of the state each"
        assert res["safetensors"] == [own], "under the saving layout a rank reads back its own file"
        assert _shards(res["touched"]) == {own}, f"rank {rank} touched {res['touched']}"
    verified = [set(r["verified"]) for r in results]
    assert not verified[0] & verified[1] and len(verified[0] | verified[1]) == 4, "each file checked once"


def _dp_resume_corrupted(root: str, victim: str):
    """Load a checkpoint whose ``victim`` shard is corrupted; report the error and the model's state."""
    from loom.checkpoint.save import new_group

    rank = torch.distributed.get_rank()
    fresh, s2 = _dp_strategy(99, 0)
    before = [p.detach().clone() for p in fresh.parameters()]
    log = FileLog(Path(root))
    error = None
    try:
        with log.watching(), CheckpointReader(root, rank, 2, new_group(2, 60)) as reader:
            s2.load_sharded(reader)
    except CheckpointError as e:
        error = str(e)
    untouched = all(torch.equal(a, p) for a, p in zip(before, fresh.parameters()))
    return error, untouched, victim in log.touched


def test_corrupted_shard_that_a_rank_never_reads_still_stops_it(pools, tmp_path):
    pools(2).run(_dp_resume_measured, str(tmp_path))  # saves step 2 (dp=2)
    ckpt = tmp_path / "step-00000002"
    victim = "shard-00001-of-00002.safetensors"
    data = bytearray((ckpt / victim).read_bytes())
    data[len(data) - 7] ^= 0x10  # inside the tensor bytes: only the hash can tell
    (ckpt / victim).write_bytes(bytes(data))
    (err0, untouched0, saw0), (err1, untouched1, saw1) = pools(2).run(
        _dp_resume_corrupted, str(tmp_path), victim
    )
    assert not saw0 and saw1, "rank 0 neither verifies nor reads shard 1: rank 1 does"
    for err, untouched in ((err0, untouched0), (err1, untouched1)):
        assert err is not None and "\n" not in err
        assert f"{ckpt / victim}: content altered" in err
        assert untouched, "nothing was loaded into the model"
    assert err0 == err1


# ----------------------------------------------------------------------------- ZeRO-2: parameters gathered, not read


def _zero2_resume_measured(root: str):
    """ZeRO-2 over dp=2 trains 2 steps and saves; a fresh ZeRO-2 resumes under a FileLog."""
    from loom.checkpoint import Checkpointer
    from loom.checkpoint.save import new_group
    from loom.model.llama import build_model
    from loom.train.build import data_parallel
    from tests.helpers import tiny_model
    from tests.test_checkpoint import _train, _zero_cfg

    mesh = get_mesh(dp_shard=2)
    rank, group = mesh.local_rank("dp"), mesh.group("dp")
    model = build_model(tiny_model(), 7)
    zero = data_parallel(model, mesh, _zero_cfg(2))
    _train(model, zero, range(2), rank, 2, group)
    ck = Checkpointer(root, torch.distributed.get_rank(), 2, new_group(2, 60))
    ck.save(2, zero.sharded_state(), {}, {})
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    other = build_model(tiny_model(), 99)
    zero2 = data_parallel(other, mesh, _zero_cfg(2))
    state = zero2
    formula = sum(st.local.numel() * st.local.element_size() for st in state.sharded_state().values())
    total = 3 * 4 * sum(p.numel() for p in other.parameters())  # fp32 master + exp_avg + exp_avg_sq
    log = FileLog(Path(root))
    with log.watching(), CheckpointReader(root, torch.distributed.get_rank(), 2, ck.group) as reader:
        state.load_sharded(reader)
    same = all(torch.equal(other.state_dict()[k], v) for k, v in saved.items())
    return {"same": same, "bytes": log.bytes_read, "formula": formula, "total": total}


def test_zero2_resume_reads_only_its_shard_and_gathers_the_parameters(pools, tmp_path):
    for res in pools(2).run(_zero2_resume_measured, str(tmp_path)):
        assert res["same"], "the gathered parameters differ from the saved ones"
        assert res["bytes"] == res["formula"], res  # its ranges of master, m, v (+ step scalars): 12Φ/N
        assert abs(res["bytes"] - res["total"] / 2) <= 0.05 * res["total"], res
