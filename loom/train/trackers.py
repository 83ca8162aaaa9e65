"""Experiment trackers beside ``metrics.jsonl``: ``run.trackers = "wandb,mlflow"`` (TensorBoard is
``run.tensorboard``). Rank 0 sends each metrics row (the same scalars), the resolved config once, and
the planner's prediction with the last row.

A tracker's run id is kept in ``run.dir/trackers.json``, so a restart or a resume of the same run
directory continues the same tracker run instead of starting a new one; so is the last step each
tracker was sent, and a resumed attempt does not send those steps again (a tracker's history cannot
be cut as ``metrics.jsonl`` and TensorBoard are: it would hold two values of each; a resume repeats
the same losses bit for bit). Both libraries are optional
(the ``trackers`` extra): naming one that is not installed is one line before any process starts.

- ``wandb``: project ``WANDB_PROJECT`` (default ``loom``), run files under ``run.dir``; offline
  with ``WANDB_MODE=offline`` (``wandb sync`` uploads later).
- ``mlflow``: ``MLFLOW_TRACKING_URI`` when set (a server, a database), else a local file store in
  ``run.dir/mlruns`` (MLflow 3 wants ``MLFLOW_ALLOW_FILE_STORE`` for it, set for this process only).
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any, Protocol

from loom.config import ConfigError

TRACKERS = ("wandb", "mlflow")
IDS = "trackers.json"  # run.dir: {"wandb": run id, "mlflow": run id}


def wants_tensorboard(run) -> bool:
    """TensorBoard events: ``run.tensorboard``, or ``tensorboard`` named in ``run.trackers``."""
    return run.tensorboard or "tensorboard" in (n.strip() for n in run.trackers.split(","))


def tracker_names(spec: str) -> list[str]:
    """The external trackers ``run.trackers`` names; unknown names and missing libraries are one line each."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for n in names:
        if n == "tensorboard":
            continue
        if n not in TRACKERS:
            raise ConfigError(
                f"run.trackers: unknown tracker {n!r}; choose from tensorboard, {', '.join(TRACKERS)}"
            )
        if importlib.util.find_spec(n) is None:
            raise ConfigError(f"run.trackers: {n} is not installed; pip install {n} (or loom[trackers])")
    return [n for n in names if n != "tensorboard"]


class Tracker(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))}


def _flat(cfg: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class _Ids:
    """The tracker run ids of one run directory, and the last step each was sent (key
    ``<name>_step``); written atomically, read at every start."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / IDS
        try:
            self.ids: dict[str, Any] = json.loads(self.path.read_text()) if self.path.is_file() else {}
        except ValueError:
            self.ids = {}

    def get(self, name: str) -> str | None:
        value = self.ids.get(name)
        return value if isinstance(value, str) else None

    def sent(self, name: str) -> int:
        value = self.ids.get(f"{name}_step", 0)
        return value if isinstance(value, int) else 0

    def set(self, name: str, value: str | int) -> None:
        self.ids[name] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.ids, indent=1, sort_keys=True))
        os.replace(tmp, self.path)


class _Once:
    """A tracker that is sent each step once across attempts: rows up to the step an earlier attempt
    sent are skipped (``_Ids.sent``), and each row sent is recorded."""

    def __init__(self, name: str, tracker: Tracker, ids: _Ids) -> None:
        self.name, self.tracker, self.ids = name, tracker, ids
        self.sent = ids.sent(name)

    def log(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        if step <= self.sent:
            return
        self.tracker.log(row)
        self.sent = step
        self.ids.set(f"{self.name}_step", step)

    def close(self) -> None:
        self.tracker.close()


class WandbTracker:
    def __init__(self, run_dir: Path, config: dict[str, Any], ids: _Ids) -> None:
        import wandb

        run_id = ids.get("wandb") or secrets.token_hex(4)  # W&B's ids: 8 characters of [a-z0-9]
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "loom"),
                name=run_dir.name,
                id=run_id,
                resume="allow",  # the same id continues the run after a restart or resume
                dir=str(run_dir),
                config=config,
            )
        except wandb.errors.UsageError as e:  # no API key, a bad setting: wandb's own words, one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"run.trackers: wandb: {first} (or export WANDB_API_KEY, or WANDB_MODE=offline to log "
                "locally and `wandb sync` later)"
            ) from None
        ids.set("wandb", run_id)

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(_scalars(row), step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, run_dir: Path, config: dict[str, Any], ids: _Ids) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            os.environ.setdefault(
                "MLFLOW_ALLOW_FILE_STORE", "true"
            )  # the local store Loom chose, not the user
            uri = (run_dir / "mlruns").absolute().as_uri()
        client = MlflowClient(tracking_uri=uri)  # no process-wide tracking URI
        run_id = ids.get("mlflow")
        if run_id is None:
            name = "loom"
            exp = client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else client.create_experiment(name)
            run_id = client.create_run(exp_id, run_name=run_dir.name).info.run_id
            for k, v in _flat(config).items():  # params are write-once: logged when the run is made
                client.log_param(run_id, k, str(v)[:500])
            ids.set("mlflow", run_id)
        self.client, self.run_id = client, run_id

    def log(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step, now = int(row["step"]), int(1000 * time.time())
        metrics = [Metric(k, v, now, step) for k, v in _scalars(row).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_trackers(spec: str, run_dir: Path, config: dict[str, Any]) -> list[Tracker]:
    """The trackers ``run.trackers`` names (rank 0 only), continuing the run ids kept in ``run_dir``."""
    ids = _Ids(run_dir)
    made: dict[str, type] = {"wandb": WandbTracker, "mlflow": MlflowTracker}
    opened: list[Tracker] = []
    for n in tracker_names(spec):
        try:
            opened.append(_Once(n, made[n](run_dir, config, ids), ids))
        except ConfigError:
            raise
        except Exception as e:  # a server that refuses, a bad URI: the library's reason, one line
            first = (str(e).strip().splitlines() or [""])[0]
            first = first if len(first) <= 1000 else first[:1000] + "…"  # whole: its fix often ends it
            raise ConfigError(f"run.trackers: {n} could not start: {type(e).__name__}: {first}") from None
    return opened
