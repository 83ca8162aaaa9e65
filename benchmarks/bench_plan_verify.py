"""``loom plan verify`` over the layout matrix: the planner's memory against one rank built and stepped.

    python benchmarks/bench_plan_verify.py [--seq 32] [--quick] [--rows N] [--on cpu|cuda]
    python benchmarks/bench_plan_verify.py --refused --on cuda [--out DIR] [--budget-s S]
    python benchmarks/bench_plan_verify.py --repredict

Rows: llama3-8b and llama3-70b x ZeRO 0-3 x pp 1/2/4 x tp 1/8 x cp 1/2 (dp 2, so ZeRO shards over
dp·cp >= 2), and a mixture of experts (llama-1b shapes, 8 experts, top-2) x ep 1/2/4 under ZeRO 1
and 3 (dp 4). Each row is rank 0 (pipeline stage 0: the embedding) of the job under PyTorch's
fake process group (:mod:`loom.train.verify`), in a fresh process, with the preset's shapes
(width, heads, vocabulary) and one block per pipeline stage (``model.n_layers = pp``: a stage's
memory is affine in its blocks, and this host has 2 cores), ``--seq`` tokens, at least 2
micro-batches (the schedule's peak with a pipeline), so ZeRO-2/3 keep their full-size gradients
between micro-batches. The planner's prediction is for the same rank, stage, sequence and
micro-batches (:meth:`loom.plan.cost.CostModel.stage_memory`).

Columns: parameters + optimizer state (one ratio, measured / predicted: the larger deviation of
the two), gradients (the shard held between steps), peak (tensor bytes over build and step against
the predicted sum without the overhead line: device runtime, fragmentation). A row passes when all three are within 10%. A row
whose predicted peak exceeds this host's available memory is refused by verify's host precheck
before anything is built (the line says what it needs): shown, not measured.

The rows go to ``docs/results/plan_verify.md`` and, beside it, ``plan_verify.json`` (every row's
prediction, measurement and where it ran). ``--refused`` runs only the rows that JSON has not
measured (on this 24 GiB host: the 22 llama3-70b tp1 rows, which need up to 45 GiB), e.g. ``--on
cuda`` on an 80 GB GPU, and merges each measured row into the page and the JSON as it lands
(``--out DIR``: a copy of both there too); rows refused again leave both as they were. Each row
says where it ran (``on``: the CPU or the CUDA device's name, and the precision ``train.precision
= auto`` resolves to there: fp32 on the CPU, bf16 on CUDA). ``--repredict`` puts the current
planner's prediction beside every measurement already on the page (nothing runs): a planner change is
judged on all rows, those measured on a GPU included.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TOLERANCE = 0.10


def matrix() -> list[dict]:
    """The rows: dicts of config, overrides, layout line, world."""
    rows = []
    for model in ("llama3-8b", "llama3-70b"):
        for tp in (1, 8):
            for pp in (1, 2, 4):
                for cp in (1, 2):
                    for zero in (0, 1, 2, 3):
                        dp = 2
                        lay = f"dp{dp} tp{tp} pp{pp} cp{cp} ep1 zero{zero} 1f1b:v1 mb1 recompute:none"
                        rows.append(
                            dict(
                                config=model,
                                overrides=[f"model.n_layers={pp}"],
                                layout=lay,
                                world=dp * tp * pp * cp,
                            )
                        )
    for zero in (1, 3):
        for ep in (1, 2, 4):
            lay = f"dp4 tp1 pp1 cp1 ep{ep} zero{zero} 1f1b:v1 mb1 recompute:none"
            over = ["model.n_layers=1", "model.n_experts=8", "model.top_k=2"]
            rows.append(dict(config="llama-1b", overrides=over, layout=lay, world=4, moe=True))
    return rows


QUICK = (  # the fast subset the tests run (tests/test_plan_verify.py)
    dict(
        config="llama3-8b",
        overrides=["model.n_layers=2"],
        layout="dp2 tp8 pp2 cp1 ep1 zero2 1f1b:v1 mb1 recompute:none",
        world=32,
    ),
    dict(
        config="llama3-70b",
        overrides=["model.n_layers=2"],
        layout="dp2 tp8 pp2 cp2 ep1 zero3 1f1b:v1 mb1 recompute:none",
        world=64,
    ),
)


def run_row(row: dict, seq: int, on: str = "cpu") -> dict:
    """One row in this process: predict, precheck, build and step rank 0 with its tensors ``on`` the
    CPU or the CUDA device (``train.precision`` auto: fp32 on the CPU, bf16 on CUDA); ratios, verdict
    and where it ran."""
    from loom.plan.cost import Layout
    from loom.train import verify as V

    m = max(2, V.default_microbatches(Layout.parse(row["layout"])))
    cfg, predicted = job(row, seq, m, on)
    out = dict(row, microbatches=m, predicted=predicted, on=device_label(on, cfg.train.precision))
    out["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    refused = V.host_problem(predicted, *V.available_bytes(on))
    if refused is not None:
        return out | {"refused": refused}
    measured = V.measure(cfg, 0, row["world"], on)
    out["measured"] = {k: v for k, v in measured.items() if k in predicted}
    out["step_s"] = measured["build_s"] + measured["step_s"]
    return out | verdict(out["measured"], predicted)


def job(row: dict, seq: int, m: int, on: str, precision: str | None = None) -> tuple:
    """The row's job config for rank 0 on ``on`` (``precision``: what ``train.precision = auto``
    resolves to there, unless given), validated, and the planner's prediction for that rank."""
    from loom import config as C
    from loom.mesh import ParallelDims
    from loom.plan.cost import Layout
    from loom.plan.hardware import ClusterSpec
    from loom.train import verify as V

    cfg = C.load(row["config"], [])
    for o in row["overrides"]:
        k, value = o.split("=")
        section, field = k.split(".")
        setattr(getattr(cfg, section), field, int(value))
    lay = Layout.parse(row["layout"])
    cfg = V.job_config(cfg, lay, seq, m)
    cfg.run.device = on
    if precision:
        cfg.train.precision = precision
    C.validate(cfg, row["world"])
    per = min(8, row["world"])
    cluster = ClusterSpec.single_node("h100-sxm", per, row["world"] // per)
    stage = ParallelDims.from_config(cfg.parallel).coords(0)["pp"]
    return cfg, V.predict(cfg, cluster, lay, stage, m)


def device_label(on: str, precision: str) -> str:
    """Where a row ran, for the page: ``cpu, fp32`` or ``NVIDIA H100 80GB HBM3, bf16``."""
    if on == "cuda":
        import torch

        return f"{torch.cuda.get_device_name()}, {precision}"
    return f"cpu, {precision}"


def verdict(measured: dict, predicted: dict) -> dict:
    """Ratios measured / predicted: state (the worse of parameters and optimizer), gradients, peak."""

    def ratio(k: str) -> float:
        p, x = predicted[k], measured[k]
        return x / p if p else (1.0 if x == 0 else float("inf"))

    state = max((ratio("parameters"), ratio("optimizer")), key=lambda r: abs(r - 1))
    r = {"state": state, "gradients": ratio("gradients"), "peak": ratio("peak")}
    return {"ratios": r, "ok": all(abs(v - 1) <= TOLERANCE for v in r.values())}


def run_isolated(row: dict, seq: int, on: str = "cpu", timeout: float = 900) -> dict:
    """:func:`run_row` in a fresh process (its resident set, or its device memory, is the row's alone)."""
    cmd = [sys.executable, __file__, "--one", json.dumps(row), "--seq", str(seq), "--on", on]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return dict(row, error=f"no result within {timeout:.0f} s")
    if p.returncode != 0:
        return dict(row, error=(p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1])
    return json.loads(p.stdout.strip().splitlines()[-1])


def key(row: dict) -> str:
    """A row's identity across runs: preset, overrides and layout line."""
    return " ".join([row["config"], *row["overrides"], "|", row["layout"]])


def measured(r: dict) -> bool:
    return "ratios" in r


IDENTITY = ("config", "overrides", "layout", "world", "moe")


def identity(r: dict) -> dict:
    """What a row is (its :func:`key` and world), without what an earlier run said of it."""
    return {k: r[k] for k in IDENTITY if k in r}


def repredict(r: dict, seq: int) -> dict:
    """A measured row with the current planner's prediction beside its measurement (nothing runs):
    the measured peak is the row's ``measured`` entry, else ratio x the prediction it was compared
    with (rows converted from the page kept only that); state and gradient ratios are recomputed
    where the row holds those measurements, else kept (the planner's state terms are exact: 1.000)."""
    got = dict(r.get("measured") or {"peak": r["ratios"]["peak"] * r["predicted"]["peak"]})
    _, predicted = job(r, seq, r["microbatches"], "cpu", precision=r["on"].rsplit(", ", 1)[-1])
    kept = {k: v for k, v in r.items() if k not in ("refused", "error")}  # a row measured is neither
    out = dict(kept, predicted=predicted, measured=got)
    if "parameters" in got:
        return out | verdict(got, predicted)
    ratios = dict(r["ratios"], peak=got["peak"] / predicted["peak"])
    return out | {"ratios": ratios, "ok": all(abs(v - 1) <= TOLERANCE for v in ratios.values())}


def merge(old: list[dict], new: list[dict]) -> tuple[list[dict], int]:
    """``old`` with each row that ``new`` measured replaced (same :func:`key`), in ``old``'s order;
    a row refused or failed again keeps its old entry. Returns the rows and how many were replaced."""
    fresh = {key(r): r for r in new if measured(r)}
    return [fresh.get(key(r), r) for r in old], sum(key(r) in fresh for r in old)


# ----------------------------------------------------------------------------- the page and its JSON

SHORT = " 1f1b:v1 mb1 recompute:none"  # every layout of the matrix ends so; the page leaves it out
MiB = 2**20


def label(r: dict) -> str:
    return r["config"] + (" MoE 8x top-2" if r.get("moe") else "")


def markdown(results: list[dict], seq: int) -> str:
    """The table (each row says where it was measured), the count of rows within 10%, then where the
    rows were measured and when."""
    lines = [
        "Each row: rank 0 of the layout built and stepped under the fake process group in its own "
        f"process, one block per pipeline stage, seq {seq}; ratios are measured / predicted "
        "(state: the worse of parameters and optimizer state; gradients: the shard held between steps; "
        "peak: tensor bytes over build and step, from the profiler's allocation records on the CPU, the "
        "CUDA allocator's max_memory_allocated on a GPU). A row passes when all three are within 10%. "
        "`on`: where the row ran (or was refused) and its precision (train.precision auto: fp32 on the "
        "CPU, bf16 on CUDA).",
        "",
        "| model | layout | m | predicted peak MiB | state | gradients | peak | result | on |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    n_measured = passed = 0
    for r in results:
        lay = r["layout"].replace(SHORT, "")
        pred = r.get("predicted", {}).get("peak", 0.0) / MiB
        on = r.get("on", "")
        if measured(r):
            n_measured += 1
            passed += r["ok"]
            q = r["ratios"]
            lines.append(
                f"| {label(r)} | {lay} | {r['microbatches']} | {pred:,.0f} | {q['state']:.3f} | "
                f"{q['gradients']:.3f} | {q['peak']:.3f} | {'ok' if r['ok'] else 'FAIL'} | {on} |"
            )
        else:
            why = r.get("refused") or r.get("error", "")
            lines.append(
                f"| {label(r)} | {lay} | {r.get('microbatches', '')} | {pred:,.0f} | | | | {why} | {on} |"
            )
    lines += [
        "",
        f"{passed} of {n_measured} measured rows within 10%; {len(results) - n_measured} not run here.",
    ]
    sources: dict[tuple[str, str], list[str]] = {}
    for r in results:
        if measured(r):
            sources.setdefault((r.get("on", ""), r.get("machine", "")), []).append(r.get("when", ""))
    if sources:
        lines += ["", "Measured on:", ""]
        for (on, machine), whens in sources.items():
            span = " to ".join(sorted({min(whens), max(whens)}))
            lines.append(f"- {on} ({machine}): {len(whens)} rows, {span}")
    return "\n".join(lines)


def from_page(text: str) -> list[dict]:
    """The rows of a page this script wrote (its table, in the matrix's order), as :func:`markdown`
    reads them: the converter for a page written before its JSON was kept. Ratios keep the page's 3
    decimals; the predicted peak its whole MiB; rows without an ``on`` column ran on the CPU in fp32,
    measured on the machine and at the date the header names."""
    by_row = {(label(r), r["layout"].replace(SHORT, "")): r for r in matrix()}
    lines = text.splitlines()
    machine = next((ln[len("- Machine: ") :] for ln in lines if ln.startswith("- Machine: ")), "")
    machine = machine.split("; device:")[0]
    when = next((ln.split(" on ", 1)[1].split(";")[0] for ln in lines if ln.startswith("Written by")), "")
    out = []
    for line in lines:
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) < 8 or (cells[0], cells[1]) not in by_row:
            continue
        r = dict(by_row[(cells[0], cells[1])], microbatches=int(cells[2]))
        r["predicted"] = {"peak": float(cells[3].replace(",", "")) * MiB}
        r["on"] = cells[8] if len(cells) > 8 else "cpu, fp32"
        if cells[4]:
            state, grads, peak = (float(c) for c in cells[4:7])
            r |= {"ratios": {"state": state, "gradients": grads, "peak": peak}, "ok": cells[7] == "ok"}
            r |= {"machine": machine, "when": when}
        else:
            r["refused"] = cells[7]
        out.append(r)
    return out


def write_page(results: list[dict], seq: int, dirs: list[Path]) -> list[Path]:
    """``plan_verify.md`` (headed as :func:`benchmarks.common.write_results` heads a page) and
    ``plan_verify.json`` (the rows; what ``--refused`` reads) in each of ``dirs``, each written to a
    temporary file and renamed over the old one."""
    from benchmarks.common import command, machine

    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    page = (
        "# plan verify over the layout matrix\n\n"
        f"Written by `benchmarks/{Path(__file__).name}` on {when}; running it again rewrites this page "
        "(`--refused` runs only the rows not measured yet and merges them in).\n\n"
        f"- Machine: {machine()}\n- Command: `{command()}`\n\n{markdown(results, seq).strip()}\n"
    )
    data = (
        f'{{"seq": {seq}, "rows": [\n' + ",\n".join(json.dumps(r) for r in results) + "\n]}\n"
    )  # a row a line
    written = []
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        for name, text in ((f"{NAME}.md", page), (f"{NAME}.json", data)):
            tmp = d / f".{name}.tmp"
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, d / name)
            written.append(d / name)
    return written


def load(results_dir: Path) -> tuple[list[dict], int]:
    """The rows and seq of ``plan_verify.json`` in ``results_dir``."""
    path = results_dir / f"{NAME}.json"
    if not path.exists():
        raise SystemExit(f"bench_plan_verify: no {path} to read (run the whole matrix first, or --from-page)")
    data = json.loads(path.read_text(encoding="utf-8"))
    return data["rows"], data["seq"]


NAME = "plan_verify"
RESULTS = ROOT / "docs" / "results"
# a row's wall time in its own process (start-up, build, one step): the CPU figure is this 2-core
# host's mean over the matrix (38 min for 102 rows); the CUDA one
# is part G of docs/gpu/2026-11-27-h100-run2.md (3 verifies of 70B shapes in 50 s, up to 56 GiB each)
ROW_S = {"cpu": 22.0, "cuda": 17.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence of the step (default 32)")
    p.add_argument("--quick", action="store_true", help="only the tests' fast subset; no page written")
    p.add_argument("--rows", type=int, default=0, help="only the first N rows (0: all)")
    p.add_argument(
        "--on", choices=("cpu", "cuda"), default="cpu", help="where each row's tensors live (verify's --on)"
    )
    p.add_argument(
        "--refused",
        action="store_true",
        help="run only the rows the page has not measured (refused by the host precheck, or failed) and "
        "merge those measured now into the page; nothing is written if none was",
    )
    p.add_argument(
        "--results", type=Path, default=RESULTS, help="where the page and its JSON are read and written"
    )
    p.add_argument("--out", type=Path, help="also write the page and its JSON here (a GPU lease's $OUT)")
    p.add_argument(
        "--budget-s", type=float, default=0, help="start no row after this many seconds (0: no limit)"
    )
    p.add_argument(
        "--from-page", action="store_true", help="write plan_verify.json from the page (a converter)"
    )
    p.add_argument(
        "--repredict",
        action="store_true",
        help="recompute every measured row's prediction with the current planner, its measurement kept "
        "(nothing runs; the rows' devices may be gone), and rewrite the page and its JSON",
    )
    p.add_argument("--one", help=argparse.SUPPRESS)  # a row, as JSON: run it here, print the result
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_row(json.loads(args.one), args.seq, args.on)))
        return 0
    if args.from_page:  # the page again (in this script's current form) and its JSON; nothing runs
        text = (args.results / f"{NAME}.md").read_text(encoding="utf-8")
        seq = int(re.search(r"seq (\d+);", text).group(1))  # type: ignore[union-attr]
        for path in write_page(from_page(text), seq, [args.results]):
            print(f"wrote {path}")
        return 0
    if args.repredict:
        rows, seq = load(args.results)
        again = [repredict(r, seq) if measured(r) else r for r in rows]
        print(markdown(again, seq))
        for path in write_page(again, seq, [args.results] + ([args.out] if args.out else [])):
            print(f"wrote {path}")
        return 0
    if args.on == "cuda":
        from loom.device import cuda_available

        if not cuda_available():
            print("bench_plan_verify: --on cuda: no CUDA device here (torch.cuda.is_available() is False)")
            return 2
    old: list[dict] = []
    if args.refused:
        old, args.seq = load(args.results)
        rows = [identity(r) for r in old if not measured(r)]
    else:
        rows = list(QUICK) if args.quick else matrix()
    rows = rows[: args.rows] if args.rows else rows
    est = len(rows) * ROW_S[args.on]
    print(
        f"{len(rows)} rows on {args.on}, seq {args.seq}: about {est / 60:.1f} min "
        f"({ROW_S[args.on]:.0f} s a row)" + (f", budget {args.budget_s:.0f} s" if args.budget_s else ""),
        flush=True,
    )
    results: list[dict] = []
    t0 = time.perf_counter()
    for i, row in enumerate(rows):
        if args.budget_s and time.perf_counter() - t0 > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: {len(rows) - i} rows not started", flush=True)
            break
        r = run_isolated(row, args.seq, args.on, timeout=300 if args.on == "cuda" else 900)
        if measured(r):
            from benchmarks.common import machine

            r["machine"] = machine().split("; device:")[0]
        results.append(r)
        state = "refused" if "refused" in r else ("error" if "error" in r else ("ok" if r["ok"] else "FAIL"))
        print(
            f"[{i + 1}/{len(rows)} {time.perf_counter() - t0:.0f} s] {row['config']} {row['layout']}: "
            f"{state} {r.get('ratios', r.get('refused', r.get('error', '')))}",
            flush=True,
        )
        if args.refused and measured(r):  # each measured row lands at once: a lease cut short keeps it
            write_page(merge(old, results)[0], args.seq, [args.results] + ([args.out] if args.out else []))
    if args.refused:
        merged, n = merge(old, results)
        if n:
            print(markdown(merged, args.seq))
            print(f"merged {n} newly measured rows into {args.results / NAME}.md and .json")
        else:
            print(f"nothing new was measured: {args.results / NAME}.md and .json kept as they were")
    else:
        print(markdown(results, args.seq))
        if not args.quick and not args.rows:
            for path in write_page(results, args.seq, [args.results] + ([args.out] if args.out else [])):
                print(f"wrote {path}")
    bad = [r for r in results if measured(r) and not r["ok"]]
    return 1 if bad or any("error" in r for r in results) else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    sys.exit(main())
