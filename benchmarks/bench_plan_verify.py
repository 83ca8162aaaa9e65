"""``loom plan verify`` over the layout matrix: the planner's memory against one rank built and stepped.

    python benchmarks/bench_plan_verify.py [--seq 32] [--quick] [--rows N]

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
"""

from __future__ import annotations

import argparse
import json
import os
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


def run_row(row: dict, seq: int) -> dict:
    """One row in this process: predict, precheck, build and step rank 0; ratios and verdict."""
    from loom import config as C
    from loom.mesh import ParallelDims
    from loom.plan.cost import Layout
    from loom.plan.hardware import ClusterSpec
    from loom.train import verify as V

    cfg = C.load(row["config"], [])
    for o in row["overrides"]:
        key, value = o.split("=")
        section, field = key.split(".")
        setattr(getattr(cfg, section), field, int(value))
    lay = Layout.parse(row["layout"])
    m = max(2, V.default_microbatches(lay))
    cfg = V.job_config(cfg, lay, seq, m)
    cfg.run.device = "cpu"
    C.validate(cfg, row["world"])
    per = min(8, row["world"])
    cluster = ClusterSpec.single_node("h100-sxm", per, row["world"] // per)
    stage = ParallelDims.from_config(cfg.parallel).coords(0)["pp"]
    predicted = V.predict(cfg, cluster, lay, stage, m)
    refused = V.host_problem(predicted, *V.available_bytes("cpu"))
    out = dict(row, microbatches=m, predicted=predicted)
    if refused is not None:
        return out | {"refused": refused}
    measured = V.measure(cfg, 0, row["world"])
    out["measured"] = {k: v for k, v in measured.items() if k in predicted}
    out["step_s"] = measured["build_s"] + measured["step_s"]
    return out | verdict(out["measured"], predicted)


def verdict(measured: dict, predicted: dict) -> dict:
    """Ratios measured / predicted: state (the worse of parameters and optimizer), gradients, peak."""

    def ratio(k: str) -> float:
        p, x = predicted[k], measured[k]
        return x / p if p else (1.0 if x == 0 else float("inf"))

    state = max((ratio("parameters"), ratio("optimizer")), key=lambda r: abs(r - 1))
    r = {"state": state, "gradients": ratio("gradients"), "peak": ratio("peak")}
    return {"ratios": r, "ok": all(abs(v - 1) <= TOLERANCE for v in r.values())}


def run_isolated(row: dict, seq: int, timeout: float = 900) -> dict:
    """:func:`run_row` in a fresh process (its resident set is the row's alone)."""
    cmd = [sys.executable, __file__, "--one", json.dumps(row), "--seq", str(seq)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if p.returncode != 0:
        return dict(row, error=(p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1])
    return json.loads(p.stdout.strip().splitlines()[-1])


def markdown(results: list[dict], seq: int) -> str:
    """The table, then the count of rows within 10%."""
    MiB = 2**20
    lines = [
        "Each row: rank 0 of the layout built and stepped under the fake process group in its own "
        f"process, one block per pipeline stage, seq {seq}; ratios are measured / predicted "
        "(state: the worse of parameters and optimizer state; gradients: the shard held between steps; "
        "peak: tensor bytes over build and step, from the profiler's allocation records). A row passes when all three are within 10%.",
        "",
        "| model | layout | m | predicted peak MiB | state | gradients | peak | result |",
        "|---|---|---|---|---|---|---|---|",
    ]
    measured = passed = 0
    for r in results:
        model = r["config"] + (" MoE 8x top-2" if r.get("moe") else "")
        lay = r["layout"].replace(" 1f1b:v1 mb1 recompute:none", "")
        pred = r.get("predicted", {}).get("peak", 0.0) / MiB
        if "ratios" in r:
            measured += 1
            passed += r["ok"]
            q = r["ratios"]
            lines.append(
                f"| {model} | {lay} | {r['microbatches']} | {pred:,.0f} | {q['state']:.3f} | "
                f"{q['gradients']:.3f} | {q['peak']:.3f} | {'ok' if r['ok'] else 'FAIL'} |"
            )
        else:
            why = r.get("refused") or r.get("error", "")
            lines.append(f"| {model} | {lay} | {r.get('microbatches', '')} | {pred:,.0f} | | | | {why} |")
    lines += ["", f"{passed} of {measured} measured rows within 10%; {len(results) - measured} not run here."]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence of the step (default 32)")
    p.add_argument("--quick", action="store_true", help="only the tests' fast subset; no page written")
    p.add_argument("--rows", type=int, default=0, help="only the first N rows (0: all)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a row, as JSON: run it here, print the result
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_row(json.loads(args.one), args.seq)))
        return 0
    rows = list(QUICK) if args.quick else matrix()
    rows = rows[: args.rows] if args.rows else rows
    results, t0 = [], time.perf_counter()
    for i, row in enumerate(rows):
        r = run_isolated(row, args.seq)
        results.append(r)
        state = "refused" if "refused" in r else ("error" if "error" in r else ("ok" if r["ok"] else "FAIL"))
        print(
            f"[{i + 1}/{len(rows)} {time.perf_counter() - t0:.0f} s] {row['config']} {row['layout']}: "
            f"{state} {r.get('ratios', r.get('refused', r.get('error', '')))}",
            flush=True,
        )
    body = markdown(results, args.seq)
    print(body)
    if not args.quick and not args.rows:
        from benchmarks.common import write_results

        print(f"wrote {write_results('plan_verify', 'plan verify over the layout matrix', body)}")
    bad = [r for r in results if "ratios" in r and not r["ok"]]
    return 1 if bad or any("error" in r for r in results) else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    sys.exit(main())
