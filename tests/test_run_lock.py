"""One owner per run directory: a second ``loom train`` on a running job's directory is refused in
one line naming the holder, and the first run's checkpoints and metrics stay intact."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loom import config as C

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One private LOOM_CACHE_DIR for the module's runs: the same corpus (0.3 MB, vocabulary 300),
    prepared by the first run that needs it and reused by the others."""
    return tmp_path_factory.mktemp("cache")


def test_lock_names_its_holder_and_is_released(tmp_path):
    from loom.train.run_lock import RunLock

    holder = RunLock(tmp_path / "run")
    with pytest.raises(
        C.ConfigError, match=rf"run.dir: {tmp_path / 'run'} is in use by pid {os.getpid()} on "
    ):
        RunLock(tmp_path / "run")
    holder.release()
    with RunLock(tmp_path / "run"):  # released on exit
        pass


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    from loom.train.run_lock import RunLock

    code = f"from loom.train.run_lock import RunLock; RunLock({str(tmp_path)!r}); import time; time.sleep(60)"
    holder = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT))
    )
    try:
        deadline = time.time() + 60
        while f'"pid": {holder.pid}' not in _read(tmp_path / ".loom.lock") and time.time() < deadline:
            time.sleep(0.1)
        with pytest.raises(C.ConfigError, match=f"pid {holder.pid}"):
            RunLock(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    with RunLock(tmp_path):  # the kernel released it with the process
        pass


def test_second_run_on_a_running_directory_is_refused(tmp_path, cache):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), LOOM_CACHE_DIR=str(cache))
    common = [
        "train",
        "configs/debug.toml",
        "--run.dir",
        str(run),
        "--run.nproc",
        "1",
        "--run.progress",
        "false",
        "--data.max_corpus_mb",
        "0.3",
        "--data.vocab_size",
        "300",
        "--train.checkpoint_every",
        "10",
        "--train.log_every",
        "10",
        "--train.eval_every",
        "0",
        "--run.tensorboard",
        "false",
    ]
    first = subprocess.Popen(
        [sys.executable, "-m", "loom", *common, "--train.steps", "60", "--train.lr", "3e-3"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while not (run / "metrics.jsonl").exists() and time.time() < deadline and first.poll() is None:
            time.sleep(0.2)
        second = subprocess.run(
            [sys.executable, "-m", "loom", *common, "--train.steps", "60", "--train.lr", "1e-3"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and f"is in use by pid {first.pid}" in lines[0], second.stderr
        out, err = first.communicate(timeout=300)
        assert first.returncode == 0, err[-2000:]
    finally:
        if first.poll() is None:
            first.kill()
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(10, 61, 10))  # the first run's rows, none lost or doubled
    assert json.loads((run / "checkpoints" / "final" / "meta.json").read_text())["step"] == 60
    assert C.load_toml(str(run / "config.toml")).train.lr == 3e-3  # not replaced by the refused run


def test_an_error_inside_the_ranks_reaches_the_user_as_one_line(tmp_path, cache):
    """A Loom error raised inside the ranks (a resume from a checkpoint whose tensor file was altered:
    its hash is checked by the ranks that read it) is one line naming the file and the rank, with the
    traceback in a file, not the launcher's traceback. Neither the run nor the failed one leaves
    anything in the temp dir (the elastic agent's directories)."""
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    scratch.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), LOOM_CACHE_DIR=str(cache), TMPDIR=str(scratch))
    common = [
        "train",
        "configs/debug.toml",
        "--run.dir",
        str(run),
        "--run.progress",
        "false",
        "--data.max_corpus_mb",
        "0.3",
        "--data.vocab_size",
        "300",
        "--train.eval_every",
        "0",
        "--run.tensorboard",
        "false",
    ]
    first = subprocess.run(
        [sys.executable, "-m", "loom", *common, "--train.steps", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    metrics = (run / "metrics.jsonl").read_text()
    ckpt = run / "checkpoints" / "step-00000002"
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # one bit of a tensor: the manifest the launcher reads is intact
    shard.write_bytes(bytes(data))
    p = subprocess.run(
        [sys.executable, "-m", "loom", *common, "--train.steps", "4", "--train.resume", str(ckpt)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode != 0
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    # every rank raises it; the launcher names those that failed before it stopped the rest (0, 1 or both)
    assert lines[0].startswith("loom: ") and not lines[0].startswith("loom: error: "), lines[0]
    assert shard.name in lines[0] and re.search(r"\(rank [01]; traceback in ", lines[0]), lines[0]
    trace = Path(re.search(r"traceback in ([^;)]+)", lines[0]).group(1))
    assert "CheckpointError" in trace.read_text()
    assert (run / "metrics.jsonl").read_text() == metrics  # nothing already written was touched
    assert not list(scratch.iterdir())


def test_a_failure_of_rank_0_alone_is_one_line(tmp_path, cache):
    """Rank 0 fails writing its run files (config.toml is a directory); rank 1, already waiting in
    the step's first collective, sees rank 0's recorded error in its heartbeat and leaves the report
    to the launcher: one line, not its own "collective failed ... gone: rank 0" before it."""
    run = tmp_path / "run"
    (run / "config.toml").mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), LOOM_CACHE_DIR=str(cache))
    args = ["train", "configs/debug.toml", "--run.dir", str(run), "--run.progress", "false"]
    args += ["--data.max_corpus_mb", "0.3", "--data.vocab_size", "300", "--train.steps", "2"]
    p = subprocess.run(
        [sys.executable, "-m", "loom", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    assert p.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("loom: rank 0 ") and "IsADirectoryError" in lines[0], lines
