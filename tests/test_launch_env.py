"""Running at scale without a GPU here: srun's variables mapped to one rank per task, NCCL's
watchdog told to raise (and dump its flight recorder) instead of killing, heartbeats written
rarely, and single-rank phases waited for on a group NCCL's watchdog does not police."""

from __future__ import annotations

import json
import os
import time

import pytest

from loom.launch import expand_counts, first_host, slurm_rank_env

SRUN = {
    "SLURM_PROCID": "13",
    "SLURM_NTASKS": "16",
    "SLURM_LOCALID": "5",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "123456",
}


def test_srun_tasks_become_ranks_on_their_local_gpu():
    env = slurm_rank_env(SRUN)
    assert env == {
        "RANK": "13",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "5",
        "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(29500 + 456),
    }


def test_torchrun_variables_win_and_single_tasks_are_left_alone():
    assert slurm_rank_env(SRUN | {"RANK": "0", "WORLD_SIZE": "2"}) == {}  # srun ... torchrun
    assert slurm_rank_env(SRUN | {"SLURM_NTASKS": "1"}) == {}  # one task: the local launcher starts the ranks
    assert slurm_rank_env({}) == {}
    assert slurm_rank_env(SRUN | {"MASTER_ADDR": "head", "MASTER_PORT": "1"})["MASTER_ADDR"] == "head"


@pytest.mark.parametrize("spec,counts", [("4(x2),3", [4, 4, 3]), ("8", [8]), ("2,2(x3)", [2, 2, 2, 2])])
def test_tasks_per_node(spec, counts):
    assert expand_counts(spec) == counts


@pytest.mark.parametrize(
    "nodes,first",
    [("gpu[07-09,12],login1", "gpu07"), ("node1,node2", "node1"), ("a[3]-ib", "a3-ib"), ("solo", "solo")],
)
def test_first_host_of_a_node_list(nodes, first):
    assert first_host(nodes) == first


def test_srun_sets_the_environment_the_trainer_reads(monkeypatch):
    from loom.launch import apply_slurm_env, under_external_launcher
    from loom.train.trainer import RankEnv

    environ = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    monkeypatch.setattr(os, "environ", environ | SRUN)  # apply_slurm_env writes into it: nothing leaks
    apply_slurm_env()
    assert under_external_launcher()
    assert RankEnv.from_environ() == RankEnv(rank=13, world=16, local_rank=5, local_world=8)


def test_nccl_watchdog_raises_and_dumps_instead_of_killing(monkeypatch, tmp_path):
    from loom.train.health import apply_nccl_watchdog_env, nccl_watchdog_env

    env = nccl_watchdog_env(1800, tmp_path)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert int(env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"]) > 1800  # Loom's diagnosis runs first
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_FR_BUFFER_SIZE"]) > 0
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "flight_recorder" / "rank_")
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in env})
    os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "50"  # the user's choice stays
    apply_nccl_watchdog_env(1800, tmp_path)
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and (tmp_path / "flight_recorder").is_dir()


def test_diagnosis_names_the_flight_recorder_dump(tmp_path):
    from loom.train.health import diagnose

    (tmp_path / "flight_recorder").mkdir()
    for r in range(2):
        (tmp_path / "flight_recorder" / f"rank_{r}").write_bytes(b"x")
    try:
        raise RuntimeError("Timed out")
    except RuntimeError as e:
        msg = diagnose(e, tmp_path, rank=0, world=1, timeout_s=60)
    assert msg.endswith(f"NCCL flight recorder: {tmp_path / 'flight_recorder'}/rank_* (2 dumps)")


def test_heartbeat_interval_scales_with_the_timeout(tmp_path):
    from loom.train.health import Heartbeat, diagnose, heartbeat_interval

    assert (
        heartbeat_interval(6) == 1.0 and heartbeat_interval(160) == 20.0 and heartbeat_interval(1800) == 60.0
    )
    writes = []
    beat = Heartbeat(tmp_path, rank=0, interval=0.25)
    real = beat._write
    beat._write = lambda: (writes.append(time.time()), real())
    try:
        time.sleep(1.3)
    finally:
        beat.close()
    assert 3 <= len(writes) <= 7, writes  # about one write per interval, not one per second per rank
    # staleness is judged against the run's interval: 40 s of silence is stale at a 6 s timeout only
    body = {"rank": 1, "pid": 1, "time": time.time() - 40, "step": 3, "phase": "train step"}
    (tmp_path / "heartbeat" / "rank-00001.json").write_text(json.dumps(body))
    try:
        raise RuntimeError("Timed out")
    except RuntimeError as e:
        assert "unresponsive: rank 1" in diagnose(e, tmp_path, rank=0, world=2, timeout_s=6)
        assert "every other rank's heartbeat is fresh" in diagnose(
            e, tmp_path, rank=0, world=2, timeout_s=1800
        )


def _control_group_timeout() -> str:
    import torch
    import torch.distributed as dist

    from loom.train.setup import RankEnv, control_group

    group = control_group(RankEnv(dist.get_rank(), 2, dist.get_rank(), 2))
    return f"{dist.get_backend(group)} {group._get_backend(torch.device('cpu')).options._timeout.total_seconds()}"


def test_single_rank_phases_wait_on_a_long_gloo_group(pools):
    from loom.train.setup import CONTROL_TIMEOUT_S

    assert pools(2).run(_control_group_timeout) == [f"gloo {float(CONTROL_TIMEOUT_S)}"] * 2


@pytest.mark.parametrize(
    "env,named",
    [
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_JOB_ID"),  # no live step: left in a shell
        (SRUN | {"SLURM_PROCID": "16"}, "SLURM_PROCID=16"),  # a task id beyond the task count
        ({k: v for k, v in SRUN.items() if k != "SLURM_JOB_ID"}, "SLURM_JOB_ID"),
    ],
)
def test_stale_slurm_variables_are_refused_in_one_line(env, named):
    from loom import config as C
    from loom.launch import check_slurm_env

    with pytest.raises(C.ConfigError) as e:
        check_slurm_env(env)
    assert named in str(e.value) and "\n" not in str(e.value)
    check_slurm_env(SRUN)  # a live step passes


@pytest.mark.parametrize("rank,world", [("1", "1"), ("0", "0"), ("-1", "2"), ("x", "2"), ("5", "4")])
def test_launcher_variables_of_no_rank_are_refused(monkeypatch, rank, world):
    from loom import config as C
    from loom.launch import check_launcher_env

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(C.ConfigError, match=f"RANK={rank} WORLD_SIZE={world}"):
        check_launcher_env()


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"])
def test_a_stray_rank_variable_that_is_no_number_is_one_line_before_the_run_dir(
    monkeypatch, tmp_path, capsys, name
):
    """Alone in the shell (no launcher), a one-rank run reads it: refused before anything is written."""
    from loom.cli import main

    for other in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, "abc")
    run = tmp_path / "run"
    assert main(["train", "debug", "--train.steps", "1", "--run.nproc", "1", "--run.dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"loom: error: environment: {name}=abc is not a whole number >= 0 (a launcher sets it; unset {name} for a local run)\n"
    )
    assert not run.exists()


@pytest.mark.parametrize("world,shown", [("\n", "'\\n'"), ("", "''"), ("2 ", "'2 '")])
def test_a_launcher_value_with_a_newline_or_space_is_quoted_on_one_line(monkeypatch, world, shown):
    from loom import config as C
    from loom.launch import check_launcher_env

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(C.ConfigError) as e:
        check_launcher_env()
    assert "\n" not in str(e.value) and f"RANK=0 WORLD_SIZE={shown} describe" in str(e.value)


def test_a_rank_killed_by_a_signal_leaves_its_stacks_in_a_file_not_on_the_terminal(tmp_path):
    """@record turns the fault handler on for stderr (every thread: ~70 lines per rank on SIGBUS); a
    rank points it at run.dir/logs/rank-r-fault.txt, which the launcher's one line names."""
    import subprocess
    import sys

    code = (
        "import faulthandler, os, sys; from pathlib import Path; faulthandler.enable(all_threads=True); "
        "from loom.launch import _fault_dumps_to_file; os.environ['RANK'] = '3'; "
        f"_fault_dumps_to_file(Path({str(tmp_path)!r})); faulthandler._sigsegv()"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode < 0 and 'File "' not in out.stderr and "Segmentation" not in out.stderr
    dump = (tmp_path / "logs" / "rank-3-fault.txt").read_text()
    assert "Segmentation fault" in dump and 'File "<string>"' in dump


def test_a_rank_of_loom_s_launcher_leaves_out_what_the_launcher_said(monkeypatch, capsys, clean_logging):
    """The launcher reads the prepared data and the checkpoint to resume before the ranks do, and
    warns once; its ranks drop those warnings (they were printed 3 to 6 times), a rank under torchrun
    prints them, and every other warning still reaches stderr."""
    import logging

    from loom.notes import LAUNCHER_SAYS, UNDER_LOOM_LAUNCHER
    from loom.train.metrics import setup_logging

    log = logging.getLogger("loom")
    for launcher, want in (("1", ["[rank 1] other"]), (None, ["[rank 1] said", "[rank 1] other"])):
        if launcher is None:
            monkeypatch.delenv(UNDER_LOOM_LAUNCHER, raising=False)
        else:
            monkeypatch.setenv(UNDER_LOOM_LAUNCHER, launcher)
        setup_logging(1)
        log.warning("said", extra=LAUNCHER_SAYS)
        log.warning("other")
        assert capsys.readouterr().err.splitlines() == want
