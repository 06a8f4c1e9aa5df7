"""Rotary position embeddings (RoFormer), HF NeoX/Llama "rotate_half" convention.

The first rotary_dim dims of each head are split into two halves (x1, x2) rotated as pairs
(x1_i, x2_i) by angle pos * inv_freq_i, inv_freq_i = base^(-2i/rotary_dim); the remaining dims pass
through (partial rotary). ``cfg.rope_scaling`` rescales the frequencies for a longer context, by the
formulas of transformers' ``modeling_rope_utils`` (same float32 operations in the same order, so an
imported model's cos/sin match HF's bit for bit):

- linear (Chen et al. 2023, position interpolation): every frequency divided by ``factor``;
- llama3 (Llama 3.1): wavelengths above original_max_position_embeddings / low_freq_factor divided by
  ``factor``, those below original / high_freq_factor kept, a linear blend between;
- yarn (Peng et al. 2023): interpolation below / extrapolation above a ramp over the dims whose
  rotations in the original context fall between beta_slow and beta_fast, and cos/sin multiplied by an
  attention factor (0.1 ln(factor) + 1 unless given), which scales the attention logits by its square.
"""
from __future__ import annotations

import math

import torch

from mtds.model.config import ModelConfig


def _plain_inv_freq(base: float, dim: int, device) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_context = p["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(cfg: ModelConfig, base: float, dim: int, device) -> tuple[torch.Tensor, float]:
    p = cfg.rope_params
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or cfg.max_position_embeddings / original   # DeepSeek-V3 style: the ratio
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:   # the dim that turns ``rotations`` times in ``original``
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp                                  # 1: the dim keeps its frequency (extrapolates)
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def inv_freq_and_scale(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2], factor on cos/sin) for cfg's RoPE scheme."""
    dim, base = cfg.rotary_dim, cfg.rotary_base
    if cfg.rope_scaling == "yarn":
        return _yarn(cfg, base, dim, device)
    inv_freq = _plain_inv_freq(base, dim, device)
    if cfg.rope_scaling == "linear":
        inv_freq = inv_freq / cfg.rope_params["factor"]
    elif cfg.rope_scaling == "llama3":
        inv_freq = _llama3(inv_freq, cfg.rope_params)
    return inv_freq, 1.0


def rotary_cos_sin(cfg: ModelConfig, seq_len: int, device, dtype,
                   positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [seq, rotary_dim], or [b, 1, seq, rotary_dim] for per-sample ``positions``
    [b, seq] (packed documents). In float32 (each attention layer keeps the plain ones per (seq, device, dtype)),
    so no frequency buffer can be rounded by a later model.half()/bfloat16()."""
    inv_freq, scale = inv_freq_and_scale(cfg, device)
    if positions is None:
        positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    else:
        positions = positions.to(torch.float32)[:, None]           # [b, 1 (heads), s]
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:   # yarn only: the multiply is skipped where HF's factor is 1, which changes no bit
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, s, head_dim]; cos/sin: [s, rotary_dim] or [b, 1, s, rotary_dim]."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    rot = rot * cos + _rotate_half(rot) * sin
    return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot
