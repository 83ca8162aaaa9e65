#!/usr/bin/env bash
# A short GPU lease, end to end (issue 32): what to bring, and the one command to run on the GPU.
#
#     bash benchmarks/gpu_lease.sh prepare [DIR]   # on a CPU machine with the package index: DIR/data, DIR/wheels
#     bash benchmarks/gpu_lease.sh run [DIR]       # on the GPU machine (no network): gpu_one.sh, then GPU tests
#
# DIR defaults to .lease (git-ignored). `prepare` tokenizes the default corpus for gpt-125m into
# DIR/data and downloads, as wheels, the packages a GPU image tends to lack (torchao built for its
# torch, tomli-w; LEASE_WHEELS overrides the list, LEASE_PYVER the target Python, default 3.12).
# `run` installs those wheels into DIR/site only when their module is missing, runs
# `benchmarks/gpu_one.sh --data DIR/data`, then, while LEASE_S seconds (default 480) last, the
# `gpu`-marked tests that LEASE_PYTEST selects with -k (default: the one-GPU ones). Results go to
# $OUT (the device tool's folder) or DIR/out: gpu-out/ (gpu_one's summary, logs, runs), pytest.log,
# lease.log. LEASE_ARGS adds arguments to gpu_one.sh (e.g. "--only C", or "--dry-run" to try the
# kit on a CPU). Exit status: gpu_one.sh's (1 when a check fails), or pytest's when it alone fails.
#
# With the device tool: carry [".lease"], command `LEASE_S=480 bash benchmarks/gpu_lease.sh run`,
# timeout about 585 s (the machine's start is not counted); then commit gpu-out/summary.md as
# docs/gpu/<date>-<device>.md and add a row to docs/gpus.md's "Runs on a GPU".
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-}"
dir="${2:-.lease}"
py="${PYTHON:-python}"

case "$mode" in
prepare)
    mkdir -p "$dir/wheels"
    if [ ! -f "$dir/data/meta.json" ]; then
        "$py" -m loom prepare gpt-125m --data.prepared_dir "$dir/data"
    fi
    read -r -a wheels <<<"${LEASE_WHEELS:-torchao==0.17.0 tomli-w==1.2.0}"
    "$py" -m pip download --no-deps --only-binary=:all: --python-version "${LEASE_PYVER:-3.12}" \
        --platform manylinux_2_28_x86_64 -d "$dir/wheels" "${wheels[@]}"
    du -sh "$dir"
    echo "ready: carry $dir to the GPU machine and run: bash benchmarks/gpu_lease.sh run $dir"
    ;;
run)
    if [ ! -f "$dir/data/meta.json" ]; then
        echo "gpu_lease.sh: $dir/data has no prepared data; run 'bash benchmarks/gpu_lease.sh prepare $dir' first" >&2
        exit 2
    fi
    out="${OUT:-$dir/out}"
    mkdir -p "$out"
    start=$SECONDS
    budget="${LEASE_S:-480}"
    {
        echo "== lease $(date -u +%FT%TZ), budget ${budget}s"
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
        "$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
    } | tee "$out/lease.log"
    missing=()
    for mod in torchao tomli_w; do
        "$py" -c "import $mod" 2>/dev/null || missing+=("$mod")
    done
    if [ ${#missing[@]} -gt 0 ] && compgen -G "$dir/wheels/*.whl" >/dev/null; then
        echo "== installing ${missing[*]} from $dir/wheels into $dir/site" | tee -a "$out/lease.log"
        "$py" -m pip install -q --no-index --no-deps --target "$dir/site" "$dir"/wheels/*.whl 2>&1 | tail -3 | tee -a "$out/lease.log"
    fi
    export PYTHONPATH="$PWD/$dir/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    read -r -a extra <<<"${LEASE_ARGS:-}"
    set +e
    bash benchmarks/gpu_one.sh --out "$out/gpu-out" --data "$dir/data" "${extra[@]}" 2>&1 | tee -a "$out/lease.log"
    rc=${PIPESTATUS[0]}
    set -e
    left=$((budget - (SECONDS - start)))
    selected="${LEASE_PYTEST-cuda_equals_fp64 or fused_kernels or flash_backend or bf16_is_faster or compile_whole_on_cuda}"
    if [ -n "$selected" ] && [ "$left" -gt 30 ]; then
        echo "== gpu tests (-k '$selected'), ${left}s left" | tee -a "$out/lease.log"
        prc=0
        timeout -k 5 "$left" "$py" -m pytest -q -o addopts= -m gpu -rs -k "$selected" tests/test_gpu.py tests/test_sliding_window.py >"$out/pytest.log" 2>&1 || prc=$?
        tail -5 "$out/pytest.log" | tee -a "$out/lease.log"
        [ "$rc" -eq 0 ] && rc=$prc
    fi
    echo "== lease used $((SECONDS - start)) s, exit $rc" | tee -a "$out/lease.log"
    exit "$rc"
    ;;
*)
    sed -n '2,/^set /{/^#/p}' "$0"
    [ "$mode" = "-h" ] || [ "$mode" = "--help" ] || exit 2
    ;;
esac
