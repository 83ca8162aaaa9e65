"""``loom cluster slurm``: an allocation as ``sbatch`` scripts or Kubernetes Jobs, so the cluster's own scheduler runs them.

An allocation gives each job a device type and a count, split into ``nodes`` x ``gpus`` per node
(``count = nodes x per_node``). It comes from a file (``--allocation``) or from a policy of
:mod:`loom.cluster.policies` applied once, at time 0, to a jobs file on a cluster file
(``--jobs FILE --policy NAME [--cluster FILE]``; jobs it does not place are named and skipped).
Each job's resolved config is written to ``OUT/<name>.toml``; then, per job:

- SLURM (``OUT/<name>.sbatch``): ``--nodes``, ``--ntasks-per-node`` = ``--gpus-per-node`` = per_node
  (of gres type ``device``), and one ``srun`` step of ``nodes x per_node`` tasks running
  ``loom train``: each task is one rank (``loom.launch.slurm_rank_env`` maps SLURM_PROCID,
  SLURM_NTASKS, SLURM_LOCALID, the node list to RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR).
  ``--signal=TERM@G`` (G = ``run.preempt_grace_s`` + 30 s) and ``--requeue``: a preempted or
  time-limited job saves its step, and the requeued script resumes from the run directory's
  latest checkpoint at whatever layout it gets.
- Kubernetes (``OUT/<name>.yaml``): a ConfigMap with the config, a headless Service (the pods' DNS
  names), and an Indexed Job of ``nodes`` pods, each requesting ``per_node`` ``nvidia.com/gpu`` on
  nodes labelled ``loom/device-type=<device>``, running ``loom train --run.nproc per_node`` and, for
  more than one node, ``--nnodes --node-rank <completion index> --rdzv-endpoint <pod 0>:29400``;
  checkpoints on the PersistentVolumeClaim ``--pvc`` at ``/runs``, ``terminationGracePeriodSeconds``
  = G.

Allocation file: ``[cluster] gpus_per_node`` (default 8) and ``[[jobs]]`` tables with ``name``,
``device``, ``gpus``, ``steps`` (the job's ``train.steps``), optional ``nodes`` (default ceil(gpus /
gpus_per_node)), ``config``, ``overrides`` (not ``run.dir``). Each job's run directory comes from its
name: ``runs/<name>`` (SLURM, relative to the directory ``sbatch`` runs in) or ``/runs/<name>``
(Kubernetes); a config's own ``run.dir`` (the ``debug`` preset's ``runs/debug``) is replaced, so jobs
sharing a config never share a run directory.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom import config as C
from loom.cluster.formats import DEFAULT_CLUSTER, Cluster, _num, _read, load_cluster
from loom.cluster.jobs import ClusterError
from loom.cluster.policies import POLICIES, JobState, make_policy
from loom.cluster.run import _config, explicit_toml, load_jobs

_KEYS = {"name", "config", "overrides", "steps", "device", "gpus", "nodes"}
RDZV_PORT = 29400
IMAGE, PVC = "loom:latest", "loom-runs"  # --image, --pvc defaults


@dataclass
class Allocated:
    """One job's share: ``nodes`` x ``per_node`` devices of type ``device``."""

    name: str
    cfg: C.LoomConfig
    device: str
    nodes: int
    per_node: int

    @property
    def gpus(self) -> int:
        return self.nodes * self.per_node

    def steps(self) -> list[str]:
        """``--train.steps N`` (the config file holds only the user's own settings)."""
        return ["--train.steps", str(self.cfg.train.steps)]

    def run_dir(self) -> str:
        """``runs/<name>``: job names are unique, so run directories are (a config's ``run.dir`` is
        shared by every job of that config)."""
        return f"runs/{self.name}"


def split(where: str, gpus: int, per_node: int, nodes: int = 0) -> tuple[int, int]:
    """(nodes, devices per node) for ``gpus`` devices on nodes of ``per_node``: every node alike."""
    nodes = nodes or math.ceil(gpus / per_node)
    if gpus % nodes or gpus // nodes > per_node:
        raise ClusterError(
            f"{where}: {gpus} devices do not split into {nodes} nodes of at most {per_node} alike "
            f"(give a multiple of {per_node}, or nodes)"
        )
    return nodes, gpus // nodes


def load_allocation(path: str | Path) -> list[Allocated]:
    """An allocation file (module doc); one line naming the file and field on any error."""
    where = str(path)
    data = _read(path)
    extra = set(data) - {"cluster", "jobs"}
    if extra or not isinstance(data.get("jobs"), list) or not data["jobs"]:
        raise ClusterError(
            f"{where}: expected [[jobs]] tables and an optional [cluster], found {sorted(data)}"
        )
    table = data.get("cluster", {})
    if not isinstance(table, dict) or set(table) - {"gpus_per_node"}:
        raise ClusterError(f"{where}: cluster: the only key is gpus_per_node, found {table!r}")
    per_node = int(_num(f"{where}: cluster.gpus_per_node", table.get("gpus_per_node", 8), integer=True))
    out: list[Allocated] = []
    for i, d in enumerate(data["jobs"]):
        at = f"{where}: jobs[{i}]"
        if not isinstance(d, dict):
            raise ClusterError(f"{at}: expected a table, got {d!r}")
        for key in d:
            if key not in _KEYS:
                raise ClusterError(f"{at}.{key}: unknown key; allowed: {', '.join(sorted(_KEYS))}")
        for key in ("name", "device", "gpus", "steps"):
            if key not in d:
                what = ", the job's train.steps" if key == "steps" else ""
                raise ClusterError(f"{at}.{key}: missing{what} (required: name, device, gpus, steps)")
        name, device = d["name"], d["device"]
        for key, v in (("name", name), ("device", device)):
            if not isinstance(v, str) or not v or not all(c.isalnum() or c in "_.-" for c in v):
                raise ClusterError(f"{at}.{key}: expected letters, digits, '_', '.', '-', got {v!r}")
        if any(a.name == name for a in out):
            raise ClusterError(f"{at}.name: {name!r} is already the name of another job")
        gpus = int(_num(f"{at}.gpus", d["gpus"], integer=True))
        nodes = int(_num(f"{at}.nodes", d["nodes"], integer=True)) if "nodes" in d else 0
        nodes, per = split(f"{at}.gpus", gpus, per_node, nodes)
        cfg = _config(at, d)
        steps = int(_num(f"{at}.steps", d["steps"], integer=True))
        C.apply_overrides(cfg, ["--train.steps", str(steps)])
        try:
            C.validate(copy.deepcopy(cfg), gpus)
            C.check_intent(cfg)
        except C.ConfigError as e:
            raise ClusterError(f"{at}: on {gpus} devices: {e}") from None
        out.append(Allocated(name, cfg, device, nodes, per))
    return out


def from_policy(jobs_path: str, cluster: Cluster, policy_name: str) -> tuple[list[Allocated], list[str]]:
    """The policy's allocation at time 0 of every job of the jobs file; (placed, names not placed)."""
    policy = make_policy(policy_name)
    jobs = load_jobs(jobs_path, cluster)
    alloc = policy.allocate([JobState(j.job()) for j in jobs], cluster, 0.0)
    out, waiting = [], []
    for j in jobs:
        p = alloc.get(j.name)
        if p is None:
            waiting.append(j.name)
            continue
        nodes, per = split(f"{jobs_path}: job {j.name}", p.n, cluster.devices_per_node)
        out.append(Allocated(j.name, j.cfg, p.device, nodes, per))
    return out, waiting


def sbatch(a: Allocated, config_path: str, log_dir: str) -> str:
    """The job's ``sbatch`` script (module doc)."""
    grace = int(math.ceil(a.cfg.run.preempt_grace_s)) + 30
    cmd = ["python", "-m", "loom", "train", config_path, "--run.dir", a.run_dir(), *a.steps()]
    return "\n".join(
        [
            "#!/bin/bash",
            f"# loom cluster slurm: {a.name} on {a.gpus} {a.device} ({a.nodes} nodes x {a.per_node})",
            f"#SBATCH --job-name=loom-{a.name}",
            f"#SBATCH --nodes={a.nodes}",
            f"#SBATCH --ntasks-per-node={a.per_node}",
            f"#SBATCH --gpus-per-node={a.device}:{a.per_node}",
            f"#SBATCH --output={log_dir}/{a.name}-%j.out",
            "#SBATCH --open-mode=append",
            f"#SBATCH --signal=TERM@{grace}",
            "#SBATCH --requeue",
            "set -euo pipefail",
            f"mkdir -p {shlex.quote(log_dir)}",
            "# one task per GPU, each one rank of loom train; a requeued job resumes from its latest checkpoint",
            f"srun --kill-on-bad-exit=1 --ntasks={a.gpus} --ntasks-per-node={a.per_node} "
            + " ".join(shlex.quote(c) for c in cmd),
            "",
        ]
    )


def _yaml(v: Any, indent: int = 0) -> str:
    """A block-style YAML document of dicts, lists, strings (JSON-quoted: valid YAML), numbers, bools."""
    pad = "  " * indent
    if isinstance(v, dict):
        lines = []
        for k, x in v.items():
            if isinstance(x, (dict, list)) and x:
                lines.append(f"{pad}{k}:\n{_yaml(x, indent + 1)}")
            else:
                lines.append(f"{pad}{k}: {_scalar(x)}")
        return "\n".join(lines)
    lines = []
    for x in v:
        if isinstance(x, (dict, list)) and x:
            body = _yaml(x, indent + 1)
            lines.append(f"{pad}- {body.lstrip()}")
        else:
            lines.append(f"{pad}- {_scalar(x)}")
    return "\n".join(lines)


def _scalar(x: Any) -> str:
    if isinstance(x, (dict, list)):
        return "{}" if isinstance(x, dict) else "[]"
    return json.dumps(x)


def k8s_name(job: str) -> str:
    """The job's Kubernetes resource name (lower case, ``_`` and ``.`` as ``-``)."""
    return f"loom-{job}".lower().replace("_", "-").replace(".", "-")


_PVC_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # a DNS-1123 subdomain


def check_kubernetes(args: argparse.Namespace) -> None:
    """``--image`` and ``--pvc`` only with ``--kubernetes`` (they would do nothing), and there a
    non-empty image without white space and a claim name Kubernetes accepts (DNS-1123)."""
    if not args.kubernetes:
        for flag, value in (("--image", args.image), ("--pvc", args.pvc)):
            if value is not None:
                raise ClusterError(f"{flag}: only with --kubernetes (sbatch scripts run no image or claim)")
        return
    if args.image is not None and (not args.image or any(c.isspace() for c in args.image)):
        raise ClusterError(
            f"--image: expected a container image name (not empty, no spaces), got {args.image!r}"
        )
    if args.pvc is not None and not _PVC_NAME.fullmatch(args.pvc):
        raise ClusterError(
            f"--pvc: expected a PersistentVolumeClaim name (lower-case letters, digits, '-', '.', starting "
            f"and ending with a letter or digit), got {args.pvc!r}"
        )


def check_k8s_names(allocs: list[Allocated]) -> None:
    """Job names whose Kubernetes resource names differ (``a_b`` and ``a.b`` are both ``loom-a-b``)."""
    seen: dict[str, str] = {}
    for a in allocs:
        other = seen.setdefault(k8s_name(a.name), a.name)
        if other != a.name:
            raise ClusterError(
                f"jobs {other!r} and {a.name!r}: both are Kubernetes resources {k8s_name(a.name)!r}; rename one"
            )


def kubernetes(a: Allocated, image: str, pvc: str) -> str:
    """The job's ConfigMap, headless Service and Indexed Job (module doc), as one YAML stream."""
    grace = int(math.ceil(a.cfg.run.preempt_grace_s)) + 30
    name = k8s_name(a.name)
    cmd = [
        "python",
        "-m",
        "loom",
        "train",
        "/etc/loom/config.toml",
        "--run.dir",
        f"/runs/{a.name}",
        *a.steps(),
    ]
    cmd += ["--run.nproc", str(a.per_node)]
    if a.nodes > 1:
        cmd += ["--nnodes", str(a.nodes), "--node-rank", "$(NODE_RANK)"]
        cmd += ["--rdzv-endpoint", f"{name}-0.{name}:{RDZV_PORT}"]
    labels = {"app": name}
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-config", "labels": labels},
        "data": {"config.toml": explicit_toml(a.cfg)},
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "clusterIP": "None",
            "selector": {"job-name": name},
            "ports": [{"name": "rdzv", "port": RDZV_PORT}],
        },
    }
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": a.nodes,
            "parallelism": a.nodes,
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "subdomain": name,
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": grace,
                    "nodeSelector": {"loom/device-type": a.device},
                    "containers": [
                        {
                            "name": "loom",
                            "image": image,
                            "command": cmd,
                            "env": [{"name": "NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": index}}}],
                            "resources": {"limits": {"nvidia.com/gpu": a.per_node}},
                            "volumeMounts": [
                                {"name": "config", "mountPath": "/etc/loom"},
                                {"name": "runs", "mountPath": "/runs"},
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "config", "configMap": {"name": f"{name}-config"}},
                        {"name": "runs", "persistentVolumeClaim": {"claimName": pvc}},
                    ],
                },
            },
        },
    }
    return "\n---\n".join(_yaml(d) for d in (config_map, service, job)) + "\n"


def add_parser(sub: Any) -> None:
    s = sub.add_parser("slurm", help="write sbatch scripts (or Kubernetes Jobs) for an allocation")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--allocation", help="allocation file: job -> device type, count, nodes (docs/cluster.md)"
    )
    src.add_argument("--jobs", help="jobs file (as loom cluster run's) to allocate with --policy")
    s.add_argument("--policy", help=f"with --jobs: one of {', '.join(POLICIES)}")
    s.add_argument("--cluster", help="with --jobs: cluster file (default: 36 v100 + 36 p100 + 36 k80)")
    s.add_argument("--out", required=True, help="directory for the configs and scripts")
    s.add_argument(
        "--kubernetes", action="store_true", help="Kubernetes Job manifests instead of sbatch scripts"
    )
    s.add_argument("--image", help=f"--kubernetes: container image with loom (default {IMAGE})")
    s.add_argument("--pvc", help=f"--kubernetes: PersistentVolumeClaim for run directories (default {PVC})")


def main_slurm(args: argparse.Namespace) -> int:
    check_kubernetes(args)
    waiting: list[str] = []
    if args.allocation:
        if args.policy or args.cluster:
            raise ClusterError("--policy and --cluster go with --jobs, not with --allocation")
        allocs = load_allocation(args.allocation)
    else:
        if not args.policy:
            raise ClusterError(
                f"--policy: --jobs needs a policy to allocate with; one of {', '.join(POLICIES)}"
            )
        make_policy(args.policy)  # an unknown name before the jobs file is read
        cluster = load_cluster(args.cluster) if args.cluster else DEFAULT_CLUSTER
        allocs, waiting = from_policy(args.jobs, cluster, args.policy)
    if args.kubernetes:
        check_k8s_names(allocs)
    out = Path(args.out)
    ext = "yaml" if args.kubernetes else "sbatch"
    if out.exists() and not out.is_dir():
        raise ClusterError(f"--out: {out} is a file, not a directory for the configs and scripts")
    for a in allocs:  # every file this writes is new: a config or script already there is never replaced
        for path in (out / f"{a.name}.toml", out / f"{a.name}.{ext}"):
            C.check_new_output(path, directory=False, error=ClusterError)
    out.mkdir(parents=True, exist_ok=True)
    for a in allocs:
        cfg_path = out / f"{a.name}.toml"
        cfg_path.write_text(explicit_toml(a.cfg))
        if args.kubernetes:
            path = out / f"{a.name}.yaml"
            path.write_text(kubernetes(a, args.image or IMAGE, args.pvc or PVC))
        else:
            path = out / f"{a.name}.sbatch"
            path.write_text(sbatch(a, str(cfg_path), str(out / "logs")))
        print(f"{a.name}: {a.gpus} {a.device} ({a.nodes} x {a.per_node}) -> {path}")
    for name in waiting:
        print(f"{name}: not placed by {args.policy} at time 0 (no devices left); no script written")
    how = "kubectl apply -f" if args.kubernetes else "sbatch"
    print(f"submit with: {how} {out}/*.{'yaml' if args.kubernetes else 'sbatch'}")
    return 0
