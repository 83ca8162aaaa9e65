"""End to end through the real CLI and the elastic launcher: train, outputs, generate, a dying rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--data.max_corpus_mb", "0.4", "--data.vocab_size", "384", "--run.progress", "false"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = dict(os.environ)
    e["LOOM_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    e["PYTHONPATH"] = str(ROOT)
    return e


def _loom(args, env, **kw):
    return subprocess.run(
        [sys.executable, "-m", "loom", *args], env=env, cwd=ROOT, capture_output=True, text=True, **kw
    )


def test_train_two_ranks_then_generate(tmp_path, env):
    run = tmp_path / "run"
    p = _loom(
        ["train", "configs/debug.toml", "--run.dir", str(run), "--train.steps", "30", *TINY], env, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [5, 10, 15, 20, 25, 30]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "param_bytes", "grad_bytes", "optim_bytes"):
        assert all(key in r for r in rows), key
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3  # it learns
    assert rows[0]["optim_bytes"] == 2 * rows[0]["param_bytes"]  # Adam: two fp32 moments
    assert rows[0]["comm_bytes"] > 0
    for r in rows:  # both ranks' phase times; the phases fit in the step (issue 36, item 3)
        ranks = {
            p: r[f"time_{p}_s_ranks"]
            for p in ("data", "forward", "backward", "comm_wait", "optimizer", "step")
        }
        assert all(len(v) == 2 and min(v) >= 0 for v in ranks.values()), ranks
        assert r["time_forward_s_median"] > 0 and r["time_backward_s_median"] > 0
        for rank in (0, 1):
            spent = sum(ranks[p][rank] for p in ("data", "forward", "backward", "comm_wait", "optimizer"))
            assert spent <= ranks["step"][rank] * 1.02, (rank, ranks)
        assert r["time_step_s_max"] == max(ranks["step"]) and r["time_step_s_max_rank"] in (0, 1)
    assert (run / "config.toml").exists() and (run / "tokenizer.json").exists()
    assert any((run / "tensorboard").iterdir())
    from safetensors import safe_open

    with safe_open(str(run / "checkpoints" / "final" / "model.safetensors"), "pt") as f:
        assert f.metadata()["format"] == "pt"  # what transformers 4.x's safetensors reader requires
    g = _loom(
        ["generate", "--run.dir", str(run), "--prompt", "def ", "--max_new_tokens", "20"], env, timeout=120
    )
    assert g.returncode == 0, g.stderr[-2000:]
    assert g.stdout.startswith("def ") and len(g.stdout.strip()) > 10


def _worker_pids(parent: int) -> list[int]:
    """Rank processes: spawned children of the launcher (not its resource tracker)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and "spawn_main" in cmd:
            out.append(int(d.name))
    return sorted(out)


def _start_and_signal(tmp_path, env, signal_of) -> tuple[subprocess.Popen, str, list[int], Path]:
    """Start a long 2-rank run, wait until it logs, send ``signal_of(launcher_pid, rank_pids)``."""
    run = tmp_path / "run"
    args = [
        "train",
        "configs/debug.toml",
        "--run.dir",
        str(run),
        "--train.steps",
        "100000",
        "--train.log_every",
        "1",
        *TINY,
    ]
    p = subprocess.Popen(
        [sys.executable, "-m", "loom", *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 240
        metrics = run / "metrics.jsonl"
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            time.sleep(0.5)
        assert metrics.exists(), "training never started"
        pids = _worker_pids(p.pid)
        assert len(pids) == 2, pids
        pid, sig = signal_of(p.pid, pids)
        os.kill(pid, sig)
        _, err = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
    time.sleep(0.5)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids), "orphan rank left"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]  # nothing written is corrupted
    assert rows and all("loss" in r for r in rows)
    return p, err, pids, run


@pytest.mark.skipif(not Path("/proc").exists(), reason="needs /proc to find the rank processes")
def test_killed_rank_stops_job_with_its_name(tmp_path, env):
    p, err, _, _ = _start_and_signal(tmp_path, env, lambda launcher, ranks: (ranks[-1], signal.SIGKILL))
    assert p.returncode != 0
    last = [ln for ln in err.splitlines() if ln.startswith("loom:")]
    assert last and "rank" in last[-1] and "SIGKILL" in last[-1], err[-2000:]


@pytest.mark.skipif(not Path("/proc").exists(), reason="needs /proc to find the rank processes")
def test_ctrl_c_stops_every_rank(tmp_path, env):
    p, err, _, _ = _start_and_signal(tmp_path, env, lambda launcher, ranks: (launcher, signal.SIGINT))
    assert p.returncode != 0
    last = [ln for ln in err.splitlines() if ln.startswith("loom:")]
    # every rank stops after the same step and saves it (tests/test_preempt.py checks the resume)
    assert last and last[-1].startswith("loom: stopped by SIGINT after step "), err[-2000:]
    assert last[-1].endswith("saved; run the same command to resume") and "Traceback" not in err, err[-2000:]


def test_a_failed_metrics_write_is_one_error_naming_the_file(tmp_path, monkeypatch, capsys):
    """Disk full while writing a metrics row: one OSError naming metrics.jsonl (a bare write() error
    has no file name), and with TensorBoard the event writer's error, not a writer-thread traceback."""
    import errno
    import threading

    from loom.train import metrics as M

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    w = M.MetricsWriter(tmp_path, enabled=True, tensorboard=True)
    monkeypatch.setattr(M.os, "write", full)
    with pytest.raises(OSError, match="No space left on device") as e:
        w.write({"step": 1, "loss": 1.0})
    assert e.value.filename == str(tmp_path / "metrics.jsonl")
    monkeypatch.undo()
    monkeypatch.setattr(w._tb, "flush", full)
    with pytest.raises(OSError) as e:
        w.write({"step": 2, "loss": 1.0})
    assert e.value.filename == str(tmp_path / "tensorboard")

    class _AsyncWriterThread(threading.Thread):  # TensorBoard's writer thread, failing as on a full disk
        def run(self):
            full()

    t = _AsyncWriterThread()
    t.start()
    t.join()
    assert "Traceback" not in capsys.readouterr().err
    w.close()
