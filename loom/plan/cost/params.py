"""Parameter counts of the Llama-style model, MoE and GPT-2 variants included (:mod:`loom.plan.cost`)."""

from __future__ import annotations

from dataclasses import dataclass

from loom.config import ModelConfig


def qk_norm_params(m: ModelConfig) -> int:
    """q/k norm weights per layer: 2·d per head (``qk_norm_scope = head``, shared by the heads), or
    (a + k)·d over the whole projections (``all``, OLMo-2); 0 without q/k norms."""
    if not m.qk_norm:
        return 0
    return (m.n_heads + m.n_kv_heads) * m.head_dim if m.qk_norm_scope == "all" else 2 * m.head_dim


def qk_norm_held(m: ModelConfig, tp: int) -> float:
    """q/k norm weights one tp rank holds per layer: per-head norms (2·d) whole on every rank; norms
    over the whole projections (``all``) cut with the heads, a·d/t + k·d/t, the k norm whole (k·d)
    when t does not divide the k heads (they are replicated)."""
    if not (m.qk_norm and m.qk_norm_scope == "all"):
        return float(qk_norm_params(m))
    k, d = m.n_kv_heads, m.head_dim
    return m.n_heads * d / tp + (k * d / tp if k % tp == 0 else k * d)


def qk_norm_partial(m: ModelConfig, tp: int) -> float:
    """q/k norm weights per layer whose gradient is summed over tp (held whole on every rank)."""
    if not m.qk_norm or tp <= 1:
        return 0.0
    if m.qk_norm_scope == "all":
        return float(m.n_kv_heads * m.head_dim) if m.n_kv_heads % tp else 0.0
    return float(qk_norm_params(m))


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of the Llama-style model (see module doc); MoE when n_experts > 1."""

    attn: int  # attention matmul weights per layer
    mlp: int  # MLP weights per layer (all experts)
    mlp_active: int  # MLP weights one token goes through
    router: int  # router weights per layer (MoE)
    norms: int  # norm weights per layer
    embed: int  # input embedding
    head: int  # output head (0 when tied)
    final_norm: int
    n_layers: int
    positions: int = 0  # learned position table (replicated over tp, on the first stage)
    mlp_whole: int = 0  # of ``mlp``: the row-parallel bias, whole on every tp rank
    attn_whole: int = 0  # of ``attn``: the row-parallel wo bias, whole on every tp rank
    # MoE shared experts per layer (moe.n_shared_experts = S: one SwiGLU 3·h·S·f every token runs;
    # replicated over tp and ep, as the router)
    shared: int = 0

    @classmethod
    def of(cls, m: ModelConfig, n_experts: int = 1, top_k: int = 1, shared_experts: int = 0) -> ParamCounts:
        h, f, kd, qd = m.dim, m.resolved_ffn_dim(), m.n_kv_heads * m.head_dim, m.n_heads * m.head_dim
        moe = n_experts > 1
        shared = 3 * h * shared_experts * f if moe else 0
        mats = 3 if m.gated_mlp else 2  # SwiGLU's w1, w3, w2, or GELU's w1, w2
        mlp_bias = (f + h) if m.bias and not moe else 0  # experts have no biases
        norm = 2 if m.norm == "layernorm" else 1  # LayerNorm: weight and bias
        return cls(
            attn=2 * h * qd
            + 2 * h * kd
            + ((qd + 2 * kd) if m.qkv_bias or m.bias else 0)
            + (h if m.bias else 0),
            mlp=mats * h * f * (n_experts if moe else 1) + mlp_bias,
            mlp_active=mats * h * f * (top_k if moe else 1) + mlp_bias + shared,
            router=h * n_experts if moe else 0,
            norms=(4 if m.norm_placement == "sandwich" else 2) * h * norm
            + qk_norm_params(m),  # Gemma 2: four
            embed=m.padded_vocab * h,  # model.pad_vocab_to rows when padded
            head=0 if m.tie_embeddings else m.padded_vocab * h,
            final_norm=h * norm,
            n_layers=m.n_layers,
            positions=m.max_seq_len * h if m.positions == "learned" else 0,
            mlp_whole=h if mlp_bias else 0,
            attn_whole=h if m.bias else 0,
            shared=shared,
        )

    def mlp_on(self, tp: int, ep: int = 1) -> float:
        """MLP parameters one rank holds: split over tp (experts over ep too) but the whole w2 bias."""
        return (self.mlp - self.mlp_whole) / (tp * ep) + self.mlp_whole

    @property
    def total(self) -> int:
        per_layer = self.attn + self.mlp + self.router + self.shared + self.norms
        return self.n_layers * per_layer + self.embed + self.head + self.final_norm + self.positions

    @property
    def matmul(self) -> int:
        """Matmul weights, every expert counted (shared ones too): layers' matmuls + the head (tied or not). The
        ones a token runs through are ``llama.flops_per_token``'s rule (top_k of the experts)."""
        return self.n_layers * (self.attn + self.mlp + self.router + self.shared) + self.embed

    @property
    def experts(self) -> int:
        """Routed experts' weights, all E of them, over the layers (0 for a dense model)."""
        return self.n_layers * self.mlp if self.router else 0  # experts have no biases


def param_count(model: ModelConfig, n_experts: int = 1) -> int:
    """Unique parameters (tied embeddings counted once), as ``llama.count_params`` counts them."""
    return ParamCounts.of(model, n_experts).total
