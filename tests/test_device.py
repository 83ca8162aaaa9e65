"""Device helpers the GPU path relies on, checked on the CPU: MFU peaks from the one hardware table
(per dtype, TF32 only when enabled), peak memory per window, timings read after a device sync."""

from __future__ import annotations

import json
import os

import pytest
import torch

from loom import config as C


@pytest.mark.parametrize("name,precision,tf32,key,flops", [
    ("NVIDIA H100 80GB HBM3", "bf16", False, "h100-sxm", 989.5e12),
    ("NVIDIA H100 80GB HBM3", "fp32", False, "h100-sxm", 67e12),  # true FP32: TF32 is off by default
    ("NVIDIA H100 80GB HBM3", "fp32", True, "h100-sxm", 494.5e12),
    ("NVIDIA H100 PCIe", "fp16", False, "h100-pcie", 756e12),
    ("NVIDIA A100-SXM4-40GB", "fp32", False, "a100-40g", 19.5e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", False, "a100-80g", 312e12),
    ("AMD Instinct MI300X", "bf16", False, "mi300x", 1307.4e12),
])  # fmt: skip
def test_mfu_peak_comes_from_the_hardware_table(name, precision, tf32, key, flops):
    from loom.plan.hardware import DEVICES, device_key, mfu_peak

    assert device_key(name) == key
    peak, source = mfu_peak(name, precision, tf32)
    assert peak == flops == DEVICES[key].peak_flops("tf32" if tf32 and precision == "fp32" else precision)
    assert source.startswith(f"datasheet {key}")


def test_unknown_devices_are_measured_in_the_run_dtype(monkeypatch):
    from loom.plan.hardware import mfu_peak as table
    from loom.train import mfu

    assert table("NVIDIA GeForce RTX 4090", "bf16", False) is None
    seen = []
    monkeypatch.setattr(mfu, "measure_gemm_flops", lambda device, dtype: seen.append(dtype) or 1e12)
    assert mfu.mfu_peak(torch.device("cpu"), "bf16") == (1e12, "measured bfloat16 GEMM on cpu "
                                                                 f"({torch.get_num_threads()} threads)")  # fmt: skip
    assert seen == [torch.bfloat16]


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


def test_trainer_reads_the_clock_after_a_device_sync(monkeypatch, tmp_path_factory):
    """The step window's time (tokens/s, MFU) is read after the device has finished the window's
    work, and the peak-memory window restarts after every logged row."""
    from loom.data import prepare_data
    from loom.train import trainer as T

    cfg = C.from_dict({"model": {"dim": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 32},
                       "data": {"seq_len": 32, "vocab_size": 300, "max_corpus_mb": 0.1},
                       "train": {"steps": 2, "global_batch": 2, "micro_batch": 2, "log_every": 1, "eval_every": 0},
                       "run": {"progress": False, "tensorboard": False, "threads": 1,
                               "dir": str(tmp_path_factory.mktemp("run"))}})  # fmt: skip
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
