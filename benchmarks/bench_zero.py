"""Loom ZeRO stages 1-3 vs PyTorch: FSDP2 ``fully_shard`` and ``ZeroRedundancyOptimizer``.

Same model, data, ranks and run: every step, each contender runs one optimizer step in turn
(ABCD... per step), so machine noise hits all alike. Prints median wall and CPU time per step,
the ratio of each Loom stage to its PyTorch peer (stage 1 : ZeroRedundancyOptimizer over DDP,
stages 2 and 3 : FSDP2 with each block and the root wrapped) and to Loom stage 0 (data parallel),
and the bytes of model state each contender holds per rank between steps (parameters,
gradients, optimizer state), beside the stage's formula (fp32: 4Φ+4Φ+8Φ/N, 4Φ+12Φ/N, 16Φ/N).

    python benchmarks/bench_zero.py [--world 2] [--steps 12] [--dim 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import add_no_write, backend_name, device, init_gloo, race, results, run_ranks  # noqa: E402

from loom.config import LoomConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from loom.model.llama import build_model, count_params, loss_fn  # noqa: E402
from loom.optim.groups import build_optimizer, param_groups, set_lr  # noqa: E402
from loom.train.schedule import lr_at  # noqa: E402

SEQ, MICRO, ACCUM, VOCAB = 256, 4, 2, 4096
PEERS = {"loom zero-1": "torch ZeRO-opt", "loom zero-2": "torch FSDP2", "loom zero-3": "torch FSDP2"}


def formula_bytes(stage: int, phi: int, n: int) -> float:
    """fp32 state per rank: 16Φ, 4Φ+4Φ+8Φ/N, 4Φ+(4Φ+8Φ)/N, 16Φ/N for stages 0-3 (unpadded Φ)."""
    return {0: 16 * phi, 1: 8 * phi + 8 * phi / n, 2: 4 * phi + 12 * phi / n, 3: 16 * phi / n}[stage]


def _cfg(args, world: int, zero: int) -> LoomConfig:
    m = ModelConfig(
        dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=4, vocab_size=VOCAB, max_seq_len=SEQ
    )
    t = TrainConfig(steps=10_000, grad_clip=1.0, warmup_steps=0)
    return LoomConfig(model=m, train=t, parallel=ParallelConfig(dp=world, dp_shard=world, zero=zero))


def _batches(step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    t = torch.randint(0, VOCAB, (ACCUM, MICRO, SEQ + 1), generator=g)
    t = t.to(device())
    return [(t[i, :, :-1], t[i, :, 1:]) for i in range(ACCUM)]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def loom_contender(cfg: LoomConfig, mesh):
    """Loom's ``parallelize`` at ``cfg.parallel.zero`` (0 = the data-parallel baseline)."""
    from loom.train.build import parallelize
    from loom.train.step import plain_run, train_step

    model = build_model(cfg.model, cfg.train.seed, device())
    strategy = parallelize(model, mesh, cfg, None).strategy

    def step(i: int, rank: int) -> None:
        train_step(
            plain_run(model, strategy, loss_fn),
            _batches(i, rank),
            cfg.train.grad_clip,
            lr_at(i, cfg.train),
            mesh.group("dp"),
        )

    return step, strategy.state_bytes


def fsdp2_contender(cfg: LoomConfig, mesh):
    """torch FSDP2: ``fully_shard`` on each block, then on the root; accumulation without sync."""
    from torch.distributed.fsdp import fully_shard

    model = build_model(cfg.model, cfg.train.seed, device())
    for block in model.layers:
        fully_shard(block, mesh=mesh.device_mesh["dp_shard"])
    fully_shard(model, mesh=mesh.device_mesh["dp_shard"])
    opt = build_optimizer(model, cfg.train)

    def step(i: int, rank: int) -> None:
        set_lr(opt, lr_at(i, cfg.train))
        opt.zero_grad()
        batches = _batches(i, rank)
        for k, (x, y) in enumerate(batches):
            model.set_requires_gradient_sync(k == len(batches) - 1)
            (loss_fn(model(x), y) / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()

    def state() -> dict[str, int]:
        params = list(model.parameters())
        optim = [
            v.to_local() for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
        ]
        return {
            "param_bytes": _nbytes(p.to_local() for p in params),
            "grad_bytes": _nbytes(p.grad.to_local() for p in params if p.grad is not None),
            "optim_bytes": _nbytes(optim),
        }

    return step, state


def zero_redundancy_contender(cfg: LoomConfig, mesh):
    """torch ``ZeroRedundancyOptimizer`` (sharded AdamW state, parameters broadcast) over DDP."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(cfg.model, cfg.train.seed, device())
    ddp = DDP(model, process_group=mesh.group("dp"))
    t = cfg.train
    opt = ZeroRedundancyOptimizer(
        param_groups(model, t.weight_decay),
        optimizer_class=torch.optim.AdamW,
        process_group=mesh.group("dp"),
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
        foreach=True,
    )

    def step(i: int, rank: int) -> None:
        set_lr(opt, lr_at(i, t))
        opt.zero_grad(set_to_none=False)
        batches = _batches(i, rank)
        for k, (x, y) in enumerate(batches):
            if k < len(batches) - 1:
                with ddp.no_sync():
                    (loss_fn(ddp(x), y) / len(batches)).backward()
            else:
                (loss_fn(ddp(x), y) / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()

    def state() -> dict[str, int]:
        optim = [v for s in opt.optim.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
        return {
            "param_bytes": _nbytes(model.parameters()),
            "grad_bytes": _nbytes(p.grad for p in model.parameters() if p.grad is not None),
            "optim_bytes": _nbytes(optim),
        }

    return step, state


def _worker(rank: int, world: int, init: str, args, out) -> None:
    from loom.mesh import ParallelDims, ParallelMesh

    init_gloo(rank, world, init, threads=None, timeout_s=300)
    mesh = ParallelMesh(ParallelDims(dp_shard=world), device().type)
    contenders = {f"loom zero-{z}": loom_contender(_cfg(args, world, z), mesh) for z in range(4)}
    contenders["torch FSDP2"] = fsdp2_contender(_cfg(args, world, 3), mesh)
    contenders["torch ZeRO-opt"] = zero_redundancy_contender(_cfg(args, world, 1), mesh)
    times = race({k: v[0] for k, v in contenders.items()}, args.steps, rank, dist.barrier)
    states = {k: v[1]() for k, v in contenders.items()}
    if rank == 0:
        out.put((times, states))
    dist.destroy_process_group()


def report(times: dict[str, list[float]], states: dict[str, dict[str, int]], phi: int, world: int) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    base = "loom zero-0"
    print(f"\nZeRO vs PyTorch, {world} {backend_name()} ranks, Φ = {phi:,} parameters (fp32), rank 0")
    head = f"{'contender':<16}{'wall s/step':>12}{'cpu s/step':>11}{'vs peer':>9}{'vs zero-0':>10}"
    print(
        head
        + f"{'params MB':>11}{'grads MB':>10}{'optim MB':>10}{'state MB':>10}{'formula MB':>11}{'peak MB':>9}"
    )
    for k in (k for k in med if not k.endswith(" cpu")):
        peer = PEERS.get(k)
        vs_peer = f"{med[k] / med[peer]:.3f}" if peer else "-"
        s = states[k]
        total = s["param_bytes"] + s["grad_bytes"] + s["optim_bytes"]
        formula = f"{formula_bytes(int(k[-1]), phi, world) / 1e6:.2f}" if k.startswith("loom") else "-"
        peak = f"{(total + s['transient_peak_bytes']) / 1e6:.2f}" if "transient_peak_bytes" in s else "-"
        print(
            f"{k:<16}{med[k]:>12.4f}{med[k + ' cpu']:>11.4f}{vs_peer:>9}{med[k] / med[base]:>10.3f}"
            f"{s['param_bytes'] / 1e6:>11.2f}{s['grad_bytes'] / 1e6:>10.2f}{s['optim_bytes'] / 1e6:>10.2f}"
            f"{total / 1e6:>10.2f}{formula:>11}{peak:>9}"
        )
    print(
        "vs peer: zero-1 / ZeroRedundancyOptimizer, zero-2 and zero-3 / FSDP2 (wall time). state: held "
        "between steps; formula: the same with unpadded Φ (Loom pads each flat buffer to N·16 bytes); peak: "
        "state + the most gathered parameters and gradient buffers alive at once during the last step."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    add_no_write(ap)
    args = ap.parse_args()
    with results("zero", "ZeRO 1-3 against PyTorch", write=not args.no_write, preformatted=True):
        phi = count_params(build_model(_cfg(args, args.world, 0).model, 0))
        times, states = run_ranks(args.world, _worker, args)
        report(times, states, phi, args.world)


if __name__ == "__main__":
    main()
