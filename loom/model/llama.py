"""A plain single-device Llama-style decoder: the reference every parallel layout is compared to.

RMSNorm, rotary position embeddings, grouped-query attention through
``F.scaled_dot_product_attention`` (optional q/k/v biases and per-head q/k RMSNorm), SwiGLU MLP or a top-k routed mixture of SwiGLU experts
(``model.n_experts > 1``), optional tied embeddings. No parallel code
lives here: strategies are applied from outside (module swap, hooks, wrapping).

Shapes: B batch, T sequence, h = dim, a = n_heads, k = n_kv_heads, d = head_dim = h / a,
V vocabulary, f = ffn_dim.
"""

from __future__ import annotations

import contextlib
import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from loom.config import ModelConfig


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w, computed in fp32."""

    activation_kind = "norm"  # what its saved tensors count as for train.compress

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                scaling: tuple[float, float, float, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """cos, sin of shape (max_seq_len, head_dim/2): angle(t, i) = t * ω_i, ω_i = theta^(-2i/d).

    ``scaling`` = (factor s, low α, high β, original length L) is Llama 3.1's long-context rule on
    the wavelength λ_i = 2π/ω_i: kept if λ < L/β, divided by s if λ > L/α, and in between
    ω ← (1-γ) ω/s + γ ω with γ = (L/λ - α) / (β - α).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None:
        s, low, high, length = scaling
        wavelen = 2 * math.pi / inv_freq
        gamma = ((length / wavelen - low) / (high - low)).clamp(0.0, 1.0)  # 0 above L/α, 1 below L/β
        inv_freq = (1 - gamma) * inv_freq / s + gamma * inv_freq
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x: (B, T, heads, d) by the angles of positions 0..T-1."""
    T = x.shape[1]
    cos, sin = cos[:T, None, :], sin[:T, None, :]  # (T, 1, d/2)
    xf = x.float().unflatten(-1, (-1, 2))  # (B, T, heads, d/2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class CoreAttention(nn.Module):
    """The attention core: softmax(q kᵀ / sqrt(d) + causal mask) v, with attention dropout p while
    training. GQA key/value heads are repeated here, so the core's inputs are the unrepeated heads.

    (B, a, T, d), (B, k, T, d), (B, k, T, d) -> (B, a, T, d). No parameters: recomputation
    policies wrap this module alone (``train.recompute = selective``).
    """

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)  # (B, a, T, d)
            v = v.repeat_interleave(rep, dim=1)
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)  # (B, a, T, d)


class Attention(nn.Module):
    """Causal grouped-query self-attention: a query heads share k key/value heads (a % k == 0)."""

    activation_kind = "attention"  # what its saved tensors count as for train.compress

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.core = CoreAttention(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # Head counts come from the weights so a tensor-parallel shard (fewer heads) runs unchanged.
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, a, d)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, k, d)
        v = self.wv(x).view(B, T, -1, self.head_dim)  # (B, T, k, d)
        if self.q_norm is not None:  # per head, over d
            q, k = self.q_norm(q), self.k_norm(k)  # type: ignore[misc]  # k_norm is set whenever q_norm is
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, d)
        y = self.core(q, k, v)  # (B, a, T, d)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, a*d)
        return self.wo(y)  # (B, T, h)


class FeedForward(nn.Module):
    """SwiGLU: w2( silu(w1 x) * w3 x ), hidden size f."""

    activation_kind = "mlp"  # what its saved tensors count as for train.compress

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, h)


class ExpertWeights(nn.Module):
    """One weight matrix per expert, stacked: ``weight`` of shape (E, out, in)."""

    def __init__(self, n_experts: int, out_features: int, in_features: int, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:  # fmt: skip
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, out_features, in_features, device=device, dtype=dtype))


def route(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of tokens x (N, h) over E experts: probabilities p = softmax(x W_rᵀ) in fp32;
    each token keeps its k most probable experts, weighted by p_e / Σ_topk p. Returns the
    weights (N, k) in x's dtype and the expert ids (N, k)."""
    probs = F.softmax(F.linear(x, router).float(), dim=-1)  # (N, E)
    weights, experts = probs.topk(top_k, dim=-1)  # (N, k)
    return (weights / weights.sum(-1, keepdim=True)).to(x.dtype), experts


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """w2( silu(w1 x) * w3 x ) for one expert's (f, h), (f, h), (h, f) weights; x: (n, h) -> (n, h)."""
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def experts_forward(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor,
                    w3: torch.Tensor, w2: torch.Tensor, first: int = 0) -> torch.Tensor:  # fmt: skip
    """Σ over each token's routed experts of weight · SwiGLU_e(x), for the experts ``first ..
    first + len(w1) - 1`` held in the stacked (E', f, h), (E', f, h), (E', h, f) weights; tokens
    routed elsewhere get nothing from here. x: (N, h) -> (N, h)."""
    out = torch.zeros_like(x)
    for j in range(w1.shape[0]):
        token, slot = (experts == first + j).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        y = swiglu(x.index_select(0, token), w1[j], w3[j], w2[j])
        out = out.index_add(0, token, y * weights[token, slot, None])
    return out


class MoEFeedForward(nn.Module):
    """Mixture of SwiGLU experts (Mixtral-style top-k routing, dropless: every routed token is
    computed): y = Σ_{e in topk(x)} (p_e / Σ_topk p) · w2_e( silu(w1_e x) * w3_e x )."""

    activation_kind = "mlp"  # what its saved tensors (router and experts) count as for train.compress

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w1 = ExpertWeights(n_experts, hidden, dim)
        self.w3 = ExpertWeights(n_experts, hidden, dim)
        self.w2 = ExpertWeights(n_experts, dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N = B·T, h)
        weights, experts = route(flat, self.router.weight, self.top_k)
        return experts_forward(flat, weights, experts, self.w1.weight, self.w3.weight, self.w2.weight).view_as(x)


class Block(nn.Module):
    """Pre-norm transformer block: x + drop(attn(norm(x))), then + drop(mlp(norm(x))).

    Dropout (``cfg.dropout``, training only) on both residual branches and inside the attention
    core; with p = 0 (the default) no dropout op runs at all.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward: nn.Module  # replaced by tensor/expert-parallel modules from outside
        if cfg.moe:
            self.feed_forward = MoEFeedForward(cfg.dim, cfg.resolved_ffn_dim(), cfg.n_experts, cfg.top_k)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.resolved_ffn_dim())
        self.dropout = cfg.dropout

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, training=True) if self.dropout > 0 and self.training else x

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self._drop(self.attention(self.attention_norm(x), cos, sin))
        return x + self._drop(self.feed_forward(self.ffn_norm(x)))


class Transformer(nn.Module):
    """Token ids (B, T) -> logits (B, T, V)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be resolved (> 0) before building the model")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = self.rope_buffers()
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def rope_buffers(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary (cos, sin) tables of every position up to ``max_seq_len``."""
        cfg = self.cfg
        scaling = (cfg.rope_scaling, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_len)
        with torch.device(device) if device is not None else contextlib.nullcontext():
            return rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, scaling if cfg.rope_scaling else None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # (B, T, h)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))  # (B, T, V)


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_value(cfg: ModelConfig, seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The initial fp32 value (on the CPU) of the whole parameter ``name`` of the reference model.

    Each parameter draws from its own generator keyed by ``seed`` and its name, so the values do not
    depend on how the model is later sharded or placed. Linear/embedding ~ N(0, std); output
    projections (wo, w2) ~ N(0, std / sqrt(2L)); norms = 1; biases = 0.
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    g = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
    std = cfg.init_std / math.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else cfg.init_std
    return torch.randn(shape, generator=g, dtype=torch.float32).mul_(std)


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Deterministic, layout-independent init from ``seed`` (:func:`init_value` for every parameter)."""
    for name, p in model.named_parameters():
        p.copy_(init_value(model.cfg, seed, name, tuple(p.shape)).to(p.device, p.dtype))


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu", meta: bool = False) -> Transformer:
    """Construct and deterministically initialise the reference model on ``device``; with ``meta``,
    parameters stay on the meta device (no memory; :func:`init_value` gives each its value later,
    per rank, once the parallel dimensions have cut it) and buffers are built on ``device``."""
    if not meta:
        model = Transformer(cfg).to(device)
        init_weights(model, seed)
        return model
    with torch.device("meta"):
        model = Transformer(cfg)
    model.rope_cos, model.rope_sin = model.rope_buffers(device)
    return model


def count_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Unique parameters (tied weights counted once); optionally without the input embedding."""
    seen: set[int] = set()
    n = 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if exclude_embedding and name.startswith("tok_embeddings"):
            continue
        n += p.numel()
    return n


def flops_per_token(cfg: ModelConfig, seq_len: int, n_params: int) -> float:
    """Training FLOPs per token: 6 N (matmuls fwd+bwd) + 12 L h T (attention scores and values)."""
    return 6.0 * n_params + 12.0 * cfg.n_layers * cfg.dim * seq_len


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over (B, T); targets < 0 are ignored."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), ignore_index=-100)
