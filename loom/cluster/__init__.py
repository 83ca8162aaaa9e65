"""Many jobs on one shared cluster: a job model on the planner, scheduling policies, a simulator.

jobs       :class:`Job` (model + workload + work), throughput per device type and count (the planner,
           cached, or a table), statistical efficiency and goodput from the gradient noise scale
formats    cluster and trace files (TOML / JSON), the default mixed cluster, synthetic traces
policies   the :class:`Policy` protocol (jobs, cluster, time) -> {job: Placement}: fifo, las, Gavel's
           LPs (HiGHS), Pollux
simulate   the discrete-event simulator and its metrics
run        ``loom cluster run``: real ``loom train`` jobs on this machine's ranks, placed by a policy
slurm      ``loom cluster slurm``: an allocation as sbatch scripts or Kubernetes Jobs
cli        ``loom cluster simulate | run | slurm``
"""

from loom.cluster.formats import DEFAULT_CLUSTER, Cluster, load_cluster, load_trace, synthetic_trace
from loom.cluster.jobs import ClusterError, Job, goodput, scaled_lr, throughput
from loom.cluster.policies import POLICIES, Allocation, JobState, Placement, Policy, make_policy
from loom.cluster.simulate import Result, simulate

__all__ = [
    "DEFAULT_CLUSTER",
    "POLICIES",
    "Allocation",
    "Cluster",
    "ClusterError",
    "Job",
    "JobState",
    "Placement",
    "Policy",
    "Result",
    "goodput",
    "load_cluster",
    "load_trace",
    "make_policy",
    "scaled_lr",
    "simulate",
    "synthetic_trace",
    "throughput",
]
