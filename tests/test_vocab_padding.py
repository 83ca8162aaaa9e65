"""Vocabulary padding (issue 34, item 6): ``model.pad_vocab_to`` gives the embedding and head V' >= V
rows, the padded ones zeros and outside every logit; so the padded model's logits, loss and training
equal the unpadded model's under 1 process and tp2 (which pads automatically to a multiple of 128·tp),
Hugging Face import pads with zeros, export writes the V real rows, generation never samples a padded id."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from loom import config as C
from loom.config.sections import vocab_padding
from loom.rules import ModelFacts, tensor_parallel_problem
from tests.helpers import SEQ, one_thread, tiny_model  # noqa: F401 (fixture)
from tests.test_finetune import STEPS, TOL, TRAIN_TOL, train_lora

pytestmark = pytest.mark.usefixtures("one_thread")

V, PADDED = 129, 256  # 129: not divisible by 2; tp2 pads it to 256 = 128·2


def test_automatic_padding_and_the_rule():
    """Megatron's rule: a vocabulary tp divides stays; otherwise the next multiple of 128·tp; an explicit
    value is kept. tp no longer refuses such a vocabulary; a bad explicit value is refused in one line."""
    assert vocab_padding(145, 2) == 256
    assert vocab_padding(50257, 8) == 51200  # GPT-2 under tp8: 50 · 1024
    assert vocab_padding(50257, 1) == 50257 and vocab_padding(64, 2) == 64
    assert vocab_padding(145, 1, pad_vocab_to=160) == 160
    facts = ModelFacts.of(tiny_model(vocab_size=145))
    assert tensor_parallel_problem(facts, 2) is None
    for bad, tp in ((144, 1), (255, 2), (-1, 1)):
        why = tensor_parallel_problem(ModelFacts.of(tiny_model(vocab_size=145, pad_vocab_to=bad)), tp)
        assert why == (
            f"model.pad_vocab_to: {bad} must be 0 (automatic) or >= the vocabulary 145 and divisible by "
            f"parallel.tp={tp}"
        )
    cfg = C.LoomConfig(model=tiny_model(vocab_size=0))
    cfg.parallel.tp = 2
    assert C.effective_vocab(cfg, 145) == 145 and cfg.model.pad_vocab_to == 256  # resolved on the way
    assert cfg.model.padded_vocab == 256


def test_padded_logits_loss_and_grads_equal_unpadded():
    """One process: logits (B, T, V) of the padded model equal the unpadded model's (same seed: the
    real rows are the same draws), the padded rows start at zero, and the loss (plain and with the head
    inside the loss, chunked) and its gradients are equal, zero on the padded rows."""
    from loom.model.llama import build_model, fused_head_loss, loss_fn

    for tie in (True, False):
        plain = build_model(tiny_model(vocab_size=V, tie_embeddings=tie), seed=3)
        padded = build_model(tiny_model(vocab_size=V, tie_embeddings=tie, pad_vocab_to=PADDED), seed=3)
        assert padded.tok_embeddings.weight.shape == (PADDED, 32)
        assert not padded.tok_embeddings.weight[V:].any() and not padded.output.weight[V:].any()
        g = torch.Generator().manual_seed(0)
        x, y = torch.randint(0, V, (2, SEQ), generator=g), torch.randint(0, V, (2, SEQ), generator=g)
        assert padded(x).shape == (2, SEQ, V)
        assert_close(padded(x), plain(x), rtol=0, atol=0)
        for fused in (False, True):
            losses, grads = [], []
            for m in (plain, padded):
                m.zero_grad()
                head = fused_head_loss(m, 2 * SEQ, chunk_rows=8) if fused else None
                loss = (head or loss_fn)(m(x), y)
                loss.backward()
                m.head_in_loss = False
                losses.append(loss)
                grads.append({n: p.grad for n, p in m.named_parameters()})
            assert_close(losses[1], losses[0])
            for n, gr in grads[0].items():
                assert_close(grads[1][n][: gr.shape[0]], gr, msg=n)
                assert not grads[1][n][gr.shape[0] :].any()


@pytest.fixture(scope="module")
def unpadded():
    return train_lora(None, {"vocab_size": V}, method="full")


def test_tp2_padded_training_equals_unpadded_single_process(pools, unpadded):
    """Full training under tp2 with the vocabulary padded 129 -> 256 (the vocab-parallel loss masks the
    padded columns; rank 1 holds 1 real column of 128) equals one process without padding: losses and
    weights of 8 steps, and the padded rows stay zero."""
    results = pools(2).run(train_lora, {"tp": 2}, {"vocab_size": V, "pad_vocab_to": PADDED}, method="full")
    for r in results:
        assert_close(torch.tensor(r["losses"]), torch.tensor(unpadded["losses"]), **TOL)
        for k, v in unpadded["base"].items():
            got = r["base"][k]
            assert_close(got[: v.shape[0]], v, **TRAIN_TOL, msg=lambda m, k=k: f"{k}: {m}")
            assert not got[v.shape[0] :].any()
    assert len(unpadded["losses"]) == STEPS


def test_adafactor_on_a_padded_vocabulary_steps_as_unpadded(pools):
    """Adafactor counts only the V real rows of a padded embedding and head (c and mean(r) over V rows,
    RMS(P) and RMS(U) over V·C elements, not V'·C): padded by ``model.pad_vocab_to`` in one process or
    for tp2, training equals one process without padding (counting the zero rows had shrunk RMS(P) and
    RMS(U): ``loom train debug --model.vocab_size 513 --parallel.tp 2 --train.optimizer adafactor`` moved
    the loss by 7e-5 after one step, the eval loss by 2e-4 after two), and the padded rows stay zero."""
    ada = {"optimizer": "adafactor"}
    unpadded = train_lora(ada, {"vocab_size": V}, method="full")
    one = train_lora(ada, {"vocab_size": V, "pad_vocab_to": PADDED}, method="full")
    tp2 = pools(2).run(train_lora, {"tp": 2, **ada}, {"vocab_size": V, "pad_vocab_to": PADDED}, method="full")
    for r in (one, *tp2):
        assert_close(torch.tensor(r["losses"]), torch.tensor(unpadded["losses"]), **TOL)
        for k, v in unpadded["base"].items():
            got = r["base"][k]
            assert_close(got[: v.shape[0]], v, **TRAIN_TOL, msg=lambda m, k=k: f"{k}: {m}")
            assert not got[v.shape[0] :].any()


def test_hf_import_pads_export_keeps_the_vocab_and_generation_never_samples_padding(tmp_path):
    """A tiny HF Llama of vocab 129 read into a padded Loom model (pad 256): its logits equal
    transformers'; the padded rows are zeros; hf_tensors writes 129 rows (export round trip); sampling
    at high temperature from the padded model draws only ids < 129."""
    import transformers

    from loom.generate.decode import generate_cached
    from loom.generate.options import SamplingOptions
    from loom.model.hf import hf_tensors, load_into, open_dir, source
    from loom.model.llama import Transformer, build_model
    from loom.parallel.materialize import materialize, tag_origins

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    ref = transformers.LlamaForCausalLM(hf_cfg).eval()
    ref.save_pretrained(tmp_path)
    hf = open_dir(tmp_path)
    m = hf.config
    m.pad_vocab_to = PADDED
    loaded = Transformer(m)
    load_into(loaded, hf)
    meta = build_model(m, 0, meta=True)
    tag_origins(meta)
    materialize(
        meta, torch.device("cpu"), source(hf)
    )  # the trainer's path: boxes read per parameter, rows >= V zeros
    x = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        want = ref(x).logits
        for model in (loaded, meta):
            assert not model.tok_embeddings.weight[V:].any() and not model.output.weight[V:].any()
            assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    out = dict(hf_tensors(m, iter(loaded.state_dict().items())))
    assert out["model.embed_tokens.weight"].shape == (V, 32) and out["lm_head.weight"].shape == (V, 32)
    assert_close(out["lm_head.weight"], ref.lm_head.weight.detach())
    opts = SamplingOptions(max_new_tokens=60, temperature=50.0, top_k=0, top_p=1.0, seed=1)
    new = generate_cached(loaded, x[:, :4].tolist(), opts).tokens
    assert sum(map(len, new)) == 120 and max(map(max, new)) < V
    assert max(map(max, new)) >= V - 20  # near-uniform sampling reaches the top of the real vocabulary
