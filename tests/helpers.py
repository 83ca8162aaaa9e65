"""Shared pieces for equality tests: a tiny model config, synthetic global batches, a reference loop."""

from __future__ import annotations

import contextlib
import os
import tempfile

import pytest
import torch

from loom.config import ModelConfig, TrainConfig

VOCAB, SEQ = 128, 16
# Weights of the tiny model after 20 fp32 Adam steps (lr 3e-3), one layout against another: a
# gradient near 0 whose last bits change with the summation order moves that weight's Adam update
# (measured 1.2-1.7e-5, under 1% of lr, at one weight of 3072, layers.1.feed_forward.w1[46, 27],
# in ZeRO and parameter-server runs); every other weight within 1e-5.
ADAM_FP32_TOL = dict(rtol=1e-4, atol=2e-5)


def tiny_model(**kw) -> ModelConfig:
    base = dict(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=SEQ, multiple_of=16
    )
    base.update(kw)
    return ModelConfig(**base)


# a tiny transformers config (head_dim 16, two kv heads of four): the Hugging Face tests' models
HF_TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def assert_layouts_equal(ref: dict, ranks, names: list[str]) -> None:
    """Every layout's losses (each rank's) and whole final state (the ranks that gather it) equal the
    one-process ``ref`` of :func:`train_layout`; ``ranks``: per rank, one result per name. Every
    layout is compared on some rank."""
    from torch.testing import assert_close

    compared = set()
    for rank in ranks:
        for name, r in zip(names, rank, strict=True):
            assert_close(
                torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6, msg=name
            )
            if r["state"] is None:  # only the ranks that gather the whole state hold it
                continue
            compared.add(name)
            assert r["state"].keys() == ref["state"].keys(), name
            for k, v in ref["state"].items():
                assert_close(r["state"][k], v, **ADAM_STATE_TOL, msg=lambda m, k=k, n=name: f"{n} {k}: {m}")
    assert compared == set(names)


def saved_random(ref, path) -> None:
    """Every tensor of the ``transformers`` model ``ref`` random (norm weights around 1, so an importer
    dropping one shows), saved at ``path`` in several shards."""
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    ref.save_pretrained(path, max_shard_size="20KB")


def imported_with_their_logits(hf, ref) -> tuple:
    """Loom's model of the opened Hugging Face directory ``hf`` (with the routing it fixes,
    :func:`~loom.model.hf.moe_options`), loaded from it, with tokens x (2, 32) and its logits, which
    equal ``ref``'s (the ``transformers`` model saved there): (model, x, logits)."""
    from torch.testing import assert_close

    from loom.config import MoEConfig
    from loom.model.hf import load_into, moe_options
    from loom.model.llama import Transformer

    model = Transformer(hf.config, MoEConfig(**moe_options(hf))).eval()
    load_into(model, hf)
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(x)
        assert_close(logits, ref(x).logits)
    return model, x, logits


def assert_field_bites(model, x: torch.Tensor, logits: torch.Tensor, **change) -> None:
    """The same weights under ``model``'s config with ``change`` give logits more than 1e-3 away: the
    changed fields do something at the tiny model's scale."""
    from dataclasses import replace

    from loom.model.llama import Transformer

    other = Transformer(replace(model.cfg, **change)).eval()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (other(x) - logits).abs().max() > 1e-3, change


def assert_export_round_trips(model, x: torch.Tensor, dst, family: type) -> None:
    """Loom's export of ``model`` (hf_config, hf_tensors) into ``dst`` loads in ``transformers`` as
    ``family`` with the model's logits on ``x`` (B, T), and the KV-cached forward (a prefill of 20
    tokens, then the rest) gives them too."""
    import json

    import transformers
    from safetensors.torch import save_file
    from torch.testing import assert_close

    from loom.model.hf import hf_config, hf_tensors
    from loom.model.kv_cache import forward_cached, new_cache

    dst.mkdir()
    state = ((k, v.detach()) for k, v in model.state_dict().items())
    save_file(dict(hf_tensors(model.cfg, state)), str(dst / "model.safetensors"))
    moe = next(
        (layer.feed_forward.options for layer in model.layers if hasattr(layer.feed_forward, "options")), None
    )
    (dst / "config.json").write_text(json.dumps(hf_config(model.cfg, moe=moe)))
    back = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    assert type(back) is family
    with torch.no_grad():
        logits = model(x)
        assert_close(back(x).logits, logits)
        cache = new_cache(model, x.shape[0], x.shape[1])
        cached = torch.cat(
            [forward_cached(model, x[:, :20], cache), forward_cached(model, x[:, 20:], cache)], 1
        )
    assert_close(cached, logits)


# Gemma 2's fields on the tiny model: offset norms, sqrt(h) embeddings, GeGLU, sandwich norms, the
# attention scale and soft-caps (small enough to bite at the tiny model's scale)
GEMMA2_FIELDS = {
    "norm_offset": True,
    "embed_scale": True,
    "mlp": "geglu_tanh",
    "norm_placement": "sandwich",
    "attn_scale": 0.3,
    "attn_softcap": 2.0,
    "logit_softcap": 3.0,
}


# Weights after AdamW steps against the one-process reference. Adam's m / sqrt(v) turns a gradient's
# float32 rounding, which differs with the GEMM kernel the CPU picks for each batch shape (AVX2 on the
# AMD EPYC machines, AVX-512/AMX on the Intel Xeon ones), into up to ~1% of one step's update where
# the gradient is a near-cancelling sum: one element of 3,072 in the tiny model, 1.8e-5 at lr 3e-3 on
# the Intel machine (within 1e-5 on the AMD one). Losses keep rtol 1e-4, atol 1e-5.
ADAM_STATE_TOL = dict(rtol=1e-4, atol=3e-5)


def tiny_train(**kw) -> TrainConfig:
    base = dict(steps=20, lr=3e-3, min_lr=3e-4, warmup_steps=3, grad_clip=1.0, seed=7)
    base.update(kw)
    return TrainConfig(**base)


def global_batch(step: int, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def packed_global_batch(step: int, batch: int, seed: int = 0, eot: int = 0) -> tuple[torch.Tensor, ...]:
    """Packed data (``data.pack``): (tokens, targets, positions), a document ending at each ``eot``,
    about one token in five (several documents per sequence)."""
    from loom.data.dataset import packed_positions

    g = torch.Generator().manual_seed(seed * 100_003 + step + 7_919)
    tokens = torch.randint(1, VOCAB, (batch, SEQ + 1), generator=g)
    tokens[torch.rand(batch, SEQ + 1, generator=g) < 0.2] = eot
    x, y = tokens[:, :-1], tokens[:, 1:]
    return x, y, packed_positions(x, eot)


def masked(y: torch.Tensor, step: int) -> torch.Tensor:
    """Chat-like targets (only answers trained, -100 elsewhere): row r of a global batch trains its
    positions from (5 r + step) mod T on, row 1 none at all; so micro-batches and ranks hold unequal
    numbers of trained targets."""
    from loom.model.loss import IGNORE_INDEX

    y = y.clone()
    for r in range(y.shape[0]):
        y[r, : (5 * r + step) % y.shape[1]] = IGNORE_INDEX
    y[1 % y.shape[0]] = IGNORE_INDEX
    return y


def rank_micro_batches(
    step: int, batch: int, micro: int, dp_rank: int, dp: int, packed: bool = False, mask: bool = False
):
    """This data-parallel rank's rows of the global batch, cut into micro-batches (``packed``: of
    :func:`packed_global_batch`, with positions; ``mask``: targets :func:`masked` as chat data's)."""
    full = packed_global_batch(step, batch) if packed else global_batch(step, batch)
    if mask:
        full = (full[0], masked(full[1], step), *full[2:])
    per = batch // dp
    rows = [t[dp_rank * per : (dp_rank + 1) * per] for t in full]
    return [tuple(t[i : i + micro] for t in rows) for i in range(0, per, micro)]


def train_dp(
    mesh,
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    batch: int,
    micro: int,
    bucket_mb: float = 25.0,
    packed: bool = False,
    mask: bool = False,
):
    """Train with Loom data parallelism over ``mesh``'s dp group; return losses, final params, DP object."""
    from loom.comm import CommMeter
    from loom.model.llama import build_model, loss_fn
    from loom.optim.groups import build_optimizer
    from loom.parallel.data.strategy import DataParallel
    from loom.train.schedule import lr_at
    from loom.train.step import plain_run, train_step

    model = build_model(model_cfg, train_cfg.seed)
    meter = CommMeter()
    group = mesh.group("dp") if mesh is not None else None
    dp_rank = mesh.local_rank("dp") if mesh is not None else 0
    dp = mesh.size("dp") if mesh is not None else 1
    sync = DataParallel(model, group, meter=meter, bucket_mb=bucket_mb)
    sync.attach_optimizer(build_optimizer(model, train_cfg))
    losses, comm_bytes = [], []
    for step in range(train_cfg.steps):
        meter.reset()
        res = train_step(
            plain_run(model, sync, loss_fn),
            rank_micro_batches(step, batch, micro, dp_rank, dp, packed, mask),
            train_cfg.grad_clip,
            lr_at(step, train_cfg),
            group,
        )
        losses.append(res.loss)
        comm_bytes.append(meter.total_moved)
    sync.remove()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "state": state, "comm_bytes": comm_bytes, "sync": sync}


def metered_steps(model, strategy, meter, mesh, cfg, loss_fn, steps: int, batch: int, micro: int):
    """``steps`` steps of :func:`loom.train.step.train_step` on this dp rank's rows of each global
    batch; per step the loss, the meter's bytes moved by kind, and its collective calls by kind."""
    from loom.train.schedule import lr_at
    from loom.train.step import plain_run, train_step

    dp = mesh.size("dp")
    losses, moved, calls = [], [], []
    for step in range(steps):
        meter.reset()
        micro_batches = rank_micro_batches(step, batch, micro, mesh.local_rank("dp"), dp)
        res = train_step(
            plain_run(model, strategy, loss_fn),
            micro_batches,
            cfg.train.grad_clip,
            lr_at(step, cfg.train),
            mesh.group("dp"),
        )
        losses.append(res.loss)
        moved.append(dict(meter.moved))
        calls.append(dict(meter.calls))
    return losses, moved, calls


def grads_of(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """[fn(q, k, v), dq, dk, dv] of an attention for the output gradient ``grad`` (inputs cloned)."""
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*ins)
    out.backward(grad)
    return [out.detach(), *(t.grad for t in ins)]


def train_layout(
    layout: dict,
    steps: int,
    batch: int,
    micro: int,
    model_kw: dict | None = None,
    sentinel: bool = False,
    device: torch.device | None = None,
    meta: bool = False,
    moe_kw: dict | None = None,
    packed: bool = False,
    checkpoint_dir: str = "",
    mask: bool = False,
) -> dict:
    """Train the tiny model (``model_kw`` over its defaults) under ``layout`` (mesh degrees, ``zero``,
    ``sp``, ``recompute``) through ``build_run``, the Trainer's path, on this rank's share of each
    global batch; returns losses, the full final state, and per step the meter's bytes and calls.

    ``sentinel``: build_run and every step run with the meta device as torch's default device,
    so a tensor created without an explicit device (the CPU, by default, on a GPU run) fails.
    ``meta``: the model is built on the meta device and each rank materializes its part (the trainer's path).
    ``moe_kw``: the [moe] options (over their defaults). ``checkpoint_dir``: save the final state there. ``packed``: batches of packed documents
    (:func:`packed_global_batch`: tokens, targets, positions); ``mask``: chat-like targets (:func:`masked`)."""
    from loom.comm import CommMeter
    from loom.config import LoomConfig, MoEConfig
    from loom.model.llama import build_model
    from loom.parallel.context.parallelize import shard_sequence
    from loom.train.build import build_run
    from loom.train.schedule import lr_at
    from loom.train.step import train_step
    from tests.dist import get_mesh, rank_device

    dims = {k: v for k, v in layout.items() if k in ("cp", "tp", "pp", "dp_shard", "dp_replicate", "ep")}
    mesh = get_mesh(**dims)
    cfg = LoomConfig(
        model=tiny_model(**(model_kw or {})), train=tiny_train(steps=steps), moe=MoEConfig(**(moe_kw or {}))
    )
    cfg.data.seq_len = SEQ
    cfg.parallel.cp, cfg.parallel.tp, cfg.parallel.pp = (
        layout.get("cp", 1),
        layout.get("tp", 1),
        layout.get("pp", 1),
    )
    cfg.parallel.dp, cfg.parallel.ep = mesh.size("dp"), layout.get("ep", 1)
    cfg.parallel.cp_mode = layout.get("cp_mode", cfg.parallel.cp_mode)
    cfg.parallel.dp_shard = layout.get("dp_shard", 1)
    cfg.parallel.zero, cfg.parallel.sp = layout.get("zero", 0), layout.get("sp", False)
    cfg.parallel.expert_tp = layout.get("expert_tp", "replicate")
    cfg.train.global_batch, cfg.train.micro_batch = batch, micro
    cfg.parallel.schedule = layout.get("schedule", cfg.parallel.schedule)
    cfg.parallel.virtual_stages = layout.get("virtual_stages", 1)
    cfg.parallel.offload = layout.get("offload", "none")
    cfg.parallel.offload_params = layout.get("offload_params", "none")
    for key in (
        "zeropp_qwz",
        "zeropp_hpz",
        "zeropp_qgz",
        "zeropp_qgz_bits",
        "hpz_group",
        "offload_dir",
    ):  # ZeRO-3 options
        if key in layout:
            setattr(cfg.parallel, key, layout[key])
    cfg.parallel.reduce_dtype = layout.get("reduce_dtype", "fp32")
    cfg.parallel.allreduce = layout.get("allreduce", "native")
    cfg.parallel.dp_mode, cfg.parallel.ps_shards = (
        layout.get("dp_mode", "allreduce"),
        layout.get("ps_shards", 1),
    )
    cfg.train.recompute = layout.get("recompute", "none")
    cfg.train.fp8_recipe = layout.get("fp8_recipe", cfg.train.fp8_recipe)
    cfg.train.fp8_layers = layout.get("fp8_layers", "all")  # tiny models: auto would leave every Linear bf16
    cfg.train.precision, cfg.train.optimizer = (
        layout.get("precision", "fp32"),
        layout.get("optimizer", "adamw"),
    )
    cfg.run.dir = os.path.join(tempfile.gettempdir(), "loom-test-layout")
    meter = CommMeter()
    device = device or rank_device()  # the CPU, or this rank's GPU in an NCCL pool
    if device.type == "cuda":
        cfg.run.device = "cuda"
    model = build_model(cfg.model, cfg.train.seed, device, meta=meta, moe=cfg.moe)
    placed = torch.device("meta") if sentinel else contextlib.nullcontext()
    with placed:
        run = build_run(cfg, mesh, model, meter)
    dp_rank, dp = mesh.local_rank("dp"), mesh.size("dp")
    losses, moved, calls, expert_rows, norms, payload = [], [], [], [], [], []
    for step in range(steps):
        meter.reset()
        batches = shard_sequence(
            rank_micro_batches(step, batch, micro, dp_rank, dp, packed, mask),
            mesh.size("cp"),
            mesh.local_rank("cp"),
        )
        batches = [tuple(t.to(device) for t in b) for b in batches]
        with placed:
            res = train_step(run, batches, cfg.train.grad_clip, lr_at(step, cfg.train), mesh.group("dp_cp"))
        losses.append(res.loss)
        norms.append(float(res.grad_norm))
        expert_rows.append(
            sum(_take_rows(m) for m in run.model.modules())
        )  # rows this rank's experts computed
        moved.append(dict(meter.moved))
        calls.append(dict(meter.calls))
        payload.append(dict(meter.payload))
    if checkpoint_dir:
        import torch.distributed as dist

        from loom.checkpoint import Checkpointer
        from loom.checkpoint.save import new_group

        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        Checkpointer(checkpoint_dir, rank, world, new_group(world, 60)).save(
            steps, run.strategy.sharded_state(), {}, {}
        )
    events = list(
        getattr(run.strategy, "events", [])
    )  # the last step's (ZeRO-3), before the state is gathered
    state = run.strategy.full_state_dict()
    state = None if state is None else {k: v.cpu() for k, v in state.items()}
    return {
        "losses": losses,
        "grad_norms": norms,
        "state": state,
        "moved": moved,
        "calls": calls,
        "payload": payload,
        "state_bytes": run.strategy.state_bytes(),
        "expert_rows": expert_rows,
        "events": events,
    }


def tp_replicated_shards(
    layout: dict, steps: int, batch: int = 8, micro: int = 4
) -> tuple[torch.Tensor, list[dict]]:
    """After ``steps`` of :func:`train_layout`, this rank's flat parameter shards over the runs of the
    parameters every tp rank keeps whole (norm weights): bitwise equal on tp peers when replicas
    stay in step (tp peers hold the same shard offsets); and the meter's bytes moved per step."""
    import loom.train.build as build

    built, make = {}, build.build_run

    def keep(*a, **k):
        built["run"] = make(*a, **k)
        return built["run"]

    build.build_run = keep
    try:
        result = train_layout(layout, steps, batch, micro)
    finally:
        build.build_run = make
    strategy = built["run"].strategy
    shards = torch.cat(
        [
            shard.detach()[lo:hi].float().cpu()
            for lay, shard in zip(strategy.layouts, strategy.optim.params)
            for lo, hi in lay.local_ranges(lambda s: not s.tp_sharded)
        ]
    )
    return shards, result["moved"]


def _take_rows(module) -> int:
    """An expert-parallel MoE layer's rows computed since the last call (0 for other modules)."""
    rows = getattr(module, "rows_computed", 0)
    if rows:
        module.rows_computed = 0
    return rows


def _scaled_mm_in_fp32(
    a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False
):
    """``torch._scaled_mm`` as the product it defines, (a·s_a)(b·s_b) in fp32 (+ bias) cast to ``out_dtype``."""
    out = (a.float() * scale_a) @ (b.float() * scale_b)
    if bias is not None:
        out = out + bias.float()
    if scale_result is not None:
        out = out * scale_result
    return out.to(out_dtype if out_dtype is not None else a.dtype)


@contextlib.contextmanager
def scaled_mm_in_fp32():
    """torch's CPU ``_scaled_mm`` is a reference loop (12 ms for a 64 x 128 x 96 tensorwise product,
    about 1 s of a debug-model step); the same product in fp32 gives bit-identical losses over 8
    steps of both fp8 recipes here, 40x faster. The fp8 casts and scales (torchao's, Loom's) still run."""
    real = torch._scaled_mm
    torch._scaled_mm = _scaled_mm_in_fp32
    try:
        yield
    finally:
        torch._scaled_mm = real


def with_scaled_mm_in_fp32(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` under :func:`scaled_mm_in_fp32` (a pool rank's call)."""
    with scaled_mm_in_fp32():
        return fn(*args, **kwargs)


@pytest.fixture
def fast_cpu_scaled_mm():
    with scaled_mm_in_fp32():
        yield


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread in this process: the 2 cores are shared with the rank pools and other runs,
    and oversubscribed threads make small steps 10-40x slower. Use with ``pytestmark``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def prepared_config(overrides: dict, cache_dir) -> dict:
    """``overrides`` (a config as a dict) with its corpus prepared once into ``cache_dir`` (a private
    cache) and ``data.prepared_dir`` pointing there: runs launched from it skip preparation."""
    import json
    import os

    from loom import config as C
    from loom.data import prepare_data

    os.environ.setdefault("LOOM_CACHE_DIR", str(cache_dir))
    prepared = prepare_data(C.from_dict(json.loads(json.dumps(overrides))).data, progress=False)
    out = json.loads(json.dumps(overrides))
    out["data"]["prepared_dir"] = str(prepared.dir)
    return out


# The smallest job the CLI and the Trainer run end to end (one block of width 32, 0.1 MB of text,
# 2 steps, 1 rank): the base that tests vary with :func:`with_sections`.
TINY_JOB = {
    "model": {"dim": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 32},
    "data": {"seq_len": 32, "vocab_size": 300, "max_corpus_mb": 0.1},
    "train": {"steps": 2, "global_batch": 2, "micro_batch": 2, "log_every": 1, "eval_every": 0},
    "run": {"progress": False, "tensorboard": False, "threads": 1},
}
# Two blocks of width 64 on 2 ranks, a batch of 4 micro-batches: restarts and preemption.
SMALL_JOB = {
    "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64},
    "data": {"seq_len": 64, "vocab_size": 512, "max_corpus_mb": 0.3},
    "train": {"global_batch": 8, "micro_batch": 2, "warmup_steps": 2, "log_every": 1, "eval_every": 0},
    "run": {"progress": False, "tensorboard": False, "threads": 1, "nproc": 2},
}


def with_sections(cfg: dict, **sections) -> dict:
    """A copy of the config dict ``cfg`` with each ``section={key: value}`` merged in."""
    import json

    out = json.loads(json.dumps(cfg))
    for section, table in sections.items():
        out.setdefault(section, {}).update(table)
    return out


def read_metrics(run_dir) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl``."""
    import json
    from pathlib import Path

    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]
