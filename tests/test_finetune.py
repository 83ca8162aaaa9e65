"""Fine-tuning (issue 19): LoRA on every layout equal to single-process LoRA, adapters-only optimizer
and gradient bytes, QLoRA's NF4 base, PEFT interop, LoRA checkpoints bound to their base."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from loom import config as C
from tests.helpers import SEQ, one_thread, rank_micro_batches, tiny_model, tiny_train  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH, MICRO, STEPS = 8, 2, 8
TOL = dict(rtol=1e-4, atol=1e-5)
TRAIN_TOL = dict(rtol=1e-4, atol=5e-5)  # weights after 8 Adam steps (as tests/test_tensor_parallel.py)
LORA = dict(method="lora", lora_rank=4, lora_alpha=8.0, lora_targets="all-linear")


def lora_cfg(
    layout: dict | None = None, model_kw: dict | None = None, steps: int = STEPS, **ft
) -> C.LoomConfig:
    """The tiny model with LoRA (``ft`` over :data:`LORA`) under ``layout`` (mesh degrees, zero, sp)."""
    layout = layout or {}
    cfg = C.LoomConfig(model=tiny_model(**(model_kw or {})), train=tiny_train(steps=steps))
    cfg.finetune = C.FinetuneConfig(**(LORA | ft))
    cfg.data.seq_len = SEQ
    cfg.train.global_batch, cfg.train.micro_batch = BATCH, layout.get("micro", MICRO)
    p = cfg.parallel
    p.tp, p.pp, p.sp, p.zero = (
        layout.get("tp", 1),
        layout.get("pp", 1),
        layout.get("sp", False),
        layout.get("zero", 0),
    )
    p.dp_shard, p.cp, p.ep = layout.get("dp_shard", -1), layout.get("cp", 1), layout.get("ep", 1)
    p.reshard_after_forward = layout.get("reshard_after_forward", True)
    p.schedule = layout.get("schedule", "1f1b")
    cfg.train.recompute = layout.get("recompute", "none")
    cfg.train.precision = layout.get("precision", "fp32")
    cfg.train.optimizer = layout.get("optimizer", "adamw")
    cfg.run.dir = os.path.join(tempfile.gettempdir(), "loom-test-finetune")
    return cfg


def train_lora(layout: dict | None = None, model_kw: dict | None = None, steps: int = STEPS, **ft) -> dict:
    """Train under ``layout`` through ``build_run`` (the trainer's path, model built on the meta device)
    on this rank's share of each global batch: losses, the full adapters, state bytes, flat sizes."""
    from loom.comm import CommMeter
    from loom.mesh import ParallelDims, ParallelMesh
    from loom.model.llama import build_model
    from loom.train.build import build_run
    from loom.train.schedule import lr_at
    from loom.train.step import train_step
    from tests.dist import get_mesh

    layout = layout or {}
    from loom.parallel.context.parallelize import shard_sequence

    dims = {k: v for k, v in layout.items() if k in ("tp", "pp", "cp", "ep", "dp_shard", "dp_replicate")}
    mesh = get_mesh(**dims) if dims else ParallelMesh(ParallelDims(), "cpu")
    cfg = lora_cfg(layout, model_kw, steps, **ft)
    C.validate(cfg, mesh.size("dp") * mesh.size("tp") * mesh.size("pp") * mesh.size("cp"))
    model = build_model(cfg.model, cfg.train.seed, meta=True)
    meter = CommMeter()
    run = build_run(cfg, mesh, model, meter)
    dp_rank, dp = mesh.local_rank("dp"), mesh.size("dp")
    losses, moved = [], []
    for step in range(steps):
        meter.reset()
        batches = rank_micro_batches(step, BATCH, cfg.train.micro_batch, dp_rank, dp)
        batches = shard_sequence(batches, mesh.size("cp"), mesh.local_rank("cp"))
        losses.append(
            train_step(run, batches, cfg.train.grad_clip, lr_at(step, cfg.train), mesh.group("dp_cp")).loss
        )
        moved.append(meter.total_moved)
    state = run.strategy.full_state_dict()
    adapters = None if state is None else {k: v.clone() for k, v in state.items() if ".lora_" in k}
    base = None if state is None else {k: v.clone() for k, v in state.items() if ".lora_" not in k}
    layouts = getattr(run.strategy, "layouts", getattr(getattr(run.strategy, "inner", None), "layouts", []))
    return {
        "losses": losses,
        "moved": moved,
        "adapters": adapters,
        "base": base,
        "bytes": run.strategy.state_bytes(),
        "flat": [(lay.numel, lay.padded, lay.world) for lay in layouts],
        "trainable": sum(p.numel() for p in run.model.parameters() if p.requires_grad),
        "frozen": sum(p.numel() for p in dict.fromkeys(run.model.parameters()) if not p.requires_grad),
        "frozen_flat": [
            (f.layout.numel, f.layout.padded * f.full.element_size())
            for u in getattr(run.strategy, "units", [])
            for f in u.frozen
        ],
    }


# ----------------------------------------------------------------------------- one rank


def test_lora_linear_equals_hand_reference():
    """y = x Wᵀ + b + (α/r)·B A x with the base frozen; adapters named as PEFT's; B starts at zero."""
    from loom.finetune.lora import LoRALinear, lora_init_value

    torch.manual_seed(0)
    base = torch.nn.Linear(12, 8)
    cfg = C.FinetuneConfig(**(LORA | {"lora_rank": 3, "lora_alpha": 6.0}))
    lin = LoRALinear(base, cfg)
    a = lora_init_value(7, "x.lora_A.weight", (3, 12))
    assert a.abs().max() <= 1 / 12**0.5 and a.std() > 0.1  # U(-1/sqrt(d_in), 1/sqrt(d_in))
    assert not lora_init_value(7, "x.lora_B.weight", (8, 3)).any()
    b = torch.randn(8, 3)
    lin.lora_A.weight = torch.nn.Parameter(a)
    lin.lora_B.weight = torch.nn.Parameter(b)
    x = torch.randn(2, 5, 12)
    expected = x @ base.weight.T + base.bias + (6.0 / 3) * (x @ a.T) @ b.T
    assert_close(lin(x), expected)
    assert [n for n, p in lin.named_parameters() if p.requires_grad] == ["lora_A.weight", "lora_B.weight"]
    assert lin.weight is base.weight and not lin.weight.requires_grad


def test_lora_dropout_only_while_training():
    """Dropout p on the adapter's input: none in eval; in training the adapter term of a kept input
    is scaled by 1/(1-p) and a dropped one is zero (the base term never drops)."""
    from loom.finetune.lora import LoRALinear

    torch.manual_seed(0)
    base = torch.nn.Linear(6, 4)
    lin = LoRALinear(
        base, C.FinetuneConfig(**(LORA | {"lora_rank": 2, "lora_alpha": 2.0, "lora_dropout": 0.5}))
    )
    a, b = torch.randn(2, 6), torch.randn(4, 2)
    lin.lora_A.weight, lin.lora_B.weight = torch.nn.Parameter(a), torch.nn.Parameter(b)
    x = torch.randn(50, 6)
    lin.eval()
    assert_close(lin(x), base(x) + (x @ a.T) @ b.T)
    lin.train()
    torch.manual_seed(1)
    y = lin(x)
    torch.manual_seed(1)
    mask = F.dropout(torch.ones_like(x), 0.5, training=True)
    assert_close(y, base(x) + ((x * mask) @ a.T) @ b.T)
    assert (mask == 0).any() and (mask == 2).any()


@pytest.fixture(scope="module")
def reference():
    """Single-process LoRA: the reference of every layout."""
    return train_lora()


@pytest.fixture(scope="module")
def reference_kv1():
    """Single-process LoRA on a model with one key/value head (replicated under tp = 2)."""
    return train_lora(model_kw={"n_kv_heads": 1})


def test_single_process_lora_trains_adapters_only(reference):
    """Only adapters change; the trainable count is r·(d_in + d_out) per target and layer; the optimizer
    and gradient bytes are the adapters' (fp32 AdamW: grad 4 bytes, moments 8 bytes per parameter)."""
    from loom.finetune.lora import adapter_numel
    from loom.model.llama import init_value

    cfg = lora_cfg()
    n = adapter_numel(cfg)
    h, f, kd = 32, cfg.model.resolved_ffn_dim(), 16
    assert n == 2 * 4 * ((32 + 32) + 2 * (h + kd) + (32 + 32) + 2 * (h + f) + (f + h))
    assert reference["trainable"] == n
    assert reference["bytes"]["grad_bytes"] == 4 * n and reference["bytes"]["optim_bytes"] == 8 * n
    for name, v in reference["base"].items():  # the base is exactly its init (the tied head is the embedding)
        name = "tok_embeddings.weight" if name == "output.weight" else name
        assert_close(v, init_value(cfg.model, cfg.train.seed, name, tuple(v.shape)), rtol=0, atol=0)
    assert all(v.abs().sum() > 0 for k, v in reference["adapters"].items() if "lora_B" in k)


# ----------------------------------------------------------------------------- every layout

LAYOUTS = {  # name -> (world, layout)
    "dp2": (2, {"dp_replicate": 2}),
    "zero1": (2, {"dp_shard": 2, "zero": 1}),
    "zero2": (2, {"dp_shard": 2, "zero": 2}),
    "zero3": (2, {"dp_shard": 2, "zero": 3}),
    "zero3_recompute": (2, {"dp_shard": 2, "zero": 3, "recompute": "full"}),  # forwards re-run in backward
    "zero3_keep": (2, {"dp_shard": 2, "zero": 3, "reshard_after_forward": False}),
    "tp2_sp": (2, {"tp": 2, "sp": True}),
    "pp2": (2, {"pp": 2}),
    "pp2_zbh1": (2, {"pp": 2, "schedule": "zb-h1"}),  # the first stage's input needs no gradient: BW only
    "cp2": (2, {"cp": 2}),
}


def _check_same(results: list[dict], ref: dict) -> None:
    for r in results:
        assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL)
        if r["adapters"] is None:  # pipeline ranks but the first
            continue
        assert r["adapters"].keys() == ref["adapters"].keys()
        for k, v in ref["adapters"].items():
            assert_close(r["adapters"][k], v, **TRAIN_TOL, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_layout_equals_single_process(pools, reference, name):
    """Losses and adapter weights of 8 steps (2 micro-batches per rank, clipping on) equal one process;
    per rank, optimizer and gradient bytes are the adapters' (the formula of each strategy over the
    adapters alone: Φ_A = Σ r·(d_in + d_out); ZeRO pads each flat buffer to N·4 elements)."""
    from loom.finetune.lora import adapter_numel

    world, layout = LAYOUTS[name]
    results = pools(world).run(train_lora, layout)
    _check_same(results, reference)
    if name == "tp2_sp":
        _check_tp_bytes(results, lora_cfg(layout))
    n = adapter_numel(lora_cfg())
    for r in results:
        b, flat = r["bytes"], r["flat"]
        if name in (
            "dp2",
            "tp2_sp",
            "pp2",
            "pp2_zbh1",
            "cp2",
        ):  # replicated optimizer (tp / pp: this rank's share of the adapters)
            assert b["grad_bytes"] == 4 * r["trainable"] and b["optim_bytes"] == 8 * r["trainable"]
            assert b["frozen_bytes"] == 4 * r["frozen"]  # the base, whole (or this rank's tp / pp share)
            if name in ("dp2", "cp2"):
                assert r["trainable"] == n
        else:  # ZeRO: flat buffers of the adapters only, sharded over N = 2
            assert sum(numel for numel, _, _ in flat) == n
            padded = sum(p for _, p, _ in flat)
            assert b["optim_bytes"] == 8 * padded // 2
            assert b["grad_bytes"] == 4 * (padded if name == "zero1" else padded // 2)
            if not name.startswith("zero3"):
                assert b["frozen_bytes"] == 4 * r["frozen"]  # ZeRO-1/2: the base replicated
        if name.startswith(
            "zero3"
        ):  # the frozen base is sharded too: 4 bytes per element over N, unit by unit
            assert b["param_bytes"] == 4 * padded // 2
            assert sum(numel for numel, _ in r["frozen_flat"]) == r["frozen"] == reference["frozen"]
            assert b["frozen_bytes"] == sum(p for _, p in r["frozen_flat"]) // 2


@pytest.mark.parametrize(
    "layout",
    [
        {"pp": 2, "dp_shard": 2, "zero": 3},
        {"tp": 2, "sp": True, "dp_shard": 2, "zero": 3},
        {"pp": 2, "dp_shard": 2, "zero": 1},
    ],
    ids=["pp2_zero3", "tp2_sp_zero3", "pp2_zero1"],
)
def test_lora_4_ranks_equals_single_process(pools, reference, layout):
    """Two dimensions at once: the frozen base sharded by ZeRO-3 under a pipeline or under tp + sp."""
    _check_same(pools(4).run(train_lora, layout), reference)


def test_lora_tp2_replicated_kv_equals_single_process(pools, reference_kv1):
    """tp = 2 over one key/value head (replicated; B whole and its gradient summed over tp), no sp."""
    results = pools(2).run(train_lora, {"tp": 2}, {"n_kv_heads": 1})
    _check_same(results, reference_kv1)
    _check_tp_bytes(results, lora_cfg({"tp": 2}, {"n_kv_heads": 1}))


@pytest.mark.parametrize("targets,sp", [("o", False), ("k", True), ("q,v", False)])
def test_lora_tp2_olmo2_norm_sums_on_the_formula(pools, targets, sp):
    """OLMo-2's q/k norms over the whole projection (``qk_norm_scope = all``) sum (B, T) squares over
    tp; behind the first adapter a norm's backward sum runs only when its own projection has one."""
    model_kw = {"norm_placement": "post", "qk_norm": True, "qk_norm_scope": "all"}
    layout = {"tp": 2, "sp": sp}
    results = pools(2).run(train_lora, layout, model_kw, lora_targets=targets)
    _check_tp_bytes(results, lora_cfg(layout, model_kw, lora_targets=targets))


def _check_tp_bytes(results: list[dict], cfg: C.LoomConfig) -> None:
    """Bytes moved per step = tp_lora's formula: the layers' collectives where a gradient reaches them
    (the frozen base's partial sums gone) + the adapters' (one (B, T, Σr) collective per entry)."""
    from loom.parallel.tensor.parallelize import lora_comm_bytes

    tp, sp, k = cfg.parallel.tp, cfg.parallel.sp, BATCH // MICRO
    for r in results:
        assert (
            r["moved"] == [pytest.approx(lora_comm_bytes(cfg, MICRO, SEQ, tp, sp, micro_batches=k))] * STEPS
        )


@pytest.mark.parametrize(
    "ft,model_kw,field,says",
    [
        (
            {"lora_targets": "q,gate"},
            {},
            "finetune.lora_targets",
            "unknown target 'gate'; valid: q, k, v, o, w1, w2, w3",
        ),
        ({"lora_rank": 0}, {}, "finetune.lora_rank", "must be >= 1, got 0"),
        ({"lora_alpha": -1.0}, {}, "finetune.lora_alpha", "must be > 0"),
        ({"lora_dropout": 1.0}, {}, "finetune.lora_dropout", "must be in [0, 1)"),
        ({"lora_targets": "w3"}, {"mlp": "gelu"}, "finetune.lora_targets", "nothing to target"),
        ({"lora_targets": "w1"}, {"n_experts": 4}, "finetune.lora_targets", "mixture of experts"),
        ({"lora_targets": ","}, {}, "finetune.lora_targets", "nothing to target"),
        (
            {"method": "qlora"},
            {"dim": 36, "n_heads": 3, "n_kv_heads": 3, "ffn_dim": 40},
            "finetune.method",
            "layers.*.attention.wq.weight (36 x 36 = 1296 elements, not a multiple of the 64-element NF4 block)",
        ),
        ({"method": "qlora"}, {}, "finetune.method", "qlora with parallel.tp = 2 is not supported"),
    ],
)
def test_bad_finetune_input_is_one_line(ft, model_kw, field, says):
    cfg = lora_cfg({"tp": 2} if "tp = 2" in says else {}, model_kw=model_kw, **ft)
    with pytest.raises(C.ConfigError) as e:
        C.validate(cfg, cfg.parallel.tp)
    msg = str(e.value)
    assert msg.startswith(field) and says in msg and "\n" not in msg


# ----------------------------------------------------------------------------- checkpoints (the trainer)

TRAIN = {
    "data": {"seq_len": 32, "vocab_size": 384, "max_corpus_mb": 0.3},
    "train": {
        "steps": 4,
        "global_batch": 4,
        "micro_batch": 2,
        "warmup_steps": 1,
        "log_every": 1,
        "eval_every": 0,
        "checkpoint_every": 2,
        "checkpoint_async": False,
        "checkpoint_keep": 0,
        "lr": 1e-2,
    },
    "run": {"progress": False, "tensorboard": False, "threads": 1},
    "finetune": {"method": "lora", "lora_rank": 4, "lora_alpha": 8.0},
}


def save_tiny_hf(path, family: str = "llama", vocab: int = 384, seed: int = 0):
    """A tiny random-init transformers model saved at ``path`` (nothing downloaded); returns it."""
    import transformers

    torch.manual_seed(seed)
    if family == "gpt2":
        hf_cfg = transformers.GPT2Config(
            vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=64
        )
        model = transformers.GPT2LMHeadModel(hf_cfg)
    else:
        cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[
            family
        ]
        hf_cfg = getattr(transformers, cls[0])(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
        model = getattr(transformers, cls[1])(hf_cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = p.dim() == 1 and ("norm" in name or "ln_" in name) and "bias" not in name
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if is_norm else 0.0))
    model.eval().save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    import json
    import os

    from loom.data import prepare_data

    os.environ.setdefault("LOOM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    return str(prepare_data(C.from_dict(json.loads(json.dumps(TRAIN))).data, progress=False).dir)


def hf_lora_config(prepared: str, base, run, **over) -> C.LoomConfig:
    import json

    from loom.model.hf import apply_to

    d = json.loads(json.dumps(TRAIN))
    for section, table in over.items():
        d.setdefault(section, {}).update(table)
    d["data"]["prepared_dir"] = prepared
    d["run"]["dir"] = str(run)
    cfg = C.from_dict(d)
    apply_to(cfg, base)
    cfg.model.from_hf = str(base)
    return cfg


def trainer_fit(cfg: C.LoomConfig) -> list[float]:
    """Train in this process; the run's losses by step."""
    import json
    from pathlib import Path

    from loom.train.trainer import RankEnv, Trainer

    trainer = Trainer(cfg, RankEnv(0, 1, 0, 1))
    try:
        trainer.fit()
    finally:
        trainer.heartbeat.close()
    rows = [json.loads(ln) for ln in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows]


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory, prepared):
    """A tiny Llama saved in transformers' format with the prepared BPE as its tokenizer."""
    from loom.data.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("base") / "llama"
    save_tiny_hf(path)
    load_tokenizer(prepared).save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, prepared, hf_base):
    """4 LoRA steps on the HF base, checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("lora") / "run"
    return run, trainer_fit(hf_lora_config(prepared, hf_base, run))


def test_lora_checkpoint_holds_adapters_optimizer_and_base_reference(lora_run, hf_base):
    """The checkpoint's tensors are the adapters and their Adam state, nothing of the base; the train
    state names the base's path and SHA-256."""
    from loom.checkpoint.load import CheckpointReader
    from loom.finetune.base import hf_dir_sha256

    run, _ = lora_run
    with CheckpointReader(run / "checkpoints" / "step-00000004") as reader:
        names = [n for n in reader.names() if not n.startswith("train.rng.")]  # RNG: loom.checkpoint.rng
        base = reader.train_state["finetune_base"]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert {n.split(".")[0] for n in names} == {"model", "optim"}
    assert sum(n.startswith("model.") for n in names) == 2 * 2 * 7  # A and B of 7 targets in 2 layers
    assert base == {"kind": "hf", "path": str(hf_base.resolve()), "sha256": hf_dir_sha256(hf_base)}


def test_init_from_a_lora_run_or_an_adapter_says_what_to_give_instead(lora_run, hf_base, tmp_path):
    """A LoRA checkpoint holds adapters, not weights to start from; a PEFT adapter directory holds no
    checkpoint: each is one line naming train.init_from and what to give instead."""
    from loom.model.hf import open_dir
    from loom.model.llama import Transformer
    from loom.train.init_from import initial_source

    run, _ = lora_run
    model = Transformer(open_dir(hf_base).config)
    with pytest.raises(C.ConfigError, match=r"train.init_from: .* is a LoRA run's checkpoint.*--merge-lora"):
        initial_source(model, run / "checkpoints" / "step-00000004")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(C.ConfigError, match=r"train.init_from: .*holds no checkpoint \(a PEFT adapter"):
        initial_source(model, adapter)


def test_convert_of_a_lora_run_is_refused_naming_what_writes_its_model(lora_run, tmp_path):
    """A "consolidated model" of a LoRA checkpoint would be its adapters alone: refused, nothing written."""
    from loom.checkpoint.convert import convert
    from loom.checkpoint.format import CheckpointError

    run, _ = lora_run
    with pytest.raises(CheckpointError, match=r"holds LoRA adapters only .*--merge-lora"):
        convert(run, tmp_path / "model.safetensors")
    assert not list(tmp_path.iterdir())


def test_lora_resume_is_exact(lora_run, prepared, hf_base, tmp_path):
    """Resumed from step 2, steps 3-4 give the losses and the adapters of the uninterrupted run."""
    import shutil

    from loom.checkpoint.load import CheckpointReader

    run, losses = lora_run
    resumed = tmp_path / "run"
    shutil.copytree(run / "checkpoints" / "step-00000002", resumed / "checkpoints" / "step-00000002")
    cfg = hf_lora_config(
        prepared, hf_base, resumed, train={"resume": str(resumed / "checkpoints" / "step-00000002")}
    )
    again = trainer_fit(cfg)
    assert again == losses[2:]
    with (
        CheckpointReader(run / "checkpoints" / "step-00000004") as a,
        CheckpointReader(resumed / "checkpoints" / "step-00000004") as b,
    ):
        for name in a.names():
            assert torch.equal(a.read(name), b.read(name)), name


def test_lora_resume_on_another_base_is_refused_naming_both_hashes(lora_run, prepared, hf_base, tmp_path):
    import shutil

    from loom.finetune.base import hf_dir_sha256
    from loom.train.trainer import RankEnv, Trainer

    run, _ = lora_run
    other = tmp_path / "other"
    shutil.copytree(hf_base, other)
    save_tiny_hf(other, seed=1)  # the same shapes, other weights
    cfg = hf_lora_config(prepared, other, tmp_path / "run", train={"resume": str(run)})
    with pytest.raises(C.ConfigError) as e:
        Trainer(cfg, RankEnv(0, 1, 0, 1)).heartbeat.close()
    msg = str(e.value)
    assert msg.startswith("finetune:") and "\n" not in msg
    assert hf_dir_sha256(hf_base) in msg and hf_dir_sha256(other) in msg


def test_merge_export_reads_the_recorded_base_and_checks_its_hash(
    prepared, hf_base, tmp_path, monkeypatch, capsys
):
    """A run trained with a relative ``model.from_hf``: ``loom export hf --merge-lora`` from another
    working directory merges onto the absolute path the checkpoint recorded (the same tensors as from
    the training directory); once that base's weights change, the export is refused in one line
    naming both SHA-256 (the rule resume applies), and nothing is written."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file

    from loom.cli import main
    from loom.finetune.base import hf_dir_sha256

    shutil.copytree(hf_base, tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    cfg = hf_lora_config(prepared, Path("base"), tmp_path / "run", train={"steps": 1})
    assert cfg.model.from_hf == "base"
    trainer_fit(cfg)
    assert main(["export", "hf", "run", "here", "--merge-lora"]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # "base" is not here
    assert main(["export", "hf", str(tmp_path / "run"), "there", "--merge-lora"]) == 0
    a, b = (
        {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
        for d in (tmp_path / "here", elsewhere / "there")
    )
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    before = hf_dir_sha256(tmp_path / "base")
    save_tiny_hf(tmp_path / "base", seed=1)  # the same shapes, other weights
    capsys.readouterr()
    assert main(["export", "hf", str(tmp_path / "run"), "again", "--merge-lora"]) == 2
    msg = capsys.readouterr().err
    assert msg.startswith("loom: error: finetune:") and msg.count("\n") == 1, msg
    assert "merge onto the base it was trained on" in msg
    assert before in msg and hf_dir_sha256(tmp_path / "base") in msg and not Path("again").exists()
    shutil.move(tmp_path / "base", tmp_path / "moved")  # the base gone from where it was recorded
    assert main(["export", "hf", str(tmp_path / "run"), "again", "--merge-lora"]) == 2
    msg = capsys.readouterr().err
    assert msg.startswith("loom: error: model.from_hf: ") and msg.count("\n") == 1, msg
    assert str(tmp_path / "base") in msg and "LoRA base" in msg and not Path("again").exists()


# ----------------------------------------------------------------------------- PEFT interop


def _loom_lora_model(path, targets: str = "all-linear", seed: int = 3):
    """Loom's LoRA model on the HF base at ``path`` (weights loaded), adapters random (B non-zero)."""
    from loom.finetune.lora import apply_lora
    from loom.model.hf import load_into, open_dir
    from loom.model.llama import Transformer

    hf = open_dir(path, 16)
    cfg = C.LoomConfig(model=hf.config)
    cfg.finetune = C.FinetuneConfig(**(LORA | {"lora_targets": targets}))
    model = Transformer(cfg.model)
    load_into(model, hf)
    apply_lora(model, targets=C.lora_targets(cfg), finetune=cfg.finetune)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "lora_A"):
                mod.lora_A.weight = torch.nn.Parameter(
                    torch.randn(mod.lora_A.weight.shape, generator=g) * 0.2
                )
                mod.lora_B.weight = torch.nn.Parameter(
                    torch.randn(mod.lora_B.weight.shape, generator=g) * 0.2
                )
    return cfg, model.eval()


@pytest.mark.parametrize(
    "family,targets", [("gpt2", "all-linear"), ("gpt2", "q,v,w2"), ("qwen2", "q,k,o,w3")]
)
def test_peft_export_loads_with_equal_logits(tmp_path, family, targets):
    """Adapters under PEFT's names (the names PEFT itself saves) and its config: PeftModel.from_pretrained
    on the Hugging Face base gives Loom's LoRA logits; GPT-2's q, k, v as one block-diagonal c_attn."""
    import json

    import peft
    from safetensors.torch import save_file

    from loom.finetune.export import peft_state

    base = save_tiny_hf(tmp_path / "base", family, vocab=128)
    cfg, model = _loom_lora_model(tmp_path / "base", targets)
    pairs = {
        f"{name}.weight": (m.lora_A.weight.detach(), m.lora_B.weight.detach())
        for name, m in model.named_modules()
        if hasattr(m, "lora_A")
    }
    tensors, config = peft_state(cfg, pairs)
    out = tmp_path / "adapter"
    out.mkdir()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config))
    theirs = peft.PeftModel.from_pretrained(base, str(out)).eval()
    ref = peft.get_peft_model(
        save_tiny_hf(tmp_path / "b2", family, vocab=128),
        peft.LoraConfig(
            **{
                k: config[k]
                for k in (
                    "r",
                    "lora_alpha",
                    "target_modules",
                    "fan_in_fan_out",
                    "rank_pattern",
                    "alpha_pattern",
                )
            }
        ),
    )
    ref.save_pretrained(tmp_path / "ref")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ref" / "adapter_model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(tensors)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(theirs(x).logits, model(x), rtol=1e-4, atol=1e-5)


def test_peft_export_and_merged_export_of_a_run(lora_run, hf_base, tmp_path):
    """``loom export peft`` of the trained run loads on the base with Loom's logits; ``loom export hf
    --merge-lora`` loads in transformers with the same logits; a PEFT export of a full run, or a plain
    HF export of a LoRA run, is one line naming what to do."""
    import peft
    import transformers

    from loom.checkpoint.format import CheckpointError
    from loom.checkpoint.hf_export import export_hf
    from loom.finetune.export import MergedReader, export_peft, merged_state
    from loom.model.llama import Transformer

    run, _ = lora_run
    export_peft(run, tmp_path / "adapter")
    export_hf(run, tmp_path / "merged", wrap=MergedReader)
    cfg, state = merged_state(run)
    loom = Transformer(cfg.model)
    loom.load_state_dict(state, strict=False)
    x = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    theirs = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(hf_base), str(tmp_path / "adapter")
    )
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        want = loom.eval()(x)
        assert_close(theirs.eval()(x).logits, want, rtol=1e-4, atol=1e-5)
        assert_close(merged.eval()(x).logits, want, rtol=1e-4, atol=1e-5)
        base_logits = transformers.AutoModelForCausalLM.from_pretrained(hf_base).eval()(x).logits
    assert (base_logits - want).abs().max() > 1e-3  # the adapters changed the model
    with pytest.raises(CheckpointError, match="holds LoRA adapters only.*--merge-lora"):
        export_hf(run, tmp_path / "plain")
    from loom.train.export import load_model

    final = Transformer(
        cfg.model
    )  # the run's final model.safetensors: merged, as a full run's (loom generate)
    load_model(final, run / "checkpoints" / "final" / "model.safetensors")
    with torch.no_grad():
        assert_close(final.eval()(x), want)
    from safetensors import safe_open

    for file in (run / "checkpoints" / "final" / "model.safetensors", *tmp_path.rglob("*/*.safetensors")):
        with safe_open(str(file), "pt") as f:  # transformers 4.x's load_state_dict refuses a file without it
            assert f.metadata().get("format") == "pt", file


def test_a_padded_lora_run_gives_a_final_model_generate_loads(prepared, hf_base, tmp_path):
    """A LoRA run with a padded vocabulary (``model.pad_vocab_to``: what tp2 sets on its own for a
    vocabulary it does not divide) writes its merged final model with the run's V' rows (the base has
    V; ``loom generate --run.dir`` refused the file), verified against the checkpoint; the merged HF
    export still has V rows and transformers' logits equal Loom's."""
    import transformers

    from loom.checkpoint.hf_export import export_hf
    from loom.finetune.export import MergedReader
    from loom.generate.source import load_run

    run = tmp_path / "run"
    cfg = hf_lora_config(prepared, hf_base, run, model={"pad_vocab_to": 512}, train={"steps": 2})
    trainer_fit(cfg)
    src = load_run(str(run))  # the final file checked against the merge of the checkpoint's adapters
    assert src.model.output.weight.shape[0] == 512 and not src.model.output.weight[384:].any()
    export_hf(run, tmp_path / "merged", wrap=MergedReader)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert merged.config.vocab_size == 384
    x = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(merged(x).logits, src.model.eval()(x)[..., :384], rtol=1e-4, atol=1e-5)


def test_training_equals_transformers_plus_peft(hf_base):
    """The same seeded LoRA init and the same batches in a plain transformers + peft loop (AdamW, the
    same clipping and LR schedule) give Loom's losses at one rank, step for step."""
    import peft
    import transformers

    from loom.finetune.lora import lora_init_value
    from loom.mesh import ParallelDims, ParallelMesh
    from loom.model.hf import open_dir, source
    from loom.model.llama import build_model
    from loom.train.build import build_run
    from loom.train.schedule import lr_at
    from loom.train.step import train_step

    hf = open_dir(hf_base, 16)
    cfg = C.LoomConfig(model=hf.config, train=tiny_train(steps=6, lr=1e-2, warmup_steps=2, min_lr=1e-3))
    cfg.finetune = C.FinetuneConfig(**LORA)
    cfg.data.seq_len, cfg.train.global_batch, cfg.train.micro_batch = 16, 4, 4
    C.validate(cfg, 1)
    model = build_model(cfg.model, cfg.train.seed, meta=True)
    run = build_run(cfg, ParallelMesh(ParallelDims(), "cpu"), model, source=source(hf))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 384, (4, 17), generator=g) for _ in range(6)]
    ours = [
        train_step(run, [(b[:, :-1], b[:, 1:])], 1.0, lr_at(s, cfg.train), None).loss
        for s, b in enumerate(batches)
    ]

    names = {
        "q_proj": "attention.wq",
        "k_proj": "attention.wk",
        "v_proj": "attention.wv",
        "o_proj": "attention.wo",
        "gate_proj": "feed_forward.w1",
        "up_proj": "feed_forward.w3",
        "down_proj": "feed_forward.w2",
    }
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_base)
    lcfg = peft.LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0, target_modules=list(names))
    theirs_model = peft.get_peft_model(hf_model, lcfg)
    with torch.no_grad():
        for name, mod in theirs_model.named_modules():
            if name.endswith(tuple(names)) and hasattr(mod, "lora_A"):
                i, leaf = name.split("layers.")[1].split(".")[0], name.rsplit(".", 1)[1]
                loom_name = f"layers.{i}.{names[leaf]}.lora_A.weight"
                a = mod.lora_A["default"].weight
                a.copy_(
                    lora_init_value(cfg.train.seed, loom_name, tuple(a.shape))
                )  # A acts on inputs: no row order
                assert not mod.lora_B["default"].weight.any()
    params = [p for p in theirs_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params,
        lr=cfg.train.lr,
        betas=(cfg.train.beta1, cfg.train.beta2),
        eps=cfg.train.eps,
        weight_decay=cfg.train.weight_decay,
    )
    theirs = []
    for s, b in enumerate(batches):
        logits = theirs_model(input_ids=b[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(s, cfg.train)
        opt.step()
        opt.zero_grad()
        theirs.append(loss.item())
    assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=1e-5)
    assert ours[-1] < ours[0]


# ----------------------------------------------------------------------------- QLoRA


def test_nf4_equals_torchao_bit_for_bit():
    """Loom's NF4 (levels, 64-element absmax blocks, double-quantized absmaxes in groups of 256) is
    torchao's ``to_nf4``: the same codes, int8 absmaxes, factors, mean and dequantized weight."""
    from torchao.quantization.quantize_.workflows.nf4 import (
        nf4_tensor,  # the package, not the quantize_ function
    )

    from loom.finetune.nf4 import dequantize, quantize

    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(0)) * 0.02  # 512 blocks: 2 groups
    ours, theirs = quantize(w), nf4_tensor.to_nf4(w, 64, 256)
    assert torch.equal(ours["codes"], theirs.quantized_data)
    assert torch.equal(ours["absmax"], theirs.quantized_scalers)
    assert torch.equal(ours["factor"], theirs.quantization_factor)
    assert torch.equal(ours["mean"], theirs.scaler_mean.reshape(1))
    assert torch.equal(dequantize(**ours, shape=w.shape, dtype=torch.float32), theirs.get_original_weight())


def test_nf4_linear_and_bytes_per_parameter():
    """x Ŵᵀ + b and its input gradient through the 4-bit weight equal the same math on the dequantized
    weight; bytes kept = n/2 + n/64 + 4·ceil(n/16384) + 4, measured on the buffers."""
    from loom.finetune.nf4 import NF4Weight, nf4_bytes

    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(1))  # 96 blocks: a partial absmax group
    q = NF4Weight(w)
    ref = q.dequantized(torch.float32)
    assert (ref - w).abs().max() <= 0.2 * w.abs().max()  # 4 bits: within a level gap of the absmax
    x = torch.randn(3, 64, requires_grad=True)
    b = torch.randn(96)
    y = q(x, b)
    y.square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    (x2 @ ref.T + b).square().sum().backward()
    assert_close(y, x2 @ ref.T + b)
    assert_close(x.grad, x2.grad)
    n = w.numel()
    assert q.nbytes == nf4_bytes(n) == n // 2 + n // 64 + 4 * 1 + 4
    assert q.nbytes / n == pytest.approx(0.5 + 1 / 64 + 8 / n)


def test_qlora_base_bytes_and_loss_near_lora(reference):
    """QLoRA: every target's base weight is NF4 (bytes per base parameter measured = the formula), the
    adapters and their optimizer bytes are LoRA's, and over 8 steps the loss stays within 0.005 of LoRA's
    (the base is the same init, quantized)."""
    from loom.finetune.nf4 import NF4Weight, nf4_bytes
    from loom.mesh import ParallelDims, ParallelMesh
    from loom.model.llama import build_model
    from loom.train.build import build_run

    q = train_lora(method="qlora")
    fb = ("frozen_bytes",)
    assert q["trainable"] == reference["trainable"]
    assert {k: v for k, v in q["bytes"].items() if k not in fb} == {
        k: v for k, v in reference["bytes"].items() if k not in fb
    }
    assert max(abs(a - b) for a, b in zip(q["losses"], reference["losses"])) < 0.005  # measured 6e-4
    cfg = lora_cfg(method="qlora")
    C.validate(cfg, 1)
    model = build_model(cfg.model, cfg.train.seed, meta=True)
    build_run(cfg, ParallelMesh(ParallelDims(), "cpu"), model)
    weights = [m for m in model.modules() if isinstance(m, NF4Weight)]
    assert len(weights) == 2 * 7
    n = sum(torch.Size(m.shape).numel() for m in weights)
    measured = sum(b.numel() * b.element_size() for m in weights for b in m.parameters())
    assert measured == sum(nf4_bytes(torch.Size(m.shape).numel()) for m in weights)
    assert 0.5 < measured / n < 0.5 + 1 / 64 + 8 / 512 + 1e-9
    # the rank's frozen bytes: LoRA's base with the targets' 4n bytes replaced by their NF4 bytes
    assert q["bytes"]["frozen_bytes"] == reference["bytes"]["frozen_bytes"] - 4 * n + measured
    assert not any(
        n.rsplit(".", 1)[-1] == "weight" and "lora" not in n and ("attention.w" in n or "feed_forward" in n)
        for n, _ in model.named_parameters()
    )


def test_qlora_merge_is_the_model_the_run_trained(prepared, hf_base, tmp_path):
    """QLoRA trains on the NF4 form Ŵ of each target: its merged export (``loom export hf
    --merge-lora``, loaded in transformers), and the run's final model, equal the QLoRA model with
    its adapters (the model the run evaluated) in logits and loss; the full-precision base plus the
    same adapters (the former merge) does not."""
    import transformers

    from loom.checkpoint.hf_export import export_hf
    from loom.checkpoint.load import CheckpointReader
    from loom.finetune.export import MergedReader, adapters, base_tensors, merged_state
    from loom.finetune.lora import LoRALinear, apply_lora, merged_weight, quantize_base
    from loom.model.llama import Transformer, loss_fn
    from loom.train.export import load_model

    run = tmp_path / "run"
    ft = {"method": "qlora", "lora_rank": 4, "lora_alpha": 8.0}
    trainer_fit(hf_lora_config(prepared, hf_base, run, train={"steps": 2}, finetune=ft))
    with CheckpointReader(run) as reader:
        cfg = C.from_dict(reader.train_state["config"])
        pairs = adapters(reader)
    trained = Transformer(cfg.model)  # the QLoRA model as the run holds it: NF4 base + adapters
    apply_lora(trained, targets=C.lora_targets(cfg), finetune=cfg.finetune)
    for mod in trained.modules():
        if isinstance(mod, LoRALinear):
            mod.lora_A.to_empty(device="cpu")
            mod.lora_B.to_empty(device="cpu")
    params = dict(trained.named_parameters())
    base = dict(base_tensors(cfg))
    with torch.no_grad():
        for name, t in base.items():
            params[name].copy_(t)
        for name, (a, b) in pairs.items():
            params[name.removesuffix(".weight") + ".lora_A.weight"].copy_(a)
            params[name.removesuffix(".weight") + ".lora_B.weight"].copy_(b)
    quantize_base(trained)
    _, state = merged_state(run)
    merged = Transformer(cfg.model)
    merged.load_state_dict(state, strict=False)
    final = Transformer(cfg.model)
    load_model(final, run / "checkpoints" / "final" / "model.safetensors")
    export_hf(run, tmp_path / "hf", wrap=MergedReader)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    old = Transformer(cfg.model)  # W + (α/r)·B A: the full-precision base
    old.load_state_dict(
        base | {n: merged_weight(base[n], a, b, 8.0 / 4) for n, (a, b) in pairs.items()}, strict=False
    )
    x = torch.randint(0, 384, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained.eval()(x[:, :-1])
        for got in (merged.eval()(x[:, :-1]), final.eval()(x[:, :-1]), exported(x[:, :-1]).logits):
            assert_close(got, want, rtol=1e-4, atol=1e-5)
            assert_close(loss_fn(got, x[:, 1:]), loss_fn(want, x[:, 1:]), rtol=1e-5, atol=1e-6)
        assert (old.eval()(x[:, :-1]) - want).abs().max() > 1e-2  # NF4 rounding the old merge missed


@pytest.mark.parametrize(
    "layout",
    [{"dp_shard": 2, "zero": 2}, {"dp_shard": 2, "zero": 3}, {"pp": 2}],
    ids=["zero2", "zero3", "pp2"],
)
def test_qlora_sharded_equals_single_process_qlora(pools, layout):
    """QLoRA under ZeRO-2 (each rank quantizes the same whole weights alike) and ZeRO-3, where the NF4
    codes, absmaxes and factors of each block are flat buffers of their unit (one per dtype), sharded
    and gathered like any frozen weight: its frozen bytes per rank are the unit buffers' over N."""
    from loom.finetune.nf4 import nf4_bytes

    ref = train_lora(method="qlora")
    results = pools(2).run(train_lora, layout, None, STEPS, method="qlora")
    _check_same(results, ref)
    if layout.get("zero") == 3:
        cfg = lora_cfg(method="qlora")
        shapes = C.target_shapes(cfg.model)
        nf4 = cfg.model.n_layers * sum(nf4_bytes(o * i) for o, i in shapes.values())
        for r in results:
            assert r["bytes"]["frozen_bytes"] == sum(p for _, p in r["frozen_flat"]) // 2
            stored = sum(numel for numel, _ in r["frozen_flat"])  # elements, of every dtype
            assert stored == r["frozen"]
            assert r["bytes"]["frozen_bytes"] < (nf4 + 4 * (r["frozen"] - nf4)) // 2 + 2 * 16 * 3 * 8


@pytest.mark.parametrize(
    "layout", [{"ep": 2, "dp_replicate": 2}, {"ep": 2, "dp_shard": 2, "zero": 3}], ids=["ep2", "ep2_zero3"]
)
def test_lora_on_moe_under_ep2_equals_single_process(pools, layout):
    """A mixture-of-experts model: attention adapters trained, experts and router frozen, under ep2
    (with ZeRO-3 the frozen experts are sharded over their edp group, the rest over dp)."""
    ref = train_lora(model_kw={"n_experts": 4, "top_k": 2})
    assert ref["trainable"] == 2 * 4 * ((32 + 32) + 2 * (32 + 16) + (32 + 32))
    results = pools(2).run(train_lora, layout, {"n_experts": 4, "top_k": 2})
    _check_same(results, ref)
    assert [r["trainable"] for r in results] == [ref["trainable"]] * 2  # this rank's experts stay frozen


def test_export_commands(lora_run, tmp_path, capsys):
    """``loom export peft`` and ``loom export hf --merge-lora`` through the CLI; a plain ``export hf``
    of a LoRA run is one error line."""
    from loom.cli import main

    run, _ = lora_run
    assert main(["export", "peft", str(run), str(tmp_path / "a")]) == 0
    assert {p.name for p in (tmp_path / "a").iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    assert main(["export", "hf", str(run), str(tmp_path / "m"), "--merge-lora"]) == 0
    assert (tmp_path / "m" / "config.json").is_file() and (tmp_path / "m" / "tokenizer.json").is_file()
    assert main(["export", "hf", str(run), str(tmp_path / "p")]) != 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "holds LoRA adapters only" in err and "--merge-lora" in err


def test_peft_export_never_adopts_a_directory_beside_its_output(lora_run, tmp_path):
    """A user's ``OUT.partial`` directory is not adopted (its files never end up in the adapter
    directory) nor touched; the adapter files get the umask's mode, as ``loom export hf`` writes."""
    from loom.finetune.export import export_peft

    run, _ = lora_run
    mine = tmp_path / "pe.partial"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    export_peft(run, tmp_path / "pe")
    assert {p.name for p in (tmp_path / "pe").iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"
    assert {p.name for p in tmp_path.iterdir()} == {"pe", "pe.partial"}  # no temporary left behind
    mask = os.umask(0)
    os.umask(mask)
    for p in (tmp_path / "pe").iterdir():
        assert p.stat().st_mode & 0o777 == 0o666 & ~mask, p.name


def test_peft_export_of_a_full_run_is_one_line(prepared, hf_base, tmp_path):
    from loom.checkpoint.format import CheckpointError
    from loom.finetune.export import export_peft

    run = tmp_path / "full"
    trainer_fit(hf_lora_config(prepared, hf_base, run, train={"steps": 1}, finetune={"method": "full"}))
    with pytest.raises(CheckpointError) as e:
        export_peft(run, tmp_path / "adapter")
    assert "is not a LoRA run (finetune.method = full" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "adapter").exists()
    from loom.train.trainer import RankEnv, Trainer  # LoRA resuming a full run's checkpoint: refused

    with pytest.raises(
        C.ConfigError, match="holds every weight .a full fine-tune.; this run has finetune.method = lora"
    ):
        Trainer(
            hf_lora_config(prepared, hf_base, tmp_path / "lora", train={"resume": str(run)}),
            RankEnv(0, 1, 0, 1),
        )


def test_base_identity_of_the_seeded_init_and_of_a_checkpoint(lora_run):
    """No from_hf / init_from: the base is the seeded init, hashed from the model fields and the seed;
    a Loom checkpoint as init_from: the SHA-256 of its manifest."""
    import hashlib

    from loom.finetune.base import base_identity

    a, b = lora_cfg(), lora_cfg()
    assert base_identity(a) == base_identity(b) and base_identity(a)["kind"] == "init"
    b.train.seed += 1
    assert base_identity(a)["sha256"] != base_identity(b)["sha256"]
    run, _ = lora_run
    a.train.init_from = str(run)
    got = base_identity(a)
    ckpt = run / "checkpoints" / "step-00000004"
    assert got == {
        "kind": "checkpoint",
        "path": str(ckpt.resolve()),
        "sha256": hashlib.sha256((ckpt / "manifest.json").read_bytes()).hexdigest(),
    }
    assert base_identity(C.LoomConfig()) is None  # a full fine-tune is bound to no base


def _zero3_peak() -> tuple[int, list[int]]:
    from loom.comm import CommMeter
    from loom.model.llama import build_model
    from loom.train.build import build_run
    from loom.train.step import train_step
    from tests.dist import get_mesh

    mesh = get_mesh(dp_shard=2)
    cfg = lora_cfg({"dp_shard": 2, "zero": 3}, {"n_layers": 6})
    C.validate(cfg, 2)
    run = build_run(cfg, mesh, build_model(cfg.model, cfg.train.seed, meta=True), CommMeter())
    train_step(run, rank_micro_batches(0, BATCH, 4, mesh.local_rank("dp"), 2), 1.0, 1e-3, None)
    units = run.strategy.units  # type: ignore[attr-defined]
    return run.strategy.transient_peak, [u.gathered_bytes for u in units if u.name.startswith("layers.")]  # type: ignore[attr-defined]


def test_zero3_frees_frozen_blocks_during_backward(pools):
    """ZeRO-3 with a frozen base: a block's gathered weights are freed once the gradient of its input
    is formed, so backward holds a few blocks at a time (the computing one, the prefetched one, the
    last), never all six (what keeping them until the end of backward would cost)."""
    for peak, blocks in pools(2).run(_zero3_peak):
        assert peak < 4 * max(blocks) < sum(blocks)


@pytest.mark.parametrize(
    "method,precision,zero", [("lora", "fp32", 0), ("lora", "bf16", 2), ("qlora", "bf16", 3)]
)
def test_state_bytes_formula_of_a_finetune(pools, method, precision, zero):
    """Per rank between steps, measured = :func:`loom.finetune.lora.state_bytes_formula` (what a
    benchmark or planner can predict), up to the flat buffers' padding (< 1%)."""
    from loom.finetune.lora import state_bytes_formula

    layout = {"dp_replicate": 2} if zero == 0 else {"dp_shard": 2, "zero": zero}
    cfg = lora_cfg(layout, method=method)
    cfg.train.precision = precision
    C.validate(cfg, 2)
    want = state_bytes_formula(cfg, 2)
    for r in pools(2).run(train_lora, {**layout, "precision": precision}, None, 2, method=method):
        got = {k: r["bytes"][k] for k in want}
        assert got == {k: pytest.approx(v, rel=0.01) for k, v in want.items()}


@pytest.mark.parametrize(
    "method,precision,zero",
    [("lora", "fp32", 0), ("lora", "bf16", 2), ("qlora", "bf16", 3), ("lora", "fp32", 3)],
)
def test_planner_state_of_a_finetune_equals_the_formula(method, precision, zero):
    """The planner's weights, gradients and optimizer state of a LoRA/QLoRA rank (frozen base W bytes
    a parameter, or NF4 on the targets; adapters trained) equal :func:`state_bytes_formula`, which the
    test above checks against a run's measured bytes."""
    from loom.finetune.lora import state_bytes_formula
    from loom.plan.auto import local_cluster
    from loom.plan.cost import CostModel, Layout
    from loom.plan.report import model_of, workload_of

    layout = {"dp_replicate": 2} if zero == 0 else {"dp_shard": 2, "zero": zero}
    cfg = lora_cfg(layout, method=method)
    cfg.train.precision, cfg.model.vocab_size = precision, 384
    want = state_bytes_formula(cfg, 2)
    lay = Layout(dp=2, dp_shard=2 if zero else 1, zero=zero, micro_batch=MICRO)
    got = CostModel(model_of(cfg), workload_of(cfg), local_cluster(2)).state_memory(lay)
    assert got["weights"] == pytest.approx(want["param_bytes"] + want["frozen_bytes"], rel=1e-9)
    assert got["gradients"] == pytest.approx(want["grad_bytes"], rel=1e-9)
    assert got["optimizer"] == pytest.approx(want["optim_bytes"], rel=1e-9)


def test_planner_drops_the_frozen_targets_weight_gradients():
    """A LoRA step is predicted faster than a full fine-tune of the same model by the weight-gradient
    GEMMs of its frozen targets: half the backward GEMM time of each (r = 2 without a profile)."""
    from loom.plan.auto import local_cluster
    from loom.plan.cost import CostModel, Layout
    from loom.plan.report import model_of, workload_of

    cfg = lora_cfg({"dp_replicate": 2})
    cfg.model.vocab_size = 384
    full = C.LoomConfig(model=cfg.model, train=cfg.train, data=cfg.data)
    lay = Layout(dp=2, micro_batch=MICRO)
    lora_cm, full_cm = (CostModel(model_of(c), workload_of(c), local_cluster(2)) for c in (cfg, full))
    lora_t, full_t = (cm.estimate(lay).time_breakdown["compute"] for cm in (lora_cm, full_cm))
    mach, T, h, f = full_cm.machine, MICRO * SEQ, cfg.model.dim, cfg.model.resolved_ffn_dim()
    kv = full_cm.kv_width(1)
    gemm_b = full_cm.act_bytes
    wgrad = sum(mach.gemm(T, *s, gemm_b) for s in [(h, h), (h, kv), (h, kv), (h, h), (h, f), (h, f), (f, h)])
    m = BATCH // (2 * MICRO)
    assert full_t - lora_t == pytest.approx(m * cfg.model.n_layers * wgrad, rel=1e-9)


def test_a_peft_adapter_names_the_hugging_face_base_it_applies_to(tmp_path):
    """``base_model_name_or_path`` (what AutoPeftModelForCausalLM loads) was null for a LoRA run on
    ``train.init_from`` a Hugging Face directory; a base of Loom's own has none to name."""
    from loom import config as C
    from loom.finetune.export import _hf_base

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    cfg = C.LoomConfig()
    assert _hf_base(cfg) is None
    cfg.train.init_from = str(hf)
    assert _hf_base(cfg) == str(hf)
    cfg.train.init_from, cfg.model.from_hf = str(tmp_path / "a-loom-run"), str(hf)
    assert _hf_base(cfg) == str(hf)
