"""RoPE's frequencies and tables: ω_i = θ^(-2i/r) for the pairs i < r/2 of the r = ``model.rope_dims``
rotated dims of a head, the long-context rule ``model.rope_kind`` applies with the factor s =
``model.rope_scaling`` > 0, and the (cos, sin) tables every position reads. The rules, on the
wavelength λ_i = 2π/ω_i, pretraining length L = ``rope_original_len``:

- ``llama3`` (Llama 3.1): ω kept if λ < L/β, ω/s if λ > L/α, between them (1-γ) ω/s + γ ω with
  γ = (L/λ - α) / (β - α), α, β = ``rope_low_freq_factor``, ``rope_high_freq_factor``;
- ``linear`` (position interpolation): every ω/s;
- ``yarn`` (NTK-by-parts, arXiv 2309.00071): dim i turns L/λ_i times over L; the dims turning more
  than ``rope_beta_fast`` times keep ω, those turning fewer than ``rope_beta_slow`` times take ω/s,
  a linear ramp in i between (its ends rounded outward with ``rope_truncate``); tables × m,
  m = ``rope_attn_factor`` or 0.1 ln s + 1;
- ``longrope`` (Phi-3): ω_i / f_i with f = ``rope_long_factor`` when the tables reach beyond L
  (``max_seq_len`` > L), else ``rope_short_factor``; tables × m, m = ``rope_attn_factor`` or
  sqrt(1 + ln s / ln L) (1 when s <= 1).

The d/2 - r/2 pairs past the rotated dims get angle 0 and no factor (cos 1, sin 0): they pass
unrotated, so every consumer of the tables (packed data, cp, the KV cache) stays one rotation of
d/2 pairs. The same numbers as transformers' ``ROPE_INIT_FUNCTIONS`` (computed in float64 here).
"""

from __future__ import annotations

import math

import torch

from loom.config import ModelConfig


def frequencies(cfg: ModelConfig, theta: float, scaled: bool = True) -> tuple[torch.Tensor, float]:
    """(ω of the r/2 rotated pairs in float64, the tables' factor m) for base ``theta``; ``scaled``:
    apply the long-context rule (Gemma 3's local layers do not)."""
    r = cfg.rope_dims
    inv_freq = 1.0 / (theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    s = cfg.rope_scaling
    if not (scaled and s):
        return inv_freq, 1.0
    length = cfg.rope_original_len
    if cfg.rope_kind == "linear":
        return inv_freq / s, 1.0
    if cfg.rope_kind == "llama3":
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        gamma = ((length / wavelen - low) / (high - low)).clamp(0.0, 1.0)  # 0 above L/α, 1 below L/β
        return (1 - gamma) * inv_freq / s + gamma * inv_freq, 1.0
    if cfg.rope_kind == "yarn":
        return inv_freq * (1 - _yarn_ramp(cfg, theta) * (1 - 1 / s)), cfg.rope_attn_factor or _mscale(s)
    factors = cfg.rope_long_factor if cfg.rope_long else cfg.rope_short_factor
    m = cfg.rope_attn_factor or (math.sqrt(1 + math.log(s) / math.log(length)) if s > 1 else 1.0)
    return inv_freq / torch.tensor(factors, dtype=torch.float64), m


def _mscale(s: float) -> float:
    """YaRN's attention factor for s: 0.1 ln s + 1 (1 when s <= 1)."""
    return 0.1 * math.log(s) + 1.0 if s > 1 else 1.0


def _yarn_ramp(cfg: ModelConfig, theta: float) -> torch.Tensor:
    """Per pair i < r/2, how far it is interpolated (0: ω kept, 1: ω/s): the dim turning b times over
    L is r·ln(L / 2πb) / (2 ln θ); the ramp runs linearly from beta_fast's dim to beta_slow's."""
    r, length = cfg.rope_dims, cfg.rope_original_len

    def dim_turning(b: float) -> float:
        return r * math.log(length / (b * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(cfg.rope_beta_fast), dim_turning(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r - 1)
    if low == high:
        high += 0.001  # a step, not a division by zero
    return ((torch.arange(r // 2, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)


def rope_tables(
    cfg: ModelConfig, theta: float | None = None, scaled: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (max_seq_len, head_dim/2) in float32: angle(t, i) = t·ω_i, times the rule's
    factor m on the r/2 rotated pairs; the pairs past them cos 1, sin 0. ``theta``: the base (default
    ``rope_theta``)."""
    inv_freq, m = frequencies(cfg, cfg.rope_theta if theta is None else theta, scaled)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq)
    cos, sin = angles.cos() * m, angles.sin() * m
    passed = cfg.head_dim // 2 - inv_freq.numel()
    if passed:
        cos = torch.cat((cos, cos.new_ones(cfg.max_seq_len, passed)), -1)
        sin = torch.cat((sin, sin.new_zeros(cfg.max_seq_len, passed)), -1)
    return cos.float(), sin.float()
