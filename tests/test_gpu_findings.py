"""Issue 32's GPU findings 3, 4, 6, 7 and 10, each shown on the CPU (docs/gpus.md says what is
verified where): streamed export, device choice under srun, MoE FLOPs, communication streams and
memory visibility."""

from __future__ import annotations

import pytest

from tests.helpers import SEQ, tiny_model

# --- finding 6: MoE FLOPs count the top_k experts that run ------------------------------------------


@pytest.mark.parametrize("shared", [0, 1])
def test_moe_flops_count_top_k_experts(shared):
    """6 N_a + 12 L h T with N_a = every matmul weight but the (E − k) experts a token skips; equal to
    the dense model of the same active width (ffn = k·f) plus the router's 6 L h E; the planner the same."""
    from loom.config import MoEConfig
    from loom.model.llama import build_model, count_params, expert_params, flops_per_token
    from loom.plan.cost.params import ParamCounts

    E, k = 8, 2
    moe_cfg = tiny_model(n_experts=E, top_k=k)
    moe = build_model(moe_cfg, 0, meta=True, moe=MoEConfig(n_shared_experts=shared))
    L, h, f = moe_cfg.n_layers, moe_cfg.dim, moe_cfg.resolved_ffn_dim()
    n_all = count_params(moe, exclude_embedding=not moe_cfg.tie_embeddings)  # as the trainer counts
    assert expert_params(moe) == L * E * 3 * h * f
    got = flops_per_token(moe_cfg, SEQ, n_all, expert_params(moe))
    active = n_all - L * (E - k) * 3 * h * f
    assert got == pytest.approx(6 * active + 12 * L * h * SEQ)
    # the dense model whose MLP is the k experts side by side (+ the shared ones): same FLOPs but the router
    dense_cfg = tiny_model(ffn_dim=(k + shared) * f)
    dense = build_model(dense_cfg, 0, meta=True)
    dense_flops = flops_per_token(
        dense_cfg, SEQ, count_params(dense, exclude_embedding=not dense_cfg.tie_embeddings)
    )
    assert got == pytest.approx(dense_flops + 6 * L * h * E)
    # counting every expert (the old rule) is (E/k)-ish too high: the fix is not a no-op
    assert 6 * n_all + 12 * L * h * SEQ > 1.5 * got
    if not shared:  # the planner (no shared experts in its counts) applies the same rule
        pc = ParamCounts.of(moe_cfg, E, k)
        norms = L * pc.norms + pc.final_norm  # counted by the trainer, not by the planner (not matmuls)
        assert pc.experts == expert_params(moe)
        assert flops_per_token(moe_cfg, SEQ, pc.matmul, pc.experts) == pytest.approx(got - 6 * norms)


# --- finding 4: the GPU of a rank under srun, and --nproc above the GPUs -----------------------------


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA 'available' with ``n`` GPUs; ``set_device`` records its argument (no CUDA here)."""
    import torch

    chosen: list[int] = []

    def with_gpus(n: int, visible: str | None = None) -> list[int]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        return chosen

    return with_gpus


def test_one_visible_gpu_per_task_is_cuda_0(fake_cuda):
    """srun --gpus-per-task=1: LOCAL_RANK 3 of a node whose task sees one GPU runs on cuda:0; with every
    GPU visible (torchrun) LOCAL_RANK picks its own."""
    import torch

    from loom.device import resolve_device

    chosen = fake_cuda(1, "5")
    assert resolve_device("auto", 3) == torch.device("cuda", 0) and chosen == [0]
    chosen = fake_cuda(8)
    assert resolve_device("cuda", 3) == torch.device("cuda", 3) and chosen[-1] == 3


def test_too_few_visible_gpus_is_one_line(fake_cuda):
    from loom.device import resolve_device

    fake_cuda(2, "0,1")
    with pytest.raises(RuntimeError) as e:
        resolve_device("auto", 3)
    msg = str(e.value)
    assert "\n" not in msg and "LOCAL_RANK=3" in msg and "sees 2 GPUs" in msg and "'0,1'" in msg


def test_nproc_above_device_count_refused_before_launch(fake_cuda, monkeypatch, tmp_path):
    """--nproc 4 on a node with 2 GPUs: refused naming run.nproc before data is prepared or a rank starts;
    on the CPU (run.device = cpu) the same nproc is allowed to proceed."""
    import loom.config as C
    import loom.data
    from loom import launch

    started: list[str] = []
    monkeypatch.setattr(launch, "launch", lambda *a, **k: started.append("launch"))
    monkeypatch.setattr(loom.data, "prepare_data", lambda *a, **k: started.append("prepare") or 1 / 0)
    cfg = C.LoomConfig()
    cfg.run.nproc, cfg.run.dir = 4, str(tmp_path)
    cfg.parallel.dp = 4
    fake_cuda(2)
    with pytest.raises(C.ConfigError, match=r"^run\.nproc: 4 ranks .*device_count\(\) = 2 .*--nproc 2") as e:
        launch.main_train(cfg, 0)
    assert "\n" not in str(e.value) and started == [] and not any(tmp_path.iterdir())  # run.dir untouched
    cfg.run.device = "cpu"
    with pytest.raises(ZeroDivisionError):  # past the check: data preparation is next
        launch.main_train(cfg, 0)
    assert started == ["prepare"]


# --- finding 3: the final export is streamed, not built whole in host memory -------------------------


class LiveBytes:
    """Tensor bytes alive at once among those the checkpoint reader makes (an instrumented reader):
    each block :meth:`CheckpointReader.read` allocates (counted from its call) and each slice
    ``_read_box`` takes from a shard file (its elements: safetensors maps the file, so the rest of
    the piece under the slice is file pages, not memory), freed when the tensor is collected."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def add(self, t, nbytes: int) -> None:
        import weakref

        self.now += nbytes
        self.peak = max(self.peak, self.now)
        weakref.finalize(t, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        self.now -= nbytes


@pytest.mark.parametrize("how", ["tp2xzero3", "pp2xtp2"])
def test_export_is_streamed_and_identical(how, tmp_path, monkeypatch):
    """The streamed file is byte for byte what writing every tensor at once gave, from a checkpoint
    saved under tp x ZeRO-3 (flat pieces) or pp x tp; the reader's tensors alive at once stay
    within 2 · max(buffer, largest row) (module doc of loom.checkpoint.convert), far below the model."""

    from loom.checkpoint.convert import convert
    from loom.checkpoint.format import write_safetensors
    from loom.checkpoint.load import CheckpointReader
    from tests.test_checkpoint import full_state, layout, save_virtual

    full = full_state(2)
    kw = dict(tp=2, dp=2, zero=True) if how == "tp2xzero3" else dict(pp=2, tp=2)
    ckpt = save_virtual(tmp_path / "run", layout(full, **kw))
    model = {n.removeprefix("model."): t for n, t in full.items() if n.startswith("model.")}
    ref = tmp_path / "whole.safetensors"  # the old export: every tensor in memory, one write
    write_safetensors(ref, model, {"format": "pt", "step": "3", "source": ckpt.name})

    live, read, read_box = LiveBytes(), CheckpointReader.read, CheckpointReader._read_box

    def counted_read(self, name, region=None):
        n = (region.numel if region is not None else model[name.removeprefix("model.")].numel()) * 4
        live.now += n  # the block is allocated before its pieces are read into it
        live.peak = max(live.peak, live.now)
        live.now -= n
        out = read(self, name, region)
        live.add(out, n)
        return out

    def counted_box(self, *args):
        t = read_box(self, *args)
        live.add(t, t.numel() * t.element_size())
        return t

    monkeypatch.setattr(CheckpointReader, "read", counted_read)
    monkeypatch.setattr(CheckpointReader, "_read_box", counted_box)
    buffer = 1024
    out = tmp_path / "model.safetensors"
    _, step, n = convert(tmp_path / "run", out, buffer_bytes=buffer)
    assert out.read_bytes() == ref.read_bytes() and (step, n) == (3, len(model))
    largest_row = max(t[0].numel() * 4 for t in model.values() if t.dim() > 0)
    total = sum(t.numel() * 4 for t in model.values())
    assert 0 < live.peak <= 2 * max(buffer, largest_row) < total / 10
    assert live.now == 0  # every block freed


# --- finding 10: expandable segments by default; every rank's peak, reserved beside allocated --------


def test_expandable_segments_default_never_overrides():
    from loom.device import ALLOC_CONF, default_allocator_conf

    env: dict[str, str] = {}
    line = default_allocator_conf(env)
    assert env == {ALLOC_CONF: "expandable_segments:True"} and line is not None and "expandable" in line
    for user in ({ALLOC_CONF: "max_split_size_mb:128"}, {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}):
        env = dict(user)
        assert default_allocator_conf(env) is None and env == user  # an explicit setting stays


def test_cuda_run_sets_allocator_once_and_logs_it(fake_cuda, monkeypatch, caplog):
    import logging
    import os

    from loom.device import ALLOC_CONF, resolve_device

    monkeypatch.delenv(ALLOC_CONF, raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    fake_cuda(2)
    with caplog.at_level(logging.INFO, logger="loom"):
        resolve_device("auto", 0)
        resolve_device("auto", 1)
    assert os.environ[ALLOC_CONF] == "expandable_segments:True"
    assert [r.getMessage().count("expandable_segments") for r in caplog.records] == [1]
    monkeypatch.setenv(ALLOC_CONF, "backend:cudaMallocAsync")
    resolve_device("auto", 0)
    assert os.environ[ALLOC_CONF] == "backend:cudaMallocAsync"
    monkeypatch.delenv(ALLOC_CONF)
    resolve_device("cpu", 0)  # the CPU: nothing set
    assert ALLOC_CONF not in os.environ


def _rank_peaks(world: int, alloc: list[int], reserved: list[int]) -> dict[str, int]:
    from datetime import timedelta

    import torch.distributed as dist

    from loom.train.metrics import max_over_ranks

    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))  # as the trainer's
    rank = dist.get_rank()
    mine = {"peak_mem_bytes": alloc[rank], "peak_reserved_bytes": reserved[rank]}
    return max_over_ranks(mine, rank, world, control, timeout_s=60)


def test_every_ranks_peak_is_logged(pools):
    """Rank 1's larger peak is reported with its rank; equal reserved peaks name the lowest rank; the
    line shows reserved beside allocated and the maxima (values from 40 GiB up: no overflow of v·world)."""
    from loom.train.metrics import step_line

    gib = 1 << 30
    alloc, reserved = [3 * gib, 40 * gib + 7], [50 * gib, 50 * gib]
    got = pools(2).run(_rank_peaks, 2, alloc, reserved)
    want = {
        "peak_mem_max_bytes": 40 * gib + 7,
        "peak_mem_max_rank": 1,
        "peak_reserved_max_bytes": 50 * gib,
        "peak_reserved_max_rank": 0,
    }
    assert got == [want, want]
    row = dict(step=1, loss=1.0, lr=1e-3, grad_norm=1.0, tokens_per_s=1.0, mfu=0.5, param_bytes=gib)
    row |= {"peak_mem_bytes": alloc[0], "peak_reserved_bytes": reserved[0], **want}
    line = step_line(row)
    assert "mem 3.0GiB (reserved 50.0GiB, state 1.0GiB)" in line
    assert "max mem 40.0GiB rank 1, reserved 50.0GiB rank 0" in line


# --- finding 7: the compute stream waits only for the reductions it reads ---------------------------


def _reducer_waits(rep: int, shard: int, stage: int) -> list[list[tuple[str, int, str]]]:
    """Two steps with small buckets; per reducer, its event-order log: ("launch", k, "") when bucket k
    is launched, then (collective, bucket, stream) for every wait the reducer makes (loom.parallel.reducer)."""
    from dataclasses import replace

    from loom import config as C
    from loom.comm import CommMeter
    from loom.model.llama import build_model, loss_fn
    from loom.parallel.reducer import GradReducer
    from loom.train.build import parallelize
    from tests.dist import get_mesh
    from tests.helpers import metered_steps, tiny_train

    mesh = get_mesh(dp_replicate=rep, dp_shard=shard)
    cfg = C.LoomConfig(model=tiny_model(), train=tiny_train(steps=2))
    cfg.parallel = replace(cfg.parallel, dp=rep * shard, dp_shard=shard, zero=stage, bucket_mb=0.01)
    model = build_model(cfg.model, cfg.train.seed)
    strategy = parallelize(model, mesh, cfg, CommMeter()).strategy
    reducers = getattr(strategy, "_reducers", [strategy.reducer])
    launch, drain = GradReducer.launch, GradReducer.drain

    def marked(self, full, dest, owned=True):
        self.stream.log.append(("launch", self.launched, ""))
        launch(self, full, dest, owned)

    def drained(self):
        self.stream.log.append(("drain", self.launched, ""))
        drain(self)

    GradReducer.launch, GradReducer.drain = marked, drained  # type: ignore[method-assign]
    try:
        metered_steps(model, strategy, CommMeter(), mesh, cfg, loss_fn, 2, 8, 8 // (rep * shard))
    finally:
        GradReducer.launch, GradReducer.drain = launch, drain  # type: ignore[method-assign]
        strategy.remove()
    return [r.stream.log for r in reducers]


@pytest.mark.parametrize("stage", [2, 3])
def test_compute_waits_only_for_reductions_it_reads(pools, stage):
    """Hybrid sharding (2 replicas x 2 shards): each bucket's reduce-scatter is waited for on the
    communication stream (the replica all-reduce chained to it), never on the compute stream; the
    compute stream waits once per bucket, for its all-reduce, where the shard is read: bucket b when
    bucket b + max_inflight is launched (the bound on buffers in flight) or at the drain."""
    from loom.parallel.reducer import MAX_INFLIGHT

    for logs in pools(4).run(_reducer_waits, 2, 2, stage):
        checked = 0
        for log in logs:
            launched, draining = -1, False
            compute: dict[int, int] = {}
            for what, bucket, where in log:
                if what in ("launch", "drain"):
                    launched, draining = (bucket, False) if what == "launch" else (launched, True)
                    continue
                if what == "reduce_scatter":
                    assert where == "comm", log  # never the compute stream's: chained on the side stream
                    continue
                assert (what, where) == ("all_reduce", "compute"), log
                compute[bucket] = compute.get(bucket, 0) + 1
                # read when it retires (bucket + MAX_INFLIGHT is launched) or at the step's drain
                assert draining or launched == bucket + MAX_INFLIGHT, log
                checked += 1
            buckets = {b for w, b, _ in log if w == "launch"}
            assert compute == dict.fromkeys(buckets, 1), log  # each bucket's result read exactly once
            assert sum(1 for w, b, s in log if w == "reduce_scatter") == len(buckets)
        assert checked >= 6


def test_attention_flops_follow_the_heads_width_not_the_model_width():
    """12 L a d T: with an explicit head width (Mistral-Nemo: a·d = 4096 against dim 5120) the scores
    and values cost a·d, not dim; by default a·d = dim and nothing changes."""
    from loom.model.llama import flops_per_token

    base = tiny_model()
    wide = tiny_model(attn_head_dim=2 * base.dim // base.n_heads)
    T = 64
    assert flops_per_token(base, T, 0.0) == 12 * base.n_layers * base.dim * T
    assert flops_per_token(wide, T, 0.0) == 12 * base.n_layers * 2 * base.dim * T
