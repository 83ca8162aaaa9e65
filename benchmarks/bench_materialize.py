"""Building a big model on each rank: Loom's meta path vs building it whole then slicing vs FSDP2's
meta-device init; importing a Hugging Face Llama at 4 ranks vs ``transformers.from_pretrained``.

Every case runs in fresh processes (one per rank, gloo, one thread each): first once on a tiny
model (first-use costs of torch and lazy imports are not the model's), then measured: the wall time
of construction (slowest rank), and per rank the peak growth of the resident set during it
(``VmHWM`` after ``/proc/self/clear_refs``, :func:`loom.device.peak_memory_bytes`) and what stays
resident after it. Expected peak per rank (Φ parameters, fp32, N ranks sharing them):

- Loom meta path (``build_model(meta=True)`` + ``build_run``): its final state + the largest whole
  parameter it holds a piece of (each parameter's whole init value exists once, briefly);
- today's whole build (``build_model(meta=False)`` + the same ``build_run``): + the whole model, 4Φ;
- FSDP2 (``fully_shard`` per block and on the root of the meta model, ``to_empty``, DTensor
  ``normal_``/``fill_``): 4Φ/N of parameters, no optimizer state until torch's AdamW first steps,
  and values of its own (each rank draws its shard; not the layout-independent init);
- HF import (Loom: ``model.from_hf`` through :func:`loom.model.hf.apply_to` and
  :func:`loom.model.hf.source`, as the trainer does): like the meta path, each rank reading only
  the boxes of the parameters it holds (a tp rank its slice; a ZeRO-3 rank every parameter of a
  unit whole, keeping its shard of the unit); ``transformers``: one process holding the whole model.

The model of the first table is built by each contender at ZeRO-3 over 2 ranks (and ``--wide`` ranks, where
16Φ/N falls under the whole model's 4Φ) and at tp2. The import measures a Llama-3.2-1B body at
4 ranks with as many of its layers as fit the memory available now, less 6 GiB left to others.

The Hugging Face directory is generated once (random init from a ``LlamaConfig``, nothing
downloaded, ``save_pretrained`` in 1 GB shards with an index) and reused from ``--hf-dir``.

    python benchmarks/bench_materialize.py [--dim 768] [--layers 12] [--vocab 32000]
        [--wide 8] [--hf-layers 16] [--hf-vocab 32000] [--hf-dir /tmp/loom-bench-llama] [--skip-hf]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import add_no_write, init_gloo, results, run_ranks  # noqa: E402

MiB = 2**20
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=256)
# Llama-3.2-1B's body (hidden 2048, 16 layers, 32 heads / 8 kv, ffn 8192, tied embeddings); with Llama 2's
# 32,000-token vocabulary it has 1.04 B parameters (1.24 B with Llama 3's 128,256: --hf-vocab)
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
)
LLAMA_TINY = dict(
    LLAMA_1B,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)


# ----------------------------------------------------------------------------- measurement


def _libc():
    """glibc with big blocks mapped and trimmed at once, so a freed tensor leaves the resident set."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD
    return libc


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _measured(build, libc) -> dict:
    """Run ``build()`` (-> what it built, its state bytes) between barriers: wall and CPU seconds,
    peak RSS growth, RSS growth while what it built is alive, state bytes."""
    from loom.device import peak_memory_bytes, reset_peak_memory

    cpu = torch.device("cpu")
    gc.collect()
    libc.malloc_trim(0)
    dist.barrier()
    base = _rss()
    reset_peak_memory(cpu)
    t0, c0 = time.perf_counter(), time.process_time()
    built, state_bytes = build()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    peak = peak_memory_bytes(cpu) - base
    gc.collect()
    libc.malloc_trim(0)
    kept = _rss() - base
    dist.barrier()
    from loom.train.step import Run

    if isinstance(built, Run):  # Loom's: its strategy's hooks on the parameters
        built.strategy.remove()
    del built
    return {"s": seconds, "cpu": cpu_seconds, "peak": peak, "kept": kept, "state": state_bytes}


# ----------------------------------------------------------------------------- contenders


def _loom_cfg(model_kw: dict, layout: dict, world: int, run_dir: str):
    from loom.config import LoomConfig, ModelConfig, TrainConfig

    cfg = LoomConfig(
        model=ModelConfig(**model_kw, max_seq_len=256, multiple_of=256), train=TrainConfig(steps=1)
    )
    cfg.data.seq_len = 256
    for k, v in layout.items():
        setattr(cfg.parallel, k, v)
    cfg.train.micro_batch, cfg.train.global_batch = 1, world // cfg.parallel.tp
    cfg.run.dir = run_dir
    return cfg


def _mesh(cfg):
    """The mesh of ``cfg`` (validated first: dp and dp_shard resolved for this world)."""
    from loom.config import validate
    from loom.mesh import ParallelDims, ParallelMesh

    validate(cfg, dist.get_world_size())
    return ParallelMesh(ParallelDims.from_config(cfg.parallel), "cpu")


def _state(run) -> int:
    """Model state bytes this rank holds: parameters, gradients, optimizer state, buffers."""
    s = run.strategy.state_bytes()
    buffers = sum(b.numel() * b.element_size() for b in run.model.buffers())
    return s["param_bytes"] + s["grad_bytes"] + s["optim_bytes"] + buffers


def loom_build(cfg, meta: bool, source=None):
    """``build_run`` on a model built on the meta device (``meta``) or whole; the run, its state bytes."""
    from loom.model.llama import build_model
    from loom.train.build import build_run

    run = build_run(cfg, _mesh(cfg), build_model(cfg.model, cfg.train.seed, "cpu", meta=meta), source=source)
    return run, _state(run)


def fsdp2_build(cfg):
    """FSDP2's meta-device init: ``fully_shard`` each block and the root, ``to_empty``, init the
    DTensor shards (norms 1, weights N(0, std), output projections std/sqrt(2L)); the model, its
    parameter bytes."""
    from torch.distributed.fsdp import fully_shard

    from loom.model.llama import build_model

    mesh = _mesh(cfg)
    model = build_model(cfg.model, cfg.train.seed, "cpu", meta=True)  # buffers (RoPE tables) on the CPU
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    for block in model.layers:
        fully_shard(block, mesh=mesh.device_mesh["dp_shard"])
    fully_shard(model, mesh=mesh.device_mesh["dp_shard"])
    model.to_empty(device="cpu")
    std, deep = cfg.model.init_std, cfg.model.init_std / (2 * cfg.model.n_layers) ** 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, deep if name.endswith(("wo.weight", "w2.weight")) else std)
        for name, b in buffers.items():
            model.get_buffer(name).copy_(b)
    return model, sum(p.to_local().numel() * p.element_size() for p in model.parameters())


def hf_build(cfg, hf_dir: str):
    """Loom's ``model.from_hf``: shape from ``config.json``, weights read per parameter into this rank's boxes."""
    from loom.model import hf

    cfg.model.from_hf = hf_dir
    cfg.data.tokenizer = cfg.data.tokenizer or "none (no data is read)"  # apply_to would take tokenizer.json
    model = hf.apply_to(cfg, hf_dir)
    return loom_build(cfg, True, hf.source(model))


def transformers_build(hf_dir: str):
    """``AutoModelForCausalLM.from_pretrained`` in fp32, the whole model in one process, then every
    parameter read once (as a first forward would: fp32 safetensors are mapped lazily, so until
    then the weights are not resident); the model, its parameter bytes."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    return model, sum(p.numel() * p.element_size() for p in model.parameters())


def _build(case: str, model_kw: dict, layout: dict, world: int, run_dir: str, hf_dir: str):
    """A callable building ``case`` and returning what it built and its state bytes."""
    if case == "transformers":
        return lambda: transformers_build(hf_dir)
    cfg = _loom_cfg(model_kw, layout, world, run_dir)
    return {
        "loom meta": lambda: loom_build(cfg, True),
        "whole then slice": lambda: loom_build(cfg, False),
        "torch FSDP2": lambda: fsdp2_build(cfg),
        "loom from_hf": lambda: hf_build(cfg, hf_dir),
    }[case]


def _worker(
    rank: int, world: int, init: str, case: str, model_kw: dict, layout: dict, hf: tuple[str, str], out
) -> None:
    warnings.filterwarnings("ignore", "DTensor random operators may not have complete support on cpu")
    init_gloo(rank, world, init, threads=1, timeout_s=1800)
    libc = _libc()
    with tempfile.TemporaryDirectory() as run_dir:
        tiny_dir, big_dir = hf
        _measured(_build(case, TINY, layout, world, run_dir, tiny_dir), libc)  # warm-up: first-use costs
        r = _measured(_build(case, model_kw, layout, world, run_dir, big_dir), libc)
    results: list = [None] * world
    dist.all_gather_object(results, r)
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def measure(case: str, world: int, model_kw: dict, layout: dict, hf: tuple[str, str] = ("", "")) -> dict:
    """One case in fresh processes: the largest per-rank value of each measure (seconds, peak, kept, state)."""
    ranks = run_ranks(world, _worker, case, model_kw, layout, hf)
    return {k: max(r[k] for r in ranks) for k in ranks[0]}


# ----------------------------------------------------------------------------- the HF directory


def _hf_need(config: dict, world: int) -> int:
    """Host bytes the import at ``world`` ranks needs, about: per rank its state 16Φ/N (ZeRO-3) or
    4Φ (tp2 x dp2: half the parameters and their gradients), twice the embedding (read whole, then
    its unit's flat buffer), and 0.5 GiB of process."""
    h, f, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = h * config["num_key_value_heads"] // config["num_attention_heads"]
    phi = V * h + config["num_hidden_layers"] * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h)
    return world * (max(16 * phi // world, 4 * phi) + 2 * 4 * V * h + 2**29)


def _available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def _fitting(config: dict, world: int, margin: int = 6 * 2**30) -> dict:
    """``config`` with as many of its layers as fit this machine's available memory now, less ``margin``
    (others share the machine)."""
    while config["num_hidden_layers"] > 1 and _hf_need(config, world) > _available() - margin:
        config = dict(config, num_hidden_layers=config["num_hidden_layers"] - 1)
    return config


def _generate(path: str, config: dict) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config, architectures=["LlamaForCausalLM"], dtype="float32"))
    model.save_pretrained(path, max_shard_size="1GB")


def hf_dir(path: str, config: dict) -> str:
    """A random-init Llama directory for ``config`` at ``path``, generated (in a child process, so
    its memory is returned) unless one for the same config is already there."""
    import torch.multiprocessing as mp

    stamp = Path(path) / "bench_config.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == config:
        return path
    print(f"generating {path} ...", file=sys.stderr, flush=True)
    p = mp.get_context("spawn").Process(target=_generate, args=(path, config))
    p.start()
    p.join()
    if p.exitcode != 0:
        sys.exit(f"generating {path} failed")
    stamp.write_text(json.dumps(config))
    return path


# ----------------------------------------------------------------------------- report


def _params(cfg) -> int:
    from loom.model.llama import build_model, count_params

    return count_params(build_model(cfg, 0, meta=True))


def table(title: str, rows: dict[str, dict], whole: int) -> None:
    print(f"\n{title}")
    print(
        f"{'layout':<12}{'contender':<20}{'time s':>8}{'cpu s':>7}{'peak MiB':>10}{'kept MiB':>10}{'state MiB':>11}"
        f"{'peak-kept':>11}{'peak/whole':>12}"
    )
    for (layout, name), r in rows.items():
        print(
            f"{layout:<12}{name:<20}{r['s']:>8.2f}{r['cpu']:>7.2f}{r['peak'] / MiB:>10.0f}{r['kept'] / MiB:>10.0f}"
            f"{r['state'] / MiB:>11.0f}{(r['peak'] - r['kept']) / MiB:>11.0f}{r['peak'] / whole:>12.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument(
        "--hf-layers", type=int, default=16, help="at most this many layers (fewer if they do not fit)"
    )
    ap.add_argument("--hf-vocab", type=int, default=32000)
    ap.add_argument("--hf-dir", default="/tmp/loom-bench-llama")
    ap.add_argument("--wide", type=int, default=8, help="also ZeRO-3 over this many ranks (0: not)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--only-hf", action="store_true", help="only the Hugging Face import part")
    add_no_write(ap)
    args = ap.parse_args()
    with results(
        "materialize", "Building models on the meta device", write=not args.no_write, preformatted=True
    ):
        os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded (the ranks inherit it)

        model_kw = dict(
            dim=args.dim,
            n_layers=args.layers,
            n_heads=args.dim // 64,
            n_kv_heads=args.dim // 64,
            vocab_size=args.vocab,
        )
        from loom.config import ModelConfig
        from loom.model.hf import model_config

        phi = _params(ModelConfig(**model_kw, max_seq_len=256, multiple_of=256))
        with_fsdp2 = ("loom meta", "whole then slice", "torch FSDP2")
        part1 = [("zero3 x2", {"dp": 2, "zero": 3}, 2, with_fsdp2), ("tp2", {"tp": 2}, 2, with_fsdp2[:2])]
        if args.wide:
            part1.append((f"zero3 x{args.wide}", {"dp": args.wide, "zero": 3}, args.wide, with_fsdp2))
        rows = {}
        for layout_name, layout, world, cases in [] if args.only_hf else part1:
            for case in cases:
                rows[layout_name, case] = measure(case, world, model_kw, layout)
                print(f"  {layout_name:<10} {case:<18} done", file=sys.stderr, flush=True)
        if not args.only_hf:
            table(
                f"Construction per rank, gloo ranks: dim {args.dim}, {args.layers} layers, vocab {args.vocab}, "
                f"Φ = {phi / 1e6:.1f} M (whole model {4 * phi / MiB:.0f} MiB fp32)",
                rows,
                4 * phi,
            )
        if args.skip_hf:
            return

        asked = dict(LLAMA_1B, num_hidden_layers=args.hf_layers, vocab_size=args.hf_vocab)
        config = _fitting(asked, 4)
        if config != asked:
            print(
                f"{args.hf_layers} layers at 4 ranks would need about {_hf_need(asked, 4) / 2**30:.1f} GiB of host "
                f"memory, {_available() / 2**30:.1f} GiB is available (6 GiB of it left to others): measuring "
                f"{config['num_hidden_layers']} layers"
            )
        big = hf_dir(args.hf_dir, config)
        tiny = hf_dir(args.hf_dir + "-tiny", LLAMA_TINY)
        hf_phi = _params(model_config(json.loads((Path(big) / "config.json").read_text()), 256))
        rows = {}
        for layout_name, layout, world in (
            ("1 process", {}, 1),
            ("zero3 x4", {"dp": 4, "zero": 3}, 4),
            ("tp2 x dp2", {"tp": 2, "dp": 2}, 4),
        ):
            case = "transformers" if world == 1 else "loom from_hf"
            rows[layout_name, case] = measure(case, world, {}, layout, (tiny, big))
            print(f"  {layout_name:<10} {case:<18} done", file=sys.stderr, flush=True)
        table(
            f"Hugging Face import: {big}, Llama-3.2-1B body with {config['num_hidden_layers']} layers, vocab {args.hf_vocab}, Φ = {hf_phi / 1e9:.2f} B "
            f"(whole model {4 * hf_phi / MiB:.0f} MiB fp32)",
            rows,
            4 * hf_phi,
        )
        print(
            "peak, kept: resident set growth per rank during and after construction (largest rank); state: the "
            "model state held (Loom: parameters, gradients, optimizer state, buffers; torch: parameters); "
            "time, cpu s: wall and CPU seconds of the slowest rank (ranks share 2 cores)."
        )


if __name__ == "__main__":
    main()
