"""Sliding-window attention (``model.sliding_window`` w, ``model.window_layers``): on a windowed layer
query i sees key j iff i - w < j <= i, transformers' ``sliding_window_causal_mask_function``.

The attention core (SDPA or the explicit capped products over the dense window mask; causal and
packed documents, GQA, with and without the soft-cap, w < T and w >= T) equals a hand-written fp64
reference, outputs and gradients; flex's forward under the windowed block masks equals it too, and
their tables skip exactly the blocks outside the window (torch 2.13's flex has no CPU backward: its
gradients run on CUDA only); a model whose layers differ in window gives each its own document block
mask; the context-parallel blocks (:func:`~loom.parallel.context.blocks.window_blocks`) merged over
every rank equal the reference and skip the blocks beyond the window; cached decoding equals the full
forward past the window, left-padded rows included; tiny ``MistralForCausalLM`` and
``Gemma2ForCausalLM`` (alternating windowed layers) import with transformers' logits; a windowed
tiny model trains under tp2 + sp, pp2 and cp2 in every mode (and packed documents) as in one process,
loss by loss; and the window changes the loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention
from torch.testing import assert_close

import loom.model.llama as llama
from loom.model.llama import (
    CoreAttention,
    build_model,
    causal_block_mask,
    document_block_mask,
    window_mask,
)
from loom.parallel.context import blocks
from tests.helpers import SEQ, grads_of, one_thread, tiny_model, tiny_train, train_dp, train_layout  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
SCALE, CAP = 0.3, 2.0
B, A, K, T, D = 2, 4, 2, 12, 8  # batch, query heads, key/value heads (GQA 4:2), sequence, head dim
DOCS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
WINDOW = 4  # < T: hides keys; T and 2T: hide none
# the layouts' model: w = 5 of 16 on layers 0 and 2 of 3 (Gemma 2's alternation); init std 0.2 makes
# the scores of order 1, so what the window hides moves the loss well past the layouts' tolerance
MODEL_KW = dict(n_layers=3, sliding_window=5, window_layers="0,2", init_std=0.2)


def visible(docs: torch.Tensor | None, window: int, n: int = T) -> torch.Tensor:
    """(B|1, 1, n, n) by hand: key j visible to query i iff i - window < j <= i (and same document)."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    seen = ((j <= i) & (j > i - window))[None, None]
    return seen if docs is None else seen & (docs[:, None, :, None] == docs[:, None, None, :])


def reference(q, k, v, seen, scale: float = 0.0, softcap: float = 0.0, drop: float = 0.0) -> torch.Tensor:
    """Eager attention written out: keys and values repeated to the query heads, s = σ q kᵀ,
    c·tanh(s/c), −∞ where not ``seen``, softmax, dropout, P v."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
    return F.dropout(p, drop, training=True) @ v if drop else p @ v


def inputs(dtype=torch.float64, seed: int = 0, n: int = T):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, generator=g, dtype=dtype) * 1.5 for h in (A, K, K))
    return q, k, v, torch.randn(B, A, n, D, generator=g, dtype=dtype)


@pytest.mark.parametrize("window", [1, 3, 12, 20])
def test_window_mask_is_transformers_rule(window):
    """:func:`window_mask` is transformers' sliding-window causal mask, element for element (also
    with queries at an offset, as the KV cache asks)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    rule = sliding_window_causal_mask_function(window)
    q_idx, kv_idx = torch.arange(T)[:, None], torch.arange(T)[None, :]
    assert torch.equal(window_mask(T, T, window), rule(0, 0, q_idx, kv_idx))
    assert torch.equal(window_mask(3, T, window, offset=T - 3), rule(0, 0, q_idx[-3:], kv_idx))


SCORES = [(0.0, 0.0), (SCALE, CAP)]


@pytest.mark.parametrize("scale,softcap", SCORES, ids=["plain", "scale+cap"])
@pytest.mark.parametrize("window", [WINDOW, T, 2 * T], ids=["w<T", "w=T", "w>T"])
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
def test_core_equals_the_fp64_reference(packed, window, scale, softcap):
    """CoreAttention with a window (GQA 4:2; causal, or packed documents' ids; SDPA over the dense
    mask, or the explicit capped products): output, dQ, dK, dV equal the reference; a window shorter
    than the sequence changes the output, one as long or longer does not."""
    q, k, v, grad = inputs()
    docs = DOCS if packed else None
    core = CoreAttention(0.0, scale, softcap, window)
    got = grads_of(lambda *t: core(*t) if docs is None else core(*t, docs), q, k, v, grad)
    want = grads_of(lambda *t: reference(*t, visible(docs, window), scale, softcap), q, k, v, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")
    whole = reference(q, k, v, visible(docs, T), scale, softcap)
    assert ((got[0] - whole).abs().max() > 0.05) == (window < T)


def test_windowed_dropout_equals_the_reference_with_the_same_draws():
    """Attention dropout on the capped windowed path drops the probabilities after the fp32 softmax:
    with the generator at the same state, the same mask, output and gradients."""
    q, k, v, grad = inputs()
    core = CoreAttention(0.25, SCALE, CAP, WINDOW).train()
    torch.manual_seed(5)
    got = grads_of(lambda *t: core(*t, DOCS), q, k, v, grad)
    torch.manual_seed(5)
    want = grads_of(lambda *t: reference(*t, visible(DOCS, WINDOW), SCALE, CAP, drop=0.25), q, k, v, grad)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


def block_sets(mask) -> tuple[set, set]:
    """(partial, full) (batch, query block, key block) of a :class:`BlockMask`'s tables."""
    out = []
    for num, idx in ((mask.kv_num_blocks, mask.kv_indices), (mask.full_kv_num_blocks, mask.full_kv_indices)):
        out.append(
            {
                (b, i, int(j))
                for b in range(num.shape[0])
                for i in range(num.shape[2])
                for j in idx[b, 0, i, : num[b, 0, i]]
            }
        )
    return out[0], out[1]


def dense_sets(seen: torch.Tensor, block: int) -> tuple[set, set]:
    """(some visible, all visible) (batch, query block, key block) of a dense (B, 1, n, n) mask."""
    tiles = seen[:, 0].unflatten(1, (-1, block)).unflatten(3, (-1, block))  # (B, nq, block, nk, block)
    some, every = tiles.any(4).any(2), tiles.all(4).all(2)  # (B, nq, nk)
    return {tuple(x) for x in some.nonzero().tolist()}, {tuple(x) for x in every.nonzero().tolist()}


@pytest.mark.parametrize("window", [3, 6, 9, 30])
def test_block_masks_skip_the_blocks_outside_the_window(window):
    """Tables of 4-token blocks over 24 tokens: the windowed causal mask's kept blocks (partial or
    full) are exactly those with a visible pair and its full blocks exactly those all visible; the
    documents' mask keeps every block with a visible pair and no block with none outside its
    documents' and window's reach (kept ⊆ the window's, full ⊆ all visible)."""
    n, block = 24, 4
    one = torch.zeros(1, n, dtype=torch.long)
    partial, full = block_sets(llama._banded_block_mask(one, block, window, llama._causal_window(window)))
    some, every = dense_sets(visible(None, window, n), block)
    assert partial | full == some and full == every and not partial & full
    if window < n:  # rows hold at most ceil((w - 1) / block) + 1 blocks: the rest are skipped
        assert len(some) < n // block * (n // block + 1) // 2
    docs = (torch.rand(2, n, generator=torch.Generator().manual_seed(window)) < 0.2).long().cumsum(1)
    partial, full = block_sets(document_block_mask(docs, block, window))
    some, every = dense_sets(visible(docs, window, n), block)
    window_some, _ = dense_sets(visible(None, window, n).expand(2, -1, -1, -1), block)
    assert some <= partial | full <= window_some and full <= every and not partial & full


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("packed", [False, True], ids=["causal block mask", "document block mask"])
@pytest.mark.parametrize("window", [3, 9])
def test_flex_forward_applies_the_window(monkeypatch, packed, window):
    """The CUDA path, forward only here (eager flex on the CPU): flex under the windowed causal mask
    or the documents' windowed mask (4-token blocks: some skipped, some full, some partial; and
    flex's own 128) equals the reference, with σ and the cap; a core given the pair (unwindowed,
    windowed) takes its own."""
    monkeypatch.setattr(llama, "_compiled_flex", flex_attention)
    n = 24
    q, k, v, _ = inputs(torch.float32, n=n)
    docs = (torch.rand(B, n, generator=torch.Generator().manual_seed(2)) < 0.2).long().cumsum(1)
    want = reference(
        q.double(), k.double(), v.double(), visible(docs if packed else None, window, n), SCALE, CAP
    )
    with torch.no_grad():
        if packed:
            for mask in (document_block_mask(docs, 4, window), document_block_mask(docs, window=window)):
                assert_close(llama.flex(q, k, v, mask, SCALE, CAP), want.float())
            pair = (document_block_mask(docs), document_block_mask(docs, window=window))
            assert_close(CoreAttention(0.0, SCALE, CAP, window)(q, k, v, pair), want.float())
            whole = reference(q.double(), k.double(), v.double(), visible(docs, n, n), SCALE, CAP)
            assert_close(CoreAttention(0.0, SCALE, CAP, 0)(q, k, v, pair), whole.float())
        else:
            mask = causal_block_mask(n, q.device, window)
            assert_close(llama.flex(q, k, v, mask, SCALE, CAP), want.float())


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("softcap", [0.0, CAP], ids=["window", "window + cap"])
def test_unpacked_flex_layers_take_their_causal_masks_from_layer_args(monkeypatch, softcap):
    """CUDA's path, on the CPU with eager flex: unpacked sequences through a model windowed on layers 0
    and 2 get from ``layer_args`` the windowed causal block mask, and for layer 1 the plain causal one
    when the model is capped (flex applies the cap) or None (SDPA's causal flag); the masks are built
    there once per forward, never inside a block (under ``torch.compile`` a block would break its
    graph to build one), the blocks compile with no graph break, and the logits equal the dense path's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = build_model(tiny_model(**MODEL_KW, attn_softcap=softcap), 0).eval()
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(5))
    built = []
    with torch.no_grad():
        dense = model(ids)
        monkeypatch.setattr(llama, "packed_attention", lambda device: "flex")
        monkeypatch.setattr(llama, "_compiled_flex", flex_attention)
        whole = llama.causal_block_mask
        monkeypatch.setattr(llama, "causal_block_mask", lambda *a: built.append(a) or whole(*a))
        first, windowed = llama.layer_args(model.rope_cos, model.rope_sin, None, model.layers, SEQ)[2]
        assert (first is None) == (softcap == 0) and isinstance(windowed, llama.BlockMask)
        built.clear()
        assert_close(model(ids), dense)
        assert sorted(built) == sorted([(SEQ, ids.device, 5)] + [(SEQ, ids.device, 0)] * (softcap > 0))
        torch._dynamo.reset()  # another test's compiles of these blocks (another cap) would make the cap a SymFloat
        counter = CompileCounterWithBackend("eager")
        for layer in model.layers:
            layer.compile(backend=counter, fullgraph=True)  # a graph break would raise
        assert_close(model(ids), dense)
        assert counter.frame_count >= 1


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_layers_of_two_windows_each_get_their_document_mask(monkeypatch):
    """Packed documents through flex (CUDA's path, eager here): a model with windowed and unwindowed
    layers gets the pair of block masks from ``layer_args``, and its logits equal the dense path's
    (SDPA over each layer's (B, 1, T, T) mask)."""
    model = build_model(tiny_model(**MODEL_KW), 0).eval()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 128, (2, SEQ), generator=g)
    positions = torch.cat([torch.arange(9), torch.arange(7)]).repeat(2, 1)
    with torch.no_grad():
        dense = model(ids, positions)
        monkeypatch.setattr(llama, "packed_attention", lambda device: "flex")
        monkeypatch.setattr(llama, "_compiled_flex", flex_attention)
        args = llama.layer_args(model.rope_cos, model.rope_sin, positions, model.layers)
        assert isinstance(args[2], tuple) and len(args[2]) == 2
        assert_close(model(ids, positions), dense)


@pytest.mark.parametrize("scale,softcap", SCORES, ids=["cpu kernel", "scale+cap fp32 products"])
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("cp,window", [(2, 3), (2, 7), (3, 5), (3, 40)])
def test_cp_window_blocks_merged_equal_the_reference(cp, window, packed, scale, softcap):
    """Ring and all-gather attention's blocks under a window, one process standing in for every cp
    rank: each rank's local queries against every rank's keys (:func:`blocks.window_blocks`, band
    masks by global positions, documents by global ids), merged by log-sum-exp, and each block's
    backward from the merged output and lse, summed: equal to the reference. The blocks are exactly
    the pairs of chunks with a visible pair: the rest are skipped."""
    n = 24
    q, k, v, grad = inputs(n=n)
    starts = torch.rand(B, n, generator=torch.Generator().manual_seed(cp)) < 0.2
    starts[:, 0] = True
    docs = starts.long().cumsum(1) if packed else None
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference(*ref_in, visible(docs, window, n), scale, softcap)
    ref.backward(grad)
    c = n // (2 * cp)
    pos = [blocks.local_positions(n, cp, r) for r in range(cp)]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    seen = visible(None, window, n)[0, 0]
    for r in range(cp):
        qr, gr = q[:, :, pos[r]], grad[:, :, pos[r]]
        out, lse = torch.zeros_like(qr), torch.full(qr.shape[:3], float("-inf"), dtype=q.dtype)
        parts = []
        for src in range(cp):
            kr, vr = k[:, :, pos[src]], v[:, :, pos[src]]
            dq_, dk_ = (None, None) if docs is None else (docs[:, pos[r]], docs[:, pos[src]])
            found = blocks.window_blocks(r, src, c, cp, window)
            chunks = {(qi, ki) for qi in range(2) for ki in range(2)}
            near = {
                (qi, ki)
                for qi, ki in chunks
                if seen[pos[r][qi * c : qi * c + c]][:, pos[src][ki * c : ki * c + c]].any()
            }
            assert {(qs.start // c, ks.start // c) for qs, ks, _, _ in found} == near
            for qs, ks, causal, gap in found:
                m = blocks.block_mask(dq_, dk_, qs, ks, causal, gap, window, q.dtype, q.device)
                o = blocks.attend(
                    qr[:, :, qs], kr[:, :, ks], vr[:, :, ks], causal and m is None, m, None, scale, softcap
                )
                blocks.merge(out[:, :, qs], lse[:, :, qs], *o)
                parts.append((src, qs, ks, causal and m is None, m))
        assert_close(out, ref.detach()[:, :, pos[r]], msg=lambda m, r=r: f"rank {r}: {m}")
        for src, qs, ks, causal, m in parts:
            kr, vr = k[:, :, pos[src]], v[:, :, pos[src]]
            gq, gk, gv = blocks.attend_backward(
                gr[:, :, qs], qr[:, :, qs], kr[:, :, ks], vr[:, :, ks], out[:, :, qs], lse[:, :, qs], causal, m,
                None, scale, softcap,
            )  # fmt: skip
            dq[:, :, pos[r][qs]] += gq
            dk[:, :, pos[src][ks]] += gk
            dv[:, :, pos[src][ks]] += gv
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_in, strict=True):
        assert_close(got, want.grad, msg=lambda m, name=name: f"{name}: {m}")


def test_cached_decode_equals_the_full_forward_past_the_window():
    """Generation's KV cache on a model windowed on layers 0 and 2 (w = 5 of 16): a prefill longer
    than the window, then one-token steps, give the full forward's logits; a left-padded row (5
    fillers) gives the logits of its prompt alone; and the window changes the logits."""
    from loom.model.kv_cache import forward_cached, new_cache

    cfg = tiny_model(**MODEL_KW)
    model = build_model(cfg, 0).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, SEQ), generator=g)
    pad = 5
    batch = torch.cat([ids[:1], torch.cat([torch.zeros(1, pad, dtype=torch.long), ids[1:, : SEQ - pad]], 1)])
    with torch.no_grad():
        full = model(ids)
        alone = model(ids[1:, : SEQ - pad])
        for rows, padding in ((ids[:1], None), (batch, torch.tensor([0, pad]))):
            cache = new_cache(model, rows.shape[0], SEQ, padding)
            got = [forward_cached(model, rows[:, :9], cache)]
            got += [forward_cached(model, rows[:, t : t + 1], cache) for t in range(9, SEQ)]
            logits = torch.cat(got, 1)
            assert_close(logits[0], full[0])
            if padding is not None:
                assert_close(logits[1, pad:], alone[0])
        unwindowed = build_model(tiny_model(**(MODEL_KW | dict(sliding_window=0))), 0).eval()
        assert (unwindowed(ids) - full).abs().max() > 1e-2


def test_windowed_layers_cache_a_ring_of_w_slots():
    """The windowed layers keep w = 5 slots of the 16 (a ring), the cache 2·B·k·d·4·(16 + 5 + 5)
    bytes; steps of every length (3, 4, then 7 > w, then one token at a time) over padded and
    unpadded rows give the full forward's logits."""
    from loom.model.kv_cache import forward_cached, new_cache

    cfg = tiny_model(**MODEL_KW)
    model = build_model(cfg, 0).eval()
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(2))
    pad = 3
    batch = torch.cat([ids[:1], torch.cat([torch.zeros(1, pad, dtype=torch.long), ids[1:, : SEQ - pad]], 1)])
    with torch.no_grad():
        full, alone = model(ids), model(ids[1:, : SEQ - pad])
        for rows, padding in ((ids, None), (batch, torch.tensor([0, pad]))):
            cache = new_cache(model, 2, SEQ, padding)
            assert [t.shape[2] for t in cache.keys] == [5, SEQ, 5]
            assert cache.nbytes == 2 * 2 * cfg.n_kv_heads * cfg.head_dim * 4 * (SEQ + 5 + 5)
            cuts = [0, 3, 7, 14, 15, 16]
            logits = torch.cat(
                [forward_cached(model, rows[:, a:b], cache) for a, b in zip(cuts, cuts[1:])], 1
            )
            assert_close(logits[0], full[0])
            if padding is None:
                assert_close(logits[1], full[1])
            else:
                assert_close(logits[1, pad:], alone[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_windowed_flex_on_cuda_equals_fp64():
    """On CUDA the window runs compiled flex: causal (``attention`` with a window, no mask) and under
    the documents' windowed block mask, GQA 8 heads on 2, bf16, soft-capped and not, forward and
    gradients against the explicit fp64 products, as close as the explicit bf16 path is; the tables
    keep about w/128 + 1 blocks per row of 128 queries, not up to T/128."""
    from loom.model.llama import attention, capped_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    n, a, k, T, d, w = 2, 8, 2, 1024, 64, 256
    q, kk, v = (torch.randn(n, h, T, d, device="cuda", generator=g).bfloat16() for h in (a, k, k))
    docs = torch.cat([torch.zeros(n, 300), torch.ones(n, T - 300)], 1).long().cuda()
    dy = torch.randn(n, a, T, d, device="cuda", generator=g).bfloat16()
    tables = causal_block_mask(T, q.device, w)
    assert int((tables.kv_num_blocks + tables.full_kv_num_blocks).max()) == w // 128 + 1
    for packed in (False, True):
        for cap in (0.0, 5.0):
            seen = window_mask(T, T, w, "cuda")
            if packed:
                seen = seen & (docs[:, None, :, None] == docs[:, None, None, :])
            ins = [t.detach().clone().requires_grad_() for t in (q, kk, v)]
            if packed:
                out = llama.flex(*ins, document_block_mask(docs, window=w), 0.1, cap)
            else:
                out = attention(*ins, scale=0.1, softcap=cap, window=w)  # CUDA, causal, no dropout: flex
            out.backward(dy)
            explicit = []
            for dtype in (torch.float64, torch.bfloat16):
                ref_in = [t.detach().to(dtype).requires_grad_() for t in (q, kk, v)]
                ref = capped_attention(*ref_in, seen, 0.0, False, 0.1, cap) if cap else None
                if ref is None:
                    ref = reference(*ref_in, seen, 0.1)
                ref.backward(dy.to(dtype))
                explicit.append((ref, *(t.grad for t in ref_in)))
            for ours, exact, half in zip((out, *(t.grad for t in ins)), *explicit, strict=True):
                err, half_err = ((x.double() - exact).norm() / exact.norm() for x in (ours, half))
                assert err <= max(2 * half_err, 1e-2), (packed, cap, err, half_err)


# ----------------------------------------------------------------------------- transformers

HF_FIELDS = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    sliding_window=5,
)
HF_FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {}, "all"),
    # eager: Gemma 2's soft-cap; default layer_types: sliding, full, sliding
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(attn_logit_softcapping=1.0), "0,2"),
}


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_import_gives_the_logits_of_transformers(tmp_path, family):
    """A tiny random transformers model with a window of 5 over sequences of 16 (eager attention)
    imports as w = 5 on its windowed layers and gives transformers' logits, which the window changes."""
    import dataclasses

    import transformers

    from loom.model.hf import load_into, open_dir
    from loom.model.llama import Transformer

    cfg_cls, model_cls, extra, layers = HF_FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_cls)(**(HF_FIELDS | extra))
    config._attn_implementation = "eager"
    theirs = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    theirs.eval().save_pretrained(tmp_path)
    hf = open_dir(tmp_path, SEQ)
    assert (hf.config.sliding_window, hf.config.window_layers) == (5, layers)
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = theirs(ids).logits
        for cfg in (hf.config, dataclasses.replace(hf.config, sliding_window=0)):
            ours = Transformer(cfg)
            load_into(ours, hf)
            got = ours.eval()(ids)
            if cfg.sliding_window:
                assert_close(got, want, rtol=1e-4, atol=1e-5)
            else:
                assert (got - want).abs().max() > 1e-3  # the window is doing something


# ----------------------------------------------------------------------------- layouts

BATCH, MICRO, STEPS = 8, 4, 3
TOL = dict(rtol=1e-4, atol=5e-5)  # as tests/test_context_parallel.py: sums split across ranks round apart


@pytest.fixture(scope="module")
def references():
    cfg, train = tiny_model(**MODEL_KW), tiny_train(steps=STEPS)
    return {packed: train_dp(None, cfg, train, BATCH, MICRO, packed=packed) for packed in (False, True)}


def test_the_window_changes_the_loss(references):
    """Not a no-op at the tiny model's scale: without the window the first loss (the same weights,
    one forward) moves by more than 100 times the layouts' tolerance."""
    first = references[False]["losses"][0]
    other = train_dp(
        None, tiny_model(**(MODEL_KW | dict(sliding_window=0))), tiny_train(steps=1), BATCH, MICRO
    )
    assert abs(other["losses"][0] - first) > 5e-3


LAYOUTS = {
    "tp2 sp": ({"tp": 2, "sp": True}, False),
    "pp2": ({"pp": 2}, False),
    "cp2 alltoall": ({"cp": 2, "cp_mode": "alltoall"}, False),
    "cp2 ring": ({"cp": 2, "cp_mode": "ring"}, False),
    "cp2 allgather": ({"cp": 2, "cp_mode": "allgather"}, False),
    "cp2 alltoall documents": ({"cp": 2, "cp_mode": "alltoall"}, True),
    "cp2 ring documents": ({"cp": 2, "cp_mode": "ring"}, True),
    "cp2 allgather documents": ({"cp": 2, "cp_mode": "allgather"}, True),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_windowed_model_trains_equal_to_one_process(pools, references, name):
    """The tiny model windowed on layers 0 and 2 (w = 5 of 16; cp2's chunks of 4: blocks skipped,
    causal, full and banded) trains under the layout as in one process: every step's loss, and the
    final weights."""
    layout, packed = LAYOUTS[name]
    reference = references[packed]
    for r in pools(2).run(train_layout, layout, STEPS, BATCH, MICRO, model_kw=MODEL_KW, packed=packed):
        assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), **TOL)
        if r["state"] is not None:
            for key, value in reference["state"].items():
                assert_close(r["state"][key], value, **TOL, msg=lambda m, key=key: f"{name} {key}: {m}")


def _halo_bytes(micro: int, batch: int, kv_width: int, layers: int, neighbours: int = 1) -> int:
    """loom.parallel.context.halo's formula: per windowed layer and micro-batch, n·2·B·H·kh·d·4 bytes
    forward (fp32 here) and n·2·B·H·kh·d·4 backward, H = w − 1."""
    h = MODEL_KW["sliding_window"] - 1
    return micro * layers * 2 * (neighbours * 2 * batch * h * kv_width * 4)


@pytest.mark.parametrize("mode", ["ring", "allgather"])
def test_windowed_layers_under_cp_exchange_only_their_halo(pools, references, mode):
    """cp2 with chunks of c = 4 tokens and w = 5 (w − 1 <= c): the two windowed layers send each
    neighbour its H = 4 last rows of K and V and get their gradients back, the formula's bytes; the
    unwindowed layer keeps the ring's (cp − 1)·2·kv forward, the same plus cp·2·kv fp32 accumulators
    backward (kv = B·(T/cp)·k·d), or all-gathers: half the ring's bytes or less in all."""
    layout = {"cp": 2, "cp_mode": mode}
    micro, b = BATCH // MICRO, MICRO  # micro-batches per step, sequences in each (dp 1)
    cfg = tiny_model(**MODEL_KW)
    kv_width = cfg.n_kv_heads * cfg.head_dim
    kv = b * (SEQ // 2) * kv_width
    ring = micro * (2 * kv * 4 + 2 * kv * 4 + 2 * 2 * kv * 4)  # the unwindowed layer, fp32
    for r in pools(2).run(train_layout, layout, 1, BATCH, MICRO, model_kw=MODEL_KW):
        assert_close(torch.tensor(r["losses"]), torch.tensor(references[False]["losses"][:1]), **TOL)
        sent = r["moved"][0]["send"]
        assert sent == _halo_bytes(micro, b, kv_width, 2) + (ring if mode == "ring" else 0)
        assert sent <= (3 * ring if mode == "ring" else ring) / 2


def test_a_window_longer_than_a_chunk_keeps_the_rings_blocks(pools):
    """w − 1 > c (w = 7 over chunks of 4): the ring circulates every block, windowed blocks banded or
    skipped, and trains equal to one process."""
    model = MODEL_KW | {"sliding_window": 7}
    ref = train_dp(None, tiny_model(**model), tiny_train(steps=2), BATCH, MICRO)
    for r in pools(2).run(train_layout, {"cp": 2, "cp_mode": "ring"}, 2, BATCH, MICRO, model_kw=model):
        assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL)
        kv = MICRO * (SEQ // 2) * 16  # B·(T/cp)·k·d: 2 key heads of 8
        assert r["moved"][0]["send"] == 3 * (BATCH // MICRO) * (2 + 2 + 4) * kv * 4  # every layer the ring's


def test_four_cp_ranks_exchange_halos_both_ways(pools):
    """cp4 (chunks of 2, w = 3): the middle ranks swap halos with both neighbours, the ends with one;
    packed documents cross the chunks; every step equals one process."""
    model = MODEL_KW | {"sliding_window": 3}
    for packed in (False, True):
        ref = train_dp(None, tiny_model(**model), tiny_train(steps=2), BATCH, MICRO, packed=packed)
        runs = pools(4).run(
            train_layout, {"cp": 4, "cp_mode": "ring"}, 2, BATCH, MICRO, model_kw=model, packed=packed
        )
        for r in runs:
            assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL)
            if r["state"] is not None:
                for key, value in ref["state"].items():
                    assert_close(
                        r["state"][key], value, **TOL, msg=lambda m, key=key, p=packed: f"{p} {key}: {m}"
                    )


def _halo_layouts(layouts: list[dict]) -> list[dict]:
    return [train_layout(layout, 2, BATCH, MICRO, model_kw=MODEL_KW) for layout in layouts]


@pytest.mark.parametrize(
    "world,layouts",
    [
        (
            2,
            [
                {"cp": 2, "cp_mode": "ring", "recompute": "full"},
                {"cp": 2, "cp_mode": "allgather", "recompute": "full"},
            ],
        ),
        (
            4,
            [
                {"cp": 2, "tp": 2, "sp": True, "cp_mode": "ring"},
                {"cp": 2, "dp_shard": 2, "zero": 3, "cp_mode": "allgather"},
            ],
        ),
    ],
    ids=["recompute full", "with tp2 + sp and ZeRO-3"],
)
def test_halo_exchanges_with_recomputation_tp_and_zero3_equal_one_process(pools, references, world, layouts):
    """The halo exchange run again in full recomputation's backward (every rank, the same order), and
    beside tp2 + sp (each rank's kv heads) and ZeRO-3 over a dp2 x cp2 group: 2 steps as one process."""
    for rank in pools(world).run(_halo_layouts, layouts):
        for layout, r in zip(layouts, rank, strict=True):
            assert_close(
                torch.tensor(r["losses"]),
                torch.tensor(references[False]["losses"][:2]),
                **TOL,
                msg=str(layout),
            )


def _seeded_train(layout: dict) -> dict:
    """:func:`train_layout` of the windowed model with dropout (p = 0.1), the default generator seeded
    first (the pool's processes are reused, and dropout draws from it)."""
    torch.manual_seed(11)
    return train_layout(layout, 2, BATCH, MICRO, model_kw=MODEL_KW | {"dropout": 0.1})


def test_windowed_dropout_ring_equals_allgather(pools, references):
    """With dropout the windowed blocks (several per pair of ranks) draw their masks from seeds of
    their own, the same under ring and allgather: both runs agree, and dropout is on."""
    ring, allgather = (
        pools(2).run(_seeded_train, {"cp": 2, "cp_mode": mode}) for mode in ("ring", "allgather")
    )
    for a, b in zip(ring, allgather, strict=True):
        assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), **TOL)
    assert not torch.allclose(torch.tensor(ring[0]["losses"]), torch.tensor(references[False]["losses"][:2]))


def test_windowed_blocks_compile_without_graph_breaks():
    """``train.compile = blocks`` of a model windowed on one layer of two (two distinct block graphs)
    equals eager, with no graph break: the window mask is built inside the compiled block."""
    from tests.test_compile import _assert_equal, _compiled_and_eager

    compiled, eager = _compiled_and_eager({"model": {"sliding_window": 5, "window_layers": "0"}})
    _assert_equal([(compiled, eager)], "windowed")
    graphs, breaks, _ = compiled["report"]
    assert graphs >= 1 and breaks == {}, (graphs, breaks)


@pytest.mark.parametrize(
    "fields,family,want",
    [
        ({}, "MistralForCausalLM", {"sliding_window": 5}),
        (
            {"qkv_bias": True, "hf_architecture": "Qwen2ForCausalLM", "window_layers": "1,2"},
            "Qwen2ForCausalLM",
            {
                "sliding_window": 5,
                "use_sliding_window": True,
                "max_window_layers": 1,
                "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
            },
        ),
    ],
    ids=["every layer: a Mistral", "some layers: Qwen2's layer types"],
)
def test_a_windowed_model_exports_its_window_and_transformers_reads_it_back(tmp_path, fields, family, want):
    """Loom's export writes the window as the family holds it; transformers built from that config.json
    with Loom's tensors gives Loom's logits on sequences longer than the window."""
    import json

    import transformers
    from safetensors.torch import save_file

    from loom.model.hf import hf_config, hf_tensors
    from loom.model.llama import build_model
    from tests.helpers import tiny_model

    cfg = tiny_model(n_layers=3, sliding_window=5, max_seq_len=16, **fields)
    model = build_model(cfg, 0).eval()
    config = hf_config(cfg)
    assert config["architectures"] == [family]
    assert {k: config[k] for k in want} == want
    save_file(
        dict(hf_tensors(cfg, ((k, v.detach()) for k, v in model.state_dict().items()))),
        str(tmp_path / "model.safetensors"),
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, model(x))


def test_a_family_without_the_window_is_refused_at_export():
    from loom.model.hf import HFError, hf_config
    from tests.helpers import tiny_model

    with pytest.raises(
        HFError, match="model.sliding_window: Phi3ForCausalLM holds a window on every layer only"
    ):
        hf_config(
            tiny_model(n_layers=3, sliding_window=5, window_layers="0", hf_architecture="Phi3ForCausalLM")
        )
    # a Mistral's layer_types (transformers reads it as a Ministral): windowed on those layers
    out = hf_config(tiny_model(n_layers=3, sliding_window=5, window_layers="0"))
    assert out["layer_types"] == ["sliding_attention", "full_attention", "full_attention"]
    with pytest.raises(HFError, match="cannot hold this model's tensors"):
        hf_config(tiny_model(n_layers=3, sliding_window=5, hf_architecture="LlamaForCausalLM"))


def test_the_planners_attention_share_counts_the_pairs_the_window_leaves():
    """``ModelConfig.attention_share``: the causal (query, key) pairs the layers compute, averaged over
    them, equals the count of the visible pairs of the window mask (w·T − w(w−1)/2 of T(T+1)/2 on a
    windowed layer); the training FLOPs per token scale their attention term by it."""
    from loom.model.llama import flops_per_token

    T, w = 16, 5
    cfg = tiny_model(n_layers=3, sliding_window=w, window_layers="0,2", max_seq_len=T)
    seen = int(window_mask(T, T, w, "cpu").sum())
    assert seen == w * T - w * (w - 1) // 2
    causal = T * (T + 1) // 2
    assert cfg.attention_share(T) == pytest.approx((2 * seen + causal) / (3 * causal))
    assert tiny_model(n_layers=3, sliding_window=T, window_layers="0,2").attention_share(T) == 1.0
    whole = tiny_model(n_layers=3, max_seq_len=T)
    attention = 12.0 * 3 * cfg.n_heads * cfg.head_dim * T
    assert flops_per_token(whole, T, 0) - flops_per_token(cfg, T, 0) == pytest.approx(
        attention * (1 - cfg.attention_share(T))
    )


@pytest.mark.parametrize("mode", ["ring", "allgather"])
def test_the_planner_prices_the_halo_exchange(mode):
    """The planner counts a windowed layer's halo sends (one per neighbour, forward and the gradients
    back) in place of its mode's exchange, prices them below the whole layer's, and keeps for an
    all-gather's windowed layer the halo rows, not the gathered sequence: the debug model (seq 64,
    cp 2: chunks of 16) windowed on layer 0 of 2 by w = 17 (a halo) and w = 18 (beyond one chunk)."""
    from loom import config as C
    from loom.plan.auto import _cost_model, layout_of
    from loom.plan.cost.comm import halo_share
    from tests.test_plan_runtime import DEBUG_CONFIG, PROFILE

    est, calls = {}, {}
    for w in (17, 18):
        cfg = C.load(
            DEBUG_CONFIG,
            ["--run.nproc", "2", "--parallel.cp", "2", "--parallel.dp", "1", "--parallel.cp_mode", mode]
            + ["--model.sliding_window", str(w), "--model.window_layers", "0"],
        )
        cm, lay = _cost_model(cfg, 2, PROFILE), layout_of(cfg)
        assert halo_share(cm, 2, mode) == (0.5 if w == 17 else 0.0)
        est[w], calls[w] = cm.estimate(lay), cm.collective_calls(lay)
    m = 8 // 2  # micro-batches per step (global batch 8, micro 2, dp 1)
    if mode == "ring":  # the ring's layer: 1 K/V hop forward and backward, 2 dK/dV hops; the halo's 2
        assert calls[18]["send"] - calls[17]["send"] == m * ((1 * 2 + 2) - 1 * 2)
    else:  # the halo's sends replace the windowed layer's two all-gathers and two reduce-scatters
        assert calls[17]["send"] == m * 2 and calls[18].get("send", 0) == 0
        assert calls[18]["all_gather"] - calls[17]["all_gather"] == m * 2
    assert est[17].time_breakdown["cp comm"] < est[18].time_breakdown["cp comm"]
    if mode == "allgather":
        assert est[17].memory < est[18].memory
