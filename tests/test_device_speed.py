"""Device-speed pieces of the model (issue 31): grouped-query attention without repeated keys and
values, the chunked cross-entropy's equality and peak bytes, and the host-sync budget of a step."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import loom.model.llama as llama
from loom.device_sync import SyncCounter, optimizer_host_tensors
from loom.model.llama import CoreAttention, build_model, loss_fn
from loom.model.loss import chunked_cross_entropy, linear_cross_entropy
from tests.helpers import SEQ, packed_global_batch, tiny_model


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages allocated inside the block and still alive, sampled after every ATen
    op: ``peak`` their largest sum, ``largest`` the largest one."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view or an in-place/out= result: no new storage
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st.data_ptr() not in self.live and st.nbytes():
                    self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
                    self.largest = max(self.largest, st.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _repeat_sdpa(q, k, v, mask=None, dropout=0.0, causal=None, scale=0.0):
    """The former path: k, v repeated to the query heads, then plain SDPA."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    causal = mask is None if causal is None else causal
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scale or None
    )


def _logits_and_grads(model, x, y, positions):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)  # dropout masks
    logits = model(x) if positions is None else model(x, positions)
    loss_fn(logits, y).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- grouped-query attention


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize("kv_heads,dropout", [(1, 0.0), (2, 0.0), (2, 0.2), (4, 0.0)])
def test_gqa_equals_the_repeat_path(monkeypatch, packed, kv_heads, dropout):
    """Logits and every gradient equal those of repeating k, v to the query heads (n_kv_heads < n_heads,
    and = n_heads as a control), causal or packed documents, with and without attention dropout."""
    model = build_model(tiny_model(n_kv_heads=kv_heads, dropout=dropout), 0).train()
    x, y, positions = packed_global_batch(0, 3)
    pos = positions if packed else None
    got = _logits_and_grads(model, x, y, pos)
    monkeypatch.setattr(llama, "sdpa", _repeat_sdpa)
    want = _logits_and_grads(model, x, y, pos)
    assert_close(got[0], want[0])
    for name in want[1]:
        assert_close(got[1][name], want[1][name], msg=name)


def _saved(fn) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn()
    return saved


def test_attention_saves_keys_and_values_unrepeated():
    """The core saves q, k, v, its output and the fp32 log-sum-exp, k and v at kv width:
    e·B·T·d·(2a + 2k) + 4·B·a·T bytes, against e·B·T·d·4a + 4·B·a·T for the repeat path."""
    B, a, k, T, d = 2, 8, 2, SEQ, 8
    q, kk, v = (torch.randn(B, h, T, d, requires_grad=True) for h in (a, k, k))
    core = CoreAttention()
    measured = sum(t.untyped_storage().nbytes() for t in _saved(lambda: core(q, kk, v)))
    assert measured == 4 * B * T * d * (2 * a + 2 * k) + 4 * B * a * T
    repeated = sum(t.untyped_storage().nbytes() for t in _saved(lambda: _repeat_sdpa(q, kk, v)))
    assert repeated - measured == 4 * B * T * d * 2 * (a - k)
    # packed documents: the same plus the mask SDPA keeps, and no tensor of a repeated width
    docs = torch.tensor([[0] * 5 + [1] * (T - 5)] * B)
    saved = _saved(lambda: core(q, kk, v, docs))
    assert sum(t.untyped_storage().nbytes() for t in saved if t.shape[-2:] != (T, T)) == measured
    assert sum(tuple(t.shape) == (B, a, T, d) for t in saved) == 2  # q and the output, not k or v


# ----------------------------------------------------------------------------- chunked cross-entropy


def _case(N=203, h=24, V=300, ignored=7, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(N, h, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, h, generator=g) / h**0.5).to(dtype).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    t[::ignored] = -100
    return hid, w, t


def _plain(h, w, t):
    return F.cross_entropy((h @ w.t()).float(), t, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("chunk", [1, 16, 64, 1024])
def test_chunked_losses_equal_the_plain_loss_and_gradients(chunk):
    """Loss and gradients of h and W equal F.cross_entropy over the full fp32 logits, also when the
    chunk does not divide the rows, with ignored targets, and with every target ignored (0, zeros)."""
    h, w, t = _case()
    want = _plain(h, w, t)
    gh, gw = torch.autograd.grad(2.0 * want, (h, w))
    for fn in (
        lambda: linear_cross_entropy(h, w, t, chunk),
        lambda: chunked_cross_entropy(h @ w.t(), t, chunk),
    ):
        got = fn()
        assert_close(got, want)
        dh, dw = torch.autograd.grad(2.0 * got, (h, w))
        assert_close(dh, gh)
        assert_close(dw, gw)
    none = torch.full_like(t, -100)
    loss = linear_cross_entropy(h, w, none, chunk)
    dh, dw = torch.autograd.grad(loss, (h, w))
    assert loss.item() == 0 and not dh.any() and not dw.any()


def test_chunked_loss_in_bf16_is_near_the_fp32_loss():
    """bf16 h and W: the log-sum-exp in fp32 keeps the loss within bf16's rounding of the logits."""
    h, w, t = _case(dtype=torch.bfloat16)
    want = _plain(h.float(), w.float(), t)
    got = linear_cross_entropy(h, w, t, 32)
    assert got.dtype == torch.float32
    assert_close(got, want, rtol=2e-3, atol=0)
    dh, dw = torch.autograd.grad(got, (h, w))
    gh, gw = torch.autograd.grad(_plain(h.float(), w.float(), t), (h, w))
    assert dh.dtype == dw.dtype == torch.bfloat16
    assert_close(dh.float(), gh.float(), rtol=2e-2, atol=2e-3)
    assert_close(dw.float(), gw.float(), rtol=2e-2, atol=2e-3)


def test_model_loss_equals_plain_cross_entropy_with_tied_embeddings():
    """The model's loss_fn (chunked) equals F.cross_entropy's mean over trained targets: loss and every
    gradient of a tied-embedding model, with ignored targets."""
    model = build_model(tiny_model(tie_embeddings=True), 0)
    x, y, _ = packed_global_batch(1, 3)
    y = y.clone()
    y[:, :4] = -100
    logits = model(x)
    got = loss_fn(logits, y)
    g_got = torch.autograd.grad(got, list(model.parameters()), retain_graph=True)
    want = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100)
    g_want = torch.autograd.grad(want, list(model.parameters()))
    assert_close(got, want)
    for a, b in zip(g_got, g_want, strict=True):
        assert_close(a, b)


def test_linear_cross_entropy_peak_bytes_is_one_chunk_of_logits():
    """Forward + backward of N rows over V: the largest tensor made is one chunk's logits, c·V·4
    bytes (fp32), and the peak of what it allocates is c·V·4 + dh (N·h·4) + dW (V·h·4) + small
    vectors (at most 8 of N fp32); the plain loss makes N·V·4-byte tensors (logits, log-softmax)."""
    N, h, V, c = 512, 16, 1000, 64
    hid, w, t = _case(N, h, V)
    with LiveBytes() as mem:
        linear_cross_entropy(hid, w, t, c).backward()
    assert mem.largest == c * V * 4
    assert c * V * 4 + (N + V) * h * 4 <= mem.peak <= c * V * 4 + (N + V) * h * 4 + 8 * N * 4
    with LiveBytes() as plain:
        _plain(hid, w, t).backward()
    assert plain.largest == N * V * 4 and plain.peak >= 2 * N * V * 4


def test_chunked_cross_entropy_holds_one_fp32_chunk_beside_the_logits():
    """Given the logits (N, V) (the model's output), the loss adds their gradient (N·V·e) and one fp32
    chunk (c·V·4) at most: bf16 logits never get an N·V fp32 copy or log-softmax."""
    N, h, V, c = 512, 16, 1000, 64
    hid, w, t = _case(N, h, V, dtype=torch.bfloat16)
    logits = (hid @ w.t()).detach().requires_grad_()
    with LiveBytes() as mem:
        chunked_cross_entropy(logits, t, c).backward()
    assert mem.largest == N * V * 2  # the gradient of the logits, in bf16
    assert mem.peak <= N * V * 2 + c * V * 4 + 8 * N * 4
    logits.grad = None
    with LiveBytes() as plain:
        F.cross_entropy(logits.float(), t, ignore_index=-100, reduction="sum").backward()
    assert plain.largest == N * V * 4 and plain.peak >= 2 * N * V * 4


# ----------------------------------------------------------------------------- host syncs


def test_sync_counter_catches_each_kind_once():
    x = torch.randn(6)
    with SyncCounter() as c:
        x.sum().item()
        x.tolist()
        x.cpu()
        bool(x[0] > 0)
        int(x[1])
        float(x[2])
        if (x > 0).any():
            pass
        x[x > 0]
        x.nonzero()
        torch.equal(x, x)
        torch.where(x > 0)
        x.repeat_interleave(torch.tensor([1, 2, 1, 1, 1, 1]))
        f"{x[0]:.2f}"
    assert [what for what, _ in c.calls] == [
        "item",
        "tolist",
        "cpu",
        "__bool__",
        "__int__",
        "__float__",
        "__bool__",
        "__getitem__",
        "nonzero",
        "equal",
        "where",
        "repeat_interleave",
        "__format__",
    ]
    assert all(where.startswith(__file__) for _, where in c.calls)
    with SyncCounter() as none:  # shape-only work, integer indexing, sized repeats, masks multiplied
        y = x[torch.tensor([0, 2])] * (x[:2] > 0)
        x.repeat_interleave(torch.tensor([1, 2, 1, 1, 1, 1]), output_size=7)
        torch.where(x > 0, x, 0.0)
        y.masked_fill(x[:2] > 0, 0.0)
        x.to("cpu", non_blocking=True)
    assert none.count == 0
    step = torch.tensor(3.0)
    with SyncCounter(host=[step]) as host:
        step.item()
    assert host.count == 0


def _debug_run():
    from loom.config import load_toml
    from loom.train.build import build_run
    from tests.dist import get_mesh

    cfg = load_toml("configs/debug.toml")
    cfg.model.vocab_size = cfg.data.vocab_size
    cfg.run.nproc, cfg.run.dir = 1, os.path.join(tempfile.gettempdir(), "loom-test-syncs")
    mesh = get_mesh()
    return cfg, mesh, build_run(cfg, mesh, build_model(cfg.model, cfg.train.seed))


def test_sync_budget_of_a_dense_step():
    """One single-process step of the debug model: 0 syncs per micro-batch (forward, loss, backward),
    1 in the optimizer step (the gradient norm, read once for the non-finite check and the log), 1 to
    log the step's loss. torch AdamW's per-parameter step counts stay on the host (not syncs)."""
    from loom.train.step import optimizer_step, train_step

    cfg, mesh, run = _debug_run()
    g = torch.Generator().manual_seed(0)

    def micro_batches(k):
        out = []
        for _ in range(k):
            t = torch.randint(
                0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.data.seq_len + 1), generator=g
            )
            out.append((t[:, :-1], t[:, 1:]))
        return out

    train_step(run, micro_batches(1), cfg.train.grad_clip, 1e-3, mesh.group("dp"))  # optimizer state built
    host = optimizer_host_tensors(run.strategy.optimizer)
    assert host  # torch AdamW's step counts (on the CPU on every device)
    counts = {}
    for k in (1, 4):
        with SyncCounter(host=host) as c:
            train_step(run, micro_batches(k), cfg.train.grad_clip, 1e-3, mesh.group("dp"))
        counts[k] = c.by_site()
    assert counts[1] == counts[4], "syncs inside the micro-batch loop"  # 0 per micro-batch
    assert sum(counts[4].values()) == 2, counts[4]
    with SyncCounter(host=host) as c:
        run.strategy.zero_grad()
        for x, y in micro_batches(2):
            with c.phase("micro-batch"):
                run.loss_fn(run.model(x), y).backward()  # the head inside the loss
        with c.phase("optimizer"):
            optimizer_step(run.strategy, 1e-3, cfg.train.grad_clip)
    assert c.phases == {"micro-batch": 0, "optimizer": 1}, c.by_site()
    assert [what for what, _ in c.calls] == ["__float__"]  # float(norm) in clip_grad_norm


def test_packed_and_gqa_forward_backward_has_no_sync():
    """Packed documents (positions, document masks), GQA, dropout and the loss: no host sync."""
    model = build_model(tiny_model(n_kv_heads=1, dropout=0.1), 0).train()
    x, y, positions = packed_global_batch(0, 2)
    with SyncCounter() as c:
        loss_fn(model(x, positions), y).backward()
    assert c.count == 0, c.by_site()
