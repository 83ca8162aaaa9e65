"""Device helpers the GPU path relies on, checked on the CPU: MFU peaks from the one hardware table
(per dtype, TF32 only when enabled), peak memory per window, timings read after a device sync."""

from __future__ import annotations

import json
import os

import pytest
import torch

from loom import config as C
from tests.helpers import TINY_JOB, with_sections


@pytest.mark.parametrize(
    "name,precision,tf32,key,flops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", False, "h100-sxm", 989.5e12),
        ("NVIDIA H100 80GB HBM3", "fp32", False, "h100-sxm", 67e12),  # true FP32: TF32 is off by default
        ("NVIDIA H100 80GB HBM3", "fp32", True, "h100-sxm", 494.5e12),
        ("NVIDIA H100 PCIe", "fp16", False, "h100-pcie", 756e12),
        ("NVIDIA A100-SXM4-40GB", "fp32", False, "a100-40g", 19.5e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", False, "a100-80g", 312e12),
        ("AMD Instinct MI300X", "bf16", False, "mi300x", 1307.4e12),
        ("NVIDIA H800", "bf16", False, "h800", 989.5e12),
        ("AMD Instinct MI250X", "bf16", False, "mi250x", 191.5e12),  # one GCD: half the module
    ],
)
def test_mfu_peak_comes_from_the_hardware_table(name, precision, tf32, key, flops):
    from loom.plan.hardware import DEVICES, device_key, mfu_peak

    assert device_key(name) == key
    peak, source = mfu_peak(name, precision, tf32)
    assert peak == flops == DEVICES[key].peak_flops("tf32" if tf32 and precision == "fp32" else precision)
    assert source.startswith(f"datasheet {key}")


def test_unknown_devices_are_measured_in_the_run_dtype(monkeypatch):
    from loom.plan.hardware import mfu_peak as table
    from loom.train import mfu

    assert table("NVIDIA GeForce RTX 3060", "bf16", False) is None
    seen = []
    monkeypatch.setattr(mfu, "measure_gemm_flops", lambda device, dtype: seen.append(dtype) or 1e12)
    assert mfu.mfu_peak(torch.device("cpu"), "bf16") == (
        1e12,
        f"measured bfloat16 GEMM on cpu ({torch.get_num_threads()} threads)",
    )
    assert seen == [torch.bfloat16]


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA H100 NVL",
        "NVIDIA H200 NVL",
        "NVIDIA GH200 480GB",
        "NVIDIA GB200",
        "NVIDIA GeForce RTX 4090 D",
        "NVIDIA H800 PCIe",
        "AMD Instinct MI250",
    ],
)
def test_parts_with_other_datasheets_are_not_given_a_known_peak(name):
    """A name containing a known part (H100 in H100 NVL, H200 in H200 NVL and GH200, B200 in GB200) is
    not that part."""
    from loom.plan.hardware import device_key

    assert device_key(name) is None


@pytest.mark.parametrize(
    "matmul_precision,precision,flops",
    [
        ("highest", "fp32", 67e12),
        ("high", "fp32", 494.5e12),
        ("highest", "bf16", 989.5e12),
        ("high", "bf16", 989.5e12),
        ("highest", "fp16", 989.5e12),
    ],
)
def test_trainer_peak_of_a_cuda_device_by_its_name(monkeypatch, matmul_precision, precision, flops):
    """The trainer's path: torch.cuda.get_device_name -> table row -> the run's dtype; fp32 counts
    TF32 tensor cores only when torch's matmul precision lets fp32 matmuls use them."""
    from loom.train import mfu

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(
        mfu, "measure_gemm_flops", lambda device, dtype: pytest.fail("a known GPU is not timed")
    )
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision(matmul_precision)
        peak, source = mfu.mfu_peak(torch.device("cuda", 0), precision)
    finally:
        torch.set_float32_matmul_precision(before)
    assert peak == flops
    assert source.startswith("datasheet h100-sxm")


@pytest.mark.parametrize(
    "precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]
)
def test_unknown_cuda_devices_time_a_gemm_in_the_run_dtype(monkeypatch, precision, dtype):
    from loom.train import mfu

    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 NVL")
    monkeypatch.setattr(mfu, "measure_gemm_flops", lambda device, dtype: seen.append((device, dtype)) or 5e14)
    peak, source = mfu.mfu_peak(torch.device("cuda", 1), precision)
    assert peak == 5e14 and seen == [(torch.device("cuda", 1), dtype)]
    assert source.startswith("measured") and "NVIDIA H100 NVL (not in the hardware table)" in source


def test_the_measured_gemm_is_large_on_an_accelerator(monkeypatch):
    """An unknown GPU's peak is an n = 8192 GEMM (2 n^3 FLOPs), not a size that measures launch cost."""
    from loom.device import measure_gemm_flops

    sizes = []

    def randn(*shape, device=None, dtype=None):
        sizes.append((shape, device, dtype))
        raise RuntimeError("stop")  # the size is all this test needs

    monkeypatch.setattr(torch, "randn", randn)
    with pytest.raises(RuntimeError, match="stop"):
        measure_gemm_flops(torch.device("meta"), torch.bfloat16)
    assert sizes == [((8192, 8192), torch.device("meta"), torch.bfloat16)]


def test_tf32_flag_follows_torch():
    from loom.device import tf32_enabled

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert not tf32_enabled()
        torch.set_float32_matmul_precision("high")
        assert tf32_enabled()
    finally:
        torch.set_float32_matmul_precision(before)


def test_peak_memory_is_reset_per_window():
    from loom.device import peak_memory_bytes, reset_peak_memory

    cpu = torch.device("cpu")
    big = torch.ones(64 * 2**20)  # 256 MiB, touched
    high = peak_memory_bytes(cpu)
    del big
    reset_peak_memory(cpu)
    low = peak_memory_bytes(cpu)
    assert high - low > 200 * 2**20, (high, low)


def test_calibration_times_between_device_syncs(monkeypatch):
    import loom.device
    from loom.plan.calibrate import _timed

    calls = []
    monkeypatch.setattr(loom.device, "synchronize", lambda device: calls.append("sync"))
    _timed(lambda: calls.append("work"), 3, torch.device("cpu"))
    assert calls == ["work", "work"] + ["sync", "work", "sync"] * 3


def test_calibration_gemm_and_bandwidth_run_on_the_device_between_syncs(monkeypatch):
    """``plan calibrate --backend nccl``: the GEMMs and the elementwise bandwidth are measured on the
    GPU (here: the device handed down), each call timed between synchronisations of that device."""
    import loom.device
    from loom.plan import calibrate

    cpu = torch.device("cpu")
    synced = []
    monkeypatch.setattr(loom.device, "synchronize", lambda device: synced.append(device))
    flops, per = calibrate.measure_gemm([(64, 32, 16)], repeats=3, device=cpu)
    assert flops > 0 and list(per) == ["64x32x16"]
    assert synced == [cpu] * 6  # before and after each of the 3 timed calls
    synced.clear()
    assert calibrate.measure_bandwidth([1024], repeats=3, device=cpu) > 0
    assert synced == [cpu] * 6
    synced.clear()
    calibrate.measure_gemm([(64, 32, 16)], repeats=3)  # the CPU default: as before, no syncs
    assert synced == []


def test_calibrate_nccl_refuses_without_cuda():
    from loom.plan.calibrate import calibrate

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        calibrate(nproc=1, backend="nccl", device="cuda")


def test_trainer_reads_the_clock_after_a_device_sync(monkeypatch, tmp_path_factory):
    """The step window's time (tokens/s, MFU) is read after the device has finished the window's
    work, and the peak-memory window restarts after every logged row."""
    from loom.data import prepare_data
    from loom.train import trainer as T

    cfg = C.from_dict(with_sections(TINY_JOB, run={"dir": str(tmp_path_factory.mktemp("run"))}))
    os.environ.setdefault("LOOM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    cfg.data.prepared_dir = str(prepare_data(cfg.data, progress=False).dir)
    events = []
    monkeypatch.setattr(T, "synchronize", lambda device: events.append("sync"))
    monkeypatch.setattr(T, "reset_peak_memory", lambda device: events.append("reset"))
    real = T.MetricsWriter.write
    monkeypatch.setattr(T.MetricsWriter, "write", lambda self, row: (events.append("row"), real(self, row)))
    trainer = T.Trainer(cfg, T.RankEnv(0, 1, 0, 1))
    try:
        trainer.fit()
    finally:
        trainer.heartbeat.close()
    assert events == ["sync", "reset"] + ["sync", "reset", "row"] * 2
    rows = [json.loads(r) for r in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["peak_mem_bytes"] > 0 for r in rows)


def test_recorded_pipeline_events_read_the_clock_after_a_device_sync(monkeypatch):
    """A measured timeline's event ends when its kernels end: a recorded run syncs before each
    clock read; an unrecorded one (training) never syncs."""
    from loom.parallel.pipeline import runtime as R

    calls = []
    monkeypatch.setattr(R, "synchronize", lambda device: calls.append("sync"))
    monkeypatch.setattr(R.time, "perf_counter", lambda: calls.append("clock") or 1.0)
    rt = object.__new__(R.PipelineRuntime)
    rt.device, rt.record = torch.device("cpu"), True
    assert rt._clock() == 1.0 and calls == ["sync", "clock"]
    calls.clear()
    rt.record = False
    assert rt._clock() == 1.0 and calls == ["clock"]
