"""A lost node launcher: two launchers ("nodes", one rank each) meet at a c10d rendezvous on
loopback; one launcher is killed with SIGKILL. The surviving node ends within ``run.timeout_s`` with
one line naming the lost node, its host and its launcher, every rank having saved the same step, and
no process of either node is left behind (the killed launcher's rank included)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import prepared_config

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 8.0  # run.timeout_s: the survivor must end within it (it takes 1.5-4.3 s here)
GRACE_S = 5.0  # run.preempt_grace_s: an orphaned rank ends within it
OVERRIDES = {
    "model": {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "max_seq_len": 32},
    "data": {"seq_len": 32, "vocab_size": 384, "max_corpus_mb": 0.2},
    "train": {
        "steps": 100_000,
        "global_batch": 4,
        "micro_batch": 2,
        "warmup_steps": 1,
        "log_every": 1,
        "eval_every": 0,
        "checkpoint_every": 0,
    },
    "run": {
        "progress": False,
        "tensorboard": False,
        "threads": 1,
        "nproc": 1,
        "timeout_s": TIMEOUT_S,
        "preempt_grace_s": GRACE_S,
        "straggler_pct": 0,  # training's own lines: only the step lines go on after the kill
    },
}
needs_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; prctl")


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> dict:
    return prepared_config(OVERRIDES, tmp_path_factory.mktemp("cache"))


def _group(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` that have not ended (zombies count as ended)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                out.append(int(d.name))
    return out


class Node:
    """``python -m loom train --nnodes 2 --node-rank R`` in its own process group, lines timestamped."""

    def __init__(self, cfg: dict, rank: int, endpoint: str, *extra: str) -> None:
        args = [f"--{s}.{k}={v}" for s, table in cfg.items() for k, v in table.items()]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loom", "train", *args, "--nnodes=2", f"--node-rank={rank}"]
            + [f"--rdzv-endpoint={endpoint}", *extra],
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its ranks share its process group, also once orphaned
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _steps(run: Path) -> int:
    try:
        rows = (run / "metrics.jsonl").read_text().splitlines()
        return max((json.loads(r).get("step", 0) for r in rows[-3:]), default=0)
    except (OSError, ValueError):
        return 0


class Job:
    """Two nodes of one job on ``run``; ``lost``: the node whose launcher the test kills."""

    def __init__(self, cfg: dict, run: Path, lost: int, *extra: str) -> None:
        from loom.launch import free_port

        cfg = json.loads(json.dumps(cfg))
        cfg["run"]["dir"] = str(run)
        endpoint = f"127.0.0.1:{free_port()}"
        self.run, self.lost = run, lost
        self.nodes = [Node(cfg, r, endpoint, *extra) for r in range(2)]
        self.victim, self.survivor = self.nodes[lost], self.nodes[1 - lost]
        self.rc: int | None = None
        self.took = 0.0

    def running(self) -> bool:
        return all(n.proc.poll() is None for n in self.nodes)

    def processes(self) -> list[int]:
        return [pid for n in self.nodes for pid in _group(n.proc.pid)]

    def close(self) -> None:
        for n in self.nodes:
            for pid in _group(n.proc.pid):
                os.kill(pid, signal.SIGKILL)
            if n.proc.poll() is None:
                n.proc.kill()
            n.proc.wait()
            n._reader.join(5)


@needs_linux
@pytest.mark.slow
def test_a_lost_node_launcher_is_named_by_the_survivor_within_the_timeout(cfg, tmp_path):
    """Three jobs at once (start-up is most of the cost): node 1's launcher killed in one, under
    ``--max-restarts`` (node 0's agent would restart its rank and wait for node 1 at the rendezvous),
    node 0's (which hosts the rendezvous store) in the second, and in the third node 1 whole (its
    launcher and its rank at once: no marker), which the survivor names by node and host in one line."""
    jobs = [Job(cfg, tmp_path / "lost1", 1, "--max-restarts=1"), Job(cfg, tmp_path / "lost0", 0)]
    whole = Job(
        cfg, tmp_path / "whole1", 1
    )  # node 1 lost with its ranks (launcher and ranks killed together)
    jobs.append(whole)
    try:
        end = time.monotonic() + 120
        while not all(_steps(j.run) >= 2 for j in jobs):
            assert time.monotonic() < end and all(j.running() for j in jobs), "\n".join(
                n.output() for j in jobs for n in j.nodes
            )
            time.sleep(0.05)
        t0 = time.monotonic()
        for j in jobs:
            if j is whole:
                os.killpg(j.victim.proc.pid, signal.SIGKILL)
            else:
                j.victim.proc.kill()
        for j in jobs:
            try:
                j.rc = j.survivor.proc.wait(max(0.1, t0 + TIMEOUT_S + 10 - time.monotonic()))
            except subprocess.TimeoutExpired:
                j.rc = None
            j.took = time.monotonic() - t0
        end = time.monotonic() + GRACE_S + 5
        while any(j.processes() for j in jobs) and time.monotonic() < end:
            time.sleep(0.05)
        left = [pid for j in jobs for pid in j.processes()]
    finally:
        for j in jobs:
            j.close()
    for j in jobs:
        out = j.survivor.output()
        said = [ln for t, ln in j.survivor.lines if t >= t0 and not ln.startswith("step ")]
        assert j.rc == 1 and j.took < TIMEOUT_S, f"node {j.lost} lost: rc {j.rc} after {j.took:.1f} s:\n{out}"
        assert len(said) == 1, "\n".join(said)
        if j is whole:  # no marker (its ranks died too): the surviving rank's collective names where they ran
            assert said[0].startswith("loom: rank 0: collective failed"), said[0]
            assert f"gone: rank 1 (node 1, host {socket.gethostname()}; pid " in said[0], said[0]
            continue
        record = json.loads((j.run / "stopped.json").read_text())
        want = (
            f"loom: node {j.lost} (host {socket.gethostname()}) stopped answering: its launcher "
            f"(pid {j.victim.proc.pid}) is gone"
        )
        assert said[0].startswith(want), said[0]
        saved = f"every rank stopped after step {record['step']}: checkpoint {record['checkpoint']} saved"
        assert saved in said[0], said[0]
        assert json.loads((j.run / "checkpoints" / "latest").read_text())["step"] == record["step"] >= 2
    assert not left, f"processes left: {left}"


_ORPHAN = """
import signal, sys, time
from pathlib import Path
from loom.launch import watch_launcher
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a rank that cannot act on the stop: the grace ends it
assert watch_launcher(Path(sys.argv[1]), float(sys.argv[2]))
print("ready", flush=True)
time.sleep(60)
"""
_LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "ready\\n"
print(child.pid, flush=True)
time.sleep(60)
"""


@needs_linux
def test_an_orphaned_rank_marks_its_node_and_ends_within_the_grace(tmp_path):
    """The launcher of a rank is SIGKILLed: the rank writes its node's marker (node, host, the
    launcher's pid) and, as it ignores the stop, kills itself ``grace`` seconds later."""
    from loom.launch import lost_marker, lost_nodes

    grace = 0.5
    env = dict(os.environ, GROUP_RANK="3", RANK="7", PYTHONPATH=str(ROOT))
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, _ORPHAN, str(tmp_path), str(grace)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert launcher.stdout is not None
    rank = int(launcher.stdout.readline())
    try:
        t0 = time.monotonic()
        launcher.kill()
        launcher.wait()
        while _alive(rank) and time.monotonic() - t0 < grace + 5:
            time.sleep(0.02)
        took = time.monotonic() - t0
    finally:
        if _alive(rank):
            os.kill(rank, signal.SIGKILL)
    assert grace <= took < grace + 2, f"the orphan ended {took:.2f} s after its launcher"
    record = json.loads(lost_marker(tmp_path, 3).read_text())
    assert (record["node"], record["rank"], record["launcher_pid"]) == (3, 7, launcher.pid)
    assert record["host"] == socket.gethostname() and list(lost_nodes(tmp_path)) == [3]


def _alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) not in ("Z", "X")
    except OSError:
        return False


def test_a_lost_rendezvous_without_a_marker_names_node_0_in_one_line(tmp_path):
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from loom.launch import Nodes, rendezvous_lost_line

    error = RendezvousConnectionError("The connection to the C10d store has failed.\nmore")
    line = rendezvous_lost_line(Nodes(2, 1, "head:29400"), error, tmp_path)
    assert line == (
        "loom: node 0 (rendezvous head:29400) stopped answering: RendezvousConnectionError, its launcher "
        "or its host is gone; the ranks stopped before a step could be saved"
    )
    line = rendezvous_lost_line(Nodes(2, 0, "head:29400"), error, tmp_path)
    assert line.startswith(
        "loom: the rendezvous at head:29400 failed: RendezvousConnectionError: The connection"
    )
    assert "\n" not in line
