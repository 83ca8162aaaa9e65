"""Experiment trackers beside ``metrics.jsonl``: ``run.trackers = "wandb,mlflow"`` (TensorBoard is
``run.tensorboard``). Rank 0 sends each metrics row (the same scalars), the resolved config once, and
the planner's prediction with the last row.

A tracker's run id is kept in ``run.dir/trackers.json``, so a restart or a resume of the same run
directory continues the same tracker run instead of starting a new one; so is the last step each
tracker was sent. A resume below that step (a rewind: the attempt re-runs steps the tracker holds,
with ``--train.lr`` changed, or only with other rounding) starts a new tracker run for the steps after
the one it resumes from, with the config logged afresh, and says so in one line (``open_trackers``).
Both libraries are optional (the ``trackers`` extra): naming one that is not installed is one line
before any process starts.

- ``wandb``: project ``WANDB_PROJECT`` (default ``loom``), run files under ``run.dir``; offline
  with ``WANDB_MODE=offline`` (``wandb sync`` uploads later).
- ``mlflow``: ``MLFLOW_TRACKING_URI`` when set (a server, a database), else a local file store in
  ``run.dir/mlruns`` (MLflow 3 wants ``MLFLOW_ALLOW_FILE_STORE`` for it, set for this process only).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any, Protocol

from loom.config import ConfigError

TRACKERS = ("wandb", "mlflow")
IDS = "trackers.json"  # run.dir: {"wandb": run id, "mlflow": run id, "<name>_step": last sent}
log = logging.getLogger("loom")


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
        self.update({name: value})

    def update(self, values: dict[str, str | int]) -> None:
        self.ids.update(values)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.ids, indent=1, sort_keys=True))
        os.replace(tmp, self.path)

    def started(self, name: str, run_id: str) -> None:
        """A new tracker run ``run_id``: it holds no step yet."""
        self.update({name: run_id, f"{name}_step": 0})


def _kept_step(run_dir: Path) -> int:
    """The last step ``metrics.jsonl`` holds. The trainer cuts it at the checkpoint it resumes from
    before the trackers open, so a tracker sent a later step holds values this attempt replaces."""
    path, step = run_dir / "metrics.jsonl", 0
    text = path.read_bytes().decode("utf-8", "replace") if path.is_file() else ""  # a line not UTF-8: no row
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a torn last line: the trainer drops it
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            step = max(step, row["step"])
    return step


def _resumed_name(run_dir: Path, after: int | None) -> str:
    """A tracker run's name: the run directory's, and where a rewind's new run takes over."""
    return run_dir.name if after is None else f"{run_dir.name} resumed after step {after}"


class _Recorded:
    """A tracker whose last step sent is recorded (``_Ids.sent``), so that the next attempt knows
    whether it re-runs steps the tracker holds (``open_trackers``)."""

    def __init__(self, name: str, tracker: Tracker, ids: _Ids) -> None:
        self.name, self.tracker, self.ids = name, tracker, ids

    def log(self, row: dict[str, Any]) -> None:
        self.tracker.log(row)
        self.ids.set(f"{self.name}_step", int(row["step"]))

    def close(self) -> None:
        self.tracker.close()


class WandbTracker:
    """``after`` (a rewind): a new run id in the first run's group (``group``, kept in
    ``trackers.json``), named for where it takes over, its notes naming the run it continues. Not
    W&B's ``resume_from`` rewind: a beta the server applies (not offline files, not every account)."""

    def __init__(self, run_dir: Path, config: dict[str, Any], ids: _Ids, after: int | None = None) -> None:
        import wandb

        old = ids.get("wandb")
        run_id = old if old is not None and after is None else secrets.token_hex(4)  # 8 of [a-z0-9]
        fresh = run_id != old
        group = ids.get("wandb_group") or old or run_id  # the first run's id: its rewinds join it
        name = _resumed_name(run_dir, after) if fresh else ids.get("wandb_name") or run_dir.name
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "loom"),
                name=name,
                id=run_id,
                resume="allow",  # the same id continues the run after a restart or resume
                group=os.environ.get("WANDB_RUN_GROUP") or group,
                notes=None if after is None else f"continues W&B run {old} after step {after}",
                dir=str(run_dir),
                config=config,
            )
        except wandb.errors.UsageError as e:  # no API key, a bad setting: wandb's own words, one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"run.trackers: wandb: {first} (or export WANDB_API_KEY, or WANDB_MODE=offline to log "
                "locally and `wandb sync` later)"
            ) from None
        if fresh:
            ids.started("wandb", run_id)
        ids.update({"wandb_group": group, "wandb_name": name})

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(_scalars(row), step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """``after`` (a rewind): a new run in the same experiment, tagged ``loom.resumed_from`` (the run it
    continues) and ``loom.resumed_after_step``, with the params logged afresh. Continuing a run, its
    params stay as first logged (MLflow's are write-once); those this attempt changed are one line."""

    def __init__(self, run_dir: Path, config: dict[str, Any], ids: _Ids, after: int | None = None) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            os.environ.setdefault(
                "MLFLOW_ALLOW_FILE_STORE", "true"
            )  # the local store Loom chose, not the user
            uri = (run_dir / "mlruns").absolute().as_uri()
        client = MlflowClient(tracking_uri=uri)  # no process-wide tracking URI
        run_id = ids.get("mlflow")
        if run_id is None or after is not None:
            run_id = _mlflow_run(client, run_dir, config, run_id, after)
            ids.started("mlflow", run_id)
        else:
            _mlflow_changed(client, run_id, config)
        self.client, self.run_id = client, run_id

    def log(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step, now = int(row["step"]), int(1000 * time.time())
        metrics = [Metric(k, v, now, step) for k, v in _scalars(row).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _params(config: dict[str, Any]) -> dict[str, str]:
    return {k: str(v)[:500] for k, v in _flat(config).items()}  # MLflow's limit on a param's value


def _mlflow_run(client, run_dir: Path, config: dict[str, Any], old: str | None, after: int | None) -> str:
    """A new MLflow run in experiment ``loom`` with the config as its params (write-once); ``after``:
    the run ``old`` held steps past it, and this one takes over there."""
    exp = client.get_experiment_by_name("loom")
    exp_id = exp.experiment_id if exp is not None else client.create_experiment("loom")
    tags = {} if after is None else {"loom.resumed_from": old or "", "loom.resumed_after_step": str(after)}
    run_id = client.create_run(exp_id, run_name=_resumed_name(run_dir, after), tags=tags).info.run_id
    for k, v in _params(config).items():
        client.log_param(run_id, k, v)
    return run_id


def _mlflow_changed(client, run_id: str, config: dict[str, Any]) -> None:
    """One line naming the params run ``run_id`` keeps that this attempt's config changed."""
    held, now = client.get_run(run_id).data.params, _params(config)
    changed = [f"{k} {held[k]} (now {now[k]})" for k in sorted(now) if held.get(k, now[k]) != now[k]]
    if changed:
        log.warning(
            "trackers: MLflow run %s keeps the params it was first logged with (they are write-once): %s",
            run_id,
            ", ".join(changed),
        )


def open_trackers(spec: str, run_dir: Path, config: dict[str, Any]) -> list[Tracker]:
    """The trackers ``run.trackers`` names (rank 0 only), continuing the run ids kept in ``run_dir``.

    A tracker sent steps past those ``metrics.jsonl`` keeps (a rewind) holds values this attempt
    replaces, and its history cannot be cut (MLflow has no call to delete a metric's values; W&B's
    rewind is server-side): the steps from there go to a new tracker run, whose run ids
    ``trackers.json`` keeps, with one line naming each new run and the one it continues (that run
    still holds the replaced steps). A new run, not silence or a second value per step: what a user
    of the tracker reads for a step is then the value ``metrics.jsonl`` holds."""
    ids, kept = _Ids(run_dir), _kept_step(run_dir)
    made: dict[str, type] = {"wandb": WandbTracker, "mlflow": MlflowTracker}
    opened: list[Tracker] = []
    rewound: list[str] = []
    for n in tracker_names(spec):
        old, sent = ids.get(n), ids.sent(n)
        after = kept if old is not None and sent > kept else None
        try:
            opened.append(_Recorded(n, made[n](run_dir, config, ids, after), ids))
        except ConfigError:
            raise
        except Exception as e:  # a server that refuses, a bad URI: the library's reason, one line
            first = (str(e).strip().splitlines() or [""])[0]
            first = first if len(first) <= 1000 else first[:1000] + "…"  # whole: its fix often ends it
            raise ConfigError(f"run.trackers: {n} could not start: {type(e).__name__}: {first}") from None
        if after is not None:
            rewound.append(f"{n} {ids.get(n)} (continues {old}, which holds steps to {sent})")
    if rewound:
        log.warning(
            "trackers: this attempt resumes after step %d and re-runs steps a tracker was sent (its "
            "history cannot be cut): they go to new runs named %r: %s",
            kept,
            _resumed_name(run_dir, kept),
            ", ".join(rewound),
        )
    return opened
