"""Launch and network: a local run listens on loopback only; the multi-node options and the launch
config they give; the warning under bare torchrun; a stopped worker does not hold the job up."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loom import config as C

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--data.max_corpus_mb", "0.3", "--data.vocab_size", "384", "--run.progress", "false"]
needs_proc = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc")


# ----------------------------------------------------------------------------- listening sockets


def _tree(root: int) -> list[int]:
    """``root`` and every descendant process (from /proc/<pid>/stat's parent field)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _address(hex_addr: str, v6: bool) -> tuple[str, int]:
    """``/proc/net/tcp*``'s ``ADDR:PORT`` (address in host byte order, 32-bit words)."""
    ip, port = hex_addr.split(":")
    raw = bytes.fromhex(ip)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET6 if v6 else socket.AF_INET, raw), int(port, 16)


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of each TCP socket in LISTEN state held open by one of ``pids``."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                owner[target[8:-1]] = pid
    out = []
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            rows = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and f[9] in owner:  # 0A: TCP_LISTEN; f[9]: inode
                out.append((owner[f[9]], *_address(f[1], v6)))
    return out


def _is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def test_proc_net_parsing_finds_this_process_listeners():
    with socket.socket() as a, socket.socket(socket.AF_INET6) as b:
        a.bind(("127.0.0.1", 0))
        a.listen()
        b.bind(("::", 0))
        b.listen()
        found = listening_sockets([os.getpid()])
        assert (os.getpid(), "127.0.0.1", a.getsockname()[1]) in found
        assert (os.getpid(), "::", b.getsockname()[1]) in found
    assert not _is_loopback("::") and not _is_loopback("0.0.0.0") and _is_loopback("::ffff:127.0.0.1")


def test_host_store_listens_on_loopback_and_torch_reuses_it():
    """The mechanism: a store hosted on loopback first; torch's own multi-tenant store on that port
    (as the rendezvous and init_process_group open them) is the same server, no new listener."""
    from datetime import timedelta

    import torch.distributed as dist

    from loom.launch import host_store

    port = host_store("127.0.0.1")
    again = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=10), multi_tenant=True)
    again.set("k", "v")
    mine = [s for s in listening_sockets([os.getpid()]) if s[2] == port]
    assert mine == [(os.getpid(), "127.0.0.1", port)]
    client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
    assert client.get("k") == b"v"


@needs_proc
def test_local_run_listens_only_on_loopback(tmp_path):
    """A real 2-rank ``loom train``: while it trains, every listening socket of the launcher and its
    ranks (rendezvous store, rank 0's store, gloo's pairs) is on a loopback address."""
    run = tmp_path / "run"
    env = dict(os.environ, LOOM_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    for key in ("MASTER_ADDR", "GLOO_SOCKET_IFNAME", "RANK", "WORLD_SIZE"):
        env.pop(key, None)
    args = [
        "train",
        "debug",
        "--run.dir",
        str(run),
        "--train.steps",
        "100000",
        "--train.log_every",
        "1",
        "--train.eval_every",
        "0",
        "--train.checkpoint_every",
        "0",
        "--run.tensorboard",
        "false",
        *TINY,
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "loom", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        metrics, end = run / "metrics.jsonl", time.monotonic() + 180
        while time.monotonic() < end and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.stdout.read()[-3000:] if proc.stdout else ""
            time.sleep(0.1)
        assert metrics.exists(), "training never started"
        found = listening_sockets(_tree(proc.pid))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    ranks = {json.loads((run / "heartbeat" / f"rank-{r:05d}.json").read_text())["pid"] for r in range(2)}
    owners = {pid for pid, _, _ in found}
    assert proc.pid in owners and owners & ranks, found  # the rendezvous store and rank 0's store were seen
    exposed = [s for s in found if not _is_loopback(s[1])]
    assert not exposed, f"listening beyond loopback (pid, address, port): {exposed}"


# ----------------------------------------------------------------------------- options and config


def _cfg() -> C.LoomConfig:
    cfg = C.load("debug", [])
    cfg.run.timeout_s = 42
    return cfg


def test_launch_options_parse_and_refuse_in_one_line():
    from loom.launch import LaunchOptions, Nodes, launch_options

    assert launch_options({}) == LaunchOptions(0, None)
    opts = launch_options(
        {"nnodes": "4", "node_rank": "3", "rdzv_endpoint": "head:29400", "max_restarts": "2"}
    )
    assert opts == LaunchOptions(2, Nodes(4, 3, "head:29400"))
    assert opts.nodes is not None and (opts.nodes.host, opts.nodes.port) == ("head", 29400)
    assert launch_options({"nnodes": "2", "rdzv_endpoint": "[::1]:5"}).nodes == Nodes(2, 0, "[::1]:5")
    cfg = _cfg()
    cfg.run.nproc = 2
    assert opts.world(cfg) == 8 and LaunchOptions().world(cfg) == 2
    bad = {
        "--nnodes": {"nnodes": "0"},
        "--node-rank": {"nnodes": "2", "node_rank": "2", "rdzv_endpoint": "h:1"},
        "--rdzv-endpoint": {"nnodes": "2"},
        "--max-restarts": {"max_restarts": "-1"},
    }
    for flag, plain in bad.items():
        with pytest.raises(C.ConfigError, match=f"^{flag}: ") as e:
            launch_options(plain)
        assert "\n" not in str(e.value)
    for endpoint in ("head", "head:", ":29400", "head:0", "head:70000", "head:x"):
        with pytest.raises(C.ConfigError, match="^--rdzv-endpoint: expected HOST:PORT"):
            launch_options({"nnodes": "2", "rdzv_endpoint": endpoint})


def test_multi_node_launch_config_and_environment(monkeypatch):
    """Every node names the same run at the endpoint, node 0 hosts the store, restarts are kept,
    and the launcher's environment has what makes restarts work."""
    from loom.launch import Nodes, _set_launch_env, launch_config

    monkeypatch.setattr(
        os,
        "environ",
        {
            k: v
            for k, v in os.environ.items()
            if k not in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "GLOO_SOCKET_IFNAME")
        },
    )
    cfg = _cfg()
    configs = [launch_config(cfg, 4, 3, Nodes(2, r, "10.1.2.3:29400"), 29400, "logs") for r in range(2)]
    for r, lc in enumerate(configs):
        assert (lc.min_nodes, lc.max_nodes, lc.nproc_per_node, lc.max_restarts) == (2, 2, 4, 3)
        assert (lc.rdzv_backend, lc.rdzv_endpoint) == ("c10d", "10.1.2.3:29400")
        assert lc.rdzv_configs["is_host"] is (r == 0) and lc.rdzv_configs["timeout"] == 42
        assert lc.local_addr is None  # this node's own name, reachable from the others
    assert configs[0].run_id == configs[1].run_id
    _set_launch_env("10.1.2.3")
    assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # a real multi-node job: not bound to lo
    local = launch_config(cfg, 2, 0, None, 1234, "logs")
    assert (local.min_nodes, local.rdzv_endpoint, local.local_addr) == (1, "127.0.0.1:1234", "127.0.0.1")
    assert launch_config(cfg, 1, 0, Nodes(2, 1, "127.0.0.1:9"), 9, "logs").local_addr == "127.0.0.1"
    _set_launch_env("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo" and os.environ["MASTER_ADDR"] == "127.0.0.1"


def test_bare_torchrun_with_restarts_warns_once():
    from loom.launch import torchrun_restart_warning

    env = {"RANK": "0", "TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RESTART_COUNT": "0"}
    line = torchrun_restart_warning(env)
    assert line is not None and "\n" not in line
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line and "--rdzv-endpoint" in line
    assert torchrun_restart_warning(env | {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}) is None
    assert torchrun_restart_warning(env | {"TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert torchrun_restart_warning(env | {"RANK": "1"}) is None  # once: rank 0
    assert torchrun_restart_warning(env | {"TORCHELASTIC_RESTART_COUNT": "1"}) is None  # first attempt only
    assert torchrun_restart_warning({"RANK": "0"}) is None  # srun, or torchrun without restarts


# ----------------------------------------------------------------------------- a stopped worker


@needs_proc
def test_a_stopped_worker_asked_to_stop_is_killed_at_once():
    from loom.launch import StoppedWorkerReaper, stopped_with_kill_pending

    child = subprocess.Popen(["sleep", "60"])
    reaper = None
    try:
        os.kill(child.pid, signal.SIGSTOP)
        end = time.monotonic() + 5
        while "T" not in Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]:
            assert time.monotonic() < end
            time.sleep(0.01)
        reaper = StoppedWorkerReaper(interval=0.05)
        time.sleep(0.3)
        assert child.poll() is None and not stopped_with_kill_pending(child.pid)  # stopped alone: left alone
        os.kill(child.pid, signal.SIGTERM)  # as the elastic agent does; it waits for a SIGCONT
        assert stopped_with_kill_pending(child.pid) or child.poll() is not None
        assert child.wait(timeout=5) == -signal.SIGKILL
        assert child.pid in reaper.killed
    finally:
        if reaper is not None:
            reaper.close()
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_node_without_node_0_stops_within_the_run_timeout_in_one_line():
    """``--node-rank 1`` with nobody at the endpoint: one line naming it after ``run.timeout_s``
    (torch's store client would wait its own 60 s and then print a traceback); once a store listens
    the wait ends at once."""
    import time

    from loom.launch import Nodes, wait_for_rendezvous

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = Nodes(2, 1, f"127.0.0.1:{port}")
    t0 = time.monotonic()
    with pytest.raises(
        C.ConfigError, match=rf"^--rdzv-endpoint: nothing answered at 127.0.0.1:{port} within"
    ) as e:
        wait_for_rendezvous(nodes, 1.0)
    assert 1.0 <= time.monotonic() - t0 < 4 and "\n" not in str(e.value) and "--node-rank 0" in str(e.value)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        t0 = time.monotonic()
        wait_for_rendezvous(Nodes(2, 1, f"127.0.0.1:{server.getsockname()[1]}"), 30.0)
        assert time.monotonic() - t0 < 1
