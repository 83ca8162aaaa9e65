"""Dropout's stream starts from ``train.seed``: two runs of one config draw the same masks (torch
starts its default generator from a random seed), another seed draws others, and a resume continues
the saved stream, so a run with dropout resumed in the same layout equals the uninterrupted one."""

from __future__ import annotations

from tests.helpers import TINY_JOB, prepared_config, read_metrics, with_sections


def _losses(cfg: dict, run_dir, steps: int, **train) -> list[float]:
    from loom.cli import main

    job = with_sections(cfg, run={"dir": str(run_dir)}, train={"steps": steps, **train})
    args = [f"--{s}.{k}={v}" for s, table in job.items() for k, v in table.items()]
    assert main(["train", *args]) == 0
    return [r["loss"] for r in read_metrics(run_dir)]


def test_dropout_is_seeded_and_resumes_exactly(tmp_path):
    import torch

    cfg = with_sections(
        prepared_config(TINY_JOB, tmp_path / "cache"),
        model={"dropout": 0.1},
        run={"nproc": 1},
        train={"checkpoint_every": 2, "checkpoint_async": False, "warmup_steps": 1},
    )
    first = _losses(cfg, tmp_path / "a", 4)
    torch.manual_seed(99)  # whatever state the process's generator is in
    assert _losses(cfg, tmp_path / "b", 4) == first
    assert _losses(cfg, tmp_path / "c", 4, seed=7)[0] != first[0]
    _losses(cfg, tmp_path / "d", 2)
    assert _losses(cfg, tmp_path / "d", 4) == first  # resumed at step 2, same layout: bit for bit
