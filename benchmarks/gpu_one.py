"""The one-GPU check (issue 32): is Loom right and fast on this GPU, in one table.

Run through ``benchmarks/gpu_one.sh`` (which puts every part under its own ``timeout``)::

    bash benchmarks/gpu_one.sh --out DIR [--data DIR] [--only A,B,...] [--dry-run] [--budget KEY=VALUE ...]

Subcommands of this driver (what the wrapper calls):

    prepare --out DIR                  the default corpus (Python's stdlib, offline) into DIR/data
    part X --out DIR --data D          one part; its rows go to DIR/parts/X.json (written after each row)
    summary --out DIR --parts ABC      DIR/summary.json and DIR/summary.md; exit 1 if any row FAILs
    _train --report F [--syncs M] -- ARGS   (internal) ``loom train ARGS`` in this process, with the
                                       allocator's peaks and, with --syncs, host syncs per step

Parts (budgets in BUDGETS; ``--budget KEY=VALUE`` overrides one, e.g. ``--budget B.mfu_min=0.3``):

    A facts        device, capability, torch / CUDA / NCCL versions, the peak of loom.plan.hardware's table
    B trainer      ``loom train`` gpt-125m, bf16, seq 2048, 30 steps on CUDA: loss falls, MFU, tokens/s and
                   step time against the planner's plan_step_time_s, peak allocated against plan_peak_mem_bytes
                   (less the runtime overhead the planner adds), reserved against allocated
    C precisions   tokens/s of fp32 / tf32 / bf16 eager and of bf16 / fp8 (train.fp8_layers = auto: only
                   the Linears where float8 pays) with train.compile blocks that ``loom config --reference``
                   lists (one missing: SKIP, with the reason), the compiled bf16 step against the planner's
                   plan_step_time_s (it prices compiled memory-bound work at one pass); and where fp8 pays: one SwiGLU MLP at llama3-8b's
                   shape (h 4096, f 14336, 16,384 tokens), forward + backward, eager, Loom's fp8 swap of
                   every Linear (tensorwise) against bf16 (the dry run: tiny shapes, the ratio SKIP)
    D CPU = GPU    the debug preset, 10 steps, fp32 with TF32 off, on CPU and on CUDA: losses within 1e-4
    E syncs        single-rank ZeRO-1, ZeRO-3 + offload_params = cpu, activation offload, MoE (grouped),
                   Adafactor: 5 steps under torch.cuda.set_sync_debug_mode("warn"), syncs per step (steps
                   2..5, inside train_step) against the step's budget (the dry run: loom.device_sync.SyncCounter)
    F CP blocks    loom.parallel.context.blocks.attend / attend_backward at 8k: peak bytes against the
                   module's O(T·d) formula, achieved FLOP/s against the datasheet peak
    G plan verify  ``loom plan verify --on cuda``: rank 0 of the planner's best llama3-70b layout on
                   1,024 H100s at seq 8192, and on 256 H100s at seq 256, built and stepped on this GPU
                   under the fake process group: model states within 2% and the allocator's peak
                   within 10% of the planner

``--dry-run``: every part on the CPU with tiny sizes (debug preset, few steps, small blocks), through
the same code; GPU budgets then become sanity ranges, marked "dry run" in the table.

No network on the GPU machine: nothing is downloaded. Missing pure-Python packages come as wheels:
on a machine with the network ``pip download -d wheels -r requirements.txt`` (same Python version
and platform), copy ``wheels/`` over, then ``pip install --no-index --find-links wheels -r
requirements.txt``. torch (with CUDA) is the machine's own.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PARTS = "ABCDEFG"
TITLES = {
    "A": "facts",
    "B": "trainer on the device",
    "C": "precisions and compile",
    "D": "CPU = GPU",
    "E": "placement and host syncs",
    "F": "context-parallel blocks",
    "G": "plan verify",
}

# key: (budget on the GPU, budget on the dry run, what it bounds)
BUDGETS: dict[str, tuple[float, float, str]] = {
    "A.capability_min": (8.0, 0.0, "compute capability (bf16, flash attention)"),
    "A.peak_tflops_min": (100.0, 1e-6, "bf16 peak FLOP/s of the device table, TFLOP/s"),
    "A.torch_min": (2.10, 2.0, "torch version"),
    "B.mfu_min": (0.20, 1e-9, "MFU of gpt-125m bf16 (eager)"),
    "B.step_ratio_max": (2.0, 1e9, "measured / planner step time"),
    "B.step_ratio_min": (0.5, 0.0, "measured / planner step time"),
    "B.mem_ratio_max": (1.25, 1e9, "peak allocated / planner peak (less runtime)"),
    "B.mem_ratio_min": (0.75, 0.0, "peak allocated / planner peak (less runtime)"),
    "B.reserved_ratio_max": (1.30, 1e9, "peak reserved / peak allocated"),
    "C.tf32_over_fp32_min": (1.5, 0.0, "tokens/s tf32 / fp32"),
    "C.bf16_over_fp32_min": (3.0, 0.0, "tokens/s bf16 / fp32"),
    "C.fp8_over_bf16_min": (0.95, 0.0, "tokens/s fp8 (auto) / bf16, both compile blocks"),
    "C.fp8_mlp_over_bf16_min": (1.2, 0.0, "speed fp8 / bf16, SwiGLU MLP fwd+bwd at llama3-8b shape (eager)"),
    "C.compile_over_eager_min": (1.05, 0.0, "tokens/s compile blocks / eager (bf16)"),
    "C.compiled_step_ratio_min": (0.75, 0.0, "measured / planner step time, bf16 + compile blocks"),
    "C.compiled_step_ratio_max": (1.33, 1e9, "measured / planner step time, bf16 + compile blocks"),
    "D.loss_atol": (1e-4, 1e-4, "max |loss CPU - loss device| over 10 steps"),
    "E.syncs_per_step_max": (2.0, 2.0, "host syncs per step (grad norm, loss)"),
    "F.mem_over_formula_max": (1.25, 4.0, "peak bytes / O(T·d) formula (the kernel's workspace in it)"),
    "F.peak_fraction_min": (0.15, 0.0, "achieved / datasheet bf16 FLOP/s"),
    "G.state_tol": (0.02, 0.02, "model-state bytes vs planner (verify's own gate)"),
}

# part: timeout in seconds (what gpu_one.sh reads): about 9 minutes in all; on an H100 (2026-11-27) the
# parts took 341 s, C and E cut short by 150 s and 60 s (the fp8 compile, ZeRO-3 offload), hence 210 and 100;
# run 4 (2026-11-27): C's five runs took 195 s, and C's fp8 MLP check adds ~15 s (hence 225)
TIMEOUTS = {"A": 20, "B": 70, "C": 225, "D": 40, "E": 100, "F": 20, "G": 75}
DRY_TIMEOUTS = {"A": 60, "B": 90, "C": 120, "D": 90, "E": 120, "F": 60, "G": 60}


class Ctx:
    def __init__(self, args: argparse.Namespace) -> None:
        self.out = Path(args.out)
        self.data = Path(args.data) if getattr(args, "data", None) else self.out / "data"
        self.dry = bool(args.dry_run)
        self.overrides = dict(_kv(b) for b in getattr(args, "budget", None) or [])
        self.device = "cpu" if self.dry else "cuda"

    def budget(self, key: str) -> float:
        if key in self.overrides:
            return self.overrides[key]
        gpu, dry, _ = BUDGETS[key]
        return dry if self.dry else gpu

    def shown(self, key: str) -> str:
        """How a budget reads in the table: the dry run's sanity ranges say so."""
        return " (dry run)" if self.dry and key not in self.overrides else ""


def _kv(text: str) -> tuple[str, float]:
    key, _, value = text.partition("=")
    if key not in BUDGETS:
        raise SystemExit(f"gpu_one: --budget {text!r}: unknown key; known: {', '.join(BUDGETS)}")
    return key, float(value)


# ----------------------------------------------------------------------------------------------- rows


class Part:
    """The rows of one part, written to ``out/parts/X.json`` after every row (a timeout keeps them)."""

    def __init__(self, ctx: Ctx, name: str) -> None:
        self.ctx, self.name, self.rows = ctx, name, []
        self.path = ctx.out / "parts" / f"{name}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.perf_counter()
        self._write()

    def add(self, check: str, measured: Any, expected: str, status: str, note: str = "") -> None:
        assert status in ("PASS", "FAIL", "SKIP"), status
        row = {"part": self.name, "check": check, "measured": _fmt(measured), "expected": expected}
        row.update(status=status, note=note)
        self.rows.append(row)
        print(f"[{self.name}] {status:4} {check}: {row['measured']} (expected {expected}) {note}", flush=True)
        self._write()

    def at_least(self, check: str, value: float | None, key: str, note: str = "", unit: str = "") -> None:
        lo = self.ctx.budget(key)
        self._bound(check, value, lo, None, f"≥ {_fmt(lo)}{unit}{self.ctx.shown(key)}", note, unit)

    def at_most(self, check: str, value: float | None, key: str, note: str = "", unit: str = "") -> None:
        hi = self.ctx.budget(key)
        self._bound(check, value, None, hi, f"≤ {_fmt(hi)}{unit}{self.ctx.shown(key)}", note, unit)

    def within(self, check: str, value: float | None, lo_key: str, hi_key: str, note: str = "") -> None:
        lo, hi = self.ctx.budget(lo_key), self.ctx.budget(hi_key)
        expected = f"{_fmt(lo)} .. {_fmt(hi)}{self.ctx.shown(lo_key) or self.ctx.shown(hi_key)}"
        self._bound(check, value, lo, hi, expected, note)

    def _bound(self, check, value, lo, hi, expected, note, unit=""):
        if value is None or not math.isfinite(value):
            self.add(check, "none", expected, "FAIL", note or "no measurement")
            return
        ok = (lo is None or value >= lo) and (hi is None or value <= hi)
        self.add(check, f"{_fmt(value)}{unit}", expected, "PASS" if ok else "FAIL", note)

    def _write(self) -> None:
        body = {"part": self.name, "rows": self.rows, "elapsed_s": time.perf_counter() - self.started}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=1))
        tmp.replace(self.path)


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        if x == 0 or 1e-3 <= abs(x) < 1e6:
            return f"{x:.4g}"
        return f"{x:.3e}"
    return str(x)


# ------------------------------------------------------------------------------------- loom train runs


def _train_args(ctx: Ctx, preset: str, run_dir: Path, **fields: Any) -> list[str]:
    """``loom train`` arguments: one rank on the part's device, the prepared data, no progress bar."""
    args = [preset, "--nproc", "1", "--run.dir", str(run_dir), "--data.prepared_dir", str(ctx.data)]
    base = {
        "run.device": ctx.device,
        "run.progress": "false",
        "run.tensorboard": "false",
        "train.eval_every": 0,
    }
    for key, value in {**base, **fields}.items():
        args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return args


def train(
    ctx: Ctx,
    name: str,
    args: list[str],
    timeout: float,
    syncs: str = "",
    env: dict[str, str] | None = None,
    kernels: int = 0,
) -> dict[str, Any]:
    """Run ``loom train ARGS`` in a child (``_train``): its report, its metrics rows, and on failure the
    error's last line (``error``)."""
    report = ctx.out / "runs" / f"{name}.report.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "_train", "--report", str(report)]
    if syncs:
        cmd += ["--syncs", syncs]
    if kernels:
        cmd += ["--kernels", str(kernels)]
    if ctx.dry:
        cmd += ["--compile-backend", "aot_eager"]  # inductor's C++ build takes a minute on a CPU
    cmd += ["--", *args]
    log = ctx.out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if ctx.dry:
        rc = _forked(cmd[2:], log, max(timeout, 1), env or {})
    else:
        try:
            with open(log, "w") as fh:
                rc = subprocess.run(
                    cmd,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    timeout=max(timeout, 1),
                    env={**os.environ, **(env or {})},
                ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    out: dict[str, Any] = json.loads(report.read_text()) if report.is_file() else {}
    out["wall_s"] = time.perf_counter() - t0
    run_dir = Path(args[args.index("--run.dir") + 1])
    metrics = run_dir / "metrics.jsonl"
    out["rows"] = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    if rc != 0:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] or ["no output"]
        out["error"] = f"rc {rc}{' (timed out)' if rc == 124 else ''}: {tail[0][-200:]} (log: {log})"
    return out


def _forked(argv: list[str], log: Path, timeout: float, env: dict[str, str]) -> int:
    """The dry run's child: ``main(ARGV)`` (the ``_train`` entry, as the GPU's fresh interpreter runs
    it) in a process forked from this one once torch and Loom are imported (CPU only, no CUDA in the
    parent), so each tiny run skips an interpreter's ~3 s of imports. Output to ``log``; the exit
    status, 124 past ``timeout`` (the child killed)."""
    import torch  # noqa: F401  the imports every run makes, once
    import torch._dynamo  # noqa: F401

    import loom.cli  # noqa: F401
    import loom.plan.auto  # noqa: F401
    import loom.train.trainer  # noqa: F401

    if "--train.compile" in argv:  # what compiling imports (aot_autograd, inductor's passes): ~1 s
        import torch._dynamo.backends.common  # noqa: F401
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the parent's code
        rc = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            os.environ.update(env)
            rc = main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell says
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return 124
        time.sleep(0.05)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _steady_tps(rows: list[dict]) -> float | None:
    """tokens/s of the log windows after the first (compilation, allocator warm-up)."""
    return _mean([r["tokens_per_s"] for r in rows[1:] if "tokens_per_s" in r])


def _remaining(part: Part, total: float) -> float:
    return total - (time.perf_counter() - part.started)


# --------------------------------------------------------------------------------------------- parts


def part_a(ctx: Ctx, part: Part) -> None:
    import torch

    from loom.train.mfu import mfu_peak

    cuda = torch.cuda.is_available()
    if ctx.dry:
        part.add("device", "cpu", "cpu (dry run)", "PASS")
    else:
        name = torch.cuda.get_device_name(0) if cuda else "no CUDA device"
        part.add("device", name, "a CUDA device", "PASS" if cuda else "FAIL")
    if cuda:
        major, minor = torch.cuda.get_device_capability(0)
        part.at_least("compute capability", major + minor / 10, "A.capability_min")
    else:
        part.add("compute capability", "n/a", "≥ 8.0", "SKIP", "no CUDA device (dry run)")
    version = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    part.at_least("torch version", version[0] + version[1] / 100, "A.torch_min", note=torch.__version__)
    if cuda:
        part.add("CUDA version", torch.version.cuda, "reported", "PASS" if torch.version.cuda else "FAIL")
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
            part.add("NCCL version", nccl, "reported", "PASS", "one GPU: NCCL itself is not exercised")
        except Exception as e:  # torch built without NCCL
            part.add("NCCL version", "none", "reported", "FAIL", str(e)[:120])
    else:
        part.add(
            "CUDA / NCCL versions", f"cuda {torch.version.cuda}", "reported", "SKIP", "no CUDA (dry run)"
        )
    device = torch.device("cuda" if cuda else "cpu")
    peak, source = mfu_peak(device, "bf16")
    known = source.startswith("datasheet")
    if not ctx.dry:
        part.add("device in loom.plan.hardware", source, "a datasheet row", "PASS" if known else "FAIL")
    part.at_least("bf16 peak (MFU's divisor)", peak / 1e12, "A.peak_tflops_min", note=source, unit=" TFLOP/s")


def part_b(ctx: Ctx, part: Part) -> None:
    steps, log_every = (4, 2) if ctx.dry else (30, 10)
    preset = "debug" if ctx.dry else "gpt-125m"
    sizes = {"data.seq_len": 64, "train.global_batch": 8, "train.micro_batch": 2} if ctx.dry else {}
    if not ctx.dry:
        sizes = {"data.seq_len": 2048, "train.global_batch": 32, "train.micro_batch": 8}
    args = _train_args(
        ctx,
        preset,
        ctx.out / "runs" / "B",
        **sizes,
        **{
            "train.precision": "bf16",
            "train.steps": steps,
            "train.log_every": log_every,
            "train.warmup_steps": 3,
            "train.lr": 6e-4,
        },
    )
    r = train(ctx, "B", args, _remaining(part, ctx_timeout(ctx, "B")) - 5, kernels=3 if ctx.dry else 5)
    rows = r["rows"]
    if r.get("kernels"):  # where a step's device time goes (the log only: a lead, not a check)
        print(
            f"top ops by self device time in step {3 if ctx.dry else 5}: {r['kernels_total_ms']:.1f} ms in all"
        )
        for name, n, ms in r["kernels"]:
            print(f"  {ms:9.2f} ms {n:6d}x  {name}")
    what = f"{preset} bf16 seq {sizes['data.seq_len']}, {steps} steps"
    if "error" in r or len(rows) < 2:
        part.add(
            f"loom train ({what})", "failed", "runs", "FAIL", r.get("error", "fewer than 2 metrics rows")
        )
        return
    first, last = rows[0], rows[-1]
    part.add(
        "loss falls",
        f"{first['loss']:.3f} → {last['loss']:.3f}",
        f"step {last['step']} < step {first['step']}",
        "PASS" if last["loss"] < first["loss"] else "FAIL",
        what,
    )
    tps = _steady_tps(rows)
    mfu = _mean([x["mfu"] for x in rows[1:]])
    part.at_least("MFU", mfu, "B.mfu_min", note=f"{_fmt(tps)} tokens/s after step {first['step']}")
    planned_step(part, rows, "B.step_ratio_min", "B.step_ratio_max", "step time / planner")
    plan_peak = last.get("plan_peak_mem_bytes")
    alloc = max([x.get("peak_mem_bytes", 0) for x in rows] + [r.get("max_allocated", 0)])
    if plan_peak:
        from loom.plan.hardware import DEVICES
        from loom.plan.hardware.datasheets import device_key

        key = device_key(r.get("device_name", "")) if not ctx.dry else "cpu"
        runtime = DEVICES[key].runtime_overhead_bytes if key in DEVICES else 0.0
        dynamic = plan_peak - runtime
        part.within(
            "peak allocated / planner" if not ctx.dry else "peak RSS / planner",
            alloc / dynamic if dynamic > 0 else None,
            "B.mem_ratio_min",
            "B.mem_ratio_max",
            note=f"{alloc / 2**20:.0f} MiB measured, {dynamic / 2**20:.0f} MiB predicted "
            f"(plan_peak_mem_bytes less {runtime / 2**30:.1f} GiB runtime)",
        )
    else:
        part.add("peak memory / planner", "none", "plan_peak_mem_bytes", "FAIL", "no plan_* fields")
    reserved = r.get("max_reserved")
    if reserved:
        logged = max(x.get("peak_reserved_bytes", 0) for x in rows)  # the trainer's own, every log window
        part.at_most(
            "peak reserved / allocated",
            reserved / max(alloc, 1),
            "B.reserved_ratio_max",
            note=f"{reserved / 2**20:.0f} MiB reserved (the allocator), {logged / 2**20:.0f} MiB in metrics.jsonl",
        )
    else:
        part.add("peak reserved / allocated", "n/a", "≤ 1.3", "SKIP", "no CUDA allocator (dry run)")


def reference_choices(field: str) -> list[str]:
    """The values ``loom config --reference`` lists for ``field`` (its "one of: a | b" tail)."""
    out = subprocess.run(
        [sys.executable, "-m", "loom", "config", "--reference"], capture_output=True, text=True, timeout=60
    ).stdout
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] == field and "one of:" in line:
            return [v.strip() for v in line.rsplit("one of:", 1)[1].split("|")]
    return []


def part_c(ctx: Ctx, part: Part) -> None:
    import importlib.util

    precisions, compiles = reference_choices("train.precision"), reference_choices("train.compile")
    preset = "debug" if ctx.dry else "gpt-125m"
    steps, log_every = (4, 2) if ctx.dry else (10, 5)
    sizes = (
        {"data.seq_len": 64, "train.global_batch": 4, "train.micro_batch": 2}
        if ctx.dry
        else {"data.seq_len": 2048, "train.global_batch": 16, "train.micro_batch": 8}
    )
    # fp8 with compile only: eager, torchao's scaling and casts are separate kernels (0.49x bf16 on an
    # H100, docs/gpu/2026-11-27-h100-run1.md); compiled they fuse into the neighbours, as torchao intends
    runs = [(p, "none") for p in ("fp32", "tf32", "bf16")] + [("bf16", "blocks"), ("fp8", "blocks")]
    tps: dict[tuple[str, str], float] = {}
    skipped: dict[tuple[str, str], str] = {}
    compiled_rows: list[dict] = []
    for precision, comp in runs:
        label = (
            precision
            + (" (auto)" if precision == "fp8" else "")
            + (f" + compile {comp}" if comp != "none" else "")
        )
        why = ""
        if precision not in precisions:
            why = f"train.precision has no {precision!r} in `loom config --reference` ({' | '.join(precisions)})"
        elif comp != "none" and comp not in compiles:
            why = f"train.compile has no {comp!r} in `loom config --reference`"
        elif precision == "fp8" and importlib.util.find_spec("torchao") is None:
            why = "torchao is not installed (bring it as a wheel: module docstring)"
        elif precision == "fp8" and not ctx.dry and _capability() < (8, 9):
            why = f"fp8 needs compute capability ≥ 8.9, this device has {_capability()}"
        if why:
            skipped[(precision, comp)] = why
            part.add(f"{label} tokens/s", "n/a", "runs", "SKIP", why)
            continue
        fields = {"train.precision": precision, "train.steps": steps, "train.log_every": log_every}
        if comp != "none":
            fields["train.compile"] = comp
        left = _remaining(part, ctx_timeout(ctx, "C")) - 3
        name = f"C-{precision}-{comp}"
        r = train(ctx, name, _train_args(ctx, preset, ctx.out / "runs" / name, **sizes, **fields), left)
        rows = r["rows"]
        if "error" in r or len(rows) < 2:
            skipped[(precision, comp)] = "its run failed"
            part.add(f"{label} tokens/s", "failed", "runs", "FAIL", r.get("error", "fewer than 2 rows"))
            continue
        finite = all(math.isfinite(x["loss"]) for x in rows)
        tps[(precision, comp)] = t = _steady_tps(rows) or 0.0
        if (precision, comp) == ("bf16", "blocks"):
            compiled_rows = rows
        part.add(
            f"{label} tokens/s",
            t,
            "runs, loss finite",
            "PASS" if finite and t > 0 else "FAIL",
            f"loss {rows[-1]['loss']:.3f}, MFU {rows[-1]['mfu']:.1%}, compile {'inductor' if not ctx.dry else 'aot_eager'}"
            if comp != "none"
            else f"loss {rows[-1]['loss']:.3f}, MFU {rows[-1]['mfu']:.1%}",
        )
    for (num, den), key in (
        ((("tf32", "none"), ("fp32", "none")), "C.tf32_over_fp32_min"),
        ((("bf16", "none"), ("fp32", "none")), "C.bf16_over_fp32_min"),
        ((("fp8", "blocks"), ("bf16", "blocks")), "C.fp8_over_bf16_min"),
        ((("bf16", "blocks"), ("bf16", "none")), "C.compile_over_eager_min"),
    ):
        label = BUDGETS[key][2]
        missing = [k for k in (num, den) if k not in tps]
        if missing:
            why = "; ".join(
                f"{k[0]}{'+' + k[1] if k[1] != 'none' else ''}: {skipped.get(k, 'no run')}" for k in missing
            )
            failed = any(skipped.get(k) == "its run failed" for k in missing)
            part.add(label, "n/a", f"≥ {_fmt(ctx.budget(key))}", "FAIL" if failed else "SKIP", why)
            continue
        part.at_least(label, tps[num] / tps[den], key)
    planned_step(
        part,
        compiled_rows,
        "C.compiled_step_ratio_min",
        "C.compiled_step_ratio_max",
        "bf16 + compile step / planner",
    )
    fp8_mlp(ctx, part)


def planned_step(part: Part, rows: list[dict], low: str, high: str, label: str) -> None:
    """The measured step time (steps after the first log window) against the planner's
    ``plan_step_time_s`` that the trainer logs beside it; a run without one, or none run, is a FAIL."""
    plan_t = rows[-1].get("plan_step_time_s") if rows else None
    if not plan_t:
        why = "no plan_step_time_s in metrics.jsonl" if rows else "its run did not finish"
        part.add(label, "none", "plan_step_time_s", "FAIL", why)
        return
    step_t = _mean([x["step_time_s"] for x in rows[1:]])
    part.within(
        label,
        step_t / plan_t if step_t else None,
        low,
        high,
        note=f"{_fmt(step_t)} s measured, {_fmt(plan_t)} s predicted",
    )


def fp8_mlp(ctx: Ctx, part: Part) -> None:
    """fp8 where it should pay: one SwiGLU MLP (``loom.model.llama.FeedForward``, plain nn.Linears) at
    llama3-8b's shape, h 4096, f 14336, M = 16,384 tokens, bf16, forward + backward, eager (the GEMMs
    dominate at this size), its Linears swapped by Loom's ``apply_low_precision`` (fp8 tensorwise,
    ``fp8_layers = all``) against the same bf16 module: median of CUDA-event times after warm-up. On
    the CPU (dry run) the same code on tiny shapes with float8 emulated: the ratio SKIP."""
    import copy
    import importlib.util

    import torch

    from loom.memory.precision import apply_low_precision
    from loom.model.llama import FeedForward

    key = "C.fp8_mlp_over_bf16_min"
    label = BUDGETS[key][2]
    why = ""
    if importlib.util.find_spec("torchao") is None:
        why = "torchao is not installed (bring it as a wheel: module docstring)"
    elif not ctx.dry and _capability() < (8, 9):
        why = f"fp8 needs compute capability ≥ 8.9, this device has {_capability()}"
    if why:
        part.add(label, "n/a", f"≥ {_fmt(ctx.budget(key))}", "SKIP", why)
        return
    h, f, M, warm, reps = (64, 192, 256, 1, 3) if ctx.dry else (4096, 14336, 16384, 3, 10)
    dev = torch.device(ctx.device)
    torch.manual_seed(0)
    bf16 = FeedForward(h, f, "swiglu").to(dev, torch.bfloat16)
    fp8 = copy.deepcopy(bf16)
    swapped = apply_low_precision(fp8, "fp8", "tensorwise", fp8_layers="all")
    x = torch.randn(M, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, h, device=dev, dtype=torch.bfloat16)
    ms = {name: _fwd_bwd_ms(mod, x, dy, warm, reps) for name, mod in (("bf16", bf16), ("fp8", fp8))}
    shape = f"h {h}, f {f}, M {M}, {swapped} Linears fp8 (tensorwise); median of {reps}: bf16 {ms['bf16']:.2f} ms, fp8 {ms['fp8']:.2f} ms"
    finite = all(math.isfinite(v) and v > 0 for v in ms.values())
    if ctx.dry:
        ok = finite and swapped == 3
        part.add(
            "SwiGLU MLP fwd+bwd, fp8 and bf16 (tiny)",
            "ran" if ok else "failed",
            "runs",
            "PASS" if ok else "FAIL",
            shape,
        )
        part.add(
            label,
            "n/a",
            f"≥ {_fmt(BUDGETS[key][0])}",
            "SKIP",
            "no fp8 tensor cores on the CPU (float8 emulated)",
        )
        return
    part.at_least(label, ms["bf16"] / ms["fp8"] if finite else None, key, note=shape)
    del bf16, fp8, x, dy
    torch.cuda.empty_cache()


def _fwd_bwd_ms(mod, x, dy, warm: int, reps: int) -> float:
    """Median milliseconds of ``mod``'s forward and backward on ``x`` (gradient ``dy``): CUDA events
    on a GPU, the wall clock on the CPU, after ``warm`` untimed calls."""
    import statistics

    import torch

    params = [x, *mod.parameters()]
    cuda = x.device.type == "cuda"
    times = []
    for i in range(warm + reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        torch.autograd.grad(mod(x), params, dy)
        if cuda:
            end.record()
            end.synchronize()
            dt = start.elapsed_time(end)
        else:
            dt = (time.perf_counter() - t0) * 1e3
        if i >= warm:
            times.append(dt)
    return statistics.median(times)


def _capability() -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(0) if torch.cuda.is_available() else (0, 0)


def part_d(ctx: Ctx, part: Part) -> None:
    steps = 4 if ctx.dry else 10
    losses: dict[str, list[float]] = {}
    for device in ("cpu", ctx.device):
        name = f"D-{device}" if f"D-{device}" not in losses else f"D-{device}-2"
        args = _train_args(
            ctx,
            "debug",
            ctx.out / "runs" / name,
            **{"run.device": device, "train.precision": "fp32", "train.steps": steps, "train.log_every": 1},
        )
        left = _remaining(part, ctx_timeout(ctx, "D")) - 3
        r = train(
            ctx, name, args, left, env={"NVIDIA_TF32_OVERRIDE": "0"}
        )  # TF32 off, whatever the code says
        if "error" in r or len(r["rows"]) < steps:
            part.add(
                f"debug fp32 on {device}", "failed", f"{steps} steps", "FAIL", r.get("error", "rows missing")
            )
            return
        losses[name] = [x["loss"] for x in r["rows"]]
    (a_name, a), (b_name, b) = losses.items()
    diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
    part.at_most(
        f"max |loss {a_name[2:]} - loss {b_name[2:]}| over {steps} steps",
        diff,
        "D.loss_atol",
        note=f"last {a[-1]:.6f} vs {b[-1]:.6f}" + (" (dry run: CPU twice)" if ctx.dry else ""),
    )


E_CONFIGS: dict[str, dict[str, Any]] = {
    "ZeRO-1": {"parallel.zero": 1},
    "ZeRO-3 offload_params=cpu": {"parallel.zero": 3, "parallel.offload_params": "cpu"},
    "activation offload": {"train.offload_activations": True},
    "MoE grouped (4 experts, top-2)": {"model.n_experts": 4, "model.top_k": 2, "moe.compute": "grouped"},
    "Adafactor": {"train.optimizer": "adafactor"},
}


def part_e(ctx: Ctx, part: Part) -> None:
    steps = 3 if ctx.dry else 5
    mode = "counter" if ctx.dry else "warn"
    budget = ctx.budget("E.syncs_per_step_max")
    for i, (label, fields) in enumerate(E_CONFIGS.items()):
        if ctx.dry and fields.get("train.offload_activations"):
            why = "train.offload_activations is refused with run.device = cpu (saved activations are host memory)"
            part.add(f"{label}: syncs/step", "n/a", f"≤ {_fmt(budget)}", "SKIP", why)
            continue
        left = _remaining(part, ctx_timeout(ctx, "E")) - 3
        share = left / (len(E_CONFIGS) - i)
        args = _train_args(
            ctx,
            "debug",
            ctx.out / "runs" / f"E{i}",
            **{
                "train.steps": steps,
                "train.log_every": steps,
                "train.precision": "bf16" if not ctx.dry else "fp32",
            },
            **fields,
        )
        r = train(ctx, f"E{i}", args, share, syncs=mode)
        per_step = r.get("syncs", [])
        if "error" in r or len(per_step) < steps:
            part.add(
                f"{label}: syncs/step", "failed", f"≤ {_fmt(budget)}", "FAIL", r.get("error", "steps missing")
            )
            continue
        counted = per_step[1:]  # step 1 builds the optimizer state
        sites = ", ".join(f"{n}× {s}" for s, n in r.get("sync_sites", [])[:3])
        how = "SyncCounter" if ctx.dry else 'set_sync_debug_mode("warn")'
        part.at_most(
            f"{label}: syncs/step",
            float(max(counted)),
            "E.syncs_per_step_max",
            note=f"{how}; {counted} {sites}",
        )


def part_f(ctx: Ctx, part: Part) -> None:
    import torch

    from loom.parallel.context import blocks

    if ctx.dry:
        B, a, k, T, d, dtype = 1, 4, 2, 256, 16, torch.float32
    else:
        B, a, k, T, d, dtype = 1, 32, 8, 8192, 128, torch.bfloat16
    dev = torch.device(ctx.device)
    e = torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator(device=dev).manual_seed(0)
    # (B, T, heads, d) memory seen as (B, heads, T, d), as the model's projections give them: the flash
    # backward copies out and dout whole when they are laid out (B, heads, T, d) instead
    q, kk, v = (
        torch.randn(B, T, h, d, device=dev, dtype=dtype, generator=g).transpose(1, 2) for h in (a, k, k)
    )
    kernel = blocks._kernel(q, None)
    forward = B * a * T * (d * e + 4)  # out and the fp32 lse
    backward = B * (a * T + 2 * k * T) * d * e  # dQ, dK, dV
    bwd_formula = "B·(a·T+2kT)·d·e"
    if kernel == "flash":  # FlashAttention-2's fp32 dQ accumulator; with k < a, dK and dV per query head
        backward += B * a * T * d * 4 + (2 * B * a * T * d * e if a != k else 0)
        bwd_formula += " + B·a·T·d·4" + (" + 2·B·a·T·d·e" if a != k else "")
    if kernel == "efficient" and a != k:
        forward, backward = forward + 2 * B * a * T * d * e, backward + 2 * B * a * T * d * e
        bwd_formula += " + 2·B·a·T·d·e"
    shape = f"B{B} a{a} k{k} T{T} d{d} {str(dtype)[6:]}, causal, kernel {kernel}"

    def once() -> None:
        out, lse = blocks.attend(q, kk, v, True)
        blocks.attend_backward(out, q, kk, v, out, lse, True)

    fwd_peak, bwd_peak = _block_peaks(q, kk, v, dev)
    part.at_most(
        "forward peak / formula",
        fwd_peak / forward,
        "F.mem_over_formula_max",
        note=f"{fwd_peak / 2**20:.1f} MiB vs B·a·T·(d·e+4) = {forward / 2**20:.1f} MiB; {shape}",
    )
    part.at_most(
        "backward peak / formula",
        bwd_peak / backward,
        "F.mem_over_formula_max",
        note=f"{bwd_peak / 2**20:.1f} MiB vs {bwd_formula} = {backward / 2**20:.1f} MiB; "
        f"dense scores would hold {B * a * T * T * 4 / 2**20:.0f} MiB",
    )
    once()  # warm-up
    reps = 2 if ctx.dry else 5
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        once()
    _sync(dev)
    dt = (time.perf_counter() - t0) / reps
    flops = 3.5 * 4 * B * a * T * T * d / 2  # causal: half of QKᵀ and PV forward, backward 2.5x
    from loom.train.mfu import mfu_peak

    peak, source = mfu_peak(dev, "bf16")
    part.at_least(
        "block fwd+bwd / peak FLOP/s",
        flops / dt / peak,
        "F.peak_fraction_min",
        note=f"{dt * 1e3:.2f} ms, {flops / dt / 1e12:.1f} TFLOP/s; peak {source}",
    )


def _block_peaks(q, k, v, dev) -> tuple[int, int]:
    """Peak bytes beyond the inputs of one block's forward, then of its backward: the CUDA allocator's
    peak, or on the CPU the live storages allocated inside (a dispatch mode)."""
    import torch

    from loom.parallel.context import blocks

    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out, lse = blocks.attend(q, k, v, True)
        torch.cuda.synchronize()
        fwd = torch.cuda.max_memory_allocated() - base
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        grads = blocks.attend_backward(out, q, k, v, out, lse, True)
        torch.cuda.synchronize()
        bwd = torch.cuda.max_memory_allocated() - base
        del grads
        return fwd, bwd
    with _LiveBytes() as f:
        out, lse = blocks.attend(q, k, v, True)
    with _LiveBytes() as b:
        blocks.attend_backward(out, q, k, v, out, lse, True)
    return f.peak, b.peak


def _LiveBytes():
    """Bytes of the storages allocated inside the block and still alive, their peak (the CPU has no
    allocator statistics; as tests/test_device_speed.py measures)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveBytes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live: dict[int, tuple[Any, int]] = {}
            self.peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.live = {p: v for p, v in self.live.items() if not v[0].expired()}
            if not any(r.alias_info is not None for r in func._schema.returns):
                for t in tree_leaves(out):
                    if hasattr(t, "untyped_storage"):
                        st = t.untyped_storage()
                        if st.data_ptr() not in self.live and st.nbytes():
                            self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
            self.peak = max(self.peak, sum(n for _, n in self.live.values()))
            return out

    return LiveBytes()


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


# (config, devices, layout, seq, overrides): the dry run verifies the debug model widened so its
# peak is not noise (untied: the planner over-predicts tied tables, docs/large-models.md); on the
# GPU, rank 0 of the planner's best llama3-70b layout on 1,024 H100s at seq 8192 (the GPU issue) and
# on 256 H100s (the planner issue's check: ~70 GiB, more than a CPU host here holds)
G_DRY = [("debug", 4, "dp2 tp2 pp1 cp1 ep1 zero1 1f1b:v1 mb1 recompute:none", 64,
          ["--model.dim", "512", "--model.n_heads", "8", "--model.vocab_size", "8192", "--model.tie_embeddings", "false"])]  # fmt: skip
G_GPU = [("llama3-70b", 1024, "best", 8192, []), ("llama3-70b", 256, "best", 256, [])]
# the first row's 2026-11-27 layout at width 1024: the CPU measures its saved activations at 1.099 of the
# planner's, the H100 at width 8192 1.20 (docs/gpu/2026-11-27-h100-run1.md): the same ratio here says
# the gap is the formula's, not the device's
G_GPU.append(("llama3-70b", 1024, "dp16 tp2 pp8 cp4:ring ep1 zero1/1 sp interleaved:v5 mb1 recompute:none "
              "split:9,11,10,10,10,10,11,9", 8192,
              ["--model.dim", "1024", "--model.n_heads", "16", "--model.n_kv_heads", "2", "--model.ffn_dim", "3584"]))  # fmt: skip


def part_g(ctx: Ctx, part: Part) -> None:
    on = "cpu" if ctx.dry else "cuda"
    for i, (cfg, devices, layout, seq, over) in enumerate(G_DRY if ctx.dry else G_GPU):
        cmd = [sys.executable, "-m", "loom", "plan", "verify", "--config", cfg, "--devices", str(devices)]
        cmd += [
            "--device",
            "h100-sxm",
            "--rank",
            "0",
            "--seq",
            str(seq),
            "--layout",
            layout,
            "--on",
            on,
            *over,
        ]
        what = f"{cfg} rank 0 of {devices} h100-sxm, {layout.split(' mb')[0]}, seq {seq}, tensors on {on}"
        try:
            left = _remaining(part, ctx_timeout(ctx, "G")) - 2
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            part.add("loom plan verify", "timed out", "runs", "FAIL", what)
            return
        (ctx.out / "logs").mkdir(parents=True, exist_ok=True)
        (ctx.out / "logs" / f"G{i}.log").write_text(p.stdout + p.stderr)
        _verify_rows(ctx, part, p, what, on)


def _verify_rows(ctx: Ctx, part: Part, p: subprocess.CompletedProcess, what: str, on: str) -> None:
    """The rows of one ``loom plan verify`` table: model states within G.state_tol, the peak within 10%."""
    rows = {}
    for line in p.stdout.splitlines():
        m = re.match(
            r"(parameters|gradients|optimizer|saved activations|peak)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", line
        )
        if m:
            rows[m.group(1)] = (float(m.group(2)), float(m.group(3)), float(m.group(4)))
    if not rows:
        tail = (p.stderr or p.stdout)[-200:]
        part.add("loom plan verify", f"rc {p.returncode}", "its table", "FAIL", f"{what}: {tail}")
        return
    layout_line = next((ln for ln in p.stdout.splitlines() if ln.startswith("verifying rank")), what)
    tol = ctx.budget("G.state_tol")
    for kind in ("parameters", "gradients", "optimizer"):
        pred, meas, ratio = rows[kind]
        ok = abs(ratio - 1) <= tol
        part.add(
            f"{kind} / planner",
            ratio,
            f"1 ± {tol:g}",
            "PASS" if ok else "FAIL",
            f"{meas:.1f} MiB vs {pred:.1f} MiB",
        )
    pred, meas, ratio = rows["peak"]
    source = (
        "the profiler's CPU allocation records"
        if on == "cpu"
        else "the CUDA allocator's max_memory_allocated"
    )
    part.add(
        f"{'host' if on == 'cpu' else 'CUDA allocator'} peak / planner",
        ratio,
        "1 ± 0.1 (verify's gate)",
        "PASS" if abs(ratio - 1) <= 0.1 else "FAIL",
        f"{meas:.1f} MiB vs {pred:.1f} MiB ({source}); {layout_line}",
    )


PART_FNS = {"A": part_a, "B": part_b, "C": part_c, "D": part_d, "E": part_e, "F": part_f, "G": part_g}


def ctx_timeout(ctx: Ctx, name: str) -> float:
    """The part's timeout: TIMEOUTS (DRY_TIMEOUTS), or the environment's GPU_ONE_TIMEOUT_<PART>."""
    default = (DRY_TIMEOUTS if ctx.dry else TIMEOUTS)[name]
    return float(os.environ.get(f"GPU_ONE_TIMEOUT_{name}", default))


# -------------------------------------------------------------------------------------- the _train child


def child_train(args: argparse.Namespace, argv: list[str]) -> int:
    """``loom train ARGV`` in this process (one rank runs in the launching process), recording the
    CUDA allocator's peaks over every log window and, with ``--syncs``, host syncs per train_step."""
    import torch

    import loom.train.trainer as trainer
    from loom.cli import main

    report: dict[str, Any] = {"max_allocated": 0, "max_reserved": 0, "syncs": [], "sync_sites": []}
    cuda = torch.cuda.is_available() and "cuda" in argv
    if cuda:
        report["device_name"] = torch.cuda.get_device_name(0)

    def peaks() -> None:
        if cuda:
            report["max_allocated"] = max(report["max_allocated"], torch.cuda.max_memory_allocated())
            report["max_reserved"] = max(report["max_reserved"], torch.cuda.max_memory_reserved())

    reset = trainer.reset_peak_memory

    def reset_peak_memory(device):  # the trainer resets the peak every log window: keep the maximum
        peaks()
        reset(device)

    trainer.reset_peak_memory = reset_peak_memory
    if args.compile_backend:
        import functools

        torch.compile = functools.partial(torch.compile, backend=args.compile_backend)
    sites: dict[str, int] = {}
    if args.syncs:
        plain = trainer.train_step
        trainer.train_step = _counting(plain, args.syncs, report, sites)
    if args.kernels:
        trainer.train_step = _profiled(trainer.train_step, args.kernels, report)
    try:
        rc = main(["train", *argv])
    finally:
        peaks()
        report["sync_sites"] = sorted(sites.items(), key=lambda kv: -kv[1])[:10]
        Path(args.report).write_text(json.dumps(report, indent=1))
    return rc


def _profiled(plain, call: int, report: dict, top: int = 15):
    """``train_step`` whose ``call``-th call runs under torch.profiler: the report's ``kernels`` are the
    ``top`` ops by self device time (name, calls, ms) and ``kernels_total_ms`` their whole sum."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    calls = [0]

    def profiled(*a, **kw):
        calls[0] += 1
        if calls[0] != call:
            return plain(*a, **kw)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            out = plain(*a, **kw)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        cuda = torch.cuda.is_available()
        rows = [  # operators (their kernels' time), not the kernels again nor Loom's ranges
            e
            for e in prof.key_averages()
            if (e.self_device_time_total if cuda else e.self_cpu_time_total)
            and e.device_type == DeviceType.CPU
            and not getattr(e, "is_user_annotation", False)
        ]
        rows.sort(key=lambda e: -(e.self_device_time_total if cuda else e.self_cpu_time_total))
        us = [(e.key, e.count, (e.self_device_time_total if cuda else e.self_cpu_time_total)) for e in rows]
        report["kernels_total_ms"] = sum(t for _, _, t in us) / 1e3
        report["kernels"] = [[k[:120], n, t / 1e3] for k, n, t in us[:top]]
        return out

    return profiled


def _counting(plain, mode: str, report: dict, sites: dict[str, int]):
    """``train_step`` counting the host syncs of each call: CUDA's sync debug mode (each synchronizing
    call warns) or :class:`loom.device_sync.SyncCounter` (calls that would sync, on any device)."""
    import warnings

    import torch

    def counted(run, batches, *a, **kw):
        if mode == "warn":
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    out = plain(run, batches, *a, **kw)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            hits = [w for w in caught if "synchroniz" in str(w.message)]
            for w in hits:
                site = f"{Path(w.filename).name}:{w.lineno}"
                sites[site] = sites.get(site, 0) + 1
            report["syncs"].append(len(hits))
            return out
        from loom.device_sync import SyncCounter, optimizer_host_tensors

        opts = [o for o in vars(run.strategy).values() if isinstance(o, torch.optim.Optimizer)]
        host = [t for o in opts for t in optimizer_host_tensors(o)]
        device = batches[0][0].device if batches else None
        with SyncCounter(device=device, host=host) as c:
            out = plain(run, batches, *a, **kw)
        for what, where in c.calls:
            site = f"{what}@{Path(where.rsplit(':', 1)[0]).name}:{where.rsplit(':', 1)[-1]}"
            sites[site] = sites.get(site, 0) + 1
        report["syncs"].append(c.count)
        return out

    return counted


# ------------------------------------------------------------------------------------------- summary


def summary(ctx: Ctx, parts: str, exits: dict[str, str]) -> int:
    rows: list[dict] = []
    elapsed: dict[str, float] = {}
    for name in parts:
        path = ctx.out / "parts" / f"{name}.json"
        body = json.loads(path.read_text()) if path.is_file() else {"rows": [], "elapsed_s": 0.0}
        rows += body["rows"]
        elapsed[name] = body["elapsed_s"]
        rc = exits.get(name, "0")
        if rc != "0":
            why = (
                "timed out (its timeout in gpu_one.sh)"
                if rc in ("124", "137")
                else f"exited with status {rc}"
            )
            rows.append(
                {
                    "part": name,
                    "check": "part finished",
                    "measured": f"rc {rc}",
                    "expected": "rc 0",
                    "status": "FAIL",
                    "note": f"{why}; log: {ctx.out / 'logs' / (name + '.log')}",
                }
            )
        elif not body["rows"]:
            rows.append(
                {
                    "part": name,
                    "check": "part finished",
                    "measured": "no rows",
                    "expected": "rows",
                    "status": "FAIL",
                    "note": "the part wrote nothing",
                }
            )
    status = {p: _part_status([r for r in rows if r["part"] == p]) for p in parts}
    failed = [p for p, s in status.items() if s == "FAIL"]
    import platform

    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not ctx.dry else "cpu"
    head = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": device,
        "host": platform.node(),
        "torch": torch.__version__,
        "dry_run": ctx.dry,
        "budgets": {k: ctx.budget(k) for k in BUDGETS},
    }
    body = {**head, "parts": status, "elapsed_s": elapsed, "rows": rows, "passed": not failed}
    (ctx.out / "summary.json").write_text(json.dumps(body, indent=1))
    lines = [
        f"# One-GPU check: {device}{' (dry run)' if ctx.dry else ''}",
        "",
        f"{head['date']}, torch {torch.__version__}, host {head['host']}; "
        + ", ".join(f"{p} {status[p]} ({elapsed[p]:.0f} s)" for p in parts),
        "",
        "| part | check | measured | expected / budget | result |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        note = f" — {r['note']}" if r["note"] else ""
        check = f"{r['check']}{note}".replace("|", "\\|")
        lines.append(
            f"| {r['part']} {TITLES[r['part']]} | {check} | {str(r['measured']).replace('|', '/')} "
            f"| {r['expected']} | {r['status']} |"
        )
    lines += [
        "",
        "FAILED parts: " + ", ".join(failed) if failed else "Every check passed or was skipped (see why).",
    ]
    (ctx.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0


def _part_status(rows: list[dict]) -> str:
    if any(r["status"] == "FAIL" for r in rows):
        return "FAIL"
    return "PASS" if any(r["status"] == "PASS" for r in rows) else "SKIP"


# ----------------------------------------------------------------------------------------------- main


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    if argv[:1] == ["_train"]:
        rest, train_argv = (
            (argv[1:], []) if "--" not in argv else (argv[1 : argv.index("--")], argv[argv.index("--") + 1 :])
        )
        p = argparse.ArgumentParser(prog="gpu_one.py _train")
        p.add_argument("--report", required=True)
        p.add_argument("--syncs", choices=["warn", "counter"], default="")
        p.add_argument("--compile-backend", default="")
        p.add_argument("--kernels", type=int, default=0, help="profile this train_step call: top kernels")
        return child_train(p.parse_args(rest), train_argv)
    p = argparse.ArgumentParser(prog="gpu_one.py", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["prepare", "part", "summary", "timeout"])
    p.add_argument("name", nargs="?", default="")
    p.add_argument("--out", required=True)
    p.add_argument("--data", default="")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--budget", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--parts", default=PARTS)
    p.add_argument("--exits", default="", help="summary: 'A=0,B=124,...' (the parts' exit statuses)")
    args = p.parse_args(argv)
    ctx = Ctx(args)
    ctx.out.mkdir(parents=True, exist_ok=True)
    if args.command == "timeout":  # the wrapper asks each part's timeout here
        print(int(ctx_timeout(ctx, args.name)))
        return 0
    if args.command == "prepare":
        preset = "debug" if ctx.dry else "gpt-125m"
        cmd = [sys.executable, "-m", "loom", "prepare", preset, "--data.prepared_dir", str(ctx.data)]
        cmd += ["--run.progress", "false"] + (["--data.max_corpus_mb", "0.5"] if ctx.dry else [])
        return subprocess.run(cmd).returncode
    if args.command == "summary":
        exits = dict(kv.split("=", 1) for kv in args.exits.split(",") if "=" in kv)
        return summary(ctx, "".join(x for x in args.parts if x in PARTS), exits)
    if args.name not in PART_FNS:
        raise SystemExit(f"gpu_one: part must be one of {PARTS}, got {args.name!r}")
    part = Part(ctx, args.name)
    PART_FNS[args.name](ctx, part)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    gc.freeze()  # a part's exit collects nothing across its heap (loom.cli.run)
    sys.exit(code)
