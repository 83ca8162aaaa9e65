#!/usr/bin/env bash
# First run on a GPU machine: the gpu-marked tests, then the peer benchmarks (Loom vs DDP, vs FSDP2 /
# ZeroRedundancyOptimizer) on NCCL, with one table at the end. Uses every GPU it finds (at least 1).
#
#     bash benchmarks/gpu_smoke.sh            # all GPUs
#     CUDA_VISIBLE_DEVICES=0,1 bash benchmarks/gpu_smoke.sh
set -uo pipefail
cd "$(dirname "$0")/.."

n=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$n" -lt 1 ]; then
    echo "gpu_smoke: no CUDA device found (torch.cuda.is_available() is False); nothing to run" >&2
    exit 1
fi
world=$(( n >= 4 ? 4 : n ))
python -c "import torch; [print(f'cuda:{i}', torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count())]"
out=$(mktemp -d)
status=0

echo "== gpu tests ($n GPUs)"
python -m pytest -q -p no:cacheprovider -o addopts= -m gpu -rs tests/test_gpu.py | tee "$out/tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

export LOOM_BENCH_DEVICE=cuda
if [ "$world" -ge 2 ]; then
    echo "== data parallel vs DDP ($world GPUs)"
    python benchmarks/bench_data_parallel.py --world "$world" --dim 1024 --layers 8 | tee "$out/dp.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    echo "== ZeRO vs FSDP2 ($world GPUs)"
    python benchmarks/bench_zero.py --world "$world" --dim 1024 --layers 8 | tee "$out/zero.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
    echo "== one GPU: the multi-rank benchmarks need 2" | tee "$out/dp.txt"
fi

echo
echo "================ gpu_smoke summary ================"
printf '%-34s %s\n' "gpu tests" "$(tail -n 1 "$out/tests.txt")"
for f in dp zero; do
    [ -f "$out/$f.txt" ] || continue
    # the benchmarks' own tables: a title line, a header, one row per contender (medians, ratios)
    grep -E "^(data parallel|single process|ZeRO vs|contender|loom|ddp|plain|torch)" "$out/$f.txt"
done
exit $status
