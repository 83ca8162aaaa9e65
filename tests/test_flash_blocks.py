"""Context-parallel attention blocks through kernels that return the log-sum-exp (issue 31, item 3):
ring and all-gather attention through the kernels equal the fp32 matrix products (outputs and
gradients; causal and packed documents), one block's peak bytes meet the O(T·d) formula of
loom/parallel/context/blocks.py, and the CUDA kernels' calls are well-formed (on the meta device)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from loom.parallel.context import blocks
from tests.dist import get_mesh
from tests.helpers import one_thread  # noqa: F401 (fixture)
from tests.test_device_speed import LiveBytes

pytestmark = pytest.mark.usefixtures("one_thread")
CP, B, A, K, T, D = 2, 2, 4, 2, 32, 8  # cp ranks; batch, query heads, key heads, sequence, head dim


def _core_both_paths(mode: str, packed: bool) -> dict:
    """This cp rank's output and gradients of one attention call through the kernels and through the
    fp32 matrix products (``blocks._fused`` off), on the same inputs."""
    from loom.parallel.context.allgather import AllGatherCore
    from loom.parallel.context.blocks import local_positions
    from loom.parallel.context.ring import RingCore

    mesh = get_mesh(cp=CP)
    rank = mesh.local_rank("cp")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (A, K, K))
    grad = torch.randn(B, A, T, D, generator=g)
    starts = torch.rand(B, T, generator=g) < 0.15
    starts[:, 0] = True
    mine = local_positions(T, CP, rank)
    docs = starts[:, mine].long().cumsum(1) if packed else None  # cumsum over this rank's own tokens
    core = (RingCore if mode == "ring" else AllGatherCore)(mesh.group("cp"), rank, CP)
    result, fused = {}, blocks._fused
    try:
        for path in ("kernel", "matmul"):
            blocks._fused = (lambda q: True) if path == "kernel" else (lambda q: False)
            ins = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
            out = core(*ins, docs)
            out.backward(grad[:, :, mine])
            result[path] = [out.detach(), *(t.grad for t in ins)]
    finally:
        blocks._fused = fused
    return result


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("mode", ["ring", "allgather"])
def test_kernel_blocks_equal_the_fp32_matmul_path(pools, mode, packed):
    """Ring and all-gather attention on 2 ranks (GQA 4:2, causal, or packed documents through the
    kernel's mask): output, dQ, dK, dV through the kernels equal the fp32 matrix products."""
    for r in pools(CP).run(_core_both_paths, mode, packed):
        for name, got, want in zip(("out", "dq", "dk", "dv"), r["kernel"], r["matmul"], strict=True):
            assert_close(got, want, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
def test_block_peak_bytes_are_linear_in_the_sequence(packed):
    """One block of Tq = Tk = 1024 tokens, a = 8 query and k = 2 key heads of d = 64 in fp32 (e = 4):
    the peak of what its forward allocates is B·a·Tq·(d·e + 4) (out and the fp32 lse), its backward's
    B·(a·Tq + 2·k·Tk)·d·e (dQ, dK, dV); a document mask adds the fully-hidden-row check, at most
    B·a·Tq·4 + B·Tq·(e + 1). The fp32 matrix products (the path before) hold (B, a, Tq, Tk) fp32
    tensors: more than 2·B·a·Tq·Tk·4 in each direction."""
    Bn, a, k, Tn, d, e = 1, 8, 2, 1024, 64, 4
    g = torch.Generator().manual_seed(0)
    q, kk, v = (torch.randn(Bn, h, Tn, d, generator=g) for h in (a, k, k))
    docs = (torch.arange(Tn) // 300)[None]
    mask = blocks.doc_mask(docs, docs, True, q.dtype) if packed else None
    extra = Bn * a * Tn * 4 + Bn * Tn * (e + 1) if packed else 0
    forward, backward = Bn * a * Tn * (d * e + 4), Bn * (a * Tn + 2 * k * Tn) * d * e
    with LiveBytes() as fwd:
        out, lse = blocks.attend(q, kk, v, not packed, mask)
    with LiveBytes() as bwd:
        blocks.attend_backward(out, q, kk, v, out, lse, not packed, mask)
    assert forward <= fwd.peak <= forward + extra
    assert bwd.peak == backward
    fused = blocks._fused
    try:
        blocks._fused = lambda q: False
        with LiveBytes() as fwd_mm:
            out, lse = blocks.attend(q, kk, v, not packed, mask)
        with LiveBytes() as bwd_mm:
            blocks.attend_backward(out, q, kk, v, out, lse, not packed, mask)
    finally:
        blocks._fused = fused
    scores = Bn * a * Tn * Tn * 4
    assert fwd_mm.peak > 2 * scores and bwd_mm.peak > 2 * scores


@pytest.mark.parametrize(
    "kernel,dtype,packed",
    [
        ("flash", torch.bfloat16, False),
        ("efficient", torch.float32, False),
        ("efficient", torch.bfloat16, True),
    ],
)
def test_cuda_kernel_calls_are_well_formed(monkeypatch, kernel, dtype, packed):
    """The CUDA kernels' forward and backward (their meta implementations: shapes and dtypes of the
    calls a GPU makes), GQA 4:2, 40 rows (the efficient kernel pads its lse to 64 and its bias to 48):
    out (B, a, Tq, d) in the input dtype, lse (B, a, Tq) in fp32, gradients in each input's shape."""
    monkeypatch.setattr(blocks, "_kernel", lambda q, mask: kernel)
    q, k, v = (torch.empty(2, h, 40, 16, device="meta", dtype=dtype) for h in (4, 2, 2))
    mask = torch.empty(2, 1, 40, 40, device="meta", dtype=dtype) if packed else None
    out, lse = blocks.attend(q, k, v, not packed, mask)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, dtype, (2, 4, 40), torch.float32)
    grads = blocks.attend_backward(out, q, k, v, out, lse, not packed, mask)
    assert [(t.shape, t.dtype) for t in grads] == [(t.shape, dtype) for t in (q, k, v)]


def test_kernel_per_device_and_dtype():
    """CPU: its flash kernel (masks too); CUDA: flash for bf16/fp16 without a mask, else efficient."""
    cpu, cuda = torch.empty(1, 1, 4, 8), torch.empty(1, 1, 4, 8, device="meta")
    assert blocks._kernel(cpu, None) == blocks._kernel(cpu, cpu) == "cpu"
    bf16 = torch.empty(1, 1, 4, 8, device="meta", dtype=torch.bfloat16)
    assert blocks._kernel(bf16, None) == "flash"
    assert blocks._kernel(bf16, bf16) == blocks._kernel(cuda, None) == "efficient"
