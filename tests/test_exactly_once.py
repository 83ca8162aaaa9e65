"""Exactly-once data (issue 35, item 2): the samples every step consumes, recorded as (source, window)
ids, are the uninterrupted run's across a resume on another dp size, micro-batch and accumulation,
with a two-source mixture and packing; a changed global batch continues at the first unseen
sequence; a resume on other sources or weights is refused in one line."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from loom import config as C
from loom.data import BatchSampler, MixtureSampler, TokenDataset

B = 8  # global batch of the unit tests
LAYOUTS = [(1, 8), (1, 1), (2, 4), (2, 1), (4, 2), (8, 1)]  # (dp, micro_batch): accumulation B/(dp·micro)


def _token_file(path: Path, n_tokens: int, offset: int) -> TokenDataset:
    """A token file whose window i starts with token offset + i·seq_len (so a row names its window)."""
    np.arange(offset, offset + n_tokens, dtype=np.uint32).tofile(path)
    return TokenDataset(path, seq_len=4, dtype=np.uint32)


@pytest.fixture
def sets(tmp_path) -> list[TokenDataset]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    return [
        _token_file(tmp_path / "a" / "train.bin", 4 * 29 + 1, 0),
        _token_file(tmp_path / "b" / "train.bin", 4 * 13 + 1, 10_000),
    ]


def _sampler(sets, mixture: bool, dp_rank=0, dp=1, micro=B, batch=B) -> BatchSampler:
    if mixture:
        return MixtureSampler(sets, [3, 1], batch, micro, dp_rank, dp, seed=11)
    return BatchSampler(sets[0], batch, micro, dp_rank, dp, seed=11)


def _step_ids(samplers: list[BatchSampler], step: int) -> np.ndarray:
    """The step's global batch: every dp rank's (source, window) rows in rank order; each rank's
    micro-batches hold exactly those windows' tokens."""
    out = []
    for s in samplers:
        ids = s.sample_ids(step)
        x = torch.cat([mb[0] for mb in s.micro_batches(step)])
        assert len(s.micro_batches(step)) == s.n_micro
        for row, (k, w) in enumerate(ids.tolist()):
            ds = s.datasets[k] if isinstance(s, MixtureSampler) else s.dataset
            assert torch.equal(x[row], ds.window(w)[:-1])
        out.append(ids)
    return np.concatenate(out)


def _layout(sets, mixture, dp, micro, batch=B) -> list[BatchSampler]:
    return [_sampler(sets, mixture, r, dp, micro, batch) for r in range(dp)]


@pytest.mark.parametrize("mixture", [False, True], ids=["one source", "mixture 3:1"])
def test_every_layout_and_accumulation_consumes_the_same_ids(sets, mixture):
    """dp 1/2/4/8 with micro-batches 1..8 (accumulation 1..8) at global batch 8: the ranks' rows,
    concatenated, are the one-process batch at every step, across epoch boundaries."""
    steps = 12  # 96 sequences: over 3 epochs of source a alone, 2+ of each mixture source
    ref = [_step_ids(_layout(sets, mixture, 1, B), s) for s in range(steps)]
    for dp, micro in LAYOUTS[1:]:
        layout = _layout(sets, mixture, dp, micro)
        for s in range(steps):
            np.testing.assert_array_equal(_step_ids(layout, s), ref[s], err_msg=f"dp {dp} micro {micro}")


@pytest.mark.parametrize("mixture", [False, True], ids=["one source", "mixture 3:1"])
def test_each_window_once_per_epoch_of_its_source(sets, mixture):
    """Over a source's first n_k sequences every one of its n_k windows appears exactly once (its
    epoch 0), and the next n_k again each once (epoch 1); the mixture's shares are its weights'."""
    ids = np.concatenate([_step_ids(_layout(sets, mixture, 1, B), s) for s in range(40)])
    for k, ds in enumerate(sets if mixture else sets[:1]):
        drawn = ids[ids[:, 0] == k, 1]
        n = ds.n_windows
        assert len(drawn) >= 2 * n
        assert sorted(drawn[:n].tolist()) == list(range(n))
        assert sorted(drawn[n : 2 * n].tolist()) == list(range(n))
        assert drawn[:n].tolist() != drawn[n : 2 * n].tolist()  # a new order each epoch
    if mixture:  # 3:1 of 320 sequences, within the low-discrepancy bound (O(log n))
        assert abs(int((ids[:, 0] == 0).sum()) - 240) <= 3


def _json(x: dict) -> dict:
    return json.loads(json.dumps(x))  # what a checkpoint's train_state.json gives back


@pytest.mark.parametrize("mixture", [False, True], ids=["one source", "mixture 3:1"])
def test_resume_on_other_layout_continues_the_uninterrupted_ids(sets, mixture):
    """Stopped at step 10 on dp 2 (micro 2), resumed on dp 1 (micro 1) and dp 4 (micro 1): steps
    10..19 are the uninterrupted dp-2 run's; an older record (no per-source counts) gives the same."""
    straight = _layout(sets, mixture, 2, 2)
    want = [_step_ids(straight, s) for s in range(20)]
    first = _layout(sets, mixture, 2, 2)
    for s in range(10):
        _step_ids(first, s)
    saved = _json(first[0].position(10))
    assert saved["global_sequences"] == 80 and saved["packing"] == "windows"
    assert sum(src["consumed"] for src in saved["sources"]) == 80
    assert [src["epoch"] for src in saved["sources"]] == [
        src["consumed"] // ds.n_windows for src, ds in zip(saved["sources"], sets)
    ]
    assert all(_json(r.position(10)) == saved for r in first)  # every rank saves the same record
    older = {"step": 10, "global_sequences": 80}
    for record, (dp, micro) in [(saved, (1, 1)), (saved, (4, 1)), (older, (1, 8))]:
        resumed = _layout(sets, mixture, dp, micro)
        for r in resumed:
            r.resume(record, 10)
        for s in range(10, 20):
            np.testing.assert_array_equal(_step_ids(resumed, s), want[s])
        assert _json(resumed[0].position(20)) == _json(straight[0].position(20))


@pytest.mark.parametrize("mixture", [False, True], ids=["one source", "mixture 3:1"])
def test_a_changed_global_batch_continues_at_the_first_unseen_sequence(sets, mixture):
    """Saved at step 5 of global batch 8 (40 sequences consumed), resumed with global batch 12 on
    dp 3 and with 4 on dp 2: the sequences after the resume are the uninterrupted run's from the
    41st on, in order (none repeated, none skipped), 12 or 4 per step; the mixture keeps its draw."""
    stream = np.concatenate([_step_ids(_layout(sets, mixture, 1, B), s) for s in range(11)])  # 88 sequences
    saved = _json(_sampler(sets, mixture).position(5))
    assert saved["global_sequences"] == 40
    for batch, dp in [(12, 3), (4, 2)]:
        resumed = _layout(sets, mixture, dp, 1, batch)
        for r in resumed:
            r.resume(saved, 5)
        after = np.concatenate([_step_ids(resumed, s) for s in range(5, 5 + 48 // batch)])
        np.testing.assert_array_equal(after, stream[40:88])
        assert resumed[0].position(5 + 48 // batch)["global_sequences"] == 88


def test_a_resume_on_other_sources_or_weights_is_refused_in_one_line(sets, tmp_path):
    saved = _json(_sampler(sets, True).position(3))
    other = _token_file(tmp_path / "c.bin", 4 * 7 + 1, 0)
    cases = [
        MixtureSampler(sets, [1, 1], B, B, seed=11),  # weights
        MixtureSampler([sets[0], other], [3, 1], B, B, seed=11),  # another second source
        MixtureSampler([*sets, other], [3, 1, 1], B, B, seed=11),  # one more source
        BatchSampler(sets[0], B, B, seed=11),  # the mixture dropped
    ]
    for sampler in cases:
        with pytest.raises(C.ConfigError) as e:
            sampler.resume(saved, 3, "run/checkpoints/step-3")
        line = str(e.value)
        assert "\n" not in line and line.startswith("data.sources: ")
        assert "run/checkpoints/step-3" in line and "--train.init_from" in line
    MixtureSampler(sets, [6, 2], B, B, seed=11).resume(saved, 3)  # the same normalized weights: accepted
    with pytest.raises(
        C.ConfigError,
        match=r"^data: ckpt was trained with train.bin \?, this run's is \?; 29 windows then, 7 now",
    ):
        BatchSampler(other, B, B, seed=11).resume(
            _json(BatchSampler(sets[0], B, B, seed=11).position(3)), 3, "ckpt"
        )


# ----------------------------------------------------------------------------- end to end

DOCS = {
    "code": [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(120)],
    "prose": [f"Document {i} tells of rivers, {i % 11} hills and the sea. " * 3 for i in range(80)],
}


@pytest.fixture(scope="module")
def mixture_cfg(tmp_path_factory) -> dict:
    """Two sources (3:1), packed, with sample ids recorded; a tiny model; prepared once here."""
    from loom.data import prepare_sources

    root = tmp_path_factory.mktemp("exactly_once")
    sources = []
    for (name, docs), weight in zip(DOCS.items(), (3, 1)):
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        sources.append({"path": str(path), "weight": weight})
    cfg = {
        "model": {
            "dim": 32,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "max_seq_len": 32,
            "multiple_of": 16,
        },
        "data": {"seq_len": 32, "vocab_size": 300, "pack": True, "record_ids": True, "sources": sources},
        "train": {
            "steps": 20,
            "global_batch": 4,
            "micro_batch": 1,
            "warmup_steps": 2,
            "lr": 3e-3,
            "log_every": 1,
            "eval_every": 0,
            "checkpoint_every": 10,
        },
        "run": {"progress": False, "tensorboard": False, "threads": 1},
    }
    cache = str(root / "cache")
    old = os.environ.get("LOOM_CACHE_DIR")
    os.environ["LOOM_CACHE_DIR"] = cache
    try:
        prepare_sources(C.from_dict(json.loads(json.dumps(cfg))).data, progress=False)
    finally:
        if old is None:
            del os.environ["LOOM_CACHE_DIR"]
        else:
            os.environ["LOOM_CACHE_DIR"] = old
    return {"cfg": cfg, "cache": cache}


def _train(cfg: dict, run_dir: str, cache: str, stop_after: int = 0) -> None:
    """One rank of a run (the pool's, or this process alone); ``stop_after``: stop there as
    train.time_limit_s would (the checkpoint of that step is the final save)."""
    import torch.distributed as dist

    from loom.train.trainer import RankEnv, Trainer

    cfg = json.loads(json.dumps(cfg))
    cfg["run"]["dir"] = run_dir
    old = os.environ.get("LOOM_CACHE_DIR")
    os.environ["LOOM_CACHE_DIR"] = cache  # the mixture's sources were prepared there
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        trainer = Trainer(C.from_dict(cfg), RankEnv(rank, world, rank, world))
        if stop_after:
            done = iter(range(trainer.start_step + 1, 10**9))
            trainer._time_up = lambda start: next(done) >= stop_after  # type: ignore[method-assign]
        try:
            trainer.fit()
        finally:
            trainer.heartbeat.close()
    finally:
        if old is None:
            del os.environ["LOOM_CACHE_DIR"]
        else:
            os.environ["LOOM_CACHE_DIR"] = old


def test_mixture_packed_stopped_on_two_ranks_resumed_on_one(pools, mixture_cfg, tmp_path):
    """The issue's case: a two-source packed mixture stopped at step 10 on 2 ranks (micro 1, accum 2)
    and resumed on 1 rank (accum 4) to step 20 consumed exactly the sample ids of the uninterrupted
    2-rank run at every step, and its losses match within 1e-4."""
    from loom.checkpoint.training import TrainCheckpoints
    from loom.data import mixture_sampler
    from loom.data.sample_ids import read_sample_ids
    from tests.helpers import read_metrics, with_sections

    cfg, cache = mixture_cfg["cfg"], mixture_cfg["cache"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    pools(2).run(_train, cfg, str(straight), cache)
    pools(2).run(_train, cfg, str(stopped), cache, 10)
    assert sorted(read_sample_ids(stopped)) == list(range(1, 11))
    (ckpt,) = [p for p in (stopped / "checkpoints").glob("step-*") if p.name.endswith("10")]
    saved = json.loads((ckpt / "train_state.json").read_text())["data"]
    assert saved["global_sequences"] == 40 and len(saved["sources"]) == 2
    shutil.copytree(stopped, tmp_path / "bigger")
    shutil.copytree(stopped, tmp_path / "reweighted")
    _train(cfg, str(stopped), cache)  # one rank: dp 1, accumulation 4

    want, got = read_sample_ids(straight), read_sample_ids(stopped)
    assert sorted(want) == sorted(got) == list(range(1, 21))
    assert got == want
    ids = np.array([want[s] for s in range(1, 21)]).reshape(-1, 2)
    assert set(ids[:, 0].tolist()) == {0, 1}  # both sources drawn
    a, b = read_metrics(straight), read_metrics(stopped)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 21))
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in b]), torch.tensor([r["loss"] for r in a]), rtol=0, atol=1e-4
    )

    # the same checkpoint resumed with global batch 8 (1 rank, 2 steps): the uninterrupted run's
    # sequences 41..56 (its steps 11-14), in order
    _train(with_sections(cfg, train={"global_batch": 8, "steps": 12}), str(tmp_path / "bigger"), cache)
    bigger = read_sample_ids(tmp_path / "bigger")
    assert [bigger[s] for s in (11, 12)] == [want[11] + want[12], want[13] + want[14]]
    # with other weights: the trainer's checkpoints refuse it in one line naming the checkpoint,
    # before any state is loaded
    reweighted = with_sections(cfg, run={"dir": str(tmp_path / "reweighted")})
    reweighted["data"]["sources"][1]["weight"] = 3
    rcfg = C.from_dict(reweighted)
    os.environ["LOOM_CACHE_DIR"], old = cache, os.environ.get("LOOM_CACHE_DIR")
    try:
        sampler = mixture_sampler(rcfg, 0, 1)
    finally:
        os.environ.pop("LOOM_CACHE_DIR") if old is None else os.environ.update(LOOM_CACHE_DIR=old)
    ckpts = TrainCheckpoints(rcfg, tmp_path / "reweighted", 0, 1, state=None, data=sampler)  # type: ignore[arg-type]
    with pytest.raises(C.ConfigError, match=r"^data.sources: .*step-0+10 was saved reading 2 sources") as e:
        ckpts.restore()
    assert "\n" not in str(e.value) and "weight 0.5" in str(e.value)


def test_record_ids_is_refused_beside_dedicated_parameter_servers():
    """Dedicated server ranks run no step, so they would not join the ids' all-gather: refused."""
    over = {"parallel": {"dp_mode": "ps", "ps_shards": 1}, "train": {"global_batch": 4, "micro_batch": 1}}
    over["data"] = {"record_ids": True}
    C.validate(C.from_dict(json.loads(json.dumps(over))), 2)  # colocated servers: accepted
    over["parallel"]["ps_colocate"] = False
    with pytest.raises(C.ConfigError, match=r"^data.record_ids: not with dedicated parameter servers"):
        C.validate(C.from_dict(over), 3)
