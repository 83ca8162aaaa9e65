"""``loom plan verify``: one rank of a huge job, built and stepped for real on this machine.

    loom plan verify --config configs/llama3-70b.toml --devices 1024 --device h100-sxm \\
        --layout best --rank 0 --seq 256 [--microbatches M] [--section.field VALUE ...]

Rank R of the N-rank job runs alone: PyTorch's fake process group stands in for the other ranks
(collectives return at once, without peers), the model is built on the meta device and only
rank R's shard is materialized (:mod:`loom.parallel.materialize`), and one step of its schedule
runs with just enough micro-batches to reach the schedule's activation peak (``pp``; ``2·pp`` for
2BW), at the given sequence length. Beside each measurement stands the planner's prediction for
that same rank, stage, sequence length and micro-batch count
(:meth:`loom.plan.cost.CostModel.stage_memory`):

    parameters, gradients, optimizer state   strategy.state_bytes() after the step
    saved activations                        peak bytes held by autograd (saved-tensor hooks)
    peak                                     peak tensor bytes over build and step (the profiler's
                                             allocation records; ``--on cuda``: the allocator's
                                             max_memory_allocated), against the predicted
                                             sum without its overhead line (the device
                                             runtime and the allocator's fragmentation,
                                             which no tensor holds)

Gradients are the shards held between steps; the full-size buffers ZeRO-2/3 keep between
micro-batches (``no_sync``) are transient and counted in the peak.

Mixture of experts: every parameter is the same constant, so every token would pick the same k
experts. The step routes instead as the planner assumes (``moe.imbalance`` 1, :func:`balanced_routing`):
each expert gets N·k/E of a rank's N·k assignments, and every rank of an expert-parallel group
sends and receives the same rows, which is what the fake group's all-to-all (it fills each peer's
slot from this rank's own input) then reproduces.

Before anything is built, the rank's predicted peak is compared with the memory available here
(``MemAvailable`` of /proc/meminfo; with ``--on cuda`` the device's free memory): if it cannot fit,
one line says how much it needs and how much there is, exit status 2, nothing allocated.
``--on cuda`` builds the rank's tensors on the CUDA device, still under the fake process group.

Exit status 1 if a model-state kind differs by more than 2% or the peak by more than 10%.
``--layout best`` takes the planner's best layout for the config's own job (its sequence length and
global batch), verified at ``--seq``; otherwise a line as ``loom plan`` prints them
(``dp16 tp8 pp8 cp1 ep1 zero1 sp interleaved:v5 mb1 recompute:none``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import sys
import time

import torch

from loom import config as C
from loom.plan.cost import CostModel, Layout, PlanError, default_split, head_in_loss, split_layout
from loom.plan.hardware import ClusterSpec, HardwareError
from loom.plan.report import model_of, workload_of

STATE_TOLERANCE = 0.02
PEAK_TOLERANCE = 0.10
MiB = 2**20


def _parser() -> argparse.ArgumentParser:
    p = C.ArgParser(prog="loom plan verify", description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument(
        "--config", required=True, help="a Loom TOML config or preset (its model and training settings)"
    )
    p.add_argument(
        "--devices", "--world", type=int, dest="world", required=True, help="devices of the whole job"
    )
    p.add_argument("--device", help="the device the job runs on (8 per node), e.g. h100-sxm")
    p.add_argument(
        "--cluster", help="or a cluster: TOML file, a name in loom/configs/clusters, or DEVICE:NODESxPER"
    )
    p.add_argument(
        "--layout",
        default="best",
        help="'best' (the planner's) or a layout line, e.g. "
        "'dp16 tp8 pp8 cp1 ep1 zero1 sp interleaved:v5 mb1 recompute:none'",
    )
    p.add_argument("--rank", type=int, default=0, help="the rank to build and step (default 0)")
    p.add_argument(
        "--seq",
        type=int,
        default=None,
        help="sequence length of the step (default 256, or the model's max_seq_len if shorter)",
    )
    p.add_argument(
        "--microbatches", type=int, default=0, help="micro-batches of the step (default: the schedule's peak)"
    )
    p.add_argument(
        "--on",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the rank's tensors live: this host's memory (default) or the CUDA device",
    )
    return p


def _overrides(rest: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Config overrides after the flags, as ``loom train`` takes them: ``--model.n_layers 4`` or
    ``--model.n_layers=4``; anything else is argparse's one-line error."""
    out, i = [], 0
    while i < len(rest):
        key, eq, value = rest[i].partition("=")
        if not (key.startswith("--") and "." in key):
            parser.error(f"unrecognized argument {rest[i]!r} (config overrides are --section.field VALUE)")
        if not eq:
            if i + 1 >= len(rest):
                parser.error(f"{key}: missing value")
            value, i = rest[i + 1], i + 1
        out += [key, value]
        i += 1
    return out


def default_microbatches(lay: Layout) -> int:
    """Enough micro-batches for every stage to reach its activation peak (and for the schedule to be valid)."""
    if lay.pp == 1:
        return 1
    return 2 * lay.pp if lay.schedule == "2bw" else lay.pp


def job_config(cfg: C.LoomConfig, lay: Layout, seq: int, m: int) -> C.LoomConfig:
    """``cfg`` with the layout's degrees, ``seq`` tokens per sequence and ``m`` micro-batches per rank."""
    cfg = copy.deepcopy(cfg)
    p = cfg.parallel
    p.dp, p.dp_shard, p.tp, p.pp, p.cp, p.ep = lay.dp, lay.dp_shard, lay.tp, lay.pp, lay.cp, lay.ep
    p.cp_mode = lay.cp_mode  # type: ignore[assignment]  # one of CP_MODES (the search enumerates only those)
    p.expert_tp = lay.expert_tp  # type: ignore[assignment]  # one of EXPERT_TP_MODES (likewise)
    p.zero, p.sp, p.schedule, p.virtual_stages = lay.zero, lay.sp, lay.schedule, lay.v
    p.offload = "cpu" if lay.offload else "none"
    cfg.train.micro_batch, cfg.train.global_batch = lay.micro_batch, lay.micro_batch * lay.dp * m
    cfg.train.recompute = lay.recompute
    cfg.train.steps = max(cfg.train.steps, 10)  # the pipeline records its timeline at step 3, never here
    if lay.pp > 1:  # the planner's blocks per stage (its split, or its default rule; no profiling run)
        # a split counts blocks per device, cut into its v chunks (the planner counts per device)
        counts = lay.split or default_split(cfg.model.n_layers, lay.pp)
        try:
            cfg.parallel.pp_layout = split_layout(counts, lay.v)
        except ValueError:  # fewer blocks than chunks on a device: the runtime's even cut
            cfg.parallel.pp_layout = uniform_layout(cfg.model.n_layers, lay.pp * lay.v)
    cfg.data.seq_len = seq
    cfg.model.vocab_size = model_of(cfg).vocab_size
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, seq)
    return cfg


def uniform_layout(n_layers: int, stages: int) -> str:
    """``parallel.pp_layout`` with ``n_layers`` blocks over ``stages`` stages, the first ones one block
    longer when they do not divide."""
    bounds, lo = [], 0
    for s in range(stages):
        hi = lo + n_layers // stages + (s < n_layers % stages)
        bounds.append(f"{lo}-{hi - 1}")
        lo = hi
    return ",".join(bounds)


def constant(name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> torch.Tensor:
    """Every parameter 1e-2 (a broadcast view: no memory, no random draw); under the fake group the
    values are meaningless anyway, only shapes and bytes are measured."""
    return torch.full((), 1e-2).expand(shape)[index]


@contextlib.contextmanager
def balanced_routing():
    """Inside the block, every MoE layer sends assignment j of token n to expert (n·k + j) mod E (k
    distinct experts per token; N·k/E rows per expert, ±1), weighted by the router's scores at those
    experts (renormalized with ``moe.norm_topk``): the balanced load the planner predicts with
    ``moe.imbalance`` 1, and the same on every rank, so the counts each rank of an ep group sends
    equal those it receives (under the fake process group, whose all-to-all repeats this rank's
    input for every peer, the split sizes then agree)."""
    from loom.model import moe

    real = moe.route

    def route(x, router, top_k, score="softmax", norm_topk=True, bias=None):
        r = real(x, router, top_k, score, norm_topk, bias)
        n, n_experts = r.scores.shape
        experts = torch.arange(n * top_k, device=x.device).view(n, top_k) % n_experts
        weights = r.scores.gather(-1, experts)
        if norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return moe.Routing(weights.to(x.dtype), experts, r.scores, r.logits)

    moe.route = route
    try:
        yield
    finally:
        moe.route = real


def _warm_up(dev: torch.device) -> None:
    """First use of the meta device, the matmul kernels, autograd and an optimizer (whose first
    construction imports torch._dynamo: ~70 MiB of resident set), so that none of it is counted in
    the model's peak."""
    with torch.device("meta"):
        torch.empty(1)
    layer = torch.nn.Linear(8, 8, device=dev)
    layer(torch.ones(2, 8, device=dev)).sum().backward()
    torch.optim.AdamW(layer.parameters()).step()


def measure(cfg: C.LoomConfig, rank: int, world: int, on: str = "cpu") -> dict[str, float]:
    """Build rank ``rank`` of a ``world``-rank job under the fake process group on device ``on``
    (``cpu`` or ``cuda``), step it once, and return its bytes by kind (parameters, gradients,
    optimizer, saved activations, peak) and timings."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from loom.mesh import ParallelDims, ParallelMesh
    from loom.model.llama import build_model
    from loom.train.build import build_run, saved_activations

    dev = torch.device("cuda", torch.cuda.current_device()) if on == "cuda" else torch.device("cpu")
    torch.set_num_threads(os.cpu_count() or 1)
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        t0 = time.perf_counter()
        mesh = ParallelMesh(ParallelDims.from_config(cfg.parallel), dev.type)
        _warm_up(dev)
        window = TensorPeak(dev).__enter__()
        run = build_run(
            cfg, mesh, build_model(cfg.model, cfg.train.seed, dev, meta=True, moe=cfg.moe), source=constant
        )
        t1 = time.perf_counter()
        g = torch.Generator().manual_seed(0)
        m = cfg.train.global_batch // (cfg.train.micro_batch * mesh.size("dp"))
        seq = cfg.data.seq_len // mesh.size("cp")
        batches = [
            (
                torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, seq), generator=g).to(dev),
                torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, seq), generator=g).to(dev),
            )
            for _ in range(m)
        ]
        saved = saved_activations(cfg, run.model, dev)
        strategy = run.strategy

        def update() -> float:  # the values are garbage under the fake group: no clipping, no finite check
            strategy.finish_sync()
            strategy.step(1e-5)
            return 0.0

        strategy.zero_grad()
        with saved, balanced_routing():
            run.forward_backward(batches, run.loss_fn, update, mesh.group("dp_cp"))
        window.__exit__(None, None, None)
        peak = window.peak
        state = strategy.state_bytes()
        return {
            "parameters": state["param_bytes"],
            "gradients": state["grad_bytes"],
            "optimizer": state["optim_bytes"],
            "saved activations": saved.peak,
            "peak": peak,
            "build_s": t1 - t0,
            "step_s": time.perf_counter() - t1,
            "stage": mesh.local_rank("pp"),
            "microbatches": m,
            "transient": state.get("transient_peak_bytes", 0),
        }
    finally:
        dist.destroy_process_group()


def predict(cfg: C.LoomConfig, cluster: ClusterSpec, lay: Layout, stage: int, m: int) -> dict[str, float]:
    """The planner's bytes by kind for a device of pipeline stage ``stage`` (``m`` micro-batches)."""
    work = dataclasses.replace(workload_of(cfg), moe_imbalance=1.0)  # measured: balanced_routing
    cm = CostModel(model_of(cfg), work, measured_on(cluster, cfg.run.device))
    bd = cm.stage_memory(lay, stage, m)
    return {
        "parameters": bd["weights"],
        "gradients": bd["gradients"],  # held between steps; full-size buffers of no_sync count in the peak
        "optimizer": bd["optimizer"],
        "saved activations": bd["activations"] + (0.0 if head_in_loss(cm, lay) else bd["logits"]),
        "peak": sum(bd.values()) - bd["overhead"],  # tensor bytes: no runtime, no fragmentation
    }


def measured_on(cluster: ClusterSpec, device: str) -> ClusterSpec:
    """``cluster`` with its device's ``grouped_mm`` (whether MoE experts run ``torch._grouped_mm`` or
    the padded batched matmul, per activation dtype) as on ``device``, where the rank is built and
    measured: the CPU's, or this CUDA device's (:func:`loom.model.moe.grouped_mm_available`)."""
    from loom.model.moe import grouped_mm_available

    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        return cluster
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    dtypes = (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))
    have = tuple(n for n, t in dtypes if grouped_mm_available(torch.empty(1, dtype=t, device=dev)))
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, grouped_mm=have))


def table(measured: dict[str, float], predicted: dict[str, float]) -> tuple[str, bool]:
    """Rows of kind | predicted MiB | measured MiB | ratio | verdict, and whether every gate holds."""
    rows, ok = [f"{'kind':<18}{'predicted MiB':>15}{'measured MiB':>15}{'ratio':>8}  check"], True
    for kind, tol in (
        ("parameters", STATE_TOLERANCE),
        ("gradients", STATE_TOLERANCE),
        ("optimizer", STATE_TOLERANCE),
        ("saved activations", None),
        ("peak", PEAK_TOLERANCE),
    ):
        p, x = predicted[kind], measured[kind]
        ratio = x / p if p else (1.0 if x == 0 else float("inf"))
        verdict = "shown"
        if tol is not None:
            good = abs(ratio - 1.0) <= tol
            ok &= good
            verdict = f"{'ok' if good else 'FAIL'} (±{tol:.0%})"
        rows.append(f"{kind:<18}{p / MiB:>15.1f}{x / MiB:>15.1f}{ratio:>8.3f}  {verdict}")
    return "\n".join(rows), ok


def main(argv: list[str], cluster_of) -> int:
    """``cluster_of(args, default)``: the cluster of ``--cluster`` / ``--device`` (as ``loom plan`` reads them)."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    overrides = _overrides(rest, parser)
    if args.on == "cuda":
        from loom.device import cuda_available

        if not cuda_available():
            print(
                "loom plan verify: error: --on cuda: no CUDA device here (torch.cuda.is_available() is False)",
                file=sys.stderr,
            )
            return 2
    try:
        for flag, value, low, note in (  # each flag named itself, before it becomes a config field
            ("--devices", args.world, 1, ""),
            ("--seq", 2 if args.seq is None else args.seq, 2, ""),
            ("--microbatches", args.microbatches, 0, " (0 = the schedule's peak)"),
            ("--rank", args.rank, 0, ""),
        ):
            if value < low:
                raise PlanError(f"{flag}: must be >= {low}{note}, got {value}")
        cfg = C.load(args.config, overrides)
        if args.seq is None:
            args.seq = min(256, cfg.model.max_seq_len)
        if args.seq > cfg.model.max_seq_len:  # loom train refuses it; raised here, a step could run for hours
            raise PlanError(
                f"--seq {args.seq}: exceeds model.max_seq_len = {cfg.model.max_seq_len} of the config; give "
                f"--model.max_seq_len {args.seq} to verify that length"
            )
        cluster = cluster_of(args, "h100-8x8")
        if args.layout == "best":
            from loom.plan.search import search

            probe = job_config(cfg, Layout(), cfg.data.seq_len, 1)  # the real job's layout; verified at --seq
            probe.train.global_batch = cfg.train.global_batch
            result = search(model_of(probe), workload_of(probe), cluster, args.world)
            if not result.ranked:
                raise PlanError(f"--layout best: no layout of {args.world} devices fits this model")
            lay = result.ranked[0].layout
        else:
            lay = Layout.parse(args.layout)
            if lay.tp_overlap or lay.ep_overlap:
                from loom.plan.cost.check import OVERLAP_REFUSED

                raise PlanError(f"--layout {args.layout!r}: {OVERLAP_REFUSED}")
        if lay.world_size != args.world:
            raise PlanError(
                f"--layout {lay.spec()!r} uses {lay.world_size} devices, --devices is {args.world}"
            )
        if not 0 <= args.rank < args.world:
            raise PlanError(f"--rank: must be in [0, {args.world}), got {args.rank}")
        m = args.microbatches or default_microbatches(lay)
        cfg = job_config(cfg, lay, args.seq, m)
        cfg.run.device = args.on  # train.precision auto resolves for it (bf16 on CUDA, fp32 on the CPU)
        C.validate(cfg, args.world)
        from loom.mesh import ParallelDims

        stage = ParallelDims.from_config(cfg.parallel).coords(args.rank)["pp"]
        predicted = predict(cfg, cluster, lay, stage, m)
        problem = host_problem(predicted, *available_bytes(args.on))  # the precheck: before building
        where = f"{lay.spec()} (--layout best)" if args.layout == "best" else lay.spec()
        if problem is not None:
            raise C.ConfigError(f"rank {args.rank} of {where} (pipeline stage {stage}): {problem}")
        from loom.plan.auto import fit_problem

        problem = fit_problem(cfg, args.world, local_ranks=1)  # one rank runs here: before building it
        if problem is not None:
            raise C.ConfigError(f"--seq {args.seq}: {problem}")
    except (C.ConfigError, PlanError, HardwareError) as e:
        print(f"loom plan verify: error: {e}", file=sys.stderr)
        return 2
    print(
        f"verifying rank {args.rank} of {args.world} ({cluster.device.name}, tensors on {args.on}): "
        f"{lay.spec()}, seq {args.seq}, "
        f"{m} micro-batch{'es' * (m > 1)}",
        flush=True,
    )
    measured = measure(cfg, args.rank, args.world, args.on)
    text, ok = table(measured, predicted)
    print(
        f"pipeline stage {int(measured['stage'])}; built in {measured['build_s']:.1f} s, "
        f"stepped in {measured['step_s']:.1f} s"
    )
    print(text)
    print(
        "verified: the planner's model states and peak hold for this rank"
        if ok
        else "NOT verified: a measurement is outside its tolerance"
    )
    return 0 if ok else 1


class TensorPeak:
    """Peak bytes of tensors allocated inside the window above those live at its start: the CUDA
    allocator's ``max_memory_allocated`` on a GPU; on the CPU, the running sum of the profiler's
    allocation records (``profile_memory``), so glibc's arenas, lazily loaded libraries and page
    reuse (which make the resident set differ by ±5% from one machine to the next) do not count."""

    def __init__(self, dev: torch.device):
        self.dev, self.peak = dev, 0

    def __enter__(self) -> TensorPeak:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            self._base = torch.cuda.memory_allocated(self.dev)
            torch.cuda.reset_peak_memory_stats(self.dev)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with _quiet_stderr():  # kineto prints a line at start and stop
                self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            self.peak = int(torch.cuda.max_memory_allocated(self.dev)) - self._base
            return
        from torch._C._autograd import DeviceType

        with _quiet_stderr():
            self._prof.__exit__(*exc)
        result = self._prof.profiler.kineto_results if self._prof.profiler else None
        records = result.events() if result else []
        live = 0
        for e in sorted(records, key=lambda e: e.start_ns()):
            if e.name() == "[memory]" and e.device_type() == DeviceType.CPU:
                live += e.nbytes()  # type: ignore[attr-defined]  # bound in C++, absent from the stub
                self.peak = max(self.peak, live)


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for the block (C++ libraries that log there unasked)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def available_bytes(on: str) -> tuple[int | None, str]:
    """(bytes free for the rank, where): ``MemAvailable`` of /proc/meminfo (the kernel's estimate of
    memory a new allocation can get without swapping) on the CPU, the device's free memory
    (``torch.cuda.mem_get_info``) on CUDA; None where the system does not say."""
    if on == "cuda":
        return int(torch.cuda.mem_get_info()[0]), "free on the CUDA device"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available host memory (MemAvailable)"
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE")), "free host memory"
    except (ValueError, OSError, AttributeError):
        return None, "host memory"


def host_problem(predicted: dict[str, float], available: int | None, where: str) -> str | None:
    """One line when the rank's predicted peak (model states included) exceeds what is available."""
    need = predicted["peak"]
    if available is None or need <= available:
        return None
    states = predicted["parameters"] + predicted["gradients"] + predicted["optimizer"]
    return (
        f"this rank needs about {need / 2**30:.1f} GiB (model states {states / 2**30:.1f} GiB + the "
        f"step's peak), {where} is {available / 2**30:.1f} GiB; nothing was built (a machine with more "
        f"memory, --on cuda, or a layout with less per rank)"
    )
