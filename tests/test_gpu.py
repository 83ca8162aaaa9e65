"""On GPUs: what only CUDA + NCCL can show. Marked ``gpu``; skipped where CUDA is absent (as on the
machines this project is developed on), run by ``benchmarks/gpu_smoke.sh`` or ``pytest -m gpu``.

- every layout equal to one GPU, on 2 GPUs with NCCL (one rank per GPU, strict comm checks on);
- communication overlapped with backward, measured with the profiler (kernels of the NCCL stream
  running while compute kernels run), in the fp32, half-precision and hybrid data-parallel paths;
- SDPA's flash backend selected for the model's attention in bf16;
- peak memory of a step against the planner's prediction;
- bf16 faster than fp32;
- the pipeline's measured bubble on GPUs against the simulation with the measured stage times;
- a checkpoint saved by 2 NCCL ranks resumes bit for bit;
- the GPU issue's findings that need several GPUs: pp2 x ZeRO-3 x offload_params x tied embeddings
  (finding 1) on 2, a dedicated asp parameter server (finding 2) on 3, ring against all-to-all
  context parallelism at 32k tokens on 2.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from loom import config as C
from tests.dist import WorkerPool, get_mesh, rank_device
from tests.helpers import train_layout

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(N_GPUS == 0, reason="needs a CUDA device")]
two_gpus = pytest.mark.skipif(N_GPUS < 2, reason=f"needs 2 CUDA devices (found {N_GPUS})")
four_gpus = pytest.mark.skipif(N_GPUS < 4, reason=f"needs 4 CUDA devices (found {N_GPUS})")

STEPS, BATCH, MICRO = 6, 8, 2
TOL = dict(rtol=1e-3, atol=1e-4)  # fp32 without TF32; 1 vs 2 ranks differ in summation order only
TOL_BF16 = dict(rtol=2e-2, atol=5e-3)


class _Pools:
    def __init__(self) -> None:
        self.pools: dict[int, WorkerPool] = {}

    def __call__(self, world: int) -> WorkerPool:
        if world not in self.pools:
            self.pools[world] = WorkerPool(world, backend="nccl")
        return self.pools[world]


@pytest.fixture(scope="module")
def nccl():
    """``nccl(n)``: n ranks, rank r on cuda:r, NCCL, started on first use."""
    pools = _Pools()
    yield pools
    for p in pools.pools.values():
        p.close()


def _medium(**kw) -> C.ModelConfig:
    """Big enough that kernels take longer than their launches (so overlap and speed are visible)."""
    base = dict(
        dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, vocab_size=8192, max_seq_len=512, multiple_of=256
    )
    return C.ModelConfig(**(base | kw))


# ----------------------------------------------------------------------------- equality

LAYOUTS = {
    "dp2": ({"dp_replicate": 2}, {}),
    "dp2 bf16": ({"dp_replicate": 2, "precision": "bf16"}, {}),
    "zero2": ({"dp_shard": 2, "zero": 2}, {}),
    "zero3": ({"dp_shard": 2, "zero": 3}, {}),
    "tp2 sp": ({"tp": 2, "sp": True}, {}),
    "pp2 1f1b": ({"pp": 2}, {}),
    "pp2 zb-h1": ({"pp": 2, "schedule": "zb-h1"}, {}),
    "cp2": ({"cp": 2}, {}),
    "cp2 ring": ({"cp": 2, "cp_mode": "ring"}, {}),  # NCCL p2p batches in issue order
    "cp2 alltoall": ({"cp": 2, "cp_mode": "alltoall"}, {}),
    "ep2": ({"dp_replicate": 2, "ep": 2}, {"n_experts": 4, "top_k": 2}),
    "tp2 sp split experts": ({"tp": 2, "sp": True, "expert_tp": "split"}, {"n_experts": 4, "top_k": 2}),
}


@two_gpus
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_on_two_gpus_equals_one_gpu(nccl, name):
    layout, model_kw = LAYOUTS[name]
    precision = {"precision": layout["precision"]} if "precision" in layout else {}
    reference = train_layout(precision, STEPS, BATCH, MICRO, model_kw, device=torch.device("cuda", 0))
    tol = TOL_BF16 if precision else TOL
    for r in nccl(2).run(train_layout, layout, STEPS, BATCH, MICRO, model_kw):
        assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), **tol)
        if r["state"] is not None:
            for k, v in reference["state"].items():
                assert_close(r["state"][k].float(), v.float(), **tol, msg=lambda m, k=k: f"{name} {k}: {m}")


@four_gpus
def test_hybrid_tp_pp_on_four_gpus_equals_one_gpu(nccl):
    reference = train_layout({}, STEPS, BATCH, MICRO, device=torch.device("cuda", 0))
    for layout in ({"dp_replicate": 2, "dp_shard": 2, "zero": 3}, {"tp": 2, "pp": 2, "sp": True}):
        for r in nccl(4).run(train_layout, layout, STEPS, BATCH, MICRO):
            assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), **TOL)


@four_gpus
def test_split_experts_pooling_rows_on_four_gpus_equal_one_gpu(nccl):
    """tp2+sp x ep2 with experts split over tp: the routed rows pooled over tp with NCCL (int64 counts,
    padded row gathers) give one GPU's losses and weights."""
    moe = {"n_experts": 4, "top_k": 2}
    reference = train_layout({}, STEPS, BATCH, MICRO, moe, device=torch.device("cuda", 0))
    layout = {"tp": 2, "sp": True, "dp_replicate": 2, "ep": 2, "expert_tp": "split"}
    for r in nccl(4).run(train_layout, layout, STEPS, BATCH, MICRO, moe):
        assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), **TOL)
        if r["state"] is not None:
            for k, v in reference["state"].items():
                assert_close(r["state"][k], v, **TOL, msg=lambda m, k=k: f"{k}: {m}")


# ----------------------------------------------------------------------------- overlap


def _overlap(layout: dict) -> dict:
    """One profiled step: the NCCL kernels, and how many of them run at the same time as a compute
    kernel (intervals on the GPU's clock that intersect)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from loom.comm import CommMeter
    from loom.model.llama import build_model, loss_fn
    from loom.train.build import parallelize
    from loom.train.step import plain_run, train_step

    dims = {k: v for k, v in layout.items() if k in ("dp_replicate", "dp_shard")}
    mesh = get_mesh(**dims)
    cfg = C.LoomConfig(model=_medium(), train=C.TrainConfig(steps=10, warmup_steps=0))
    cfg.data.seq_len, cfg.run.device = 512, "cuda"
    cfg.train.precision = layout.get("precision", "fp32")
    cfg.parallel.dp, cfg.parallel.dp_shard, cfg.parallel.zero = (
        mesh.size("dp"),
        mesh.size("dp_shard"),
        layout.get("zero", 0),
    )
    cfg.parallel.bucket_mb = 8.0
    device = rank_device()
    model = build_model(cfg.model, 0, device)
    strategy = parallelize(model, mesh, cfg, CommMeter()).strategy
    g = torch.Generator().manual_seed(mesh.local_rank("dp"))
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 2, 513), generator=g).to(device)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    for _ in range(2):
        train_step(plain_run(model, strategy, loss_fn), batches, 1.0, 1e-4, mesh.group("dp"))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train_step(plain_run(model, strategy, loss_fn), batches, 1.0, 1e-4, mesh.group("dp"))
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    comm = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()]
    compute = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()]
    overlapped = sum(any(a < d and c < b for c, d in compute) for a, b in comm)
    return {"nccl_kernels": len(comm), "overlapped": overlapped}


@two_gpus
@pytest.mark.parametrize(
    "layout", [{"dp_replicate": 2}, {"dp_replicate": 2, "precision": "bf16"}, {"dp_shard": 2, "zero": 2}]
)
def test_gradient_reduction_overlaps_backward(nccl, layout):
    for r in nccl(2).run(_overlap, layout):
        assert r["nccl_kernels"] >= 2, r
        assert r["overlapped"] >= 1, r  # at least one reduction ran while backward computed


@four_gpus
def test_hybrid_sharding_overlaps_backward(nccl):
    for r in nccl(4).run(_overlap, {"dp_replicate": 2, "dp_shard": 2, "zero": 3}):
        assert r["overlapped"] >= 1, r


# ----------------------------------------------------------------------------- one GPU


def _model_and_batch(precision: str, micro: int = 4, seq: int = 512):
    from loom.model.llama import build_model

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    model = build_model(_medium(max_seq_len=seq), 0, "cuda").to(dtype)
    tokens = torch.randint(0, 8192, (micro, seq + 1), device="cuda")
    return model, tokens[:, :-1], tokens[:, 1:]


def test_sdpa_flash_backend_runs_the_attention():
    """With only the flash backend allowed, SDPA raises if it cannot serve the model's call
    (layout, dtype, mask, head size): forward and backward must run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from loom.model.llama import loss_fn

    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("flash attention needs compute capability 8.0+")
    model, x, y = _model_and_batch("bf16")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        loss_fn(model(x), y).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def _step_time(precision: str, steps: int = 6) -> float:
    from loom.model.llama import loss_fn

    model, x, y = _model_and_batch(precision)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss_fn(model(x), y).backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def test_bf16_is_faster_than_fp32():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 tensor cores need compute capability 8.0+")
    assert torch.get_float32_matmul_precision() == "highest"  # fp32 measured without TF32
    fp32, bf16 = _step_time("fp32"), _step_time("bf16")
    assert fp32 / bf16 > 1.5, f"fp32 {fp32 * 1e3:.1f} ms vs bf16 {bf16 * 1e3:.1f} ms per step"


def test_peak_memory_matches_the_planner():
    """A data-parallel step of the medium model on one GPU: the allocator's peak against the
    planner's bytes (model states, activations, logits; its runtime constant left out)."""
    from loom.comm import CommMeter
    from loom.model.llama import build_model, loss_fn
    from loom.plan.auto import _cost_model, layout_of
    from loom.train.build import parallelize
    from loom.train.step import plain_run, train_step

    cfg = C.LoomConfig(model=_medium(), train=C.TrainConfig(steps=10, global_batch=4, micro_batch=4))
    cfg.data.seq_len, cfg.run.device = 512, "cuda"
    mesh = get_mesh()
    model = build_model(cfg.model, 0, "cuda")
    strategy = parallelize(model, mesh, cfg, CommMeter()).strategy
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 513), device="cuda")
    batches = [(tokens[:, :-1], tokens[:, 1:])]
    train_step(plain_run(model, strategy, loss_fn), batches, 1.0, 1e-4, None)  # optimizer state allocated
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    train_step(plain_run(model, strategy, loss_fn), batches, 1.0, 1e-4, None)
    measured = torch.cuda.max_memory_allocated()
    cm = _cost_model(cfg, 1, None)
    total, parts, _ = cm.memory(layout_of(cfg))
    predicted = total - cm.cluster.device.runtime_overhead_bytes
    assert abs(predicted - measured) / measured < 0.25, (predicted, measured, parts)


# ----------------------------------------------------------------------------- pipeline, resume


def _gpu_pipeline_timeline(model_kw: dict | None = None) -> str:
    from loom.model.llama import build_model, loss_fn
    from loom.optim.groups import build_optimizer
    from loom.parallel.data.strategy import DataParallel
    from loom.parallel.pipeline.report import timeline_report
    from loom.parallel.pipeline.stage import split_model
    from loom.parallel.pipeline.strategy import PipelineStrategy
    from loom.train.build import pipeline_run
    from loom.train.step import train_step

    mesh, device, m = get_mesh(pp=2), rank_device(), 8
    mcfg = _medium(tie_embeddings=False, **(model_kw or {}))
    model = build_model(mcfg, 0, device)
    pipe = split_model(
        model,
        mesh.local_rank("pp"),
        2,
        [0, mcfg.n_layers // 2, mcfg.n_layers],
        mesh.group("pp"),
        mesh.pp_links(),
    )
    strategy = PipelineStrategy(
        DataParallel(pipe, None).attach_optimizer(build_optimizer(pipe, C.TrainConfig())),
        pipe,
        "1f1b",
        1,
        record_step=2,
    )
    g = torch.Generator().manual_seed(0)
    seq = mcfg.max_seq_len
    batches = [
        tuple(torch.randint(0, mcfg.vocab_size, (2, seq), generator=g).to(device) for _ in range(2))
        for _ in range(m)
    ]
    for _ in range(3):
        train_step(pipeline_run(pipe, strategy, loss_fn), batches, 1.0, 1e-4, None)
    return timeline_report(strategy.timeline, "1f1b", m) if mesh.local_rank("pp") == 0 else ""


@two_gpus
def test_pipeline_bubble_on_gpus_equals_the_simulation(nccl):
    """The measured 1F1B bubble on 2 GPUs against the simulator fed the measured stage times: a
    runtime that serialised transfers or timed without synchronising would miss it."""
    text = nccl(2).run(_gpu_pipeline_timeline)[0]
    print(text)
    measured = float(text.split("measured bubble ")[1].split("%")[0]) / 100
    simulated = float(text.split("stage times ")[1].split("%")[0]) / 100
    assert measured == pytest.approx(simulated, abs=0.03), text


def _resume(run_dir: str, steps: int, stop_at: int) -> list[tuple[int, float, float]]:
    """Train ZeRO-3 through the Trainer (checkpoint every 2 steps), stopping after ``stop_at`` if
    given; rank 0 returns (step, loss, grad norm) of every metrics row."""
    import torch.distributed as dist

    from loom.train.trainer import RankEnv, Trainer

    cfg = C.from_dict(
        {
            "model": {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 128},
            "data": {"seq_len": 128, "vocab_size": 512, "max_corpus_mb": 0.3},
            "train": {
                "steps": steps,
                "global_batch": 8,
                "micro_batch": 2,
                "eval_every": 0,
                "checkpoint_every": 2,
                "log_every": 1,
            },
            "parallel": {"zero": 3},
            "run": {"dir": run_dir, "device": rank_device().type, "progress": False, "tensorboard": False},
        }
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer(cfg, RankEnv(rank, world, rank, world))
    if stop_at:
        done = iter(range(trainer.start_step + 1, 10**9))
        trainer._time_up = lambda start: next(done) >= stop_at  # as train.time_limit_s would
    try:
        trainer.fit()
    finally:
        trainer.heartbeat.close()
    if rank != 0:
        return []
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows]


@two_gpus
def test_checkpoint_resume_on_nccl_is_bit_identical(nccl, tmp_path):
    straight = nccl(2).run(_resume, str(tmp_path / "a"), 6, 0)[0]
    first = nccl(2).run(_resume, str(tmp_path / "b"), 6, 4)[0]  # stops after step 4 (checkpoint at 4)
    resumed = nccl(2).run(_resume, str(tmp_path / "b"), 6, 0)[0]
    assert [r[0] for r in first] == [1, 2, 3, 4] and [r[0] for r in straight] == [1, 2, 3, 4, 5, 6]
    assert resumed == straight  # steps 5 and 6 after the resume, bit for bit


# ----------------------------------------------------------------------------- findings needing 2-3 GPUs

three_gpus = pytest.mark.skipif(N_GPUS < 3, reason=f"needs 3 CUDA devices (found {N_GPUS})")


@two_gpus
def test_pp2_zero3_offload_params_tied_embeddings_on_nccl_equals_one_gpu(nccl):
    """Finding 1 on NCCL: pp2 x ZeRO-3 x offload_params = cpu x tied embeddings (the tiny model ties
    them). Its tied-gradient exchange and norm all-reduce once handed host tensors to NCCL; now
    they go through device copies, and both ranks equal one GPU (strict checks on)."""
    layout = {"pp": 2, "zero": 3, "offload_params": "cpu"}
    reference = train_layout({}, STEPS, BATCH, MICRO, device=torch.device("cuda", 0))
    results = nccl(2).run(train_layout, layout, STEPS, BATCH, MICRO)
    for r in results:
        assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), **TOL)
    states = [r["state"] for r in results if r["state"] is not None]
    assert states
    for state in states:
        for k, v in reference["state"].items():
            assert_close(state[k].float(), v.float(), **TOL, msg=lambda m, k=k: f"{k}: {m}")


@three_gpus
def test_dedicated_asp_server_on_nccl_does_not_deadlock(nccl):
    """Finding 2 on NCCL: 2 workers and 1 dedicated server under asp, worker 0 slowed so worker 1
    runs ahead. The listener threads wait on their own streams, so the server's pulls never queue
    behind a wait: 20 steps complete (the pool's timeout would name a deadlock), every push is applied
    once, the fast worker ran ahead (staleness > 1) and the model learned the fixed batch."""
    from tests.test_param_server import _assemble, _batch_loss, _dedicated

    workers, steps = 2, 20
    results = nccl(3).run(_dedicated, workers, 1, "asp", steps, 0.1, 60.0, -1, True)
    server = results[workers]
    assert server["rounds"] == steps and len(server["staleness"]) == workers * steps
    assert max(server["staleness"]) > 1
    start = results[0]["losses"][0]
    assert _batch_loss(_assemble(results, workers)) < start - 0.5


def _cp_at_length(mode: str, seq: int) -> dict:
    """Forward and backward of a 2-block medium model over ``seq`` tokens under cp2 ``mode`` on this
    rank's GPU: the loss, the bytes each block saved against the formula, and the step's peak
    allocated bytes above the model's."""
    from loom.memory.activations import activation_bytes_per_layer, measure_layer_bytes
    from loom.model.llama import build_model, loss_fn
    from loom.parallel.context.parallelize import apply_context_parallel, shard_sequence

    device = rank_device()
    mesh = get_mesh(cp=2)
    cfg = _medium(n_layers=2, max_seq_len=seq)
    model = build_model(cfg, 0, device)
    apply_context_parallel(model, mesh, mode=mode, seq_len=seq)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    ((x, y),) = shard_sequence([(tokens[:, :-1], tokens[:, 1:])], 2, mesh.local_rank("cp"))
    x, y = x.to(device), y.to(device)
    saved = measure_layer_bytes(model, x)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = loss_fn(model(x), y)
    loss.backward()
    torch.cuda.synchronize()
    grads = {n: p.grad.norm().item() for n, p in model.named_parameters() if p.grad is not None}
    return {
        "loss": loss.item(),
        "saved": sorted(set(saved.values())),
        "formula": activation_bytes_per_layer(cfg, 1, seq, cp=2, cp_mode=mode),
        "peak": torch.cuda.max_memory_allocated() - base,
        "grads": grads,
    }


@two_gpus
def test_ring_context_parallel_at_32k_against_alltoall(nccl):
    """Ring and all-to-all context parallelism over 32k tokens on 2 GPUs: the same loss and
    gradients, each block saving the module's formula for its mode, and the ring's peak
    (local keys and values plus one block in flight) no higher than all-to-all's (the whole
    sequence for half the heads)."""
    ring = nccl(2).run(_cp_at_length, "ring", 32768)
    alltoall = nccl(2).run(_cp_at_length, "alltoall", 32768)
    for r, a in zip(ring, alltoall, strict=True):
        print(f"cp2 at 32k: peak ring {r['peak'] / 2**20:.0f} MiB, all-to-all {a['peak'] / 2**20:.0f} MiB")
        for x in (r, a):  # CUDA's attention kernels may pad their log-sum-exp rows: within 2%
            assert len(x["saved"]) == 1 and x["saved"][0] == pytest.approx(x["formula"], rel=0.02), x["saved"]
        assert r["loss"] == pytest.approx(a["loss"], rel=1e-4)
        for name, g in a["grads"].items():
            assert r["grads"][name] == pytest.approx(g, rel=1e-3), name
        assert r["peak"] <= 1.05 * a["peak"]


def test_linear_cross_entropy_bf16_on_cuda_equals_fp64():
    """The head inside the loss on CUDA in bf16 (its dW from tensor-core GEMMs with fp32 products,
    summed over chunks in fp32) against the fp64 loss and gradients: within bf16's rounding, as
    close as PyTorch's own bf16 head + cross entropy is."""
    from loom.model.loss import linear_cross_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    N, h, V = 3000, 256, 5000  # three chunks of 1024 rows, the last short
    x = torch.randn(N, h, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, h, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    t[::7] = -100
    loss = linear_cross_entropy(x, w, t)
    loss.backward()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(x64 @ w64.t(), t, reduction="sum")
    ref.backward()
    x16, w16 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.nn.functional.cross_entropy((x16 @ w16.t()).float(), t, reduction="sum").backward()
    assert_close(loss.double(), ref, rtol=1e-4, atol=1e-3)
    for ours, torchs, exact in ((x.grad, x16.grad, x64.grad), (w.grad, w16.grad, w64.grad)):
        err, torch_err = ((a.double() - exact).norm() / exact.norm() for a in (ours, torchs))
        assert err <= max(1.5 * torch_err, 1e-2), (err, torch_err)


def test_softcapped_flex_attention_on_cuda_equals_fp64():
    """Gemma 2's soft-capped attention on CUDA: compiled flex with the cap as its ``score_mod``, causal
    and under a packed-document block mask, GQA 8 heads on 2, bf16, forward and gradients, against
    the explicit fp64 products (:func:`capped_attention`), as close as the explicit bf16 path is."""
    from loom.model.llama import attention, capped_attention, document_block_mask, flex

    g = torch.Generator(device="cuda").manual_seed(0)
    B, a, k, T, d, scale, cap = 2, 8, 2, 512, 64, 0.1, 5.0
    q, kk, v = (torch.randn(B, h, T, d, device="cuda", generator=g).bfloat16() for h in (a, k, k))
    docs = torch.cat([torch.zeros(B, 200), torch.ones(B, T - 200)], 1).long().cuda()
    dense_docs = docs[:, None, :, None] == docs[:, None, None, :]  # (B, 1, T, T)
    dy = torch.randn(B, a, T, d, device="cuda", generator=g).bfloat16()
    for packed in (False, True):
        ins = [t.detach().clone().requires_grad_() for t in (q, kk, v)]
        if packed:
            out = flex(*ins, document_block_mask(docs), scale, cap)
        else:
            out = attention(*ins, scale=scale, softcap=cap)  # CUDA, causal, no dropout: flex
        out.backward(dy)
        mask = dense_docs if packed else None
        ref_in = [t.detach().double().requires_grad_() for t in (q, kk, v)]
        ref = capped_attention(*ref_in, mask, 0.0, True, scale, cap)
        ref.backward(dy.double())
        half_in = [t.detach().clone().requires_grad_() for t in (q, kk, v)]
        half = capped_attention(*half_in, mask, 0.0, True, scale, cap)
        half.backward(dy)
        for ours, explicit, exact in zip(
            (out, *(t.grad for t in ins)),
            (half, *(t.grad for t in half_in)),
            (ref, *(t.grad for t in ref_in)),
        ):
            err, explicit_err = ((x.double() - exact).norm() / exact.norm() for x in (ours, explicit))
            assert err <= max(2 * explicit_err, 1e-2), (packed, err, explicit_err)


def test_rmsnorm_on_cuda_runs_torchs_fused_kernels_and_equals_fp64():
    """On CUDA, Loom's RMSNorm is one fused kernel forward and one backward (``_fused_rms_norm`` and
    its backward, where the fp32 chain makes 5 passes forward and 12 backward) and equals the fp64
    formula within bf16's rounding."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from loom.model.norms import rms_norm

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view:
                self.names.append(func.__name__)
            return out

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 2048, 768, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(768, device="cuda", generator=g)).bfloat16().requires_grad_()
    dy = torch.randn(4, 2048, 768, device="cuda", generator=g).bfloat16()
    with Ops() as fwd:
        y = rms_norm(x, w, 1e-5)
    with Ops() as bwd:
        y.backward(dy)
    assert [n for n in fwd.names if "rms" in n] == ["_fused_rms_norm.default"], fwd.names
    assert any("_fused_rms_norm_backward" in n for n in bwd.names), bwd.names
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
    y64.backward(dy.double())
    assert_close(y.double(), y64, rtol=1.6e-2, atol=1e-2)
    assert_close(x.grad.double(), x64.grad, rtol=1.6e-2, atol=1e-2)
    assert_close(w.grad.double(), w64.grad, rtol=2e-2, atol=1.0)


def test_windowed_and_capped_blocks_compile_whole_on_cuda():
    """A Gemma-2-shaped model (windowed and full layers, soft-capped scores and logits) on CUDA in bf16:
    each block compiled with ``fullgraph=True`` (a graph break would raise: the flex causal block
    masks come from ``layer_args``, built outside the blocks), forward and backward equal to eager as
    closely as bf16 allows."""
    from loom.model.llama import build_model
    from tests.helpers import GEMMA2_FIELDS, tiny_model

    torch.manual_seed(0)
    cfg = tiny_model(**GEMMA2_FIELDS, n_layers=3, sliding_window=5, window_layers="0,2", max_seq_len=256)
    eager = build_model(cfg, 0).cuda().bfloat16()
    compiled = build_model(cfg, 0).cuda().bfloat16()
    compiled.load_state_dict(eager.state_dict())
    for layer in compiled.layers:
        layer.compile(fullgraph=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 256), device="cuda")
    outs = []
    for model in (eager, compiled):
        logits = model(ids)
        logits.float().square().mean().backward()
        outs.append((logits.float(), model.layers[0].attention.wq.weight.grad.float()))
    for mine, ref in zip(outs[1], outs[0], strict=True):
        assert (mine - ref).norm() / ref.norm() < 2e-2
