"""Families added for issue 34, item 10: Qwen3-MoE (``Qwen3MoeForCausalLM``: Qwen3's attention with
per-head q/k norms, every MLP a mixture of experts routed by softmax then top-k, renormalized or not
by ``norm_topk_prob``) and OLMo-2 (``Olmo2ForCausalLM``: norms closing the branches, x + norm(attn(x)),
and one q/k RMSNorm over all heads, a·d and k·d wide). A tiny random model built by ``transformers``
from a config (nothing downloaded) imports with its logits under 1 process, pp2, tp2 + sp (Qwen3-MoE's
experts whole on each tp rank; OLMo-2's q/k norms cut with the heads, sums of squares all-reduced) and ep2 (Qwen3-MoE), and Loom's export of
it (config and tensors) loads in ``transformers`` with the same weights and logits; what Loom cannot
hold is refused in one line naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from torch.testing import assert_close

from loom import config as C
from tests.test_finetune import hf_lora_config, prepared, trainer_fit  # noqa: F401

FIELDS = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,  # the dense MLP's width: unused when every layer is sparse
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=5e5,
)
FAMILIES = {
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48},
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
}


def save_family(path: Path, family: str, **kw) -> torch.nn.Module:
    """A random model of ``family`` saved at ``path`` in several shards (norm weights around 1)."""
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**(FIELDS | extra | kw)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.eval().save_pretrained(path, max_shard_size="20KB")
    return model


def _loom(path: Path):
    """(HF directory, Loom model with its weights): the [moe] options the directory fixes applied."""
    from loom.model.hf import load_into, moe_options, open_dir
    from loom.model.llama import Transformer

    hf = open_dir(path, 32)
    model = Transformer(hf.config, C.MoEConfig(**moe_options(hf)))  # type: ignore[arg-type]
    load_into(model, hf)
    return hf, model.eval()


@pytest.mark.parametrize(
    "family,kw",
    [("qwen3-moe", {"norm_topk_prob": True}), ("qwen3-moe", {"norm_topk_prob": False}), ("olmo2", {})],
    ids=["qwen3-moe renormalized", "qwen3-moe raw top-k", "olmo2"],
)
def test_import_gives_the_logits_of_transformers_and_export_round_trips(tmp_path, family, kw):
    """Logits equal transformers'; Loom's export (hf_config, hf_tensors) equals the checkpoint bit for
    bit and loads in transformers as the same family with the same routing and logits; generation's
    cached forward (prefill, then one token) gives the same logits as the model's."""
    from safetensors.torch import load_file, save_file

    from loom.model.hf import hf_config, hf_tensors
    from loom.model.kv_cache import forward_cached, new_cache

    ref = save_family(tmp_path / "src", family, **kw)
    hf, model = _loom(tmp_path / "src")
    assert hf.config.hf_architecture == FAMILIES[family][1]
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(x)
        assert_close(logits, ref(x).logits)
    out = dict(hf_tensors(hf.config, ((k, v.detach()) for k, v in model.state_dict().items())))
    on_disk = {
        k: v for f in sorted((tmp_path / "src").glob("*.safetensors")) for k, v in load_file(f).items()
    }
    assert out.keys() == on_disk.keys()
    for name, t in on_disk.items():
        assert torch.equal(out[name], t), name
    dst = tmp_path / "out"
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(hf.config, moe=C.MoEConfig(norm_topk=kw.get("norm_topk_prob", True)))
    (dst / "config.json").write_text(json.dumps(config))
    back = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    assert type(back) is type(ref)
    assert getattr(back.config, "norm_topk_prob", None) == kw.get("norm_topk_prob")
    theirs = ref.state_dict()  # in memory (transformers 5 fuses the experts): the same on both sides
    assert back.state_dict().keys() == theirs.keys()
    for name, t in back.state_dict().items():
        assert torch.equal(t, theirs[name]), name
    with torch.no_grad():
        assert_close(back(x).logits, logits)
        cache = new_cache(model, 2, 32)
        cached = torch.cat(
            (forward_cached(model, x[:, :31], cache), forward_cached(model, x[:, 31:], cache)), 1
        )
    assert_close(cached, logits)


def test_import_under_ep2_tp2_and_pp2_gives_the_logits_of_transformers(pools, tmp_path):
    """Built on the meta device and read box by box: under ep2 each rank reads only its experts (the
    bytes it holds) and gives its sequence's logits; under tp2 + sp each rank reads exactly its
    parameters' bytes (attention's rows, OLMo-2's q/k norm weights with them; the experts whole) and
    the gathered logits are transformers' (both families); under pp2 the loss through the pipeline is (and OLMo-2's, in the same pool call)."""
    from loom.model.llama import loss_fn
    from tests.test_hf import _ep2_logits, _layout_outputs

    ref = save_family(tmp_path, "qwen3-moe", norm_topk_prob=True)  # Loom's default routing
    olmo2 = save_family(tmp_path / "olmo2", "olmo2")
    x = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, expected_olmo2 = ref(x[:, :-1]).logits, olmo2(x[:, :-1]).logits
    for rank, (logits, read, held) in enumerate(pools(2).run(_ep2_logits, str(tmp_path), x[:, :-1])):
        assert_close(logits[0], expected[rank])
        assert read == held
    for rank in pools(2).run(_layout_outputs, [str(tmp_path), str(tmp_path / "olmo2")], x, "tp2"):
        for (logits, read, held, whole), want in zip(rank, (expected, expected_olmo2)):
            assert_close(logits, want)
            assert read == held < whole  # OLMo-2: its q/k norm weights' slices with the heads
    for loss in pools(2).run(_layout_outputs, [str(tmp_path), str(tmp_path / "olmo2")], x, "pp2"):
        assert loss[0] == pytest.approx(float(loss_fn(expected, x[:, 1:])), rel=1e-5)
        assert loss[1] == pytest.approx(float(loss_fn(expected_olmo2, x[:, 1:])), rel=1e-5)


def test_an_explicit_routing_option_against_the_directory_is_refused(tmp_path):
    """``--moe.norm_topk true`` on a Qwen3-MoE saved with ``norm_topk_prob = false`` would run other
    routing than the weights were trained with: refused in one line (it was silently overridden)."""
    from loom.model.hf import resolve_from_hf

    save_family(tmp_path, "qwen3-moe", norm_topk_prob=False)
    cfg = C.load(
        None,
        [
            "--model.from_hf",
            str(tmp_path),
            "--moe.norm_topk",
            "true",
            "--data.source",
            "x.txt",
            "--data.tokenizer",
            "t.json",
        ],
    )
    with pytest.raises(
        C.ConfigError, match=r"moe.norm_topk: True contradicts .*config.json, whose routing gives False"
    ):
        resolve_from_hf(cfg)
    cfg = C.load(
        None,
        [
            "--model.from_hf",
            str(tmp_path),
            "--moe.norm_topk",
            "false",
            "--data.source",
            "x.txt",
            "--data.tokenizer",
            "t.json",
        ],
    )
    resolve_from_hf(cfg)  # the same value: fine
    assert cfg.moe.norm_topk is False


@pytest.mark.parametrize(
    "edit,says",
    [
        (
            {"mlp_only_layers": [1]},
            "config.json: mlp_only_layers = [1] is not supported (Loom: []: every layer a mixture of experts)",
        ),
        (
            {"decoder_sparse_step": 2},
            "config.json: decoder_sparse_step = 2 is not supported (Loom: 1: every layer a mixture of experts)",
        ),
    ],
    ids=["mlp_only_layers", "decoder_sparse_step"],
)
def test_what_loom_cannot_hold_is_one_line_naming_the_field(tmp_path, edit, says):
    from loom.model.hf import HFError, open_dir

    save_family(tmp_path, "qwen3-moe")
    raw = json.loads((tmp_path / "config.json").read_text()) | edit
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HFError) as e:
        open_dir(tmp_path, 32)
    assert str(e.value) == says


OLMO2 = {"qk_norm": True, "qk_norm_scope": "all", "norm_placement": "post"}


def _olmo2_tp2(kvs: list[int]) -> list[dict]:
    from tests.helpers import train_layout

    return [train_layout({"tp": 2, "sp": True}, 3, 4, 2, OLMO2 | {"n_kv_heads": kv}, meta=True) for kv in kvs]


def test_olmo2_trains_under_tp2_sp_equal_to_one_process(pools):
    """OLMo-2's q/k norms over all heads under tp2 + sp: each rank's weight slice with its heads, the
    sums of squares all-reduced (forward and backward); with one kv head (replicated over tp) the k
    norm's weight whole and its sum divided by the 2 copies. 3 steps of 2 micro-batches: losses and
    every parameter equal one process, and the bytes moved per step equal ``comm_bytes_formula``
    (its 2ρ·4L·b·s·4 of norm sums included). The planner counts the same collective calls and bytes
    by op (``tp_calls``: 4 all-reduces of the (B, T, 1) fp32 sums per layer and micro-batch)."""
    from loom.comm import ring_bytes
    from loom.parallel.tensor.parallelize import comm_bytes_formula
    from loom.plan.cost import CostModel, Layout, Workload
    from loom.plan.hardware import ClusterSpec
    from tests.helpers import SEQ, tiny_model, train_layout

    kvs = [2, 1]
    refs = [train_layout({}, 3, 4, 2, OLMO2 | {"n_kv_heads": kv}) for kv in kvs]
    for rank in pools(2).run(_olmo2_tp2, kvs):
        for kv, r, ref in zip(kvs, rank, refs):
            assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
            assert r["state"].keys() == ref["state"].keys()
            for k, v in ref["state"].items():
                assert_close(
                    r["state"][k], v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k, kv=kv: f"kv {kv} {k}: {m}"
                )
            want = comm_bytes_formula(tiny_model(**OLMO2, n_kv_heads=kv), 2, SEQ, 2, True, micro_batches=2)
            assert [sum(m.values()) for m in r["moved"]] == [pytest.approx(want)] * 3, kv
            cm = CostModel(
                tiny_model(**OLMO2, n_kv_heads=kv),
                Workload(4, SEQ, precision="fp32"),
                ClusterSpec.single_node("cpu", 2),
            )
            lay = Layout(tp=2, sp=True, micro_batch=2)
            assert r["calls"] == [cm.collective_calls(lay)] * 3, kv
            planned = cm.tp_payload(lay)  # + the once-a-step sum of the gradients held in part (fp32)
            planned["all_reduce"] += 4 * cm.tp_partial_params(2, True, 1)
            assert r["moved"] == [{op: ring_bytes(op, b, 2) for op, b in planned.items()}] * 3, kv


@pytest.mark.parametrize("family", ["qwen3-moe", "olmo2"])
def test_a_run_from_the_family_exports_it_with_its_weights(prepared, tmp_path, family):  # noqa: F811
    """2 full fine-tuning steps from the directory (Qwen3-MoE without top-k renormalization: from_hf
    sets moe.norm_topk = false); ``export hf`` writes the same family, its tensors the checkpoint's,
    that transformers loads with the same routing and Loom's logits."""
    from safetensors.torch import load_file

    from loom.checkpoint.hf_export import export_hf
    from loom.checkpoint.load import CheckpointReader
    from loom.data.tokenizer import load_tokenizer
    from loom.model.hf import hf_tensors
    from loom.model.llama import Transformer

    base = tmp_path / "base"
    save_family(base, family, vocab_size=384, **({"norm_topk_prob": False} if family == "qwen3-moe" else {}))
    load_tokenizer(prepared).save(str(base / "tokenizer.json"))
    run = tmp_path / "run"
    cfg = hf_lora_config(prepared, base, run, finetune={"method": "full"}, train={"steps": 2})
    trainer_fit(cfg)
    export_hf(run, tmp_path / "out", dtype="fp32")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(theirs).__name__ == FAMILIES[family][1]
    with CheckpointReader(run) as reader:
        saved = C.from_dict(reader.train_state["config"])
        state = {n[len("model.") :]: reader.read(n) for n in reader.names() if n.startswith("model.")}
    assert saved.moe.norm_topk == (family != "qwen3-moe")
    assert getattr(theirs.config, "norm_topk_prob", False) is False
    written = {
        k: v for f in sorted((tmp_path / "out").glob("*.safetensors")) for k, v in load_file(f).items()
    }
    want = dict(hf_tensors(saved.model, iter(state.items())))
    assert written.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(written[name], t), name
    model = Transformer(saved.model, saved.moe)
    model.load_state_dict(state)
    x = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(theirs(x).logits, model.eval()(x))
