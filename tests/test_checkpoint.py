"""Checkpoint format: region geometry, resharding across layouts, integrity, atomicity, no pickle.

Layouts are simulated with *virtual ranks* in one process (each writes its shard exactly as a
real rank does: :func:`snapshot` + :func:`write_shard`, then rank 0's :func:`commit`), so
dp × ZeRO-3, tp, pp and pp × tp × dp (8 ranks) cost milliseconds; real multi-rank saves of the
strategies go through the gloo pool.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import socket
from pathlib import Path

import pytest
import torch

from loom.checkpoint import Box, Checkpointer, CheckpointError, CheckpointReader, ShardedTensor, find
from loom.checkpoint.protocol import Flat
from loom.checkpoint.regions import copy_region, flat_to_boxes
from loom.checkpoint.save import build_index, commit, snapshot, write_shard
from tests.dist import get_mesh
from tests.helpers import tiny_model

ROOT = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------- geometry


def test_flat_ranges_cut_into_contiguous_boxes():
    rng = random.Random(0)
    for _ in range(500):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        n = int(torch.tensor(shape).prod())
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        g = torch.arange(n).view(shape)
        boxes = flat_to_boxes(a, b - a, shape)
        assert sum(bx.numel for _, bx in boxes) == b - a
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        for off, bx in boxes:
            sl = tuple(slice(o, o + ln) for o, ln in zip(bx.offsets, bx.lengths))
            assert torch.equal(g[sl].flatten(), g.flatten()[a + off : a + off + bx.numel])


def test_copy_between_flat_box_and_flat_within_box():
    g = torch.arange(4 * 6 * 5).view(4, 6, 5)
    shape = tuple(g.shape)
    box = Box((1, 2, 0), (2, 3, 5))
    sub = g[1:3, 2:5, :]
    for start, length in [(0, 30), (7, 11), (29, 1)]:
        within = Flat(start, length, box)
        dst = torch.full((length,), -1)
        copy_region(dst, within, g.clone(), Box((0, 0, 0), shape), shape)
        assert torch.equal(dst, sub.flatten()[start : start + length])
        back = torch.full(shape, -1)
        copy_region(back, Box((0, 0, 0), shape), dst, within, shape)
        assert torch.equal(back[1:3, 2:5, :].flatten()[start : start + length], dst)


# ----------------------------------------------------------------------------- simulated layouts


def full_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Model parameters of the tiny model plus Adam-like state, by global name."""
    from loom.checkpoint.replicated import unique_named_tensors
    from loom.model.llama import build_model

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in unique_named_tensors(build_model(tiny_model(), seed)):
        out[f"model.{name}"] = p.detach().clone()
        out[f"optim.{name}.exp_avg"] = torch.randn(p.shape, generator=g)
        out[f"optim.{name}.exp_avg_sq"] = torch.rand(p.shape, generator=g)
        out[f"optim.{name}.step"] = torch.tensor(float(seed + 5))
    return out


def _param(name: str) -> str:
    return name.split(".", 1)[1].rsplit(".", 1)[0] if name.startswith("optim.") else name.split(".", 1)[1]


def _tp_dim(name: str) -> int | None:
    p = _param(name)
    if p.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight", "tok_embeddings.weight")):
        return 0
    if p.endswith(("wo.weight", "w2.weight")):
        return 1
    return None


def _stage(name: str, pp: int, n_layers: int) -> int:
    p = _param(name)
    if p.startswith("layers."):
        return int(p.split(".")[1]) * pp // n_layers
    return 0 if p.startswith("tok_embeddings") else pp - 1


def layout(
    full: dict, pp: int = 1, tp: int = 1, dp: int = 1, zero: bool = False
) -> list[dict[str, ShardedTensor]]:
    """Per-rank states (rank = (pp_i*dp + dp_i)*tp + tp_i) of ``full`` under pp × dp × tp (ZeRO-3 over dp)."""
    n_layers = tiny_model().n_layers
    ranks = []
    for pi in range(pp):
        for di in range(dp):
            for ti in range(tp):
                st: dict[str, ShardedTensor] = {}
                for name, t in full.items():
                    if _stage(name, pp, n_layers) != pi:
                        continue
                    if t.dim() == 0:  # step counters: written once per tensor
                        st[name] = ShardedTensor.full(t.clone(), (0, 1) if di == 0 and ti == 0 else (1, 2))
                        continue
                    dim = _tp_dim(name) if tp > 1 else None
                    box = Box(tuple(0 for _ in t.shape), tuple(t.shape))
                    local, rep_i, rep_n = t, ti * dp + di, tp * dp
                    if dim is not None:
                        n = t.shape[dim] // tp
                        offs = [0] * t.dim()
                        offs[dim] = ti * n
                        box = Box(tuple(offs), tuple(n if d == dim else s for d, s in enumerate(t.shape)))
                        local, rep_i, rep_n = t.narrow(dim, ti * n, n), di, dp
                    if zero:  # ZeRO-3: a flat 1/dp range of this (tp) piece, not replicated over dp
                        flat = local.reshape(-1)
                        a, b = flat.numel() * di // dp, flat.numel() * (di + 1) // dp
                        within = None if dim is None else box
                        st[name] = ShardedTensor.flat(
                            flat[a:b].clone(),
                            tuple(t.shape),
                            a,
                            (ti if dim is None else 0, tp if dim is None else 1),
                            within,
                        )
                    else:
                        st[name] = ShardedTensor(local.clone(), tuple(t.shape), box, (rep_i, rep_n))
                ranks.append(st)
    return ranks


def save_virtual(root: Path, ranks: list[dict[str, ShardedTensor]], step: int = 3, keep: int = 0) -> Path:
    records = []
    for r, st in enumerate(ranks):
        snap = snapshot(step, st, {"rank": r}, {"config": {}, "data": {"step": step}})
        records.append(write_shard(root / f".tmp-step-{step:08d}", snap, r, len(ranks)))
    return commit(root, records, len(ranks), keep)


LAYOUTS = {
    "1": dict(),
    "dp2": dict(dp=2),
    "dp2xzero3": dict(dp=2, zero=True),
    "dp4xzero3": dict(dp=4, zero=True),
    "tp2": dict(tp=2),
    "pp2": dict(pp=2),
    "pp2xtp2xdp2": dict(pp=2, tp=2, dp=2),
    "tp2xzero3dp2": dict(tp=2, dp=2, zero=True),
}


@pytest.mark.parametrize("saved", ["dp2xzero3", "tp2", "pp2", "pp2xtp2xdp2", "tp2xzero3dp2"])
def test_reshard_any_layout_into_any_other(tmp_path, saved):
    full = full_state(1)
    save_virtual(tmp_path, layout(full, **LAYOUTS[saved]))
    with CheckpointReader(tmp_path) as reader:
        assert sorted(reader.names()) == sorted(full)
        for name, t in full.items():  # one process: every tensor whole, bit for bit
            assert torch.equal(reader.read(name), t), name
        for target in ("dp2", "dp4xzero3", "tp2", "pp2xtp2xdp2", "tp2xzero3dp2"):
            want = layout(full, **LAYOUTS[target])
            for r, st in enumerate(
                layout({k: torch.zeros_like(v) for k, v in full.items()}, **LAYOUTS[target])
            ):
                reader.fill(st)
                for name, piece in st.items():
                    assert torch.equal(piece.local, want[r][name].local), (
                        f"{saved} -> {target} rank {r} {name}"
                    )


def test_pieces_must_tile_every_tensor(tmp_path):
    full = {"model.w": torch.arange(12.0).view(3, 4)}
    w = full["model.w"]
    twice = [{"model.w": ShardedTensor.full(w)}, {"model.w": ShardedTensor.full(w)}]
    with pytest.raises(CheckpointError, match="hold 24 elements, the tensor has 12"):
        save_virtual(tmp_path, twice)
    overlap = [
        {"model.w": ShardedTensor.box(w[:2], (3, 4), (0, 0))},
        {"model.w": ShardedTensor.flat(w[1], (3, 4), 4)},
    ]
    with pytest.raises(CheckpointError, match="overlap"):
        save_virtual(tmp_path, overlap)
    gap = [{"model.w": ShardedTensor.box(full["model.w"][:2], (3, 4), (0, 0))}]
    with pytest.raises(CheckpointError, match="hold 8 elements, the tensor has 12"):
        save_virtual(tmp_path, gap)


def test_ranks_disagreeing_on_the_step_are_refused(tmp_path):
    records = []
    for r, step in enumerate((10, 11)):
        snap = snapshot(step, {"model.w": ShardedTensor.full(torch.ones(4), (r, 2))}, {}, {})
        records.append(write_shard(tmp_path / f".tmp-{snap.tag}", snap, r, 2))
    with pytest.raises(CheckpointError, match="ranks disagree.*rank 0: step-00000010, rank 1: step-00000011"):
        build_index(records, 2)


# ----------------------------------------------------------------------------- real strategies


def _dp_model_and_strategy(seed: int = 7, group=None, steps: int = 2):
    from loom.model.llama import build_model, loss_fn
    from loom.optim.groups import build_optimizer
    from loom.parallel.data.strategy import DataParallel
    from loom.train.schedule import lr_at
    from loom.train.step import plain_run, train_step
    from tests.helpers import rank_micro_batches, tiny_train

    model = build_model(tiny_model(), seed)
    strategy = DataParallel(model, group).attach_optimizer(build_optimizer(model, tiny_train()))
    dp_rank = 0 if group is None else torch.distributed.get_rank(group)
    dp = 1 if group is None else torch.distributed.get_world_size(group)
    for step in range(steps):
        train_step(
            plain_run(model, strategy, loss_fn),
            rank_micro_batches(step, 8, 2, dp_rank, dp),
            1.0,
            lr_at(step, tiny_train()),
            group,
        )
    return model, strategy


def _full_from(model, optimizer) -> dict[str, torch.Tensor]:
    from loom.checkpoint.replicated import unique_named_tensors

    names = {id(p): n for n, p in unique_named_tensors(model)}
    out = {f"model.{n}": p.detach().clone() for n, p in unique_named_tensors(model)}
    for p, st in optimizer.state.items():
        for k, v in st.items():
            out[f"optim.{names[id(p)]}.{k}"] = v.detach().clone()
    return out


def _dp_save(root: str, async_save: bool):
    from loom.checkpoint.save import new_group

    mesh = get_mesh(dp_replicate=2)
    model, strategy = _dp_model_and_strategy(group=mesh.group("dp"))
    group = new_group(2, 60)
    ck = Checkpointer(root, torch.distributed.get_rank(), 2, group)
    expected = _full_from(model, strategy.optimizer)
    state = strategy.sharded_state()
    path = ck.save(2, state, {"rank": torch.distributed.get_rank()}, {}, blocking=not async_save)
    if async_save:  # training goes on while the shard is written: the checkpoint must not see it
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
            for st in strategy.optimizer.state.values():
                st["exp_avg"].mul_(3.0)
        path = ck.wait()
    bad = None
    try:  # a save whose ranks disagree on the step is refused on every rank
        ck.save(5 + torch.distributed.get_rank(), strategy.sharded_state(), {}, {})
    except CheckpointError as e:
        bad = str(e)
    return {k: v for k, v in expected.items()}, str(path), bad


@pytest.mark.parametrize("async_save", [False, True])
def test_dp2_checkpoint_loads_into_one_process(pools, tmp_path, async_save):

    (expected, path, bad), (_, path1, bad1) = pools(2).run(_dp_save, str(tmp_path), async_save)
    assert path == path1 and Path(path).name == "step-00000002"
    assert bad and bad1 and "ranks disagree" in bad and "ranks disagree" in bad1
    assert not list(tmp_path.glob(".tmp-*")), "a refused save leaves no temporary directory"
    files = sorted(p.name for p in Path(path).iterdir())
    assert files == [
        "index.json",
        "manifest.json",
        "shard-00000-of-00002.safetensors",
        "shard-00001-of-00002.safetensors",
        "train_state.json",
    ]
    sizes = [(Path(path) / f).stat().st_size for f in files if f.startswith("shard")]
    assert abs(sizes[0] - sizes[1]) < 0.2 * max(sizes), "each replica writes about half"
    model, strategy = _dp_model_and_strategy(seed=99, steps=0)
    with CheckpointReader(tmp_path) as reader:
        strategy.load_sharded(reader)
    got = _full_from(model, strategy.optimizer)
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v) and got[k].dtype == v.dtype, k


def _tp_save_and_reload(root: str):
    """tp=2 (real tensor-parallel layers) saves; returns each rank's full expected state."""
    from loom.checkpoint.save import new_group
    from loom.config import LoomConfig
    from loom.model.llama import build_model
    from loom.optim.groups import build_optimizer
    from loom.parallel.data.strategy import DataParallel
    from loom.parallel.tensor.parallelize import apply_tensor_parallel
    from tests.helpers import tiny_train

    mesh = get_mesh(tp=2)
    cfg = LoomConfig()
    cfg.model, cfg.parallel.tp = tiny_model(), 2
    model = build_model(cfg.model, 3)
    reference = {f"model.{k}": v.clone() for k, v in model.state_dict().items() if k != "output.weight"}
    apply_tensor_parallel(model, mesh)
    strategy = DataParallel(model, mesh.group("dp"), tp_group=mesh.group("tp"))
    strategy.attach_optimizer(build_optimizer(model, tiny_train()))
    ck = Checkpointer(root, torch.distributed.get_rank(), 2, new_group(2, 60))
    ck.save(1, strategy.sharded_state(), {}, {})
    # and back into tp=2 from scratch
    fresh = build_model(cfg.model, 55)
    apply_tensor_parallel(fresh, mesh)
    s2 = DataParallel(fresh, mesh.group("dp"), tp_group=mesh.group("tp"))
    s2.attach_optimizer(build_optimizer(fresh, tiny_train()))
    with CheckpointReader(root, torch.distributed.get_rank(), 2, ck.group) as reader:
        s2.load_sharded(reader)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    return reference, same


def test_tensor_parallel_checkpoint_unshards(pools, tmp_path):
    (reference, same0), (_, same1) = pools(2).run(_tp_save_and_reload, str(tmp_path))
    assert same0 and same1
    with CheckpointReader(tmp_path) as reader:
        for name, t in reference.items():
            assert torch.equal(reader.read(name), t), name
        assert reader.read("optim.layers.0.attention.wq.weight.exp_avg").shape == (32, 32)


# ----------------------------------------------------------------------------- integrity, atomicity


@pytest.fixture
def saved(tmp_path):
    full = full_state(2)
    path = save_virtual(tmp_path, layout(full, dp=2))
    return tmp_path, path, full


def _load_fails(root: Path, match: str) -> None:
    target = layout({k: torch.zeros_like(v) for k, v in full_state(2).items()})[0]
    with pytest.raises(CheckpointError, match=match), CheckpointReader(root) as reader:
        reader.fill(target)
    assert all(not st.local.any() for n, st in target.items() if n.startswith("model.")), "nothing applied"


def test_flipped_byte_is_detected(saved):
    root, path, _ = saved
    shard = path / "shard-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    _load_fails(root, r"shard-00001-of-00002.safetensors: content altered")


def test_truncated_and_missing_files_are_named(saved):
    root, path, _ = saved
    shard = path / "shard-00000-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    _load_fails(root, r"shard-00000-of-00002.safetensors: truncated")
    (path / "shard-00001-of-00002.safetensors").unlink()
    _load_fails(root, r"shard-00001-of-00002.safetensors: missing")
    (path / "index.json").unlink()
    _load_fails(root, r"index.json: missing")


def test_tampered_manifest_is_caught_through_latest(saved):
    root, path, _ = saved
    m = json.loads((path / "manifest.json").read_text())
    m["files"]["index.json"]["sha256"] = ["0" * 64]  # forged, yet the pointer remembers the real manifest
    (path / "manifest.json").write_text(json.dumps(m))
    _load_fails(root, "manifest.json: content altered")


def test_torn_save_and_bad_pointer_fall_back_to_newest_complete(saved, caplog):
    root, first, full = saved
    second = save_virtual(root, layout(full, dp=2), step=6)
    assert find(root)[0] == second
    (second / "manifest.json").unlink()  # as if killed before the manifest was written
    assert find(root)[0] == first
    (root / "latest").write_text("garbage")
    assert find(root)[0] == first
    torn = root / ".tmp-step-00000009"  # a save killed half way: never renamed into place
    torn.mkdir()
    (torn / "shard-00000-of-00002.safetensors").write_bytes(b"\0" * 10)
    Checkpointer(root)  # a new job cleans up what an interrupted save left
    assert not torn.exists()
    with CheckpointReader(root) as reader:
        assert reader.step == 3 and torch.equal(reader.read("model.norm.weight"), full["model.norm.weight"])


def _reseal_state(ckpt: Path, edit) -> None:
    """``edit`` ``ckpt``'s train_state.json in place, then seal it again as a save would (manifest.json
    and ``latest`` rewritten): the integrity check passes, only the state's own check is left."""
    from loom.checkpoint.integrity import hash_bytes, manifest_bytes, read_manifest, sha256_file

    state = json.loads((ckpt / "train_state.json").read_text())
    edit(state)
    data = json.dumps(state).encode()
    (ckpt / "train_state.json").write_bytes(data)
    files, _ = read_manifest(ckpt)
    table = {name: (e["sha256"], e["bytes"]) for name, e in files.items()}
    table["train_state.json"] = (hash_bytes(data), len(data))
    (ckpt / "manifest.json").write_bytes(manifest_bytes(table))
    latest = json.loads((ckpt.parent / "latest").read_text())
    latest["manifests"][ckpt.name] = sha256_file(ckpt / "manifest.json")
    if latest["tag"] == ckpt.name:
        latest["manifest_sha256"] = latest["manifests"][ckpt.name]
    (ckpt.parent / "latest").write_text(json.dumps(latest))


def _set(*keys, value=None, drop: bool = False):
    """An edit of train_state.json: ``value`` at the path ``keys`` (``drop``: that key removed)."""

    def edit(state: dict) -> None:
        for key in keys[:-1]:
            state = state[key]
        if drop:
            del state[keys[-1]]
        else:
            state[keys[-1]] = value

    return edit


def _with_source(**fields):
    def edit(state: dict) -> None:
        state["data"]["sources"] = [{"consumed": 24, "epoch": 0, "windows": 100, "weight": 1.0} | fields]

    return edit


BAD_STATES = {  # case: (edit, what the one line must say)
    "step_str": (_set("step", value="abc"), "step is 'abc'; must be an integer >= 0"),
    "step_neg": (_set("step", value=-1), "step is -1; must be an integer >= 0"),
    "step_bool": (_set("step", value=True), "step is true; must be an integer >= 0"),
    "step_float": (_set("step", value=3.0), "step is 3.0; must be an integer >= 0"),
    "step_missing": (_set("step", drop=True), "step is null; must be an integer >= 0"),
    "step_not_its_tag": (
        _set("step", value=1),
        "step is 1; must be 3, the step of its checkpoint step-00000003",
    ),
    "tag": (_set("tag", value="step-00000001"), "tag is 'step-00000001'; must be 'step-00000003'"),
    "version": (_set("version", value=99), "version 99; this Loom reads format 'loom-checkpoint' version 1"),
    "format": (_set("format", value="something-else"), "format 'something-else', version 1; this Loom reads"),
    "format_missing": (_set("format", drop=True), "format null, version 1; this Loom reads"),
    "world_size_str": (_set("world_size", value="x"), "world_size is 'x'; must be an integer >= 1"),
    "world_size_zero": (_set("world_size", value=0), "world_size is 0; must be an integer >= 1"),
    "ranks_empty": (_set("ranks", value=[]), r"ranks is \[\]; must be a list of world_size = 2 objects"),
    "ranks_entry": (_set("ranks", 1, value=7), r"ranks\[1\] is 7; must be an object"),
    "data_str": (_set("data", value="x"), "data is 'x'; must be an object or null"),
    "data_step": (_set("data", "step", value=2), "data.step is 2; must be 3"),
    "global_sequences": (
        _set("data", "global_sequences", value=-5),
        "data.global_sequences is -5; must be an integer >= 0",
    ),
    "global_batch": (
        _set("data", "global_batch", value=0),
        "data.global_batch is 0; must be an integer >= 1",
    ),
    "sources": (_set("data", "sources", value={}), r"data.sources is \{\}; must be a list of objects"),
    "consumed": (_with_source(consumed=-1), r"data.sources\[0\].consumed is -1; must be an integer >= 0"),
    "epoch": (_with_source(epoch="0"), r"data.sources\[0\].epoch is '0'; must be an integer >= 0"),
    "weight": (_with_source(weight="heavy"), r"data.sources\[0\].weight is 'heavy'; must be a number >= 0"),
    "config": (_set("config", value=[]), r"config is \[\]; must be an object"),
    "config_train": (_set("config", "train", value="x"), "config.train is 'x'; must be an object"),
    "loss_scale": (_set("loss_scale", value={"scale": "big"}), "loss_scale.scale is 'big'; must be a number"),
    "finetune_base": (_set("finetune_base", value=5), "finetune_base is 5; must be an object or null"),
}


def test_a_resealed_train_state_that_is_left_valid_still_loads(saved):
    root, path, full = saved
    _reseal_state(path, lambda state: state["data"].update(global_sequences=24, global_batch=8))
    with CheckpointReader(root) as reader:
        assert reader.step == 3 and torch.equal(reader.read("model.norm.weight"), full["model.norm.weight"])


@pytest.mark.parametrize("case", sorted(BAD_STATES))
def test_bad_train_state_is_refused_in_one_line_naming_the_field(saved, case):
    root, path, _ = saved
    edit, says = BAD_STATES[case]
    _reseal_state(path, edit)
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(root)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{path / 'train_state.json'}: ")
    assert re.search(says, line), line


def test_a_bad_train_state_falls_back_like_a_damaged_checkpoint_unless_named(tmp_path, caplog):
    """In run.dir, the newest checkpoint with a bad state is skipped for the older one (as a damaged
    one is); named by train.resume, it is refused."""
    from loom.checkpoint.training import TrainCheckpoints
    from loom.config import LoomConfig

    _, strategy = _dp_model_and_strategy(steps=1)
    cfg = LoomConfig()
    cfg.run.dir = str(tmp_path)
    saver = TrainCheckpoints(cfg, tmp_path, 0, 1, strategy)
    saver.save(1, blocking=True)
    saver.save(2, blocking=True)
    newest = tmp_path / "checkpoints" / "step-00000002"
    _reseal_state(newest, _set("world_size", value="x"))
    assert TrainCheckpoints(cfg, tmp_path, 0, 1, strategy).restore() == 1
    assert "SKIPPING checkpoint" in caplog.text and "world_size is 'x'" in caplog.text
    cfg.train.resume = str(newest)
    with pytest.raises(CheckpointError, match="train_state.json: world_size is 'x'"):
        TrainCheckpoints(cfg, tmp_path, 0, 1, strategy).restore()


def test_keep_prunes_old_checkpoints(tmp_path):
    full = full_state(0)
    for step in (1, 2, 3, 4):
        save_virtual(tmp_path, layout(full), step=step, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000003", "step-00000004"]
    assert json.loads((tmp_path / "latest").read_text())["tag"] == "step-00000004"


# ----------------------------------------------------------------------------- no pickle


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_pickle_checkpoints_are_refused(saved, tmp_path_factory):
    from loom.checkpoint.integrity import hash_bytes, manifest_bytes
    from loom.config import ConfigError, LoomConfig, validate

    root, path, _ = saved
    marker = tmp_path_factory.mktemp("m") / "pwned"
    evil = pickle.dumps(_Payload(marker))
    # 1) a DCP-style directory (pickled .metadata) and a torch.save file: not Loom checkpoints
    dcp = tmp_path_factory.mktemp("dcp")
    (dcp / ".metadata").write_bytes(evil)
    (dcp / "__0_0.distcp").write_bytes(evil)
    assert find(dcp) is None
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        CheckpointReader(dcp)
    pt = dcp / "model.pt"
    pt.write_bytes(evil)
    with pytest.raises(CheckpointError, match="never loaded"):
        CheckpointReader(pt)
    cfg = LoomConfig()
    cfg.train.resume = str(pt)
    with pytest.raises(ConfigError, match="train.resume"):
        validate(cfg, 1)
    # 2) pickles inside a Loom checkpoint whose manifest was forged to match (a checkpoint copied
    # without its run's ``latest``, whose recorded manifest hash would refuse it at once)
    pointer = path.parent / "latest"
    kept = pointer.read_bytes()
    pointer.unlink()
    for victim, match in (
        ("index.json", "not valid JSON"),
        ("shard-00000-of-00002.safetensors", "not a safetensors"),
    ):
        original, manifest = (path / victim).read_bytes(), (path / "manifest.json").read_bytes()
        (path / victim).write_bytes(evil)
        files = json.loads((path / "manifest.json").read_text())["files"]
        files[victim] = {"sha256": hash_bytes(evil), "bytes": len(evil)}
        (path / "manifest.json").write_bytes(
            manifest_bytes({k: (v["sha256"], v["bytes"]) for k, v in files.items()})
        )
        with pytest.raises(CheckpointError, match=match), CheckpointReader(path) as reader:
            reader.read("model.norm.weight")
            reader.read("model.tok_embeddings.weight")
        (path / victim).write_bytes(original)
        (path / "manifest.json").write_bytes(manifest)
    pointer.write_bytes(kept)
    assert not marker.exists(), "a crafted pickle was executed"


def test_loom_has_no_pickle_or_unsafe_torch_load():
    pattern = re.compile(
        r"^\s*(import|from)\s+(pickle|cPickle|_pickle|dill|cloudpickle)\b|pickle\.loads?\(|torch\.load\(|weights_only\s*=\s*False"
    )
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in sorted((ROOT / "loom").rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, "pickle-based loading in loom/:\n" + "\n".join(hits)


# ----------------------------------------------------------------------------- export, RNG


def test_convert_exports_a_model_loom_generate_reads(saved, tmp_path):
    from loom.checkpoint.convert import convert
    from loom.model.llama import Transformer
    from loom.train.export import load_model, unique_state

    root, _, full = saved
    out = tmp_path / "model.safetensors"
    _, step, n = convert(root, out)
    model = Transformer(tiny_model())
    load_model(model, out)
    assert step == 3 and n == len(unique_state(model))
    for name, t in unique_state(model).items():
        assert torch.equal(t, full[f"model.{name}"])
    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as f:  # what torch's save_file writes, for its readers
        assert f.metadata() == {"format": "pt", "step": "3", "source": "step-00000003"}


def _umask_file_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def test_convert_never_touches_a_file_beside_its_output(saved, tmp_path, monkeypatch):
    """A user's ``OUT.tmp`` is neither written nor renamed away: the file is built under a new hidden
    name, removed if the write fails, and ends with the umask's mode."""
    import loom.checkpoint.convert as convert_mod

    root = saved[0]
    out, mine = tmp_path / "c5.safetensors", tmp_path / "c5.safetensors.tmp"
    mine.write_text("mine")
    before = set(tmp_path.iterdir())

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(convert_mod, "_write_tensor", disk_full)
        with pytest.raises(OSError, match="No space"):
            convert_mod.convert(root, out)
    assert set(tmp_path.iterdir()) == before and mine.read_text() == "mine"
    convert_mod.convert(root, out)
    assert set(tmp_path.iterdir()) == before | {out} and mine.read_text() == "mine"
    assert out.stat().st_mode & 0o777 == _umask_file_mode()


def test_rng_states_round_trip_through_json():
    import numpy as np

    from loom.checkpoint.rng import capture_rng, restore_rng

    torch.manual_seed(3)
    random.seed(4)
    np.random.seed(5)
    state = json.loads(json.dumps(capture_rng()))
    a = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    restore_rng(state)
    b = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


# ----------------------------------------------------------------------------- ZeRO


def _zero_cfg(stage: int):
    from loom.config import LoomConfig
    from tests.helpers import tiny_train

    cfg = LoomConfig()
    cfg.model, cfg.train = tiny_model(), tiny_train()
    cfg.parallel.zero, cfg.parallel.dp, cfg.parallel.dp_shard = stage, 2, 2
    return cfg


def _train(model, strategy, steps: range, dp_rank: int, dp: int, group) -> list[float]:
    from loom.model.llama import loss_fn
    from loom.train.schedule import lr_at
    from loom.train.step import plain_run, train_step
    from tests.helpers import rank_micro_batches, tiny_train

    return [
        train_step(
            plain_run(model, strategy, loss_fn),
            rank_micro_batches(s, 8, 2, dp_rank, dp),
            1.0,
            lr_at(s, tiny_train()),
            group,
        ).loss
        for s in steps
    ]


def _zero_save_and_reshard(root: str, save_stage: int, load_stage: int):
    """ZeRO-``save_stage`` over dp=2 trains 2 steps and saves; ZeRO-``load_stage`` loads and goes on."""
    from loom.checkpoint.save import new_group
    from loom.model.llama import build_model
    from loom.train.build import data_parallel

    mesh = get_mesh(dp_shard=2)
    rank, group = mesh.local_rank("dp"), mesh.group("dp")
    model = build_model(tiny_model(), 7)
    zero = data_parallel(model, mesh, _zero_cfg(save_stage))
    _train(model, zero, range(2), rank, 2, group)
    ck = Checkpointer(root, torch.distributed.get_rank(), 2, new_group(2, 60))
    ck.save(2, zero.sharded_state(), {}, {})
    full = zero.full_state_dict() if hasattr(zero, "full_state_dict") else dict(model.state_dict())
    full = {k: v.detach().clone() for k, v in full.items()}
    ref = _train(model, zero, range(2, 4), rank, 2, group)
    other = build_model(tiny_model(), 99)
    zero2 = data_parallel(other, mesh, _zero_cfg(load_stage))
    with CheckpointReader(root, torch.distributed.get_rank(), 2, ck.group) as reader:
        zero2.load_sharded(reader)
    got = zero2.full_state_dict() if hasattr(zero2, "full_state_dict") else dict(other.state_dict())
    same = all(torch.equal(got[k], v) for k, v in full.items())
    return full, ref, _train(other, zero2, range(2, 4), rank, 2, group), same


@pytest.mark.parametrize("save_stage,load_stage", [(3, 1), (2, 3)])
def test_zero_checkpoint_reshards_across_stages_and_into_one_process(pools, tmp_path, save_stage, load_stage):
    results = pools(2).run(_zero_save_and_reshard, str(tmp_path), save_stage, load_stage)
    for _, ref, resumed, same in results:
        assert same, f"ZeRO-{load_stage} did not get ZeRO-{save_stage}'s parameters back exactly"
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    full, ref = results[0][0], results[0][1]
    model, strategy = _dp_model_and_strategy(seed=5, steps=0)  # one process, plain AdamW
    with CheckpointReader(tmp_path) as reader:
        strategy.load_sharded(reader)
    for k, v in model.state_dict().items():
        assert torch.equal(v, full[k]), k
    assert all(float(st["step"]) == 2.0 for st in strategy.optimizer.state.values())
    one = _train(model, strategy, range(2, 4), 0, 1, None)
    torch.testing.assert_close(torch.tensor(one), torch.tensor(ref), rtol=1e-4, atol=1e-5)


def test_large_files_are_verified_chunk_by_chunk_in_parallel(tmp_path):
    from loom.checkpoint.integrity import ChunkHasher, verify

    data = os.urandom(1000)
    (tmp_path / "f").write_bytes(data)
    h = ChunkHasher(chunk=64)
    for i in range(0, len(data), 37):  # fed in parts that straddle chunk boundaries
        h.update(data[i : i + 37])
    files = {"f": {"sha256": h.hexdigests(), "bytes": len(data)}}
    assert len(files["f"]["sha256"]) == 16
    verify(tmp_path, files, chunk_bytes=64)
    flipped = bytearray(data)
    flipped[700] ^= 0x80
    (tmp_path / "f").write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="f: content altered"):
        verify(tmp_path, files, chunk_bytes=64)


def test_loss_scale_and_rng_come_back_with_the_checkpoint(tmp_path):
    from loom.checkpoint.training import TrainCheckpoints
    from loom.config import LoomConfig

    class Scaler:  # the numbers of loom.memory.loss_scale.DynamicLossScaler
        def __init__(self) -> None:
            self.scale, self.good_steps, self.tracker, self.skipped, self.static = 1024.0, 3, 2, 1, False

    _, strategy = _dp_model_and_strategy(steps=1)
    scaler = Scaler()
    cfg = LoomConfig()
    cfg.run.dir = str(tmp_path)
    torch.manual_seed(123)
    TrainCheckpoints(cfg, tmp_path, 0, 1, strategy, scaler).save(1, blocking=True)
    expected = torch.rand(3)
    scaler.scale, scaler.skipped = 2.0, 9
    assert TrainCheckpoints(cfg, tmp_path, 0, 1, strategy, scaler).restore() == 1
    assert vars(scaler) == vars(Scaler())
    assert torch.equal(torch.rand(3), expected)


def test_cli_convert(saved, tmp_path, capsys):
    from loom.cli import main

    root, path, full = saved
    out = tmp_path / "exported" / "model.safetensors"
    assert main(["checkpoint", "convert", str(root), str(out)]) == 0
    assert f"from {path} (step 3)" in capsys.readouterr().out
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(out))["norm.weight"], full["model.norm.weight"])
    assert main(["checkpoint", "convert", str(tmp_path / "nothing-here"), str(out)]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err


def test_metrics_past_the_checkpoint_are_dropped_on_restart(tmp_path):
    from loom.checkpoint.training import truncate_metrics

    rows = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 8))
    (tmp_path / "metrics.jsonl").write_text(rows + '{"step": 8, "lo')  # killed mid-write
    truncate_metrics(tmp_path, 5)
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
        4,
        5,
    ]
    truncate_metrics(tmp_path, 0)  # a restart before the first checkpoint starts the file afresh
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_killed_writers_staged_output_is_removed_by_the_next(tmp_path, caplog):
    """An export killed by SIGKILL leaves its hidden staged directory; the next staged output of that
    name removes it (its writer's pid no longer runs) with one warning giving its size, and never one
    a running process is writing."""
    import logging
    import signal
    import subprocess
    import sys

    from loom.checkpoint.format import staged

    out = tmp_path / "export"
    code = (
        "import sys, time; from pathlib import Path; from loom.checkpoint.format import staged\n"
        f"with staged(Path({str(out)!r}), directory=True) as t:\n"
        "    (t / 'shard').write_bytes(b'x' * 200_000); print('staged', flush=True); time.sleep(120)"
    )
    killed = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert killed.stdout is not None and killed.stdout.readline().strip() == "staged"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    live = tmp_path / f".export.{socket.gethostname()[:32]}-{os.getpid()}.abc.partial"  # this process's
    live.mkdir()
    orphans = [p for p in tmp_path.iterdir() if p.name.endswith(".partial") and p != live]
    assert len(orphans) == 1
    with caplog.at_level(logging.WARNING, logger="loom"), staged(out, directory=True) as tmp:
        (tmp / "shard").write_text("ok")
    assert not orphans[0].exists() and live.exists() and (out / "shard").read_text() == "ok"
    assert [r.getMessage() for r in caplog.records if "removed" in r.getMessage()] == [
        f"loom: warning: removed {orphans[0]} (0.2 MB), left unfinished by process {killed.pid}, which no "
        "longer runs"
    ]


def test_an_atomic_write_that_fails_names_its_file_and_leaves_no_tmp(tmp_path, monkeypatch):
    """Disk full while run.dir's data.json is written: the error names the file, no data.json.tmp stays."""
    import errno

    from loom.checkpoint import format as F

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(F.os, "fsync", full)
    with pytest.raises(OSError, match=r"No space left on device \(while writing .*data\.json\)"):
        F.write_bytes_atomic(tmp_path / "data.json", b"{}")
    assert list(tmp_path.iterdir()) == []
