"""Incremental decoding with a key/value cache for the plain :class:`~loom.model.llama.Transformer`.

The training forward is not touched: :func:`forward_cached` calls the model's own submodules
(embeddings, norms, q/k/v/o projections, q/k norms, MLP or MoE, head) in the order of
``Attention.forward`` and ``Block.forward`` and differs only in where keys and values come from.
A step of T new tokens at cache offset s computes, per layer,

    q, k, v = wq x, wk x, wv x              (B, T, heads, d), RoPE at positions s - pad .. s+T-1 - pad
    K[:, :, s:s+T], V[:, :, s:s+T] = k, v   the cache: (B, k_heads, S, d) per layer, S slots
    y = softmax(q K[:s+T]ᵀ / sqrt(d) + mask) V[:s+T]

so decoding n tokens after a prompt of P costs O(n (P + n)) attention work instead of the
O(n (P + n)²) of recomputing the whole context per token. Cache bytes = 2 · L · B · k_heads · S · d
· element size, allocated once by :func:`new_cache`: a step writes its T new positions into the
buffers in place (slice assignment) and attends over the filled prefix, a view, so it copies
O(B · k_heads · T · d) per layer, never the cache. The query heads read their key/value head
through SDPA's ``enable_gqa`` (no repeat of the cache to a heads), and whether any row is padded
is decided once when the cache is made, so a decode step waits on the host for nothing.

Batches of prompts of different lengths are left-padded: row b starts with ``pad[b]`` filler
tokens that no query attends to, and its real tokens take positions 0, 1, ... as if alone (RoPE
angles and learned position rows), so each row computes what it would compute alone. Without
padding a prompt's prefill is the training forward's causal attention (``is_causal``) and a
one-token step attends to every cached key with no mask. A windowed layer (``model.sliding_window``
w, ``model.window_layers``) hides the keys w or more positions back: the query at position p sees the
cached keys in (p - w, p], prefill included (one mask per window, made once per step). Such a layer keeps
only min(S, w) slots, a ring: slot j of the sequence lives at ring index j mod w, and a query never
needs a key w or more slots back, so the cache holds 2 · B · k_heads · d · element size ·
Σ_layers min(S, w_layer) bytes (Gemma 3's five local layers of six at w = 1024: a sixth of the
whole cache at long contexts, plus 5/6 · 1024 slots). A one-token step writes its key first (over
the one w slots back) and attends over the ring; a longer step attends over the ring's filled slots
followed by its own keys, then keeps its last w in the ring. Keys are cached after RoPE, so their
order in the ring does not matter: the mask is made from each ring index's slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from loom.model.llama import Attention, Block, Transformer, apply_rope, attention, embed, window_mask


@dataclass
class KVCache:
    """Keys and values of every layer, (B, k_heads, S, d) each, or (B, k_heads, w, d) for a layer
    windowed by w < S (a ring, module doc); ``capacity`` S slots, ``length`` of them filled; ``pad``
    (B,) the left padding of each row (its first real token's slot); ``padded``: whether any pad > 0."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    pad: torch.Tensor
    capacity: int = 0
    length: int = 0
    padded: bool = False

    @property
    def nbytes(self) -> int:
        """2 · B · k_heads · d · element size · Σ_layers min(S, w_layer)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def ring(self, layer: int) -> bool:
        """Whether ``layer`` keeps a ring of fewer slots than the capacity (a windowed layer)."""
        return self.keys[layer].shape[2] < self.capacity


def new_cache(model: Transformer, batch: int, slots: int, pad: torch.Tensor | None = None) -> KVCache:
    """An empty cache of ``slots`` positions for ``batch`` rows of ``model`` (its dtype and device): a
    layer windowed by w < ``slots`` gets w of them, a ring (module doc)."""
    ref = model.tok_embeddings.weight
    keys, values = [], []
    for block in model.layers:
        attn = cast(Attention, block.attention)
        w = attn.core.window
        shape = (batch, attn.n_kv_heads, min(slots, w) if w > 0 else slots, attn.head_dim)
        keys.append(torch.zeros(shape, dtype=ref.dtype, device=ref.device))
        values.append(torch.zeros(shape, dtype=ref.dtype, device=ref.device))
    if pad is None:
        return KVCache(keys, values, torch.zeros(batch, dtype=torch.long, device=ref.device), slots)
    padded = bool((pad > 0).any())  # the cache's one host read, here rather than in every step
    return KVCache(keys, values, pad.to(ref.device), slots, padded=padded)


def _mask(cache: KVCache, T: int, window: int = 0) -> torch.Tensor | None:
    """Boolean (B, 1, T, s+T) mask, True where query i (slot s + i) sees key j: pad[b] <= j <= s + i,
    with a ``window`` w > 0 also s + i - w < j (a row's real tokens fill consecutive slots, so slots
    are as far apart as positions: :func:`~loom.model.llama.window_mask`), and a filler query sees
    itself (so its row is finite; no real query sees it); None when no row is padded and no query
    needs hiding (one new token, or a prefill, which uses the causal flag, within the window)."""
    s = cache.length
    if not cache.padded and (T == 1 or s == 0) and (window <= 0 or s + T <= window):
        return None
    j = torch.arange(s + T, device=cache.pad.device)
    i = torch.arange(T, device=cache.pad.device)[:, None] + s
    real = (j[None, None, :] >= cache.pad[:, None, None]) | (j[None, :] == i)[None]  # (B, T, s+T)
    near = window_mask(T, s + T, window, cache.pad.device, offset=s) if window > 0 else j[None, :] <= i
    return (near[None] & real)[:, None]


def _ring_slots(length: int, size: int, device) -> torch.Tensor:
    """(size,) the slot each ring index holds after ``length`` slots were written (index i: the last
    slot ≡ i mod size), −1 where none yet."""
    i = torch.arange(size, device=device)
    return torch.where(i < length, i + (length - 1 - i).div(size, rounding_mode="floor") * size, -1)


def _ring_mask(cache: KVCache, T: int, window: int, size: int) -> torch.Tensor | None:
    """Boolean (B, 1, T, K) mask of a ring layer's step of T tokens over its K keys: the ring after
    the step's write (T = 1, K = size) or before it followed by the step's own keys (K = size + T):
    query slot q sees a key of slot j iff q − w < j <= q and j >= pad[b] (a filler query: itself);
    None when every key is seen (one token, no padding, the ring full)."""
    s, dev = cache.length, cache.pad.device
    if T == 1 and not cache.padded and s + 1 >= size:
        return None
    ring = _ring_slots(s + 1 if T == 1 else s, size, dev)
    keys = ring if T == 1 else torch.cat([ring, torch.arange(s, s + T, device=dev)])  # (K,)
    q = torch.arange(s, s + T, device=dev)[:, None]  # (T, 1)
    near = (keys >= 0) & (keys > q - window) & (keys <= q)  # (T, K)
    real = (keys[None, None, :] >= cache.pad[:, None, None]) | (keys == q)[None]  # (B, T, K)
    return (near[None] & real)[:, None]


def _attend(
    attn: Attention,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: KVCache,
    layer: int,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """``Attention.forward`` for T new tokens x (B, T, h) against the cache's keys and values."""
    B, T, _ = x.shape
    q, k = attn.wq(x), attn.wk(x)  # (B, T, a*d), (B, T, k*d)
    if attn.q_norm is not None and attn.qk_norm_all:  # over all heads at once (OLMo-2)
        q, k = attn.q_norm(q), attn.k_norm(k)  # type: ignore[misc]  # k_norm is set whenever q_norm is
    q = q.view(B, T, -1, attn.head_dim)  # (B, T, a, d)
    k = k.view(B, T, -1, attn.head_dim)  # (B, T, k, d)
    v = attn.wv(x).view(B, T, -1, attn.head_dim)  # (B, T, k, d)
    if attn.q_norm is not None and not attn.qk_norm_all:  # per head, over d
        q, k = attn.q_norm(q), attn.k_norm(k)  # type: ignore[misc]
    if attn.rope:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, d)
    s, K, V = cache.length, cache.keys[layer], cache.values[layer]
    if not cache.ring(layer):
        K[:, :, s : s + T], V[:, :, s : s + T] = k, v
        k, v = K[:, :, : s + T], V[:, :, : s + T]  # (B, k, s+T, d) views
    elif T == 1:  # over the slot one window back, then the ring whole
        K[:, :, s % K.shape[2]], V[:, :, s % K.shape[2]] = k[:, :, 0], v[:, :, 0]
        k, v = K, V
    else:  # the ring's filled slots and the step's own keys; its last w kept
        k, v = torch.cat([K, k], 2), torch.cat([V, v], 2)
        kept = torch.arange(max(s, s + T - K.shape[2]), s + T, device=k.device)
        K[:, :, kept % K.shape[2]], V[:, :, kept % K.shape[2]] = (
            k[:, :, K.shape[2] + kept - s],
            v[:, :, K.shape[2] + kept - s],
        )
    causal = mask is None and T > 1  # a prefill of unpadded rows: the training forward's attention
    core = attn.core  # its scale and soft-cap (model.attn_scale, model.attn_softcap)
    y = attention(q, k, v, mask, causal=causal, scale=core.scale, softcap=core.softcap)  # (B, a, T, d)
    return attn.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, h)


@torch.no_grad()
def forward_cached(model: Transformer, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (B, T, V) of ``tokens`` (B, T) following the ``cache.length`` tokens already cached;
    their keys and values are appended to the cache."""
    B, T = tokens.shape
    if cache.length + T > cache.capacity:
        raise ValueError(f"KV cache of {cache.capacity} slots cannot take {T} more after {cache.length}")
    pos = (
        torch.arange(cache.length, cache.length + T, device=tokens.device)[None] - cache.pad[:, None]
    ).clamp(min=0)
    h = embed(
        model.tok_embeddings,
        model.pos_embeddings,
        None,
        tokens,
        pos,
        model.embed_scale,
        model.embed_multiplier,
    )  # (B, T, h)
    cos, sin = cast(torch.Tensor, model.rope_cos)[pos], cast(torch.Tensor, model.rope_sin)[pos]  # (B, T, d/2)
    attns = [cast(Attention, cast(Block, layer).attention) for layer in model.layers]
    kinds = {(a.core.window, cache.keys[i].shape[2], cache.ring(i)) for i, a in enumerate(attns)}
    masks = {  # one per window and layout (whole or ring), made once per step
        (w, n, ring): _ring_mask(cache, T, w, n) if ring else _mask(cache, T, w) for w, n, ring in kinds
    }
    for i, (layer, attn) in enumerate(zip(model.layers, attns, strict=True)):
        mask = masks[(attn.core.window, cache.keys[i].shape[2], cache.ring(i))]
        h = layer(h, cos, sin, attend=lambda x, c, s: _attend(attn, x, c, s, cache, i, mask))  # noqa: B023 (called here)
    cache.length += T
    return model.logits(h)  # (B, T, V): norm, head and the logit cap, as the full forward
