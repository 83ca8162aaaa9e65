"""A run directory damaged or edited between two attempts: each damage is refused in one line
naming the file and what is wrong, or (a damaged newest checkpoint of run.dir) skipped for the older
one, as a damaged manifest is; never a traceback, never training on the wrong weights.

Every test copies one tiny run (trained 2 steps in this process, checkpoints at steps 1 and 2), damages
the copy, and calls ``loom.cli.main`` in this process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loom import config as C
from tests.helpers import TINY_JOB, with_sections

pytestmark = pytest.mark.usefixtures("clean_logging")  # the CLI runs in-process: its logging set-up

TINY = with_sections(
    TINY_JOB, train={"warmup_steps": 1, "checkpoint_every": 1, "checkpoint_async": False}, run={"nproc": 1}
)
NEWEST = "step-00000002"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny config as TOML, a run of it trained 2 steps), made once."""
    from loom.data import prepare_data
    from loom.train.trainer import RankEnv, Trainer

    root = tmp_path_factory.mktemp("damaged")
    mp = pytest.MonkeyPatch()
    mp.setenv("LOOM_CACHE_DIR", str(root / "cache"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        mp.delenv(k, raising=False)
    cfg = C.from_dict(json.loads(json.dumps(TINY)))
    cfg.data.prepared_dir = str(prepare_data(cfg.data, progress=False).dir)
    tiny = root / "tiny.toml"
    tiny.write_text(C.dump_toml(cfg))
    cfg.run.dir = str(root / "run")
    trainer = Trainer(cfg, RankEnv(0, 1, 0, 1))
    try:
        trainer.fit()
    finally:
        trainer.heartbeat.close()
    yield tiny, root / "run"
    mp.undo()


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run, to damage."""
    return Path(shutil.copytree(trained[1], tmp_path / "run"))


def _main(argv: list[str], capsys) -> tuple[int, str]:
    from loom.cli import main

    capsys.readouterr()
    rc = main(argv)
    return rc, capsys.readouterr().err


def _train(trained, run: Path, capsys, steps: int = 3) -> tuple[int, str]:
    return _main(["train", str(trained[0]), "--run.dir", str(run), "--train.steps", str(steps)], capsys)


def _one_line(rc: int, err: str, *names: str) -> str:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("loom: error: "), err
    assert "Traceback" not in err
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"
    return lines[0]


def _reseal(ckpt: Path, drop_hash: bool = False) -> None:
    """Seal ``ckpt`` again after an edit, as a save would (its manifest's sizes and SHA-256s, and the
    manifest's hash in ``latest``): the integrity check passes. ``drop_hash``: ``latest`` records no
    hash for it instead (the manifest itself is then taken as it is)."""
    from loom.checkpoint.integrity import hash_bytes, manifest_bytes, sha256_file

    if not drop_hash:
        names = json.loads((ckpt / "manifest.json").read_text())["files"]
        table = {n: (hash_bytes((ckpt / n).read_bytes()), (ckpt / n).stat().st_size) for n in names}
        (ckpt / "manifest.json").write_bytes(manifest_bytes(table))
    latest = json.loads((ckpt.parent / "latest").read_text())
    sha = None if drop_hash else sha256_file(ckpt / "manifest.json")
    latest["manifests"][ckpt.name] = sha
    if latest["tag"] == ckpt.name:
        latest["manifest_sha256"] = sha
    (ckpt.parent / "latest").write_text(json.dumps(latest))


def _edit_json(path: Path, edit) -> None:
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))


# ----------------------------------------------------------------------------- 1. index vs. stored tensors
def _other_key(index: dict) -> None:
    """Both pieces of wk read wq's stored tensor (another shape)."""
    tensors = index["tensors"]
    for piece in tensors["model.layers.0.attention.wk.weight"]["pieces"]:
        piece["key"] = "model.layers.0.attention.wq.weight"


def _other_dtype(index: dict) -> None:
    index["tensors"]["model.norm.weight"]["dtype"] = "bfloat16"


@pytest.mark.parametrize(
    "edit,names",
    [
        (_other_key, ["model.layers.0.attention.wq.weight", "float32 [32, 32]", "float32 [16, 32]"]),
        (_other_dtype, ["model.norm.weight", "float32 [32]", "bfloat16 [32]"]),
    ],
    ids=["key of another shape", "dtype"],
)
def test_an_index_that_disagrees_with_the_stored_tensor_is_refused(
    trained, run, capsys, clean_logging, edit, names
):
    ckpt = run / "checkpoints" / NEWEST
    _edit_json(ckpt / "index.json", edit)
    _reseal(ckpt)
    rc, err = _train(trained, run, capsys)
    line = _one_line(
        rc, err, str(ckpt / "shard-00000-of-00001.safetensors"), str(ckpt / "index.json"), *names
    )
    assert "is stored as" in line
    assert not (run / "checkpoints" / "step-00000003").exists()


# ----------------------------------------------------------------------------- 2. manifest entry types
BAD_MANIFESTS = {
    "bytes not an integer": (
        lambda m: m["files"]["index.json"].update(bytes="abc"),
        ["'index.json'", "bytes 'abc'", "an integer >= 0"],
    ),
    "bytes negative": (lambda m: m["files"]["index.json"].update(bytes=-1), ["'index.json'", "bytes -1"]),
    "entry not an object": (
        lambda m: m["files"].update({"index.json": "x"}),
        ["'index.json'", "is 'x'", "must be an object"],
    ),
    "sha256 not a list": (
        lambda m: m["files"]["train_state.json"].update(sha256="00"),
        ["'train_state.json'", "sha256 '00'"],
    ),
    "chunk_bytes": (lambda m: m.update(chunk_bytes="big"), ["chunk_bytes is 'big'"]),
}


@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
def test_a_manifest_of_wrong_types_is_refused_in_one_line(run, capsys, case, tmp_path):
    """Where ``latest`` records no hash for it, the manifest's own entries are checked."""
    edit, names = BAD_MANIFESTS[case]
    ckpt = run / "checkpoints" / NEWEST
    _edit_json(ckpt / "manifest.json", edit)
    _reseal(ckpt, drop_hash=True)
    rc, err = _main(["checkpoint", "convert", str(ckpt), str(tmp_path / "out.safetensors")], capsys)
    _one_line(rc, err, str(ckpt / "manifest.json"), *names)
    assert not (tmp_path / "out.safetensors").exists()


def test_a_newest_checkpoint_with_a_bad_manifest_is_skipped_for_the_older(
    trained, run, capsys, clean_logging
):
    """As for any damaged manifest: run.dir's newest is skipped, loudly, for the older checkpoint."""
    ckpt = run / "checkpoints" / NEWEST
    _edit_json(ckpt / "manifest.json", lambda m: m["files"]["index.json"].update(bytes="abc"))
    _reseal(ckpt, drop_hash=True)
    rc, err = _train(trained, run, capsys)
    assert rc == 0 and "Traceback" not in err, err
    assert "SKIPPING checkpoint" in err and "bytes 'abc'" in err
    assert "resumed from" in err and "step-00000001 at step 1" in err


# ----------------------------------------------------------------------------- 3. metrics.jsonl
def _rows(*steps: int) -> bytes:
    return b"".join(json.dumps({"step": s, "loss": 1.0}).encode() + b"\n" for s in steps)


def test_lines_of_metrics_that_are_no_rows_are_kept_as_they_are(tmp_path):
    from loom.checkpoint.training import truncate_metrics

    other = [
        b"\xff\xfe not UTF-8\n",
        b'{"step": "x"}\n',
        b"[1, 2]\n",
        b'{"loss": 2}\n',
        b"\n",
        b"[" * 5000 + b"\n",
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(_rows(1, 2) + b"".join(other) + _rows(3, 4, 5) + b'{"step": 6, "lo')  # torn last line
    truncate_metrics(tmp_path, 3)
    assert path.read_bytes() == _rows(1, 2) + b"".join(other) + _rows(3)
    path.write_bytes(_rows(1, 2).rstrip(b"\n"))  # a whole last row, lacking only its newline
    truncate_metrics(tmp_path, 3)
    assert path.read_bytes() == _rows(1, 2)


def test_the_other_readers_of_metrics_skip_a_line_that_is_not_utf8(tmp_path):
    """The trackers' last kept step and the final model's logged loss read past such a line."""
    from loom.train.trackers import _kept_step
    from loom.train.trainer import _logged_loss

    (tmp_path / "metrics.jsonl").write_bytes(_rows(1, 2) + b"\xff\xfe not UTF-8\n" + _rows(3))
    assert _kept_step(tmp_path) == 3
    assert _logged_loss(tmp_path, 3) == 1.0


@pytest.mark.parametrize(
    "line", [b"\xff\xfe not UTF-8\n", b'{"step": "x"}\n'], ids=["not UTF-8", "step a string"]
)
def test_a_resume_keeps_the_lines_of_metrics_that_are_no_rows(trained, run, capsys, clean_logging, line):
    metrics = run / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes() + line)
    rc, err = _train(trained, run, capsys)
    assert rc == 0 and "Traceback" not in err, err
    data = metrics.read_bytes()
    assert line in data and json.loads(data.splitlines()[-1])["step"] == 3


# ----------------------------------------------------------------------------- 4. run.dir layout
def test_a_directory_named_latest_is_refused_before_training(trained, run, capsys):
    latest = run / "checkpoints" / "latest"
    latest.unlink()
    latest.mkdir()
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    rc, err = _train(trained, run, capsys)
    _one_line(rc, err, str(latest), "is a directory", "a file")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
