"""Resume trusts nothing it was handed: the manifest must have the hash ``latest`` recorded, and a
damaged newest checkpoint is skipped, loudly, for the newest intact one, unless ``train.resume``
names it (then it is refused)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from loom import config as C
from tests.helpers import TINY_JOB, with_sections


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[dict, Path]:
    """4 steps, checkpoints at 2 and 4 (one process)."""
    from loom.data import prepare_data
    from loom.train.trainer import RankEnv, Trainer

    run = tmp_path_factory.mktemp("run")
    cfg = with_sections(
        TINY_JOB,
        train={"steps": 4, "checkpoint_every": 2, "checkpoint_async": False},
        run={"dir": str(run)},
    )
    os.environ.setdefault("LOOM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    cfg["data"]["prepared_dir"] = str(prepare_data(C.from_dict(cfg).data, progress=False).dir)
    trainer = Trainer(C.from_dict(cfg), RankEnv(0, 1, 0, 1))
    try:
        trainer.fit()
    finally:
        trainer.heartbeat.close()
    return cfg, run


def _start_step(cfg: dict, **train) -> int:
    from loom.train.trainer import RankEnv, Trainer

    c = json.loads(json.dumps(cfg))
    c["train"] |= {"steps": 6, **train}
    trainer = Trainer(C.from_dict(c), RankEnv(0, 1, 0, 1))
    trainer.heartbeat.close()
    return trainer.start_step


def _copy_run(trained, tmp_path) -> tuple[dict, Path]:
    import shutil

    cfg, run = trained
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    cfg = json.loads(json.dumps(cfg))
    cfg["run"]["dir"] = str(dst)
    return cfg, dst


def test_a_damaged_newest_checkpoint_is_skipped_loudly(trained, tmp_path, caplog):
    cfg, run = _copy_run(trained, tmp_path)
    newest = run / "checkpoints" / "step-00000004"
    shard = sorted(newest.glob("shard-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="loom"):
        assert _start_step(cfg) == 2
    assert any(
        "SKIPPING checkpoint" in r.message and str(newest) in r.message and shard.name in r.message
        for r in caplog.records
    )
    with pytest.raises(Exception, match=shard.name):  # named explicitly: refused, not replaced
        _start_step(cfg, resume=str(newest))


def test_a_manifest_rewritten_with_its_shard_is_refused(trained, tmp_path, caplog):
    """A shard altered together with its manifest entry passes the manifest check; the hash that
    ``latest`` recorded for the manifest does not."""
    from loom.checkpoint.integrity import sha256_file

    cfg, run = _copy_run(trained, tmp_path)
    newest = run / "checkpoints" / "step-00000004"
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["note"] = "edited"  # any rewrite changes the manifest's hash
    (newest / "manifest.json").write_text(json.dumps(manifest))
    assert (
        sha256_file(newest / "manifest.json")
        != json.loads((run / "checkpoints" / "latest").read_text())["manifest_sha256"]
    )
    with caplog.at_level(logging.WARNING, logger="loom"):
        assert _start_step(cfg) == 2
    assert any("SHA-256 differs from the one recorded in 'latest'" in r.message for r in caplog.records)


def test_convert_never_writes_into_its_source(trained, tmp_path):
    from loom.checkpoint.convert import convert
    from loom.checkpoint.format import CheckpointError

    _, run = trained
    ckpt = run / "checkpoints" / "step-00000004"
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    for target in (ckpt / "shard-00000-of-00001.safetensors", ckpt / "model.safetensors"):
        with pytest.raises(CheckpointError, match="inside the checkpoint it is converted from"):
            convert(ckpt, target)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    convert(ckpt, tmp_path / "model.safetensors")  # elsewhere: fine


def test_resuming_on_other_data_is_refused(trained, tmp_path):
    """Same vocabulary size, another corpus: the run would continue on data it never started on."""
    from loom.data import prepare_data

    cfg, run = _copy_run(trained, tmp_path)
    assert json.loads((run / "data.json").read_text())["tokenizer"]
    other = json.loads(json.dumps(cfg))
    other["data"] |= {"max_corpus_mb": 0.12, "prepared_dir": ""}
    other["data"]["prepared_dir"] = str(prepare_data(C.from_dict(other).data, progress=False).dir)
    metrics = (run / "metrics.jsonl").read_text()
    with pytest.raises(
        C.ConfigError,
        match=r"data: .* was trained with (tokenizer|train.bin) [0-9a-f]{12}, this "
        r"run's is [0-9a-f]{12}; .* --train.init_from",
    ):
        _start_step(other)
    assert (run / "metrics.jsonl").read_text() == metrics
    assert _start_step(cfg) == 4  # the run's own data resumes


def _other_tokenizer(cfg: dict) -> Path:
    """The tokenizer.json of another corpus with the same vocabulary size (other merges)."""
    from loom.data import prepare_data

    other = json.loads(json.dumps(cfg))
    other["data"] |= {"max_corpus_mb": 0.12, "prepared_dir": ""}
    return prepare_data(C.from_dict(other).data, progress=False).dir / "tokenizer.json"


def test_a_checkpoint_is_used_only_with_the_tokenizer_it_was_trained_with(trained, tmp_path):
    """Every checkpoint records its tokenizer's SHA-256: a resume (train.resume from another run) or an
    export (a checkpoint copied into another run) with another tokenizer of the same size is refused
    in one line naming both, before anything is written."""
    import hashlib
    import shutil

    from loom.checkpoint.format import CheckpointError
    from loom.checkpoint.hf_export import export_hf

    cfg, run = trained
    ckpt = run / "checkpoints" / "step-00000004"
    recorded = json.loads((ckpt / "train_state.json").read_text())["tokenizer_sha256"]
    assert recorded == hashlib.sha256((run / "tokenizer.json").read_bytes()).hexdigest()
    other_tok = _other_tokenizer(cfg)
    other_sha = hashlib.sha256(other_tok.read_bytes()).hexdigest()
    assert other_sha != recorded
    said = rf"{ckpt.name}: trained with another tokenizer \(sha256 {recorded[:12]}\) than .*\(sha256 {other_sha[:12]}\)"

    other = json.loads(json.dumps(cfg))  # a new run on the other corpus, resuming this run's checkpoint
    other["data"] |= {"max_corpus_mb": 0.12, "prepared_dir": str(other_tok.parent)}
    other["run"]["dir"] = str(tmp_path / "new")
    with pytest.raises(CheckpointError, match=said + r"; its token ids would mean other text"):
        _start_step(other, resume=str(ckpt))
    assert not (tmp_path / "new" / "checkpoints").exists() or not any(
        (tmp_path / "new" / "checkpoints").iterdir()
    )

    _, copied = _copy_run(trained, tmp_path)  # a run of the other tokenizer, holding this checkpoint
    shutil.copyfile(other_tok, copied / "tokenizer.json")
    ident = json.loads((copied / "data.json").read_text()) | {"tokenizer": other_sha}
    (copied / "data.json").write_text(json.dumps(ident))
    with pytest.raises(CheckpointError, match=said):
        export_hf(copied / "checkpoints" / "step-00000004", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    export_hf(ckpt, tmp_path / "hf")  # in its own run: fine


def test_an_unreadable_latest_is_reported_once_however_often_it_is_looked_up(trained, tmp_path, caplog):
    from loom.checkpoint.load import find

    _, run = _copy_run(trained, tmp_path)
    (run / "checkpoints" / "latest").write_text("{")
    with caplog.at_level(logging.WARNING, logger="loom"):
        for _ in range(3):  # the launcher's check, the ranks' resume, ...
            assert find(run)[0].name == "step-00000004"
    said = [r.getMessage() for r in caplog.records]
    assert sum("is unusable" in m for m in said) == 1, said
    assert sum("instead of the checkpoint 'latest' names" in m for m in said) == 1, said


def test_a_resume_with_another_model_of_the_same_shapes_is_refused_naming_each_field(trained, tmp_path):
    """Heads regrouped, another RoPE base or norm epsilon: the same tensor shapes, another model. Refused
    in one line naming each field with its saved and new values; what may change is accepted."""
    from loom.checkpoint.format import CheckpointError

    cfg, run = _copy_run(trained, tmp_path)
    ckpt = run / "checkpoints" / "step-00000004"
    for model, said in (
        (
            {"n_heads": 2, "n_kv_heads": 1},
            f"model.n_heads: {ckpt} was saved with 4, this run has 2; "
            "model.n_kv_heads: saved with 2, this run has 1; ",
        ),
        (
            {"rope_theta": 500000.0},
            f"model.rope_theta: {ckpt} was saved with 10000.0, this run has 500000.0; ",
        ),
        ({"norm_eps": 1e-3}, f"model.norm_eps: {ckpt} was saved with 1e-05, this run has 0.001; "),
    ):
        with pytest.raises(CheckpointError) as e:
            _start_step(with_sections(cfg, model=model))
        msg = str(e.value)
        assert msg.startswith(said) and msg.endswith("Use the saved values to resume, or start a new run.dir")
        assert "\n" not in msg
    free = {"dropout": 0.1, "init_std": 0.5, "max_seq_len": 64, "hf_architecture": "LlamaForCausalLM"}
    assert _start_step(with_sections(cfg, model=free)) == 4  # RoPE: max_seq_len extends the context


def test_a_resume_with_another_optimizer_says_so_first(trained, tmp_path):
    """An AdamW checkpoint resumed with Adafactor: the optimizer named (it was a list of missing
    optimizer tensors); train.init_from, which it suggests, starts a new run and is not checked."""
    from loom.checkpoint.format import CheckpointError

    cfg, run = _copy_run(trained, tmp_path)
    ckpt = run / "checkpoints" / "step-00000004"
    other = with_sections(cfg, train={"optimizer": "adafactor"}, model={"n_heads": 2, "n_kv_heads": 1})
    with pytest.raises(CheckpointError) as e:
        _start_step(other)
    assert str(e.value) == (
        f"train.optimizer: {ckpt} was saved with adamw, this run has adafactor; its optimizer state is "
        f"adamw's. Use train.optimizer = adamw to resume, or start a new run.dir (train.init_from = "
        f"{ckpt} keeps the weights, with a fresh adafactor state)"
    )
    fresh = with_sections(cfg, train={"optimizer": "adafactor", "init_from": str(ckpt)})
    fresh["run"]["dir"] = str(tmp_path / "new")
    assert _start_step(fresh) == 0


def test_which_model_fields_a_resume_compares():
    """Learned positions keep their table's rows, RoPE may extend its context; fields with no effect
    on the recorded model (a dense model's top_k, multiple_of beside an explicit ffn_dim) are not
    compared; a checkpoint without a recorded config is not checked."""
    from loom.checkpoint.recorded import free_on_resume, model_changes, recorded_config

    def changes(recorded: dict, **edit) -> list:
        saved = recorded_config({"config": C.to_dict(C.from_dict({"model": recorded}))})
        assert saved is not None
        now = C.from_dict({"model": recorded | edit})
        return [name for name, _, _ in model_changes(saved, now, free_on_resume(saved))]

    assert changes({"positions": "learned"}, max_seq_len=512) == ["model.max_seq_len"]
    assert changes({"positions": "learned"}, rope_theta=1e6) == []
    assert changes({}, max_seq_len=512) == []
    assert changes({}, top_k=1) == []
    assert changes({"n_experts": 4}, top_k=1) == ["model.top_k"]
    assert changes({"ffn_dim": 128}, multiple_of=32) == []
    assert changes({}, multiple_of=32) == []  # the automatic width stays 704
    assert changes({}, multiple_of=256) == ["model.multiple_of"]  # 704 -> 768
    assert recorded_config({"config": {"train": {}}}) is None


def test_a_run_whose_only_checkpoint_lost_its_manifest_is_one_line_naming_it(
    trained, tmp_path, capsys, caplog
):
    """Convert and export of a run with no complete checkpoint said two lines: a warning that
    ``latest`` names an incomplete one, then "holds no checkpoint"; now one line with the reason."""
    import shutil

    from loom.cli import main

    _, run = _copy_run(trained, tmp_path)
    shutil.rmtree(run / "checkpoints" / "step-00000002")
    (run / "checkpoints" / "step-00000004" / "manifest.json").unlink()
    for argv in (
        ["checkpoint", "convert", str(run), str(tmp_path / "m.safetensors")],
        ["export", "hf", str(run), str(tmp_path / "hf")],
    ):
        with caplog.at_level(logging.WARNING):
            assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"loom: error: {run}: holds no checkpoint (step-00000004, which latest names, has no "
            "manifest.json: incomplete or deleted)"
        ], err
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        caplog.clear()
    assert not (tmp_path / "m.safetensors").exists() and not (tmp_path / "hf").exists()
