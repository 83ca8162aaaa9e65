"""Gemma 2's attention scale and soft-cap: scores s = c·tanh(σ q kᵀ / c) before the mask and the
softmax (σ = ``model.attn_scale``, 0: 1/sqrt(d); c = ``model.attn_softcap``, 0: no cap).

The attention core (SDPA with σ, the explicit capped products with GQA, packed documents and
dropout) and the context-parallel blocks (the fp32 products' forward and their backward through
the cap, the CPU flash kernel's σ) equal a hand-written fp64 reference, outputs and gradients; the
flex path's forward equals it too (torch 2.13's flex has no CPU backward: its gradients run on CUDA
only); generation with the KV cache equals the training forward; training under tp2 + sp, cp2 in
every mode (and packed documents) and pp2 equals one process, loss by loss; and neither σ nor c is a
no-op at the model's scale.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention
from torch.testing import assert_close

import loom.model.llama as llama
from loom.model.llama import CoreAttention, build_model, causal_block_mask, document_block_mask
from tests.helpers import SEQ, grads_of, one_thread, tiny_model, tiny_train, train_dp, train_layout  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
SCALE, CAP = 0.3, 2.0
# init std 0.2: the tiny model's scores are of order 1, where c·tanh(s/c) bends them (at the default
# 0.02 they are ~0.01 and the cap changes them by s³/(3c²) ~ 1e-7: no test could see it)
MODEL_KW = dict(attn_scale=SCALE, attn_softcap=CAP, init_std=0.2)
B, A, K, T, D = 2, 4, 2, 12, 8  # batch, query heads, key/value heads (GQA 4:2), sequence, head dim
DOCS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])


def visible(docs: torch.Tensor | None) -> torch.Tensor:
    """(B, 1, T, T) by hand: key j visible to query i iff j <= i (and in the same document)."""
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    return causal if docs is None else causal & (docs[:, None, :, None] == docs[:, None, None, :])


def reference(q, k, v, seen, scale: float, softcap: float, drop: float = 0.0) -> torch.Tensor:
    """transformers' Gemma 2 ``eager_attention_forward``, written out: keys and values repeated to the
    query heads (head i reads i // (a/k)), s = σ q kᵀ, c·tanh(s/c), −∞ where not ``seen``, softmax,
    dropout, P v."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * (scale or D**-0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
    return F.dropout(p, drop, training=True) @ v if drop else p @ v


def inputs(dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # scores σ q·k of order 1 to 3: the cap c = 2 bends them
    q, k, v = (torch.randn(B, h, T, D, generator=g, dtype=dtype) * 1.5 for h in (A, K, K))
    return q, k, v, torch.randn(B, A, T, D, generator=g, dtype=dtype)


SCORES = [(SCALE, CAP), (SCALE, 0.0), (0.0, CAP)]


@pytest.mark.parametrize("scale,softcap", SCORES, ids=["scale+cap", "scale", "cap"])
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
def test_core_equals_the_fp64_reference(packed, scale, softcap):
    """CoreAttention (GQA 4:2; causal, or packed documents' ids): output, dQ, dK, dV equal the
    reference, through SDPA with σ when uncapped and the explicit products when capped; and the cap
    changes the output (it is no identity at these scores)."""
    q, k, v, grad = inputs()
    docs = DOCS if packed else None
    core = CoreAttention(0.0, scale, softcap)
    got = grads_of(lambda *t: core(*t) if docs is None else core(*t, docs), q, k, v, grad)
    want = grads_of(lambda *t: reference(*t, visible(docs), scale, softcap), q, k, v, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")
    if softcap:
        assert (got[0] - reference(q, k, v, visible(docs), scale, 0.0)).abs().max() > 0.05


def test_capped_dropout_equals_the_reference_with_the_same_draws():
    """Attention dropout on the capped path drops the probabilities after the fp32 softmax, as
    transformers does: with the generator at the same state, the same mask, output and gradients."""
    q, k, v, grad = inputs()
    core = CoreAttention(0.25, SCALE, CAP).train()
    torch.manual_seed(5)
    got = grads_of(lambda *t: core(*t, DOCS), q, k, v, grad)
    torch.manual_seed(5)
    want = grads_of(lambda *t: reference(*t, visible(DOCS), SCALE, CAP, drop=0.25), q, k, v, grad)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)
    assert not torch.equal(got[0], reference(q, k, v, visible(DOCS), SCALE, CAP))  # something dropped


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("packed", [False, True], ids=["causal block mask", "document block mask"])
def test_flex_forward_applies_scale_and_cap(monkeypatch, packed):
    """The CUDA path, forward only here (eager flex on the CPU; no CPU backward in torch 2.13): flex
    with σ as its scale and the cap as its score_mod, under the causal or the documents' block mask,
    equals the reference; CoreAttention given a block mask takes it."""
    monkeypatch.setattr(llama, "_compiled_flex", flex_attention)
    q, k, v, _ = inputs(torch.float32)
    docs = DOCS if packed else None
    mask = document_block_mask(DOCS) if packed else causal_block_mask(T, q.device)
    want = reference(q.double(), k.double(), v.double(), visible(docs), SCALE, CAP).float()
    with torch.no_grad():
        assert_close(llama.flex(q, k, v, mask, SCALE, CAP), want)
        if packed:
            assert_close(CoreAttention(0.0, SCALE, CAP)(q, k, v, mask), want)


@pytest.mark.parametrize("scale,softcap", SCORES[:2], ids=["scale+cap fp32 products", "scale cpu kernel"])
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
def test_cp_blocks_merged_equal_the_reference(packed, scale, softcap):
    """Ring and all-gather attention's blocks (two causal diagonal blocks and one unmasked block, or
    the documents' masks), merged by log-sum-exp, and each block's backward from the merged output
    and lse: equal to the reference. Capped blocks run the fp32 products (dS through 1 − tanh²);
    uncapped ones the CPU flash kernel with σ as its scale."""
    from loom.parallel.context import blocks

    q, k, v, grad = inputs()
    docs = DOCS if packed else None
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference(*ref_in, visible(docs), scale, softcap)
    ref.backward(grad)
    h = T // 2
    parts = [
        (slice(0, h), slice(0, h), True),
        (slice(h, T), slice(h, T), True),
        (slice(h, T), slice(0, h), False),
    ]
    masks = [
        None if docs is None else blocks.doc_mask(docs[:, i], docs[:, j], c, q.dtype) for i, j, c in parts
    ]
    out, lse = torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"), dtype=q.dtype)
    for (i, j, c), m in zip(parts, masks, strict=True):
        o = blocks.attend(q[:, :, i], k[:, :, j], v[:, :, j], c and m is None, m, None, scale, softcap)
        blocks.merge(out[:, :, i], lse[:, :, i], *o)
    assert_close(out, ref.detach())
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (i, j, c), m in zip(parts, masks, strict=True):
        gq, gk, gv = blocks.attend_backward(
            grad[:, :, i], q[:, :, i], k[:, :, j], v[:, :, j], out[:, :, i], lse[:, :, i], c and m is None, m,
            None, scale, softcap,
        )  # fmt: skip
        dq[:, :, i] += gq
        dk[:, :, j] += gk
        dv[:, :, j] += gv
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_in, strict=True):
        assert_close(got, want.grad, msg=lambda m, name=name: f"{name}: {m}")


def test_cached_generation_equals_the_training_forward():
    """Generation's KV-cache path applies σ and the cap too: prefill and one-token steps give the
    logits of the full forward."""
    from loom.model.kv_cache import forward_cached, new_cache

    model = build_model(tiny_model(**MODEL_KW), 0)
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = new_cache(model, 1, SEQ)
        assert_close(forward_cached(model, ids[:, :10], cache), full[:, :10])
        for t in range(10, SEQ):
            assert_close(forward_cached(model, ids[:, t : t + 1], cache), full[:, t : t + 1])


# ----------------------------------------------------------------------------- layouts

BATCH, MICRO, STEPS = 8, 4, 4
TOL = dict(rtol=1e-4, atol=5e-5)  # as tests/test_context_parallel.py: sums split across ranks round apart


@pytest.fixture(scope="module")
def references():
    cfg, train = tiny_model(**MODEL_KW), tiny_train(steps=STEPS)
    return {packed: train_dp(None, cfg, train, BATCH, MICRO, packed=packed) for packed in (False, True)}


def test_scale_and_cap_change_the_loss(references):
    """Neither is a no-op at the tiny model's scale: without the cap, or with the default scale, the
    first loss (the same weights, one forward) moves by more than 100 times the layouts' tolerance."""
    first = references[False]["losses"][0]
    for change in (dict(attn_softcap=0.0), dict(attn_scale=0.0)):
        other = train_dp(None, tiny_model(**(MODEL_KW | change)), tiny_train(steps=1), BATCH, MICRO)
        assert abs(other["losses"][0] - first) > 5e-3, change


LAYOUTS = {
    "tp2 sp": ({"tp": 2, "sp": True}, False),
    "cp2 allgather": ({"cp": 2, "cp_mode": "allgather"}, False),
    "cp2 ring": ({"cp": 2, "cp_mode": "ring"}, False),
    "cp2 alltoall": ({"cp": 2, "cp_mode": "alltoall"}, False),
    "cp2 ring documents": ({"cp": 2, "cp_mode": "ring"}, True),
    "cp2 alltoall documents": ({"cp": 2, "cp_mode": "alltoall"}, True),
    "pp2": ({"pp": 2}, False),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_capped_model_trains_equal_to_one_process(pools, references, name):
    """The tiny model with σ = 0.3 and c = 2 trains under the layout as in one process: every step's
    loss, and the final weights."""
    layout, packed = LAYOUTS[name]
    reference = references[packed]
    for r in pools(2).run(train_layout, layout, STEPS, BATCH, MICRO, model_kw=MODEL_KW, packed=packed):
        assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), **TOL)
        if r["state"] is not None:
            for key, value in reference["state"].items():
                assert_close(r["state"][key], value, **TOL, msg=lambda m, key=key: f"{name} {key}: {m}")
