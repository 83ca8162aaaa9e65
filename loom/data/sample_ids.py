"""The samples each step consumes, recorded (``data.record_ids``) into ``run.dir/sample_ids.jsonl``.

One line per step, written by rank 0: ``{"step": s, "ids": [[source, window], ...]}``, the step's
global batch in data-parallel rank order (each rank's rows as its sampler handed them to the step).
The rows of every rank reach rank 0 in one all-gather of ``1 + 2·rows`` int64 per rank (``[dp_rank,
ids...]``) on the gloo control group; ranks that share a dp rank (tp, cp, pp) hold the same rows and
the first of them is taken. A resumed run drops the lines past its checkpoint first, as for the
metrics, so the file reads as one uninterrupted run; :func:`read_sample_ids` keeps the last line
of each step.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

SAMPLE_IDS = "sample_ids.jsonl"


def gather_ids(ids: np.ndarray, dp_rank: int, dp: int, world: int, group, timeout_s: float) -> np.ndarray:
    """Every dp rank's ``ids`` (rows, 2) concatenated in dp-rank order, (dp·rows, 2), on every rank."""
    mine = torch.from_numpy(np.concatenate([[dp_rank], ids.reshape(-1)]).astype(np.int64))
    if world == 1:
        return ids.reshape(-1, 2)
    every = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(every, mine, group=group, async_op=True)
    assert work is not None
    work.wait(timedelta(seconds=timeout_s))
    first: dict[int, torch.Tensor] = {}
    for t in every:
        first.setdefault(int(t[0]), t[1:])
    if sorted(first) != list(range(dp)):
        raise RuntimeError(f"data.record_ids: gathered dp ranks {sorted(first)}, expected 0..{dp - 1}")
    return torch.cat([first[r] for r in range(dp)]).numpy().reshape(-1, 2)


class SampleIdLog:
    """Appends one line per step to ``run_dir/sample_ids.jsonl`` (rank 0; the others only gather)."""

    def __init__(self, run_dir: Path, is_main: bool) -> None:
        self.file = open(run_dir / SAMPLE_IDS, "a") if is_main else None  # noqa: SIM115 - held open for the run

    def write(self, step: int, ids: np.ndarray) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"step": step, "ids": ids.tolist()}) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def read_sample_ids(run_dir: str | Path) -> dict[int, list[list[int]]]:
    """Step -> its global batch's ``[source, window]`` rows, from ``run_dir/sample_ids.jsonl``."""
    out: dict[int, list[list[int]]] = {}
    for line in (Path(run_dir) / SAMPLE_IDS).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            out[int(row["step"])] = row["ids"]
    return out
