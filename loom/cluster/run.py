"""``loom cluster run``: real ``loom train`` jobs on this machine, placed by a policy of :mod:`loom.cluster.policies`.

The cluster is ``N`` ranks of one device type (``cpu`` here; a rank is a device). Each job is a Loom
config (a TOML path or a preset, plus override tables) with a number of steps; its run directory is
``OUT/<name>``. At every arrival, completion and round boundary (every ``round_s`` seconds) the
driver asks the policy for an allocation and applies the difference:

- preempt (a running job whose rank count changes or that loses its ranks): SIGTERM to the job's
  launcher, which saves the step every rank finished and exits (``run.preempt_grace_s``;
  :class:`loom.train.trainer.StopRequest`). A job is preempted only after its first step since it
  started, so every preemption saves a real step instead of throwing its start-up away;
- start or resume: ``loom train OUT/<name>.toml --run.dir OUT/<name> --run.nproc k``; an existing
  checkpoint is resumed (``train.resume`` defaults to the run directory's latest), resharded to the
  new layout, with the data position exactly once across the dp resize (docs/data.md), so the job's
  losses continue those of an uninterrupted run at the new layout.

The policy sees each job as a :class:`loom.cluster.Job` whose work is ``steps x global_batch``
sequences and whose throughput (sequences/s per rank count) is the job's ``throughput`` table or the
planner's prediction for the ``cpu`` datasheet, for the rank counts its config validates at. The
batch and learning rate stay the job's own (table-driven jobs: Pollux resizes, it does not rebatch).

Every decision is a row of ``OUT/decisions.jsonl`` (``t`` seconds since the start, ``job``,
``event`` in start | preempt | resume | finish | fail, ``ranks``, ``step``) and one printed line; the
end prints each job's JCT (finish - arrival). Jobs file: ``[[jobs]]`` tables with ``name``,
``steps``, optional ``config`` (preset or .toml; default: the defaults), ``overrides`` (section
tables; not ``run.dir``: the run directory is ``OUT/<name>``, a config's own ``run.dir`` is replaced), ``arrival_s`` (0), ``devices`` (requested ranks; default the config's ``run.nproc``, at most
``N``), ``throughput`` (ranks -> sequences/s, or device type -> that table); every error is one line
naming the file and the field, before any job starts.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom import config as C
from loom.cluster.formats import Cluster, _num, _read
from loom.cluster.jobs import ClusterError, Job, planner_step_time
from loom.cluster.policies import POLICIES, JobState, Placement, Policy, make_policy
from loom.numbers import is_whole

_KEYS = {"name", "config", "overrides", "steps", "arrival_s", "devices", "throughput"}
DEVICE = "cpu"
STOPPED = 128 + signal.SIGTERM  # a launcher's exit code after a SIGTERM it saved for


@dataclass
class RealJob:
    """A job of a jobs file: its resolved config (not validated: automatic values stay automatic)."""

    name: str
    cfg: C.LoomConfig
    steps: int
    arrival: float
    devices: int
    throughput: dict[str, dict[int, float]]  # device type -> ranks -> sequences/s
    valid: list[int] = field(default_factory=list)  # rank counts the config validates at

    def job(self) -> Job:
        """The policy's view (module doc)."""
        b = self.cfg.train.global_batch
        return Job(
            name=self.name,
            arrival=self.arrival,
            samples=float(self.steps * b),
            devices=self.devices,
            batch=b,
            max_batch=b,
            seq_len=self.cfg.data.seq_len,
            throughput=self.throughput,
            lr=self.cfg.train.lr,
        )


def _planned_model(cfg: C.LoomConfig) -> C.ModelConfig:
    """The model the planner prices for ``cfg``: a vocabulary left to the tokenizer (``model.vocab_size
    = 0``, the debug preset's) is the given tokenizer's, else the one trained here (``data.vocab_size``),
    as loom train resolves it."""
    if cfg.model.vocab_size > 0:
        return cfg.model
    vocab = cfg.data.vocab_size
    if cfg.data.tokenizer:
        from loom.data.tokenizer import load_tokenizer

        vocab = load_tokenizer(cfg.data.tokenizer).get_vocab_size()
    return dataclasses.replace(cfg.model, vocab_size=vocab)


# config fields every launch of a job gives on its command line, so a job's overrides may not set them
GIVEN_BY_THE_SCHEDULER: dict[tuple[str, str], str] = {
    ("run", "dir"): "the job's run directory comes from its name (loom cluster run: OUT/<name>; slurm: "
    "runs/<name>; Kubernetes: /runs/<name>)",
    ("train", "steps"): "the job's steps key gives train.steps",
    ("run", "nproc"): "the scheduler gives each launch its ranks: set the job's devices (loom cluster run) "
    "or gpus (slurm)",
}


def _config(at: str, d: dict[str, Any]) -> C.LoomConfig:
    src = d.get("config")
    if src is not None and not (isinstance(src, str) and (src in C.presets() or src.endswith(".toml"))):
        raise ClusterError(
            f"{at}.config: expected a preset ({', '.join(C.presets())}) or a .toml path, got {src!r}"
        )
    if isinstance(src, str) and src.endswith(".toml") and not Path(src).is_file():
        raise ClusterError(f"{at}.config: {src}: file does not exist")
    over = d.get("overrides", {})
    if not isinstance(over, dict) or not all(isinstance(v, dict) for v in over.values()):
        raise ClusterError(
            f"{at}.overrides: expected section tables ({{ train = {{ lr = 1e-3 }} }}), got {over!r}"
        )
    for (section, key), why in GIVEN_BY_THE_SCHEDULER.items():  # each launch's option would win, silently
        if key in over.get(section, {}):
            raise ClusterError(f"{at}.overrides.{section}.{key}: not allowed; {why}")
    try:
        return C.from_dict(copy.deepcopy(over), base=C.load(src, []))
    except C.ConfigError as e:
        raise ClusterError(f"{at}: {e}") from None


def _check_data(at: str, cfg: C.LoomConfig) -> None:
    """The job's data and paths can be read here (``loom cluster run`` runs its jobs on this machine): a
    source, base model, checkpoint or tokenizer that does not exist is refused before any job starts,
    not by the job's own exit."""
    from loom.data.corpus import STDLIB, source_files

    for name, value in (
        ("model.from_hf", cfg.model.from_hf),
        ("train.init_from", cfg.train.init_from),
        ("train.resume", cfg.train.resume),
        ("data.tokenizer", cfg.data.tokenizer),
    ):
        if value and not Path(value).expanduser().exists():
            raise ClusterError(f"{at}: {name}: {value!r} does not exist")
    d = cfg.data
    if d.prepared_dir:
        return
    for i, src in enumerate([s.path for s in d.sources] if d.sources else [d.source]):
        if src != STDLIB:
            try:
                source_files(src)
            except C.ConfigError as e:
                where = f"data.sources[{i}]" if d.sources else "data.source"
                raise ClusterError(f"{at}: {str(e).replace('data.source', where, 1)}") from None


def _table(at: str, v: Any, types: list[str], ranks: int) -> dict[str, dict[int, float]]:
    """``{ranks: seq/s}`` (the first device type's) or ``{type: {ranks: seq/s}}``; TOML keys are strings."""
    if not isinstance(v, dict) or not v:
        raise ClusterError(f"{at}: expected a table of ranks -> sequences/s, got {v!r}")
    nested = all(isinstance(x, dict) for x in v.values())
    tables = v if nested else {types[0]: v}
    out: dict[str, dict[int, float]] = {}
    for t, row in tables.items():
        if t not in types:
            raise ClusterError(f"{at}.{t}: not a device type of the cluster ({', '.join(types)})")
        out[t] = {}
        for k, s in row.items():
            if not is_whole(str(k)) or not 1 <= int(k) <= ranks:
                raise ClusterError(f"{at}.{t}.{k}: expected a device count in 1..{ranks}")
            out[t][int(k)] = float(_num(f"{at}.{t}.{k}", s))
    return out


def explicit_toml(cfg: C.LoomConfig) -> str:
    """The fields a file, table or override set on ``cfg`` (:func:`loom.config.explicit`), as TOML: the
    launched run sees the user's settings as the user's, defaults as defaults (``train.steps`` aside,
    given on the command line as ``loom train PRESET --train.steps N`` would)."""
    import tomli_w

    full = C.to_dict(cfg)
    out: dict[str, dict[str, Any]] = {}
    for name in sorted(C.explicit(cfg) - {"train.steps"}):
        section, key = name.split(".", 1)
        out.setdefault(section, {})[key] = full[section][key]
    return tomli_w.dumps(out)


def _precision(cfg: C.LoomConfig, device: str) -> str:
    p = cfg.train.precision
    return p if p != "auto" else ("fp32" if device == "cpu" else "fp16")


def _last_error(log_file: Path, tail: int = 1 << 16) -> str:
    """The last ``loom: error:`` line a job wrote to its log (its one-line reason), without the prefix;
    "" if none (read from the log's last ``tail`` bytes)."""
    try:
        with open(log_file, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    said = [ln.strip() for ln in lines if ln.strip().startswith("loom: error: ")]
    return said[-1].removeprefix("loom: error: ") if said else ""


def load_jobs(path: str | Path, cluster: Cluster) -> list[RealJob]:
    """The jobs file (module doc), checked against ``cluster``: one line naming the file and field."""
    where = str(path)
    data = _read(path)
    jobs = data.get("jobs")
    if set(data) != {"jobs"} or not isinstance(jobs, list) or not jobs:
        raise ClusterError(f"{where}: expected [[jobs]] tables and nothing else, found {sorted(data)}")
    per_node, biggest = cluster.devices_per_node, max(cluster.devices.values())
    out: list[RealJob] = []
    for i, d in enumerate(jobs):
        at = f"{where}: jobs[{i}]"
        if not isinstance(d, dict):
            raise ClusterError(f"{at}: expected a table, got {d!r}")
        for key in d:
            if key not in _KEYS:
                trace = " (a cluster simulate trace? --jobs takes jobs of a config and steps)" * (
                    key in ("samples", "model", "batch", "gns")
                )
                raise ClusterError(f"{at}.{key}: unknown key; allowed: {', '.join(sorted(_KEYS))}{trace}")
        name = d.get("name", f"job{i}")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise ClusterError(f"{at}.name: expected letters, digits, '_', '.', '-', got {name!r}")
        if any(j.name == name for j in out):
            raise ClusterError(f"{at}.name: {name!r} is already the name of another job")
        if "steps" not in d:
            raise ClusterError(f"{at}.steps: missing (the job's train.steps)")
        steps = int(_num(f"{at}.steps", d["steps"], integer=True))
        arrival = float(_num(f"{at}.arrival_s", d.get("arrival_s", 0), strict=False))
        cfg = _config(at, d)
        _check_data(at, cfg)
        C.apply_overrides(cfg, ["--train.steps", str(steps)])  # as the launch gives it
        devices = int(_num(f"{at}.devices", d.get("devices", cfg.run.nproc), integer=True))
        if devices > biggest:
            raise ClusterError(
                f"{at}.devices: {devices} ranks requested, the cluster has {biggest} of a type"
            )
        given = (
            _table(f"{at}.throughput", d["throughput"], cluster.types, biggest) if "throughput" in d else None
        )
        sizes = {devices} | {2**k for k in range(biggest.bit_length()) if 2**k <= biggest}
        sizes |= {n for row in (given or {}).values() for n in row}  # a table's rank counts too
        valid = []
        for n in sorted(x for x in sizes if 1 <= x <= biggest):
            try:
                C.validate(copy.deepcopy(cfg), n)
                C.check_intent(cfg)  # as loom train checks it
                valid.append(n)
            except C.ConfigError as e:
                if n == devices:
                    raise ClusterError(f"{at}: on {n} ranks: {e}") from None
        if given is not None:
            table = given
        else:  # the planner, per device type of the cluster
            table = {}
            for t in cluster.types:
                row = {}
                for n in (n for n in valid if n <= cluster.devices[t]):
                    s = planner_step_time(
                        _planned_model(cfg), cfg.train.global_batch, cfg.data.seq_len, _precision(cfg, t), t, n,
                        per_node, cluster.profile(t),
                    )  # fmt: skip
                    if math.isfinite(s):
                        row[n] = cfg.train.global_batch / s
                table[t] = row
        table = {t: {n: s for n, s in row.items() if n in valid} for t, row in table.items()}
        if not any(table.values()):
            raise ClusterError(f"{at}: runs on no rank count of the cluster (throughput or config)")
        out.append(RealJob(name, cfg, steps, arrival, devices, table, valid))
    return out


def _last_step(run_dir: Path) -> int:
    """The last step in ``run_dir/metrics.jsonl`` (0 if none yet)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - 4096))
        lines = [x for x in f.read().decode(errors="replace").splitlines() if x.strip()]
    for line in reversed(lines):
        try:
            return int(json.loads(line).get("step", 0))
        except (json.JSONDecodeError, ValueError, AttributeError):
            continue
    return 0


def _saved_step(run_dir: Path) -> int:
    latest = run_dir / "checkpoints" / "latest"
    try:
        return int(json.loads(latest.read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


@dataclass
class Running:
    proc: subprocess.Popen
    ranks: int
    first_step: int  # metrics' last step when it started
    log: Any
    stopping: bool = False  # the allocation took its ranks away or changed their number
    sigterm_at: float = math.nan


class Driver:
    """Applies a policy's allocations to real ``loom train`` processes (module doc).

    Non-blocking: a job to preempt gets SIGTERM once it has logged a step since it started and keeps
    its ranks until it exits; the allocation's starts wait until its stops are done."""

    def __init__(
        self, jobs: list[RealJob], cluster: Cluster, policy: Policy, out: Path, poll_s: float = 0.05
    ):
        self.jobs = {j.name: j for j in jobs}
        self.states = {j.name: JobState(j.job()) for j in jobs}
        self.cluster, self.policy, self.out, self.poll_s = cluster, policy, out, poll_s
        self.running: dict[str, Running] = {}
        self.alloc: dict[str, Placement] = {}
        self.failed: dict[str, int] = {}
        self.restarts = dict.fromkeys(self.jobs, 0)
        self.t0 = time.monotonic()
        out.mkdir(parents=True, exist_ok=True)
        (out / "logs").mkdir(exist_ok=True)
        self.decisions = (out / "decisions.jsonl").open("a")
        for j in jobs:  # the job's own settings, which each launch reads (steps on the command line)
            (out / f"{j.name}.toml").write_text(explicit_toml(j.cfg))

    def now(self) -> float:
        return time.monotonic() - self.t0

    def log(self, job: str, event: str, ranks: int, step: int) -> None:
        row = {"t": round(self.now(), 3), "job": job, "event": event, "ranks": ranks, "step": step}
        self.decisions.write(json.dumps(row) + "\n")
        self.decisions.flush()
        print(
            f"[{row['t']:8.2f}s] {job}: {event} on {ranks} rank{'s' if ranks != 1 else ''} at step {step}",
            flush=True,
        )

    def start(self, name: str, p: Placement) -> None:
        run_dir = self.out / name
        step = _saved_step(run_dir)
        cmd = [
            sys.executable,
            "-m",
            "loom",
            "train",
            str(self.out / f"{name}.toml"),
            "--run.dir",
            str(run_dir),
        ]
        cmd += ["--run.nproc", str(p.n), "--train.steps", str(self.jobs[name].steps)]
        log = (self.out / "logs" / f"{name}.log").open("a")
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        self.running[name] = Running(proc, p.n, _last_step(run_dir), log)
        st = self.states[name]
        st.placement, st.started = p, True
        self.log(name, "resume" if step else "start", p.n, step)

    def reap(self, name: str) -> None:
        """Account for an ended process: finished, failed, or preempted (its checkpoint saved)."""
        r = self.running.pop(name)
        r.log.close()
        st, rc = self.states[name], r.proc.returncode
        st.placement = None
        if rc == 0:
            st.done, st.finish = st.job.samples, self.now()
            self.log(name, "finish", r.ranks, self.jobs[name].steps)
        elif rc == STOPPED and r.stopping:
            self.restarts[name] += 1
            self.log(name, "preempt", r.ranks, _saved_step(self.out / name))
        else:
            self.failed[name], st.finish = rc, self.now()
            self.log(name, "fail", r.ranks, _last_step(self.out / name))
            log_file = self.out / "logs" / f"{name}.log"
            why = _last_error(log_file)
            print(
                f"loom: error: job {name} exited with code {rc}{f': {why}' if why else ''}; see {log_file}",
                file=sys.stderr,
            )

    def active(self, now: float) -> list[JobState]:
        return [s for n, s in self.states.items() if s.job.arrival <= now and math.isnan(s.finish)]

    def advance(self, now: float) -> None:
        """Stop what the allocation took away (after a first step), start what fits in the free ranks."""
        for name, r in self.running.items():
            p = self.alloc.get(name)
            if math.isnan(r.sigterm_at):  # not signalled yet: the latest allocation decides
                r.stopping = p is None or p.n != r.ranks
            if not r.stopping or r.proc.poll() is not None:
                continue
            if math.isnan(r.sigterm_at) and _last_step(self.out / name) > r.first_step:
                r.proc.send_signal(signal.SIGTERM)  # the launcher forwards it; every rank saves one step
                r.sigterm_at = now
            elif now - r.sigterm_at > self.jobs[name].cfg.run.preempt_grace_s + 60:
                os.killpg(r.proc.pid, signal.SIGKILL)
        if any(r.stopping for r in self.running.values()):
            return  # an allocation's stops come before its starts (as a round's changes in Gavel)
        free = self.cluster.total - sum(r.ranks for r in self.running.values())
        for name, p in self.alloc.items():
            if name not in self.running and math.isnan(self.states[name].finish) and p.n <= free:
                self.start(name, p)
                free -= p.n

    def run(self) -> int:
        """Until every job finished or failed; on an interruption every running job is stopped with its checkpoint."""
        seen: set[str] = set()
        last, next_round = 0.0, 0.0
        try:
            while any(math.isnan(s.finish) for s in self.states.values()):
                now = self.now()
                event = False
                for name in [n for n, r in self.running.items() if r.proc.poll() is not None]:
                    self.reap(name)
                    event = True
                for name, r in self.running.items():  # progress and attained service since the last pass
                    st = self.states[name]
                    st.done = min(st.job.samples, _last_step(self.out / name) * st.job.batch)
                    st.attained += r.ranks * (now - last)
                    st.received[DEVICE] = st.received.get(DEVICE, 0.0) + (now - last)
                last = now
                arrived = {s.job.name for s in self.active(now)}
                if arrived - seen or event or now >= next_round:
                    seen |= arrived
                    self.alloc = self.policy.allocate(self.active(now), self.cluster, now)
                    next_round = now + self.cluster.round_s
                self.advance(now)
                time.sleep(self.poll_s)
        finally:
            for r in self.running.values():
                if r.proc.poll() is None:
                    r.proc.send_signal(signal.SIGTERM)
            for name, r in self.running.items():
                try:
                    r.proc.wait(self.jobs[name].cfg.run.preempt_grace_s + 60)
                except subprocess.TimeoutExpired:
                    os.killpg(r.proc.pid, signal.SIGKILL)
                    r.proc.wait()
                if r.proc.returncode == STOPPED:
                    self.log(name, "preempt", r.ranks, _saved_step(self.out / name))
                r.log.close()
            self.decisions.close()
        return 1 if self.failed else 0

    def table(self) -> str:
        rows = [f"{'job':<16}{'arrival s':>10}{'finish s':>10}{'JCT s':>9}{'preempted':>10}  status"]
        for name, st in self.states.items():
            status = f"failed ({self.failed[name]})" if name in self.failed else "done"
            rows.append(
                f"{name:<16}{st.job.arrival:>10.2f}{st.finish:>10.2f}{st.finish - st.job.arrival:>9.2f}{self.restarts[name]:>10}  {status}"
            )
        done = [s.finish - s.job.arrival for n, s in self.states.items() if n not in self.failed]
        if done:
            rows.append(f"average JCT {sum(done) / len(done):.2f} s over {len(done)} jobs")
        return "\n".join(rows)


def add_parser(sub: Any) -> None:
    r = sub.add_parser("run", help="run real loom train jobs on this machine's ranks, placed by a policy")
    r.add_argument("--jobs", required=True, help="jobs file (TOML/JSON, docs/cluster.md)")
    r.add_argument("--devices", type=int, required=True, help="ranks of this machine the jobs share")
    r.add_argument("--policy", required=True, help=f"one of {', '.join(POLICIES)}")
    r.add_argument("--round-s", type=float, default=30.0, help="scheduling round in seconds (default 30)")
    r.add_argument(
        "--out", default="runs/cluster", help="run directories, logs, decisions.jsonl (default runs/cluster)"
    )


def main_run(args: argparse.Namespace) -> int:
    if args.devices < 1:
        raise ClusterError(f"--devices: expected a rank count >= 1, got {args.devices}")
    if not (math.isfinite(args.round_s) and args.round_s > 0):
        raise ClusterError(f"--round-s: expected seconds > 0 (a finite number), got {args.round_s}")
    policy = make_policy(args.policy)
    cluster = Cluster(
        {DEVICE: args.devices}, devices_per_node=args.devices, round_s=args.round_s, restart_s=0.0
    )
    jobs = load_jobs(args.jobs, cluster)
    driver = Driver(jobs, cluster, policy, Path(args.out))
    print(
        f"{len(jobs)} jobs on {args.devices} ranks, policy {policy.name}; decisions in {driver.out / 'decisions.jsonl'}",
        flush=True,
    )
    stop = {}

    def stopped(signum: int, _frame: Any) -> None:
        stop["sig"] = signum
        raise KeyboardInterrupt

    old = {sig: signal.signal(sig, stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = driver.run()  # its finally stops every running job with a checkpoint
    except KeyboardInterrupt:
        sig = signal.Signals(stop.get("sig", signal.SIGINT))
        print(
            f"loom: stopped by {sig.name}: running jobs saved their checkpoints in {driver.out}; "
            "run the same command to resume them",
            file=sys.stderr,
        )
        return 128 + sig
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    print(driver.table())
    return rc
