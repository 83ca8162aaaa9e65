"""A plain single-device Llama-style decoder: the reference every parallel layout is compared to.

RMSNorm, rotary position embeddings, grouped-query attention through
``F.scaled_dot_product_attention`` (packed documents on CUDA: compiled ``flex_attention`` under one
document block mask per micro-batch, :func:`document_block_mask`; scores scaled by ``attn_scale`` and
soft-capped by ``attn_softcap``, :class:`CoreAttention`) (optional q/k/v biases and per-head q/k RMSNorm), SwiGLU MLP or a top-k routed mixture of SwiGLU experts
(``model.n_experts > 1``), optional tied embeddings. The GPT-2 variants are fields of the config,
not other classes: ``norm`` (LayerNorm with a bias), ``mlp`` (GELU, non-gated), ``positions``
(a learned table instead of RoPE), ``bias`` (biases on every linear but the head). No parallel code
lives here: strategies are applied from outside (module swap, hooks, wrapping).

Shapes: B batch, T sequence, h = dim, a = n_heads, k = n_kv_heads, d = head_dim = h / a,
V vocabulary, f = ffn_dim. A padded vocabulary (``model.pad_vocab_to`` = V' > V) gives the embedding
and the head V' rows, the padded ones zeros; the head's logits are those of the V real rows
(:class:`VocabHead`), so padding changes no logit, loss or sample.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from collections.abc import Callable, Iterable
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from loom.config import ModelConfig, MoEConfig
from loom.config.sections import GATED_MLPS
from loom.model import moe
from loom.model.loss import CHUNK_ROWS, IGNORE_INDEX, chunked_cross_entropy, linear_cross_entropy
from loom.model.moe import ExpertWeights, MoEFeedForward, experts_forward, real_buffers, route, swiglu  # noqa: F401 (re-exported)
from loom.model.norms import LayerNorm, RMSNorm, make_norm  # noqa: F401 (re-exported)
from loom.model.rope import rope_tables  # noqa: F401 (re-exported)
from loom.model.softcap import softcap as cap_logits  # (attention's ``softcap`` is its float c)

# Packed documents as a block takes them: ids (B, T), one flex block mask, or the pair (unwindowed,
# windowed) of block masks when only some layers attend within ``model.sliding_window`` (layer_args;
# unpacked, the unwindowed layers' may be None: SDPA's causal flag serves them)
Documents = torch.Tensor | BlockMask | tuple[BlockMask | None, BlockMask]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pairs (x[2i], x[2i+1]) as complex numbers times e^{iθ} = cos θ + i sin θ, in fp32, rounded
    back to x's dtype: one multiply over x where the real form takes about nine. Under
    ``torch.compile`` the real form, which inductor fuses into one kernel (it generates no code for
    complex operators); the same products and sums."""
    if torch.compiler.is_compiling():
        x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # (..., d/2) each
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).type_as(x)
    xc = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))  # (..., d/2)
    return torch.view_as_real(xc * torch.complex(cos.float(), sin.float())).flatten(-2).type_as(x)


class _Rope(torch.autograd.Function):
    """x ↦ x·m·e^{iθ}, backward g ↦ g·m·e^{-iθ} (the product's transpose is by the conjugate; m: the
    RoPE rule's factor, 1 but for YaRN and LongRoPE): saves only the tables, where autograd of the
    product would also keep the complex table it builds."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _rotate(g, cos, -sin), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x: (B, T, heads, d) by the angles of positions 0..T-1 (tables
    of shape (≥T, d/2)), or of each token's own position (per-token rows (B, T, d/2), packed data):
    (x0, x1) ↦ (x0 cos - x1 sin, x0 sin + x1 cos), in fp32."""
    T = x.shape[1]
    if cos.dim() == 3:  # per-token rows
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # (B, T, 1, d/2)
    else:
        cos, sin = cos[:T, None, :], sin[:T, None, :]  # (T, 1, d/2)
    return _Rope.apply(x, cos, sin)


class CoreAttention(nn.Module):
    """The attention core: softmax(cap(σ q kᵀ) + causal mask) v, with attention dropout p while
    training. σ = ``model.attn_scale`` (0: 1/sqrt(d)); cap(s) = c·tanh(s/c) with c =
    ``model.attn_softcap`` > 0 (Gemma 2's attention logit soft-capping), cap(s) = s when c = 0. Query
    head i reads key/value head i // (a/k) (SDPA's or flex's ``enable_gqa``, or a broadcast product):
    the keys and values are never repeated to a heads, so backward saves them at width k·d, not a·d.

    Kernels (:func:`attention`): without a cap SDPA (flash), σ passed as its ``scale``; packed
    documents on CUDA compiled flex (:func:`flex`, the cap as its ``score_mod``). With a cap and no
    block mask: :func:`capped_attention`'s explicit products (O(T²) scores), or on CUDA without
    dropout compiled flex under a causal block mask. A sliding window w (``model.sliding_window`` on
    the layers ``model.window_layers`` names): query i sees keys i - w < j <= i (:func:`window_mask`),
    on CUDA through flex under a windowed block mask that skips the blocks outside it (O(T·w)),
    elsewhere SDPA or the capped products over the dense (T, T) window mask.

    (B, a, T, d), (B, k, T, d), (B, k, T, d) -> (B, a, T, d). No parameters: recomputation
    policies wrap this module alone (``train.recompute = selective``).
    """

    def __init__(
        self, dropout: float = 0.0, scale: float = 0.0, softcap: float = 0.0, window: int = 0
    ) -> None:
        super().__init__()
        self.dropout = dropout
        self.scale = scale  # σ; 0 = 1/sqrt(d)
        self.softcap = softcap  # c; 0 = no cap
        self.window = window  # w: query i sees keys i - w < j <= i; 0 = every earlier key

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents | None = None
    ) -> torch.Tensor:
        """``docs``, packed data: key j is visible to query i iff j <= i and docs[j] == docs[i] (and,
        with a window w, i - w < j). Either the document ids (B, T) int64 (SDPA over the dense mask of
        :func:`document_mask`) or the micro-batch's :func:`document_block_mask` built with this core's
        window (compiled ``flex_attention``: no (T, T) tensor), or the pair (unwindowed, windowed) of
        them when the model's layers differ (:func:`layer_args`): this core takes its own."""
        p = self.dropout if self.training else 0.0
        if isinstance(docs, tuple):  # (window 0, window w): layers of both kinds share the micro-batch's
            docs = docs[1] if self.window else docs[0]
        if isinstance(docs, BlockMask):
            if p > 0:
                raise ValueError("flex attention has no dropout: packed documents with dropout take SDPA")
            return flex(q, k, v, docs, self.scale, self.softcap)  # (B, a, T, d)
        mask = None if docs is None else document_mask(docs, docs)[:, None]  # (B, 1, T, T)
        return attention(q, k, v, mask, p, scale=self.scale, softcap=self.softcap, window=self.window)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    dropout: float = 0.0,
    causal: bool | None = None,
    scale: float = 0.0,
    softcap: float = 0.0,
    window: int = 0,
) -> torch.Tensor:
    """softmax(cap(σ q kᵀ) + mask) v of q (B, a, Tq, d) over grouped k, v (B, k, Tk, d) (σ = ``scale``,
    0: 1/sqrt(d); cap as :class:`CoreAttention`'s, none when ``softcap`` = 0); ``mask`` boolean
    (True: visible) or additive, and ``causal`` as :func:`sdpa`'s. ``window`` w > 0: besides ``mask``,
    query i sees key j iff i - w < j <= i (:func:`window_mask`, aligned at the start; causal with it).

    No cap: :func:`sdpa` (flash kernels, σ as its ``scale``). A cap, which SDPA cannot apply: on CUDA,
    causal self-attention without dropout runs compiled flex under :func:`causal_block_mask` with the
    cap as its ``score_mod`` (:func:`flex`); anything else :func:`capped_attention` (O(Tq·Tk) scores).
    A window: on CUDA, causal self-attention without ``mask`` or dropout runs compiled flex under the
    windowed :func:`causal_block_mask` (blocks outside the window skipped: O(T·w)); anything else
    takes the paths above with the (Tq, Tk) window mask folded into ``mask`` (O(Tq·Tk)).
    """
    if window > 0:
        causal = mask is None if causal is None else causal
        Tq, Tk = q.shape[2], k.shape[2]
        if q.is_cuda and mask is None and causal and dropout == 0 and Tq == Tk:
            return flex(q, k, v, causal_block_mask(Tq, q.device, window), scale, softcap)
        seen = window_mask(Tq, Tk, window, q.device)  # (Tq, Tk): i - w < j <= i
        if mask is None:
            mask = seen
        else:
            mask = mask & seen if mask.dtype == torch.bool else mask.masked_fill(~seen, float("-inf"))
        causal = False  # the window mask is causal
    if softcap <= 0:
        return sdpa(q, k, v, mask, dropout, causal, scale)
    causal = mask is None if causal is None else causal
    if q.is_cuda and mask is None and causal and dropout == 0 and q.shape[2] == k.shape[2]:
        return flex(q, k, v, causal_block_mask(q.shape[2], q.device), scale, softcap)
    return capped_attention(q, k, v, mask, dropout, causal, scale, softcap)


def window_mask(
    Tq: int, Tk: int, window: int, device: torch.device | str = "cpu", offset: int = 0
) -> torch.Tensor:
    """Boolean (Tq, Tk) sliding-window mask, True where query i (at position ``offset`` + i) sees key j:
    offset + i - w < j <= offset + i (transformers' ``sliding_window_causal_mask_function``: causal and
    ``kv_idx > q_idx - sliding_window``), so each query sees itself and its w - 1 predecessors."""
    i = torch.arange(Tq, device=device)[:, None] + offset
    j = torch.arange(Tk, device=device)[None, :]
    return (j <= i) & (j > i - window)


def capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    causal: bool,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """The explicit soft-capped attention, as transformers' Gemma 2 ``eager_attention_forward``:
    s = c·tanh(σ q kᵀ / c) in fp32 (or wider), −∞ where ``causal`` hides (key j > query i, aligned at
    the start) and where ``mask`` does, P = softmax(s) in fp32 cast to q's dtype, dropout p, P v.
    GQA by broadcasting: q viewed (B, k, a/k, Tq, d) against k (B, k, 1, d, Tk), no repeated keys.
    Memory: the (B, a, Tq, Tk) scores, tanh and probabilities, saved for backward (the reference and
    the CPU path; CUDA takes :func:`flex` wherever it can)."""
    B, a, Tq, d = q.shape
    kv, Tk = k.shape[1], k.shape[2]
    sigma = scale or 1.0 / math.sqrt(d)
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(acc).unflatten(1, (kv, a // kv))  # (B, k, a/k, Tq, d): query head i -> kv head i // (a/k)
    s = (qg @ k.to(acc).transpose(-1, -2)[:, :, None]).flatten(1, 2) * sigma  # (B, a, Tq, Tk)
    s = softcap * torch.tanh(s / softcap)
    if causal:
        s = s.masked_fill(torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(acc)
    p = torch.softmax(s, dim=-1).to(q.dtype)  # (B, a, Tq, Tk)
    if dropout > 0:
        p = F.dropout(p, dropout, training=True)
    return (p.unflatten(1, (kv, a // kv)) @ v[:, :, None]).flatten(1, 2)  # (B, a, Tq, d)


_compiled_flex: Callable[..., torch.Tensor] | None = None


def flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    scale: float = 0.0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """``flex_attention`` of q (B, a, T, d) over grouped k, v (B, k, T, d) under ``block_mask``, through
    ``torch.compile`` (one fused kernel; eager flex would materialize the (B, a, T, T) scores). Memory:
    q, k, v, the output and an fp32 log-sum-exp (B, a, T), plus the block mask's O(B·(T/128)²) ints.

    Scores σ q kᵀ (flex's ``scale``; 0: 1/sqrt(d)), then with ``softcap`` c > 0 the ``score_mod``
    s -> c·tanh(s/c) (:func:`softcap_score_mod`; flex differentiates it: dS·(1 − tanh²)), then the
    block mask. Not run by the CPU tests' backward (torch 2.13's flex has none on the CPU): its forward
    is checked there against :func:`capped_attention`, its gradients on CUDA only."""
    global _compiled_flex
    if _compiled_flex is None:  # compiled on first use: importing the model compiles nothing
        _compiled_flex = cast(Callable[..., torch.Tensor], torch.compile(flex_attention))
    return _compiled_flex(
        q,
        k,
        v,
        score_mod=softcap_score_mod(softcap) if softcap > 0 else None,
        block_mask=block_mask,
        scale=scale or None,
        enable_gqa=q.shape[1] != k.shape[1],
    )


@functools.cache
def softcap_score_mod(softcap: float) -> Callable[..., torch.Tensor]:
    """flex's ``score_mod`` of the soft-cap c: s -> c·tanh(s/c); one function per c, so the compiled
    flex is not traced again at every call."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


_causal_masks: dict[tuple[int, int, str], BlockMask] = {}


def causal_block_mask(T: int, device: torch.device, window: int = 0) -> BlockMask:
    """The causal :class:`BlockMask` of T queries and keys (key j visible to query i iff j <= i, and
    with a ``window`` w > 0 also i - w < j: :func:`window_mask`), broadcast over batch and heads;
    built once per (T, w, device): O((T/128)²) ints. Windowed, its tables skip every block wholly
    outside the window (:func:`document_block_mask`'s rule over one document), so flex reads
    O(T·w) scores, not O(T²)."""
    key = (T, window, str(device))
    if key not in _causal_masks:
        if window > 0:
            one = torch.zeros(1, T, dtype=torch.long, device=device)  # one document: the causal band
            _causal_masks[key] = _banded_block_mask(one, FLEX_BLOCK, window, _causal_window(window))
        else:
            _causal_masks[key] = create_block_mask(_causal, None, None, T, T, device=device)
    return _causal_masks[key]


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


@functools.cache
def _causal_window(window: int) -> Callable[..., torch.Tensor]:
    """flex's ``mask_mod`` of the causal window w: i - w < j <= i."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return mask_mod


def packed_attention(device: torch.device) -> Literal["flex", "dense"]:
    """The kernel packed documents take on ``device``: ``flex`` (compiled ``flex_attention`` over one
    :func:`document_block_mask` per micro-batch) on CUDA; ``dense`` (SDPA with the (B, 1, T, T) mask
    of :func:`document_mask`) elsewhere: torch 2.13's flex attention has no backward on the CPU."""
    return "flex" if device.type == "cuda" else "dense"


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    dropout: float = 0.0,
    causal: bool | None = None,
    scale: float = 0.0,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of q (B, a, Tq, d) over grouped k, v (B, k, Tk, d), a % k == 0,
    scores scaled by ``scale`` (0: SDPA's default 1/sqrt(d)).

    Causal (aligned at the start) when ``mask`` is None, unless ``causal`` says otherwise. GQA goes
    through ``enable_gqa`` on every backend that takes it (CPU flash and math; CUDA flash,
    memory-efficient and math), so no repeated k, v is made or saved. ROCm's flash and
    memory-efficient kernels have refused grouped heads, which would drop SDPA to the math kernel's
    O(T²) scores: only there are k and v repeated first.
    """
    rep = q.shape[1] // k.shape[1]
    if causal is None:
        causal = mask is None
    gqa = rep > 1
    if gqa and torch.version.hip is not None and q.is_cuda:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, a, Tk, d)
        gqa = False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scale or None, enable_gqa=gqa
    )  # (B, a, Tq, d)


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """Document index of every token of a packed sequence: cumsum(positions == 0) along T, (B, T)."""
    return (positions == 0).cumsum(dim=1)


def document_mask(docs_q: torch.Tensor, docs_k: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Boolean (B, Tq, Tk) mask, True where query i (global index ``offset + i``) may see key j:
    j <= offset + i and docs_k[j] == docs_q[i]. A query always sees itself, so no row is empty."""
    i = torch.arange(docs_q.shape[1], device=docs_q.device)[:, None] + offset
    j = torch.arange(docs_k.shape[1], device=docs_k.device)[None, :]
    return (j <= i)[None] & (docs_q[:, :, None] == docs_k[:, None, :])


FLEX_BLOCK = 128  # flex_attention's tile: the block mask keeps one entry per (128 queries, 128 keys)


def _sorted_blocks(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count (B, 1, n), indices (B, 1, n, n)) int32 of the True kv blocks of each query block row."""
    idx = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True)  # True blocks first, in order
    return sel.sum(-1, dtype=torch.int32)[:, None], idx.to(torch.int32)[:, None]


def document_block_mask(docs: torch.Tensor, block: int = FLEX_BLOCK, window: int = 0) -> BlockMask:
    """The document-causal :class:`BlockMask` of packed ``docs`` (B, T): key j visible to query i iff
    j <= i and docs[j] == docs[i], as :func:`document_mask`, without any (T, T) tensor; with a
    ``window`` w > 0 also i - w < j (:func:`window_mask`).

    ``docs`` is non-decreasing along T (:func:`document_ids`), so a block of tokens holds every id in
    [first, last]. With n = ceil(T / block) blocks, query block i and key block j are: skipped when
    j > i or last_j < first_i (no shared document); full (no mask evaluated) when j < i and both blocks
    lie whole inside one document; partial otherwise (the mask_mod decides per element). Memory:
    O(B·n²) int32 block tables, no host sync. A window w also skips the blocks whose nearest pair is
    w or more apart, (i - j)·block - (block - 1) >= w, and keeps full only those whose farthest pair
    is within it, (i - j)·block + block - 1 < w: about w/block + 1 blocks per row remain."""
    padded = _padded_docs(docs, block)

    def mask_mod(b, h, q_idx, kv_idx):
        seen = (kv_idx <= q_idx) & (padded[b, q_idx] == padded[b, kv_idx])
        return seen & (q_idx - kv_idx < window) if window > 0 else seen

    return _banded_block_mask(docs, block, window, mask_mod)


def _padded_docs(docs: torch.Tensor, block: int) -> torch.Tensor:
    """``docs`` (B, T) padded to whole blocks with document -1: never visible to a real query."""
    pad = -docs.shape[1] % block
    return F.pad(docs, (0, pad), value=-1) if pad else docs  # (B, n·block)


def _banded_block_mask(
    docs: torch.Tensor, block: int, window: int, mask_mod: Callable[..., torch.Tensor]
) -> BlockMask:
    """:func:`document_block_mask`'s tables of ``docs`` (B, T) and ``window`` (0: none), under
    ``mask_mod``."""
    B, T = docs.shape
    n = -(-T // block)
    blocks = _padded_docs(docs, block).view(B, n, block)
    first = blocks[:, :, 0]  # (B, n)
    last = docs[:, torch.clamp(torch.arange(1, n + 1, device=docs.device) * block, max=T) - 1]  # (B, n)
    i = torch.arange(n, device=docs.device)
    lower = (i[None, :] <= i[:, None])[None]  # (1, n, n): j <= i
    shared = last[:, None, :] >= first[:, :, None]  # (B, n, n): last_j >= first_i
    whole = (first == last) & (i < T // block)[None]  # (B, n): a complete block inside one document
    same = first[:, :, None] == first[:, None, :]  # (B, n, n)
    full = (i[None, :] < i[:, None])[None] & whole[:, :, None] & whole[:, None, :] & same
    if window > 0:  # query block i against key block j: pairs (i - j)·block ± (block - 1) apart
        gap = (i[:, None] - i[None, :]) * block  # (n, n)
        lower = lower & (gap - (block - 1) < window)[None]  # the nearest pair inside the window
        full = full & (gap + block - 1 < window)[None]  # the farthest too
    partial = lower & shared & ~full
    kv_num, kv_idx = _sorted_blocks(partial)
    full_num, full_idx = _sorted_blocks(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, block, mask_mod, seq_lengths=(T, T))


class Attention(nn.Module):
    """Causal grouped-query self-attention: a query heads share k key/value heads (a % k == 0)."""

    activation_kind = "attention"  # what its saved tensors count as for train.compress

    def __init__(self, cfg: ModelConfig, window: int = 0, rope: bool = True) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qkv_bias = cfg.qkv_bias or cfg.bias
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.bias)
        # learned positions are added to the embeddings instead; a NoPE layer (model.nope_layers) has none
        self.rope = cfg.positions == "rope" and rope
        self.qk_norm_all = cfg.qk_norm_scope == "all"  # over a·d (k·d) at once, else per head over d
        q_width, k_width = (cfg.n_heads, cfg.n_kv_heads) if self.qk_norm_all else (1, 1)
        norm_args = (cfg.norm_eps, cfg.norm_offset)
        self.q_norm = RMSNorm(q_width * cfg.head_dim, *norm_args) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width * cfg.head_dim, *norm_args) if cfg.qk_norm else None
        self.core = CoreAttention(cfg.dropout, cfg.attn_scale, cfg.attn_softcap, window)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        docs: Documents | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        # Head counts come from the weights so a tensor-parallel shard (fewer heads) runs unchanged.
        q, k = self.wq(x), self.wk(x)  # (B, T, a*d), (B, T, k*d)
        if self.q_norm is not None and self.qk_norm_all:  # over all heads at once (OLMo-2)
            q, k = self.q_norm(q), self.k_norm(k)  # type: ignore[misc]  # k_norm is set whenever q_norm is
        q = q.view(B, T, -1, self.head_dim)  # (B, T, a, d)
        k = k.view(B, T, -1, self.head_dim)  # (B, T, k, d)
        v = self.wv(x).view(B, T, -1, self.head_dim)  # (B, T, k, d)
        if self.q_norm is not None and not self.qk_norm_all:  # per head, over d
            q, k = self.q_norm(q), self.k_norm(k)  # type: ignore[misc]
        if self.rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, d)
        y = self.core(q, k, v) if docs is None else self.core(q, k, v, docs)  # (B, a, T, d)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, a*d)
        return self.wo(y)  # (B, T, h)


def mlp_activation(kind: str, a: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The MLP's hidden activation: silu(a) * b (SwiGLU), gelu_tanh(a) * b (GeGLU, Gemma), gelu(a)
    exact, or gelu(a) with the tanh approximation 0.5 a (1 + tanh(sqrt(2/π) (a + 0.044715 a³)))
    (GPT-2's gelu_new)."""
    if kind in GATED_MLPS:
        assert b is not None  # the gate's partner w3 x
        gate = F.silu(a) if kind == "swiglu" else F.gelu(a, approximate="tanh")
        return gate * b
    return F.gelu(a, approximate="tanh" if kind == "gelu_tanh" else "none")


class FeedForward(nn.Module):
    """Gated w2( act(w1 x) * w3 x ) (``kind`` swiglu: SiLU; geglu_tanh: GELU-tanh), or (gelu,
    gelu_tanh) w2( gelu(w1 x) ) without w3; hidden size f, biases on w1 and w2 with ``bias``."""

    activation_kind = "mlp"  # what its saved tensors count as for train.compress

    def __init__(self, dim: int, hidden: int, kind: str = "swiglu", bias: bool = False) -> None:
        super().__init__()
        self.kind = kind
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=False) if kind in GATED_MLPS else None
        self.w2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(
            mlp_activation(self.kind, self.w1(x), None if self.w3 is None else self.w3(x))
        )  # (B, T, h)


class Block(nn.Module):
    """Pre-norm transformer block: x + drop(attn(norm(x))), then + drop(mlp(norm(x))); with
    ``norm_placement = post`` (OLMo-2) the norms close the branches: x + drop(norm(attn(x))), then
    + drop(norm(mlp(x))); with ``sandwich`` (Gemma 2 and 3) both: x + drop(norm'(attn(norm(x)))),
    then the same with the MLP (its own two norms: ``post_attention_norm``, ``post_ffn_norm``).

    Dropout (``cfg.dropout``, training only) on both residual branches and inside the attention
    core; with p = 0 (the default) no dropout op runs at all.
    """

    def __init__(self, cfg: ModelConfig, moe: MoEConfig | None = None, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = make_norm(cfg, cfg.dim)
        # layer ``layer`` attends within ``model.sliding_window`` where ``model.window_layers`` names it
        self.attention = Attention(
            cfg,
            cfg.sliding_window if layer in cfg.windowed_layers() else 0,
            layer not in cfg.nope_layer_set(),
        )
        self.ffn_norm = make_norm(cfg, cfg.dim)
        self.feed_forward: nn.Module  # replaced by tensor/expert-parallel modules from outside
        if cfg.moe:
            self.feed_forward = MoEFeedForward(cfg.dim, cfg.resolved_ffn_dim(), cfg.n_experts, cfg.top_k, moe)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.resolved_ffn_dim(), cfg.mlp, cfg.bias)
        sandwich = cfg.norm_placement == "sandwich"
        self.post_attention_norm = make_norm(cfg, cfg.dim) if sandwich else None
        self.post_ffn_norm = make_norm(cfg, cfg.dim) if sandwich else None
        self.dropout = cfg.dropout
        self.residual = cfg.residual_multiplier
        self.post_norm = cfg.norm_placement == "post"
        # with two RoPE bases (Gemma 3): which of the stacked tables this layer rotates by (1: local)
        self.rope_table = int(layer in cfg.local_layers()) if cfg.rope_local_theta else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        docs: Documents | None = None,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``docs``: packed data's document ids (B, T) or block mask, passed to the attention (see
        CoreAttention). ``attend``: another attention on (B, T, h) and this layer's RoPE rows (the KV-cached
        decoder's). The
        attention is called in this frame, not in a nested function: under ``torch.compile`` a
        communicating module run eagerly breaks the graph here, and the rest of the block compiles."""
        extra = () if docs is None else (docs,)
        if self.rope_table is not None:  # (…, 2, d/2): this layer's base
            cos, sin = cos[..., self.rope_table, :], sin[..., self.rope_table, :]
        if self.post_norm:  # (B, T, h) throughout
            a = self.attention(x, cos, sin, *extra) if attend is None else attend(x, cos, sin)
            x = x + self._drop(self.attention_norm(a))
            return x + self._drop(self.ffn_norm(self.feed_forward(x)))
        h = self.attention_norm(x)
        a = self.attention(h, cos, sin, *extra) if attend is None else attend(h, cos, sin)
        if self.post_attention_norm is not None:
            a = self.post_attention_norm(a)
        x = x + self._drop(a)
        m = self.feed_forward(self.ffn_norm(x))
        if self.post_ffn_norm is not None:
            m = self.post_ffn_norm(m)
        return x + self._drop(m)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        """A branch's output into the residual: times ``model.residual_multiplier`` (Granite), and its
        dropout while training."""
        if self.residual != 1:
            x = x * self.residual
        return F.dropout(x, self.dropout, training=True) if self.dropout > 0 and self.training else x


class VocabHead(nn.Linear):
    """The output head over a padded vocabulary (``model.pad_vocab_to``): a weight of V' >= V rows,
    logits of the first V only, z = x W[:V]ᵀ (B, T, V). The padded rows take no part in the logits,
    so none in the loss, the softmax or sampling; their gradient is zero."""

    def __init__(self, dim: int, padded: int, vocab: int) -> None:
        super().__init__(dim, padded, bias=False)
        self.vocab = vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight[: self.vocab])  # (B, T, V)


def final_norm(norm: nn.Module, h: torch.Tensor, divisor: float = 1.0) -> torch.Tensor:
    """norm(h), divided by the logits' ``divisor`` (``model.logit_divisor``) when it is not 1."""
    out = norm(h)
    return out if divisor == 1 else out / divisor


def embed(
    tok: nn.Module,
    pos: nn.Module | None,
    pos_ids: torch.Tensor | None,
    tokens: torch.Tensor,
    positions: torch.Tensor | None = None,
    scale: float | None = None,
    multiplier: float = 1.0,
) -> torch.Tensor:
    """Token embeddings (B, T, h), times ``scale`` rounded to their dtype (Gemma's sqrt(h):
    ``model.embed_scale``) when given and times ``multiplier`` (``model.embed_multiplier``, Granite's,
    unrounded), plus with learned positions the table's rows at each token's position: ``positions``
    (B, T) when given, else the first T of ``pos_ids``."""
    h = tok(tokens)
    if scale is not None:  # the scale rounded to h's dtype as Gemma rounds it; a Python number: no device
        h = h * torch.tensor(scale, dtype=h.dtype, device="cpu").item()
    if multiplier != 1:
        h = h * multiplier
    if pos is None:
        return h
    return h + pos(positions if positions is not None else cast(torch.Tensor, pos_ids)[: tokens.shape[1]])


class Transformer(nn.Module):
    """Token ids (B, T) -> logits (B, T, V)."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig | None = None) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be resolved (> 0) before building the model")
        self.cfg = cfg
        V = cfg.padded_vocab  # V' >= V rows (model.pad_vocab_to): the padded ones zeros, outside the logits
        self.tok_embeddings = nn.Embedding(V, cfg.dim)
        # Learned absolute positions (GPT-2): row p of the table is added at position p; pos_ids holds
        # the positions of the tokens this model sees (context parallelism swaps in its ranks' own).
        learned = cfg.positions == "learned"
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim) if learned else None
        self.register_buffer("pos_ids", torch.arange(cfg.max_seq_len) if learned else None, persistent=False)
        self.embed_scale = cfg.dim**0.5 if cfg.embed_scale else None  # embeddings times sqrt(h) (Gemma)
        self.embed_multiplier = cfg.embed_multiplier  # and times this (Granite)
        self.layers = nn.ModuleList(Block(cfg, moe, i) for i in range(cfg.n_layers))
        for i, block in enumerate(self.layers):  # MoE metrics name their layer
            if isinstance(block.feed_forward, MoEFeedForward):
                block.feed_forward.layer_id = i
        self.norm = make_norm(cfg, cfg.dim)
        self.output = (
            VocabHead(cfg.dim, V, cfg.vocab_size) if cfg.vocab_size < V else nn.Linear(cfg.dim, V, bias=False)
        )
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.head_in_loss = False  # set by fused_head_loss: training forwards end before the head
        cos, sin = self.rope_buffers()
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def rope_buffers(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary (cos, sin) tables of every position up to ``max_seq_len``, (S, d/2) each; with
        ``model.rope_local_theta`` two, (S, 2, d/2): rope_theta's and the local layers' base, every
        position's rows side by side, so whatever picks positions (packed data, cp, the KV cache)
        picks both and each block takes its own (:attr:`Block.rope_table`)."""
        cfg = self.cfg
        with torch.device(device) if device is not None else contextlib.nullcontext():
            cos, sin = rope_tables(cfg)  # the long-context rule on rope_theta's layers only
            if not cfg.rope_local_theta:
                return cos, sin  # (S, d/2) each
            local = rope_tables(cfg, cfg.rope_local_theta, scaled=False)
            return torch.stack((cos, local[0]), -2), torch.stack((sin, local[1]), -2)  # (S, 2, d/2)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions`` (B, T) int64, packed data: each token's position in its own document (0 at
        every document start); RoPE then uses those positions and attention stays inside documents."""
        h = embed(
            self.tok_embeddings,
            self.pos_embeddings,
            cast(torch.Tensor | None, self.pos_ids),
            tokens,
            positions,
            self.embed_scale,
            self.embed_multiplier,
        )  # (B, T, h)
        cos, sin = cast(torch.Tensor, self.rope_cos), cast(torch.Tensor, self.rope_sin)
        # the document mask (or flex's causal one): once per micro-batch, outside the compiled blocks
        args = layer_args(cos, sin, positions, self.layers, tokens.shape[1])
        for layer in self.layers:
            h = layer(h, *args)
        if self.head_in_loss and torch.is_grad_enabled():
            return self.head_input(h)  # (B, T, h): the loss applies the head chunk by chunk (fused_head_loss)
        return self.logits(h)  # (B, T, V)

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """The output projection's input: the final norm of h, divided by ``model.logit_divisor``
        (Granite's logits_scaling: W (h/s) = (W h)/s, so every head, fused loss and stage takes it)."""
        return final_norm(self.norm, h, self.cfg.logit_divisor)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head on the last block's output h (B, T, h): the final norm (:meth:`head_input`), the
        output projection, then ``model.logit_softcap``'s cap (:func:`~loom.model.softcap.softcap`) ->
        logits (B, T, V)."""
        return cap_logits(self.output(self.head_input(h)), self.cfg.logit_softcap)


def layer_args(
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None = None,
    layers: Iterable[nn.Module] = (),
    length: int = 0,
) -> tuple[torch.Tensor | Documents, ...]:
    """What every block takes after h: the RoPE tables (cos, sin), or with packed ``positions`` each
    token's rows (B, T, d/2) and the documents: their ids (B, T) (:func:`document_ids`), or, where
    every one of ``layers`` attends through a :class:`CoreAttention` able to take it
    (:func:`flex_documents`), the micro-batch's one :func:`document_block_mask`, built with the
    layers' window; layers of two windows (0 and ``model.sliding_window``, Gemma 2's alternation)
    get the pair (unwindowed, windowed), each core taking its own. Without packing, sequences of
    ``length`` T whose windowed or soft-capped layers run flex (:func:`flex_documents`' device and
    cores) get their :func:`causal_block_mask` here too, outside any compiled block (None for a
    layer SDPA serves: no window, no cap), so no compiled block breaks its graph to build it."""
    layers = list(layers)
    if positions is None:
        causal = _causal_flex_masks(layers, cos.device, length)
        return (cos, sin) if causal is None else (cos, sin, causal)
    docs = document_ids(positions)
    if flex_documents(layers, positions.device):
        masks = [
            document_block_mask(docs, FLEX_BLOCK, w) if w else document_block_mask(docs)
            for w in sorted({_core(layer).window for layer in layers})  # (0 and) w
        ]
        return cos[positions], sin[positions], masks[0] if len(masks) == 1 else (masks[0], masks[1])
    return cos[positions], sin[positions], docs


def _causal_flex_masks(layers: list[nn.Module], device: torch.device, length: int) -> Documents | None:
    """The causal block masks of unpacked sequences of ``length`` for ``layers`` whose cores run flex
    (a window or a soft-cap on a device where :func:`flex_documents` holds), by window as
    :func:`layer_args` pairs them; None when no layer needs one."""
    if not length or not flex_documents(layers, device):
        return None
    windows = sorted({_core(layer).window for layer in layers})
    capped = any(_core(layer).softcap > 0 for layer in layers)
    masks = [causal_block_mask(length, device, w) if (w or capped) else None for w in windows]
    if len(masks) == 1:
        return masks[0]
    return (masks[0], cast(BlockMask, masks[1]))


def _core(layer: nn.Module) -> CoreAttention:
    """The attention core of a block (a :class:`CoreAttention` where :func:`flex_documents` says so)."""
    return cast(CoreAttention, getattr(getattr(layer, "attention", None), "core", None))


def flex_documents(layers: Iterable[nn.Module], device: torch.device) -> bool:
    """Packed documents go through flex attention: :func:`packed_attention` says ``flex`` on ``device``
    and every layer's attention core is a :class:`CoreAttention` without active dropout (context
    parallelism's cores take document ids and merge blocks of their own)."""
    cores = [getattr(getattr(layer, "attention", None), "core", None) for layer in layers]
    return (
        bool(cores)
        and packed_attention(device) == "flex"
        and all(isinstance(c, CoreAttention) and not (c.training and c.dropout > 0) for c in cores)
    )


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_value(cfg: ModelConfig, seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The initial fp32 value (on the CPU) of the whole parameter ``name`` of the reference model.

    Each parameter draws from its own generator keyed by ``seed`` and its name, so the values do not
    depend on how the model is later sharded or placed. Linear/embedding ~ N(0, std); output
    projections (wo, w2) ~ N(0, std / sqrt(2L)); norms = 1 (0 with ``model.norm_offset``: a scale of
    1 + w); biases = 0. The padded rows of the
    embedding and head (rows >= V of V' = ``model.pad_vocab_to``) are zeros; the real rows are those of
    the unpadded model (the same draws, in order).
    """
    if name in ("tok_embeddings.weight", "output.weight") and shape[0] > cfg.vocab_size:
        return torch.cat(
            (
                init_value(cfg, seed, name, (cfg.vocab_size, *shape[1:])),
                torch.zeros(shape[0] - cfg.vocab_size, *shape[1:]),
            )
        )
    if name.endswith("norm.weight"):
        return torch.zeros(shape) if cfg.norm_offset and cfg.norm == "rmsnorm" else torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    g = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
    std = (
        cfg.init_std / math.sqrt(2 * cfg.n_layers)
        if name.endswith(("wo.weight", "w2.weight"))
        else cfg.init_std
    )
    return torch.randn(shape, generator=g, dtype=torch.float32).mul_(std)


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Deterministic, layout-independent init from ``seed`` (:func:`init_value` for every parameter)."""
    for name, p in model.named_parameters():
        p.copy_(init_value(model.cfg, seed, name, tuple(p.shape)).to(p.device, p.dtype))


def build_model(
    cfg: ModelConfig,
    seed: int,
    device: torch.device | str = "cpu",
    meta: bool = False,
    moe: MoEConfig | None = None,
) -> Transformer:
    """Construct and deterministically initialise the reference model on ``device``; with ``meta``,
    parameters stay on the meta device (no memory; :func:`init_value` gives each its value later,
    per rank, once the parallel dimensions have cut it) and buffers are built on ``device``. ``moe``:
    the [moe] options of MoE layers (shared experts, selection bias, routing; defaults when None)."""
    if not meta:
        model = Transformer(cfg, moe).to(device)
        init_weights(model, seed)
        return model
    with torch.device("meta"):
        model = Transformer(cfg, moe)
    model.rope_cos, model.rope_sin = model.rope_buffers(device)
    real_buffers(model, device)
    if model.pos_ids is not None:
        model.pos_ids = torch.arange(cfg.max_seq_len, device=device)
    return model


def count_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Unique parameters (tied weights counted once); optionally without the input embeddings (the
    token table, and the learned position table: lookups, not matmuls)."""
    seen: set[int] = set()
    n = 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if exclude_embedding and name.startswith(("tok_embeddings", "pos_embeddings")):
            continue
        n += p.numel()
    return n


def expert_params(model: nn.Module) -> int:
    """Routed experts' weights (every :class:`ExpertWeights`, all E experts): what
    :func:`flops_per_token` counts at k/E (shared experts and the router are not among them)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, ExpertWeights))


def flops_per_token(
    cfg: ModelConfig,
    seq_len: int,
    n_params: float,
    experts: float = 0.0,
    n_experts: int | None = None,
    top_k: int | None = None,
) -> float:
    """Training FLOPs per token: 6 N_a (matmuls fwd+bwd) + 12 L a d T ρ (attention scores and values,
    over a query heads of width d: a·d = h unless ``attn_head_dim`` sets d apart, Mistral-Nemo's shape;
    ρ = :meth:`~loom.config.ModelConfig.attention_share`, below 1 where sliding windows hide keys).

    N_a = the matmul weights a token runs through = ``n_params`` − ``experts`` · (1 − k/E): of the
    routed experts' weights (``experts``, all E of them, counted in ``n_params``) only the top_k run,
    while attention, shared experts, router and head all do. ``n_experts`` / ``top_k`` default to
    ``cfg``'s (the planner may explore others); a dense model (E = 1) has N_a = ``n_params``."""
    e = cfg.n_experts if n_experts is None else n_experts
    k = cfg.top_k if top_k is None else top_k
    active = n_params - experts * (1.0 - k / e) if e > 1 else n_params
    attention = 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len * cfg.attention_share(seq_len)
    return 6.0 * active + attention


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the trained targets of (B, T) (-100 ignored): the sum over
    them / max(1, their count), so a micro-batch with none trained (chat data) gives 0, not NaN.

    Equal to ``F.cross_entropy(logits.float(), ...)``, computed over chunks of rows
    (:func:`~loom.model.loss.chunked_cross_entropy`): besides the logits (B, T, V) and their
    gradient, in the logits' dtype, it holds one chunk in fp32, never B·T·V."""
    total = chunked_cross_entropy(logits, targets)  # (B, T, V), (B, T) -> () fp32 sum
    return total / (targets != IGNORE_INDEX).sum().clamp(min=1)


def fused_head_loss(
    model: nn.Module, rows: int, chunk_rows: int = CHUNK_ROWS
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """Move the head of ``model`` into its training loss where that saves memory: a
    :class:`Transformer` whose ``output`` is a plain ``nn.Linear`` (tied or not), and micro-batches of
    more than ``chunk_rows`` ``rows`` (B·T tokens; with fewer, one chunk already holds every logit).
    Otherwise None and the model unchanged (a tensor-parallel or low-precision head, short batches).

    With grad enabled the model then returns the normed hidden states (B, T, h) and the loss is
    :func:`~loom.model.loss.linear_cross_entropy` of them and the head's weight W (V, h), divided as
    :func:`loss_fn`: the B·T·V logits never exist, one chunk of ``chunk_rows`` rows of them at most
    (c·V·4 bytes, against B·T·V·e for the logits and B·T·V·e for their gradient). Under no_grad
    (evaluation, inference) the model returns logits and the loss is :func:`loss_fn`, as before."""
    if (
        not isinstance(model, Transformer)
        or type(model.output) not in (nn.Linear, VocabHead)
        or rows <= chunk_rows
    ):
        return None
    model.head_in_loss = True
    head = model.output  # its weight is read at every call: casts and ZeRO-3 keep the module
    vocab = model.cfg.vocab_size  # a padded head's real rows (VocabHead): the padded ones in no logit
    cap = model.cfg.logit_softcap  # > 0: each chunk's logits capped (loom.model.softcap), as the model's

    def head_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(B, T, h) normed hidden states with grad enabled, else (B, T, V) logits -> mean loss."""
        if not torch.is_grad_enabled():
            return loss_fn(out, targets)
        total = linear_cross_entropy(out, head.weight[:vocab], targets, chunk_rows, cap=cap)  # () fp32 sum
        return total / (targets != IGNORE_INDEX).sum().clamp(min=1)

    return head_loss


def keep_eager_under_compile() -> None:
    """What runs eagerly under ``torch.compile``, wrapped in ``torch.compiler.disable`` once, when
    :mod:`loom.train.compile` begins (not at import: it imports ``torch._dynamo``, about 1 s in every
    process that never compiles): :func:`document_block_mask`, built once per micro-batch outside
    any compiled region and passed to every layer, :func:`causal_block_mask` (built once per length),
    and MoE's balance losses."""
    global document_block_mask, causal_block_mask
    if not hasattr(document_block_mask, "_torchdynamo_disable"):
        document_block_mask = torch.compiler.disable(document_block_mask)
    if not hasattr(causal_block_mask, "_torchdynamo_disable"):
        causal_block_mask = torch.compiler.disable(causal_block_mask)
    moe.keep_eager_under_compile()
