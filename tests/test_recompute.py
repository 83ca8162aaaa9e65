"""Activation recomputation: full / selective / every:2 give exactly the losses and gradients of none
(fp32, dropout on), alone and under tensor + sequence parallelism, ZeRO-3 and pipeline schedules; the
bytes kept for backward equal the formula; bad policies are refused with one line."""

from __future__ import annotations

import tempfile
from dataclasses import replace

import pytest
import torch
from torch import nn

from loom.config import ConfigError, LoomConfig, validate
from loom.memory.activations import activation_bytes_per_layer, measure_layer_bytes
from loom.memory.compress import SavedActivations
from loom.memory.recompute import apply_recompute, saved_bytes_per_layer, selective_savings
from tests.dist import get_mesh
from tests.helpers import SEQ, VOCAB, one_thread, rank_micro_batches, tiny_model, tiny_train  # noqa: F401 (fixture)

POLICIES = ("none", "full", "selective", "every:2")
BATCH, MICRO = 8, 4


def run_layout(par: dict, train_kw: dict, model_kw: dict, steps: int, mesh_dims: dict | None = None) -> dict:
    """Train through ``build_run`` with ``cfg.parallel`` fields ``par`` on this rank's mesh; per-step
    losses and grad norms, and this rank's parameters (ZeRO-3: gathered) and gradients of the last step."""
    from loom.model.llama import build_model
    from loom.train.build import build_run
    from loom.train.schedule import lr_at
    from loom.train.step import train_step

    dims = mesh_dims or {}
    world = 1
    for v in dims.values():
        world *= v
    mesh = get_mesh(**dims) if dims else _single_mesh()
    cfg = LoomConfig(model=tiny_model(**model_kw), train=tiny_train(steps=steps, **train_kw))
    cfg.data.seq_len = SEQ
    cfg.run.dir = tempfile.mkdtemp(prefix="loom-recompute-")  # never the checkout's runs/default
    cfg.train.global_batch, cfg.train.micro_batch = BATCH, BATCH // mesh.size("dp") // 2  # 2 micro-batches
    cfg.parallel = replace(cfg.parallel, dp=mesh.size("dp"), dp_shard=mesh.size("dp_shard"), **par)
    validate(cfg, world)
    torch.manual_seed(cfg.train.seed)  # dropout masks: the same stream for every policy
    model = build_model(cfg.model, cfg.train.seed)
    run = build_run(cfg, mesh, model)
    model, strategy = run.model, run.strategy
    dp, dp_rank = mesh.size("dp"), mesh.local_rank("dp")
    saved = SavedActivations(model, cfg.train.compress)
    losses, norms = [], []
    for step in range(steps):
        micro = rank_micro_batches(step % 2, BATCH, cfg.train.micro_batch, dp_rank, dp)
        with saved:
            res = train_step(run, micro, cfg.train.grad_clip, lr_at(step, cfg.train), mesh.group("dp"))
        losses.append(res.loss)
        norms.append(res.grad_norm)
    params = _local_or_full_state(model, strategy, mesh)
    saved.remove()
    return {
        "losses": losses,
        "norms": norms,
        "params": params,
        "bytes": strategy.state_bytes(),
        "act_peak": saved.peak,
        "numels": [lay.padded for lay in getattr(getattr(strategy, "inner", strategy), "layouts", [])],
    }


def _local_or_full_state(model, strategy, mesh) -> dict[str, torch.Tensor]:
    """This rank's state dict; ZeRO-3 units gathered; tensor-parallel shards gathered into full tensors."""
    from loom.parallel.state import gather_full_state

    with strategy.gathered():
        if mesh.size("tp") > 1:
            return gather_full_state(model, mesh.group("tp"))
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _single_mesh():
    from loom.mesh import ParallelDims, ParallelMesh

    return ParallelMesh(ParallelDims(), "cpu")


def _grads_with(policy: str, dropout: float) -> tuple[float, list[torch.Tensor]]:
    from loom.model.llama import build_model, loss_fn

    model = build_model(tiny_model(n_layers=4, dropout=dropout), 3)
    apply_recompute(model, policy)
    torch.manual_seed(11)
    x, y = rank_micro_batches(0, BATCH, BATCH, 0, 1)[0]
    loss = loss_fn(model(x), y)
    loss.backward()
    return float(loss.detach()), [p.grad for p in model.parameters()]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests.helpers.one_thread: one intra-op thread


# ----------------------------------------------------------------------------- single process


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_recompute_equals_none_exactly_with_dropout(policy):
    ref_loss, ref_grads = _grads_with("none", 0.1)
    loss, grads = _grads_with(policy, 0.1)
    assert loss == ref_loss
    assert all(torch.equal(a, b) for a, b in zip(ref_grads, grads))


def test_recompute_training_equals_none_exactly():
    """Five optimizer steps through ``parallelize`` (dropout on): identical losses and weights."""
    runs = {p: run_layout({}, {"recompute": p}, {"dropout": 0.1, "n_layers": 4}, 5) for p in POLICIES}
    for p in POLICIES[1:]:
        assert runs[p]["losses"] == runs["none"]["losses"], p
        assert runs[p]["act_peak"] < runs["none"]["act_peak"], p
        assert all(torch.equal(runs[p]["params"][k], v) for k, v in runs["none"]["params"].items()), p


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_saved_bytes_equal_formula(kv_heads):
    """Per layer: none = A, full = the block input e·s·b·h only, selective = A - Δ, every:2 alternating."""
    from loom.model.llama import build_model

    cfg = tiny_model(n_layers=4, n_kv_heads=kv_heads)
    model = build_model(cfg, 0)
    x = torch.randint(0, VOCAB, (2, SEQ))
    assert cfg.n_kv_heads == kv_heads
    for policy in POLICIES:
        apply_recompute(model, policy)
        measured = measure_layer_bytes(model, x)
        want = {i: saved_bytes_per_layer(cfg, policy, i, 2, SEQ) for i in range(cfg.n_layers)}
        assert measured == want, policy
    full_layer = activation_bytes_per_layer(cfg, 2, SEQ)
    assert saved_bytes_per_layer(cfg, "full", 0, 2, SEQ) == 4 * 2 * SEQ * cfg.dim < full_layer / 15
    assert selective_savings(cfg, 2, SEQ) == 4 * 2 * SEQ * cfg.n_heads  # the log-sum-exp: k, v are unrepeated


def test_recompute_config_errors():
    for spec in ("sometimes", "every:0", "every:x", "every"):
        cfg = LoomConfig(model=tiny_model(), train=tiny_train(recompute=spec))
        cfg.data.seq_len = SEQ
        with pytest.raises(
            ConfigError, match=r"^train\.recompute: must be one of none, full, selective"
        ) as e:
            validate(cfg, 1)
        assert "\n" not in str(e.value)
    cfg = LoomConfig(model=tiny_model(n_layers=2), train=tiny_train(recompute="every:3"))
    cfg.data.seq_len = SEQ
    with pytest.raises(ConfigError, match=r"^train\.recompute: every:3 .* model\.n_layers = 2$"):
        validate(cfg, 1)
    mlp_only = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.raises(
        ConfigError, match=r"^train\.recompute: 'selective' recomputes the attention core"
    ) as e:
        apply_recompute(mlp_only, "selective")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^train\.recompute: 'full' checkpoints transformer blocks"):
        apply_recompute(mlp_only, "full")


# ----------------------------------------------------------------------------- 4 ranks

LAYOUTS = {  # name: (mesh dims, parallel fields)
    "tp2-sp-dp2": ({"tp": 2, "dp_replicate": 2}, {"tp": 2, "sp": True}),
    "zero3-dp4": ({"dp_shard": 4}, {"zero": 3}),
    "pp2-dp2-zb": ({"pp": 2, "dp_replicate": 2}, {"pp": 2, "pp_layout": "0-1,2-3", "schedule": "zb-h1"}),
}


def recompute_layouts(steps: int) -> dict:
    out = {}
    for name, (dims, par) in LAYOUTS.items():
        for policy in POLICIES if name != "zero3-dp4" else ("none", "full", "selective"):
            r = run_layout(par, {"recompute": policy}, {"dropout": 0.1, "n_layers": 4}, steps, dims)
            out[(name, policy)] = r
    return out


def test_recompute_equals_none_under_tp_sp_zero3_and_pipeline(pools):
    results = pools(4).run(recompute_layouts, 3)
    for r in results:
        for (name, policy), run in r.items():
            ref = r[(name, "none")]
            assert run["losses"] == ref["losses"], (name, policy)
            assert run["norms"] == ref["norms"], (name, policy)
            for k, v in ref["params"].items():
                assert torch.equal(run["params"][k], v), (name, policy, k)
            if policy != "none":  # the policy was applied: less is kept for backward
                assert run["act_peak"] < ref["act_peak"], (name, policy)
            if policy == "full":
                assert run["act_peak"] < ref["act_peak"] / 3, (name, run["act_peak"], ref["act_peak"])
