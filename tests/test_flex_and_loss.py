"""Issue 31 (items 2 and 3): packed documents through a flex-attention block mask built once per
micro-batch, the head inside the loss (linear cross-entropy) and a chunked vocabulary-parallel loss,
saved-tensor and module hooks only where a feature needs them.

torch 2.13's flex attention has no backward on the CPU, so here the flex path is checked forward
(compiled, as it runs); its gradients and memory are checked on CUDA (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.testing import assert_close

import loom.model.llama as llama
from loom.memory.compress import SavedActivations
from loom.model.llama import (
    build_model,
    document_block_mask,
    document_ids,
    document_mask,
    fused_head_loss,
    loss_fn,
)
from tests.helpers import SEQ, packed_global_batch, tiny_model
from tests.test_device_speed import LiveBytes

CUDA = torch.cuda.is_available()


def _docs(B: int, T: int, seed: int = 0) -> torch.Tensor:
    """Document ids (B, T) of random packed rows: documents of 1-20 tokens; the last row one document."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(B, T, generator=g) < 0.08
    starts[:, 0] = True
    starts[-1, 1:] = False
    positions = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        for t in range(1, T):
            positions[b, t] = 0 if starts[b, t] else positions[b, t - 1] + 1
    return document_ids(positions)


# ----------------------------------------------------------------------------- flex attention


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_document_block_mask_equals_the_dense_mask(kv_heads):
    """The block tables equal create_block_mask's over document_mask (T not a multiple of the block,
    several blocks per row), flex attention under it equals SDPA under the dense mask (GQA and not),
    and building it makes no tensor of T·T elements (its largest is O(B·(T/block)²))."""
    B, T, a, d = 3, 50, 4, 8
    docs = _docs(B, T)
    dense = document_mask(docs, docs)  # (B, T, T)
    q, k, v = torch.randn(B, a, T, d), torch.randn(B, kv_heads, T, d), torch.randn(B, kv_heads, T, d)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense[:, None], enable_gqa=kv_heads < a)
    for block in (4, 16, 128):
        with LiveBytes() as mem:
            bm = document_block_mask(docs, block)
        n = -(-T // block)
        assert mem.largest <= 8 * B * max(n * n, n * block)  # an int64 (B, n, n) table, padded ids
        ref = create_block_mask(lambda b, h, i, j: dense[b, i, j], B, None, T, T, "cpu", BLOCK_SIZE=block)
        assert torch.equal(bm.to_dense(), ref.to_dense()), block
        got = flex_attention(q, k, v, block_mask=bm, enable_gqa=kv_heads < a)
        assert_close(got, want)
    long = _docs(2, 4096)
    with LiveBytes() as mem:
        document_block_mask(long)
    # O(B·n² + B·T) int64 (n = 32 blocks): 128 KiB at most, against 32 MiB for the dense bool mask
    assert mem.largest <= 8 * 2 * 32 * 32 and mem.peak <= 4 * 8 * 2 * 32 * 32 + 8 * 2 * 4096


def test_flex_path_equals_the_dense_path_with_one_mask_per_micro_batch(monkeypatch):
    """Forced onto the flex path (compiled flex_attention), a packed GQA model's logits equal the dense
    mask path's, the block mask is built once per forward (not per layer) and no layer sees the
    document ids; on CUDA the gradients of every parameter are equal too."""
    device = torch.device("cuda" if CUDA else "cpu")
    model = build_model(tiny_model(n_layers=3), 0, device)
    x, y, positions = (t.to(device) for t in packed_global_batch(0, 2))
    built = []

    def counted(docs, *a):
        built.append(docs.shape)
        return document_block_mask(docs, *a)

    monkeypatch.setattr(llama, "document_block_mask", counted)

    def run(path: str):
        monkeypatch.setattr(llama, "packed_attention", lambda _d: path)
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(CUDA):
            logits = model(x, positions)
            if CUDA:
                loss_fn(logits, y).backward()
        return logits.detach(), {n: p.grad for n, p in model.named_parameters()}

    dense = run("dense")
    assert built == []
    flex = run("flex")
    assert built == [(2, SEQ)]  # one block mask for the 3 layers
    assert_close(flex[0], dense[0])
    if CUDA:
        for name, g in dense[1].items():
            assert_close(flex[1][name], g, msg=name)


@pytest.mark.skipif(not CUDA, reason="flex attention's backward runs on CUDA only")
def test_flex_path_saves_no_T_by_T_tensor():
    """On the flex path forward + backward of the attention core allocate no (B, 1, T, T) or (B, a, T, T)
    tensor (every aten op's outputs are checked), and it saves q, k, v, the output and the lse only."""
    B, a, kvh, T, d = 2, 4, 2, 4096, 16
    docs = _docs(B, T).cuda()
    q, k, v = (torch.randn(B, h, T, d, device="cuda", requires_grad=True) for h in (a, kvh, kvh))
    core = llama.CoreAttention()
    bm = document_block_mask(docs)
    core(q, k, v, bm).sum().backward()  # compile first
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = core(q, k, v, bm)
    assert all(t.numel() < B * T * T for t in saved)
    floats = [t for t in saved if t.is_floating_point()]
    assert sum(t.numel() for t in floats if t.dim() == 4) == B * T * d * (2 * a + 2 * kvh)  # q k v out
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.sum().backward()
    peak = torch.cuda.max_memory_allocated() - base
    # dq, dk, dv, the output's gradient (4·B·T·d·(2a + 2k)) and fp32 vectors of B·a·T, with 2x slack for
    # kernel workspace: O(T·d), against B·T·T = 32 MiB for the (B, 1, T, T) bool mask alone
    assert peak <= 2 * 4 * B * T * d * (2 * a + 2 * kvh) + 64 * B * a * T, peak
    assert peak < B * T * T  # a (B, 1, T, T) bool mask alone


# ----------------------------------------------------------------------------- head inside the loss


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fused_head_loss_equals_the_plain_loss_and_gradients(tied):
    """With the head in the loss, the training forward returns the normed hidden states and the loss
    (linear cross-entropy, chunks smaller than the rows) equals loss_fn over the logits, loss and every
    gradient, with ignored targets; under no_grad the model returns logits and the same loss."""
    x, y, positions = packed_global_batch(2, 3)
    y = y.clone()
    y[:, :3] = -100
    plain = build_model(tiny_model(tie_embeddings=tied), 0)
    want = loss_fn(plain(x, positions), y)
    g_want = torch.autograd.grad(want, list(plain.parameters()))
    model = build_model(tiny_model(tie_embeddings=tied), 0)
    head_loss = fused_head_loss(model, rows=3 * SEQ, chunk_rows=7)  # 7 chunks of rows
    assert head_loss is not None and model.head_in_loss
    out = model(x, positions)
    assert out.shape == (*x.shape, model.cfg.dim)
    got = head_loss(out, y)
    assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, list(model.parameters())), g_want, strict=True):
        assert_close(a, b)
    with torch.no_grad():
        logits = model(x, positions)
        assert logits.shape[-1] == model.cfg.vocab_size
        assert_close(head_loss(logits, y), want.detach())


def test_fused_head_loss_refuses_a_swapped_head():
    """A head that is not a plain Linear (tensor-parallel, low precision), or micro-batches of one
    chunk of rows at most (nothing to save), keep the logits path."""
    model = build_model(tiny_model(), 0)
    assert fused_head_loss(model, rows=1024, chunk_rows=1024) is None
    model.output = torch.nn.Sequential(model.output)
    assert fused_head_loss(model, rows=10**6) is None and not model.head_in_loss


# ----------------------------------------------------------------------------- vocabulary-parallel loss


def _vocab_parallel(tp: int) -> None:
    from loom.parallel.tensor.parallelize import vocab_parallel_cross_entropy
    from tests.dist import get_mesh

    group = get_mesh(tp=tp).group("tp")
    rank = torch.distributed.get_rank(group)
    g = torch.Generator().manual_seed(3)
    B, T, V = 3, 7, 24 * tp
    logits = (torch.randn(B, T, V, generator=g) * 3).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, :4] = -100
    ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    ref.backward()
    for chunk in (1, 4, 64):  # rows per chunk: 1, not dividing N = 21, all of them
        local = logits.detach().chunk(tp, -1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, targets, group, chunk_rows=chunk)
        loss.backward()
        assert_close(loss, ref.detach())
        assert_close(local.grad, logits.grad.chunk(tp, -1)[rank])


def test_chunked_vocab_parallel_loss_equals_the_reference_under_tp2(pools):
    pools(2).run(_vocab_parallel, 2)


def test_vocab_parallel_loss_holds_one_fp32_chunk():
    """bf16 local logits (N, V/n): forward + backward allocate their gradient (N·V/n·2) and at most one
    fp32 chunk (c·V/n·4) plus fp32 vectors of N, never an (N, V/n) fp32 copy or softmax."""
    from loom.parallel.tensor.parallelize import vocab_parallel_cross_entropy

    N, V, c = 512, 1000, 64
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, N, V, generator=g).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (1, N), generator=g)
    with LiveBytes() as mem:
        vocab_parallel_cross_entropy(logits, targets, None, chunk_rows=c).backward()
    assert mem.largest == N * V * 2  # the gradient, in the logits' dtype
    assert mem.peak <= N * V * 2 + c * V * 4 + 12 * N * 8


# ----------------------------------------------------------------------------- hooks


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _step(model, saved: SavedActivations, logged: bool, batch) -> None:
    x, y, positions = batch
    with saved.around(logged):
        loss_fn(model(x, positions), y).backward()


def test_default_step_installs_no_hooks_and_logs_the_same_activation_peak():
    """Without compression or offload: no module hook is installed, an unlogged step runs without
    saved-tensor hooks (nothing counted), and the logged step's act_saved_peak_bytes equals that of
    hooks around every step of the window (the former path). Compression still hooks every step."""
    model = build_model(tiny_model(), 0)
    batches = [packed_global_batch(s, 2) for s in range(3)]
    every = SavedActivations(model)
    for b in batches:
        with every:
            loss_fn(model(b[0], b[2]), b[1]).backward()
    saved = SavedActivations(model)
    assert _hooks(model) == 0 and not saved.every_step
    for i, b in enumerate(batches):
        _step(model, saved, i == len(batches) - 1, b)
        if i == 0:
            assert saved.stats() == {"act_saved_peak_bytes": 0}  # no hook ran
    assert saved.stats() == every.stats() and every.peak > 0
    fp8 = SavedActivations(model, "mlp=fp8")
    kinds = sum(hasattr(m, "activation_kind") for m in model.modules())
    assert fp8.every_step and _hooks(model) == 2 * kinds
    assert fp8.around(False) is fp8
    fp8.remove()
    assert _hooks(model) == 0


def test_pipeline_stages_take_the_flex_block_mask(monkeypatch):
    """Packed documents in pipeline stages: forced onto the flex path, each stage builds one block mask
    per forward and every one of its layers receives it (a BlockMask, not the document ids); the two
    stages' logits equal the whole model's on the dense path (forward only: no flex backward on CPU)."""
    from torch.nn.attention.flex_attention import BlockMask

    from loom.parallel.pipeline.stage import StageModule

    model = build_model(tiny_model(n_layers=3), 0, "cpu")
    x, _, positions = packed_global_batch(0, 2)
    stages = [StageModule(model, 0, 2, 0, 2), StageModule(model, 1, 2, 2, 3)]
    seen: list[type] = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda _m, args: seen.append(type(args[-1])))
    built = []

    def counted(docs, *a):
        built.append(docs.shape)
        return document_block_mask(docs, *a)

    monkeypatch.setattr(llama, "document_block_mask", counted)
    monkeypatch.setattr(llama, "packed_attention", lambda _d: "dense")
    with torch.no_grad():
        want = model(x, positions)
    assert built == [] and all(t is torch.Tensor for t in seen)
    seen.clear()
    monkeypatch.setattr(llama, "packed_attention", lambda _d: "flex")
    with torch.no_grad():
        got = stages[1](stages[0](x, positions), positions)
    assert built == [(2, SEQ), (2, SEQ)]  # one per stage
    assert seen == [BlockMask] * 3
    assert_close(got, want)
