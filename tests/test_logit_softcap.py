"""Logit soft-capping (``model.logit_softcap`` = c > 0, Gemma 2's ``final_logit_softcapping``): the
logits z become c·tanh(z/c) on every path that makes them, as Hugging Face's ``Gemma2ForCausalLM``
does: the model's forward, the chunked head-in-loss (per chunk, forward and backward), the
tensor-parallel head (its vocabulary-parallel loss), the pipeline's last stage, evaluation and the
KV-cache decoder. Checked against ``torch.tanh(z / c) * c`` then cross-entropy, and one process
against tp2 (+sp, and a padded vocabulary), pp2 and ZeRO-3.

The tiny model's logits at its default init (std 0.02) are ~0.1: a cap of 2 would move its loss by
1e-4, inside the layouts' tolerance. At ``init_std`` 0.3 they are a few units and the cap of 2 moves
the loss by ~0.8, so a path that missed the cap fails every comparison here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from tests.helpers import SEQ, VOCAB, global_batch, one_thread, tiny_model, train_layout  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

CAP = 2.0
CAPPED = {"logit_softcap": CAP, "init_std": 0.3}  # logits of a few units: the cap of 2 matters
STEPS, BATCH, MICRO = 4, 8, 4
TOL = dict(rtol=1e-4, atol=5e-5)  # sums split across ranks round differently over AdamW steps


def reference_logits(plain: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rule on the uncapped model's logits: tanh(z / c) * c."""
    return torch.tanh(plain(x) / CAP) * CAP


def pair(**kw) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The capped tiny model and the same weights uncapped (the cap changes no initial value)."""
    from loom.model.llama import build_model

    capped = build_model(tiny_model(**CAPPED, **kw), seed=3)
    plain = build_model(tiny_model(**{**CAPPED, "logit_softcap": 0.0}, **kw), seed=3)
    plain.load_state_dict(capped.state_dict())
    return capped, plain


def test_softcap_values_and_gradient():
    """softcap(z, c) = c·tanh(z/c) and its gradient 1 - tanh²(z/c), against torch's autograd; c = 0 is
    the identity (the same tensor)."""
    from loom.model.softcap import softcap

    z = (torch.randn(3, 7, dtype=torch.float64) * 5).requires_grad_()
    ref = z.detach().clone().requires_grad_()
    dy = torch.randn(3, 7, dtype=torch.float64)
    y = softcap(z, CAP)
    want = torch.tanh(ref / CAP) * CAP
    assert_close(y, want)
    assert y.abs().max() < CAP
    y.backward(dy)
    want.backward(dy)
    assert_close(z.grad, ref.grad)
    assert_close(z.grad, dy * (1 - torch.tanh(z.detach() / CAP) ** 2))
    assert softcap(z, 0.0) is z
    assert torch.autograd.gradcheck(lambda t: softcap(t, CAP), (z.detach()[:1, :3].requires_grad_(),))


@pytest.mark.parametrize("padded", [False, True], ids=["plain head", "padded vocabulary"])
def test_fused_chunked_loss_equals_capped_cross_entropy(padded):
    """fp32: the head inside the loss (several chunks of 8 rows, some targets ignored) with the cap
    equals cross-entropy of tanh(z/c)·c of the uncapped model's logits, loss and every gradient; so
    does the model's own capped forward with :func:`loss_fn`; a padded vocabulary (129 -> 256 rows)
    keeps its padded rows out of every logit, with zero gradient. Without the cap the loss differs."""
    from loom.model.llama import fused_head_loss, loss_fn

    kw = {"vocab_size": 129, "pad_vocab_to": 256} if padded else {}
    capped, plain = pair(**kw)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.randint(0, VOCAB, (2, SEQ), generator=g)
    y[0, :5] = -100
    plain.zero_grad()
    want = F.cross_entropy(reference_logits(plain, x).flatten(0, 1), y.flatten(), ignore_index=-100)
    want.backward()
    grads = {n: p.grad.clone() for n, p in plain.named_parameters()}
    for fused in (True, False):
        capped.zero_grad()
        head = fused_head_loss(capped, 2 * SEQ, chunk_rows=8) if fused else None
        assert (head is not None) == fused
        loss = (head or loss_fn)(capped(x), y)
        loss.backward()
        capped.head_in_loss = False
        assert_close(loss, want, msg=f"fused={fused}")
        for n, p in capped.named_parameters():
            assert_close(p.grad, grads[n], msg=lambda m, n=n, f=fused: f"fused={f} {n}: {m}")
            if padded and ("output" in n or "tok_embeddings" in n):
                assert not p.grad[129:].any()
    assert abs(float(loss_fn(plain(x), y).detach()) - float(want.detach())) > 0.1


def test_linear_cross_entropy_cap_in_low_precision():
    """bf16 (the CPU's branch of the chunked backward): the capped chunked loss follows the unfused
    capped loss of the same bf16 logits, loss and gradients, within bf16's rounding."""
    from loom.model.loss import linear_cross_entropy

    g = torch.Generator().manual_seed(1)
    h = torch.randn(40, 32, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(96, 32, generator=g) * 0.5).bfloat16().requires_grad_()
    t = torch.randint(0, 96, (40,), generator=g)
    t[:3] = -100
    loss = linear_cross_entropy(h, w, t, chunk_rows=16, cap=CAP)
    loss.backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    z = torch.tanh((h2 @ w2.t()) / CAP) * CAP  # bf16, as the model's capped logits
    want = F.cross_entropy(z.float(), t, ignore_index=-100, reduction="sum")
    want.backward()
    assert_close(loss, want, rtol=1e-3, atol=1e-3)
    assert_close(h.grad.float(), h2.grad.float(), rtol=2e-2, atol=2e-2)
    assert_close(w.grad.float(), w2.grad.float(), rtol=2e-2, atol=2e-2)


def test_the_cap_keeps_no_logits_of_its_own():
    """Memory: the capped model keeps one (N, V) tensor for backward, the capped logits, which both the
    cap and the loss save (``torch.tanh(z / c) * c`` under autograd keeps tanh's output besides); the
    capped chunked head-in-loss in fp32 allocates one chunk's logits at a time, c·V·4 bytes, and holds
    c·V·8 at most (backward's softmax beside the capped chunk), besides dh, dW and vectors of N."""
    from loom.model.loss import chunked_cross_entropy, linear_cross_entropy
    from loom.model.softcap import softcap
    from tests.test_device_speed import LiveBytes, _saved

    N, h, V, c = 512, 16, 1000, 64
    g = torch.Generator().manual_seed(0)
    hid = torch.randn(N, h, generator=g).requires_grad_()
    w = torch.randn(V, h, generator=g).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    z = (hid @ w.t()).detach().requires_grad_()
    saved = _saved(lambda: chunked_cross_entropy(softcap(z, CAP), t, c))
    assert len({s.untyped_storage().data_ptr() for s in saved if s.shape == (N, V)}) == 1
    autograd_cap = _saved(lambda: chunked_cross_entropy(torch.tanh(z / CAP) * CAP, t, c))
    assert len({s.untyped_storage().data_ptr() for s in autograd_cap if s.shape == (N, V)}) == 2
    with LiveBytes() as mem:
        linear_cross_entropy(hid, w, t, c, cap=CAP).backward()
    assert mem.largest == c * V * 4
    assert mem.peak <= 2 * c * V * 4 + (N + V) * h * 4 + 8 * N * 4


def test_eval_loss_is_capped():
    """Evaluation (no grad) of a model whose training loss holds the head: the model returns capped
    logits and the eval loss is the capped cross-entropy."""
    from loom.model.llama import fused_head_loss
    from loom.train.step import evaluate

    capped, plain = pair()
    head = fused_head_loss(capped, 2 * SEQ, chunk_rows=8)
    assert head is not None and capped.head_in_loss
    batches = [global_batch(s, 2) for s in range(2)]
    got = evaluate(capped, batches, head, None)
    with torch.no_grad():
        want = [F.cross_entropy(reference_logits(plain, x).flatten(0, 1), y.flatten()) for x, y in batches]
    assert_close(torch.tensor(got), torch.stack(want).mean())


def test_decoding_samples_from_capped_logits():
    """The KV-cache decoder's logits are the capped full forward's (prefill and every cached step);
    greedy decoding is the argmax of the capped forward; sampling draws from softmax of the capped
    logits: the same tokens as a loop over tanh(z/c)·c of the uncapped model with the same generator,
    by the cached and the uncached decoder, and other tokens than the uncapped model's."""
    from loom.generate.decode import generate_cached, generate_uncached, generators, next_token
    from loom.generate.options import SamplingOptions
    from loom.model.kv_cache import forward_cached, new_cache

    capped, plain = pair()
    capped.eval(), plain.eval()
    prompts = [[5, 9, 2, 77], [3, 1]]
    x = torch.tensor([prompts[0]])
    with torch.no_grad():
        cache = new_cache(capped, 1, 8, torch.zeros(1, dtype=torch.long))
        pre = forward_cached(capped, x, cache)
        step = forward_cached(capped, torch.tensor([[11]]), cache)
        full = reference_logits(plain, torch.tensor([[*prompts[0], 11]]))
    assert_close(torch.cat([pre, step], 1), full)
    assert full.abs().max() < CAP and plain(x).abs().max() > CAP  # the cap bites

    def loop(model, prompt, opts, cap):
        gen, ids, out = generators(1, opts.seed), torch.tensor([prompt]), []
        with torch.no_grad():
            for _ in range(opts.max_new_tokens):
                z = model(ids)[:, -1]
                tok = next_token(torch.tanh(z / CAP) * CAP if cap else z, opts, gen)
                out.append(int(tok[0]))
                ids = torch.cat([ids, tok[:, None]], 1)
        return out

    greedy = SamplingOptions(max_new_tokens=6, temperature=0.0, top_k=0, top_p=1.0)
    assert generate_cached(capped, prompts, greedy).tokens == [loop(plain, p, greedy, True) for p in prompts]
    sample = SamplingOptions(max_new_tokens=8, temperature=1.0, top_k=0, top_p=1.0, seed=5)
    want = [loop(plain, p, sample, True) for p in prompts]
    assert generate_cached(capped, prompts, sample).tokens == want
    assert generate_uncached(capped, prompts, sample).tokens == want
    assert generate_cached(plain, prompts, sample).tokens != want  # sampling sees the cap


def test_the_planner_prices_the_cap():
    """The planner counts the cap where Loom pays it: the head's memory-bound time gains a tanh
    forward and backward over the T·V logits (z read, y written; y and dy read, dz written: 5·B_a
    bytes each); the chunked head-in-loss holds c·V·(B_a + 4) in fp32 too (backward's softmax beside
    the capped chunk, where the uncapped fp32 chunk is its own softmax: c·V·4); bf16's is unchanged."""
    import dataclasses

    from loom.model.loss import CHUNK_ROWS
    from loom.plan.cli import MODELS
    from loom.plan.cost import CostModel, Layout, Workload
    from loom.plan.hardware import ClusterSpec

    m, cluster = MODELS["llama3-8b"], ClusterSpec.single_node("h100-sxm", 8, 1)
    lay = Layout(dp=8, dp_shard=8, zero=3, micro_batch=1, recompute="full")
    T, V = 8192, m.vocab_size
    for precision, B in (("bf16", 2), ("fp32", 4)):
        w = Workload(8, T, precision)
        plain = CostModel(m, w, cluster)
        capped = CostModel(dataclasses.replace(m, logit_softcap=30.0), w, cluster)
        args = (1, False, 1, 1, 1, "full", 1)
        extra = capped._microbatch_times(*args)[2]["compute"] - plain._microbatch_times(*args)[2]["compute"]
        other = plain.other if plain.kernels else 1.0
        assert extra == pytest.approx(other * 5 * B * T * V / plain.machine.hbm)
        grown = capped.memory(lay)[1]["logits"] - plain.memory(lay)[1]["logits"]
        assert grown == pytest.approx(CHUNK_ROWS * V * 4 if precision == "fp32" else 0.0)


@pytest.fixture(scope="module")
def references():
    """One process, capped and uncapped, plain vocabulary and 129 words (for the padded tp2 run)."""
    return {
        "capped": train_layout({}, STEPS, BATCH, MICRO, model_kw=CAPPED),
        "uncapped": train_layout({}, STEPS, BATCH, MICRO, model_kw={**CAPPED, "logit_softcap": 0.0}),
        "capped 129": train_layout({}, STEPS, BATCH, MICRO, model_kw={**CAPPED, "vocab_size": 129}),
    }


def test_the_cap_changes_training(references):
    """Not a no-op: the capped run's losses differ from the uncapped run's by far more than the layouts'
    tolerance, from the first step."""
    capped, uncapped = (torch.tensor(references[k]["losses"]) for k in ("capped", "uncapped"))
    assert ((capped - uncapped).abs() > 0.1).all()


LAYOUTS = {
    "tp2": ({"tp": 2}, {}),
    "tp2 sp": ({"tp": 2, "sp": True}, {}),
    "tp2 padded": ({"tp": 2}, {"vocab_size": 129, "pad_vocab_to": 256}),  # rank 1: 1 real column of 128
    "pp2": ({"pp": 2}, {}),
    "dp2 zero3": ({"dp_shard": 2, "zero": 3}, {}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_capped_training_equals_single_process(pools, references, name):
    """2 ranks train the capped tiny model equal to one process, losses step by step and final weights
    (tensor parallelism: the vocabulary-parallel loss on capped local logits, a padded vocabulary's
    padded columns still masked; pipeline: the last stage caps; ZeRO-3: the gathered head)."""
    layout, kw = LAYOUTS[name]
    ref = references["capped 129" if "vocab_size" in kw else "capped"]
    for r in pools(2).run(train_layout, layout, STEPS, BATCH, MICRO, model_kw={**CAPPED, **kw}):
        assert_close(
            torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **TOL, msg=lambda m: f"{name}: {m}"
        )
        if r["state"] is not None:
            for k, v in ref["state"].items():
                got = r["state"][k]
                assert_close(got[: v.shape[0]], v, **TOL, msg=lambda m, k=k: f"{name} {k}: {m}")
                assert not got[v.shape[0] :].any()
