#!/usr/bin/env bash
# The one-GPU check (issue 32): on one GPU, in about 6 minutes of commands (9 at most), one table that says
# whether Loom is right and fast there. Each part A..G runs under its own `timeout`; the table goes
# to DIR/summary.md and DIR/summary.json; exit status 1 if any check FAILs (see benchmarks/gpu_one.py
# for what each part measures and its budget).
#
#     bash benchmarks/gpu_one.sh --out DIR [--data DIR] [--only A,B,...] [--dry-run] [--budget KEY=VALUE]...
#
#   --out DIR       where results go (required): summary.md, summary.json, parts/, logs/, runs/
#   --data DIR      data prepared beforehand (on a CPU machine: python -m loom prepare gpt-125m
#                   --data.prepared_dir DIR); without it the default corpus (Python's stdlib, offline)
#                   is prepared into DIR/data first (not counted in those minutes)
#   --only PARTS    a subset, e.g. --only B or --only A,C
#   --dry-run       every part on the CPU with tiny sizes (what tests/test_gpu_one.py runs)
#   --budget K=V    override one budget (keys in BUDGETS in gpu_one.py), e.g. --budget B.mfu_min=0.3
#   --jobs N        with --dry-run only: N parts at a time (their runs are mostly Python start-up, one
#                   core each); on a GPU parts run one at a time, so none disturbs another's timings
#
# No network on the GPU machine: nothing is downloaded. Missing pure-Python packages as wheels: on a
# networked machine with the same Python, `pip download -d wheels -r requirements.txt`; copy wheels/
# over; there `pip install --no-index --find-links wheels -r requirements.txt` (torch is the machine's).
# Environment: PYTHON (default python); GPU_ONE_TIMEOUT_<PART>=seconds replaces a part's timeout.
set -euo pipefail
cd "$(dirname "$0")/.."

out="" data="" only="ABCDEFG" dry=() jobs=1
budgets=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="${2:?--out needs a directory}"; shift 2 ;;
        --data) data="${2:?--data needs a directory}"; shift 2 ;;
        --only) only="${2:?--only needs parts, e.g. A,B}"; shift 2 ;;
        --dry-run) dry=(--dry-run); shift ;;
        --budget) budgets+=(--budget "${2:?--budget needs KEY=VALUE}"); shift 2 ;;
        --jobs) jobs="${2:?--jobs needs a number}"; shift 2 ;;
        -h|--help) sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;;
        *) echo "gpu_one.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [ -z "$out" ]; then
    echo "gpu_one.sh: --out DIR is required" >&2
    exit 2
fi
if [[ ! "$jobs" =~ ^[1-9][0-9]*$ ]]; then
    echo "gpu_one.sh: --jobs takes a positive integer, got $jobs" >&2
    exit 2
fi
if [ "$jobs" -gt 1 ] && [ ${#dry[@]} -eq 0 ]; then
    echo "gpu_one.sh: --jobs $jobs needs --dry-run (on a GPU, parts run one at a time)" >&2
    exit 2
fi
only="${only//,/}"
only="${only^^}"
if [[ ! "$only" =~ ^[A-G]+$ ]]; then
    echo "gpu_one.sh: --only takes parts among A..G, got $only" >&2
    exit 2
fi
if [ -d "$out/runs" ]; then  # its trainers would resume the finished runs there and measure no step
    echo "gpu_one.sh: --out $out holds a previous run (runs/): give a new directory or remove that one" >&2
    exit 2
fi
mkdir -p "$out/logs"
py=("${PYTHON:-python}" benchmarks/gpu_one.py)
common=(--out "$out" "${dry[@]}" "${budgets[@]}")

if [ -z "$data" ]; then
    data="$out/data"
    if [ ! -f "$data/meta.json" ]; then
        echo "== preparing the default corpus into $data"
        timeout -k 10 300 "${py[@]}" prepare "${common[@]}" --data "$data" >"$out/logs/prepare.log" 2>&1 || {
            echo "gpu_one.sh: preparing data failed; see $out/logs/prepare.log" >&2
            exit 1
        }
    fi
fi

run_part() {  # part P under its timeout; its exit status to logs/P.rc
    local p="$1" t rc=0
    t=$("${py[@]}" timeout "$p" "${common[@]}")
    echo "== part $p (timeout ${t}s)"
    timeout -k 10 "$t" "${py[@]}" part "$p" "${common[@]}" --data "$data" >"$out/logs/$p.log" 2>&1 || rc=$?
    echo "$rc" >"$out/logs/$p.rc"
    grep -E '^\[[A-G]\] ' "$out/logs/$p.log" || true
}

start=$SECONDS
for (( i = 0; i < ${#only}; i++ )); do
    if [ "$jobs" -gt 1 ]; then
        while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
        run_part "${only:$i:1}" &
    else
        run_part "${only:$i:1}"
    fi
done
wait
exits=()
for (( i = 0; i < ${#only}; i++ )); do
    p="${only:$i:1}"
    exits+=("$p=$(cat "$out/logs/$p.rc" 2>/dev/null || echo 1)")
done
echo "== parts took $(( SECONDS - start )) s"
joined=$(IFS=,; echo "${exits[*]}")
"${py[@]}" summary "${common[@]}" --parts "$only" --exits "$joined"
